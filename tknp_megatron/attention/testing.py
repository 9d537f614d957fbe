"""Random paged-attention cases for tests and benchmarks.

A case is a random paged cache (K and V as views of one ``[2, blocks, block_size, Hkv,
d]`` buffer, like a layer's slice of the owner's KV buffer), a shuffled block table,
query rows and metadata. Cache slots that no request owns (unassigned blocks, the tail
of each request's last page) can be filled with NaN, so a backend that reads past a
request's length, even to multiply by a zero weight, is caught.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

from tknp_megatron.attention.base import AttentionMetadata

__all__ = ["PagedCase", "make_paged_case", "poison_unowned_slots"]


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


def _shuffled_block_table(
    seq_lens: Sequence[int], block_size: int, num_blocks: int, pad_blocks: int, gen: torch.Generator
) -> torch.Tensor:
    """``[R, max_blocks + pad_blocks]`` int32; pages are a random permutation of the pool,
    padding entries are random (valid) block ids."""
    needed = [-(-s // block_size) for s in seq_lens]
    width = max(needed, default=0) + pad_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, max(num_blocks, 1), (len(seq_lens), width), generator=gen)
    start = 0
    for r, n in enumerate(needed):
        table[r, :n] = perm[start : start + n]
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
) -> PagedCase:
    """Random case: request ``r`` has ``query_lens[r]`` rows ending at ``seq_lens[r]``.

    The pool holds the requests' pages plus ``spare_blocks`` unassigned ones; every
    block-table row has ``pad_blocks`` extra random entries. ``head_major`` stores the buffer
    as ``[2, blocks, Hkv, block_size, d]`` (a page of one head is contiguous) and returns the
    same ``[blocks, block_size, Hkv, d]`` views, strided.
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + spare_blocks
    table = _shuffled_block_table(seq_lens, block_size, num_blocks, pad_blocks, gen)
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
