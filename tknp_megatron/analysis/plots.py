"""Paper-style figures from benchmark result rows (paper Figures 8, 9 and 12a).

One :class:`ModeResult` per (mode, context, offered batch or arrival rate). The plot
functions write PNGs with matplotlib's Agg canvas (no pyplot, no global backend
switch); matplotlib is imported inside them, so this module imports without it.

    rows = load_rows("results.json")          # or a CSV written by rows_to_csv
    plot_throughput_vs_batch(rows, "fig8.png")
    plot_latency_panels(rows, 65536, "fig9.png")
    plot_slo_vs_rate(rows, "fig12a.png")

Rows with ``arrival_rate is None`` are offered batches released at once (Figures 8, 9);
rows with a rate are Poisson runs (Figure 12a).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from tknp_megatron.cli import ArgumentParser


__all__ = [
    "ModeResult",
    "MODE_ORDER",
    "load_rows",
    "rows_to_csv",
    "rows_to_json",
    "plot_throughput_vs_batch",
    "plot_latency_panels",
    "plot_slo_vs_rate",
]

PathLike = Union[str, Path]

MODE_ORDER = ("TKNP", "DP", "TP", "PP", "DCP")
"""Legend order; other modes follow, alphabetically."""
_STYLE = {  # mode -> (marker, colour); colour-blind-safe Okabe-Ito colours
    "TKNP": ("o", "#D55E00"),
    "DP": ("s", "#0072B2"),
    "TP": ("^", "#009E73"),
    "PP": ("v", "#CC79A7"),
    "DCP": ("D", "#E69F00"),
}
_EXTRA_MARKERS = ("P", "X", "*", "h", "<", ">")
_EXTRA_COLOURS = ("#56B4E9", "#000000", "#999999", "#F0E442", "#882255", "#44AA99")


@dataclass(frozen=True)
class ModeResult:
    """One measured point of one parallel mode; times in seconds."""

    mode: str
    """Parallel mode: "TKNP", "DP", "TP", "PP", "DCP" (others get spare styles)."""
    context: int
    """Input length of a fixed-length run in tokens (0 or any tag for a mixed workload)."""
    offered_batch: int
    """Submitted requests (not the resident batch)."""
    completion_throughput_tok_s: float
    queue_wait_s_mean: float
    itl_s_p95: float
    completion_time_s_mean: float
    slo_attainment: float
    """Fraction 0..1 of requests meeting the per-token SLO."""
    arrival_rate: Optional[float] = None
    """Poisson rate in requests/s; None for a burst / offered batch."""

    def __post_init__(self) -> None:
        if not self.mode:
            raise ValueError("ModeResult.mode must be non-empty")
        if self.context < 0 or self.offered_batch < 1:
            raise ValueError(f"ModeResult {self.mode}: need context >= 0 and offered_batch "
                             f">= 1, got {self.context}, {self.offered_batch}")
        if self.arrival_rate is not None and not self.arrival_rate > 0:
            raise ValueError(f"ModeResult {self.mode}: arrival_rate must be None or > 0")

    @classmethod
    def from_dict(cls, d: dict) -> "ModeResult":
        """From a dict with (at least) the field names; extra keys are ignored, None -> NaN."""
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                if f.name == "arrival_rate":
                    continue
                raise ValueError(f"result row lacks {f.name!r}: {d}")
            kw[f.name] = _convert(f.name, d[f.name])
        return cls(**kw)

    def as_dict(self) -> dict:
        """JSON-ready: NaN -> None."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in dataclasses.asdict(self).items()}


_INT_FIELDS = ("context", "offered_batch")


def _convert(name: str, value):
    """A JSON or CSV cell to the field's type; empty / None is NaN (None for the rate)."""
    if name == "mode":
        return str(value)
    if name in _INT_FIELDS:
        return int(value)
    if value is None or value == "":
        return None if name == "arrival_rate" else math.nan
    return float(value)


