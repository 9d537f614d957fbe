"""Probe: FlashInfer's paged decode kernels, and cuDNN's paged decode through FlashInfer, over
the engine's cache, against the Triton kernel, SDPA over contiguous K/V and a device copy.

The question (the kernels to choose from per shape, ``docs/ARCHITECTURE.md``, "Kernels per
shape"): does a library kernel read the engine's 16-token pages (``[blocks, 16, Hkv, d]``,
FlashInfer's NHD layout) at SDPA's speed over contiguous K/V, where the Triton kernel and FA3
stay 1-8 % behind it at head dim 128 (``benchmarks/RESULTS.md``)? Columns, each checked
against torch's reference on 16 requests, then replayed from CUDA graphs and timed in turn
(``bench_attention.Timer``: L2 flushed before every call, median):

- ``fi``: ``BatchDecodeWithPagedKVCacheWrapper``, its CUDA-core decode kernel;
- ``fi_tc``: the same wrapper with ``use_tensor_cores`` (its FA2 prefill kernel with a
  one-row query per request);
- ``cudnn``: ``cudnn_batch_decode_with_kv_cache``, cuDNN's SDPA over the page table, the
  engine's pages seen as ``[blocks, Hkv, 16, d]`` through strides (``cudnn_hnd``: over a
  copy stored so, the layout cuDNN's documentation names); only when ``VARIANTS`` names
  them (on an H100 torch's own cuDNN attention failed in the same process after them);
- ``triton`` (the ``triton`` backend's own launch), ``sdpa`` (contiguous K/V), ``copy``.

FlashInfer plans each batch on the host (page lists, its split schedule) before its kernel
runs: that plan runs once per shape, outside the timing, and its host time is reported
(``fi_plan_ms``). Each (kernel, head dim) is compiled first, in parallel processes
(FlashInfer compiles its kernels with ``nvcc`` on first use) and tried on 32 requests of 8K
tokens, eagerly and from a CUDA graph: a kernel that fails there is left out of the timing
process (a fault would end it). A failure is recorded, not raised.

Shapes are timed in worker processes: after a CUDA fault (which leaves a process's context
unusable) the driver starts a new worker at the same shape without the variant that was
running, and stops after four faults. Rows go to ``rows.jsonl`` as they finish, the summary
to ``flashinfer_probe.json``; results in ``benchmarks/RESULTS.md``, "FlashInfer over the
engine's pages".

A benchmark probe, not the library. On a GPU where ``flashinfer`` (and, for the cuDNN
columns, ``cudnn`` from ``nvidia-cudnn-frontend``) import: ``python
benchmarks/scripts/flashinfer_probe.py`` (``OUT`` for the JSON; ``VARIANTS``, default
``fi fi_tc``; ``HEADS``, e.g. ``"8:1:128 64:8:128"``; ``SHAPES=quick``; ``REPS``).
``--dry-run`` on CPU checks the page lists FlashInfer is given against the block table.
"""
import json
import os
import subprocess
import sys
import time

import torch

from tknp_megatron.attention import paging, testing

PAGE = 16
# the library columns; cuDNN's only when asked (VARIANTS="fi fi_tc cudnn cudnn_hnd"): on an H100
# (2026-12-06) torch's own cuDNN SDPA then failed or faulted in the same process
VARIANTS = tuple(os.environ.get("VARIANTS", "fi fi_tc").split())


def page_lists(seq_lens: torch.Tensor, block_table: torch.Tensor, page: int):
    """FlashInfer's description of a decode batch's pages, on the host: ``(indptr [R + 1],
    indices [pages], last_page_len [R])`` int32 from ``seq_lens [R]`` and ``block_table [R, W]``
    (request ``r``'s pages are ``indices[indptr[r]:indptr[r + 1]]``, its last holding
    ``last_page_len[r]`` tokens)."""
    lens = seq_lens.cpu().long()
    pages = (lens + page - 1) // page
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = pages.cumsum(0)
    table = block_table.cpu()
    owned = torch.arange(table.shape[1]) < pages[:, None]
    return indptr, table[owned].to(torch.int32), (lens - (pages - 1) * page).to(torch.int32)


def dry_run() -> list:
    """Each request's tokens read through the page lists equal its tokens read through the
    block table (``paging.gather_pages``)."""
    rows = []
    for i, lens in enumerate(([33, 16, 1, 70], [5, 200, 17])):
        case = testing.make_paged_case([1] * len(lens), lens, num_heads=4, num_kv_heads=2, head_dim=8,
                                       block_size=PAGE, seed=i, poison=False)
        indptr, indices, last = page_lists(case.meta.seq_lens, case.meta.block_table, PAGE)
        want = paging.gather_pages(case.k_cache, case.meta.block_table, max(lens))  # [R, ctx, Hkv, d]
        err = 0.0
        for r, n in enumerate(lens):
            mine = case.k_cache[indices[indptr[r]:indptr[r + 1]].long()].flatten(0, 1)
            assert int((len(mine) - PAGE) + last[r]) == n
            err = max(err, float((mine[:n] - want[r, :n]).abs().max()))
        rows.append(dict(lens=lens, pages=int(indptr[-1]), max_err=err))
    return rows


