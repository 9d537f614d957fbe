"""Predict a decode pool's serving metrics without GPUs: the engine's scheduler on a trace,
each step timed by the calibrated roofline (:mod:`tknp_megatron.analysis.simulator`).

Every mode on the same traces as ``tools/bench_serving.py`` (same flags), one table::

    python -m tknp_megatron.tools.simulate_pool --model llama3.1-70b --layers 12 --world 2 \\
        --kv-tokens-per-node 504192 --contexts 32768 --batches 128 64 --output-len 256

``--paper`` predicts the paper's headline ratios (section 5: Llama 3.1 405B and Nemotron-4 340B
on 4 and 8 hosts of 8 H100s, FP8; :mod:`tknp_megatron.analysis.paper_figures`) and prints
each next to the paper's (minutes on one CPU core).

``--replay DIR`` instead rebuilds each row of a measured ``bench_serving`` run (its
``results.json``, the traces from the same flags as that run, each row's own KV capacity)
and prints the prediction next to the measurement. ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

from tknp_megatron.analysis.bench_traces import (add_trace_flags, count_problems, mode_runs, run_preset,
                                                 trace_problems, traces)
from tknp_megatron.analysis.simulator import H200_CALIBRATION, SIMULATED, Calibration, simulate
from tknp_megatron.cli import ArgumentParser


PROG = "simulate_pool.py"
MODES = tuple(m.value for m in SIMULATED)


class FlagError(ValueError):
    """A flag that cannot be simulated; one line for the user."""


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_trace_flags(p, MODES)
    p.add_argument("--world", type=int, default=2, help="GPUs in the pool (TKNP: nodes x --tp)")
    p.add_argument("--kv-tokens-per-node", type=int, default=None,
                   help="KV tokens each owning node holds (DP: each replica; TP, PP, DCP: the pool)")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="instead of --kv-tokens-per-node: GiB per GPU for weights and KV, each mode's "
                        "KV from the capacity model (its share of one copy per GPU, the rest KV)")
    p.add_argument("--kv-weight-ratio", type=float, default=None, metavar="R",
                   help="instead: the GPU memory at which DP keeps R times its weights' bytes for KV "
                        "(as bench_serving's flag; the paper's regime: 0.2335)")
    p.add_argument("--max-requests-per-node", type=int, default=256)
    p.add_argument("--calibration", choices=("h200", "none"), default="h200",
                   help="h200: the measured implementation factors; none: the bare roofline")
    p.add_argument("--replay", default=None, help="a bench_serving --out folder to predict row by row")
    p.add_argument("--fp8-weights", action="store_true",
                   help="linear weights stored in FP8 (one byte each; bench_serving's --fp8-recipe)")
    p.add_argument("--paper", action="store_true", help="the paper's headline ratios, predicted")
    p.add_argument("--paper-batches", type=int, nargs="*", default=[],
                   help="with --paper: these batches for every figure instead of the paper's grid")
    p.add_argument("--json", default=None, help="write the rows here")
    return p.parse_args(argv)


def check(args) -> None:
    """Every problem with the flags, before anything runs."""
    problems = []
    for flag, value in (("--world", args.world), ("--tp", args.tp), ("--output-len", args.output_len),
                        ("--block-size", args.block_size)):
        if value < 1:
            problems.append(f"{flag} {value}: must be at least 1")
    problems += count_problems((("--max-requests-per-node", args.max_requests_per_node),))
    if not args.paper:  # the trace flags (--model, --layers, --contexts, --rates, ...) and the traces
        problems += [line for line in trace_problems(args) if line.split(" ")[0] not in
                     ("--tp", "--output-len", "--block-size")]  # those named above
    if args.world >= 1 and args.tp >= 1 and args.world % args.tp:
        problems.append(f"--tp {args.tp}: must divide --world {args.world}")
    if args.paper_batches and not args.paper:
        problems.append("--paper-batches: only with --paper")
    if any(b < 1 for b in args.paper_batches):
        problems.append(f"--paper-batches {args.paper_batches}: each must be at least 1")
    memory = [f for f, v in (("--kv-tokens-per-node", args.kv_tokens_per_node),
                             ("--gpu-memory-gib", args.gpu_memory_gib),
                             ("--kv-weight-ratio", args.kv_weight_ratio)) if v is not None]
    if len(memory) > 1:
        problems.append(f"{' and '.join(memory)}: give one of them")
    if args.replay is None and not memory and not args.paper:
        problems.append("--kv-tokens-per-node: required (or --gpu-memory-gib, --kv-weight-ratio, "
                        "or --replay a measured run)")
    for flag, value in (("--gpu-memory-gib", args.gpu_memory_gib), ("--kv-weight-ratio", args.kv_weight_ratio)):
        if value is not None and not (math.isfinite(value) and value > 0):
            problems.append(f"{flag} {value}: must be > 0 and finite")
    if args.kv_tokens_per_node is not None and args.kv_tokens_per_node < args.block_size:
        problems.append(f"--kv-tokens-per-node {args.kv_tokens_per_node}: must hold at least one "
                        f"block of {args.block_size}")
    if args.replay is not None:
        problem = _replay_problem(args)
        if problem:
            problems.append(problem)
    if args.json is not None and not Path(args.json).resolve().parent.is_dir():
        problems.append(f"--json {args.json}: no directory {Path(args.json).resolve().parent} to write it in")
    if problems:
        raise FlagError("; ".join(problems))


_ROW_KEYS = ("mode", "context", "offered_batch", "arrival_rate", "kv_capacity_tokens",
             "completion_throughput_tok_s", "waves")


def _replay_problem(args):
    """What is wrong with ``--replay``'s results.json (None: it holds rows to replay)."""
    path = Path(args.replay) / "results.json"
    if not path.is_file():
        return f"--replay {args.replay}: no results.json there"
    try:
        _measured(args)
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
        why = err.args[0] if err.args else type(err).__name__
        return f"--replay {args.replay}: results.json is " + (
            "not JSON" if isinstance(err, json.JSONDecodeError) else f"malformed ({why})")
    return None


