"""Token-parallel process groups over Megatron's parallel state.

Rank layout (Megatron order ``tp-cp-ep-dp-pp`` with pp = cp = ep = 1): the global rank of
(node, tp_rank) is ``node * T + tp_rank``. TP groups are the T ranks of a node; the
token-parallel group of a rank is the N ranks with its tp_rank (matching TP ranks across
nodes), which carries the per-layer scatter / gather and the block handoffs.

A world may hold several independent pools (``num_pools`` R, e.g. the replicas of the
data-parallel baseline): pool p owns global ranks ``p*N*T .. (p+1)*N*T - 1`` and has its
own coordinator (its first rank) and its own pool group for step-plan broadcasts.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Optional, Tuple

import torch.distributed as dist
from megatron.core import parallel_state as mpu


@dataclass(frozen=True)
class TokenParallelGroups:
    """The groups and coordinates of one rank in an N x T pool.

    Attributes:
        num_nodes: N, the token-parallel world size.
        tp_size: T, ranks per node.
        node: this rank's node id (its token-parallel rank).
        tp_rank: this rank's rank inside its node.
        tp_group: Megatron's tensor-parallel group (the node).
        tknp_group: the N ranks sharing ``tp_rank``, ordered by node.
        pool: this rank's pool (0 unless the world holds several).
        num_pools: pools in the world.
        pool_group: the N x T ranks of this pool (token broadcasts, device tensors).
        pool_cpu_group: the same ranks over gloo: step plans travel host to host, so a
            rank receives the next plan without waiting for its GPU (on CPU runs it is
            ``pool_group`` itself).
    """

    num_nodes: int
    tp_size: int
    node: int
    tp_rank: int
    tp_group: dist.ProcessGroup
    tknp_group: dist.ProcessGroup
    pool: int = 0
    num_pools: int = 1
    pool_group: Optional[dist.ProcessGroup] = None
    pool_cpu_group: Optional[dist.ProcessGroup] = None

    @property
    def pool_size(self) -> int:
        return self.num_nodes * self.tp_size

    @property
    def coordinator_rank(self) -> int:
        """Global rank of this pool's coordinator (its node 0, tp_rank 0)."""
        return self.pool * self.pool_size

    def global_rank(self, node: int, tp_rank: Optional[int] = None) -> int:
        """Global rank of (node, tp_rank) in this pool; tp_rank defaults to this rank's."""
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        if not (0 <= node < self.num_nodes and 0 <= tp_rank < self.tp_size):
            raise ValueError(
                f"(node={node}, tp_rank={tp_rank}) outside the {self.num_nodes}x{self.tp_size} pool"
            )
        return self.coordinator_rank + node * self.tp_size + tp_rank

    @property
    def tknp_ranks(self) -> Tuple[int, ...]:
        """Global ranks of this rank's token-parallel group, by node."""
        return tuple(self.global_rank(n) for n in range(self.num_nodes))

    @property
    def is_coordinator(self) -> bool:
        """The pool's first rank builds and broadcasts the step plans."""
        return self.node == 0 and self.tp_rank == 0


