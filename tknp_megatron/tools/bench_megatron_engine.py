#!/usr/bin/env python
"""Megatron-Core's own ``DynamicInferenceEngine`` on the serving benchmark's traces: the peer row.

The engine a Megatron user would run instead of this library, on the same model geometry,
the same seeded weights (``models/weights.fill_seeded_``, as every mode of
``tools/bench_serving.py`` gets them) and the same fixed-length traces (``--contexts`` x
``--batches``, ``--output-len``), greedy, no early stop. One process per GPU::

    python -m tknp_megatron.tools.bench_megatron_engine --model llama3.1-70b --layers 12 \\
        --contexts 8192 --batches 16 64 --output-len 128 --cuda-graphs --out $OUT/megatron.json

- TP: ``torchrun --nproc-per-node T ... --tp T`` (one engine over T GPUs, Megatron's TP).
- DP: R copies of the command, each on its own GPU, with ``--replicas R --replica-index i``:
  replica i serves requests ``i, i + R, ...`` of each trace, as R data-parallel engines do.

Megatron prefills the prompts itself, while ``bench_serving`` ingests their KV from outside
(a decode pool), so the comparable figures are the decode ones: ``decode_step_ms`` (median
wall time of one ``step_modern`` call, host work included, over the steps after every
request has its first token that decode the largest batch seen then, ``decode_batch``: the
whole trace unless the engine paused some; bench_serving's ``step_ms`` is its median
inter-token latency, the same quantity) and ``decode_tok_s`` (tokens / wall time over those
steps). Completion throughput including prefill is reported beside them. ``--max-tokens``
(one forward pass) must hold the longest prompt beside a token of each other request:
with less, Megatron admits a prompt only once every earlier request has finished.

Its paged attention is flash-attn's (FA4 ``flash_attn.cute.flash_attn_varlen_func`` when
``flash-attn-4`` is installed). flash-attn-4 4.0.0b36 refuses split-K on compute
capability 9.0, while Megatron asks for FA4's split heuristic (``num_splits=0``), which
splits when a decode batch has fewer (request, KV head) tiles than half the SMs; on such a
GPU ``--fa4-single-split`` (the default there) sets each attention module's
``batch_invariant_mode`` so that Megatron passes ``num_splits=1``, the only change made to
the engine. ``--no-fa4-single-split`` runs it unchanged.

Needs megatron-core >= 0.17 (its ``InferenceConfig``), CUDA and flash-attn; each missing
piece is refused in one line before anything is built. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional

from tknp_megatron.cli import ArgumentParser


__all__ = ["PeerRow", "kv_buffer_gib", "replica_requests", "trace_layout_problems", "main"]


@dataclass(frozen=True)
class PeerRow:
    """One trace served by Megatron's engine (all times in seconds unless named)."""

    engine: str
    tp: int
    replicas: int
    context: int
    batch: int
    output_len: int
    requests: int
    completed: int
    generated_tokens: int
    makespan_s: float
    completion_tok_s: float
    prefill_s: float
    decode_steps: int
    decode_step_ms: Optional[float]
    decode_tok_s: Optional[float]
    decode_batch: int  # requests in each decode-phase step (the trace's, unless some were paused)
    steps_after_prefill: int
    kv_buffer_gib: float
    block_size_tokens: int
    cuda_graphs: bool
    fa4_single_split: bool


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3.1-70b")
    p.add_argument("--layers", type=int, default=None, help="stack this many of the preset's layers")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192], help="prompt tokens per request")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64], help="requests per trace (all of a replica's resident)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--tp", type=int, default=1, help="Megatron TP size (the world size under torchrun)")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel replicas the trace is split over")
    p.add_argument("--replica-index", type=int, default=0)
    p.add_argument("--block-size-tokens", type=int, default=256, help="Megatron's KV block (its default 256)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per forward pass (default: Megatron's 16384, or the longest prompt plus a "
                        "token for each other request of the largest batch where that is more)")
    p.add_argument("--cuda-graphs", action="store_true", help="Megatron's local CUDA graphs, block scope")
    p.add_argument("--num-cuda-graphs", type=int, default=16)
    p.add_argument("--fa4-single-split", dest="fa4_single_split", action="store_true", default=None,
                   help="num_splits=1 for FA4 (default: on where FA4 has no split-K, compute capability 9.x)")
    p.add_argument("--no-fa4-single-split", dest="fa4_single_split", action="store_false")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    problems = trace_layout_problems(args)
    from tknp_megatron.analysis.bench_traces import model_problems

    problems += model_problems(args.model, args.layers)
    if args.output_len < 1:
        problems.append(f"--output-len {args.output_len}: must be >= 1")
    # Megatron prefills a prompt in one pass (no chunked prefill), beside a token of each
    # request decoding: a pass that holds only the prompt admits it once every earlier
    # request has finished, and the batch decodes one request at a time (seen at 32K)
    need = max(args.contexts) + max(args.batches) - 1
    if args.max_tokens is None:
        args.max_tokens = max(16384, need)
    if args.block_size_tokens < 1:
        problems.append(f"--block-size-tokens {args.block_size_tokens}: must be >= 1")
    if args.max_tokens < need:
        problems.append(f"--max-tokens {args.max_tokens}: must hold the longest prompt and a token of each "
                        f"other request of the largest batch ({max(args.contexts)} + {max(args.batches)} - 1 = "
                        f"{need}; no chunked prefill, and with less the batch decodes one request at a time)")
    if problems:
        p.error("; ".join(problems))
    return args


