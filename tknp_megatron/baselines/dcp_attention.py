"""Partial attention over one sequence shard (output and log-sum-exp), and the LSE merge.

Shard layout (cyclic): with DCP degree D, the token at position ``p`` of a request lives
on DCP rank ``p % D`` of its KV head's group, at shard-local position ``p // D``. A
rank's paged cache therefore holds shard-local positions ``0 .. ceil((L - j) / D) - 1``
for shard ``j``, and a query at position ``q`` sees local token ``t`` iff
``t * D + j <= q`` (causal over the global sequence).

This is the torch reference implementation (plain, vectorised over rows, fp32); a fused
kernel is out of scope.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from ..attention.paging import gather_pages

__all__ = ["ShardMetadata", "partial_attention", "merge_partials"]


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
    """

    row_request: torch.Tensor
    positions: torch.Tensor
    local_lens: torch.Tensor
    block_table: torch.Tensor
    max_local_len: int
    shard: int
    degree: int


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
    """
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
