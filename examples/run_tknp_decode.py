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
    --hf DIR              a Hugging Face Llama / Mistral / Qwen2 / Nemotron folder, converted
                          once (before the pool starts, or on rank 0 under torchrun) into a
                          temporary checkpoint, then --load
    --model-config FILE   architecture as JSON (TransformerConfig field names + GPTModel args);
                          without --load: seeded weights of that architecture. With --load it
                          defaults to DIR/model_config.json, else Megatron-LM's stored args
    --tokenizer DIR       Hugging Face tokenizer folder (local files only); its EOS stops
                          generation and the report decodes the outputs ("texts" in the JSON)
    --prompt TEXT         a text prompt (repeatable; needs --tokenizer)

Every flag and file is checked before any process starts: a mistake is one line on
stderr naming it, the value and what is allowed, and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

# Megatron warns at import when Apex / Transformer Engine are absent (always, on CPU).
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed")

from job_inputs import (  # noqa: E402
    JobError,
    add_model_flags,
    check_flags,
    check_launch,
    default_kv_budget,
    dense_format,
    finish_model_flags,
    load_tokenizer,
    make_prompts,
    rank_device,
)

from tknp_megatron.cli import ArgumentParser  # noqa: E402
from tknp_megatron.config import dtype_from_name  # noqa: E402
from tknp_megatron.launch import init_distributed, spawn  # noqa: E402
from tknp_megatron.models.source import (  # noqa: E402
    ModelSource,
    SourceError,
    converted_checkpoint,
    converted_on_each_host,
    resolve_source,
)
from tknp_megatron.models.tokenizer import Tokenizer  # noqa: E402


PROG = "run_tknp_decode.py"


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="token-parallel nodes N")
    p.add_argument("--tp", type=int, default=2, help="TP ranks per node T")
    add_model_flags(p)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(4, 48), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=12, help="max new tokens per request")
    p.add_argument("--kv-tokens-per-node", type=int, default=None,
                   help="KV budget per node (default: half the offered load, so >= 2 waves)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policy", choices=("usage", "reserved"), default="usage")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts-file", default=None,
                   help="JSON list of token-id lists (or of strings, with --tokenizer)")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="text prompt (repeatable; needs --tokenizer)")
    p.add_argument("--no-reference", action="store_true", help="skip the reference run")
    p.add_argument("--json", default=None, help="write the results here (strict JSON)")
    p.add_argument("--show", type=int, default=4, metavar="N",
                   help="print the first N requests' output (text with --tokenizer, else ids)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung pool fails")
    args = p.parse_args(argv)
    finish_model_flags(args)
    if args.prompt and not args.tokenizer:
        raise JobError("--prompt needs --tokenizer")
    if args.prompt and args.prompts_file:
        raise JobError("--prompt and --prompts-file: choose one")
    return args


# ----------------------------------------------------------------------------- the job
@dataclass(frozen=True)
class Job:
    """Everything the ranks need (pickled to spawned workers)."""

    args: argparse.Namespace
    model: ModelSource
    prompts: List[List[int]]
    kv_tokens: Optional[int]
    eos_id: Optional[int] = None
    stop_ids: Tuple[int, ...] = ()  # the tokenizer's other end-of-sequence ids

    def sampling(self):
        from tknp_megatron.sampling import SamplingParams

        return SamplingParams(max_new_tokens=self.args.output_len, eos_id=self.eos_id,
                              stop_sequences=tuple((i,) for i in self.stop_ids))

    @property
    def progress(self) -> bool:
        """Progress lines: on a terminal, unless ``--quiet``."""
        return not self.args.quiet and sys.stderr.isatty()


def prepare_job(args) -> Job:
    """Resolve and check every input (no process started); :class:`JobError` or
    :class:`SourceError` names the first bad one."""
    source = resolve_source(args.model, args.load, args.hf, args.model_config, args.seed)
    check_flags(args, source.preset)
    tokenizer = load_tokenizer(args, source.preset)
    prompts = make_prompts(args, source.preset, tokenizer)
    kv = args.kv_tokens_per_node
    if kv is None and args.device == "cpu":
        kv = default_kv_budget(args, prompts)
    return Job(args, source, prompts, kv, tokenizer.eos_id if tokenizer else None,
               tokenizer.stop_ids if tokenizer else ())


def _weights(source: ModelSource, seed: int):
    """The checkpoint (its load is collective: every rank calls it), else the seed."""
    return source.checkpoint or seed


