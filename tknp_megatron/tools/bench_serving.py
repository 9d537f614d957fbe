"""Side by side: TKNP, DP, TP, PP and DCP on the same traces, one invocation.

On GPUs, one process per GPU::

    torchrun --nproc-per-node 2 tknp_megatron/tools/bench_serving.py --device cuda --model llama3.1-70b \\
        --layers 8 --gpu-memory-gib 32 --contexts 32768 --batches 16 64 128 --output-len 128 \\
        --out $OUT/serving

On CPU (no torchrun) it starts a gloo pool itself (``--world``). Every mode serves the
same seeded trace with prompts' KV arriving from outside (synthetic, identical in every
mode), greedy decoding; a mode's tokens must equal every other mode's on the same model
(checked and reported). DCP needs more ranks than KV heads, so it runs on a variant
with ``--dcp-kv-heads`` KV heads, and TKNP runs on that variant too (``tknp-mqa``).
Each mode's engine (weights, KV cache, CUDA graphs) is built once and serves every trace in
turn; a row records the build time of the engine built for it (``engine_build_s``, 0 where
an earlier trace's engine served it).
Writes ``results.json``, ``results.csv`` and PNG plots (throughput vs offered batch,
latency panels, SLO vs arrival rate) under ``--out``.

``--modes tknp-dual`` (two weight copies, dual active roots) runs two copies only on the
traces where the pool simulator predicts they pay (:mod:`tknp_megatron.analysis.dual_choice`,
decided before any process starts, one line per trace); elsewhere that trace runs
single-copy ``tknp`` (or, if ``tknp`` is also asked for, only its row). ``--force-dual``
runs two copies everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from tknp_megatron.analysis.bench_traces import (  # noqa: E402
    add_trace_flags, count_problems, finite_problems, mode_runs, trace_problems, traces)
from tknp_megatron.cli import ArgumentParser  # noqa: E402
from tknp_megatron.config import dtype_from_name  # noqa: E402
from tknp_megatron.launch import run_ranks  # noqa: E402
from tknp_megatron.mode import Mode  # noqa: E402



def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_trace_flags(p)
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="per-GPU memory cap")
    p.add_argument("--kv-weight-ratio", type=float, default=None, metavar="R",
                   help="instead of --gpu-memory-gib: cap each GPU at one weight copy (of --model and "
                        "--layers, as stored in the run's format, over --tp GPUs) plus R times it, so "
                        "that DP keeps R times its weights' bytes for KV (the paper's memory regime: "
                        "0.2335, Llama-3.1-405B FP8 on 8 x H100); every mode gets the same cap")
    p.add_argument("--kv-tokens-per-node", type=int, default=None,
                   help="KV budget per node (CPU default: half the largest trace's reservations; "
                        "GPU default: free memory)")
    p.add_argument("--max-sequence-length", type=int, default=None, metavar="TOKENS",
                   help="the longest request every mode serves (EngineConfig.max_sequence_length; "
                        "default: the model's): also the bound the CUDA graphs' attention is sized for")
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--max-requests-per-node", type=int, default=None, metavar="N",
                   help="request slots per node (EngineConfig.max_requests_per_node; more wait in the "
                        "queue): also the largest batch bucket the CUDA graphs capture at start "
                        "(default: the most requests a trace has, at most 256, so it never binds)")
    p.add_argument("--no-fused-elementwise", action="store_true",
                   help="on GPUs, run the element-wise work between the root's GEMMs on Megatron's "
                        "modules instead of fused kernels (EngineConfig.fused_elementwise)")
    p.add_argument("--no-fused-rope", action="store_true",
                   help="with the fused kernels, Megatron's RoPE and K/V append instead of one kernel "
                        "per layer (EngineConfig.fused_rope)")
    p.add_argument("--attention-backend", default=None, metavar="NAME",
                   help="the owners' paged attention for every mode but DCP (whose shards run their "
                        "own): triton, fa3, fa4, ... (default: the device's, EngineConfig.attention_backend)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--transformer-impl", default="auto", metavar="IMPL",
                   help="dense layers of every mode: local, transformer_engine or auto (TE where installed, on GPU)")
    p.add_argument("--fp8-recipe", default=None, metavar="RECIPE",
                   help="FP8-stored GEMM weights for every mode: tensorwise or blockwise")
    p.add_argument("--force-dual", action="store_true",
                   help="with --modes tknp-dual: two weight copies even where the pool simulator "
                        "predicts that a single copy serves the trace faster")
    p.add_argument("--world", type=int, default=2, help="processes when not under torchrun")
    p.add_argument("--out", default="bench_serving_out")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the table, CSV/JSON and plots from --out's partial.jsonl")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    problems = dense_format(args).problems(args.device)
    if not args.report_only:
        # the counts the defaults below divide by, before they are computed
        world = int(os.environ.get("WORLD_SIZE", args.world))
        problems += count_problems((("--world", args.world),))
        problems += trace_problems(args)
        known = "WORLD_SIZE" in os.environ or args.device == "cpu"  # else torchrun's, not known yet
        if known and world >= 1 and args.tp >= 1 and world % args.tp:
            problems.append(f"--tp {args.tp}: must divide the world of {world} processes")
        problems += finite_problems((("--gpu-memory-gib", args.gpu_memory_gib),))
        problems += count_problems((("--kv-tokens-per-node", args.kv_tokens_per_node),))
    if args.max_requests_per_node is not None and args.max_requests_per_node < 1:
        problems.append(f"--max-requests-per-node {args.max_requests_per_node}: must be >= 1")
    if args.force_dual and Mode.TKNP_DUAL.value not in args.modes:
        problems.append("--force-dual: only with --modes tknp-dual")
    if args.kv_weight_ratio is not None:
        problems += kv_ratio_problems(args)
    from tknp_megatron.attention import backend_problem

    if backend_problem(args.attention_backend, args.device):
        problems.append(f"--attention-backend {backend_problem(args.attention_backend, args.device)}")
    problems = problems or out_problems(args)  # no directory made for a refused run
    if problems:
        p.error("; ".join(problems))
    if args.kv_weight_ratio is not None:
        args.gpu_memory_gib = kv_ratio_cap_gib(args)
        print(f"bench_serving: --kv-weight-ratio {args.kv_weight_ratio:g}: each GPU capped at "
              f"{args.gpu_memory_gib:.2f} GiB (one weight copy per {args.tp} GPU(s) plus "
              f"{args.kv_weight_ratio:g} of it)", flush=True)
    if args.device == "cpu" and args.kv_tokens_per_node is None and not args.report_only:
        args.kv_tokens_per_node = default_cpu_kv_budget(args)
    if args.max_requests_per_node is None and not args.report_only:
        args.max_requests_per_node = min(256, max(len(trace.requests) for *_, trace in traces(args)))
    args.dual = {}  # trace key -> DualPolicy, decided in main before the pool starts
    return args


def out_problems(args) -> list:
    """Why ``--out`` cannot take the results (checked up front, made by the run); under
    ``--report-only`` it must hold the partial.jsonl of an earlier run."""
    out = Path(args.out)
    if args.report_only:
        if not (out / "partial.jsonl").is_file():
            return [f"--out {args.out}: no partial.jsonl there to report (--report-only)"]
        return []
    if out.exists() and not out.is_dir():
        return [f"--out {args.out}: is a file, not a directory"]
    base = next(d for d in (out, *out.absolute().parents) if d.exists())  # where it would be made
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        return [f"--out {args.out}: cannot be made under {base}"]
    return []


def decide_dual(args) -> dict:
    """``(context, batch, rate) -> DualPolicy`` per trace when ``tknp-dual`` is asked for: the
    pool simulator's single vs dual copy prediction on that trace (H200 costs, whatever the
    device) under this run's KV budget. Raises ValueError (one line) for a forced dual that
    cannot run."""
    if Mode.TKNP_DUAL.value not in args.modes:
        return {}
    # the pool simulator builds engines: importing it imports Megatron-Core (seconds of CPU,
    # before the pool starts), so only for a run that asks for tknp-dual
    from tknp_megatron.analysis.dual_choice import choose_dual, dual_policy

    (preset,) = [p for label, _, p in mode_runs(args) if label == Mode.TKNP_DUAL.value]
    nodes = int(os.environ.get("WORLD_SIZE", args.world)) // args.tp
    budget = _dual_budget(args, preset)
    return {(ctx, batch, rate): dual_policy(choose_dual(
                preset, nodes, args.tp, trace, kv_tokens_per_node=args.kv_tokens_per_node, budget=budget,
                block_size=args.block_size, weight_elem=1.0 if args.fp8_recipe else 2.0), args.force_dual)
            for ctx, batch, rate, trace in traces(args)}


def _dual_budget(args, preset):
    """None under ``--kv-tokens-per-node`` (every node gets it, one copy or two); else the
    node's memory as the engine sizes it: ``--gpu-memory-gib`` per GPU, or 0.9 of the GPU's."""
    from tknp_megatron.analysis.dual_choice import gpu_budget

    if args.kv_tokens_per_node is not None:
        return None
    capped = args.gpu_memory_gib is not None  # the engine's cap replaces its 0.9 of the GPU
    gib = args.gpu_memory_gib if capped else torch.cuda.get_device_properties(
        int(os.environ.get("LOCAL_RANK", 0))).total_memory / 2**30
    return gpu_budget(preset, args.tp, gib, 1.0 if capped else 0.9, fp8=args.fp8_recipe is not None)


def planned_runs(args, key) -> list:
    """``mode_runs`` for the trace ``key``, ``tknp-dual`` replaced by single-copy ``tknp``
    where :func:`decide_dual` said so (dropped if ``tknp`` runs on the trace anyway)."""
    runs = []
    for label, mode, preset in mode_runs(args):
        if label == Mode.TKNP_DUAL.value and args.dual[key].mode is Mode.TKNP:
            if Mode.TKNP.value in args.modes:
                continue
            label = mode = Mode.TKNP.value
        runs.append((label, mode, preset))
    return runs


def kv_ratio_problems(args) -> list:
    """What stops ``--kv-weight-ratio`` (one line each, before any process starts)."""
    out = []
    if not args.kv_weight_ratio > 0:
        out.append(f"--kv-weight-ratio {args.kv_weight_ratio}: must be > 0")
    if args.gpu_memory_gib is not None:
        out.append("--kv-weight-ratio: sets the per-GPU cap itself; not with --gpu-memory-gib")
    if args.device != "cuda":
        out.append(f"--kv-weight-ratio: caps GPU memory (--device {args.device}: give --kv-tokens-per-node)")
    return out


def _one_copy(args):
    """``(preset, element bytes, ModelBytes)``: the run's model (every mode's but DCP's
    variant) and one copy of it as stored (FP8 GEMM weights with ``--fp8-recipe``, else
    the run's dtype)."""
    from tknp_megatron.analysis.bench_traces import run_preset
    from tknp_megatron.placement import model_bytes

    preset = run_preset(args)
    elem = dtype_from_name(args.dtype).itemsize
    return preset, elem, model_bytes(preset, 1 if dense_format(args).fp8_recipe else elem, elem)


def kv_ratio_cap_gib(args) -> float:
    """The per-GPU cap of ``--kv-weight-ratio``: one copy of the run's model as stored, over
    ``--tp`` GPUs, plus the ratio times it (the cap is the GPU's: every mode gets it)."""
    from tknp_megatron.analysis.costmodel import gpu_gib_for_kv_ratio

    return gpu_gib_for_kv_ratio(_one_copy(args)[2], args.kv_weight_ratio, args.tp)


def realized_kv_ratio(args, rows) -> str:
    """One line: DP's KV / weights as run (its smallest replica's KV tokens against one
    copy's bytes), beside the ratio asked for: the cap leaves the weights as allocated,
    which can exceed the count of parameters."""
    preset, elem, copy = _one_copy(args)
    weights = copy.total
    per_token = 2 * elem * preset.num_layers * preset.num_query_groups * preset.kv_channels
    dp = [min(min(c) for c in r["kv_capacity_tokens"]) for r in rows if r["mode"] == "DP"]
    if not dp:
        return f"--kv-weight-ratio {args.kv_weight_ratio:g}: no DP row to check the regime on"
    return (f"--kv-weight-ratio {args.kv_weight_ratio:g}: DP kept {min(dp) * per_token / weights:.3f} "
            f"of its weights' bytes for KV ({min(dp)} tokens per replica)")


def dense_format(args):
    """Every mode's dense layers, from the flags."""
    from tknp_megatron.models.precision import DenseFormat

    return DenseFormat(args.transformer_impl, args.fp8_recipe)


def default_cpu_kv_budget(args) -> int:
    """A CPU run has no free-memory measure: the largest trace's waves budget (half its
    reservations per node, at least its largest request)."""
    from tknp_megatron.engine.kv_budget import waves_budget

    nodes = max(1, args.world // args.tp)
    return max(waves_budget([r.prompt_len + r.output_len for r in trace.requests], nodes, args.block_size)
               for _, _, _, trace in traces(args))


def engine_config(args):
    """Every mode's :class:`~tknp_megatron.engine.config.EngineConfig`, from the flags."""
    from tknp_megatron.engine.config import EngineConfig

    return EngineConfig(block_size=args.block_size, kv_tokens_per_node=args.kv_tokens_per_node,
                        gpu_memory_cap_gib=args.gpu_memory_gib, cuda_graphs=args.cuda_graphs,
                        max_requests_per_node=args.max_requests_per_node, max_prefill_tokens=1 << 30,
                        fused_elementwise=False if args.no_fused_elementwise else None,
                        fused_rope=not args.no_fused_rope, attention_backend=args.attention_backend,
                        max_sequence_length=args.max_sequence_length)


def worker(rank, world, args):
    warnings.simplefilter("ignore")
    from tknp_megatron.analysis.serving import run_mode

    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    config = engine_config(args)
    attention = attention_description(args.attention_backend, device)
    dcp_attention = dcp_attention_description(device, args.attention_backend)
    if rank == 0:
        print(f"attention: {attention}; DCP's shards: {dcp_attention}", flush=True)
    # each mode's engine is built once and serves every trace that runs it; the rows come
    # back in trace order, the modes in their order within a trace
    runs_of = {}  # (label, mode, preset name) -> (preset, [(trace index, mode index)], [traces])
    keyed = []
    for i, (ctx, batch, rate, trace) in enumerate(traces(args)):
        keyed.append((ctx, batch, rate, trace))
        for j, (label, mode, preset) in enumerate(planned_runs(args, (ctx, batch, rate))):
            entry = runs_of.setdefault((label, mode, preset.name), (preset, [], []))
            entry[1].append((i, j))
            entry[2].append(trace)
    rows = {}
    for (label, mode, _), (preset, places, mode_traces) in runs_of.items():

        def keep(k: int, run, label=label, mode=mode, preset=preset, places=places) -> None:
            """Rank 0: trace ``k`` of this mode's row, saved and printed as soon as it ran."""
            if rank != 0:
                return
            i, j = places[k]
            ctx, batch, rate, trace = keyed[i]
            row = _row(label, ctx, batch, rate, run, _roofline(mode, preset, trace, world, args),
                       dcp_attention if Mode(mode) is Mode.DCP else attention)
            row["trace_index"] = i  # the trace's place in the invocation (--report-only's order)
            rows[i, j] = row
            _save_partial(row, Path(args.out))
            m = run.metrics
            built = f", engine built in {run.engine_build_s:.1f} s" if run.engine_build_s else ""
            print(f"[{len(rows)}] {label:>8} ctx={ctx} batch={batch} rate={rate}: "
                  f"{m.completion_throughput_tok_s:.1f} tok/s, waves {m.waves}{built}", flush=True)

        run_mode(Mode(mode), preset, mode_traces, config, args.tp, dtype_from_name(args.dtype), device,
                 args.seed, dense_format(args), on_run=keep)
    return [rows[k] for k in sorted(rows)]


def _save_partial(row: dict, out_dir: Path) -> None:
    """Append a finished run to ``partial.jsonl`` (kept if a later run is cut short)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "partial.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def _roofline(mode, preset, trace, world, args, gpu: Optional[str] = None):
    """Predicted step time at a run's mean resident batch and mean context, on the hardware
    of ``gpu`` (its name; default this process's GPU: ``roofline.hardware_for``, calibrated
    on H200s and scaled by HBM bandwidth for an H100); None off GPU."""
    from tknp_megatron.analysis.roofline import hardware_for, predicted_step_s

    if args.device != "cuda":
        return None

    n = len(trace.requests)
    context = sum(r.prompt_len + r.output_len / 2 for r in trace.requests) / n
    elem = 1.0 if args.fp8_recipe else 2.0  # FP8-stored GEMM weights: one byte each
    hw = hardware_for(torch.cuda.get_device_name() if gpu is None else gpu)
    return lambda batch: predicted_step_s(mode, preset, world, args.tp, batch, context, hw=hw, weight_elem=elem)


def attention_description(name, device) -> str:
    """The owners' attention backend as the rows record it: its name and, for ``auto``,
    the kernels it has here (DCP's shards run their own)."""
    from tknp_megatron.attention import default_backend_name
    from tknp_megatron.attention.per_shape import auto_kernels

    name = name or default_backend_name(device)
    return f"auto: {auto_kernels(device)}" if name == "auto" else name


def dcp_attention_description(device, name: Optional[str] = None) -> str:
    """DCP's shards' partial attention (``baselines/dcp_attention.py``) under the engine's
    backend ``name``, as rows record it: FA3 for the decode shapes ``per_shape.prefer_fa3``
    takes (with ``auto``) or for all (``fa3``), where it runs; else the Triton kernel."""
    from tknp_megatron.attention.flash3 import fa3_usable
    from tknp_megatron.baselines.dcp_attention import triton_decode_usable

    if not triton_decode_usable(device):
        return "torch"
    if name in (None, "auto", "fa3") and fa3_usable(device):
        return ("fa3" if name == "fa3" else "fa3 per shape + triton") + " decode, torch for prompts"
    return "triton decode, torch for prompts"


def _row(label, ctx, batch, rate, run, predict, attention) -> dict:
    m = run.metrics
    predicted = None
    if predict is not None and run.resident_batch_mean:
        predicted = predict(run.resident_batch_mean)
    md = m.as_dict()  # NaN (nothing measured) as None: the rows are strict JSON
    itl_p50 = md["itl_s_p50"]
    return dict(mode=label.upper(), context=ctx, offered_batch=batch, arrival_rate=rate, attention=attention,
                **{k: md[k] for k in ("completion_throughput_tok_s", "queue_wait_s_mean", "itl_s_p95",
                                      "completion_time_s_mean", "slo_attainment", "waves",
                                      "completed", "rejected")},
                resident_batch_mean=run.resident_batch_mean,
                step_ms_measured=None if itl_p50 is None else 1e3 * itl_p50,
                step_ms_predicted=None if predicted is None else 1e3 * predicted,
                measured_over_predicted=None if None in (predicted, itl_p50) else itl_p50 / predicted,
                kv_capacity_tokens=[list(c) for c in run.kv_capacity_tokens],
                host_ms_per_step=list(run.host_ms_per_step), wait_ms_per_step=list(run.wait_ms_per_step),
                host_ms_p50_per_step=list(run.host_ms_p50_per_step), engine_build_s=run.engine_build_s,
                outputs=[list(o) for o in run.outputs])


def tokens_agree(rows) -> dict:
    """Per trace and model family: each mode's greedy-token match rate against the first
    mode run on it (1.0 everywhere in fp32; bf16 modes round differently)."""
    firsts, out = {}, {}
    for r in rows:
        family = "mqa" if r["mode"] in ("DCP", "TKNP-MQA") else "base"
        key = f"{family}/ctx{r['context']}/b{r['offered_batch']}/rate{r['arrival_rate']}"
        first = firsts.setdefault(key, r)
        pairs = [(a, b) for x, y in zip(r["outputs"], first["outputs"]) for a, b in zip(x, y)]
        total = max(1, sum(max(len(x), len(y)) for x, y in zip(r["outputs"], first["outputs"])))
        out[f"{key}/{r['mode']}_vs_{first['mode']}"] = sum(a == b for a, b in pairs) / total
    return out


def report(rows, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    agree = tokens_agree(rows)
    (out_dir / "results.json").write_text(json.dumps(dict(rows=rows, tokens_agree=agree), separators=(",", ":")))
    plot_all(rows, out_dir)
    print(f"{'mode':>9} {'ctx':>6} {'batch':>5} {'rate':>6} {'tok/s':>9} {'waves':>5} "
          f"{'queue_s':>8} {'itl95_ms':>8} {'compl_s':>8} {'resident':>8} {'step_ms':>8} "
          f"{'roof_ms':>8} {'meas/roof':>9} {'host_ms':>7} {'host_p50':>8} {'gpu_wait':>8}")
    for r in rows:
        ratio = r["measured_over_predicted"]
        print(f"{r['mode']:>9} {r['context']:>6} {r['offered_batch']:>5} {str(r['arrival_rate']):>6} "
              f"{r['completion_throughput_tok_s']:>9.1f} {r['waves']:>5} "
              f"{_num(r['queue_wait_s_mean'], '.3f'):>8} {_num(r['itl_s_p95'], '.2f', 1e3):>8} "
              f"{_num(r['completion_time_s_mean'], '.3f'):>8} {r['resident_batch_mean']:>8.1f} "
              f"{_num(r['step_ms_measured'], '.2f'):>8} {_num(r['step_ms_predicted'], '.2f'):>8} "
              f"{_num(ratio, '.2f'):>9} "
              f"{_host_ms(r):>7} {_host_ms(r, 'host_ms_p50_per_step'):>8} {_wait_ms(r):>8}")
    print("tokens agree across modes:", agree, flush=True)


def _num(value, fmt: str, scale: float = 1.0) -> str:
    """A table cell: ``value * scale`` formatted, or n/a where nothing was measured."""
    return "n/a" if value is None else format(value * scale, fmt)


def _host_ms(r, key: str = "host_ms_per_step") -> str:
    """Busiest rank's host work per step (ms: the mean, or with ``key`` the median; for
    PP per microbatch step, its loop's tick)."""
    host = r.get(key) or []
    return "n/a" if not host else f"{max(host):.2f}"


def _wait_ms(r) -> str:
    """Rank 0 (a coordinator) waiting for step tokens, per step (ms)."""
    wait = r.get("wait_ms_per_step") or []
    return "n/a" if not wait else f"{wait[0]:.2f}"


def plot_all(rows, out_dir: Path) -> None:
    """CSV and the paper-style figures (8, 9 and 12) from result rows."""
    from tknp_megatron.analysis.plots import (
        ModeResult,
        plot_latency_panels,
        plot_slo_vs_rate,
        plot_throughput_vs_batch,
        rows_to_csv,
    )

    results = [ModeResult.from_dict(r) for r in rows]
    rows_to_csv(results, out_dir / "results.csv")
    batch_rows = [r for r in results if r.arrival_rate is None]
    if batch_rows:
        plot_throughput_vs_batch(batch_rows, out_dir / "throughput_vs_batch.png")
        for ctx in sorted({r.context for r in batch_rows}):
            plot_latency_panels(batch_rows, ctx, out_dir / f"latency_ctx{ctx}.png")
    if any(r.arrival_rate not in (None, float("inf")) for r in results):
        plot_slo_vs_rate(results, out_dir / "slo_vs_rate.png")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report_only:
        lines = (Path(args.out) / "partial.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]  # as runs finished: mode by mode
        report(sorted(rows, key=lambda r: r.get("trace_index", 0)), Path(args.out))
        return 0
    try:
        with warnings.catch_warnings():  # Megatron warns about missing Apex / TE at import
            warnings.simplefilter("ignore")
            args.dual = decide_dual(args)
    except ValueError as err:
        print(f"bench_serving: error: {err}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", 0)) == 0:
        for (ctx, batch, rate), policy in args.dual.items():
            print(f"bench_serving: ctx={ctx} batch={batch} rate={rate}: {policy.line}", flush=True)
    rank, rows = run_ranks(worker, args, args.device, args.world)
    if rank == 0:
        report(rows, Path(args.out))
        if args.kv_weight_ratio is not None:
            print(realized_kv_ratio(args, rows), flush=True)
    if "RANK" in os.environ:
        dist.barrier()
        if args.device == "cuda":
            os._exit(0)  # NCCL teardown after graph capture can hang: skip it, the run is written
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
