"""Model configs as Megatron writes them -> :class:`ModelPreset`.

Two sources: a ``--model-config`` JSON object (``TransformerConfig`` field names plus the
``GPTModel`` constructor arguments, e.g. a training run's config dumped as JSON) and the
training arguments Megatron-LM stores in a checkpoint's ``common.pt``.

Every ``TransformerConfig`` field and ``GPTModel`` argument is accepted. Those that shape
the served model map onto the preset; those that only matter for training or for kernels
(dropout, initialisation, fusions, parallel sizes, recomputation, ...) are accepted and
ignored; architecture features this library does not serve (mixture of experts,
multi-latent attention, QK L2 norm, sliding windows, ...) are refused by name with the
value found, before any process starts. A key that is neither is a typo and is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from tknp_megatron.config import Activation, GPTArgs, ModelPreset, dtype_from_name

__all__ = [
    "load_model_config",
    "preset_from_checkpoint_args",
    "preset_from_model_config",
    "unsupported_features",
]

# (what it is, --model-config key, Megatron-LM argument, value when the feature is off)
_UNSUPPORTED: Tuple[Tuple[str, str, str, Any], ...] = (
    ("mixture of experts", "num_moe_experts", "num_experts", None),
    ("multi-latent attention", "multi_latent_attention", "multi_latent_attention", False),
    ("QK L2 norm", "qk_l2_norm", "qk_l2_norm", False),
    ("interleaved RoPE", "rotary_interleaved", "rotary_interleaved", False),
    ("sliding-window attention", "window_size", "window_size", None),
    ("post-layernorm residuals", "apply_residual_connection_post_layernorm",
     "apply_residual_connection_post_layernorm", False),
    ("a custom softmax scale", "softmax_scale", "softmax_scale", None),
    ("a non-vanilla softmax", "softmax_type", "softmax_type", "vanilla"),
    ("an attention output gate", "attention_output_gate", "attention_output_gate", False),
    ("experimental attention variants", "experimental_attention_variant",
     "experimental_attention_variant", None),
    ("linear attention layers", "linear_attention_freq", "linear_attention_freq", None),
    ("layers without RoPE", "no_rope_freq", "no_rope_freq", None),
    ("multimodal RoPE", "mrope_section", "mrope_section", None),
    ("heterogeneous layers", "heterogeneous_block_specs", "heterogeneous_layers_config_path", None),
    ("an FP32 residual stream", "fp32_residual_connection", "fp32_residual_connection", False),
    ("a GLU linear offset", "glu_linear_offset", "glu_linear_offset", 0.0),
    ("RoPE sequence interpolation", "seq_len_interpolation_factor",
     "rotary_seq_len_interpolation_factor", None),
    ("an activation clamp", "activation_func_clamp_value", "activation_func_clamp_value", None),
    ("hybrid (Mamba) layers", "is_hybrid_model", "is_hybrid_model", False),
)

# --model-config keys that map onto the preset, with Megatron's defaults.
_DEFAULTS: Dict[str, Any] = {
    "num_query_groups": None,  # = num_attention_heads
    "kv_channels": None,  # = hidden_size // num_attention_heads
    "ffn_hidden_size": None,  # = 4 * hidden_size
    "normalization": "LayerNorm",
    "gated_linear_unit": False,
    "add_bias_linear": True,
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "layernorm_zero_centered_gamma": False,
    "layernorm_epsilon": 1e-5,
    "position_embedding_type": "rope",
    "rotary_percent": 1.0,
    "rotary_base": 10000,
    "rope_scaling": False,
    "rope_scaling_factor": 8.0,
    "share_embeddings_and_output_weights": False,
    "params_dtype": "float32",
    "activation": "gelu",
    "activation_func": None,
    "init_method_std": 0.02,  # std of seeded weights when no checkpoint is loaded
    "name": "model-config",
}
_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_sequence_length")
# The type each key that maps onto the preset must have in the JSON (optional ones may be null).
_POSITIVE_INTS = (*_REQUIRED, "num_query_groups", "kv_channels", "ffn_hidden_size")
_BOOLS = ("gated_linear_unit", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
          "layernorm_zero_centered_gamma", "rope_scaling", "share_embeddings_and_output_weights")
_POSITIVE_NUMBERS = ("layernorm_epsilon", "rotary_percent", "rotary_base", "rope_scaling_factor")
_ALIASES = {"squared_relu": "squared_relu", "relu2": "squared_relu", "silu": "silu", "swish": "silu",
            "gelu": "gelu"}


@functools.lru_cache(maxsize=1)
def megatron_config_keys() -> frozenset:
    """Every ``TransformerConfig`` field and ``GPTModel`` constructor argument."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    args = set(inspect.signature(GPTModel.__init__).parameters) - {"self", "config"}
    return frozenset(fields | args)


