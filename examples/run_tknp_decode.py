"""Main job: TKNP decode on an N x T pool, checked against the non-TKNP reference.

With no arguments (CPU): 2 nodes x TP2 = 4 gloo processes, the ``tiny`` preset with
seeded weights, 16 requests of mixed prompt lengths, a KV budget that forces at least
two admission waves, greedy decoding, then the reference (Megatron's GPTModel on one
rank, full recompute) on the same weights, and a summary table.

On GPUs, one process per GPU under torchrun::

    torchrun --nproc-per-node 2 examples/run_tknp_decode.py --device cuda --nodes 2 --tp 1

Real models and text::

    --load DIR            a Megatron-Core torch_dist checkpoint (any TP / PP it was saved at);
                          every TKNP rank reads only its own blocks, the reference reads it too
    --hf DIR              a Hugging Face Llama or Nemotron folder, converted once (before the
                          pool starts, or on rank 0 under torchrun) into a temporary checkpoint,
                          then --load
    --model-config FILE   architecture as JSON (TransformerConfig field names + GPTModel args);
                          without --load: seeded weights of that architecture. With --load it
                          defaults to DIR/model_config.json, else Megatron-LM's stored args
    --tokenizer DIR       Hugging Face tokenizer folder (local files only); its EOS stops
                          generation and the report decodes the outputs ("texts" in the JSON)
    --prompt TEXT         a text prompt (repeatable; needs --tokenizer)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist

# Megatron warns at import when Apex / Transformer Engine are absent (always, on CPU).
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed")

from tknp_megatron.config import ModelPreset, dtype_from_name, get_preset  # noqa: E402
from tknp_megatron.launch import init_distributed, spawn  # noqa: E402
from tknp_megatron.models.tokenizer import Tokenizer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="token-parallel nodes N")
    p.add_argument("--tp", type=int, default=2, help="TP ranks per node T")
    p.add_argument("--model", default=None, help="model preset (default tiny, seeded weights)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(4, 48), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=12, help="max new tokens per request")
    p.add_argument("--kv-tokens-per-node", type=int, default=None,
                   help="KV budget per node (default: half the offered load, so >= 2 waves)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policy", choices=("usage", "reserved"), default="usage")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    p.add_argument("--prompts-file", default=None,
                   help="JSON list of token-id lists (or of strings, with --tokenizer)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--load", default=None, metavar="DIR", help="Megatron dist checkpoint")
    src.add_argument("--hf", default=None, metavar="DIR",
                     help="Hugging Face Llama / Nemotron folder")
    p.add_argument("--model-config", default=None, metavar="FILE", help="model JSON")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="HF tokenizer folder")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="text prompt (repeatable; needs --tokenizer)")
    p.add_argument("--no-reference", action="store_true", help="skip the reference run")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung pool fails")
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    if args.prompt and not args.tokenizer:
        p.error("--prompt needs --tokenizer")
    if args.prompt and args.prompts_file:
        p.error("--prompt and --prompts-file: choose one")
    if args.model and (args.load or args.hf or args.model_config):
        p.error("--model is a preset with seeded weights: not with --load / --hf / --model-config")
    if args.hf and args.model_config:
        p.error("--hf takes the architecture from the folder's config.json")
    return args


# ----------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class ModelSource:
    """What the pool serves.

    Attributes:
        preset: the architecture.
        checkpoint: torch_dist directory every rank loads from; None = seeded weights.
        padded_vocab: the checkpoint's embedding rows (None: the default padding).
        weights: where the weights come from, for the report.
    """

    preset: ModelPreset
    checkpoint: Optional[str] = None
    padded_vocab: Optional[int] = None
    weights: str = ""


def convert_worker(rank: int, world: int, hf_dir: str, out_dir: str, dtype: str) -> None:
    """One-process pool: HF Llama / Nemotron folder -> torch_dist checkpoint + model_config."""
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


def convert_hf(args, out_dir: str) -> None:
    """``--hf`` -> a torch_dist checkpoint in ``out_dir``, in a one-process pool."""
    with _outside_torchrun():
        spawn(convert_worker, 1, (args.hf, out_dir, args.dtype), timeout_s=args.timeout)


@contextlib.contextmanager
def checkpoint_dir(args) -> Iterator[Optional[str]]:
    """The checkpoint to serve: ``--load``, ``--hf`` converted into a temporary directory
    (removed on exit; under torchrun rank 0 converts, so ranks must share a filesystem),
    or None."""
    if not args.hf:
        yield args.load
        return
    distributed = dist.is_initialized()
    with contextlib.ExitStack() as stack:
        path = None
        if not distributed or dist.get_rank() == 0:
            path = stack.enter_context(tempfile.TemporaryDirectory(prefix="tknp-hf-"))
            convert_hf(args, path)
        if distributed:
            box = [path]
            dist.broadcast_object_list(box, src=0, device=_object_device(args))
            path = box[0]
        yield path


def _model_config(path: str) -> ModelPreset:
    from tknp_megatron.models.model_config import load_model_config

    try:
        return load_model_config(path)[0]  # params_dtype is the file's; --dtype serves
    except (ValueError, KeyError) as err:
        raise SystemExit(f"{path}: {err}") from None


def _checkpoint_preset(ckpt: str) -> ModelPreset:
    """``ckpt/model_config.json`` (written by the HF converter), else Megatron-LM's args."""
    from tknp_megatron.models.checkpoint import read_checkpoint_args
    from tknp_megatron.models.model_config import preset_from_checkpoint_args

    config = os.path.join(ckpt, "model_config.json")
    if os.path.exists(config):
        return _model_config(config)
    stored = read_checkpoint_args(ckpt)
    if stored is None:
        raise SystemExit(f"{ckpt}: no model_config.json and no Megatron-LM args; "
                         "pass --model-config FILE")
    return preset_from_checkpoint_args(stored, name=os.path.basename(os.path.normpath(ckpt)))


