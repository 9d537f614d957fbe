"""Random paged-attention cases for tests and benchmarks.

A case is a random paged cache (K and V as views of one ``[2, blocks, block_size, Hkv,
d]`` buffer, like a layer's slice of the owner's KV buffer), a block table (pages in a
random order by default, see :data:`PAGE_ORDERS`), query rows and metadata. Cache slots
that no request owns (unassigned blocks, the tail of each request's last page) can be
filled with NaN, so a backend that reads past a request's length, even to multiply by a
zero weight, is caught.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

from tknp_megatron.attention.base import AttentionMetadata

__all__ = ["PAGE_ORDERS", "PagedCase", "make_paged_case", "poison_unowned_slots"]

# How a case's pages lie in the pool, from most to least local:
# - "in-order": each request's pages consecutive, request after request, as the engine's
#   allocator hands out a fresh pool's reservations (``kv_cache.BlockAllocator``);
# - "interleaved": page j of request r is page j * R + r, as if R requests had grown one
#   page at a time in lockstep;
# - "shuffled": a random permutation of the pool (the default: no locality at all).
PAGE_ORDERS = ("in-order", "interleaved", "shuffled")


@dataclass(frozen=True, eq=False)
class PagedCase:
    """Inputs of one attention call.

    Attributes:
        q: ``[rows, Hq, d]``.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, d]`` views of one buffer.
        meta: the step metadata.
        scale: softmax scale, ``d ** -0.5``.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float

    def args(self):
        """``(q, k_cache, v_cache, meta, scale)`` for ``AttentionBackend.forward``."""
        return self.q, self.k_cache, self.v_cache, self.meta, self.scale


def _block_table(
    seq_lens: Sequence[int], block_size: int, num_blocks: int, pad_blocks: int, gen: torch.Generator,
    page_order: str = "shuffled",
) -> torch.Tensor:
    """``[R, max_blocks + pad_blocks]`` int32, the pages laid out as ``page_order`` says
    (:data:`PAGE_ORDERS`); padding entries are random (valid) block ids."""
    if page_order not in PAGE_ORDERS:
        raise ValueError(f"page_order {page_order!r}: one of {', '.join(PAGE_ORDERS)}")
    needed = [-(-s // block_size) for s in seq_lens]
    width = max(needed, default=0) + pad_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, max(num_blocks, 1), (len(seq_lens), width), generator=gen)
    if page_order == "interleaved":  # deal page j of every request before page j + 1 of any
        n = torch.tensor(needed, dtype=torch.long)
        owned = torch.arange(width).unsqueeze(0) < n.unsqueeze(1)  # [R, width]
        ids = owned.t().reshape(-1).cumsum(0).reshape(width, -1).t() - 1  # numbered page by page
        return torch.where(owned, ids, table).to(torch.int32)
    pool = perm if page_order == "shuffled" else torch.arange(num_blocks)
    start = 0
    for r, n in enumerate(needed):
        table[r, :n] = pool[start : start + n]
        start += n
    return table.to(torch.int32)


def poison_unowned_slots(cache: torch.Tensor, meta: AttentionMetadata, value: float = float("nan")) -> None:
    """Fill every slot of ``cache [blocks, block_size, ...]`` that holds no request's token.

    Reads the metadata back to the host; for test set-up only.
    """
    block_size = cache.shape[1]
    owned = torch.zeros(cache.shape[:2], dtype=torch.bool, device=cache.device)
    table = meta.block_table.long()
    for r, length in enumerate(meta.seq_lens.tolist()):
        pos = torch.arange(length, device=cache.device)
        owned[table[r, pos // block_size], pos % block_size] = True
    cache[~owned] = value


def make_paged_case(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device] = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    pad_blocks: int = 1,
    poison: bool = True,
    head_major: bool = False,
    page_order: str = "shuffled",
) -> PagedCase:
    """Random case: request ``r`` has ``query_lens[r]`` rows ending at ``seq_lens[r]``.

    The pool holds the requests' pages plus ``spare_blocks`` unassigned ones; every
    block-table row has ``pad_blocks`` extra random entries. ``head_major`` stores the buffer
    as ``[2, blocks, Hkv, block_size, d]`` (a page of one head is contiguous) and returns the
    same ``[blocks, block_size, Hkv, d]`` views, strided. ``page_order`` places the
    requests' pages in the pool (:data:`PAGE_ORDERS`).
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + spare_blocks
    table = _block_table(seq_lens, block_size, num_blocks, pad_blocks, gen, page_order)
    meta = AttentionMetadata.from_lengths(query_lens, seq_lens, table, device=device)
    dims = (num_kv_heads, block_size) if head_major else (block_size, num_kv_heads)
    buf = torch.empty((2, num_blocks, *dims, head_dim), dtype=dtype, device=device)
    buf.normal_(generator=_device_generator(device, seed))
    if head_major:
        buf = buf.transpose(2, 3)
    k_cache, v_cache = buf[0], buf[1]
    if poison:
        poison_unowned_slots(k_cache, meta)
        poison_unowned_slots(v_cache, meta)
    q = torch.randn((sum(query_lens), num_heads, head_dim), generator=gen).to(dtype=dtype, device=device)
    return PagedCase(q, k_cache, v_cache, meta, head_dim**-0.5)


def _device_generator(device: Union[str, torch.device], seed: int) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(seed + 1)
