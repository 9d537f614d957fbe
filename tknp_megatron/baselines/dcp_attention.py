"""Partial attention over one sequence shard (output and log-sum-exp), and the LSE merge.

Shard layout (cyclic): with DCP degree D, the token at position ``p`` of a request lives
on DCP rank ``p % D`` of its KV head's group, at shard-local position ``p // D``. A
rank's paged cache therefore holds shard-local positions ``0 .. ceil((L - j) / D) - 1``
for shard ``j``, and a query at position ``q`` sees local token ``t`` iff
``t * D + j <= q`` (causal over the global sequence).

:func:`partial_attention` is the torch reference (plain, fp32) and serves every step that
is not pure decode: vectorised over rows, or, for prompt steps, request by request with
each request's context read once and its rows in chunks of bounded memory (gathering the
context per row held ``rows x context x heads x d`` floats: tens to hundreds of GiB for one
prompt of a few thousand tokens). :func:`partial_attention_triton` serves pure-decode steps (one query
row per request, its newest token) on CUDA, or on CPU under ``TRITON_INTERPRET=1``: there
every cached local token is visible, so the shard's partial attention is exactly the
split-K paged kernel of :mod:`~tknp_megatron.attention.triton_kernels` over the local
cache (``seq_lens = local_lens``), whose per-split partials are merged here in torch.
:func:`partial_attention_fa3` is the same on FlashAttention 3, which the DCP executor takes
for decode where the default backend's per-shape rule would (``attention/per_shape.py``):
with one KV head per rank and the group's 32-64 query heads, FA3's packed tiles reach the
copy ceiling where the Triton kernel's do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from tknp_megatron.attention import AttentionMetadata
from tknp_megatron.attention import triton_paged as paged  # the decode kernel's launch helpers
from tknp_megatron.attention.paging import gather_pages

__all__ = [
    "ShardMetadata", "decode_metadata", "partial_attention", "partial_attention_fa3", "partial_attention_triton",
    "triton_decode_usable",
    "merge_partials",
]

_TRITON = paged.TritonConfig()  # launch parameters and split heuristic of the Triton decode path


@dataclass(frozen=True, eq=False)
class ShardMetadata:
    """One rank's view of the step for shard ``shard`` of ``degree``.

    Attributes:
        row_request: ``[rows]`` int64 request index of each query row.
        positions: ``[rows]`` int64 global position of each query row.
        local_lens: ``[R]`` int64 shard-local tokens cached per request (this step included).
        block_table: ``[R, max_blocks]`` int32 physical blocks of the local shard.
        max_local_len: host int >= every ``local_lens``.
        shard: j, this rank's shard index.
        degree: D.
        kernel: for a pure-decode step, the Triton kernel's view of it
            (:func:`decode_metadata`), built once per step rather than once per layer.
        row_spans: host ``(first row, rows)`` of each request, where the step's rows are
            request by request (prompt steps: :func:`partial_attention` then reads each
            request's context once and bounds its scores' memory); None: not known.
    """

    row_request: torch.Tensor
    positions: torch.Tensor
    local_lens: torch.Tensor
    block_table: torch.Tensor
    max_local_len: int
    shard: int
    degree: int
    kernel: Optional[AttentionMetadata] = None
    row_spans: Optional[Tuple[Tuple[int, int], ...]] = None


SCORE_BUDGET = 1 << 26
"""fp32 scores (rows x heads x local tokens) :func:`partial_attention` holds at once per
request when it knows the step's row spans (256 MiB)."""


