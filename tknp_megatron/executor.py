"""One TKNP step over all layers, run by every rank in its role for each layer.

For layer l with active root b(l) (DESIGN section 7):
  root:   input norm + QKV projection for the whole batch (TP inside the node)
  comm:   scatter each owner's QKV rows (matching TP ranks)
  owners: RoPE, append K/V to the local paged cache, attention for their own requests
  comm:   gather attention outputs to the root, in batch order
  root:   output projection (TP all-reduce), residual, pre-MLP norm, MLP, residual
At block boundaries the hidden state moves to the next root; the last root computes
logits and samples; the sampled tokens are broadcast to every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from parallel_state import TokenParallelGroups

from .attention import AttentionBackend, AttentionMetadata
from .comm import TokenParallelComm
from .kv_cache import PagedKVCache
from .model import StageModel
from .placement import Placement
from .plan import StepPlan
from .rope import Rope
from .sampling import sample

__all__ = ["StepOutput", "TKNPExecutor", "OwnerStep"]


@dataclass(frozen=True)
class StepOutput:
    """Sampled tokens ``[R]`` (batch order) and, if recorded, logits ``[R, vocab]``."""

    tokens: torch.Tensor
    logits: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class OwnerStep:
    """This node's share of a step, computed once and reused by every layer.

    Attributes:
        rows: query rows owned here.
        meta: attention metadata for those rows.
        slot_mapping: ``[rows]`` cache slots for the new K/V.
        freqs: ``[rows, 1, 1, rot_dim]`` RoPE angles.
    """

    rows: int
    meta: AttentionMetadata
    slot_mapping: torch.Tensor
    freqs: torch.Tensor


class TKNPExecutor:
    """Runs step plans for one rank.

    Args:
        model: the blocks this rank stores (Megatron modules).
        placement: layer blocks and roots.
        groups: this rank's TP / token-parallel groups.
        kv: this rank's paged KV cache.
        rope: RoPE for owners.
        attention: attention backend for owners.
        vocab_size: unpadded vocabulary (padded logits are masked before sampling).
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
    ):
        cfg = model.config
        self.model, self.placement, self.groups, self.kv = model, placement, groups, kv
        self.rope, self.attention, self.vocab_size, self.device = rope, attention, vocab_size, device
        self.comm = TokenParallelComm(groups)
        self.node = groups.node
        t = groups.tp_size
        self.heads = cfg.num_attention_heads // t
        self.groups_local = cfg.num_query_groups // t
        self.head_dim = cfg.kv_channels
        self.qkv_width = (self.heads + 2 * self.groups_local) * self.head_dim
        self.hidden_size = cfg.hidden_size
        self.dtype = cfg.params_dtype
        self.scale = self.head_dim ** -0.5
        self.local_ingest = {}  # request id -> KV the coordinator keeps for itself

    # ---------------------------------------------------------------- step
    @torch.no_grad()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run ``plan`` on this rank; every rank returns the same :class:`StepOutput`."""
        self._apply_admissions(plan)
        own = self._owner_step(plan)
        hidden = self._embed(plan) if self.node == self.placement.root_of_layer(0) else None
        num_layers = self.placement.num_layers
        for layer in range(num_layers):
            root = self.placement.root_of_layer(layer)
            hidden = self._layer(layer, root, hidden, plan, own)
            nxt = self.placement.root_of_layer(layer + 1) if layer + 1 < num_layers else root
            if nxt != root:
                buf = self._hidden_buffer(plan) if self.node == nxt else None
                hidden = self.comm.handoff(hidden, root, nxt, buf)
        return self._sample(hidden, plan)

    # ---------------------------------------------------------------- owner side
    def _apply_admissions(self, plan: StepPlan) -> None:
        for adm in plan.admissions:
            if adm.owner != self.node:
                continue
            self.kv.assign(adm.slot, adm.blocks)
            if adm.ingest_len:
                self.kv.ingest(adm.slot, self._ingested_kv(adm))

    def _ingested_kv(self, adm) -> torch.Tensor:
        """KV for the admitted request's first ``ingest_len`` tokens, this rank's heads."""
        shape = (
            self.placement.num_layers, 2, adm.ingest_len, self.groups_local, self.head_dim
        )
        if adm.synthetic_seed is not None:
            gen = torch.Generator(device="cpu").manual_seed(adm.synthetic_seed)
            return torch.randn(shape, generator=gen).to(self.device, self.kv.spec.dtype)
        if adm.request_id in self.local_ingest:  # the coordinator owns it
            return self.local_ingest.pop(adm.request_id)
        buf = torch.empty(shape, dtype=self.kv.spec.dtype, device=self.device)
        dist.recv(buf, src=0)  # the coordinator sends each rank its heads (engine.py)
        return buf

    def _owner_step(self, plan: StepPlan) -> OwnerStep:
        lo, hi = plan.request_range(self.node)
        q_lens = plan.q_lens[lo:hi].to(self.device)
        start = plan.start_pos[lo:hi].to(self.device)
        slots = plan.slots[lo:hi].to(self.device)
        rows = plan.rows_per_owner[self.node]
        cu = torch.zeros(hi - lo + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(q_lens, 0, out=cu[1:])
        row_req = torch.repeat_interleave(torch.arange(hi - lo, device=self.device), q_lens, output_size=rows)
        positions = start[row_req] + torch.arange(rows, device=self.device) - cu[row_req]
        seq_lens = start + q_lens
        meta = AttentionMetadata(
            query_start_loc=cu.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            block_table=self.kv.block_table[slots],
            max_query_len=int(plan.q_lens[lo:hi].max()) if hi > lo else 0,
            max_seq_len=int((plan.start_pos[lo:hi] + plan.q_lens[lo:hi]).max()) if hi > lo else 0,
        )
        mapping = self.kv.slot_mapping(slots[row_req], positions)
        return OwnerStep(rows, meta, mapping, self.rope.freqs(positions))

    def _attend(self, layer: int, qkv: torch.Tensor, own: OwnerStep) -> torch.Tensor:
        """``[rows, qkv_width]`` -> ``[rows, heads * d]`` for this node's requests."""
        per_group = self.heads // self.groups_local
        mixed = qkv.view(own.rows, self.groups_local, per_group + 2, self.head_dim)
        q = mixed[:, :, :per_group].reshape(own.rows, self.heads, self.head_dim)
        k = mixed[:, :, per_group]
        v = mixed[:, :, per_group + 1]
        q = self.rope.apply(q, own.freqs)
        k = self.rope.apply(k, own.freqs)
        self.kv.write(layer, k, v, own.slot_mapping)
        k_cache, v_cache = self.kv.layer(layer)
        out = self.attention.forward(q, k_cache, v_cache, own.meta, self.scale)
        return out.reshape(own.rows, self.heads * self.head_dim)

    # ---------------------------------------------------------------- root side
    def _hidden_buffer(self, plan: StepPlan) -> torch.Tensor:
        return torch.empty(plan.num_rows, 1, self.hidden_size, dtype=self.dtype, device=self.device)

    def _embed(self, plan: StepPlan) -> torch.Tensor:
        """``[rows]`` token ids -> ``[rows, 1, D]`` (Megatron's [s, b, h])."""
        ids = plan.tokens.to(self.device).unsqueeze(1)  # [s, b] -> embedding wants [b, s]
        return self.model.embedding(ids.t().contiguous(), position_ids=None)

    def _layer(self, layer, root, hidden, plan: StepPlan, own: OwnerStep):
        is_root = self.node == root
        block = self.model.layer(layer) if is_root else None
        qkv = None
        if is_root:
            normed = block.input_layernorm(hidden)
            qkv, _ = block.self_attention.linear_qkv(normed)
            qkv = qkv.view(plan.num_rows, self.qkv_width)
        mine = torch.empty(own.rows, self.qkv_width, dtype=self.dtype, device=self.device)
        mine = self.comm.scatter(qkv, root, plan.rows_per_owner, mine)
        attn = self._attend(layer, mine, own)
        gathered = None
        if is_root:
            gathered = torch.empty(plan.num_rows, attn.shape[1], dtype=self.dtype, device=self.device)
        gathered = self.comm.gather(attn, root, plan.rows_per_owner, gathered)
        if not is_root:
            return None
        return self._finish_layer(block, gathered.unsqueeze(1), hidden)

    @staticmethod
    def _finish_layer(block, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Megatron's order: linear_proj, bias-dropout-add, pre-MLP norm, MLP, bias-dropout-add."""
        cfg = block.config
        out = block.self_attention.linear_proj(attn)
        hidden = block.self_attn_bda(False, cfg.bias_dropout_fusion)(out, residual, block.hidden_dropout)
        mlp_out = block.mlp(block.pre_mlp_layernorm(hidden))
        return block.mlp_bda(False, cfg.bias_dropout_fusion)(mlp_out, hidden, block.hidden_dropout)

    # ---------------------------------------------------------------- sampling
    def _sample(self, hidden, plan: StepPlan) -> StepOutput:
        last = self.placement.root_of_layer(self.placement.num_layers - 1)
        src = self.groups.global_rank(last, 0)
        n = plan.num_requests
        tokens = torch.empty(n, dtype=torch.int64, device=self.device)
        logits = None
        if plan.record_logits:
            logits = torch.empty(n, self.vocab_size, dtype=torch.float32, device=self.device)
        if self.node == last:
            full = self._logits(hidden, plan)
            tokens = sample(
                full,
                plan.temperature.to(self.device),
                plan.top_k.to(self.device),
                plan.top_p.to(self.device),
                plan.seeds.to(self.device),
                plan.request_ids.to(self.device),
                plan.sample_steps.to(self.device),
            )
            if logits is not None:
                logits.copy_(full)
        dist.broadcast(tokens, src=src)
        if logits is not None:
            dist.broadcast(logits, src=src)
        return StepOutput(tokens, logits)

    def _logits(self, hidden: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Last row of each request -> ``[R, vocab]`` float32 (TP all-gather, padding cut)."""
        last_rows = torch.cumsum(plan.q_lens, 0).to(self.device) - 1
        h = self.model.decoder.final_layernorm(hidden[last_rows])
        local, _ = self.model.output_layer(h)  # [R, 1, V / T]
        local = local[:, 0].contiguous()
        t = self.groups.tp_size
        if t == 1:
            return local[:, : self.vocab_size].float()
        parts = local.new_empty((t * local.shape[0], local.shape[1]))
        # Megatron's gather_from_tensor_model_parallel_region asks torch.cuda for a device.
        dist.all_gather_into_tensor(parts, local, group=self.groups.tp_group)
        full = parts.view(t, local.shape[0], -1).permute(1, 0, 2).reshape(local.shape[0], -1)
        return full[:, : self.vocab_size].float()
