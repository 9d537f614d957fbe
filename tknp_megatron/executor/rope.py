"""Rotary position embedding on request owners, at arbitrary per-row positions.

Megatron's ``RotaryEmbedding.forward`` builds frequencies for positions 0..S-1 on the
current CUDA device; owners need them for scattered positions (each request at its own
length) and on CPU too. The inverse frequencies (including Llama 3.1 scaling) come from
Megatron's ``RotaryEmbedding`` and the rotation from Megatron's ``apply_rotary_pos_emb``,
so the numerics are Megatron's.

With the fused element-wise kernels and ``EngineConfig.fused_rope`` (``DenseFusion.rope``)
an owner's rotation and its K/V append run as one Triton kernel per layer,
:meth:`Rope.rotate_and_append` (``rope_kernels.py``), in place of about a dozen small kernels
(the splits and copies of the fused QKV, the rotation's multiplies, adds and casts, two index
copies), with Megatron's rounding. The cosines and sines are computed once a step
(:meth:`Rope.cos_sin`, three small kernels, whether or not the step uses them).
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from tknp_megatron.config import ModelPreset

__all__ = ["Rope", "fusable_rope"]


def fusable_rope(config) -> bool:
    """Megatron's unfused bshd rotation is what :meth:`Rope.rotate_and_append` computes:
    not with TE's fused RoPE (``apply_rope_fusion``, other rounding) or MLA's layout."""
    return not (getattr(config, "apply_rope_fusion", False) or getattr(config, "multi_latent_attention", False))


class Rope:
    """Frequencies and rotation for one model.

    Args:
        preset: model preset (rotary percent, base, scaling).
        config: Megatron ``TransformerConfig`` (rotation options).
        device: where frequencies live.
        cp_group: context-parallel group handed to Megatron (size 1 here).
    """

    def __init__(self, preset: ModelPreset, config, device: torch.device, cp_group=None):
        rot = RotaryEmbedding(
            kv_channels=preset.kv_channels,
            rotary_percent=preset.gpt.rotary_percent,
            rotary_interleaved=config.rotary_interleaved,
            rotary_base=preset.gpt.rotary_base,
            rope_scaling=preset.gpt.rope_scaling,
            rope_scaling_factor=preset.gpt.rope_scaling_factor,
            use_cpu_initialization=True,
        )
        self.inv_freq = rot.inv_freq.to(device=device, dtype=torch.float32)
        self.interleaved = config.rotary_interleaved
        self.config = config
        self.cp_group = cp_group

    def freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """``[rows]`` int positions -> ``[rows, 1, 1, rot_dim]`` float32 angles."""
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        if self.interleaved:
            emb = torch.stack((angles, angles), dim=-1).flatten(-2)
        else:
            emb = torch.cat((angles, angles), dim=-1)
        return emb[:, None, None, :]

    def apply(self, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Rotate ``t`` ``[rows, heads, d]`` by ``freqs`` from :meth:`freqs`."""
        out = apply_rotary_pos_emb(t.unsqueeze(1), freqs, self.config, cp_group=self.cp_group)
        return out.squeeze(1)

    @staticmethod
    def cos_sin(freqs: torch.Tensor) -> torch.Tensor:
        """``[rows, 1, 1, rot_dim]`` angles -> ``[rows, 2, rot_dim]`` float32 cosines and sines
        (Megatron's ``cos_`` and ``sin_`` before their cast to the activations' dtype)."""
        f = freqs.flatten(1)
        return torch.stack((torch.cos(f), torch.sin(f)), dim=1)

    def rotate_and_append(self, qkv: torch.Tensor, cos_sin: torch.Tensor, slot_mapping: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """Megatron's layout ``qkv`` ``[rows, Hkv * (G + 2) * d]`` -> rotated queries
        ``[rows, Hkv * G, d]``; the rotated keys and the values are written to ``k_cache`` /
        ``v_cache`` ``[blocks, block_size, Hkv, d]`` at ``slot_mapping`` ``[rows]``. One kernel;
        equal to :meth:`apply` on the query and key heads followed by the cache's ``write``."""
        from tknp_megatron.executor.rope_kernels import rope_append_kernel
        from tknp_megatron.executor.dense_fusion import triton_next_pow2

        rows = qkv.shape[0]
        head_dim = k_cache.shape[-1]
        group = qkv.shape[1] // (kv_heads * head_dim) - 2
        q = qkv.new_empty((rows, kv_heads * group, head_dim))
        if rows == 0:
            return q
        if qkv.stride(1) != 1:
            qkv = qkv.contiguous()
        rope_append_kernel[(rows, kv_heads)](
            qkv, cos_sin, slot_mapping, q, k_cache, v_cache, qkv.stride(0),
            *k_cache.stride()[:3], *v_cache.stride()[:3],
            GROUP=group, GROUP_PAD=triton_next_pow2(group + 1), HEAD_DIM=head_dim,
            D_PAD=triton_next_pow2(head_dim), ROT=cos_sin.shape[-1], PAGE=k_cache.shape[1],
            INTERLEAVED=bool(self.interleaved))
        return q
