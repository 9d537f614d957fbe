"""One request's whole life: its tokens, ownership, blocks, status and timeline.

A request is created waiting (or rejected at once, :meth:`Request.reject`); the scheduler
admits it to an owner (:meth:`Request.admit`), books one generated token per step it ran
in (:meth:`Request.book_token`) and completes it (:meth:`Request.complete`) once
:meth:`Request.finished`. Each transition stamps the request's :class:`RequestTimeline`,
from which :mod:`tknp_megatron.analysis.metrics` derives the serving metrics.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from tknp_megatron.sampling import SamplingParams

__all__ = ["Request", "RequestStatus", "RequestTimeline"]


class RequestStatus(str, enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    COMPLETED = "completed"
    REJECTED = "rejected"


@dataclass(slots=True)
class RequestTimeline:
    """What happened to one request, in seconds on the engine's clock."""

    release: float
    """When the request arrived (became eligible for scheduling)."""
    first_scheduled: Optional[float] = None
    """When it was first placed on a node (admitted to a batch)."""
    first_token: Optional[float] = None
    """When its first generated token was available."""
    token_times: list[float] = field(default_factory=list)
    """When each generated token was available, the first included."""
    completion: Optional[float] = None
    """When it finished (last token or EOS)."""
    output_tokens: int = 0
    """Generated tokens so far."""
    status: RequestStatus = RequestStatus.WAITING
    reject_reason: Optional[str] = None
    """Why it was rejected (``status == REJECTED``), e.g. an invalid max_new_tokens."""

    def mark_scheduled(self, now: float) -> None:
        """Record admission; later calls (re-batching) keep the first time."""
        if self.first_scheduled is None:
            self.first_scheduled = now
        self.status = RequestStatus.RUNNING

    def record_token(self, now: float) -> None:
        """Record one generated token; ``output_tokens`` follows ``len(token_times)``."""
        if self.first_token is None:
            self.first_token = now
        self.token_times.append(now)
        self.output_tokens = len(self.token_times)

    def complete(self, now: float) -> None:
        """Mark the request finished at ``now``."""
        self.completion = now
        self.status = RequestStatus.COMPLETED

    def reject(self, reason: str) -> None:
        """Mark the request rejected, never to be scheduled."""
        self.status = RequestStatus.REJECTED
        self.reject_reason = reason

    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive tokens, after the first: ``len(token_times) - 1`` values."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass(eq=False)
