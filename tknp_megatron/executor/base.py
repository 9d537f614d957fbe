"""The contract between an engine and the executor that runs its steps on one rank.

Every mode's executor (:class:`~tknp_megatron.executor.tknp.TKNPExecutor`,
:class:`~tknp_megatron.executor.dual_root.DualRootExecutor`,
:class:`~tknp_megatron.baselines.pp.PPExecutor`,
:class:`~tknp_megatron.baselines.dcp.DCPExecutor`) implements :class:`Executor`. The
engine decides (scheduling, booking); the executor only writes block tables, ingests KV
and runs plans. Admissions share one implementation, :mod:`tknp_megatron.executor.ingest`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, runtime_checkable

import torch

from tknp_megatron.plan import Admission, StepPlan
from tknp_megatron.profiler import PhaseTimer

__all__ = ["Executor", "StepOutput"]


@dataclass(frozen=True)
class StepOutput:
    """Sampled tokens ``[R]`` (batch order) and, if recorded, logits ``[R, vocab]``.

    When the plan asks for log-probs (``plan.log_probs_top_n >= 0``, K of them):
    ``log_probs`` ``[R]`` float32 (each token's log-prob), ``top_log_probs`` ``[R, K]``
    float32 and ``top_ids`` ``[R, K]`` int64, computed where the logits are (the last root).
    When it names prompt rows (``plan.prompt_rows``, P of them), ``prompt_log_probs``
    ``[P, 1 + 2 K]`` float32: each row's prompt token's log-prob, its top values and ids,
    packed (:func:`~tknp_megatron.sampling.unpack_log_probs` unpacks them).
    """

    tokens: torch.Tensor
    logits: Optional[torch.Tensor] = None
    log_probs: Optional[torch.Tensor] = None
    top_log_probs: Optional[torch.Tensor] = None
    top_ids: Optional[torch.Tensor] = None
    prompt_log_probs: Optional[torch.Tensor] = None


@runtime_checkable
class Executor(Protocol):
    """What an engine drives on every rank of a pool (its KV cache, a
    :class:`~tknp_megatron.kv_cache.PagedKVCache`, is built with it and handed to the
    engine beside it)."""

    def apply_admissions(self, admissions: Sequence[Admission]) -> None:
        """Write the block-table rows of the requests this rank stores KV for, and their
        ingested prompt KV ``[layers, 2, ingest_len, local KV heads, head_dim]`` (the
        rank's layers, positions and heads of it; synthetic, or received from the
        coordinator). :meth:`execute` calls it first; callable alone for tools."""
        ...

    def execute(self, plan: StepPlan, timer: Optional[PhaseTimer] = None) -> Optional[StepOutput]:
        """Run this rank's part of ``plan`` (admissions first).

        Returns the step's tokens ``[R]`` and, if ``plan.record_logits``, its logits
        ``[R, vocab]`` (fp32) on every rank where the step ends: every rank for TKNP, DP,
        TP and DCP; a pipeline's last stage for PP (None on the other stages). Nothing
        waits for the GPU: the tokens may still be in flight when it returns. ``timer``
        marks per-phase times where the executor supports it.
        """
        ...

    def enable_cuda_graphs(self, max_requests_per_owner: int = 0) -> None:
        """Replay pure-decode steps from CUDA graphs from now on, or raise ValueError
        naming the fix where the mode runs eagerly. With ``max_requests_per_owner`` the
        executor may capture every batch bucket up to it now (collective: every rank of
        the pool calls it), so no step captures while requests wait."""
        ...
