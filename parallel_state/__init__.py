"""Token-parallel extension of ``megatron.core.parallel_state``.

A decode pool is N nodes x T ranks. Megatron's own initializer builds the usual groups
(TP inside a node, so every Megatron getter keeps working); this module adds the
token-parallel dimension: the N ranks that share a tp_rank, one per node.
"""

from .token_parallel import (
    TokenParallelGroups,
    destroy_model_parallel,
    get_groups,
    get_token_parallel_group,
    get_token_parallel_global_rank,
    get_token_parallel_rank,
    get_token_parallel_world_size,
    get_tensor_model_parallel_group,
    initialize_model_parallel,
    model_parallel_is_initialized,
)

__all__ = [
    "TokenParallelGroups",
    "destroy_model_parallel",
    "get_groups",
    "get_token_parallel_group",
    "get_token_parallel_global_rank",
    "get_token_parallel_rank",
    "get_token_parallel_world_size",
    "get_tensor_model_parallel_group",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
]
