"""The lockstep engines: one plan a step, broadcast to the whole pool; the TKNP engine.

The coordinator admits what fits, builds a :class:`~tknp_megatron.plan.StepPlan`,
broadcasts it (host to host, over the pool's gloo group) and queues its own part of the
step on the GPU; the other ranks run the same plan. TKNP, DP and TP
(:class:`TKNPInferenceEngine`) and DCP (:mod:`tknp_megatron.baselines.dcp`) step so.

Scheduling overlaps the GPU: a step's tokens are read back and booked only after the
next step has been queued, so the host plans step n + 1 while step n runs (booking each
step before planning the next would leave the GPU idle while the host plans). Requests
fed in step n + 1 take their step-n token on the device. A request that
ends with its end-of-sequence token at step n is already in step n + 1; that step's row
for it is discarded (its KV write lands in its own, just-freed blocks, before any later
admission's writes in stream order).

In steady decode (the batch the queued plan was built from, nothing admitted, every
request fed its in-flight token) the next plan is derived from the queued one
(:func:`~tknp_megatron.plan.next_decode_plan`) instead of read from every request.
"""

from __future__ import annotations

import time
from typing import List, Optional

from tknp_megatron.attention import get_backend
from tknp_megatron.engine.base import BuiltExecutor, InferenceEngine
from tknp_megatron.engine.config import EngineConfig, GenerationResult
from tknp_megatron.engine.intake import Arrival
from tknp_megatron.engine.kv_budget import kv_cache_spec, pool_block_counts
from tknp_megatron.engine.request import Request
from tknp_megatron.executor.dense_fusion import dense_fusion_for
from tknp_megatron.executor.ingest import KVIngest
from tknp_megatron.executor.rope import Rope
from tknp_megatron.executor.tknp import TKNPExecutor
from tknp_megatron.host_to_device import HostCopy
from tknp_megatron.kv_cache import PagedKVCache
from tknp_megatron.models.model import StageModel
from tknp_megatron.plan import StepPlan, build_plan, next_decode_plan

__all__ = [
    "Arrival", "EngineConfig", "GenerationResult", "InferenceEngine", "LockstepEngine",
    "TKNPInferenceEngine",
]


class LockstepEngine(InferenceEngine):
    """An :class:`~tknp_megatron.engine.base.InferenceEngine` whose every rank runs each
    broadcast plan; the mode supplies only :meth:`_build_executor`."""

    def __init__(self, *args, **kwargs):
        self._inflight: Optional[tuple] = None  # (plan, output, HostCopy) queued, not booked
        self._queued_batch: tuple = ()  # the requests the queued plan was built from
        super().__init__(*args, **kwargs)

    @property
    def queued_plan(self) -> Optional[StepPlan]:
        """Coordinator: the plan of the step queued last, whose tokens are not booked yet."""
        return self._inflight[0] if self._inflight else None

    def _steps_in_flight(self) -> bool:
        """Coordinator: a step is queued whose tokens are not booked yet."""
        return self._inflight is not None

    def _forget_in_flight(self) -> None:
        self._inflight = None

    def idle(self) -> None:
        """Coordinator with nothing to run: broadcast an idle plan, so that the other
        ranks' wait for the next plan ends inside the collective timeout (a server)."""
        self._require_coordinator("idle")
        self._broadcast([StepPlan.idle_plan(self.groups.num_nodes)])

    def _lead(self) -> List[int]:
        """The coordinator's step: plan and queue step n + 1, then book step n."""
        start, waited = time.perf_counter(), self.loop_timing.wait_s
        self._release_due()
        result = self.scheduler.schedule()
        for req in result.admitted:
            req.microbatch = -1  # unassigned: not counted by _microbatch_for
        for req in result.admitted:
            req.microbatch = self._microbatch_for(req)
        queued = None
        if result.batch:
            plan = next_decode_plan(self._step, self.queued_plan, self._queued_batch, result.batch,
                                    result.admissions)
            if plan is None:
                plan = build_plan(
                    self._step, result.batch, result.admissions, len(self.block_counts),
                    self.config.record_logits, self.config.microbatches,
                )
            self._step += 1
            self._broadcast([plan])
            self._send_ingested_kv(plan)  # before the owners' receives in execute
            out = self.executor.execute(plan)
            queued = (plan, out, HostCopy(out.tokens))
        finished = self._book_keep(*self._inflight) if self._inflight else []
        self._inflight, self._queued_batch = queued, result.batch
        if queued is not None:
            self.scheduler.mark_in_flight(queued[0])
        timing = self.loop_timing
        timing.add(time.perf_counter() - start - (timing.wait_s - waited))
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
        if plan.idle:
            return True
        self.executor.execute(plan)
        self.loop_timing.add(time.perf_counter() - received, received - start)
        return True

    def shutdown(self) -> None:
        """Coordinator: release the other ranks from :meth:`serve`."""
        self._require_coordinator("shutdown")
        self._broadcast([StepPlan.stop_plan(self.groups.num_nodes)])

    def _send_ingested_kv(self, plan: StepPlan) -> None:
        """Send each owner rank its heads of requests admitted with outside KV."""
        for adm in plan.admissions:
            req = self.requests[adm.request_id]
            if req.kv is not None:
                self.ingest.send(adm, req.kv)
                req.kv = None  # delivered


class TKNPInferenceEngine(LockstepEngine):
    """The TKNP pool (and DP / TP, its one-node pools): owners keep their requests' KV of
    every layer; ``config.microbatches == 2`` runs dual active roots."""

    def _build_executor(self, model: StageModel) -> BuiltExecutor:
        preset, groups, device = self.preset, self.groups, self.device
        spec = kv_cache_spec(preset, model.config, groups, self.config, device)
        block_counts = pool_block_counts(spec, groups, device)
        kv = PagedKVCache(spec.with_blocks(block_counts[groups.node]), device)
        ingest = KVIngest(groups, preset.num_query_groups // groups.tp_size, spec.dtype, device)
        rope = Rope(preset, model.config, device)
        backend = get_backend(self.config.attention_backend, device)
        cls = TKNPExecutor
        if self.config.microbatches == 2:
            from tknp_megatron.executor.dual_root import DualRootExecutor as cls
        fusion = dense_fusion_for(model, device, self.config.fused_elementwise, self.config.fused_rope)
        executor = cls(model, self.placement, groups, kv, rope, backend, preset.vocab_size, device, ingest,
                       fusion)
        return BuiltExecutor(executor, kv, tuple(block_counts), ingest)
