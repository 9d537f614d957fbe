"""The step plan crosses the pool every step pickled: it must come back identical, from
every kind of plan the engine broadcasts (one microbatch or two, with in-flight tokens,
the stop and idle plans), with each tensor's dtype."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from tknp_megatron.engine.request import Request, RequestTimeline
from tknp_megatron.plan import Admission, RequestColumns, StepPlan, build_plan, next_decode_plan
from tknp_megatron.sampling import SamplingParams

from tests.helpers import booked_plans, lockstep_plans, mixed_requests


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


def broadcast_worker(rank: int, world: int, plans) -> dict:
    """Plans and a large object through :class:`PlanBroadcast` over a real gloo group; each
    rank reports what it received and the collectives and capacity after each object."""
    import torch.distributed as dist

    from tknp_megatron.engine.plan_broadcast import PlanBroadcast

    send = PlanBroadcast(None, src=0, capacity=8192)
    big = torch.arange(4000, dtype=torch.int64)  # about 32 KB pickled: over the buffer (plans: 2-5 KB)
    log = []
    for obj, grow in [(plans[0], True), (big, False), (plans[1], True), (big, True), (plans[0], True)]:
        got = send(obj if rank == 0 else None, grow)
        log.append((got, send.collectives, send.capacity))
    dist.barrier()
    return dict(log=log)


def test_plans_cross_a_gloo_pool_in_one_collective():
    """A plan that fits the buffer crosses in one collective; an object larger than the
    buffer in two (its length, then its bytes), growing the buffer on every rank unless
    told not to; every rank gets what the coordinator sent."""
    from tknp_megatron.launch import spawn

    plans = (build_plan(5, _requests(7, 2, True), (), 2),
             build_plan(6, _requests(3, 2, False), (Admission(3, 1, 1, (4, 5, 6)),), 2))
    big = torch.arange(4000, dtype=torch.int64)
    for out in spawn(broadcast_worker, 3, (plans,), timeout_s=120):
        (p0, c0, cap0), (b1, c1, cap1), (p2, c2, cap2), (b3, c3, cap3), (p4, c4, cap4) = out["log"]
        _assert_same(p0, plans[0])
        _assert_same(p2, plans[1])
        _assert_same(p4, plans[0])
        assert torch.equal(b1, big) and torch.equal(b3, big)
        assert (c0, c1, c2, c3, c4) == (1, 3, 4, 6, 7)  # fits: one; too large: two
        assert (cap0, cap1, cap2) == (8192, 8192, 8192)  # grow=False kept the buffer
        size = len(pickle.dumps(big, protocol=pickle.HIGHEST_PROTOCOL))
        assert cap3 == cap4 == 1 << (size - 1).bit_length()  # grown to the next power of two


def link_worker(rank: int, world: int, plans) -> dict:
    """Plans and a large object along a chain of :class:`PlanLink` (rank r to r + 1) over a
    real gloo group: each rank receives from the one before and passes every object on
    before using it, as PP's stages do; reports what arrived and the messages and capacity
    after each object."""
    import torch.distributed as dist

    from tknp_megatron.engine.plan_broadcast import PlanLink

    inbound = PlanLink(None, rank - 1, capacity=8192) if rank > 0 else None
    outbound = PlanLink(None, rank + 1, capacity=8192) if rank < world - 1 else None
    big = torch.arange(4000, dtype=torch.int64)  # about 32 KB pickled: over the buffer
    log = []
    for obj in (plans[0], big, plans[1], plans[0]):
        got = obj if inbound is None else inbound.recv()
        if outbound is not None:
            outbound.send(got)
        end = inbound or outbound
        log.append((got, end.messages, end.capacity))
    if outbound is not None:
        outbound.flush()
    dist.barrier()
    return dict(log=log)


def test_plans_pass_stage_to_stage_in_one_message():
    """A plan that fits the link's buffer is one message; a larger object two (the buffer
    with its length, then its bytes), after which both ends grow alike; every rank of a
    three-rank chain gets every object, in order."""
    from tknp_megatron.launch import spawn

    plans = (build_plan(5, _requests(7, 2, True), (), 2),
             build_plan(6, _requests(3, 2, False), (Admission(3, 1, 1, (4, 5, 6)),), 2))
    big = torch.arange(4000, dtype=torch.int64)
    size = len(pickle.dumps(big, protocol=pickle.HIGHEST_PROTOCOL))
    for out in spawn(link_worker, 3, (plans,), timeout_s=120):
        (p0, m0, cap0), (b1, m1, cap1), (p2, m2, cap2), (p3, m3, cap3) = out["log"]
        _assert_same(p0, plans[0])
        _assert_same(p2, plans[1])
        _assert_same(p3, plans[0])
        assert torch.equal(b1, big)
        assert (m0, m1, m2, m3) == (1, 3, 4, 5)  # fits: one message; too large: two
        assert cap0 == 8192 and cap1 == cap2 == cap3 == 1 << (size - 1).bit_length()


@pytest.mark.parametrize("inflight", [False, True])
def test_plan_columns_hold_each_requests_values(inflight):
    """The plan's columns, owner counts and tokens, against the requests written out one by one."""
    reqs = _requests(7, 3, inflight)  # prompts still to feed, and (inflight) decoding requests
    plan = build_plan(2, reqs, (), 3)
    order = sorted(reqs, key=lambda r: r.owner)  # stable: admission order within an owner
    pending = [(0,) if r.inflight_rows else r.pending_tokens() for r in order]
    cols = plan.per_request
    assert cols.request_ids.tolist() == [r.request_id for r in order]
    assert cols.slots.tolist() == [r.slot for r in order]
    assert cols.q_lens.tolist() == [len(p) for p in pending]
    assert cols.start_pos.tolist() == [r.num_cached + r.inflight_rows for r in order]
    assert cols.temperature.tolist() == [r.params.temperature for r in order]
    assert cols.top_k.tolist() == [r.params.top_k for r in order]
    assert cols.top_p.tolist() == [r.params.top_p for r in order]
    assert cols.seeds.tolist() == [r.params.seed for r in order]
    assert cols.sample_steps.tolist() == [len(r.generated) + (r.inflight_rows > 0) for r in order]
    assert plan.tokens.tolist() == [t for p in pending for t in p]
    assert plan.requests_per_owner == tuple(sum(r.owner == n for r in reqs) for n in range(3))
    assert plan.rows_per_owner == tuple(sum(len(p) for r, p in zip(order, pending) if r.owner == n)
                                        for n in range(3))
    assert all(c.dtype == f.metadata["dtype"] for c, f in
               zip((getattr(cols, f.name) for f in dataclasses.fields(cols)), dataclasses.fields(cols)))


