"""The engine contract without a pool: every executor honours ``Executor``, every engine the
shared surface; one ``Mode``; the factory's config and weight rules; each mode's slice
of the synthetic KV against slicing the whole cache (seeded, randomised shapes)."""

from __future__ import annotations

import types

import pytest
import torch

from tknp_megatron.baselines.dcp import DCPExecutor, DCPInferenceEngine
from tknp_megatron.baselines.pp import PPExecutor, PPInferenceEngine
from tknp_megatron.engine.base import InferenceEngine
from tknp_megatron.engine.config import EngineConfig
from tknp_megatron.engine.engine import TKNPInferenceEngine
from tknp_megatron.engine.factory import (
    Mode,
    build_engine,
    engine_config_for,
    load_weights,
)
from tknp_megatron.engine.scheduler import LoadPolicy
from tknp_megatron.executor.base import Executor
from tknp_megatron.executor.dual_root import DualRootExecutor
from tknp_megatron.executor.ingest import INGEST_CHUNK_BYTES, Admitter, KVIngest, KVSlice, position_chunks
from tknp_megatron.executor.synthetic import synthetic_kv
from tknp_megatron.executor.tknp import TKNPExecutor
from tknp_megatron.plan import Admission

SURFACE = ("add_request", "step", "generate", "run_until_done", "serve", "shutdown",
           "has_unfinished_requests", "metrics", "result")


@pytest.mark.parametrize("cls", [TKNPExecutor, DualRootExecutor, PPExecutor, DCPExecutor],
                         ids=lambda c: c.__name__)
def test_every_executor_is_an_executor(cls):
    assert issubclass(cls, Executor)


@pytest.mark.parametrize("cls", [TKNPInferenceEngine, PPInferenceEngine, DCPInferenceEngine],
                         ids=lambda c: c.__name__)
def test_every_engine_has_the_whole_surface(cls):
    assert issubclass(cls, InferenceEngine) and not cls.__abstractmethods__
    assert all(callable(getattr(cls, name)) for name in SURFACE)


def test_one_mode_enum_two_spellings():
    assert [m.value for m in Mode] == ["dp", "tp", "pp", "dcp", "tknp", "tknp-dual"]
    assert Mode("tknp_dual") is Mode("tknp-dual") is Mode.TKNP_DUAL
    assert Mode.TKNP_DUAL.field == "tknp_dual" and Mode.DP.field == "dp"
    assert Mode.TKNP.pool_shape(8, 2) == (1, 4, 2)
    assert Mode.DP.pool_shape(8, 2) == (4, 1, 2)
    assert Mode.DCP.pool_shape(8, 2) == (1, 1, 8)
    with pytest.raises(ValueError):
        Mode("tknp dual")


def test_engine_config_per_mode():
    base = EngineConfig(cuda_graphs=True)
    assert engine_config_for(Mode.TKNP_DUAL, base).microbatches == 2
    assert engine_config_for(Mode.TKNP, base) is base
    assert engine_config_for("pp", base) is base  # PP replays each stage's share from graphs
    assert engine_config_for(Mode.DCP, base) is base  # DCP replays padded decode steps from graphs
    with pytest.raises(ValueError, match="tknp-dual"):
        engine_config_for(Mode.TKNP, EngineConfig(microbatches=2))


def test_weights_and_one_node_modes_are_checked():
    seen = []
    load_weights(torch.nn.Linear(2, 2), None, seen.append)
    assert len(seen) == 1
    with pytest.raises(TypeError, match="seed, a checkpoint path or a loader"):
        load_weights(torch.nn.Linear(2, 2), None, 1.5)
    groups = types.SimpleNamespace(num_nodes=2)
    with pytest.raises(ValueError, match="one node"):
        build_engine(Mode.DP, None, groups, EngineConfig(), torch.device("cpu"), torch.float32)


