"""Convert a Hugging Face Llama / Nemotron safetensors folder to a Megatron torch_dist checkpoint.

    python -m tknp_megatron.tools.convert_hf_checkpoint --hf HF_DIR --out CKPT_DIR [--dtype bfloat16]

The checkpoint keeps the folder's own dtype (``config.json``'s ``torch_dtype``) unless
``--dtype`` says otherwise, so serving it gives the same tokens as serving the folder
with ``--hf``.

``config.json``'s ``model_type`` (``llama``, ``mistral``, ``qwen2`` or ``nemotron``) picks
the weight mapping. Runs in one process (gloo, world 1) and holds one copy of the model in
memory. The output directory is served with ``--load CKPT_DIR`` (its ``model_config.json``
is read from it).

The folder and the output are checked first: a folder the library cannot serve, an output
that is a file, sits in a missing or read-only directory, or already holds files (unless
``--force``) is one line naming it, with exit status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from tknp_megatron.cli import ArgumentParser


PROG = "convert_hf_checkpoint"


def output_problem(out: str, force: bool) -> Optional[str]:
    """Why ``--out`` cannot take the checkpoint, or None (the directory is made if new)."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        return f"--out {out}: a file, not a directory"
    if path.is_dir() and any(path.iterdir()) and not force:
        return f"--out {out}: not empty; pass --force to write the checkpoint over what it holds"
    if not path.is_dir() and not path.parent.is_dir():
        return f"--out {out}: its directory {path.parent} does not exist"
    try:  # made now, and written to once (a permission check would pass root anywhere)
        path.mkdir(exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as err:
        return f"--out {out}: cannot be written ({err.strerror or err})"
    return None


def main(argv=None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, help="HF folder with config.json + *.safetensors")
    parser.add_argument("--out", required=True, help="output checkpoint directory (new or empty)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="the checkpoint's dtype (default: the folder's own)")
    parser.add_argument("--force", action="store_true", help="write into a directory that is not empty")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")

    from tknp_megatron.models.source import SourceError, resolve_source

    try:
        resolve_source(hf=args.hf)  # the folder's config and weights files, as --hf checks them
    except SourceError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    problem = output_problem(args.out, args.force)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2

    import parallel_state as ps
    from tknp_megatron.config import dtype_from_name
    from tknp_megatron.launch import init_tool_process
    from tknp_megatron.models.hf_convert import convert_hf_to_dist_checkpoint, hf_checkpoint_dtype

    init_tool_process("cpu")  # a world of one
    try:
        ps.initialize_model_parallel(1)
        dtype = dtype_from_name(args.dtype) if args.dtype else hf_checkpoint_dtype(args.hf)
        preset = convert_hf_to_dist_checkpoint(args.hf, args.out, dtype)
        ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    print(f"wrote {args.out}: {preset.num_layers} layers, hidden {preset.hidden_size}, "
          f"vocab {preset.vocab_size}, {str(dtype).removeprefix('torch.')} "
          f"(model config: {os.path.join(args.out, 'model_config.json')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
