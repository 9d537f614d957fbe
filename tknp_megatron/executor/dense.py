"""The root's dense work on Megatron's own layer submodules, in Megatron's order.

Shared by TKNP and the baselines: the input norm + QKV projection, then (after
attention) linear_proj, bias-dropout-add, pre-MLP norm, MLP, bias-dropout-add; and the
final norm + vocab-parallel output layer with the TP all-gather of the logits. With a
:class:`~tknp_megatron.executor.dense_fusion.DenseFusion` (GPUs) the element-wise steps
between the GEMMs run as fused kernels on the same modules' parameters.

Where the step pads its dense rows itself (``row_align`` > 1, from
:func:`~tknp_megatron.models.precision.row_alignment`: FP8 GEMMs' alignment), the hidden
state carries zero rows after the step's rows from the embedding on (:func:`pad_rows`), the
attention runs over the step's rows only, and its output is padded back before
``linear_proj``: every GEMM then finds its rows aligned.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from tknp_megatron.executor.dense_fusion import DenseFusion

__all__ = ["dense_rows", "pad_rows", "qkv_projection", "qk_layernorm_", "finish_layer", "vocab_logits"]


def dense_rows(rows: int, align: int) -> int:
    """Rows of the dense batch for a step of ``rows`` rows: ``rows`` rounded up to a multiple
    of ``align``."""
    return -(-rows // align) * align


def pad_rows(x: torch.Tensor, align: int) -> torch.Tensor:
    """``[rows, ...]`` -> ``[dense_rows(rows, align), ...]``: zero rows appended (``x`` itself
    where already aligned)."""
    pad = dense_rows(x.shape[0], align) - x.shape[0]
    if not pad:
        return x
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))


def qkv_projection(block, hidden: torch.Tensor, fusion: Optional[DenseFusion] = None) -> torch.Tensor:
    """``[rows, 1, D]`` -> ``[rows, qkv_width / T]`` (this TP rank's fused QKV columns),
    query and key heads normalized where the model has QK layernorm."""
    if fusion is not None:
        qkv = fusion.qkv(block, hidden)
    else:
        qkv, _ = block.self_attention.linear_qkv(block.input_layernorm(hidden))
    qkv = qkv.view(hidden.shape[0], qkv.shape[-1])
    cfg = block.config
    if cfg.qk_layernorm:  # a rank holds Hkv / T query groups, or one (T > Hkv, and DCP's ranks)
        qk_layernorm_(block.self_attention, qkv, max(1, cfg.num_query_groups // cfg.tensor_model_parallel_size))
    return qkv


def qk_layernorm_(attention, qkv: torch.Tensor, groups: int) -> torch.Tensor:
    """Megatron's QK layernorm, in place: ``qkv`` ``[rows, groups * (P + 2) * d]`` holds per
    query group its ``P`` query heads, its key head and its value head (``d`` channels
    each; a DCP rank's one group of its own query heads alike); ``attention.q_layernorm``
    normalizes every query head and ``attention.k_layernorm`` every key head over their
    ``d`` channels, as Megatron does after the projection and before RoPE."""
    d = attention.hidden_size_per_attention_head
    heads = qkv.view(qkv.shape[0], groups, -1, d)  # [rows, groups, P + 2, d]
    per_group = heads.shape[2] - 2
    heads[:, :, :per_group] = attention.q_layernorm(heads[:, :, :per_group].contiguous())
    heads[:, :, per_group] = attention.k_layernorm(heads[:, :, per_group].contiguous())
    return qkv


def finish_layer(block, attn: torch.Tensor, residual: torch.Tensor,
                 fusion: Optional[DenseFusion] = None) -> torch.Tensor:
    """Attention output ``[rows, 1, heads * d / T]`` and residual ``[rows, 1, D]`` -> ``[rows, 1, D]``."""
    if fusion is not None:
        return fusion.finish(block, attn, residual)
    cfg = block.config
    out, bias = block.self_attention.linear_proj(attn)
    hidden = block.self_attn_bda(False, cfg.bias_dropout_fusion)((out, bias), residual, block.hidden_dropout)
    mlp_out = block.mlp(block.pre_mlp_layernorm(hidden))
    return block.mlp_bda(False, cfg.bias_dropout_fusion)(mlp_out, hidden, block.hidden_dropout)


def vocab_logits(model, hidden: torch.Tensor, rows: torch.Tensor, tp_group, tp_size: int, vocab: int):
    """Rows ``rows`` of ``hidden`` -> ``[R, vocab]`` float32 logits on every TP rank."""
    h = model.decoder.final_layernorm(hidden.index_select(0, rows))
    local, _ = model.output_layer(h)  # [R, 1, V / T]
    local = local[:, 0].contiguous()
    if tp_size == 1:
        return local[:, :vocab].float()
    parts = local.new_empty((tp_size * local.shape[0], local.shape[1]))
    # Megatron's gather_from_tensor_model_parallel_region asks torch.cuda for a device.
    dist.all_gather_into_tensor(parts, local, group=tp_group)
    full = parts.view(tp_size, local.shape[0], -1).permute(1, 0, 2).reshape(local.shape[0], -1)
    return full[:, :vocab].float()
