"""Seeded random weights that do not depend on how the model is split.

Each parameter element gets a value from a counter-based hash of (seed, checkpoint key,
global element index), where the key and the global index come from Megatron's own
sharded state dict (the same ``ShardedTensor`` metadata dist_checkpointing uses to
reshard). So a TP=1 reference model, a TP=2 node, and a rank holding two layers of a
block all see identical values for the same logical weight, and no rank ever builds a
tensor larger than its own shard.
"""

from __future__ import annotations

import zlib
from typing import Dict, Iterable, Tuple

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from tknp_megatron.config import ModelPreset
from tknp_megatron.hashing import MASK32, mix32

__all__ = ["SLAB_ELEMENTS", "fill_seeded_", "hash_uniform"]

def hash_uniform(seed: int, index: torch.Tensor) -> torch.Tensor:
    """Uniform values in [-1, 1) from int64 element indices; same on every device.

    Args:
        seed: 32-bit stream id.
        index: int64 tensor of global element indices (< 2**62).
    Returns:
        float32 tensor of ``index``'s shape.
    """
    lo = index & MASK32
    hi = (index >> 32) & MASK32
    h = mix32(mix32(lo ^ (seed & MASK32)) ^ mix32(hi ^ 0x632BE5AB))
    return (h >> 8).to(torch.float32) * (2.0 / (1 << 24)) - 1.0


def _global_indices(st: ShardedTensor, rows: range) -> torch.Tensor:
    """Global flat element index of the local elements ``st.data[rows]`` (int64, that
    slab's shape; ``rows`` along the local axis 0)."""
    p = st.prepend_axis_num
    data_shape = st.global_shape[p:]
    idx = torch.zeros((), dtype=torch.int64, device=st.data.device)
    for axis, (offset, size) in enumerate(zip(st.global_offset[p:], st.data.shape)):
        lo, hi = (offset + rows.start, offset + rows.stop) if axis == 0 else (offset, offset + size)
        rng = torch.arange(lo, hi, dtype=torch.int64, device=idx.device)
        idx = idx.unsqueeze(-1) * data_shape[axis] + rng
    unit = 1
    for n in data_shape:
        unit *= n
    layer = 0
    for axis in range(p):  # stacked layer axes, outermost first
        layer = layer * st.global_shape[axis] + st.global_offset[axis]
    return idx + layer * unit


def _key_seed(seed: int, key: str) -> int:
    return zlib.crc32(key.encode()) ^ (seed * 0x27D4EB2F & MASK32)


def _scale_shift(key: str, preset: ModelPreset) -> Tuple[float, float]:
    """(scale, shift) of the uniform draw: norms near 1 (or 0 if zero-centred)."""
    is_norm = "layernorm" in key or "layer_norm" in key
    if is_norm and key.endswith("weight"):
        return 0.1, 0.0 if preset.zero_centered_gamma else 1.0
    if key.endswith("bias"):
        return 0.02, 0.0
    return preset.init_std * 3 ** 0.5, 0.0  # uniform with std init_std


SLAB_ELEMENTS = 1 << 20
"""Elements hashed at once: the int64 indices and the hash's temporaries are several times
a weight's own bytes, so a weight is filled in slabs of rows of at most this many elements
(about 50 MiB of working memory, whatever the weight's size)."""


def _fill_tensor_(st: ShardedTensor, seed: int, preset: ModelPreset) -> None:
    scale, shift = _scale_shift(st.key, preset)
    key_seed = _key_seed(seed, st.key)
    data = st.data if st.data.dim() else st.data.view(1)
    rows = data.shape[0]
    step = max(1, SLAB_ELEMENTS // max(1, data[:1].numel()))
    for lo in range(0, rows, step):
        slab = range(lo, min(rows, lo + step))
        values = hash_uniform(key_seed, _global_indices(st, slab)) * scale + shift
        data[slab.start : slab.stop].copy_(values.to(data.dtype))


def _sharded_tensors(sd: Dict) -> Iterable[ShardedTensor]:
    for value in sd.values():
        if isinstance(value, ShardedTensor):
            yield value
        elif isinstance(value, ShardedTensorFactory):
            built = value.build()
            yield from built if isinstance(built, list) else _sharded_tensors(built)
        elif isinstance(value, dict):
            yield from _sharded_tensors(value)


@torch.no_grad()
def fill_seeded_(model: torch.nn.Module, preset: ModelPreset, seed: int) -> None:
    """Fill every parameter of ``model`` (a StageModel or GPTModel) from the seed.

    Uses ``model.sharded_state_dict()``; factories (SwiGLU's split ``linear_fc1``) are
    built so each half gets the values of its place in the unsharded tensor. Each tensor is
    filled in slabs of rows (:data:`SLAB_ELEMENTS`), so the working memory stays small
    beside the weights (docs/ARCHITECTURE.md, "FP8 on the root": the load's peak).
    """
    for st in _sharded_tensors(model.sharded_state_dict()):
        if st.data.dtype.is_floating_point:
            _fill_tensor_(st, seed, preset)
