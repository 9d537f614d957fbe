"""The main job's inputs, checked before any process starts (examples/run_tknp_decode.py).

Every mistake in a flag or a file becomes one :class:`JobError` line naming the flag or
file, the value and what is allowed; the main job prints it and exits with status 2.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import List, Optional

import torch

from tknp_megatron.config import PRESETS, ModelPreset
from tknp_megatron.models.tokenizer import Tokenizer
from tknp_megatron.pool_checks import pool_problems


class JobError(ValueError):
    """A flag or file the job cannot run with; the message is one line for the user."""


def add_model_flags(p, tokenizer_help: str = "HF tokenizer folder") -> None:
    """The flags that say what model runs, and where: both launchers take them."""
    p.add_argument("--model", default=None,
                   help=f"model preset with seeded weights (default tiny): {', '.join(sorted(PRESETS))}")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--load", default=None, metavar="DIR", help="Megatron dist checkpoint")
    src.add_argument("--hf", default=None, metavar="DIR",
                     help="Hugging Face Llama / Mistral / Qwen2 / Nemotron folder")
    p.add_argument("--model-config", default=None, metavar="FILE", help="model JSON")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help=tokenizer_help)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="float32 (CPU default) or bfloat16 (GPU default)")
    p.add_argument("--transformer-impl", default="auto", metavar="IMPL",
                   help="dense layers: local (Megatron's local spec), transformer_engine (its TE "
                        "spec) or auto (TE where installed, on GPU)")
    p.add_argument("--fp8-recipe", default=None, metavar="RECIPE",
                   help="store the layers' GEMM weights in FP8 and run them in FP8 with this "
                        "Megatron recipe: tensorwise or blockwise (needs Transformer Engine, GPU)")
    p.add_argument("--fp8-format", default="hybrid", metavar="FORMAT",
                   help="Megatron's FP8 format with --fp8-recipe: hybrid or e4m3")


def finish_model_flags(args) -> None:
    """:func:`add_model_flags`' defaults, and the combinations it refuses (:class:`JobError`)."""
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    if args.model and (args.load or args.hf or args.model_config):
        raise JobError("--model is a preset with seeded weights: not with --load / --hf / --model-config")
    if args.hf and args.model_config:
        raise JobError("--hf takes the architecture from the folder's config.json: not with --model-config")


MAX_TIMEOUT_S = 10**9
"""The longest ``--timeout`` (about 30 years): torch's collectives take it as a ``timedelta``."""


def launcher_problems(args) -> List[str]:
    """The flags both launchers take beside the model's: ``--timeout`` and ``--seed``."""
    problems = []
    if not 0 < args.timeout <= MAX_TIMEOUT_S:
        problems.append(f"--timeout {args.timeout}: must be positive (seconds) and at most {MAX_TIMEOUT_S}")
    if not -2**63 <= args.seed < 2**63:
        problems.append(f"--seed {args.seed}: must fit in 64 bits (signed)")
    return problems


def output_file_problem(flag: str, path: str) -> Optional[str]:
    """Why the file ``path`` cannot be written when the run ends, or None: asked now, so that
    no run ends without its output."""
    target = Path(path)
    if target.is_dir():
        return f"{flag} {path}: a directory, not a file"
    folder = target.parent
    if not folder.is_dir():
        return f"{flag} {path}: its directory {folder} does not exist"
    try:  # written to once (a permission check would pass root anywhere)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        return f"{flag} {path}: {folder} cannot be written ({err.strerror or err})"
    return None


def kv_memory_problem(flag: str, kv_tokens: int, preset: ModelPreset, tp: int, dtype: str,
                      processes: int) -> Optional[str]:
    """On CPU, where every rank of the pool runs on this host: why ``kv_tokens`` per node
    cannot be allocated (more KV than the host's memory), or None."""
    elem = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    per_rank = kv_tokens * preset.num_layers * 2 * preset.local_kv_heads(tp) * preset.kv_channels * elem
    total = per_rank * processes
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if total > host:
        return (f"{flag} {kv_tokens}: {total / 2**30:.1f} GiB of KV cache in the {processes} processes on this "
                f"host, more than its {host / 2**30:.1f} GiB of memory")
    return None


BLOCK_TABLE_MAX_BYTES = 2**30


