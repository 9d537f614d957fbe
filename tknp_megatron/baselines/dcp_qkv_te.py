"""DCP's QKV projection on Transformer Engine: the input norm fused in, FP8 weights possible.

Megatron's TE layer spec fuses the input norm into ``linear_qkv``
(``TELayerNormColumnParallelLinear``, TE's ``LayerNormLinear``; the layer's
``input_layernorm`` is an identity). :class:`DCPTEQKVLinear` is that module holding a DCP
rank's rows (:class:`~tknp_megatron.baselines.dcp_qkv.HeadRows`: own query heads, the
group's k and v) instead of an even ``1 / W`` of the fused rows. A column-parallel TE
layer without sequence parallelism does no communication in its forward pass and keeps
``out_features / W`` rows, so it is built with ``out_features = W x rows``; the norm's
parameters are the full, replicated ones. Being Megatron's class, the rest follows as for
the other TE layers: FP8-stored weights under Megatron's FP8 parameter context, the FP8
row padding of ``prepare_model_for_fp8_inference``, TE's zero-centred gamma.

Checkpoint keys are Megatron's TE-spec keys: ``linear_qkv.weight`` (and ``bias``) mapped
head by head onto Megatron's fused global tensor, as :class:`~tknp_megatron.baselines.dcp_qkv.DCPQKVLinear`
maps them, and ``linear_qkv.layer_norm_weight`` (``layer_norm_bias``) replicated.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear

from tknp_megatron.baselines.dcp_qkv import HeadRows, dp_rank

__all__ = ["DCPTEQKVLinear"]


class DCPTEQKVLinear(TELayerNormColumnParallelLinear):
    """``[s, b, hidden] -> ([s, b, (Hq / W + 2) d_h], None)``: norm, then own q heads, k, v.

    Takes what :class:`~megatron.core.transformer.attention.SelfAttention` passes its
    ``linear_qkv`` (the layer spec's entry); other keyword arguments go to Megatron's class.
    """

    def __init__(self, input_size, output_size, *, config, tp_group=None, **kwargs):
        layout = HeadRows.of(config, output_size, tp_group)
        world = dist.get_world_size(tp_group)
        super().__init__(input_size, layout.rows * world, config=config, tp_group=tp_group, **kwargs)
        self.layout = layout

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron's TE entries (the norm's replicated, ``_extra_state``), with ``weight``
        (and ``bias``) as fragments of Megatron's fused global tensor."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        dp = dp_rank(metadata)
        for name in ("weight", "bias"):
            param = getattr(self, name, None)
            if f"{prefix}{name}" in out and param is not None:
                out[f"{prefix}{name}"] = self.layout.sharded(f"{prefix}{name}", param, sharded_offsets, dp)
        return out
