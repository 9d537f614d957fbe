"""Request-owned paged KV cache: block allocator (coordinator) and buffers (every rank).

Every node keeps the KV cache of the requests it owns, for every layer, with its KV heads
sharded over the node's TP ranks. The coordinator runs one :class:`BlockAllocator` per node
and decides block ids; each rank holds one :class:`PagedKVCache` buffer
``[layers, 2, blocks, block_size, local_kv_heads, head_dim]`` and a block table per
request slot, written once at admission (the full reservation is allocated up front).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Sequence

import torch

from tknp_megatron.host_to_device import to_device

__all__ = ["OutOfBlocks", "BlockAllocator", "KVCacheSpec", "PagedKVCache"]


class OutOfBlocks(RuntimeError):
    """An allocation asked for more blocks than are free."""


class BlockAllocator:
    """Free list of a node's KV blocks, with per-node capacity accounting.

    Args:
        num_blocks: blocks each TP rank of the node holds (the node's usable minimum).
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: Deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks  # catches a double free even when others are out

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_tokens(self) -> int:
        return self.num_free * self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold ``tokens`` tokens."""
        return math.ceil(tokens / self.block_size)

    def can_allocate(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= self.num_free

    def allocate(self, tokens: int) -> List[int]:
        """Take the blocks for ``tokens`` tokens off the free list."""
        n = self.blocks_for(tokens)
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} blocks for {tokens} tokens, {self.num_free} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._is_free[b] = False
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Return blocks to the free list; checked before anything changes."""
        blocks = list(blocks)
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block {b} outside [0, {self.num_blocks})")
        if len(set(blocks)) != len(blocks) or any(self._is_free[b] for b in blocks):
            raise RuntimeError(f"double free: a block of {blocks} is already free")
        for b in blocks:
            self._is_free[b] = True
        self._free.extend(blocks)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one rank's KV cache.

    Attributes:
        num_layers: layers (every rank caches every layer for its own requests).
        num_blocks: blocks in the buffer.
        block_size: tokens per block.
        local_kv_heads: KV heads this TP rank holds.
        head_dim: d_h.
        dtype: element type.
        max_slots: most requests a node owns at once.
        max_blocks_per_seq: block-table width (longest sequence / block size).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    local_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_slots: int
    max_blocks_per_seq: int

    def __post_init__(self):
        for name in ("num_layers", "block_size", "local_kv_heads", "head_dim", "max_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1")
        if self.num_blocks < 1:
            raise ValueError("KV cache has no room: num_blocks < 1")

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.local_kv_heads * self.head_dim * elem

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def with_blocks(self, num_blocks: int) -> "KVCacheSpec":
        return KVCacheSpec(**{**self.__dict__, "num_blocks": num_blocks})

    def blocks_for_bytes(self, budget_bytes: int) -> int:
        """Blocks that fit in ``budget_bytes``."""
        return budget_bytes // self.bytes_per_block


class PagedKVCache:
    """One rank's KV buffer and block tables.

    One extra block (index ``num_blocks``, never allocated) and one extra block-table row
    (``dummy_slot``, pointing at it) absorb the writes of the padding requests that fill a
    CUDA-graph batch bucket.

    Attributes:
        buffer: ``[layers, 2, num_blocks + 1, block_size, local_kv_heads, head_dim]``.
        block_table: ``[max_slots + 1, max_blocks_per_seq]`` int32, row per request slot.
    """

    def __init__(self, spec: KVCacheSpec, device: torch.device):
        self.spec = spec
        self.buffer = torch.zeros(
            spec.num_layers,
            2,
            spec.num_blocks + 1,
            spec.block_size,
            spec.local_kv_heads,
            spec.head_dim,
            dtype=spec.dtype,
            device=device,
        )
        self.block_table = torch.zeros(
            spec.max_slots + 1, spec.max_blocks_per_seq, dtype=torch.int32, device=device
        )
        self.block_table[self.dummy_slot] = spec.num_blocks  # the scratch block

    @property
    def dummy_slot(self) -> int:
        """Block-table row of padding requests (all entries: the scratch block)."""
        return self.spec.max_slots

    def layer(self, layer: int):
        """``(k_cache, v_cache)`` views of one layer, each ``[blocks, block_size, heads, d]``."""
        return self.buffer[layer, 0], self.buffer[layer, 1]

    def assign(self, slot: int, blocks: Sequence[int]) -> None:
        """Write a newly admitted request's blocks into its slot's block-table row."""
        if len(blocks) > self.spec.max_blocks_per_seq:
            raise ValueError(
                f"{len(blocks)} blocks exceed the block-table width {self.spec.max_blocks_per_seq}"
            )
        (row,) = to_device((torch.tensor(list(blocks), dtype=torch.int32),), self.block_table.device)
        self.block_table[slot, : len(blocks)].copy_(row)  # stream-ordered, no host wait

    def slot_mapping(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat cache slot of each row: ``[rows]`` slots and positions -> ``[rows]`` int64."""
        bs = self.spec.block_size
        blocks = self.block_table[slots.long(), torch.div(positions, bs, rounding_mode="floor")]
        return blocks.long() * bs + positions % bs

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
        """Store ``k``, ``v`` ``[rows, local_kv_heads, d]`` at ``slot_mapping`` ``[rows]``."""
        flat = self.buffer[layer].flatten(1, 2)  # [2, blocks * block_size, heads, d]
        flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
        flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))

    def ingest(self, slot: int, kv: torch.Tensor, start: int = 0) -> None:
        """Place KV computed elsewhere: ``kv`` ``[layers, 2, L, local_kv_heads, d]`` at positions
        ``start .. start + L - 1`` (a long prompt's KV arrives in pieces)."""
        length = kv.shape[2]
        positions = torch.arange(start, start + length, device=self.block_table.device)
        slots = torch.full_like(positions, slot)
        mapping = self.slot_mapping(slots, positions)
        flat = self.buffer.flatten(2, 3)  # [layers, 2, blocks * block_size, heads, d]
        flat.index_copy_(2, mapping, kv.to(device=flat.device, dtype=flat.dtype))
