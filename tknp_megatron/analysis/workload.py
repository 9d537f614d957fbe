"""Benchmark workloads: request lengths and arrival times, deterministic from a seed.

A :class:`Workload` is a trace, not a run: every parallel mode (TKNP, DP, TP, PP, DCP)
replays the same trace, so the same seed gives the same requests, lengths, arrival
times and prompt tokens everywhere (paper section 5.1).

* :func:`fixed_length`: the RULER-style sweep, ``batch`` distinct requests of one
  input and output length, all released at t = 0.
* :func:`mixed_length`: the L-Eval / LongBench mix, prompt lengths drawn from a
  piecewise-linear quantile function fitted to the paper's statistics (range 8,223 to
  126,848, mean 32,898, median 19,048, std 28,496; 12.5% of requests above 64K holding
  36.1% of input tokens; top 25% holding 57.2%). ``scale`` shrinks every length by the
  same factor so a smaller machine sees the same capacity regime.
* :func:`with_poisson_arrivals` / :func:`as_burst`: the two arrival processes.
* :func:`prompt_tokens`: random token ids for one request, no prefix shared with any
  other request (prefix caching cannot help any mode).

Random draws use ``numpy.random.Generator`` (PCG64) and ``torch.Generator``; the trace
is bit-identical for a given seed within one installation, which is what a side-by-side
comparison of modes needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = [
    "WorkloadRequest",
    "Workload",
    "MixedLengthStats",
    "MIXED_QUANTILES",
    "PAPER_MIXED_STATS",
    "fixed_length",
    "mixed_length",
    "mixed_length_stats",
    "with_poisson_arrivals",
    "as_burst",
    "prompt_tokens",
]

LONG_PROMPT_TOKENS = 65_536
"""The paper's "64K" threshold, before scaling."""

MIXED_QUANTILES: Tuple[Tuple[float, int], ...] = (
    (0.0, 8_223), (0.05, 9_021), (0.125, 10_272), (0.25, 12_431), (0.375, 14_938),
    (0.5, 19_048), (0.625, 28_895), (0.75, 45_917), (0.8125, 55_325),
    (0.875, 65_536), (0.9375, 93_819), (1.0, 126_848),
)
"""``(u, Q(u))`` knots of the mixed-length quantile function; Q is linear in between.

Q(0), Q(0.5), Q(1) are the paper's min, median and max, Q(0.875) = 64K (12.5% above);
the other knots were fitted (least squares on log Q, with a smoothness penalty) so the
exact moments of Q give mean 32,898, std 28,496, 36.1% of tokens above 64K and 57.2%
in the top quarter."""


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a trace; lengths in tokens, arrival in seconds from release."""

    request_id: int
    prompt_len: int
    output_len: int
    """Tokens to generate; every request generates exactly this many (no EOS)."""
    arrival_s: float

    def __post_init__(self) -> None:
        if self.request_id < 0:
            raise ValueError(f"request_id must be >= 0, got {self.request_id}")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"request {self.request_id}: prompt_len and output_len must be "
                             f">= 1, got {self.prompt_len}, {self.output_len}")
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"request {self.request_id}: arrival_s must be finite and >= 0, "
                             f"got {self.arrival_s}")

    @property
    def total_len(self) -> int:
        """Prompt + output: the KV tokens the request reserves at admission."""
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class Workload:
    """A named trace of requests, in request-id order (ids 0..n-1)."""

    name: str
    requests: Tuple[WorkloadRequest, ...]
    seed: int
    scale: float = 1.0
    """Factor applied to the lengths of a scaled generator (1.0 = paper lengths)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", tuple(self.requests))
        ids = [r.request_id for r in self.requests]
        if ids != list(range(len(ids))):
            raise ValueError(f"workload {self.name!r}: request ids must be 0..n-1 in order")
        if not self.scale > 0:
            raise ValueError(f"workload {self.name!r}: scale must be > 0, got {self.scale}")

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return iter(self.requests)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def prompt_lens(self) -> Tuple[int, ...]:
        return tuple(r.prompt_len for r in self.requests)

    @property
    def total_input_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def max_total_len(self) -> int:
        """Longest prompt + output: what one request may need to fit on one node."""
        return max((r.total_len for r in self.requests), default=0)

    @property
    def duration_s(self) -> float:
        """Last arrival time (0 for a burst)."""
        return max((r.arrival_s for r in self.requests), default=0.0)

    @property
    def is_burst(self) -> bool:
        return all(r.arrival_s == 0.0 for r in self.requests)

    def in_arrival_order(self) -> Tuple[WorkloadRequest, ...]:
        """Requests sorted by (arrival, id): the order a driver submits them."""
        return tuple(sorted(self.requests, key=lambda r: (r.arrival_s, r.request_id)))


