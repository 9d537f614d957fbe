"""End to end: TKNP on real gloo pools vs Megatron's GPTModel reference (fp32, CPU).

Greedy tokens must match exactly and logits within 1e-4 for every (N, T) in
{(1,1), (2,1), (3,1), (4,1), (1,2), (2,2)}, with mixed prompt lengths, requests that
finish mid-batch (different max new tokens), admission waves under a tight KV budget, a
node owning no request, KV ingested from outside (the reference's own K/V) versus
in-pool prefill, seeded sampling, and both Llama-style and Nemotron-style tiny models.
"""

from __future__ import annotations

import pytest

from tests.helpers import assert_matches_reference, reference_kvs, spawn_runs
from tests.tknp_workers import SCENARIOS, SEED, tknp_worker

WORLDS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 3: [(3, 1)], 4: [(4, 1), (2, 2)]}
ALL_SHAPES = [s for shapes in WORLDS.values() for s in shapes]
# the data-parallel baseline: two independent pools (1 node x TP2 each) in a world of 4
DP_SHAPE = (1, 2, 2)


@pytest.fixture(scope="module")
def tknp(reference):
    kvs = reference_kvs(reference)
    args = {world: (shapes + ([DP_SHAPE] if world == 4 else []), SCENARIOS, SEED, kvs)
            for world, shapes in WORLDS.items()}
    out = {}
    for key, run in spawn_runs(tknp_worker, args):
        _merge(out, key, run)
    return out


def _merge(out, key, run):
    """Pools of one shape report separately; join their results in request-id order."""
    if key not in out:
        out[key] = run
        return
    merged = out[key]
    merged["results"] = sorted(merged["results"] + run["results"], key=lambda r: r.request_id)
    merged["waves"] = max(merged["waves"], run["waves"])


def _good(s, results):
    return results[: len(s.prompts)]


# every TKNP shape x every scenario; the DP pools x every scenario but bad input (whose
# rejections are checked per pool shape below)
CASES = [(shape, s) for shape in ALL_SHAPES for s in SCENARIOS] + [
    (DP_SHAPE, s) for s in SCENARIOS if not s.extra_bad
]


@pytest.mark.parametrize(
    "shape,scenario", CASES, ids=[f"{'x'.join(map(str, sh))}-{s.name}" for sh, s in CASES]
)
def test_matches_reference(tknp, reference, shape, scenario):
    run = tknp[(*shape, scenario.name)]
    ref, _ = reference[scenario.name]
    # the graph path records no logits
    assert_matches_reference(_good(scenario, run["results"]), ref, logits=not scenario.graphs)


@pytest.mark.parametrize("shape", ALL_SHAPES, ids=lambda s: f"N{s[0]}T{s[1]}")
def test_waves_and_mid_batch_completion(tknp, shape):
    run = tknp[(shape[0], shape[1], "llama-waves")]
    assert run["waves"] >= 2
    assert [len(r.tokens) for r in run["results"]] == list(SCENARIOS[0].max_new)
    owners = {r.owner for r in run["results"]}
    assert owners == set(range(shape[0]))  # capacity pressure spreads requests over every node


def test_a_node_owns_no_request(tknp):
    run = tknp[(4, 1, "llama-few")]
    owners = [r.owner for r in run["results"]]
    assert len(set(owners)) == 3 and all(0 <= o < 4 for o in owners)


@pytest.mark.parametrize("shape", ALL_SHAPES, ids=lambda s: f"N{s[0]}T{s[1]}")
def test_ingest_equals_in_pool_prefill(tknp, shape):
    ingest = tknp[(shape[0], shape[1], "llama-ingest")]["results"]
    prefill = tknp[(shape[0], shape[1], "llama-waves")]["results"][: len(ingest)]
    assert [r.tokens for r in ingest] == [r.tokens for r in prefill]


@pytest.mark.parametrize("shape", ALL_SHAPES, ids=lambda s: f"N{s[0]}T{s[1]}")
def test_bad_input_rejected_others_served(tknp, shape):
    results = tknp[(shape[0], shape[1], "llama-bad-input")]["results"]
    good, bad = results[:3], results[3:]
    assert all(r.status.value == "completed" for r in good)
    assert all(r.status.value == "rejected" and not r.tokens for r in bad)
    reasons = [r.reject_reason for r in bad]
    assert "request 3: empty prompt" == reasons[0]
    assert "request 4" in reasons[1] and "outside the vocabulary [0, 512)" in reasons[1]
    assert "request 5" in reasons[2] and "max_new_tokens must be >= 1" in reasons[2]
    assert "request 6" in reasons[3] and "more than any node holds (64 tokens)" in reasons[3]


@pytest.mark.parametrize("shape", ALL_SHAPES, ids=lambda s: f"N{s[0]}T{s[1]}")
def test_eos_while_next_step_is_queued(tknp, reference, shape):
    """Requests that end on EOS or a stop sequence stop there, though their next step was
    already queued (overlapped scheduling); the scenario is not vacuous: two end each way."""
    scenario = next(s for s in SCENARIOS if s.name == "llama-eos")
    run = tknp[(shape[0], shape[1], scenario.name)]
    lengths = [len(r.tokens) for r in run["results"]]
    early = [run["results"][i] for i, (n, m) in enumerate(zip(lengths, scenario.max_new)) if n < m]
    reasons = [r.finish_reason for r in early]
    assert sorted(reasons) == ["eos", "eos", "stop", "stop"], reasons
    for r in early:
        assert r.tokens[-1] == scenario.eos_id or any(r.tokens[-len(q):] == q for q in scenario.stop)


@pytest.mark.parametrize("shape", ALL_SHAPES + [DP_SHAPE], ids=lambda s: "x".join(map(str, s)))
def test_every_gemm_sees_aligned_rows(tknp, shape):
    """With the roots' rows padded to 16 once per step (as FP8 runs pad them), every dense
    GEMM of the coordinator's layers runs over a multiple of 16 rows; without, it runs over
    the step's rows (the check tells the two apart)."""
    aligned = tknp[(*shape, "llama-graph-aligned")]["gemm_rows"]
    assert aligned and all(rows % 16 == 0 for rows in aligned), aligned
    assert any(rows % 16 for rows in tknp[(*shape, "llama-graph-path")]["gemm_rows"])
