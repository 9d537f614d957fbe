"""Where the coordinator's host work per decode step goes: wall clock per call of each piece.

Wraps the pieces of the coordinator's step (``LockstepEngine._lead``: scheduling, the plan,
the executor's graph path, booking) in ``perf_counter`` timers, runs ``bench_serving`` with
the given arguments in this process, and prints each piece's calls and median / mean / p90
microseconds (pieces nest: ``_lead`` holds the others; ``HostCopy.result`` is the wait for
the GPU, not host work). A profiling harness for benchmarks only: it patches the classes.
Usage (one GPU): torchrun --nproc-per-node 1 benchmarks/scripts/host_profile.py --device cuda \
    --model llama3.1-70b --layers 12 --modes dp --cuda-graphs --contexts 8192 --batches 64 --output-len 128
"""
import functools
import statistics
import sys
import time
from collections import defaultdict

import torch

from tknp_megatron.engine import base as eb, engine as ee, scheduler as es
from tknp_megatron.executor import cuda_graphs as cg, step_inputs as si, tknp as tx
from tknp_megatron import host_to_device as h2d

T = defaultdict(list)


def wrap(owner, name, label=None):
    fn = getattr(owner, name)
    label = label or f"{getattr(owner, '__name__', owner)}.{name}"

    @functools.wraps(fn)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T[label].append(time.perf_counter() - t)
    setattr(owner, name, timed)


for owner, name in [
    (ee.LockstepEngine, "_lead"), (eb.InferenceEngine, "_release_due"), (es.Scheduler, "schedule"),
    (ee, "build_plan"), (ee, "next_decode_plan"), (eb.InferenceEngine, "_broadcast"), (ee.LockstepEngine, "_send_ingested_kv"),
    (tx.TKNPExecutor, "execute"), (tx.TKNPExecutor, "apply_admissions"), (cg.DecodeGraphs, "run"),
    (tx.TKNPExecutor, "graph_inputs"), (tx, "padded_step"), (si, "pad_plan"), (si, "host_inputs"),
    (si, "_advance"), (si.GraphStep, "copy_"),
    (torch.cuda.CUDAGraph, "replay"), (h2d.HostCopy, "__init__"), (h2d.HostCopy, "result"),
    (eb.InferenceEngine, "_book_keep"), (es.Scheduler, "postprocess"), (es.Scheduler, "mark_in_flight"),
    (es.StepLogProbs, "read"),
]:
    wrap(owner, name)


def report():
    print("host profile (per call, us): piece, calls, median, mean, p90", flush=True)
    for label, xs in sorted(T.items(), key=lambda kv: -statistics.median(kv[1])):
        xs2 = sorted(xs)
        print(f"  {label:45s} {len(xs):6d} {1e6 * statistics.median(xs):9.1f} {1e6 * statistics.mean(xs):9.1f} "
              f"{1e6 * xs2[int(0.9 * (len(xs2) - 1))]:9.1f}", flush=True)


if __name__ == "__main__":
    from tknp_megatron.tools import bench_serving
    import os
    real_exit = os._exit

    def exit_after_report(code):
        report()
        real_exit(code)
    os._exit = exit_after_report
    rc = bench_serving.main(sys.argv[1:])
    report()
    os._exit(rc)