def flashinfer_call(fi, case, hq, hkv, d, tc, workspace):
    """``(call(q), plan host ms)`` for FlashInfer's wrapper over ``case``'s pages."""
    device = case.q.device
    indptr, indices, last = page_lists(case.meta.seq_lens, case.meta.block_table, PAGE)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
        paged_kv_indptr_buffer=torch.empty_like(indptr, device=device),
        paged_kv_indices_buffer=torch.empty_like(indices, device=device),
        paged_kv_last_page_len_buffer=torch.empty_like(last, device=device),
        backend="fa2" if tc else "auto")
    start = time.perf_counter()
    wrapper.plan(indptr, indices, last, hq, hkv, d, PAGE, pos_encoding_mode="NONE",
                 q_data_type=case.q.dtype, kv_data_type=case.k_cache.dtype, sm_scale=case.scale)
    plan_ms = (time.perf_counter() - start) * 1e3
    return (lambda q: wrapper.run(q, (case.k_cache, case.v_cache))), plan_ms


def cudnn_call(fi, case, ctx, workspace, contiguous=False):
    """``call(q)`` for cuDNN's paged decode over ``case``'s pages: the engine's pages seen as
    ``[blocks, Hkv, PAGE, d]`` through strides, or (``contiguous``) a copy stored so."""
    width = -(-ctx // PAGE)
    table = case.meta.block_table[:, :width].contiguous()
    lens = case.meta.seq_lens.view(-1, 1, 1, 1).contiguous()
    k, v = case.k_cache.transpose(1, 2), case.v_cache.transpose(1, 2)  # [blocks, Hkv, PAGE, d]
    if contiguous:
        k, v = k.contiguous(), v.contiguous()
    return lambda q: fi.cudnn_batch_decode_with_kv_cache(
        q, k, v, case.scale, workspace, max_sequence_kv=ctx, actual_seq_lens_kv=lens, block_tables=table,
        is_cuda_graph_compatible=True)


def make_call(fi, variant, case, hq, hkv, d, ctx, workspace):
    if variant.startswith("cudnn"):
        return cudnn_call(fi, case, ctx, workspace, variant == "cudnn_hnd"), None
    return flashinfer_call(fi, case, hq, hkv, d, variant == "fi_tc", workspace)


def warm(variant: str, hq: int, hkv: int, d: int) -> None:
    """Compile ``variant`` for one head shape, then run it on 32 requests of 8K tokens eagerly
    and from a CUDA graph against torch's reference: exit 0 only if both match (a kernel that
    faults leaves its CUDA context unusable, so it is tried here, not in the timing process)."""
    import flashinfer as fi

    from tknp_megatron.attention import get_backend
    from tknp_megatron.tools import bench_attention as ba

    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    for batch, ctx in ((2, 100), (32, 8192)):
        case = testing.make_paged_case([1] * batch, [ctx] * batch, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                                       block_size=PAGE, dtype=torch.bfloat16, device="cuda")
        call, _ = make_call(fi, variant, case, hq, hkv, d, ctx, workspace)
        ref = get_backend("torch")(*case.args())
        eager = call(case.q)
        torch.cuda.synchronize()
        (graph,), (replayed,) = ba.capture_graphs(torch, [lambda: call(case.q)])
        graph.replay()
        torch.cuda.synchronize()
        for out in (eager, replayed):
            err = ba.rel_err(out, ref)
            print(f"B={batch} ctx={ctx} rel_err {err:.2e}", flush=True)
            if not err < 1e-2:
                sys.exit(3)


def compile_ahead(shapes) -> dict:
    """Every (variant, head shape) compiled and tried (:func:`warm`) in its own process, all at
    once: seconds, exit codes, and the last lines of each failure's log."""
    t0, procs = time.time(), {}
    for variant in VARIANTS:
        for hq, hkv, d in sorted(set(shapes)):
            key = f"{variant}:{hq}:{hkv}:{d}"
            procs[key] = subprocess.Popen([sys.executable, __file__, "--warm", variant, str(hq), str(hkv), str(d)],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    codes, why = {}, {}
    for key, proc in procs.items():
        try:
            log = proc.communicate(timeout=max(1, 240 - (time.time() - t0)))[0]
            codes[key] = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            log, codes[key] = proc.communicate()[0], "timeout"
        if codes[key] != 0:
            kept = [x for x in log.splitlines() if x.strip() and not x.lstrip().startswith(("nanobind", "- ", "See "))]
            why[key] = "\n".join(kept[-3:])[-400:]
    return dict(seconds=round(time.time() - t0, 1), exit=codes, failures=why)


def run_shape(env, ba, fi, args, batch, ctx, hq, hkv, d, workspace, usable):
    """Check and time one shape; ``usable(variant, elements)`` says whether a variant runs at
    a cache of that many elements (a variant that faulted is left out from that size on)."""
    torch_, device = env["torch"], env["device"]
    elements = batch * ctx * hkv * d
    row = dict(B=batch, ctx=ctx, hq=hq, hkv=hkv, head_dim=d, query_len=1, kv_bytes=4 * elements)
    cap = torch_.cuda.get_device_properties(device).total_memory / 6  # cache, contiguous and HND copies, copy
    if row["kv_bytes"] > cap:
        row["status"] = f"skipped: K+V over {cap / 2**30:.0f} GiB"
        return row
    case = testing.make_paged_case([1] * batch, [ctx] * batch, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                                   block_size=PAGE, dtype=torch.bfloat16, device=device, seed=batch + ctx + hq)
    qs = [case.q] + [torch_.randn_like(case.q) for _ in range(3)]
    ref, rows = ba.reference(env, args, case, batch)
    jobs = ba.Jobs()
    triton = env["attn"].get_backend("triton", device)
    tcall = lambda q: triton(q, case.k_cache, case.v_cache, case.meta, case.scale)
    out = tcall(case.q)
    row["triton_rel_err"] = ba.rel_err(out[rows], ref)
    jobs.add(row, "triton_us", ba.graph_replay(env, tcall, qs))
    for variant in VARIANTS:
        why = usable(variant, hq, hkv, d, elements)
        if why:
            row[f"{variant}_status"] = why
            continue
        print(f"TRY {variant} {elements}", flush=True)  # the driver's record, should this fault
        try:
            call, plan_ms = make_call(fi, variant, case, hq, hkv, d, ctx, workspace)
            if plan_ms is not None:
                row[f"{variant}_plan_ms"] = plan_ms
            row[f"{variant}_rel_err"] = ba.rel_err(call(case.q)[rows], ref)
            torch_.cuda.synchronize()
            if not row[f"{variant}_rel_err"] < 1e-2:
                row[f"{variant}_status"] = "WRONG"
                continue
            jobs.add(row, f"{variant}_us", ba.graph_replay(env, call, qs))
            torch_.cuda.synchronize()
        except Exception as exc:  # keep the shape's other columns, unless the context is lost
            if faulted(exc):
                raise
            row[f"{variant}_status"] = f"error: {type(exc).__name__}: {exc}"[:300]
    print("TRY timing 0", flush=True)
    ba.check_contiguous_kernels(env, case, qs, out, row, jobs)
    ba.add_copy(env, row, jobs)
    jobs.run(env["timer"])
    for name in ("triton", *VARIANTS, "sdpa", "copy"):
        if f"{name}_us" in row:
            row[f"{name}_TBps"] = row["kv_bytes"] / (row[f"{name}_us"] * 1e-6) / 1e12
            if name not in ("sdpa", "copy"):
                row[f"{name}_over_sdpa"] = row[f"{name}_us"] / row["sdpa_us"]
    row["status"] = "ok"
    return row


def faulted(exc: Exception) -> bool:
    """Whether ``exc`` is a CUDA fault, after which this process's CUDA context is unusable."""
    return isinstance(exc, getattr(torch, "AcceleratorError", ())) or "CUDA error" in str(exc)


def sweep():
    """The shapes, the decisive ones first: ``[(B, ctx, hq, hkv, d)]``."""
    if os.environ.get("SHAPES") == "quick":
        heads, batches, ctxs = [(64, 8, 128), (8, 1, 128)], [32, 128], [32768]
    else:
        heads = [(64, 8, 128), (8, 1, 128), (16, 1, 128)]  # FlashInfer's decode takes no head dim 192
        if any(v.startswith("cudnn") for v in VARIANTS):
            heads += [(96, 8, 192), (12, 1, 192)]
        if os.environ.get("HEADS"):  # e.g. HEADS="8:1:128 64:8:128"
            heads = [tuple(map(int, h.split(":"))) for h in os.environ["HEADS"].split()]
        batches, ctxs = [128, 32, 256, 8, 1], [32768, 131072, 4096]
    return heads, [(b, c, *h) for c in ctxs for b in batches for h in heads]


def worker(first: int, plan: dict) -> None:
    """Time shapes ``first`` on, appending each row to ``rows.jsonl`` (``plan``: the compile
    results and the sizes at which a variant faulted)."""
    from tknp_megatron.tools import bench_attention as ba

    import flashinfer as fi

    args = ba.parse_args(["--reps", os.environ.get("REPS", "20")])
    env = ba.setup(args)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")

    def usable(variant, hq, hkv, d, elements):
        code = plan["compile"]["exit"].get(f"{variant}:{hq}:{hkv}:{d}")
        if code != 0:
            return f"not compiled ({code})"
        if elements >= plan["faulted"].get(variant, float("inf")):
            return f"left out: faulted at {plan['faulted'][variant]} cache elements"
        return ""

    _, shapes = sweep()
    for i in range(first, len(shapes)):
        print(f"ROW {i}", flush=True)
        try:
            row = run_shape(env, ba, fi, args, *shapes[i], workspace, usable)
        except Exception as exc:
            if faulted(exc):
                raise  # the driver starts a new worker
            batch, ctx, hq, hkv, d = shapes[i]
            row = dict(B=batch, ctx=ctx, hq=hq, hkv=hkv, head_dim=d, status=f"error: {type(exc).__name__}: {exc}"[:300])
        with open(os.path.join(plan["out"], "rows.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def main() -> int:
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    if "--dry-run" in sys.argv:
        rows = dry_run()
        json.dump(rows, open(os.path.join(out, "flashinfer_probe.json"), "w"), indent=1)
        print(json.dumps(rows))
        return 0 if all(r["max_err"] == 0 for r in rows) else 1
    import flashinfer as fi

    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    heads, shapes = sweep()
    plan = dict(out=out, compile=compile_ahead(heads), faulted={})
    print("compiled:", json.dumps(plan["compile"]["exit"]), flush=True)
    rows_file = os.path.join(out, "rows.jsonl")
    if os.path.exists(rows_file):
        os.remove(rows_file)
    first, faults = 0, []
    while first < len(shapes):  # a worker a fault ends is started again past what faulted
        proc = subprocess.run([sys.executable, __file__, "--worker", str(first), json.dumps(plan)],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            break
        marks = [x.split() for x in proc.stdout.splitlines() if x.startswith(("ROW ", "TRY "))]
        rows_done = [int(m[1]) for m in marks if m[0] == "ROW"]
        tried = [m for m in marks if m[0] == "TRY"]
        at = rows_done[-1] if rows_done else first
        tail = [x for x in proc.stderr.splitlines() if "Error" in x][-1:]
        faults.append(dict(row=at, shape=shapes[at], tried=tried[-1][1] if tried else None, error=tail))
        print("fault:", json.dumps(faults[-1]), flush=True)
        if len(faults) >= 4:  # each new worker costs tens of seconds: stop, with what is there
            break
        if tried and tried[-1][1] != "timing":
            plan["faulted"][tried[-1][1]] = min(int(tried[-1][2]), plan["faulted"].get(tried[-1][1], 1 << 62))
            first = at  # again, without the variant that faulted
        else:
            first = at + 1
    rows = [json.loads(x) for x in open(rows_file)] if os.path.exists(rows_file) else []
    info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, flashinfer=fi.__version__,
                compile=plan["compile"], faulted=plan["faulted"], faults=faults, rows=rows)
    json.dump(info, open(os.path.join(out, "flashinfer_probe.json"), "w"), indent=1)
    print("compile failures:", json.dumps({k: v[-160:] for k, v in plan["compile"]["failures"].items()}, indent=1))
    cols = ("triton", *VARIANTS)
    print(f"{'B':>4} {'ctx':>7} {'heads':>9} {'sdpa_us':>9} " + " ".join(f"{c + '/sdpa':>14}" for c in cols)
          + f" {'copy_TBps':>9} {'fi_plan_ms':>10}")
    for r in rows:
        if r.get("status") != "ok":
            print(r["B"], r["ctx"], f"{r['hq']}/{r['hkv']}/{r['head_dim']}", r.get("status"))
            continue
        ratios = " ".join(f"{r[c + '_over_sdpa']:>14.3f}" if c + "_over_sdpa" in r else f"{'-':>14}" for c in cols)
        print(f"{r['B']:>4} {r['ctx']:>7} {r['hq']:>4}/{r['hkv']}/{r['head_dim']:<3} {r['sdpa_us']:>9.1f} {ratios} "
              f"{r['copy_TBps']:>9.2f} {r.get('fi_plan_ms', float('nan')):>10.3f}", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--warm"]:
        warm(sys.argv[2], *map(int, sys.argv[3:6]))
        sys.exit(0)
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]), json.loads(sys.argv[3]))
        sys.stdout.flush()
        os._exit(0)
    code = main()
    sys.stdout.flush()
    os._exit(code)
