"""A torch norm with zero-centred gamma, for Megatron's local (no Apex / no TE) layer spec.

Megatron's ``WrappedTorchNorm`` asserts ``not config.layernorm_zero_centered_gamma``; only
Apex's and TE's fused norms implement it. Nemotron-4 stores LayerNorm weights as
``gamma - 1`` (LayerNorm1p), so CPU runs need this module. Same constructor as Megatron's
norms (``config, hidden_size, eps``) and the same parameter names (``weight``, ``bias``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ZeroCenteredNorm(torch.nn.Module):
    """``LayerNorm`` or ``RMSNorm`` (per ``config.normalization``) computing with ``1 + weight``.

    Args:
        config: Megatron ``TransformerConfig``.
        hidden_size: normalised width D.
        eps: epsilon.

    Input and output: ``[..., D]``.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"unsupported normalization {config.normalization!r}")
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        self.hidden_size = hidden_size
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)
        if not self.rms:
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
            setattr(self.bias, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = self.weight + 1
        if self.rms:
            return F.rms_norm(x, (self.hidden_size,), gamma, self.eps)
        return F.layer_norm(x, (self.hidden_size,), gamma, self.bias, self.eps)