def load_rows(path: PathLike) -> List[ModeResult]:
    """Rows from a ``.csv`` (as :func:`rows_to_csv` writes) or a JSON file.

    JSON may be a list of row objects or an object with a ``"rows"`` list.
    """
    path = Path(path)
    if path.suffix.lower() == ".csv":
        with path.open(newline="", encoding="utf-8") as fh:
            return [ModeResult.from_dict(d) for d in csv.DictReader(fh)]
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict):
        data = data["rows"]
    return [ModeResult.from_dict(d) for d in data]


def rows_to_csv(rows: Iterable[ModeResult], path: PathLike) -> Path:
    """Write rows as CSV, one column per field; None is an empty cell. Returns the path."""
    path = Path(path)
    names = [f.name for f in dataclasses.fields(ModeResult)]
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=names)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else (repr(v) if isinstance(v, float) else v))
                        for k, v in r.as_dict().items()})
    return path


def rows_to_json(rows: Iterable[ModeResult], path: PathLike) -> Path:
    """Write ``{"rows": [...]}`` (strict JSON, NaN as null). Returns the path."""
    path = Path(path)
    path.write_text(json.dumps({"rows": [r.as_dict() for r in rows]}, indent=1) + "\n",
                    encoding="utf-8")
    return path


def _ordered_modes(rows: Sequence[ModeResult]) -> List[str]:
    present = {r.mode for r in rows}
    known = [m for m in MODE_ORDER if m in present]
    return known + sorted(present - set(known))


def _style(mode: str, modes: Sequence[str]) -> Tuple[str, str]:
    if mode in _STYLE:
        return _STYLE[mode]
    i = [m for m in modes if m not in _STYLE].index(mode)
    return _EXTRA_MARKERS[i % len(_EXTRA_MARKERS)], _EXTRA_COLOURS[i % len(_EXTRA_COLOURS)]


def _context_label(context: int) -> str:
    return f"{context // 1024}K" if context >= 1024 and context % 1024 == 0 else str(context)


def _series(rows: Sequence[ModeResult], mode: str, x: str, y: str,
            factor: float = 1.0) -> Tuple[List[float], List[float]]:
    pts = sorted((getattr(r, x), getattr(r, y) * factor) for r in rows if r.mode == mode)
    return [p[0] for p in pts], [p[1] for p in pts]


def _figure(panels: int, width_per_panel: float = 4.0, height: float = 3.2):
    """A Figure on an Agg canvas with ``panels`` axes side by side (no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_per_panel * panels, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    return fig, list(axes)


def _log2_x(ax, xs: Iterable[float], label: str) -> None:
    """A base-2 log x axis with a tick at every measured value."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ticks = sorted(set(xs))
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{t:g}" for t in ticks])
    ax.set_xlabel(label)


def _plot_modes(ax, rows: Sequence[ModeResult], x: str, y: str, factor: float = 1.0) -> None:
    modes = _ordered_modes(rows)
    for mode in modes:
        xs, ys = _series(rows, mode, x, y, factor)
        marker, colour = _style(mode, modes)
        ax.plot(xs, ys, marker=marker, color=colour, label=mode, markersize=5, linewidth=1.5)
    ax.grid(True, alpha=0.3)