def _full(seed, layers, length, heads, dim):
    return synthetic_kv(seed, range(layers), torch.arange(length), range(heads), heads, dim,
                        torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("trial", range(4))
def test_each_mode_keeps_its_slice_of_the_synthetic_kv(trial):
    gen = torch.Generator().manual_seed(trial)
    layers, length, tp, dim = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in
                               ((2, 6), (1, 140), (1, 4), (2, 9)))
    local = int(torch.randint(1, 3, (1,), generator=gen))
    heads, seed, cpu = tp * local, trial + 7, torch.device("cpu")
    full = _full(seed, layers, length, heads, dim)
    for t in range(tp):  # TKNP owner / PP stage: the TP rank's heads (of some layers)
        mine = range(t * local, (t + 1) * local)
        kept = list(range(layers))[t % layers:]
        assert KVSlice.tp_heads(kept, t, tp, local, dim) == KVSlice(kept, mine, heads, dim)
        got = KVSlice(kept, mine, heads, dim).synthetic(seed, length, torch.float32, cpu)
        assert torch.equal(got, full[kept][:, :, :, t * local : (t + 1) * local])
    degree = tp + 1
    for shard in range(degree):  # DCP: every D-th position of one head
        kv_slice = KVSlice(range(layers), (heads - 1,), heads, dim, shard=shard, num_shards=degree)
        got = kv_slice.synthetic(seed, length, torch.float32, cpu)
        assert got.shape == kv_slice.shape(length)
        assert torch.equal(got, full[:, :, shard::degree, heads - 1 :])


class _RecordingCache:
    """Records what the admitter hands a cache: assigned slots, and each slot's ingested
    pieces as ``(start, kv)``."""

    spec = types.SimpleNamespace(dtype=torch.float32)

    def __init__(self):
        self.assigned, self.pieces = [], {}

    def assign(self, slot, blocks):
        self.assigned.append(slot)

    def ingest(self, slot, kv, start=0):
        self.pieces.setdefault(slot, []).append((start, kv))

    def ingested(self, slot):
        """The slot's pieces joined, after checking that they follow each other from 0."""
        starts = [start for start, _ in self.pieces[slot]]
        ends = [start + kv.shape[2] for start, kv in self.pieces[slot]]
        assert starts == [0, *ends[:-1]]
        return torch.cat([kv for _, kv in self.pieces[slot]], dim=2)


TWO_POSITIONS = 3 * 2 * 2 * 4 * 4 * 2  # 3 layers x K/V x 2 heads x 4 dims x fp32, twice


@pytest.mark.parametrize("chunk_bytes", [None, TWO_POSITIONS, 1])
def test_admitter_owner_filter_and_coordinator_ingest(chunk_bytes):
    groups = types.SimpleNamespace(tp_size=1, coordinator_rank=0, global_rank=lambda node, t: node)
    chunks = {} if chunk_bytes is None else dict(chunk_bytes=chunk_bytes)
    ingest = KVIngest(groups, 2, torch.float32, torch.device("cpu"), **chunks)
    kv_slice = KVSlice(range(3), range(2), 2, 4)
    outside = torch.randn(3, 2, 5, 2, 4)
    admissions = [Admission(0, 0, 0, (0,), ingest_len=5), Admission(1, 1, 0, (1,)),
                  Admission(2, 0, 1, (2,), ingest_len=4, synthetic_seed=3)]
    ingest.send(admissions[0], outside)  # node 0 is the coordinator: kept, not sent
    cache = _RecordingCache()
    Admitter(cache, kv_slice, torch.device("cpu"), owner=0, ingest=ingest, **chunks).apply(admissions)
    assert cache.assigned == [0, 1]
    assert torch.equal(cache.ingested(0), outside)
    assert torch.equal(cache.ingested(1), kv_slice.synthetic(3, 4, torch.float32, torch.device("cpu")))
    # pieces of at most chunk_bytes (2 positions of 3 layers x K/V x 2 heads x 4 dims fp32; 1 position at 1 byte)
    assert [len(cache.pieces[s]) for s in (0, 1)] == {None: [1, 1], TWO_POSITIONS: [3, 2], 1: [5, 4]}[chunk_bytes]
    every = _RecordingCache()
    Admitter(every, kv_slice, torch.device("cpu")).apply(admissions[1:2])
    assert every.assigned == [0]


