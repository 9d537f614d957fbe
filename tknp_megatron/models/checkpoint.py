"""Megatron-Core distributed checkpoints into a rank's :class:`StageModel`, and model configs.

A ``torch_dist`` checkpoint (``dist_checkpointing.save`` of ``GPTModel.sharded_state_dict()``,
directly or under Megatron-LM's ``{"model": ...}``) stores each tensor under a global key with
its global shape (layers stacked on axis 0). :class:`StageModel` builds a sharded state dict
with exactly those keys, but only for its own blocks and TP shard, so
``dist_checkpointing.load`` reads just those slices -- from a checkpoint written at any TP
(and PP): resharding is Megatron's own.

The load may also run in rounds of a few layers (:mod:`tknp_megatron.models.layer_rounds`):
how FP8-stored layers are filled, through one-layer staging copies in the run's dtype.

Also here: reading Megatron-LM's stored training args (the common state: ``common.pt``, or
from megatron-core 0.19 an object among the distributed files); turning them (or a
``--model-config`` file) into a preset is :mod:`tknp_megatron.models.model_config`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import (
    dict_list_map_inplace,
    dict_list_map_outplace,
    extract_matching_values,
)
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)
from megatron.core.dist_checkpointing.validation import StrictHandling

from tknp_megatron.models.layer_rounds import LayerRounds, fill_in_rounds_

__all__ = [
    "checkpoint_padded_vocab_size",
    "checkpoint_problems",
    "key_prefix",
    "load_megatron_checkpoint",
    "read_checkpoint_args",
    "resolve_checkpoint_dir",
]

PathLike = Union[str, os.PathLike]
_EMBEDDING_KEY = "embedding.word_embeddings.weight"
_VOCAB_KEYS = (_EMBEDDING_KEY, "output_layer.weight")  # vocabulary-parallel, rows padded


def resolve_checkpoint_dir(ckpt_dir: PathLike) -> Path:
    """The ``torch_dist`` directory: ``ckpt_dir`` itself, or Megatron-LM's latest
    ``iter_XXXXXXX`` / ``release`` under it (``latest_checkpointed_iteration.txt``)."""
    path = Path(ckpt_dir)
    tracker = path / "latest_checkpointed_iteration.txt"
    if not (path / "metadata.json").exists() and tracker.exists():
        it = tracker.read_text().strip()
        if it != "release" and not it.isdigit():
            raise ValueError(f"{tracker}: holds {it[:40]!r}, not an iteration number or 'release'")
        path = path / ("release" if it == "release" else f"iter_{int(it):07d}")
    if not (path / "metadata.json").exists():
        legacy = sorted(p.name for p in path.glob("mp_rank_*")) if path.is_dir() else []
        if legacy:  # Megatron-LM's per-rank `--ckpt-format torch` files
            raise FileNotFoundError(
                f"{path}: a legacy 'torch' format checkpoint ({legacy[0]}/...), not a distributed one; "
                "Megatron-LM rewrites it: its training script with the run's arguments plus "
                "--ckpt-convert-format torch_dist --ckpt-convert-save DIR")
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
    """Megatron-LM nests the model under ``"model"`` (with ``args`` in the common state)."""
    common = _load_common(path)
    return isinstance(common, dict) and ("model" in common or "args" in common)


def load_megatron_checkpoint(model: torch.nn.Module, ckpt_dir: PathLike,
                             rounds: Optional[LayerRounds] = None) -> None:
    """Fill ``model``'s stored blocks from a ``torch_dist`` checkpoint, reading only them.

    Every rank of the world calls this (it is collective over the default group). Each rank
    asks for the slices its ``sharded_state_dict()`` describes -- its layers, its TP shard,
    the embedding / output layer only where held -- so memory while loading is about one
    copy of the rank's own parameters. The embedding and output layer may have more rows
    than the checkpoint's (vocabulary padding for a TP that does not divide the
    checkpoint's rows): those ranks read the whole checkpoint tensor and keep their rows,
    zero beyond the checkpoint's.

    Args:
        model: a :class:`StageModel` (or, without ``rounds``, a Megatron ``GPTModel``).
        ckpt_dir: the checkpoint (see :func:`resolve_checkpoint_dir`).
        rounds: load in rounds of layers (:func:`~tknp_megatron.models.layer_rounds.fill_in_rounds_`;
            through staging copies if ``rounds.staging``): one collective load a round,
            the endpoints with round 0. The ranks first agree on the largest round count
            (one ``all_gather_object``), so every rank makes the same number of loads;
            every rank must pass rounds or none. None: one load of the whole model.

    Raises ``CheckpointingException`` if a needed tensor is missing, ``RuntimeError`` if
    other shapes differ.
    """
    path = resolve_checkpoint_dir(ckpt_dir)
    nested = _model_nesting(path)
    prefix = key_prefix(dist_checkpointing.load_tensors_metadata(str(path)))
    if rounds is None:
        _load_into(model, path, nested, prefix)
        return
    counts = [len(rounds.rounds)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, len(rounds.rounds))
    fill_in_rounds_(model, lambda part: _load_into(part, path, nested, prefix), rounds, max(counts))


def key_prefix(keys) -> str:
    """What the checkpoint's model keys start with: nothing for a model Megatron-LM or
    Megatron-Core saved, ``module.`` for one saved through a wrapper module (NeMo 2's
    checkpoints), ``model.`` for NeMo 1's; read off where the word embedding is stored."""
    found = sorted((k for k in keys if k.endswith(_EMBEDDING_KEY) and not k.startswith(_IGNORED_PREFIXES)),
                   key=len)
    return found[0][: -len(_EMBEDDING_KEY)] if found else ""


