"""Pipeline-parallel baseline: N stages x TP T, about N microbatches in flight.

Stage s stores the same layer block as TKNP's node s, and keeps the KV cache of *every*
request for *its own* layers (so a request reserves the same block ids on every stage
and the pool has one logical owner). The coordinator (stage 0, TP rank 0) splits the
running requests into microbatches (each request joins the smallest at admission and
stays there) and cycles over them: a microbatch's next step enters stage 0 as soon as
its previous tokens come back from the last stage, so with M = N microbatches every
stage stays busy (vLLM-style pipelining, no per-step fill and drain). Plans travel with
the hidden state, stage to stage between matching TP ranks; the last stage returns the
sampled tokens to the coordinator.
"""

from __future__ import annotations

import pickle
from typing import List, Optional

import torch
import torch.distributed as dist

from tknp_megatron.attention import get_backend
from tknp_megatron.engine.engine import TKNPInferenceEngine
from tknp_megatron.engine.kv_budget import kv_cache_spec, pool_block_counts
from tknp_megatron.executor.dense import finish_layer, qkv_projection, vocab_logits
from tknp_megatron.executor.owner_attention import OwnerAttention
from tknp_megatron.executor.rope import Rope
from tknp_megatron.executor.step_inputs import prepare_inputs
from tknp_megatron.executor.synthetic import synthetic_kv
from tknp_megatron.executor.tknp import StepOutput, draw_tokens
from tknp_megatron.kv_cache import PagedKVCache
from tknp_megatron.plan import StepPlan, build_plan

__all__ = ["PPExecutor", "PPInferenceEngine"]


