"""Host-side cost of one step on the coordinator, without any model (runs on CPU).

A decode step's GPU work replays from a CUDA graph, so the host work around it (building
the plan, pickling it for the broadcast, padding it to a graph bucket, deriving the
rank's host inputs and packing them for the copy into the graph's buffers) sits on the
critical path of every step. This times each piece for a batch of ``--batch`` requests
at ``--context`` tokens (the packing as on CPU: on a GPU it packs into pinned memory)::

    python tknp_megatron/tools/bench_host.py --batch 64 --context 32768
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
import warnings

import torch

from tknp_megatron.cli import ArgumentParser



def _requests(batch: int, context: int, nodes: int):
    from tknp_megatron.engine.request import Request, RequestTimeline
    from tknp_megatron.sampling import SamplingParams

    out = []
    for i in range(batch):
        r = Request(i, list(range(context)), SamplingParams(max_new_tokens=64), RequestTimeline(0.0))
        r.owner, r.slot, r.generated = i % nodes, i // nodes, [1] * 5
        r.num_cached = context + len(r.generated) - 1
        out.append(r)
    return out


def _time_ms(fn, reps: int, rounds: int = 5) -> float:
    """Mean milliseconds per call over ``reps`` calls, the best of ``rounds`` rounds (a shared
    host's other work only ever adds time)."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps * 1e3)
    return best


def main(argv=None) -> int:
    warnings.simplefilter("ignore")
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    bad = [f"--{name} {getattr(args, name)}: must be >= 1"
           for name in ("nodes", "reps", "batch", "context") if getattr(args, name) < 1]
    if bad:
        p.error("; ".join(bad))
    from tknp_megatron.executor.step_inputs import GraphStep, host_inputs, pad_plan, padded_step
    from tknp_megatron.kv_cache import KVCacheSpec, PagedKVCache
    from tknp_megatron.plan import build_plan, next_decode_plan

    reqs = _requests(args.batch, args.context, args.nodes)
    plan = build_plan(0, reqs, (), args.nodes)
    # steady decode: every request's last token in flight at its row of the step before, so
    # the next plan can be derived from this one (next_decode_plan) instead of built
    for i, rid in enumerate(plan.per_request.request_ids.tolist()):
        reqs[rid].inflight_rows, reqs[rid].inflight_index = 1, i
    steady = build_plan(1, reqs, (), args.nodes)
    follower = next_decode_plan(2, steady, reqs, reqs, ())
    if follower is None:
        raise RuntimeError("bench_host: the steady plan's successor was not derived")
    data = pickle.dumps(plan)
    per_owner = -(-args.batch // args.nodes)
    spec = KVCacheSpec(num_layers=1, num_blocks=per_owner, block_size=16, local_kv_heads=1,
                       head_dim=8, dtype=torch.float32, max_slots=per_owner,
                       max_blocks_per_seq=-(-(args.context + 64) // 16))
    kv = PagedKVCache(spec, torch.device("cpu"))
    padded, _ = pad_plan(plan, kv.dummy_slot)
    host = host_inputs(padded, 0)
    staged = GraphStep(host, 0).stage(torch.device("cpu"))
    steady_padded = padded_step(steady, 0, kv.dummy_slot)
    rows = [
        ("build_plan", _time_ms(lambda: build_plan(0, reqs, (), args.nodes), args.reps)),
        ("next_decode_plan", _time_ms(lambda: next_decode_plan(2, steady, reqs, reqs, ()), args.reps)),
        ("pickle plan", _time_ms(lambda: pickle.dumps(plan), args.reps)),
        ("unpickle plan", _time_ms(lambda: pickle.loads(data), args.reps)),
        ("pad_plan", _time_ms(lambda: pad_plan(plan, kv.dummy_slot), args.reps)),
        ("host_inputs", _time_ms(lambda: host_inputs(padded, 0), args.reps)),
        ("pack inputs", _time_ms(lambda: staged.copy_(GraphStep(host, 0)), args.reps)),
        ("padded_step", _time_ms(lambda: padded_step(follower, 0, kv.dummy_slot, previous=steady_padded),
                                 args.reps)),
    ]
    print(f"host work per step: batch {args.batch}, context {args.context}, {args.nodes} nodes,"
          f" plan {len(data)} bytes")
    for name, ms in rows:
        print(f"  {name:<16} {ms:8.3f} ms")
    ms = dict(rows)
    path = ms["build_plan"] + ms["pad_plan"] + ms["host_inputs"] + ms["pack inputs"]
    derived = ms["next_decode_plan"] + ms["padded_step"] + ms["pack inputs"]
    print(f"  {'graph path':<16} {path:8.3f} ms (build_plan, pad_plan, host_inputs, pack inputs)")
    print(f"  {'steady decode':<16} {derived:8.3f} ms (next_decode_plan, padded_step derived from the step"
          " before, pack inputs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
