"""The "auto" backend: per call, the paged kernel measured fastest for the call's shape,
between the Triton kernel (``triton_paged.py``) and FlashAttention 3 (``flash3.py``).

The rule (:func:`prefer_fa3`), from ``tools/bench_attention.py`` on one H200 over the
per-rank shapes of Llama-3.1-70B / 405B and Nemotron-4-340B at TP 1, 2, 8, B 1-256,
contexts 1K-128K, 16-token pages, both kernels replayed from CUDA graphs and timed in turn
(``docs/ARCHITECTURE.md``, "Kernels per shape"):

- head dim above 128 (Nemotron's 192): FA3. It took 0.86-1.15x the Triton kernel's time
  (median 0.98, faster at 34 of 55 shapes) and reads 89-102 % of copy bandwidth at
  B x context >= 1M, where the Triton kernel's 32-token tiles read 85-95 %.
- head dim 128, calls bounded by a context of 32K or more: FA3, 0.97-1.20x (median 0.99,
  faster at 36 of 50 shapes; 86-105 % of copy bandwidth against 84-102 %).
- head dim 128 below 32K: Triton. FA3 took 0.93-1.22x its time (median 1.08, faster at 10
  of 60 shapes), and the engine's decode step at 8K was 0.5-1 % slower with it.
- groups of ``FA3_MIN_GROUP`` (32) query heads per KV head or more, at any context: FA3. With
  one KV head at TP 1-2 of a 64-head model (the DCP and TKNP-MQA layouts), B = 32 / 128 at
  8K-64K, it took 0.69-0.83x the time of the Triton kernel's 64-token tile and 0.77-0.95x
  its best of eight tiles, at the copy ceiling from B x context = 4M (0.99-1.02x copy): its
  tiles pack the group's heads for Hopper's warpgroup MMA, where the Triton kernel's dots
  and softmax over 32-64 rows weigh as much as its loads.
- pages of 128 tokens or more: Triton. FA3 then loads a request's last page whole, slots
  past its length included, and weighs them by zero; a NaN left there by an earlier owner
  of the page turns this request's rows into NaN (seen at 128- and 256-token pages, not at
  16 or 64). The Triton kernel masks those slots before it reads them.
- query chunks (``max_query_len > 1``: prompts, and decode rows stepping with them): FA3
  at every head dim and context. On whole 4K and 16K prompts and on 2048-token chunks at
  the end of a 32K context it took 0.16-0.43x the time of the Triton kernel's first prompt
  tile (650-715 TFLOP/s against 115-265 at the larger shapes; SDPA over contiguous K/V
  586-721), and about a third of its time at head dim 192 with the tile tuned since
  (``triton_paged.prefill_tile``): the Triton kernel's tiles hold 64 or 128 rows, a few
  query positions times the head group, and gather K and V per token, so each K/V tile
  feeds few rows and no tensor-memory copy.
- fp32 and head dims FA3 does not take: Triton.

Without FA3 (no library, another torch, not Hopper) every call is Triton's. The choice
reads host ints only (dtype, head dim, page size, ``max_query_len``, ``max_seq_len``): no
device sync, and a CUDA graph replays the kernel it was captured with. Graphs capture
with ``max_seq_len`` at the longest sequence the engine admits
(``EngineConfig.max_sequence_length``, by default the model's), so under graphs the choice
follows that limit, not the contexts of the moment: with Llama-3.1's 128K limit every
graphed decode step at head dim 128 runs FA3, also at 8K contexts, where it was 1 % slower
in the engine's step. A limit below 32K keeps those steps on the Triton kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from tknp_megatron.attention.base import AttentionBackend, AttentionMetadata, CallShape, flash_inputs_problem
from tknp_megatron.attention.flash3 import (
    FlashAttn3Backend,
    fa3_available,
    fa3_supports_device,
    fa3_unavailable_reason,
    fa3_usable,
)
from tknp_megatron.attention.registry import register_backend
from tknp_megatron.attention.triton_paged import TritonPagedBackend, triton_importable, triton_supports_device

__all__ = ["FA3_MIN_CONTEXT_HEAD_DIM_128", "FA3_MIN_GROUP", "FA3_MAX_PAGE", "PerShapeBackend", "auto_kernels", "prefer_fa3"]

FA3_MIN_CONTEXT_HEAD_DIM_128 = 32768
"""At head dim 128, the context bound from which FA3 is chosen (see the module docstring)."""

FA3_MIN_GROUP = 32
"""Query heads per KV head from which FA3 is chosen at any context (module docstring)."""

FA3_MAX_PAGE = 64
"""The largest page (tokens) FA3 is chosen at: from 128 it reads past a request's length."""


