"""TKNP decode-step benchmark on GPUs: per-layer phases, graphs vs eager.

Run under torchrun, one process per GPU (N nodes x ``--tp`` T GPUs)::

    torchrun --nproc-per-node 2 tknp_megatron/tools/bench_step.py --layers 8 --out $OUT/bench_step.json

A Llama-3.1-70B-geometry layer stack (``--layers`` of its 80 layers, random bf16
weights) is placed over N nodes; each owner holds B/N requests at ``ctx`` tokens of
(synthetic) KV. One node is DP's replica (T = 1) or a TP group (``--tp`` = the process
count). For each (B, ctx) it reports:
  * step time eager and from a CUDA graph (median of ``--reps``),
  * eager per-phase time on each rank (root QKV, scatter, attention, gather,
    root proj+MLP, handoff; from CUDA events in the executor),
  * compute-only critical path = layers x (dense(B) + attention(B/N, ctx)) + logits,
    each timed alone on this GPU in a CUDA graph, and the exposed communication share
    = 1 - critical path / graph step time,
  * with ``--profile``, the graphed step's GPU kernels, grouped and held against the
    roofline's parts (:func:`roofline_gap`).
It also checks that graph replay gives the same tokens as eager steps. Results print as
a table and go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from tknp_megatron.cli import ArgumentParser  # noqa: E402
from tknp_megatron.executor.dense import finish_layer, qkv_projection, vocab_logits  # noqa: E402
from tknp_megatron.models.precision import dense_autocast  # noqa: E402
from tknp_megatron.plan import RequestColumns, StepPlan  # noqa: E402
from tknp_megatron.profiler import PhaseTimer, PhaseTimes  # noqa: E402


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama3.1-70b")
    p.add_argument("--layers", type=int, default=8, help="layers of the preset to stack")
    p.add_argument("--tp", type=int, default=1, help="GPUs per node (TP within each node's root)")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--no-fused-elementwise", action="store_true",
                   help="Megatron's modules between the GEMMs instead of the fused kernels the engine "
                        "runs on GPUs (EngineConfig.fused_elementwise)")
    p.add_argument("--no-fused-rope", action="store_true",
                   help="with the fused kernels, Megatron's RoPE and K/V append instead of one kernel "
                        "per layer (EngineConfig.fused_rope)")
    p.add_argument("--transformer-impl", default="local", metavar="IMPL",
                   help="dense layers: local, transformer_engine or auto (TE where installed, on GPU)")
    p.add_argument("--fp8-recipe", default=None, metavar="RECIPE",
                   help="FP8-stored GEMM weights through Transformer Engine (tensorwise or blockwise; "
                        "implies TE layers); the roofline counts them at one byte")
    p.add_argument("--megatron-row-padding", action="store_true",
                   help="FP8: leave the padding of each GEMM's rows to Megatron's per-linear wrappers "
                        "instead of padding the step's rows once (models/precision.py: row_alignment)")
    p.add_argument("--profile", action="store_true",
                   help="also list the GPU kernels of a graphed step (torch.profiler, CUPTI)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU/gloo smoke run of the eager parts (no graphs, no GPU)")
    args = p.parse_args(argv)
    dense = dense_format(args)
    if args.dry_run and dense.transformer_impl != "local":
        flag = (f"--fp8-recipe {args.fp8_recipe}" if args.fp8_recipe is not None
                else f"--transformer-impl {args.transformer_impl}")
        p.error(f"{flag}: Transformer Engine's layers run on GPUs only, not with --dry-run (local layers)")
    problems = [] if args.dry_run else dense.problems("cuda")
    from tknp_megatron.analysis.bench_traces import model_problems

    problems = model_problems(args.model, args.layers) + problems
    for flag, value in (("--tp", [args.tp]), ("--batches", args.batches), ("--contexts", args.contexts),
                        ("--block-size", [args.block_size]), ("--reps", [args.reps])):
        bad = [v for v in value if v < 1]
        if bad:
            problems.append(f"{flag} {bad[0]}: must be >= 1")
    if problems:
        p.error("; ".join(problems))
    return args


def dense_format(args):
    """The dense layers from the flags: ``--fp8-recipe`` alone means TE layers."""
    from tknp_megatron.models.precision import DenseFormat

    impl = "auto" if args.fp8_recipe is not None and args.transformer_impl == "local" else args.transformer_impl
    return DenseFormat(impl, args.fp8_recipe)


def setup(args):
    """Groups, model, KV cache and executor for the largest shape.

    The model comes from the engine factory; the KV cache is sized here (every slot
    holds the longest context, block tables as wide as it, not the model's maximum), so
    the executor is built directly rather than through an engine.
    """
    import parallel_state as ps
    from tknp_megatron.attention import get_backend
    from tknp_megatron.config import get_preset
    from tknp_megatron.engine.factory import Mode, build_model, load_weights, placement_for
    from tknp_megatron.executor.dense_fusion import dense_fusion_for
    from tknp_megatron.executor.rope import Rope
    from tknp_megatron.executor.tknp import TKNPExecutor
    from tknp_megatron.kv_cache import KVCacheSpec, PagedKVCache

    if dist.get_world_size() % args.tp:
        raise SystemExit(f"bench_step: --tp {args.tp} does not divide the {dist.get_world_size()} processes")
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    cuda = not args.dry_run
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    preset = get_preset(args.model).replace(num_layers=args.layers)
    placement = placement_for(Mode.TKNP, preset, groups)
    model = build_model(Mode.TKNP, preset, placement, groups, dtype, device, dense=dense_format(args))
    load_weights(model, preset, 0)
    n = groups.num_nodes
    per_owner = -(-max(args.batches) // n)
    blocks_per_req = -(-max(args.contexts) // args.block_size) + 1
    spec = KVCacheSpec(
        num_layers=preset.num_layers, num_blocks=per_owner * blocks_per_req,
        block_size=args.block_size, local_kv_heads=preset.local_kv_heads(args.tp),
        head_dim=preset.kv_channels, dtype=dtype, max_slots=per_owner,
        max_blocks_per_seq=blocks_per_req,
    )
    kv = PagedKVCache(spec, device)
    kv.buffer.normal_()
    for slot in range(per_owner):
        kv.assign(slot, range(slot * blocks_per_req, (slot + 1) * blocks_per_req))
    rope = Rope(preset, model.config, device)
    fusion = dense_fusion_for(model, device, False if args.no_fused_elementwise else None, not args.no_fused_rope)
    ex = TKNPExecutor(model, placement, groups, kv, rope, get_backend(None, device),
                      preset.vocab_size, device, fusion=fusion)
    if args.megatron_row_padding:
        ex.row_align = 1
    return groups, preset, placement, ex


def decode_plan(batch: int, ctx: int, num_nodes: int, step: int, tokens=None) -> StepPlan:
    """Pure decode: every request at position ctx - 1 + step, owners balanced."""
    per = [batch // num_nodes + (1 if g < batch % num_nodes else 0) for g in range(num_nodes)]
    slots = torch.cat([torch.arange(c) for c in per])
    z = torch.zeros(batch, dtype=torch.int64)
    toks = torch.arange(batch) % 1000 if tokens is None else tokens.cpu()
    per_request = RequestColumns(
        request_ids=torch.arange(batch), noise_ids=torch.arange(batch), slots=slots, q_lens=z + 1,
        start_pos=z + ctx - 1 + step, temperature=z.float(), top_k=z, top_p=z.float() + 1, seeds=z, sample_steps=z + step,
    )
    return StepPlan(
        step=step, admissions=(), per_request=per_request, tokens=toks,
        requests_per_owner=tuple(per), rows_per_owner=tuple(per),
    )


def time_steps(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` synchronised runs."""
    if not torch.cuda.is_available():
        return _wall_times(fn, reps)
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[2:])