def test_position_chunks_cover_the_prompt_within_the_bound():
    shape = (80, 2, 65536, 8, 128)  # 64K tokens of Llama-3.1-70B's 80 layers: 20 GiB in BF16
    chunks = position_chunks(shape, 2)
    assert chunks[0][0] == 0 and chunks[-1][1] == 65536
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert max(hi - lo for lo, hi in chunks) * 80 * 2 * 8 * 128 * 2 <= INGEST_CHUNK_BYTES
    assert position_chunks((1, 2, 3, 1, 4), 4, 1) == [(0, 1), (1, 2), (2, 3)]  # at least one position
    assert position_chunks((1, 2, 0, 1, 4), 4) == []


def test_dcp_shards_synthetic_kv_in_pieces():
    kv_slice = KVSlice(range(2), (1,), 2, 4, shard=1, num_shards=3)
    cpu = torch.device("cpu")
    whole = kv_slice.synthetic(5, 23, torch.float32, cpu)
    cache = _RecordingCache()
    Admitter(cache, kv_slice, cpu, chunk_bytes=2 * 2 * 1 * 4 * 4 * 3).apply([Admission(0, 0, 0, (0,), ingest_len=23,
                                                                                        synthetic_seed=5)])
    assert len(cache.pieces[0]) == 3 and torch.equal(cache.ingested(0), whole)


def ingest_worker(rank: int, world: int, chunk_bytes: int) -> dict:
    """Rank 0 (the coordinator) sends rank 1 (node 1's owner) a prompt's outside KV; rank 1
    writes it into a real paged cache, pieces of at most ``chunk_bytes``. Returns rank 1's
    cache buffer."""
    import parallel_state as ps
    from tknp_megatron.kv_cache import KVCacheSpec, PagedKVCache

    groups = ps.initialize_model_parallel(tensor_model_parallel_size=1, token_parallel_size=2)
    cpu = torch.device("cpu")
    spec = KVCacheSpec(num_layers=3, num_blocks=8, block_size=4, local_kv_heads=2, head_dim=4,
                       dtype=torch.float32, max_slots=2, max_blocks_per_seq=4)
    ingest = KVIngest(groups, 2, torch.float32, cpu, chunk_bytes=chunk_bytes)
    adm = Admission(7, 1, 1, (5, 2, 6), ingest_len=11)
    out = {}
    if rank == 0:
        ingest.send(adm, torch.arange(3 * 2 * 11 * 2 * 4, dtype=torch.float32).view(3, 2, 11, 2, 4))
    else:
        cache = PagedKVCache(spec, cpu)
        Admitter(cache, KVSlice(range(3), range(2), 2, 4), cpu, owner=1, ingest=ingest,
                 chunk_bytes=chunk_bytes).apply([adm])
        out["buffer"] = cache.buffer.clone()
    ps.destroy_model_parallel()
    return out


def test_outside_kv_travels_to_its_owner_in_pieces():
    from tknp_megatron.launch import spawn

    whole = spawn(ingest_worker, 2, (1 << 20,), timeout_s=120)[1]["buffer"]
    pieces = spawn(ingest_worker, 2, (3 * 2 * 2 * 4 * 4 * 3,), timeout_s=120)[1]["buffer"]  # 3 positions a message
    kv = torch.arange(3 * 2 * 11 * 2 * 4, dtype=torch.float32).view(3, 2, 11, 2, 4)
    for pos in range(11):  # blocks 5, 2, 6 of 4 tokens hold positions 0-3, 4-7, 8-10
        assert torch.equal(whole[:, :, (5, 2, 6)[pos // 4], pos % 4], kv[:, :, pos])
    torch.testing.assert_close(pieces, whole, rtol=0, atol=0, equal_nan=True)


def heap_worker(rank: int, world: int, freeze: bool) -> dict:
    """Build a tiny TKNP engine with or without ``freeze_gc``, generate, then drop it and
    destroy the groups; report the frozen-object counts and whether the executor (its
    graphs and KV cache with it) was collected."""
    import gc
    import weakref

    import parallel_state as ps
    from tknp_megatron.config import get_preset
    from tknp_megatron.sampling import SamplingParams

    frozen_at_start = gc.get_freeze_count()  # a fork of the pool's forkserver starts frozen
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=1, token_parallel_size=1)
    config = EngineConfig(kv_tokens_per_node=256, cuda_graphs=True, freeze_gc=freeze)
    engine = build_engine(Mode.TKNP, get_preset("tiny"), groups, config, torch.device("cpu"), torch.float32)
    frozen_built = gc.get_freeze_count()
    tokens = [list(r.tokens) for r in engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=3))]
    executor = weakref.ref(engine.executor)
    cycle = [engine]
    cycle.append(cycle)  # the engine kept alive only by a reference cycle, as a caller might
    del engine, cycle
    ps.destroy_model_parallel()
    return dict(frozen_at_start=frozen_at_start, frozen_built=frozen_built,
                frozen_after=gc.get_freeze_count(), executor_collected=executor() is None, tokens=tokens)


