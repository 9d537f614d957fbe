"""Probe: paged decode attention whose K/V pages arrive by TMA (Hopper's tensor memory
accelerator), against the Triton kernel as it is, SDPA over contiguous K/V and a device copy.

The question: the Triton kernel's attention loop reads scattered 16-token pages 3-6 % slower
than cuDNN reads contiguous K/V at head dim 128 (``benchmarks/RESULTS.md``, "Where the gap to
SDPA sits"). Its K/V tiles are gathered by per-token pointer loads. Here each page is one TMA
box (``[PAGE, head_dim]`` of one KV head, through a host-made tensor descriptor over the
cache as ``[blocks * PAGE, Hkv * d]``), loaded asynchronously into shared memory and
multi-buffered by Triton's pipeliner; the loop over a slice's whole pages has no masks, and
the slice's last partial page (if any) is read by masked pointer loads. Splits follow the
production plan (``launch_split_plan``: balanced slices) and a separate merge kernel combines
them, so the probe pays one more launch per call than the production kernel (which merges in
its last program).

Variants: ``tma_sN`` (N pipeline stages), ``tma_ws`` (Triton's warp specialization of the
loop), ``ptr_peeled`` (the same loop with pointer loads, 64-token tiles: the masks alone).
Every variant's output is checked against the torch reference first.

A benchmark probe, not the library: ``python benchmarks/scripts/tma_probe.py`` on a GPU
(``OUT`` for the JSON; ``REPS``; ``SHAPES=quick``), ``--dry-run`` on CPU under Triton's
interpreter (small shapes, correctness only).
"""
import json
import os
import sys

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tknp_megatron import attention as attn
from tknp_megatron.attention import testing, triton_paged as tp


