"""Capacity-aware continuous batching (paper 4.2), and the books of each step's tokens.

A waiting request goes, in arrival order, to the eligible node with the lowest KV load;
eligible means the node has a free request slot and free blocks for prompt + max new
tokens on all its TP ranks (every rank of a node has the same block count: the node's
minimum). If the head of the queue fits nowhere it waits, and so does everyone behind it
(FCFS): admissions then come in waves as running requests complete and free their
blocks. Ownership is fixed until completion.

:meth:`Scheduler.postprocess` books a finished step: each request's sampled token, and
the end of those that are done. A step is booked after the next one is queued (see
:mod:`tknp_megatron.engine.engine`), so a request that ended on EOS may still have a row
in the step being booked: that row is dropped.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from tknp_megatron.engine.request import Request
from tknp_megatron.kv_cache import BlockAllocator
from tknp_megatron.plan import Admission, StepPlan

__all__ = ["LoadPolicy", "SchedulerConfig", "ScheduleResult", "Scheduler", "StepLogProbs"]


@dataclass(frozen=True)
class StepLogProbs:
    """A step's log-probs read back to the host, per row in plan order: the sampled
    token's log-prob and the top ``(id, log-prob)`` pairs, most likely first."""

    chosen: List[float]
    top_values: List[List[float]]
    top_ids: List[List[int]]

    @classmethod
    def read(cls, log_probs: Optional[torch.Tensor], top_values: Optional[torch.Tensor],
             top_ids: Optional[torch.Tensor]) -> Optional["StepLogProbs"]:
        """From a step's ``[R]``, ``[R, K]``, ``[R, K]`` outputs (None when not computed)."""
        if log_probs is None:
            return None
        return cls(log_probs.tolist(), top_values.tolist(), top_ids.tolist())

    def row(self, i: int) -> Tuple[float, Tuple[Tuple[int, float], ...]]:
        return self.chosen[i], tuple(zip(self.top_ids[i], self.top_values[i]))


