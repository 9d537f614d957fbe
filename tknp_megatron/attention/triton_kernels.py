"""Triton kernels for paged causal attention (imported lazily: needs ``triton``).

``_paged_attn_kernel``: one program per (query tile, kv head, KV split). A query tile is
``BLOCK_Q`` query rows of one request times the ``GROUP`` query heads that share the kv
head, flattened into ``BLOCK_Q * GROUP_PAD`` matrix rows, so each K/V tile is read once
per kv-head group and fed to ``tl.dot``. Decode uses ``BLOCK_Q = 1`` and pads the group
to 16 rows (the smallest ``tl.dot`` M). The context ``[0, kv_end)`` of a tile is cut
into ``num_splits`` equal, ``BLOCK_N``-aligned slices (flash-decoding); each program
runs an online softmax (base 2) over its slice, reading the block table per token so
any page size works. A head dim that is not a power of two is read as two column tiles
of power-of-two widths (192 as 128 + 64, 96 as 64 + 32: :func:`head_dim_tiles`) and each
``tl.dot`` runs over both, instead of one tile padded to the next power of two (192 to
256), whose masked third of every load and dot cost bandwidth and registers. With one
split it writes the normalised output directly; otherwise it writes the slice's
normalised fp32 partial and log2-sum-exp, and ``_combine_splits_kernel`` (one program
per (row, head)) merges the slices.

Balanced splits (decode only, :func:`launch_split_plan` first): the slices are cut by
tokens instead, the same length for every request, so a request gets as many slices as
its length needs, up to ``num_splits``. ``_split_plan_kernel`` (one program per request,
before each launch, so a CUDA graph replays it) computes the slice length from
``seq_lens`` and writes a work list, one ``request * num_splits + slice`` entry per
program of the attention grid ``(R * budget + R, Hkv)`` (-1 past the last slice: at most
``R`` of them); the merge reads only the slices its row has. With mixed lengths the
longest request's programs then take about as long as the others' instead of holding up
the wave, and no program of a fixed per-request grid sits idle.

A balanced launch can also merge its slices itself (``MERGE``): each program, once its
partial is written, raises its (request, KV head)'s counter in the plan; the program that
raises it to the request's slice count merges that request's head group and sets the
counter back to zero, so no merge kernel follows (its launch, and the gap before it, sat
on every layer's critical path) and the counters are zero again for the next layer's call
on the same plan. The plan kernel zeroes them at the start of the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tknp_megatron import triton_interpreter

__all__ = ["head_dim_tiles", "launch_paged_attention", "launch_combine_splits", "launch_split_plan"]

triton_interpreter.install()  # Triton 3.6's CPU interpreter with a recent NumPy (see triton_interpreter)


def head_dim_tiles(head_dim: int):
    """``(d_lo, d_hi)``: the column tiles the attention kernel reads a head in, powers of two
    (``tl.arange`` sizes) of at least 16 (``tl.dot``'s smallest K). A power of two (or a
    head dim up to 16) is one tile, ``d_hi = 0``; otherwise ``d_lo`` is the largest power of
    two below ``head_dim`` and ``d_hi`` covers the rest, padded: 192 -> (128, 64), 96 -> (64,
    32), 80 -> (64, 16), 112 -> (64, 64)."""
    if head_dim <= 16 or head_dim & (head_dim - 1) == 0:
        return max(16, triton.next_power_of_2(head_dim)), 0
    d_lo = 1 << (head_dim.bit_length() - 1)
    return d_lo, max(16, triton.next_power_of_2(head_dim - d_lo))


COMBINE_BLOCK_S = 16
"""Slices the merge reads per iteration. A tile of every slice at once (``[splits, d]``
fp32 per program) spilled registers past 128 splits on an H200 and made long contexts at
small batches slower with more splits, not faster (``benchmarks/RESULTS.md``)."""


MERGE_UNROLL = 4
"""Slices the merge in the attention kernel loads per iteration, each ``[group rows, d]``
fp32: their loads are in flight together, in registers the attention loop has freed."""


# Triton specializes integer arguments on their value (== 1, divisible by 16) and compiles a
# kernel for each combination it meets. The request count and the split count (and the
# partials' strides, which follow the split count) change from one eager (prefill) step to
# the next, and a compile holds up its step, so they are plain runtime values: one compile
# serves them all.
@triton.jit(do_not_specialize=["num_requests", "budget_splits", "num_splits", "num_work", "num_kv_heads"])
def _split_plan_kernel(seq_lens_ptr, split_tiles_ptr, work_ptr, counters_ptr, num_requests, budget_splits, num_splits,
                       num_work, num_kv_heads, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """The plan of a balanced decode launch, one program per request ``r``.

    Slice length (``split_tiles_ptr[0]``, in ``BLOCK_N`` tiles): the step's tokens over
    ``num_requests * budget_splits`` slices, but at least the longest context over
    ``num_splits``, so that no request needs more slices than that. Work list
    (``work_ptr[num_work]``): request ``r``'s slices ``k`` as ``r * num_splits + k`` at the
    place of ``r`` in the running count of slices; the last request fills the rest with -1.
    Every program computes the sums itself (``R`` is at most a few hundred), so the plan
    is one launch. It also zeroes request ``r``'s ``num_kv_heads`` merge counters
    (``counters_ptr``, see ``_paged_attn_kernel``'s ``MERGE``).
    """
    me = tl.program_id(0)
    total = tl.zeros([], tl.int64)
    longest = tl.zeros([], tl.int32)
    for r0 in range(0, num_requests, 128):
        r = r0 + tl.arange(0, 128)
        lens = tl.load(seq_lens_ptr + r, mask=r < num_requests, other=0)
        total += tl.sum(lens.to(tl.int64), 0)
        longest = tl.maximum(longest, tl.max(lens, 0))
    per = tl.cdiv(total, tl.maximum(num_requests * budget_splits, 1)).to(tl.int32)
    tiles = tl.maximum(tl.cdiv(tl.maximum(per, tl.cdiv(longest, num_splits)), BLOCK_N), 1)
    split_len = tiles * BLOCK_N
    before = tl.zeros([], tl.int32)  # slices of the requests ahead of this one
    for r0 in range(0, num_requests, 128):
        r = r0 + tl.arange(0, 128)
        lens = tl.load(seq_lens_ptr + r, mask=r < me, other=0)
        before += tl.sum(tl.cdiv(lens, split_len), 0)
    mine = tl.cdiv(tl.load(seq_lens_ptr + me), split_len)
    k = tl.arange(0, MAX_SPLITS)
    tl.store(work_ptr + before + k, me * num_splits + k, mask=k < mine)
    for h0 in range(0, num_kv_heads, 128):
        h = h0 + tl.arange(0, 128)
        tl.store(counters_ptr + me * num_kv_heads + h, tl.zeros([128], tl.int32), mask=h < num_kv_heads)
    if me == 0:
        tl.store(split_tiles_ptr, tiles)
    if me == num_requests - 1:
        for w0 in range(before + mine, num_work, 128):
            w = w0 + tl.arange(0, 128)
            tl.store(work_ptr + w, tl.full([128], -1, tl.int32), mask=w < num_work)


@triton.jit(do_not_specialize=["num_splits", "num_requests", "stride_os", "stride_lt", "stride_lh"])
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
    qsl_ptr, seq_lens_ptr, bt_ptr, tile_req_ptr, tile_first_ptr, split_tiles_ptr, work_ptr,
    counters_ptr, merged_ptr, stride_mt, stride_mh,
    scale_log2, num_splits, num_requests,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, D_LO: tl.constexpr, D_HI: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, SPLIT: tl.constexpr, BALANCED: tl.constexpr, MERGE: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, MERGE_S: tl.constexpr, MERGE_UNROLL: tl.constexpr,
):
    kvh = tl.program_id(1)
    if BALANCED:  # decode: this program's (request, slice) from the plan's work list
        item = tl.load(work_ptr + tl.program_id(0))
        if item < 0:
            return
        tile = item // num_splits
        split = item % num_splits
        split_len = tl.load(split_tiles_ptr) * BLOCK_N  # a multiple of BLOCK_N, as below
    else:
        tile = tl.program_id(0)
        split = tl.program_id(2)
    # Which request and which of its query tiles this program serves.
    if VARLEN:
        req = tl.load(tile_req_ptr + tile)
        req_c = tl.minimum(req, num_requests - 1)
        q_tile = tile - tl.load(tile_first_ptr + req_c)
    else:
        req = tile
        req_c = tile
        q_tile = 0
    q_start = tl.load(qsl_ptr + req_c)
    q_len = tl.load(qsl_ptr + req_c + 1) - q_start
    q_len = tl.where(req < num_requests, q_len, 0)
    tile_q0 = q_tile * BLOCK_Q
    if tile_q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req_c)
    first_pos = seq_len - q_len  # cache position of the request's first query row
    kv_end = tl.minimum(seq_len, first_pos + tile_q0 + BLOCK_Q)  # causal bound of the tile
    if not BALANCED:  # each request's context in num_splits equal slices (balanced: equal tokens)
        split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = split * split_len
    kv_hi = tl.minimum(kv_lo + split_len, kv_end)

    # Matrix row m = (query row tile_q0 + m // GROUP_PAD, head kvh * GROUP + m % GROUP_PAD).
    m = tl.arange(0, BLOCK_Q * GROUP_PAD)
    qi = tile_q0 + m // GROUP_PAD
    head = kvh * GROUP + m % GROUP_PAD
    row_ok = (qi < q_len) & (m % GROUP_PAD < GROUP)
    row_pos = first_pos + qi
    rows = (q_start + qi).to(tl.int64)
    q_row = q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh
    # columns [0, D_LO) and, where the head dim is not a power of two, [D_LO, D_LO + D_HI)
    d = tl.arange(0, D_LO)
    d_ok = d < HEAD_DIM
    q = tl.load(q_row + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the CPU interpreter cannot tl.dot bf16
        q = q.to(tl.float32)
    if D_HI > 0:
        dh = D_LO + tl.arange(0, D_HI)
        dh_ok = dh < HEAD_DIM
        q_hi = tl.load(q_row + dh[None, :], mask=row_ok[:, None] & dh_ok[None, :], other=0.0)
        if UPCAST:
            q_hi = q_hi.to(tl.float32)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, D_LO], tl.float32)
    if D_HI > 0:
        acc_hi = tl.zeros([BLOCK_Q * GROUP_PAD, D_HI], tl.float32)
    bt_row = bt_ptr + req_c.to(tl.int64) * stride_bt
    n = tl.arange(0, BLOCK_N)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        tok = start + n
        tok_ok = tok < kv_hi
        blk = tl.load(bt_row + tok // PAGE, mask=tok_ok, other=0).to(tl.int64)
        slot = tok % PAGE
        k_off = blk * stride_kb + slot * stride_kt + kvh * stride_kh
        v_off = blk * stride_vb + slot * stride_vt + kvh * stride_vh
        # K is read as V is, [BLOCK_N, D] with a token's D values contiguous, and transposed
        # in registers for the dot
        k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=tok_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=tok_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if D_HI > 0:
            k_hi = tl.load(k_ptr + k_off[:, None] + dh[None, :], mask=tok_ok[:, None] & dh_ok[None, :], other=0.0)
            v_hi = tl.load(v_ptr + v_off[:, None] + dh[None, :], mask=tok_ok[:, None] & dh_ok[None, :], other=0.0)
            if UPCAST:
                k_hi = k_hi.to(tl.float32)
                v_hi = v_hi.to(tl.float32)
            if IEEE:
                s += tl.dot(q_hi, tl.trans(k_hi), input_precision="ieee")
            else:
                s += tl.dot(q_hi, tl.trans(k_hi))
        s = s * scale_log2
        s = tl.where(tok_ok[None, :] & (tok[None, :] <= row_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows stay 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        if D_HI > 0:
            if IEEE:
                pv_hi = tl.dot(p, v_hi, input_precision="ieee")
            else:
                pv_hi = tl.dot(p.to(v_hi.dtype), v_hi)
            acc_hi = acc_hi * alpha[:, None] + pv_hi
        m_i = m_new

    norm = tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_row = out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh
    if SPLIT:
        o_row += split * stride_os
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(lse_ptr + rows * stride_lt + head * stride_lh + split, lse, mask=row_ok)
    tl.store(o_row + d[None, :], (acc / norm).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if D_HI > 0:
        tl.store(o_row + dh[None, :], (acc_hi / norm).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dh_ok[None, :])

    if MERGE:  # balanced decode: the last of the request's slices to finish merges them
        # every thread's stores above are done before the count is raised (the atomic's
        # release, at GPU scope, makes them visible to the program that merges)
        tl.debug_barrier()
        counter = counters_ptr + req_c * tl.num_programs(1) + kvh
        count = tl.cdiv(seq_len, split_len)  # the request's slices, as the plan counted them
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == count - 1:
            _merge_slices(out_ptr, lse_ptr, merged_ptr, rows, head, row_ok, count,
                          stride_os, stride_lt, stride_lh, stride_ot, stride_oh, stride_mt, stride_mh,
                          BLOCK_Q * GROUP_PAD, HEAD_DIM, D_LO, D_HI, MERGE_S, MERGE_UNROLL)
            tl.store(counter, 0)  # ready for the next call on this plan (every slice has counted)


@triton.jit
def _merge_slices(part_ptr, lse_ptr, merged_ptr, rows, head, row_ok, count,
                  stride_ps, stride_lt, stride_lh, stride_pt, stride_ph, stride_mt, stride_mh,
                  ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_LO: tl.constexpr, D_HI: tl.constexpr, MERGE_S: tl.constexpr,
                  MERGE_UNROLL: tl.constexpr):
    """The matrix rows' ``count`` slices (fp32 partials ``[rows, Hq, S, d]`` and their
    log2-sum-exp ``[rows, Hq, S]``), weighted by ``exp2(lse - max lse)``, into ``merged``
    ``[rows, Hq, d]``: as ``_combine_splits_kernel`` does, for one request's head group.
    The loads bypass L1 (``.cg``): other programs wrote the partials."""
    lse_row = lse_ptr + rows * stride_lt + head * stride_lh
    s = tl.arange(0, MERGE_S)
    top = tl.full([ROWS], float("-inf"), tl.float32)
    for s0 in range(0, count, MERGE_S):
        lse = tl.load(lse_row[:, None] + s0 + s[None, :], mask=row_ok[:, None] & (s0 + s < count)[None, :],
                      other=float("-inf"), cache_modifier=".cg")
        top = tl.maximum(top, tl.max(lse, 1))
    top = tl.where(top == float("-inf"), 0.0, top)
    part_row = part_ptr + rows[:, None] * stride_pt + head[:, None] * stride_ph
    d = tl.arange(0, D_LO)
    d_ok = d < HEAD_DIM
    acc = tl.zeros([ROWS, D_LO], tl.float32)
    if D_HI > 0:
        dh = D_LO + tl.arange(0, D_HI)
        dh_ok = dh < HEAD_DIM
        acc_hi = tl.zeros([ROWS, D_HI], tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    # MERGE_UNROLL slices per iteration, so that their loads are in flight together: one
    # slice at a time, a request of 16-32 slices waited out 16-32 L2 round trips in turn
    # at the end of the launch (benchmarks/RESULTS.md, "The last slice merges")
    for k0 in range(0, count, MERGE_UNROLL):
        for j in tl.static_range(MERGE_UNROLL):
            k = k0 + j
            ok = row_ok & (tl.full([ROWS], 0, tl.int32) + k < count)  # a vector: the interpreter refuses a scalar term
            w = tl.exp2(tl.load(lse_row + k, mask=ok, other=float("-inf"), cache_modifier=".cg") - top)
            part = tl.load(part_row + k * stride_ps + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0,
                           cache_modifier=".cg")
            acc += part * w[:, None]
            if D_HI > 0:
                part_hi = tl.load(part_row + k * stride_ps + dh[None, :], mask=ok[:, None] & dh_ok[None, :],
                                  other=0.0, cache_modifier=".cg")
                acc_hi += part_hi * w[:, None]
            total += w
    norm = tl.maximum(total, 1e-30)[:, None]
    m_row = merged_ptr + rows[:, None] * stride_mt + head[:, None] * stride_mh
    tl.store(m_row + d[None, :], (acc / norm).to(merged_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if D_HI > 0:
        tl.store(m_row + dh[None, :], (acc_hi / norm).to(merged_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dh_ok[None, :])


@triton.jit(do_not_specialize=["num_splits", "stride_pt", "stride_ph", "stride_ps", "stride_lt", "stride_lh"])
def _combine_splits_kernel(
    part_ptr, lse_ptr, out_ptr, seq_lens_ptr, split_tiles_ptr, num_splits,
    stride_pt, stride_ph, stride_ps,
    stride_lt, stride_lh,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    BALANCED: tl.constexpr,
):
    """One program per (row, head): the row's slices, ``BLOCK_S`` at a time (any count, one
    compile), weighted by ``exp2(lse - max lse)``. Two passes over the slices' ``lse``
    (the max, then the weighted sum of the partials), so no tile grows with the count."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if BALANCED:  # only the slices this row's request has were written (one row per request)
        count = tl.cdiv(tl.load(seq_lens_ptr + row), tl.load(split_tiles_ptr) * BLOCK_N)
    else:
        count = num_splits
    lse_row = lse_ptr + row * stride_lt + head * stride_lh
    part_row = part_ptr + row * stride_pt + head * stride_ph
    s = tl.arange(0, BLOCK_S)
    top = tl.full([], float("-inf"), tl.float32)
    for s0 in range(0, count, BLOCK_S):
        lse = tl.load(lse_row + s0 + s, mask=s0 + s < count, other=float("-inf"))
        top = tl.maximum(top, tl.max(lse, 0))
    top = tl.where(top == float("-inf"), 0.0, top)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    acc = tl.zeros([D_PAD], tl.float32)
    total = tl.zeros([], tl.float32)
    for s0 in range(0, count, BLOCK_S):
        s_ok = s0 + s < count
        w = tl.exp2(tl.load(lse_row + s0 + s, mask=s_ok, other=float("-inf")) - top)  # empty slices weigh 0
        part = tl.load(part_row + (s0 + s)[:, None] * stride_ps + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                       other=0.0)
        acc += tl.sum(part * w[:, None], 0)
        total += tl.sum(w, 0)
    out = acc / tl.maximum(total, 1e-30)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def launch_paged_attention(
    q, k_cache, v_cache, out, lse, meta, scale, *, num_tiles, num_splits, block_q, group_pad,
    block_n, num_warps, num_stages, tile_req=None, tile_first=None, upcast=False, plan=None, merged=None,
):
    """Launch the partial (``lse`` given, ``out`` ``[rows, Hq, S, d]`` fp32) or direct kernel.

    Args:
        q: ``[rows, Hq, d]``; k_cache, v_cache: ``[num_blocks, block_size, Hkv, d]``.
        out: ``[rows, Hq, d]`` (one split) or ``[rows, Hq, num_splits, d]`` fp32 partials.
        lse: ``[rows, Hq, num_splits]`` fp32 log2-sum-exp per split, or ``None``.
        num_tiles: grid size over query tiles (host int; ``R`` for decode).
        tile_req, tile_first: ``[num_tiles]`` request of each tile and ``[R]`` first tile
            of each request, for varlen launches (``None`` for decode).
        plan: ``(split_tiles, work, counters)`` from :func:`launch_split_plan` for balanced
            splits (decode with ``lse`` only; ``num_splits`` is then the most any request
            gets), or ``None``.
        merged: ``[rows, Hq, d]``, balanced launches only: the last program of each request
            and KV head to finish merges the request's slices into it (the plan's counters
            count them), so no merge kernel follows; ``None``: ``out`` keeps the partials.
    """
    head_dim, num_kv_heads = q.shape[2], k_cache.shape[2]
    split = lse is not None
    balanced = plan is not None
    if balanced and (not split or tile_req is not None):
        raise ValueError("balanced splits are for decode launches with partial outputs (lse given)")
    if merged is not None and not balanced:
        raise ValueError("merging in the attention kernel needs a balanced launch's plan (its counters)")
    if balanced and plan[2].shape[0] != meta.num_requests * num_kv_heads:
        raise ValueError(f"the plan's counters cover {plan[2].shape[0]} (request, KV head) pairs, "
                         f"the launch {meta.num_requests} x {num_kv_heads}")
    dummy = meta.seq_lens  # unused pointer arguments
    d_lo, d_hi = head_dim_tiles(head_dim)
    grid = (plan[1].shape[0], num_kv_heads, 1) if balanced else (num_tiles, num_kv_heads, num_splits)
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, out, lse if split else dummy,
        meta.query_start_loc, meta.seq_lens, meta.block_table,
        tile_req if tile_req is not None else dummy, tile_first if tile_first is not None else dummy,
        plan[0] if balanced else dummy, plan[1] if balanced else dummy,
        plan[2] if balanced else dummy, merged if merged is not None else dummy,
        merged.stride(0) if merged is not None else 0, merged.stride(1) if merged is not None else 0,
        scale * 1.4426950408889634, num_splits, meta.num_requests,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2) if split else 0,
        lse.stride(0) if split else 0, lse.stride(1) if split else 0,
        meta.block_table.stride(0),
        GROUP=q.shape[1] // num_kv_heads, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        PAGE=k_cache.shape[1], HEAD_DIM=head_dim, D_LO=d_lo, D_HI=d_hi,
        BLOCK_N=block_n, VARLEN=tile_req is not None, SPLIT=split, BALANCED=balanced, MERGE=merged is not None,
        UPCAST=upcast, IEEE=q.dtype == torch.float32, MERGE_S=COMBINE_BLOCK_S, MERGE_UNROLL=MERGE_UNROLL,
        num_warps=num_warps, num_stages=num_stages,
    )