def unsupported_features(get: Callable[[str, Any], Any], megatron_lm: bool = False) -> List[str]:
    """Features that are on, as ``"<what> (<name>=<value>)"``.

    ``get(name, off)`` reads one setting by its ``TransformerConfig`` / ``GPTModel`` name,
    or by its Megatron-LM argument name if ``megatron_lm``; ``off`` if absent. An empty or
    zero value counts as off too.
    """
    found = []
    for what, key, lm_arg, off in _UNSUPPORTED:
        name = lm_arg if megatron_lm else key
        value = get(name, off)
        if value != off and value not in (None, False, 0, "", [], ()):
            found.append(f"{what} ({name}={value!r})")
    return found


def _refuse(source: str, found: List[str]) -> None:
    if found:
        raise ValueError(f"{source}: not supported by tknp-megatron: {'; '.join(found)}")


def _activation(c: Mapping[str, Any]) -> Activation:
    """``activation`` (ours) or Megatron's ``activation_func`` given by name
    (``"torch.nn.functional.silu"``, ``"squared_relu"``, or ``"<function silu at 0x...>"`` as
    Megatron's config logger writes a function)."""
    key = "activation" if c.get("activation_func") is None else "activation_func"
    name = c[key]
    if not isinstance(name, str):
        raise ValueError(f"{key} {name!r}: expected a name, one of {sorted(set(_ALIASES))}")
    logged = re.fullmatch(r"<function (\S+) at 0x[0-9a-fA-F]+>", name)
    leaf = (logged.group(1) if logged else name).rsplit(".", 1)[-1].lower()
    if leaf not in _ALIASES:
        raise ValueError(f"activation {name!r} unsupported; choose one of {sorted(set(_ALIASES))}")
    return Activation(_ALIASES[leaf])


def _type_problem(c: Mapping[str, Any]) -> Optional[str]:
    """The first key whose value has the wrong type or sign, as ``"<key> <value>: <rule>"``:
    JSON numbers and booleans as Megatron's fields take them (``"2"`` is not 2, ``"false"``
    is not false); ``rotary_base`` a whole number, as Megatron's argument is."""
    for key in _POSITIVE_INTS:
        value = c.get(key)
        if value is None and key not in _REQUIRED:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{key} {value!r}: must be a positive integer"
        if value >= 2**63:
            return f"{key} {str(value)[:12]}... ({len(str(value))} digits): over the 64-bit integers"
    for key in _BOOLS:
        if not isinstance(c[key], bool):
            return f"{key} {c[key]!r}: must be true or false"
    for key in _POSITIVE_NUMBERS:
        value = c[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            return f"{key} {value!r}: must be a positive number"
    if c["rotary_base"] != int(c["rotary_base"]):
        return f"rotary_base {c['rotary_base']!r}: must be a whole number (Megatron's rotary_base is an int)"
    std = c["init_method_std"]
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not 0 <= std < float("inf"):
        return f"init_method_std {std!r}: must be a number >= 0"
    return None


def preset_from_model_config(cfg: Mapping[str, Any]) -> ModelPreset:
    """A preset from a ``--model-config`` JSON object (see the module docstring).

    Required: ``num_layers``, ``hidden_size``, ``num_attention_heads``, ``vocab_size``,
    ``max_sequence_length``. Omitted keys take Megatron's defaults (LayerNorm, GELU, biases
    on, not gated), except untied embeddings. ``activation`` (``silu``, ``gelu``,
    ``squared_relu``) or ``activation_func`` name the MLP activation; ``gated_linear_unit``
    with SiLU is SwiGLU. Raises ``ValueError`` naming unknown keys, missing keys, values of
    the wrong type or sign, and unsupported features.
    """
    cfg = _unwrapped(cfg)
    known = set(_DEFAULTS) | set(_REQUIRED) | megatron_config_keys()
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"unknown model-config keys (not TransformerConfig fields nor GPTModel "
                         f"arguments): {unknown}")
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"model-config lacks required keys: {missing}")
    _refuse("model-config", unsupported_features(cfg.get))
    c = {**_DEFAULTS, **cfg}
    problem = _type_problem(c)
    if problem:
        raise ValueError(f"model-config: {problem}")
    if c["position_embedding_type"] != "rope":
        raise ValueError(f"model-config: position_embedding_type {c['position_embedding_type']!r} "
                         "unsupported (owners apply RoPE: 'rope' only)")
    params_dtype(c)  # validate early
    if not isinstance(c["name"], str):
        raise ValueError(f"model-config: name {c['name']!r}: must be text")
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    return ModelPreset(
        name=c["name"],
        num_layers=c["num_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=c["num_query_groups"] or heads,
        kv_channels=c["kv_channels"] or hidden // heads,
        ffn_hidden_size=c["ffn_hidden_size"] or 4 * hidden,
        gated=bool(c["gated_linear_unit"]),
        activation=_activation(c),
        normalization=c["normalization"],
        zero_centered_gamma=bool(c["layernorm_zero_centered_gamma"]),
        layernorm_epsilon=float(c["layernorm_epsilon"]),
        add_bias_linear=bool(c["add_bias_linear"]),
        add_qkv_bias=bool(c["add_qkv_bias"]),
        qk_layernorm=bool(c["qk_layernorm"]),
        init_std=float(c["init_method_std"]),
        gpt=GPTArgs(
            vocab_size=c["vocab_size"],
            max_sequence_length=c["max_sequence_length"],
            position_embedding_type=c["position_embedding_type"],
            rotary_percent=float(c["rotary_percent"]),
            rotary_base=int(c["rotary_base"]),  # a whole number (_type_problem)
            rope_scaling=bool(c["rope_scaling"]),
            rope_scaling_factor=float(c["rope_scaling_factor"]),
            share_embeddings_and_output_weights=bool(c["share_embeddings_and_output_weights"]),
        ),
    )


def load_model_config(path) -> Tuple[ModelPreset, torch.dtype]:
    """``--model-config FILE``: the preset and its ``params_dtype``.

    Raises ``ValueError`` naming the file for a file that is not a JSON object.
    """
    try:
        cfg = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"expected a JSON object of TransformerConfig fields, got {type(cfg).__name__}")
    return preset_from_model_config(cfg), params_dtype({**_DEFAULTS, **_unwrapped(cfg)})