def _wall_times(fn, reps: int) -> float:
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def graph_time(fn, reps: int) -> float:
    """Median seconds of ``fn`` captured alone in a CUDA graph (no communication)."""
    if not torch.cuda.is_available():
        return _wall_times(fn, reps)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_steps(g.replay, reps)


def compute_only(ex, preset, batch: int, ctx: int, num_nodes: int, reps: int) -> dict:
    """Dense work of one layer at B, attention at B/N and ctx, and logits, timed alone."""
    from tknp_megatron.executor.step_inputs import prepare_inputs

    layer_id = ex.model.layer_ids[0]
    block = ex.model.layer(layer_id)
    hidden = torch.randn(batch, 1, preset.hidden_size, device=ex.device, dtype=ex.dtype)
    attn_in = torch.randn(batch, 1, ex.heads * ex.head_dim, device=ex.device, dtype=ex.dtype)

    def dense():
        with dense_autocast(ex.model.config, ex.groups.tp_group):  # FP8 GEMMs if stored FP8
            qkv = qkv_projection(block, hidden, ex.fusion)
            finish_layer(block, attn_in, hidden, ex.fusion)
        return qkv

    plan = decode_plan(batch, ctx, num_nodes, 0)
    inp = prepare_inputs(plan, ex.node, ex.kv, ex.rope, ex.device)
    rows = plan.rows_per_owner[ex.node]
    qkv_rows = torch.randn(rows, ex.qkv_width, device=ex.device, dtype=ex.dtype)
    out = dict(dense_ms=graph_time(dense, reps) * 1e3,
               attention_ms=graph_time(lambda: ex.attend(layer_id, qkv_rows, inp), reps) * 1e3)
    if ex.model.output_layer is not None:
        g = ex.groups
        out["logits_ms"] = graph_time(
            lambda: vocab_logits(ex.model, hidden, inp.last_rows, g.tp_group, g.tp_size, ex.vocab_size),
            reps) * 1e3
    return out


