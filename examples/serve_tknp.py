"""Serve TKNP pools behind Megatron-Core's own inference server until stopped.

Rank 0 starts Megatron's ``DataParallelInferenceCoordinator`` and its HTTP server
(``POST /v1/completions``, ``/v1/chat/completions``, ``GET /health``); the coordinator
rank of every pool registers with the coordinator as one data-parallel engine and serves
it (``tknp_megatron.serving``). With no arguments (CPU): one pool of 2 nodes x TP2 = 4
gloo processes, the ``tiny`` preset with seeded weights, Megatron's null tokenizer (a
prompt is space-separated token ids), on http://127.0.0.1:5000. ::

    python examples/serve_tknp.py                       # or: make serve
    curl -s http://127.0.0.1:5000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "1 2 3 4", "max_tokens": 8, "temperature": 0}'

On GPUs, one process per GPU under torchrun (``--pools`` pools of ``--nodes`` x ``--tp``)::

    torchrun --nproc-per-node 2 examples/serve_tknp.py --device cuda --nodes 2 --tp 1

Models: ``--model`` (a preset, seeded weights), ``--load DIR`` (Megatron checkpoint),
``--hf DIR`` (Hugging Face folder), ``--model-config FILE``; ``--tokenizer DIR`` (a
Hugging Face tokenizer folder) for text. Every flag is checked before any process
starts (one line naming it, exit status 2). SIGTERM or Ctrl-C stops the server in order:
requests still open end with an error naming the stop, and every process exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed")

from job_inputs import (  # noqa: E402
    JobError,
    add_model_flags,
    block_table_problem,
    check_launch,
    dense_format,
    finish_model_flags,
    kv_memory_problem,
    launcher_problems,
    load_tokenizer,
    output_file_problem,
    rank_device,
)

from tknp_megatron.attention import backend_problem  # noqa: E402
from tknp_megatron.cli import ArgumentParser  # noqa: E402
from tknp_megatron.config import dtype_from_name  # noqa: E402
from tknp_megatron.engine.config import sequence_limit_problem  # noqa: E402
from tknp_megatron.launch import init_distributed, supervise  # noqa: E402
from tknp_megatron.models.source import (  # noqa: E402
    ModelSource,
    SourceError,
    converted_checkpoint,
    converted_on_each_host,
    resolve_source,
)
from tknp_megatron.pool_checks import pool_problems  # noqa: E402

PROG = "serve_tknp.py"


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="token-parallel nodes N per pool")
    p.add_argument("--tp", type=int, default=2, help="TP ranks per node T")
    p.add_argument("--pools", type=int, default=1,
                   help="pools in the world, each a data-parallel engine of the coordinator")
    add_model_flags(p, "HF tokenizer folder (default: Megatron's null tokenizer, ids as text)")
    p.add_argument("--layers", type=int, default=None,
                   help="with --model: stack this many of the preset's layers (benchmarks)")
    p.add_argument("--seed", type=int, default=0, help="seed of the preset's weights")
    p.add_argument("--kv-tokens-per-node", type=int, default=None,
                   help="KV budget per node in tokens (CPU default: 4 x max_sequence_length; "
                        "GPU: sized from free memory)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-sequence-length", type=int, default=None, metavar="TOKENS",
                   help="the longest request served, prompt + output tokens (default: the model's "
                        "max_sequence_length); also Megatron's default output length")
    p.add_argument("--max-requests-per-node", type=int, default=256)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay decode steps from CUDA graphs, every batch bucket captured at start-up")
    p.add_argument("--lazy-graph-capture", action="store_true",
                   help="with --cuda-graphs: capture each bucket on its first step instead (faster "
                        "start-up; that step waits for the capture)")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the heap the engine was built with to Python's garbage collector "
                        "(by default it is frozen once built: a full collection stalled a step)")
    p.add_argument("--host", default="127.0.0.1",
                   help="interface of the HTTP server (0.0.0.0: all); Megatron's coordinator binds "
                        "to this machine's host name, as Megatron's own server does")
    p.add_argument("--port", type=int, default=5000, help="HTTP port")
    p.add_argument("--coordinator-port", type=int, default=None, help="Megatron coordinator's port")
    p.add_argument("--frontend-replicas", type=int, default=None,
                   help="HTTP server processes on the port (default: as many as Megatron's own "
                        "launcher starts, 1 in megatron-core 0.16, 4 from 0.17)")
    p.add_argument("--idle-tick", type=float, default=1.0,
                   help="seconds an idle pool waits before telling its ranks it is alive")
    p.add_argument("--step-log", default=None, metavar="FILE",
                   help="write the pool's arrivals, steps and replies as JSON lines when it stops "
                        "(held in memory until then: for benchmarks; several pools: FILE.<pool>)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="collective timeout in seconds (a hung or dead rank fails the pool)")
    args = p.parse_args(argv)
    finish_model_flags(args)
    if args.layers is not None and (args.load or args.hf or args.model_config):
        raise JobError("--layers cuts a preset (--model): not with --load / --hf / --model-config")
    return args


@dataclass(frozen=True)
class ServeJob:
    """Everything the ranks need (pickled to spawned workers)."""

    args: argparse.Namespace
    model: ModelSource
    kv_tokens: Optional[int]


def prepare(args) -> ServeJob:
    """Resolve and check every input (no process started)."""
    source = resolve_source(args.model, args.load, args.hf, args.model_config, args.seed)
    if args.layers is not None:
        if args.layers < 1:
            raise JobError(f"--layers {args.layers}: must be at least 1")
        source = dataclasses.replace(source, preset=source.preset.replace(num_layers=args.layers))
    preset = source.preset
    problems = [f"--{p}" for p in pool_problems(preset, args.nodes, args.tp)]
    problems += dense_format(args).problems(args.device)
    for flag, value in (("--pools", args.pools), ("--block-size", args.block_size),
                        ("--max-requests-per-node", args.max_requests_per_node),
                        ("--frontend-replicas", args.frontend_replicas)):
        if value is not None and value < 1:
            problems.append(f"{flag} {value}: must be at least 1")
    for flag, value in (("--port", args.port), ("--coordinator-port", args.coordinator_port)):
        if value is not None and not 1 <= value <= 65535:
            problems.append(f"{flag} {value}: must be a TCP port in [1, 65535]")
    if not args.idle_tick > 0:
        problems.append(f"--idle-tick {args.idle_tick}: must be positive (seconds)")
    problems += launcher_problems(args)
    if args.step_log:
        problem = output_file_problem("--step-log", args.step_log)
        problems += [problem] if problem else []
    if args.idle_tick > 0 and args.timeout > 0 and args.idle_tick * 4 > args.timeout:
        problems.append(f"--idle-tick {args.idle_tick}: must be well inside --timeout "
                        f"{args.timeout} (at most a quarter of it)")
    limit = args.max_sequence_length
    if limit is not None and sequence_limit_problem(limit, preset):
        problems.append(f"--max-sequence-length {limit}: {sequence_limit_problem(limit, preset)}")
    elif args.block_size >= 1 and args.max_requests_per_node >= 1:
        problem = block_table_problem(limit or preset.gpt.max_sequence_length, args.block_size,
                                      args.max_requests_per_node)
        problems += [problem] if problem else []
    kv = args.kv_tokens_per_node
    if kv is not None and kv < args.block_size:
        problems.append(f"--kv-tokens-per-node {kv}: must hold at least one block "
                        f"(--block-size {args.block_size})")
    elif kv is not None and args.device == "cpu":
        problem = kv_memory_problem("--kv-tokens-per-node", kv, preset, args.tp, args.dtype,
                                    args.pools * args.nodes * args.tp)
        problems += [problem] if problem else []
    if "RANK" not in os.environ or os.environ["RANK"] == "0":  # the process that serves HTTP
        problems += _address_problems(args.host, args.port, args.coordinator_port)
    if backend_problem(args.attention_backend, args.device):
        problems.append(f"--attention-backend {backend_problem(args.attention_backend, args.device)}")
    if problems:
        raise JobError("; ".join(problems))
    load_tokenizer(args, preset)  # checked here; every process loads its own
    if kv is None and args.device == "cpu":
        kv = 4 * (limit or preset.gpt.max_sequence_length)
    return ServeJob(args, source, kv)


def _address_problems(host: str, port: int, coordinator_port: Optional[int]) -> list:
    """``--host`` that does not resolve, or a port already taken there (bound once and
    released: the front end binds it once the pools are up, too late to refuse in a line)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError, OverflowError) as err:
        return [f"--host {host}: not an address of this machine ({err})"]
    problems = []
    for flag, value in (("--port", port), ("--coordinator-port", coordinator_port)):
        if value is None or not 1 <= value <= 65535:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, value))
            except OSError as err:
                problems.append(f"{flag} {value}: cannot be bound on {host} ({err.strerror or err})")
    return problems