class LoadPolicy(str, enum.Enum):
    """How a node's KV load is measured when choosing an owner."""

    USAGE = "usage"  # context tokens of its requests (cached, or being prefilled now)
    RESERVED = "reserved"  # tokens reserved (prompt + max new) by its requests


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler knobs.

    Attributes:
        policy: load measure for choosing among eligible nodes.
        max_requests_per_node: request slots per node (block-table rows).
        max_prefill_tokens: prompt tokens admitted per step (in-pool prefill budget);
            the first admission of a step is always allowed.
    """

    policy: LoadPolicy = LoadPolicy.USAGE
    max_requests_per_node: int = 256
    max_prefill_tokens: int = 1 << 30

    def __post_init__(self):
        if self.max_requests_per_node < 1:
            raise ValueError("max_requests_per_node must be >= 1")
        object.__setattr__(self, "policy", LoadPolicy(self.policy))


@dataclass(frozen=True)
class ScheduleResult:
    """Requests admitted this step (with their admissions) and the whole step batch."""

    admitted: Tuple[Request, ...]
    admissions: Tuple[Admission, ...]
    batch: Tuple[Request, ...]


class Scheduler:
    """Owns the waiting queue, the running set and one block allocator per node, and
    books what each step produced."""

    def __init__(
        self,
        config: SchedulerConfig,
        allocators: Sequence[BlockAllocator],
        clock: Callable[[], float],
    ):
        self.config = config
        self.allocators = list(allocators)
        self.clock = clock
        self.waiting: Deque[Request] = deque()
        self._live: Dict[int, Request] = {}  # waiting or running, by id
        self.running: List[List[Request]] = [[] for _ in self.allocators]
        self._free_slots = [
            deque(range(config.max_requests_per_node)) for _ in self.allocators
        ]
        self.waves = 0
        self._blocked = False

    @property
    def num_nodes(self) -> int:
        return len(self.allocators)

    def max_fit_tokens(self) -> int:
        """Largest reservation any node could ever hold."""
        return max(a.capacity_tokens for a in self.allocators)

    def enqueue(self, request: Request) -> None:
        self.waiting.append(request)
        self._live[request.request_id] = request

    def drop_waiting(self) -> None:
        """Forget every waiting request (they were ended elsewhere)."""
        for request in self.waiting:
            self._live.pop(request.request_id, None)
        self.waiting.clear()

    def has_work(self) -> bool:
        return bool(self.waiting) or any(self.running)

    def num_running(self) -> int:
        return sum(len(r) for r in self.running)

    def load(self, node: int) -> int:
        """KV load of ``node`` under the configured policy, in tokens."""
        reqs = self.running[node]
        if self.config.policy is LoadPolicy.RESERVED:
            return sum(r.reserved_tokens for r in reqs)
        return sum(len(r.prompt) + len(r.generated) for r in reqs)

    def _eligible(self, request: Request) -> List[int]:
        need = request.reserved_tokens
        return [
            n
            for n, alloc in enumerate(self.allocators)
            if self._free_slots[n] and alloc.can_allocate(need)
        ]

    def _admit(self, request: Request, node: int) -> Admission:
        slot = self._free_slots[node].popleft()
        blocks = self.allocators[node].allocate(request.reserved_tokens)
        request.admit(node, slot, blocks, self.clock())
        self.running[node].append(request)
        return Admission(
            request.request_id,
            node,
            slot,
            tuple(blocks),
            ingest_len=request.num_cached,  # KV arriving from outside
            synthetic_seed=request.synthetic_kv,
        )

    def schedule(self) -> ScheduleResult:
        """Admit what fits (FCFS), then return this step's batch: every running request
        with tokens still to schedule (one whose last token is in flight waits for
        its booking to leave ``running``)."""
        admitted, admissions = [], []
        budget = self.config.max_prefill_tokens
        while self.waiting:
            request = self.waiting[0]
            cost = len(request.pending_tokens())
            nodes = self._eligible(request)
            if not nodes:
                self._blocked = True
                break
            if admitted and cost > budget:
                break
            if self._blocked or self.waves == 0:
                self.waves += 1
                self._blocked = False
            node = min(nodes, key=lambda n: (self.load(n), n))
            self.waiting.popleft()
            admissions.append(self._admit(request, node))
            admitted.append(request)
            budget -= cost
        batch = tuple(r for reqs in self.running for r in reqs if r.needs_step())
        return ScheduleResult(tuple(admitted), tuple(admissions), batch)

    def finish(self, request: Request) -> None:
        """Release a completed request's blocks and slot."""
        node = request.owner
        self.running[node].remove(request)
        self.allocators[node].free(request.blocks)
        self._free_slots[node].append(request.slot)
        request.blocks = []
        self._live.pop(request.request_id, None)

    # ---------------------------------------------------------------- books
    def mark_in_flight(self, plan: StepPlan) -> None:
        """Record, per request of a queued step, its rows and its index in the step's tokens."""
        live = self._live
        cols = plan.per_request
        for i, (rid, rows) in enumerate(zip(cols.request_ids.tolist(), cols.q_lens.tolist())):
            req = live.get(rid)
            if req is not None:
                req.inflight_rows, req.inflight_index = rows, i

    def book_prompt_log_probs(self, plan: StepPlan, log_probs: StepLogProbs) -> None:
        """Book a prefill step's prompt log-probs (one per ``plan.prompt_rows`` row, in its
        order) to the requests that asked (``plan.prompt_requests``)."""
        ids = plan.per_request.request_ids.tolist()
        owners = plan.prompt_requests.tolist()
        start = 0
        for end in range(1, len(owners) + 1):  # rows come grouped by request
            if end == len(owners) or owners[end] != owners[start]:
                req = self._live.get(ids[owners[start]])
                if req is not None:
                    req.book_prompt_log_probs(log_probs.chosen[start:end],
                                              [log_probs.row(j)[1] for j in range(start, end)])
                start = end

    def postprocess(self, plan: StepPlan, tokens: Sequence[int],
                    logits: Optional[torch.Tensor], now: float,
                    log_probs: Optional[StepLogProbs] = None) -> List[int]:
        """Book a finished step: each request's sampled token (``tokens`` ``[R]`` in plan
        order; ``logits`` ``[R, vocab]`` if recorded; ``log_probs`` when the step computed
        them), and complete and release those that are done. Returns the ids that finished."""
        finished, live = [], self._live
        cols = plan.per_request
        for i, (rid, rows, token) in enumerate(zip(cols.request_ids.tolist(), cols.q_lens.tolist(), tokens)):
            req = live.get(rid)
            if req is None:  # ended (EOS or a stop sequence) one step earlier
                continue
            lp, top = (None, ()) if log_probs is None else log_probs.row(i)
            if req.book_token(token, rows, now, None if logits is None else logits[i], lp, top):
                req.complete(now)
                self.finish(req)
                finished.append(rid)
        return finished

    def kv_utilization(self) -> List[float]:
        """Per node: fraction of KV tokens currently cached."""
        return [
            sum(r.num_cached for r in self.running[n]) / max(1, a.capacity_tokens)
            for n, a in enumerate(self.allocators)
        ]

    def reserved_fraction(self) -> List[float]:
        """Per node: fraction of KV blocks reserved."""
        return [1 - a.num_free / max(1, a.num_blocks) for a in self.allocators]
