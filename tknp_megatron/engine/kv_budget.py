"""Sizing a rank's KV cache and agreeing on every node's block count.

CPU runs take an explicit token budget per node; GPU runs size the cache from the free
memory left after the weights. A node's capacity is its smallest TP rank's (eligibility
must hold on every rank), and the coordinator learns every node's count.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch
import torch.distributed as dist

from tknp_megatron.config import ModelPreset
from tknp_megatron.kv_cache import KVCacheSpec

if TYPE_CHECKING:  # parallel_state imports Megatron-Core (seconds of CPU), which a job's
    # launching process, sizing the budget with waves_budget, has no other use for
    from parallel_state import TokenParallelGroups

__all__ = ["budget_blocks", "kv_cache_spec", "pool_block_counts", "waves_budget"]


def waves_budget(reservations: Sequence[int], nodes: int, block_size: int) -> int:
    """A KV budget per node (tokens) for a CPU run, which has no free memory to measure:
    half of the ``reservations`` (prompt + max new tokens of each request) per node, at
    least the largest, in whole blocks, so the requests are admitted in waves."""
    half = -(-sum(reservations) // (2 * nodes))
    return -(-max(half, max(reservations)) // block_size) * block_size


def budget_blocks(bytes_per_block: int, engine_config, device: torch.device) -> int:
    """KV blocks this rank may allocate under the engine's budget."""
    if engine_config.kv_tokens_per_node is not None:  # whole blocks within the budget
        return engine_config.kv_tokens_per_node // engine_config.block_size
    if device.type != "cuda":
        raise ValueError("kv_tokens_per_node is required off GPU (no free-memory measure)")
    free, total = torch.cuda.mem_get_info(device)
    budget = free - (1.0 - engine_config.gpu_memory_utilization) * total
    if engine_config.gpu_memory_cap_gib is not None:  # pretend the GPU holds only this much
        budget = min(budget, engine_config.gpu_memory_cap_gib * 2**30 - torch.cuda.memory_allocated(device))
    return max(0, int(budget // bytes_per_block))


def kv_cache_spec(
    preset: ModelPreset,
    model_config,
    groups: TokenParallelGroups,
    engine_config,
    device: torch.device,
    num_layers: Optional[int] = None,
) -> KVCacheSpec:
    """This rank's cache shape, sized from the engine's budget.

    ``num_layers`` is the layers whose KV this rank keeps (all of them for TKNP owners;
    a pipeline stage keeps only its own).
    """
    probe = KVCacheSpec(
        num_layers=preset.num_layers if num_layers is None else num_layers,
        num_blocks=1,
        block_size=engine_config.block_size,
        local_kv_heads=preset.local_kv_heads(groups.tp_size),
        head_dim=preset.kv_channels,
        dtype=model_config.params_dtype,
        max_slots=engine_config.max_requests_per_node,
        max_blocks_per_seq=math.ceil(engine_config.sequence_limit(preset) / engine_config.block_size),
    )
    blocks = budget_blocks(probe.bytes_per_block, engine_config, device)
    if blocks < 1:
        raise RuntimeError(
            f"node {groups.node} rank {groups.tp_rank}: no memory left for the KV cache "
            f"({probe.bytes_per_block} bytes per block)"
        )
    return probe.with_blocks(blocks)


def pool_block_counts(spec: KVCacheSpec, groups: TokenParallelGroups, device) -> List[int]:
    """Per node, the smallest block count of its TP ranks (known on every rank)."""
    mine = torch.tensor([spec.num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=groups.tp_group)
    every = [torch.zeros_like(mine) for _ in range(groups.pool_size)]
    dist.all_gather(every, mine, group=groups.pool_group)
    base = groups.coordinator_rank
    return [int(every[groups.global_rank(n, 0) - base]) for n in range(groups.num_nodes)]