def test_engine_freezes_its_heap_and_the_teardown_collects_it():
    """EngineConfig.freeze_gc moves the built heap out of the collector's reach (so a full
    collection does not stall a step); destroy_model_parallel thaws and collects it, so an
    engine dropped before it is gone, CUDA graphs included, before any group is destroyed,
    then freezes what is left. A rank forked from the pool's forkserver starts with the
    server's imports frozen (tknp_megatron/forkserver_heap.py)."""
    from tknp_megatron.launch import _context, spawn

    frozen = spawn(heap_worker, 1, (True,), timeout_s=180)[0]
    plain = spawn(heap_worker, 1, (False,), timeout_s=180)[0]
    if _context().get_start_method() == "forkserver":
        assert frozen["frozen_at_start"] > 100_000 and plain["frozen_at_start"] > 100_000
    assert frozen["frozen_built"] > frozen["frozen_at_start"] + 5_000  # the engine's own objects
    assert plain["frozen_built"] <= plain["frozen_at_start"]  # freeze_gc off: nothing added
    assert frozen["executor_collected"] and plain["executor_collected"]
    assert frozen["frozen_after"] > 0  # what is left alive, frozen again
    assert frozen["tokens"] == plain["tokens"] and all(len(t) == 3 for t in frozen["tokens"])


def restart_worker(rank: int, world: int) -> dict:
    """A tiny TKNP engine serving the same two requests (same ids) twice, its counts
    restarted in between; restarting while a request runs is refused."""
    import parallel_state as ps
    from tknp_megatron.config import get_preset
    from tknp_megatron.sampling import SamplingParams

    groups = ps.initialize_model_parallel(tensor_model_parallel_size=1, token_parallel_size=1)
    try:
        config = EngineConfig(kv_tokens_per_node=256, cuda_graphs=True)
        engine = build_engine(Mode.TKNP, get_preset("tiny"), groups, config, torch.device("cpu"), torch.float32)
        rounds, refused = [], None
        for round_ in range(2):
            for rid, prompt in enumerate(([1, 2, 3], [4, 5])):
                engine.add_request(prompt, SamplingParams(max_new_tokens=4), request_id=rid)
            engine.step()
            if round_ == 0:
                try:
                    engine.restart_counts()
                except ValueError as err:
                    refused = str(err)
            engine.run_until_done()
            rounds.append(dict(tokens=[list(engine.result(i).tokens) for i in range(2)],
                               steps=engine.resident_steps, waves=engine.metrics().waves))
            engine.restart_counts()
            rounds[-1].update(left=len(engine.requests), steps_after=engine.resident_steps,
                              peak_after=list(engine.peak_kv_tokens), timed_after=engine.loop_timing.steps)
        return dict(rounds=rounds, refused=refused)
    finally:
        ps.destroy_model_parallel()


def test_an_engine_serves_trace_after_trace_with_its_counts_restarted():
    """``InferenceEngine.restart_counts`` (bench_serving builds each mode's engine once for
    all its traces): the second round of the same requests gets the same tokens and counts
    as the first; the books are empty after each restart, which refuses while a request runs."""
    from tknp_megatron.launch import spawn

    out = spawn(restart_worker, 1, (), timeout_s=180)[0]
    first, second = out["rounds"]
    assert "restart_counts: requests [0, 1]" in out["refused"]
    assert first["tokens"] == second["tokens"] and all(len(t) == 4 for t in first["tokens"])
    assert first["steps"] == second["steps"] > 0 and first["waves"] == second["waves"] == 1
    for r in (first, second):
        assert r["left"] == 0 and r["steps_after"] == 0 and r["peak_after"] == [0] and r["timed_after"] == 0


