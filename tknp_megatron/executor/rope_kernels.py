"""Triton kernel for an owner's RoPE and KV append (see ``Rope.rotate_and_append``).

Imported on first use, so ``TRITON_INTERPRET=1`` set before that runs it on CPU (tests).
It computes what Megatron's unfused ``apply_rotary_pos_emb`` computes, rounding where it
rounds (``dense_kernels._round``): ``t * cos`` and ``rotate_half(t) * sin`` each rounded to
the activations' dtype, then their sum, with ``cos`` and ``sin`` rounded to that dtype first.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tknp_megatron.executor.dense_kernels import _round

__all__ = ["rope_append_kernel"]


@triton.jit(do_not_specialize=["stride_qkv", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt",
                               "stride_vh"])
def rope_append_kernel(QKV, COS_SIN, SLOTS, Q_OUT, K_CACHE, V_CACHE,
                       stride_qkv, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                       D_PAD: tl.constexpr, ROT: tl.constexpr, PAGE: tl.constexpr,
                       INTERLEAVED: tl.constexpr):
    """One program per (row, KV head ``g``): the group's ``GROUP`` query heads and its key
    head rotated, the query heads stored to ``Q_OUT [rows, heads, d]``, the key and the
    value head written to the caches at the row's slot.

    ``QKV [rows, W]`` is Megatron's fused layout (per group: its query heads, k, v);
    ``COS_SIN [rows, 2, ROT]`` float32 (``Rope.cos_sin``); ``SLOTS [rows]`` flat cache slots
    ``block * PAGE + offset``; ``K_CACHE``, ``V_CACHE`` ``[blocks, PAGE, Hkv, d]`` by strides.
    Columns from ``ROT`` on pass through unrotated (partial rotary).
    """
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    DT: tl.constexpr = QKV.dtype.element_ty
    j = tl.arange(0, GROUP_PAD)  # 0..GROUP-1: query heads, GROUP: the key head
    col = tl.arange(0, D_PAD)
    j_ok = j <= GROUP
    col_ok = col < HEAD_DIM
    ok = j_ok[:, None] & col_ok[None, :]
    base = QKV + row * stride_qkv + g * (GROUP + 2) * HEAD_DIM
    t = tl.load(base + j[:, None] * HEAD_DIM + col[None, :], mask=ok, other=0.0).to(tl.float32)
    # rotate_half: non-interleaved [-x2, x1] over the halves, interleaved (-x[2i+1], x[2i]) in pairs
    if INTERLEAVED:
        partner = col ^ 1
        sign = tl.where(col % 2 == 0, -1.0, 1.0)
    else:
        half = ROT // 2
        partner = tl.where(col < half, col + half, col - half)
        sign = tl.where(col < half, -1.0, 1.0)
    rot_ok = col < ROT
    other = tl.load(base + j[:, None] * HEAD_DIM + partner[None, :], mask=ok & rot_ok[None, :], other=0.0)
    cs = COS_SIN + row * (2 * ROT)
    cos = _round(tl.load(cs + col, mask=rot_ok, other=1.0), DT)
    sin = _round(tl.load(cs + ROT + col, mask=rot_ok, other=0.0), DT)
    rotated = _round(_round(t * cos[None, :], DT) + _round(sign[None, :] * other.to(tl.float32) * sin[None, :], DT),
                     DT)
    out = tl.where(rot_ok[None, :], rotated, t)

    heads = g * GROUP + j
    tl.store(Q_OUT + (row * (tl.num_programs(1) * GROUP) + heads[:, None]) * HEAD_DIM + col[None, :],
             out.to(Q_OUT.dtype.element_ty), mask=(j < GROUP)[:, None] & col_ok[None, :])
    slot = tl.load(SLOTS + row).to(tl.int64)
    blk = slot // PAGE
    pos = slot % PAGE
    k_ptrs = K_CACHE + blk * stride_kb + pos * stride_kt + g * stride_kh + col
    k = tl.sum(tl.where((j == GROUP)[:, None], out, 0.0), axis=0)  # the key head's row
    tl.store(k_ptrs, k.to(K_CACHE.dtype.element_ty), mask=col_ok)
    v = tl.load(base + (GROUP + 1) * HEAD_DIM + col, mask=col_ok, other=0.0)
    tl.store(V_CACHE + blk * stride_vb + pos * stride_vt + g * stride_vh + col, v.to(V_CACHE.dtype.element_ty),
             mask=col_ok)
