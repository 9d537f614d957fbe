"""One layer's dense work against its GEMMs and its weight-read floor, with its kernels.

    torchrun --nproc-per-node 1 -m tknp_megatron.tools.bench_dense --formats local te fp8 \\
        --batches 16 32 64 128 --profile --out $OUT/dense.json

The root's dense work of one decode step per layer is the input norm + QKV projection, the
attention output projection, the residual add, the pre-MLP norm, the MLP and the second
residual add (``executor/dense.py``; attention excluded). On decode every GEMM reads its
whole weight for a few rows, so the floor of that work is the layer's weight bytes over
the GPU's read bandwidth. For each format (``local``: Megatron's local layers in BF16;
``te``: its Transformer Engine layers; ``fp8`` / ``fp8-blockwise``: TE layers with FP8-stored
GEMM weights) and each batch ``B`` (rows), captured in a CUDA graph, median of ``--reps``
replays, it reports:

* ``layer_us``: the dense work as the executor runs it;
* ``linears_us``: the layer's four linear modules alone on inputs of the same shapes (with
  TE the QKV and FC1 modules include the norm fused into them);
* ``floor_us``: the GEMM weights' stored bytes over the GPU's measured read bandwidth
  (``read_tb_s``: a reduction over 2 GiB);
* with ``--profile``, the kernels of one graphed layer (CUPTI), each with its share, and the
  time outside the GEMMs.

``layer_us - linears_us`` is what surrounds the GEMMs (norms where not fused, residual
adds, activation, casts); ``linears_us / floor_us`` is how close the GEMMs themselves come
to reading their weights at the read bandwidth. The model is ``--model``'s layer geometry with seeded
weights, TP over the launched processes (one per GPU); ``--rank-of-tp T`` times one rank's
share of TP ``T`` in a single process (its heads, KV heads and MLP columns; no all-reduce),
e.g. a rank of Llama-3.1-405B at the paper's TP 8 on one GPU. ``--device cpu`` runs the local
format eagerly with wall-clock times (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import List

import torch
import torch.distributed as dist

from tknp_megatron.cli import ArgumentParser
from tknp_megatron.executor.dense import finish_layer, qkv_projection

__all__ = ["DenseRow", "read_bandwidth", "dense_row", "main"]



@dataclass(frozen=True)
class DenseRow:
    """One format at one batch: microseconds of one layer's dense work and its parts."""

    format: str
    fused: bool  # the element-wise steps as fused kernels (executor/dense_fusion.py)
    model: str
    tp: int
    batch: int
    layer_us: float
    linears_us: float
    floor_us: float
    weight_bytes: int
    read_tb_s: float
    kernels: List[dict] = field(default_factory=list)  # name, us, calls (with --profile)
    max_diff_vs_unfused: float = 0.0  # fused rows: largest |output - Megatron modules' output| (QKV and layer)
    output_max: float = 0.0  # largest |output| (the scale of that difference)
    rank_of_tp: int = 1  # the layer is one rank's share of TP this (in one process)
    gemm_kernel_us: float = 0.0  # the profiled kernels that are GEMMs
    other_kernel_us: float = 0.0  # every other profiled kernel

    @property
    def around_gemms_us(self) -> float:
        return self.layer_us - self.linears_us


def parse_args(argv=None) -> argparse.Namespace:
    from tknp_megatron.tools.check_fp8 import FORMATS

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama3.1-70b", help="preset whose layer geometry is timed")
    p.add_argument("--formats", nargs="+", default=["local"], choices=list(FORMATS))
    p.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--fusion", choices=("on", "off", "both"), default="both",
                   help="the element-wise steps between the GEMMs as fused kernels, Megatron's "
                        "modules, or each in turn (default)")
    p.add_argument("--rank-of-tp", type=int, default=1, metavar="T",
                   help="time one rank's share of TP T in one process (default 1: the whole layer, "
                        "or TP over the launched processes)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--profile", action="store_true", help="list each layer's kernels (CUPTI)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--out", default=None, metavar="FILE")
    args = p.parse_args(argv)
    bad = [b for b in args.batches if b < 1]
    if bad:
        p.error(f"--batches {bad[0]}: must be at least 1")
    if args.reps < 1:
        p.error(f"--reps {args.reps}: must be at least 1")
    if args.rank_of_tp < 1:
        p.error(f"--rank-of-tp {args.rank_of_tp}: must be at least 1")
    from tknp_megatron.analysis.bench_traces import model_problems
    from tknp_megatron.config import get_preset

    for problem in model_problems(args.model):
        p.error(problem)
    preset = get_preset(args.model)
    if preset.num_attention_heads % args.rank_of_tp or preset.ffn_hidden_size % args.rank_of_tp:
        p.error(f"--rank-of-tp {args.rank_of_tp}: must divide {args.model}'s {preset.num_attention_heads} "
                f"query heads and {preset.ffn_hidden_size} MLP columns")
    if args.device == "cpu" and args.formats != ["local"]:
        p.error(f"--formats {' '.join(args.formats)}: --device cpu runs local only "
                "(Transformer Engine needs a GPU)")
    return args