def _measured(args) -> dict:
    """``(mode label, context, batch, rate) -> row`` of the replayed run."""
    rows = json.loads((Path(args.replay) / "results.json").read_text())["rows"]
    if not isinstance(rows, list):
        raise TypeError("'rows' is not a list")
    out = {}
    for r in rows:
        missing = [k for k in _ROW_KEYS if k not in r] if isinstance(r, dict) else ["a JSON object"]
        if missing:
            raise KeyError(f"a row without {', '.join(missing)}")
        if not (isinstance(r["completion_throughput_tok_s"], (int, float)) and r["completion_throughput_tok_s"] > 0):
            raise ValueError(f"completion_throughput_tok_s {r['completion_throughput_tok_s']!r} is not > 0")
        caps = r["kv_capacity_tokens"]
        if not (isinstance(caps, list) and caps and isinstance(caps[0], list) and caps[0]):
            raise ValueError(f"kv_capacity_tokens {caps!r} is not a list of per-node capacities")
        out[(r["mode"].lower(), r["context"], r["offered_batch"], r["arrival_rate"])] = r
    return out


def run(args) -> list:
    calibration = H200_CALIBRATION if args.calibration == "h200" else Calibration()
    measured = _measured(args) if args.replay else None
    rows = []
    for ctx, batch, rate, trace in traces(args):
        for label, mode, preset in mode_runs(args):
            row = measured.get((label, ctx, batch, rate)) if measured is not None else None
            if measured is not None and row is None:
                continue  # the measured run has no such row (cut short)
            capacity = min(row["kv_capacity_tokens"][0]) if row is not None else _capacity(args, mode, preset)
            sim = simulate(mode, preset, args.world, args.tp, trace, capacity,
                           block_size=args.block_size, max_requests_per_node=args.max_requests_per_node,
                           calibration=calibration, weight_elem=1.0 if args.fp8_weights else 2.0)
            m = sim.metrics
            out = dict(mode=label.upper(), context=ctx, offered_batch=batch, arrival_rate=rate,
                       kv_tokens_per_node=capacity, waves=m.waves,
                       completion_throughput_tok_s=m.completion_throughput_tok_s,
                       queue_wait_s_mean=m.queue_wait_s_mean, itl_s_p50=m.itl_s_p50,
                       completion_time_s_mean=m.completion_time_s_mean,
                       resident_batch_mean=sim.resident_batch_mean)
            if row is not None:
                out.update(measured_tok_s=row["completion_throughput_tok_s"], measured_waves=row["waves"],
                           predicted_over_measured=m.completion_throughput_tok_s
                           / row["completion_throughput_tok_s"])
            rows.append(out)
    return rows


def _capacity(args, mode: str, preset) -> int:
    """KV tokens per owning node of ``mode``: ``--kv-tokens-per-node``, or the capacity
    model's under ``--gpu-memory-gib`` (or the memory ``--kv-weight-ratio`` implies)."""
    if args.kv_tokens_per_node is not None:
        return args.kv_tokens_per_node
    from tknp_megatron.analysis.costmodel import gpu_gib_for_kv_ratio
    from tknp_megatron.analysis.dual_choice import gpu_budget
    from tknp_megatron.analysis.simulator import kv_tokens_per_owner
    from tknp_megatron.placement import model_bytes

    gib = args.gpu_memory_gib
    if gib is None:  # DP's copy of the run's model (not DCP's variant), over --tp GPUs
        copy = model_bytes(run_preset(args), 1 if args.fp8_weights else 2, 2)
        gib = gpu_gib_for_kv_ratio(copy, args.kv_weight_ratio, args.tp)
    budget = gpu_budget(preset, args.tp, gib, mem_util=1.0, fp8=args.fp8_weights)
    return kv_tokens_per_owner(mode, preset, args.world // args.tp, budget)


def print_ratios(rows: list) -> None:
    """Per trace, TKNP's predicted throughput over each other mode's on the same model
    (TKNP-MQA's over DCP's on DCP's variant)."""
    by_trace = {}
    for r in rows:
        by_trace.setdefault((r["context"], r["offered_batch"], r["arrival_rate"]), {})[r["mode"]] = r
    for (ctx, batch, rate), modes in by_trace.items():
        parts = []
        for ours, theirs in (("TKNP", [m for m in modes if m not in ("TKNP", "DCP", "TKNP-MQA")]),
                             ("TKNP-MQA", ["DCP"])):
            if ours not in modes:
                continue
            tok_s = {m: r["completion_throughput_tok_s"] for m, r in modes.items()}
            parts += [f"{ours}/{m} {tok_s[ours] / tok_s[m]:.2f}" for m in theirs if m in tok_s and tok_s[m] > 0]
        if parts:
            print(f"predicted at ctx {ctx}, batch {batch}, rate {rate}: {', '.join(parts)}")


def _json_safe(rows: list) -> list:
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) and k != "arrival_rate" else v)
             for k, v in r.items()} for r in rows]


