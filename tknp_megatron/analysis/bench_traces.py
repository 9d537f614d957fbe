"""The traces and model variants of a side-by-side run, shared by the serving benchmark
(``tools/bench_serving.py``, measured) and the pool simulator (``tools/simulate_pool.py``,
predicted), so that a simulated row is the measured row's exact trace.

Fixed-length traces for every ``--contexts`` x ``--batches``; with ``--mixed-requests``, the
mixed-length trace under Poisson arrivals at each ``--rates`` and, with ``--burst``, all at
once. DCP needs more ranks than KV heads, so it runs on a variant with ``--dcp-kv-heads``
KV heads, and TKNP on that variant too (``tknp-mqa``).
"""

from __future__ import annotations

import argparse
import math
from typing import Iterator, List, Optional, Tuple

from tknp_megatron.analysis import workload as wl
from tknp_megatron.config import ModelPreset, get_preset
from tknp_megatron.engine.config import sequence_limit_problem
from tknp_megatron.mode import Mode

__all__ = ["MODES", "EXTRA_MODES", "add_trace_flags", "count_problems", "finite_problems", "flag_problems",
           "layers_problem", "model_problems", "mode_runs", "trace_problems", "traces"]

MODES = tuple(m.value for m in (Mode.TKNP, Mode.DP, Mode.TP, Mode.PP, Mode.DCP))
EXTRA_MODES = (Mode.TKNP_DUAL.value,)  # on request: dual-active-root microbatching


def add_trace_flags(p: argparse.ArgumentParser, modes: Tuple[str, ...] = MODES + EXTRA_MODES) -> None:
    """The model, mode and trace flags both tools take."""
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=modes)
    p.add_argument("--model", default="tiny")
    p.add_argument("--layers", type=int, default=None, help="stack this many of the preset's layers")
    p.add_argument("--dcp-kv-heads", type=int, default=1)
    p.add_argument("--tp", type=int, default=1, help="ranks per node (TKNP, DP, PP)")
    p.add_argument("--contexts", type=int, nargs="+", default=[64])
    p.add_argument("--batches", type=int, nargs="*", default=[4, 8],
                   help="offered batches of the fixed-length traces (none: mixed traces only)")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--rates", type=float, nargs="*", default=[],
                   help="Poisson arrival rates (req/s) for the mixed-length trace")
    p.add_argument("--mixed-requests", type=int, default=0, help="requests in the mixed trace")
    p.add_argument("--mixed-scale", type=float, default=1.0 / 256)
    p.add_argument("--burst", action="store_true", help="also the mixed trace as one burst")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)


def traces(args) -> Iterator[Tuple[int, int, Optional[float], wl.Workload]]:
    """``(context, offered batch, arrival rate, trace)``: context 0 and the request count
    for the mixed trace, rate None for the fixed-length ones and inf for the burst."""
    for ctx in args.contexts:
        for batch in args.batches:
            yield ctx, batch, None, wl.fixed_length(batch, ctx, args.output_len, args.seed)
    if args.mixed_requests:
        base = wl.mixed_length(args.mixed_requests, args.seed, args.mixed_scale, args.output_len)
        for rate in args.rates:
            yield 0, args.mixed_requests, rate, wl.with_poisson_arrivals(base, rate, args.seed)
        if args.burst:
            yield 0, args.mixed_requests, float("inf"), wl.as_burst(base)


def layers_problem(model: str, layers: Optional[int]) -> Optional[str]:
    """What is wrong with ``--layers`` of preset ``model`` (None: fine, or not given): it
    must be between 1 and the preset's own layer count. An unknown preset is the
    ``--model`` check's to name, not this one's."""
    if layers is None:
        return None
    try:
        total = get_preset(model).num_layers
    except ValueError:
        return None
    if not 1 <= layers <= total:
        return f"--layers {layers}: must be >= 1 and <= {total} ({model}'s layers)"
    return None