def prefer_fa3(dtype: torch.dtype, head_dim: int, block_size: int, max_query_len: int, max_seq_len: int,
               group: int = 1) -> bool:
    """Whether FA3 is the faster correct kernel for a call of this shape (module docstring);
    ``group``: query heads per KV head."""
    if flash_inputs_problem("fa3", dtype, head_dim) or block_size > FA3_MAX_PAGE:
        return False
    return (max_query_len > 1 or head_dim > 128 or max_seq_len >= FA3_MIN_CONTEXT_HEAD_DIM_128
            or group >= FA3_MIN_GROUP)


def auto_kernels(device: torch.device) -> str:
    """What ``auto`` runs on ``device``, for logs and result rows: ``"fa3 + triton"``, or
    ``"triton (fa3: why not)"``."""
    if fa3_usable(device):
        return "fa3 + triton"
    why = "needs a CUDA device of compute capability 9.x" if not fa3_supports_device(device) \
        else fa3_unavailable_reason()
    return f"triton (fa3: {why})"


class PerShapeBackend(AttentionBackend):
    """Each call on the kernel :func:`prefer_fa3` picks; Triton when FA3 is not there.

    Args:
        **triton_options: :class:`TritonConfig` fields for the Triton kernel.
    """

    name = "auto"

    def __init__(self, **triton_options) -> None:
        self.triton = TritonPagedBackend(**triton_options)
        self._fa3: Optional[FlashAttn3Backend] = None
        self._fa3_checked = False
        if torch.cuda.is_available():
            fa3_available()  # load FA3's library now, not inside the capture of a first call's graph

    def fa3_here(self, device: torch.device) -> Optional[FlashAttn3Backend]:
        """The FA3 backend when it runs on ``device``, else None (checked once: an engine's
        backend serves one device)."""
        if not self._fa3_checked:
            self._fa3_checked = True
            if fa3_usable(device):
                self._fa3 = FlashAttn3Backend()
        return self._fa3

    def choose(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> AttentionBackend:
        """The backend this call runs on (``q [rows, Hq, d]``, ``k_cache [blocks, block_size, Hkv, d]``)."""
        if prefer_fa3(q.dtype, q.shape[-1], k_cache.shape[1], meta.max_query_len, meta.max_seq_len,
                      q.shape[1] // k_cache.shape[2]):
            fa3 = self.fa3_here(q.device)
            if fa3 is not None:
                return fa3
        return self.triton

    def _forward(self, q, k_cache, v_cache, meta, scale):
        return self.choose(q, k_cache, meta)._forward(q, k_cache, v_cache, meta, scale)

    def prepare(self, meta: AttentionMetadata, shape: CallShape) -> AttentionMetadata:
        """The step's schedule of the kernel that this step's calls of ``shape`` run on (FA3's
        calls schedule themselves: ``flash3.py``)."""
        if prefer_fa3(shape.dtype, shape.head_dim, shape.block_size, meta.max_query_len, meta.max_seq_len,
                      shape.heads // shape.kv_heads):
            fa3 = self.fa3_here(meta.seq_lens.device)
            if fa3 is not None:
                return fa3.prepare(meta, shape)
        return self.triton.prepare(meta, shape)


register_backend("auto", PerShapeBackend, available=triton_importable, supports=triton_supports_device)
