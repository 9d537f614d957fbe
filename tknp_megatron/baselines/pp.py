"""Pipeline-parallel baseline: N stages x TP T, about N microbatches in flight.

Stage s stores the same layer block as TKNP's node s, and keeps the KV cache of *every*
request for *its own* layers (so a request reserves the same block ids on every stage
and the pool has one logical owner). The coordinator (stage 0, TP rank 0) splits the
running requests into microbatches (each request joins the smallest at admission and
stays there) and cycles over them: a microbatch's next step enters stage 0 as soon as
its previous tokens come back from the last stage, so with M = N microbatches every
stage stays busy (vLLM-style pipelining, no per-step fill and drain). A step's plan goes
host to host over gloo (:class:`~tknp_megatron.engine.plan_broadcast.PlanLink`: from the
coordinator to stage 0's other TP ranks, and from each stage to the next stage's
matching TP rank as the stage starts the step), so no rank waits on its GPU to learn
what comes next; the hidden state follows over the device group, and the last stage
returns the sampled tokens to the coordinator.

With CUDA graphs, each stage replays its own share of a pure-decode microbatch step (the
embedding on stage 0, its layers, the sampling on the last stage) from a graph per batch
bucket, captured when the engine is built, as TKNP's whole step is
(:mod:`~tknp_megatron.executor.cuda_graphs`). The plan and the hidden state still travel
between stages outside the graphs, as the real rows only: each stage pads them into its
graph's buffers and sends the real rows of its output on.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from tknp_megatron.attention import get_backend
from tknp_megatron.engine.base import BuiltExecutor, InferenceEngine
from tknp_megatron.engine.kv_budget import kv_cache_spec, pool_block_counts
from tknp_megatron.engine.plan_broadcast import PlanLink
from tknp_megatron.executor.base import StepOutput
from tknp_megatron.executor.dense import dense_rows, finish_layer, pad_rows, qkv_projection, vocab_logits
from tknp_megatron.executor.dense_fusion import DenseFusion, dense_fusion_for
from tknp_megatron.executor.ingest import Admitter, KVSlice
from tknp_megatron.executor.owner_attention import OwnerAttention
from tknp_megatron.executor.prompt_log_probs import PromptRows, prompt_log_probs
from tknp_megatron.executor.rope import Rope
from tknp_megatron.executor.step_inputs import GraphStep, PaddedStep, padded_step, prepare_inputs
from tknp_megatron.executor.tknp import draw_tokens
from tknp_megatron.models.precision import dense_autocast, row_alignment
from tknp_megatron.sampling import pack_log_probs, token_log_probs, unpack_log_probs
from tknp_megatron.kv_cache import PagedKVCache
from tknp_megatron.plan import Admission, StepPlan, build_plan, next_decode_plan

__all__ = ["PPExecutor", "PPInferenceEngine"]


class PPExecutor:
    """One stage's share of a microbatch step: receive, run its layers, pass on (an
    :class:`~tknp_megatron.executor.base.Executor`)."""

    def __init__(self, model, placement, groups, kv: PagedKVCache, rope, backend, vocab, device,
                 fusion: Optional[DenseFusion] = None):
        cfg = model.config
        self.model, self.groups, self.kv, self.rope = model, groups, kv, rope
        self.vocab, self.device, self.dtype = vocab, device, cfg.params_dtype
        self.fusion = fusion  # the root's fused element-wise kernels (None: Megatron's modules)
        self.stage, self.num_stages = groups.node, groups.num_nodes
        t = groups.tp_size
        local_kv_heads = cfg.num_query_groups // t
        self.attend = OwnerAttention(kv, rope, backend, cfg.num_attention_heads // t,
                                     local_kv_heads, cfg.kv_channels, fused_rope=fusion is not None and fusion.rope)
        kv_slice = KVSlice.tp_heads(model.layer_ids, groups.tp_rank, t, local_kv_heads, cfg.kv_channels)
        self.admitter = Admitter(kv, kv_slice, device)  # every stage stores every request
        self.local_layer = {layer: i for i, layer in enumerate(model.layer_ids)}
        self.hidden_size = cfg.hidden_size
        # the stage's hidden state: the step's rows, then zero rows up to a multiple of this
        # (FP8 GEMMs' alignment, where exact; models/precision.py: row_alignment); only the
        # step's rows travel between stages
        self.row_align = row_alignment(cfg)
        self._pending: List = []  # sends of the previous tick still in flight
        self._local: Dict[int, StepOutput] = {}  # one-stage pipeline: step -> its output
        self.graphs = None  # set by enable_cuda_graphs
        # graphs: the padded plans and inputs of the last steps (a microbatch's next plan is
        # derived from its plan before, some steps back)
        self._recent: "OrderedDict[int, PaddedStep]" = OrderedDict()
        self._recent_kept = max(8, 2 * self.num_stages)
        self.plan_owners = 1  # every plan has one logical owner: every stage holds every request
        # plans stage to stage, host to host (the pool's gloo group)
        last = self.num_stages - 1
        cpu = groups.pool_cpu_group
        self._plan_out = PlanLink(cpu, self._rank(self.stage + 1)) if self.stage < last else None
        self._plan_in = PlanLink(cpu, self._rank(self.stage - 1)) if self.stage > 0 else None

    def enable_cuda_graphs(self, max_requests_per_owner: int = 0) -> None:
        """Replay this stage's share of pure-decode steps from CUDA graphs, one per batch
        bucket; with ``max_requests_per_owner``, on a GPU, capture every bucket up to it
        now (every rank of the stage together: the graphs hold its TP collectives).

        Off GPU the bucketed, padded path runs eagerly (what the graphs replay)."""
        from tknp_megatron.executor.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, capture=self.device.type == "cuda")
        if max_requests_per_owner and self.graphs.capture:
            self.graphs.capture_buckets(max_requests_per_owner)

    # ---------------------------------------------------------------- links
    def _rank(self, stage: int, tp_rank: Optional[int] = None) -> int:
        return self.groups.global_rank(stage, tp_rank)

    def flush(self) -> None:
        """Wait for the sends still in flight."""
        for work in self._pending:
            work.wait()
        self._pending = []
        if self._plan_out is not None:
            self._plan_out.flush()

    def _send_hidden(self, hidden: torch.Tensor) -> None:
        """The hidden state ``[rows, 1, D]`` to the next stage's matching TP rank."""
        for work in self._pending:
            work.wait()
        hidden = hidden.contiguous()
        self._pending = [dist.isend(hidden, self._rank(self.stage + 1), group=self.groups.tknp_group)]
        self._keep = hidden  # alive until the send completes

    def receive_plan(self) -> StepPlan:
        """Stages 1..N-1: the next plan from the previous stage's matching TP rank (host to
        host: no wait on either GPU)."""
        return self._plan_in.recv()

    def _receive_hidden(self, plan: StepPlan) -> torch.Tensor:
        """``[rows, 1, D]`` hidden state of ``plan`` from the previous stage."""
        hidden = torch.empty(plan.num_rows, 1, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(hidden, self._rank(self.stage - 1), group=self.groups.tknp_group)
        return hidden

    def stop(self, plan: StepPlan) -> None:
        """Pass the stop plan down the pipeline and wait for the sends in flight."""
        if self._plan_out is not None:
            self._plan_out.send(plan)
        self.flush()

    def receive_tokens(self, plan: StepPlan) -> StepOutput:
        """Coordinator: the sampled tokens ``[R]`` (and logits) of ``plan`` from the last stage."""
        if self.num_stages == 1:
            return self._local.pop(plan.step)
        n, src = plan.num_requests, self._rank(self.num_stages - 1, 0)
        tokens = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.recv(tokens, src)
        logits = None
        if plan.record_logits:
            logits = torch.empty(n, self.vocab, dtype=torch.float32, device=self.device)
            dist.recv(logits, src)
        top_n = plan.log_probs_top_n
        if top_n < 0:
            return StepOutput(tokens, logits)
        packed = torch.empty(n, 1 + 2 * top_n, dtype=torch.float32, device=self.device)
        dist.recv(packed, src)
        prompt = None
        if plan.prompt_rows is not None:  # the prompts' log-probs of a prefill step
            prompt = torch.empty(len(plan.prompt_rows), 1 + 2 * top_n, dtype=torch.float32, device=self.device)
            dist.recv(prompt, src)
        return StepOutput(tokens, logits, *unpack_log_probs(packed, top_n), prompt)

    # ---------------------------------------------------------------- compute
    def apply_admissions(self, admissions: List[Admission]) -> None:
        """Every stage holds every request's KV for its layers: assign all admissions."""
        self.admitter.apply(admissions)

    @torch.no_grad()
    def execute(self, plan: StepPlan, timer=None) -> Optional[StepOutput]:
        """This stage's share of ``plan``: the hidden state from the previous stage (stages
        > 0), its layers, then on to the next stage; the last stage returns the tokens
        ``[R]`` (and logits ``[R, V]``) and sends them to the coordinator."""
        if self._plan_out is not None:  # the next stage learns the step before this one runs it
            self._plan_out.send(plan)
        hidden = self._receive_hidden(plan) if self.stage > 0 else None
        self.apply_admissions(plan.admissions)
        use_graph = (self.graphs is not None and timer is None and plan.num_requests and plan.max_query_len == 1
                     and not plan.record_logits and plan.log_probs_top_n < 0)  # graphs replay the tokens-only step
        with dense_autocast(self.model.config, self.groups.tp_group):  # FP8 GEMMs if stored FP8
            if use_graph:
                out = self.graphs.run(plan, hidden)  # hidden [R, 1, D], or the last stage's tokens [R]
                out = out if self.stage < self.num_stages - 1 else (out, None, None)
            else:
                out = self._run(plan, hidden)
        if self.stage < self.num_stages - 1:
            self._send_hidden(out)
            return None
        if not plan.num_requests:
            return None
        tokens, logits, prompt = out
        top_n = plan.log_probs_top_n
        log_probs = token_log_probs(logits, tokens, top_n) if top_n >= 0 else (None, None, None)
        output = StepOutput(tokens, logits if plan.record_logits else None, *log_probs, prompt)
        coordinator = self.groups.coordinator_rank
        if self.num_stages == 1:
            if self.groups.is_coordinator:
                self._local[plan.step] = output  # read back by receive_tokens
        elif self.groups.tp_rank == 0:  # tokens (and logits, log-probs) go to the coordinator
            dist.send(tokens, coordinator)
            if plan.record_logits:
                dist.send(logits.contiguous(), coordinator)
            if top_n >= 0:
                dist.send(pack_log_probs(*log_probs), coordinator)
            if prompt is not None:
                dist.send(prompt, coordinator)
        return output

    def _run(self, plan: StepPlan, hidden: Optional[torch.Tensor]):
        """This stage's layers for ``plan``: hidden ``[rows, 1, D]`` out, or on the last
        stage ``(tokens [R], logits [R, V], the prompts' packed log-probs or None)``."""
        if not plan.num_requests:  # admissions only: nothing to compute this tick
            return torch.empty(0, 1, self.hidden_size, dtype=self.dtype, device=self.device)
        return self._forward(prepare_inputs(plan, 0, self.kv, self.rope, self.device), hidden,
                             PromptRows.of(plan, self.device), plan.log_probs_top_n)

    def _forward(self, inp, hidden: Optional[torch.Tensor], prompt: Optional[PromptRows] = None, top_n: int = -1):
        """The stage's computation over prepared inputs: (stage 0) the embedding, the
        stage's layers, and (last stage) the logits and tokens, and with ``prompt`` its
        rows' log-probs (``top_n`` top tokens each, packed); ``hidden`` ``[rows, 1, D]``
        in, ``[rows, 1, D]`` out (the alignment's zero rows stay on the stage)."""
        inp = self.attend.prepare(inp)  # the attention kernel's schedule, once for every layer
        rows = inp.shape.num_rows
        if self.stage == 0:
            hidden = self.model.embedding(inp.tokens.unsqueeze(0), position_ids=None)
        hidden = pad_rows(hidden, self.row_align)  # [dense rows, 1, D]
        for layer in self.model.layer_ids:
            block = self.model.layer(layer)
            attn = self.attend(self.local_layer[layer], qkv_projection(block, hidden, self.fusion)[:rows], inp)
            hidden = finish_layer(block, pad_rows(attn, self.row_align).unsqueeze(1), hidden, self.fusion)
        if self.stage < self.num_stages - 1:
            return hidden[:rows]
        groups = self.groups
        logits = vocab_logits(self.model, hidden, inp.last_rows, groups.tp_group, groups.tp_size, self.vocab)
        packed = None
        if prompt is not None:
            packed = prompt_log_probs(self.model, hidden, prompt, top_n, groups.tp_group, groups.tp_size, self.vocab)
        return draw_tokens(logits, inp.sampling, inp.shape.all_greedy), logits, packed

    # ---------------------------------------------------------------- graphs
    def graph_inputs(self, plan: StepPlan, hidden: Optional[torch.Tensor], max_seq_len: int):
        """For :class:`~tknp_megatron.executor.cuda_graphs.DecodeGraphs`: ``(layout key,
        (inputs of the padded plan, padded hidden [rows, 1, D] or None on stage 0), [R]
        index of each real request in the padded batch)``; ``hidden`` is the previous
        stage's real rows (None: zeros, as the captures at start-up run)."""
        done = padded_step(plan, 0, self.kv.dummy_slot, self.device.type == "cuda", self._recent.get(plan.follows))
        self._recent[plan.step] = done
        if len(self._recent) > self._recent_kept:
            self._recent.popitem(last=False)
        inp = GraphStep(done.host, max_seq_len)
        buf = None
        if self.stage > 0:
            rows = dense_rows(done.padded.num_rows, self.row_align)  # the zero rows too: nothing pads them per replay
            buf = torch.zeros(rows, 1, self.hidden_size, dtype=self.dtype, device=self.device)
            if hidden is not None:  # one owner: the real requests are the padded batch's first rows
                buf[: hidden.shape[0]].copy_(hidden)
        return inp.key, (inp, buf), done.index

    def graph_forward(self, inputs) -> torch.Tensor:
        """The captured body: the padded hidden ``[rows, 1, D]``, or on the last stage the
        padded tokens ``[rows]``."""
        step, hidden = inputs
        out = self._forward(step.inputs(self.kv, self.rope, None), hidden)
        return out if self.stage < self.num_stages - 1 else out[0]


class PPInferenceEngine(InferenceEngine):
    """The PP baseline behind the engines' surface (add_request, step, generate, metrics).

    ``placement`` gives the stages' layer blocks; ``groups.num_nodes`` is the stage count.
    The coordinator's :meth:`step` is one tick of the microbatch cycle: book the tokens of
    the microbatch's step in flight, then plan and issue its next step.
    """

    def __init__(self, model, preset, placement, groups, config, device, *,
                 num_microbatches: Optional[int] = None, **kwargs):
        super().__init__(model, preset, placement, groups, config, device, **kwargs)
        self.num_microbatches = num_microbatches or self.groups.num_nodes
        self._awaiting: List[Optional[StepPlan]] = [None] * self.num_microbatches  # tokens due
        # each microbatch's last plan and the requests it was built from (next_decode_plan)
        self._last: List[Tuple[Optional[StepPlan], tuple]] = [(None, ())] * self.num_microbatches
        self._cursor = 0  # the microbatch the coordinator's next tick serves
        # stage 0's plans, host to host: the coordinator to each other TP rank of stage 0
        g = self.groups
        if g.is_coordinator:
            self._stage0 = [PlanLink(g.pool_cpu_group, g.global_rank(0, t)) for t in range(1, g.tp_size)]
        elif g.node == 0:
            self._stage0 = [PlanLink(g.pool_cpu_group, g.coordinator_rank)]
        else:
            self._stage0 = []

    def _build_executor(self, model) -> BuiltExecutor:
        layers = len(model.layer_ids)
        spec = kv_cache_spec(self.preset, model.config, self.groups, self.config, self.device, layers)
        blocks = min(pool_block_counts(spec, self.groups, self.device))
        # every stage must hold every request's blocks: one logical owner, pool minimum
        kv = PagedKVCache(spec.with_blocks(blocks), self.device)
        rope = Rope(self.preset, model.config, self.device)
        backend = get_backend(self.config.attention_backend, self.device)
        executor = PPExecutor(model, self.placement, self.groups, kv, rope, backend,
                              self.preset.vocab_size, self.device,
                              dense_fusion_for(model, self.device, self.config.fused_elementwise,
                                               self.config.fused_rope))
        return BuiltExecutor(executor, kv, (blocks,))

    # ---------------------------------------------------------------- serving
    def _problem(self, req):
        reason = super()._problem(req)
        if reason is None and req.kv is not None:
            return f"request {req.request_id}: the PP baseline takes outside KV only as synthetic_kv"
        return reason

    def _steps_in_flight(self) -> bool:
        return any(p is not None for p in self._awaiting)

    def _forget_in_flight(self) -> None:
        self._awaiting = [None] * self.num_microbatches
        self._last = [(None, ())] * self.num_microbatches

    def _lead(self) -> List[int]:
        """One tick: book microbatch m's tokens if its step is in flight, then plan and
        issue its next step; the next tick serves microbatch m + 1."""
        timing = self.loop_timing
        start, waited = time.perf_counter(), timing.wait_s
        m = self._cursor
        self._cursor = (m + 1) % self.num_microbatches
        finished, booked = [], None
        if self._awaiting[m] is not None:
            plan, self._awaiting[m] = self._awaiting[m], None
            received = time.perf_counter()
            out = self.executor.receive_tokens(plan)  # the last stage's send (gloo: blocking)
            timing.wait_s += time.perf_counter() - received
            booked = self._read_tokens(out)
            finished = self._book(plan, booked, out)
        plan = self._plan_for(m, booked)
        if plan is not None:
            self._issue(plan)
            self._awaiting[m] = plan if plan.num_requests else None
        timing.add(time.perf_counter() - start - (timing.wait_s - waited))  # one microbatch's tick
        return finished

    def _plan_for(self, m: int, booked: Optional[List[int]] = None) -> Optional[StepPlan]:
        """Microbatch ``m``'s next plan (None: nothing to run or admit): derived from its plan
        before and the tokens just ``booked`` where :func:`next_decode_plan` can, else built."""
        self._release_due()
        result = self.scheduler.schedule()
        for req in result.admitted:
            req.microbatch = -1  # not placed yet: not counted below
        for req in result.admitted:  # join the smallest microbatch, for good
            sizes = [0] * self.num_microbatches
            for r in (r for reqs in self.scheduler.running for r in reqs if r.microbatch >= 0):
                sizes[r.microbatch] += 1
            req.microbatch = min(range(len(sizes)), key=lambda i: (sizes[i], i))
        batch = [r for r in result.batch if r.microbatch == m]
        if not batch and not result.admissions:
            return None
        self._step += 1
        plan = None
        if booked is not None:
            plan = next_decode_plan(self._step, *self._last[m], batch, result.admissions, booked)
        if plan is None:
            plan = build_plan(self._step, batch, result.admissions, 1, self.config.record_logits)
        self._last[m] = (plan, tuple(batch))
        return plan

    def _issue(self, plan: StepPlan) -> None:
        """Coordinator: hand ``plan`` to stage 0's other TP ranks, run stage 0's share."""
        self._to_stage0(plan)
        self.executor.execute(plan)

    def shutdown(self) -> None:
        """Coordinator: stop the pipeline (every stage returns from :meth:`serve`)."""
        self._require_coordinator("shutdown")
        stop = StepPlan.stop_plan(1)
        self._to_stage0(stop)
        self.executor.stop(stop)
        for link in self._stage0:
            link.flush()

    def _to_stage0(self, plan: StepPlan) -> None:
        for link in self._stage0:
            link.send(plan)

    def _follow(self) -> bool:
        """One plan on a rank other than the coordinator: stage 0's other TP ranks take it
        from the coordinator, later stages from the previous stage; False on the stop plan."""
        start = time.perf_counter()
        if self.groups.node == 0:
            plan = self._stage0[0].recv()
        else:
            plan = self.executor.receive_plan()
        if plan.stop:
            self.executor.stop(plan)
            return False
        received = time.perf_counter()
        self.executor.execute(plan)
        self.loop_timing.add(time.perf_counter() - received, received - start)
        return True
