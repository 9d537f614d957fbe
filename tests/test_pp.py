"""The pipeline-parallel baseline against the same Megatron reference (fp32, CPU, gloo).

Stages hold TKNP's layer blocks; every stage keeps every request's KV for its own layers;
microbatches are pipelined across steps. Greedy tokens equal the reference, logits within
1e-4, for (stages, TP) in {(1,2), (2,1), (3,1), (2,2)}, with waves, mid-batch completion,
seeded sampling and bad input, and on the bucketed, padded path each stage's CUDA graphs
replay (run eagerly on CPU, after the all-padding steps a GPU captures at start-up), also
with each stage's hidden state padded once per step to a multiple of 16 rows as FP8 runs pad
it (only the step's rows travel between stages); outside KV other than synthetic is refused by name.
"""

from __future__ import annotations

import pytest

from tests.helpers import assert_matches_reference, reference_kvs, spawn_runs
from tests.tknp_workers import SCENARIOS, SEED, tknp_worker
from tknp_megatron.mode import Mode

WORLDS = {2: [(1, 2), (2, 1)], 3: [(3, 1)], 4: [(2, 2)]}
SHAPES = [s for shapes in WORLDS.values() for s in shapes]
PP_SCENARIOS = [s for s in SCENARIOS if not s.ingest]
INGEST = [s for s in SCENARIOS if s.ingest]


@pytest.fixture(scope="module")
def pp(reference):
    kvs = reference_kvs(reference)
    args = {world: (shapes, PP_SCENARIOS + INGEST[:1] * (world == 2), SEED, kvs, Mode.PP)
            for world, shapes in WORLDS.items()}
    return dict(spawn_runs(tknp_worker, args))


CASES = [(shape, s) for shape in SHAPES for s in PP_SCENARIOS]


@pytest.mark.parametrize("shape,scenario", CASES,
                         ids=[f"S{sh[0]}T{sh[1]}-{s.name}" for sh, s in CASES])
def test_pp_matches_reference(pp, reference, shape, scenario):
    run = pp[(*shape, scenario.name)]
    ref, _ = reference[scenario.name]
    assert_matches_reference(run["results"][: len(scenario.prompts)], ref, logits=not scenario.graphs)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"S{s[0]}T{s[1]}")
def test_pp_graph_path_is_taken(pp, shape):
    assert pp[(*shape, "llama-graph-path")]["graph_steps"] > 0  # stage 0's steps replayed from its graphs
    assert pp[(*shape, "llama-waves")]["graph_steps"] == 0


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"S{s[0]}T{s[1]}")
def test_pp_gemms_see_aligned_rows(pp, shape):
    """With the stage's rows padded to 16 once per step, every dense GEMM of stage 0 runs
    over a multiple of 16 rows; without, over the step's rows."""
    aligned = pp[(*shape, "llama-graph-aligned")]["gemm_rows"]
    assert aligned and all(rows % 16 == 0 for rows in aligned), aligned
    assert any(rows % 16 for rows in pp[(*shape, "llama-graph-path")]["gemm_rows"])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"S{s[0]}T{s[1]}")
def test_pp_waves_under_capacity(pp, shape):
    assert pp[(*shape, "llama-waves")]["waves"] >= 2


@pytest.mark.parametrize("shape", WORLDS[2], ids=lambda s: f"S{s[0]}T{s[1]}")
def test_pp_refuses_outside_kv_by_name(pp, shape):
    results = pp[(*shape, "llama-ingest")]["results"]
    assert all(r.status.value == "rejected" for r in results)
    assert "request 0: the PP baseline takes outside KV only as synthetic_kv" == results[0].reject_reason