def block_table_problem(limit: int, block_size: int, max_requests: int) -> Optional[str]:
    """Why a rank's block table (a row of ``ceil(limit / block_size)`` int32 block ids per
    request slot, one more for padding) for requests up to ``limit`` tokens is no table to
    allocate: over :data:`BLOCK_TABLE_MAX_BYTES`; or None."""
    blocks = -(-limit // block_size)
    size = (max_requests + 1) * blocks * 4
    if size <= BLOCK_TABLE_MAX_BYTES:
        return None
    return (f"requests of up to {limit} tokens in {block_size}-token blocks: a block table of "
            f"{size / 2**30:.1f} GiB on every rank ({max_requests + 1} request slots x {blocks} blocks), "
            f"over {BLOCK_TABLE_MAX_BYTES // 2**30} GiB; bound the length with --max-sequence-length")


def dense_format(args):
    """The dense layers the flags ask for (see :mod:`tknp_megatron.models.precision`)."""
    from tknp_megatron.models.precision import DenseFormat

    return DenseFormat(args.transformer_impl, args.fp8_recipe, args.fp8_format)


def check_launch(args, shape: str, world: int) -> None:
    """GPU runs go under torchrun, whose WORLD_SIZE must be the pool shape's ``world``
    (``shape`` names its flags, e.g. ``--nodes 2 --tp 1``)."""
    if args.device == "cuda" and "RANK" not in os.environ:
        raise JobError("--device cuda: runs under torchrun, one process per GPU")
    if "RANK" in os.environ and int(os.environ["WORLD_SIZE"]) != world:
        raise JobError(f"{shape}: their product must equal torchrun's WORLD_SIZE "
                       f"{os.environ['WORLD_SIZE']}")
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if "RANK" in os.environ and per_host % args.tp:
        raise JobError(f"--tp {args.tp}: a node's TP group stays on one host, so it must divide "
                       f"torchrun's --nproc-per-node {per_host}")


def rank_device(args, rank: int) -> torch.device:
    """This rank's device: LOCAL_RANK's GPU (bound first, before NCCL starts) or the CPU."""
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def check_flags(args, preset: ModelPreset) -> None:
    """The numeric flags, and the pool shape against the model."""
    positive = [("--requests", args.requests), ("--output-len", args.output_len),
                ("--block-size", args.block_size)]
    if args.kv_tokens_per_node is not None:
        positive.append(("--kv-tokens-per-node", args.kv_tokens_per_node))
    problems = [f"{flag} {value}: must be at least 1" for flag, value in positive if value < 1]
    kv = args.kv_tokens_per_node
    if kv is not None and 1 <= kv < args.block_size:
        problems.append(f"--kv-tokens-per-node {kv}: must hold at least one block (--block-size {args.block_size})")
    elif kv is not None and kv >= 1 and args.device == "cpu":
        problem = kv_memory_problem("--kv-tokens-per-node", kv, preset, args.tp, args.dtype,
                                    args.nodes * args.tp)
        problems += [problem] if problem else []
    lo, hi = args.prompt_len
    if not 1 <= lo <= hi:
        problems.append(f"--prompt-len {lo} {hi}: needs 1 <= MIN <= MAX")
    problems += launcher_problems(args)
    if args.json:
        problem = output_file_problem("--json", args.json)
        problems += [problem] if problem else []
    problems += [f"--{p}" for p in pool_problems(preset, args.nodes, args.tp)]
    problems += dense_format(args).problems(args.device)
    if args.attention_backend is not None:
        from tknp_megatron.attention import available_backends

        usable = available_backends(args.device)
        if args.attention_backend not in usable:
            problems.append(f"--attention-backend {args.attention_backend}: not usable on "
                            f"{args.device}; choose one of {', '.join(usable)}")
    if problems:
        raise JobError("; ".join(problems))


def load_tokenizer(args, preset: ModelPreset) -> Optional[Tokenizer]:
    """``--tokenizer DIR``, checked against the model's vocabulary."""
    if not args.tokenizer:
        return None
    if not os.path.isdir(args.tokenizer):
        raise JobError(f"--tokenizer {args.tokenizer}: no such directory")
    try:
        tokenizer = Tokenizer(args.tokenizer)
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises plain Exception
        raise JobError(f"--tokenizer {args.tokenizer}: not a tokenizer folder ({err})") from None
    if tokenizer.vocab_size > preset.vocab_size:
        raise JobError(f"--tokenizer {args.tokenizer}: {tokenizer.vocab_size} ids, more than the "
                       f"model's vocab_size {preset.vocab_size}")
    return tokenizer


def _read_prompts_file(path: str, tokenizer: Optional[Tokenizer]) -> list:
    what = "token-id lists or strings" if tokenizer else "token-id lists"
    if not os.path.isfile(path):
        raise JobError(f"--prompts-file {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            prompts = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise JobError(f"--prompts-file {path}: not JSON ({err}); expected a list of {what}") from None
    if not isinstance(prompts, list) or not prompts:
        raise JobError(f"--prompts-file {path}: expected a non-empty JSON list of {what}")
    for i, p in enumerate(prompts):
        ids = isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        if not (ids or (tokenizer is not None and isinstance(p, str))):
            raise JobError(f"--prompts-file {path}: prompt {i} is {json.dumps(p)[:40]}; expected "
                           f"{what[:-1]}")
    return prompts


def make_prompts(args, preset: ModelPreset, tokenizer: Optional[Tokenizer]) -> List[List[int]]:
    """``--prompt`` texts, ``--prompts-file``, or seeded random prompts of mixed lengths;
    every prompt non-empty with ids inside the model's vocabulary."""
    if not (args.prompt or args.prompts_file):
        gen = torch.Generator().manual_seed(args.seed)
        lo, hi = args.prompt_len
        lengths = torch.randint(lo, hi + 1, (args.requests,), generator=gen).tolist()
        return [torch.randint(0, preset.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    source = "--prompt" if args.prompt else f"--prompts-file {args.prompts_file}"
    raw = args.prompt or _read_prompts_file(args.prompts_file, tokenizer)
    prompts = [tokenizer.encode(x) if isinstance(x, str) else x for x in raw]
    for i, ids in enumerate(prompts):
        if not ids:
            raise JobError(f"{source}: prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < preset.vocab_size]
        if bad:
            raise JobError(f"{source}: prompt {i} has token id {bad[0]}, outside the vocabulary "
                           f"[0, {preset.vocab_size})")
    return prompts


def default_kv_budget(args, prompts) -> int:
    """Half the offered reservations per node (>= the largest request): >= 2 waves."""
    from tknp_megatron.engine.kv_budget import waves_budget

    return waves_budget([len(p) + args.output_len for p in prompts], args.nodes, args.block_size)
