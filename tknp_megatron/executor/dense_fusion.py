"""The element-wise work around the root's GEMMs, fused into one Triton kernel per step.

Megatron's local layers run each torch norm as about eight element-wise kernels (upcast,
square, mean, add, rsqrt, two scales, downcast), and the residual adds and the gated
activation as kernels of their own: 21 small kernels beside a Llama layer's four GEMMs, 34-76
us of kernel time per layer at B = 1-128 on an H200, plus the gaps between them in a graph
(``tools/bench_dense.py``; ``benchmarks/RESULTS.md``, "Dense work around the GEMMs"). On a
GPU the root runs instead, per layer:

* the input norm: one kernel (``add_norm_kernel`` with no residual);
* after the output projection, its bias, the residual add and the pre-MLP norm: one kernel,
  which also stores the sum (the MLP's residual);
* the MLP's activation (gated or not, with FC1's bias): one kernel;

and the second residual add as before. Each is where Megatron's module would be, on that
module's own parameters (``weight``, ``bias``, ``eps``), so checkpoints, FP8 storage and
Megatron's GEMM modules are untouched. The kernels round to the activations' dtype where
Megatron's modules round, so their outputs are the modules' outputs up to the order of the
norms' sums (``dense_kernels.py``). With Transformer Engine's layers the norms are fused into
the QKV and FC1 GEMMs already (the spec's norms are identities): only the activation is
replaced there, and with FP8 GEMMs under the ``tensorwise`` recipe each GEMM's input is
quantized by the kernel that makes it, the norms run here again (``fp8_inputs.py``). A module
this does not know (another norm class, TE's fused MLP) runs as Megatron's.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from tknp_megatron.executor.rope import fusable_rope
from tknp_megatron.models.norms import ZeroCenteredNorm

__all__ = ["DenseFusion", "activation_blocks", "dense_fusion_for", "fused_activation", "fused_add_norm",
           "launch_add_norm"]

_NORM_BLOCK = 8192  # columns per chunk of a norm's row (any width: rows are looped), 16 warps
_ACT_BLOCK = 1024
_MAX_PARTIALS = 4096  # partial maxima an activation with an amax writes, about (wider blocks past it)


@dataclass(frozen=True)
class DenseFusion:
    """Which of a layer's element-wise steps run fused (one per model: its layers are alike).

    Attributes:
        norms: the input and pre-MLP norms are torch ``RMSNorm`` / ``LayerNorm`` or
            :class:`~tknp_megatron.models.norms.ZeroCenteredNorm` (local spec).
        activation: ``silu``, ``gelu`` or ``squared_relu`` (the MLP is Megatron's ``MLP``),
            else None.
        gated: the activation gates (SwiGLU, GeGLU): FC1's output is ``[rows, 2 F / T]``.
        rope: the owners' RoPE and K/V append run as one kernel per layer
            (:meth:`~tknp_megatron.executor.rope.Rope.rotate_and_append`; Megatron's unfused
            rotation is configured, :func:`~tknp_megatron.executor.rope.fusable_rope`).
        fp8_rows: TE FP8 layers (``tensorwise``) whose GEMM inputs are quantized here
            (:mod:`~tknp_megatron.executor.fp8_inputs`), for batches whose row count is a
            multiple of this (TE's alignment; the step pads to it); 0: TE quantizes them.
    """

    norms: bool
    activation: Optional[str]
    gated: bool
    rope: bool = False
    fp8_rows: int = 0

    def fp8_for(self, rows: int) -> bool:
        """Whether a batch of ``rows`` rows takes the FP8 inputs quantized here."""
        return self.fp8_rows > 0 and rows % self.fp8_rows == 0

    def qkv(self, block, hidden: torch.Tensor) -> torch.Tensor:
        """The input norm and the QKV projection: ``[rows, 1, D]`` -> ``[rows, 1, N / T]``."""
        if self.fp8_for(hidden.shape[0]):
            from tknp_megatron.executor import fp8_inputs as f8

            scaling = f8.Fp8Scaling.current()
            linear = block.self_attention.linear_qkv
            return f8.column_gemm(linear, f8.norm_quantized(linear, hidden, scaling)[0], scaling)
        qkv, _ = block.self_attention.linear_qkv(self.input_norm(block, hidden))
        return qkv

    def finish(self, block, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The output projection, the residual add, the pre-MLP norm, the MLP and the second
        residual add: attention output ``[rows, 1, heads * d / T]`` -> ``[rows, 1, D]``."""
        cfg = block.config
        if self.fp8_for(attn.shape[0]):
            from tknp_megatron.executor import fp8_inputs as f8

            scaling = f8.Fp8Scaling.current()
            out = f8.row_linear(block.self_attention.linear_proj, f8.quantize(attn, scaling))
            fc1 = block.mlp.linear_fc1
            normed, hidden = f8.norm_quantized(fc1, out, scaling, residual)
            inter = f8.column_gemm(fc1, normed, scaling)
            mlp_out = (f8.row_linear(block.mlp.linear_fc2, f8.activation_quantized(inter, self.activation, self.gated,
                                                                                 scaling)), None)
        else:
            out, bias = block.self_attention.linear_proj(attn)
            hidden, normed = self.add_norm(block, out, bias, residual)
            mlp_out = self.mlp(block, normed)
        return block.mlp_bda(False, cfg.bias_dropout_fusion)(mlp_out, hidden, block.hidden_dropout)

    def input_norm(self, block, hidden: torch.Tensor) -> torch.Tensor:
        """``block.input_layernorm(hidden)``: ``[rows, 1, D]`` -> ``[rows, 1, D]``."""
        if not self.norms:
            return block.input_layernorm(hidden)
        return fused_add_norm(block.input_layernorm, hidden)[0]

    def add_norm(self, block, out: torch.Tensor, bias: Optional[torch.Tensor],
                 residual: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The self-attention's bias-dropout-add (inference: no dropout) and the pre-MLP
        norm: ``(h, norm(h))`` with ``h = out (+ bias) + residual``, each ``[rows, 1, D]``."""
        if not self.norms:
            cfg = block.config
            hidden = block.self_attn_bda(False, cfg.bias_dropout_fusion)((out, bias), residual,
                                                                         block.hidden_dropout)
            return hidden, block.pre_mlp_layernorm(hidden)
        normed, hidden = fused_add_norm(block.pre_mlp_layernorm, out, residual, bias)
        return hidden, normed

    def mlp(self, block, normed: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``block.mlp(normed)``: ``(output [rows, 1, D], bias or None)``."""
        if self.activation is None:
            return block.mlp(normed)
        inter, bias = block.mlp.linear_fc1(normed)
        inter = fused_activation(inter, bias, self.activation, self.gated)
        return block.mlp.linear_fc2(inter)


def dense_fusion_for(model, device: torch.device, enabled: Optional[bool] = None,
                     rope: bool = False) -> Optional[DenseFusion]:
    """The fusion ``model``'s layers take on ``device`` (None: run Megatron's modules).

    ``enabled``: None on a GPU only; True wherever Triton runs (a GPU, or any device under
    ``TRITON_INTERPRET=1``: tests ask for it there, the interpreter being far too slow to
    serve with); False never. ``rope``: the owners' RoPE and K/V append as well, where the
    model's rotation is Megatron's unfused one (``EngineConfig.fused_rope``).
    """
    from tknp_megatron.attention.triton_paged import triton_supports_device

    layers = list(model.decoder.layers.values())
    runs = device.type == "cuda" if enabled is None else enabled and triton_supports_device(device)
    if not (runs and layers and find_spec("triton")):
        return None
    block = layers[0]
    cfg = block.config
    norms = _fusable_norm(block.input_layernorm) and _fusable_norm(block.pre_mlp_layernorm)
    activation = _activation_name(cfg.activation_func) if type(block.mlp).__name__ == "MLP" else None
    if activation is not None and (cfg.bias_activation_fusion or cfg.use_te_activation_func):
        activation = None  # Megatron's own fused activation is configured: keep it
    rope = rope and fusable_rope(cfg)
    fp8_rows = _fp8_rows(block) if activation is not None else 0
    if not norms and activation is None and not rope:
        return None
    return DenseFusion(norms=norms, activation=activation, gated=bool(cfg.gated_linear_unit), rope=rope,
                       fp8_rows=fp8_rows)


def _fp8_rows(block) -> int:
    """TE's row alignment where ``block``'s FP8 GEMM inputs can be quantized here, else 0."""
    from tknp_megatron.models.precision import row_alignment

    cfg = block.config
    if not (getattr(cfg, "fp8", None) and getattr(cfg, "fp8_recipe", None) == "tensorwise"):
        return 0
    from tknp_megatron.executor.fp8_inputs import fp8_inputs_usable

    align = row_alignment(cfg)
    return align if align > 1 and fp8_inputs_usable(block) is None else 0


def _fusable_norm(module) -> bool:
    return type(module) in (torch.nn.RMSNorm, torch.nn.LayerNorm, ZeroCenteredNorm)


def _activation_name(fn) -> Optional[str]:
    from tknp_megatron.config import squared_relu

    names = {F.silu: "silu", F.gelu: "gelu", squared_relu: "squared_relu"}
    return names.get(fn)


def fused_add_norm(norm, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(norm(h), h)`` with ``h = x (+ bias) (+ residual)`` in one kernel, on ``norm``'s
    parameters (a torch ``RMSNorm`` / ``LayerNorm`` or ``ZeroCenteredNorm``).

    Shapes ``[..., D]``; without a residual ``h`` is ``x`` (not copied).
    """
    rms = type(norm) is torch.nn.RMSNorm or getattr(norm, "rms", False)
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    return launch_add_norm(x, residual, bias, norm.weight, None if rms else norm.bias, eps, rms=rms,
                           zero_centred=isinstance(norm, ZeroCenteredNorm))


def launch_add_norm(x: torch.Tensor, residual: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                    weight: torch.Tensor, norm_bias: Optional[torch.Tensor], eps: float, rms: bool,
                    zero_centred: bool, amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_add_norm` on a norm's parameters; ``amax`` (one float per row): each row's
    largest ``|norm(h)|`` is written to it (``dense_kernels.add_norm_kernel``)."""
    from tknp_megatron.executor.dense_kernels import add_norm_kernel

    cols = x.shape[-1]
    x2 = x.reshape(-1, cols)
    block = min(_NORM_BLOCK, triton_next_pow2(cols))
    out = torch.empty_like(x2)
    total = torch.empty_like(x2) if residual is not None else x2
    res = residual.reshape(-1, cols) if residual is not None else x2
    add_norm_kernel[(x2.shape[0],)](
        x2, bias if bias is not None else x2, res, total, weight, norm_bias if norm_bias is not None else weight,
        out, amax if amax is not None else x2, cols, float(eps),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, RMS=rms,
        ZERO_CENTRED=zero_centred, HAS_NB=norm_bias is not None, HAS_AMAX=amax is not None,
        BLOCK=block, num_warps=max(4, min(16, block // 512)),
    )
    return out.view(x.shape), (total.view(x.shape) if residual is not None else x)


def fused_activation(x: torch.Tensor, bias: Optional[torch.Tensor], activation: str,
                     gated: bool, amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Megatron's MLP activation on FC1's output ``x`` ``[..., W]`` (+ its bias): ``[..., W / 2]``
    gated (first half activated, times the second), else ``[..., W]``; ``amax``
    (:func:`activation_blocks` floats): each program's largest ``|output|`` is written to it."""
    from tknp_megatron.executor.dense_kernels import ACTIVATIONS, activation_kernel

    width = x.shape[-1]
    n_out = width // 2 if gated else width
    x2 = x.reshape(-1, width)
    out = x2.new_empty(x2.shape[0], n_out)
    block, col_blocks = _act_grid(x2.shape[0], n_out, amax is not None)
    grid = (x2.shape[0], col_blocks)
    assert amax is None or amax.numel() == grid[0] * grid[1]
    activation_kernel[grid](x2, bias if bias is not None else x2, out, amax if amax is not None else x2, n_out,
                            ACT=ACTIVATIONS[activation], GATED=gated, HAS_BIAS=bias is not None,
                            HAS_AMAX=amax is not None, BLOCK=block, num_warps=4 if block == _ACT_BLOCK else 8)
    return out.view(*x.shape[:-1], n_out)


def activation_blocks(x: torch.Tensor, gated: bool) -> int:
    """Programs of :func:`fused_activation` on FC1's output ``x``: rows times column blocks."""
    width = x.shape[-1]
    rows = x.numel() // width
    return rows * _act_grid(rows, width // 2 if gated else width, True)[1]


def _act_grid(rows: int, n_out: int, amax: bool) -> Tuple[int, int]:
    """``(columns per program, column blocks)`` of the activation: 1024 columns, or with an
    amax 4096 where 1024 would write more than :data:`_MAX_PARTIALS` partial maxima (prompts
    of many rows), since every program of the cast that follows reads them all."""
    wide = amax and rows * -(-n_out // _ACT_BLOCK) > _MAX_PARTIALS
    block = 4 * _ACT_BLOCK if wide else _ACT_BLOCK
    return block, -(-n_out // block)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
