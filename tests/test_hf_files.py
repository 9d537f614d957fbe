"""A Hugging Face folder's weight files checked from their headers before anything spawns:
a damaged or mismatched folder is one line naming the file, the tensor and the shape."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from tests.helpers import make_hf_llama
from tknp_megatron.models.source import SourceError, resolve_source

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny saved Llama (3 layers, GQA 4/2, hidden 64, MLP 160, vocab 256, untied)."""
    folder = tmp_path_factory.mktemp("hf") / "llama"
    make_hf_llama(folder, None)
    return folder


def _tensors(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _variant(llama, tmp_path, tensors=None, config=None):
    """A copy of ``llama`` with its tensors and/or config.json changed."""
    from safetensors.torch import save_file

    folder = tmp_path / "variant"
    shutil.copytree(llama, folder)
    if tensors is not None:
        save_file(tensors, str(folder / "model.safetensors"))
    if config is not None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(config)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _refused(folder, message):
    with pytest.raises(SourceError) as err:
        resolve_source(hf=str(folder))
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"--hf {folder}: "), text
    assert re.search(message, text), text


def test_the_saved_folder_passes(llama):
    assert resolve_source(hf=str(llama)).preset.num_layers == 3


def test_a_tensor_of_another_shape(llama, tmp_path):
    t = _tensors(llama)
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"][:100].clone()
    _refused(_variant(llama, tmp_path, t), re.escape(
        "model.safetensors: model.layers.1.mlp.up_proj.weight has shape [100, 64], the config implies [160, 64]"))


def test_an_embedding_with_more_rows_than_the_vocabulary(llama, tmp_path):
    t = _tensors(llama)
    t["model.embed_tokens.weight"] = torch.zeros(320, 64)
    _refused(_variant(llama, tmp_path, t), re.escape("model.embed_tokens.weight has shape [320, 64]"))


def test_a_missing_tensor_and_a_layer_the_weights_lack(llama, tmp_path):
    t = _tensors(llama)
    del t["model.layers.1.self_attn.k_proj.weight"]
    _refused(_variant(llama, tmp_path, t), "no tensor model.layers.1.self_attn.k_proj.weight in its weight files$")
    shutil.rmtree(tmp_path / "variant")
    _refused(_variant(llama, tmp_path, config={"num_hidden_layers": 4}),
             r"no tensor model.layers.3.self_attn.q_proj.weight in its weight files \(and 8 more\)")


def test_an_untied_model_without_its_output_layer(llama, tmp_path):
    t = _tensors(llama)
    del t["lm_head.weight"]
    _refused(_variant(llama, tmp_path, t), re.escape("no tensor lm_head.weight in its weight files "
                                                     "(tie_word_embeddings is false)"))
    shutil.rmtree(tmp_path / "variant")
    tied = _variant(llama, tmp_path, t, config={"tie_word_embeddings": True})
    assert resolve_source(hf=str(tied)).preset.num_layers == 3  # tied: the embedding serves


def test_a_file_cut_short(llama, tmp_path):
    folder = _variant(llama, tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    _refused(folder, r"model.safetensors: cut short \(\d+ bytes, its header places \d+\)")
    (folder / "model.safetensors").write_bytes(b"garbage")
    _refused(folder, re.escape("model.safetensors: not a safetensors file (no header)"))


def test_an_index_naming_a_shard_the_folder_lacks(llama, tmp_path):
    from safetensors.torch import save_file

    folder = _variant(llama, tmp_path)
    t = _tensors(llama)
    (folder / "model.safetensors").unlink()
    names = sorted(t)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    for file, part in shards.items():
        save_file({n: t[n] for n in part}, str(folder / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert resolve_source(hf=str(folder)).preset.num_layers == 3  # whole, sharded
    (folder / "model-00002-of-00002.safetensors").unlink()
    _refused(folder, re.escape("model.safetensors.index.json names model-00002-of-00002.safetensors, "
                               "which the folder lacks"))


def test_quantized_weights_are_refused(llama, tmp_path):
    _refused(_variant(llama, tmp_path, config={"quantization_config": {"quant_method": "fp8"}}),
             re.escape("quantization_config (quant_method 'fp8') unsupported"))
    shutil.rmtree(tmp_path / "variant")
    t = _tensors(llama)
    t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"].to(torch.float8_e4m3fn)
    _refused(_variant(llama, tmp_path, t), re.escape(
        "model.layers.0.self_attn.q_proj.weight is stored as F8_E4M3; the converter takes F32, F16, BF16"))


def test_mistral_consolidated_weights_are_not_read_twice(llama, tmp_path):
    from tknp_megatron.models.hf_files import weight_files

    folder = _variant(llama, tmp_path)
    shutil.copy(folder / "model.safetensors", folder / "consolidated.safetensors")
    assert [p.name for p in weight_files(folder)] == ["model.safetensors"]


def test_only_the_files_transformers_loads_are_read(llama, tmp_path):
    """Another ``*.safetensors`` beside ``model.safetensors`` (an EMA copy with the same
    tensor names, read after it) would replace the model's weights: it is not read; a folder
    with neither ``model.safetensors`` nor an index is refused naming what it holds."""
    from safetensors.torch import save_file

    from tknp_megatron.models.hf_files import weight_files

    folder = _variant(llama, tmp_path)
    save_file({k: torch.zeros_like(v) for k, v in _tensors(llama).items()}, str(folder / "model_ema.safetensors"))
    assert [p.name for p in weight_files(folder)] == ["model.safetensors"]
    (folder / "model.safetensors").rename(folder / "weights.safetensors")
    _refused(folder, re.escape("no model.safetensors and no model.safetensors.index.json (model_ema.safetensors, "
                               "weights.safetensors found: transformers loads neither"))


def test_the_stored_dtype_where_config_names_none(llama, tmp_path):
    from tknp_megatron.models.hf_convert import hf_checkpoint_dtype

    t = {k: v.to(torch.bfloat16) for k, v in _tensors(llama).items()}
    folder = _variant(llama, tmp_path, t, config={"dtype": "auto", "torch_dtype": None})
    assert hf_checkpoint_dtype(folder) == torch.bfloat16


def test_rope_parameters_win_over_a_stale_top_level_value():
    """transformers 5 reads rope_theta (and partial_rotary_factor) from rope_parameters
    where it has them; a leftover top-level value is ignored, as transformers ignores it."""
    from tknp_megatron.models.hf_convert import preset_from_hf_config

    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 160, "vocab_size": 256, "rope_theta": 10000.0,
           "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    assert preset_from_hf_config(cfg).gpt.rotary_base == 500000
    nemotron = {**cfg, "model_type": "nemotron", "partial_rotary_factor": 1.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5}}
    preset = preset_from_hf_config(nemotron)
    assert (preset.gpt.rotary_base, preset.gpt.rotary_percent) == (500000, 0.5)
