"""Whether a second weight copy pays: single-copy TKNP against dual active roots, predicted.

Dual-active-root microbatching (paper section 4.5; ``docs/ARCHITECTURE.md``, "Dual active
roots") stores two weight copies, each over half the nodes, so every node keeps less KV
and the same trace may need more admission waves; in exchange two microbatches run with
different active roots. :func:`choose_dual` predicts both sides' completion throughput on
a workload: KV tokens per node from the capacity model
(:func:`~tknp_megatron.analysis.simulator.kv_tokens_per_owner`) or from an explicit
per-node budget, the engine's own scheduler and two-microbatch plans in the pool simulator
(:func:`~tknp_megatron.analysis.simulator.simulate`), each step timed by the roofline on
the schedule :mod:`tknp_megatron.executor.dual_root` runs (``tknp-dual``; the paper's
``tknp-dual-paper`` on request). Both sides get the same implementation factor (none: no
dual-root run has been measured against its roofline), so the ratio is the roofline's.

The trace replays coarse-grained (``simulate``'s ``token_scale``, chosen here so that a
request's reservation is at least 256 simulated tokens and its output at least 8): the
waves and step times are the full trace's up to rounding, and a decision on 32K-128K
contexts takes well under a second on one CPU core. Deterministic: no clock, no GPU.

:func:`dual_policy` is what the tools do with it before any process starts: asked for
``tknp-dual``, they run single-copy ``tknp`` where dual does not pay and say so in one
line, unless forced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tknp_megatron.analysis import workload as wl
from tknp_megatron.analysis.costmodel import NodeBudget, budget_from_preset
from tknp_megatron.analysis.roofline import H200, Hardware
from tknp_megatron.analysis.simulator import Calibration, kv_tokens_per_owner, simulate
from tknp_megatron.config import ModelPreset
from tknp_megatron.mode import Mode
from tknp_megatron.placement import model_bytes

__all__ = ["DUAL_SCHEDULE", "DualChoice", "DualPolicy", "choose_dual", "choose_dual_at", "dual_policy",
           "gpu_budget"]

DUAL_SCHEDULE = "tknp-dual"  # the roofline's model of executor/dual_root.py's schedule
MIN_RESERVATION = 256  # simulated tokens per request reservation, at least (see token_scale)
MIN_OUTPUT = 8  # simulated decode steps per request, at least


@dataclass(frozen=True)
class DualChoice:
    """The prediction for one pool and workload, and what it implies.

    Attributes:
        dual: two weight copies are predicted to pay (dual over single above the threshold).
        nodes: N, the pool's nodes.
        schedule: the roofline's name of the dual step (``tknp-dual``: the executor's).
        single_tok_s: predicted completion throughput of single-copy TKNP (tok/s).
        dual_tok_s: the same with two copies (0.0 where two copies cannot run).
        single_kv_tokens_per_node: KV tokens a node holds with one copy.
        dual_kv_tokens_per_node: the same with two copies (0 where they cannot run).
        reason: one line: the capacity each side keeps and the predicted ratio.
    """

    dual: bool
    nodes: int
    schedule: str
    single_tok_s: float
    dual_tok_s: float
    single_kv_tokens_per_node: int
    dual_kv_tokens_per_node: int
    reason: str

    @property
    def runnable(self) -> bool:
        """Two copies can run here at all (an even node count, KV left beside them)."""
        return self.dual_kv_tokens_per_node > 0

    @property
    def ratio(self) -> float:
        """Predicted dual over single-copy completion throughput."""
        return self.dual_tok_s / self.single_tok_s if self.single_tok_s > 0 else 0.0


@dataclass(frozen=True)
class DualPolicy:
    """What runs when ``tknp-dual`` is asked for.

    Attributes:
        mode: the mode that runs (``tknp-dual``, or ``tknp`` where dual does not pay).
        forced: dual runs although the prediction says it does not pay.
        choice: the prediction.
        line: one line for the user saying which runs and why.
    """

    mode: Mode
    forced: bool
    choice: DualChoice
    line: str


def _tokens(n: int) -> str:
    """``693K`` for 693,112 tokens; small counts as they are."""
    return f"{n / 1000:.0f}K" if n >= 10_000 else str(n)


def _token_scale(workload: wl.Workload) -> int:
    """The largest power of two that keeps every reservation >= MIN_RESERVATION and every
    output >= MIN_OUTPUT simulated tokens (1 for short traces)."""
    longest = max(r.prompt_len + r.output_len for r in workload.requests)
    shortest_out = min(r.output_len for r in workload.requests)
    scale = 1
    while 2 * scale * MIN_RESERVATION <= longest and 2 * scale * MIN_OUTPUT <= shortest_out:
        scale *= 2
    return scale


def _no_dual(nodes: int, schedule: str, single_kv: int, why: str) -> DualChoice:
    return DualChoice(False, nodes, schedule, 0.0, 0.0, single_kv, 0, why)


def choose_dual(preset: ModelPreset, nodes: int, tp: int, workload: wl.Workload, *,
                kv_tokens_per_node: Optional[int] = None, budget: Optional[NodeBudget] = None,
                hw: Hardware = H200, weight_elem: float = 2.0, schedule: str = DUAL_SCHEDULE,
                block_size: int = 16, max_requests_per_node: int = 256,
                threshold: float = 1.0) -> DualChoice:
    """Single copy or two on ``nodes`` x ``tp`` GPUs serving ``workload``.

    Give exactly one of ``kv_tokens_per_node`` (an explicit per-node budget, as
    ``EngineConfig.kv_tokens_per_node`` sets it: both copy counts get it, so only the
    schedule differs) or ``budget`` (the node's memory, :func:`gpu_budget`: two copies
    leave less KV per node, as the engine sizes it from free memory). ``weight_elem`` is
    bytes per linear weight (1: FP8-stored). Dual pays where its predicted throughput
    exceeds ``threshold`` times the single copy's.
    """
    if (kv_tokens_per_node is None) == (budget is None):
        raise ValueError("give exactly one of kv_tokens_per_node and budget")
    if kv_tokens_per_node is not None:
        single_kv = dual_kv = kv_tokens_per_node
    else:
        single_kv = kv_tokens_per_owner(Mode.TKNP, preset, nodes, budget)
        dual_kv = kv_tokens_per_owner(Mode.TKNP_DUAL, preset, nodes, budget) if nodes % 2 == 0 else 0
    if nodes < 2 or nodes % 2:
        return _no_dual(nodes, schedule, single_kv,
                        f"dual active roots need an even number of nodes (two copies over halves), got {nodes}")
    if dual_kv < block_size:
        return _no_dual(nodes, schedule, single_kv,
                        f"two weight copies leave no KV cache on {nodes} nodes (one copy: "
                        f"{_tokens(single_kv)} KV tokens per node)")
    longest = max(r.prompt_len + r.output_len for r in workload.requests)
    if dual_kv < longest <= single_kv:
        return DualChoice(False, nodes, schedule, 0.0, 0.0, single_kv, dual_kv,
                          f"dual copy leaves {_tokens(dual_kv)} KV tokens per node, less than the "
                          f"longest request's {_tokens(longest)} (one copy: {_tokens(single_kv)})")
    scale = _token_scale(workload)

    def tok_s(mode: Mode, kv: int, sched: Optional[str]) -> float:
        run = simulate(mode, preset, nodes * tp, tp, workload, kv, block_size=block_size,
                       max_requests_per_node=max_requests_per_node, hw=hw, calibration=Calibration(),
                       weight_elem=weight_elem, schedule=sched, token_scale=scale)
        return run.completion_throughput_tok_s

    single = tok_s(Mode.TKNP, single_kv, None)
    dual = tok_s(Mode.TKNP_DUAL, dual_kv, schedule)
    ratio = dual / single if single > 0 else 0.0
    where = ("" if schedule == DUAL_SCHEDULE else f" on the {schedule} schedule")
    if kv_tokens_per_node is not None:
        kv = f"both copy counts hold {_tokens(single_kv)} KV tokens per node (an explicit budget)"
    else:
        kv = f"dual copy leaves {_tokens(dual_kv)} KV tokens per node against {_tokens(single_kv)}"
    reason = f"{kv}; predicted {ratio:.2f}x single copy{where}"
    return DualChoice(ratio > threshold, nodes, schedule, single, dual, single_kv, dual_kv, reason)


def choose_dual_at(preset: ModelPreset, nodes: int, tp: int, context: int, batch: int,
                   output_len: int = 1024, **kw) -> DualChoice:
    """:func:`choose_dual` on ``batch`` requests of ``context`` prompt tokens and
    ``output_len`` output tokens, all arriving at once (the paper's offered batch)."""
    return choose_dual(preset, nodes, tp, wl.fixed_length(batch, context, output_len), **kw)


def gpu_budget(preset: ModelPreset, tp: int, gpu_memory_gib: float, mem_util: float = 0.9,
               fp8: bool = False) -> NodeBudget:
    """A node of ``tp`` GPUs that each offer ``gpu_memory_gib * mem_util`` for weights and
    KV, one weight copy stored in BF16 (its four GEMM weights in FP8 with ``fp8``)."""
    weights = model_bytes(preset, linear_bytes=1 if fp8 else 2, other_bytes=2)
    return budget_from_preset(preset, tp, gpu_memory_gib, mem_util, weights=weights)


def dual_policy(choice: DualChoice, force: bool = False, force_flag: str = "--force-dual") -> DualPolicy:
    """The mode to run when ``tknp-dual`` is asked for: dual where ``choice`` says it pays or
    ``force`` is set (``force_flag`` names how the user forces it), else single-copy
    ``tknp``; with the line that says so. Forcing two copies where they cannot run at
    all raises ValueError (one line)."""
    if force and not choice.runnable:
        raise ValueError(f"{force_flag}: {choice.reason}")
    if choice.dual:
        return DualPolicy(Mode.TKNP_DUAL, False, choice, f"tknp-dual runs two weight copies: {choice.reason}")
    if force:
        return DualPolicy(Mode.TKNP_DUAL, True, choice,
                          f"tknp-dual runs two weight copies ({force_flag}), though {choice.reason}")
    return DualPolicy(Mode.TKNP, False, choice,
                      f"tknp-dual runs as single-copy tknp: {choice.reason} ({force_flag} runs two copies)")
