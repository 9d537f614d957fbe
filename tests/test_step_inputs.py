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