def launch_split_plan(seq_lens, budget_splits, num_splits, block_n, kv_heads=1):
    """``(split_tiles [1], work [R * budget_splits + R], counters [R * kv_heads])`` int32:
    the plan of a balanced decode launch over ``[R] seq_lens`` (about ``budget_splits``
    slices per request, at most ``num_splits``, slices of ``split_tiles * block_n``
    tokens) and the zeroed merge counters of the launches over ``kv_heads`` KV heads that
    merge in the attention kernel (each such launch leaves them zero again)."""
    num_requests = seq_lens.shape[0]
    split_tiles = torch.empty(1, dtype=torch.int32, device=seq_lens.device)
    work = torch.empty(num_requests * (budget_splits + 1), dtype=torch.int32, device=seq_lens.device)
    counters = torch.empty(num_requests * kv_heads, dtype=torch.int32, device=seq_lens.device)
    _split_plan_kernel[(num_requests,)](
        seq_lens, split_tiles, work, counters, num_requests, budget_splits, num_splits, work.shape[0], kv_heads,
        BLOCK_N=block_n, MAX_SPLITS=max(16, triton.next_power_of_2(num_splits)),
    )
    return split_tiles, work, counters


def launch_combine_splits(part, lse, out, num_splits, seq_lens=None, split_tiles=None, block_n=16):
    """Merge ``part [rows, Hq, S, d]`` fp32 with ``lse [rows, Hq, S]`` into ``out [rows, Hq, d]``.

    After a balanced decode launch, pass its ``[R] seq_lens`` (one row per request), its
    ``split_tiles`` and ``block_n``: each row then reads only the slices it has.
    """
    rows, num_heads, head_dim = out.shape
    balanced = split_tiles is not None
    if balanced and (seq_lens is None or seq_lens.shape[0] != rows):
        raise ValueError("a balanced merge needs the launch's seq_lens, one per row")
    _combine_splits_kernel[(rows, num_heads)](
        part, lse, out, seq_lens if balanced else lse, split_tiles if balanced else lse, num_splits,
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_S=COMBINE_BLOCK_S, BLOCK_N=block_n, BALANCED=balanced, num_warps=4,
    )
