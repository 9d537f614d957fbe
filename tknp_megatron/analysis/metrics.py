"""The serving metrics derived from per-request timelines.

Each request's :class:`~tknp_megatron.engine.request.RequestTimeline` is stamped as it
moves through its life (times in seconds on one clock); :func:`summarize` turns them into
a frozen :class:`ServingMetrics`.

Conventions: percentiles interpolate linearly between order statistics (numpy's
default ``"linear"`` method); the mean or a percentile of an empty set is NaN;
``makespan_s`` and the throughput are 0.0 while no request has completed; NaN
becomes ``None`` in :meth:`ServingMetrics.as_dict`, so the dict is strict JSON.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from tknp_megatron.engine.request import RequestStatus, RequestTimeline

__all__ = ["ServingMetrics", "percentile", "summarize"]

DEFAULT_SLO_S_PER_TOKEN = 0.1


@dataclass(frozen=True)
class ServingMetrics:
    """Summary of one run; times in seconds, NaN where the underlying set is empty."""

    requests: int
    completed: int
    rejected: int
    output_tokens: int
    """Generated tokens over all requests, completed or not."""
    makespan_s: float
    """First release -> last completion; 0.0 if nothing completed."""
    completion_throughput_tok_s: float
    """Output tokens of completed requests / makespan_s; 0.0 if makespan_s is 0."""
    queue_wait_s_mean: float
    queue_wait_s_p95: float
    """Release -> first scheduled, over scheduled requests."""
    ttft_s_mean: float
    """Release -> first token, over requests with a token."""
    itl_s_p50: float
    itl_s_p95: float
    """Gaps between consecutive tokens of a request, pooled over requests."""
    completion_time_s_mean: float
    completion_time_s_p95: float
    """Release -> completion, over completed requests."""
    slo_attainment: float
    """Fraction of completed requests with (completion - release) / tokens <= SLO."""
    slo_s_per_token: float
    waves: int
    """Admission waves the scheduler went through."""
    kv_utilization: tuple[float, ...] = ()
    """Per node, as passed to :func:`summarize`."""

    def as_dict(self) -> dict:
        """Plain JSON-ready dict: NaN -> None, tuples -> lists."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                v = [_json_float(x) for x in v]
            elif isinstance(v, float):
                v = _json_float(v)
            out[f.name] = v
        return out

    def format_table(self) -> str:
        """A short human-readable multi-line summary."""
        kv = "  ".join(f"n{i}={_pct(u)}" for i, u in enumerate(self.kv_utilization)) or "-"
        rows = [
            ("requests", f"{self.requests} ({self.completed} completed, "
                         f"{self.rejected} rejected)"),
            ("output tokens", f"{self.output_tokens}"),
            ("makespan", f"{self.makespan_s:.3f} s"),
            ("throughput", f"{self.completion_throughput_tok_s:.1f} tok/s (completed)"),
            ("queue wait", f"mean {_ms(self.queue_wait_s_mean)}  p95 {_ms(self.queue_wait_s_p95)}"),
            ("TTFT", f"mean {_ms(self.ttft_s_mean)}"),
            ("ITL", f"p50 {_ms(self.itl_s_p50)}  p95 {_ms(self.itl_s_p95)}"),
            ("completion time", f"mean {_sec(self.completion_time_s_mean)}  "
                                f"p95 {_sec(self.completion_time_s_p95)}"),
            ("SLO attainment", f"{_pct(self.slo_attainment)} "
                               f"(<= {_ms(self.slo_s_per_token)}/token)"),
            ("waves", f"{self.waves}"),
            ("KV utilisation", kv),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _json_float(x: float) -> Optional[float]:
    return None if math.isnan(x) else float(x)


def _pct(fraction: float) -> str:
    return "n/a" if math.isnan(fraction) else f"{fraction:.1%}"


def _sec(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds:.3f} s"


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:.1f} ms"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between order statistics; NaN if empty.

    Same as ``numpy.percentile(values, q)`` (method ``"linear"``): the value at rank
    ``q / 100 * (n - 1)`` of the sorted values, interpolated.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return math.nan
    rank = q / 100.0 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _span(timelines: Sequence[RequestTimeline], done: Sequence[RequestTimeline]) -> float:
    """First release (any request) -> last completion; 0.0 if nothing completed."""
    if not done:
        return 0.0
    return max(t.completion for t in done) - min(t.release for t in timelines)


def _slo_attainment(done: Sequence[RequestTimeline], slo_s_per_token: float) -> float:
    """Fraction of ``done`` meeting the per-token SLO (a 0-token request counts as 1)."""
    if not done:
        return math.nan
    met = sum((t.completion - t.release) / max(t.output_tokens, 1) <= slo_s_per_token
              for t in done)
    return met / len(done)


def summarize(
    timelines: Sequence[RequestTimeline],
    waves: int,
    kv_utilization: Sequence[float] = (),
    slo_s_per_token: float = DEFAULT_SLO_S_PER_TOKEN,
) -> ServingMetrics:
    """Derive the serving metrics of a run from its per-request timelines.

    A request counts as completed when ``status == COMPLETED`` and ``completion`` is
    set. Queue wait, TTFT and ITL use every request that reached that point, so
    requests still running contribute what they have.
    """
    done = [t for t in timelines
            if t.status == RequestStatus.COMPLETED and t.completion is not None]
    makespan = _span(timelines, done)
    done_tokens = sum(t.output_tokens for t in done)
    waits = [t.first_scheduled - t.release for t in timelines if t.first_scheduled is not None]
    ttfts = [t.first_token - t.release for t in timelines if t.first_token is not None]
    itls = [gap for t in timelines for gap in t.inter_token_latencies()]
    completion_times = [t.completion - t.release for t in done]
    return ServingMetrics(
        requests=len(timelines),
        completed=len(done),
        rejected=sum(t.status == RequestStatus.REJECTED for t in timelines),
        output_tokens=sum(t.output_tokens for t in timelines),
        makespan_s=makespan,
        completion_throughput_tok_s=done_tokens / makespan if makespan > 0 else 0.0,
        queue_wait_s_mean=_mean(waits),
        queue_wait_s_p95=percentile(waits, 95),
        ttft_s_mean=_mean(ttfts),
        itl_s_p50=percentile(itls, 50),
        itl_s_p95=percentile(itls, 95),
        completion_time_s_mean=_mean(completion_times),
        completion_time_s_p95=percentile(completion_times, 95),
        slo_attainment=_slo_attainment(done, slo_s_per_token),
        slo_s_per_token=slo_s_per_token,
        waves=waves,
        kv_utilization=tuple(float(u) for u in kv_utilization),
    )
