"""Rotary position embedding on request owners, at arbitrary per-row positions.

Megatron's ``RotaryEmbedding.forward`` builds frequencies for positions 0..S-1 on the
current CUDA device; owners need them for scattered positions (each request at its own
length) and on CPU too. The inverse frequencies (including Llama 3.1 scaling) come from
Megatron's ``RotaryEmbedding`` and the rotation from Megatron's ``apply_rotary_pos_emb``,
so the numerics are Megatron's.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from tknp_megatron.config import ModelPreset

__all__ = ["Rope"]


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
