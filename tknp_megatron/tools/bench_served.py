"""Served vs offline: one fixed trace through Megatron's server in front of a TKNP pool, and
through the same engine's offline ``generate``; completion throughput side by side.

Both runs build the same pool (``--nodes`` x ``--tp``, the same engine knobs and seeded
weights) and serve the same greedy requests (``--requests`` prompts of ``--prompt-len``
random ids, ``--output-len`` new tokens each, all arriving at once). Each run serves the
trace 1 + ``--passes`` times and reports the median timed pass (the first warms up).
Throughput = generated tokens / (last completion - first submission). The served pass
sends every request at once over HTTP (``POST /v1/completions``, token-id prompts) to
``examples/serve_tknp.py``; its tokens must equal the offline run's.

GPU (one process per GPU; the tool starts torchrun itself)::

    python -m tknp_megatron.tools.bench_served --device cuda --gpus 2 --nodes 2 --tp 1 \\
        --model llama3.1-70b --layers 8 --requests 128 --prompt-len 32 --output-len 128 --cuda-graphs

CPU smoke run (gloo)::

    python -m tknp_megatron.tools.bench_served --gpus 2 --nodes 2 --tp 1 --requests 8 --output-len 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import List

import torch

from tknp_megatron.cli import ArgumentParser


ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "examples" / "serve_tknp.py"


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    # (flag names must not prefix torchrun's own: it reads them after the script too)
    p.add_argument("--gpus", type=int, default=2, help="processes (GPUs): nodes x tp")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--model", default="tiny")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-tokens-per-node", type=int, default=None)
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--lazy-graph-capture", action="store_true",
                   help="capture each batch bucket's graph on its first step, not at start-up")
    p.add_argument("--frontend-replicas", type=int, default=None,
                   help="the server's HTTP processes (default: Megatron's default)")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="both paths: do not freeze the engine's heap once built (EngineConfig.freeze_gc)")
    p.add_argument("--attention-backend", default=None,
                   help="both paths: the owners' attention backend (default: the device's, auto on CUDA)")
    p.add_argument("--offline-only", action="store_true",
                   help="time the offline engine alone (no server): e.g. to compare engine settings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--passes", type=int, default=3, help="timed passes of each path, after one warm-up")
    p.add_argument("--out", default=None, help="write the results here (JSON)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--stage", choices=("both", "offline"), default="both", help=argparse.SUPPRESS)
    p.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.passes < 1:
        p.error(f"--passes {args.passes}: must be at least 1")
    from tknp_megatron.analysis.bench_traces import model_problems

    for problem in model_problems(args.model, args.layers):
        p.error(problem)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device on this machine")
    from tknp_megatron.attention import backend_problem

    if backend_problem(args.attention_backend, args.device):  # before any process starts
        p.error(f"--attention-backend {backend_problem(args.attention_backend, args.device)}")
    return args


def _preset(args):
    from tknp_megatron.config import get_preset

    preset = get_preset(args.model)
    return preset.replace(num_layers=args.layers) if args.layers is not None else preset


def make_trace(args) -> List[List[int]]:
    vocab = _preset(args).vocab_size
    gen = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, vocab - 1, (args.requests, args.prompt_len), generator=gen).tolist()


def _engine_flags(args) -> list:
    flags = ["--nodes", str(args.nodes), "--tp", str(args.tp), "--model", args.model,
             "--device", args.device, "--seed", str(args.seed)]
    if args.layers is not None:
        flags += ["--layers", str(args.layers)]
    if args.kv_tokens_per_node:
        flags += ["--kv-tokens-per-node", str(args.kv_tokens_per_node)]
    if args.cuda_graphs:
        flags += ["--cuda-graphs"]
    if args.lazy_graph_capture:
        flags += ["--lazy-graph-capture"]
    if args.no_gc_freeze:
        flags += ["--no-gc-freeze"]
    if args.attention_backend:
        flags += ["--attention-backend", args.attention_backend]
    return flags


# ----------------------------------------------------------------------------- offline
def offline_worker(rank: int, world: int, job) -> dict:
    """The engine as the server builds it; ``generate`` 1 + ``--passes`` times (the first warms up)."""
    import parallel_state as ps
    from tknp_megatron.engine.config import EngineConfig
    from tknp_megatron.engine.factory import Mode, build_engine
    from tknp_megatron.sampling import SamplingParams

    warnings.simplefilter("ignore")
    args, prompts = job
    preset = _preset(args)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    kv = args.kv_tokens_per_node or (4 * preset.gpt.max_sequence_length if args.device == "cpu" else None)
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, token_parallel_size=args.nodes)
    config = EngineConfig(kv_tokens_per_node=kv, cuda_graphs=args.cuda_graphs,
                          capture_at_start=not args.lazy_graph_capture, freeze_gc=not args.no_gc_freeze,
                          attention_backend=args.attention_backend)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    built = time.perf_counter()
    engine = build_engine(Mode.TKNP, preset, groups, config, device, dtype, weights=args.seed)
    if rank == 0:  # each phase's time, so a slow run says where it went
        print(f"bench_served: offline engine built in {time.perf_counter() - built:.1f} s "
              f"(KV tokens per node {engine.kv_capacity_tokens})", flush=True)
    params = SamplingParams(max_new_tokens=args.output_len, eos_id=preset.vocab_size - 1)  # the null tokenizer's eod
    walls, tokens = [], None
    for attempt in range(1 + args.passes):  # the first warms up
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        walls.append(time.perf_counter() - start)
        tokens = [list(r.tokens) for r in results]
        if rank == 0:
            host, wait = engine.loop_timing.per_step_ms()
            print(f"bench_served: offline {'timed' if attempt else 'warm-up'} pass {walls[-1]:.2f} s "
                  f"(per step: engine host {host:.2f} ms, GPU wait {wait:.2f} ms)", flush=True)
        engine.loop_timing.clear()
    out = dict(walls=walls[1:], tokens=tokens)
    del engine, results  # first its CUDA graphs (see parallel_state.destroy_model_parallel)
    ps.destroy_model_parallel()
    return out if rank == 0 else None


def run_offline(args, prompts) -> dict:
    from tknp_megatron.launch import spawn

    if args.device == "cpu":
        return spawn(offline_worker, args.gpus, ((args, prompts),), timeout_s=args.timeout)[0]
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file, out = Path(tmp) / "prompts.json", Path(tmp) / "offline.json"
        prompts_file.write_text(json.dumps(prompts))
        argv = sys.argv[1:]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.gpus),
               "-m", "tknp_megatron.tools.bench_served", *argv, "--stage", "offline",
               "--prompts-file", str(prompts_file), "--out", str(out)]
        proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
        try:
            code = proc.wait(args.timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the offline half did not end within --timeout {args.timeout:.0f} s") from None
        finally:
            if proc.poll() is None:  # torchrun and its workers: a worker left behind holds the GPU
                _kill_group(proc)
        if code:
            raise RuntimeError(f"the offline half exited with {code}")
        return json.loads(out.read_text())


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (it was started in a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# ----------------------------------------------------------------------------- served
def completion_tokens(answer: dict) -> List[int]:
    """The generated ids of a completion: 0.17+ returns them, 0.16 only the text (the null
    tokenizer's text is the ids)."""
    choice = answer["choices"][0]
    ids = choice.get("generation_token_ids")
    return list(ids) if ids is not None else [int(t) for t in choice["text"].split()]


async def serve_passes(url: str, prompts: List[List[int]], output_len: int, timeout_s: float,
                       passes: int = 2) -> List[dict]:
    """Send every prompt at once as its own ``POST /v1/completions``, ``passes`` times (the
    next pass after the last answer); each pass's wall time runs from its first send
    (``start``, perf_counter) to its last answer. One aiohttp session on one event loop, a kept-alive connection per
    request in flight (as an ``openai`` async client would): the client neither spreads
    the burst out (a thread per request in ``requests`` took about 1.7 ms of CPU each on
    2 cores) nor competes with the server's processes for the CPU while it waits."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def ask(prompt):
            body = dict(prompt=prompt, max_tokens=output_len, temperature=0)
            async with session.post(url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:500]}")
                answer = await r.json(content_type=None)
            return completion_tokens(answer), time.perf_counter()

        for _ in range(passes):
            start = time.perf_counter()
            answers = await asyncio.gather(*(ask(p) for p in prompts))
            out.append(dict(start=start, wall_s=max(t for _, t in answers) - start,
                            tokens=[a for a, _ in answers]))
    return out


def pass_timeline(events: List[dict], start: float, end: float) -> dict:
    """Where one served pass's wall time went, from the pool's step log (seconds after the
    pass's first send): its first and last arrival at the pool, its first step, its last
    reply; its steps, how many ran eagerly (admissions, or no graph) and their host time;
    the garbage collector's full (generation 2) collections in the pool and their time."""
    inside = [e for e in events if start <= e.get("t", e.get("start", 0)) <= end]
    arrivals = [e["t"] - start for e in inside if e["kind"] == "arrive"]
    steps = [e for e in inside if e["kind"] == "step"]
    full_gc = [e["end"] - e["start"] for e in inside if e["kind"] == "gc" and e["generation"] == 2]
    replies = [e["t"] - start for e in inside if e["kind"] == "reply"]
    eager = [e for e in steps if not e["graph"]]
    return dict(
        first_arrival_s=min(arrivals, default=None), last_arrival_s=max(arrivals, default=None),
        first_step_s=steps[0]["start"] - start if steps else None,
        last_reply_s=max(replies, default=None), steps=len(steps), eager_steps=len(eager),
        eager_step_host_s=sum(e["end"] - e["start"] for e in eager),
        step_host_s=sum(e["end"] - e["start"] for e in steps),
        admitting_steps=sum(1 for e in steps if e["admitted"]),
        full_gc=len(full_gc), full_gc_s=sum(full_gc),
    )


def run_served(args, prompts) -> dict:
    """Start the server, send the trace 1 + ``--passes`` times (the first warms up), stop it."""
    from tknp_megatron.launch import free_port

    port = free_port()
    launcher = [sys.executable, str(SERVE)]
    if args.device == "cuda":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.gpus), str(SERVE)]
    step_log = Path(tempfile.mkdtemp(prefix="bench_served_")) / "steps.jsonl"
    flags = ["--port", str(port), "--step-log", str(step_log)]
    if args.frontend_replicas:
        flags += ["--frontend-replicas", str(args.frontend_replicas)]
    proc = subprocess.Popen([*launcher, *_engine_flags(args), *flags],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    ready = threading.Event()
    lines: list = []

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip())
            print(line.rstrip(), flush=True)
            if " ready " in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(args.timeout):
            raise RuntimeError(f"server not ready within {args.timeout:.0f} s")
        url = json.loads(next(x for x in lines if " ready " in x).split(" ready ", 1)[1])["url"]
        passes = asyncio.run(serve_passes(url, prompts, args.output_len, args.timeout, 1 + args.passes))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
    events = [json.loads(x) for x in step_log.read_text().splitlines()] if step_log.exists() else []
    shutil.rmtree(step_log.parent, ignore_errors=True)
    summary = next((e for e in events if e["kind"] == "summary"), {})  # the pool's ServeSummary
    timed = passes[1:]
    timelines = [pass_timeline(events, p["start"], p["start"] + p["wall_s"]) for p in timed]
    for i, t in enumerate(timelines):
        print(f"bench_served: served pass {i + 1}: {timed[i]['wall_s']:.3f} s; " + ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in t.items()), flush=True)
    return dict(walls=[p["wall_s"] for p in timed], tokens=timed[-1]["tokens"], pool=summary,
                timelines=timelines)


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.simplefilter("ignore")
    if args.stage == "offline":  # this process is one rank under torchrun
        from tknp_megatron.launch import run_ranks

        prompts = json.loads(Path(args.prompts_file).read_text())
        rank, result = run_ranks(offline_worker, (args, prompts), args.device, args.gpus, args.timeout)
        if rank == 0:
            Path(args.out).write_text(json.dumps(result))
        os._exit(0)  # past NCCL teardown (see benchmarks/RESULTS.md)
    # a SIGTERM (e.g. from `timeout`) unwinds, so each half's clean-up stops its processes:
    # they run in sessions of their own, out of reach of a signal to this process's group
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    prompts = make_trace(args)
    start = time.perf_counter()
    offline = run_offline(args, prompts)
    print(f"bench_served: offline done ({time.perf_counter() - start:.0f} s)", flush=True)
    if args.offline_only:
        tokens = sum(len(t) for t in offline["tokens"])
        wall = statistics.median(offline["walls"])
        print(f"offline: {wall:.3f} s, {tokens} tokens, {tokens / wall:.1f} tok/s (median of {args.passes} passes: "
              + " ".join(f"{w:.3f}" for w in offline["walls"]) + ")")
        if args.out:
            Path(args.out).write_text(json.dumps(dict(args=vars(args), offline=dict(
                wall_s=wall, walls=offline["walls"], tokens=tokens, tok_per_s=tokens / wall)), indent=1))
        return 0
    served = run_served(args, prompts)
    print(f"bench_served: served done ({time.perf_counter() - start:.0f} s)", flush=True)
    rows = {}
    for name, run in (("offline", offline), ("served", served)):
        tokens = sum(len(t) for t in run["tokens"])
        wall = statistics.median(run["walls"])
        rows[name] = dict(wall_s=wall, walls=run["walls"], tokens=tokens, tok_per_s=tokens / wall)
    pairs = [(a, b) for x, y in zip(offline["tokens"], served["tokens"]) for a, b in zip(x, y)]
    agreement = sum(a == b for a, b in pairs) / max(1, len(pairs))
    ratio = rows["served"]["tok_per_s"] / rows["offline"]["tok_per_s"]
    print(f"{'path':8} {'wall_s':>8} {'tokens':>8} {'tok/s':>10}  (median of {args.passes} passes; each pass's wall_s)")
    for name, r in rows.items():
        print(f"{name:8} {r['wall_s']:8.3f} {r['tokens']:8d} {r['tok_per_s']:10.1f}  "
              + " ".join(f"{w:.3f}" for w in r["walls"]))
    # In fp32 (CPU) the tokens must be equal; in BF16 a request's numerics depend on how
    # the arrivals were batched, and a random model's near-tied logits then diverge.
    print(f"served / offline: {ratio:.3f}; token agreement {agreement:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), rows=rows, ratio=ratio,
                                                  token_agreement=agreement, pool=served["pool"],
                                                  served_timelines=served["timelines"]),
                                             indent=1))
    return 0 if agreement == 1.0 or args.device == "cuda" else 1


if __name__ == "__main__":
    sys.exit(main())