def _unwrapped(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The JSON Megatron-Core's config logger writes for a ``GPTModel``
    (``TransformerConfig(config_logger_dir=...)``: the ``TransformerConfig`` under ``"config"``,
    the constructor's other arguments beside it) as one object of fields; any other object
    as it is."""
    if not isinstance(cfg.get("config"), dict):
        return cfg
    rest = {k: v for k, v in cfg.items() if k not in ("config", "transformer_layer_spec", "__class__")}
    return {**cfg["config"], **rest}


def params_dtype(c: Mapping[str, Any]) -> torch.dtype:
    """``params_dtype`` (``"bfloat16"``, or ``"torch.bfloat16"`` as Megatron's config logger
    writes it) as a torch dtype; ``ValueError`` naming the key for anything else."""
    value = c["params_dtype"]
    if not isinstance(value, str):
        raise ValueError(f"model-config: params_dtype {value!r}: expected the name of a dtype "
                         "(float32, bfloat16, float16)")
    try:
        return dtype_from_name(value.removeprefix("torch."))
    except ValueError as err:
        raise ValueError(f"model-config: params_dtype: {err}") from None


_MEGATRON_LM_DEFAULTS = {
    "normalization": "LayerNorm", "norm_epsilon": 1e-5, "rotary_percent": 1.0, "rotary_base": 10000,
    "swiglu": False, "group_query_attention": False, "num_query_groups": 1, "kv_channels": None,
    "ffn_hidden_size": None, "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False,
    "apply_layernorm_1p": False,
    "squared_relu": False, "untie_embeddings_and_output_weights": False, "use_rope_scaling": False,
    "rope_scaling_factor": 8.0, "position_embedding_type": "rope",
}
"""Megatron-LM's argument defaults, for arguments a checkpoint from an older Megatron-LM did not
store (its parser did not have them yet)."""


def preset_from_checkpoint_args(args: Any, name: str = "checkpoint") -> ModelPreset:
    """A preset from Megatron-LM's training args (an ``argparse.Namespace``, as stored in
    ``common.pt``; an argument it lacks takes Megatron-LM's default); refuses unsupported
    features by name."""
    _refuse(f"checkpoint {name}", unsupported_features(
        lambda arg, off: getattr(args, arg, off), megatron_lm=True))

    def arg(key: str):
        return getattr(args, key, _MEGATRON_LM_DEFAULTS.get(key))

    heads = args.num_attention_heads
    if arg("squared_relu"):
        act = Activation.SQUARED_RELU
    elif arg("swiglu"):
        act = Activation.SILU
    else:
        act = Activation.GELU
    pos = arg("position_embedding_type")
    if pos != "rope":
        raise ValueError(f"checkpoint {name}: position_embedding_type {pos!r} unsupported (rope only)")
    return ModelPreset(
        name=name,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=heads,
        num_query_groups=arg("num_query_groups") if arg("group_query_attention") else heads,
        kv_channels=arg("kv_channels") or args.hidden_size // heads,
        ffn_hidden_size=arg("ffn_hidden_size") or 4 * args.hidden_size,
        gated=bool(arg("swiglu")),
        activation=act,
        normalization=arg("normalization"),
        zero_centered_gamma=bool(arg("apply_layernorm_1p")),
        layernorm_epsilon=arg("norm_epsilon"),
        add_bias_linear=bool(arg("add_bias_linear")),
        add_qkv_bias=bool(arg("add_qkv_bias")),
        qk_layernorm=bool(arg("qk_layernorm")),
        gpt=GPTArgs(
            vocab_size=_unpadded_vocab(args),
            max_sequence_length=args.max_position_embeddings,
            position_embedding_type=pos,
            rotary_percent=arg("rotary_percent"),
            rotary_base=int(arg("rotary_base")),
            rope_scaling=bool(arg("use_rope_scaling")),
            rope_scaling_factor=float(arg("rope_scaling_factor")),
            share_embeddings_and_output_weights=not arg("untie_embeddings_and_output_weights"),
        ),
    )


def _unpadded_vocab(args: Any) -> int:
    """The tokenizer's vocabulary if Megatron-LM stored it, else its padded size."""
    vocab: Optional[int] = getattr(args, "vocab_size", None)
    return int(vocab or args.padded_vocab_size)
