"""Per-phase time of a step on one rank (benchmarks only; off on the serving path).

The executor calls :meth:`PhaseTimer.mark` after each phase of each layer, in the code
where the phase happens. On CUDA the marks are events (no host sync until
:meth:`PhaseTimer.summary`); on CPU they are wall-clock reads.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Deque, List, Tuple

import torch

__all__ = ["PHASES", "LoopTiming", "PhaseTimes", "PhaseTimer"]

HOST_STEPS_KEPT = 4096  # LoopTiming: steps whose host work the median is taken over

PHASES = ("root_qkv", "scatter", "attention", "gather", "root_proj_mlp", "handoff")


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds spent in each phase, summed over a step's layers, on one rank."""

    root_qkv: float = 0.0
    scatter: float = 0.0
    attention: float = 0.0
    gather: float = 0.0
    root_proj_mlp: float = 0.0
    handoff: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def __add__(self, other: "PhaseTimes") -> "PhaseTimes":
        return PhaseTimes(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


class PhaseTimer:
    """Collects marks for one step; create, :meth:`start`, run the step, :meth:`summary`."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: List[Tuple[str, object]] = []

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [("start", self._now())]

    def mark(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        self._marks.append((phase, self._now()))

    def summary(self) -> PhaseTimes:
        """Per-phase totals (synchronises the device once)."""
        if self.cuda:
            torch.cuda.synchronize()
        totals = dict.fromkeys(PHASES, 0.0)
        for (_, a), (phase, b) in zip(self._marks, self._marks[1:]):
            totals[phase] += (a.elapsed_time(b) / 1e3) if self.cuda else (b - a)
        return PhaseTimes(**totals)


@dataclass
class LoopTiming:
    """Where one rank's serving loop spends its wall time (always on: two clock reads).

    ``host_s`` is time the rank's host works on steps (planning, broadcasting, preparing
    inputs, launching, booking); ``wait_s`` is time it waits: the coordinator for a
    step's tokens (the GPU), the other ranks for the next plan (the coordinator). A rank
    whose ``host_s`` per step is near the step period is host-bound. The mean includes the
    steps that admit requests (sending or receiving their prompts' KV); the median of
    :attr:`host_steps` (the last ``HOST_STEPS_KEPT`` steps, so a server's record stays
    bounded) is a decode step's host work.
    """

    steps: int = 0
    host_s: float = 0.0
    wait_s: float = 0.0
    host_steps: Deque[float] = field(default_factory=lambda: deque(maxlen=HOST_STEPS_KEPT))  # seconds

    def add(self, host_s: float, wait_s: float = 0.0) -> None:
        """Book one step: its host work and its waiting (seconds)."""
        self.steps += 1
        self.host_s += host_s
        self.wait_s += wait_s
        self.host_steps.append(host_s)

    def clear(self) -> None:
        self.steps, self.host_s, self.wait_s = 0, 0.0, 0.0
        self.host_steps.clear()

    def per_step_ms(self) -> Tuple[float, float]:
        """``(host, wait)`` milliseconds per step."""
        n = max(1, self.steps)
        return 1e3 * self.host_s / n, 1e3 * self.wait_s / n

    def host_median_ms(self) -> float:
        """Median host work of one step (ms); 0 before any step."""
        return 1e3 * statistics.median(self.host_steps) if self.host_steps else 0.0
