"""The FlashAttention-4 backend ("fa4"): flash-attn-4's CuTe-DSL kernels over the paged cache.

Registered only when ``flash_attn.cute`` imports (the ``flash-attn-4`` distribution with
``nvidia-cutlass-dsl``; ``docs/ARCHITECTURE.md`` says how it is installed on the GPU
machine) and used on CUDA devices of compute capability 9.0 or newer (its paged KV does
not run on 8.x). It is the kernel Megatron-Core's ``DynamicInferenceEngine`` calls for
paged attention, with the same arguments: one ``flash_attn_varlen_func`` call for decode
and prefill alike, the query rows as varlen ``cu_seqlens_q``, the cache lengths as
``seqused_k`` and the block table as ``page_table``. Its split-K (``num_splits=0``: FA4's
own count per shape) runs only on compute capability 10.x/11.x: on Hopper (9.0) flash-attn-4
4.0.0b36 refuses split-K ("SplitKV not supported on SM 9.0"), so there one program per
(request, KV head) reads the whole context, which underfills the GPU below one program per
SM (``docs/ARCHITECTURE.md`` has the measured per-shape choice).

Pages of 128 tokens (its key tile at head dim 128) load by TMA; other page sizes take its
slower non-TMA path. With TMA a tile also reads the rows past a request's length in its
last page, which must be finite: the KV cache is zero-initialised, so they are.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Optional

import torch

from tknp_megatron.attention.base import AttentionBackend, AttentionMetadata, check_flash_inputs
from tknp_megatron.attention.registry import register_backend

__all__ = ["FlashAttn4Backend", "fa4_importable", "fa4_supports_device"]


def _fa4_module() -> Optional[Any]:
    try:
        return importlib.import_module("flash_attn.cute")
    except Exception:  # absent, or built for another torch / CUDA
        return None


def fa4_importable() -> bool:
    """Whether ``flash_attn.cute`` imports and has ``flash_attn_varlen_func``."""
    try:
        if importlib.util.find_spec("flash_attn") is None:
            return False
    except (ImportError, ValueError):
        return False
    module = _fa4_module()
    return module is not None and hasattr(module, "flash_attn_varlen_func")


def fa4_supports_device(device: torch.device) -> bool:
    """CUDA devices of compute capability 9.0 or newer (Hopper, Blackwell)."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 9


class FlashAttn4Backend(AttentionBackend):
    """Paged causal attention through ``flash_attn.cute.flash_attn_varlen_func``.

    Args:
        num_splits: FA4's split-K count; 0 is its own heuristic per shape; None (default)
            is 0 where FA4 splits (compute capability 10.x / 11.x) and 1 elsewhere.
    """

    name = "fa4"

    def __init__(self, num_splits: Optional[int] = None) -> None:
        module = _fa4_module()
        if module is None:
            raise RuntimeError("flash_attn.cute (flash-attn-4) is not importable")
        if num_splits is not None and num_splits < 0:
            raise ValueError(f"num_splits {num_splits}: must be >= 0 (0: FA4's heuristic)")
        self._varlen = module.flash_attn_varlen_func
        self.num_splits = num_splits
        self._splits_on = {}  # device index -> the split count used there

    def _splits(self, device: torch.device) -> int:
        if self.num_splits is not None:
            return self.num_splits
        if device.index not in self._splits_on:
            major = torch.cuda.get_device_capability(device)[0]
            self._splits_on[device.index] = 0 if major in (10, 11) else 1
        return self._splits_on[device.index]

    def _forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale):
        """``q [rows, Hq, d]``, caches ``[num_blocks, block_size, Hkv, d]`` -> ``[rows, Hq, d]``."""
        check_flash_inputs("fa4", q)
        out = self._varlen(
            q, k_cache, v_cache,
            cu_seqlens_q=meta.query_start_loc, max_seqlen_q=max(meta.max_query_len, 1),
            seqused_k=meta.seq_lens, max_seqlen_k=meta.max_seq_len,
            page_table=meta.block_table.contiguous(),
            softmax_scale=scale, causal=True, num_splits=self._splits(q.device),
        )
        return out[0] if isinstance(out, tuple) else out


register_backend("fa4", FlashAttn4Backend, available=fa4_importable, supports=fa4_supports_device)
