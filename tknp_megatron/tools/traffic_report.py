"""Per-layer cross-node traffic of TKNP versus DCP and dense TP (paper 4.4, eq. 1-5).

  python tknp_megatron/tools/traffic_report.py --model llama3.1-405b --nodes 4 --tp 8 --batch 128
  python tknp_megatron/tools/traffic_report.py --model llama3.1-405b --nodes 4 --tp 8 --batch 128 --json

Per layer and matching-rank group: QKV scattered to and outputs gathered from each remote
owner, the eq. 3 total, a DCP rank's partial output and FP32 LSE, and a dense TP all-reduce
operand [B, D].
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Union

from tknp_megatron.analysis.bench_traces import count_problems, model_problems  # noqa: E402
from tknp_megatron.analysis.costmodel import KIB, MIB, LayerTraffic, layer_traffic  # noqa: E402
from tknp_megatron.cli import ArgumentParser  # noqa: E402
from tknp_megatron.config import get_preset  # noqa: E402

PROG = "traffic_report.py"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="preset name, e.g. llama3.1-405b")
    p.add_argument("--nodes", type=int, required=True, help="decode nodes N")
    p.add_argument("--tp", type=int, default=8, help="GPUs per node T")
    p.add_argument("--batch", type=int, required=True, help="active batch B")
    p.add_argument("--dtype-bytes", type=int, default=2, help="bytes per activation element")
    p.add_argument("--root", type=int, default=0, help="active root node")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    problems = model_problems(args.model)
    problems += count_problems((("--nodes", args.nodes), ("--tp", args.tp), ("--batch", args.batch),
                                ("--dtype-bytes", args.dtype_bytes)))
    if args.nodes >= 1 and not 0 <= args.root < args.nodes:
        problems.append(f"--root {args.root}: must be in [0, --nodes {args.nodes})")
    if problems:
        p.error("; ".join(problems))
    return args


def _num(x: float) -> Union[int, float]:
    """An int when exact, else rounded to 3 decimals."""
    return int(x) if float(x).is_integer() else round(x, 3)


def to_json(args: argparse.Namespace, t: LayerTraffic) -> dict:
    return {
        "scatter_kib_per_owner": _num(t.scatter_bytes_per_owner / KIB),
        "gather_kib_per_owner": _num(t.gather_bytes_per_owner / KIB),
        "dcp_output_kib": _num(t.dcp_output_bytes / KIB),
        "dcp_lse_kib": _num(t.dcp_lse_bytes / KIB),
        "tp_allreduce_mib": _num(t.tp_allreduce_bytes / MIB),
        "eq3_bytes_per_layer": t.eq3_bytes,
        "eq3_kib_per_layer": _num(t.eq3_bytes / KIB),
        "gather_over_dcp_output": _num(t.gather_bytes_per_owner / t.dcp_output_bytes)
        if t.dcp_output_bytes else None,
        "owner_batches": list(t.owner_batches),
        "inputs": {"model": args.model, "nodes": args.nodes, "tp": args.tp,
                   "batch": args.batch, "dtype_bytes": args.dtype_bytes, "root": t.root},
    }


def to_table(args: argparse.Namespace, t: LayerTraffic) -> str:
    rows = [
        ("TKNP scatter per remote owner", t.scatter_bytes_per_owner / KIB, "KiB"),
        ("TKNP gather per remote owner", t.gather_bytes_per_owner / KIB, "KiB"),
        ("TKNP eq. 3 total per layer", t.eq3_bytes / KIB, "KiB"),
        ("DCP partial output per rank", t.dcp_output_bytes / KIB, "KiB"),
        ("DCP LSE per rank (fp32)", t.dcp_lse_bytes / KIB, "KiB"),
        ("dense TP all-reduce operand", t.tp_allreduce_bytes / MIB, "MiB"),
    ]
    head = (f"per-layer traffic, one matching-rank group: {args.model}, N={args.nodes}, "
            f"T={args.tp}, B={args.batch} (owners {list(t.owner_batches)}, root {t.root}), "
            f"{args.dtype_bytes} B/element")
    return "\n".join([head] + [f"  {name:<32}{_num(v):>12} {unit}" for name, v, unit in rows])


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        traffic = layer_traffic(
            get_preset(args.model), args.nodes, args.tp, args.batch, args.dtype_bytes, root=args.root
        )
    except ValueError as err:  # the cost model refuses the flags' numbers (one line)
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(to_json(args, traffic)) if args.json else to_table(args, traffic))
    return 0


if __name__ == "__main__":
    sys.exit(main())
