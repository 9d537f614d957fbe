"""Prompt tokens' log-probs, read from the logits of the step that prefills the prompt.

A request with ``SamplingParams.return_prompt_log_probs`` is prefilled in one step whose
rows are its prompt; the logits of row ``j`` give the log-prob of prompt token ``j + 1``
(Megatron's ``prompt_log_probs``; lm-eval's log-likelihoods ask for them through an HTTP
completion with ``echo``). The plan names those rows (``StepPlan.prompt_rows``) and their
tokens; the rank holding the step's last hidden state computes, per row, the token's
log-prob under the unscaled distribution and the top ``top_n`` tokens, as
:func:`~tknp_megatron.sampling.token_log_probs` does for sampled tokens.

Only prefill steps carry such rows, so this runs eagerly (CUDA graphs replay pure decode
steps). The rows' logits are made a slice at a time: a long prompt's full
``[rows, vocab]`` float32 logits would be gigabytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tknp_megatron.executor.dense import vocab_logits
from tknp_megatron.plan import StepPlan
from tknp_megatron.sampling import pack_log_probs, token_log_probs

__all__ = ["PromptRows", "prompt_log_probs"]

ROWS_PER_SLICE = 1024
"""Rows whose logits exist at once: 1024 x a 128K vocabulary in float32 is 0.5 GiB."""


@dataclass(frozen=True)
class PromptRows:
    """A step's rows that give prompt log-probs, on the device.

    Attributes:
        rows: ``[P]`` rows of the step (batch order).
        targets: ``[P]`` the prompt token each row's logits are read at.
    """

    rows: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def of(cls, plan: StepPlan, device: torch.device) -> Optional["PromptRows"]:
        """``plan``'s prompt rows on ``device``, or None when it has none."""
        if plan.prompt_rows is None:
            return None
        return cls(plan.prompt_rows.to(device, non_blocking=True), plan.prompt_targets.to(device, non_blocking=True))

    @property
    def count(self) -> int:
        return int(self.rows.shape[0])


@torch.no_grad()
def prompt_log_probs(model, hidden: torch.Tensor, prompt: PromptRows, top_n: int, tp_group, tp_size: int,
                     vocab: int) -> torch.Tensor:
    """The rows' log-probs packed as :func:`~tknp_megatron.sampling.pack_log_probs` packs
    them: ``[P, 1 + 2 top_n]`` float32 (the target's log-prob, the top values, the top ids).

    ``hidden`` ``[rows, 1, D]`` is the step's last hidden state (the final norm not yet
    applied); every TP rank of the model calls this (the logits' all-gather).
    """
    out = torch.empty(prompt.count, 1 + 2 * top_n, dtype=torch.float32, device=hidden.device)
    for lo in range(0, prompt.count, ROWS_PER_SLICE):
        hi = min(lo + ROWS_PER_SLICE, prompt.count)
        logits = vocab_logits(model, hidden, prompt.rows[lo:hi], tp_group, tp_size, vocab)
        pack_log_probs(*token_log_probs(logits, prompt.targets[lo:hi], top_n), out=out[lo:hi])
    return out
