"""The Triton kernels under TRITON_INTERPRET=1 (CPU), against the torch reference.

TRITON_INTERPRET is read when a kernel is decorated, so it is set before anything
imports ``tknp_megatron.attention.triton_kernels`` (the backend imports it lazily); if
another test imported it first without the interpreter, it is reloaded here.
"""

import importlib
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from tknp_megatron.attention import AttentionMetadata, available_backends, get_backend  # noqa: E402
from tknp_megatron.attention.testing import make_paged_case  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _interpreted_kernels():
    from triton.runtime.interpreter import InterpretedFunction

    module = sys.modules.get("tknp_megatron.attention.triton_kernels")
    if module is not None and not isinstance(module._paged_attn_kernel, InterpretedFunction):
        importlib.reload(module)
    yield


def _tol(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


def _check(case, dtype, **options):
    out = get_backend("triton", "cpu", **options)(*case.args())
    ref = get_backend("torch")(*case.args())
    assert out.dtype == dtype and out.shape == case.q.shape
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))


def test_triton_registered_under_interpreter():
    assert "triton" in available_backends("cpu")


DECODE = [
    # (Hq, Hkv, head_dim, block_size, seq_lens, options)
    (4, 4, 16, 4, [13, 1, 37], {}),  # MHA, one split, ragged lengths
    (4, 2, 16, 8, [70, 33], dict(num_splits=3)),  # GQA 2, split-K
    (8, 2, 32, 16, [45, 100, 17], dict(num_splits=4, block_n=16)),  # GQA 4, 4 non-empty splits
    (16, 1, 16, 4, [90], dict(num_splits=5, block_n=16)),  # GQA 16, context % splits != 0
    (4, 1, 24, 3, [29, 8], dict(num_splits=2, block_n=16)),  # head_dim 24: tiles 16 + 16 (padded), block 3
    (12, 1, 192, 16, [40, 9], dict(num_splits=2, block_n=16)),  # Nemotron's 192: tiles 128 + 64
    (4, 2, 96, 8, [33, 70], {}),  # 64 + 32, one split
    (4, 1, 80, 16, [50], dict(num_splits=3, block_n=16)),  # 64 + 16 (padded from 16)
    (2, 1, 16, 32, [5, 77], dict(num_splits=2)),  # page larger than block_n
    (2, 1, 16, 64, [5, 150], dict(num_splits=2, block_n=16)),  # a tile inside one page
    (4, 2, 16, 48, [100, 47], dict(num_splits=2, block_n=16)),  # the same, pages not a power of two
    (4, 1, 16, 8, [760, 50], dict(num_splits=24, block_n=16)),  # more slices than the merge reads at once
]


@pytest.mark.parametrize("hq,hkv,d,bs,seq_lens,options", DECODE)
def test_decode_fp32(hq, hkv, d, bs, seq_lens, options):
    case = make_paged_case(
        [1] * len(seq_lens), seq_lens, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, seed=len(seq_lens)
    )
    _check(case, torch.float32, **options)