def decode_tokens(ex, batch: int, ctx: int, n: int, steps: int = 4) -> torch.Tensor:
    """``[steps, batch]`` tokens of ``steps`` decode steps from position ``ctx - 1``, each
    fed the tokens of the step before. A run writes the KV of positions ctx-1.. before
    reading them and never reads past its own step, so runs in turn see the same state."""
    tokens, out = None, []
    for step in range(steps):
        tokens = ex.execute(decode_plan(batch, ctx, n, step, tokens)).tokens
        out.append(tokens.cpu())
    return torch.stack(out)


def check_graph_tokens(ex, batch: int, ctx: int, n: int) -> bool:
    """Graph replay gives the tokens of eager steps from the same KV state."""
    ex.graphs = None
    eager = decode_tokens(ex, batch, ctx, n)
    ex.enable_cuda_graphs()
    graphed = decode_tokens(ex, batch, ctx, n)
    ex.graphs = None
    return bool(torch.equal(eager, graphed))


def check_row_padding(ex, batch: int, ctx: int, n: int) -> Optional[bool]:
    """Where the step pads the roots' rows itself (``ex.row_align`` > 1: FP8), eager steps
    give the tokens they give with Megatron's per-GEMM padding instead (``row_align`` 1),
    from the same KV state; None where the step pads nothing. Both runs have TE quantize the
    GEMM inputs: those quantized by the fused kernels need the padded rows, so unpadded rows
    would compare two quantizers rather than two paddings (``tests/test_fp8_inputs.py``
    compares the quantizers)."""
    align, fusion = ex.row_align, ex.fusion
    if align == 1:
        return None
    ex.graphs = None
    if fusion is not None:
        ex.fusion = dataclasses.replace(fusion, fp8_rows=0)
    try:
        padded_once = decode_tokens(ex, batch, ctx, n)
        ex.row_align = 1
        per_gemm = decode_tokens(ex, batch, ctx, n)
    finally:
        ex.row_align, ex.fusion = align, fusion
    return bool(torch.equal(padded_once, per_gemm))


def bench_shape(ex, preset, batch, ctx, args) -> dict:
    n = ex.groups.num_nodes
    plan = decode_plan(batch, ctx, n, 0)
    ex.graphs = None
    eager_s = time_steps(lambda: ex.execute(plan), args.reps)
    timer = PhaseTimer(ex.device)
    phases = PhaseTimes()
    for _ in range(5):
        timer.start()
        ex.execute(plan, timer)
        phases = phases + timer.summary()
    phases = PhaseTimes(*(getattr(phases, f) / 5 for f in phases.__dataclass_fields__))
    ex.enable_cuda_graphs()  # off GPU: the padded decode path, run eagerly
    graph_s = time_steps(lambda: ex.execute(plan), args.reps)
    kernels = kernel_profile(lambda: ex.execute(plan)) if args.profile and torch.cuda.is_available() else {}
    if kernels and len(ex.graphs.captured) == 1:  # the step's one graph, replayed without the host's inputs
        (captured,) = ex.graphs.captured.values()
        kernels["replay_ms"] = time_steps(captured.graph.replay, args.reps) * 1e3
    ex.graphs = None
    parts = compute_only(ex, preset, batch, ctx, n, args.reps)
    return dict(B=batch, ctx=ctx, eager_ms=eager_s * 1e3, graph_ms=graph_s * 1e3,
                phases_ms={k: getattr(phases, k) * 1e3 for k in phases.__dataclass_fields__},
                **kernels, **parts)


