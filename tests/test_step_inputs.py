"""A step's row layout: which request and position each query row has."""

import dataclasses

import pytest
import torch

from tknp_megatron.executor.step_inputs import row_layout


@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1], [0, 2, 0, 3, 1], [5], [0, 0, 4], [2, 0], [1, 0, 0, 1, 7]])
def test_row_layout_against_repeat_interleave(q_lens):
    """Decode, prefill and mixed batches, with requests that have no rows this step."""
    q = torch.tensor(q_lens)
    start = torch.tensor([100 * i + 7 for i in range(len(q_lens))])
    rows = int(q.sum())
    layout = row_layout(q, start, rows)
    owner = torch.repeat_interleave(torch.arange(len(q_lens)), q)
    assert torch.equal(layout.row_request, owner)
    assert layout.cu_seqlens.tolist() == [0] + torch.cumsum(q, 0).tolist()
    expected = [int(start[r]) + j for r, n in enumerate(q_lens) for j in range(n)]
    assert layout.positions.tolist() == expected


def test_graph_step_refills_its_fixed_buffers_in_place():
    """A staged step's buffers keep their addresses when refilled from a later step, and
    hold what a fresh staging of that step holds."""
    from tknp_megatron.executor.step_inputs import GraphStep, host_inputs
    from tknp_megatron.plan import RequestColumns, StepPlan

    def plan(start):
        cols = RequestColumns.of(request_ids=range(4), slots=[3, 1, 0, 2], q_lens=[1] * 4,
                                 start_pos=[start + i for i in range(4)], temperature=[0.0] * 4,
                                 top_k=[0] * 4, top_p=[1.0] * 4, seeds=[7] * 4, sample_steps=[start] * 4)
        return StepPlan(step=start, admissions=(), per_request=cols, tokens=torch.arange(4) + start,
                        requests_per_owner=(2, 2), rows_per_owner=(2, 2),
                        prev_token_index=torch.tensor([1, -1, 0, 3]))

    cpu = torch.device("cpu")
    staged = GraphStep(host_inputs(plan(5), 1), 64).stage(cpu)
    addresses = [t.data_ptr() for t in staged.static.views]
    later = GraphStep(host_inputs(plan(9), 1), 64)
    staged.copy_(later)
    assert [t.data_ptr() for t in staged.static.views] == addresses
    for got, want in zip(staged.static.views, later.stage(cpu).static.views):
        assert torch.equal(got, want)
    host = later.host.tensors
    assert host.positions.tolist() == [11, 12] and host.slots.tolist() == [0, 2]
    assert host.prev_index.tolist() == [1, -1, 0, 3] and host.last_rows.tolist() == [0, 1, 2, 3]


def test_packed_host_tensors_are_views_of_one_buffer_per_dtype():
    """``pack``: each dtype's arrays back to back in one buffer, in order of first appearance
    (the grouping of ``StaticInputs``), and the views give the arrays back."""
    import numpy as np

    from tknp_megatron.host_to_device import StaticInputs, pack

    arrays = [np.arange(5), np.zeros((0,), np.int64), np.array([0.5, 2.0], np.float32), np.arange(3) + 7,
              np.array([1.5], np.float32)]
    packed = pack(arrays)
    assert [f.dtype for f in packed.flats] == [torch.int64, torch.float32]
    assert packed.flats[0].tolist() == [0, 1, 2, 3, 4, 7, 8, 9] and packed.flats[1].tolist() == [0.5, 2.0, 1.5]
    for view, a in zip(packed.views(), arrays):
        assert view.dtype == torch.from_numpy(a).dtype and view.tolist() == a.tolist()
    static = StaticInputs([torch.zeros(len(a), dtype=torch.from_numpy(a).dtype) for a in arrays], torch.device("cpu"))
    static.copy_(packed)
    assert [v.tolist() for v in static.views] == [a.tolist() for a in arrays]
    with pytest.raises(ValueError, match="packed inputs of 2 torch.float32 values"):
        StaticInputs([torch.zeros(3), torch.zeros(1, dtype=torch.int64)], torch.device("cpu")).copy_(
            pack([np.zeros(2, np.float32), np.arange(1)]))


def _count_advances(monkeypatch) -> list:
    """A list that grows by one at every padded step derived from the one before
    (``step_inputs._advance``)."""
    from tknp_megatron.executor import step_inputs

    advanced = []
    real_advance = step_inputs._advance
    monkeypatch.setattr(step_inputs, "_advance", lambda *a: advanced.append(1) or real_advance(*a))
    return advanced


def _assert_padded_alike(chain, fresh, where):
    assert chain.step == fresh.step and torch.equal(chain.index, fresh.index)
    assert (chain.real == fresh.real).all()
    for f in dataclasses.fields(fresh.padded.per_request):
        assert torch.equal(getattr(chain.padded.per_request, f.name), getattr(fresh.padded.per_request, f.name))
    assert torch.equal(chain.padded.tokens, fresh.padded.tokens)
    assert chain.padded.requests_per_owner == fresh.padded.requests_per_owner
    a, b = chain.host, fresh.host
    assert (a.shape, a.max_query_len, a.max_seq_len, a.feeds_previous) == \
        (b.shape, b.max_query_len, b.max_seq_len, b.feeds_previous)
    for name, x, y in zip(a.tensors._fields, a.tensors, b.tensors):
        assert torch.equal(x, y), (where, name)


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_derived_plans_padded_inputs_are_derived_from_the_last(nodes, monkeypatch):
    """padded_step: for a plan derived from the step before, the padded plan and each node's
    host inputs advanced from the previous step's are what pad_plan and host_inputs give."""
    from tknp_megatron.executor.step_inputs import padded_step
    from tests.helpers import lockstep_plans, mixed_requests

    advanced = _count_advances(monkeypatch)
    plans = [derived or built for built, derived in lockstep_plans(mixed_requests(), nodes, 40)]
    followers = sum(p.follows >= 0 for p in plans)
    assert followers >= 12
    for node in range(nodes):
        chain = None
        for plan in plans:
            fresh = padded_step(plan, node, dummy_slot=63)
            chain = padded_step(plan, node, dummy_slot=63, previous=chain)
            _assert_padded_alike(chain, fresh, (plan.step, node))
    assert len(advanced) == nodes * followers  # every such plan's inputs were derived


@pytest.mark.parametrize("microbatches", [1, 2])
def test_padded_inputs_of_plans_fed_the_booked_tokens_are_derived(microbatches, monkeypatch):
    """padded_step over PP's plans (fed from the host, each derived from its microbatch's
    plan before): the booked tokens land at the real rows, the rest as padded afresh."""
    from tknp_megatron.executor.step_inputs import padded_step
    from tests.helpers import booked_plans, mixed_requests

    advanced = _count_advances(monkeypatch)
    plans = [derived or built for built, derived in booked_plans(mixed_requests(), microbatches, 60)]
    followers = sum(p.follows >= 0 for p in plans)
    assert followers >= 12
    recent = {}  # step -> PaddedStep, as the PP executor keeps them
    for plan in plans:
        fresh = padded_step(plan, 0, dummy_slot=63)
        chain = padded_step(plan, 0, dummy_slot=63, previous=recent.get(plan.follows))
        _assert_padded_alike(chain, fresh, plan.step)
        assert chain.host.feeds_previous is False
        recent[plan.step] = chain
    assert len(advanced) == followers
