"""Megatron-Core distributed checkpoints into a rank's :class:`StageModel`, and model configs.

A ``torch_dist`` checkpoint (``dist_checkpointing.save`` of ``GPTModel.sharded_state_dict()``,
directly or under Megatron-LM's ``{"model": ...}``) stores each tensor under a global key with
its global shape (layers stacked on axis 0). :class:`StageModel` builds a sharded state dict
with exactly those keys, but only for its own blocks and TP shard, so
``dist_checkpointing.load`` reads just those slices -- from a checkpoint written at any TP
(and PP): resharding is Megatron's own.

Also here: Megatron-LM's stored training args (``common.pt``) and ``--model-config`` JSON
files -> :class:`ModelPreset`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.validation import StrictHandling

from tknp_megatron.config import Activation, GPTArgs, ModelPreset, dtype_from_name
from tknp_megatron.models.model import StageModel

__all__ = [
    "checkpoint_padded_vocab_size",
    "load_megatron_checkpoint",
    "load_model_config",
    "preset_from_checkpoint_args",
    "preset_from_model_config",
    "read_checkpoint_args",
    "resolve_checkpoint_dir",
]

PathLike = Union[str, os.PathLike]
_EMBEDDING_KEY = "embedding.word_embeddings.weight"


def resolve_checkpoint_dir(ckpt_dir: PathLike) -> Path:
    """The ``torch_dist`` directory: ``ckpt_dir`` itself, or Megatron-LM's latest
    ``iter_XXXXXXX`` / ``release`` under it (``latest_checkpointed_iteration.txt``)."""
    path = Path(ckpt_dir)
    tracker = path / "latest_checkpointed_iteration.txt"
    if not (path / "metadata.json").exists() and tracker.exists():
        it = tracker.read_text().strip()
        path = path / ("release" if it == "release" else f"iter_{int(it):07d}")
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"{path}: not a Megatron distributed checkpoint (no metadata.json)")
    return path


def _drop_extra_state(sd: Dict) -> Dict:
    """Remove ``_extra_state`` objects (None for local-spec layers, FP8 meta for TE ones):
    serving does not need them and checkpoints from another spec may lack them."""
    return {
        k: v
        for k, v in sd.items()
        if not (k.endswith("._extra_state") or isinstance(v, ShardedObject))
    }


def _model_nesting(path: Path) -> bool:
    """Megatron-LM nests the model under ``"model"`` (with ``args`` in ``common.pt``)."""
    common = _load_common(path)
    return isinstance(common, dict) and ("model" in common or "args" in common)


def load_megatron_checkpoint(model: StageModel, ckpt_dir: PathLike) -> None:
    """Fill ``model``'s stored blocks from a ``torch_dist`` checkpoint, reading only them.

    Every rank of the pool calls this (it is collective over the default group). Each rank
    asks for the slices its ``StageModel.sharded_state_dict()`` describes -- its layers, its
    TP shard, the embedding / output layer only where held -- so memory while loading is
    about one copy of the rank's own parameters. Raises ``CheckpointingException`` if a
    needed tensor is missing, ``RuntimeError`` if the shapes differ (e.g. vocabulary
    padding: build the model with :func:`checkpoint_padded_vocab_size`).
    """
    path = resolve_checkpoint_dir(ckpt_dir)
    request = _drop_extra_state(model.sharded_state_dict())
    nested = _model_nesting(path)
    sharded = {"model": request} if nested else request
    # No access-integrity check: it asserts every shard is read once as a main replica,
    # true of a whole training job but not of a decode pool (node replicas, partial reads).
    loaded = dist_checkpointing.load(
        sharded, str(path), validate_access_integrity=False,
        strict=StrictHandling.ASSUME_OK_UNEXPECTED,
    )
    state = loaded["model"] if nested else loaded
    state = {k: v for k, v in state.items() if k in request}
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise RuntimeError(f"{path}: parameters not in the checkpoint: {missing}")


def checkpoint_padded_vocab_size(ckpt_dir: PathLike) -> int:
    """Rows of the checkpoint's (padded) embedding, read from its metadata only."""
    meta = dist_checkpointing.load_tensors_metadata(str(resolve_checkpoint_dir(ckpt_dir)))
    key = next((k for k in meta if k.endswith(_EMBEDDING_KEY)), None)
    if key is None:
        raise KeyError(f"{ckpt_dir}: no {_EMBEDDING_KEY} in the checkpoint")
    return int(meta[key].global_shape[0])


def _load_common(path: Path) -> Any:
    common = path / "common.pt"
    if not common.exists():
        return None
    # Megatron-LM pickles argparse.Namespace (and enums) here: only load trusted checkpoints.
    return torch.load(common, map_location="cpu", weights_only=False)


