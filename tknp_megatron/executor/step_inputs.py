"""Device tensors for one step on one rank, built from the step plan once per step.

Everything the per-layer loop needs that depends on the batch (the owner's attention
metadata, cache slots of the new K/V, RoPE angles, the sampled rows, sampling knobs) is
computed here, before the layer loop, so the loop itself has no host work and can be
captured in a CUDA graph. For graphs, :func:`pad_plan` rounds each owner's request count
up to a bucket with dummy requests that write to a scratch block and are never sampled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch

from tknp_megatron.attention import AttentionMetadata
from tknp_megatron.executor.rope import Rope
from tknp_megatron.host_to_device import to_device
from tknp_megatron.kv_cache import PagedKVCache
from tknp_megatron.plan import StepPlan, take_rows
from tknp_megatron.sampling import SamplingTensors

__all__ = [
    "RowLayout", "StepInputs", "StepShape", "bucket", "pad_plan", "plan_sampling", "prepare_inputs",
    "row_layout", "step_tokens",
]


@dataclass(frozen=True)
class StepShape:
    """What a captured step is specialised on: the ownership layout and sampling mode."""

    rows_per_owner: Tuple[int, ...]
    requests_per_owner: Tuple[int, ...]
    all_greedy: bool

    @property
    def num_rows(self) -> int:
        return sum(self.rows_per_owner)


@dataclass(frozen=True, eq=False)
class StepInputs:
    """One rank's inputs for a step (all on the rank's device).

    Attributes:
        tokens: ``[rows]`` input ids (used by the first root).
        slot_mapping: ``[own_rows]`` cache slots for this node's new K/V.
        freqs: ``[own_rows, 1, 1, rot_dim]`` RoPE angles of this node's rows.
        meta: attention metadata of this node's requests.
        last_rows: ``[R]`` row of each request's sampled token.
        sampling: the ``[R]`` sampling tensors of :func:`~tknp_megatron.sampling.sample`.
    """

    shape: StepShape
    tokens: torch.Tensor
    slot_mapping: torch.Tensor
    freqs: torch.Tensor
    meta: AttentionMetadata
    last_rows: torch.Tensor
    sampling: SamplingTensors

    def tensors(self):
        """Every tensor field, in a fixed order (for copying into static buffers)."""
        m = self.meta
        return (
            self.tokens, self.slot_mapping, self.freqs, m.query_start_loc, m.seq_lens,
            m.block_table, self.last_rows, *self.sampling,
        )

    def copy_(self, other: "StepInputs") -> None:
        """Fill these (static) buffers from ``other`` of the same shape."""
        for dst, src in zip(self.tensors(), other.tensors()):
            dst.copy_(src, non_blocking=True)


class RowLayout(NamedTuple):
    """Where each query row of a batch sits (host tensors, int64)."""

    cu_seqlens: torch.Tensor
    """``[R + 1]`` first row of each request, then the row count."""
    row_request: torch.Tensor
    """``[rows]`` the request of each row."""
    positions: torch.Tensor
    """``[rows]`` the sequence position of each row."""


def row_layout(q_lens: torch.Tensor, start_pos: torch.Tensor, rows: int) -> RowLayout:
    """The rows of requests fed ``q_lens`` ``[R]`` tokens from ``start_pos`` ``[R]`` on
    (``rows = sum(q_lens)``)."""
    cu = torch.zeros(q_lens.numel() + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=cu[1:])
    steps = torch.arange(rows)
    # row r belongs to the request whose rows end first after r (requests of no rows skipped);
    # a search, not repeat_interleave: its output_size path took 0.56 ms a step on the GPU
    # machine's host (benchmarks/RESULTS.md, "Host work per decode step")
    row_req = torch.searchsorted(cu[1:], steps, right=True)
    positions = start_pos[row_req] + steps - cu[row_req]
    return RowLayout(cu, row_req, positions)


def prepare_inputs(
    plan: StepPlan,
    node: int,
    kv: PagedKVCache,
    rope: Rope,
    device: torch.device,
    max_seq_len: int = 0,
    last_tokens: Optional[torch.Tensor] = None,
) -> StepInputs:
    """Build this rank's :class:`StepInputs`: host arithmetic, then one non-blocking copy
    per dtype to the device (no host sync, so it can run while the previous step does).

    ``max_seq_len`` overrides the attention grid bound (graphs capture with the cache's
    longest sequence so any later length fits). ``last_tokens`` ``[R_prev]`` are the
    previous step's sampled tokens on the device, which rows with a
    ``plan.prev_token_index`` take as their input.
    """
    lo, hi = plan.request_range(node)
    cols = plan.per_request
    q_lens, start = cols.q_lens[lo:hi], cols.start_pos[lo:hi]
    cu, row_req, positions = row_layout(q_lens, start, plan.rows_per_owner[node])
    slots = cols.slots[lo:hi]
    seq_lens = start + q_lens
    bound = int(seq_lens.max()) if hi > lo else 0
    host = (
        cu.to(torch.int32), seq_lens.to(torch.int32), slots, slots[row_req], positions,
        torch.cumsum(cols.q_lens, 0) - 1, plan.tokens, *_prev_index(plan), *cols.sampling(),
    )
    cu, seq_lens, slots, row_slots, positions, last_rows, tokens, *rest = to_device(host, device)
    if plan.prev_token_index is not None:
        tokens = _feed_previous(tokens, rest.pop(0), last_tokens)
    meta = AttentionMetadata(
        query_start_loc=cu,
        seq_lens=seq_lens,
        block_table=kv.block_table[slots],
        max_query_len=int(q_lens.max()) if hi > lo else 0,
        max_seq_len=max(bound, max_seq_len),
    )
    shape = StepShape(
        plan.rows_per_owner, plan.requests_per_owner, bool((cols.temperature == 0).all())
    )
    return StepInputs(
        shape=shape,
        tokens=tokens,
        slot_mapping=kv.slot_mapping(row_slots, positions),
        freqs=rope.freqs(positions),
        meta=meta,
        last_rows=last_rows,
        sampling=SamplingTensors(*rest),
    )


def _prev_index(plan: StepPlan) -> Tuple[torch.Tensor, ...]:
    return () if plan.prev_token_index is None else (plan.prev_token_index,)


def _feed_previous(tokens: torch.Tensor, index: torch.Tensor, last: Optional[torch.Tensor]) -> torch.Tensor:
    """``[rows]`` input ids: ``last[index]`` where ``index >= 0``, else ``tokens``."""
    if last is None:
        raise RuntimeError("the plan feeds tokens of a previous step this rank has not run")
    return torch.where(index >= 0, last[index.clamp(min=0)], tokens)


def step_tokens(plan: StepPlan, device: torch.device, last_tokens: Optional[torch.Tensor]) -> torch.Tensor:
    """``[rows]`` input ids of ``plan`` on ``device`` (executors without :class:`StepInputs`)."""
    tokens, *prev = to_device((plan.tokens, *_prev_index(plan)), device)
    return _feed_previous(tokens, prev[0], last_tokens) if prev else tokens


def plan_sampling(plan: StepPlan, device: torch.device) -> SamplingTensors:
    """The plan's ``[R]`` sampling tensors on ``device``."""
    return SamplingTensors(*to_device(plan.per_request.sampling(), device))