def sequence_limit_worker(rank: int, world: int, limit) -> dict:
    """A tiny TKNP engine (graphs on the CPU's bucketed path) with ``max_sequence_length =
    limit``: its block-table width, its graphs' attention bound, and how three requests end."""
    import parallel_state as ps
    from tknp_megatron.config import get_preset
    from tknp_megatron.sampling import SamplingParams

    groups = ps.initialize_model_parallel(tensor_model_parallel_size=1, token_parallel_size=1)
    try:
        config = EngineConfig(kv_tokens_per_node=256, cuda_graphs=True, max_sequence_length=limit)
        engine = build_engine(Mode.TKNP, get_preset("tiny"), groups, config, torch.device("cpu"), torch.float32)
        results = engine.generate([[1, 2, 3], [7] * 38, [4, 5]], SamplingParams(max_new_tokens=3))
        return dict(width=engine.executor.kv.spec.max_blocks_per_seq, bound=engine.executor.graphs.max_seq_len,
                    tokens=[list(r.tokens) for r in results], reasons=[r.reject_reason for r in results])
    finally:
        ps.destroy_model_parallel()


def test_a_sequence_limit_below_the_models():
    """EngineConfig.max_sequence_length (vLLM's max_model_len): a longer request is refused
    naming the limit, the others get the tokens they get without it, and the block table
    and the graphs' attention bound are sized for the limit, not the model's 1024."""
    from tknp_megatron.config import get_preset
    from tknp_megatron.launch import spawn

    capped = spawn(sequence_limit_worker, 1, (40,), timeout_s=180)[0]
    full = spawn(sequence_limit_worker, 1, (None,), timeout_s=180)[0]
    assert (capped["width"], capped["bound"]) == (3, 48) and (full["width"], full["bound"]) == (64, 1024)
    assert capped["reasons"][1] == "request 1: prompt 38 + max_new_tokens 3 = 41 tokens exceeds max_sequence_length 40"
    assert capped["reasons"][0] is None and capped["reasons"][2] is None and full["reasons"] == [None] * 3
    assert capped["tokens"][0::2] == full["tokens"][0::2] and all(len(t) == 3 for t in full["tokens"])
    with pytest.raises(ValueError, match=r"^max_sequence_length 2048: over the model's max_sequence_length 1024 \(tiny\)$"):
        EngineConfig(max_sequence_length=2048).sequence_limit(get_preset("tiny"))
    with pytest.raises(ValueError, match="max_sequence_length 0: must be None or an integer >= 1"):
        EngineConfig(max_sequence_length=0)