def read_checkpoint_args(ckpt_dir: PathLike) -> Optional[Any]:
    """Megatron-LM's training ``args`` (an ``argparse.Namespace``) if the checkpoint has them."""
    common = _load_common(resolve_checkpoint_dir(ckpt_dir))
    return common.get("args") if isinstance(common, dict) else None


def preset_from_checkpoint_args(args: Any, name: str = "checkpoint") -> ModelPreset:
    """A preset from Megatron-LM's training args (as stored in ``common.pt``)."""
    heads = args.num_attention_heads
    if args.squared_relu:
        act = Activation.SQUARED_RELU
    elif args.swiglu:
        act = Activation.SILU
    else:
        act = Activation.GELU
    return ModelPreset(
        name=name,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else heads,
        kv_channels=args.kv_channels or args.hidden_size // heads,
        ffn_hidden_size=args.ffn_hidden_size,
        gated=bool(args.swiglu),
        activation=act,
        normalization=args.normalization,
        zero_centered_gamma=bool(getattr(args, "apply_layernorm_1p", False)),
        layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=bool(args.add_bias_linear),
        gpt=GPTArgs(
            vocab_size=getattr(args, "padded_vocab_size", None) or args.vocab_size,
            max_sequence_length=args.max_position_embeddings,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=int(args.rotary_base),
            rope_scaling=bool(getattr(args, "use_rope_scaling", False)),
            rope_scaling_factor=float(getattr(args, "rope_scaling_factor", 8.0)),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        ),
    )


# --model-config: TransformerConfig field names (+ GPTModel arguments), Megatron's defaults.
_CONFIG_DEFAULTS: Dict[str, Any] = {
    "num_query_groups": None,  # = num_attention_heads
    "kv_channels": None,  # = hidden_size // num_attention_heads
    "ffn_hidden_size": None,  # = 4 * hidden_size
    "normalization": "LayerNorm",
    "gated_linear_unit": False,
    "add_bias_linear": True,
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
    "name": "model-config",
}
_CONFIG_REQUIRED = (
    "num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_sequence_length",
)


def preset_from_model_config(cfg: Mapping[str, Any]) -> ModelPreset:
    """A preset from a ``--model-config`` JSON object.

    Keys are ``TransformerConfig`` field names (``num_layers``, ``hidden_size``,
    ``num_attention_heads``, ``num_query_groups``, ``kv_channels``, ``ffn_hidden_size``,
    ``normalization``, ``gated_linear_unit``, ``add_bias_linear``,
    ``layernorm_zero_centered_gamma``, ``layernorm_epsilon``) plus ``vocab_size``,
    ``max_sequence_length``, ``position_embedding_type``, ``rotary_percent``, ``rotary_base``,
    ``rope_scaling``, ``rope_scaling_factor``, ``share_embeddings_and_output_weights``,
    ``params_dtype`` (see :func:`load_model_config`), ``activation`` (``silu``, ``gelu``,
    ``squared_relu``) and ``name``. Omitted keys take Megatron's defaults (LayerNorm, GELU,
    biases on, not gated), except untied embeddings. Unknown or missing keys -> ValueError.
    """
    unknown = sorted(set(cfg) - set(_CONFIG_DEFAULTS) - set(_CONFIG_REQUIRED))
    if unknown:
        raise ValueError(f"unknown model-config keys: {unknown}")
    missing = [k for k in _CONFIG_REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"model-config lacks required keys: {missing}")
    c = {**_CONFIG_DEFAULTS, **cfg}
    dtype_from_name(c["params_dtype"])  # validate early
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
        activation=Activation(c["activation"]),
        normalization=c["normalization"],
        zero_centered_gamma=bool(c["layernorm_zero_centered_gamma"]),
        layernorm_epsilon=float(c["layernorm_epsilon"]),
        add_bias_linear=bool(c["add_bias_linear"]),
        gpt=GPTArgs(
            vocab_size=c["vocab_size"],
            max_sequence_length=c["max_sequence_length"],
            position_embedding_type=c["position_embedding_type"],
            rotary_percent=float(c["rotary_percent"]),
            rotary_base=int(c["rotary_base"]),
            rope_scaling=bool(c["rope_scaling"]),
            rope_scaling_factor=float(c["rope_scaling_factor"]),
            share_embeddings_and_output_weights=bool(c["share_embeddings_and_output_weights"]),
        ),
    )


def load_model_config(path: PathLike) -> Tuple[ModelPreset, torch.dtype]:
    """``--model-config FILE``: the preset and its ``params_dtype``."""
    cfg = json.loads(Path(path).read_text())
    return preset_from_model_config(cfg), dtype_from_name(cfg.get("params_dtype", "float32"))