class Request:
    """A submitted request.

    Attributes:
        request_id: engine-assigned id (submission order).
        prompt: prompt token ids.
        params: sampling parameters.
        timeline: timestamps and status (:class:`RequestTimeline`).
        kv: optional KV computed elsewhere for ``prompt[:-1]``,
            ``[layers, 2, len(prompt) - 1, num_kv_heads, head_dim]`` (disaggregated prefill).
        synthetic_kv: KV for ``prompt[:-1]`` is generated on the owner from this seed
            (benchmarks: same values in every mode, no prefill cost).
        owner: node that owns the request's KV cache (-1 while waiting).
        slot: the owner's block-table row.
        blocks: KV blocks reserved on the owner.
        generated: generated token ids.
        num_cached: tokens whose KV is already in the owner's cache.
        inflight_rows: rows of the request's step that is running but not yet booked
            (0: none); its KV then covers ``num_cached + inflight_rows`` tokens.
        inflight_index: the request's row in that step's sampled tokens.
        microbatch: its microbatch under dual-active-root or PP execution (fixed at admission).
        logits: per generated token, the full-vocabulary logits (only if recorded).
        log_probs: per generated token, its log-prob (``params.return_log_probs``).
        top_log_probs: per generated token, ``params.top_n_logprobs`` ``(id, log-prob)``
            pairs, most likely first.
        prompt_log_probs: per prompt token after the first, its log-prob given the tokens
            before it (``params.return_prompt_log_probs``), from the prompt's prefill step.
        prompt_top_log_probs: per such position, the top ``(id, log-prob)`` pairs.
    """

    request_id: int
    prompt: List[int]
    params: SamplingParams
    timeline: RequestTimeline
    kv: Optional[torch.Tensor] = None
    synthetic_kv: Optional[int] = None
    owner: int = -1
    slot: int = -1
    blocks: List[int] = field(default_factory=list)
    generated: List[int] = field(default_factory=list)
    num_cached: int = 0
    inflight_rows: int = 0
    inflight_index: int = -1
    microbatch: int = 0
    logits: List[torch.Tensor] = field(default_factory=list)
    log_probs: List[float] = field(default_factory=list)
    top_log_probs: List[Tuple[Tuple[int, float], ...]] = field(default_factory=list)
    prompt_log_probs: List[float] = field(default_factory=list)
    prompt_top_log_probs: List[Tuple[Tuple[int, float], ...]] = field(default_factory=list)

    @property
    def status(self) -> RequestStatus:
        return self.timeline.status

    @property
    def reserved_tokens(self) -> int:
        """KV tokens reserved at admission: prompt + max new tokens (the paper's rule)."""
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def ingested(self) -> bool:
        return self.kv is not None or self.synthetic_kv is not None

    # ---------------------------------------------------------------- transitions
    def reject(self, reason: str) -> None:
        """Never to be scheduled, because of ``reason`` (naming the request and the limit)."""
        self.timeline.reject(reason)

    def admit(self, owner: int, slot: int, blocks: List[int], now: float) -> None:
        """Placed on ``owner`` in block-table row ``slot`` with ``blocks`` reserved; KV that
        arrives from outside (``prompt[:-1]``) counts as cached from now on."""
        self.owner, self.slot, self.blocks = owner, slot, blocks
        self.num_cached = len(self.prompt) - 1 if self.ingested else 0
        self.timeline.mark_scheduled(now)

    def book_token(self, token: int, rows: int, now: float,
                   logits: Optional[torch.Tensor] = None, log_prob: Optional[float] = None,
                   top: Sequence[Tuple[int, float]] = ()) -> bool:
        """A step's result: its ``rows`` fed tokens are cached and ``token`` was generated
        (``logits`` ``[vocab]``, if recorded, are kept on the host; ``log_prob`` and the
        ``top`` ``(id, log-prob)`` pairs are kept when the request asked for them). Returns
        :meth:`finished` (answered from ``token`` itself where it can: the scheduler books
        every running request every step)."""
        self.inflight_rows = 0
        self.num_cached += rows
        gen, p = self.generated, self.params
        gen.append(token)
        if logits is not None:
            self.logits.append(logits.cpu())
        if p.return_log_probs and log_prob is not None:
            self.log_probs.append(log_prob)
            self.top_log_probs.append(tuple(top[: p.top_n_logprobs]))
        self.timeline.record_token(now)
        return len(gen) >= p.max_new_tokens or token == p.eos_id or (
            bool(p.stop_sequences) and self.finish_reason() is not None)

    def book_prompt_log_probs(self, log_probs: Sequence[float],
                              tops: Sequence[Sequence[Tuple[int, float]]]) -> None:
        """The prompt's log-probs from its prefill step (:meth:`prompt_log_prob_positions`'
        order), with each position's top ``(id, log-prob)`` pairs."""
        n = self.params.top_n_logprobs
        self.prompt_log_probs.extend(log_probs)
        self.prompt_top_log_probs.extend(tuple(top[:n]) for top in tops)

    def prompt_log_prob_positions(self) -> int:
        """How many of this step's fed rows, from its first, give a prompt token's log-prob:
        ``len(prompt) - 1`` in the step that prefills the whole prompt, when asked for
        (each row's logits give the next prompt token's), else 0."""
        if not self.params.return_prompt_log_probs or self.num_cached or self.inflight_rows:
            return 0
        return len(self.prompt) - 1

    def complete(self, now: float) -> None:
        """Done (:meth:`finished`); the scheduler releases its blocks."""
        self.timeline.complete(now)

    # ---------------------------------------------------------------- queries
    def pending_tokens(self) -> List[int]:
        """Tokens to feed this step: every token whose KV is not cached yet.

        Built without copying the prompt once it is cached (a decode step of a 128K-token
        request must not touch its prompt on the host).
        """
        cached, prompt_len = self.num_cached, len(self.prompt)
        if cached >= prompt_len:
            return self.generated[cached - prompt_len :]
        return self.prompt[cached:] + self.generated

    def needs_step(self) -> bool:
        """Tokens remain to be scheduled (the in-flight one counted as generated)."""
        return len(self.generated) + (self.inflight_rows > 0) < self.params.max_new_tokens

    def finished(self) -> bool:
        """Reached max new tokens, produced the end-of-sequence id or ended with a stop
        sequence."""
        return self.finish_reason() is not None

    def finish_reason(self) -> Optional[str]:
        """``"length"``, ``"eos"`` or ``"stop"`` once :meth:`finished`, else None."""
        gen, p = self.generated, self.params
        if len(gen) >= p.max_new_tokens:
            return "length"
        if p.eos_id is not None and gen and gen[-1] == p.eos_id:
            return "eos"
        for seq in p.stop_sequences:
            if len(gen) >= len(seq) and tuple(gen[-len(seq):]) == seq:
                return "stop"
        return None