def run_tknp(job: Job, device: torch.device):
    import parallel_state as ps
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import Mode, build_engine

    args, preset = job.args, job.model.preset
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, token_parallel_size=args.nodes)
    # the job knows its requests: the engine serves up to the longest of them (its block
    # tables sized for that, not for the model's limit, which may be far longer)
    longest = min(preset.gpt.max_sequence_length, max(len(p) for p in job.prompts) + args.output_len)
    config = EngineConfig(
        block_size=args.block_size, kv_tokens_per_node=job.kv_tokens, policy=args.policy,
        attention_backend=args.attention_backend, record_logits=not args.no_reference,
        max_sequence_length=longest,
    )
    # a checkpoint: each rank reads only its own blocks
    engine = build_engine(Mode.TKNP, preset, groups, config, device, dtype_from_name(args.dtype),
                          weights=_weights(job.model, args.seed), padded_vocab=job.model.padded_vocab,
                          dense=dense_format(args))
    bar = _bar(job, groups.is_coordinator, len(job.prompts), "TKNP")
    results = engine.generate(job.prompts, job.sampling(), progress=bar.update if bar else None)
    stored = [0] * dist.get_world_size()  # every rank's parameter bytes, as allocated
    dist.all_gather_object(stored, engine.weight_bytes)
    summary = None
    if groups.is_coordinator:
        per_node = [sum(stored[groups.global_rank(n, t)] for t in range(args.tp))
                    for n in range(args.nodes)]
        summary = dict(metrics=engine.metrics(), capacity=engine.kv_capacity_tokens,
                       peak=engine.peak_kv_tokens, placement=engine.placement.describe(),
                       weight_bytes=per_node, dense=dense_format(args).resolved(device).describe())
    _close(bar)
    del engine  # first its CUDA graphs (see parallel_state.destroy_model_parallel)
    ps.destroy_model_parallel()
    return results, summary


def run_reference(job: Job, device: torch.device, accepted: List[int]):
    """Rank 0 generates the ``accepted`` requests: Megatron's GPTModel, TP=1, same
    weights. A checkpoint load is collective, so then every rank builds and loads it."""
    from megatron.core import parallel_state as mpu

    from tknp_megatron.engine.factory import load_weights
    from tknp_megatron.models.reference import (
        build_reference_model,
        reference_generate,
        reference_to_fp8,
    )

    source, args = job.model, job.args
    mpu.initialize_model_parallel(1)
    out = None
    if source.checkpoint or dist.get_rank() == 0:
        dense = dense_format(args)
        model = build_reference_model(source.preset, dtype_from_name(args.dtype), device,
                                      vocab_size=source.padded_vocab, dense=dense)
        load_weights(model, source.preset, _weights(source, args.seed))
        if dense.fp8:  # quantized as the TKNP ranks quantize theirs
            model = reference_to_fp8(model, source.preset)
        if dist.get_rank() == 0:
            bar = _bar(job, True, len(accepted), "reference")
            prompts = [job.prompts[i] for i in accepted]
            out = dict(zip(accepted, reference_generate(model, source.preset, prompts,
                                                        [job.sampling()] * len(prompts))))
            _close(bar)
    dist.barrier()
    mpu.destroy_model_parallel()
    return out


def _bar(job: Job, show: bool, total: int, what: str):
    """A progress line on stderr (rank 0, a terminal, not --quiet), else None."""
    if not (show and job.progress):
        return None
    from report import Progress  # examples/report.py

    return Progress(what, total)


def _close(bar) -> None:
    if bar is not None:
        bar.close()


def worker(rank: int, world: int, job: Job):
    """Everything one rank does; returns the report on rank 0."""
    warnings.simplefilter("ignore")  # Megatron warns about missing Apex / TE at import
    device = rank_device(job.args, rank)
    results, summary = run_tknp(job, device)
    reference = None
    if not job.args.no_reference:  # the reference serves what the pool accepted
        accepted = [i for i, r in enumerate(results) if r.status.value != "rejected"]
        reference = run_reference(job, device, accepted)
    if rank != 0:
        return None
    from report import build_report  # examples/report.py

    return build_report(job.args, job.prompts, results, summary, reference,
                        model=job.model.preset.name, weights=job.model.weights)


def run_torchrun(job: Job):
    """This process's part of a torchrun launch; the report on rank 0."""
    args = job.args
    rank, world = int(os.environ["RANK"]), args.nodes * args.tp
    rank_device(args, rank)  # bind the GPU before NCCL starts
    init_distributed("nccl" if args.device == "cuda" else "gloo", rank, world, args.timeout)
    with converted_on_each_host(job.model, args.dtype, args.timeout) as source:
        report = worker(rank, world, Job(args, source, job.prompts, job.kv_tokens, job.eos_id, job.stop_ids))
    dist.destroy_process_group()
    return report


def run_local(job: Job):
    """Spawn an N x T gloo pool here; the report."""
    args = job.args
    with converted_checkpoint(job.model, args.dtype, args.timeout) as source:
        job = Job(args, source, job.prompts, job.kv_tokens, job.eos_id, job.stop_ids)
        return spawn(worker, args.nodes * args.tp, (job,), timeout_s=args.timeout)[0]


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        check_launch(args, f"--nodes {args.nodes} --tp {args.tp}", args.nodes * args.tp)
        job = prepare_job(args)
    except (JobError, SourceError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    report = run_torchrun(job) if "RANK" in os.environ else run_local(job)
    if report is None:
        return 0
    from report import add_texts, print_report, write_json

    if args.tokenizer:
        add_texts(report, Tokenizer(args.tokenizer).decode)
    print_report(report, show=args.show)
    if args.json:
        write_json(report, args.json)
    exact = args.dtype == "float32"  # bf16 reports match rate and logit gap instead
    return 1 if exact and report["match_reference"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
