#!/usr/bin/env python
"""Paged decode attention on one GPU: the Triton backend against SDPA and a copy ceiling.

For each (batch, context, q heads / kv heads / head dim) it builds a random paged bf16
cache with a shuffled block table, checks the Triton output against the torch reference
(on a subset of requests for big shapes), and times every column of the shape in turn,
one call of each per rep (:class:`Timer`: CUDA events, a warm-up of at least 50 ms, L2
flushed before every call, median, rotating among several query sets). ``--models`` takes the
shapes of model presets at each ``--tp``; ``--configs`` lists launch configs to compare
(``auto`` is the backend's own per-shape choice; a suffix ``@k`` sets
``TritonConfig.balance``, slices of equal tokens on a grid of k times the splits);
``--spread`` gives the requests mixed lengths; ``--kv-layout head-major`` stores each page
as ``[Hkv, block_size, d]`` (one head's page contiguous) instead of the engine's
``[block_size, Hkv, d]``, the Triton kernel reading it through strides (FA4 not timed there);
``--page-order`` places the pages in the pool (shuffled by default; ``in-order`` as the
engine's allocator hands out a fresh pool; ``interleaved`` as requests growing in lockstep);
``--fa3-variants`` times FA3 again with its split count and GQA packing fixed;
``--query-len N`` times prompt chunks instead of decode: each request's last ``N`` tokens
as query rows (causal), with TFLOP/s per column (``*_TFLOPs``), SDPA (causal, over
contiguous K/V) where the chunk is the whole context, and the check on request 0's last
rows.

- triton: the ``triton`` backend's decode (split-K) over the paged cache;
- sdpa: ``scaled_dot_product_attention`` on q ``[B, Hq, 1, d]`` with contiguous K/V
  ``[B, Hkv, ctx, d]`` and ``enable_gqa=True`` (``sdpa_fold`` in the JSON: the GQA group
  folded into the query length, ``[B, Hkv, G, d]``, which reads K/V once per group);
- copy: a device-to-device copy moving the same number of bytes as attention reads
  (reads half, writes half): the bandwidth ceiling;
- fa3, fa4: the ``fa3`` backend (FlashAttention 3 from vLLM's wheel) and the ``fa4``
  backend (flash-attn-4) over the same paged cache, each when it is there; checked against
  the reference like triton, timed from CUDA graphs (``fa3_us``, ``fa4_us``);
- auto: the default backend (fa3 or triton per shape), where fa3 is there (``auto_us``);
- flash: ``flash_attn_with_kvcache`` on contiguous K/V, when flash_attn imports.

Bandwidth = bytes of K and V read / time. Prints one table last and writes JSON to
``--out`` (default ``$OUT/bench_attention.json``). ``--dry-run`` runs tiny shapes on CPU
under ``TRITON_INTERPRET=1`` (a check of this script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from tknp_megatron.cli import ArgumentParser


PAGE_ORDERS = ("in-order", "interleaved", "shuffled")  # as attention/testing.py's (imported late)
LIBRARIES = ("fa3", "fa4")  # the paged backends of other libraries, timed where they are there
COLUMNS = ["B", "ctx", "hq/hkv/d", "triton_us", "triton_TBps", "pct_of_copy", "sdpa_us", "sdpa_TBps", "copy_TBps", "rel_err"]


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--ctx", type=int, nargs="+", default=[4096, 32768, 131072])
    p.add_argument("--heads", nargs="+", default=["16:1", "8:1"],
                   help="q_heads:kv_heads[:head_dim] per rank (head dim defaults to --head-dim)")
    p.add_argument("--models", nargs="+", default=None,
                   help="model presets whose per-rank shapes at each --tp replace --heads")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 8], help="TP sizes of --models")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-layout", choices=("token-major", "head-major"), default="token-major",
                   help="page layout: [block_size, Hkv, d] (the engine's) or [Hkv, block_size, d]")
    p.add_argument("--page-order", choices=PAGE_ORDERS, default="shuffled",
                   help="where the requests' pages lie in the pool (attention/testing.py, PAGE_ORDERS)")
    p.add_argument("--fa3-variants", nargs="*", default=[],
                   help="FA3 timed again per variant splits[:pack|nopack] (splits 0: its heuristic; "
                        "pack: GQA packing forced on or off), e.g. 1 2 4 0:nopack; JSON fa3_variants")
    p.add_argument("--prefill-rows", type=int, default=None,
                   help="triton configs: matrix rows of a prompt tile (TritonConfig.prefill_rows; default 64)")
    p.add_argument("--query-len", type=int, default=1,
                   help="query rows per request (1: decode; more: a prompt chunk ending at the context)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--query-sets", type=int, default=4, help="query tensors rotated among reps")
    p.add_argument("--ref-requests", type=int, default=16, help="requests checked against the reference")
    p.add_argument("--configs", nargs="+", default=["64:4:2"],
                   help="triton configs block_n:num_warps:num_stages[:waves], or auto (the backend's own choice "
                        "per shape), each optionally with @balance (e.g. auto@4); the first is the reported one")
    p.add_argument("--num-splits", type=int, default=None,
                   help="fix the split count (default, or 0: the heuristic; --dry-run's default: 3)")
    p.add_argument("--waves", type=int, default=4, help="split heuristic: programs per SM")
    p.add_argument("--min-split-tokens", type=int, default=256, help="split heuristic: fewest tokens a split gets")
    p.add_argument("--max-splits", type=int, default=None, help="split heuristic: most splits (default: the backend's)")
    p.add_argument("--balance-min-work", type=int, default=None,
                   help="configs without @balance: fewest KV head-tokens a launch covers to be balanced "
                        "(default: the backend's, TritonConfig.balance_min_work)")
    p.add_argument("--max-kv-gib", type=float, default=None, help="skip shapes whose K+V exceed this many GiB")
    p.add_argument("--spread", type=float, default=0.0,
                   help="mixed lengths: request i of B holds ctx * (1 - spread * i / (B - 1)) tokens "
                        "(0: all ctx; SDPA is then not timed, its contiguous K/V would be padded)")
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 between reps")
    p.add_argument("--kernel-profile", type=int, default=0, metavar="CALLS",
                   help="also run each column CALLS times under torch.profiler: its kernels' mean time per call "
                        "(JSON 'kernels'), e.g. a split launch's plan, attention and merge apart")
    p.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timing of triton")
    p.add_argument("--prepared", action="store_true",
                   help="also time the reported Triton config and each library on the step's prepared schedule "
                        "(AttentionBackend.prepare, made once outside the timed call as an engine step makes it "
                        "once for all its layers): columns *_prepared_us")
    p.add_argument("--separate-merge", action="store_true",
                   help="also time the reported Triton config with its balanced splits merged by a kernel of their "
                        "own after the attention kernel (TritonConfig.fused_merge=False; on the step's prepared plan "
                        "with --prepared): column triton_separate_merge_us, beside triton_graph_us / "
                        "triton_prepared_us of the kernel merging them itself")
    p.add_argument("--out", default=None)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = p.parse_args(argv)
    if args.dry_run:
        args.batch, args.ctx, args.heads = [2], [48, 100], ["4:1", "2:1"]
        args.head_dim, args.warmup, args.reps, args.query_sets, args.ref_requests = 32, 1, 2, 2, 2
        args.configs = ["16:4:2"] if args.configs == ["64:4:2"] else args.configs
        args.num_splits = 3 if args.num_splits is None else args.num_splits
    if args.num_splits == 0:
        args.num_splits = None
    if args.out is None and os.environ.get("OUT"):
        args.out = os.path.join(os.environ["OUT"], "bench_attention.json")
    if not 0.0 <= args.spread < 1.0:
        p.error(f"--spread {args.spread}: must be in [0, 1)")
    try:
        args.fa3_variants = [parse_fa3_variant(v) for v in args.fa3_variants]
    except SystemExit as err:  # one line, argparse's way
        p.error(str(err))
    if args.query_len < 1 or args.query_len > min(args.ctx):
        p.error(f"--query-len {args.query_len}: must be in [1, the shortest --ctx {min(args.ctx)}]")
    if args.query_len > 1 and args.spread:
        p.error("--query-len > 1 times equal contexts: leave --spread at 0")
    try:
        args.shapes = shapes_of(args)
    except ValueError as err:  # one line naming the flag
        p.error(str(err))
    return args


def parse_fa3_variant(text: str):
    """``"splits[:pack|nopack]"`` -> ``(text, num_splits, pack_gqa)`` (pack_gqa None: FA3's choice)."""
    spec, _, pack = text.partition(":")
    if not spec.isdigit() or pack not in ("", "pack", "nopack"):
        raise SystemExit(f"--fa3-variants {text!r}: expected splits[:pack|nopack], splits >= 0")
    return text, int(spec), {"": None, "pack": True, "nopack": False}[pack]


def shapes_of(args):
    """``[(hq, hkv, head_dim)]`` per rank: from ``--models`` x ``--tp``, else ``--heads``."""
    shapes = []
    if args.models:
        from tknp_megatron.config import get_preset

        bad_tp = [tp for tp in args.tp if tp < 1]
        if bad_tp:
            raise ValueError(f"--tp {bad_tp[0]}: must be >= 1")
        for name in args.models:
            try:
                preset = get_preset(name)
            except ValueError as err:  # an unknown preset, named with the known ones
                raise ValueError(f"--models {name}: {err}") from None
            for tp in args.tp:
                if preset.num_attention_heads % tp:
                    raise ValueError(f"--tp {tp}: {name}'s {preset.num_attention_heads} heads do not split")
                shapes.append((preset.num_attention_heads // tp, preset.local_kv_heads(tp), preset.kv_channels))
    else:
        for spec in args.heads:
            try:
                parts = [int(x) for x in spec.split(":")]
            except ValueError:
                parts = []
            if len(parts) not in (2, 3) or min(parts) < 1:
                raise ValueError(f"--heads {spec!r}: expected q_heads:kv_heads[:head_dim], each >= 1")
            shapes.append((parts[0], parts[1], parts[2] if len(parts) == 3 else args.head_dim))
    return list(dict.fromkeys(shapes))


class Timer:
    """Median times (us) of several ``fn(i)`` timed in turn; CUDA events on GPU (L2 flushed
    before every call), perf_counter on CPU.

    :meth:`interleaved` times its functions round-robin, one call of each per rep, so that
    a drift of the GPU's speed while a shape is measured (clocks, power, temperature) falls
    on every column alike. On an H200, timed one after the other, the first kernel of a
    shape read up to 12 % slower than the same launch timed right after it, and a column
    timed later could read up to 11 % slower than the same kernel timed before it
    (``benchmarks/RESULTS.md``, "Timing in turn"). The warm-up runs ``warmup`` calls of
    each and then keeps cycling until the GPU has been busy for ``WARM_S``.
    """

    WARM_S = 0.05

    def __init__(self, torch, device, warmup, reps, flush):
        self.torch, self.device, self.warmup, self.reps = torch, device, warmup, reps
        cuda = device.type == "cuda"
        self.flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device=device) if cuda and flush else None

    def __call__(self, fn) -> float:
        return self.interleaved([fn])[0]

    def interleaved(self, fns) -> list:
        """The median time (us) of each of ``fns``, timed in turn."""
        torch, cuda = self.torch, self.device.type == "cuda"
        for fn in fns:
            for i in range(self.warmup):
                fn(i)
        if cuda:
            torch.cuda.synchronize()
            t0, i = time.perf_counter(), 0
            while fns and time.perf_counter() - t0 < self.WARM_S:
                for fn in fns:
                    fn(i)
                i += 1
                torch.cuda.synchronize()
        times = [[] for _ in fns]
        if not cuda:
            for i in range(self.reps):
                for fn, out in zip(fns, times):
                    t0 = time.perf_counter()
                    fn(i)
                    out.append((time.perf_counter() - t0) * 1e6)
            return [statistics.median(t) for t in times]
        events = [[] for _ in fns]
        for i in range(self.reps):
            for fn, out in zip(fns, events):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if self.flush_buf is not None:
                    self.flush_buf.zero_()
                start.record()
                fn(i)
                end.record()
                out.append((start, end))
        torch.cuda.synchronize()
        return [statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs) for pairs in events]


class Jobs:
    """The timings of one shape, collected first and run together (:meth:`Timer.interleaved`):
    each is ``(target dict, key, fn)``, and its median lands in ``target[key]``."""

    def __init__(self):
        self.items = []

    def add(self, target: dict, key: str, fn) -> None:
        self.items.append((target, key, fn))

    def run(self, timer: Timer) -> None:
        for (target, key, _), us in zip(self.items, timer.interleaved([fn for _, _, fn in self.items])):
            target[key] = us

    def profile(self, torch, calls: int) -> dict:
        """``{key: {kernel: mean us per call}}``: each job run ``calls`` times under
        ``torch.profiler`` (after its timing, so warm; no L2 flush between calls), the
        GPU time of each kernel it launched (graph replays included) over ``calls``.
        A Triton config's keys are prefixed with its tile (``triton64:4:3.graph_us``)."""
        from torch.profiler import ProfilerActivity, profile

        found = {}
        for target, key, fn in self.items:
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(calls):
                    fn(i)
                torch.cuda.synchronize()
            kernels = {}
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    name = ev.name[:80]
                    kernels[name] = kernels.get(name, 0.0) + ev.time_range.elapsed_us() / calls
            label = key if "B" in target else f"triton{target['block_n']}:{target['num_warps']}:{target['num_stages']}.{key}"
            found[label] = {k: round(v, 2) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])}
        return found


