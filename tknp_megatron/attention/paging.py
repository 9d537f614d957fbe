"""Vectorised torch helpers over the paged cache and the query-row layout (no host sync)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from tknp_megatron.attention.base import AttentionMetadata

__all__ = ["gather_pages", "row_requests", "query_lens"]


def gather_pages(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    max_len: int,
    seq_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Copy each request's pages into contiguous storage.

    Args:
        cache: ``[num_blocks, block_size, Hkv, d]`` one layer's K or V cache.
        block_table: ``[R, max_blocks]`` int physical block ids.
        max_len: host int, tokens to keep per request (>= every request's length).
        seq_lens: ``[R]`` lengths; when given, positions past a request's length are
            zeroed (a cache slot nobody owns may hold anything, NaN included, and a
            masked score still multiplies it).

    Returns:
        ``[R, max_len, Hkv, d]``; without ``seq_lens``, positions past a request's length
        hold whatever its pages or padding blocks hold.
    """
    block_size = cache.shape[1]
    num_blocks = -(-max_len // block_size)
    if num_blocks > block_table.shape[1]:
        raise ValueError(f"max_len {max_len} needs {num_blocks} blocks, table has {block_table.shape[1]}")
    pages = cache[block_table[:, :num_blocks].long()]  # [R, nb, block_size, Hkv, d]
    flat = pages.reshape(block_table.shape[0], num_blocks * block_size, *cache.shape[2:])
    flat = flat[:, :max_len]
    if seq_lens is None:
        return flat
    valid = torch.arange(max_len, device=cache.device)[None, :] < seq_lens[:, None]
    return torch.where(valid[:, :, None, None], flat, flat.new_zeros(()))


def query_lens(meta: AttentionMetadata) -> torch.Tensor:
    """``[R]`` int64 query rows per request."""
    return (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()


def row_requests(meta: AttentionMetadata, num_rows: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Map each query row to its request, its index inside the request and its position.

    Returns:
        ``(req, idx, pos)``, each ``[num_rows]`` int64: row ``i`` is query ``idx[i]`` of
        request ``req[i]`` and sits at cache position ``pos[i]``.
    """
    qsl = meta.query_start_loc.long()
    rows = torch.arange(num_rows, device=qsl.device)
    req = torch.searchsorted(qsl[1:], rows, right=True)
    idx = rows - qsl[req]
    pos = meta.seq_lens.long()[req] - query_lens(meta)[req] + idx
    return req, idx, pos
