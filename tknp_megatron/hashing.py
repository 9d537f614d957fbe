"""Counter-based 32-bit hashing on int64 tensors, exact and identical on every device.

Seeded weights, synthetic KV and sampling noise are all pure functions of integer
coordinates through :func:`mix32`, so they never depend on how work is split.
"""

from __future__ import annotations

import torch

__all__ = ["MASK32", "mix32"]

MASK32 = 0xFFFFFFFF


def mix32(h: torch.Tensor) -> torch.Tensor:
    """A bijection on [0, 2**32): a lowbias32-style mixer (hash-prospector constants).

    Both multipliers are below 2**31, so with ``h < 2**32`` every product is below 2**63:
    the int64 arithmetic never overflows and the result is exact on every backend.
    """
    h = h ^ (h >> 16)
    h = (h * 0x21F0AAAD) & MASK32
    h = h ^ (h >> 15)
    h = (h * 0x735A2D97) & MASK32
    return h ^ (h >> 15)
