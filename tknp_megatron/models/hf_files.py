"""What a Hugging Face model folder's weight files hold, read from their headers only.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the bytes. Reading the headers costs kilobytes
however large the model, so the launcher checks a folder here before any process starts:
every file the index names exists and is whole, and every tensor the conversion reads is
present, stored as a float the converter takes, and of the shape the config implies.

Which files: those ``model.safetensors.index.json`` maps tensors to when the folder has
one, else ``model.safetensors``, as ``transformers`` loads them. Any other ``*.safetensors``
beside them (Mistral's ``consolidated.safetensors``, an EMA copy, an adapter) is not the
model's and is not read: read as well, a copy with the same tensor names would replace the
model's weights without a word.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple, Union

from tknp_megatron.config import ModelPreset

PathLike = Union[str, os.PathLike]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
              "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8}
CONVERTED = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
"""Stored dtypes the converter takes (safetensors name -> torch name)."""


class HFFolderError(ValueError):
    """A weight file that cannot be read as safetensors, or an index naming a missing file."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor's entry in a safetensors header."""

    file: str
    dtype: str
    shape: Tuple[int, ...]


def weight_files(folder: PathLike) -> List[Path]:
    """The folder's weight files, in a fixed order (see the module docstring)."""
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise HFFolderError(f"{INDEX} has no weight_map of tensor -> file ({err})") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise HFFolderError(f"{INDEX} names {missing[0]}, which the folder lacks"
                                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return [folder / n for n in names]
    single = folder / SINGLE
    if single.is_file():
        return [single]
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    raise HFFolderError(f"no {SINGLE} and no {INDEX}" + (
        f" ({', '.join(others[:3])}{' ...' if len(others) > 3 else ''} found: transformers loads neither, "
        f"name the model's file {SINGLE} or give the index)" if others else " (no *.safetensors weights)"))


def read_header(path: Path) -> Dict[str, StoredTensor]:
    """``name -> StoredTensor`` of one file; :class:`HFFolderError` where the header does not
    parse or the file is not exactly as long as its tensors (cut short, or padded)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            raise HFFolderError(f"{path.name}: not a safetensors file (no header)")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise HFFolderError(f"{path.name}: its safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise HFFolderError(f"{path.name}: its safetensors header is not a JSON object")
    out, end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            # a dtype this table lacks (newer safetensors) is not sized here; the converter
            # refuses it where it reads that tensor (folder_problems)
            nbytes = math.prod(shape) * ITEM_BYTES[dtype] if dtype in ITEM_BYTES else stop - start
        except (KeyError, TypeError, ValueError):
            raise HFFolderError(f"{path.name}: tensor {name}'s header entry is malformed") from None
        if stop - start != nbytes:
            raise HFFolderError(f"{path.name}: tensor {name} {list(shape)} {dtype} spans "
                                f"{stop - start} bytes, not {nbytes}")
        out[name] = StoredTensor(path.name, dtype, shape)
        end = max(end, stop)
    if size != 8 + length + end:
        state = "cut short" if size < 8 + length + end else "longer than its tensors"
        raise HFFolderError(f"{path.name}: {state} ({size} bytes, its header places "
                            f"{8 + length + end})")
    return out


def stored_tensors(folder: PathLike) -> Dict[str, StoredTensor]:
    """Every tensor of the folder's weight files, by name."""
    out: Dict[str, StoredTensor] = {}
    for path in weight_files(folder):
        out.update(read_header(path))
    return out


def expected_shapes(model_type: str, preset: ModelPreset) -> Dict[str, Tuple[int, ...]]:
    """``name -> shape`` of every tensor the conversion reads. ``lm_head.weight`` is among
    them; a tied model (``tie_word_embeddings``, which ``preset`` does not record) may lack
    it, but one that has it is served with it, as ``transformers`` loads it."""
    h, f, v = preset.hidden_size, preset.ffn_hidden_size, preset.gpt.vocab_size
    q, kv = preset.num_attention_heads * preset.kv_channels, preset.num_query_groups * preset.kv_channels
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    nemotron = model_type == "nemotron"
    if nemotron:
        shapes["model.norm.bias"] = (h,)
    for i in range(preset.num_layers):
        layer = f"model.layers.{i}."
        attn = layer + "self_attn."
        shapes.update({attn + "q_proj.weight": (q, h), attn + "k_proj.weight": (kv, h),
                       attn + "v_proj.weight": (kv, h), attn + "o_proj.weight": (h, q)})
        if preset.add_qkv_bias:
            shapes.update({attn + "q_proj.bias": (q,), attn + "k_proj.bias": (kv,), attn + "v_proj.bias": (kv,)})
        if preset.qk_layernorm:  # Qwen3: one RMSNorm over every query head's channels, one over every key head's
            shapes.update({attn + "q_norm.weight": (preset.kv_channels,), attn + "k_norm.weight": (preset.kv_channels,)})
        for norm in ("input_layernorm.", "post_attention_layernorm."):
            shapes[layer + norm + "weight"] = (h,)
            if nemotron:
                shapes[layer + norm + "bias"] = (h,)
        mlp = layer + "mlp."
        if preset.gated:
            shapes[mlp + "gate_proj.weight"] = (f, h)
        shapes.update({mlp + "up_proj.weight": (f, h), mlp + "down_proj.weight": (h, f)})
    return shapes


def folder_problems(folder: PathLike, cfg: Dict, preset: ModelPreset) -> List[str]:
    """Every mismatch between the folder's weight files and what converting ``cfg``
    (whose preset is ``preset``) reads, one line each; [] when the conversion can read them.
    Raises :class:`HFFolderError` for a file that cannot be read at all."""
    stored = stored_tensors(folder)
    tied = bool(cfg.get("tie_word_embeddings", False))
    problems = []
    for name, shape in expected_shapes(cfg.get("model_type", "llama"), preset).items():
        tensor = stored.get(name)
        if tensor is None:
            if name == "lm_head.weight" and tied:
                continue
            why = " (tie_word_embeddings is false)" if name == "lm_head.weight" else ""
            problems.append(f"no tensor {name} in its weight files{why}")
        elif tensor.shape != shape:
            problems.append(f"{tensor.file}: {name} has shape {list(tensor.shape)}, the config "
                            f"implies {list(shape)}")
        elif tensor.dtype not in CONVERTED:
            problems.append(f"{tensor.file}: {name} is stored as {tensor.dtype}; the converter "
                            f"takes {', '.join(CONVERTED)}")
    return problems


def stored_float_dtype(folder: PathLike) -> str:
    """The torch name of the folder's first floating-point weight (its embedding's when
    present): its dtype when ``config.json`` names none the converter knows."""
    stored = stored_tensors(folder)
    first = stored.get("model.embed_tokens.weight")
    for tensor in ([first] if first else []) + list(stored.values()):
        if tensor.dtype in CONVERTED:
            return CONVERTED[tensor.dtype]
    raise HFFolderError(f"no {', '.join(CONVERTED)} tensor in its weight files")
