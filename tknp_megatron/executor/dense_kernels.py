"""Triton kernels for the element-wise work around the root's GEMMs (see ``dense_fusion.py``).

Imported on first use, so ``TRITON_INTERPRET=1`` set before that runs them on CPU (tests).
Every kernel reads its inputs in their own dtype and computes in fp32, rounding to the
activations' dtype wherever Megatron's modules round (after a bias add, after a residual add,
after the activation before the gate's product, the output), so that its results are those
of the modules it stands in for, not merely close to them. Rounding to bf16 is done on the
bits (round to nearest even), as a GPU's conversion does, so Triton's CPU interpreter, whose
conversion truncates, gives the GPU's results too. Rows are the batch's tokens, one program
per row (norms) or per row and column block (activations).

With FP8 GEMMs (Transformer Engine's per-tensor current scaling) the norm and activation
kernels also write the largest magnitude of what each program wrote (``AMAX``, one float
per program), and :func:`quantize_kernel` takes the tensor's amax from those partial maxima
and casts it to E4M3 with TE's scale (``fp8_inputs.py``): two kernels where TE runs three or
four, with no atomics and no state kept between calls.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tknp_megatron import triton_interpreter

__all__ = ["add_norm_kernel", "activation_kernel", "amax_kernel", "quantize_kernel", "ACTIVATIONS"]

triton_interpreter.install()  # Triton 3.6's CPU interpreter with a recent NumPy (see triton_interpreter)

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
def add_norm_kernel(X, BIAS, RES, SUM, W, NB, OUT, AMAX, n_cols, eps,
                    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RMS: tl.constexpr,
                    ZERO_CENTRED: tl.constexpr, HAS_NB: tl.constexpr, HAS_AMAX: tl.constexpr,
                    BLOCK: tl.constexpr):
    """One row: ``h = x (+ bias) (+ residual)``, each add rounded to the activations' dtype
    and stored to SUM when there is a residual (as Megatron's bias-dropout-add stores it),
    then ``OUT = norm(h)``, rounded once (as torch's RMSNorm and LayerNorm round).

    RMSNorm: ``h * rsqrt(mean(h^2) + eps) * g``; LayerNorm: ``(h - mean) * rsqrt(var + eps)
    * g (+ nb)``; ``g = w``, or with zero-centred gamma ``w + 1`` rounded to ``w``'s dtype
    (as the zero-centred norm module computes it). The row is read in BLOCK-wide chunks, so
    any width fits; a few KiB per row stay in L2 between the passes.

    HAS_AMAX: ``AMAX[row]`` is the row's largest ``|norm(h)|`` before rounding, as TE's norm
    kernel takes it for its FP8 cast.
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
    top = tl.zeros([BLOCK], dtype=tl.float32)
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
        if HAS_AMAX:
            top = tl.maximum(top, tl.where(mask, tl.abs(y), 0.0))
        tl.store(OUT + base + cols, _round(y, OUT.dtype.element_ty).to(OUT.dtype.element_ty), mask=mask)
    if HAS_AMAX:
        tl.store(AMAX + row, tl.max(top, axis=0))


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
def activation_kernel(X, BIAS, OUT, AMAX, n_out, ACT: tl.constexpr, GATED: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_AMAX: tl.constexpr, BLOCK: tl.constexpr):
    """``OUT[r] = act(x[r, :n] (+ bias)) (* (x[r, n:] (+ bias)) if GATED)``, ``n = n_out``,
    rounded as Megatron's MLP rounds: after the bias add, after the activation, after the
    gate's product.

    Gated: ``X`` is ``[rows, 2 n_out]``, Megatron's fused FC1 output (first half through
    the activation, second half the gate), e.g. SwiGLU = silu(x1) * x2.

    HAS_AMAX: ``AMAX[row * blocks + block]`` is the block's largest ``|OUT|`` (as stored: TE
    takes the amax of the tensor it casts).
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
    if HAS_AMAX:
        tl.store(AMAX + row * tl.num_programs(1) + tl.program_id(1), tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0))


@triton.jit(do_not_specialize=["n"])
def amax_kernel(X, AMAX, n, BLOCK: tl.constexpr):
    """``AMAX[program] = max |X[i]|`` over the program's ``BLOCK`` of the ``n`` elements."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(AMAX + pid, tl.max(tl.abs(x), axis=0))


@triton.jit(do_not_specialize=["n", "n_partials", "max_fp8", "epsilon"])
def quantize_kernel(X, AMAX, n_partials, OUT, SCALE_INV, n, max_fp8, epsilon, POW2: tl.constexpr,
                    BITS: tl.constexpr, BLOCK: tl.constexpr, PBLOCK: tl.constexpr):
    """``OUT = e4m3(X * scale)`` (the bits, uint8), with Transformer Engine's per-tensor
    current scaling: ``amax`` the largest of the producer's ``n_partials`` partial maxima
    ``AMAX``, ``scale = max_fp8 / max(amax, epsilon)`` rounded to nearest (1 where the amax is
    0, infinite or NaN; the largest float where the quotient overflows; its exponent alone
    with POW2), ``SCALE_INV = 1 / scale``, each value rounded to nearest even and saturated to
    the finite range, as TE's cast kernel rounds: by the GPU's conversion, or with BITS on
    the bits (:func:`_e4m3_bits`, for Triton's CPU interpreter). Each program reads the
    partial maxima (a few KiB, from L2) and casts every ``num_programs``-th block of ``BLOCK``.
    """
    pid = tl.program_id(0)
    top = tl.zeros([PBLOCK], dtype=tl.float32)
    for p0 in range(0, n_partials, PBLOCK):
        p = p0 + tl.arange(0, PBLOCK)
        top = tl.maximum(top, tl.load(AMAX + p, mask=p < n_partials, other=0.0))
    amax = tl.max(top, axis=0)
    amax = tl.where(amax < epsilon, epsilon, amax)  # a NaN stays NaN, as in TE
    bad = (amax == 0.0) | (amax != amax) | (amax == float("inf"))
    scale = tl.math.div_rn(max_fp8, tl.where(bad, 1.0, amax))
    scale = tl.where(scale == float("inf"), 3.4028234663852886e38, scale)
    if POW2:
        scale = (scale.to(tl.uint32, bitcast=True) & 0xFF800000).to(tl.float32, bitcast=True)
    scale = tl.where(bad, 1.0, scale)
    if pid == 0:
        tl.store(SCALE_INV, tl.math.div_rn(1.0, scale))
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < n
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if BITS:
            tl.store(OUT + offs, _e4m3_bits(x * scale), mask=mask)
        else:
            tl.store(OUT + offs, (x * scale).to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)


@triton.jit
def _e4m3_bits(v):
    """fp32 ``v`` as FP8 E4M3 bits (uint8): round to nearest even, beyond 448 saturated to
    448, NaN to NaN, subnormals kept. Done on the bits, as ``_round`` does for bf16, so the
    CPU interpreter (whose conversion neither saturates nor keeps subnormals) matches a GPU's
    ``cvt.rn.satfinite``."""
    raw = v.to(tl.uint32, bitcast=True)
    sign = ((raw >> 24) & 0x80).to(tl.int32)  # -0.0 keeps its sign, as the conversion does
    nan = (raw & 0x7FFFFFFF) > 0x7F800000
    bits = tl.where(nan, 0, raw & 0x7FFFFFFF)  # NaN set apart: its code is chosen below
    a = bits.to(tl.float32, bitcast=True)
    # normal: 3 mantissa bits of fp32's 23, rounded to nearest even; exponent bias 127 -> 7
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20
    normal = rounded.to(tl.int32) - (120 << 3)
    # subnormal (below 2^-6): multiples of 2^-9, rounded to nearest even by the 1.5 * 2^23 trick
    sub = ((a * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, tl.minimum(normal, 0x7E))
    code = tl.where(a >= 448.0, 0x7E, code)
    code = tl.where(nan, 0x7F, code)
    return (code | sign).to(tl.uint8)