def environment_problems(tp: int) -> List[str]:
    """What this machine lacks to run Megatron's engine, one line each (nothing is built)."""
    import torch

    problems = []
    if not torch.cuda.is_available():
        problems.append("no CUDA device: Megatron's DynamicInferenceEngine runs on GPUs only")
    elif torch.cuda.device_count() < tp and "LOCAL_RANK" not in os.environ:
        problems.append(f"--tp {tp}: needs {tp} GPUs under torchrun, {torch.cuda.device_count()} visible")
    try:
        import megatron.core as mc
        from megatron.core.inference import config as _config  # noqa: F401  (0.17+)
    except ImportError as exc:
        problems.append(f"megatron-core >= 0.17 is needed for its InferenceConfig ({exc})")
        return problems
    try:
        from megatron.core.transformer import attention as matt
    except Exception as exc:  # e.g. an import that needs CUDA
        problems.append(f"megatron.core.transformer.attention does not import: {exc}")
        return problems
    if not (getattr(matt, "HAVE_FA4", False) or getattr(matt, "HAVE_FA3", False)
            or getattr(matt, "flash_attn_varlen_func", None) is not None):
        problems.append(f"megatron-core {mc.__version__}'s dynamic batching needs flash-attn (FA4, FA3 or "
                        "2.7.3+), none imports")
    return problems