# ----------------------------------------------------------------------------- a rank
def serve_rank(rank: int, world: int, job: ServeJob) -> None:
    """One rank: build the pool's engine; a pool coordinator serves Megatron's
    coordinator, the other ranks follow it; rank 0 also runs Megatron's front end."""
    import parallel_state as ps
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import Mode, build_engine
    from tknp_megatron.models.tokenizer import server_tokenizer
    from tknp_megatron.serving.coordinator_link import CoordinatorLink
    from tknp_megatron.serving.frontend import Frontend, helper_context
    from tknp_megatron.serving.pool_server import PoolServer

    warnings.simplefilter("ignore")  # Megatron warns about missing Apex / TE at import
    # Megatron's coordinator module (its engines import it) registers stack dumps on
    # SIGTERM and SIGINT when first imported; here those signals are the orderly stop.
    import megatron.core.inference.data_parallel_inference_coordinator  # noqa: F401

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        faulthandler.unregister(sig)
        signal.signal(sig, lambda *_: stop.set())
    args, source = job.args, job.model
    preset = source.preset
    if rank == 0:  # the front end's helper processes' server imports while the engine is built
        helper_context()
    device = rank_device(args, rank)
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                          token_parallel_size=args.nodes, num_pools=args.pools)
    config = EngineConfig(
        block_size=args.block_size, kv_tokens_per_node=job.kv_tokens,
        max_requests_per_node=args.max_requests_per_node,
        attention_backend=args.attention_backend, cuda_graphs=args.cuda_graphs,
        capture_at_start=not args.lazy_graph_capture, freeze_gc=not args.no_gc_freeze,
        max_sequence_length=args.max_sequence_length,
    )
    engine = build_engine(Mode.TKNP, preset, groups, config, device, dtype_from_name(args.dtype),
                          weights=source.checkpoint or args.seed, padded_vocab=source.padded_vocab,
                          dense=dense_format(args))
    tokenizer = server_tokenizer(args.tokenizer, preset.vocab_size)
    object_device = device if device.type == "cuda" else None
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    frontend = None
    if rank == 0:
        frontend = Frontend(args.pools, tokenizer, args.host, args.coordinator_port,
                            args.max_requests_per_node * args.nodes)
    box = [frontend.address if frontend else None]
    dist.broadcast_object_list(box, src=0, device=object_device)
    server = None
    try:
        if groups.is_coordinator:
            link = CoordinatorLink(box[0], groups.pool)
            if frontend is not None:
                frontend.wait_for_engines(args.timeout)
                url = frontend.serve_http(args.port, args.frontend_replicas)
                ready = dict(url=url, coordinator=frontend.address, pools=args.pools,
                             nodes=args.nodes, tp=args.tp, model=preset.name, rank_pids=pids,
                             kv_tokens_per_node=engine.kv_capacity_tokens,
                             max_sequence_length=config.sequence_limit(preset),
                             frontend_pids=frontend.http_pids)
                print(f"{PROG}: ready {json.dumps(ready)}", flush=True)
            step_log = args.step_log and (f"{args.step_log}.{groups.pool}" if args.pools > 1 else args.step_log)
            server = PoolServer(engine, link, tokenizer, config.sequence_limit(preset),
                                args.idle_tick, stop.is_set, step_log)
            try:
                summary = server.run()
            finally:
                link.close()
            # One write per line: every pool's coordinator shares this stdout, and print()
            # writes the text and its newline apart when Python runs unbuffered.
            sys.stdout.write(f"{PROG}: pool {summary.pool} ended ({summary.stopped_by}): "
                             f"{summary.completed} completed, {summary.failed} failed, "
                             f"{summary.steps} steps, {summary.graph_steps} from CUDA graphs, "
                             f"{summary.graph_captures} captured while serving (per step: engine "
                             f"host {summary.host_ms:.2f} ms, GPU wait {summary.wait_ms:.2f} ms, "
                             f"server {summary.server_ms:.2f} ms)\n")
            sys.stdout.flush()
        else:
            engine.serve()
    finally:
        if frontend is not None:
            frontend.stop()  # after the requests it holds are answered (errors of a stop or a failure)
    engine = server = None  # first the CUDA graphs (see parallel_state.destroy_model_parallel)
    ps.destroy_model_parallel()


# ----------------------------------------------------------------------------- launch
def run_torchrun(job: ServeJob) -> int:
    args = job.args
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rank_device(args, rank)  # bind the GPU before NCCL starts
    init_distributed("nccl" if args.device == "cuda" else "gloo", rank, world, args.timeout)
    with converted_on_each_host(job.model, args.dtype, args.timeout) as source:
        serve_rank(rank, world, ServeJob(args, source, job.kv_tokens))
    dist.destroy_process_group()
    return 0


def run_local(job: ServeJob) -> int:
    args = job.args
    with converted_checkpoint(job.model, args.dtype, args.timeout) as source:
        world = args.pools * args.nodes * args.tp
        return supervise(serve_rank, world, (ServeJob(args, source, job.kv_tokens),),
                         timeout_s=args.timeout)


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        check_launch(args, f"--pools {args.pools} --nodes {args.nodes} --tp {args.tp}",
                     args.pools * args.nodes * args.tp)
        job = prepare(args)
    except (JobError, SourceError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    return run_torchrun(job) if "RANK" in os.environ else run_local(job)


if __name__ == "__main__":
    sys.exit(main())