def rel_err(out, ref) -> float:
    """``||out - ref|| / ||ref||`` in fp32."""
    diff = (out.float() - ref.float()).norm()
    return float(diff / ref.float().norm().clamp_min(1e-30))


def bytes_needed(batch, ctx, hkv, d, elem, block_size):
    """Peak bytes of one shape: paged cache, contiguous K/V, copy buffers, a gather."""
    kv = 2 * batch * (-(-ctx // block_size) * block_size) * hkv * d * elem
    return int(4 * kv + (512 << 20))


def run_shape(env, args, batch, ctx, hq, hkv, head_dim):
    """Check and time one shape; returns its JSON row."""
    torch, device = env["torch"], env["device"]
    dtype = getattr(torch, args.dtype)
    elem = torch.finfo(dtype).bits // 8
    row = dict(B=batch, ctx=ctx, hq=hq, hkv=hkv, head_dim=head_dim, block_size=args.block_size, dtype=args.dtype,
               kv_layout=args.kv_layout, page_order=args.page_order, query_len=args.query_len)
    lens = context_lengths(batch, ctx, args.spread)
    row["spread"], row["mean_ctx"] = args.spread, sum(lens) / batch
    row["kv_bytes"] = 2 * sum(lens) * hkv * head_dim * elem
    if args.max_kv_gib is not None and row["kv_bytes"] > args.max_kv_gib * 2**30:
        row["status"] = f"skipped: K+V {row['kv_bytes'] / 2**30:.1f} GiB > --max-kv-gib {args.max_kv_gib}"
        return row
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        need = bytes_needed(batch, ctx, hkv, head_dim, elem, args.block_size)
        if need > 0.9 * free:
            row["status"] = f"skipped: needs {need / 2**30:.1f} GiB, free {free / 2**30:.1f} GiB"
            return row
    # causal attention's multiply-adds: row i of a chunk ending at L sees L - n + i + 1 tokens
    n = args.query_len
    row["flop"] = sum(4 * hq * head_dim * (n * length - n * (n - 1) // 2) for length in lens)
    case = env["testing"].make_paged_case(
        [n] * batch, lens, num_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
        block_size=args.block_size, dtype=dtype, device=device, seed=batch + ctx + hq,
        head_major=args.kv_layout == "head-major", page_order=args.page_order)
    qs = [case.q] + [torch.randn_like(case.q) for _ in range(args.query_sets - 1)]
    jobs = Jobs()  # every column's timing, run together in turn once all are checked
    out, ref = check_triton(env, args, case, qs, row, jobs)
    if args.kv_layout == "token-major":
        for name in env["libraries"]:
            check_library(env, name, args, case, qs, row, ref, jobs)
        if "fa3" in env["libraries"] and args.fa3_variants:
            check_fa3_variants(env, args, case, qs, row, ref, jobs)
    if not args.spread and (n == 1 or n == ctx):
        check_contiguous_kernels(env, case, qs, out, row, jobs)
    add_copy(env, row, jobs)
    jobs.run(env["timer"])
    if args.kernel_profile and device.type == "cuda":
        row["kernels"] = jobs.profile(torch, args.kernel_profile)
    summarize_triton(row, env["device"].type == "cuda" and not args.no_graphs)
    del case, qs, out, jobs
    for name in ("triton", *env["libraries"], "sdpa", "copy"):
        if f"{name}_us" in row:
            row[f"{name}_TBps"] = row["kv_bytes"] / (row[f"{name}_us"] * 1e-6) / 1e12
    for name in ("triton_graph", *env["libraries"], "sdpa"):
        if n > 1 and f"{name}_us" in row:
            row[f"{name}_TFLOPs"] = row["flop"] / (row[f"{name}_us"] * 1e-6) / 1e12
    row["pct_of_copy"] = 100.0 * row["triton_TBps"] / row["copy_TBps"]
    row["status"] = "ok" if row["rel_err"] < 1e-2 else "WRONG"
    return row


def context_lengths(batch: int, ctx: int, spread: float):
    """Each request's context: all ``ctx``, or with ``spread`` evenly from ``ctx`` down to
    ``ctx * (1 - spread)``."""
    if batch == 1 or not spread:
        return [ctx] * batch
    return [max(1, round(ctx * (1 - spread * i / (batch - 1)))) for i in range(batch)]


def check_triton(env, args, case, qs, row, jobs):
    """Relative error against the reference, then the eager (and graphed) timing of each
    config added to ``jobs``.

    Every config is checked against the reference before it is timed; one that fails to
    compile (e.g. out of shared memory) or is wrong is recorded as such and not timed.
    The first config is the reported one and must work.
    """
    attn, meta, batch = env["attn"], case.meta, len(qs[0])
    configs = [parse_config(c, args.waves) for c in args.configs]
    limits = {} if args.max_splits is None else dict(max_splits=args.max_splits)
    if args.balance_min_work is not None:
        limits["balance_min_work"] = args.balance_min_work
    backends = []
    for bn, w, s, waves, balance in configs:
        launch = {} if bn is None else dict(block_n=bn, num_warps=w, num_stages=s)
        backends.append(attn.get_backend("triton", env["device"], waves=waves, num_splits=args.num_splits,
                                         min_split_tokens=args.min_split_tokens, balance=balance, **limits,
                                         prefill_rows=args.prefill_rows, **launch))
    ref, rows = reference(env, args, case, batch)
    out = backends[0](*case.args())
    row["rel_err"], row["ref_rows"] = rel_err(out[rows], ref), rows.stop - rows.start
    graphs = env["device"].type == "cuda" and not args.no_graphs
    row["configs"] = []
    for i, ((bn, w, s, waves, balance), backend) in enumerate(zip(configs, backends)):
        call = lambda q, b=backend: b(q, case.k_cache, case.v_cache, meta, case.scale)
        how = env["decode_launch"](batch * row["hkv"], row["ctx"], row["head_dim"], env["num_sms"], backend.config,
                                   balanced=batch > 1, group=row["hq"] // row["hkv"])  # as the backend's decode decides
        timing = dict(block_n=how.block_n, num_warps=how.num_warps, num_stages=how.num_stages, waves=waves,
                      num_splits=how.num_splits, budget_splits=how.budget_splits, balance=balance,
                      auto=bn is None)
        row["configs"].append(timing)
        try:
            timing["rel_err"] = row["rel_err"] if i == 0 else rel_err(call(case.q)[rows], ref)
        except Exception as exc:
            if i == 0:
                raise
            timing["status"] = f"error: {type(exc).__name__}: {exc}"[:200]
            continue
        if not timing["rel_err"] < 1e-2:
            timing["status"] = "WRONG"
            continue
        jobs.add(timing, "us", lambda i, c=call: c(qs[i % len(qs)]))
        if graphs:
            jobs.add(timing, "graph_us", graph_replay(env, call, qs))
        if i == 0 and args.prepared:
            add_prepared(env, backend, case, qs, row, "triton", jobs, graphs)
        if i == 0 and args.separate_merge:
            add_separate_merge(env, backend, case, qs, row, jobs, graphs, args.prepared)
    return out, (ref, rows)


def add_separate_merge(env, backend, case, qs, row, jobs, graphs, prepared):
    """The reported config with the merge as a kernel of its own (``fused_merge=False``),
    on the step's prepared plan where ``prepared``, as ``row["triton_separate_merge_us"]``;
    ``row["separate_merge_rel_err"]`` its output against the fused merge's."""
    separate = env["attn"].get_backend("triton", env["device"],
                                       **{**vars(backend.config), "fused_merge": False})
    meta = case.meta
    if prepared:
        shape = env["attn"].CallShape(row["hq"], row["hkv"], row["head_dim"], row["block_size"], case.q.dtype)
        meta = separate.prepare(case.meta, shape)
    call = lambda q: separate(q, case.k_cache, case.v_cache, meta, case.scale)
    row["separate_merge_rel_err"] = rel_err(call(case.q), backend(*case.args()))
    jobs.add(row, "triton_separate_merge_us", graph_replay(env, call, qs) if graphs else
             lambda i: call(qs[i % len(qs)]))


def add_prepared(env, backend, case, qs, row, name, jobs, graphs):
    """``name``'s call on the step's prepared schedule (``backend.prepare`` once, outside the
    timing) added to ``jobs`` as ``row[name + "_prepared_us"]``; ``row[name + "_prepared"]``
    says whether the backend prepared anything for this shape."""
    shape = env["attn"].CallShape(row["hq"], row["hkv"], row["head_dim"], row["block_size"], case.q.dtype)
    meta = backend.prepare(case.meta, shape)
    row[f"{name}_prepared"] = meta.prepared is not None
    call = lambda q: backend(q, case.k_cache, case.v_cache, meta, case.scale)
    jobs.add(row, f"{name}_prepared_us", graph_replay(env, call, qs) if graphs else lambda i: call(qs[i % len(qs)]))


def reference(env, args, case, batch):
    """The torch reference for some of the output rows: ``(ref, rows)``, ``rows`` a slice of
    the output. Decode: the first ``--ref-requests`` requests. Chunks: request 0's last 128
    rows at most (the reference holds a ``[Hq, rows, ctx]`` score matrix)."""
    attn, meta = env["attn"], case.meta
    if args.query_len == 1:
        n = min(batch, args.ref_requests)
        sub = attn.AttentionMetadata(meta.query_start_loc[: n + 1], meta.seq_lens[:n], meta.block_table[:n],
                                     1, meta.max_seq_len)
        rows = slice(0, n)
    else:
        n = min(args.query_len, 128)
        starts = env["torch"].tensor([0, n], dtype=env["torch"].int32, device=env["device"])
        sub = attn.AttentionMetadata(starts, meta.seq_lens[:1], meta.block_table[:1], n, meta.max_seq_len)
        rows = slice(args.query_len - n, args.query_len)
    return attn.get_backend("torch")(case.q[rows], case.k_cache, case.v_cache, sub, case.scale), rows


def summarize_triton(row, graphs):
    """The reported config's times and the best config, once the jobs have run."""
    timed = [c for c in row["configs"] if "us" in c]
    first = row["configs"][0]
    row["num_splits"] = first["num_splits"]
    row["launch"] = f"{first['block_n']}:{first['num_warps']}:{first['num_stages']} s{first['num_splits']}"
    if first["budget_splits"]:
        row["launch"] += f"/{first['budget_splits']}"
    row["triton_us"] = row["configs"][0]["us"]
    row["triton_best_us"] = min(c["us"] for c in timed)
    if graphs:
        row["triton_graph_us"] = row["configs"][0]["graph_us"]
        best = min(timed, key=lambda c: c["graph_us"])
        row["triton_best_graph_us"] = best["graph_us"]
        row["best_config"] = (f"{best['block_n']}:{best['num_warps']}:{best['num_stages']}:{best['waves']}"
                              f"@{best['balance'] or 'auto'}")


def check_library(env, name, args, case, qs, row, ref, jobs):
    """A library's backend (``fa3``, ``fa4``, ``auto``) over the same paged cache: checked on the
    reference's requests, then its eager and (on CUDA) graphed timing added to ``jobs``; a
    failure is recorded, not raised."""
    meta, (ref, rows) = case.meta, ref
    try:
        backend = env["attn"].get_backend(name, env["device"])
        call = lambda q: backend(q, case.k_cache, case.v_cache, meta, case.scale)
        row[f"{name}_rel_err"] = rel_err(call(case.q)[rows], ref)
    except Exception as exc:
        row[f"{name}_status"] = f"error: {type(exc).__name__}: {exc}"[:200]
        return
    if not row[f"{name}_rel_err"] < 1e-2:
        row[f"{name}_status"] = "WRONG"
        return
    eager = lambda i: call(qs[i % len(qs)])
    jobs.add(row, f"{name}_eager_us", eager)
    jobs.add(row, f"{name}_us", eager if args.no_graphs else graph_replay(env, call, qs))
    if args.prepared:
        add_prepared(env, backend, case, qs, row, name, jobs, env["device"].type == "cuda" and not args.no_graphs)


def check_fa3_variants(env, args, case, qs, row, ref, jobs):
    """FA3 with its split count and GQA packing fixed (``--fa3-variants``), each checked on
    the reference's requests and timed from CUDA graphs: ``row["fa3_variants"][text]`` is
    the time (us) or why not."""
    meta, (ref, rows), found = case.meta, ref, {}
    for text, num_splits, pack_gqa in args.fa3_variants:
        try:
            backend = env["attn"].get_backend("fa3", env["device"], num_splits=num_splits, pack_gqa=pack_gqa)
            call = lambda q, b=backend: b(q, case.k_cache, case.v_cache, meta, case.scale)
            err = rel_err(call(case.q)[rows], ref)
        except Exception as exc:
            found[text] = f"error: {type(exc).__name__}: {exc}"[:200]
            continue
        if err < 1e-2:
            jobs.add(found, text, graph_replay(env, call, qs) if not args.no_graphs else
                     lambda i, c=call: c(qs[i % len(qs)]))
        else:
            found[text] = f"WRONG (rel_err {err:.3g})"
    row["fa3_variants"] = found


def parse_config(text: str, waves: int):
    """``"auto[@balance]"`` or ``"block_n:num_warps:num_stages[:waves][@balance]"`` ->
    ``(bn, w, s, waves, balance)`` (``None`` launch fields: the backend's own choice)."""
    spec, _, bal = text.partition("@")
    try:
        balance = int(bal) if bal else None  # None: the backend's own choice per shape
        parts = [] if spec == "auto" else [int(x) for x in spec.split(":")]
    except ValueError:
        parts, balance = [0], 0
    if spec == "auto" and (balance is None or balance >= 1):
        return None, None, None, waves, balance
    if len(parts) not in (3, 4) or (balance is not None and balance < 1):
        raise SystemExit(f"--configs {text!r}: expected block_n:num_warps:num_stages[:waves][@balance] "
                         f"or auto[@balance]")
    return (*parts[:3], parts[3] if len(parts) == 4 else waves, balance)


def check_contiguous_kernels(env, case, qs, out, row, jobs):
    """SDPA (and flash-attn) on contiguous K/V copies of the pages, added to ``jobs``."""
    F = env["F"]
    batch, hq, hkv, d, scale = row["B"], row["hq"], row["hkv"], row["head_dim"], case.scale
    k = attn_gather(env, case.k_cache, case.meta.block_table, row["ctx"])  # [B, Hkv, ctx, d]
    v = attn_gather(env, case.v_cache, case.meta.block_table, row["ctx"])
    if row["query_len"] > 1:  # a whole prompt (the chunk is the context): causal, [B, Hq, ctx, d]
        q4 = [q.view(batch, row["ctx"], hq, d).transpose(1, 2) for q in qs]
        sdpa = lambda i: F.scaled_dot_product_attention(q4[i % len(q4)], k, v, scale=scale, is_causal=True,
                                                        enable_gqa=True)
        row["sdpa_rel_err"] = rel_err(sdpa(0).transpose(1, 2).reshape(out.shape), out)
        jobs.add(row, "sdpa_us", sdpa)
        return
    q4 = [q.unsqueeze(2) for q in qs]  # [B, Hq, 1, d]
    sdpa = lambda i: F.scaled_dot_product_attention(q4[i % len(q4)], k, v, scale=scale, enable_gqa=True)
    row["sdpa_rel_err"] = rel_err(sdpa(0).squeeze(2), out)
    jobs.add(row, "sdpa_us", sdpa)
    qf = [q.view(batch, hkv, hq // hkv, d) for q in qs]  # the group folded into the query length
    jobs.add(row, "sdpa_fold_us", lambda i: F.scaled_dot_product_attention(qf[i % len(qf)], k, v, scale=scale))
    if env["flash"] is not None:
        kf, vf = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, ctx, Hkv, d]
        qq, fa, lens = [q.unsqueeze(1) for q in qs], env["flash"].flash_attn_with_kvcache, case.meta.seq_lens
        jobs.add(row, "flash_us", lambda i: fa(qq[i % len(qq)], kf, vf, cache_seqlens=lens, softmax_scale=scale))


def add_copy(env, row, jobs):
    """The ceiling: a device copy moving ``kv_bytes`` (reads half of it, writes half)."""
    src = env["torch"].empty(row["kv_bytes"] // 2, dtype=env["torch"].uint8, device=env["device"])
    dst = env["torch"].empty_like(src)
    jobs.add(row, "copy_us", lambda i: dst.copy_(src))  # reads kv_bytes/2, writes kv_bytes/2


SMALL_CASES = [
    # (query_lens, seq_lens, Hq, Hkv, head_dim, block_size, dtype, options)
    ([1, 1, 1], [1000, 17, 300], 8, 1, 128, 16, "bfloat16", {}),
    ([1, 1], [5000, 4099], 16, 1, 128, 16, "bfloat16", dict(num_splits=7)),
    ([1, 0, 1], [77, 5, 260], 8, 2, 64, 32, "float16", dict(num_splits=3, block_n=32)),
    ([1, 1], [333, 1025], 4, 4, 96, 8, "float32", dict(num_splits=2)),
    ([37, 1, 1, 200], [37, 900, 15, 700], 8, 1, 128, 16, "bfloat16", {}),
    ([64, 3], [64, 1000], 16, 2, 128, 256, "float16", dict(num_splits=4)),
]


def check_small_cases(env, dry_run):
    """Decode and mixed batches, several dtypes/shapes, against the reference; returns rows."""
    torch, attn, testing = env["torch"], env["attn"], env["testing"]
    rows = []
    for i, (ql, sl, hq, hkv, d, bs, dt, opts) in enumerate(SMALL_CASES[:2] if dry_run else SMALL_CASES):
        if dry_run:  # the interpreter is slow: shrink the contexts
            sl, ql, d = [min(s, 70) for s in sl], [min(q, 1) for q in ql], 32
        case = testing.make_paged_case(ql, sl, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                                       dtype=getattr(torch, dt), device=env["device"], seed=i)
        out = attn.get_backend("triton", env["device"], **opts)(*case.args())
        ref = attn.get_backend("torch")(*case.args())
        err = rel_err(out, ref) if bool(torch.isfinite(out.float()).all()) else float("inf")
        rows.append(dict(case=i, dtype=dt, rel_err=err, ok=err < (1e-4 if dt == "float32" else 1e-2)))
        if dt != "float32":
            rows += [check_library_case(env, name, i, dt, case, ref) for name in env["libraries"]]
    if env["device"].type == "cuda":
        for hq, hkv, d, balance in ((12, 1, 192, None), (8, 1, 128, 2)):
            rows.append(check_graph_replay(env, hq, hkv, d, balance))
    return rows


def check_library_case(env, name, i, dt, case, ref):
    """One small case through a library's backend: ``ok`` False if wrong, None if it
    refuses the shape. The cases leave NaN in every cache slot no request owns; where that
    NaN reaches the output (FA3 at pages of 128+ tokens loads a request's last page whole:
    ``attention/per_shape.py``), the case is run again with those slots zeroed, as the
    engine's cache starts, and the row says so."""
    torch = env["torch"]
    try:
        backend = env["attn"].get_backend(name, env["device"])
        out = backend(*case.args())
    except Exception as exc:
        return dict(case=f"{i} {name}", dtype=dt, ok=None, status=f"refused: {type(exc).__name__}: {exc}"[:200])
    row = dict(case=f"{i} {name}", dtype=dt)
    if not bool(torch.isfinite(out.float()).all()):
        row["status"] = "NaN in unowned page slots reached the output; rel_err with them zeroed"
        out = backend(case.q, case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0), case.meta, case.scale)
    err = rel_err(out, ref) if bool(torch.isfinite(out.float()).all()) else float("inf")
    return dict(row, rel_err=err, ok=err < 1e-2)


def check_graph_replay(env, hq, hkv, d, balance):
    """A decode call captured in a CUDA graph at short lengths, replayed after the lengths
    and queries change in place to long ones (as the engine's static inputs do): the
    balanced slice length must be recomputed inside the graph, or the long requests would
    need more slices than the grid has. Compared with the reference at the new lengths."""
    torch, attn, testing = env["torch"], env["attn"], env["testing"]
    bound, block = 4096, 16
    case = testing.make_paged_case([1] * 8, [50] * 8, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=block,
                                   dtype=torch.bfloat16, device=env["device"], seed=7, pad_blocks=bound // block,
                                   poison=False)  # the new lengths read the padding entries
    meta = attn.AttentionMetadata(case.meta.query_start_loc, case.meta.seq_lens.clone(), case.meta.block_table, 1,
                                  bound)  # the grid is sized for the bound, as a captured bucket's is
    backend = attn.get_backend("triton", env["device"], balance=balance, balance_min_work=0)  # balanced
    how = env["decode_launch"](8 * hkv, bound, d, env["num_sms"], backend.config, balanced=True)
    q = case.q.clone()
    (graph,), (out,) = capture_graphs(torch, [lambda: backend(q, case.k_cache, case.v_cache, meta, case.scale)])
    graph.replay()
    meta.seq_lens.copy_(torch.tensor([4000, 17, 3900, 64, 2600, 5, 1200, 4090], dtype=torch.int32,
                                     device=env["device"]))
    q.copy_(torch.randn_like(q))
    graph.replay()
    ref = attn.get_backend("torch")(q, case.k_cache, case.v_cache, meta, case.scale)
    err = rel_err(out, ref)
    return dict(case=f"graph replay {hq}/{hkv}/{d}, budget {how.budget_splits} of {how.num_splits} splits",
                dtype="bfloat16", rel_err=err, ok=how.budget_splits > 0 and err < 1e-2)


def capture_graphs(torch, fns):
    """Warm each of ``fns`` up on a side stream (compiles, allocates), then capture each in
    a CUDA graph; returns ``(graphs, outputs of the captured calls)``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graphs, outs = [], []
    for fn in fns:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(fn())
        graphs.append(graph)
    return graphs, outs


def graph_replay(env, call, qs):
    """``fn(i)`` replaying ``call(q)`` from CUDA graphs, one graph per query set (captured
    now, kept alive by ``fn``)."""
    graphs, _ = capture_graphs(env["torch"], [lambda q=q: call(q) for q in qs])
    return lambda i: graphs[i % len(graphs)].replay()


def attn_gather(env, cache, block_table, ctx):
    """``[B, Hkv, ctx, d]`` contiguous copy of the requests' pages."""
    return env["paging"].gather_pages(cache, block_table, ctx).transpose(1, 2).contiguous()


def fmt_table(rows):
    extra = [c for c in ("launch", "triton_graph_us", "triton_prepared_us", "triton_separate_merge_us",
                         "triton_best_graph_us", "best_config", "fa3_us", "fa4_us",
                         "auto_us", "flash_us", "triton_graph_TFLOPs", "fa3_TFLOPs", "sdpa_TFLOPs")
             if any(c in r for r in rows)]
    lines = ["  ".join(f"{c:>11}" for c in COLUMNS + extra)]
    for r in rows:
        head = [r["B"], r["ctx"], f"{r['hq']}/{r['hkv']}/{r.get('head_dim', '')}"]
        if r.get("status") not in ("ok", "WRONG"):
            lines.append("  ".join(f"{v!s:>11}" for v in head) + f"  {r.get('status')}")
            continue
        vals = head + [r.get(c, "-") for c in COLUMNS[3:]] + [r.get(c, "") for c in extra]
        cells = [f"{v:>11.3g}" if isinstance(v, float) else f"{v!s:>11}" for v in vals]
        lines.append("  ".join(cells) + ("" if r["status"] == "ok" else "  WRONG"))
    return "\n".join(lines)


def setup(args):
    """Import torch and the package (after TRITON_INTERPRET is set for dry runs)."""
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.nn.functional as F

    import tknp_megatron.attention as attn
    from tknp_megatron.attention import paging, testing
    from tknp_megatron.attention import decode_launch, device_num_sms

    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{os.path.basename(sys.argv[0])}: error: no CUDA device; use --dry-run for a CPU check",
              file=sys.stderr)
        raise SystemExit(2)
    try:
        import flash_attn
        if not hasattr(flash_attn, "flash_attn_with_kvcache"):  # flash-attn-4 alone: no 2.x API
            flash_attn = None
    except Exception:
        flash_attn = None
    if testing.PAGE_ORDERS != PAGE_ORDERS:
        raise SystemExit(f"bench_attention's PAGE_ORDERS {PAGE_ORDERS} differ from attention/testing.py's")
    num_sms = device_num_sms(device)
    libraries = [n for n in LIBRARIES if device.type == "cuda" and n in attn.available_backends(device)]
    if "fa3" in libraries:  # the default backend then differs from triton: its own column
        libraries.append("auto")
    return dict(libraries=libraries, torch=torch, F=F, attn=attn, paging=paging, testing=testing, device=device, num_sms=num_sms,
                decode_launch=decode_launch, flash=flash_attn if device.type == "cuda" else None,
                timer=Timer(torch, device, args.warmup, args.reps, not args.no_flush))


def main(argv=None) -> int:
    args = parse_args(argv)
    env = setup(args)
    torch = env["torch"]
    rows = []
    t0 = time.time()
    checks = check_small_cases(env, args.dry_run)
    print("small cases:", json.dumps(checks), flush=True)
    for batch in args.batch:
        for ctx in args.ctx:
            for hq, hkv, head_dim in args.shapes:
                try:
                    row = run_shape(env, args, batch, ctx, hq, hkv, head_dim)
                except torch.cuda.OutOfMemoryError as exc:
                    row = dict(B=batch, ctx=ctx, hq=hq, hkv=hkv, head_dim=head_dim,
                               status=f"skipped: OOM ({str(exc)[:80]})")
                except Exception as exc:  # keep going: one broken shape must not lose the others
                    row = dict(B=batch, ctx=ctx, hq=hq, hkv=hkv, head_dim=head_dim,
                               status=f"error: {type(exc).__name__}: {exc}"[:300])
                rows.append(row)
                print(json.dumps(row), flush=True)
                if env["device"].type == "cuda":
                    torch.cuda.empty_cache()
    info = dict(device=torch.cuda.get_device_name() if env["device"].type == "cuda" else "cpu (interpreter)",
                torch=torch.__version__, num_sms=env["num_sms"], seconds=time.time() - t0, args=vars(args),
                small_cases=checks, results=rows)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(info, indent=1))
    print(f"\n{info['device']}, {args.dtype}, block={args.block_size}, {info['seconds']:.0f} s")
    print(f"small cases: {sum(c['ok'] is True for c in checks)}/{len(checks)} ok"
          + "".join(f"; {c['case']} {c['status']}" for c in checks if c["ok"] is None))
    print(fmt_table(rows), flush=True)
    wrong = [r for r in rows if r.get("status") == "WRONG" or r.get("status", "").startswith("error")
             or any(r.get(f"{n}_status") == "WRONG" for n in env["libraries"])]
    return 0 if all(c["ok"] is not False for c in checks) and not wrong else 1


def cli() -> None:
    """Console entry point: :func:`main`, then exit at once (:func:`~tknp_megatron.launch.exit_with`)."""
    from tknp_megatron.launch import exit_with

    exit_with(main)


if __name__ == "__main__":
    cli()