@pytest.mark.parametrize("field, value, message", [
    ("block_size", 0, "block_size 0: must be an integer >= 1"),
    ("block_size", 16.5, "block_size 16.5: must be an integer >= 1"),
    ("kv_tokens_per_node", 8, "kv_tokens_per_node 8: must be None or an integer >= block_size 16 (one block)"),
    ("kv_tokens_per_node", "100", "kv_tokens_per_node '100': must be None or an integer"),
    ("max_requests_per_node", 0, "max_requests_per_node 0: must be an integer >= 1"),
    ("max_prefill_tokens", -1, "max_prefill_tokens -1: must be an integer >= 1"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization 1.5: must be in (0, 1]"),
    ("gpu_memory_cap_gib", -1, "gpu_memory_cap_gib -1: must be None or a positive number of GiB"),
    ("policy", "bogus", "policy 'bogus': choose one of usage, reserved"),
    ("attention_backend", 3, "attention_backend 3: must be None or a backend name"),
    ("cuda_graphs", "yes", "cuda_graphs 'yes': must be True or False"),
])
def test_engine_config_names_the_field_the_value_and_the_limit(field, value, message):
    """Checked when the config is made, not deep inside the engine's build or first step."""
    with pytest.raises(ValueError) as err:
        EngineConfig(**{field: value})
    assert str(err.value).startswith(f"EngineConfig {message}")
    assert EngineConfig(policy="reserved").policy is LoadPolicy.RESERVED


def non_integer_ids_worker(rank: int, world: int) -> list:
    import parallel_state as ps
    from tknp_megatron.config import get_preset
    from tknp_megatron.sampling import SamplingParams

    groups = ps.initialize_model_parallel(tensor_model_parallel_size=1, token_parallel_size=1)
    try:
        engine = build_engine(Mode.TKNP, get_preset("tiny"), groups, EngineConfig(kv_tokens_per_node=256),
                              torch.device("cpu"), torch.float32)
        results = engine.generate([[1, 2.7, 3], ["a", 2], [1, 2, 3]], SamplingParams(max_new_tokens=2))
        return [(r.status.value, r.reject_reason, len(r.tokens)) for r in results]
    finally:
        ps.destroy_model_parallel()


def test_token_ids_that_are_not_integers_are_refused_not_rounded():
    """``generate`` / ``add_request`` take integer ids only: 2.7 is refused, not served as 2,
    and a string refuses its request alone, the batch's others are served."""
    from tknp_megatron.launch import spawn

    ended = spawn(non_integer_ids_worker, 1, (), timeout_s=180)[0]
    assert ended[0][:2] == ("rejected", "request 0: token id 2.7 is not an integer")
    assert ended[1][:2] == ("rejected", "request 1: token id 'a' is not an integer")
    assert ended[2] == ("completed", None, 2)


def derived_plans_worker(rank: int, world: int, derive: bool, mode: str = "tknp") -> dict:
    """A tiny engine of ``mode`` (TKNP, or PP over ``world`` stages; graphs on the CPU's
    bucketed path) serving requests that end at different steps, one of them sampled:
    their tokens, how many plans were derived from the one before (``derive``; with
    ``derive`` False every plan is built) and how many padded steps were derived."""
    import parallel_state as ps
    from tknp_megatron.baselines import pp as pp_module
    from tknp_megatron.config import get_preset
    from tknp_megatron.engine import engine as engine_module
    from tknp_megatron.executor import step_inputs
    from tknp_megatron.sampling import SamplingParams

    derived, advanced = [], []
    where = pp_module if mode == "pp" else engine_module  # the module whose name the loop calls
    real, real_advance = where.next_decode_plan, step_inputs._advance

    def counted(*args):
        plan = real(*args) if derive else None
        derived.append(plan is not None)
        return plan

    where.next_decode_plan = counted
    step_inputs._advance = lambda *a: advanced.append(1) or real_advance(*a)
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=1, token_parallel_size=world)
    try:
        config = EngineConfig(kv_tokens_per_node=512, cuda_graphs=True)
        engine = build_engine(Mode(mode), get_preset("tiny"), groups, config, torch.device("cpu"), torch.float32)
        params = [SamplingParams(max_new_tokens=n) for n in (12, 7, 9)]
        params.append(SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, seed=3))
        prompts = [[1, 2, 3], [4, 5], [6] * 9, [7, 8, 9, 10]]
        results = engine.generate(prompts, params)  # every rank: the coordinator leads, the others follow
        return dict(tokens=[list(r.tokens) for r in results], derived=sum(derived), plans=len(derived),
                    advanced=len(advanced))
    finally:
        where.next_decode_plan, step_inputs._advance = real, real_advance
        ps.destroy_model_parallel()


@pytest.mark.parametrize("mode,world", [("tknp", 1), ("pp", 1), ("pp", 2)])
def test_steady_decode_plans_are_derived_and_change_no_token(mode, world):
    """In steady decode the engine derives each plan from the queued one
    (plan.next_decode_plan), and PP's loop each microbatch's plan from its plan before and
    the tokens just booked; every rank derives the padded inputs alike: the requests'
    tokens, greedy and seeded sampling, are the ones of plans built request by request
    every step."""
    from tknp_megatron.launch import spawn

    quick_ranks = spawn(derived_plans_worker, world, (True, mode), timeout_s=180)
    built_ranks = spawn(derived_plans_worker, world, (False, mode), timeout_s=180)
    quick, built = quick_ranks[0], built_ranks[0]
    assert built["derived"] == 0 and quick["plans"] == built["plans"]
    assert quick["derived"] >= 5  # the steps between admissions and the requests' ends
    # every rank (each PP stage) derived each derived plan's padded inputs too
    assert [r["advanced"] for r in quick_ranks] == [quick["derived"]] * world
    assert [r["advanced"] for r in built_ranks] == [0] * world
    assert quick["tokens"] == built["tokens"] and [len(t) for t in quick["tokens"]] == [12, 7, 9, 12]
