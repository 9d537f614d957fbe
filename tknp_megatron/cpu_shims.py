"""The one place where CPU runs stand in for CUDA-only Megatron helpers.

Megatron-Core's ``DotProductAttention`` takes its scratch buffer from a global CUDA memory
buffer, so a Megatron ``TransformerLayer`` cannot run its own core attention on CPU. The
*reference* model (the same Megatron modules without TKNP) swaps in
:class:`SDPACoreAttention`, a causal ``scaled_dot_product_attention`` with
``DotProductAttention``'s constructor and call signature; everything else in the layer
(QKV split, RoPE, projections, MLP, residuals) is Megatron's own forward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

__all__ = ["SDPACoreAttention"]


class SDPACoreAttention(MegatronModule):
    """Causal GQA attention over full sequences, shaped like Megatron's core attention.

    forward: query ``[sq, b, np, hn]``, key / value ``[sk, b, ng, hn]`` -> ``[sq, b, np * hn]``.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        self.scale = softmax_scale or config.kv_channels ** -0.5

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, **_):
        sq, b, np_, hn = query.shape
        group = np_ // key.shape[2]
        q = query.permute(1, 2, 0, 3).float()
        k = key.repeat_interleave(group, dim=2).permute(1, 2, 0, 3).float()
        v = value.repeat_interleave(group, dim=2).permute(1, 2, 0, 3).float()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.to(query.dtype).permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)
