"""Usable KV-cache capacity per decode-pool layout (paper section 3.2, Figure 5).

Two ways to feed it:

  # from the preset's byte count and a per-GPU memory budget
  python tknp_megatron/tools/capacity_report.py --model llama3.1-405b --nodes 1 2 4 8 --tp 8 \
      --gpu-memory-gib 80 --mem-util 0.9 --reserve-gib 2 --fp8
  # from a measured DP node (the paper's numbers)
  python tknp_megatron/tools/capacity_report.py --model llama3.1-405b --nodes 1 2 4 8 --tp 8 \
      --weights-gib 454 --dp-kv-gib 106

``--json`` prints one JSON object: {"nodes": {"2": {"dp": .., ..., "tknp_over_dp": ..}},
"inputs": {...}}; dual copy is null for odd node counts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import List, Optional

from tknp_megatron.analysis.bench_traces import count_problems, finite_problems, model_problems  # noqa: E402
from tknp_megatron.analysis.costmodel import (  # noqa: E402
    Capacity,
    NodeBudget,
    budget_from_measurement,
    budget_from_preset,
    kv_capacity,
    placement_shares,
)
from tknp_megatron.cli import ArgumentParser  # noqa: E402
from tknp_megatron.config import get_preset  # noqa: E402
from tknp_megatron.mode import Mode  # noqa: E402
from tknp_megatron.placement import ModelBytes, model_bytes  # noqa: E402

PROG = "capacity_report.py"

FP8_RECIPES = {
    # every linear weight in FP8; norms, embedding and output layer in BF16
    "all": dict(linear_bytes=1, other_bytes=2),
    # Meta's Llama 3.1 FP8 checkpoint: FP8 MLPs except in the first and last layer
    "mlp": dict(linear_bytes=1, other_bytes=2, attention_bytes=2, edge_layers_at_other_bytes=1),
}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3.1-405b", help="preset name, e.g. llama3.1-405b")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--tp", type=int, default=8, help="GPUs per node (intra-node TP)")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0)
    p.add_argument("--mem-util", type=float, default=0.9, help="fraction of GPU memory used")
    p.add_argument("--reserve-gib", type=float, default=0.0, help="runtime reserve per GPU")
    p.add_argument("--fp8", nargs="?", const="all", choices=sorted(FP8_RECIPES), default=None,
                   help="FP8 linear weights: 'all' (default) or 'mlp' (Meta's Llama 3.1 FP8)")
    p.add_argument("--weights-gib", type=float, help="measured weights of one DP node")
    p.add_argument("--dp-kv-gib", type=float, help="measured KV left on one DP node")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    problems = model_problems(args.model)
    problems += count_problems((("--nodes", args.nodes), ("--tp", args.tp)))
    problems += finite_problems((("--gpu-memory-gib", args.gpu_memory_gib), ("--mem-util", args.mem_util),
                                 ("--weights-gib", args.weights_gib), ("--dp-kv-gib", args.dp_kv_gib)))
    if not (math.isfinite(args.reserve_gib) and args.reserve_gib >= 0):
        problems.append(f"--reserve-gib {args.reserve_gib}: must be a finite number >= 0")
    if (args.weights_gib is None) != (args.dp_kv_gib is None):
        problems.append("--weights-gib and --dp-kv-gib go together")
    if problems:
        p.error("; ".join(problems))
    return args


def _weights(args: argparse.Namespace) -> ModelBytes:
    recipe = FP8_RECIPES[args.fp8] if args.fp8 else dict(linear_bytes=2, other_bytes=2)
    return model_bytes(get_preset(args.model), **recipe)


def _budget(args: argparse.Namespace, weights: ModelBytes) -> NodeBudget:
    preset = get_preset(args.model)
    if args.weights_gib is not None:
        return budget_from_measurement(
            args.weights_gib, args.dp_kv_gib, args.tp, preset.num_query_groups
        )
    return budget_from_preset(
        preset, args.tp, args.gpu_memory_gib, args.mem_util, args.reserve_gib, weights=weights
    )


def capacities(args: argparse.Namespace) -> List[Capacity]:
    """One :class:`Capacity` per requested node count."""
    weights = _weights(args)
    budget = _budget(args, weights)
    out = []
    for n in args.nodes:
        dual = placement_shares(weights, n, dual=True) if n % 2 == 0 else None
        out.append(kv_capacity(budget, n, placement_shares(weights, n), dual))
    return out


def _round(x: Optional[float], digits: int = 3) -> Optional[float]:
    return None if x is None else round(x, digits)


def to_json(args: argparse.Namespace, caps: List[Capacity]) -> dict:
    budget = _budget(args, _weights(args))
    nodes = {}
    for cap in caps:
        row = {mode.field: _round(cap.of(mode)) for mode in Mode}
        row["tknp_over_dp"] = _round(cap.tknp_over_dp, 4)
        nodes[str(cap.num_nodes)] = row
    inputs = {
        "model": args.model,
        "source": "measured" if args.weights_gib is not None else "preset",
        "gpus_per_node": args.tp,
        "node_gib": _round(budget.node_gib),
        "weights_gib": _round(budget.copy_gib),
        "dp_kv_gib_per_node": _round(budget.dp_kv_gib),
        "kv_heads": budget.kv_heads,
    }
    if args.weights_gib is None:
        inputs.update(gpu_memory_gib=args.gpu_memory_gib, mem_util=args.mem_util,
                      reserve_gib=args.reserve_gib, fp8=args.fp8)
    return {"nodes": nodes, "inputs": inputs}


def to_table(args: argparse.Namespace, caps: List[Capacity]) -> str:
    budget = _budget(args, _weights(args))
    head = (f"usable KV cache (GiB): {args.model}, {args.tp} GPUs/node, node {budget.node_gib:.1f}"
            f" GiB, weight copy {budget.copy_gib:.1f} GiB, DP KV {budget.dp_kv_gib:.1f} GiB/node")
    cols = "".join(f"{str(c.num_nodes) + (' node' if c.num_nodes == 1 else ' nodes'):>11}"
                   for c in caps)
    lines = [head, f"{'layout':<10}{cols}"]
    for mode in Mode:
        cells = "".join(f"{'-' if c.of(mode) is None else f'{c.of(mode):.1f}':>11}"
                        for c in caps)
        lines.append(f"{mode.field:<10}{cells}")
    ratios = "".join(f"{'-' if c.tknp_over_dp is None else f'{c.tknp_over_dp:.2f}x':>11}"
                     for c in caps)
    lines.append(f"{'tknp/dp':<10}{ratios}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        caps = capacities(args)
    except ValueError as err:  # the cost model refuses the flags' numbers (one line)
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(to_json(args, caps)) if args.json else to_table(args, caps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
