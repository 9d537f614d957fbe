"""Tests of tknp_megatron.analysis.metrics on hand-made timelines."""

import json
import math
import random

import pytest

from tknp_megatron.analysis.metrics import ServingMetrics, percentile, summarize
from tknp_megatron.engine.request import RequestStatus, RequestTimeline

approx = pytest.approx


def _run(release, scheduled, tokens, complete=True):
    t = RequestTimeline(release=release)
    t.mark_scheduled(scheduled)
    for x in tokens:
        t.record_token(x)
    if complete:
        t.complete(tokens[-1])
    return t


def _timelines():
    """A: 3 tokens, slow; B: 4 tokens, meets the SLO; C: rejected; D: still running."""
    a = _run(0.0, 0.5, [1.0, 1.1, 1.3])
    b = _run(1.0, 1.0, [1.2, 1.25, 1.30, 1.35])
    c = RequestTimeline(release=2.0)
    c.reject("max_new_tokens must be >= 1")
    d = _run(0.2, 1.5, [1.6], complete=False)
    return [a, b, c, d]


def test_timeline_lifecycle():
    t = RequestTimeline(release=1.0)
    assert t.status is RequestStatus.WAITING and t.output_tokens == 0
    t.mark_scheduled(2.0)
    t.mark_scheduled(3.0)  # re-batching keeps the first admission
    assert t.first_scheduled == 2.0 and t.status is RequestStatus.RUNNING
    t.record_token(4.0)
    t.record_token(4.5)
    assert t.first_token == 4.0 and t.token_times == [4.0, 4.5] and t.output_tokens == 2
    assert t.inter_token_latencies() == [0.5]
    t.complete(4.5)
    assert t.status is RequestStatus.COMPLETED and t.status == "completed"
    r = RequestTimeline(release=0.0)
    r.reject("too long")
    assert r.status == "rejected" and r.reject_reason == "too long"


def test_counts_and_makespan():
    m = summarize(_timelines(), waves=2, kv_utilization=[0.5, 0.25])
    assert (m.requests, m.completed, m.rejected) == (4, 2, 1)
    assert m.output_tokens == 3 + 4 + 1  # the running request's token counts
    assert m.makespan_s == approx(1.35)  # release 0.0 -> last completion 1.35
    assert m.completion_throughput_tok_s == approx(7 / 1.35)  # completed tokens only
    assert m.waves == 2 and m.kv_utilization == (0.5, 0.25)


def test_latencies():
    m = summarize(_timelines(), waves=1)
    # waits 0.5, 0.0, 1.3 (C never scheduled); p95 rank 1.9 -> 0.5 + 0.9 * 0.8
    assert m.queue_wait_s_mean == approx(0.6)
    assert m.queue_wait_s_p95 == approx(1.22)
    assert m.ttft_s_mean == approx((1.0 + 0.2 + 1.4) / 3)
    # gaps 0.1, 0.2 (A) and 0.05 x3 (B); D has one token, so none
    assert m.itl_s_p50 == approx(0.05)
    assert m.itl_s_p95 == approx(0.1 + 0.8 * 0.1)  # rank 3.8 of 5
    # completion times 1.3 and 0.35; p95 rank 0.95 of 2
    assert m.completion_time_s_mean == approx(0.825)
    assert m.completion_time_s_p95 == approx(0.35 + 0.95 * 0.95)


def test_slo_attainment():
    tl = _timelines()
    # A: 1.3 s / 3 tokens = 0.43 s; B: 0.35 / 4 = 0.0875 s
    assert summarize(tl, waves=1).slo_attainment == approx(0.5)
    assert summarize(tl, waves=1, slo_s_per_token=0.5).slo_attainment == approx(1.0)
    assert summarize(tl, waves=1, slo_s_per_token=0.05).slo_attainment == approx(0.0)
    exact = [_run(0.0, 0.0, [0.125, 0.25])]  # 0.25 s / 2 tokens == 0.125 exactly
    assert summarize(exact, waves=1, slo_s_per_token=0.125).slo_attainment == 1.0


def test_throughput_span_starts_at_first_release_of_any_request():
    early_reject = RequestTimeline(release=0.0)
    early_reject.reject("bad")
    late = _run(1.0, 1.0, [1.5, 2.0])
    m = summarize([early_reject, late], waves=1)
    assert m.makespan_s == approx(2.0) and m.completion_throughput_tok_s == approx(1.0)


def test_completed_status_without_time_is_not_counted():
    t = RequestTimeline(release=0.0, status=RequestStatus.COMPLETED)
    assert summarize([t], waves=0).completed == 0


def test_empty_inputs():
    m = summarize([], waves=0)
    assert (m.requests, m.completed, m.output_tokens) == (0, 0, 0)
    assert m.makespan_s == 0.0 and m.completion_throughput_tok_s == 0.0
    for name in ("queue_wait_s_mean", "queue_wait_s_p95", "ttft_s_mean", "itl_s_p50",
                 "itl_s_p95", "completion_time_s_mean", "completion_time_s_p95",
                 "slo_attainment"):
        assert math.isnan(getattr(m, name)), name
    d = m.as_dict()
    assert d["itl_s_p50"] is None and d["kv_utilization"] == []
    json.dumps(d, allow_nan=False)  # strict JSON
    assert "n/a" in m.format_table()


def test_as_dict_and_table():
    m = summarize(_timelines(), waves=3, kv_utilization=(0.5, 0.25))
    d = m.as_dict()
    assert set(d) == {f for f in ServingMetrics.__dataclass_fields__}
    assert d["kv_utilization"] == [0.5, 0.25] and d["completed"] == 2
    assert json.loads(json.dumps(d, allow_nan=False)) == d
    table = m.format_table()
    lines = table.splitlines()
    assert 8 <= len(lines) <= 15
    assert "4 (2 completed, 1 rejected)" in table
    assert "p50 50.0 ms" in table and "50.0%" in table and "n0=50.0%" in table


def test_metrics_are_frozen():
    m = summarize([], waves=0)
    with pytest.raises(Exception):
        m.waves = 3


def test_percentile_definition():
    assert math.isnan(percentile([], 50))
    assert percentile([7.0], 95) == 7.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 0) == 1.0  # order of input does not matter
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for _ in range(50):
        xs = [rng.expovariate(1.0) for _ in range(rng.randint(1, 40))]
        q = rng.uniform(0, 100)
        assert percentile(xs, q) == approx(float(np.percentile(xs, q)), rel=1e-12)
