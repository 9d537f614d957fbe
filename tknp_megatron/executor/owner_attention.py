"""An owner's attention for one layer: split QKV, RoPE, append K/V, paged attention.

Input is this TP rank's fused QKV columns for the owner's rows, in Megatron's layout
(per query group: its query heads, then k, then v); output is ``[rows, heads * d]``. With
``fused_rope`` the split, the rotation and the append are one kernel
(:meth:`~tknp_megatron.executor.rope.Rope.rotate_and_append`), else Megatron's functions.
"""

from __future__ import annotations

import dataclasses

import torch

from tknp_megatron.attention import AttentionBackend, CallShape
from tknp_megatron.executor.rope import Rope
from tknp_megatron.kv_cache import PagedKVCache

__all__ = ["OwnerAttention"]


class OwnerAttention:
    """Attention of one rank over its paged KV cache.

    Args:
        kv: this rank's cache.
        rope: RoPE.
        backend: attention backend.
        heads: query heads on this TP rank.
        kv_heads: KV heads on this TP rank.
        head_dim: d_h.
        fused_rope: rotate and append in one kernel (GPUs; ``DenseFusion.rope``).
    """

    def __init__(self, kv: PagedKVCache, rope: Rope, backend: AttentionBackend,
                 heads: int, kv_heads: int, head_dim: int, fused_rope: bool = False):
        self.kv, self.rope, self.backend = kv, rope, backend
        self.fused_rope = fused_rope
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.call_shape = CallShape(heads, kv_heads, head_dim, kv.spec.block_size, kv.spec.dtype)

    def prepare(self, inp):
        """``inp`` (the step's StepInputs) with the attention kernel's schedule for this step
        made once, for every layer's call (:meth:`AttentionBackend.prepare`); device work
        only, so it runs inside a graph's captured step."""
        meta = self.backend.prepare(inp.meta, self.call_shape)
        return inp if meta is inp.meta else dataclasses.replace(inp, meta=meta)

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def __call__(self, cache_layer: int, qkv: torch.Tensor, inp) -> torch.Tensor:
        """``[rows, qkv_width]`` -> ``[rows, heads * d]``; ``inp`` is the step's StepInputs."""
        rows = qkv.shape[0]
        if self.fused_rope:
            k_cache, v_cache = self.kv.layer(cache_layer)
            q = self.rope.rotate_and_append(qkv, inp.cos_sin, inp.slot_mapping, k_cache, v_cache, self.kv_heads)
            out = self.backend.forward(q, k_cache, v_cache, inp.meta, self.scale)
            return out.reshape(rows, self.heads * self.head_dim)
        per_group = self.heads // self.kv_heads
        mixed = qkv.view(rows, self.kv_heads, per_group + 2, self.head_dim)
        # one RoPE call rotates each group's query heads and its key head together
        qk = mixed[:, :, : per_group + 1].reshape(rows, self.kv_heads * (per_group + 1), self.head_dim)
        qk = self.rope.apply(qk, inp.freqs).view(rows, self.kv_heads, per_group + 1, self.head_dim)
        q = qk[:, :, :per_group].reshape(rows, self.heads, self.head_dim)
        k = qk[:, :, per_group]
        v = mixed[:, :, per_group + 1]
        self.kv.write(cache_layer, k, v, inp.slot_mapping)
        k_cache, v_cache = self.kv.layer(cache_layer)
        out = self.backend.forward(q, k_cache, v_cache, inp.meta, self.scale)
        return out.reshape(rows, self.heads * self.head_dim)
