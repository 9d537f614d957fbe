"""Triton kernels for the element-wise work around the root's GEMMs (see ``dense_fusion.py``).

Imported on first use, so ``TRITON_INTERPRET=1`` set before that runs them on CPU (tests).
Every kernel reads its inputs in their own dtype and computes in fp32, rounding to the
activations' dtype wherever Megatron's modules round (after a bias add, after a residual add,
after the activation before the gate's product, the output), so that its results are those
of the modules it stands in for, not merely close to them. Rounding to bf16 is done on the
bits (round to nearest even), as a GPU's conversion does, so Triton's CPU interpreter, whose
conversion truncates, gives the GPU's results too. Rows are the batch's tokens, one program
per row (norms) or per row and column block (activations).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["add_norm_kernel", "activation_kernel", "ACTIVATIONS"]

ACTIVATIONS = {"silu": 0, "gelu": 1, "squared_relu": 2}


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (to nearest even), returned as fp32."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit(do_not_specialize=["n_cols", "eps"])
def add_norm_kernel(X, BIAS, RES, SUM, W, NB, OUT, n_cols, eps,
                    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RMS: tl.constexpr,
                    ZERO_CENTRED: tl.constexpr, HAS_NB: tl.constexpr, BLOCK: tl.constexpr):
    """One row: ``h = x (+ bias) (+ residual)``, each add rounded to the activations' dtype
    and stored to SUM when there is a residual (as Megatron's bias-dropout-add stores it),
    then ``OUT = norm(h)``, rounded once (as torch's RMSNorm and LayerNorm round).

    RMSNorm: ``h * rsqrt(mean(h^2) + eps) * g``; LayerNorm: ``(h - mean) * rsqrt(var + eps)
    * g (+ nb)``; ``g = w``, or with zero-centred gamma ``w + 1`` rounded to ``w``'s dtype
    (as the zero-centred norm module computes it). The row is read in BLOCK-wide chunks, so
    any width fits; a few KiB per row stay in L2 between the passes.
    """
    row = tl.program_id(0).to(tl.int64)
    base = row * n_cols
    DT: tl.constexpr = X.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        h = _first_pass_h(X, BIAS, RES, base, cols, mask, DT, HAS_BIAS, HAS_RES)
        if HAS_RES:
            tl.store(SUM + base + cols, h.to(SUM.dtype.element_ty), mask=mask)
        if RMS:
            acc += h * h
        else:
            acc += h
    mean = 0.0
    if RMS:
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n_cols + eps)
    else:
        mean = tl.sum(acc, axis=0) / n_cols
        var = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            h = _reload(X, BIAS, SUM, base, cols, mask, DT, HAS_BIAS, HAS_RES)
            d = tl.where(mask, h - mean, 0.0)
            var += d * d
        rstd = 1.0 / tl.sqrt(tl.sum(var, axis=0) / n_cols + eps)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        h = _reload(X, BIAS, SUM, base, cols, mask, DT, HAS_BIAS, HAS_RES)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if ZERO_CENTRED:
            w = _round(w + 1.0, W.dtype.element_ty)
        y = (h - mean) * rstd * w
        if HAS_NB:
            y += tl.load(NB + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + base + cols, _round(y, OUT.dtype.element_ty).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _first_pass_h(X, BIAS, RES, base, cols, mask, DT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HAS_RES: tl.constexpr):
    """``x (+ bias) (+ residual)``, each add rounded to ``DT``."""
    h = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h = _round(h + tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32), DT)
    if HAS_RES:
        h = _round(h + tl.load(RES + base + cols, mask=mask, other=0.0).to(tl.float32), DT)
    return h


@triton.jit
def _reload(X, BIAS, SUM, base, cols, mask, DT: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_RES: tl.constexpr):
    """``h`` of the first pass again: the stored sum, or ``x (+ bias)``."""
    if HAS_RES:
        h = tl.load(SUM + base + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        h = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            h = _round(h + tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32), DT)
    return h


@triton.jit(do_not_specialize=["n_out"])
def activation_kernel(X, BIAS, OUT, n_out, ACT: tl.constexpr, GATED: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``OUT[r] = act(x[r, :n] (+ bias)) (* (x[r, n:] (+ bias)) if GATED)``, ``n = n_out``,
    rounded as Megatron's MLP rounds: after the bias add, after the activation, after the
    gate's product.

    Gated: ``X`` is ``[rows, 2 n_out]``, Megatron's fused FC1 output (first half through
    the activation, second half the gate), e.g. SwiGLU = silu(x1) * x2.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_out
    DT: tl.constexpr = OUT.dtype.element_ty
    width = 2 * n_out if GATED else n_out
    a = tl.load(X + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a = _round(a + tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32), DT)
    if ACT == 0:
        y = a / (1.0 + tl.exp(-a))
    elif ACT == 1:
        y = 0.5 * a * (1.0 + tl.erf(a * 0.7071067811865476))
    else:
        r = tl.maximum(a, 0.0)
        y = r * r
    y = _round(y, DT)
    if GATED:
        b = tl.load(X + row * width + n_out + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = _round(b + tl.load(BIAS + n_out + cols, mask=mask, other=0.0).to(tl.float32), DT)
        y = _round(y * b, DT)
    tl.store(OUT + row * n_out + cols, y.to(DT), mask=mask)
