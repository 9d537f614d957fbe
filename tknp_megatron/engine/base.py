"""InferenceEngine: the request / step / generate surface every mode's engine shares.

Every rank constructs the engine. The pool's first rank (the coordinator) holds the waiting
queue and the scheduler and steps the pool; the other ranks follow it from :meth:`serve`
(or from :meth:`step`, in lockstep) until it calls :meth:`shutdown`. What one step is
differs by mode (:meth:`InferenceEngine._lead` on the coordinator,
:meth:`InferenceEngine._follow` elsewhere): one plan broadcast to the whole pool for
TKNP, DP, TP and DCP (:class:`~tknp_megatron.engine.engine.LockstepEngine`), one tick of
the microbatch cycle for PP (:mod:`tknp_megatron.baselines.pp`). A mode also supplies its
executor, KV cache and block counts through :meth:`InferenceEngine._build_executor`.
Build engines with :func:`tknp_megatron.engine.factory.build_engine`.

Names follow Megatron-Core's inference engines where they overlap (``add_request``,
``step``, ``generate``, ``has_unfinished_requests``).
"""

from __future__ import annotations

import abc
import gc
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from parallel_state import TokenParallelGroups
from tknp_megatron.analysis.metrics import ServingMetrics, summarize
from tknp_megatron.config import ModelPreset
from tknp_megatron.engine.config import EngineConfig, GenerationResult
from tknp_megatron.engine.intake import Arrival, ArrivalQueue, integer_ids, request_problem
from tknp_megatron.engine.plan_broadcast import PlanBroadcast
from tknp_megatron.engine.request import Request, RequestStatus, RequestTimeline
from tknp_megatron.engine.scheduler import Scheduler, SchedulerConfig, StepLogProbs
from tknp_megatron.executor.base import Executor, StepOutput
from tknp_megatron.executor.ingest import KVIngest
from tknp_megatron.host_to_device import HostCopy
from tknp_megatron.kv_cache import BlockAllocator, PagedKVCache
from tknp_megatron.models.model import StageModel
from tknp_megatron.models.precision import stored_bytes
from tknp_megatron.placement import Placement
from tknp_megatron.plan import StepPlan
from tknp_megatron.profiler import LoopTiming
from tknp_megatron.sampling import SamplingParams, unpack_log_probs

__all__ = ["Arrival", "BuiltExecutor", "EngineConfig", "GenerationResult", "InferenceEngine", "freeze_heap"]


@dataclass(frozen=True)
class BuiltExecutor:
    """What a mode builds on this rank for its engine (:meth:`InferenceEngine._build_executor`).

    Attributes:
        executor: runs this rank's part of each plan.
        kv: this rank's paged KV cache (the executor's).
        block_counts: KV blocks of each owning node, known on every rank.
        ingest: moves outside KV from the coordinator to owners; None where the mode
            takes outside KV only as synthetic KV.
    """

    executor: Executor
    kv: PagedKVCache
    block_counts: Tuple[int, ...]
    ingest: Optional[KVIngest] = None


def freeze_heap() -> None:
    """Collect, then move every object alive into the garbage collector's permanent
    generation (``EngineConfig.freeze_gc`` says why); undone by
    ``parallel_state.destroy_model_parallel``, which must collect the engines dropped."""
    gc.collect()
    gc.freeze()