_GROUPS: Optional[TokenParallelGroups] = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    token_parallel_size: Optional[int] = None,
    num_pools: int = 1,
    **megatron_kwargs,
) -> TokenParallelGroups:
    """Build Megatron's groups for TP = T and add the token-parallel groups.

    ``torch.distributed`` must be initialised (gloo on CPU, NCCL on GPU) with a world of
    R x N x T ranks (R = ``num_pools``, 1 for one TKNP pool). ``token_parallel_size`` (N)
    defaults to world_size / (R x T). Extra keyword arguments go to
    ``megatron.core.parallel_state.initialize_model_parallel``.
    """
    global _GROUPS
    if _GROUPS is not None:
        raise RuntimeError("token-parallel groups already initialised; destroy them first")
    world = dist.get_world_size()
    t = tensor_model_parallel_size
    if num_pools < 1 or t < 1 or (token_parallel_size is not None and token_parallel_size < 1):
        # checked before world // t: 0 would divide by zero, and two negatives could
        # multiply to the world size and reach Megatron, leaving its state half built
        raise ValueError(
            f"sizes must be >= 1: tensor_model_parallel_size {t}, "
            f"token_parallel_size {token_parallel_size}, num_pools {num_pools}"
        )
    n = world // (t * num_pools) if token_parallel_size is None else token_parallel_size
    if num_pools * n * t != world:
        raise ValueError(
            f"num_pools {num_pools} x token_parallel_size {n} x tensor_model_parallel_size {t}"
            f" != world size {world}"
        )
    mpu.initialize_model_parallel(tensor_model_parallel_size=t, **megatron_kwargs)
    rank = dist.get_rank()
    size = n * t
    tknp_group = pool_group = pool_cpu_group = None
    host_backend = dist.get_backend() == "gloo"
    for pool in range(num_pools):  # every rank creates every group, in the same order
        for tp_rank in range(t):
            ranks = [pool * size + node * t + tp_rank for node in range(n)]
            group = dist.new_group(ranks)
            if rank in ranks:
                tknp_group = group
        ranks = list(range(pool * size, (pool + 1) * size))
        group = dist.new_group(ranks) if num_pools > 1 else dist.group.WORLD
        cpu_group = group if host_backend else dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            pool_group, pool_cpu_group = group, cpu_group
    _GROUPS = TokenParallelGroups(
        num_nodes=n,
        tp_size=t,
        node=(rank % size) // t,
        tp_rank=rank % t,
        tp_group=mpu.get_tensor_model_parallel_group(),
        tknp_group=tknp_group,
        pool=rank // size,
        num_pools=num_pools,
        pool_group=pool_group,
        pool_cpu_group=pool_cpu_group,
    )
    return _GROUPS


def get_groups() -> TokenParallelGroups:
    """The groups built by :func:`initialize_model_parallel`."""
    if _GROUPS is None:
        raise RuntimeError("token-parallel groups are not initialised")
    return _GROUPS


def model_parallel_is_initialized() -> bool:
    return _GROUPS is not None and mpu.model_parallel_is_initialized()


def get_token_parallel_group() -> dist.ProcessGroup:
    return get_groups().tknp_group


def get_token_parallel_rank() -> int:
    """This rank's node id."""
    return get_groups().node


def get_token_parallel_world_size() -> int:
    return get_groups().num_nodes


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    return get_groups().tp_group


def get_token_parallel_global_rank(node: int, tp_rank: Optional[int] = None) -> int:
    """Global rank of (node, tp_rank)."""
    return get_groups().global_rank(node, tp_rank)


def destroy_model_parallel() -> None:
    """Drop the token-parallel groups and Megatron's.

    Drop every engine built on them first (``del engine``): this collects garbage before
    it destroys a group, because destroying an NCCL group while CUDA graphs captured on it
    are still alive hangs (seen on H200 with torch 2.11: ``destroy_process_group`` never
    returned). It thaws the heap first: an engine freezes the objects alive once it is built
    (``gc.freeze``), and a frozen cycle is never collected. What is left alive it freezes
    again, so the next engine's collection, and every full one until then, scans only what
    was allocated after it (as in a rank forked from a frozen forkserver:
    ``tknp_megatron.forkserver_heap``).
    """
    global _GROUPS
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    if _GROUPS is not None and dist.is_initialized():
        dist.destroy_process_group(_GROUPS.tknp_group)
        if _GROUPS.num_pools > 1:
            dist.destroy_process_group(_GROUPS.pool_group)
        if _GROUPS.pool_cpu_group is not _GROUPS.pool_group:
            dist.destroy_process_group(_GROUPS.pool_cpu_group)
    _GROUPS = None
    mpu.destroy_model_parallel()