def _requests(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> Tuple[WorkloadRequest, ...]:
    return tuple(WorkloadRequest(i, int(p), int(o), 0.0)
                 for i, (p, o) in enumerate(zip(prompt_lens, output_lens)))


def fixed_length(batch: int, input_len: int, output_len: int, seed: int = 0) -> Workload:
    """``batch`` distinct requests of ``input_len`` prompt and ``output_len`` output tokens.

    All arrive at t = 0 (the offered batch of Figures 8 and 9). Requests differ only in
    their prompt tokens (:func:`prompt_tokens` with ``seed``).
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    name = f"fixed-b{batch}-isl{input_len}-osl{output_len}"
    return Workload(name, _requests([input_len] * batch, [output_len] * batch), seed)


def _quantile(u: np.ndarray) -> np.ndarray:
    knots = np.array([k for k, _ in MIXED_QUANTILES])
    values = np.array([v for _, v in MIXED_QUANTILES], dtype=np.float64)
    return np.interp(u, knots, values)


def mixed_length(num_requests: int, seed: int = 0, scale: float = 1.0,
                 output_len: Optional[int] = None) -> Workload:
    """The paper's mixed-length workload: ``num_requests`` prompts from :data:`MIXED_QUANTILES`.

    Draws are stratified (one uniform in each of ``num_requests`` equal slices of
    [0, 1), then shuffled), so even a small trace follows the target distribution:
    with a multiple of 8 requests, 1/8 of them are above 64K. ``scale`` multiplies every
    prompt length (rounded, at least 1) and, when ``output_len`` is None, the default
    1,024 output tokens too, so the KV demand keeps its shape on a smaller machine.
    Arrivals are all 0; use :func:`with_poisson_arrivals` for online serving.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if output_len is None:
        output_len = max(1, round(1024 * scale))
    rng = np.random.default_rng([seed, 0x6D6978])  # stream distinct from the arrival draws
    u = (np.arange(num_requests) + rng.random(num_requests)) / num_requests
    lens = np.maximum(1, np.rint(_quantile(u[rng.permutation(num_requests)]) * scale))
    name = f"mixed-n{num_requests}" + ("" if scale == 1.0 else f"-x{scale:g}")
    return Workload(name, _requests(lens.astype(np.int64).tolist(), [output_len] * num_requests),
                    seed, scale)


@dataclass(frozen=True)
class MixedLengthStats:
    """Prompt-length statistics of a trace, as the paper reports them (section 5.1)."""

    min: float
    max: float
    mean: float
    median: float
    std: float
    """Population standard deviation."""
    frac_above_64k_scaled: float
    """Fraction of requests with prompt_len > 65,536 * scale."""
    token_share_above_64k: float
    """Their share of all input tokens."""
    token_share_top25: float
    """Share of input tokens held by the longest 25% of requests."""

    def scaled(self, factor: float) -> "MixedLengthStats":
        """Length fields multiplied by ``factor`` (fractions unchanged)."""
        return replace(self, min=self.min * factor, max=self.max * factor,
                       mean=self.mean * factor, median=self.median * factor,
                       std=self.std * factor)


PAPER_MIXED_STATS = MixedLengthStats(
    min=8_223, max=126_848, mean=32_898, median=19_048, std=28_496,
    frac_above_64k_scaled=0.125, token_share_above_64k=0.361, token_share_top25=0.572)
"""The statistics the paper reports for its mixed-length workload."""


def mixed_length_stats(workload: Workload, scale: Optional[float] = None) -> MixedLengthStats:
    """Statistics of ``workload``'s prompt lengths; the 64K threshold is scaled by
    ``scale`` (default: ``workload.scale``). Compare with ``PAPER_MIXED_STATS.scaled(scale)``."""
    if not workload.requests:
        raise ValueError("mixed_length_stats needs at least one request")
    scale = workload.scale if scale is None else scale
    x = np.sort(np.array(workload.prompt_lens, dtype=np.float64))
    total = x.sum()
    long = x > LONG_PROMPT_TOKENS * scale
    top = x[len(x) - int(math.ceil(0.25 * len(x))):]
    return MixedLengthStats(
        min=float(x[0]), max=float(x[-1]), mean=float(x.mean()), median=float(np.median(x)),
        std=float(x.std()), frac_above_64k_scaled=float(long.mean()),
        token_share_above_64k=float(x[long].sum() / total),
        token_share_top25=float(top.sum() / total))


def with_poisson_arrivals(workload: Workload, rate_per_s: float, seed: int) -> Workload:
    """The same requests arriving as a Poisson process of ``rate_per_s`` requests/s.

    Request 0 arrives at t = 0; the gaps after it are exponential with mean
    ``1 / rate_per_s``, assigned in request-id order. ``rate_per_s = inf`` is a burst.
    """
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    if math.isinf(rate_per_s):
        return as_burst(workload)
    n = len(workload)
    rng = np.random.default_rng([seed, 0x617272])
    gaps = rng.exponential(1.0 / rate_per_s, size=max(n - 1, 0))
    arrivals = np.concatenate([[0.0], np.cumsum(gaps)])
    reqs = tuple(replace(r, arrival_s=float(t)) for r, t in zip(workload.requests, arrivals))
    return replace(workload, name=f"{_base_name(workload)}@poisson{rate_per_s:g}", requests=reqs)


def as_burst(workload: Workload) -> Workload:
    """The same requests, all arriving at t = 0 (a synchronized burst)."""
    reqs = tuple(replace(r, arrival_s=0.0) for r in workload.requests)
    return replace(workload, name=f"{_base_name(workload)}@burst", requests=reqs)


def _base_name(workload: Workload) -> str:
    """The name without its arrival-process suffix ("@poisson2", "@burst")."""
    return workload.name.split("@")[0]


def _mix_seed(seed: int, request_id: int) -> int:
    """splitmix64 of (seed, request_id): decorrelated generator seeds per request."""
    z = (seed * 0x9E3779B97F4A7C15 + request_id + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def prompt_tokens(req: WorkloadRequest, vocab_size: int, seed: int, low: int = 0) -> list[int]:
    """``req.prompt_len`` random token ids in ``[low, vocab_size)`` for one request.

    Deterministic from ``(seed, req.request_id)`` and independent of every other request,
    so prompts share no prefix (a shared first block has probability
    ``(vocab_size - low) ** -block``). Use ``low`` to keep special ids out.
    """
    if not 0 <= low < vocab_size:
        raise ValueError(f"need 0 <= low < vocab_size, got low={low}, vocab_size={vocab_size}")
    g = torch.Generator().manual_seed(_mix_seed(seed, req.request_id))
    return torch.randint(low, vocab_size, (req.prompt_len,), generator=g).tolist()