def _load_into(model: torch.nn.Module, path: Path, nested: bool, prefix: str = "") -> None:
    """One collective ``dist_checkpointing.load`` of what ``model`` describes (every rank
    calls it, an empty description included), loaded into ``model``; ``prefix``: the
    checkpoint's keys carry it (:func:`key_prefix`).

    The request's factories (SwiGLU's split FC1, DCP's head rows) are applied here, as
    Megatron's load would, so that every stacked-layer tensor can be described with its
    layer axis as an explicit axis of size one (:func:`_explicit_layer_axes`).
    """
    request = _drop_extra_state(model.sharded_state_dict(prefix))
    resized = _whole_vocab_requests(request, path)
    factories, _ = extract_matching_values(
        request, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True)
    apply_factories(request)
    shapes = dict_list_map_outplace(
        lambda x: x.local_shape if isinstance(x, ShardedTensor) else None, request)
    dict_list_map_inplace(_explicit_layer_axes, request)
    sharded = {"model": request} if nested else request
    loaded = _load_tensors(sharded, path)
    state = loaded["model"] if nested else loaded
    state = {k: _local_view(state[k], shapes[k]) for k in request}
    state = apply_factory_merges(state, factories)
    for name, served in resized.items():
        state[name] = _served_rows(state[name], served)
    state = {k[len(prefix):]: v for k, v in state.items()}  # the model's own names
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise RuntimeError(f"{path}: parameters not in the checkpoint: {missing}")


