"""FP8 GEMM inputs quantized by the kernels that make them (``executor/fp8_inputs.py``), on a
GPU with Transformer Engine: the cast gives TE's quantizer's bits and scale (and its
conversion on the bits, the CPU interpreter's, the GPU's own); the output projection on an
input quantized here gives TE's module's output bit for bit; the QKV projection and the rest
of a Llama layer with FP8-stored weights (Megatron's ``tensorwise`` recipe) are as close to
the same layer in BF16 as TE's own FP8 modules are. The kernels' arithmetic is tested on CPU
under Triton's interpreter (``tests/test_dense_fusion.py``); TE and its FP8 GEMMs need a GPU.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("transformer_engine")),
    reason="FP8 GEMMs need a GPU and Transformer Engine")


def _layers(rows_list):
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer
    import transformer_engine_torch as tex

    import parallel_state as ps
    from tknp_megatron.config import get_preset
    from tknp_megatron.engine.factory import load_weights
    from tknp_megatron.executor import fp8_inputs as f8
    from tknp_megatron.executor.dense import finish_layer, qkv_projection
    from tknp_megatron.executor.dense_fusion import dense_fusion_for
    from tknp_megatron.models.model import build_stage_model
    from tknp_megatron.models.precision import dense_autocast
    from tknp_megatron.tools.check_fp8 import FORMATS

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if torch.cuda.get_device_capability() < (8, 9):
        return None
    preset = get_preset("llama3.1-8b").replace(num_layers=1)
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model = build_stage_model(preset, [0], pre_process=False, post_process=False, tp=1,
                              params_dtype=torch.bfloat16, device=device, dense=FORMATS["fp8"])
    load_weights(model, preset, 0)
    reference = build_stage_model(preset, [0], pre_process=False, post_process=False, tp=1,
                                  params_dtype=torch.bfloat16, device=device, dense=FORMATS["te"])
    load_weights(reference, preset, 0)  # the same weights in BF16: what FP8 approximates
    fusion = dense_fusion_for(model, device, enabled=True)
    block, ref = model.layer(0), reference.layer(0)
    out = dict(fusion=repr(fusion), usable=f8.fp8_inputs_usable(block), interpreted=f8._INTERPRETED, layers={})
    g = torch.Generator(device=device).manual_seed(1)
    inputs = {rows: (torch.randn(rows, 1, preset.hidden_size, device=device, generator=g).to(torch.bfloat16),
                     torch.randn(rows, 1, preset.num_attention_heads * preset.kv_channels, device=device,
                                 generator=g).to(torch.bfloat16)) for rows in rows_list}
    with torch.no_grad():  # outside TE's FP8 autocast: BF16 GEMMs
        bf16 = {rows: (qkv_projection(ref, h).float(), finish_layer(ref, a, h).float())
                for rows, (h, a) in inputs.items()}
    with torch.no_grad(), dense_autocast(model.config, groups.tp_group):
        x = torch.randn(64, 4096, device=device, generator=g).to(torch.bfloat16) * 3
        ours = f8.quantize(x, f8.Fp8Scaling.current())
        theirs = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=device)(x)
        out["cast"] = (torch.equal(ours._data, theirs._data), ours._scale_inv.item(), theirs._scale_inv.item())
        out["bits"] = _conversions_agree(device)
        for rows, (hidden, attn) in inputs.items():
            parts = []
            for part, args, want in ((qkv_projection, (hidden,), bf16[rows][0]),
                                     (finish_layer, (attn, hidden), bf16[rows][1])):
                te, mine = part(block, *args).float(), part(block, *args, fusion).float()
                parts.append(dict(te=_error(te, want), ours=_error(mine, want), apart=_error(mine, te)))
            out["layers"][rows] = parts
            if rows % 16 == 0:  # the attention's output: an amax both take exactly, so TE's GEMM output
                proj = block.self_attention.linear_proj
                out["layers"][rows].append(torch.equal(f8.row_linear(proj, f8.quantize(attn, f8.Fp8Scaling.current())),
                                                       proj(attn)[0]))
    ps.destroy_model_parallel()
    return out


def _error(x: torch.Tensor, ref: torch.Tensor):
    """(mean |x - ref| / mean |ref|, max |x - ref| / max |ref|)."""
    d = (x - ref).abs()
    return d.mean().item() / ref.abs().mean().item(), d.max().item() / ref.abs().max().item()


def _conversions_agree(device) -> bool:
    """The cast kernel's conversion on the bits (the CPU interpreter's path) gives the GPU's
    own conversion's bits: every E4M3 value, the midpoints between them, beyond 448, NaN."""
    from tknp_megatron.executor.dense_kernels import quantize_kernel

    values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (values[:-1] + values[1:]) / 2
    x = torch.cat([values, -values, mids, -mids, torch.tensor([449.0, 464.0, 1e6, float("inf"), float("nan"),
                                                               -0.0, 2.0 ** -12])]).to(device)
    outs = []
    for bits in (True, False):
        amax = torch.tensor([448.0], device=device)
        out = torch.empty(x.shape, dtype=torch.uint8, device=device)
        quantize_kernel[(1,)](x, amax, 1, out, torch.empty(1, device=device), x.numel(), 448.0, 0.0,
                              POW2=False, BITS=bits, BLOCK=1024, PBLOCK=16)
        outs.append(out)
    return torch.equal(outs[0], outs[1])


@pytest.fixture
def compiled_kernels(monkeypatch):
    """The kernels compiled for the GPU, not run by Triton's interpreter: the suite's CPU test
    files set TRITON_INTERPRET=1 as pytest collects them, and the kernels' modules read it
    when they are imported, so this test imports them afresh without it (and puts the
    modules it found back after)."""
    import tknp_megatron.executor as executor

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for name in ("fp8_inputs", "dense_kernels"):
        monkeypatch.delitem(sys.modules, f"tknp_megatron.executor.{name}", raising=False)
        monkeypatch.delattr(executor, name, raising=False)


def test_fp8_layer_with_inputs_quantized_here_gives_te_modules_output(compiled_kernels):
    # in this process: a pool's processes start from a forkserver, which with TE installed has
    # CUDA started by importing it, and a forked child cannot start CUDA again
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out = _layers([16, 64, 7])
    finally:
        dist.destroy_process_group()
    if out is None:
        pytest.skip("FP8 GEMMs need compute capability 8.9 or more")
    assert out["usable"] is None and "fp8_rows=16" in out["fusion"] and not out["interpreted"]
    same_bits, ours_inv, te_inv = out["cast"]
    assert same_bits and ours_inv == te_inv  # an amax both take exactly: TE's bits
    assert out["bits"]
    for rows, parts in out["layers"].items():
        if rows % 16 == 0:
            assert parts.pop() is True, out  # the output projection on an input quantized here: TE's output
        for part in parts:
            # the norms' amax may differ from TE's by an ulp (the order of their sums), so a
            # GEMM's input may round to the neighbouring FP8 values: as far from the layer in
            # BF16 as TE's own FP8 is; 7 rows are not aligned: TE's modules run them, exactly
            (te_mean, te_max), (ours_mean, ours_max) = part["te"], part["ours"]
            assert ours_mean <= 1.2 * te_mean and ours_max <= 1.5 * te_max, (rows, out)
            if rows % 16:
                assert part["apart"] == (0.0, 0.0), (rows, out)
