"""Decode context parallelism (DCP, as in vLLM) run by the TKNP engine and scheduler.

One pool of W ranks, one "node": dense layers are Megatron tensor parallel over all W
ranks (embedding, ``linear_proj``, MLP, output layer: Megatron's modules with TP = W).
Each rank computes its ``Hq / W`` query heads; the ``D = W / Hkv`` ranks that share a KV
head compute that head's k/v redundantly (:class:`~.dcp_qkv.DCPQKVLinear`) but *store*
only their sequence shard: position ``p`` lives on shard ``p % D`` at local position
``p // D`` (cyclic; see :mod:`.dcp_attention`). Per layer, on every rank:

1. norm + QKV (own q heads, the group's k/v), RoPE;
2. append k/v of the rows whose position falls in this shard;
3. all-gather the queries of the D ranks of the group  -> ``[rows, Hq / Hkv, d]``;
4. partial attention over the local shard              -> out ``[rows, Hq/Hkv, d]``, LSE fp32
   (Triton split-K kernel on pure-decode steps on CUDA, torch otherwise);
5. all-gather LSE ``[rows, Hq / Hkv]`` and all-to-all the partial outputs so each rank
   gets the D partials of its own heads; merge with the LSE correction;
6. ``linear_proj`` (row parallel, all-reduce over W), residual, norm, MLP, residual.

Blocks: the scheduler's block of ``B`` tokens is one local block of ``B / D`` tokens on
each shard (token p -> local block ``(p // D) // (B / D) = p // B``), so the same block
table row serves every rank and capacity is counted in whole-sequence tokens.

With CUDA graphs, pure-decode steps replay from a graph per batch bucket
(:mod:`~tknp_megatron.executor.cuda_graphs`, captured when the engine is built): the
padded plan's host vectors cross into the graph's fixed buffers
(:class:`~tknp_megatron.executor.step_inputs.GraphStep`), and the captured body derives
inputs of fixed shapes per bucket from them (:func:`~.dcp_inputs.dcp_decode_inputs`: every
row writes, those this shard does not hold to the scratch block), then runs steps 1-6
above, the collectives included.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from parallel_state import TokenParallelGroups
from tknp_megatron.attention.flash3 import FlashAttn3Backend, fa3_supports_device, fa3_unavailable_reason, fa3_usable
from tknp_megatron.attention.per_shape import prefer_fa3
from tknp_megatron.baselines.dcp_attention import (
    merge_partials,
    partial_attention,
    partial_attention_fa3,
    partial_attention_triton,
    triton_decode_usable,
)
from tknp_megatron.baselines.dcp_inputs import (
    DCPStepInputs,
    check_dcp_decode,
    dcp_decode_inputs,
    prepare_dcp_inputs,
)
from tknp_megatron.baselines.dcp_qkv import dcp_degree
from tknp_megatron.engine.base import BuiltExecutor
from tknp_megatron.engine.engine import LockstepEngine
from tknp_megatron.engine.kv_budget import budget_blocks, pool_block_counts
from tknp_megatron.executor.base import StepOutput
from tknp_megatron.executor.dense import finish_layer, pad_rows, qkv_projection, vocab_logits
from tknp_megatron.executor.dense_fusion import DenseFusion, dense_fusion_for
from tknp_megatron.executor.ingest import Admitter, KVSlice
from tknp_megatron.executor.prompt_log_probs import PromptRows, prompt_log_probs
from tknp_megatron.executor.rope import Rope
from tknp_megatron.executor.step_inputs import GraphStep, PaddedStep, padded_step
from tknp_megatron.executor.tknp import draw_tokens
from tknp_megatron.kv_cache import KVCacheSpec, PagedKVCache
from tknp_megatron.models.precision import dense_autocast, row_alignment
from tknp_megatron.placement import balanced_placement
from tknp_megatron.plan import Admission, StepPlan
from tknp_megatron.sampling import token_log_probs

__all__ = [
    "DCPGroups", "DCPStepInputs", "DCPExecutor", "DCPInferenceEngine",
    "init_dcp_groups", "dcp_kv_cache_spec", "prepare_dcp_inputs",
]


@dataclass(frozen=True)
class DCPGroups:
    """A rank's place in DCP.

    Attributes:
        degree: D, ranks sharing one KV head.
        shard: j, this rank's sequence shard (its index among the D).
        kv_head: the KV head this rank's group holds.
        group: the D ranks of the group (the TP group itself when D = W).
    """

    degree: int
    shard: int
    kv_head: int
    group: Optional[dist.ProcessGroup]


def init_dcp_groups(groups: TokenParallelGroups, num_query_groups: int) -> DCPGroups:
    """Create the DCP groups (every rank creates every group, in order)."""
    if groups.num_nodes != 1:
        raise ValueError("DCP runs one TP group over the whole pool (token_parallel_size=1)")
    world = groups.tp_size
    degree = dcp_degree(num_query_groups, world)
    kv_head, shard = divmod(groups.tp_rank, degree)
    if degree == world:
        return DCPGroups(degree, shard, kv_head, groups.tp_group)
    mine = None
    for head in range(world // degree):
        ranks = [groups.global_rank(0, head * degree + j) for j in range(degree)]
        pg = dist.new_group(ranks)
        mine = pg if head == kv_head else mine
    return DCPGroups(degree, shard, kv_head, mine)


def dcp_kv_cache_spec(preset, model_config, dcp: DCPGroups, engine_config, device) -> KVCacheSpec:
    """One shard's cache: one KV head, ``block_size / D`` tokens per block, and as many
    blocks as the budget holds in whole-sequence tokens (CPU) or free memory (GPU)."""
    block_size = engine_config.block_size
    if block_size % dcp.degree:
        raise ValueError(f"block_size {block_size} must be a multiple of DCP degree {dcp.degree}")
    probe = KVCacheSpec(
        num_layers=preset.num_layers, num_blocks=1, block_size=block_size // dcp.degree,
        local_kv_heads=1, head_dim=preset.kv_channels, dtype=model_config.params_dtype,
        max_slots=engine_config.max_requests_per_node,
        max_blocks_per_seq=math.ceil(engine_config.sequence_limit(preset) / block_size),
    )
    blocks = budget_blocks(probe.bytes_per_block, engine_config, device)
    if blocks < 1:
        raise RuntimeError(f"DCP shard {dcp.shard}: no memory left for the KV cache")
    return probe.with_blocks(blocks)


class DCPExecutor:
    """Runs step plans for one DCP rank (an :class:`~tknp_megatron.executor.base.Executor`).

    Args:
        model: the whole model, TP-sharded over W, with DCP QKV (see ``build_dcp_model``).
        groups: the pool's groups (one node, TP = W).
        dcp: this rank's DCP group.
        kv: this shard's paged cache (:func:`dcp_kv_cache_spec`).
        rope: RoPE.
        vocab_size: unpadded vocabulary.
        device: this rank's device.
        fusion: the root's fused element-wise kernels (None: Megatron's modules).
        attention_backend: the engine's (``EngineConfig.attention_backend``): with None or
            ``auto``, decode steps run FlashAttention 3 where ``per_shape.prefer_fa3`` takes
            it for the shard's shape (on Hopper with FA3's library there), with ``fa3`` at
            every decode step where it runs, else the Triton kernel (CUDA, or the CPU's
            interpreter); other steps, and decode without either, the torch form.
    """

    def __init__(self, model, groups: TokenParallelGroups, dcp: DCPGroups, kv: PagedKVCache,
                 rope: Rope, vocab_size: int, device: torch.device, fusion: Optional[DenseFusion] = None,
                 attention_backend: Optional[str] = None):
        cfg = model.config
        self.model, self.groups, self.dcp, self.kv, self.rope = model, groups, dcp, kv, rope
        self.vocab_size, self.device = vocab_size, device
        self.fusion = fusion  # the root's fused element-wise kernels (None: Megatron's modules)
        self.num_layers = cfg.num_layers
        self.num_kv_heads = cfg.num_query_groups
        self.heads = cfg.num_attention_heads // groups.tp_size  # own q heads
        self.head_dim = cfg.kv_channels
        self.scale = self.head_dim ** -0.5
        self.dtype = cfg.params_dtype
        # the hidden state: the step's rows, then zero rows up to a multiple of this (FP8
        # GEMMs' alignment, where exact; models/precision.py: row_alignment)
        self.row_align = row_alignment(cfg)
        self.fused_decode = triton_decode_usable(device)  # decode steps on the Triton kernel
        fa3_rule = attention_backend in (None, "auto", "fa3")
        self.fa3 = FlashAttn3Backend() if fa3_rule and fa3_usable(device) else None  # decode, per shape
        self.fa3_always = attention_backend == "fa3"
        if self.fa3_always and self.fa3 is None:
            why = fa3_unavailable_reason() if fa3_supports_device(device) else \
                f"{device} is not a CUDA device of compute capability 9.x"
            raise RuntimeError(f"DCP with attention_backend 'fa3': FA3 does not run here: {why}")
        # this shard's positions p = shard, shard + D, ... of its group's one KV head
        kv_slice = KVSlice(range(self.num_layers), (dcp.kv_head,), self.num_kv_heads, self.head_dim,
                           shard=dcp.shard, num_shards=dcp.degree)
        self.admitter = Admitter(kv, kv_slice, device)  # every rank writes every block-table row
        self.last_tokens = None  # [R] previous step's tokens (device)
        self.graphs = None  # set by enable_cuda_graphs
        self.graph_last: Optional[torch.Tensor] = None  # graphs: the previous step's tokens, fixed
        self._padded: Optional[PaddedStep] = None  # graphs: the last step's padded plan and inputs
        self.plan_owners = 1  # a plan's owners: one node holds every request

    def enable_cuda_graphs(self, max_requests_per_owner: int = 0) -> None:
        """Replay pure-decode steps from CUDA graphs, one per batch bucket (inputs padded
        and derived by :func:`~tknp_megatron.baselines.dcp_inputs.dcp_decode_inputs`); with
        ``max_requests_per_owner``, on a GPU, capture every bucket up to it now (every
        rank of the pool together: the graphs hold the DCP and TP collectives).

        Off GPU the bucketed, padded decode path runs eagerly (what the graphs replay)."""
        from tknp_megatron.executor.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, capture=self.device.type == "cuda")
        self.graph_last = torch.zeros(self.kv.spec.max_slots, dtype=torch.int64, device=self.device)
        if max_requests_per_owner and self.graphs.capture:
            self.graphs.capture_buckets(max_requests_per_owner)

    @torch.no_grad()
    def execute(self, plan: StepPlan, timer=None) -> StepOutput:
        """Run ``plan``; every rank returns the same :class:`StepOutput`."""
        self.apply_admissions(plan.admissions)
        use_graph = (self.graphs is not None and timer is None and plan.max_query_len == 1
                     and not plan.record_logits and plan.log_probs_top_n < 0)  # graphs replay the tokens-only step
        with dense_autocast(self.model.config, self.groups.tp_group):  # FP8 GEMMs if stored FP8
            if use_graph:
                out = StepOutput(self.graphs.run(plan, self.last_tokens))
            else:
                inp = prepare_dcp_inputs(plan, self.dcp, self.kv, self.rope, self.device, self.last_tokens)
                out = self._forward(inp, plan.record_logits, plan.log_probs_top_n, PromptRows.of(plan, self.device))
        self.last_tokens = out.tokens  # rows of the next plan may be fed from them
        return out

    def _forward(self, inp: DCPStepInputs, record_logits: bool = False, top_n: int = -1,
                 prompt: Optional[PromptRows] = None) -> StepOutput:
        """Embedding, the layer loop and sampling over prepared inputs (no host work;
        log-probs at ``prompt``'s rows where given)."""
        hidden = self.model.embedding(inp.tokens.unsqueeze(0), position_ids=None)  # [rows, 1, D]
        hidden = pad_rows(hidden, self.row_align)  # [dense rows, 1, D]: the alignment's zero rows
        for layer in range(self.num_layers):
            hidden = self._layer(layer, hidden, inp)
        out = self._sample(hidden, inp, record_logits, top_n)
        if prompt is None:
            return out
        g = self.groups
        packed = prompt_log_probs(self.model, hidden, prompt, top_n, g.tp_group, g.tp_size, self.vocab_size)
        return dataclasses.replace(out, prompt_log_probs=packed)

    # ---------------------------------------------------------------- graphs
    def graph_inputs(self, plan: StepPlan, last_tokens, max_seq_len: int):
        """For :class:`~tknp_megatron.executor.cuda_graphs.DecodeGraphs`: ``(layout key, host
        inputs of the padded plan, [R] index of each real request in the padded batch)``.
        ``max_seq_len`` is the cache's longest sequence in its own blocks' tokens: for a
        shard's cache (blocks of ``B / D`` tokens) the longest shard-local length. The
        previous step's tokens go to the fixed buffer the captured body reads."""
        self._padded = padded_step(plan, 0, self.kv.dummy_slot, self.device.type == "cuda", self._padded)
        host = self._padded.host
        check_dcp_decode(host, self.dcp, max_seq_len)
        if last_tokens is not None:
            self.graph_last[: last_tokens.shape[0]].copy_(last_tokens)
        return host.shape, GraphStep(host, max_seq_len), self._padded.index

    def graph_forward(self, step: GraphStep) -> torch.Tensor:
        """The captured body: the step's device inputs, the layers and sampling; ``[R_padded]`` tokens."""
        inp = dcp_decode_inputs(step.key, step.staged, self.dcp, self.kv, self.rope, step.max_seq_len,
                                self.graph_last)
        return self._forward(inp).tokens

    def apply_admissions(self, admissions: Sequence[Admission]) -> None:
        """Every rank writes the same block-table row; ingested KV: synthetic only."""
        self.admitter.apply(admissions)

    # ---------------------------------------------------------------- one layer
    def _layer(self, layer: int, hidden: torch.Tensor, inp: DCPStepInputs) -> torch.Tensor:
        block = self.model.layer(layer)
        rows, h, d = inp.shape.num_rows, self.heads, self.head_dim
        qkv = qkv_projection(block, hidden, self.fusion)[:rows].view(rows, h + 2, d)  # own q heads, k, v
        q = self.rope.apply(qkv[:, :h], inp.freqs)
        k = self.rope.apply(qkv[:, h : h + 1], inp.freqs)
        v = qkv[:, h + 1 : h + 2]
        own = inp.own_rows  # None: every row writes (those held elsewhere to the scratch block)
        if own is not None:
            k, v = k.index_select(0, own), v.index_select(0, own)
        self.kv.write(layer, k, v, inp.write_slots)
        k_cache, v_cache = self.kv.layer(layer)
        queries = self._gather_queries(q)  # [rows, D h, d]: the group's heads
        if inp.decode and self._fa3_decode(queries, k_cache, inp):
            out, lse = partial_attention_fa3(queries, k_cache, v_cache, inp.attn, self.scale, self.fa3)
        else:
            attend = partial_attention_triton if inp.decode and self.fused_decode else partial_attention
            out, lse = attend(queries, k_cache, v_cache, inp.attn, self.scale)
        attn = self._merge(out, lse).to(self.dtype).reshape(rows, 1, h * d)
        return finish_layer(block, pad_rows(attn, self.row_align), hidden, self.fusion)

    def _fa3_decode(self, queries: torch.Tensor, k_cache: torch.Tensor, inp: DCPStepInputs) -> bool:
        """Whether this decode step's shard attention runs on FA3 (host ints only: a graph
        replays the kernel it captured)."""
        if self.fa3 is None:
            return False
        return self.fa3_always or prefer_fa3(k_cache.dtype, self.head_dim, k_cache.shape[1], 1,
                                             inp.attn.max_local_len, queries.shape[1] // k_cache.shape[2])

    def _gather_queries(self, q: torch.Tensor) -> torch.Tensor:
        """``[rows, h, d]`` own heads -> ``[rows, D h, d]`` the group's heads, in head order."""
        deg = self.dcp.degree
        if deg == 1:
            return q
        buf = q.new_empty((deg * q.shape[0],) + tuple(q.shape[1:]))  # gloo: dim-0 concatenation
        dist.all_gather_into_tensor(buf, q.contiguous(), group=self.dcp.group)
        return buf.view((deg,) + tuple(q.shape)).permute(1, 0, 2, 3).reshape(q.shape[0], deg * q.shape[1], q.shape[2])

    def _merge(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """Partials over the group's heads ``[rows, D h, d]`` + LSE -> own heads ``[rows, h, d]``.

        LSE (fp32) is all-gathered; the partial outputs (model dtype) go through one
        all-to-all so each rank receives the D shards' partials of its own heads.
        """
        deg, (rows, _, d), h = self.dcp.degree, out.shape, self.heads
        if deg == 1:
            return out
        lses = lse.new_empty((deg * rows, deg * h))
        dist.all_gather_into_tensor(lses, lse.contiguous(), group=self.dcp.group)
        send = out.to(self.dtype).view(rows, deg, h, d).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)  # [D source shards, rows, h, d]
        dist.all_to_all_single(recv, send, group=self.dcp.group)
        mine = lses.view(deg, rows, deg, h)[:, :, self.dcp.shard]
        return merge_partials(recv, mine)

    # ---------------------------------------------------------------- sampling
    def _sample(self, hidden: torch.Tensor, inp: DCPStepInputs, record_logits: bool,
                top_n: int = -1) -> StepOutput:
        """Every rank computes the logits (TP all-gather); the coordinator's draw is
        broadcast; log-probs (``top_n >= 0``) are computed on every rank from its logits."""
        g = self.groups
        logits = vocab_logits(self.model, hidden, inp.last_rows, g.tp_group, g.tp_size, self.vocab_size)
        tokens = draw_tokens(logits, inp.sampling, inp.shape.all_greedy)
        dist.broadcast(tokens, src=g.coordinator_rank, group=g.pool_group)
        log_probs = token_log_probs(logits, tokens, top_n) if top_n >= 0 else (None, None, None)
        return StepOutput(tokens, logits if record_logits else None, *log_probs)


class DCPInferenceEngine(LockstepEngine):
    """:class:`~tknp_megatron.engine.engine.LockstepEngine` with a DCP executor and cache.

    Only :meth:`_build_executor` differs from the TKNP engine: the pool is one node (one
    allocator, block counts in whole-sequence tokens); requests, scheduling, stepping and
    metrics are the shared engine's. External KV (``add_request(kv=...)``) is rejected.
    """

    def __init__(self, model, preset, groups: TokenParallelGroups, dcp: DCPGroups, config,
                 device: torch.device, clock=time.perf_counter):
        self.dcp = dcp
        super().__init__(model, preset, balanced_placement(preset, 1), groups, config, device, clock)

    def _build_executor(self, model) -> BuiltExecutor:
        spec = dcp_kv_cache_spec(self.preset, model.config, self.dcp, self.config, self.device)
        block_counts = pool_block_counts(spec, self.groups, self.device)
        kv = PagedKVCache(spec.with_blocks(block_counts[0]), self.device)
        rope = Rope(self.preset, model.config, self.device)
        fusion = dense_fusion_for(model, self.device, self.config.fused_elementwise)
        executor = DCPExecutor(model, self.groups, self.dcp, kv, rope, self.preset.vocab_size, self.device, fusion,
                               self.config.attention_backend)
        return BuiltExecutor(executor, kv, tuple(block_counts))

    def _problem(self, req):
        reason = super()._problem(req)
        if reason is None and req.kv is not None:
            reason = f"request {req.request_id}: external KV ingest is not supported by DCP"
        return reason
