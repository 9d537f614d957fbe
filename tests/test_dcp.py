"""DCP baseline (decode context parallelism) vs Megatron's GPTModel reference (fp32, CPU).

Greedy tokens must match exactly and logits within 1e-4 for W = 2 with an MQA tiny model
(D = 2), and W = 4 with Hkv = 2 (D = 2) and Hkv = 1 (D = 4); mixed prompt lengths go
through the same path (prefill), requests finish mid-batch, and a tight KV budget forces
admission waves. The greedy waves and the seeded sampling also run on the bucketed, padded
decode path that CUDA graphs replay (eagerly on CPU, after the all-padding steps a GPU
captures at start-up): same tokens, and the path is taken; and with the hidden state
padded once per step to a multiple of 16 rows, as FP8 runs pad it. Unit tests: partial attention
over cyclic shards merged with LSE equals full attention; the Triton decode path equals
the torch partial attention per shard; padded decode inputs have one shape per bucket and
write only the rows a shard holds to real KV; the DCP QKV module holds exactly its rows
of Megatron's fused weight.

TRITON_INTERPRET=1 is set before anything imports ``triton`` (as in
``test_attention_triton``), so where ``triton`` is installed the W = 2 end-to-end runs of
the eager and the graph-path waves also decode through the Triton kernel, in the interpreter
(spawned workers inherit it). The other runs decode through the torch partial attention,
which the unit tests prove equal to the kernel shard by shard: interpreted, the W = 4 runs
take three times as long, and W = 2's sampled and aligned runs add a minute to the suite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
import types

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.dcp_workers import DCPCase, dcp_worker, reference_worker  # noqa: E402
from tests.helpers import assert_matches_reference, random_prompts  # noqa: E402
from tests.tknp_workers import Scenario  # noqa: E402
from tknp_megatron.attention.torch_ref import attend_one_request  # noqa: E402
from tknp_megatron.attention.triton_paged import TritonConfig  # noqa: E402
from tknp_megatron.baselines import dcp_attention  # noqa: E402
from tknp_megatron.baselines.dcp_attention import (  # noqa: E402
    ShardMetadata,
    merge_partials,
    partial_attention,
    partial_attention_triton,
    triton_decode_usable,
)
from tknp_megatron.baselines.dcp import DCPGroups  # noqa: E402
from tknp_megatron.baselines.dcp_inputs import prepare_dcp_decode_inputs, prepare_dcp_inputs  # noqa: E402
from tknp_megatron.config import get_preset  # noqa: E402
from tknp_megatron.executor.rope import Rope  # noqa: E402
from tknp_megatron.executor.step_inputs import pad_plan  # noqa: E402
from tknp_megatron.kv_cache import KVCacheSpec, PagedKVCache  # noqa: E402
from tknp_megatron.launch import spawn  # noqa: E402
from tknp_megatron.plan import RequestColumns, StepPlan  # noqa: E402

SEED = 5
GRAPHS = ("waves", "graph-path")
CASES = [
    DCPCase(2, "tiny", 1, GRAPHS + ("sampled", "sampled-graph", "graph-aligned", "prompt-log-probs")),  # MQA, D = 2
    DCPCase(4, "tiny", 2, GRAPHS),  # Hkv = 2, D = 2 (two DCP groups)
    DCPCase(4, "tiny", 1, GRAPHS + ("sampled-graph",)),  # MQA, D = 4
    DCPCase(2, "tiny-qk", 1, GRAPHS),  # QK layernorm over a rank's own query heads and its key head
]

WAVES = random_prompts(8, 1, 23, 11), (6, 3, 8, 1, 5, 7, 2, 4)
SAMPLED = random_prompts(4, 2, 12, 12), (4, 6, 3, 5)
SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.9)
SCENARIOS = [
    # 8 requests, 140 tokens reserved, 48 in the pool: several waves, mid-batch completions
    Scenario("waves", "tiny", *WAVES, kv_tokens_per_node=48, block_size=4),
    Scenario("sampled", "tiny", *SAMPLED, kv_tokens_per_node=96, **SAMPLING, block_size=8, log_probs=2),
    # the prompts' log-probs too, from every rank's logits of their prefill
    Scenario("prompt-log-probs", "tiny", *SAMPLED, kv_tokens_per_node=96, block_size=8, log_probs=2,
             prompt_log_probs=True),
    # the same on the bucketed, padded decode path that CUDA graphs replay (eagerly here):
    # the rows each shard holds change every step, the bucket's shapes do not
    Scenario("graph-path", "tiny", *WAVES, kv_tokens_per_node=48, block_size=4, graphs=True),
    Scenario("sampled-graph", "tiny", *SAMPLED, kv_tokens_per_node=96, **SAMPLING, block_size=8,
             graphs=True),
    # the hidden state padded with zero rows to a multiple of 16 once per step, as FP8 runs
    # pad it (models/precision.py: row_alignment): the same tokens
    Scenario("graph-aligned", "tiny", *WAVES, kv_tokens_per_node=48, block_size=4, graphs=True, row_align=16),
]


# ---------------------------------------------------------------- unit: LSE merge
def _paged_shard(k, v, shard, degree, block_size, gen):
    """Cache a request's tokens ``p % degree == shard`` at local positions, in shuffled blocks."""
    ks, vs = k[shard::degree], v[shard::degree]
    n_blocks = max(1, -(-ks.shape[0] // block_size))
    order = torch.randperm(n_blocks + 2, generator=gen)[:n_blocks]
    k_cache = torch.full((n_blocks + 2, block_size) + tuple(k.shape[1:]), float("nan"))
    v_cache = k_cache.clone()
    for i in range(ks.shape[0]):
        b, o = order[i // block_size], i % block_size
        k_cache[b, o], v_cache[b, o] = ks[i], vs[i]
    return k_cache, v_cache, order.to(torch.int32)


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_lse_merge_equals_full_attention(degree):
    gen = torch.Generator().manual_seed(degree)
    heads, kv_heads, d, block = 4, 2, 8, 2
    for ctx, q_len in [(1, 1), (2, 2), (7, 1), (9, 5), (13, 13)]:
        k, v = torch.randn(ctx, kv_heads, d, generator=gen), torch.randn(ctx, kv_heads, d, generator=gen)
        q = torch.randn(q_len, heads, d, generator=gen)
        expected = attend_one_request(q, k, v, d ** -0.5)
        positions = torch.arange(ctx - q_len, ctx)
        outs, lses = [], []
        for j in range(degree):
            k_cache, v_cache, table = _paged_shard(k, v, j, degree, block, gen)
            local = max(0, -(-(ctx - j) // degree))
            meta = ShardMetadata(
                row_request=torch.zeros(q_len, dtype=torch.int64), positions=positions,
                local_lens=torch.tensor([local]), block_table=table[None], max_local_len=local,
                shard=j, degree=degree,
            )
            out, lse = partial_attention(q, k_cache, v_cache, meta, d ** -0.5)
            outs.append(out)
            lses.append(lse)
        merged = merge_partials(torch.stack(outs), torch.stack(lses))
        assert torch.isfinite(merged).all()
        torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [1 << 26, 40])
def test_prompt_rows_by_request_match_the_row_gather(monkeypatch, budget):
    """Prompt steps (row spans known): each request's context gathered once, its rows in
    chunks of a bounded score budget (40 scores: two rows at a time here), give the rows'
    gather's outputs and LSEs, requests without rows and rows that see nothing included."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, d, block, degree, shard = 4, 2, 8, 2, 2, 1
    ctxs, q_lens = [9, 1, 6, 4], [5, 1, 0, 4]
    caches = []
    for ctx in ctxs:
        k, v = torch.randn(ctx, kv_heads, d, generator=gen), torch.randn(ctx, kv_heads, d, generator=gen)
        caches.append(_paged_shard(k, v, shard, degree, block, gen))
    # one pool: request r's blocks after the ones before it
    k_cache = torch.cat([c[0] for c in caches])
    v_cache = torch.cat([c[1] for c in caches])
    offsets = [0]
    for c in caches:
        offsets.append(offsets[-1] + c[0].shape[0])
    width = max(c[2].shape[0] for c in caches)
    table = torch.zeros(len(ctxs), width, dtype=torch.int32)
    for r, c in enumerate(caches):
        table[r, : c[2].shape[0]] = c[2] + offsets[r]
    row_request = torch.tensor([r for r, n in enumerate(q_lens) for _ in range(n)])
    positions = torch.tensor([p for ctx, n in zip(ctxs, q_lens) for p in range(ctx - n, ctx)])
    local = torch.tensor([max(0, -(-(ctx - shard) // degree)) for ctx in ctxs])
    q = torch.randn(int(sum(q_lens)), heads, d, generator=gen)
    spans, first = [], 0
    for n in q_lens:
        spans.append((first, n))
        first += n
    meta = ShardMetadata(row_request=row_request, positions=positions, local_lens=local, block_table=table,
                         max_local_len=int(local.max()), shard=shard, degree=degree)
    expected = partial_attention(q, k_cache, v_cache, meta, d ** -0.5)
    monkeypatch.setattr(dcp_attention, "SCORE_BUDGET", budget)
    got = partial_attention(q, k_cache, v_cache, dataclasses.replace(meta, row_spans=tuple(spans)), d ** -0.5)
    assert torch.isinf(expected[1][5]).all()  # request 1's one row, position 0, sees no token of shard 1
    torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], expected[1], atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- unit: Triton decode path
def _decode_shard(ks, vs, shard, degree, block_size, gen):
    """Shard ``shard`` of a decode step over requests with contexts ``ks``, ``vs`` (each
    ``[L_r, Hkv, d]``): one shared cache whose blocks are dealt out shuffled (unowned
    slots NaN), and the step's :class:`ShardMetadata` (row r = request r's last token)."""
    local = [k[shard::degree].shape[0] for k in ks]
    per_req = [-(-n // block_size) for n in local]
    n_blocks = sum(per_req) + 2
    order = torch.randperm(n_blocks, generator=gen)
    k_cache = torch.full((n_blocks, block_size) + tuple(ks[0].shape[1:]), float("nan"))
    v_cache = k_cache.clone()
    table = torch.zeros(len(ks), max(max(per_req), 1), dtype=torch.int32)
    first = 0
    for r, (k, v) in enumerate(zip(ks, vs)):
        blocks = order[first : first + per_req[r]]
        first += per_req[r]
        table[r, : len(blocks)] = blocks.to(torch.int32)
        for i in range(local[r]):
            b, o = blocks[i // block_size], i % block_size
            k_cache[b, o], v_cache[b, o] = k[shard + i * degree], v[shard + i * degree]
    meta = ShardMetadata(
        row_request=torch.arange(len(ks)), positions=torch.tensor([k.shape[0] - 1 for k in ks]),
        local_lens=torch.tensor(local), block_table=table, max_local_len=max(local), shard=shard,
        degree=degree,
    )
    return k_cache, v_cache, meta


def _decode_step(lens, heads: int, d: int, seed: int):
    """Random contexts ``[L_r, 1, d]`` (K and V) of requests of ``lens`` tokens and their
    newest tokens' queries ``[R, heads, d]``: ``(ks, vs, q, generator)``."""
    gen = torch.Generator().manual_seed(seed)
    ks = [torch.randn(n, 1, d, generator=gen) for n in lens]
    vs = [torch.randn(n, 1, d, generator=gen) for n in lens]
    return ks, vs, torch.randn(len(lens), heads, d, generator=gen), gen


@pytest.fixture(scope="module")
def interpreted_kernels():
    """The kernels decorated under the interpreter (reloaded if imported without it)."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    module = sys.modules.get("tknp_megatron.attention.triton_kernels")
    if module is not None and not isinstance(module._paged_attn_kernel, InterpretedFunction):
        importlib.reload(module)
    yield


@pytest.mark.parametrize("degree", [2, 3])
@pytest.mark.parametrize("splits", [None, 3], ids=["heuristic", "3splits"])
def test_triton_decode_matches_partial_attention(interpreted_kernels, monkeypatch, degree, splits):
    """Every shard's (out, lse) equals the torch reference, empty shards give (0, -inf),
    and the shards merged equal full attention."""
    assert triton_decode_usable(torch.device("cpu"))
    if splits is not None:  # several splits, some of them empty
        monkeypatch.setattr(dcp_attention, "_TRITON", TritonConfig(num_splits=splits, block_n=16))
    heads, d, block, scale = 4, 16, 4, 16 ** -0.5
    lens = [1, 2, 9, 37, 22]  # L = 1, 2: some shards hold nothing for that request
    ks, vs, q, gen = _decode_step(lens, heads, d, seed=10 + degree)
    outs, lses = [], []
    for j in range(degree):
        k_cache, v_cache, meta = _decode_shard(ks, vs, j, degree, block, gen)
        out, lse = partial_attention_triton(q, k_cache, v_cache, meta, scale)
        ref_out, ref_lse = partial_attention(q, k_cache, v_cache, meta, scale)
        assert out.dtype == lse.dtype == torch.float32
        empty = meta.local_lens == 0
        assert empty.any() == (j > 0)
        assert torch.equal(torch.isneginf(lse), empty[:, None].expand_as(lse))
        assert torch.equal(torch.isneginf(ref_lse), torch.isneginf(lse))
        torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=1e-4, rtol=1e-4)
        assert (out[empty] == 0).all()
        outs.append(out)
        lses.append(lse)
    merged = merge_partials(torch.stack(outs), torch.stack(lses))
    expected = torch.cat([attend_one_request(q[r : r + 1], ks[r], vs[r], scale) for r in range(len(lens))])
    torch.testing.assert_close(merged, expected, atol=1e-4, rtol=1e-4)


def _fa3_on_cuda() -> bool:
    from tknp_megatron.attention.flash3 import fa3_usable
    return torch.cuda.is_available() and fa3_usable(torch.device("cuda"))


@pytest.mark.skipif(not _fa3_on_cuda(), reason="vLLM's FA3 library and a Hopper GPU are optional; CI has neither")
@pytest.mark.parametrize("degree", [1, 2])
def test_fa3_decode_matches_partial_attention(degree):
    """FA3's form of a shard's decode attention (the DCP executor's, for the group's 32+
    query heads over one KV head): every shard's (out, lse) as the torch reference's within
    bf16, empty shards (0, -inf), unowned slots NaN kept out, the merge as full attention."""
    from tknp_megatron.attention.flash3 import FlashAttn3Backend
    from tknp_megatron.baselines.dcp_attention import partial_attention_fa3

    fa3, dev = FlashAttn3Backend(), torch.device("cuda")
    heads, d, block, scale = 32, 128, 16, 128 ** -0.5
    lens = [1, 2, 9, 37, 300, 1000]  # L = 1: shard 1 holds nothing for that request
    ks, vs, q, gen = _decode_step(lens, heads, d, seed=20 + degree)
    outs, lses = [], []
    for j in range(degree):
        k_cache, v_cache, meta = _decode_shard(ks, vs, j, degree, block, gen)
        ref_out, ref_lse = partial_attention(q, k_cache, v_cache, meta, scale)
        meta = dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(dev) for f in dataclasses.fields(meta)
                                            if isinstance(getattr(meta, f.name), torch.Tensor)})
        out, lse = partial_attention_fa3(q.to(dev, torch.bfloat16), k_cache.to(dev, torch.bfloat16),
                                         v_cache.to(dev, torch.bfloat16), meta, scale, fa3)
        out, lse = out.float().cpu(), lse.cpu()
        assert lse.dtype == torch.float32 and out.shape == ref_out.shape
        empty = meta.local_lens.cpu() == 0
        assert empty.any() == (j > 0)
        assert torch.equal(torch.isneginf(lse), empty[:, None].expand_as(lse))
        assert torch.isfinite(out).all() and (out[empty] == 0).all()
        torch.testing.assert_close(out, ref_out, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=3e-2, rtol=1e-2)
        outs.append(out)
        lses.append(lse)
    merged = merge_partials(torch.stack(outs), torch.stack(lses))
    expected = torch.cat([attend_one_request(q[r : r + 1], ks[r], vs[r], scale) for r in range(len(lens))])
    torch.testing.assert_close(merged, expected, atol=3e-2, rtol=3e-2)


def test_fa3_asked_for_where_it_does_not_run_is_refused_by_name():
    """DCP with ``attention_backend="fa3"`` on a CPU: one line naming the backend and why."""
    from tests.dcp_workers import fa3_refusal_worker
    from tknp_megatron.launch import spawn

    reasons = spawn(fa3_refusal_worker, 2, (CASES[0],), timeout_s=120)
    assert reasons == ["DCP with attention_backend 'fa3': FA3 does not run here: "
                       "cpu is not a CUDA device of compute capability 9.x"] * 2


# ---------------------------------------------------------------- unit: padded decode inputs
def _decode_plan(start_pos, slots):
    """A pure-decode plan of one owner: request r at ``start_pos[r]`` in slot ``slots[r]``."""
    n = len(start_pos)
    cols = RequestColumns.of(request_ids=range(n), slots=slots, q_lens=[1] * n, start_pos=start_pos,
                             temperature=[0.0] * n, top_k=[0] * n, top_p=[1.0] * n, seeds=[0] * n,
                             sample_steps=[0] * n)
    return StepPlan(step=1, admissions=(), per_request=cols, tokens=torch.arange(n),
                    requests_per_owner=(n,), rows_per_owner=(n,))


@pytest.mark.parametrize("degree", [2, 4])
def test_padded_decode_inputs_have_bucket_shapes(degree):
    """Two decode steps of one bucket, whose requests fall on different shards, give every
    shard inputs of the same shapes (what one captured graph replays); a row the shard
    holds writes where the eager path writes it, every other row to the scratch block;
    each real request's local length is the eager path's, a padding request's is 1 on
    shard 0 and 0 elsewhere (a finite merge)."""
    cpu, block = torch.device("cpu"), 2  # local tokens per block
    spec = KVCacheSpec(num_layers=1, num_blocks=32, block_size=block, local_kv_heads=1, head_dim=8,
                       dtype=torch.float32, max_slots=8, max_blocks_per_seq=4)
    kv = PagedKVCache(spec, cpu)
    for slot in range(8):
        kv.assign(slot, [4 * slot + 3, 4 * slot + 1, 4 * slot + 2, 4 * slot])
    rope = Rope(get_preset("tiny"), types.SimpleNamespace(rotary_interleaved=False), cpu)
    bound = spec.max_blocks_per_seq * block  # longest shard-local length
    plans = [_decode_plan([4, 7, 2], [5, 0, 3]), _decode_plan([5, 1, 6, 3 * degree + 1], [1, 2, 6, 7])]
    for j in range(degree):
        dcp_j = DCPGroups(degree, j, 0, None)
        seen = []
        for plan in plans:
            padded, index = pad_plan(plan, kv.dummy_slot)
            inp = prepare_dcp_decode_inputs(padded, dcp_j, kv, rope, cpu, bound)
            eager = prepare_dcp_inputs(plan, dcp_j, kv, rope, cpu)
            seen.append((inp.shape, [(t.shape, t.dtype) for t in inp.tensors()]))
            assert inp.own_rows is None and inp.decode and inp.attn.max_local_len == bound
            mine = index[(plan.per_request.start_pos % degree == j).nonzero().flatten()]
            assert torch.equal(inp.write_slots[mine], eager.write_slots)
            elsewhere = torch.ones(padded.num_rows, dtype=torch.bool)
            elsewhere[mine] = False
            assert (inp.write_slots[elsewhere] // block == spec.num_blocks).all()  # the scratch block
            assert torch.equal(inp.attn.local_lens[index], eager.attn.local_lens)
            pads = torch.ones(padded.num_rows, dtype=torch.bool)
            pads[index] = False
            assert (inp.attn.local_lens[pads] == int(j == 0)).all()  # plan 0 has one padding request
        assert seen[0] == seen[1]


# ---------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def dcp_reference():
    return spawn(reference_worker, 1, (CASES, SCENARIOS, SEED), timeout_s=300)[0]


TRITON_WORLDS = (2,)  # the end-to-end worlds whose decode steps run the Triton kernel ...
TRITON_SCENARIOS = ("waves", "graph-path")  # ... in these scenarios


@contextlib.contextmanager
def _interpreter(on: bool):
    """TRITON_INTERPRET as ``on`` says for the pools started inside (they copy the
    environment), restored after."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = before


@pytest.fixture(scope="module")
def dcp():
    out = {}
    for world in sorted({c.world for c in CASES}):
        for interpreted in ((True, False) if world in TRITON_WORLDS else (False,)):
            scenarios = [s for s in SCENARIOS
                         if world not in TRITON_WORLDS or (s.name in TRITON_SCENARIOS) == interpreted]
            with _interpreter(interpreted):
                rank_outs = spawn(dcp_worker, world, (CASES, scenarios, SEED), timeout_s=300)
            pool = {}
            for rank_out in rank_outs:
                for key, value in rank_out.items():
                    pool.setdefault(key, []).append(value)  # per rank, in rank order
            for key, values in pool.items():  # the model's own keys (its weights) from the first pool
                out.setdefault(key, values)
    return out


CASE_SCENARIOS = [(c, s) for c in CASES for s in SCENARIOS if s.name in c.scenarios]


@pytest.mark.parametrize("case,scenario", CASE_SCENARIOS,
                         ids=[f"{c.name}-{s.name}" for c, s in CASE_SCENARIOS])
def test_matches_reference(dcp, dcp_reference, case, scenario):
    run = dcp[(case.name, scenario.name)][0]  # the coordinator's results
    gens, _ = dcp_reference[(case.base, case.kv_heads)]
    assert_matches_reference(run["results"], gens[scenario.name], logits=not scenario.graphs)


@pytest.mark.parametrize("case,scenario", CASE_SCENARIOS,
                         ids=[f"{c.name}-{s.name}" for c, s in CASE_SCENARIOS])
def test_decode_kernel_is_the_one_asked_for(dcp, case, scenario):
    """W = 2's decode steps in the Triton scenarios ran the Triton kernel where ``triton`` is
    installed; the others the torch partial attention."""
    triton_importable = importlib.util.find_spec("triton") is not None
    expected = case.world in TRITON_WORLDS and scenario.name in TRITON_SCENARIOS and triton_importable
    assert dcp[(case.name, scenario.name, "triton")] == [expected] * case.world


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_graph_path_is_taken(dcp, case):
    """The graph scenario's decode steps ran through DecodeGraphs, between the eager
    prefill steps of its admission waves; the eager scenario's did not."""
    run = dcp[(case.name, "graph-path")][0]
    assert run["graph_steps"] > 0 and run["waves"] >= 2
    assert dcp[(case.name, "waves")][0]["graph_steps"] == 0


def test_gemms_see_aligned_rows(dcp):
    """With the hidden state padded to 16 rows once per step, every dense GEMM runs over a
    multiple of 16 rows; without, over the step's rows."""
    case = CASES[0]
    aligned = dcp[(case.name, "graph-aligned")][0]["gemm_rows"]
    assert aligned and all(rows % 16 == 0 for rows in aligned), aligned
    assert any(rows % 16 for rows in dcp[(case.name, "graph-path")][0]["gemm_rows"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_waves_and_sharded_capacity(dcp, case):
    run = dcp[(case.name, "waves")][0]
    assert run["waves"] >= 2
    assert [len(r.tokens) for r in run["results"]] == list(SCENARIOS[0].max_new)
    degree = dcp[(case.name, "dcp")][0][0]
    assert degree == case.world // case.kv_heads
    # the pool holds 48 whole-sequence tokens; each shard stores block_size / D per block
    assert run["capacity"] == [48]
    for block_size, blocks in dcp[(case.name, "waves", "kv")]:
        assert (block_size * degree, blocks) == (4, 12)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_qkv_rows_are_megatrons(dcp, dcp_reference, case):
    """Rank g*D + j holds q heads of group g at j*P/D.. and the group's k, v rows."""
    _, full = dcp_reference[(case.base, case.kv_heads)]
    preset = case.preset()
    d, per_group = preset.kv_channels, preset.num_attention_heads // preset.num_query_groups
    mixed = full.view(preset.num_query_groups, per_group + 2, d, -1)
    for rank, local in enumerate(dcp[(case.name, "qkv")]):
        degree, shard, g = dcp[(case.name, "dcp")][rank]
        h = per_group // degree
        expected = torch.cat([mixed[g, shard * h : (shard + 1) * h], mixed[g, per_group:]])
        torch.testing.assert_close(local, expected.reshape(-1, full.shape[1]), atol=0, rtol=0)
        # the layer spec's QKV is DCP's: a layer rebuilt from it (FP8 storage) holds these rows
        assert dcp[(case.name, "rebuilt")][rank] == ("DCPQKVLinear", tuple(local.shape))