def partial_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: ShardMetadata, scale: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query row over this rank's shard of its request's context.

    Args:
        q: ``[rows, Hq, d]`` query heads of the group (all D ranks' heads).
        k_cache, v_cache: ``[blocks, block_size, Hkv, d]`` local paged shard.
        meta: shard metadata.
        scale: softmax scale.

    Returns:
        ``(out [rows, Hq, d], lse [rows, Hq])`` fp32; a row that sees no local token has
        ``out = 0`` and ``lse = -inf`` (weight 0 in :func:`merge_partials`).

    With ``meta.row_spans`` (prompt steps) each request's context is gathered once and its
    rows attend in chunks of at most :data:`SCORE_BUDGET` scores; without, every row
    gathers its request's context (``[rows, L, Hq, d]``: fine for a few rows, far too much
    for a prompt of thousands).
    """
    if meta.row_spans is not None:
        return _partial_attention_by_request(q, k_cache, v_cache, meta, scale)
    rows, heads, d = q.shape
    length = max(meta.max_local_len, 1)
    k = gather_pages(k_cache, meta.block_table, length, meta.local_lens)  # [R, L, Hkv, d]
    v = gather_pages(v_cache, meta.block_table, length, meta.local_lens)
    group = heads // k.shape[2]
    k = k.float().repeat_interleave(group, dim=2)[meta.row_request]  # [rows, L, Hq, d]
    v = v.float().repeat_interleave(group, dim=2)[meta.row_request]
    scores = torch.einsum("rhd,rlhd->rhl", q.float(), k) * scale
    local = torch.arange(length, device=q.device)
    visible = (local[None, :] < meta.local_lens[meta.row_request][:, None]) & (
        local[None, :] * meta.degree + meta.shard <= meta.positions[:, None]
    )  # [rows, L]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    peak = scores.amax(-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    probs = torch.exp(scores - peak)  # exp(-inf) = 0 for hidden tokens
    total = probs.sum(-1)  # [rows, Hq]
    out = torch.einsum("rhl,rlhd->rhd", probs, v) / total.clamp_min(1e-30)[..., None]
    lse = torch.log(total) + peak[..., 0]  # -inf where nothing is visible
    return out, lse


def _partial_attention_by_request(q, k_cache, v_cache, meta: ShardMetadata, scale: float):
    """:func:`partial_attention` request by request, rows in chunks (``meta.row_spans``)."""
    rows, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    length = max(meta.max_local_len, 1)
    out = torch.zeros(rows, heads, d, dtype=torch.float32, device=q.device)
    lse = torch.full((rows, heads), float("-inf"), dtype=torch.float32, device=q.device)
    local = torch.arange(length, device=q.device)
    chunk = max(1, SCORE_BUDGET // (heads * length))
    for r, (first, count) in enumerate(meta.row_spans):
        if count == 0:
            continue
        lens = meta.local_lens[r : r + 1]
        k = gather_pages(k_cache, meta.block_table[r : r + 1], length, lens)[0].float()  # [L, Hkv, d]
        v = gather_pages(v_cache, meta.block_table[r : r + 1], length, lens)[0].float()
        for a in range(first, first + count, chunk):
            b = min(a + chunk, first + count)
            qc = q[a:b].float().view(b - a, kv_heads, group, d)
            scores = torch.einsum("ckgd,lkd->ckgl", qc, k).reshape(b - a, heads, length) * scale
            visible = (local[None, :] < lens) & (local[None, :] * meta.degree + meta.shard
                                                 <= meta.positions[a:b, None])  # [c, L]
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            peak = scores.amax(-1, keepdim=True)
            peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
            probs = torch.exp(scores - peak)
            total = probs.sum(-1)  # [c, Hq]
            pv = torch.einsum("ckgl,lkd->ckgd", probs.view(b - a, kv_heads, group, length), v)
            out[a:b] = pv.reshape(b - a, heads, d) / total.clamp_min(1e-30)[..., None]
            lse[a:b] = torch.log(total) + peak[..., 0]
    return out, lse


def triton_decode_usable(device: torch.device) -> bool:
    """Whether :func:`partial_attention_triton` can run on ``device`` (host only): CUDA, or
    ``TRITON_INTERPRET=1``, and ``triton`` importable."""
    return paged.triton_supports_device(device) and paged.triton_importable()


def decode_metadata(meta: ShardMetadata) -> AttentionMetadata:
    """The kernel's view of a decode step: request ``r`` is row ``r`` and sees its
    ``local_lens[r]`` local tokens (int32 ``query_start_loc = arange(R + 1)``)."""
    num_req, device = meta.local_lens.shape[0], meta.local_lens.device
    return AttentionMetadata(
        query_start_loc=torch.arange(num_req + 1, dtype=torch.int32, device=device),
        seq_lens=meta.local_lens.to(torch.int32),
        block_table=meta.block_table.to(torch.int32),
        max_query_len=1,
        max_seq_len=meta.max_local_len,
    )


def _merge_splits(part: torch.Tensor, lse2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge the kernel's KV splits.

    Args:
        part: ``[rows, H, S, d]`` fp32 normalised partial outputs (0 for empty splits).
        lse2: ``[rows, H, S]`` fp32 log2-sum-exp per split (-inf for empty splits).

    Returns:
        ``(out [rows, H, d], lse [rows, H])`` fp32, ``lse`` in natural log; rows and heads
        with every split empty give ``out = 0``, ``lse = -inf``.
    """
    top = lse2.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp2(lse2 - top)  # [rows, H, S], 0 for empty splits
    total = weights.sum(-1)  # [rows, H]
    out = torch.einsum("rhs,rhsd->rhd", weights, part) / total.clamp_min(1e-30)[..., None]
    lse = (torch.log2(total) + top[..., 0]) * math.log(2.0)  # log2(0) = -inf stays -inf
    return out, lse