def model_problems(model: str, layers: Optional[int] = None, flag: str = "--model") -> List[str]:
    """``[]``, or one line: the preset ``model`` unknown (named with the known ones), else
    ``--layers`` outside it (:func:`layers_problem`)."""
    try:
        get_preset(model)
    except ValueError as err:
        return [f"{flag} {model}: {err}"]
    problem = layers_problem(model, layers)
    return [problem] if problem else []


def finite_problems(pairs) -> List[str]:
    """One line per ``(flag, value)`` (value a number, a list of them, or None) that is not
    a finite number > 0."""
    out = []
    for flag, value in pairs:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and not (math.isfinite(v) and v > 0):
                out.append(f"{flag} {v}: must be > 0 and finite")
                break
    return out


def count_problems(pairs, least: int = 1) -> List[str]:
    """One line per ``(flag, value)`` (an int, a list of them, or None) below ``least``."""
    out = []
    for flag, value in pairs:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and v < least:
                out.append(f"{flag} {v}: must be >= {least}")
                break
    return out


def flag_problems(args) -> List[str]:
    """What is wrong with the trace flags themselves (one line each), before any trace is built."""
    try:
        get_preset(args.model)
    except ValueError as err:  # an unknown preset, named with the known ones
        return [f"--model: {err}"]
    out = count_problems((("--tp", args.tp), ("--contexts", args.contexts), ("--batches", args.batches),
                          ("--output-len", args.output_len), ("--block-size", args.block_size),
                          ("--dcp-kv-heads", args.dcp_kv_heads)))
    out += count_problems((("--mixed-requests", args.mixed_requests),), least=0)
    out += finite_problems((("--rates", args.rates), ("--mixed-scale", args.mixed_scale)))
    if layers_problem(args.model, args.layers):
        out.append(layers_problem(args.model, args.layers))
    return out


def trace_problems(args) -> List[str]:
    """The :func:`flag_problems`, else one line per trace whose longest request (prompt +
    output tokens) is over the model's ``max_sequence_length``, or over
    ``args.max_sequence_length`` where the caller has that flag (every such request would be
    refused: none would be served)."""
    problems = flag_problems(args)
    if problems:
        return problems
    preset = get_preset(args.model)
    cap = getattr(args, "max_sequence_length", None)
    if cap is not None and sequence_limit_problem(cap, preset):
        return [f"--max-sequence-length {cap}: {sequence_limit_problem(cap, preset)}"]
    limit, what = (preset.gpt.max_sequence_length, f"{args.model}'s max_sequence_length") if cap is None else \
        (cap, "--max-sequence-length")
    out = []
    for ctx, _, _, trace in traces(args):
        longest = max((r.prompt_len + r.output_len for r in trace.requests), default=0)
        if longest > limit:
            name = f"--contexts {ctx} with --output-len {args.output_len}" if ctx else "the mixed-length trace"
            out.append(f"{name}: requests of {longest} tokens, over {what} {limit}")
    return list(dict.fromkeys(out))  # one line per context, whatever its batches


def run_preset(args) -> ModelPreset:
    """The model of ``--model`` with ``--layers`` (every mode's but DCP's variant);
    ``ValueError`` (one line) for ``--layers`` outside [1, the preset's layers]."""
    preset = get_preset(args.model)
    problem = layers_problem(args.model, args.layers)
    if problem:
        raise ValueError(problem)
    return preset.replace(num_layers=args.layers) if args.layers is not None else preset


def mode_runs(args) -> List[Tuple[str, str, ModelPreset]]:
    """``(label, mode, preset)`` for every requested mode (``dcp`` adds ``tknp-mqa``)."""
    preset = run_preset(args)
    mqa = preset.replace(num_query_groups=args.dcp_kv_heads)
    out = [(m, m, preset) for m in args.modes if m != "dcp"]
    if "dcp" in args.modes:
        out += [("dcp", "dcp", mqa), ("tknp-mqa", "tknp", mqa)]
    return out