def kernel_rows(fn, reps: int = 5) -> list:
    """GPU kernels of one call of ``fn`` (CUPTI, averaged over ``reps`` calls after one
    warm-up), longest first: ``dict(name, us, calls)`` per kernel."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [dict(name=e.key, us=e.device_time_total / reps, calls=e.count / reps)
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["us"])


KERNEL_KINDS = ("attention", "gemm", "nccl", "other")
_ATTENTION_MARKS = ("attn", "flash", "_combine_splits", "_split_plan")
_GEMM_MARKS = ("gemm", "xmma", "cutlass", "nvjet", "cublas", "wgmma", "sm90", "splitkreduce")


def kernel_kind(name: str) -> str:
    """Which part of a step a GPU kernel is, by its name: ``attention`` (the paged kernels,
    Triton's or FlashAttention's, their split merge and plan), ``gemm`` (cuBLAS / CUTLASS,
    split-K reductions), ``nccl``, or ``other`` (norms, RoPE and the KV append, activation,
    residual adds, casts, sampling). Attention first: FlashAttention 3's kernels carry
    ``Sm90`` too."""
    low = name.lower()
    if any(m in low for m in _ATTENTION_MARKS):
        return "attention"
    if any(m in low for m in _GEMM_MARKS):
        return "gemm"
    return "nccl" if "nccl" in low else "other"


def kernel_profile(fn, reps: int = 5, top: int = 14) -> dict:
    """GPU kernels of ``fn`` (a graphed step): busy time per step, per :func:`kernel_kind`,
    and the top kernels.

    ``busy_ms`` sums kernel durations per step (NCCL kernels include their wait for the
    peer); graph step time minus busy time is GPU idle time (launch gaps, host).
    """
    rows = kernel_rows(fn, reps)
    kinds = dict.fromkeys(KERNEL_KINDS, 0.0)
    for r in rows:
        kinds[kernel_kind(r["name"])] += r["us"] / 1e3
    return dict(busy_ms=sum(r["us"] for r in rows) / 1e3, kind_ms=kinds,
                kernels=[dict(name=r["name"][:90], ms=round(r["us"] / 1e3, 4), calls=r["calls"])
                         for r in rows[:top]])


def roofline_gap(row: dict, parts) -> dict:
    """A profiled step against its roofline (:class:`~tknp_megatron.analysis.roofline.StepParts`),
    part by part, in ms: per :func:`kernel_kind`, the kernels' time on rank 0 and the
    roofline's for that part (GEMMs against the calibrated GEMMs and the logits, attention
    against the KV read at the calibrated bandwidth, NCCL against the all-reduces and
    exchanges; other kernels and the GPU's idle time have none), so the step's excess over
    its roofline is named part by part. Where the graph's replay alone was timed
    (``replay_ms``), the idle time splits into ``host`` (the step's host work before the
    replay: the inputs, their copy, the launch; the engine overlaps it with the step before)
    and ``idle`` (gaps between the replay's kernels)."""
    kinds = row["kind_ms"]
    roof = dict(attention=parts.attention, gemm=parts.gemm + parts.logits,
                nccl=parts.allreduce + parts.exchange, other=0.0)
    gap = {k: dict(measured_ms=kinds[k], roofline_ms=1e3 * roof[k]) for k in KERNEL_KINDS}
    replay = row.get("replay_ms", row["graph_ms"])
    if "replay_ms" in row:
        gap["host"] = dict(measured_ms=row["graph_ms"] - replay, roofline_ms=0.0)
    gap["idle"] = dict(measured_ms=replay - row["busy_ms"], roofline_ms=0.0)
    gap["step"] = dict(measured_ms=row["graph_ms"], roofline_ms=1e3 * parts.total)
    return gap


def summarize(rows_by_rank, layers: int, preset=None, tp: int = 1, weight_elem: float = 2.0,
              gpu: str = "H200") -> list:
    """Combine ranks (``tp`` per node): critical path and exposed communication share per
    shape, and where rank 0 was profiled, its step against the roofline (:func:`roofline_gap`)
    of ``gpu`` (:func:`~tknp_megatron.analysis.roofline.hardware_for`)."""
    from tknp_megatron.analysis.roofline import hardware_for, tknp_step_parts

    out = []
    for shape_rows in zip(*rows_by_rank):
        r0 = dict(shape_rows[0])
        dense = max(r["dense_ms"] for r in shape_rows)
        attn = max(r["attention_ms"] for r in shape_rows)
        logits = max(r.get("logits_ms", 0.0) for r in shape_rows)
        critical = layers * (dense + attn) + logits
        r0.update(dense_ms=dense, attention_ms=attn, logits_ms=logits, critical_ms=critical,
                  exposed_comm_share=max(0.0, 1 - critical / r0["graph_ms"]),
                  phases_ms_by_rank=[r["phases_ms"] for r in shape_rows],
                  busy_ms_by_rank=[r.get("busy_ms") for r in shape_rows])
        r0.pop("phases_ms", None)
        if "kind_ms" in r0 and preset is not None:
            parts = tknp_step_parts(preset, len(shape_rows) // tp, tp, r0["B"], r0["ctx"],
                                    hw=hardware_for(gpu), weight_elem=weight_elem)
            r0["roofline"] = roofline_gap(r0, parts)
        out.append(r0)
    return out


def main(argv=None):
    warnings.simplefilter("ignore")
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_step: error: no CUDA device on this machine (--dry-run runs on CPU)", file=sys.stderr)
        return 2
    if args.dry_run:  # under torchrun its world, else a world of one
        from tknp_megatron.launch import init_tool_process

        init_tool_process("cpu")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    groups, preset, placement, ex = setup(args)
    n = groups.num_nodes
    same = check_graph_tokens(ex, min(args.batches), min(args.contexts), n)
    padded_same = check_row_padding(ex, min(args.batches), min(args.contexts), n)  # (None: row_align 1)
    rows = []
    with torch.no_grad():
        for ctx in args.contexts:
            for batch in args.batches:
                rows.append(bench_shape(ex, preset, batch, ctx, args))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        gpu = torch.cuda.get_device_name() if not args.dry_run else "cpu (dry run)"
        table = summarize(gathered, args.layers, preset, args.tp, 1.0 if args.fp8_recipe else 2.0, gpu)
        report = dict(model=args.model, layers=args.layers, nodes=n, tp=args.tp,
                      placement=placement.describe(), graph_tokens_equal_eager=same,
                      row_align=ex.row_align, row_padding_tokens_equal_megatrons=padded_same,
                      megatron_row_padding=args.megatron_row_padding,
                      fused_elementwise=ex.fusion is not None, fp8_recipe=args.fp8_recipe,
                      gpu=gpu,
                      rows=table)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        print(f"graph replay tokens == eager tokens: {same}; fused element-wise kernels: {ex.fusion is not None}")
        if padded_same is not None:
            print(f"rows padded to {ex.row_align} once per step: tokens == with Megatron's per-GEMM padding: "
                  f"{padded_same}")
        print(f"{'B':>5} {'ctx':>6} {'eager_ms':>9} {'graph_ms':>9} {'dense_ms':>9} "
              f"{'attn_ms':>8} {'crit_ms':>8} {'exposed':>8}")
        for r in table:
            print(f"{r['B']:>5} {r['ctx']:>6} {r['eager_ms']:>9.2f} {r['graph_ms']:>9.2f} "
                  f"{r['dense_ms']:>9.3f} {r['attention_ms']:>8.3f} {r['critical_ms']:>8.2f} "
                  f"{r['exposed_comm_share']:>8.1%}")
        for r in table:
            print(f"B={r['B']} ctx={r['ctx']} eager phases (ms, per rank):",
                  [{k: round(v, 2) for k, v in p.items()} for p in r["phases_ms_by_rank"]])
        for r in table:
            if "busy_ms" in r:
                print(f"B={r['B']} ctx={r['ctx']} rank 0 graphed step: kernels busy {r['busy_ms']:.2f} ms"
                      f" of {r['graph_ms']:.2f} ms")
                for k in r["kernels"]:
                    print(f"    {k['ms']:8.3f} ms  x{k['calls']:<6.0f} {k['name']}")
            if "roofline" in r:
                gap = r["roofline"]
                step = gap["step"]
                print(f"B={r['B']} ctx={r['ctx']} against the roofline: step {step['measured_ms']:.2f} ms, "
                      f"roofline {step['roofline_ms']:.2f} ms ({step['measured_ms'] / step['roofline_ms']:.3f}x); "
                      f"excess by part (measured - roofline, ms):")
                for part, v in gap.items():
                    if part != "step":
                        print(f"    {part:10s} {v['measured_ms']:8.3f} - {v['roofline_ms']:8.3f} = "
                              f"{v['measured_ms'] - v['roofline_ms']:+8.3f}")
        sys.stdout.flush()
    dist.barrier()
    os._exit(0)  # NCCL teardown after capturing P2P can hang: skip it, the report is written


if __name__ == "__main__":
    sys.exit(main())
