"""The attention-backend interface used by request owners.

An owner holds a paged KV cache per layer. ``k_cache`` and ``v_cache`` are each
``[num_blocks, block_size, num_kv_heads, head_dim]`` (views of one buffer
``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``; the layout of
``flash_attn_with_kvcache``'s paged cache). This step's new k/v are already written
into the cache when :meth:`AttentionBackend.forward` runs.

Query rows of request ``r`` are ``q[query_start_loc[r]:query_start_loc[r + 1]]`` and sit
at positions ``seq_lens[r] - q_len_r ... seq_lens[r] - 1``; attention is causal (the
row at position ``p`` sees cache positions ``0..p``). With ``Hq`` query heads and
``Hkv`` kv heads, query head ``h`` reads kv head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

__all__ = ["AttentionMetadata", "AttentionBackend", "CallShape", "PreparedLaunch", "check_attention_inputs",
           "check_flash_inputs", "flash_inputs_problem"]


@dataclass(frozen=True)
class CallShape:
    """The host shape of one owner's attention calls, the same in every layer of a step.

    Attributes:
        heads: query heads (``Hq``) on this rank.
        kv_heads: KV heads (``Hkv``) on this rank.
        head_dim: ``d``.
        block_size: tokens per page of the cache.
        dtype: the dtype of ``q`` and of the cache.
    """

    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


# eq=False: the fields are tensors.
@dataclass(frozen=True, eq=False)
class PreparedLaunch:
    """Device work a backend does once per step for every layer's call: a kernel's schedule
    over the step's ``seq_lens`` (the Triton kernel's balanced split plan, FA3's scheduler
    metadata), made by :meth:`AttentionBackend.prepare` inside the step (so a CUDA graph
    replays it with the step). A call uses it only when it would make the same schedule
    itself: same ``backend`` and ``key`` (the host ints the schedule was made for).

    Attributes:
        backend: the name of the backend that made it.
        key: the host ints of the launch it schedules.
        tensors: the schedule, on the device.
    """

    backend: str
    key: Tuple
    tensors: Tuple[torch.Tensor, ...]


# eq=False: the fields are tensors, so a generated __eq__ would be ambiguous.
@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """Per-step metadata for one owner's query rows; built once per step, shared by all layers.

    Attributes:
        query_start_loc: ``[R+1]`` int32 cu_seqlens of query rows per request (rows of
            request ``r`` are ``query_start_loc[r]:query_start_loc[r+1]``).
        seq_lens: ``[R]`` int32 context length of request ``r`` INCLUDING this step's new
            tokens.
        block_table: ``[R, max_blocks_per_seq]`` int32 physical block ids (padding entries
            arbitrary but valid ids, e.g. 0).
        max_query_len: host int; 1 means pure decode (one query row per request).
        max_seq_len: host int; an upper bound of ``seq_lens`` (used for grid sizing).
        prepared: the step's :class:`PreparedLaunch` (None: every call schedules itself).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int
    prepared: Optional[PreparedLaunch] = None

    def __post_init__(self) -> None:
        # Host-only checks (shapes, dtypes): nothing here reads device memory.
        num_req = self.seq_lens.shape[0] if self.seq_lens.dim() == 1 else -1
        if num_req < 0 or tuple(self.query_start_loc.shape) != (num_req + 1,):
            raise ValueError(
                f"query_start_loc {tuple(self.query_start_loc.shape)} must be [R+1] for "
                f"seq_lens {tuple(self.seq_lens.shape)} = [R]"
            )
        if self.block_table.dim() != 2 or self.block_table.shape[0] != num_req:
            raise ValueError(f"block_table {tuple(self.block_table.shape)} must be [R, max_blocks]")
        for name in ("query_start_loc", "seq_lens", "block_table"):
            if getattr(self, name).dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {getattr(self, name).dtype}")
        if self.max_query_len < 0 or self.max_seq_len < 0:
            raise ValueError("max_query_len and max_seq_len must be >= 0")

    @property
    def num_requests(self) -> int:
        """R, the number of requests (host int)."""
        return self.seq_lens.shape[0]

    def prepared_for(self, backend: str, key: Tuple) -> Optional[Tuple[torch.Tensor, ...]]:
        """The prepared schedule's tensors if ``backend`` made it for ``key``, else None."""
        p = self.prepared
        return p.tensors if p is not None and p.backend == backend and p.key == key else None

    @classmethod
    def from_lengths(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_table: torch.Tensor,
        device: Optional[torch.device] = None,
    ) -> "AttentionMetadata":
        """Build metadata from host lengths (the owner knows them from the step plan).

        Args:
            query_lens: ``R`` query-row counts.
            seq_lens: ``R`` context lengths including the new tokens.
            block_table: ``[R, max_blocks]`` physical block ids (any int dtype; cast to int32).
            device: where the tensors go (default: ``block_table.device``).
        """
        if len(query_lens) != len(seq_lens):
            raise ValueError("query_lens and seq_lens must have the same length")
        if any(q > s for q, s in zip(query_lens, seq_lens)):
            raise ValueError("a request has more query rows than context tokens")
        device = block_table.device if device is None else device
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + int(n))
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            query_start_loc=torch.tensor(starts, **i32),
            seq_lens=torch.tensor([int(s) for s in seq_lens], **i32),
            block_table=block_table.to(**i32),
            max_query_len=max((int(n) for n in query_lens), default=0),
            max_seq_len=max((int(s) for s in seq_lens), default=0),
        )


