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

A prompt's KV is written (and sent) in pieces of at most ``chunk_bytes`` along its
positions (:func:`position_chunks`), so that a rank whose memory the cache nearly fills
never holds a long prompt's KV whole: 64K tokens of all 80 layers of Llama-3.1-70B are
20 GiB in BF16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from parallel_state import TokenParallelGroups
from tknp_megatron.executor.synthetic import synthetic_kv
from tknp_megatron.kv_cache import PagedKVCache
from tknp_megatron.plan import Admission

__all__ = ["Admitter", "INGEST_CHUNK_BYTES", "KVIngest", "KVSlice", "position_chunks"]

INGEST_CHUNK_BYTES = 256 << 20
"""The most bytes of a request's prompt KV a rank holds at once while writing or sending it."""


def position_chunks(shape: Sequence[int], elem_bytes: int, chunk_bytes: int = INGEST_CHUNK_BYTES) -> List[Tuple[int, int]]:
    """``[(lo, hi), ...]``: the pieces along dim 2 (positions) of KV ``shape``
    ``[layers, 2, positions, heads, d]`` of ``elem_bytes`` elements, each at most
    ``chunk_bytes`` (at least one position), covering ``[0, positions)`` in order."""
    positions = shape[2]
    per_position = elem_bytes * shape[0] * shape[1] * shape[3] * shape[4]
    step = max(1, chunk_bytes // max(per_position, 1))
    return [(lo, min(lo + step, positions)) for lo in range(0, positions, step)]


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

    def synthetic(self, seed: int, length: int, dtype: torch.dtype, device: torch.device,
                  lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """This rank's part (:meth:`shape`) of the synthetic KV of ``length`` tokens, or of its
        stored positions ``[lo, hi)`` only (indices into this rank's positions)."""
        positions = torch.arange(self.shard, length, self.num_shards, device=device)[lo:hi]
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
        chunk_bytes: the most bytes sent in one message (:func:`position_chunks`); the same
            on every rank of the pool.
    """

    def __init__(self, groups: TokenParallelGroups, local_kv_heads: int, dtype: torch.dtype,
                 device: torch.device, chunk_bytes: int = INGEST_CHUNK_BYTES):
        self.groups, self.local_kv_heads, self.dtype, self.device = groups, local_kv_heads, dtype, device
        self.chunk_bytes = chunk_bytes
        self._kept: Dict[int, torch.Tensor] = {}  # request id -> the coordinator's own part

    def send(self, adm: Admission, kv: torch.Tensor) -> None:
        """Coordinator: send each of ``adm.owner``'s TP ranks its heads of ``kv``
        ``[layers, 2, ingest_len, num_kv_heads, d]``, piece by piece along the positions;
        keep the part it owns itself."""
        groups, heads = self.groups, self.local_kv_heads
        for t in range(groups.tp_size):
            part = kv[:, :, :, t * heads : (t + 1) * heads]
            dst = groups.global_rank(adm.owner, t)
            if dst == groups.coordinator_rank:
                self._kept[adm.request_id] = part
                continue
            for lo, hi in position_chunks(part.shape, self.dtype.itemsize, self.chunk_bytes):
                dist.send(part[:, :, lo:hi].to(self.device, self.dtype).contiguous(), dst)

    def receive(self, adm: Admission, shape: Sequence[int]) -> Iterator[Tuple[int, torch.Tensor]]:
        """Owner rank: ``(first position, piece)`` of its part ``shape`` of ``adm``'s KV, in
        the pieces :meth:`send` sent (on the coordinator, of the part it kept)."""
        kept = self._kept.pop(adm.request_id, None)
        for lo, hi in position_chunks(shape, self.dtype.itemsize, self.chunk_bytes):
            if kept is not None:  # the coordinator owns it
                yield lo, kept[:, :, lo:hi]
                continue
            buf = torch.empty((shape[0], shape[1], hi - lo, *shape[3:]), dtype=self.dtype, device=self.device)
            dist.recv(buf, src=self.groups.coordinator_rank)
            yield lo, buf


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
        chunk_bytes: the most bytes of synthetic KV generated at once (:func:`position_chunks`).
    """

    def __init__(self, kv: PagedKVCache, kv_slice: KVSlice, device: torch.device,
                 owner: Optional[int] = None, ingest: Optional[KVIngest] = None,
                 chunk_bytes: int = INGEST_CHUNK_BYTES):
        self.kv, self.kv_slice, self.device, self.owner, self.ingest = kv, kv_slice, device, owner, ingest
        self.chunk_bytes = chunk_bytes

    def apply(self, admissions: Sequence[Admission]) -> None:
        """Assign (and fill) the admitted requests this rank stores."""
        for adm in admissions:
            if self.owner is not None and adm.owner != self.owner:
                continue
            self.kv.assign(adm.slot, adm.blocks)
            if adm.ingest_len:
                for lo, piece in self._prompt_kv(adm):
                    self.kv.ingest(adm.slot, piece, start=lo)

    def _prompt_kv(self, adm: Admission) -> Iterator[Tuple[int, torch.Tensor]]:
        """``(first position, piece)`` of this rank's part (``kv_slice.shape(ingest_len)``) of
        ``adm``'s ingested KV, piece by piece."""
        shape = self.kv_slice.shape(adm.ingest_len)
        if adm.synthetic_seed is not None:
            dtype = self.kv.spec.dtype
            for lo, hi in position_chunks(shape, dtype.itemsize, self.chunk_bytes):
                yield lo, self.kv_slice.synthetic(adm.synthetic_seed, adm.ingest_len, dtype, self.device, lo, hi)
            return
        if self.ingest is None:  # unreachable: the engine rejects it at add_request
            raise ValueError(f"request {adm.request_id}: this mode takes outside KV only as synthetic_kv")
        yield from self.ingest.receive(adm, shape)