def kv_buffer_gib(token_counts: List[int], block: int, layers: int, kv_heads_local: int, head_dim: int,
                  elem_bytes: int = 2, margin: float = 1.15) -> float:
    """GiB of KV blocks that hold every request of ``token_counts`` (prompt + output tokens)
    at once, with ``margin`` for the engine's own spare blocks; rounded up to 0.25 GiB."""
    blocks = sum(-(-n // block) + 1 for n in token_counts)
    gib = blocks * block * 2 * layers * kv_heads_local * head_dim * elem_bytes * margin / 2**30
    return math.ceil(gib * 4) / 4


def trace_layout_problems(args) -> List[str]:
    """One line per bad trace or layout flag a peer tool shares (``--contexts``,
    ``--batches``, ``--replicas`` / ``--replica-index``, ``--tp``)."""
    problems = []
    for name in ("contexts", "batches"):
        bad = [v for v in getattr(args, name) if v < 1]
        if bad:
            problems.append(f"--{name} {bad[0]}: must be >= 1")
    if args.replicas < 1 or not 0 <= args.replica_index < args.replicas:
        problems.append(f"--replica-index {args.replica_index}: must be in [0, --replicas {args.replicas})")
    if args.replicas > 1 and args.tp > 1:
        problems.append(f"--replicas {args.replicas} with --tp {args.tp}: one layout per run (DP or TP)")
    small = [b for b in args.batches if b < args.replicas]
    if small:
        problems.append(f"--batches {small[0]}: fewer requests than --replicas {args.replicas}")
    return problems


def replica_requests(n: int, replicas: int, index: int) -> List[int]:
    """Request ids replica ``index`` of ``replicas`` serves out of ``n``: every replicas-th."""
    return list(range(index, n, replicas))


def _init(args):
    """One process (or the torchrun rank): NCCL group, Megatron's parallel state, RNG."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tknp_megatron.launch import free_port, init_distributed

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != args.tp:
        raise SystemExit(f"--tp {args.tp}: run under torchrun with --nproc-per-node {args.tp} (world is {world})")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_distributed("nccl", rank, world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    model_parallel_cuda_manual_seed(args.seed, inference_rng_tracker=True, force_reset_rng=True)
    return rank, dist


def build_engine(args, preset, max_requests: int, max_seq_len: int, buffer_gib: float):
    """Megatron's GPTModel (local spec, seeded weights) -> its dynamic context and engine."""
    import torch
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.enums import InferenceCudaGraphScope

    from tknp_megatron.models.model import layer_spec, padded_vocab_size
    from tknp_megatron.models.weights import fill_seeded_

    graphs = dict(cuda_graph_impl="local", inference_cuda_graph_scope=InferenceCudaGraphScope.block) \
        if args.cuda_graphs else dict(cuda_graph_impl="none")
    config = preset.to_transformer_config(args.tp, torch.bfloat16, use_cpu_initialization=False,
                                          inference_rng_tracker=True, inference_sampling_seed=args.seed,
                                          pipeline_dtype=torch.bfloat16, **graphs)
    vocab = padded_vocab_size(preset, args.tp)
    model = GPTModel(
        config, layer_spec(preset), vocab_size=vocab,
        max_sequence_length=max(preset.gpt.max_sequence_length, max_seq_len),
        position_embedding_type=preset.gpt.position_embedding_type, rotary_percent=preset.gpt.rotary_percent,
        rotary_base=preset.gpt.rotary_base, rope_scaling=preset.gpt.rope_scaling,
        rope_scaling_factor=preset.gpt.rope_scaling_factor,
        share_embeddings_and_output_weights=preset.gpt.share_embeddings_and_output_weights,
    ).cuda()
    fill_seeded_(model, preset, args.seed)
    model.eval()
    if args.fa4_single_split:
        for module in model.modules():
            if isinstance(module, Attention):
                module.batch_invariant_mode = True  # read only to pick FA4's num_splits (1)
    context = DynamicInferenceContext(
        model_config=config,
        inference_config=InferenceConfig(
            block_size_tokens=args.block_size_tokens, buffer_size_gb=buffer_gib, max_requests=max_requests,
            max_tokens=args.max_tokens, max_sequence_length=max_seq_len,
            num_cuda_graphs=args.num_cuda_graphs if args.cuda_graphs else None,
            unified_memory_level=0, materialize_only_last_token_logits=True,
        ),
    )
    wrapped = GPTInferenceWrapper(model, context)
    tokenizer = types.SimpleNamespace(vocab_size=vocab, eod=-1, detokenize=lambda tokens: "")
    engine = DynamicInferenceEngine(TextGenerationController(wrapped, tokenizer), context)
    return engine, vocab


def serve_trace(engine, prompts, output_len: int, first_id: int = 0):
    """Add every prompt at t = 0 (request ids from ``first_id``: unique over the engine's
    life), step until all finish; returns the timings of the run."""
    import torch
    from megatron.core.inference.sampling_params import SamplingParams

    params = SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=output_len, termination_id=-1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ids = range(first_id, first_id + len(prompts))
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    pending = set(ids)  # requests without a first token yet
    prefill_s, generated, completed = None, 0, 0
    after = []  # (requests in the step, wall s) of each step once every request has its first token
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        result = engine.step_modern()
        te = time.perf_counter()
        active = len(result["active_request_ids"])
        for record in result["finished_request_records"]:
            request = record.merge()
            generated += len(request.generated_tokens)
            completed += 1
        if prefill_s is None:
            pending = {r for r in pending if not _has_token(engine, r)}
            if not pending:
                prefill_s = te - t0
            continue
        after.append((active + len(result["finished_request_records"]), te - ts))
    # the decode phase: the steps after every request has its first token that decode the
    # largest batch seen then (the whole trace, unless the engine paused some requests)
    full = max((n for n, _ in after), default=0)
    decode_times = [wall for n, wall in after if n == full]
    torch.cuda.synchronize()
    makespan = time.perf_counter() - t0
    decode_wall = sum(decode_times)
    return dict(makespan_s=makespan, prefill_s=prefill_s or makespan, generated=generated, completed=completed,
                decode_steps=len(decode_times),
                decode_step_ms=statistics.median(decode_times) * 1e3 if decode_times else None,
                decode_tok_s=full * len(decode_times) / decode_wall if decode_wall > 0 else None,
                decode_batch=full, steps_after_prefill=len(after))


def _has_token(engine, rid: int) -> bool:
    try:
        return len(engine.get_request(rid).generated_tokens) > 0
    except (KeyError, IndexError, AttributeError):
        return True  # finished and gone


def main(argv=None) -> int:
    args = parse_args(argv)
    problems = environment_problems(args.tp)
    if problems:
        print("bench_megatron_engine: " + "; ".join(problems), file=sys.stderr)
        return 2
    import torch

    from tknp_megatron.analysis import workload as wl
    from tknp_megatron.config import get_preset

    preset = get_preset(args.model)
    if args.layers is not None:
        preset = preset.replace(num_layers=args.layers)
    if args.fa4_single_split is None:
        args.fa4_single_split = torch.cuda.get_device_capability()[0] == 9
    rank, dist = _init(args)
    kv_local = preset.local_kv_heads(args.tp)
    longest = max(args.contexts) + args.output_len
    per_replica = max(len(replica_requests(b, args.replicas, args.replica_index)) for b in args.batches)
    buffer_gib = kv_buffer_gib([longest] * per_replica, args.block_size_tokens, preset.num_layers, kv_local,
                               preset.kv_channels)
    t_build = time.perf_counter()
    engine, vocab = build_engine(args, preset, per_replica, longest + args.block_size_tokens, buffer_gib)
    if rank == 0:
        print(f"megatron engine built in {time.perf_counter() - t_build:.1f} s: {preset.num_layers} layers, "
              f"TP {args.tp}, KV buffer {buffer_gib} GiB, block {args.block_size_tokens}, "
              f"graphs {args.cuda_graphs}, fa4 single split {args.fa4_single_split}", flush=True)
    rows, first_id = [], 0
    for ctx in args.contexts:
        for batch in args.batches:
            trace = wl.fixed_length(batch, ctx, args.output_len, args.seed)
            mine = replica_requests(batch, args.replicas, args.replica_index)
            prompts = [wl.prompt_tokens(trace.requests[i], vocab, args.seed) for i in mine]
            run = serve_trace(engine, prompts, args.output_len, first_id)
            first_id += len(prompts)
            row = PeerRow(
                engine="megatron-dynamic", tp=args.tp, replicas=args.replicas, context=ctx, batch=batch,
                output_len=args.output_len, requests=len(mine), completed=run["completed"],
                generated_tokens=run["generated"], makespan_s=run["makespan_s"],
                completion_tok_s=run["generated"] / run["makespan_s"], prefill_s=run["prefill_s"],
                decode_steps=run["decode_steps"], decode_step_ms=run["decode_step_ms"],
                decode_tok_s=run["decode_tok_s"], decode_batch=run["decode_batch"],
                steps_after_prefill=run["steps_after_prefill"], kv_buffer_gib=buffer_gib,
                block_size_tokens=args.block_size_tokens, cuda_graphs=args.cuda_graphs,
                fa4_single_split=args.fa4_single_split)
            rows.append(asdict(row))
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
    if rank == 0 and args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))
    dist.barrier()
    return 0


def cli() -> None:
    """Console entry point: :func:`main`, then exit at once (:func:`~tknp_megatron.launch.exit_with`)."""
    from tknp_megatron.launch import exit_with

    exit_with(main)


if __name__ == "__main__":
    cli()
