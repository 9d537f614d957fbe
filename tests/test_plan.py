"""The step plan crosses the pool every step pickled: it must come back identical, from
every kind of plan the engine broadcasts (one microbatch or two, with in-flight tokens,
the stop and idle plans), with each tensor's dtype."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from tknp_megatron.engine.request import Request, RequestTimeline
from tknp_megatron.plan import Admission, RequestColumns, StepPlan, build_plan
from tknp_megatron.sampling import SamplingParams


def _requests(n: int, nodes: int, inflight: bool):
    out = []
    for i in range(n):
        params = SamplingParams(max_new_tokens=8, temperature=0.5 * (i % 2), top_k=i % 3, seed=i)
        r = Request(i, list(range(10 + i)), params, RequestTimeline(0.0))
        r.owner, r.slot, r.microbatch = i % nodes, i // nodes, i % 2
        if inflight and i % 3:
            r.generated, r.num_cached = [1, 2], 10 + i + 1
            r.inflight_rows, r.inflight_index = 1, i
        out.append(r)
    return out


def _assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, (StepPlan, RequestColumns)):
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("inflight", [False, True])
def test_a_plan_survives_pickling(microbatches, inflight):
    admissions = (Admission(3, 1, 1, (4, 5, 6), ingest_len=12, synthetic_seed=7),)
    plan = build_plan(5, _requests(7, 2, inflight), admissions, 2, num_microbatches=microbatches)
    assert (plan.prev_token_index is not None) == inflight
    _assert_same(plan, pickle.loads(pickle.dumps(plan)))


@pytest.mark.parametrize("plan", [StepPlan.stop_plan(3), StepPlan.idle_plan(3)], ids=["stop", "idle"])
def test_the_empty_plans_survive_pickling(plan):
    _assert_same(plan, pickle.loads(pickle.dumps(plan)))
