"""Attention backends for request owners: paged causal attention over the local KV cache.

Backends register themselves on import: ``torch`` (reference), ``sdpa`` (vectorised
torch), ``triton`` (paged split-K decode; needs ``triton`` and CUDA, or
``TRITON_INTERPRET=1`` on CPU) and ``flash`` (only when ``flash_attn`` imports).
``get_backend(None, device)`` picks ``triton`` on CUDA when usable, else ``torch``.
"""

from tknp_megatron.attention import flash as _flash  # noqa: F401  (registers "flash"; imports flash_attn lazily)
from tknp_megatron.attention import sdpa as _sdpa  # noqa: F401  (registers "sdpa")
from tknp_megatron.attention import torch_ref as _torch_ref  # noqa: F401  (registers "torch")
from tknp_megatron.attention import triton_paged as _triton_paged  # noqa: F401  (registers "triton"; imports triton lazily)
from tknp_megatron.attention.base import AttentionBackend, AttentionMetadata
from tknp_megatron.attention.registry import (
    available_backends,
    default_backend_name,
    get_backend,
    register_backend,
)

__all__ = [
    "AttentionMetadata",
    "AttentionBackend",
    "get_backend",
    "available_backends",
    "default_backend_name",
    "register_backend",
]
