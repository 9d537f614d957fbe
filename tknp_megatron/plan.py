"""The step plan: what every rank needs to run one step, broadcast once per step.

Requests are in batch order, grouped by owner node (node 0's first), so each owner's rows
are one contiguous slice and the root's gather is a concatenation in batch order.

Plans are built one step ahead (overlapped scheduling, as in vLLM's async scheduler;
DESIGN section 7 books every step before planning the next): while step n runs on the
GPUs the coordinator plans step n + 1 before it has read step n's tokens.
A request whose step-n token is still in flight is fed that token on the device:
``prev_token_index`` points at its row of step n's output, which every rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from tknp_megatron.engine.request import Request

__all__ = ["Admission", "StepPlan", "build_plan", "STOP_PLAN"]


@dataclass(frozen=True)
class Admission:
    """A request placed on an owner this step.

    Attributes:
        request_id: the request.
        owner: owning node.
        slot: the owner's block-table row.
        blocks: reserved block ids on the owner.
        ingest_len: tokens of KV arriving from outside (0 = prefill in the pool).
        synthetic_seed: if set, the owner generates the ingested KV from this seed.
    """

    request_id: int
    owner: int
    slot: int
    blocks: Tuple[int, ...]
    ingest_len: int = 0
    synthetic_seed: Optional[int] = None


@dataclass(frozen=True)
class StepPlan:
    """One step for the whole pool.

    Per request (``[R]``, batch order): ``request_ids``, ``slots``, ``q_lens`` (tokens fed
    this step: prompt length for prefill, 1 for decode), ``start_pos`` (tokens already
    cached), and the sampling tensors ``temperature``, ``top_k``, ``top_p``, ``seeds``,
    ``sample_steps`` (index of the token being generated). ``tokens`` is ``[rows]`` with
    rows = sum(q_lens). ``prev_token_index`` is None when every input token is in
    ``tokens``; otherwise ``[rows]``: the index into the previous step's sampled tokens
    (batch order) of the row's input token, or -1 to take ``tokens``' entry.
    ``requests_per_owner`` / ``rows_per_owner`` are per node.

    With dual-active-root microbatching, ``microbatches`` holds one plan per microbatch
    (each grouped by owner, no admissions) and this plan is their concatenation in that
    order, for booking; its rows are then grouped by microbatch first, so
    :meth:`request_range` is only meaningful on the microbatches' plans.
    """

    step: int
    admissions: Tuple[Admission, ...]
    request_ids: torch.Tensor
    slots: torch.Tensor
    q_lens: torch.Tensor
    start_pos: torch.Tensor
    tokens: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    sample_steps: torch.Tensor
    requests_per_owner: Tuple[int, ...]
    rows_per_owner: Tuple[int, ...]
    record_logits: bool = False
    stop: bool = False
    prev_token_index: Optional[torch.Tensor] = None
    microbatches: Tuple["StepPlan", ...] = ()

    @property
    def num_requests(self) -> int:
        return int(self.request_ids.numel())

    @property
    def num_rows(self) -> int:
        return int(self.tokens.numel())

    @property
    def max_query_len(self) -> int:
        return int(self.q_lens.max()) if self.num_requests else 0

    def request_range(self, node: int) -> Tuple[int, int]:
        lo = sum(self.requests_per_owner[:node])
        return lo, lo + self.requests_per_owner[node]

    def row_range(self, node: int) -> Tuple[int, int]:
        lo = sum(self.rows_per_owner[:node])
        return lo, lo + self.rows_per_owner[node]


def _empty_plan(step: int, num_nodes: int, stop: bool) -> StepPlan:
    z = torch.zeros(0, dtype=torch.int64)
    return StepPlan(
        step, (), z, z, z, z, z, z.float(), z, z.float(), z, z,
        (0,) * num_nodes, (0,) * num_nodes, stop=stop,
    )


def STOP_PLAN(num_nodes: int) -> StepPlan:
    """The plan that tells every rank to leave its serve loop."""
    return _empty_plan(-1, num_nodes, stop=True)


def build_plan(
    step: int,
    batch: Sequence[Request],
    admissions: Sequence[Admission],
    num_nodes: int,
    record_logits: bool = False,
    num_microbatches: int = 1,
) -> StepPlan:
    """Plan for ``batch``; requests are reordered so each owner's rows are contiguous.

    A request with a step in flight (``inflight_rows > 0``) is fed its in-flight token
    from the device (one row, ``prev_token_index``); the others are fed their pending
    host tokens. With ``num_microbatches`` > 1 the batch is split by ``Request.microbatch``
    into per-microbatch plans (see :class:`StepPlan`).
    """
    feed_prev = any(r.inflight_rows for r in batch)
    if num_microbatches == 1:
        return _plan(step, batch, admissions, num_nodes, record_logits, feed_prev)
    parts = tuple(
        _plan(step, [r for r in batch if r.microbatch == m], (), num_nodes, record_logits, feed_prev)
        for m in range(num_microbatches)
    )
    return _concat(parts, admissions)


_CONCAT = (
    "request_ids", "slots", "q_lens", "start_pos", "tokens", "temperature", "top_k", "top_p",
    "seeds", "sample_steps",
)


def _concat(parts: Tuple[StepPlan, ...], admissions: Sequence[Admission]) -> StepPlan:
    """One plan holding ``parts`` back to back (the engine books it; executors run parts)."""
    cat = {f: torch.cat([getattr(p, f) for p in parts]) for f in _CONCAT}
    prev = None
    if parts[0].prev_token_index is not None:
        prev = torch.cat([p.prev_token_index for p in parts])
    return StepPlan(
        step=parts[0].step, admissions=tuple(admissions), **cat,
        requests_per_owner=tuple(map(sum, zip(*(p.requests_per_owner for p in parts)))),
        rows_per_owner=tuple(map(sum, zip(*(p.rows_per_owner for p in parts)))),
        record_logits=parts[0].record_logits, prev_token_index=prev, microbatches=parts,
    )


def _plan(step, batch, admissions, num_nodes: int, record_logits: bool, feed_prev: bool) -> StepPlan:
    batch = sorted(batch, key=lambda r: r.owner)  # stable: keeps admission order per owner
    pending = [_PREV if r.inflight_rows else r.pending_tokens() for r in batch]
    per_owner = [0] * num_nodes
    rows_owner = [0] * num_nodes
    for r, toks in zip(batch, pending):
        per_owner[r.owner] += 1
        rows_owner[r.owner] += len(toks)
    longs = lambda xs: torch.tensor(list(xs), dtype=torch.int64)  # noqa: E731
    floats = lambda xs: torch.tensor(list(xs), dtype=torch.float32)  # noqa: E731
    prev = None
    if feed_prev:
        prev = longs(
            i for r, toks in zip(batch, pending)
            for i in ((r.inflight_index,) if r.inflight_rows else (-1,) * len(toks))
        )
    return StepPlan(
        step=step,
        admissions=tuple(admissions),
        request_ids=longs(r.request_id for r in batch),
        slots=longs(r.slot for r in batch),
        q_lens=longs(len(t) for t in pending),
        start_pos=longs(r.num_cached + r.inflight_rows for r in batch),
        tokens=longs(t for toks in pending for t in toks),
        temperature=floats(r.params.temperature for r in batch),
        top_k=longs(r.params.top_k for r in batch),
        top_p=floats(r.params.top_p for r in batch),
        seeds=longs(r.params.seed for r in batch),
        sample_steps=longs(len(r.generated) + (r.inflight_rows > 0) for r in batch),
        requests_per_owner=tuple(per_owner),
        rows_per_owner=tuple(rows_owner),
        record_logits=record_logits,
        prev_token_index=prev,
    )


_PREV = (0,)  # placeholder host token of a row fed from the previous step's output
