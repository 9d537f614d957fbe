"""Synthetic ingested KV that is the same in every parallel mode.

Benchmarks skip prefill: a request's prompt KV "arrives from the prefill server" as
values generated on the rank that stores them. Each element is a hash of (seed, global
layer, K or V, position, global KV head, dim) (see :func:`weights.hash_uniform`), so
TKNP owners, DP replicas, TP shards, PP stages and DCP sequence shards all store the
same logical cache, each generating only its own slice, and greedy tokens agree
across modes. Values repeat with period ``PERIOD`` along the sequence, so generating a
128K-token prompt costs one small tile plus a copy, not a hash per element.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tknp_megatron.host_to_device import to_device
from tknp_megatron.models.weights import hash_uniform

__all__ = ["PERIOD", "synthetic_kv"]

PERIOD = 61  # positions p and p + PERIOD hold the same values


def synthetic_kv(
    seed: int,
    layers: Sequence[int],
    positions: torch.Tensor,
    kv_heads: Sequence[int],
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    scale: float = 1.0,
) -> torch.Tensor:
    """``[len(layers), 2, len(positions), len(kv_heads), head_dim]`` of values in [-scale, scale).

    Args:
        seed: the request's synthetic seed.
        layers: global layer ids to generate.
        positions: ``[P]`` int64 token positions.
        kv_heads: global KV-head ids to generate.
        num_kv_heads: the model's KV heads (for the global index).
        head_dim: d_h.
    """
    dev = device
    lay, head = to_device((torch.as_tensor(list(layers), dtype=torch.int64),
                           torch.as_tensor(list(kv_heads), dtype=torch.int64)), dev)
    lay, head = lay.view(-1, 1, 1, 1, 1), head.view(1, 1, 1, -1, 1)
    kv = torch.arange(2, dtype=torch.int64, device=dev).view(1, 2, 1, 1, 1)
    phase = torch.arange(PERIOD, dtype=torch.int64, device=dev).view(1, 1, -1, 1, 1)
    dim = torch.arange(head_dim, dtype=torch.int64, device=dev).view(1, 1, 1, 1, -1)
    index = (((lay * 2 + kv) * PERIOD + phase) * num_kv_heads + head) * head_dim + dim
    tile = (hash_uniform(seed, index) * scale).to(dtype)  # [L, 2, PERIOD, H, d]
    return tile.index_select(2, positions.to(dev, torch.int64) % PERIOD)
