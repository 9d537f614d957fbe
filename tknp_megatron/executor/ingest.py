"""Admitting requests on a rank: block-table rows and the prompt KV that comes with them.

A request admitted with its prompt's KV from outside (``add_request(kv=...)``, or a
synthetic seed in benchmarks) has the KV of its first ``ingest_len`` tokens written into
the cache of every rank that stores part of it. Modes differ only in which admissions a
rank assigns and which part of the logical KV ``[layers, 2, positions, kv_heads, d]``
it keeps (:class:`KVSlice`):

  TKNP, DP, TP: the owner node's ranks; every layer, the TP rank's heads.
  PP: every stage; the stage's layers, the TP rank's heads.
  DCP: every rank; every layer, positions ``p = shard (mod D)``, its group's one head.

Outside KV that is not synthetic travels from the coordinator to the owner's ranks
through one :class:`KVIngest`: the engine calls :meth:`KVIngest.send` when it issues the
step that admits the request, the owners' :class:`Admitter` calls
:meth:`KVIngest.receive`; the coordinator keeps its own part in the same object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from parallel_state import TokenParallelGroups
from tknp_megatron.executor.synthetic import synthetic_kv
from tknp_megatron.kv_cache import PagedKVCache
from tknp_megatron.plan import Admission

__all__ = ["Admitter", "KVIngest", "KVSlice"]


@dataclass(frozen=True)
class KVSlice:
    """The part of a request's KV ``[layers, 2, positions, kv_heads, d]`` one rank stores.

    Attributes:
        layers: global layer ids.
        kv_heads: global KV-head ids.
        num_kv_heads: the model's KV heads counted as the synthetic KV's global index does.
        head_dim: d.
        shard: this rank keeps positions ``shard, shard + num_shards, ...``.
        num_shards: 1 unless the sequence is sharded (DCP's degree D).
    """

    layers: Tuple[int, ...]
    kv_heads: Tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    shard: int = 0
    num_shards: int = 1

    def __post_init__(self):
        if not 0 <= self.shard < self.num_shards:
            raise ValueError(f"shard {self.shard} outside [0, {self.num_shards})")
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "kv_heads", tuple(self.kv_heads))

    @classmethod
    def tp_heads(cls, layers: Sequence[int], tp_rank: int, tp_size: int, local_kv_heads: int,
                 head_dim: int) -> "KVSlice":
        """Every position of TP rank ``tp_rank``'s heads
        ``[tp_rank * local_kv_heads, (tp_rank + 1) * local_kv_heads)`` in ``layers``."""
        first = tp_rank * local_kv_heads
        return cls(tuple(layers), tuple(range(first, first + local_kv_heads)),
                   local_kv_heads * tp_size, head_dim)

    def shape(self, length: int) -> Tuple[int, ...]:
        """This rank's part of the KV of ``length`` tokens."""
        positions = len(range(self.shard, length, self.num_shards))
        return (len(self.layers), 2, positions, len(self.kv_heads), self.head_dim)

    def synthetic(self, seed: int, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This rank's part (:meth:`shape`) of the synthetic KV of ``length`` tokens."""
        positions = torch.arange(self.shard, length, self.num_shards, device=device)
        return synthetic_kv(seed, self.layers, positions, self.kv_heads, self.num_kv_heads,
                            self.head_dim, dtype, device)


class KVIngest:
    """Both sides of moving a request's outside KV from the coordinator to its owner.

    Args:
        groups: the pool's groups.
        local_kv_heads: KV heads per TP rank (the owner's rank t gets heads
            ``[t * local_kv_heads, (t + 1) * local_kv_heads)``).
        dtype: the cache's dtype.
        device: this rank's device.
    """

    def __init__(self, groups: TokenParallelGroups, local_kv_heads: int, dtype: torch.dtype,
                 device: torch.device):
        self.groups, self.local_kv_heads, self.dtype, self.device = groups, local_kv_heads, dtype, device
        self._kept: Dict[int, torch.Tensor] = {}  # request id -> the coordinator's own part

    def send(self, adm: Admission, kv: torch.Tensor) -> None:
        """Coordinator: send each of ``adm.owner``'s TP ranks its heads of ``kv``
        ``[layers, 2, ingest_len, num_kv_heads, d]``; keep the part it owns itself."""
        groups, heads = self.groups, self.local_kv_heads
        for t in range(groups.tp_size):
            part = kv[:, :, :, t * heads : (t + 1) * heads].contiguous()
            dst = groups.global_rank(adm.owner, t)
            if dst == groups.coordinator_rank:
                self._kept[adm.request_id] = part
            else:
                dist.send(part.to(self.device, self.dtype), dst)

    def receive(self, adm: Admission, shape: Sequence[int]) -> torch.Tensor:
        """Owner rank: its part ``shape`` of ``adm``'s KV, as :meth:`send` sent it."""
        kept = self._kept.pop(adm.request_id, None)
        if kept is not None:  # the coordinator owns it
            return kept
        buf = torch.empty(tuple(shape), dtype=self.dtype, device=self.device)
        dist.recv(buf, src=self.groups.coordinator_rank)
        return buf


class Admitter:
    """Applies a plan's admissions on one rank: block-table rows, then ingested KV.

    Args:
        kv: this rank's paged cache.
        kv_slice: the part of each request's KV this rank stores.
        device: this rank's device.
        owner: assign only admissions to this node; None assigns every admission (every
            PP stage and DCP shard stores part of every request).
        ingest: where outside KV that is not synthetic comes from; None: synthetic only
            (the engine refuses other outside KV at ``add_request``).
    """

    def __init__(self, kv: PagedKVCache, kv_slice: KVSlice, device: torch.device,
                 owner: Optional[int] = None, ingest: Optional[KVIngest] = None):
        self.kv, self.kv_slice, self.device, self.owner, self.ingest = kv, kv_slice, device, owner, ingest

    def apply(self, admissions: Sequence[Admission]) -> None:
        """Assign (and fill) the admitted requests this rank stores."""
        for adm in admissions:
            if self.owner is not None and adm.owner != self.owner:
                continue
            self.kv.assign(adm.slot, adm.blocks)
            if adm.ingest_len:
                self.kv.ingest(adm.slot, self._prompt_kv(adm))

    def _prompt_kv(self, adm: Admission) -> torch.Tensor:
        """This rank's part (``kv_slice.shape(ingest_len)``) of ``adm``'s ingested KV."""
        if adm.synthetic_seed is not None:
            return self.kv_slice.synthetic(adm.synthetic_seed, adm.ingest_len, self.kv.spec.dtype, self.device)
        if self.ingest is None:  # unreachable: the engine rejects it at add_request
            raise ValueError(f"request {adm.request_id}: this mode takes outside KV only as synthetic_kv")
        return self.ingest.receive(adm, self.kv_slice.shape(adm.ingest_len))
