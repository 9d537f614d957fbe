"""HF Llama / Nemotron (random, tiny, safetensors) -> Megatron dist checkpoint -> GPTModel.

The converted checkpoint is loaded by :func:`load_megatron_checkpoint` into the TP=1
reference ``GPTModel`` (Megatron's own layers, SDPA core-attention shim) and its logits on a
random sequence must equal ``transformers``' fp32 CPU logits within 1e-4 -- Llama with and
without llama3 RoPE scaling, and Nemotron (LayerNorm1p with biases, squared-ReLU MLP,
partial RoPE). This also checks that HF's q/k rows need no permutation.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers import convert_and_run, make_hf_llama, make_hf_nemotron
from tknp_megatron.launch import spawn


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192}],
                         ids=["plain", "llama3"])
def test_hf_llama_logits_match(tmp_path, scaling):
    pytest.importorskip("transformers")
    hf_dir, out_dir = tmp_path / "hf", tmp_path / "mcore"
    ids, expected = make_hf_llama(hf_dir, scaling)
    logits, preset = spawn(convert_and_run, 1, (str(hf_dir), str(out_dir), ids), timeout_s=120)[0]
    assert preset.gpt.rope_scaling == (scaling is not None)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_hf_config_preset():
    from tknp_megatron.models.hf_convert import preset_from_hf_config

    p = preset_from_hf_config({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "intermediate_size": 160,
                               "vocab_size": 256, "rope_theta": 500000.0, "rms_norm_eps": 1e-6,
                               "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert (p.num_query_groups, p.kv_channels, p.gpt.rotary_base) == (2, 16, 500000)
    assert p.gpt.rope_scaling and p.gpt.rope_scaling_factor == 8.0
    with pytest.raises(ValueError, match="yarn"):
        preset_from_hf_config({"rope_scaling": {"rope_type": "yarn"}, "num_attention_heads": 4})


def test_hf_nemotron_logits_match(tmp_path):
    pytest.importorskip("transformers")
    hf_dir, out_dir = tmp_path / "hf", tmp_path / "mcore"
    ids, expected = make_hf_nemotron(hf_dir)
    logits, preset = spawn(convert_and_run, 1, (str(hf_dir), str(out_dir), ids), timeout_s=120)[0]
    assert (preset.gated, preset.activation.value, preset.normalization) == (
        False, "squared_relu", "LayerNorm")
    assert preset.zero_centered_gamma and preset.gpt.rotary_percent == 0.5
    assert not preset.gpt.share_embeddings_and_output_weights
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


_NEMOTRON = {"model_type": "nemotron", "num_hidden_layers": 2, "hidden_size": 64,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "intermediate_size": 192, "vocab_size": 512, "norm_eps": 1e-6,
             "max_position_embeddings": 2048}


def test_hf_nemotron_config_preset():
    from tknp_megatron.models.hf_convert import preset_from_hf_config

    # transformers 5.x layout (rope_parameters) and 4.x layout (top-level fields)
    new = preset_from_hf_config({**_NEMOTRON, "rope_parameters": {
        "rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.25}})
    old = preset_from_hf_config({**_NEMOTRON, "rope_theta": 20000.0,
                                 "partial_rotary_factor": 0.25, "rope_scaling": None})
    assert new == old
    assert (new.num_layers, new.num_query_groups, new.kv_channels, new.ffn_hidden_size) == (
        2, 2, 16, 192)
    assert (new.gpt.rotary_percent, new.gpt.rotary_base, new.layernorm_epsilon) == (
        0.25, 20000, 1e-6)
    assert (new.gpt.vocab_size, new.gpt.max_sequence_length) == (512, 2048)
    # HF's default partial_rotary_factor is 0.5
    assert preset_from_hf_config(_NEMOTRON).gpt.rotary_percent == 0.5


@pytest.mark.parametrize("field,value", [
    ("attention_bias", True),
    ("mlp_bias", True),
    ("hidden_act", "gelu"),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    ("model_type", "gemma"),
])
def test_hf_config_unsupported_field(field, value):
    from tknp_megatron.models.hf_convert import preset_from_hf_config

    with pytest.raises(ValueError, match=field):
        preset_from_hf_config({**_NEMOTRON, field: value})


_LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 160, "vocab_size": 256}


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu_pytorch_tanh"}, "llama hidden_act 'gelu_pytorch_tanh' unsupported (silu, swish, gelu)"),
    ({"rope_theta": 20.9}, "llama rope_theta 20.9: must be a positive whole number"),
    ({"intermediate_size": None}, "config.json intermediate_size None: must be a positive integer"),
    ({"num_attention_heads": "4"}, "config.json num_attention_heads '4': must be a positive integer"),
    ({"head_dim": 15}, "RoPE rotates 15 of the 15 channels of a head"),
    ({"rms_norm_eps": "1e-5"}, "config.json rms_norm_eps '1e-5': must be a number > 0"),
    ({"rms_norm_eps": 0}, "config.json rms_norm_eps 0: must be a number > 0"),
    ({"rope_scaling": "none"}, "config.json rope_scaling 'none': must be an object (or null)"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 0}}, "config.json rope_scaling factor 0: must be a number >= 1"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "eight"}}, "rope_scaling factor 'eight': must be a number >= 1"),
    ({"attention_bias": True}, "llama attention_bias True unsupported (Llama's layers have no such biases; Qwen2"),
    ({"model_type": "mistral", "mlp_bias": 1}, "mistral mlp_bias 1 unsupported"),
    ({"model_type": "qwen3", "attention_bias": True}, "qwen3 attention_bias True unsupported"),
    ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]},
     "qwen3 layer_types with 'sliding_attention' unsupported (full_attention only)"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "qwen2 use_sliding_window=True unsupported"),
], ids=["tanh_gelu", "fractional_theta", "null_key", "string_heads", "odd_head_dim", "string_eps", "zero_eps",
        "string_rope_scaling", "llama3_factor_0", "llama3_factor_text", "attention_bias", "mlp_bias",
        "qwen3_attention_bias", "sliding_layer_types", "sliding_window"])
def test_hf_llama_config_refused_by_name(change, message):
    from tknp_megatron.models.hf_convert import preset_from_hf_config

    assert preset_from_hf_config(_LLAMA).activation.value == "silu"
    qwen3 = preset_from_hf_config({**_LLAMA, "model_type": "qwen3", "head_dim": 32,
                                   "layer_types": ["full_attention"] * 2})
    assert qwen3.qk_layernorm and qwen3.kv_channels == 32 and not preset_from_hf_config(_LLAMA).qk_layernorm
    assert preset_from_hf_config({**_LLAMA, "hidden_act": "gelu"}).activation.value == "gelu"
    with pytest.raises(ValueError, match=re.escape(message)):
        preset_from_hf_config({**_LLAMA, **change})


@pytest.mark.parametrize("change, message", [
    ({"norm_eps": "x"}, "config.json norm_eps 'x': must be a number > 0"),
    ({"partial_rotary_factor": "half"}, "config.json partial_rotary_factor 'half': must be a number > 0"),
    ({"rope_scaling": [1]}, "config.json rope_scaling [1]: must be an object (or null)"),
])
def test_hf_nemotron_config_refused_by_name(change, message):
    from tknp_megatron.models.hf_convert import preset_from_hf_config

    assert preset_from_hf_config({**_NEMOTRON, "norm_eps": None}).layernorm_epsilon == 1e-5
    with pytest.raises(ValueError, match=re.escape(message)):
        preset_from_hf_config({**_NEMOTRON, **change})


def test_hf_config_lacking_a_key_says_so():
    from tknp_megatron.models.hf_convert import preset_from_hf_config

    cfg = {k: v for k, v in _LLAMA.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match=re.escape("config.json lacks required keys ['intermediate_size']")):
        preset_from_hf_config(cfg)

