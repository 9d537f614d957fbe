"""Traces, every parallel mode: build a mode's pool, replay workloads on it, collect metrics.

Modes (paper section 5.1) are :class:`~tknp_megatron.mode.Mode`, for a world of W ranks
with T ranks per node: tknp, tknp-dual, dp (W / T replicas; requests round-robin), tp,
pp and dcp (needs W > KV heads: run it on an MQA variant, and TKNP on the same variant
for comparison); :func:`~tknp_megatron.engine.factory.build_engine` builds each.
Prompts' KV arrives from "outside" (synthetic, identical in every mode), so runs measure
decode only; metrics count from each request's release time in the workload. A mode's
engine is built once and serves every workload in turn (:func:`run_mode`). CUDA
graphs, when asked for, apply to every mode (PP: each stage's share of a step).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

import parallel_state as ps
from tknp_megatron.analysis.metrics import ServingMetrics, summarize
from tknp_megatron.analysis.workload import Workload, prompt_tokens
from tknp_megatron.config import ModelPreset
from tknp_megatron.engine.config import EngineConfig
from tknp_megatron.engine.factory import build_engine
from tknp_megatron.models.precision import DenseFormat
from tknp_megatron.engine.intake import Arrival
from tknp_megatron.mode import Mode
from tknp_megatron.sampling import SamplingParams

__all__ = ["Mode", "ModeRun", "run_mode"]


@dataclass(frozen=True)
class ModeRun:
    """A mode's result on one workload (merged over its pools)."""

    mode: Mode
    workload: str
    metrics: ServingMetrics
    outputs: tuple  # generated tokens per request id
    kv_capacity_tokens: tuple  # per pool, per owner
    resident_batch_mean: float  # requests resident per step, summed over pools
    host_ms_per_step: tuple = ()  # per rank: host work per step (LoopTiming)
    wait_ms_per_step: tuple = ()  # per rank: waiting per step (coordinators: for the GPU)
    host_ms_p50_per_step: tuple = ()  # per rank: median host work of a step (a decode step's)
    engine_build_s: float = 0.0  # building the mode's engine (model, KV, graphs); 0: built for an earlier run


def _arrivals(workload: Workload, vocab: int, seed: int, pool: int, pools: int) -> List[Arrival]:
    """This pool's share (round-robin by request id) of the trace, with synthetic KV."""
    out = []
    for req in workload.requests:
        if req.request_id % pools != pool:
            continue
        # the prompt's KV "arrives from prefill": only its last token is fed to the pool
        prompt = tuple(prompt_tokens(req, vocab, seed))
        params = SamplingParams(max_new_tokens=req.output_len)
        out.append(Arrival(req.arrival_s, prompt, params, req.request_id, synthetic_kv=seed + req.request_id))
    return out


def _warm_up(engine, workload: Workload, vocab: int, seed: int, pools: int) -> None:
    """Serve the trace's first requests for a few tokens, unmeasured: compiles kernels,
    starts communicators and captures the decode graphs of the trace's layouts."""
    warm = dataclasses.replace(workload, requests=tuple(
        dataclasses.replace(r, output_len=min(r.output_len, 4), arrival_s=0.0)
        for r in workload.requests
    ))
    if engine.groups.is_coordinator:
        engine.release_trace(_arrivals(warm, vocab, seed, engine.groups.pool, pools))
        engine.run_until_done()
    else:
        engine.serve()
    engine.restart_counts()


def run_mode(
    mode: Mode,
    preset: ModelPreset,
    workloads: Sequence[Workload],
    config: EngineConfig,
    tp: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    dense: DenseFormat = DenseFormat(),
    on_run: Optional[Callable[[int, Optional[ModeRun]], None]] = None,
) -> List[Optional[ModeRun]]:
    """Build ``mode`` once over the whole world with ``dense`` layers (FP8 or not) and
    replay each of ``workloads`` on it in turn, its counts restarted between them (a
    model of 80 layers takes about a minute to build and capture: one build per mode, not
    per trace). Global rank 0 gets a run per workload, the first with the engine's
    build time; the other ranks Nones. ``on_run(i, run)``, if given, is called on every
    rank as soon as workload ``i`` has run (a caller cut short by a time limit keeps the
    runs before)."""
    mode = Mode(mode)
    pools, nodes, t = mode.pool_shape(dist.get_world_size(), tp)
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=t, token_parallel_size=nodes,
                                          num_pools=pools)
    runs: List[Optional[ModeRun]] = []
    try:
        start = time.perf_counter()
        engine = build_engine(mode, preset, groups, config, device, dtype, weights=seed, dense=dense)
        dist.barrier()
        build_s = time.perf_counter() - start
        for i, workload in enumerate(workloads):
            run = _replay(engine, mode, workload, preset.vocab_size, seed, pools)
            if run is not None and i == 0:
                run = dataclasses.replace(run, engine_build_s=build_s)
            runs.append(run)
            if on_run is not None:
                on_run(i, run)
    finally:
        engine = None
        ps.destroy_model_parallel()  # (collects the engine first)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return runs


def _replay(engine, mode: Mode, workload: Workload, vocab: int, seed: int, pools: int) -> Optional[ModeRun]:
    """One workload on a built engine (every rank together); the run on global rank 0."""
    groups = engine.groups
    _warm_up(engine, workload, vocab, seed, pools)
    arrivals = _arrivals(workload, vocab, seed, groups.pool, pools)
    dist.barrier()
    t0 = time.perf_counter()  # one clock for every process on the host
    if groups.is_coordinator:
        engine.release_trace(arrivals, t0)
        engine.run_until_done()
        mine = ([r.timeline for r in engine.requests.values()],
                {rid: tuple(r.generated) for rid, r in engine.requests.items()},
                engine.scheduler.waves, tuple(engine.kv_capacity_tokens),
                engine.mean_resident)
    else:
        engine.serve()
        mine = None
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    timings = [None] * dist.get_world_size()
    dist.all_gather_object(timings, (*engine.loop_timing.per_step_ms(), engine.loop_timing.host_median_ms()))
    engine.restart_counts()
    if dist.get_rank() != 0:
        return None
    run = _merge(mode, workload, [m for m in every if m is not None])
    return dataclasses.replace(run, host_ms_per_step=tuple(t[0] for t in timings),
                               wait_ms_per_step=tuple(t[1] for t in timings),
                               host_ms_p50_per_step=tuple(t[2] for t in timings))


def _merge(mode: Mode, workload: Workload, parts) -> ModeRun:
    timelines = [tl for p in parts for tl in p[0]]
    outputs = {}
    for p in parts:
        outputs.update(p[1])
    metrics = summarize(timelines, max(p[2] for p in parts))
    ordered = tuple(outputs[i] for i in sorted(outputs))
    resident = sum(p[4] for p in parts)
    return ModeRun(mode, workload.name, metrics, ordered, tuple(p[3] for p in parts), resident)