def test_padding_requests_take_each_columns_pad_value():
    """``RequestColumns.take``: -1 entries hold the column's pad value (or the one given)."""
    plan = build_plan(0, _requests(3, 1, False), (), 1)
    cols = plan.per_request.take(torch.tensor([2, -1, 0, -1]), slots=9)
    assert cols.request_ids.tolist() == [2, -1, 0, -1]
    assert cols.slots.tolist() == [plan.per_request.slots[2].item(), 9, plan.per_request.slots[0].item(), 9]
    assert cols.q_lens.tolist()[1::2] == [1, 1] and cols.start_pos.tolist()[1::2] == [0, 0]
    assert cols.temperature.tolist()[1::2] == [0.0, 0.0] and cols.top_p.tolist()[1::2] == [1.0, 1.0]
    empty = RequestColumns.empty().take(torch.tensor([-1, -1]), slots=4)
    assert empty.request_ids.tolist() == [-1, -1] and empty.slots.tolist() == [4, 4]
    with pytest.raises(IndexError, match="of columns holding none"):
        RequestColumns.empty().take(torch.tensor([-1, 0]))


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_steady_decode_plan_derived_from_the_last_is_the_one_built(nodes):
    # the derivation must hold on every steady step, and decline wherever the batch or its
    # rows changed (admissions, whole prompts, requests ending)
    steps = lockstep_plans(mixed_requests(), nodes, 40)
    for built, derived in steps:
        if derived is not None:
            assert derived.follows == derived.step - 1 and built.follows == -1
            _assert_same(dataclasses.replace(derived, follows=-1), built)
    derived = sum(d is not None for _, d in steps)
    assert derived >= 12
    assert len(steps) > derived + 3  # the steps around admissions and ends were built


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_decode_plan_fed_the_booked_tokens_derives_as_built(microbatches):
    # PP's loop: a microbatch's step is booked, then its next one planned, fed from the host
    steps = booked_plans(mixed_requests(), microbatches, 60)
    for built, derived in steps:
        if derived is not None:
            assert built.prev_token_index is None and built.follows == -1
            assert derived.step - microbatches <= derived.follows < derived.step  # the microbatch's plan before
            _assert_same(dataclasses.replace(derived, follows=-1), built)
    derived = sum(d is not None for _, d in steps)
    assert derived >= 12
    assert len(steps) > derived + 3


def test_next_decode_plan_declines_what_it_cannot_derive():
    reqs = _requests(3, 1, False)
    for r in reqs:  # decoding: one token generated and booked
        r.generated, r.num_cached = [1], len(r.prompt)
    plan = build_plan(4, reqs, (), 1)  # fed from the host
    assert next_decode_plan(5, plan, reqs, reqs, (), booked=[7, 8, 9]).tokens.tolist() == [7, 8, 9]
    assert next_decode_plan(5, plan, reqs, reqs, ()) is None  # no token in flight to take
    assert next_decode_plan(5, plan, reqs, reqs, (), booked=[7, 8]) is None  # a token short
    assert next_decode_plan(5, plan, reqs, reqs[::-1], (), booked=[7, 8, 9]) is None  # another order
    with pytest.raises(ValueError, match="step 4 does not come after step 4"):
        next_decode_plan(4, plan, reqs, reqs, (), booked=[7, 8, 9])


def test_bench_host_times_the_built_and_the_derived_plan(capsys):
    from tknp_megatron.tools import bench_host

    assert bench_host.main(["--batch", "12", "--context", "256", "--nodes", "2", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert "next_decode_plan" in out and "steady decode" in out


def test_host_profile_wraps_pieces_that_exist():
    """benchmarks/scripts/host_profile.py wraps the step's pieces by name: each must still be
    there (run in its own process: the wrapping patches the classes)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "scripts" / "host_profile.py"
    code = ("import importlib.util as u; s = u.spec_from_file_location('host_profile', %r); "
            "m = u.module_from_spec(s); s.loader.exec_module(m)" % str(script))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("mode", ["dp", "pp"])
def test_host_step_cpu_times_steady_steps(mode):
    """benchmarks/scripts/host_step_cpu.py (the coordinator's host work per step on a CPU,
    the RESULTS figures of DP and PP) runs and reports its median."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "scripts" / "host_step_cpu.py"), "4",
                           *(["pp"] if mode == "pp" else [])], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{mode} B=4 host work per step: median" in proc.stdout