def test_decode_head_major_pages():
    """Pages stored ``[Hkv, block_size, d]`` (``bench_attention --kv-layout head-major``) are read
    through the cache's strides: the same output as the engine's token-major pages."""
    kw = dict(num_heads=8, num_kv_heads=2, head_dim=16, block_size=8, seed=5)
    token_major = make_paged_case([1, 1], [45, 70], **kw)
    head_major = make_paged_case([1, 1], [45, 70], head_major=True, **kw)
    assert head_major.k_cache.shape == token_major.k_cache.shape
    assert head_major.k_cache.stride()[1:] == (16, 8 * 16, 1)  # slot, head, dim
    head_major.k_cache.copy_(token_major.k_cache)
    head_major.v_cache.copy_(token_major.v_cache)
    head_major = type(head_major)(token_major.q, head_major.k_cache, head_major.v_cache, token_major.meta,
                                  token_major.scale)
    _check(head_major, torch.float32, num_splits=3, block_n=16)
    backend = get_backend("triton", "cpu", num_splits=3, block_n=16)
    assert torch.equal(backend(*head_major.args()), backend(*token_major.args()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half(dtype):
    case = make_paged_case(
        [1, 1, 1], [50, 3, 66], num_heads=8, num_kv_heads=2, head_dim=16, block_size=8, dtype=dtype, seed=3
    )
    _check(case, dtype, num_splits=3, block_n=16)


def test_decode_heuristic_splits_long_context():
    # 1 request x 1 kv head on "132 SMs" with 600 tokens: the heuristic picks 2 splits.
    case = make_paged_case([1], [600], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16, seed=5)
    _check(case, torch.float32, block_n=64)


@pytest.mark.parametrize("hq,dtype", [(64, torch.float32), (32, torch.bfloat16)])
def test_decode_large_group(hq, dtype):
    """One KV head for 32-64 query heads (a 64-head model's KV head at TP 1-2, the DCP and
    TKNP-MQA layouts): the large-group tile, balanced splits, against the reference."""
    from tknp_megatron.attention import TritonConfig, decode_launch
    from tknp_megatron.attention.triton_paged import H200_NUM_SMS

    seq_lens = [300, 40, 129, 1]
    case = make_paged_case([1] * len(seq_lens), seq_lens, num_heads=hq, num_kv_heads=1, head_dim=32, block_size=16,
                           dtype=dtype, seed=hq)
    _check(case, dtype, min_split_tokens=32, balance_min_work=0)
    how = decode_launch(len(seq_lens), max(seq_lens), 32, H200_NUM_SMS,
                        TritonConfig(min_split_tokens=32, balance_min_work=0), balanced=True, group=hq)
    assert (how.block_n, how.num_warps, how.num_stages) == (32, 4, 2) and how.budget_splits > 0


BALANCED = [
    # (Hq, Hkv, head_dim, block_size, seq_lens, options): mixed lengths, slices of equal tokens
    (4, 2, 16, 8, [300, 20, 150, 1], dict(balance=4, min_split_tokens=16, block_n=16)),
    (8, 1, 32, 16, [700, 1, 64, 65], dict(balance=2, min_split_tokens=32, block_n=16)),  # a one-token request
    (4, 4, 16, 4, [250, 250, 250], dict(balance=3, min_split_tokens=16, block_n=16)),  # equal lengths
    (16, 1, 16, 16, [1000] + [17] * 20, dict(balance=4, min_split_tokens=16, block_n=16)),  # one long request
]


@pytest.mark.parametrize("hq,hkv,d,bs,seq_lens,options", BALANCED)
def test_decode_balanced_splits(hq, hkv, d, bs, seq_lens, options):
    """Balanced splits give the reference's output, and the launch really is balanced:
    a grid of ``balance`` times the budget, the longest request using more slices than
    the uniform split count."""
    from tknp_megatron.attention import TritonConfig, decode_launch
    from tknp_megatron.attention.triton_paged import H200_NUM_SMS

    case = make_paged_case([1] * len(seq_lens), seq_lens, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                           block_size=bs, seed=sum(seq_lens))
    _check(case, torch.float32, **options)
    how = decode_launch(len(seq_lens) * hkv, max(seq_lens), d, H200_NUM_SMS, TritonConfig(**options), balanced=True)
    assert how.budget_splits > 0 and how.partials
    assert how.num_splits == max(how.budget_splits,
                                 min(how.budget_splits * options["balance"], -(-max(seq_lens) // how.block_n), 128))
    split_len = -(-max(-(-sum(seq_lens) // (len(seq_lens) * how.budget_splits)),
                       -(-max(seq_lens) // how.num_splits)) // how.block_n) * how.block_n
    if len(set(seq_lens)) > 1:
        assert -(-max(seq_lens) // split_len) > how.budget_splits  # the long request gets more slices


@pytest.mark.parametrize("seed", range(4))
def test_split_plan_against_a_python_reference(seed):
    """The balanced launch's plan: the slice length, and a work list holding every
    (request, slice) once, in request order, with at most R idle (-1) entries."""
    from tknp_megatron.attention.triton_paged import load_kernels

    gen = torch.Generator().manual_seed(seed)
    num_req = int(torch.randint(1, 300, (1,), generator=gen))
    lens = torch.randint(1, 5000, (num_req,), generator=gen, dtype=torch.int32)
    budget, block_n = int(torch.randint(1, 5, (1,), generator=gen)), 16
    grid = 2 * budget  # the most slices a request may take (decode_launch's grid at balance 2)
    kv_heads = int(torch.randint(1, 64, (1,), generator=gen))  # (the interpreter's time grows with it)
    tiles, work, counters = load_kernels().launch_split_plan(lens, budget, grid, block_n, kv_heads)
    assert counters.shape == (num_req * kv_heads,) and not counters.any()  # the merge counters, zeroed
    per = -(-int(lens.sum()) // (num_req * budget))
    split_len = max(-(-max(per, -(-int(lens.max()) // grid)) // block_n), 1) * block_n
    expected = [r * grid + k for r, n in enumerate(lens.tolist()) for k in range(-(-n // split_len))]
    assert int(tiles) * block_n == split_len and max(-(-n // split_len) for n in lens.tolist()) <= grid
    assert work.shape == (num_req * (budget + 1),) and len(expected) <= work.shape[0]
    assert work.tolist() == expected + [-1] * (work.shape[0] - len(expected))
    assert work.shape[0] - len(expected) <= num_req


@pytest.mark.parametrize("hq,hkv,d,lens", [
    (4, 2, 16, [300, 20, 150, 1, 64]),  # mixed lengths: 1 to 10 slices a request
    (6, 2, 24, [97, 33, 250]),  # head dim 24 (two column tiles), group of 3
    (2, 2, 16, [200, 9, 12]),  # MHA; the short requests in one slice: that program merges its own
])
def test_the_last_slice_to_finish_merges_its_request(hq, hkv, d, lens, monkeypatch):
    """A balanced launch merging in the attention kernel (the default) gives the separate
    merge kernel's output and the reference's, and launches no merge kernel; the plan's
    counters are zero after every call, so three calls on one step's plan give the same output."""
    from tknp_megatron.attention import CallShape
    from tknp_megatron.attention.triton_paged import load_kernels

    kernels = load_kernels()
    real, merges = kernels.launch_combine_splits, []
    monkeypatch.setattr(kernels, "launch_combine_splits", lambda *a: merges.append(1) or real(*a))
    options = dict(balance=4, min_split_tokens=16, block_n=16, max_splits=4)  # at most 16 slices a request
    fused, separate = get_backend("triton", "cpu", **options), get_backend("triton", "cpu", fused_merge=False, **options)
    case = make_paged_case([1] * len(lens), lens, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=8, seed=9)
    meta = fused.prepare(case.meta, CallShape(hq, hkv, d, 8, torch.float32))
    counters = meta.prepared.tensors[2]
    assert counters.shape == (len(lens) * hkv,)
    apart = separate(case.q, case.k_cache, case.v_cache, meta, case.scale)
    assert merges == [1]
    outs = []
    for _ in range(3):
        outs.append(fused(case.q, case.k_cache, case.v_cache, meta, case.scale))
        assert not counters.any()
    assert merges == [1]  # the fused calls launched no merge kernel
    torch.testing.assert_close(outs[0], apart, atol=1e-6, rtol=1e-6)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=0, rtol=0)
    torch.testing.assert_close(outs[0], get_backend("torch")(*case.args()), **_tol(torch.float32))
    torch.testing.assert_close(fused(*case.args()), outs[0], atol=0, rtol=0)  # planning itself


def test_requests_of_many_slices_keep_the_merge_kernel(monkeypatch):
    """Past ``FUSED_MERGE_MAX_SLICES`` slices a request, the merge kernel runs (one program
    reading them all at the launch's end is the slower tail); same output as the reference."""
    from tknp_megatron.attention.triton_paged import FUSED_MERGE_MAX_SLICES, load_kernels

    kernels = load_kernels()
    real, merges = kernels.launch_combine_splits, []
    monkeypatch.setattr(kernels, "launch_combine_splits", lambda *a: merges.append(1) or real(*a))
    backend = get_backend("triton", "cpu", balance=4, min_split_tokens=16, block_n=16, max_splits=8)
    case = make_paged_case([1, 1], [600, 530], num_heads=2, num_kv_heads=1, head_dim=16, block_size=8, seed=2)
    how = backend._decode_launch(case.meta, 2, 1, 16, torch.device("cpu"), balanced=True)
    assert how.budget_splits and how.num_splits > FUSED_MERGE_MAX_SLICES
    torch.testing.assert_close(backend(*case.args()), get_backend("torch")(*case.args()), **_tol(torch.float32))
    assert merges == [1]


def test_the_merge_counters_belong_to_their_plan():
    """A launch merging in the kernel refuses a plan whose counters cover another head count,
    and a merge target without a plan, in one line each."""
    from tknp_megatron.attention.triton_paged import load_kernels

    kernels = load_kernels()
    case = make_paged_case([1, 1], [40, 70], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, seed=1)
    plan = kernels.launch_split_plan(case.meta.seq_lens, 2, 4, 16, 1)  # counters for one KV head
    part = torch.empty(2, 4, 4, 16)
    lse = torch.empty(2, 4, 4)
    launch = dict(num_tiles=2, num_splits=4, block_q=1, group_pad=16, block_n=16, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="counters cover 2 .* 2 x 2"):
        kernels.launch_paged_attention(case.q, case.k_cache, case.v_cache, part, lse, case.meta, case.scale,
                                       plan=plan, merged=torch.empty_like(case.q), **launch)
    with pytest.raises(ValueError, match="needs a balanced launch's plan"):
        kernels.launch_paged_attention(case.q, case.k_cache, case.v_cache, part, lse, case.meta, case.scale,
                                       merged=torch.empty_like(case.q), **launch)


def test_a_step_plans_its_balanced_splits_once_for_every_layer(monkeypatch):
    """``prepare`` launches the plan kernel once for a step; every layer's call takes that
    plan (bit for bit the output of planning per call, and the reference's), a call that
    would launch differently plans for itself, and steps that do not balance prepare nothing."""
    from tknp_megatron.attention import CallShape
    from tknp_megatron.attention.triton_paged import load_kernels

    kernels = load_kernels()
    real, plans = kernels.launch_split_plan, []
    monkeypatch.setattr(kernels, "launch_split_plan", lambda *a: plans.append(1) or real(*a))
    options = dict(balance=4, min_split_tokens=16, block_n=16)
    backend = get_backend("triton", "cpu", **options)
    case = make_paged_case([1] * 4, [300, 20, 150, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, seed=5)
    meta = backend.prepare(case.meta, CallShape(4, 2, 16, 8, torch.float32))
    assert meta.prepared is not None and meta.prepared.backend == "triton" and plans == [1]
    per_call = backend(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert len(plans) == 2  # unprepared: the call planned
    layers = [backend(case.q, case.k_cache, case.v_cache, meta, case.scale) for _ in range(3)]
    assert len(plans) == 2  # three layers of one step on the step's plan
    for out in layers:
        torch.testing.assert_close(out, per_call, atol=0, rtol=0)
    torch.testing.assert_close(per_call, get_backend("torch")(*case.args()), **_tol(torch.float32))
    # prepared for a shape whose launch differs (more KV heads: fewer splits each): the call plans itself
    other = backend.prepare(case.meta, CallShape(64, 64, 16, 8, torch.float32))
    if other.prepared is not None:
        assert other.prepared.key != meta.prepared.key
    backend(case.q, case.k_cache, case.v_cache, other, case.scale)
    assert len(plans) == 4 - (other.prepared is None)
    # nothing to prepare: a prompt step, one request, a launch that does not balance
    prompt = make_paged_case([3, 1], [30, 20], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, seed=1)
    assert backend.prepare(prompt.meta, CallShape(4, 2, 16, 8, torch.float32)) is prompt.meta
    single = make_paged_case([1], [300], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, seed=1)
    assert backend.prepare(single.meta, CallShape(4, 2, 16, 8, torch.float32)) is single.meta
    uniform = get_backend("triton", "cpu", num_splits=2)
    assert uniform.prepare(case.meta, CallShape(4, 2, 16, 8, torch.float32)) is case.meta


NEW_TOKENS = 4


def prepared_engine_worker(rank: int, world: int, backend: str) -> dict:
    """A tiny engine (``world`` TKNP nodes, graphs on the CPU's bucketed path) on the Triton
    kernel with balanced splits at these small lengths (``backend`` "triton"), or on the torch
    reference: its tokens, the plan kernel's launches and the decode steps' layers."""
    import parallel_state as ps
    from tknp_megatron.attention.triton_paged import load_kernels
    from tknp_megatron.config import get_preset
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import Mode, build_engine
    from tknp_megatron.sampling import SamplingParams

    kernels = load_kernels()
    real, plans = kernels.launch_split_plan, []
    kernels.launch_split_plan = lambda *a: plans.append(1) or real(*a)
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=1, token_parallel_size=world)
    try:
        config = EngineConfig(kv_tokens_per_node=512, cuda_graphs=True, attention_backend=backend)
        engine = build_engine(Mode.TKNP, get_preset("tiny"), groups, config, torch.device("cpu"), torch.float32)
        if backend == "triton":  # slices of 16 tokens, so these short requests balance as long ones do
            engine.executor.attend.backend = get_backend("triton", "cpu", balance=2, min_split_tokens=16,
                                                         block_n=16, balance_min_work=0)
        prompts = [[1, 2, 3] * 10, [4, 5], [6] * 17, [7, 8, 9, 10] * 6]
        results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
        return dict(tokens=[list(r.tokens) for r in results], plans=len(plans),
                    layers=engine.executor.placement.num_layers)
    finally:
        kernels.launch_split_plan = real
        ps.destroy_model_parallel()


def test_an_engine_step_plans_once_and_keeps_its_tokens():
    """In an engine's decode steps (TKNP on two nodes, each owning requests) the balanced
    plan is made once per step and node, not per layer, and the tokens are the torch
    reference's."""
    from tknp_megatron.launch import spawn

    world = 2
    ranks = spawn(prepared_engine_worker, world, ("triton",), timeout_s=240)
    ref = spawn(prepared_engine_worker, world, ("torch",), timeout_s=240)[0]
    assert ranks[0]["tokens"] == ref["tokens"] and [len(t) for t in ref["tokens"]] == [NEW_TOKENS] * 4
    assert ranks[0]["layers"] > 1
    for r in ranks:  # the decode steps of 1-4 requests per node: at most one plan each
        assert 0 < r["plans"] <= NEW_TOKENS


def test_decode_balanced_half_and_uniform_callers():
    """bf16 through the balanced path; a caller that does not ask for balance (DCP's
    partial attention, whose merge reads every slice) keeps uniform splits."""
    from tknp_megatron.attention import TritonConfig, decode_launch
    from tknp_megatron.attention.triton_paged import BALANCE_MIN_WORK

    case = make_paged_case([1] * 3, [90, 7, 40], num_heads=8, num_kv_heads=2, head_dim=16, block_size=8,
                           dtype=torch.bfloat16, seed=4)
    _check(case, torch.bfloat16, balance=4, min_split_tokens=16, block_n=16)
    config = TritonConfig(balance=4, min_split_tokens=16)
    assert decode_launch(6, 90, 16, 132, config).budget_splits == 0
    assert decode_launch(6, 90, 16, 132, TritonConfig(balance=4, num_splits=2), balanced=True).budget_splits == 0
    rowless = make_paged_case([1, 0, 1], [90, 4, 40], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=2)
    _check(rowless, torch.float32, balance=4, min_split_tokens=16, block_n=16)  # rows != requests: uniform
    with pytest.raises(ValueError, match="balance"):
        TritonConfig(balance=0)
    # the default: balanced (balance 2) where there is more than one split, not where one fills the GPU,
    # and not below BALANCE_MIN_WORK KV head-tokens (the plan's kernel would cost more than it saves)
    assert decode_launch(8, 65536, 128, 132, TritonConfig(), balanced=True).budget_splits > 0
    assert decode_launch(1024, 4096, 192, 132, TritonConfig(), balanced=True).budget_splits == 0
    assert 8 * 4096 < BALANCE_MIN_WORK <= 8 * 65536
    assert decode_launch(8, 4096, 128, 132, TritonConfig(), balanced=True).budget_splits == 0
    assert decode_launch(8, 4096, 128, 132, TritonConfig(balance_min_work=0), balanced=True).budget_splits > 0
    assert decode_launch(8, 4096, 128, 132, TritonConfig(balance=2), balanced=True).budget_splits > 0  # asked for
    with pytest.raises(ValueError, match="balance_min_work"):
        TritonConfig(balance_min_work=-1)


def test_decode_request_without_rows():
    case = make_paged_case([1, 0, 1], [9, 4, 21], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=2)
    _check(case, torch.float32, num_splits=2, block_n=16)


MIXED = [
    # (query_lens, seq_lens, Hq, Hkv, block_size, options)
    ([5, 1, 20], [13, 1, 37], 4, 2, 4, {}),
    ([7, 1, 1, 3], [7, 30, 12, 40], 8, 2, 8, dict(num_splits=3, block_n=16)),
    ([20], [20], 2, 1, 16, dict(block_n=16)),  # one prompt, several q tiles
]


@pytest.mark.parametrize("query_lens,seq_lens,hq,hkv,bs,options", MIXED)
def test_varlen_prefill_and_decode_fp32(query_lens, seq_lens, hq, hkv, bs, options):
    case = make_paged_case(query_lens, seq_lens, num_heads=hq, num_kv_heads=hkv, head_dim=16, block_size=bs, seed=7)
    _check(case, torch.float32, **options)


def test_varlen_head_dim_in_two_tiles():
    """Prompt tiles at head dim 192 (two column tiles, 128 + 64) against the reference."""
    case = make_paged_case([6, 1], [6, 30], num_heads=8, num_kv_heads=2, head_dim=192, block_size=8, seed=9)
    _check(case, torch.float32, num_splits=2, block_n=16)


def test_head_dim_tiles():
    from tknp_megatron.attention.triton_kernels import head_dim_tiles

    assert [head_dim_tiles(d) for d in (8, 16, 24, 64, 80, 96, 112, 128, 160, 192, 256)] == [
        (16, 0), (16, 0), (16, 16), (64, 0), (64, 16), (64, 32), (64, 64), (128, 0), (128, 32), (128, 64), (256, 0)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_varlen_half(dtype):
    case = make_paged_case(
        [4, 1], [10, 19], num_heads=4, num_kv_heads=1, head_dim=16, block_size=4, dtype=dtype, seed=8
    )
    _check(case, dtype, block_n=16)


def test_prefill_sdpa_option():
    case = make_paged_case([4, 1], [10, 19], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=4)
    _check(case, torch.float32, prefill="sdpa")


def test_no_requests():
    meta = AttentionMetadata.from_lengths([], [], torch.zeros((0, 2), dtype=torch.int32))
    cache = torch.randn(3, 4, 1, 16)
    out = get_backend("triton", "cpu")(torch.randn(0, 4, 16), cache, cache, meta, 0.25)
    assert out.shape == (0, 4, 16)


def test_bench_dry_run(tmp_path, capsys):
    """The tool's entry point in this process (already under the interpreter)."""
    from tknp_megatron.tools.bench_attention import main

    out = tmp_path / "bench.json"
    assert main(["--dry-run", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert rows and all(r["rel_err"] < 1e-2 for r in rows if r.get("status") == "ok")
    assert "triton_us" in capsys.readouterr().out


def test_bench_per_model_shapes_and_launch_choice(tmp_path):
    """--models expands presets into per-rank shapes at each --tp; "auto" is the backend's
    own per-shape launch, recorded with its tile and splits; a 4-field config sets waves;
    --spread gives the requests mixed lengths (checked against the reference, no SDPA)."""
    from tknp_megatron.tools.bench_attention import main

    out = tmp_path / "bench.json"
    assert main(["--dry-run", "--models", "nemotron4-340b",
                 "--tp", "8", "--configs", "auto", "16:4:2:2", "16:4:2@4", "--spread", "0.5", "--min-split-tokens", "16",
                 "--num-splits", "0", "--balance-min-work", "0",  # tiny shapes: balanced as a big one would be
                 "--prepared", "--separate-merge", "--out", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["results"] if r.get("status") == "ok"]
    assert rows and {(r["hq"], r["hkv"], r["head_dim"]) for r in rows} == {(12, 1, 192)}
    for r in rows:
        auto, fixed, balanced = r["configs"]
        assert auto["auto"] and auto["block_n"] == 128  # few programs: 128-token tiles
        assert auto["budget_splits"] > 0  # balanced splits by default
        assert not fixed["auto"] and (fixed["block_n"], fixed["waves"]) == (16, 2)
        assert balanced["balance"] == 4 and 0 < balanced["budget_splits"] <= balanced["num_splits"]
        assert r["triton_prepared"] and r["triton_prepared_us"] > 0  # timed on the step's plan too
        assert r["triton_separate_merge_us"] > 0 and r["separate_merge_rel_err"] < 1e-5  # the merge kernel apart
        assert all(c["rel_err"] < 1e-2 for c in r["configs"])
        assert r["launch"] == f"128:4:2 s{auto['num_splits']}/{auto['budget_splits']}"
        assert r["mean_ctx"] == 0.75 * r["ctx"] and "sdpa_us" not in r  # 2 requests: ctx and ctx / 2


def test_query_view_of_fused_qkv():
    # Owners receive q as a slice of the fused QKV rows: row stride > Hq * d.
    case = make_paged_case([1, 1], [21, 40], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=6)
    fused = torch.randn(2, (4 + 2 * 2) * 16)
    fused[:, : 4 * 16] = case.q.reshape(2, -1)
    q = fused[:, : 4 * 16].view(2, 4, 16)
    assert not q.is_contiguous()
    args = (q, case.k_cache, case.v_cache, case.meta, case.scale)
    out = get_backend("triton", "cpu", num_splits=2, block_n=16)(*args)
    torch.testing.assert_close(out, get_backend("torch")(*args), atol=1e-4, rtol=1e-4)


def test_auto_rule_takes_fa3_only_where_it_was_measured_faster():
    """The per-shape rule of the default backend: FA3 for query chunks, for decode at head
    dim 192, at 128 from a 32K context bound and for groups of 32+ query heads per KV head;
    Triton for decode below that, at pages of 128+ (FA3 reads past a request's length
    there), in fp32 and at head dims FA3 does not take."""
    from tknp_megatron.attention.per_shape import prefer_fa3

    bf16 = torch.bfloat16
    assert prefer_fa3(bf16, 192, 16, 1, 4096)
    assert prefer_fa3(torch.float16, 192, 64, 1, 1024)
    assert prefer_fa3(bf16, 128, 16, 1, 32768) and prefer_fa3(bf16, 128, 16, 1, 131072)
    assert not prefer_fa3(bf16, 128, 16, 1, 32767)
    assert not prefer_fa3(bf16, 192, 128, 1, 4096)  # pages of 128 tokens
    assert prefer_fa3(bf16, 192, 16, 2, 4096) and prefer_fa3(bf16, 128, 16, 2048, 8192)  # query chunks
    assert not prefer_fa3(bf16, 128, 128, 2048, 8192)  # ... but not at pages of 128 tokens
    assert not prefer_fa3(torch.float32, 192, 16, 1, 4096)
    assert not prefer_fa3(bf16, 100, 16, 1, 65536) and not prefer_fa3(bf16, 264, 16, 1, 65536)
    assert prefer_fa3(bf16, 128, 16, 1, 4096, group=64) and prefer_fa3(bf16, 128, 16, 1, 8192, group=32)
    assert not prefer_fa3(bf16, 128, 16, 1, 8192, group=16)
    assert not prefer_fa3(bf16, 128, 128, 1, 8192, group=64)  # pages of 128 tokens


def test_auto_says_what_it_runs_here():
    """Logs and bench rows name the kernels ``auto`` has on a device, and why not FA3."""
    from tknp_megatron.attention.per_shape import auto_kernels

    assert auto_kernels(torch.device("cpu")) == "triton (fa3: needs a CUDA device of compute capability 9.x)"


@pytest.mark.parametrize("head_dim,mixed", [(192, False), (32, True)])
def test_auto_backend_runs_triton_where_fa3_is_not_there(head_dim, mixed):
    """Without FA3 (no library, no Hopper GPU: here) the default CUDA backend is the Triton
    kernel for every call, also where the rule would take FA3 (decode at head dim 192):
    the same output, bit for bit."""
    from tknp_megatron.attention.per_shape import PerShapeBackend

    case = make_paged_case([2, 1] if mixed else [1, 1], [40, 70], num_heads=4, num_kv_heads=2, head_dim=head_dim,
                           block_size=16, dtype=torch.bfloat16, device="cpu", seed=3)
    auto = get_backend("auto", "cpu", num_splits=2, block_n=16)
    assert isinstance(auto, PerShapeBackend)
    assert auto.choose(case.q, case.k_cache, case.meta) is auto.triton
    out = auto(*case.args())
    assert torch.equal(out, get_backend("triton", "cpu", num_splits=2, block_n=16)(*case.args()))
    ref = get_backend("torch")(*case.args())
    torch.testing.assert_close(out.float(), ref.float(), **_tol(torch.bfloat16))


@pytest.mark.parametrize("order", ["in-order", "interleaved", "shuffled"])
def test_page_orders(order):
    """Each order gives every request its own pages (no page shared, all in the pool), laid
    out as named; the kernel's output does not depend on it."""
    case = make_paged_case([1, 1, 1], [40, 17, 33], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                           seed=3, page_order=order)
    needed = [5, 3, 5]
    table = case.meta.block_table
    pages = [table[r, :n].tolist() for r, n in enumerate(needed)]
    flat = [p for row in pages for p in row]
    assert len(set(flat)) == len(flat) and all(0 <= p < case.k_cache.shape[0] for p in flat)
    if order == "in-order":
        assert pages == [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    elif order == "interleaved":  # page j of every request before page j + 1 of any
        assert pages == [[0, 3, 6, 9, 11], [1, 4, 7], [2, 5, 8, 10, 12]]
    _check(case, torch.float32, num_splits=2, block_n=16)


def test_prefill_tile_per_head_dim_and_overrides():
    from tknp_megatron.attention.triton_paged import TritonConfig, prefill_tile

    assert prefill_tile(128, TritonConfig()) == (64, 64, 4, 2)
    assert prefill_tile(192, TritonConfig()) == (128, 64, 8, 3)
    assert prefill_tile(192, TritonConfig(prefill_rows=32, block_n=32, num_warps=4, num_stages=2)) == (32, 32, 4, 2)
    with pytest.raises(ValueError, match="prefill_rows must be a power of two >= 16, got 48"):
        TritonConfig(prefill_rows=48)


def test_kernel_split_summarizes_a_kernel_profile():
    """benchmarks/scripts/kernel_split.py reads bench_attention --kernel-profile's JSON (the
    H200 run committed under benchmarks/attention_h200x1/kernels/) and names each column's
    kernels: the Triton launch's plan, attention and merge apart."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    data = root / "benchmarks" / "attention_h200x1" / "kernels" / "kernels_128.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "scripts" / "kernel_split.py"), str(data)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "B=128 ctx=32768 8/1/128" in out
    assert "_paged_attn" in out and "_combine_splits" in out and "_split_plan" in out and "FlashAttnFwdSm90" in out


def _probe_dry_run(script: str, tmp_path, timeout_s: float):
    """``benchmarks/scripts/<script>.py --dry-run`` on CPU: the rows of its ``<script>.json``."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "scripts" / f"{script}.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=timeout_s, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((tmp_path / f"{script}.json").read_text())


def test_tma_probe_runs_under_the_interpreter(tmp_path):
    """benchmarks/scripts/tma_probe.py (the TMA-loaded decode kernel tried against this
    kernel, "K/V pages loaded by TMA" in benchmarks/RESULTS.md) still builds on the production
    split plan: on CPU under Triton's interpreter every variant matches torch's reference."""
    rows = _probe_dry_run("tma_probe", tmp_path, 300)
    assert len(rows) == 2
    for row in rows:
        assert not [k for k in row if k.endswith("_status")], row
        errs = {k: v for k, v in row.items() if k.endswith("_err")}
        assert set(errs) == {"tma_s2_err", "tma2_s2_err", "ptr_peeled_err", "triton_err"}, row
        assert max(errs.values()) < 1e-5, row


def test_flashinfer_probe_gives_flashinfer_every_requests_pages(tmp_path):
    """benchmarks/scripts/flashinfer_probe.py (FlashInfer's and cuDNN's paged decode timed against
    this kernel, "FlashInfer over the engine's pages" in benchmarks/RESULTS.md) hands FlashInfer
    page lists built from the engine's block table: on CPU, each request's tokens read through
    them equal its tokens read through the block table."""
    rows = _probe_dry_run("flashinfer_probe", tmp_path, 120)
    assert [r["pages"] for r in rows] == [10, 16] and all(r["max_err"] == 0 for r in rows), rows
