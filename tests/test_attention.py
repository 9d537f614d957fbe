"""The torch reference (and the vectorised sdpa backend) against a naive dense loop.

``naive_attention`` is written independently of the package: it walks the block table
token by token, loops over requests, rows and heads, and uses ``torch.softmax`` in
float64.
"""

import random

import pytest
import torch

from tknp_megatron.attention import (
    AttentionBackend,
    AttentionMetadata,
    available_backends,
    default_backend_name,
    get_backend,
    register_backend,
)
from tknp_megatron.attention.testing import make_paged_case


def naive_attention(q, k_cache, v_cache, query_lens, seq_lens, block_table, scale):
    """Dense causal attention, one (request, row, head) at a time, in float64."""
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for r, (q_len, ctx_len) in enumerate(zip(query_lens, seq_lens)):
        keys, values = [], []
        for p in range(ctx_len):
            block = int(block_table[r][p // block_size])
            keys.append(k_cache[block, p % block_size].double())
            values.append(v_cache[block, p % block_size].double())
        for i in range(q_len):
            last = ctx_len - q_len + i  # this row's position: it sees keys 0..last
            for h in range(q.shape[1]):
                k = torch.stack([keys[j][h // group] for j in range(last + 1)])
                v = torch.stack([values[j][h // group] for j in range(last + 1)])
                w = torch.softmax((k @ q[row + i, h].double()) * scale, dim=0)
                out[row + i, h] = w @ v
        row += q_len
    return out


def _lengths(rng, num_req, max_ctx, mixed):
    seq_lens = [rng.randint(1, max_ctx) for _ in range(num_req)]
    if not mixed:
        return [1] * num_req, seq_lens
    query_lens = [rng.choice([1, 1, rng.randint(1, s)]) for s in seq_lens]
    return query_lens, seq_lens


CASES = [
    # (seed, requests, Hq, Hkv, head_dim, block_size, max_ctx, mixed)
    (0, 3, 4, 4, 16, 4, 23, False),  # MHA decode
    (1, 4, 4, 2, 8, 8, 40, False),  # GQA 2
    (2, 3, 8, 2, 16, 16, 50, True),  # GQA 4, prefill + decode
    (3, 5, 2, 1, 8, 1, 17, True),  # MQA, block size 1
    (4, 2, 6, 3, 12, 5, 29, True),  # odd block size and head dim
    (5, 1, 4, 1, 8, 4, 30, True),  # one request
]


@pytest.mark.parametrize("seed,num_req,hq,hkv,d,bs,max_ctx,mixed", CASES)
@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_backend_matches_naive(backend, seed, num_req, hq, hkv, d, bs, max_ctx, mixed):
    rng = random.Random(seed)
    query_lens, seq_lens = _lengths(rng, num_req, max_ctx, mixed)
    case = make_paged_case(
        query_lens, seq_lens, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, seed=seed
    )
    out = get_backend(backend, "cpu")(*case.args())
    table = case.meta.block_table.tolist()
    expected = naive_attention(case.q, case.k_cache, case.v_cache, query_lens, seq_lens, table, case.scale)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_full_prefill_is_causal_over_whole_prompt():
    case = make_paged_case([7, 5], [7, 5], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4, seed=9)
    out = get_backend("torch")(*case.args())
    expected = naive_attention(case.q, case.k_cache, case.v_cache, [7, 5], [7, 5], case.meta.block_table.tolist(), case.scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # The first row of each prompt sees only itself: its output is its own v.
    torch.testing.assert_close(out[0, 0], case.v_cache[int(case.meta.block_table[0, 0]), 0, 0])


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_no_requests_gives_empty_output(backend):
    meta = AttentionMetadata.from_lengths([], [], torch.zeros((0, 4), dtype=torch.int32))
    k_cache = torch.randn(3, 4, 2, 8)
    out = get_backend(backend)(torch.randn(0, 4, 8), k_cache, k_cache.clone(), meta, 0.3)
    assert out.shape == (0, 4, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_keep_dtype(dtype):
    case = make_paged_case([1, 3], [9, 12], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    out = get_backend("torch")(*case.args())
    assert out.dtype == dtype
    expected = naive_attention(case.q, case.k_cache, case.v_cache, [1, 3], [9, 12], case.meta.block_table.tolist(), case.scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


def test_metadata_rejects_bad_shapes():
    table = torch.zeros((2, 3), dtype=torch.int32)
    with pytest.raises(ValueError):
        AttentionMetadata(torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32), table, 1, 1)
    with pytest.raises(ValueError):
        AttentionMetadata(torch.zeros(3, dtype=torch.int64), torch.ones(2, dtype=torch.int32), table, 1, 1)
    with pytest.raises(ValueError):
        AttentionMetadata.from_lengths([3], [2], table[:1])
    meta = AttentionMetadata.from_lengths([2, 1], [5, 9], table)
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_requests) == (2, 9, 2)


def test_forward_rejects_mismatched_inputs():
    meta = AttentionMetadata.from_lengths([1], [3], torch.zeros((1, 1), dtype=torch.int32))
    cache = torch.randn(2, 4, 2, 8)
    backend = get_backend("torch")
    with pytest.raises(ValueError, match="multiple"):
        backend(torch.randn(1, 3, 8), cache, cache, meta, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        backend(torch.randn(1, 4, 8, dtype=torch.float16), cache, cache, meta, 1.0)


def test_registry_names_and_errors():
    names = available_backends("cpu")
    assert {"torch", "sdpa"} <= set(names)
    assert "flash" not in names  # flash is CUDA-only
    assert get_backend(None, "cpu").name == "torch"
    with pytest.raises(ValueError, match="available on cpu: .*torch"):
        get_backend("no-such-backend", "cpu")
    with pytest.raises(ValueError, match="not available"):
        get_backend("flash", "cpu")
    assert "fa4" not in names  # flash-attn-4 needs compute capability 9.0+
    with pytest.raises(ValueError, match="not available"):
        get_backend("fa4", "cpu")
    assert "fa3" not in names  # FlashAttention 3 runs on Hopper only
    with pytest.raises(ValueError, match="not available"):
        get_backend("fa3", "cpu")


def test_fa3_found_in_a_vllm_folder_and_its_load_failure_named(tmp_path, monkeypatch):
    """The FA3 extension is looked up inside a ``vllm`` folder on the path without importing
    vLLM; a file there that does not load (built for another torch, or for CUDA on this CPU
    build) leaves the backend unavailable with one line naming the file and the loader's
    reason."""
    import importlib

    from tknp_megatron.attention import flash3

    folder = tmp_path / "vllm" / "vllm_flash_attn"
    folder.mkdir(parents=True)
    library = folder / "_vllm_fa3_C.abi3.so"
    library.write_bytes(b"not a shared library")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    flash3._load.cache_clear()
    try:
        assert flash3.fa3_library_path() == library
        why = flash3.fa3_unavailable_reason()
        assert why.startswith(f"{library} does not load here: ") and "\n" not in why
        assert not flash3.fa3_available()
        with pytest.raises(RuntimeError, match="fa3 backend: .* does not load here"):
            flash3.FlashAttn3Backend()
    finally:
        flash3._load.cache_clear()


def test_register_custom_backend():
    class Zeros(AttentionBackend):
        name = "zeros-test"

        def _forward(self, q, k_cache, v_cache, meta, scale):
            return torch.zeros_like(q)

    register_backend("zeros-test", Zeros, available=lambda: True)
    assert "zeros-test" in available_backends()
    case = make_paged_case([1], [3], num_heads=2, num_kv_heads=1, head_dim=8, block_size=2)
    assert torch.count_nonzero(get_backend("zeros-test")(*case.args())) == 0
    register_backend("zeros-test", Zeros, available=lambda: False)
    assert "zeros-test" not in available_backends()


def test_cases_poison_unowned_slots():
    case = make_paged_case([1, 2], [5, 9], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4)
    assert torch.isnan(case.k_cache).any() and torch.isnan(case.v_cache).any()
    assert not torch.isnan(get_backend("torch")(*case.args())).any()


def test_split_heuristic():
    from tknp_megatron.attention.triton_paged import TritonConfig, choose_num_splits

    cfg = TritonConfig()  # waves 4, >= 256 tokens a split, <= 256 splits
    assert choose_num_splits(8, 131072, 132, cfg) == 66  # few programs, long context: floor(528 / 8)
    assert choose_num_splits(1, 131072, 132, cfg) == 256  # one program: the cap
    assert choose_num_splits(8, 4096, 132, cfg) == 16  # bounded by 4096 / 256
    assert choose_num_splits(32, 32768, 132, cfg) == 16  # floor(528 / 32): one resident wave
    assert choose_num_splits(128, 32768, 132, cfg) == 4
    assert choose_num_splits(256, 32768, 132, cfg) == 2  # 512 programs, not 768
    assert choose_num_splits(1024, 32768, 132, cfg) == 1  # the batch already fills the GPU
    assert choose_num_splits(4, 100, 132, cfg) == 1  # short context
    assert choose_num_splits(4, 100000, 132, TritonConfig(num_splits=3)) == 3
    with pytest.raises(ValueError):
        TritonConfig(block_n=48)
    with pytest.raises(ValueError):
        TritonConfig(num_stages=0)


def test_decode_launch_per_shape():
    from tknp_megatron.attention.triton_paged import DecodeLaunch, TritonConfig, decode_launch

    cfg = TritonConfig()
    assert decode_launch(8, 4096, 128, 132, cfg) == DecodeLaunch(16, 128, 4, 2)  # 128 programs < 132 SMs
    assert decode_launch(256, 32768, 192, 132, cfg) == DecodeLaunch(2, 32, 4, 2)  # Nemotron's head dim
    assert decode_launch(1024, 32768, 128, 132, cfg) == DecodeLaunch(1, 64, 4, 3)  # the batch fills the GPU
    assert decode_launch(128, 32768, 128, 132, cfg) == DecodeLaunch(4, 64, 4, 3)
    # 32+ query heads per KV head at head dim <= 128: 32-token tiles, however many programs
    assert decode_launch(128, 32768, 128, 132, cfg, group=64) == DecodeLaunch(4, 32, 4, 2)
    assert decode_launch(8, 4096, 128, 132, cfg, group=32) == DecodeLaunch(16, 32, 4, 2)
    assert decode_launch(128, 32768, 128, 132, cfg, group=16) == DecodeLaunch(4, 64, 4, 3)
    assert decode_launch(256, 32768, 192, 132, cfg, group=48) == DecodeLaunch(2, 32, 4, 2)
    fixed = TritonConfig(block_n=16, num_splits=3)  # fields set in the config win
    assert decode_launch(1024, 32768, 128, 132, fixed) == DecodeLaunch(3, 16, 4, 3)
    assert decode_launch(1024, 32768, 128, 132, fixed, group=64) == DecodeLaunch(3, 16, 4, 2)
    with pytest.raises(ValueError):
        TritonConfig(prefill="flash")


def _flash_usable() -> bool:
    return torch.cuda.is_available() and "flash" in available_backends("cuda")


@pytest.mark.skipif(not _flash_usable(), reason="flash-attn and a GPU are optional; CI has neither")
@pytest.mark.parametrize("mixed", [False, True])
def test_flash_matches_torch_reference(mixed):
    """Where flash-attn imports (GPU machines), it must match the reference backend."""
    query_lens = [3, 1, 5] if mixed else [1, 1, 1]
    seq_lens = [300, 700, 1200]
    case = make_paged_case(query_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=128,
                           block_size=256, dtype=torch.bfloat16, device="cuda", poison=False)
    out = get_backend("flash", "cuda")(*case.args())
    ref = get_backend("torch", "cuda")(*case.args())
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def _usable_on_cuda(name: str) -> bool:
    return torch.cuda.is_available() and name in available_backends("cuda")


def _library_case(name: str, block_size: int, why: str):
    return pytest.param(name, block_size, id=f"{name}-{block_size}",
                        marks=pytest.mark.skipif(not _usable_on_cuda(name), reason=why))


@pytest.mark.parametrize("name,block_size", [
    # vLLM's FA3 at the engine's page and a larger one
    *(_library_case("fa3", b, "vLLM's FA3 library and a Hopper GPU are optional; CI has neither") for b in (16, 64)),
    # flash-attn-4 at the engine's page size (its non-TMA path) and at its key tile (TMA)
    *(_library_case("fa4", b, "flash-attn-4 and a Hopper+ GPU are optional; CI has neither") for b in (16, 128)),
])
@pytest.mark.parametrize("mixed", [False, True])
def test_library_backend_matches_torch_reference(name, block_size, mixed):
    """Where another library's paged kernel is there (GPU machines), it must match the
    reference backend."""
    query_lens = [3, 1, 5] if mixed else [1, 1, 1]
    case = make_paged_case(query_lens, [300, 700, 1200], num_heads=8, num_kv_heads=2, head_dim=128,
                           block_size=block_size, dtype=torch.bfloat16, device="cuda", poison=False)
    out = get_backend(name, "cuda")(*case.args())
    ref = get_backend("torch", "cuda")(*case.args())
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not _usable_on_cuda("fa3"), reason="vLLM's FA3 library and a Hopper GPU are optional; CI has neither")
@pytest.mark.parametrize("head_dim,seq_lens,query_lens,expect", [
    (192, [300, 1200], [1, 1], "fa3"),
    (128, [300, 1200], [1, 1], "triton"),
    (128, [300, 40000], [1, 1], "fa3"),
    (192, [300, 1200], [3, 1], "fa3"),  # a query chunk
    (128, [300, 1200], [300, 1], "fa3"),  # a whole prompt beside a decode row
])
def test_auto_backend_on_hopper_picks_by_shape(head_dim, seq_lens, query_lens, expect):
    """Where FA3 is there, the default backend runs it for the shapes it was measured faster
    at and the Triton kernel elsewhere, matching the reference either way."""
    assert default_backend_name("cuda") == "auto"
    case = make_paged_case(query_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=16,
                           dtype=torch.bfloat16, device="cuda", poison=False)
    auto = get_backend(None, "cuda")
    assert auto.choose(case.q, case.k_cache, case.meta).name == expect
    out = auto(*case.args())
    ref = get_backend("torch", "cuda")(*case.args())
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not _usable_on_cuda("fa3"), reason="vLLM's FA3 library and a Hopper GPU are optional; CI has neither")
@pytest.mark.parametrize("block_size", [16, 64])
def test_fa3_ignores_unowned_slots_at_the_pages_auto_gives_it(block_size):
    """The default backend gives FA3 pages of up to ``FA3_MAX_PAGE`` tokens because there it
    does not read the slots past a request's length: NaN left in them (by an earlier owner
    of the page) must not reach the output. At 128-token pages and more it does."""
    from tknp_megatron.attention.per_shape import FA3_MAX_PAGE

    assert block_size <= FA3_MAX_PAGE
    case = make_paged_case([64, 3], [64, 1000], num_heads=16, num_kv_heads=2, head_dim=128, block_size=block_size,
                           dtype=torch.bfloat16, device="cuda", seed=5)  # poison=True: NaN in every unowned slot
    out = get_backend("fa3", "cuda")(*case.args())
    ref = get_backend("torch", "cuda")(*case.args())
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def _layers_on_prepared(name: str, case, shape):
    """Four layers' calls of one step (different queries, the same metadata) on the step's
    prepared schedule, each against the same call scheduling itself and the reference."""
    backend = get_backend(name, "cuda")
    meta = backend.prepare(case.meta, shape)
    for layer in range(4):
        q = case.q * (1 + 0.25 * layer)
        out = backend(q, case.k_cache, case.v_cache, meta, case.scale)
        alone = backend(q, case.k_cache, case.v_cache, case.meta, case.scale)
        ref = get_backend("torch", "cuda")(q, case.k_cache, case.v_cache, case.meta, case.scale)
        torch.testing.assert_close(out.float(), alone.float(), atol=1e-3, rtol=0)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    return meta


@pytest.mark.skipif(not _usable_on_cuda("fa3"), reason="vLLM's FA3 library and a Hopper GPU are optional; CI has neither")
@pytest.mark.parametrize("query_lens,seq_lens,heads", [
    ([1] * 5, [300, 40000, 17, 1200, 5000], (8, 1)),  # decode, FA3 splitting the long request
    ([1] * 3, [300, 700, 1200], (64, 8)),
    ([3, 1, 300], [300, 700, 1200], (8, 2)),  # a prompt beside decode rows
])
def test_fa3_calls_schedule_themselves(query_lens, seq_lens, heads):
    """FA3 prepares nothing for a step (a shared ``get_scheduler_metadata`` result faulted,
    ``flash3.py``): every layer's call schedules itself and matches the reference."""
    from tknp_megatron.attention import CallShape

    case = make_paged_case(query_lens, seq_lens, num_heads=heads[0], num_kv_heads=heads[1], head_dim=128,
                           block_size=16, dtype=torch.bfloat16, device="cuda", seed=3)
    meta = _layers_on_prepared("fa3", case, CallShape(heads[0], heads[1], 128, 16, torch.bfloat16))
    assert meta is case.meta


@pytest.mark.skipif(not _usable_on_cuda("triton"), reason="a GPU with Triton is optional; CI has none")
def test_triton_runs_every_layer_of_a_step_on_the_steps_plan():
    """On a GPU, a decode step large enough to balance by default makes its split plan once
    (``prepare``) for every layer's call: the same output as each call planning itself."""
    from tknp_megatron.attention import CallShape

    case = make_paged_case([1] * 4, [40000, 300, 20000, 1200], num_heads=64, num_kv_heads=8, head_dim=128,
                           block_size=16, dtype=torch.bfloat16, device="cuda", seed=4)
    meta = _layers_on_prepared("triton", case, CallShape(64, 8, 128, 16, torch.bfloat16))
    assert meta.prepared is not None and meta.prepared.backend == "triton"


@pytest.mark.skipif(not _usable_on_cuda("triton"), reason="a GPU with Triton is optional; CI has none")
@pytest.mark.parametrize("seq_lens,heads,head_dim", [
    ([40000, 300, 20000, 1200] * 16, (8, 1), 128),  # mixed lengths, 1 to 16 slices a request
    ([4096] * 128, (8, 1), 128),  # equal lengths, B = 128
    ([9000, 17, 30000, 4096] * 4, (64, 8), 128),  # GQA, 8 KV heads (16 requests: few enough programs to split)
    ([6000, 33000, 800] * 24, (12, 1), 192),  # Nemotron's head dim (two column tiles)
])
def test_triton_merges_in_the_kernel_under_graph_replays(seq_lens, heads, head_dim):
    """On a GPU, the balanced launch whose last program per request and KV head merges the
    slices (the default) gives the separate merge kernel's output and the reference's, across
    50 replays of a CUDA graph of eight layers on one step's plan (the counters every program
    raises are zero again after each call)."""
    from tknp_megatron.attention import CallShape
    from tknp_megatron.attention.triton_paged import FUSED_MERGE_MAX_SLICES

    case = make_paged_case([1] * len(seq_lens), seq_lens, num_heads=heads[0], num_kv_heads=heads[1],
                           head_dim=head_dim, block_size=16, dtype=torch.bfloat16, device="cuda", seed=6)
    fused, separate = get_backend("triton", "cuda"), get_backend("triton", "cuda", fused_merge=False)
    meta = fused.prepare(case.meta, CallShape(heads[0], heads[1], head_dim, 16, torch.bfloat16))
    assert meta.prepared is not None
    how = fused._decode_launch(case.meta, heads[0], heads[1], head_dim, case.q.device, balanced=True)
    assert 1 < how.num_splits <= FUSED_MERGE_MAX_SLICES  # the kernel merges (not the merge kernel)
    qs = [case.q * (1 + 0.125 * layer) for layer in range(8)]
    apart = [separate(q, case.k_cache, case.v_cache, meta, case.scale) for q in qs]
    fused(qs[0], case.k_cache, case.v_cache, meta, case.scale)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fused(q, case.k_cache, case.v_cache, meta, case.scale) for q in qs]
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    assert not meta.prepared.tensors[2].any()
    for q, out, sep in zip(qs, outs, apart):
        torch.testing.assert_close(out.float(), sep.float(), atol=1e-2, rtol=0)  # one bf16 rounding apart
        ref = get_backend("torch", "cuda")(q, case.k_cache, case.v_cache, case.meta, case.scale)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
