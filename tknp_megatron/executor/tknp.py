"""One TKNP step over all layers, run by every rank in its role for each layer.

For layer l with active root b(l):
  root:   input norm + QKV projection for the whole batch (TP inside the node)
  comm:   scatter each owner's QKV rows (matching TP ranks)
  owners: RoPE, append K/V to the local paged cache, attention for their own requests
  comm:   gather attention outputs to the root, in batch order
  root:   output projection (TP all-reduce), residual, pre-MLP norm, MLP, residual
At block boundaries the hidden state moves to the next root; the last root computes
logits and samples; the sampled tokens are broadcast to every rank.

:meth:`TKNPExecutor.forward` is the whole layer loop over prepared inputs; it has no host
work, so decode steps replay it from CUDA graphs (:mod:`tknp_megatron.executor.cuda_graphs`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from parallel_state import TokenParallelGroups
from tknp_megatron.attention import AttentionBackend
from tknp_megatron.executor.base import StepOutput
from tknp_megatron.executor.comm import TokenParallelComm
from tknp_megatron.executor.dense import dense_rows, finish_layer, pad_rows, qkv_projection, vocab_logits
from tknp_megatron.executor.dense_fusion import DenseFusion
from tknp_megatron.executor.ingest import Admitter, KVIngest, KVSlice
from tknp_megatron.executor.owner_attention import OwnerAttention
from tknp_megatron.executor.prompt_log_probs import PromptRows, prompt_log_probs
from tknp_megatron.executor.rope import Rope
from tknp_megatron.executor.step_inputs import GraphStep, PaddedStep, StepInputs, padded_step, prepare_inputs
from tknp_megatron.kv_cache import PagedKVCache
from tknp_megatron.models.model import StageModel
from tknp_megatron.models.precision import dense_autocast, row_alignment
from tknp_megatron.placement import Placement
from tknp_megatron.plan import Admission, StepPlan
from tknp_megatron.profiler import PhaseTimer
from tknp_megatron.sampling import (
    SamplingTensors,
    greedy,
    pack_log_probs,
    sample,
    token_log_probs,
    unpack_log_probs,
)

__all__ = ["TKNPExecutor", "draw_tokens"]


class TKNPExecutor:
    """Runs step plans for one rank (an :class:`~tknp_megatron.executor.base.Executor`).

    Args:
        model: the blocks this rank stores (Megatron modules).
        placement: layer blocks and roots.
        groups: this rank's TP / token-parallel groups.
        kv: this rank's paged KV cache.
        rope: RoPE for owners.
        attention: attention backend for owners.
        vocab_size: unpadded vocabulary (padded logits are cut before sampling).
        device: this rank's device.
        ingest: where outside KV of admitted requests comes from (None: synthetic only).
        fusion: the root's fused element-wise kernels (None: Megatron's modules).
    """

    def __init__(
        self,
        model: StageModel,
        placement: Placement,
        groups: TokenParallelGroups,
        kv: PagedKVCache,
        rope: Rope,
        attention: AttentionBackend,
        vocab_size: int,
        device: torch.device,
        ingest: Optional[KVIngest] = None,
        fusion: Optional[DenseFusion] = None,
    ):
        cfg = model.config
        self.model, self.placement, self.groups, self.kv = model, placement, groups, kv
        self.rope, self.attention, self.vocab_size, self.device = rope, attention, vocab_size, device
        self.fusion = fusion
        self.comm = TokenParallelComm(groups)
        self.node = groups.node
        t = groups.tp_size
        self.heads = cfg.num_attention_heads // t
        self.local_kv_heads = cfg.num_query_groups // t
        self.head_dim = cfg.kv_channels
        self.attend = OwnerAttention(kv, rope, attention, self.heads, self.local_kv_heads, self.head_dim,
                                     fused_rope=fusion is not None and fusion.rope)
        self.qkv_width = self.attend.qkv_width
        self.hidden_size = cfg.hidden_size
        self.dtype = cfg.params_dtype
        self.last_root = placement.root_of_layer(placement.num_layers - 1)
        kv_slice = KVSlice.tp_heads(range(placement.num_layers), groups.tp_rank, t, self.local_kv_heads,
                                    self.head_dim)  # an owner keeps every layer of its requests
        self.admitter = Admitter(kv, kv_slice, device, owner=self.node, ingest=ingest)
        self.graphs = None  # set by enable_cuda_graphs
        self.plan_owners = groups.num_nodes  # a plan's owners: every node
        # the roots' hidden state: the step's rows, then zero rows up to a multiple of this
        # (FP8 GEMMs' alignment, where exact; models/precision.py: row_alignment)
        self.row_align = row_alignment(cfg)
        self.last_tokens: Optional[torch.Tensor] = None  # [R] previous step's tokens (device)
        self.graph_last: Optional[torch.Tensor] = None  # graphs: the previous step's tokens, fixed
        self._padded: Optional[PaddedStep] = None  # graphs: the last step's padded plan and inputs

    def enable_cuda_graphs(self, max_requests_per_owner: int = 0) -> None:
        """Replay pure-decode steps from CUDA graphs (per ownership-layout bucket); with
        ``max_requests_per_owner``, on a GPU, capture every bucket up to it now
        (collective).

        Off GPU the bucketed, padded decode path runs eagerly (what the graphs replay),
        and nothing is captured ahead (``graphs.capture_buckets`` runs those steps eagerly).
        """
        from tknp_megatron.executor.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, capture=self.device.type == "cuda")
        most = self.groups.num_nodes * self.kv.spec.max_slots  # requests a plan can hold
        self.graph_last = torch.zeros(most, dtype=torch.int64, device=self.device)
        if max_requests_per_owner and self.graphs.capture:
            self.graphs.capture_buckets(max_requests_per_owner)

    # ---------------------------------------------------------------- step
    @torch.no_grad()
    def execute(self, plan: StepPlan, timer: Optional[PhaseTimer] = None) -> StepOutput:
        """Run ``plan`` on this rank; every rank returns the same :class:`StepOutput`.

        Nothing here waits for the GPU: the returned tokens are still being computed
        when it returns (the engine reads them after queueing the next step).
        """
        self.apply_admissions(plan.admissions)
        use_graph = (self.graphs is not None and timer is None and not plan.record_logits
                     and plan.log_probs_top_n < 0)  # graphs replay the tokens-only step
        with dense_autocast(self.model.config, self.groups.tp_group):  # FP8 GEMMs if stored FP8
            if use_graph and plan.max_query_len == 1:
                out = StepOutput(self.graphs.run(plan, self.last_tokens))
            else:
                inputs = prepare_inputs(plan, self.node, self.kv, self.rope, self.device,
                                        last_tokens=self.last_tokens)
                out = self.forward(inputs, plan.record_logits, timer, plan.log_probs_top_n,
                                   PromptRows.of(plan, self.device))
        self.last_tokens = out.tokens
        return out

    def forward(self, inp: StepInputs, record_logits: bool = False, timer=None,
                top_n: int = -1, prompt: Optional[PromptRows] = None) -> StepOutput:
        """The layer loop and sampling over prepared inputs (log-probs with ``top_n`` top
        tokens when ``top_n >= 0``, and at ``prompt``'s rows where given)."""
        inp = self.attend.prepare(inp)  # the attention kernel's schedule, once for every layer
        hidden = self._embed(inp) if self.node == self.placement.root_of_layer(0) else None
        num_layers = self.placement.num_layers
        for layer in range(num_layers):
            root = self.placement.root_of_layer(layer)
            hidden = self._layer(layer, root, hidden, inp, timer)
            nxt = self.placement.root_of_layer(layer + 1) if layer + 1 < num_layers else root
            if nxt != root:
                hidden = self._handoff(hidden, root, nxt, inp)
                _mark(timer, "handoff")
        return self._sample(hidden, inp, record_logits, top_n=top_n, prompt=prompt)

    # ---------------------------------------------------------------- graphs
    def graph_inputs(self, plan: StepPlan, last_tokens, max_seq_len: int):
        """For :class:`~tknp_megatron.executor.cuda_graphs.DecodeGraphs`: ``(layout key, host
        inputs of the padded plan, [R] index of each real request in the padded batch)``.
        The previous step's tokens go to the fixed buffer the captured body reads."""
        self._padded = padded_step(plan, self.node, self.kv.dummy_slot, self.device.type == "cuda", self._padded)
        step = GraphStep(self._padded.host, max_seq_len)
        if last_tokens is not None:
            self.graph_last[: last_tokens.shape[0]].copy_(last_tokens)
        return step.key, step, self._padded.index

    def graph_forward(self, step: GraphStep) -> torch.Tensor:
        """The captured body: the step's device inputs, the layers and sampling; ``[R_padded]`` tokens."""
        return self.forward(step.inputs(self.kv, self.rope, self.graph_last)).tokens

    # ---------------------------------------------------------------- owner side
    def apply_admissions(self, admissions: Sequence[Admission]) -> None:
        """Write this node's newly admitted requests' block tables (and ingested KV)."""
        self.admitter.apply(admissions)

    # ---------------------------------------------------------------- root side
    def _hidden_buffer(self, rows: int) -> torch.Tensor:
        return torch.empty(dense_rows(rows, self.row_align), 1, self.hidden_size, dtype=self.dtype,
                           device=self.device)

    def _embed(self, inp: StepInputs) -> torch.Tensor:
        """``[rows]`` token ids -> ``[dense rows, 1, D]`` (Megatron's [s, b, h]): the step's
        rows, then zero rows up to the dense alignment. The roots' norms, GEMMs and MLP run
        over every row; the zero rows stay zero (``row_alignment`` says where that holds),
        never reach an owner and are never sampled."""
        return pad_rows(self.model.embedding(inp.tokens.unsqueeze(0), position_ids=None), self.row_align)

    def _layer(self, layer, root, hidden, inp: StepInputs, timer):
        is_root = self.node == root
        block = self.model.layer(layer) if is_root else None
        qkv = None
        if is_root:
            qkv = qkv_projection(block, hidden, self.fusion)
            _mark(timer, "root_qkv")
        mine = self._scatter_qkv(qkv, root, inp)
        _mark(timer, "scatter")
        attn = self.attend(layer, mine, inp)
        _mark(timer, "attention")
        gathered = self._gather_attention(attn, root, inp)
        _mark(timer, "gather")
        if not is_root:
            return None
        hidden = finish_layer(block, gathered.unsqueeze(1), hidden, self.fusion)
        _mark(timer, "root_proj_mlp")
        return hidden

    # ---------------------------------------------------------------- comm
    def _scatter_qkv(self, qkv: Optional[torch.Tensor], root: int, inp: StepInputs) -> torch.Tensor:
        """This node's rows ``[own_rows, qkv_width]`` of the root's QKV ``[dense rows, qkv_width]``
        (its first ``rows`` rows: the alignment's zero rows stay on the root)."""
        if qkv is not None:
            qkv = qkv[: inp.shape.num_rows]
        if self.comm.num_nodes == 1:  # one node (DP, TP): the root owns every row, nothing moves
            return qkv
        rows = inp.shape.rows_per_owner
        mine = torch.empty(rows[self.node], self.qkv_width, dtype=self.dtype, device=self.device)
        return self.comm.scatter(qkv, root, rows, mine)

    def _gather_attention(self, attn: torch.Tensor, root: int, inp: StepInputs) -> Optional[torch.Tensor]:
        """Every owner's ``[own_rows, W]`` outputs -> ``[dense rows, W]`` in batch order on
        ``root``, zero at the alignment's rows."""
        if self.comm.num_nodes == 1:  # the root's own rows, already in batch order
            return pad_rows(attn, self.row_align)
        rows = inp.shape.num_rows
        dense = dense_rows(rows, self.row_align)
        out = None
        if self.node == root:
            out = (torch.zeros if dense > rows else torch.empty)(dense, attn.shape[1], dtype=self.dtype,
                                                                device=self.device)
        self.comm.gather(attn, root, inp.shape.rows_per_owner, None if out is None else out[:rows])
        return out

    def _handoff(self, hidden, src: int, dst: int, inp: StepInputs):
        """Hidden state ``[dense rows, 1, D]`` from root ``src`` to root ``dst`` (None elsewhere)."""
        buf = self._hidden_buffer(inp.shape.num_rows) if self.node == dst else None
        return self.comm.handoff(hidden, src, dst, buf)

    # ---------------------------------------------------------------- sampling
    def _sample(self, hidden, inp: StepInputs, record_logits: bool, last_root: Optional[int] = None,
                top_n: int = -1, prompt: Optional[PromptRows] = None) -> StepOutput:
        """Logits and tokens on ``last_root`` (default: the last layer's root), broadcast to
        the pool: tokens ``[R]``, logits ``[R, vocab]`` if recorded, and with ``top_n >= 0``
        the log-probs, computed there too (one packed ``[R, 1 + 2 top_n]`` broadcast), and
        those of ``prompt``'s rows (one more, ``[P, 1 + 2 top_n]``)."""
        last_root = self.last_root if last_root is None else last_root
        src = self.groups.global_rank(last_root, 0)
        n = inp.last_rows.shape[0]
        tokens = torch.empty(n, dtype=torch.int64, device=self.device)
        logits = packed = None
        if record_logits:
            logits = torch.empty(n, self.vocab_size, dtype=torch.float32, device=self.device)
        if top_n >= 0:
            packed = torch.empty(n, 1 + 2 * top_n, dtype=torch.float32, device=self.device)
        prompt_packed = None
        if prompt is not None and self.node != last_root:  # the last root makes its own
            prompt_packed = torch.empty(prompt.count, 1 + 2 * top_n, dtype=torch.float32, device=self.device)
        if self.node == last_root:
            g = self.groups
            full = vocab_logits(self.model, hidden, inp.last_rows, g.tp_group, g.tp_size, self.vocab_size)
            tokens = draw_tokens(full, inp.sampling, inp.shape.all_greedy)
            if logits is not None:
                logits.copy_(full)
            if packed is not None:
                pack_log_probs(*token_log_probs(full, tokens, top_n), out=packed)
            if prompt is not None:
                prompt_packed = prompt_log_probs(self.model, hidden, prompt, top_n, g.tp_group, g.tp_size,
                                                 self.vocab_size)
        dist.broadcast(tokens, src=src, group=self.groups.pool_group)
        if logits is not None:
            dist.broadcast(logits, src=src, group=self.groups.pool_group)
        if packed is None:
            return StepOutput(tokens, logits)
        dist.broadcast(packed, src=src, group=self.groups.pool_group)
        if prompt_packed is not None:
            dist.broadcast(prompt_packed, src=src, group=self.groups.pool_group)
        return StepOutput(tokens, logits, *unpack_log_probs(packed, top_n), prompt_packed)


def draw_tokens(logits: torch.Tensor, sampling: SamplingTensors, all_greedy: bool) -> torch.Tensor:
    """``[R, vocab]`` -> ``[R]`` tokens: argmax when the whole step is greedy, else sample."""
    if all_greedy:
        return greedy(logits)
    return sample(logits, *sampling)


def _mark(timer: Optional[PhaseTimer], phase: str) -> None:
    if timer is not None:
        timer.mark(phase)