class InferenceEngine(abc.ABC):
    """Decode-pool engine for one rank: requests in, tokens out, in any mode.

    Subclasses supply :meth:`_build_executor`, the step's two sides (:meth:`_lead`,
    :meth:`_follow`), :meth:`_steps_in_flight`, :meth:`_forget_in_flight` and :meth:`shutdown`.

    Args:
        model: this rank's blocks (see :func:`tknp_megatron.models.model.build_stage_model`).
        preset: model preset.
        placement: layer-block placement.
        groups: this rank's process groups.
        config: engine knobs.
        device: this rank's device.
        clock: wall clock of request timelines.
    """

    def __init__(
        self,
        model: StageModel,
        preset: ModelPreset,
        placement: Placement,
        groups: TokenParallelGroups,
        config: EngineConfig,
        device: torch.device,
        clock=time.perf_counter,
    ):
        self.preset, self.placement, self.groups, self.config = preset, placement, groups, config
        self.device, self.clock = device, clock
        # this rank's parameters, FP8 ones as stored (a simulated pool has no model)
        self.weight_bytes = stored_bytes(model) if model is not None else 0
        built = self._build_executor(model)
        self.executor, self.kv, self.ingest = built.executor, built.kv, built.ingest
        self.block_counts = list(built.block_counts)  # KV blocks per owning node
        if config.cuda_graphs:  # every bucket captured now, before any request waits on one
            self.executor.enable_cuda_graphs(config.max_requests_per_node if config.capture_at_start else 0)
        self.requests: Dict[int, Request] = {}
        self._arrivals = ArrivalQueue(clock)  # trace replay: requests still to arrive
        self.resident_steps = self.resident_total = 0  # steps booked, requests resident over them
        self._next_id = 0
        self.peak_kv_tokens = [0] * len(self.block_counts)  # per owner, most tokens cached
        self._step = 0
        self.loop_timing = LoopTiming()
        # plans to the rest of the pool, one collective a step; a pool of one rank (a DP
        # replica, a simulated pool) has no one to tell: pickling a plan for itself cost it
        # about 1 ms a step
        pool = groups.pool_cpu_group
        alone = not dist.is_initialized() or dist.get_world_size(pool) == 1
        self._plans = None if alone else PlanBroadcast(pool, groups.coordinator_rank)
        self.scheduler = None
        if groups.is_coordinator:
            allocators = [BlockAllocator(n, config.block_size) for n in self.block_counts]
            sched_cfg = SchedulerConfig(
                config.policy, config.max_requests_per_node, config.max_prefill_tokens
            )
            self.scheduler = Scheduler(sched_cfg, allocators, clock)
        if config.freeze_gc:
            freeze_heap()

    @abc.abstractmethod
    def _build_executor(self, model: StageModel) -> BuiltExecutor:
        """Size this rank's KV cache, agree on every node's blocks, build the executor
        (collective: every rank of the pool calls it)."""

    @abc.abstractmethod
    def _lead(self) -> List[int]:
        """The coordinator's step; returns the ids of requests it finished."""

    @abc.abstractmethod
    def _follow(self) -> bool:
        """Another rank's step: run the next piece of work; False once stopped."""

    @abc.abstractmethod
    def _steps_in_flight(self) -> bool:
        """Coordinator: some queued step's tokens are not booked yet."""

    @abc.abstractmethod
    def _forget_in_flight(self) -> None:
        """Coordinator: drop the record of steps queued but not booked (their tokens are
        never read; :meth:`abort_all`)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Coordinator: release the other ranks from :meth:`serve`."""

    # ---------------------------------------------------------------- requests
    @property
    def kv_capacity_tokens(self) -> List[int]:
        """Per node: KV tokens it can hold."""
        return [n * self.config.block_size for n in self.block_counts]

    def add_request(
        self,
        prompt_tokens: Sequence[int],
        sampling_params: Optional[SamplingParams] = None,
        *,
        kv: Optional[torch.Tensor] = None,
        synthetic_kv: Optional[int] = None,
        arrival_time: Optional[float] = None,
        request_id: Optional[int] = None,
    ) -> int:
        """Submit a request (coordinator only); returns its id.

        ``kv`` is KV computed elsewhere for ``prompt_tokens[:-1]``,
        ``[layers, 2, len(prompt) - 1, num_kv_heads, head_dim]``, in the model's head order
        (post-RoPE keys, as a prefill server writes them). ``synthetic_kv`` instead has the
        owner generate that KV from a seed (benchmarks). ``request_id`` (default: the next
        free id) is what seeded sampling keys on, so a router in front of several pools
        passes global ids. Invalid requests are rejected at once with a reason naming the
        request and the limit; they never reach the pool.
        """
        self._require_coordinator("add_request")
        rid = self._next_id if request_id is None else int(request_id)
        if rid in self.requests:
            raise ValueError(f"request id {rid} is already in use")
        self._next_id = max(self._next_id, rid + 1)
        params = sampling_params or SamplingParams()
        timeline = RequestTimeline(release=self.clock() if arrival_time is None else arrival_time)
        prompt, bad = integer_ids(prompt_tokens)
        reason = None if bad is None else f"request {rid}: token id {bad!r} is not an integer"
        req = Request(rid, prompt, params, timeline, kv, synthetic_kv)
        if reason is None:
            reason = self._problem(req)  # before the request is recorded: should it raise, none is
        self.requests[rid] = req
        if reason is not None:
            req.reject(reason)
        else:
            self.scheduler.enqueue(req)
        return rid

    def _problem(self, req: Request) -> Optional[str]:
        """Why ``req`` can never be served, or None (baselines add their own limits)."""
        return request_problem(req, self.preset, self.scheduler.max_fit_tokens(),
                               self.config.sequence_limit(self.preset))

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running (arrivals still to come and a step whose tokens are
        not yet booked included)."""
        self._require_coordinator("has_unfinished_requests")
        return self.scheduler.has_work() or bool(self._arrivals) or self._steps_in_flight()

    def release_trace(self, arrivals: Sequence[Arrival], t0: Optional[float] = None) -> None:
        """Coordinator: submit each arrival once ``t0 + time_s`` has passed (trace replay).

        Request release times (queue wait, completion time) count from ``t0 + time_s``.
        """
        self._require_coordinator("release_trace")
        self._arrivals.load(arrivals, self.clock() if t0 is None else t0)
        self._release_due()

    def _release_due(self) -> None:
        for a in self._arrivals.due():
            self.add_request(a.prompt, a.params, synthetic_kv=a.synthetic_kv,
                             arrival_time=self._arrivals.t0 + a.time_s, request_id=a.request_id)

    def abort_all(self, reason: str) -> List[int]:
        """Coordinator: end every request still waiting or running, with ``reason`` (the
        server stops, or the pool failed); their KV blocks and slots are released and a
        step still in flight is never booked. Returns their ids."""
        self._require_coordinator("abort_all")
        self._forget_in_flight()
        self._arrivals.load((), self._arrivals.t0)
        ended = []
        for req in self.requests.values():
            if req.status is RequestStatus.RUNNING:
                self.scheduler.finish(req)
            elif req.status is not RequestStatus.WAITING:
                continue
            req.reject(reason)
            ended.append(req.request_id)
        self.scheduler.drop_waiting()
        return ended

    def _wait_for_arrival(self) -> None:
        """Idle until the next arrival (nothing is queued or running)."""
        self._arrivals.sleep_until_next()
        self._release_due()

    # ---------------------------------------------------------------- stepping
    def step(self) -> List[int]:
        """Run one step. Coordinator: admit what fits, queue the next step and book one
        whose tokens are back; returns the ids of requests that finished in it. Other
        ranks: run their part of the coordinator's next step."""
        if not self.groups.is_coordinator:
            self._follow()
            return []
        return self._lead()

    def serve(self) -> None:
        """Non-coordinator ranks: follow the coordinator's steps until it stops the pool."""
        while self._follow():
            pass

    def _book_keep(self, plan: StepPlan, out: StepOutput, copy: Optional[HostCopy] = None) -> List[int]:
        """Read a step's tokens (the coordinator's one wait per step: for this step only,
        not the one queued behind it) and book them."""
        return self._book(plan, self._read_tokens(out, copy), out)

    def _read_tokens(self, out: StepOutput, copy: Optional[HostCopy] = None) -> List[int]:
        """A step's ``[R]`` sampled tokens on the host (waiting for them counts as waiting)."""
        start = time.perf_counter()
        tokens = (copy or HostCopy(out.tokens)).result().tolist()
        self.loop_timing.wait_s += time.perf_counter() - start
        return tokens

    def _book(self, plan: StepPlan, tokens: List[int], out: StepOutput) -> List[int]:
        """Book a step's ``tokens`` (and its log-probs and logits, from ``out``); returns the
        ids of the requests it finished."""
        self.resident_steps += 1
        self.resident_total += self.scheduler.num_running()
        log_probs = StepLogProbs.read(out.log_probs, out.top_log_probs, out.top_ids)
        if out.prompt_log_probs is not None:  # before the tokens: a request may end this step
            self.scheduler.book_prompt_log_probs(
                plan, StepLogProbs.read(*unpack_log_probs(out.prompt_log_probs, plan.log_probs_top_n)))
        finished = self.scheduler.postprocess(plan, tokens, out.logits, self.clock(), log_probs)
        used = plan.cached_tokens_per_owner()
        self.peak_kv_tokens = [max(p, u) for p, u in zip(self.peak_kv_tokens, used)]
        return finished

    # ---------------------------------------------------------------- whole runs
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: Optional[SamplingParams | Sequence[SamplingParams]] = None,
        progress: Optional[Callable[[int], None]] = None,
    ) -> List[GenerationResult]:
        """Serve ``prompts`` to completion on every rank; all ranks get the results.

        ``progress`` (coordinator) is told how many requests ended at each step.
        """
        results = None
        if self.groups.is_coordinator:
            params = sampling_params
            if params is None or isinstance(params, SamplingParams):
                params = [params] * len(prompts)
            ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
            if progress is not None:  # refused at once
                progress(sum(self.requests[i].status.value == "rejected" for i in ids))
            self.run_until_done(progress)
            results = [self.result(i) for i in ids]
        else:
            self.serve()
        box = [results]
        self._broadcast(box, grow=False)  # once: the buffer is not grown for it
        return box[0]

    def run_until_done(self, progress: Optional[Callable[[int], None]] = None) -> None:
        """Coordinator: step until every submitted request has ended, then stop the pool;
        ``progress`` is told how many requests ended at each step."""
        while self.has_unfinished_requests():
            if not self.scheduler.has_work() and not self._steps_in_flight():
                self._wait_for_arrival()
            finished = self.step()
            if progress is not None:
                progress(len(finished))
        self.shutdown()

    def result(self, request_id: int) -> GenerationResult:
        """How request ``request_id`` ended (coordinator; all ranks after :meth:`generate`)."""
        req = self.requests[request_id]
        logits = torch.stack(req.logits) if req.logits else None
        return GenerationResult(
            request_id, req.status, tuple(req.prompt), tuple(req.generated), req.owner,
            req.timeline.reject_reason, logits,
            tuple(req.log_probs) if req.params.return_log_probs else None,
            tuple(req.top_log_probs) if req.params.top_n_logprobs else None,
            req.finish_reason() if req.status is RequestStatus.COMPLETED else None,
            tuple(req.prompt_log_probs) if req.params.return_prompt_log_probs else None,
            tuple(req.prompt_top_log_probs) if req.params.return_prompt_log_probs and req.params.top_n_logprobs
            else None,
        )

    def forget(self, request_id: int) -> None:
        """Coordinator: drop an ended request's record (a long-running server keeps none;
        :meth:`result` and :meth:`metrics` no longer see it)."""
        req = self.requests[request_id]
        if req.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
            raise ValueError(f"request {request_id} has not ended ({req.status.value})")
        del self.requests[request_id]

    def restart_counts(self) -> None:
        """Start the serving counts afresh, as between two benchmark traces on one engine:
        the coordinator forgets its ended requests (``ValueError`` while one is waiting or
        running) and its counts of resident requests, admission waves and peak KV; every
        rank its loop timing."""
        self.loop_timing.clear()
        if not self.groups.is_coordinator:
            return
        live = [r.request_id for r in self.requests.values()
                if r.status in (RequestStatus.WAITING, RequestStatus.RUNNING)]
        if live or self._arrivals or self._steps_in_flight():
            raise ValueError(f"restart_counts: requests {live[:8]} (or arrivals, or a step) not ended")
        self.requests.clear()
        self.resident_steps = self.resident_total = 0
        self.scheduler.waves = 0
        self.peak_kv_tokens = [0] * len(self.block_counts)

    @property
    def mean_resident(self) -> float:
        """Requests resident per booked step, on average (coordinator)."""
        return self.resident_total / max(1, self.resident_steps)

    def metrics(self) -> ServingMetrics:
        """Serving metrics over every request submitted so far (coordinator)."""
        self._require_coordinator("metrics")
        timelines = [r.timeline for r in self.requests.values()]
        peak = [p / max(1, c) for p, c in zip(self.peak_kv_tokens, self.kv_capacity_tokens)]
        return summarize(timelines, self.scheduler.waves, peak)  # KV use: peak fraction per node

    # ---------------------------------------------------------------- helpers
    def _broadcast(self, box: list, grow: bool = True) -> None:
        """Broadcast ``box[0]``, a picklable object, from the coordinator to the pool, host
        to host (gloo, :class:`~tknp_megatron.engine.plan_broadcast.PlanBroadcast`): no
        rank waits for its GPU to receive a plan. Every rank's ``box[0]`` is the object after."""
        if self._plans is not None:
            box[0] = self._plans(box[0], grow)

    def _require_coordinator(self, what: str) -> None:
        if not self.groups.is_coordinator:
            raise RuntimeError(f"{what} is for the pool's coordinator (its first rank)")
