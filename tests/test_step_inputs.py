"""A step's row layout: which request and position each query row has."""

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
