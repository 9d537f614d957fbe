"""Hugging Face Llama / Mistral / Qwen2 / Qwen3 / Nemotron safetensors -> Megatron ``GPTModel`` dist checkpoint.

:func:`convert_hf_to_dist_checkpoint` dispatches on ``config.json``'s ``model_type``:
``llama``, ``mistral``, ``qwen2`` and ``qwen3`` (Llama's mapping) or ``nemotron``
(``NemotronForCausalLM``, e.g. Nemotron-4 340B). Keys below are local-spec
``GPTModel.state_dict()`` keys; ``L`` = layer index. (Over 350 lines: the key tables of each
family live here, beside the code that applies them.)

Mistral is Llama's layers; a ``sliding_window`` caps the served sequence length at the
window, within which attention is the same as full attention. Qwen2 adds q/k/v biases,
fused into ``linear_qkv.bias`` grouped per KV head like the weights (Megatron's
``add_qkv_bias``). Qwen3 adds an RMSNorm over each query head's and each key head's
channels after the projection, before RoPE (``self_attn.q_norm`` / ``k_norm``, one weight of
``head_dim`` shared by the heads): Megatron's ``qk_layernorm``, whose
``self_attention.q_layernorm`` / ``k_layernorm`` weights they copy to. Tied embeddings
(``tie_word_embeddings``) are untied: the output layer gets a copy of the embedding.

Llama:

=========================================  ===============================================
HF                                         Megatron
=========================================  ===============================================
model.embed_tokens.weight                  embedding.word_embeddings.weight (rows padded)
model.layers.L.input_layernorm.weight      decoder.layers.L.input_layernorm.weight
q_proj / k_proj / v_proj .weight           decoder.layers.L.self_attention.linear_qkv.weight
                                           rows grouped per KV head g:
                                           [q heads of group g..., k_g, v_g]
o_proj.weight                              decoder.layers.L.self_attention.linear_proj.weight
model.layers.L.post_attention_layernorm    decoder.layers.L.pre_mlp_layernorm.weight
gate_proj / up_proj .weight                decoder.layers.L.mlp.linear_fc1.weight = [gate; up]
down_proj.weight                           decoder.layers.L.mlp.linear_fc2.weight
model.norm.weight                          decoder.final_layernorm.weight
lm_head.weight (or embed_tokens if tied)   output_layer.weight (rows padded; untied)
=========================================  ===============================================

(In the sharded state dict / checkpoint the local spec maps ``input_layernorm`` to
``linear_qkv.layer_norm_weight`` and ``pre_mlp_layernorm`` to
``linear_fc1.layer_norm_weight``, the TE names; saving through the model does that.)
No q/k permutation: HF Llama's RoPE is rotate-half, like Megatron's non-interleaved RoPE.

Nemotron (Megatron side: ``normalization="LayerNorm"``, ``layernorm_zero_centered_gamma``,
``gated_linear_unit=False``, squared-ReLU activation, no linear biases, untied output):

=========================================  ===============================================
HF                                         Megatron
=========================================  ===============================================
model.embed_tokens.weight                  embedding.word_embeddings.weight (rows padded)
model.layers.L.input_layernorm.weight      decoder.layers.L.input_layernorm.weight (as is)
model.layers.L.input_layernorm.bias        decoder.layers.L.input_layernorm.bias
q_proj / k_proj / v_proj .weight           decoder.layers.L.self_attention.linear_qkv.weight
                                           (grouped per KV head, as for Llama)
o_proj.weight                              decoder.layers.L.self_attention.linear_proj.weight
post_attention_layernorm.weight / .bias    decoder.layers.L.pre_mlp_layernorm.weight / .bias
mlp.up_proj.weight                         decoder.layers.L.mlp.linear_fc1.weight (no gate)
mlp.down_proj.weight                       decoder.layers.L.mlp.linear_fc2.weight
model.norm.weight / .bias                  decoder.final_layernorm.weight / .bias
lm_head.weight (or embed_tokens if tied)   output_layer.weight (rows padded; untied)
=========================================  ===============================================

Norms: HF's ``NemotronLayerNorm1P`` computes ``F.layer_norm(x, ..., weight + 1, bias)``, i.e.
it stores ``gamma - 1`` exactly like Megatron's ``layernorm_zero_centered_gamma``
(:class:`~tknp_megatron.models.norms.ZeroCenteredNorm` on the local spec), so weights and biases
copy unchanged. (The local spec's zero-centred norms keep the ``input_layernorm`` /
``pre_mlp_layernorm`` names in the sharded state dict too.) Config: ``norm_eps`` ->
``layernorm_epsilon``; ``hidden_act`` must be ``relu2`` (= Megatron's ``squared_relu``).

RoPE: HF Nemotron rotates the first ``int(head_dim * partial_rotary_factor)`` dims of each
q/k head (rotate-half within them, inverse frequencies over that width) and passes the rest
through; Megatron's ``rotary_percent`` does the same on the first
``int(kv_channels * rotary_percent)`` dims with the same frequencies. So
``partial_rotary_factor`` -> ``rotary_percent`` with no q/k permutation (the end-to-end test
compares logits with ``transformers``). ``partial_rotary_factor`` and ``rope_theta`` are read
from ``rope_parameters`` (transformers 5.x), else from the top level (4.x), as transformers
reads them; only the default RoPE type is supported.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Dict, Optional, Union

import torch

from tknp_megatron.config import Activation, GPTArgs, ModelPreset, dtype_from_name
from tknp_megatron.models.hf_files import CONVERTED, stored_float_dtype, weight_files

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "convert_hf_to_dist_checkpoint",
    "convert_llama_to_dist_checkpoint",
    "hf_checkpoint_dtype",
    "hf_state_dict",
    "llama_state_dict",
    "nemotron_state_dict",
    "preset_from_hf_config",
]

PathLike = Union[str, os.PathLike]
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")  # Llama's mapping; Qwen2 adds QKV biases, Qwen3 QK norms
SUPPORTED_MODEL_TYPES = (*LLAMA_FAMILY, "nemotron")


def preset_from_hf_config(cfg: Dict, name: str = "hf") -> ModelPreset:
    """A preset from a Llama or Nemotron ``config.json`` (dict); ``model_type`` picks
    (default ``llama``). Tied embeddings are untied on conversion. Unsupported settings
    raise ``ValueError`` naming the config field."""
    model_type = cfg.get("model_type", "llama")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(f"quantization_config (quant_method {method!r}) unsupported: the "
                         "converter takes float32, float16 or bfloat16 weights (FP8 comes from "
                         "Transformer Engine at load time, --fp8-recipe)")
    if model_type in LLAMA_FAMILY:
        return _llama_preset(cfg, name, model_type)
    if model_type == "nemotron":
        return _nemotron_preset(cfg, name)
    raise ValueError(f"model_type {model_type!r} unsupported (one of {SUPPORTED_MODEL_TYPES})")


_LLAMA_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
_LLAMA_ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu": Activation.GELU}
"""``hidden_act`` -> the gated MLP's activation: SwiGLU, or GeGLU with the exact GELU
(``transformers``' ``gelu``; its tanh approximations are other functions)."""


def _llama_preset(cfg: Dict, name: str, model_type: str = "llama") -> ModelPreset:
    """Llama, Mistral (Llama's layers; a sliding window caps the served length, within which
    attention is exact), Qwen2 (Llama's layers plus q/k/v biases) and Qwen3 (Llama's layers
    plus an RMSNorm over each query and key head: Megatron's ``qk_layernorm``)."""
    scaling = _rope_scaling(cfg)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope_scaling type {rope_type!r} unsupported (default, llama3)")
    llama3 = rope_type == "llama3"
    if llama3 and (scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0),
                   scaling.get("original_max_position_embeddings", 8192)) != (1.0, 4.0, 8192):
        raise ValueError(f"llama3 rope_scaling {scaling}: Megatron fixes 1/4/8192")
    factor = _config_float(scaling, "factor", 8.0, "rope_scaling factor", low=1.0) if llama3 else 8.0
    theta = _whole_rope_theta(_rope_value(cfg, "rope_theta", 10000.0), model_type)
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"{model_type} {key} {cfg[key]!r} unsupported (Llama's layers have no "
                             f"such biases{'; Qwen2 has q/k/v biases without the key' if key == 'attention_bias' else ''})")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{model_type} use_sliding_window=True unsupported (full attention only)")
    kinds = cfg.get("layer_types")
    if kinds is not None and model_type != "mistral" and (
            not isinstance(kinds, list) or any(kind != "full_attention" for kind in kinds)):
        other = next((k for k in kinds if k != "full_attention"), None) if isinstance(kinds, list) else kinds
        raise ValueError(f"{model_type} layer_types with {other!r} unsupported (full_attention only)")
    missing = [key for key in _LLAMA_REQUIRED if key not in cfg]
    if missing:
        raise ValueError(f"config.json lacks required keys {missing} (model_type {model_type!r})")
    for key in (*_LLAMA_REQUIRED, "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window"):
        value = cfg.get(key)
        if (value is not None or key in _LLAMA_REQUIRED) and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"config.json {key} {value!r}: must be a positive integer")
    act = cfg.get("hidden_act", "silu")
    if act not in _LLAMA_ACTIVATIONS:
        raise ValueError(f"{model_type} hidden_act {act!r} unsupported ({', '.join(_LLAMA_ACTIVATIONS)})")
    heads = cfg["num_attention_heads"]
    max_len = cfg.get("max_position_embeddings", 4096)
    if model_type == "mistral" and cfg.get("sliding_window"):
        max_len = min(max_len, int(cfg["sliding_window"]))
    return ModelPreset(
        name=name,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn_hidden_size=cfg["intermediate_size"],
        gated=True,
        activation=_LLAMA_ACTIVATIONS[act],
        normalization="RMSNorm",
        layernorm_epsilon=_config_float(cfg, "rms_norm_eps", 1e-6, low=0.0, above=True),
        add_qkv_bias=model_type == "qwen2",
        qk_layernorm=model_type == "qwen3",
        gpt=GPTArgs(
            vocab_size=cfg["vocab_size"],
            max_sequence_length=max_len,
            rotary_base=theta,
            rope_scaling=llama3,
            rope_scaling_factor=factor,
            share_embeddings_and_output_weights=False,
        ),
    )


