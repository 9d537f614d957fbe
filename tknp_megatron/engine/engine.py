"""TKNPInferenceEngine: add_request / step / generate over an N x T pool.

Every rank constructs the engine. The pool's first rank (the coordinator) holds the waiting
queue and the scheduler; each :meth:`step` it admits what fits, builds a
:class:`~tknp_megatron.plan.StepPlan`, broadcasts it (host to host, over the pool's gloo
group), and queues its own part of the step on the GPU; the other ranks run the same
plan from :meth:`serve` (or from :meth:`step`, in lockstep).

Scheduling overlaps the GPU: a step's tokens are read back and booked only after the
next step has been queued, so the host plans step n + 1 while step n runs. Requests fed
in step n + 1 take their step-n token on the device. A request that ends with its
end-of-sequence token at step n is already in step n + 1; that step's row for it is
discarded (its KV write lands in its own, just-freed blocks, before any later
admission's writes in stream order).
Names follow Megatron-Core's inference engines where they overlap (``add_request``,
``step``, ``generate``, ``has_unfinished_requests``).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from parallel_state import TokenParallelGroups
from tknp_megatron.analysis.metrics import ServingMetrics, summarize
from tknp_megatron.attention import get_backend
from tknp_megatron.config import ModelPreset
from tknp_megatron.engine.config import EngineConfig, GenerationResult
from tknp_megatron.engine.intake import Arrival, ArrivalQueue, request_problem
from tknp_megatron.engine.kv_budget import kv_cache_spec, pool_block_counts
from tknp_megatron.engine.request import Request, RequestTimeline
from tknp_megatron.engine.scheduler import Scheduler, SchedulerConfig
from tknp_megatron.executor.rope import Rope
from tknp_megatron.executor.tknp import StepOutput, TKNPExecutor
from tknp_megatron.host_to_device import HostCopy
from tknp_megatron.kv_cache import BlockAllocator, PagedKVCache
from tknp_megatron.models.model import StageModel
from tknp_megatron.placement import Placement
from tknp_megatron.plan import StepPlan, build_plan
from tknp_megatron.profiler import LoopTiming
from tknp_megatron.sampling import SamplingParams

__all__ = ["Arrival", "EngineConfig", "GenerationResult", "TKNPInferenceEngine"]


class TKNPInferenceEngine:
    """Decode-pool engine for one rank.

    Args:
        model: this rank's blocks (see :func:`tknp_megatron.models.model.build_stage_model`).
        preset: model preset.
        placement: layer-block placement.
        groups: this rank's process groups.
        config: engine knobs.
        device: this rank's device.
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
        self.executor = self._build_executor(model)
        if config.cuda_graphs:
            self.executor.enable_cuda_graphs()
        self.requests: Dict[int, Request] = {}
        self._arrivals = ArrivalQueue(clock)  # trace replay: requests still to arrive
        self.resident_log: List[int] = []  # requests resident at each step (coordinator)
        self._next_id = 0
        self.peak_kv_tokens = [0] * len(self.block_counts)  # per owner, most tokens cached
        self._step = 0
        self._inflight: Optional[tuple] = None  # (plan, output, HostCopy) queued, not booked
        self.loop_timing = LoopTiming()
        self.scheduler = None
        if groups.is_coordinator:
            allocators = [BlockAllocator(n, config.block_size) for n in self.block_counts]
            sched_cfg = SchedulerConfig(
                config.policy, config.max_requests_per_node, config.max_prefill_tokens
            )
            self.scheduler = Scheduler(sched_cfg, allocators, clock)

    def _build_executor(self, model: StageModel) -> TKNPExecutor:
        """Size this rank's KV cache, agree on every node's blocks, build the executor.

        Sets ``self.kv`` and ``self.block_counts`` (blocks per owning node).
        """
        preset, groups, device = self.preset, self.groups, self.device
        spec = kv_cache_spec(preset, model.config, groups, self.config, device)
        self.block_counts = pool_block_counts(spec, groups, device)
        self.kv = PagedKVCache(spec.with_blocks(self.block_counts[groups.node]), device)
        rope = Rope(preset, model.config, device)
        backend = get_backend(self.config.attention_backend, device)
        cls = TKNPExecutor
        if self.config.microbatches == 2:
            from tknp_megatron.executor.dual_root import DualRootExecutor as cls
        return cls(model, self.placement, groups, self.kv, rope, backend, preset.vocab_size, device)

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
        req = Request(rid, [int(t) for t in prompt_tokens], params, timeline, kv, synthetic_kv)
        self.requests[rid] = req
        reason = self._problem(req)
        if reason is not None:
            req.reject(reason)
        else:
            self.scheduler.enqueue(req)
        return rid

    def _problem(self, req: Request) -> Optional[str]:
        """Why ``req`` can never be served, or None (baselines add their own limits)."""
        return request_problem(req, self.preset, self.scheduler.max_fit_tokens())

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running (arrivals still to come and a step whose tokens are
        not yet booked included)."""
        self._require_coordinator("has_unfinished_requests")
        return self.scheduler.has_work() or bool(self._arrivals) or self._inflight is not None

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

    def _wait_for_arrival(self) -> None:
        """Idle until the next arrival (nothing is queued or running)."""
        self._arrivals.sleep_until_next()
        self._release_due()

    # ---------------------------------------------------------------- stepping
    def step(self) -> List[int]:
        """Run one step. Coordinator: schedule, broadcast and queue this step, then book the
        previous one; returns the ids of requests that finished in it. Other ranks: run
        the next broadcast plan."""
        if not self.groups.is_coordinator:
            self._follow()
            return []
        start, waited = time.perf_counter(), self.loop_timing.wait_s
        self._release_due()
        result = self.scheduler.schedule()
        for req in result.admitted:
            req.microbatch = -1  # unassigned: not counted by _microbatch_for
        for req in result.admitted:
            req.microbatch = self._microbatch_for(req)
        queued = None
        if result.batch:
            plan = build_plan(
                self._step, result.batch, result.admissions, len(self.block_counts),
                self.config.record_logits, self.config.microbatches,
            )
            self._step += 1
            self._broadcast([plan])
            self._send_ingested_kv(plan)
            out = self.executor.execute(plan)
            queued = (plan, out, HostCopy(out.tokens))
        finished = self._book_keep(*self._inflight) if self._inflight else []
        self._inflight = queued
        if queued is not None:
            self.scheduler.mark_in_flight(queued[0])
        timing = self.loop_timing
        timing.steps += 1
        timing.host_s += time.perf_counter() - start - (timing.wait_s - waited)
        return finished

    def _microbatch_for(self, req: Request) -> int:
        """The microbatch with fewer of the owner's running requests (dual active roots)."""
        if self.config.microbatches == 1:
            return 0
        others = [r.microbatch for r in self.scheduler.running[req.owner]]
        return int(others.count(1) < others.count(0))

    def _follow(self) -> bool:
        """Receive and run one plan; False when it is the stop plan."""
        box = [None]
        start = time.perf_counter()
        self._broadcast(box)
        received = time.perf_counter()
        plan: StepPlan = box[0]
        if plan.stop:
            return False
        self.executor.execute(plan)
        timing = self.loop_timing
        timing.steps += 1
        timing.wait_s += received - start
        timing.host_s += time.perf_counter() - received
        return True

    def serve(self) -> None:
        """Non-coordinator ranks: run plans until the coordinator stops the pool."""
        while self._follow():
            pass

    def shutdown(self) -> None:
        """Coordinator: release the other ranks from :meth:`serve`."""
        self._require_coordinator("shutdown")
        self._broadcast([StepPlan.stop_plan(self.groups.num_nodes)])

    def _book_keep(self, plan: StepPlan, out: StepOutput, copy: Optional[HostCopy] = None) -> List[int]:
        """Read a step's tokens (the coordinator's one wait per step: for this step only,
        not the one queued behind it) and book them."""
        start = time.perf_counter()
        tokens = (copy or HostCopy(out.tokens)).result().tolist()
        self.loop_timing.wait_s += time.perf_counter() - start
        self.resident_log.append(self.scheduler.num_running())
        finished = self.scheduler.postprocess(plan, tokens, out.logits, self.clock())
        used = self.scheduler.kv_tokens_per_node(plan)
        self.peak_kv_tokens = [max(p, u) for p, u in zip(self.peak_kv_tokens, used)]
        return finished

    def _send_ingested_kv(self, plan: StepPlan) -> None:
        """Send each owner rank its KV heads of requests admitted with external KV."""
        g = self.preset.num_query_groups // self.groups.tp_size
        for adm in plan.admissions:
            req = self.requests[adm.request_id]
            if req.kv is None:
                continue
            for t in range(self.groups.tp_size):
                part = req.kv[:, :, :, t * g : (t + 1) * g].contiguous()
                dst = self.groups.global_rank(adm.owner, t)
                if dst == self.groups.coordinator_rank:
                    self.executor.local_ingest[adm.request_id] = part
                else:
                    dist.send(part.to(self.device, self.kv.spec.dtype), dst)
            req.kv = None  # delivered

    # ---------------------------------------------------------------- whole runs
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: Optional[SamplingParams | Sequence[SamplingParams]] = None,
    ) -> List[GenerationResult]:
        """Serve ``prompts`` to completion on every rank; all ranks get the results."""
        results = None
        if self.groups.is_coordinator:
            params = sampling_params
            if params is None or isinstance(params, SamplingParams):
                params = [params] * len(prompts)
            ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
            self.run_until_done()
            results = [self.result(i) for i in ids]
        else:
            self.serve()
        box = [results]
        self._broadcast(box)
        return box[0]

    def run_until_done(self) -> None:
        """Coordinator: step until every submitted request has ended, then stop the pool."""
        while self.has_unfinished_requests():
            if not self.scheduler.has_work() and self._inflight is None:
                self._wait_for_arrival()
            self.step()
        self.shutdown()

    def result(self, request_id: int) -> GenerationResult:
        req = self.requests[request_id]
        logits = torch.stack(req.logits) if req.logits else None
        return GenerationResult(
            request_id, req.status, tuple(req.prompt), tuple(req.generated), req.owner,
            req.timeline.reject_reason, logits,
        )

    def metrics(self) -> ServingMetrics:
        """Serving metrics over every request submitted so far (coordinator)."""
        self._require_coordinator("metrics")
        timelines = [r.timeline for r in self.requests.values()]
        peak = [p / max(1, c) for p, c in zip(self.peak_kv_tokens, self.kv_capacity_tokens)]
        return summarize(timelines, self.scheduler.waves, peak)  # KV use: peak fraction per node

    # ---------------------------------------------------------------- helpers
    def _broadcast(self, box: list) -> None:
        """Broadcast picklable objects from the coordinator to the pool, host to host
        (gloo): no rank waits for its GPU to receive a plan."""
        dist.broadcast_object_list(box, src=self.groups.coordinator_rank, group=self.groups.pool_cpu_group)

    def _require_coordinator(self, what: str) -> None:
        if not self.groups.is_coordinator:
            raise RuntimeError(f"{what} is for the pool's coordinator (its first rank)")

