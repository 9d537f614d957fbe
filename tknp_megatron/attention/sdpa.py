"""A vectorised torch backend ("sdpa"): gather pages, pad queries, one masked SDPA call.

No per-request Python loop and no host sync, so it runs on any device, including the
mixed prefill + decode batches of the Triton backend when asked to. It materialises
``[R, max_seq_len, Hkv, d]`` K and V, so it suits prefill more than long-context decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tknp_megatron.attention.base import AttentionBackend, AttentionMetadata
from tknp_megatron.attention.paging import gather_pages, row_requests
from tknp_megatron.attention.registry import register_backend

__all__ = ["SdpaBackend", "sdpa_paged"]


def _sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """SDPA over ``[R, H, L, d]`` tensors; kv heads are shared by groups of query heads."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        except TypeError:  # torch < 2.5 has no enable_gqa
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def sdpa_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Paged causal attention through ``scaled_dot_product_attention``: ``q`` ``[rows, Hq,
    d]`` over ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, Hkv, d]`` -> ``[rows, Hq,
    d]`` in ``q.dtype``."""
    num_req, max_q, max_k = meta.num_requests, meta.max_query_len, meta.max_seq_len
    req, idx, _ = row_requests(meta, q.shape[0])
    q_pad = q.new_zeros((num_req, max_q, q.shape[1], q.shape[2]))
    q_pad[req, idx] = q
    k = gather_pages(k_cache, meta.block_table, max_k, meta.seq_lens).transpose(1, 2)  # [R, Hkv, Lk, d]
    v = gather_pages(v_cache, meta.block_table, max_k, meta.seq_lens).transpose(1, 2)
    # Query i of request r sits at seq_len - q_len + i and sees keys 0..that position.
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
    first = (meta.seq_lens.long() - q_lens)[:, None]  # [R, 1]
    q_pos = first + torch.arange(max_q, device=q.device)[None, :]  # [R, Lq]
    k_pos = torch.arange(max_k, device=q.device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [R, Lq, Lk]; padded rows see >= 1 key
    out = _sdpa_gqa(q_pad.transpose(1, 2), k, v, mask[:, None], scale)  # [R, Hq, Lq, d]
    return out.transpose(1, 2)[req, idx]


class SdpaBackend(AttentionBackend):
    """Vectorised gather + masked ``scaled_dot_product_attention``."""

    name = "sdpa"

    def _forward(self, q, k_cache, v_cache, meta, scale):
        return sdpa_paged(q, k_cache, v_cache, meta, scale)


register_backend("sdpa", SdpaBackend, available=lambda: True)
