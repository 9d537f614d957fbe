"""FP8 GEMM inputs quantized by the kernels that make them (Transformer Engine's per-tensor
current scaling: Megatron's ``tensorwise`` recipe).

A TE FP8 linear quantizes its own input: the norm-fused QKV and FC1 modules run their norm
kernel (which also takes the amax), a scale kernel and a cast kernel; the output projection
and FC2 an amax kernel, a scale kernel and a cast kernel. With the residual add before FC1's
norm and the activation before FC2, that is 15 element-wise launches a layer, each a few
microseconds at decode sizes, whatever the GEMMs' size: on the whole FP8 Llama-3.1-70B at two
requests, 2.0 ms of a 24.5 ms step for the norms, amaxes, scales, casts and residual adds
(``benchmarks/RESULTS.md``, "The whole FP8 70B's row padding side by side"), and relatively
more at TP 8, where each rank's GEMMs are an eighth.

Here the kernel that makes a GEMM input writes the partial maxima of what it writes (the
norm, with the residual add before it, one per row; the activation, one per block), and one
cast kernel takes the amax from them, computes TE's scale and writes the E4M3 bits
(``dense_kernels.quantize_kernel``); the attention's output takes an amax kernel and the
cast. No atomics, nothing kept between calls. Eight launches a layer and the second residual
add. The quantized input goes to TE as a ``Float8Tensor``: into the row-parallel module itself (TE
takes an input that is quantized already as it is, and does its TP all-reduce), and for
the norm-fused column-parallel modules, which would norm their input again, into TE's GEMM
(``general_gemm``) on the module's FP8 weight, as the module calls it.

The scale and the cast are TE's (``scale = max / amax`` rounded to nearest, its guards for a
zero, infinite or NaN amax, round to nearest even, saturated), so the same amax gives the
same bits; the amax itself differs from TE's where the norm's sum does (the order of its
additions), by an ulp at most. Taken only where each batch's rows are aligned for FP8
(``precision.row_alignment``: the step pads them once) and the linears are RMSNorm-fused,
bias-free and FP8-stored (:func:`fp8_inputs_usable`); elsewhere TE's modules run as they are
(``DenseFusion.fp8_rows``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

__all__ = ["Fp8Scaling", "fp8_inputs_usable", "quantize", "norm_quantized", "activation_quantized",
           "column_gemm", "row_linear"]

_BLOCK = 2048  # elements per block of the cast kernel
_AMAX_BLOCK = 8192  # elements per program of the amax kernel
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # its FP8 conversion is not a GPU's
_SMS: Dict[torch.device, int] = {}


@dataclass(frozen=True)
class Fp8Scaling:
    """How TE's recipe scales and multiplies an activation in the forward pass.

    Attributes:
        max_fp8: the largest finite value of the forward format (E4M3: 448).
        epsilon: the amax's lower bound (``fp8_quant_fwd_inp.amax_epsilon``).
        pow2: scales rounded down to a power of two (``fp8_quant_fwd_inp.power_2_scale``).
        split_accumulator: the forward GEMM's ``use_split_accumulator``.
    """

    max_fp8: float
    epsilon: float
    pow2: bool
    split_accumulator: bool

    @classmethod
    def of(cls, recipe) -> "Fp8Scaling":
        """The scaling of a TE ``Float8CurrentScaling`` recipe (AttributeError for a TE whose
        recipe names them otherwise)."""
        qp = recipe.fp8_quant_fwd_inp
        return cls(float(recipe.fp8_format.value.max_fwd), float(qp.amax_epsilon), bool(qp.power_2_scale),
                   bool(recipe.fp8_gemm_fprop.use_split_accumulator))

    @classmethod
    def current(cls) -> "Fp8Scaling":
        """The scaling of the recipe of the TE autocast this is called in."""
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        return cls.of(FP8GlobalStateManager.get_fp8_recipe())


def fp8_inputs_usable(block) -> Optional[str]:
    """None if ``block``'s linears take inputs quantized here, else why not (one line)."""
    try:
        from transformer_engine.pytorch.cpp_extensions import general_gemm  # noqa: F401
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: F401
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor  # noqa: F401
    except ImportError as err:
        return f"this Transformer Engine has no {err.name}"
    from megatron.core.fp8_utils import get_fp8_recipe

    try:  # the recipe the step's autocast runs (models/precision.py: dense_autocast)
        Fp8Scaling.of(get_fp8_recipe(block.config))
    except AttributeError as err:
        return f"this Transformer Engine's recipe lacks {err.name}"
    attn, mlp = block.self_attention, block.mlp
    column = (attn.linear_qkv, mlp.linear_fc1)
    for m in column:
        if getattr(m, "normalization", None) != "RMSNorm" or getattr(m, "layer_norm_weight", None) is None:
            return f"{type(m).__name__} is not an RMSNorm-fused TE linear"
        if m.zero_centered_gamma:
            return "zero-centred gamma (TE's norm adds 1 in fp32, the kernel here as Megatron's module)"
    for m in column + (attn.linear_proj, mlp.linear_fc2):
        if getattr(m, "use_bias", True) or getattr(m, "sequence_parallel", False):
            return f"{type(m).__name__} has a bias or is sequence-parallel"
        if type(m.weight.data).__name__ != "Float8Tensor":
            return f"{type(m).__name__}'s weight is not FP8-stored"
    return None


