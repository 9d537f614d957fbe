"""The one place where CPU runs stand in for CUDA-only Megatron helpers.

Megatron-Core's ``DotProductAttention`` takes its scratch buffer from a global CUDA memory
buffer, so a Megatron ``TransformerLayer`` cannot run its own core attention on CPU. The
*reference* model (the same Megatron modules without TKNP) swaps in
:class:`SDPACoreAttention`, a causal ``scaled_dot_product_attention`` with
``DotProductAttention``'s constructor and call signature; everything else in the layer
(QKV split, RoPE, projections, MLP, residuals) is Megatron's own forward.

Megatron's inference request types mark NVTX ranges in ``serialize``
(``torch.cuda.nvtx.range_push``), which raise on a CPU build of torch; a server on CPU
calls :func:`allow_nvtx_without_cuda` first, which makes them no-ops there.

One more acts before Megatron-Core is imported, so it cannot live here (this module imports
Megatron's classes): :mod:`tknp_megatron.cpu_import`.
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

__all__ = ["SDPACoreAttention", "allow_nvtx_without_cuda", "cpu_torch_dist_save_strategy"]


def allow_nvtx_without_cuda() -> None:
    """On a torch built without CUDA, turn ``torch.cuda.nvtx.range_push`` / ``range_pop``
    into no-ops (they only annotate profiles); a CUDA build is left alone."""
    import torch

    if torch.version.cuda is not None:
        return
    torch.cuda.nvtx.range_push = lambda *args, **kwargs: 0
    torch.cuda.nvtx.range_pop = lambda *args, **kwargs: 0


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


def cpu_torch_dist_save_strategy():
    """A ``torch_dist`` save strategy for CPU / gloo pools (tests and CPU conversion).

    Why a shim: Megatron's ``TorchDistSaveShardedStrategy`` always goes through its async
    writer, which starts a multiprocessing ``Manager`` and forked writer processes (refused
    inside daemonic pool workers), calls ``torch.cuda.synchronize`` and reduces a
    ``device='cuda'`` tensor when finalising. This subclass keeps Megatron's own state-dict
    translation (``_replace_state_dict_keys_with_sharded_keys``, ``mcore_to_pyt_state_dict``)
    and save planner, and writes synchronously with PyTorch DCP's ``FileSystemWriter``: the
    files are the same ``torch_dist`` layout (``.metadata`` + ``*.distcp``) that Megatron's
    ``TorchDistLoadShardedStrategy`` reads. Pass it as ``dist_checkpointing.save(...,
    sharded_strategy=cpu_torch_dist_save_strategy())``.
    """
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class _CPUTorchDistSave(mcore_torch.TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            sd, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            pyt_sd = mcore_torch.mcore_to_pyt_state_dict(sd, False)
            planner = mcore_torch.MCoreSavePlanner(
                dedup_replicated_tensors=not self.keep_only_main_replica,
                flatten_state_dict=False,
            )
            dcp_save(pyt_sd, storage_writer=FileSystemWriter(checkpoint_dir), planner=planner)

    return _CPUTorchDistSave("torch_dist", 1, thread_count=1)
