"""Block allocator and paged KV cache, checked against simple references.

The allocator is driven by random allocate / free sequences next to a reference model
(a Python set of free block ids). The paged cache is checked by writing K/V for random
requests with shuffled block assignments and reading it back by gathering pages through
the block table, against the contiguous values that were written.
"""

import math
import random

import pytest
import torch

from tknp_megatron.kv_cache import (
    BlockAllocator,
    KVCacheSpec,
    OutOfBlocks,
    PagedKVCache,
)

# --------------------------------------------------------------------- allocator


def _check_accounting(alloc: BlockAllocator, ref_free: set) -> None:
    assert alloc.num_free == len(ref_free)
    assert alloc.free_tokens == len(ref_free) * alloc.block_size
    assert alloc.capacity_tokens == alloc.num_blocks * alloc.block_size
    assert 0 <= alloc.free_tokens <= alloc.capacity_tokens


@pytest.mark.parametrize("seed", range(8))
def test_allocator_matches_reference_set(seed):
    rng = random.Random(seed)
    num_blocks, block_size = rng.randint(1, 40), rng.choice([1, 2, 4, 16])
    alloc = BlockAllocator(num_blocks, block_size)
    ref_free = set(range(num_blocks))  # the reference model
    held = []  # allocations still out, each a list of block ids
    for _ in range(400):
        if held and rng.random() < 0.45:
            blocks = held.pop(rng.randrange(len(held)))
            alloc.free(blocks)
            assert not ref_free & set(blocks)
            ref_free |= set(blocks)
        else:
            tokens = rng.randint(0, 3 * block_size * 4)
            need = math.ceil(tokens / block_size)
            assert alloc.blocks_for(tokens) == need
            assert alloc.can_allocate(tokens) == (need <= len(ref_free))
            if need > len(ref_free):
                with pytest.raises(OutOfBlocks):
                    alloc.allocate(tokens)
            else:
                blocks = alloc.allocate(tokens)
                assert len(blocks) == need
                assert len(set(blocks)) == need
                # every block handed out was free: never handed out twice
                assert set(blocks) <= ref_free
                ref_free -= set(blocks)
                held.append(blocks)
        _check_accounting(alloc, ref_free)
    out = [b for blocks in held for b in blocks]
    assert len(out) == len(set(out))
    assert set(out) | ref_free == set(range(num_blocks))


def test_allocator_out_of_blocks_leaves_state_unchanged():
    alloc = BlockAllocator(5, 4)
    first = alloc.allocate(13)  # 4 blocks
    assert len(first) == 4 and alloc.num_free == 1
    with pytest.raises(OutOfBlocks):
        alloc.allocate(5)  # 2 blocks, 1 free
    assert alloc.num_free == 1
    assert alloc.allocate(4) == [b for b in range(5) if b not in first]
    assert alloc.num_free == 0 and alloc.free_tokens == 0
    assert not alloc.can_allocate(1)
    assert alloc.can_allocate(0) and alloc.allocate(0) == []


def test_allocator_double_free_detected_while_other_blocks_are_out():
    alloc = BlockAllocator(4, 2)
    a = alloc.allocate(4)  # 2 blocks
    alloc.allocate(4)
    alloc.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(a)  # the free list would still hold no more than num_blocks ids
    assert alloc.num_free == 2
    # the rejected free changed nothing: the next allocation gets each freed block once
    assert sorted(alloc.allocate(4)) == sorted(a)
    assert alloc.num_free == 0


def test_allocator_rejects_duplicate_and_foreign_ids():
    alloc = BlockAllocator(4, 2)
    blocks = alloc.allocate(8)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free([blocks[0], blocks[0]])
    with pytest.raises(ValueError):
        alloc.free([4])
    with pytest.raises(ValueError):
        alloc.free([-1])
    assert alloc.num_free == 0
    alloc.free(blocks)
    assert alloc.num_free == 4


def test_allocator_bad_arguments():
    with pytest.raises(ValueError):
        BlockAllocator(-1, 4)
    with pytest.raises(ValueError):
        BlockAllocator(4, 0)
    empty = BlockAllocator(0, 4)
    assert empty.capacity_tokens == 0 and not empty.can_allocate(1)


# --------------------------------------------------------------------- spec


