"""Summary table and JSON of a main-job run (examples/run_tknp_decode.py)."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence


class Progress:
    """One status line on stderr, redrawn in place: ``TKNP: 5/16 requests (3.1 s)``.

    Args:
        what: the phase (``TKNP``, ``reference``).
        total: requests in the phase.
    """

    def __init__(self, what: str, total: int):
        self.what, self.total, self.done = what, total, 0
        self.start = time.perf_counter()
        self._draw()

    def update(self, finished: int) -> None:
        """``finished`` more requests ended."""
        self.done += finished
        self._draw()

    def close(self) -> None:
        self.done = self.total
        self._draw()
        sys.stderr.write("\n")
        sys.stderr.flush()

    def _draw(self) -> None:
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"\r{self.what}: {self.done}/{self.total} requests ({elapsed:.1f} s)")
        sys.stderr.flush()


def _compare(results, reference: Optional[Dict[int, object]]) -> dict:
    """Token match against the reference (request index -> its generation, for the
    requests the pool accepted), and the largest logit difference; None for each where
    nothing was compared (no reference run, or every request refused)."""
    if not reference:
        return dict(match_reference=None, token_match_rate=None, max_logit_diff=None)
    matched = total = 0
    max_diff = 0.0
    for res, ref in ((results[i], ref) for i, ref in sorted(reference.items())):
        n = min(len(res.tokens), len(ref.tokens))
        same = [a == b for a, b in zip(res.tokens, ref.tokens)]
        matched += sum(same)
        total += max(len(res.tokens), len(ref.tokens))
        agree = same.index(False) + 1 if False in same else n  # logits comparable up to here
        if res.logits is not None and agree:
            diff = (res.logits[:agree].float().cpu() - ref.logits[:agree].float().cpu()).abs().max()
            max_diff = max(max_diff, float(diff))
    return dict(
        match_reference=matched == total,
        token_match_rate=matched / max(1, total),
        max_logit_diff=max_diff,
    )


def build_report(args, prompts, results, summary, reference, model: str,
                 weights: str = "") -> dict:
    """The run's JSON-ready summary (rank 0): counts, outputs, metrics, reference match."""
    metrics = summary["metrics"]
    completed = [r for r in results if r.status.value == "completed"]
    rejected = [r for r in results if r.status.value == "rejected"]
    nodes = args.nodes
    owned = [sum(1 for r in results if r.owner == n) for n in range(nodes)]
    report = dict(
        model=model,
        weights=weights,
        nodes=nodes,
        tp=args.tp,
        device=args.device,
        dtype=args.dtype,
        dense=summary["dense"],
        requests=len(results),
        completed=len(completed),
        rejected=len(rejected),
        reject_reasons={r.request_id: r.reject_reason for r in rejected},
        outputs=[list(r.tokens) for r in results],
        owners=[r.owner for r in results],
        requests_per_node=owned,
        waves=metrics.waves,
        kv_capacity_tokens=list(summary["capacity"]),
        kv_peak_tokens=list(summary["peak"]),
        weight_gib_stored=[b / 2**30 for b in summary["weight_bytes"]],
        output_tokens=metrics.output_tokens,
        completion_throughput_tok_s=metrics.completion_throughput_tok_s,
        queue_wait_s_mean=metrics.queue_wait_s_mean,
        itl_p95_s=metrics.itl_s_p95,
        completion_time_s_mean=metrics.completion_time_s_mean,
        placement=summary["placement"],
    )
    report.update(_compare(results, reference))
    return report


def add_texts(report: dict, decode: Callable[[Sequence[int]], str]) -> None:
    """``texts``: each request's generated tokens decoded (``--tokenizer``)."""
    report["texts"] = [decode(ids) for ids in report["outputs"]]


def _f(x: Optional[float], unit: str = "", scale: float = 1.0) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x * scale:.3g}{unit}"


def print_report(r: dict, show: int = 4) -> None:
    """The summary table, the refusals, and the first ``show`` requests' outputs (text
    with a tokenizer, else token ids)."""
    lines: List[str] = [
        f"TKNP decode: {r['model']} on {r['nodes']} nodes x TP{r['tp']} ({r['device']}, {r['dtype']}, "
        f"{r['dense']})",
        f"weights: {r['weights']}",
        r["placement"],
        "",
        "node  requests  KV peak / capacity (tokens)  weights stored (GiB)",
    ]
    for n in range(r["nodes"]):
        kv = f"{r['kv_peak_tokens'][n]:>6} / {r['kv_capacity_tokens'][n]}"
        lines.append(
            f"{n:>4}  {r['requests_per_node'][n]:>8}  {kv:<27}  {r['weight_gib_stored'][n]:.4f}"
        )
    lines += [
        "",
        f"requests {r['requests']}  completed {r['completed']}  rejected {r['rejected']}  waves {r['waves']}",
        f"output tokens {r['output_tokens']}  completion throughput {_f(r['completion_throughput_tok_s'])} tok/s",
        f"queue wait mean {_f(r['queue_wait_s_mean'], ' ms', 1e3)}  ITL p95 {_f(r['itl_p95_s'], ' ms', 1e3)}"
        f"  completion time mean {_f(r['completion_time_s_mean'], ' ms', 1e3)}",
        f"match_reference: {'n/a' if r['match_reference'] is None else str(r['match_reference']).lower()}"
        f"  token match rate {_f(r['token_match_rate'])}"
        f"  max logit diff {_f(r['max_logit_diff'])}",
    ]
    for rid, why in r["reject_reasons"].items():
        lines.append(f"rejected: {why}")
    outputs = r.get("texts") or r["outputs"]
    for i, out in enumerate(outputs[: max(0, show)]):
        lines.append(f"output {i}: {out!r}")
    if len(outputs) > show > 0:
        lines.append(f"({len(outputs) - show} more outputs: --show N, or --json FILE)")
    print("\n".join(lines), flush=True)


def _strict(value):
    """NaN (a metric with nothing to measure, e.g. ITL of one-token requests) -> None."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def write_json(report: dict, path: str) -> None:
    """Strict JSON (no NaN), written to a temporary file beside ``path`` and renamed
    over it, so a reader never sees half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(_strict(report), f, indent=1, allow_nan=False, default=str)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
