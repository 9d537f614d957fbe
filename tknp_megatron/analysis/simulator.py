"""A decode pool simulated in one process: the engine's own code, the roofline's step times.

:class:`SimulatedPool` is a :class:`~tknp_megatron.engine.engine.LockstepEngine` whose
executor computes nothing. Queueing, admission in capacity waves, block accounting, plan
building, booking and the serving metrics are the engine's code, unchanged; only the
time of a step comes from a model: :func:`~tknp_megatron.analysis.roofline.predicted_step_s`
for the step's batch and the KV its busiest owner reads, times the mode's *implementation
factor* (measured step time over the roofline's on the H200, :class:`Calibration`), charged
to a virtual clock. Prompts' KV arrives from outside, as in the serving benchmarks; its
write is charged at the KV bandwidth.

One process plays the pool's coordinator; the other ranks exist only in the step time.
DP runs one simulated pool per replica (requests round-robin by id, as the benchmarks
route them) and merges their timelines. ``tknp-dual`` runs the engine's two microbatches
(each request's microbatch chosen by the engine) on the roofline's model of this
repository's dual-root schedule, or with ``schedule="tknp-dual-paper"`` on the paper's.

``token_scale`` replays a trace coarse-grained (each simulated token stands for that many:
prompts, outputs, KV capacity and block size divided by it, each step's context and KV
write multiplied back, each simulated step that many decode steps). Waves and step times
stay those of the full trace up to rounding of a request's reservation to whole simulated
tokens; a trace of long prompts then replays in a fraction of the time (the dual-copy
decision, :mod:`tknp_megatron.analysis.dual_choice`). Arrivals keep their times, so a
Poisson trace is admitted at a coarser step grain.

Known skew: the engine books step n after queuing step n + 1, and the executor advances
the clock when a step is queued, so each token's timestamp is one step late (completion
times by one step in a request's whole run).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from parallel_state import TokenParallelGroups
from tknp_megatron.analysis.costmodel import NodeBudget, kv_capacity
from tknp_megatron.analysis.metrics import ServingMetrics, summarize
from tknp_megatron.analysis.roofline import H200, Hardware, predicted_step_s
from tknp_megatron.analysis.workload import Workload
from tknp_megatron.config import ModelPreset
from tknp_megatron.engine.base import BuiltExecutor
from tknp_megatron.engine.config import EngineConfig
from tknp_megatron.engine.engine import LockstepEngine
from tknp_megatron.engine.factory import engine_config_for
from tknp_megatron.engine.intake import Arrival
from tknp_megatron.executor.base import StepOutput
from tknp_megatron.mode import Mode
from tknp_megatron.placement import GIB
from tknp_megatron.plan import StepPlan
from tknp_megatron.sampling import SamplingParams

__all__ = ["Calibration", "H200_CALIBRATION", "SimClock", "SimRun", "SimulatedPool", "kv_tokens_per_owner",
           "simulate"]

SIMULATED = (Mode.TKNP, Mode.TKNP_DUAL, Mode.DP, Mode.TP, Mode.PP, Mode.DCP)


@dataclass(frozen=True)
class Calibration:
    """Per mode: measured step time over the roofline's (1.0: the roofline itself).

    Attributes:
        factors: mode value -> factor.
        source: where the factors were measured.
    """

    factors: Dict[str, float] = field(default_factory=dict)
    source: str = "none: the roofline's step times"

    def factor(self, mode: Mode) -> float:
        return self.factors.get(Mode(mode).value, 1.0)


# Medians of ``measured_over_predicted`` over the rows of
# benchmarks/headline_h200x2/serving_x2_ctx32k_run2 (TKNP, DP, TP: CUDA graphs, overlapped
# scheduling) and, for PP and DCP (eager), of benchmarks/headline_h200x2/serving_x2_ctx64k_mixed's
# fixed-length rows: Llama-3.1-70B geometry, 12 layers, H200 x2, 2026-11.
H200_CALIBRATION = Calibration(
    factors={"tknp": 1.23, "dp": 1.295, "tp": 1.385, "pp": 2.58, "dcp": 10.46},
    source="H200 x2, benchmarks/headline_h200x2 (serving_x2_ctx32k_run2, serving_x2_ctx64k_mixed)",
)


class SimClock:
    """Virtual seconds, advanced by the simulated steps and by waits for arrivals."""

    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += max(0.0, seconds)

    def advance_to(self, t: float) -> None:
        self.now_s = max(self.now_s, t)


@dataclass(frozen=True)
class StepModel:
    """A step's seconds from its plan: the roofline over the plan's layout, times the
    mode's factor, plus the write of admitted prompts' KV on the busiest owner.

    Attributes:
        mode: the pool's mode.
        preset: the model.
        world: GPUs of this pool (one replica's for DP).
        tp: GPUs per node.
        hw: per-op costs.
        factor: implementation factor (:class:`Calibration`).
        weight_elem: bytes per linear weight (1: FP8-stored).
        schedule: the roofline's name for the step, if not the mode's (``tknp-dual-paper``:
            dual active roots as the paper describes them).
        token_scale: real tokens per simulated token (see the module docstring).
    """

    mode: Mode
    preset: ModelPreset
    world: int
    tp: int
    hw: Hardware = H200
    factor: float = 1.0
    weight_elem: float = 2.0
    schedule: Optional[str] = None
    token_scale: int = 1

    def seconds(self, plan: StepPlan) -> float:
        """``plan``'s time on its pool."""
        rows, scale = plan.num_requests, self.token_scale
        per_node = plan.cached_tokens_per_owner()
        num_nodes = len(per_node)
        ingest = [0] * num_nodes
        for adm in plan.admissions:
            ingest[adm.owner] += adm.ingest_len
        write = max(ingest) * scale * kv_bytes_per_token(self.preset) / self.tp  # a node's GPUs split it
        if not rows:
            return write / self.hw.kv_bw
        context = max(per_node) * scale * num_nodes / rows  # the busiest owner bounds attention
        step = predicted_step_s(self.schedule or self.mode.value, self.preset, self.world, self.tp, rows,
                                context, self.hw, self.weight_elem)
        return scale * self.factor * step + write / self.hw.kv_bw


class _TimedExecutor:
    """An :class:`~tknp_megatron.executor.base.Executor` that charges each plan's modelled
    time to the clock and returns a token that ends no request early (id 0)."""

    def __init__(self, model: StepModel, clock: SimClock):
        self.model, self.clock = model, clock

    def apply_admissions(self, admissions) -> None:
        pass  # no KV is stored: the blocks are the scheduler's books

    def execute(self, plan: StepPlan, timer=None) -> StepOutput:
        self.clock.advance(self.model.seconds(plan))
        return StepOutput(torch.zeros(plan.num_requests, dtype=torch.long))

    def enable_cuda_graphs(self, max_requests_per_owner: int = 0) -> None:
        pass  # the factor already says how the measured engine ran


class SimulatedPool(LockstepEngine):
    """A pool's coordinator alone, its steps timed by ``model`` on ``clock``.

    Args:
        preset: the model.
        block_counts: KV blocks of each owning node (``kv_capacity_tokens / block_size``).
        config: the engine's knobs (block size, request slots, prefill budget).
        model: step times.
        clock: the virtual clock every request timeline uses.
    """

    def __init__(self, preset: ModelPreset, block_counts: Sequence[int], config: EngineConfig,
                 model: StepModel, clock: SimClock):
        self._sim = (tuple(block_counts), model, clock)
        groups = TokenParallelGroups(num_nodes=len(block_counts), tp_size=1, node=0, tp_rank=0,
                                     tp_group=None, tknp_group=None)
        super().__init__(None, preset, None, groups, config, torch.device("cpu"), clock=clock)

    def _build_executor(self, model) -> BuiltExecutor:
        counts, step_model, clock = self._sim
        return BuiltExecutor(_TimedExecutor(step_model, clock), None, counts)

    def _broadcast(self, box: list, grow: bool = True) -> None:
        pass  # no other rank: the plan's work is in the step time

    def _send_ingested_kv(self, plan: StepPlan) -> None:
        pass  # the write is in the step time

    def _wait_for_arrival(self) -> None:
        """Idle: jump the clock to the next arrival."""
        nxt = self._arrivals.next_time()
        if nxt is not None:
            self._sim[2].advance_to(nxt)
        self._release_due()


@dataclass(frozen=True)
class SimRun:
    """A simulated mode on one workload.

    Attributes:
        mode: the mode.
        metrics: serving metrics over every replica's requests.
        resident_batch_mean: requests resident per step, summed over replicas.
        kv_capacity_tokens: per replica, per owning node.
        steps: booked steps (the most of any replica).
        token_scale: real tokens per simulated token: ``metrics`` counts simulated tokens
            (its throughput times this is tok/s); capacities are in real tokens.
    """

    mode: Mode
    metrics: ServingMetrics
    resident_batch_mean: float
    kv_capacity_tokens: tuple
    steps: int
    token_scale: int = 1

    @property
    def completion_throughput_tok_s(self) -> float:
        """Completed requests' output tokens per second, in real tokens."""
        return self.metrics.completion_throughput_tok_s * self.token_scale


def _arrivals(workload: Workload, pool: int, pools: int) -> List[Arrival]:
    """This replica's share of the trace (round-robin by id), KV arriving from outside."""
    return [Arrival(r.arrival_s, (0,) * r.prompt_len, SamplingParams(max_new_tokens=r.output_len),
                    r.request_id, synthetic_kv=r.request_id)
            for r in workload.requests if r.request_id % pools == pool]


def _coarse(workload: Workload, scale: int) -> Workload:
    """``workload`` with every length in simulated tokens of ``scale`` real ones (rounded up)."""
    if scale == 1:
        return workload
    return dataclasses.replace(workload, requests=tuple(
        dataclasses.replace(r, prompt_len=math.ceil(r.prompt_len / scale),
                            output_len=math.ceil(r.output_len / scale))
        for r in workload.requests))


def simulate(mode: Mode, preset: ModelPreset, world: int, tp: int, workload: Workload,
             kv_tokens_per_node: int, *, block_size: int = 16, max_requests_per_node: int = 256,
             hw: Hardware = H200, calibration: Calibration = H200_CALIBRATION,
             max_prefill_tokens: int = 1 << 30, weight_elem: float = 2.0,
             schedule: Optional[str] = None, token_scale: int = 1) -> SimRun:
    """Replay ``workload`` on ``mode`` over ``world`` GPUs (``tp`` per node) whose every
    owning node holds ``kv_tokens_per_node`` KV tokens; see the module docstring."""
    mode = Mode(mode)
    if mode not in SIMULATED:
        raise ValueError(f"--mode {mode.value}: the simulator runs {[m.value for m in SIMULATED]}")
    if token_scale < 1:
        raise ValueError(f"token_scale must be >= 1, got {token_scale}")
    workload = _coarse(workload, token_scale)
    kv_tokens_per_node //= token_scale
    block_size = max(1, block_size // token_scale)
    pools, nodes, t = mode.pool_shape(world, tp)
    owners = nodes if mode in (Mode.TKNP, Mode.TKNP_DUAL) else 1  # PP and DCP: one budget
    config = engine_config_for(mode, EngineConfig(
        block_size=block_size, kv_tokens_per_node=kv_tokens_per_node,
        max_requests_per_node=max_requests_per_node, max_prefill_tokens=max_prefill_tokens,
        freeze_gc=False))  # one process builds many simulated pools, on a virtual clock
    pool_world = world // pools
    model = StepModel(mode, preset, pool_world, t, hw, calibration.factor(mode), weight_elem, schedule,
                      token_scale)
    timelines, resident, capacity, steps, waves = [], 0.0, [], 0, 0
    for pool in range(pools):
        clock = SimClock()
        engine = SimulatedPool(preset, [kv_tokens_per_node // block_size] * owners, config, model, clock)
        engine.release_trace(_arrivals(workload, pool, pools), 0.0)
        engine.run_until_done()
        timelines += [r.timeline for r in engine.requests.values()]
        resident += engine.mean_resident
        capacity.append(tuple(c * token_scale for c in engine.kv_capacity_tokens))
        steps = max(steps, engine.resident_steps)
        waves = max(waves, engine.scheduler.waves)
    return SimRun(mode, summarize(timelines, waves), resident, tuple(capacity), steps, token_scale)



def kv_bytes_per_token(preset: ModelPreset) -> int:
    """BF16 K and V of every layer and KV head: one token of one request."""
    return 2 * 2 * preset.num_layers * preset.num_query_groups * preset.kv_channels


def kv_tokens_per_owner(mode: Mode, preset: ModelPreset, num_nodes: int, budget: NodeBudget) -> int:
    """What each owning node of ``mode`` holds on ``num_nodes`` nodes under ``budget`` (the
    capacity model, :func:`~tknp_megatron.analysis.costmodel.kv_capacity`), in tokens:
    TKNP (either copy count) per node, DP per replica, TP / PP / DCP the whole pool."""
    mode = Mode(mode)
    gib = kv_capacity(budget, num_nodes).of(mode)
    if mode in (Mode.TKNP, Mode.TKNP_DUAL, Mode.DP):
        gib /= num_nodes
    return int(gib * GIB // kv_bytes_per_token(preset))