def _nemotron_preset(cfg: Dict, name: str) -> ModelPreset:
    """``NemotronConfig`` dict -> preset (HF defaults for omitted keys)."""
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field):
            raise ValueError(f"nemotron {field}=True unsupported (Megatron preset has no biases)")
    act = cfg.get("hidden_act", "relu2")
    if act != "relu2":
        raise ValueError(f"nemotron hidden_act {act!r} unsupported (relu2 = squared ReLU)")
    for field in ("rope_scaling", "rope_parameters"):
        rope = _rope_scaling({field: cfg.get(field)})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"nemotron {field} {rope!r} unsupported (default RoPE only)")
    factor = _config_float({"partial_rotary_factor": _rope_value(cfg, "partial_rotary_factor", 0.5)},
                           "partial_rotary_factor", 0.5, low=0.0, above=True)
    theta = _whole_rope_theta(_rope_value(cfg, "rope_theta", 10000.0), "nemotron")
    heads = cfg.get("num_attention_heads", 48)
    hidden = cfg.get("hidden_size", 6144)
    head_dim = cfg.get("head_dim") or hidden // heads
    rot_dim = int(head_dim * factor)
    if not 0.0 < factor <= 1.0 or rot_dim % 2:
        raise ValueError(f"nemotron partial_rotary_factor {factor}: rotary dims "
                         f"int({head_dim} * {factor}) = {rot_dim} must be even and > 0")
    return ModelPreset(
        name=name,
        num_layers=cfg.get("num_hidden_layers", 32),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=head_dim,
        ffn_hidden_size=cfg.get("intermediate_size", 24576),
        gated=False,
        activation=Activation.SQUARED_RELU,
        normalization="LayerNorm",
        zero_centered_gamma=True,
        layernorm_epsilon=_config_float(cfg, "norm_eps", 1e-5, low=0.0, above=True),
        add_bias_linear=False,
        gpt=GPTArgs(
            vocab_size=cfg.get("vocab_size", 256000),
            max_sequence_length=cfg.get("max_position_embeddings", 4096),
            rotary_percent=factor,
            rotary_base=theta,
            share_embeddings_and_output_weights=False,
        ),
    )


