"""Root <-> owner exchange and block handoffs on the token-parallel group.

All traffic is between matching TP ranks of different nodes (the token-parallel group).
Per layer there is one scatter (root -> owners, each owner's rows of this TP rank's QKV
slice) and one gather (owners -> root, attention outputs in batch order), each a single
``all_to_all_single`` with split sizes taken from the step plan (host ints: no sync).
The root's own rows go through the same call as a local copy (a pool of one node has no
exchange: its executor skips both calls). A block handoff is one
point-to-point transfer of the hidden state from one root to the next.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from parallel_state import TokenParallelGroups

__all__ = ["TokenParallelComm"]


class TokenParallelComm:
    """Collectives of one rank over its token-parallel group."""

    def __init__(self, groups: TokenParallelGroups):
        self.groups = groups
        self.group = groups.tknp_group
        self.node = groups.node
        self.num_nodes = groups.num_nodes

    def _only_from(self, root: int, count: int) -> list:
        splits = [0] * self.num_nodes
        splits[root] = count
        return splits

    def scatter(
        self,
        rows: Optional[torch.Tensor],
        root: int,
        rows_per_owner: Sequence[int],
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Send each owner its rows of ``rows`` (root only) and receive this node's.

        Args:
            rows: on the root ``[sum(rows_per_owner), W]`` in batch order; None elsewhere.
            root: the layer's active root node.
            rows_per_owner: ``[N]`` rows owned by each node.
            out: ``[rows_per_owner[node], W]`` receive buffer.
        Returns:
            ``out``, filled with this node's rows.
        """
        if self.node == root:
            send, send_splits = rows, list(rows_per_owner)
        else:
            send, send_splits = out.new_empty((0,) + tuple(out.shape[1:])), [0] * self.num_nodes
        recv_splits = self._only_from(root, rows_per_owner[self.node])
        dist.all_to_all_single(out, send, recv_splits, send_splits, group=self.group)
        return out

    def gather(
        self,
        mine: torch.Tensor,
        root: int,
        rows_per_owner: Sequence[int],
        out: Optional[torch.Tensor],
    ) -> Optional[torch.Tensor]:
        """Return each owner's rows ``mine`` ``[rows_per_owner[node], W]`` to the root.

        ``out`` is the root's ``[sum(rows_per_owner), W]`` buffer (None elsewhere); the
        root's result is in batch order.
        """
        send_splits = self._only_from(root, rows_per_owner[self.node])
        if self.node == root:
            recv, recv_splits = out, list(rows_per_owner)
        else:
            recv = mine.new_empty((0,) + tuple(mine.shape[1:]))
            recv_splits = [0] * self.num_nodes
        dist.all_to_all_single(recv, mine.contiguous(), recv_splits, send_splits, group=self.group)
        return out if self.node == root else None

    def handoff(
        self, hidden: Optional[torch.Tensor], src: int, dst: int, out: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        """Move the hidden state from root ``src`` to root ``dst`` (matching TP ranks).

        ``hidden`` is given on ``src``; ``out`` (same shape) is filled on ``dst``. Ranks on
        other nodes do nothing and get None.
        """
        if self.node == src:
            dist.send(hidden.contiguous(), self.groups.global_rank(dst), group=self.group)
            return None
        if self.node == dst:
            dist.recv(out, self.groups.global_rank(src), group=self.group)
            return out
        return None