def resolve_model(args, ckpt: Optional[str]) -> ModelSource:
    """The preset (``--model-config``, the checkpoint's own config, or ``--model``) and,
    for a checkpoint, its padded vocabulary."""
    if args.model_config:
        preset = _model_config(args.model_config)
    elif ckpt:
        preset = _checkpoint_preset(ckpt)
    else:
        preset = get_preset(args.model or "tiny")
    if ckpt is None:
        return ModelSource(preset, weights=f"seeded (seed {args.seed})")
    from tknp_megatron.models.checkpoint import checkpoint_padded_vocab_size

    vocab = checkpoint_padded_vocab_size(ckpt)
    if vocab < preset.vocab_size:
        raise SystemExit(f"{ckpt}: {vocab} embedding rows < vocab_size {preset.vocab_size}")
    origin = f"HF {args.hf} (converted)" if args.hf else f"checkpoint {ckpt}"
    return ModelSource(preset, ckpt, vocab, origin)


def _weights(source: ModelSource, seed: int):
    """The checkpoint (its load is collective: every rank calls it), else the seed."""
    return source.checkpoint or seed


# ----------------------------------------------------------------------------- the prompts
def _read_prompts_file(path: str, tokenizer: Optional[Tokenizer]) -> List:
    with open(path, encoding="utf-8") as f:
        prompts = json.load(f)
    ok = isinstance(prompts, list) and all(
        isinstance(x, list) or (tokenizer is not None and isinstance(x, str)) for x in prompts
    )
    if not ok:
        what = "token-id lists or strings" if tokenizer else "token-id lists"
        raise SystemExit(f"{path}: expected a JSON list of {what}")
    return prompts