def _config_float(cfg: Dict, key: str, default: float, name: Optional[str] = None, *, low: float,
                  above: bool = False) -> float:
    """``cfg[key]`` as a float (``default`` where absent or null); ``ValueError`` naming the key
    (``name``, if given) and the value for one that is not a finite number ``>= low`` (``>
    low`` with ``above``). JSON ``"1e-5"`` is text, not a number: refused, as transformers'
    typed config classes would, not passed on to fail inside a rank."""
    value = cfg.get(key)
    if value is None:
        return default
    bound = f"> {low:g}" if above else f">= {low:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            value <= low if above else value < low):
        raise ValueError(f"config.json {name or key} {value!r}: must be a number {bound}")
    return float(value)


def _rope_scaling(cfg: Dict) -> Dict:
    """``rope_scaling`` (or ``rope_parameters``) as a dict, ``{}`` where absent or null;
    ``ValueError`` naming it for any other value."""
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"config.json {key} {value!r}: must be an object (or null)")
    return cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}


def _rope_value(cfg: Dict, key: str, default):
    """A RoPE setting as ``transformers`` 5 reads it: ``rope_parameters``' value where it has
    one, else the top level's (4.x configs), else ``rope_scaling``'s, else ``default``."""
    for source in (cfg.get("rope_parameters") or {}, cfg, cfg.get("rope_scaling") or {}):
        if isinstance(source, dict) and source.get(key) is not None:
            return source[key]
    return default