@triton.jit(do_not_specialize=["num_splits"])
def _tma_decode_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, part_ptr, lse_ptr,
    seq_lens_ptr, bt_ptr, split_tiles_ptr, work_ptr,
    scale_log2, num_splits,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    PLAN_N: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, PAIR: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One program per (work item, KV head): the slice's whole ``BLOCK_N``-token tiles
    unmasked (TMA: one page a tile), then its partial last tile masked; fp32 partial and
    log2-sum-exp out. K and V share strides (one buffer)."""
    kvh = tl.program_id(1)
    item = tl.load(work_ptr + tl.program_id(0))
    if item < 0:
        return
    req = item // num_splits
    split = item % num_splits
    split_len = tl.load(split_tiles_ptr) * PLAN_N
    seq_len = tl.load(seq_lens_ptr + req)
    kv_lo = split * split_len
    kv_hi = tl.minimum(kv_lo + split_len, seq_len)
    full_end = kv_lo + (kv_hi - kv_lo) // BLOCK_N * BLOCK_N

    m = tl.arange(0, GROUP_PAD)
    head = kvh * GROUP + m
    row_ok = m < GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + req.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    n = tl.arange(0, BLOCK_N)
    col = kvh * HEAD_DIM
    for start in tl.range(kv_lo, full_end, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        if PAIR:  # BLOCK_N == 2 * PAGE: two pages, two boxes each of K and V
            blk0 = tl.load(bt_row + start // PAGE)
            blk1 = tl.load(bt_row + start // PAGE + 1)
            k0 = k_desc.load([blk0 * PAGE, col])
            k1 = k_desc.load([blk1 * PAGE, col])
            v0 = v_desc.load([blk0 * PAGE, col])
            v1 = v_desc.load([blk1 * PAGE, col])
            if UPCAST:
                k0, k1, v0, v1 = k0.to(tl.float32), k1.to(tl.float32), v0.to(tl.float32), v1.to(tl.float32)
            s0 = tl.dot(q, tl.trans(k0)) * scale_log2
            s1 = tl.dot(q, tl.trans(k1)) * scale_log2
            m_new = tl.maximum(m_i, tl.maximum(tl.max(s0, 1), tl.max(s1, 1)))
            alpha = tl.exp2(m_i - m_new)
            p0 = tl.exp2(s0 - m_new[:, None])
            p1 = tl.exp2(s1 - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p0, 1) + tl.sum(p1, 1)
            acc = acc * alpha[:, None] + tl.dot(p0.to(v0.dtype), v0)
            acc = tl.dot(p1.to(v1.dtype), v1, acc)
            m_i = m_new
        else:
            if TMA:  # BLOCK_N == PAGE: the tile is one page
                blk = tl.load(bt_row + start // PAGE)
                k = k_desc.load([blk * PAGE, col])
                v = v_desc.load([blk * PAGE, col])
            else:
                tok = start + n
                blk = tl.load(bt_row + tok // PAGE).to(tl.int64)
                off = blk * stride_kb + (tok % PAGE) * stride_kt + kvh * stride_kh
                k = tl.load(k_ptr + off[:, None] + d[None, :])
                v = tl.load(v_ptr + off[:, None] + d[None, :])
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k)) * scale_log2
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
    if full_end < kv_hi:  # the slice's last, partial tile
        tok = full_end + n
        tok_ok = tok < kv_hi
        blk = tl.load(bt_row + tok // PAGE, mask=tok_ok, other=0).to(tl.int64)
        off = blk * stride_kb + (tok % PAGE) * stride_kt + kvh * stride_kh
        k = tl.load(k_ptr + off[:, None] + d[None, :], mask=tok_ok[:, None], other=0.0)
        v = tl.load(v_ptr + off[:, None] + d[None, :], mask=tok_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    rows = req.to(tl.int64)
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
    tl.store(lse_ptr + rows * stride_lt + head * stride_lh + split, lse, mask=row_ok)
    norm = tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o = part_ptr + rows * stride_pt + head[:, None] * stride_ph + split * stride_ps + d[None, :]
    tl.store(o, acc / norm, mask=row_ok[:, None])


class Probe:
    """A decode call over ``case`` with the balanced plan of the production launch."""

    def __init__(self, case, variant, num_sms, plan_n=64):
        q, kc = case.q, case.k_cache
        self.case, self.variant = case, variant
        R, hq, d = q.shape
        hkv, page = kc.shape[2], kc.shape[1]
        backend = attn.get_backend("triton", q.device)
        launch = backend._decode_launch(case.meta, hq, hkv, d, q.device, balanced=True)
        self.splits = max(1, launch.num_splits)
        budget = launch.budget_splits or 1
        kern = tp.load_kernels()
        self.kern = kern
        self.plan = kern.launch_split_plan(case.meta.seq_lens, budget, self.splits, plan_n, hkv)
        self.plan_n = plan_n
        self.part = torch.empty(R, hq, self.splits, d, dtype=torch.float32, device=q.device)
        self.lse = torch.empty(R, hq, self.splits, dtype=torch.float32, device=q.device)
        self.out = torch.empty(R, hq, d, dtype=q.dtype, device=q.device)
        self.tma = variant.startswith("tma")
        self.pair = variant.startswith("tma2")
        self.block_n = (2 * page if self.pair else page) if self.tma else 64
        self.stages = int(variant.split("_s")[1]) if "_s" in variant else 3
        self.ws = variant.endswith("_ws")
        flat = lambda c: c.view(c.shape[0] * page, hkv * d)
        self.k_desc = TensorDescriptor.from_tensor(flat(kc), [page, d]) if self.tma else kc
        self.v_desc = TensorDescriptor.from_tensor(flat(case.v_cache), [page, d]) if self.tma else case.v_cache
        assert case.v_cache.stride() == kc.stride()

    def __call__(self, q):
        case, kc = self.case, self.case.k_cache
        R, hq, d = q.shape
        hkv = kc.shape[2]
        meta = case.meta
        _tma_decode_kernel[(self.plan[1].shape[0], hkv)](
            q, kc, case.v_cache, self.k_desc, self.v_desc, self.part, self.lse,
            meta.seq_lens, meta.block_table, self.plan[0], self.plan[1],
            case.scale * 1.4426950408889634, self.splits,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
            self.part.stride(0), self.part.stride(1), self.part.stride(2),
            self.lse.stride(0), self.lse.stride(1), meta.block_table.stride(0),
            GROUP=hq // hkv, GROUP_PAD=max(16, triton.next_power_of_2(hq // hkv)), PAGE=kc.shape[1], HEAD_DIM=d,
            PLAN_N=self.plan_n, BLOCK_N=self.block_n, TMA=self.tma, PAIR=self.pair, STAGES=self.stages, WS=self.ws,
            UPCAST=q.device.type == "cpu", num_warps=4,
        )
        self.kern.launch_combine_splits(self.part, self.lse, self.out, self.splits, meta.seq_lens, self.plan[0],
                                        self.plan_n)
        return self.out


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    dry = "--dry-run" in sys.argv
    dev = torch.device("cpu" if dry else "cuda")
    dt = torch.float32 if dry else torch.bfloat16
    variants = ["tma_s3", "tma_s4", "tma_s6", "tma2_s3", "tma2_s4", "tma_ws", "ptr_peeled"]
    if dry:
        shapes = [(3, 100, 8, 1, 32, 16), (2, 300, 16, 2, 32, 16)]
        variants = ["tma_s2", "tma2_s2", "ptr_peeled"]
    elif os.environ.get("SHAPES") == "quick":
        shapes = [(128, 32768, 8, 1, 128, 16), (256, 4096, 8, 1, 128, 16)]
    else:
        shapes = [(b, c, hq, hkv, 128, pg) for (hq, hkv) in [(8, 1), (16, 1), (64, 8)] for (b, c) in [(5, 3000)]
                  for pg in (16, 64)]  # mixed lengths against torch first
        shapes += [(b, c, hq, hkv, 128, pg) for (hq, hkv) in [(8, 1), (16, 1), (64, 8)]
                  for (b, c) in [(32, 32768), (128, 32768), (256, 4096), (8, 131072), (128, 4096)]
                  for pg in (16, 64) if 2 * b * c * hkv * 128 * 2 <= 24 << 30 and (pg == 16 or b * c >= 1 << 20)]
    rows = []
    num_sms = 1 if dry else torch.cuda.get_device_properties(dev).multi_processor_count
    if not dry:
        from tknp_megatron.tools.bench_attention import Timer, graph_replay
        timer = Timer(torch, dev, warmup=5, reps=int(os.environ.get("REPS", 30)), flush=True)
        env = {"torch": torch}
    for (b, c, hq, hkv, d, pg) in shapes:
        lens = [c - 7 * i for i in range(b)] if dry or b * c <= 1 << 16 else [c] * b
        case = testing.make_paged_case([1] * b, lens, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                                       block_size=pg, dtype=dt, device=dev, seed=b + c)
        backend = attn.get_backend("triton", dev)
        # the reference: torch's on small (and CPU) cases, the production kernel's output on large ones
        ref = (attn.get_backend("torch") if dry or b * c <= 1 << 16 else backend)(*case.args()).float()
        row = dict(B=b, ctx=c, hq=hq, hkv=hkv, d=d, page=pg, kv_bytes=2 * b * c * hkv * d * case.q.element_size())
        calls = {}
        meta = backend.prepare(case.meta, attn.CallShape(hq, hkv, d, pg, case.q.dtype))
        calls["triton"] = lambda q, m=meta: backend(q, case.k_cache, case.v_cache, m, case.scale)
        for v in variants:
            try:
                p = Probe(case, v, num_sms)
                out = p(case.q)
                row[f"{v}_err"] = rel(out, ref)
                if not (row[f"{v}_err"] < 2e-2):
                    row[f"{v}_status"] = "WRONG"
                    continue
                calls[v] = p
            except Exception as e:  # a variant Triton cannot build here
                row[f"{v}_status"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        row["triton_err"] = rel(calls["triton"](case.q), ref)
        if not dry:
            qs = [case.q, torch.randn_like(case.q)]
            names = list(calls)
            fns = [graph_replay(env, calls[n], qs) for n in names]
            k = testing_contiguous(case, c)
            q4 = [q.unsqueeze(2) for q in qs]
            scale = case.scale
            names.append("sdpa")
            fns.append(lambda i: torch.nn.functional.scaled_dot_product_attention(
                q4[i % 2], k[0], k[1], scale=scale, enable_gqa=True))
            src = torch.empty(row["kv_bytes"] // 2, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            names.append("copy")
            fns.append(lambda i: dst.copy_(src))
            ts = timer.interleaved(fns)
            for n, t in zip(names, ts):
                row[f"{n}_us"] = round(t, 2)
            base = row["triton_us"]
            print(f"B={b:4d} ctx={c:6d} {hq}/{hkv}/{d} page {pg}: " + " ".join(
                f"{n} {row[n + '_us']:.1f}" for n in names) + " | /triton " + " ".join(
                f"{n} {row[n + '_us'] / base:.3f}" for n in names if n != "copy") +
                f" | triton/sdpa {base / row['sdpa_us']:.3f} best/sdpa "
                f"{min(row[n + '_us'] for n in names if n not in ('sdpa', 'copy')) / row['sdpa_us']:.3f}", flush=True)
            del fns, k, qs
        else:
            print(row, flush=True)
        bad = {k: v for k, v in row.items() if k.endswith("_status")}
        if bad:
            print("  ", bad, flush=True)
        rows.append(row)
        if os.environ.get("OUT"):  # each row saved as it ends
            json.dump(rows, open(os.path.join(os.environ["OUT"], "tma_probe.json"), "w"), indent=1)
        del case, calls
        if not dry:
            torch.cuda.empty_cache()


def testing_contiguous(case, ctx):
    """``(k, v)`` ``[B, Hkv, ctx, d]`` contiguous copies of the requests' pages."""
    from tknp_megatron.attention import paging
    g = lambda cache: paging.gather_pages(cache, case.meta.block_table, ctx).transpose(1, 2).contiguous()
    return g(case.k_cache), g(case.v_cache)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
