"""One request as the coordinator tracks it: tokens, ownership, blocks and timeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from tknp_megatron.analysis.metrics import RequestStatus, RequestTimeline
from tknp_megatron.sampling import SamplingParams

__all__ = ["Request"]


@dataclass(eq=False)
class Request:
    """A submitted request.

    Attributes:
        request_id: engine-assigned id (submission order).
        prompt: prompt token ids.
        params: sampling parameters.
        timeline: timestamps and final status (see :mod:`tknp_megatron.analysis.metrics`).
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
        microbatch: its microbatch under dual-active-root execution (fixed at admission).
        logits: per generated token, the full-vocabulary logits (only if recorded).
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
        """Reached max new tokens or produced the end-of-sequence id."""
        if len(self.generated) >= self.params.max_new_tokens:
            return True
        eos = self.params.eos_id
        return eos is not None and bool(self.generated) and self.generated[-1] == eos