def _spec(**overrides) -> KVCacheSpec:
    fields = dict(
        num_layers=3,
        num_blocks=10,
        block_size=4,
        local_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        max_slots=6,
        max_blocks_per_seq=5,
    )
    fields.update(overrides)
    return KVCacheSpec(**fields)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_spec_capacity_math(dtype):
    spec = _spec(dtype=dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    assert spec.bytes_per_block == 2 * 3 * 4 * 2 * 8 * elem
    assert spec.capacity_tokens == 10 * 4
    assert spec.capacity_bytes == 10 * spec.bytes_per_block
    # the bytes match a real buffer of that shape (plus the one scratch block for padding)
    cache = PagedKVCache(spec, torch.device("cpu"))
    assert cache.buffer.numel() * cache.buffer.element_size() == spec.capacity_bytes + spec.bytes_per_block
    assert spec.blocks_for_bytes(spec.capacity_bytes) == 10
    assert spec.blocks_for_bytes(spec.capacity_bytes - 1) == 9
    assert spec.blocks_for_bytes(0) == 0
    bigger = spec.with_blocks(25)
    assert bigger.num_blocks == 25 and bigger.bytes_per_block == spec.bytes_per_block
    assert spec.num_blocks == 10  # frozen: with_blocks returns a copy


def test_spec_without_room_raises():
    with pytest.raises(ValueError, match="no room"):
        _spec(num_blocks=0)
    with pytest.raises(ValueError, match="no room"):
        _spec().with_blocks(_spec().blocks_for_bytes(_spec().bytes_per_block - 1))
    for name in ("num_layers", "block_size", "local_kv_heads", "head_dim", "max_slots"):
        with pytest.raises(ValueError, match=name):
            _spec(**{name: 0})


# --------------------------------------------------------------------- paged cache


def _gather(cache: PagedKVCache, layer: int, slot: int, length: int):
    """Read a request's K and V back through its block table: ``[length, heads, d]`` each."""
    bs = cache.spec.block_size
    n = math.ceil(length / bs)
    table = cache.block_table[slot, :n].long()
    k_cache, v_cache = cache.layer(layer)  # [blocks, block_size, heads, d]
    k = k_cache[table].flatten(0, 1)[:length]
    v = v_cache[table].flatten(0, 1)[:length]
    return k, v


def _random_requests(rng: random.Random, spec: KVCacheSpec, count: int):
    """Slots, lengths and shuffled disjoint block lists for ``count`` requests."""
    ids = list(range(spec.num_blocks))
    rng.shuffle(ids)
    slots = rng.sample(range(spec.max_slots), count)
    out = []
    for slot in slots:
        length = rng.randint(1, spec.max_blocks_per_seq * spec.block_size)
        n = math.ceil(length / spec.block_size)
        blocks, ids = ids[:n], ids[n:]
        out.append((slot, length, blocks))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_write_slot_mapping_round_trip(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    spec = _spec(num_blocks=40, block_size=rng.choice([1, 3, 4]), max_blocks_per_seq=6)
    cache = PagedKVCache(spec, torch.device("cpu"))
    reqs = _random_requests(rng, spec, count=5)
    h, d = spec.local_kv_heads, spec.head_dim
    expected = {}
    for slot, length, blocks in reqs:
        cache.assign(slot, blocks)
        expected[slot] = torch.randn(spec.num_layers, 2, length, h, d)
    # write in random interleaved chunks, as prefill and decode steps would
    rows = [(slot, pos) for slot, length, _ in reqs for pos in range(length)]
    rng.shuffle(rows)
    for start in range(0, len(rows), 7):
        chunk = rows[start : start + 7]
        slots = torch.tensor([s for s, _ in chunk])
        positions = torch.tensor([p for _, p in chunk])
        mapping = cache.slot_mapping(slots, positions)
        assert mapping.dtype == torch.int64 and mapping.shape == (len(chunk),)
        for layer in range(spec.num_layers):
            k = torch.stack([expected[s][layer, 0, p] for s, p in chunk])
            v = torch.stack([expected[s][layer, 1, p] for s, p in chunk])
            cache.write(layer, k, v, mapping)
    for slot, length, _ in reqs:
        for layer in range(spec.num_layers):
            k, v = _gather(cache, layer, slot, length)
            torch.testing.assert_close(k, expected[slot][layer, 0], rtol=0, atol=0)
            torch.testing.assert_close(v, expected[slot][layer, 1], rtol=0, atol=0)
    # nothing outside the assigned pages was touched
    used = {b for _, _, blocks in reqs for b in blocks}
    unused = [b for b in range(spec.num_blocks) if b not in used]
    assert torch.count_nonzero(cache.buffer[:, :, unused]) == 0


def test_slot_mapping_matches_block_table_arithmetic():
    spec = _spec(num_blocks=12, block_size=4, max_blocks_per_seq=3)
    cache = PagedKVCache(spec, torch.device("cpu"))
    cache.assign(2, [7, 0, 11])
    positions = torch.arange(12)
    mapping = cache.slot_mapping(torch.full_like(positions, 2), positions)
    expected = [[7, 0, 11][p // 4] * 4 + p % 4 for p in range(12)]
    assert mapping.tolist() == expected
    with pytest.raises(ValueError, match="block-table width"):
        cache.assign(0, [1, 2, 3, 4])


@pytest.mark.parametrize("seed", range(3))
def test_ingest_in_pieces_equals_ingest_whole(seed):
    rng = random.Random(seed)
    torch.manual_seed(200 + seed)
    spec = _spec(num_blocks=30, block_size=rng.choice([2, 4, 5]), max_blocks_per_seq=5)
    whole = PagedKVCache(spec, torch.device("cpu"))
    pieces = PagedKVCache(spec, torch.device("cpu"))
    for slot, length, blocks in _random_requests(rng, spec, count=4):
        kv = torch.randn(spec.num_layers, 2, length, spec.local_kv_heads, spec.head_dim)
        for cache in (whole, pieces):
            cache.assign(slot, blocks)
        whole.ingest(slot, kv)
        cuts = sorted({0, length, *(rng.randrange(length + 1) for _ in range(3))})
        for lo, hi in zip(cuts, cuts[1:]):  # pieces of any lengths, not page-aligned
            pieces.ingest(slot, kv[:, :, lo:hi], start=lo)
    torch.testing.assert_close(pieces.buffer, whole.buffer, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("seed", range(3))
def test_ingest_equals_token_by_token_write(seed):
    rng = random.Random(seed)
    torch.manual_seed(100 + seed)
    spec = _spec(num_blocks=30, block_size=rng.choice([2, 4, 5]), max_blocks_per_seq=5)
    ingested = PagedKVCache(spec, torch.device("cpu"))
    written = PagedKVCache(spec, torch.device("cpu"))
    for slot, length, blocks in _random_requests(rng, spec, count=4):
        kv = torch.randn(spec.num_layers, 2, length, spec.local_kv_heads, spec.head_dim)
        for cache in (ingested, written):
            cache.assign(slot, blocks)
        ingested.ingest(slot, kv)
        for pos in range(length):
            mapping = written.slot_mapping(torch.tensor([slot]), torch.tensor([pos]))
            for layer in range(spec.num_layers):
                written.write(layer, kv[layer, 0, pos : pos + 1], kv[layer, 1, pos : pos + 1], mapping)
        for layer in range(spec.num_layers):
            k, v = _gather(ingested, layer, slot, length)
            torch.testing.assert_close(k, kv[layer, 0], rtol=0, atol=0)
            torch.testing.assert_close(v, kv[layer, 1], rtol=0, atol=0)
    torch.testing.assert_close(ingested.buffer, written.buffer, rtol=0, atol=0)


def test_write_casts_to_cache_dtype():
    spec = _spec(dtype=torch.bfloat16)
    cache = PagedKVCache(spec, torch.device("cpu"))
    cache.assign(0, [3])
    k = torch.randn(2, spec.local_kv_heads, spec.head_dim)
    v = torch.randn(2, spec.local_kv_heads, spec.head_dim)
    cache.write(1, k, v, cache.slot_mapping(torch.tensor([0, 0]), torch.tensor([0, 1])))
    got_k, got_v = _gather(cache, 1, 0, 2)
    assert got_k.dtype == torch.bfloat16
    torch.testing.assert_close(got_k, k.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(got_v, v.to(torch.bfloat16), rtol=0, atol=0)
