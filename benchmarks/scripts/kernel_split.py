#!/usr/bin/env python
"""Summarize ``bench_attention --kernel-profile``: per shape, each column's timed median and
the GPU time of its kernels per call (summed, and the largest three by name), so a gap
between two columns can be named to a kernel (a split launch's plan and merge against its
attention kernel, FA3's combine, SDPA's).

Usage: python benchmarks/scripts/kernel_split.py bench_attention.json
"""

import json
import sys


def short(name: str) -> str:
    for key in ("_split_plan", "_paged_attn", "_combine_splits", "flash_fwd_splitkv_combine", "flash_fwd_splitkv",
                "flash_fwd", "FlashAttnFwdSm90", "Combine", "copy", "fill"):
        if key.lower() in name.lower():
            return key
    return name[:28]


def main(path: str) -> None:
    rows = json.load(open(path))["results"]
    for r in rows:
        if "kernels" not in r:
            continue
        print(f"B={r['B']} ctx={r['ctx']} {r['hq']}/{r['hkv']}/{r['head_dim']}  launch {r.get('launch', '')}")
        for col, kernels in r["kernels"].items():
            if col.endswith("eager_us") or col == "triton64:4:3.us":
                continue
            total = sum(kernels.values())
            parts = ", ".join(f"{short(k)} {v:.1f}" for k, v in list(kernels.items())[:3])
            timed = r.get(col) if col in r else None
            if timed is None and "." in col:
                i = [c for c in r.get("configs", []) if col.startswith(f"triton{c['block_n']}:{c['num_warps']}:{c['num_stages']}.")]
                timed = i[0].get(col.split(".", 1)[1]) if i else None
            head = f"{timed:8.1f}" if isinstance(timed, float) else "       -"
            print(f"  {col:24s} timed {head} us; kernels {total:8.1f} us: {parts}")


if __name__ == "__main__":
    main(sys.argv[1])