_SMALL_BUCKETS = (1, 2, 4, 8)


def bucket(n: int, multiple: int = 8) -> int:
    """Graph bucket for ``n`` requests on one owner: 0, 1, 2, 4, 8, then multiples of 8."""
    if n <= 0:
        return 0
    for b in _SMALL_BUCKETS:
        if n <= b:
            return b
    return -(-n // multiple) * multiple


def pad_plan(plan: StepPlan, dummy_slot: int, size: Optional[int] = None) -> Tuple[StepPlan, torch.Tensor]:
    """Pad a pure-decode plan so every owner holds the same bucketed request count.

    One bucket for all owners (that of the busiest) keeps the number of captured layouts
    to the number of buckets; the scheduler balances owners, so little is padded.
    ``size`` sets the count instead (at least the busiest owner's; a plan of no requests
    padded to ``size`` is all dummies, what graphs are captured on ahead of time).
    Dummy requests use ``dummy_slot`` (whose block-table row points at a scratch block),
    and each column's pad value (:class:`~tknp_megatron.plan.RequestColumns`): position 0,
    token 0, greedy, request id -1. Returns the padded plan and ``[R]`` the index of each
    real request in the padded batch.
    """
    counts = plan.requests_per_owner
    if size is None:
        size = bucket(max(counts))
    elif size < max(counts):
        raise ValueError(f"pad_plan: size {size} below the busiest owner's {max(counts)} requests")
    padded = (size,) * len(counts)
    n = torch.tensor(counts, dtype=torch.int64).unsqueeze(1)  # [N, 1]
    k = torch.arange(size)
    real = k < n  # [N, size]: which padded entries hold a real request
    take = torch.where(real, torch.cumsum(n, 0) - n + k, -1).flatten()  # -1: a dummy
    prev = plan.prev_token_index
    new = dataclasses.replace(
        plan, requests_per_owner=padded, rows_per_owner=padded, admissions=(),
        per_request=plan.per_request.take(take, slots=dummy_slot),
        tokens=take_rows(plan.tokens, take, 0),  # one row per request: rows pad alike
        prev_token_index=None if prev is None else take_rows(prev, take, -1),
    )
    return new, real.flatten().nonzero().flatten()