def _whole_rope_theta(theta, model_type: str) -> int:
    """``rope_theta`` as Megatron's ``rotary_base``, an int; ``ValueError`` for a fraction."""
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf") \
            or theta != int(theta):
        raise ValueError(f"{model_type} rope_theta {theta!r}: must be a positive whole number "
                         "(Megatron's rotary_base is an int)")
    return int(theta)


def _read_safetensors(folder: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: Dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        out.update(load_file(str(f)))
    return out


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _fuse_qkv(q, k, v, preset: ModelPreset) -> torch.Tensor:
    """``[Hq d, *D]``, ``[Hkv d, *D]`` x2 -> Megatron's grouped ``[(Hq + 2 Hkv) d, *D]``
    (weights with ``D`` the hidden size, or biases with no ``D``)."""
    g, d, rest = preset.num_query_groups, preset.kv_channels, tuple(q.shape[1:])
    q = q.reshape(g, -1, d, *rest)  # [g, Hq/g, d, *D]
    k = k.reshape(g, 1, d, *rest)
    v = v.reshape(g, 1, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _common_state_dict(hf: Dict[str, torch.Tensor], preset: ModelPreset,
                       padded_vocab: int) -> Dict[str, torch.Tensor]:
    """Embedding, output layer and attention projections: identical for Llama and Nemotron."""
    out = {}
    emb = hf["model.embed_tokens.weight"]
    out["embedding.word_embeddings.weight"] = _pad_rows(emb, padded_vocab)
    out["output_layer.weight"] = _pad_rows(hf.get("lm_head.weight", emb), padded_vocab)
    for i in range(preset.num_layers):
        attn, dst = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.self_attention."
        for kind in ("weight", "bias") if preset.add_qkv_bias else ("weight",):
            out[dst + f"linear_qkv.{kind}"] = _fuse_qkv(
                *(hf[attn + f"{p}_proj.{kind}"] for p in "qkv"), preset)
        out[dst + "linear_proj.weight"] = hf[attn + "o_proj.weight"]
    return out


def llama_state_dict(hf: Dict[str, torch.Tensor], preset: ModelPreset, padded_vocab: int,
                     dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """HF Llama tensors -> TP=1 ``GPTModel.state_dict()`` (local spec) tensors."""
    out = _common_state_dict(hf, preset, padded_vocab)
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    for i in range(preset.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        mlp = src + "mlp."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        if preset.qk_layernorm:
            for p in "qk":
                out[dst + f"self_attention.{p}_layernorm.weight"] = hf[src + f"self_attn.{p}_norm.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]]
        )
        out[dst + "mlp.linear_fc2.weight"] = hf[mlp + "down_proj.weight"]
    return {k: v.to(dtype) for k, v in out.items()}


def nemotron_state_dict(hf: Dict[str, torch.Tensor], preset: ModelPreset, padded_vocab: int,
                        dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """HF Nemotron tensors -> TP=1 ``GPTModel.state_dict()`` (local spec) tensors.

    LayerNorm1p weights (``gamma - 1`` on both sides) and biases copy unchanged; the MLP
    is not gated, so ``linear_fc1`` is ``up_proj`` alone.
    """
    out = _common_state_dict(hf, preset, padded_vocab)
    norms = {"model.norm.": "decoder.final_layernorm."}
    for i in range(preset.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        norms[src + "input_layernorm."] = dst + "input_layernorm."
        norms[src + "post_attention_layernorm."] = dst + "pre_mlp_layernorm."
        out[dst + "mlp.linear_fc1.weight"] = hf[src + "mlp.up_proj.weight"]
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
    for src, dst in norms.items():
        out[dst + "weight"] = hf[src + "weight"]
        out[dst + "bias"] = hf[src + "bias"]
    return {k: v.to(dtype) for k, v in out.items()}


_STATE_DICT_FNS = {**dict.fromkeys(LLAMA_FAMILY, llama_state_dict), "nemotron": nemotron_state_dict}


def hf_state_dict(model_type: str, hf: Dict[str, torch.Tensor], preset: ModelPreset,
                  padded_vocab: int, dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """:func:`llama_state_dict` or :func:`nemotron_state_dict` by HF ``model_type``."""
    try:
        fn = _STATE_DICT_FNS[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} unsupported (one of {SUPPORTED_MODEL_TYPES})"
        ) from None
    return fn(hf, preset, padded_vocab, dtype)


def hf_checkpoint_dtype(hf_dir: PathLike) -> torch.dtype:
    """The dtype a Hugging Face folder stores: ``config.json``'s ``torch_dtype`` (``dtype``
    in transformers 5) where it names float32, float16 or bfloat16, else that of its stored
    weights (read from the file headers)."""
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    name = cfg.get("torch_dtype") or cfg.get("dtype")
    name = name.removeprefix("torch.") if isinstance(name, str) else None
    if name not in CONVERTED.values():  # absent, or "auto": what the weights are stored as
        name = stored_float_dtype(hf_dir)
    return dtype_from_name(name)


def convert_hf_to_dist_checkpoint(hf_dir: PathLike, out_dir: PathLike,
                                  dtype: Optional[torch.dtype] = None) -> ModelPreset:
    """Write a ``torch_dist`` checkpoint that :func:`load_megatron_checkpoint` serves.

    ``dtype`` None keeps the folder's own dtype (:func:`hf_checkpoint_dtype`), so a
    conversion changes no value unless told to; ``model_config.json`` records it as
    ``params_dtype``.

    ``hf_dir`` holds ``config.json`` and ``*.safetensors`` of a Llama or Nemotron model
    (``model_type`` picks the mapping). Builds the full TP=1 ``GPTModel`` in this process
    (fine for conversion hosts with RAM for one copy of the model), fills it and saves its
    sharded state dict. Needs ``torch.distributed`` and ``megatron.core.parallel_state``
    initialised with TP = 1. Returns the preset (also written to ``out_dir/model_config.json``).
    """
    from megatron.core import dist_checkpointing

    from tknp_megatron.models.cpu_shims import cpu_torch_dist_save_strategy
    from tknp_megatron.models.model import padded_vocab_size
    from tknp_megatron.models.reference import build_reference_model

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    dtype = dtype or hf_checkpoint_dtype(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    preset = preset_from_hf_config(cfg, name=hf_dir.name or "hf")
    model = build_reference_model(preset, dtype)
    sd = hf_state_dict(cfg.get("model_type", "llama"), _read_safetensors(hf_dir), preset,
                       padded_vocab_size(preset, 1), dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"mapping mismatch: missing {missing}, unexpected {unexpected}")
    out_dir.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(out_dir),
                            sharded_strategy=cpu_torch_dist_save_strategy())
    if torch.distributed.get_rank() == 0:
        (out_dir / "model_config.json").write_text(json.dumps(_model_config(preset, dtype), indent=1))
    return preset


# Older name, kept for callers written when only Llama was supported (handles both).
convert_llama_to_dist_checkpoint = convert_hf_to_dist_checkpoint


def _model_config(p: ModelPreset, dtype: torch.dtype) -> Dict:
    """``--model-config`` JSON for a preset (see :func:`tknp_megatron.models.model_config.preset_from_model_config`)."""
    return dict(
        name=p.name, num_layers=p.num_layers, hidden_size=p.hidden_size,
        num_attention_heads=p.num_attention_heads, num_query_groups=p.num_query_groups,
        kv_channels=p.kv_channels, ffn_hidden_size=p.ffn_hidden_size,
        normalization=p.normalization, gated_linear_unit=p.gated,
        add_bias_linear=p.add_bias_linear, add_qkv_bias=p.add_qkv_bias, qk_layernorm=p.qk_layernorm,
        layernorm_zero_centered_gamma=p.zero_centered_gamma,
        layernorm_epsilon=p.layernorm_epsilon, activation=p.activation.value,
        vocab_size=p.gpt.vocab_size, max_sequence_length=p.gpt.max_sequence_length,
        position_embedding_type=p.gpt.position_embedding_type,
        rotary_percent=p.gpt.rotary_percent, rotary_base=p.gpt.rotary_base,
        rope_scaling=p.gpt.rope_scaling, rope_scaling_factor=p.gpt.rope_scaling_factor,
        share_embeddings_and_output_weights=False,
        params_dtype=str(dtype).removeprefix("torch."),
    )
