"""The QKV projection of a DCP rank, and a StageModel that uses it.

With tensor parallelism W over more ranks than KV heads Hkv, Megatron's fused
``linear_qkv`` splits the fused rows evenly over ranks, which cuts through query groups.
DCP instead keeps the head structure: with D = W / Hkv ranks per KV head, rank
``r = g * D + j`` computes

* its own ``Hq / W`` query heads (column-parallel over all W ranks): heads
  ``g * P + j * P / D ...`` of query group ``g`` (P = Hq / Hkv), and
* the key and value head of group ``g`` (replicated over the D ranks of the group).

Megatron's fused weight holds, per query group g, the rows ``[q heads of g ..., k_g, v_g]``
(``d_h`` rows each). :meth:`DCPQKVLinear.sharded_state_dict` maps the local rows back onto
that same global tensor and key (one fragment per head, like Megatron's SwiGLU factory
maps one parameter onto two fragments), so checkpoints and
:func:`tknp_megatron.models.weights.fill_seeded_` give exactly the reference's weights.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from tknp_megatron.models.model import StageModel, padded_vocab_size

__all__ = ["DCPQKVLinear", "dcp_degree", "build_dcp_model"]


def dcp_degree(num_query_groups: int, world: int) -> int:
    """D = W / Hkv, the ranks that share one KV head (1 when W <= Hkv: plain TP)."""
    if world % num_query_groups and num_query_groups % world:
        raise ValueError(f"world {world} and {num_query_groups} KV heads: neither divides the other")
    return max(1, world // num_query_groups)


class DCPQKVLinear(torch.nn.Module):
    """``[s, b, hidden] -> ([s, b, (Hq / W + 2) d_h], None)``: own q heads, then k and v.

    Takes the arguments :class:`~megatron.core.transformer.attention.SelfAttention` passes
    to its ``linear_qkv`` builder, so it can be a ``ModuleSpec`` override. Requires
    W >= Hkv (the DCP case); the rank comes from ``tp_group``.
    """

    def __init__(self, input_size, output_size, *, config, init_method=None, gather_output=False,
                 bias=False, skip_bias_add=False, is_expert=False, tp_comm_buffer_name=None,
                 tp_group=None):
        super().__init__()
        world = dist.get_world_size(tp_group)
        rank = dist.get_rank(tp_group)
        heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
        if output_size != (heads + 2 * groups) * d or world < groups or world % groups:
            raise ValueError(f"DCPQKVLinear: {heads} q / {groups} kv heads over {world} ranks")
        self.config, self.skip_bias_add = config, skip_bias_add
        self.degree = world // groups
        self.group, self.shard = divmod(rank, self.degree)
        self.q_heads = heads // world
        self.per_group = heads // groups
        self.head_dim = d
        rows = (self.q_heads + 2) * d
        self.weight = torch.nn.Parameter(torch.empty(rows, input_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.empty(rows, dtype=config.params_dtype)) if bias else None

    def forward(self, x: torch.Tensor):
        out = torch.nn.functional.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        return out, (self.bias if self.skip_bias_add else None)

    # ------------------------------------------------------------ checkpoint mapping
    def _global_heads(self) -> List[int]:
        """Global head-row index (units of d_h rows) of each local head row, in order."""
        base = self.group * (self.per_group + 2)
        q = [base + self.shard * self.q_heads + i for i in range(self.q_heads)]
        return q + [base + self.per_group, base + self.per_group + 1]

    def _factory(self, key: str, param: torch.Tensor, sharded_offsets, replica_dp: int):
        heads, total = self._global_heads(), self.config.num_query_groups * (self.per_group + 2)
        prepend = len(sharded_offsets)
        d, n_q, shard = self.head_dim, self.q_heads, self.shard

        @torch.no_grad()
        def build(key, t, replica_id, flattened_range):
            parts = torch.split(t, d, dim=0)  # views: filling them fills the parameter
            return [
                ShardedTensor.from_rank_offsets(
                    key, part, *sharded_offsets, (prepend, head, total),
                    # k/v are replicated over the D ranks of a group; shard 0 is the main copy
                    replica_id=(0, 0 if i < n_q else shard, replica_dp),
                    prepend_axis_num=prepend,
                )
                for i, (part, head) in enumerate(zip(parts, heads))
            ]

        def merge(parts):
            return torch.cat(parts)

        return ShardedTensorFactory(key, param, build, merge, replica_id=(0, 0, replica_dp))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """``{prefix}weight`` (and ``bias``) as fragments of Megatron's fused global tensor."""
        dp = 0
        if metadata is not None and metadata.get("dp_cp_group") is not None:
            dp = dist.get_rank(metadata["dp_cp_group"])
        out = {f"{prefix}weight": self._factory(f"{prefix}weight", self.weight, sharded_offsets, dp)}
        if self.bias is not None:
            out[f"{prefix}bias"] = self._factory(f"{prefix}bias", self.bias, sharded_offsets, dp)
        return out


def build_dcp_model(preset, layers, *, pre_process: bool, post_process: bool, tp: int,
                    params_dtype: torch.dtype, device: torch.device, tp_group=None) -> StageModel:
    """Megatron's StageModel with TP = W and every layer's ``linear_qkv`` a DCPQKVLinear.

    Built on the meta device like :func:`tknp_megatron.models.model.build_stage_model`; the swap
    happens before allocation, so Megatron's uneven fused split is never materialised.
    """
    config = preset.to_transformer_config(
        tensor_model_parallel_size=tp, params_dtype=params_dtype,
        use_cpu_initialization=device.type == "cpu",
    )
    vocab = padded_vocab_size(preset, tp)
    with torch.device("meta"):
        model = StageModel(preset, config, layers, pre_process, post_process, vocab)
        for layer in model.decoder.layers.values():
            attn = layer.self_attention
            old = attn.linear_qkv
            attn.linear_qkv = DCPQKVLinear(
                config.hidden_size, attn.linear_qkv_out_dim, config=config,
                bias=old.bias is not None, tp_group=tp_group if tp_group is not None else attn.tp_group,
            )
    return model.to_empty(device=device).eval()