def partial_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: ShardMetadata, scale: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`partial_attention` for a pure-decode step, with the Triton split-K kernel.

    Row ``r`` must be request ``r``'s newest token (``rows == R``), whose own k/v (if this
    shard holds it) is already cached, so all ``local_lens[r]`` local tokens are visible.
    The kernel always runs in its partial form (fp32 per-split outputs and log2-sum-exp,
    splits and tile from :func:`~tknp_megatron.attention.triton_paged.decode_launch`), merged
    by :func:`_merge_splits`. No host sync: grid sizes come from host ints.

    Args:
        q: ``[rows, Hq, d]`` query heads of the group (cast to the cache dtype; the
            kernel accumulates in fp32).
        k_cache, v_cache: ``[blocks, block_size, Hkv, d]`` local paged shard.
        meta: shard metadata of a decode step.
        scale: softmax scale.

    Returns:
        ``(out [rows, Hq, d], lse [rows, Hq])`` fp32, as :func:`partial_attention`.
    """
    rows, heads, d = q.shape
    if rows != meta.local_lens.shape[0]:
        raise ValueError(f"decode needs one row per request: {rows} rows, {meta.local_lens.shape[0]} requests")
    if rows == 0:
        return q.new_zeros((0, heads, d), dtype=torch.float32), q.new_zeros((0, heads), dtype=torch.float32)
    q = q.to(k_cache.dtype)
    q = q if q.stride(-1) == 1 else q.contiguous()
    num_kv_heads = k_cache.shape[2]
    how = paged.decode_launch(rows * num_kv_heads, meta.max_local_len, d, paged.device_num_sms(q.device), _TRITON,
                              group=heads // num_kv_heads)
    splits = how.num_splits
    part = torch.empty((rows, heads, splits, d), dtype=torch.float32, device=q.device)
    lse2 = torch.empty((rows, heads, splits), dtype=torch.float32, device=q.device)
    paged.load_kernels().launch_paged_attention(
        q, k_cache, v_cache, part, lse2, decode_metadata(meta) if meta.kernel is None else meta.kernel, scale,
        num_tiles=rows, num_splits=splits, block_q=1,
        group_pad=paged.decode_group_pad(heads, num_kv_heads),
        block_n=how.block_n, num_warps=how.num_warps, num_stages=how.num_stages,
        upcast=paged.interpreter_upcast(q.dtype),
    )
    return _merge_splits(part, lse2)


def partial_attention_fa3(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: ShardMetadata, scale: float, fa3
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`partial_attention_triton` on FlashAttention 3 (``fa3``: a
    :class:`~tknp_megatron.attention.flash3.FlashAttn3Backend`): one call over the local
    shard, causal with the query row at the end of each request's local tokens, so every
    cached local token is visible, as in the Triton form. FA3 packs a KV head's query heads
    (all D ranks' heads of the group here) into its tiles, where the Triton kernel's dots
    over 32-64 rows weigh as much as its loads (``attention/per_shape.py``).

    Returns:
        ``(out [rows, Hq, d]`` in the cache dtype, ``lse [rows, Hq]`` fp32); a row with no
        local token has ``out = 0``, ``lse = -inf``.
    """
    rows, heads, d = q.shape
    if rows != meta.local_lens.shape[0]:
        raise ValueError(f"decode needs one row per request: {rows} rows, {meta.local_lens.shape[0]} requests")
    if rows == 0 or meta.max_local_len == 0:
        return (q.new_zeros((rows, heads, d), dtype=k_cache.dtype),
                q.new_full((rows, heads), float("-inf"), dtype=torch.float32))
    q = q.to(k_cache.dtype)
    q = q if q.stride(-1) == 1 else q.contiguous()
    return fa3.forward_with_lse(q, k_cache, v_cache, decode_metadata(meta) if meta.kernel is None else meta.kernel,
                                scale)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Combine D partial results of the same heads: ``sum_i w_i o_i / sum_i w_i`` with
    ``w_i = exp(lse_i - max_i lse_i)``.

    Args:
        outs: ``[D, rows, H, d]`` partial outputs.
        lses: ``[D, rows, H]`` fp32 log-sum-exp (at least one finite per row and head).

    Returns:
        ``[rows, H, d]`` fp32.
    """
    peak = lses.amax(0)
    weights = torch.exp(lses - peak)  # [D, rows, H]
    num = (weights[..., None] * outs.float()).sum(0)
    return num / weights.sum(0)[..., None]