def _cast(x: torch.Tensor, partials: torch.Tensor, scaling: Fp8Scaling) -> torch.Tensor:
    """``x`` ``[..., K]`` (contiguous; ``partials``: its producer's partial maxima) as a TE
    ``Float8Tensor`` ``[rows, K]``."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor
    import transformer_engine_torch as tex

    import triton

    from tknp_megatron.executor.dense_kernels import quantize_kernel

    shape = (x.numel() // x.shape[-1], x.shape[-1])
    data = torch.empty(shape, dtype=torch.uint8, device=x.device)
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    n = x.numel()
    programs = min(triton.cdiv(n, _BLOCK), _programs(x.device))
    quantize_kernel[(programs,)](x, partials, partials.numel(), data, scale_inv, n, scaling.max_fp8,
                                 scaling.epsilon, POW2=scaling.pow2, BITS=_INTERPRETED, BLOCK=_BLOCK,
                                 PBLOCK=1024)
    return Float8Tensor(shape=shape, dtype=x.dtype, data=data, fp8_scale_inv=scale_inv,
                        fp8_dtype=tex.DType.kFloat8E4M3, requires_grad=False)


def _programs(device: torch.device) -> int:
    """Programs of a cast launch: two per SM, each looping over its blocks (each reads the
    producer's partial maxima once)."""
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return 2 * _SMS[device]


def quantize(x: torch.Tensor, scaling: Fp8Scaling) -> torch.Tensor:
    """``x`` ``[..., K]`` (the attention's output) with TE's current scaling, ``[rows, K]``:
    an amax kernel and the cast."""
    import triton

    from tknp_megatron.executor.dense_kernels import amax_kernel

    x = x.contiguous()
    n = x.numel()
    partials = torch.empty(triton.cdiv(n, _AMAX_BLOCK), dtype=torch.float32, device=x.device)
    amax_kernel[(partials.numel(),)](x, partials, n, BLOCK=_AMAX_BLOCK)
    return _cast(x, partials, scaling)


def norm_quantized(linear, x: torch.Tensor, scaling: Fp8Scaling, residual: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(quantized rmsnorm(h) [rows, D], h [rows, 1, D])``, ``h = x (+ residual)``, on the
    norm of ``linear`` (a TE RMSNorm-fused linear); without a residual ``h`` is ``x``."""
    from tknp_megatron.executor.dense_fusion import launch_add_norm

    partials = torch.empty(x.numel() // x.shape[-1], dtype=torch.float32, device=x.device)
    normed, total = launch_add_norm(x, residual, None, linear.layer_norm_weight, None, linear.eps,
                                    rms=True, zero_centred=False, amax=partials)
    return _cast(normed, partials, scaling), total


def activation_quantized(x: torch.Tensor, activation: str, gated: bool, scaling: Fp8Scaling) -> torch.Tensor:
    """FC1's output ``[..., W]`` through Megatron's MLP activation, quantized: ``[rows, W / 2]``
    gated, else ``[rows, W]``."""
    from tknp_megatron.executor.dense_fusion import activation_blocks, fused_activation

    partials = torch.empty(activation_blocks(x, gated), dtype=torch.float32, device=x.device)
    return _cast(fused_activation(x, None, activation, gated, amax=partials), partials, scaling)


def column_gemm(linear, x8: torch.Tensor, scaling: Fp8Scaling) -> torch.Tensor:
    """``x8 [rows, K]`` (quantized) times the FP8 weight of ``linear`` (a norm-fused TE
    column-parallel linear, no bias, not sequence-parallel: nothing to communicate), as TE's
    module calls its GEMM: ``[rows, 1, N / T]`` in the weight's nominal dtype."""
    from transformer_engine.pytorch.cpp_extensions import general_gemm

    weight = linear.weight
    out, *_ = general_gemm(weight, x8, out_dtype=weight.dtype, use_split_accumulator=scaling.split_accumulator)
    return out.view(x8.shape[0], 1, -1)


def row_linear(linear, x8: torch.Tensor) -> torch.Tensor:
    """``x8 [rows, K]`` (quantized) through ``linear`` (a TE row-parallel linear, no bias)
    itself, past Megatron's FP8 padding wrapper (the rows are aligned): ``[rows, 1, N]``,
    all-reduced over its TP group."""
    forward = getattr(linear.forward, "__wrapped__", linear.forward)
    out, _ = forward(x8)
    return out.view(x8.shape[0], 1, -1)