def read_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Bytes/s a reduction reads from device memory (a GEMM on few rows streams its weight
    the same way: read only); NaN off a GPU."""
    from tknp_megatron.tools.bench_step import graph_time

    if device.type != "cuda":
        return float("nan")
    src = torch.ones(nbytes // 2 // 4096, 4096, dtype=torch.bfloat16, device=device)
    out = torch.empty(4096, dtype=torch.float32, device=device)
    s = graph_time(lambda: torch.sum(src, dim=0, dtype=torch.float32, out=out), reps)
    return nbytes / s


def _gemm_weight_bytes(block) -> int:
    from tknp_megatron.models.precision import stored_bytes

    linears = (block.self_attention.linear_qkv, block.self_attention.linear_proj,
               block.mlp.linear_fc1, block.mlp.linear_fc2)
    # TE's fused norm + linear modules hold the norm's weight too: a few KiB, counted
    return sum(stored_bytes(m) for m in linears)


def _linears(block, hidden, attn, fc2_in):
    """The layer's four linear modules alone, on inputs of the served shapes."""
    block.self_attention.linear_qkv(hidden)
    block.self_attention.linear_proj(attn)
    block.mlp.linear_fc1(hidden)
    return block.mlp.linear_fc2(fc2_in)


def _is_gemm(name: str) -> bool:
    from tknp_megatron.tools.bench_step import kernel_kind

    return kernel_kind(name) == "gemm"


