"""The root's fused element-wise kernels (``executor/dense_fusion.py``) under TRITON_INTERPRET=1
(CPU), against Megatron's own modules on the same layer: the input norm, the residual add +
pre-MLP norm and the MLP's activation, for RMSNorm + SwiGLU (Llama), zero-centred LayerNorm +
squared ReLU (Nemotron) and LayerNorm + GELU with biases (GPT); the owners' RoPE + K/V append
kernel (``Rope.rotate_and_append``) against Megatron's rotation and the cache write; then a
whole engine with and without them all gives the same greedy tokens. The FP8 input kernels
(``fp8_inputs.py``): the amax each producer takes, and the cast against Transformer Engine's
current scaling as torch computes it (every E4M3 value and the midpoints between them, the
scale's guards); the whole path through TE's GEMMs is tested on a GPU
(``tests/test_fp8_inputs.py``).

TRITON_INTERPRET is read when a kernel is decorated: the kernels module is imported lazily
(first use), and the spawned workers inherit the variable.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from tknp_megatron.launch import spawn  # noqa: E402

CASES = {
    # preset, overrides
    "llama": ("tiny", {}),
    "nemotron": ("tiny-nemotron", {}),
    "gpt-bias-gelu": ("tiny", dict(normalization="LayerNorm", gated=False, activation="gelu",
                                   add_bias_linear=True)),
}


def _preset(case):
    from tknp_megatron.config import Activation, get_preset

    name, overrides = CASES[case]
    overrides = dict(overrides)
    if "activation" in overrides:
        overrides["activation"] = Activation(overrides["activation"])
    return get_preset(name).replace(num_layers=1, **overrides)


def _layer_worker(rank, world, case, dtype):
    import parallel_state as ps
    from tknp_megatron.executor.dense import finish_layer, qkv_projection
    from tknp_megatron.executor.dense_fusion import dense_fusion_for
    from tknp_megatron.models.model import build_stage_model
    from tknp_megatron.models.weights import fill_seeded_

    preset = _preset(case)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model = build_stage_model(preset, [0], pre_process=False, post_process=False, tp=1,
                              params_dtype=dtype, device=torch.device("cpu"))
    fill_seeded_(model, preset, seed=3)
    with torch.no_grad():  # norms away from their default weights, biases non-zero
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3
                p.copy_((p.float() + noise).to(p.dtype))
    fusion = dense_fusion_for(model, torch.device("cpu"), enabled=True)
    block = model.layer(0)
    g = torch.Generator().manual_seed(5)
    rows = 7
    hidden = (torch.randn(rows, 1, preset.hidden_size, generator=g) * 2 + 0.5).to(dtype)
    attn = torch.randn(rows, 1, preset.num_attention_heads * preset.kv_channels, generator=g).to(dtype)
    with torch.no_grad():
        out = dict(
            fusion=fusion,
            qkv=(qkv_projection(block, hidden), qkv_projection(block, hidden, fusion)),
            layer=(finish_layer(block, attn, hidden), finish_layer(block, attn, hidden, fusion)),
        )
    ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_fused_steps_equal_megatrons_modules(case):
    """The kernels round where Megatron's modules round: in fp32 the outputs are Megatron's
    within the sums' order, in bf16 they are Megatron's bit for bit (on this CPU; a GPU's
    exp and rsqrt may move a last fp32 bit)."""
    preset = _preset(case)
    for dtype in (torch.float32, torch.bfloat16):
        out = spawn(_layer_worker, 1, (case, dtype), timeout_s=200)[0]
        fusion = out["fusion"]
        assert fusion is not None and fusion.norms
        assert fusion.activation == preset.activation.value and fusion.gated == preset.gated
        for part in ("qkv", "layer"):
            megatron, fused = out[part]
            assert fused.dtype == dtype and fused.shape == megatron.shape
            if dtype == torch.float32:
                torch.testing.assert_close(fused, megatron, atol=2e-5, rtol=2e-5)
                continue
            assert torch.equal(fused, megatron), (part, (fused != megatron).sum().item())


def test_fusion_is_chosen_per_device_and_flag():
    out = spawn(_choice_worker, 1, (), timeout_s=120)[0]
    assert out == dict(enabled="DenseFusion(norms=True, activation='silu', gated=True, rope=False, fp8_rows=0)",
                       with_rope="DenseFusion(norms=True, activation='silu', gated=True, rope=True, fp8_rows=0)",
                       disabled=None, default=None, no_triton_device=None)


def _choice_worker(rank, world):
    import parallel_state as ps
    from tknp_megatron.executor.dense_fusion import dense_fusion_for
    from tknp_megatron.models.model import build_stage_model

    preset = _preset("llama")
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model = build_stage_model(preset, [0], pre_process=False, post_process=False, tp=1,
                              params_dtype=torch.float32, device=torch.device("cpu"))
    cpu = torch.device("cpu")
    enabled = dense_fusion_for(model, cpu, enabled=True)
    with_rope = dense_fusion_for(model, cpu, enabled=True, rope=True)
    disabled = dense_fusion_for(model, cpu, enabled=False, rope=True)
    default = dense_fusion_for(model, cpu)  # off a GPU only when asked, even under the interpreter
    os.environ["TRITON_INTERPRET"] = "0"  # a CPU without the interpreter: Megatron's modules
    no_triton_device = dense_fusion_for(model, cpu, enabled=True)
    ps.destroy_model_parallel()
    return dict(enabled=repr(enabled), with_rope=repr(with_rope), disabled=disabled, default=default,
                no_triton_device=no_triton_device)


def _engine_worker(rank, world, fused: bool):
    import parallel_state as ps
    from tests.helpers import random_prompts
    from tknp_megatron.config import get_preset
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import Mode, build_engine
    from tknp_megatron.sampling import SamplingParams

    preset = get_preset("tiny")
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=1, token_parallel_size=world)
    config = EngineConfig(kv_tokens_per_node=512, block_size=4, record_logits=True, fused_elementwise=fused,
                          fused_rope=fused)
    engine = build_engine(Mode.TKNP, preset, groups, config, torch.device("cpu"), torch.float32, weights=0)
    prompts = random_prompts(6, 3, 9, seed=11)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    ex = engine.executor
    out = (ex.fusion is not None and ex.attend.fused_rope, [(r.tokens, r.logits) for r in results])
    ps.destroy_model_parallel()
    return out if rank == 0 else None


def test_a_pool_with_fused_kernels_gives_the_same_tokens():
    fused_on, fused = spawn(_engine_worker, 2, (True,), timeout_s=300)[0]
    fused_off, plain = spawn(_engine_worker, 2, (False,), timeout_s=300)[0]
    assert fused_on and not fused_off
    for (tokens_a, logits_a), (tokens_b, logits_b) in zip(fused, plain):
        assert tokens_a == tokens_b
        torch.testing.assert_close(logits_a, logits_b, atol=1e-4, rtol=0)


def test_bench_dense_runs_on_cpu(tmp_path, capsys):
    """``tools/bench_dense.py``'s CPU smoke run: one row per batch, fused (interpreted
    kernels) and not, the fused output within rounding of Megatron's modules, on one rank's
    share of TP 2; bad flags are one line before anything starts."""
    import json
    import subprocess
    import sys

    out = tmp_path / "dense.json"
    cmd = [sys.executable, "-m", "tknp_megatron.tools.bench_dense", "--device", "cpu", "--model", "tiny",
           "--batches", "3", "5", "--reps", "1", "--rank-of-tp", "2", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["fused"], r["batch"]) for r in rows] == [(False, 3), (False, 5), (True, 3), (True, 5)]
    from tknp_megatron.config import get_preset
    from tknp_megatron.tools.bench_dense import main, rank_share

    tiny, share = get_preset("tiny"), rank_share(get_preset("tiny"), 2)
    assert (share.num_attention_heads, share.ffn_hidden_size) == (tiny.num_attention_heads // 2, tiny.ffn_hidden_size // 2)
    for r in rows:
        assert r["layer_us"] > 0 and r["linears_us"] > 0 and r["weight_bytes"] > 0 and r["rank_of_tp"] == 2
        assert r["max_diff_vs_unfused"] <= 1e-5 * max(1.0, r["output_max"])

    for flags, line in ((["--batches", "0"], "--batches 0: must be at least 1"),
                        (["--rank-of-tp", "3"], "--rank-of-tp 3: must divide tiny's")):
        with pytest.raises(SystemExit) as bad:  # the tool's entry point, in this process
            main(cmd[3:-4] + flags)
        assert bad.value.code == 2 and line in capsys.readouterr().err.strip().splitlines()[-1]


ROPE_CASES = {
    # preset case, preset overrides, dtype, rotary_interleaved
    "llama-fp32": ("llama", {}, torch.float32, False),
    "llama-bf16": ("llama", {}, torch.bfloat16, False),
    "gqa4-d24-bf16": ("llama", dict(num_attention_heads=8, kv_channels=24), torch.bfloat16, False),
    "interleaved-bf16": ("llama", {}, torch.bfloat16, True),
    "partial-rotary-bf16": ("nemotron", {}, torch.bfloat16, False),  # rotary_percent 0.5
}


def _rope_worker(rank, world, case):
    from types import SimpleNamespace

    import parallel_state as ps
    from tknp_megatron.attention import AttentionMetadata, get_backend
    from tknp_megatron.executor.owner_attention import OwnerAttention
    from tknp_megatron.executor.rope import Rope
    from tknp_megatron.kv_cache import KVCacheSpec, PagedKVCache
    from tknp_megatron.models.model import build_stage_model

    base, overrides, dtype, interleaved = ROPE_CASES[case]
    preset = _preset(base).replace(**overrides)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model = build_stage_model(preset, [0], pre_process=False, post_process=False, tp=1,
                              params_dtype=dtype, device=torch.device("cpu"))
    model.config.rotary_interleaved = interleaved
    rope = Rope(preset, model.config, torch.device("cpu"))
    heads, kv_heads, d = preset.num_attention_heads, preset.num_query_groups, preset.kv_channels
    # three requests: two decoding (one row each), one prefilling 4 rows; pages of 4 tokens
    q_lens, seq_lens = [1, 4, 1], [9, 6, 14]
    spec = KVCacheSpec(num_layers=1, num_blocks=12, block_size=4, local_kv_heads=kv_heads, head_dim=d,
                       dtype=dtype, max_slots=3, max_blocks_per_seq=4)
    caches = [PagedKVCache(spec, torch.device("cpu")) for _ in range(2)]
    g = torch.Generator().manual_seed(9)
    start = torch.randn(caches[0].buffer.shape, generator=g).to(dtype)
    blocks = [[7, 2, 11], [0, 5], [3, 9, 1, 4]]
    for kv in caches:
        kv.buffer.copy_(start)
        for slot, bl in enumerate(blocks):
            kv.assign(slot, bl)
    positions = torch.tensor([8, 2, 3, 4, 5, 13])
    slots = torch.tensor([0, 1, 1, 1, 1, 2])
    meta = AttentionMetadata.from_lengths(q_lens, seq_lens, caches[0].block_table[:3])
    freqs = rope.freqs(positions)
    inp = SimpleNamespace(freqs=freqs, cos_sin=rope.cos_sin(freqs), meta=meta,
                          slot_mapping=caches[0].slot_mapping(slots, positions))  # the StepInputs it reads
    qkv = (torch.randn(6, (heads + 2 * kv_heads) * d, generator=g) * 3).to(dtype)
    outs = []
    for kv, fused in zip(caches, (False, True)):
        attend = OwnerAttention(kv, rope, get_backend("torch"), heads, kv_heads, d, fused_rope=fused)
        outs.append(attend(0, qkv, inp))
    ps.destroy_model_parallel()
    return outs, [kv.buffer for kv in caches], start


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_fused_rope_and_append_equal_megatrons_rotation_and_the_cache_write(case):
    """One kernel rotates the owner's query and key heads and appends K/V, for a decode and a
    prefill request on scattered pages: its attention output and the cache afterwards equal
    Megatron's ``apply_rotary_pos_emb`` followed by the cache's ``write``, bit for bit (in
    bf16 too: the kernel rounds where Megatron's rotation rounds)."""
    (megatron, fused), (cache_megatron, cache_fused), start = spawn(_rope_worker, 1, (case,), timeout_s=120)[0]
    assert torch.equal(cache_fused, cache_megatron)
    assert not torch.equal(cache_fused, start)  # the rows were written
    assert fused.dtype == megatron.dtype and torch.equal(fused, megatron)


# ---------------------------------------------------------------- FP8 inputs: amax and cast


def _te_scale(amax: float, max_fp8=448.0, epsilon=0.0, pow2=False) -> torch.Tensor:
    """Transformer Engine's ``compute_scale_from_amax`` in fp32 (torch's division rounds to nearest)."""
    a = torch.tensor(amax, dtype=torch.float32)
    if a < epsilon:
        a = torch.tensor(epsilon, dtype=torch.float32)
    if torch.isinf(a) or a == 0 or torch.isnan(a):
        return torch.tensor(1.0)
    scale = torch.tensor(max_fp8, dtype=torch.float32) / a
    if torch.isinf(scale):
        scale = torch.tensor(torch.finfo(torch.float32).max)
    if pow2:
        scale = (scale.view(torch.int32) & -8388608).view(torch.float32)  # 0xFF800000
    return scale


def _cast(x: torch.Tensor, amax_in: float, **scaling):
    """The cast kernel on ``x`` with partial maxima whose largest is ``amax_in``, in two
    programs of 64-element blocks (each looping over its blocks): (bits, scale_inv). NaN
    partials are passed over, as TE's amax (``fmaxf``) passes over NaN values: all NaN is an
    amax of 0."""
    from tknp_megatron.executor.dense_kernels import quantize_kernel

    partials = torch.tensor([0.5 * amax_in, amax_in, 0.0], dtype=torch.float32)
    out = torch.empty(x.shape, dtype=torch.uint8)
    scale_inv = torch.empty(1)
    quantize_kernel[(2,)](x, partials, 3, out, scale_inv, x.numel(), scaling.get("max_fp8", 448.0),
                          scaling.get("epsilon", 0.0), POW2=scaling.get("pow2", False), BITS=True, BLOCK=64,
                          PBLOCK=2)
    return out, scale_inv


def test_cast_writes_every_e4m3_value_and_rounds_to_nearest_even():
    """At scale 1 (amax 448) every finite E4M3 value comes back as its own bits, the points
    between neighbours round to the even one, values past 448 saturate, NaN stays NaN, as
    torch's (and a GPU's) conversion does; the interpreter's own conversion would not."""
    codes = torch.arange(0, 127, dtype=torch.uint8)  # +0 .. 448 (0x7F is NaN)
    values = codes.view(torch.float8_e4m3fn).float()
    mids = (values[:-1] + values[1:]) / 2
    x = torch.cat([values, -values, mids, -mids, torch.tensor([449.0, 463.9, 464.0, 1e6, float("inf"),
                                                               -float("inf"), 2.0 ** -10, 2.0 ** -12])])
    bits, scale_inv = _cast(x, 448.0)
    expected = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(bits[: 2 * len(values)], expected[: 2 * len(values)])
    assert torch.equal(bits, expected), x[bits != expected]
    nan_bits = _cast(torch.tensor([float("nan"), 1.0]), 448.0)[0]
    assert nan_bits[0].item() & 0x7F == 0x7F and nan_bits[1].item() == 0x38
    assert scale_inv.item() == 1.0


@pytest.mark.parametrize("amax_in,scaling", [
    (3.7, {}), (1e-3, {}), (0.0, {}), (float("inf"), {}), (float("nan"), {}), (1e-40, {}),
    (3.7, dict(pow2=True)), (1e-3, dict(epsilon=0.5)), (900.0, dict(max_fp8=57344.0)),
])
def test_cast_scales_as_transformer_engine(amax_in, scaling):
    """TE's scale from the amax (and its guards: a zero, infinite or NaN amax scales by 1,
    an overflowing quotient by the largest float, a power of two on request, the epsilon
    floor), its reciprocal as the scale-inverse, and the values cast with it."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 100, generator=g) * 2).to(torch.bfloat16)
    bits, scale_inv = _cast(x, amax_in, **scaling)
    scale = _te_scale(amax_in, **{k: v for k, v in scaling.items()})
    assert scale_inv.item() == (1.0 / scale).item()
    if scaling.get("max_fp8", 448.0) == 448.0:
        expected = (x.float() * scale).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(bits, expected)


def test_producers_write_the_partial_maxima_of_what_they_write():
    """The norm (with the residual add before it) writes each row's largest magnitude of its
    fp32 output before rounding, as TE's norm kernel takes it; the activation and the amax
    kernel each program's largest magnitude of the tensor they write."""
    from tknp_megatron.executor.dense_fusion import activation_blocks, fused_activation, launch_add_norm
    from tknp_megatron.executor.dense_kernels import amax_kernel

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 1, 300, generator=g) * 3).to(torch.bfloat16)
    res = torch.randn(5, 1, 300, generator=g).to(torch.bfloat16)
    w = (torch.rand(300, generator=g) + 0.5).to(torch.bfloat16)
    rows = torch.full((5,), float("nan"))
    normed, total = launch_add_norm(x, res, None, w, None, 1e-5, rms=True, zero_centred=False, amax=rows)
    h = (x.float() + res.float()).to(torch.bfloat16).float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
    torch.testing.assert_close(rows, y.abs().amax(-1).flatten(), rtol=1e-6, atol=0)
    assert torch.equal(total, h.to(torch.bfloat16)) and torch.equal(normed, y.to(torch.bfloat16))

    fc1 = (torch.randn(5, 1, 2 * 1500, generator=g) * 4).to(torch.bfloat16)
    blocks = torch.full((activation_blocks(fc1, True),), float("nan"))
    assert blocks.numel() == 5 * 2  # 1500 columns in blocks of 1024
    out = fused_activation(fc1, None, "silu", True, amax=blocks)
    by_block = torch.nn.functional.pad(out.float().abs().reshape(5, 1500), (0, 548)).reshape(5, 2, 1024).amax(-1)
    assert torch.equal(blocks, by_block.flatten())

    many = torch.randn(600, 1, 2 * 8000, generator=g).to(torch.bfloat16)  # rows of a prompt: wider blocks
    wide = torch.full((activation_blocks(many, True),), float("nan"))
    assert wide.numel() == 600 * 2  # 8000 columns in blocks of 4096, not 8 of 1024
    out = fused_activation(many, None, "silu", True, amax=wide)
    by_block = torch.nn.functional.pad(out.float().abs().reshape(600, 8000), (0, 192)).reshape(600, 2, 4096).amax(-1)
    assert torch.equal(wide, by_block.flatten())

    flat = (torch.randn(7000, generator=g) * 5).to(torch.bfloat16)
    partials = torch.full((7,), float("nan"))
    amax_kernel[(7,)](flat, partials, flat.numel(), BLOCK=1024)
    assert torch.equal(partials, torch.nn.functional.pad(flat.float().abs(), (0, 168)).reshape(7, 1024).amax(-1))
