"""What a pool serves: a preset with seeded weights, a Megatron checkpoint, or a Hugging
Face folder, resolved (and checked) before any process of the pool starts.

A launcher (the main job, a server) resolves its flags into one :class:`ModelSource`:
the architecture comes from ``--model-config``, the checkpoint's own config (the
converter's ``model_config.json`` or Megatron-LM's stored arguments), the Hugging Face
``config.json``, or a preset name. Everything that can be wrong with those inputs raises
:class:`SourceError` with one line naming the input, the value and what is allowed.
A Hugging Face folder is converted once, into a temporary checkpoint
(:func:`converted_checkpoint`), after the checks.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from tknp_megatron.config import PRESETS, ModelPreset, dtype_from_name, get_preset

__all__ = ["ModelSource", "SourceError", "converted_checkpoint", "converted_on_each_host",
           "resolve_source"]


class SourceError(ValueError):
    """A model input that cannot be served; the message is one line for the user."""


@dataclass(frozen=True)
class ModelSource:
    """What the pool serves.

    Attributes:
        preset: the architecture.
        checkpoint: ``torch_dist`` directory every rank loads from; None = seeded weights
            (or, for ``hf``, the checkpoint converted later).
        hf: Hugging Face folder to convert before serving, if any.
        padded_vocab: the checkpoint's embedding rows (None: Megatron's padding).
        weights: where the weights come from, for reports.
    """

    preset: ModelPreset
    checkpoint: Optional[str] = None
    hf: Optional[str] = None
    padded_vocab: Optional[int] = None
    weights: str = ""


def _model_config(path: str, flag: str) -> ModelPreset:
    from tknp_megatron.models.model_config import load_model_config

    if not os.path.isfile(path):
        raise SourceError(f"{flag} {path}: no such file")
    try:
        return load_model_config(path)[0]  # params_dtype is the file's; the launcher's dtype serves
    except (ValueError, KeyError, TypeError) as err:
        raise SourceError(f"{flag} {path}: {err}") from None


def _checkpoint_preset(ckpt: str) -> ModelPreset:
    """``ckpt/model_config.json`` (written by the HF converter), else Megatron-LM's args."""
    from tknp_megatron.models.checkpoint import read_checkpoint_args
    from tknp_megatron.models.model_config import preset_from_checkpoint_args

    config = os.path.join(ckpt, "model_config.json")
    if os.path.exists(config):
        return _model_config(config, "--load")
    try:
        stored = read_checkpoint_args(ckpt)
    except _UNREADABLE as err:
        raise SourceError(f"--load {ckpt}: {_one_line(err)}") from None
    if stored is None:
        raise SourceError(f"--load {ckpt}: no model_config.json and no Megatron-LM args stored "
                          "with it; pass --model-config FILE")
    try:
        return preset_from_checkpoint_args(stored, name=os.path.basename(os.path.normpath(ckpt)))
    except (ValueError, AttributeError) as err:
        raise SourceError(f"--load {ckpt}: {err}") from None