def dense_row(name: str, preset, block, config, tp_group, tp: int, batch: int, reps: int,
              read_b_s: float, profile: bool, fusion=None) -> DenseRow:
    """Time ``block``'s dense work at ``batch`` rows (graphed on a GPU, eager on CPU)."""
    from tknp_megatron.models.precision import dense_autocast
    from tknp_megatron.tools.bench_step import graph_time, kernel_rows, time_steps

    p = next(block.parameters())
    device, dtype = p.device, config.params_dtype
    hidden = torch.randn(batch, 1, preset.hidden_size, device=device, dtype=dtype)
    attn = torch.randn(batch, 1, preset.num_attention_heads * preset.kv_channels // tp,
                       device=device, dtype=dtype)
    fc2_in = torch.randn(batch, 1, preset.ffn_hidden_size // tp, device=device, dtype=dtype)

    def layer():
        qkv_projection(block, hidden, fusion)
        return finish_layer(block, attn, hidden, fusion)


    cuda = device.type == "cuda"
    kernels: List[dict] = []
    with torch.no_grad(), dense_autocast(config, tp_group):  # FP8 GEMMs are captured in FP8
        if cuda:
            layer_s = graph_time(layer, reps)
            linears_s = graph_time(lambda: _linears(block, hidden, attn, fc2_in), reps)
            if profile:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    layer()
                kernels = [dict(k, name=k["name"][:100], us=round(k["us"], 2)) for k in kernel_rows(g.replay)]
        else:
            layer_s = time_steps(layer, reps)
            linears_s = time_steps(lambda: _linears(block, hidden, attn, fc2_in), reps)
        out, qkv = layer(), qkv_projection(block, hidden, fusion)
        plain = finish_layer(block, attn, hidden) if fusion is not None else out
        plain_qkv = qkv_projection(block, hidden) if fusion is not None else qkv
    weight_bytes = _gemm_weight_bytes(block)
    gemm_us = sum(k["us"] for k in kernels if _is_gemm(k["name"]))
    return DenseRow(
        format=name, fused=fusion is not None, model=preset.name, tp=tp, batch=batch, layer_us=layer_s * 1e6,
        linears_us=linears_s * 1e6, floor_us=weight_bytes / read_b_s * 1e6 if cuda else float("nan"),
        weight_bytes=weight_bytes, read_tb_s=read_b_s / 1e12, kernels=kernels,
        max_diff_vs_unfused=max((out.float() - plain.float()).abs().max().item(),
                                (qkv.float() - plain_qkv.float()).abs().max().item()),
        output_max=plain.float().abs().max().item(), gemm_kernel_us=gemm_us, other_kernel_us=sum(k["us"] for k in kernels) - gemm_us,
    )


def rank_share(preset, tp: int):
    """``preset`` cut to one rank's share of TP ``tp``: its query heads, KV heads (at least
    one, as TP replicates them beyond their count) and MLP columns; the head size and the
    hidden size stay."""
    if tp == 1:
        return preset
    return preset.replace(num_attention_heads=preset.num_attention_heads // tp,
                          num_query_groups=max(1, preset.num_query_groups // tp),
                          ffn_hidden_size=preset.ffn_hidden_size // tp)


def format_rows(model_name: str, name: str, batches, reps: int, device: torch.device, dtype: torch.dtype,
                read_b_s: float, fusion: str = "both", profile: bool = False, seed: int = 0,
                rank_of_tp: int = 1) -> List[DenseRow]:
    """Build one layer of preset ``model_name`` in format ``name`` (``check_fp8.FORMATS``), TP
    over the default group (or one rank's share of TP ``rank_of_tp``, :func:`rank_share`), and
    time it at every batch: with Megatron's modules for the element-wise steps, the fused
    kernels, or both (``fusion``: off, on, both)."""
    import parallel_state as ps
    from tknp_megatron.config import get_preset
    from tknp_megatron.engine.factory import load_weights
    from tknp_megatron.executor.dense_fusion import dense_fusion_for
    from tknp_megatron.models.model import build_stage_model
    from tknp_megatron.tools.check_fp8 import FORMATS

    fmt = FORMATS[name]
    tp = dist.get_world_size()
    preset = rank_share(get_preset(model_name).replace(num_layers=1), rank_of_tp)
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model = build_stage_model(preset, [0], pre_process=False, post_process=False, tp=tp,
                              params_dtype=dtype, device=device, dense=fmt)
    load_weights(model, preset, seed)  # FP8 layers: through one-layer staging copies
    fusions = []
    if fusion in ("off", "both"):
        fusions.append(None)
    if fusion in ("on", "both"):
        fused = dense_fusion_for(model, device, enabled=True)
        if fused is None:
            print(f"{name}: no element-wise step of these layers is fused on {device}", flush=True)
        else:
            fusions.append(fused)
    rows = [dataclasses.replace(dense_row(name, preset, model.layer(0), model.config, groups.tp_group, tp, b, reps,
                                          read_b_s, profile, f), rank_of_tp=rank_of_tp)
            for f in fusions for b in batches]
    del model
    ps.destroy_model_parallel()
    return rows


def print_table(rows: List[DenseRow]) -> None:
    print(f"{'format':>14} {'fused':>5} {'B':>4} {'layer_us':>9} {'linears_us':>10} {'around':>7} "
          f"{'floor_us':>9} {'lin/floor':>9} {'layer/floor':>11}")
    for r in rows:
        print(f"{r.format:>14} {'yes' if r.fused else 'no':>5} {r.batch:>4} {r.layer_us:>9.1f} {r.linears_us:>10.1f} "
              f"{r.around_gemms_us:>7.1f} {r.floor_us:>9.1f} {r.linears_us / r.floor_us:>9.2f} "
              f"{r.layer_us / r.floor_us:>11.2f}  diff {r.max_diff_vs_unfused:.3g} of {r.output_max:.3g}")
    for r in rows:
        if r.kernels:
            print(f"-- {r.format}{' fused' if r.fused else ''} B={r.batch}: kernels {r.gemm_kernel_us:.1f} us in GEMMs, "
                  f"{r.other_kernel_us:.1f} us in {sum(k['calls'] for k in r.kernels if not _is_gemm(k['name'])):.0f} other kernels")
            for k in r.kernels[:16]:
                print(f"   {k['us']:8.1f} us x{k['calls']:<4.0f} {'G' if _is_gemm(k['name']) else ' '} {k['name']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.simplefilter("ignore")
    from tknp_megatron.launch import end_tool_process, init_tool_process

    device = init_tool_process(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    read_b_s = read_bandwidth(device)
    rows: List[DenseRow] = []
    for name in args.formats:
        rows += format_rows(args.model, name, args.batches, args.reps, device, dtype, read_b_s,
                            args.fusion, args.profile, rank_of_tp=args.rank_of_tp)
        if args.out and dist.get_rank() == 0:  # after every format: a later failure keeps these
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                               rows=[dict(asdict(r), around_gemms_us=r.around_gemms_us) for r in rows]),
                          f, indent=1)
    if dist.get_rank() == 0:
        print_table(rows)
    return end_tool_process(device)


if __name__ == "__main__":
    sys.exit(main())