def make_prompts(args, preset: ModelPreset, tokenizer: Optional[Tokenizer]) -> List[List[int]]:
    """``--prompt`` texts, ``--prompts-file``, or seeded random prompts of mixed lengths."""
    if args.prompt or args.prompts_file:
        raw = args.prompt or _read_prompts_file(args.prompts_file, tokenizer)
        return [tokenizer.encode(x) if isinstance(x, str) else x for x in raw]
    gen = torch.Generator().manual_seed(args.seed)
    lo, hi = args.prompt_len
    lengths = torch.randint(lo, hi + 1, (args.requests,), generator=gen).tolist()
    return [torch.randint(0, preset.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def default_kv_budget(args, prompts) -> int:
    """Half the offered reservations per node (>= the largest request): >= 2 waves."""
    need = [len(p) + args.output_len for p in prompts]
    half = math.ceil(sum(need) / (2 * args.nodes))
    blocks = math.ceil(max(half, max(need)) / args.block_size)
    return blocks * args.block_size


# ----------------------------------------------------------------------------- the job
@dataclass(frozen=True)
class Job:
    """Everything the ranks need (pickled to spawned workers)."""

    args: argparse.Namespace
    model: ModelSource
    prompts: List[List[int]]
    kv_tokens: Optional[int]
    eos_id: Optional[int] = None

    def sampling(self):
        from tknp_megatron.sampling import SamplingParams

        return SamplingParams(max_new_tokens=self.args.output_len, eos_id=self.eos_id)


def build_job(args, ckpt: Optional[str], tokenizer: Optional[Tokenizer]) -> Job:
    model = resolve_model(args, ckpt)
    if tokenizer is not None and tokenizer.vocab_size > model.preset.vocab_size:
        raise SystemExit(f"tokenizer has {tokenizer.vocab_size} ids, the model's vocab_size "
                         f"is {model.preset.vocab_size}")
    prompts = make_prompts(args, model.preset, tokenizer)
    kv = args.kv_tokens_per_node
    if kv is None and args.device == "cpu":
        kv = default_kv_budget(args, prompts)
    return Job(args, model, prompts, kv, tokenizer.eos_id if tokenizer else None)


def _device(args, rank: int) -> torch.device:
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _object_device(args) -> Optional[torch.device]:
    """Object collectives run on the GPU under NCCL."""
    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else None


def run_tknp(job: Job, device: torch.device):
    import parallel_state as ps
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import Mode, build_engine

    args, preset = job.args, job.model.preset
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, token_parallel_size=args.nodes)
    config = EngineConfig(
        block_size=args.block_size, kv_tokens_per_node=job.kv_tokens, policy=args.policy,
        attention_backend=args.attention_backend, record_logits=not args.no_reference,
    )
    # a checkpoint: each rank reads only its own blocks
    engine = build_engine(Mode.TKNP, preset, groups, config, device, dtype_from_name(args.dtype),
                          weights=_weights(job.model, args.seed), padded_vocab=job.model.padded_vocab)
    results = engine.generate(job.prompts, job.sampling())
    summary = None
    if groups.is_coordinator:
        summary = dict(metrics=engine.metrics(), capacity=engine.kv_capacity_tokens,
                       peak=engine.peak_kv_tokens, placement=engine.placement.describe())
    ps.destroy_model_parallel()
    return results, summary


def run_reference(job: Job, device: torch.device):
    """Rank 0 generates: Megatron's GPTModel, TP=1, same weights. A checkpoint load is
    collective, so then every rank builds and loads the full model."""
    from megatron.core import parallel_state as mpu

    from tknp_megatron.engine.factory import load_weights
    from tknp_megatron.models.reference import build_reference_model, reference_generate

    source, args = job.model, job.args
    mpu.initialize_model_parallel(1)
    out = None
    if source.checkpoint or dist.get_rank() == 0:
        model = build_reference_model(source.preset, dtype_from_name(args.dtype), device,
                                      vocab_size=source.padded_vocab)
        load_weights(model, source.preset, _weights(source, args.seed))
        if dist.get_rank() == 0:
            params = [job.sampling()] * len(job.prompts)
            out = reference_generate(model, source.preset, job.prompts, params)
    dist.barrier()
    mpu.destroy_model_parallel()
    return out


def worker(rank: int, world: int, job: Job):
    """Everything one rank does; returns the report on rank 0."""
    warnings.simplefilter("ignore")  # Megatron warns about missing Apex / TE at import
    device = _device(job.args, rank)
    results, summary = run_tknp(job, device)
    reference = None if job.args.no_reference else run_reference(job, device)
    if rank != 0:
        return None
    from report import build_report  # examples/report.py

    return build_report(job.args, job.prompts, results, summary, reference,
                        model=job.model.preset.name, weights=job.model.weights)


def run_torchrun(args, tokenizer: Optional[Tokenizer]):
    """This process's part of a torchrun launch; the report on rank 0."""
    rank, world = int(os.environ["RANK"]), args.nodes * args.tp
    if int(os.environ["WORLD_SIZE"]) != world:
        raise SystemExit(f"WORLD_SIZE {os.environ['WORLD_SIZE']} != nodes x tp = {world}")
    _device(args, rank)  # bind the GPU before NCCL starts
    init_distributed("nccl" if args.device == "cuda" else "gloo", rank, world, args.timeout)
    with checkpoint_dir(args) as ckpt:
        report = worker(rank, world, build_job(args, ckpt, tokenizer))
        dist.barrier()  # every rank is done with the checkpoint before rank 0 removes it
    dist.destroy_process_group()
    return report


def run_local(args, tokenizer: Optional[Tokenizer]):
    """Spawn an N x T gloo pool here; the report."""
    if args.device == "cuda":
        raise SystemExit("--device cuda runs under torchrun (one process per GPU)")
    with checkpoint_dir(args) as ckpt:
        job = build_job(args, ckpt, tokenizer)
        return spawn(worker, args.nodes * args.tp, (job,), timeout_s=args.timeout)[0]


def main(argv=None) -> int:
    args = parse_args(argv)
    tokenizer = Tokenizer(args.tokenizer) if args.tokenizer else None
    if "RANK" in os.environ:  # torchrun
        report = run_torchrun(args, tokenizer)
    else:
        report = run_local(args, tokenizer)
    if report is None:
        return 0
    from report import add_texts, print_report, write_json

    if tokenizer is not None:
        add_texts(report, tokenizer.decode)
    print_report(report)
    if args.json:
        write_json(report, args.json)
    exact = args.dtype == "float32"  # bf16 reports match rate and logit gap instead
    return 1 if exact and report["match_reference"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