def _hf_preset(folder: str) -> ModelPreset:
    from tknp_megatron.models.hf_convert import preset_from_hf_config
    from tknp_megatron.models.hf_files import HFFolderError, folder_problems

    path = Path(folder)
    if not path.is_dir():
        raise SourceError(f"--hf {folder}: no such directory")
    config = path / "config.json"
    if not config.is_file():
        raise SourceError(f"--hf {folder}: not a Hugging Face model folder (no config.json)")
    try:
        cfg = json.loads(config.read_text())
    except ValueError as err:
        raise SourceError(f"--hf {folder}: config.json is not JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise SourceError(f"--hf {folder}: config.json holds a {type(cfg).__name__}, not a JSON object")
    try:
        preset = preset_from_hf_config(cfg, name=path.name or "hf")
    except (ValueError, KeyError, TypeError) as err:
        raise SourceError(f"--hf {folder}: {err}") from None
    try:  # the weight files' headers against the config: kilobytes read, nothing converted
        problems = folder_problems(path, cfg, preset)
    except (HFFolderError, OSError) as err:
        raise SourceError(f"--hf {folder}: {_one_line(err)}") from None
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise SourceError(f"--hf {folder}: {problems[0]}{more}")
    return preset


# What reading a damaged checkpoint's files raises: a missing or unreadable file, a tracker
# or JSON that does not parse, a pickle or shard that does not load (torch's and Megatron's
# checkpoint errors are RuntimeErrors or their own exceptions, derived from Exception).
_UNREADABLE = (OSError, ValueError, KeyError, RuntimeError, EOFError, ImportError, AttributeError,
               pickle.UnpicklingError)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def _checkpoint_rows(ckpt: str, preset: ModelPreset) -> int:
    """The checkpoint's embedding rows, once its files and tensors are checked against
    ``preset`` (:func:`~tknp_megatron.models.checkpoint.checkpoint_problems`)."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from tknp_megatron.models.checkpoint import checkpoint_padded_vocab_size, checkpoint_problems

    if not os.path.isdir(ckpt):
        raise SourceError(f"--load {ckpt}: no such directory")
    try:
        problems = checkpoint_problems(ckpt, preset)
        rows = None if problems else checkpoint_padded_vocab_size(ckpt)
    except (*_UNREADABLE, CheckpointingException) as err:
        raise SourceError(f"--load {ckpt}: {_one_line(err)}") from None
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise SourceError(f"--load {ckpt}: {problems[0]}{more}")
    if rows < preset.vocab_size:
        raise SourceError(f"--load {ckpt}: {rows} embedding rows, fewer than the model's "
                          f"vocab_size {preset.vocab_size}")
    return rows


# What a checkpoint's shapes cannot show (RoPE, norms, the head split of a width), compared
# between a --model-config and the arguments Megatron-LM stored with the checkpoint.
_ARGS_COMPARED = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                  "ffn_hidden_size", "gated", "activation", "normalization", "zero_centered_gamma",
                  "layernorm_epsilon", "add_bias_linear", "add_qkv_bias", "qk_layernorm")
_GPT_ARGS_COMPARED = ("position_embedding_type", "rotary_percent", "rotary_base", "rope_scaling",
                      "rope_scaling_factor", "share_embeddings_and_output_weights")


def _against_stored_args(ckpt: str, preset: ModelPreset, config_path: str) -> None:
    """A ``--model-config`` for a checkpoint that stores its description (Megatron-LM's
    arguments or the converter's ``model_config.json``: :func:`_checkpoint_preset`) must
    agree with it on every setting the weights' shapes do not pin, and may not cut its
    vocabulary where it names one (a larger vocabulary and another sequence limit are
    taken); a mismatch raises :class:`SourceError` naming the field.
    Stored arguments that do not describe a servable model are not compared: the config is
    then the description."""
    try:
        stored = _checkpoint_preset(ckpt)
    except SourceError:
        return
    pairs = [(f, getattr(preset, f), getattr(stored, f)) for f in _ARGS_COMPARED]
    pairs += [(f, getattr(preset.gpt, f), getattr(stored.gpt, f)) for f in _GPT_ARGS_COMPARED]
    for field, given, saved in pairs:
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (given, saved))
        if given != saved and not (numbers and math.isclose(given, saved, rel_tol=1e-9)):
            raise SourceError(f"--model-config {config_path}: {field} {getattr(given, 'value', given)!r}, but "
                              f"the checkpoint {ckpt} was saved with {getattr(saved, 'value', saved)!r}")
    if preset.vocab_size < stored.vocab_size and _names_its_vocabulary(ckpt):
        raise SourceError(f"--model-config {config_path}: vocab_size {preset.vocab_size}, but the checkpoint "
                          f"{ckpt} was saved with {stored.vocab_size} tokens: the ones from "
                          f"{preset.vocab_size} on could never be sampled")


def _names_its_vocabulary(ckpt: str) -> bool:
    """Whether the checkpoint's stored description gives the tokenizer's vocabulary itself
    (``model_config.json``, or Megatron-LM's ``args.vocab_size``), not only the padded rows
    (a config's vocabulary below those is the usual case: they include Megatron's padding)."""
    from tknp_megatron.models.checkpoint import read_checkpoint_args

    if os.path.exists(os.path.join(ckpt, "model_config.json")):
        return True
    return bool(getattr(read_checkpoint_args(ckpt), "vocab_size", None))


def resolve_source(model: Optional[str] = None, load: Optional[str] = None,
                   hf: Optional[str] = None, model_config: Optional[str] = None,
                   seed: int = 0) -> ModelSource:
    """One source from a launcher's flags (``--model``, ``--load``, ``--hf``,
    ``--model-config``); raises :class:`SourceError` naming the bad input."""
    if model is not None and model not in PRESETS:
        raise SourceError(f"--model {model}: unknown preset; known: {', '.join(sorted(PRESETS))}")
    if model_config:
        preset = _model_config(model_config, "--model-config")
    elif hf:
        preset = _hf_preset(hf)
    elif load:
        if not os.path.isdir(load):
            raise SourceError(f"--load {load}: no such directory")
        preset = _checkpoint_preset(load)
    else:
        preset = get_preset(model or "tiny")
    if load and model_config:
        _against_stored_args(load, preset, model_config)
    if load:
        return ModelSource(preset, load, None, _checkpoint_rows(load, preset), f"checkpoint {load}")
    if hf:
        return ModelSource(preset, None, hf, None, f"HF {hf} (converted)")
    return ModelSource(preset, weights=f"seeded (seed {seed})")


def convert_worker(rank: int, world: int, hf_dir: str, out_dir: str, dtype: str) -> None:
    """One-process pool: an HF folder -> a ``torch_dist`` checkpoint + model_config.json."""
    warnings.simplefilter("ignore")
    import parallel_state as ps
    from tknp_megatron.models.hf_convert import convert_hf_to_dist_checkpoint

    ps.initialize_model_parallel(1)
    convert_hf_to_dist_checkpoint(hf_dir, out_dir, dtype_from_name(dtype))
    ps.destroy_model_parallel()


@contextlib.contextmanager
def _outside_torchrun() -> Iterator[None]:
    """Hide torchrun's variables while starting a separate pool: with them, its ranks
    would join torchrun's rendezvous store (TORCHELASTIC_USE_AGENT_STORE) and hang."""
    names = [k for k in os.environ if k.startswith("TORCHELASTIC_")]
    names += ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"]
    saved = {k: os.environ.pop(k) for k in names if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def converted_checkpoint(source: ModelSource, dtype: str, timeout_s: float,
                         convert_here: bool = True) -> Iterator[ModelSource]:
    """``source`` with its Hugging Face folder converted into a temporary checkpoint
    (removed on exit), in a one-process pool; unchanged if it has no folder.

    ``convert_here`` False skips the conversion and yields the source as is (the ranks
    of a torchrun launch that read their host's conversion: :func:`converted_on_each_host`).
    """
    if source.hf is None or not convert_here:
        yield source
        return
    from tknp_megatron.launch import spawn
    from tknp_megatron.models.model import padded_vocab_size

    with tempfile.TemporaryDirectory(prefix="tknp-hf-") as path:
        with _outside_torchrun():
            spawn(convert_worker, 1, (source.hf, path, dtype), timeout_s=timeout_s)
        rows = padded_vocab_size(source.preset, 1)  # the converter pads as Megatron does at TP 1
        yield ModelSource(source.preset, path, source.hf, rows, source.weights)


@contextlib.contextmanager
def converted_on_each_host(source: ModelSource, dtype: str, timeout_s: float) -> Iterator[ModelSource]:
    """Under torchrun, with the process group up: ``source`` with its Hugging Face folder
    converted once per host (torchrun's ``GROUP_RANK``) by the host's local rank 0, into a
    temporary checkpoint on that host, which the host's ranks then serve. Hosts need not
    share a filesystem; the folder must be at the same path on each. On a normal exit every
    rank waits for the others, so no converter removes a checkpoint still being read."""
    if source.hf is None:
        yield source
        return
    import torch.distributed as dist

    host, local = os.environ.get("GROUP_RANK", "0"), int(os.environ.get("LOCAL_RANK", "0"))
    with converted_checkpoint(source, dtype, timeout_s, convert_here=local == 0) as mine:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (host, local, mine))
        (shared,) = [s for h, rank, s in everyone if h == host and rank == 0]
        yield shared
        dist.barrier()
