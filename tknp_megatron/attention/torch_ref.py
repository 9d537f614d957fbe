"""The reference backend ("torch"): plain, obviously correct, one request at a time.

Every other backend is tested against this one. It reads lengths back to the host and
loops over requests, so it is for tests, CPU runs and checking, not the GPU hot path.
"""

from __future__ import annotations

import torch

from tknp_megatron.attention.base import AttentionBackend, AttentionMetadata
from tknp_megatron.attention.registry import register_backend

__all__ = ["TorchReferenceBackend", "attend_one_request"]


def attend_one_request(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of one request's last query rows over its whole context, in fp32.

    Args:
        q: ``[q_len, Hq, d]`` query rows at positions ``L - q_len ... L - 1``.
        k, v: ``[L, Hkv, d]`` the request's contiguous context.
        scale: softmax scale.

    Returns:
        ``[q_len, Hq, d]`` fp32.
    """
    q_len, num_heads, _ = q.shape
    ctx_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k32 = k.float().repeat_interleave(group, dim=1)  # [L, Hq, d]: head h reads kv head h // group
    v32 = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k32) * scale  # [Hq, q_len, L]
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
    k_pos = torch.arange(ctx_len, device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]  # [q_len, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v32)


class TorchReferenceBackend(AttentionBackend):
    """Gather each request's pages into contiguous K/V, then causal softmax in fp32."""

    name = "torch"

    def _forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        block_size = k_cache.shape[1]
        starts = meta.query_start_loc.tolist()
        lengths = meta.seq_lens.tolist()
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        for r, ctx_len in enumerate(lengths):
            lo, hi = starts[r], starts[r + 1]
            if hi == lo:
                continue
            blocks = meta.block_table[r, : -(-ctx_len // block_size)].long()
            k = k_cache[blocks].flatten(0, 1)[:ctx_len]  # [L, Hkv, d]
            v = v_cache[blocks].flatten(0, 1)[:ctx_len]
            out[lo:hi] = attend_one_request(q[lo:hi], k, v, scale).to(q.dtype)
        return out


register_backend("torch", TorchReferenceBackend, available=lambda: True)