def _load_tensors(sharded: Dict, path: Path) -> Dict:
    """``dist_checkpointing.load`` of ``sharded`` (tensors only). A checkpoint that keeps its
    common state among its distributed files (saved by megatron-core 0.19 or later: no
    ``common.pt``) goes through Megatron's loading strategy alone where the installed
    megatron-core is older, whose ``load`` would first read ``common.pt``; the tensors do
    not need that state."""
    if (path / "common.pt").exists() or _megatron_version() >= (0, 19):
        # No access-integrity check: it asserts every shard is read once as a main replica,
        # true of a whole training job but not of a decode pool (node replicas, partial reads).
        return dist_checkpointing.load(sharded, str(path), validate_access_integrity=False,
                                       strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    return TorchDistLoadShardedStrategy().load(sharded, str(path))


def _megatron_version() -> tuple:
    from megatron.core import __version__

    return tuple(int(p) for p in __version__.split(".")[:2])


def _explicit_layer_axes(st: ShardedTensor) -> ShardedTensor:
    """``st`` with its prepended axes (the stacked layers' axis) as explicit axes of size one
    (the same chunk of the same global tensor). Megatron reads such a tensor as a DCP chunk
    directly; a prepended axis it reads through a torch ``ShardedTensor`` that places every
    other layer's fragment on the next rank, which in a world of one rank is this one, so a
    one-rank load of some layers only (a round, :mod:`~tknp_megatron.models.layer_rounds`)
    would fail."""
    if not isinstance(st, ShardedTensor) or not st.prepend_axis_num:
        return st
    data = st.data.view((1,) * st.prepend_axis_num + tuple(st.data.shape))
    return dataclasses.replace(st, data=data, local_shape=tuple(data.shape), prepend_axis_num=0)


def _local_view(loaded, shapes):
    """``loaded`` (a tensor, or lists / dicts of them, as requested) viewed as ``shapes``
    (the requested tensors' local shapes, same structure; None: left as loaded)."""
    if isinstance(shapes, dict):
        return {k: _local_view(loaded[k], v) for k, v in shapes.items()}
    if isinstance(shapes, list):
        return [_local_view(t, v) for t, v in zip(loaded, shapes)]
    return loaded if shapes is None else loaded.view(shapes)


def _whole_vocab_requests(request: Dict, path: Path) -> Dict[str, ShardedTensor]:
    """Replace, in ``request``, the vocabulary tensors whose rows differ from the
    checkpoint's by a request for the whole checkpoint tensor; returns the replaced
    (served) entries by name. Reads the checkpoint's metadata (a local read) only when
    ``request`` holds a vocabulary tensor."""
    vocab = {name: st for name, st in request.items()
             if isinstance(st, ShardedTensor) and st.key.endswith(_VOCAB_KEYS)}
    if not vocab:
        return {}
    meta = dist_checkpointing.load_tensors_metadata(str(path))
    replaced = {}
    for name, st in vocab.items():
        if st.key not in meta:
            continue
        stored = tuple(meta[st.key].global_shape)
        if stored == tuple(st.global_shape):
            continue
        whole = torch.empty(stored, dtype=st.data.dtype, device=st.data.device)
        request[name] = ShardedTensor.from_rank_offsets(st.key, whole, replica_id=st.replica_id)
        replaced[name] = st
    return replaced


def _served_rows(whole: torch.Tensor, served: ShardedTensor) -> torch.Tensor:
    """This rank's rows of the served (padded) tensor: the checkpoint's, zeros beyond."""
    if whole.shape[1:] != served.data.shape[1:]:
        raise RuntimeError(f"{served.key}: checkpoint shape {tuple(whole.shape)} does not match "
                           f"the model's {tuple(served.global_shape)} beyond the vocabulary rows")
    lo, n = served.global_offset[0], served.data.shape[0]
    part = torch.zeros_like(served.data)
    rows = whole[lo : lo + n]
    part[: rows.shape[0]] = rows
    return part


def checkpoint_padded_vocab_size(ckpt_dir: PathLike) -> int:
    """Rows of the checkpoint's (padded) embedding, read from its metadata only."""
    meta = dist_checkpointing.load_tensors_metadata(str(resolve_checkpoint_dir(ckpt_dir)))
    key = next((k for k in meta if k.endswith(_EMBEDDING_KEY)), None)
    if key is None:
        raise KeyError(f"{ckpt_dir}: no {_EMBEDDING_KEY} in the checkpoint")
    return int(meta[key].global_shape[0])


_LAYER = "decoder.layers."


def checkpoint_problems(ckpt_dir: PathLike, preset) -> List[str]:
    """What keeps the checkpoint from holding ``preset``'s weights, one line each, read from
    its metadata and its files' sizes (no tensor is read), so that a launcher refuses it
    before any rank starts: a shard file missing or shorter than the metadata says; a
    tensor the model needs that is not stored, or stored with another shape (the layer
    count, widths, head layout as far as shapes show it); a tensor stored that the model
    would leave unread (biases, norm biases or a separate output layer the config does not
    have, or any tensor of a feature it lacks, such as learned position embeddings or q/k
    layernorm: served without them, the tokens would not be the checkpoint's model's). The
    vocabulary rows may differ (checked by the caller against the model's vocabulary);
    nothing else may."""
    path = resolve_checkpoint_dir(ckpt_dir)
    try:
        problems = _short_files(path)
        meta = None if problems else dist_checkpointing.load_tensors_metadata(str(path))
    except Exception as err:  # a damaged metadata file: whatever its reader raises
        raise ValueError(f"{path}: its metadata does not load ({type(err).__name__}: {err})") from None
    if problems:
        return problems
    prefix = key_prefix(meta)
    return _layout_problems({k[len(prefix):] if k.startswith(prefix) else k: tuple(v.global_shape)
                             for k, v in meta.items()}, preset)


def _short_files(path: Path) -> List[str]:
    """Shard files the checkpoint's metadata names that are missing or cut short (a
    ``torch_dist`` checkpoint's; another backend's files are left to its loader)."""
    import json

    from torch.distributed.checkpoint import FileSystemReader

    backend = json.loads((path / "metadata.json").read_text()).get("sharded_backend")
    if backend == "zarr":  # older Megatron and NeMo checkpoints (Nemotron-4 340B's release among them)
        return [f"{path}: a zarr-backend distributed checkpoint, which megatron-core 0.16 and later no longer "
                "read; megatron-core 0.15 or older (with the zarr package) rewrites it as torch_dist "
                "(Megatron-LM's --ckpt-convert-format torch_dist)"]
    if backend != "torch_dist":
        return []

    needed: Dict[str, int] = {}
    for info in FileSystemReader(str(path)).read_metadata().storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    out = []
    for name, size in sorted(needed.items()):
        file = path / name
        have = file.stat().st_size if file.is_file() else None
        if have is None or have < size:
            out.append(f"{file}: {'missing' if have is None else f'{have} bytes'}, the metadata needs {size} bytes")
    return out


_IGNORED_PREFIXES = ("optimizer.", "mtp.")
"""Stored tensors serving does not read: the optimizer's state, and multi-token-prediction
heads (used for speculative drafts; the main model's tokens do not depend on them)."""
_IGNORED_SUFFIXES = ("_extra_state",)  # Transformer Engine's FP8 metadata, no weights


def _layout_problems(stored: Dict[str, tuple], preset) -> List[str]:
    """``stored`` (key -> global shape, layers stacked on axis 0) against what a TP-1
    ``GPTModel`` of ``preset`` saves; see :func:`checkpoint_problems`. Norms are found under
    the TE names the local spec also saves (``linear_qkv.layer_norm_weight``) or the local
    names zero-centred norms keep (``input_layernorm.weight``)."""
    L, h = preset.num_layers, preset.hidden_size
    fc1 = preset.ffn_hidden_size * (2 if preset.gated else 1)
    layer_norm = preset.normalization == "LayerNorm"
    d, qk = preset.kv_channels, preset.qk_layernorm
    # (names it may be stored under, shape, whether the model has it)
    tensors = [
        (("self_attention.linear_qkv.weight",), (L, preset.qkv_width, h), True),
        (("self_attention.linear_proj.weight",), (L, h, preset.num_attention_heads * preset.kv_channels), True),
        (("mlp.linear_fc1.weight",), (L, fc1, h), True),
        (("mlp.linear_fc2.weight",), (L, h, preset.ffn_hidden_size), True),
        (("self_attention.linear_qkv.bias",), (L, preset.qkv_width), preset.add_bias_linear or preset.add_qkv_bias),
        (("self_attention.linear_proj.bias",), (L, h), preset.add_bias_linear),
        (("mlp.linear_fc1.bias",), (L, fc1), preset.add_bias_linear),
        (("mlp.linear_fc2.bias",), (L, h), preset.add_bias_linear),
        (("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"), (L, h), True),
        (("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"), (L, h), True),
        (("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"), (L, h), layer_norm),
        (("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"), (L, h), layer_norm),
        (("self_attention.q_layernorm.weight",), (L, d), qk),
        (("self_attention.k_layernorm.weight",), (L, d), qk),
        (("self_attention.q_layernorm.bias",), (L, d), qk and layer_norm),
        (("self_attention.k_layernorm.bias",), (L, d), qk and layer_norm),
    ]
    entries = [(tuple(_LAYER + n for n in names), shape, wanted) for names, shape, wanted in tensors]
    entries += [(("decoder.final_layernorm.weight",), (h,), True),
                (("decoder.final_layernorm.bias",), (h,), layer_norm)]
    out = []
    known = {n for names, _, _ in entries for n in names} | {_EMBEDDING_KEY, "output_layer.weight"}
    for key in sorted(stored):
        if key not in known and not key.endswith(_IGNORED_SUFFIXES) and not key.startswith(_IGNORED_PREFIXES):
            out.append(f"the checkpoint holds {key} {stored[key]}, which a model of this config does not have "
                       "(learned position embeddings, ... are not served): served without "
                       "it, the tokens would be another model's")
    for names, shape, wanted in entries:
        found = [n for n in names if n in stored]
        if wanted and not found:
            out.append(f"no {names[0]} in the checkpoint (the model config needs {shape})")
        elif found and not wanted:
            out.append(f"the checkpoint holds {found[0]} {stored[found[0]]}, which the model config does not "
                       "have (add_bias_linear, add_qkv_bias, normalization, qk_layernorm)")
        elif found and stored[found[0]] != shape:
            out.append(f"{found[0]} is {stored[found[0]]} in the checkpoint; the model config needs {shape}")
    tied = preset.gpt.share_embeddings_and_output_weights
    for key, wanted in ((_EMBEDDING_KEY, True), ("output_layer.weight", not tied)):
        if wanted and key not in stored:
            why = " (the checkpoint ties it to the embedding: set share_embeddings_and_output_weights)" \
                if key == "output_layer.weight" else ""
            out.append(f"no {key} in the checkpoint{why}")
        elif key in stored and not wanted:
            out.append(f"the checkpoint holds a separate {key}, but the model config ties the output layer to "
                       "the embedding (share_embeddings_and_output_weights)")
        elif key in stored and stored[key][1:] != (h,):
            out.append(f"{key} is {stored[key]} in the checkpoint; the model config needs (rows, {h})")
    return out


def _load_common(path: Path) -> Any:
    """The checkpoint's common (non-sharded) state: ``common.pt`` (megatron-core up to 0.18),
    or the ``common_state`` object saved among the distributed files (0.19 and later), read
    as Megatron's ``load_common_state_dict`` reads it; None where it has neither."""
    common = path / "common.pt"
    # Megatron-LM pickles argparse.Namespace (and enums) here: only load trusted checkpoints.
    try:
        if common.exists():
            return torch.load(common, map_location="cpu", weights_only=False)
        return _embedded_common(path)
    except Exception as err:  # a damaged file: whatever unpickling raises
        where = common if common.exists() else f"{path}: its common_state"
        raise ValueError(f"{where}: does not load ({type(err).__name__}: {err})") from None


def _embedded_common(path: Path) -> Any:
    import io
    import warnings

    import torch.distributed.checkpoint as dcp

    key = ShardedObject("common_state", None, (1,), (0,)).unique_key
    reader = dcp.FileSystemReader(str(path))
    if key not in reader.read_metadata().state_dict_metadata:
        return None
    state = {key: io.BytesIO()}
    with warnings.catch_warnings():  # torch's note that it reads in one process: as asked
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    loaded = state[key]  # torch may hand back the bytes, or already what they unpickle to
    if isinstance(loaded, io.BytesIO):
        loaded.seek(0)
        loaded = torch.load(loaded, map_location="cpu", weights_only=False)
    return loaded[0]


def read_checkpoint_args(ckpt_dir: PathLike) -> Optional[Any]:
    """Megatron-LM's training ``args`` (an ``argparse.Namespace``) if the checkpoint has them."""
    common = _load_common(resolve_checkpoint_dir(ckpt_dir))
    return common.get("args") if isinstance(common, dict) else None