def check_attention_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Host-only shape/dtype checks shared by all backends; raises ``ValueError``."""
    if q.dim() != 3:
        raise ValueError(f"q must be [rows, Hq, d], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_blocks, block_size, Hkv, d], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: q {head_dim}, cache {k_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_heads} must be a multiple of Hkv={num_kv_heads}")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if meta.block_table.device != q.device or meta.seq_lens.device != q.device:
        raise ValueError("metadata tensors must be on q's device")


def flash_inputs_problem(backend: str, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """Why FlashAttention's kernels (``fa3``, ``fa4``) cannot take inputs of ``dtype`` and
    ``head_dim`` (they take fp16/bf16 and a head dim that is a multiple of 8 and at most
    256), naming ``backend``; None if they can."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{backend} backend needs fp16/bf16 inputs, got {dtype}; use the 'triton' backend"
    if head_dim % 8 or head_dim > 256:
        return f"{backend} backend needs a head dim that is a multiple of 8 and at most 256, got {head_dim}"
    return None


def check_flash_inputs(backend: str, q: torch.Tensor) -> None:
    """:func:`flash_inputs_problem` for ``q [rows, Hq, d]`` as a ``ValueError``."""
    problem = flash_inputs_problem(backend, q.dtype, q.shape[-1])
    if problem is not None:
        raise ValueError(problem)


class AttentionBackend(abc.ABC):
    """Paged causal attention for one owner's query rows.

    Subclasses implement :meth:`_forward`; :meth:`forward` validates inputs (host-only)
    and answers an empty batch without touching the device.
    """

    name: str = "abstract"

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attend query rows to their requests' cached context.

        Args:
            q: ``[rows, Hq, d]`` query rows, grouped by request per ``meta.query_start_loc``.
            k_cache, v_cache: ``[num_blocks, block_size, Hkv, d]`` paged cache of one layer.
            meta: the step's :class:`AttentionMetadata`.
            scale: softmax scale (usually ``d ** -0.5``).

        Returns:
            ``[rows, Hq, d]`` in ``q.dtype`` (accumulated in fp32).
        """
        check_attention_inputs(q, k_cache, v_cache, meta)
        if q.shape[0] == 0 or meta.num_requests == 0:
            return q.new_empty((0, q.shape[1], q.shape[2]))
        return self._forward(q, k_cache, v_cache, meta, float(scale))

    __call__ = forward

    def prepare(self, meta: AttentionMetadata, shape: CallShape) -> AttentionMetadata:
        """``meta`` with this step's :class:`PreparedLaunch` for calls of ``shape``: device work
        that every layer's call would otherwise repeat, done once per step (device work only,
        no host sync, so a graph's captured body can run it). The default prepares nothing;
        a backend whose kernel schedules over ``seq_lens`` overrides it."""
        return meta

    @staticmethod
    def with_prepared(meta: AttentionMetadata, prepared: Optional[PreparedLaunch]) -> AttentionMetadata:
        """``meta`` carrying ``prepared`` (``meta`` itself when there is nothing)."""
        return meta if prepared is None else dataclasses.replace(meta, prepared=prepared)

    @abc.abstractmethod
    def _forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Backend-specific work on validated, non-empty inputs (same contract as forward)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
