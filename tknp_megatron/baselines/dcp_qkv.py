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

from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from tknp_megatron.models.model import StageModel, build_stage_model
from tknp_megatron.models.precision import DenseFormat

__all__ = ["DCPQKVLinear", "HeadRows", "dcp_degree", "build_dcp_model", "dp_rank"]


def dcp_degree(num_query_groups: int, world: int) -> int:
    """D = W / Hkv, the ranks that share one KV head (1 when W <= Hkv: plain TP)."""
    if world % num_query_groups and num_query_groups % world:
        raise ValueError(f"world {world} and {num_query_groups} KV heads: neither divides the other")
    return max(1, world // num_query_groups)


@dataclass(frozen=True)
class HeadRows:
    """Which rows of Megatron's fused QKV weight a DCP rank holds, and their checkpoint mapping.

    Rank ``r = g * D + j`` of W holds query group ``g``'s heads ``j * P / D ...`` (its own
    ``Hq / W`` query heads) and the group's k and v head, ``d_h`` rows each.

    Attributes:
        degree: D = W / Hkv.
        group: g, the rank's query group (its KV head).
        shard: j, the rank's index among the group's D ranks.
        q_heads: own query heads, Hq / W.
        per_group: query heads per group, P = Hq / Hkv.
        head_dim: d_h.
        num_groups: Hkv.
    """

    degree: int
    group: int
    shard: int
    q_heads: int
    per_group: int
    head_dim: int
    num_groups: int

    @classmethod
    def of(cls, config, output_size: int, tp_group) -> "HeadRows":
        """The layout of this rank of ``tp_group`` (ValueError unless W >= Hkv, Hkv | W)."""
        world, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
        if output_size != (heads + 2 * groups) * d or world < groups or world % groups:
            raise ValueError(f"DCP QKV: {heads} q / {groups} kv heads over {world} ranks")
        degree = world // groups
        group, shard = divmod(rank, degree)
        return cls(degree, group, shard, heads // world, heads // groups, d, groups)

    @property
    def rows(self) -> int:
        """Local output rows: ``(Hq / W + 2) d_h``."""
        return (self.q_heads + 2) * self.head_dim

    def global_heads(self) -> List[int]:
        """Global head-row index (units of d_h rows) of each local head row, in order."""
        base = self.group * (self.per_group + 2)
        q = [base + self.shard * self.q_heads + i for i in range(self.q_heads)]
        return q + [base + self.per_group, base + self.per_group + 1]

    def sharded(self, key: str, param: torch.Tensor, sharded_offsets, replica_dp: int):
        """``param`` (``[rows, ...]``) as fragments of Megatron's fused global tensor ``key``."""
        heads, total = self.global_heads(), self.num_groups * (self.per_group + 2)
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


def dp_rank(metadata) -> int:
    """This rank's place in the sharded-state-dict metadata's DP group (0 without one)."""
    if metadata is not None and metadata.get("dp_cp_group") is not None:
        return dist.get_rank(metadata["dp_cp_group"])
    return 0


class DCPQKVLinear(torch.nn.Module):
    """``[s, b, hidden] -> ([s, b, (Hq / W + 2) d_h], None)``: own q heads, then k and v
    (the rows of :class:`HeadRows`), with Megatron's local layers.

    Takes the arguments :class:`~megatron.core.transformer.attention.SelfAttention` passes
    to its ``linear_qkv`` builder, so it is the layer spec's ``linear_qkv``. Requires
    W >= Hkv (the DCP case); the rank comes from ``tp_group``. With Transformer Engine,
    :class:`~tknp_megatron.baselines.dcp_qkv_te.DCPTEQKVLinear` is the same rows with
    the norm fused in.
    """

    def __init__(self, input_size, output_size, *, config, init_method=None, gather_output=False,
                 bias=False, skip_bias_add=False, is_expert=False, tp_comm_buffer_name=None,
                 tp_group=None, name=None):
        super().__init__()
        self.layout = HeadRows.of(config, output_size, tp_group)
        self.config, self.skip_bias_add = config, skip_bias_add
        rows = self.layout.rows
        self.weight = torch.nn.Parameter(torch.empty(rows, input_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.empty(rows, dtype=config.params_dtype)) if bias else None

    def forward(self, x: torch.Tensor):
        out = torch.nn.functional.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        return out, (self.bias if self.skip_bias_add else None)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """``{prefix}weight`` (and ``bias``) as fragments of Megatron's fused global tensor."""
        dp = dp_rank(metadata)
        out = {f"{prefix}weight": self.layout.sharded(f"{prefix}weight", self.weight, sharded_offsets, dp)}
        if self.bias is not None:
            out[f"{prefix}bias"] = self.layout.sharded(f"{prefix}bias", self.bias, sharded_offsets, dp)
        return out


def build_dcp_model(preset, layers, *, pre_process: bool, post_process: bool, tp: int,
                    params_dtype: torch.dtype, device: torch.device,
                    dense: DenseFormat = DenseFormat(transformer_impl="local")) -> StageModel:
    """Megatron's StageModel with TP = W whose layer spec's ``linear_qkv`` is DCP's:
    :class:`DCPQKVLinear` with local layers, the TE fused norm + linear of
    :class:`~tknp_megatron.baselines.dcp_qkv_te.DCPTEQKVLinear` with Transformer Engine
    (its FP8 weights too). Megatron's own uneven split of the fused QKV is never built: a
    layer built FP8-stored from the spec and its staging copy in the run's dtype, which a
    weight source fills (:mod:`~tknp_megatron.models.layer_rounds`), are both DCP's.
    """
    dense = dense.resolved(device)
    if dense.use_te:
        from tknp_megatron.baselines.dcp_qkv_te import DCPTEQKVLinear as qkv
    else:
        qkv = DCPQKVLinear
    return build_stage_model(preset, layers, pre_process=pre_process, post_process=post_process, tp=tp,
                             params_dtype=params_dtype, device=device, dense=dense, linear_qkv=qkv)