def print_table(rows: list, calibration: str) -> None:
    print(f"{'mode':>9} {'ctx':>6} {'batch':>5} {'rate':>6} {'tok/s':>8} {'waves':>5} {'queue_s':>8} "
          f"{'itl_ms':>7} {'compl_s':>8} {'measured':>8} {'m.waves':>7} {'pred/meas':>9}")
    for r in rows:
        meas = r.get("measured_tok_s")
        print(f"{r['mode']:>9} {r['context']:>6} {r['offered_batch']:>5} {str(r['arrival_rate']):>6} "
              f"{r['completion_throughput_tok_s']:>8.1f} {r['waves']:>5} {r['queue_wait_s_mean']:>8.3f} "
              f"{1e3 * r['itl_s_p50']:>7.2f} {r['completion_time_s_mean']:>8.3f} "
              f"{'' if meas is None else format(meas, '.1f'):>8} {r.get('measured_waves', ''):>7} "
              f"{'' if meas is None else format(r['predicted_over_measured'], '.3f'):>9}")
    print(f"step times: roofline x implementation factor ({calibration})")


def print_paper(args) -> None:
    """Every mode on the paper's setups, then its headline ratios next to the paper's."""
    from tknp_megatron.analysis.paper_figures import TABLE_BATCHES, Grid, dual_table, mode_table, predict

    grid = Grid()
    table = mode_table(args.paper_batches or TABLE_BATCHES, grid)
    modes = list(table[0]["tok_s"])
    print(f"{'figure':<8} {'model':<15} {'nodes':>5} {'ctx':>4} {'batch':>5} "
          + " ".join(f"{m:>7}" for m in modes) + "  " + " ".join(f"{'/' + m:>6}" for m in modes[1:]))
    for r in table:
        print(f"{r['figure']:<8} {r['model']:<15} {r['nodes']:>5} {r['context'] // 1024:>3}K {r['batch']:>5} "
              + " ".join(f"{r['tok_s'][m]:>7.0f}" for m in modes) + "  "
              + " ".join(f"{r['tknp_over'][m]:>6.2f}" for m in modes[1:]))
    dual = dual_table(batches=args.paper_batches or TABLE_BATCHES, grid=grid)
    print(f"\ndual active roots on 405B: {'nodes':>5} {'ctx':>4} {'batch':>5} {'KV tok/node':>11} "
          f"{'dual KV':>9} {'single tok/s':>12} {'dual/single':>11} {'paper sched.':>12}")
    for r in dual:
        print(f"{'':<26} {r['nodes']:>5} {r['context'] // 1024:>3}K {r['batch']:>5} "
              f"{r['kv_tokens_per_node']:>11} {r['dual_kv_tokens_per_node']:>9} {r['single_tok_s']:>12.0f} "
              f"{r['dual_over_single']:>11.2f} {r['paper_dual_over_single']:>12.2f}")
    rows = predict(batches=args.paper_batches, grid=grid)
    print(f"\n{'the paper reports':<66} {'paper':>6} {'predicted':>9} {'diff':>6}  at")
    for r in rows:
        print(f"{r['what']:<66} {r['paper']:>6.2f} {r['predicted']:>9.2f} {r['difference']:>+6.0%}  "
              f"{r['context'] // 1024}K, B={r['batch']}")
    print("tok/s: completion throughput, 1,024 output tokens; step times: bare roofline on H100 "
          "constants (analysis/roofline.py: H100)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(modes=table, dual=dual, headlines=rows), indent=1))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check(args)
    except FlagError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    warnings.simplefilter("ignore")  # Megatron warns about missing Apex / TE at import
    if args.paper:
        print_paper(args)
        return 0
    rows = run(args)
    print_table(rows, H200_CALIBRATION.source if args.calibration == "h200" else "bare roofline")
    print_ratios(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(_json_safe(rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
