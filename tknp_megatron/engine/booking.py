"""The coordinator's books: what a finished step's tokens do to its requests.

A step is booked after the next one is queued (see :mod:`tknp_megatron.engine.engine`), so a
request that ended on EOS may still have a row in the step being booked: that row is
dropped.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from tknp_megatron.analysis.metrics import RequestStatus
from tknp_megatron.engine.request import Request
from tknp_megatron.plan import StepPlan

__all__ = ["book_step", "kv_tokens_per_node", "mark_in_flight"]


def book_step(
    plan: StepPlan,
    tokens: Sequence[int],
    logits: Optional[torch.Tensor],
    requests: Dict[int, Request],
    scheduler,
    now: float,
) -> List[int]:
    """Append each request's sampled token (``tokens`` ``[R]`` in plan order; ``logits``
    ``[R, vocab]`` if recorded), stamp its timeline, and finish those that are done
    (their blocks go back to ``scheduler``). Returns the ids that finished."""
    finished = []
    for i, (rid, q_len) in enumerate(zip(plan.request_ids.tolist(), plan.q_lens.tolist())):
        req = requests[rid]
        req.inflight_rows = 0
        if req.status is RequestStatus.COMPLETED:  # ended by EOS one step earlier
            continue
        req.num_cached += q_len
        req.generated.append(tokens[i])
        if logits is not None:
            req.logits.append(logits[i].cpu())
        tl = req.timeline
        tl.first_token = now if tl.first_token is None else tl.first_token
        tl.token_times.append(now)
        tl.output_tokens = len(req.generated)
        if req.finished():
            tl.completion = now
            tl.status = RequestStatus.COMPLETED
            scheduler.finish(req)
            finished.append(rid)
        else:
            tl.status = RequestStatus.RUNNING
    return finished


def mark_in_flight(plan: StepPlan, requests: Dict[int, Request]) -> None:
    """Record, per request of a queued step, its rows and its index in the step's tokens."""
    for i, (rid, q_len) in enumerate(zip(plan.request_ids.tolist(), plan.q_lens.tolist())):
        req = requests[rid]
        req.inflight_rows, req.inflight_index = q_len, i


def kv_tokens_per_node(plan: StepPlan, num_nodes: int) -> List[int]:
    """KV tokens each node holds for the step's requests (this step's included)."""
    used = [0] * num_nodes
    for part in plan.microbatches or (plan,):
        cached = (part.start_pos + part.q_lens).tolist()
        for node in range(num_nodes):
            lo, hi = part.request_range(node)
            used[node] += sum(cached[lo:hi])
    return used
