"""The flash-attn backend ("flash"), registered only when ``flash_attn`` imports.

Decode calls ``flash_attn_with_kvcache`` on the paged cache (the new k/v are already in
it, so no ``k=``/``v=`` are passed); prefill or mixed batches call
``flash_attn_varlen_func`` with the block table. flash-attn 2 needs the page size to be
a multiple of 256 and fp16/bf16 inputs; both are checked before calling it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Optional

import torch

from tknp_megatron.attention.base import AttentionBackend, AttentionMetadata
from tknp_megatron.attention.registry import register_backend

__all__ = ["FlashAttnBackend", "flash_importable"]

PAGE_MULTIPLE = 256


def _flash_module() -> Optional[Any]:
    try:
        return importlib.import_module("flash_attn")
    except Exception:  # absent, or built for another torch/CUDA
        return None


def flash_importable() -> bool:
    """Whether ``flash_attn`` imports and has ``flash_attn_with_kvcache``."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    module = _flash_module()
    return module is not None and hasattr(module, "flash_attn_with_kvcache")


class FlashAttnBackend(AttentionBackend):
    """Paged attention through flash-attn's kernels."""

    name = "flash"

    def __init__(self) -> None:
        module = _flash_module()
        if module is None:
            raise RuntimeError("flash_attn is not importable")
        self._fa = module

    def _check(self, q: torch.Tensor, k_cache: torch.Tensor) -> None:
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"flash backend needs fp16/bf16 inputs, got {q.dtype}")
        if k_cache.shape[1] % PAGE_MULTIPLE:
            raise ValueError(
                f"flash backend needs a block size that is a multiple of {PAGE_MULTIPLE}, "
                f"got {k_cache.shape[1]}; use the 'triton' backend"
            )

    def _forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale):
        self._check(q, k_cache)
        if meta.max_query_len <= 1 and q.shape[0] == meta.num_requests:
            out = self._fa.flash_attn_with_kvcache(
                q.unsqueeze(1), k_cache, v_cache,
                cache_seqlens=meta.seq_lens, block_table=meta.block_table,
                causal=True, softmax_scale=scale,
            )
            return out.squeeze(1)
        # Causal masks in flash-attn >= 2.1 align to the bottom right: query i of a
        # request of q_len rows and L keys sees keys 0..L - q_len + i, as required.
        cu_k = torch.zeros(meta.num_requests + 1, dtype=torch.int32, device=q.device)
        torch.cumsum(meta.seq_lens, 0, out=cu_k[1:])
        return self._fa.flash_attn_varlen_func(
            q, k_cache, v_cache,
            cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=cu_k,
            max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale, causal=True, block_table=meta.block_table,
        )


register_backend(
    "flash", FlashAttnBackend, available=flash_importable, supports=lambda device: device.type == "cuda"
)