class PPExecutor:
    """One stage's share of a microbatch step: receive, run its layers, pass on."""

    def __init__(self, model, placement, groups, kv: PagedKVCache, rope, backend, vocab, device):
        cfg = model.config
        self.model, self.groups, self.kv, self.rope = model, groups, kv, rope
        self.vocab, self.device, self.dtype = vocab, device, cfg.params_dtype
        self.stage, self.num_stages = groups.node, groups.num_nodes
        t = groups.tp_size
        self.attend = OwnerAttention(kv, rope, backend, cfg.num_attention_heads // t,
                                     cfg.num_query_groups // t, cfg.kv_channels)
        self.local_layer = {g: i for i, g in enumerate(model.layer_ids)}
        self.hidden_size = cfg.hidden_size
        self._pending: List = []  # sends of the previous tick still in flight
        self.local_ingest = {}

    # ---------------------------------------------------------------- links
    def _rank(self, stage: int, tp_rank: Optional[int] = None) -> int:
        return self.groups.global_rank(stage, tp_rank)

    def flush(self) -> None:
        """Wait for the sends still in flight."""
        for work in self._pending:
            work.wait()
        self._pending = []

    def send_next(self, plan: StepPlan, hidden: Optional[torch.Tensor]) -> None:
        """Pass the plan (and hidden state) to the next stage's matching TP rank."""
        self.flush()
        data = torch.frombuffer(bytearray(pickle.dumps(plan)), dtype=torch.uint8).to(self.device)
        header = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        dst, group = self._rank(self.stage + 1), self.groups.tknp_group
        self._pending = [dist.isend(header, dst, group=group), dist.isend(data, dst, group=group)]
        if hidden is not None:
            self._pending.append(dist.isend(hidden.contiguous(), dst, group=group))
        self._keep = (header, data, hidden)  # alive until the sends complete

    def recv_prev(self):
        """``(plan, hidden | None)`` from the previous stage's matching TP rank."""
        src, group = self._rank(self.stage - 1), self.groups.tknp_group
        header = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(header, src, group=group)
        data = torch.empty(int(header), dtype=torch.uint8, device=self.device)
        dist.recv(data, src, group=group)
        plan: StepPlan = pickle.loads(data.cpu().numpy().tobytes())
        hidden = None
        if not plan.stop:
            hidden = torch.empty(plan.num_rows, 1, self.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(hidden, src, group=group)
        return plan, hidden

    # ---------------------------------------------------------------- compute
    def apply_admissions(self, admissions) -> None:
        """Every stage holds every request's KV for its layers: assign all admissions."""
        for adm in admissions:
            self.kv.assign(adm.slot, adm.blocks)
            if adm.ingest_len:
                kv = self._ingested(adm)
                self.kv.ingest(adm.slot, kv)

    def _ingested(self, adm) -> torch.Tensor:
        """This stage's layers and this TP rank's heads of the request's synthetic KV."""
        g, t = self.attend.kv_heads, self.groups.tp_rank
        return synthetic_kv(
            adm.synthetic_seed, self.model.layer_ids, torch.arange(adm.ingest_len),
            range(t * g, (t + 1) * g), g * self.groups.tp_size, self.attend.head_dim,
            self.kv.spec.dtype, self.device,
        )

    @torch.no_grad()
    def run(self, plan: StepPlan, hidden: Optional[torch.Tensor]):
        """This stage's layers for ``plan``: hidden ``[rows, 1, D]`` out, or on the last
        stage ``(tokens [R], logits [R, V] | None)``."""
        self.apply_admissions(plan.admissions)
        if not plan.num_requests:  # admissions only: nothing to compute this tick
            return torch.empty(0, 1, self.hidden_size, dtype=self.dtype, device=self.device)
        inp = prepare_inputs(plan, 0, self.kv, self.rope, self.device)
        if self.stage == 0:
            hidden = self.model.embedding(inp.tokens.unsqueeze(0), position_ids=None)
        for g in self.model.layer_ids:
            block = self.model.layer(g)
            attn = self.attend(self.local_layer[g], qkv_projection(block, hidden), inp)
            hidden = finish_layer(block, attn.unsqueeze(1), hidden)
        if self.stage < self.num_stages - 1:
            return hidden
        gr = self.groups
        logits = vocab_logits(self.model, hidden, inp.last_rows, gr.tp_group, gr.tp_size, self.vocab)
        return draw_tokens(logits, inp.sampling, inp.shape.all_greedy), logits


class PPInferenceEngine(TKNPInferenceEngine):
    """The PP baseline behind the TKNP engine's interface (add_request, generate, metrics).

    ``placement`` gives the stages' layer blocks; ``groups.num_nodes`` is the stage count.
    """

    def __init__(self, model, preset, placement, groups, config, device, *,
                 num_microbatches: Optional[int] = None, **kwargs):
        if config.cuda_graphs:
            raise ValueError("the PP baseline runs eagerly: set EngineConfig.cuda_graphs=False")
        super().__init__(model, preset, placement, groups, config, device, **kwargs)
        self.num_microbatches = num_microbatches or self.groups.num_nodes
        self.microbatch_of = {}

    def _build_executor(self, model) -> PPExecutor:
        layers = len(model.layer_ids)
        spec = kv_cache_spec(self.preset, model.config, self.groups, self.config, self.device, layers)
        blocks = min(pool_block_counts(spec, self.groups, self.device))
        # every stage must hold every request's blocks: one logical owner, pool minimum
        self.block_counts = [blocks]
        self.kv = PagedKVCache(spec.with_blocks(blocks), self.device)
        rope = Rope(self.preset, model.config, self.device)
        backend = get_backend(self.config.attention_backend, self.device)
        return PPExecutor(model, self.placement, self.groups, self.kv, rope, backend,
                          self.preset.vocab_size, self.device)

    # ---------------------------------------------------------------- serving
    def _problem(self, req):
        reason = super()._problem(req)
        if reason is None and req.kv is not None:
            return f"request {req.request_id}: the PP baseline takes outside KV only as synthetic_kv"
        return reason

    def step(self):
        raise RuntimeError("the PP baseline runs whole workloads: use run_until_done / generate")

    def serve(self) -> None:
        """Ranks other than the coordinator: follow the pipeline until it stops."""
        if self.groups.node == 0:
            self._stage0_follower()
        else:
            self._stage_loop()

    def run_until_done(self) -> None:
        """Coordinator: cycle microbatches until every request has ended, then stop."""
        inflight = [None] * self.num_microbatches
        while self.has_unfinished_requests() or any(p is not None for p in inflight):
            if not self.scheduler.has_work() and not any(p is not None for p in inflight):
                self._wait_for_arrival()
            for m in range(self.num_microbatches):
                if inflight[m] is not None:
                    self._receive_tokens(inflight[m])
                    inflight[m] = None
                plan = self._plan_for(m)
                if plan is not None:
                    self._tick(plan)
                    inflight[m] = plan if plan.num_requests else None
        self._tick(StepPlan.stop_plan(1))
        self.executor.flush()

    def _plan_for(self, m: int) -> Optional[StepPlan]:
        self._release_due()
        result = self.scheduler.schedule()
        for req in result.admitted:  # join the smallest microbatch, for good
            sizes = [0] * self.num_microbatches
            for rid in self.microbatch_of_running():
                sizes[self.microbatch_of[rid]] += 1
            self.microbatch_of[req.request_id] = min(range(len(sizes)), key=lambda i: (sizes[i], i))
        batch = [r for r in result.batch if self.microbatch_of[r.request_id] == m]
        if not batch and not result.admissions:
            return None
        self._step += 1
        return build_plan(self._step, batch, result.admissions, 1, self.config.record_logits)

    def microbatch_of_running(self):
        return [r.request_id for reqs in self.scheduler.running for r in reqs
                if r.request_id in self.microbatch_of]

    def _tick(self, plan: StepPlan) -> None:
        """Coordinator's stage-0 work for one plan (also sends it down the pipeline)."""
        if self.groups.tp_size > 1:
            dist.broadcast_object_list([plan], src=self.groups.coordinator_rank,
                                       group=self.groups.tp_group)
        self._stage0_run(plan)

    def _stage0_run(self, plan: StepPlan) -> None:
        ex = self.executor
        out = None if plan.stop else ex.run(plan, None)
        if ex.num_stages > 1:
            ex.send_next(plan, out)
        elif not plan.stop:
            self._local_tokens = out

    def _stage0_follower(self) -> None:
        """Stage 0's other TP ranks: take each plan from the coordinator and run it."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=self.groups.coordinator_rank,
                                       group=self.groups.tp_group)
            self._stage0_run(box[0])
            if box[0].stop:
                self.executor.flush()
                return

    def _stage_loop(self) -> None:
        """Stages 1..N-1: receive, run, pass on (the last returns tokens)."""
        ex = self.executor
        last = ex.num_stages - 1
        while True:
            plan, hidden = ex.recv_prev()
            if plan.stop:
                if ex.stage < last:
                    ex.send_next(plan, None)
                ex.flush()
                return
            out = ex.run(plan, hidden)
            if ex.stage < last:
                ex.send_next(plan, out)
            elif plan.num_requests and self.groups.tp_rank == 0:  # tokens go to the coordinator
                tokens, logits = out
                dist.send(tokens, self.groups.coordinator_rank)
                if plan.record_logits:
                    dist.send(logits.contiguous(), self.groups.coordinator_rank)

    def _receive_tokens(self, plan: StepPlan) -> None:
        """Coordinator: the sampled tokens of ``plan`` from the last stage; book-keep."""
        n = plan.num_requests
        if self.executor.num_stages == 1:
            tokens, logits = self._local_tokens
        else:
            src = self.groups.global_rank(self.executor.num_stages - 1, 0)
            tokens = torch.empty(n, dtype=torch.int64, device=self.device)
            dist.recv(tokens, src)
            logits = None
            if plan.record_logits:
                logits = torch.empty(n, self.preset.vocab_size, dtype=torch.float32, device=self.device)
                dist.recv(logits, src)
        self._book_keep(plan, StepOutput(tokens, logits if plan.record_logits else None))