def _save(fig, path: PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _batch_rows(rows: Sequence[ModeResult]) -> List[ModeResult]:
    return [r for r in rows if r.arrival_rate is None]


def plot_throughput_vs_batch(rows: Sequence[ModeResult], path: PathLike,
                             contexts: Optional[Sequence[int]] = None) -> Path:
    """Figure 8: completion throughput vs offered batch, one panel per context length.

    Uses the rows without an arrival rate; ``contexts`` picks and orders the panels
    (default: every context present, ascending). Returns the PNG path.
    """
    rows = _batch_rows(rows)
    contexts = sorted({r.context for r in rows}) if contexts is None else list(contexts)
    if not contexts:
        raise ValueError("plot_throughput_vs_batch: no offered-batch rows")
    fig, axes = _figure(len(contexts))
    for i, (ax, ctx) in enumerate(zip(axes, contexts)):
        sub = [r for r in rows if r.context == ctx]
        if not sub:
            raise ValueError(f"plot_throughput_vs_batch: no rows at context {ctx}")
        _plot_modes(ax, sub, "offered_batch", "completion_throughput_tok_s")
        _log2_x(ax, (r.offered_batch for r in sub), "Batch size (requests)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"({chr(ord('a') + i)}) {_context_label(ctx)} context")
        if i == 0:
            ax.set_ylabel("Completion throughput (tokens/s)")
            ax.legend(fontsize=8)
    return _save(fig, path)


_LATENCY_PANELS = (  # field, scale, y label, title
    ("queue_wait_s_mean", 1.0, "Mean queue wait (s)", "(a) Mean queue wait"),
    ("itl_s_p95", 1e3, "p95 active-request ITL (ms)", "(b) p95 active-request ITL"),
    ("completion_time_s_mean", 1.0, "Mean completion time (s)",
     "(c) Mean request completion time"),
)


def plot_latency_panels(rows: Sequence[ModeResult], context: int, path: PathLike) -> Path:
    """Figure 9: mean queue wait, p95 ITL (ms) and mean completion time vs offered batch
    at one context length (rows without an arrival rate). Returns the PNG path."""
    sub = [r for r in _batch_rows(rows) if r.context == context]
    if not sub:
        raise ValueError(f"plot_latency_panels: no offered-batch rows at context {context}")
    fig, axes = _figure(len(_LATENCY_PANELS))
    for ax, (field, factor, ylabel, title) in zip(axes, _LATENCY_PANELS):
        _plot_modes(ax, sub, "offered_batch", field, factor)
        _log2_x(ax, (r.offered_batch for r in sub), "Batch size (submitted requests)")
        ax.set_ylim(bottom=0)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{_context_label(context)} context")
    return _save(fig, path)


def plot_slo_vs_rate(rows: Sequence[ModeResult], path: PathLike,
                     target: Optional[float] = 0.9) -> Path:
    """Figure 12a: SLO attainment (%) vs Poisson arrival rate, one line per mode.

    Uses the rows with an arrival rate; ``target`` draws a dashed goal line (None: none).
    Returns the PNG path.
    """
    sub = [r for r in rows if r.arrival_rate is not None]
    if not sub:
        raise ValueError("plot_slo_vs_rate: no rows with an arrival rate")
    fig, (ax,) = _figure(1, width_per_panel=4.5)
    _plot_modes(ax, sub, "arrival_rate", "slo_attainment", 100.0)
    _log2_x(ax, (r.arrival_rate for r in sub), "Arrival rate (requests/s)")
    if target is not None:
        ax.axhline(100.0 * target, color="grey", linestyle="--", linewidth=1,
                   label=f"{100 * target:g}% target")
    ax.set_ylim(0, 105)
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title("(a) SLO attainment")
    ax.legend(fontsize=8)
    return _save(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Path]:
    """``python -m tknp_megatron.analysis.plots rows.json --out DIR``: every figure the rows allow."""
    p = ArgumentParser(description="Paper-style figures from result rows.")
    p.add_argument("rows", help="JSON or CSV of ModeResult rows")
    p.add_argument("--out", default=".", help="output folder")
    args = p.parse_args(argv)
    rows, out = load_rows(args.rows), Path(args.out)
    written: Dict[str, Path] = {}
    batch = _batch_rows(rows)
    if batch:
        written["throughput"] = plot_throughput_vs_batch(rows, out / "throughput_vs_batch.png")
        for ctx in sorted({r.context for r in batch}):
            written[f"latency_{ctx}"] = plot_latency_panels(
                rows, ctx, out / f"latency_{_context_label(ctx)}.png")
    if len(batch) < len(rows):
        written["slo"] = plot_slo_vs_rate(rows, out / "slo_vs_rate.png")
    for name, path in written.items():
        print(f"{name}: {path}")
    return written


if __name__ == "__main__":
    main()
