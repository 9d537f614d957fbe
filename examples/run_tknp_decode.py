"""Main job: TKNP decode on an N x T pool, checked against the non-TKNP reference.

With no arguments (CPU): 2 nodes x TP2 = 4 gloo processes, the ``tiny`` preset with
seeded weights, 16 requests of mixed prompt lengths, a KV budget that forces at least
two admission waves, greedy decoding, then the reference (Megatron's GPTModel on one
rank, full recompute) on the same weights, and a summary table.

On GPUs, one process per GPU under torchrun::

    torchrun --nproc-per-node 2 examples/run_tknp_decode.py --device cuda --nodes 2 --tp 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tknp_megatron.config import dtype_from_name, get_preset  # noqa: E402
from tknp_megatron.launch import init_distributed, spawn  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="token-parallel nodes N")
    p.add_argument("--tp", type=int, default=2, help="TP ranks per node T")
    p.add_argument("--model", default="tiny", help="model preset")
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
    p.add_argument("--prompts-file", default=None, help="JSON list of token-id lists")
    p.add_argument("--no-reference", action="store_true", help="skip the reference run")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung pool fails")
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    return args


def make_prompts(args) -> List[List[int]]:
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts = json.load(f)
        if not isinstance(prompts, list) or not all(isinstance(x, list) for x in prompts):
            raise SystemExit(f"{args.prompts_file}: expected a JSON list of token-id lists")
        return prompts
    gen = torch.Generator().manual_seed(args.seed)
    vocab = get_preset(args.model).vocab_size
    lo, hi = args.prompt_len
    lengths = torch.randint(lo, hi + 1, (args.requests,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def default_kv_budget(args, prompts) -> int:
    """Half the offered reservations per node (>= the largest request): >= 2 waves."""
    need = [len(p) + args.output_len for p in prompts]
    half = math.ceil(sum(need) / (2 * args.nodes))
    blocks = math.ceil(max(half, max(need)) / args.block_size)
    return blocks * args.block_size


@dataclass(frozen=True)
class Job:
    args: argparse.Namespace
    prompts: List[List[int]]
    kv_tokens: Optional[int]


def _device(args, rank: int) -> torch.device:
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def run_tknp(job: Job, device: torch.device):
    import parallel_state as ps
    from tknp_megatron.engine import EngineConfig, TKNPInferenceEngine
    from tknp_megatron.model import build_rank_model
    from tknp_megatron.placement import balanced_placement
    from tknp_megatron.sampling import SamplingParams
    from tknp_megatron.weights import fill_seeded_

    args = job.args
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, token_parallel_size=args.nodes)
    preset = get_preset(args.model)
    placement = balanced_placement(preset, args.nodes)
    model = build_rank_model(preset, placement, groups, dtype_from_name(args.dtype), device)
    fill_seeded_(model, preset, args.seed)
    config = EngineConfig(
        block_size=args.block_size, kv_tokens_per_node=job.kv_tokens, policy=args.policy,
        attention_backend=args.attention_backend, record_logits=not args.no_reference,
    )
    engine = TKNPInferenceEngine(model, preset, placement, groups, config, device)
    results = engine.generate(job.prompts, SamplingParams(max_new_tokens=args.output_len))
    summary = None
    if groups.is_coordinator:
        summary = dict(metrics=engine.metrics(), capacity=engine.kv_capacity_tokens,
                       peak=engine.peak_kv_tokens, placement=placement.describe())
    ps.destroy_model_parallel()
    return results, summary


def run_reference(job: Job, device: torch.device):
    """Rank 0 alone: Megatron's GPTModel, TP=1, same seeded weights."""
    from megatron.core import parallel_state as mpu
    from tknp_megatron.reference import build_reference_model, reference_generate
    from tknp_megatron.sampling import SamplingParams
    from tknp_megatron.weights import fill_seeded_

    args = job.args
    mpu.initialize_model_parallel(1)
    out = None
    if dist.get_rank() == 0:
        preset = get_preset(args.model)
        model = build_reference_model(preset, dtype_from_name(args.dtype), device)
        fill_seeded_(model, preset, args.seed)
        params = [SamplingParams(max_new_tokens=args.output_len)] * len(job.prompts)
        out = reference_generate(model, preset, job.prompts, params)
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

    return build_report(job.args, job.prompts, results, summary, reference)


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = make_prompts(args)
    kv = args.kv_tokens_per_node
    if kv is None and args.device == "cpu":
        kv = default_kv_budget(args, prompts)
    job = Job(args, prompts, kv)
    world = args.nodes * args.tp
    if "RANK" in os.environ:  # torchrun
        rank = int(os.environ["RANK"])
        if int(os.environ["WORLD_SIZE"]) != world:
            raise SystemExit(f"WORLD_SIZE {os.environ['WORLD_SIZE']} != nodes x tp = {world}")
        _device(args, rank)  # bind the GPU before NCCL starts
        init_distributed("nccl" if args.device == "cuda" else "gloo", rank, world, args.timeout)
        report = worker(rank, world, job)
        dist.destroy_process_group()
    else:
        if args.device == "cuda":
            raise SystemExit("--device cuda runs under torchrun (one process per GPU)")
        report = spawn(worker, world, (job,), timeout_s=args.timeout)[0]
    if report is not None:
        from report import print_report, write_json

        print_report(report)
        if args.json:
            write_json(report, args.json)
        exact = args.dtype == "float32"  # bf16 reports match rate and logit gap instead
        return 1 if exact and report["match_reference"] is False else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
