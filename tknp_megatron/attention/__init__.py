"""Attention backends for request owners: paged causal attention over the local KV cache.

Backends register themselves on import: ``torch`` (reference), ``sdpa`` (vectorised
torch), ``triton`` (paged split-K decode; needs ``triton`` and CUDA, or
``TRITON_INTERPRET=1`` on CPU), ``flash`` (only when ``flash_attn`` 2 imports), ``fa3``
(FlashAttention 3 from vLLM's wheel, only when its library loads, on compute capability
9.x), ``fa4`` (flash-attn-4, only when ``flash_attn.cute`` imports, on 9.0+) and ``auto``
(per call, ``fa3`` or ``triton``, whichever was measured faster for the call's shape).
``get_backend(None, device)`` picks ``auto`` on CUDA when Triton is usable there, else ``torch``.

The Triton launch helpers (:class:`TritonConfig`, :func:`decode_launch`, :func:`choose_num_splits`,
:func:`decode_group_pad`, :func:`device_num_sms`, :func:`load_kernels`, ...) are public so
that other callers of the paged kernels (DCP's partial attention over one sequence shard)
launch them exactly as the ``triton`` backend does.
"""

from tknp_megatron.attention import flash as _flash  # noqa: F401  (registers "flash"; imports flash_attn lazily)
from tknp_megatron.attention import flash3 as _flash3  # noqa: F401  (registers "fa3"; loads its library lazily)
from tknp_megatron.attention import flash4 as _flash4  # noqa: F401  (registers "fa4"; imports flash_attn.cute lazily)
from tknp_megatron.attention import per_shape as _per_shape  # noqa: F401  (registers "auto": fa3 or triton per call)
from tknp_megatron.attention import sdpa as _sdpa  # noqa: F401  (registers "sdpa")
from tknp_megatron.attention import torch_ref as _torch_ref  # noqa: F401  (registers "torch")
from tknp_megatron.attention import triton_paged as _triton_paged  # noqa: F401  (registers "triton"; imports triton lazily)
from tknp_megatron.attention.base import AttentionBackend, AttentionMetadata, CallShape, PreparedLaunch
from tknp_megatron.attention.registry import (
    available_backends,
    backend_problem,
    default_backend_name,
    get_backend,
    register_backend,
)
from tknp_megatron.attention.triton_paged import (
    H200_NUM_SMS,
    TritonConfig,
    DecodeLaunch,
    choose_num_splits,
    decode_launch,
    decode_group_pad,
    device_num_sms,
    interpreter_upcast,
    load_kernels,
    next_pow2,
    triton_importable,
    triton_interpreting,
    triton_supports_device,
)

__all__ = [
    "AttentionMetadata",
    "AttentionBackend",
    "CallShape",
    "PreparedLaunch",
    "get_backend",
    "available_backends",
    "backend_problem",
    "default_backend_name",
    "register_backend",
    # Triton launch helpers
    "H200_NUM_SMS",
    "TritonConfig",
    "DecodeLaunch",
    "choose_num_splits",
    "decode_launch",
    "decode_group_pad",
    "device_num_sms",
    "interpreter_upcast",
    "load_kernels",
    "next_pow2",
    "triton_importable",
    "triton_interpreting",
    "triton_supports_device",
]
