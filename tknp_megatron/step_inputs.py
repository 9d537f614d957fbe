"""Device tensors for one step on one rank, built from the step plan once per step.

Everything the per-layer loop needs that depends on the batch (the owner's attention
metadata, cache slots of the new K/V, RoPE angles, the sampled rows, sampling knobs) is
computed here, before the layer loop, so the loop itself has no host work and can be
captured in a CUDA graph. For graphs, :func:`pad_plan` rounds each owner's request count
up to a bucket with dummy requests that write to a scratch block and are never sampled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Tuple

import torch

from .attention import AttentionMetadata
from .kv_cache import PagedKVCache
from .plan import StepPlan
from .rope import Rope
from .sampling import SamplingTensors

__all__ = ["StepInputs", "StepShape", "prepare_inputs", "plan_sampling", "pad_plan", "bucket"]


@dataclass(frozen=True)
class StepShape:
    """What a captured step is specialised on: the ownership layout and sampling mode."""

    rows_per_owner: Tuple[int, ...]
    requests_per_owner: Tuple[int, ...]
    all_greedy: bool

    @property
    def num_rows(self) -> int:
        return sum(self.rows_per_owner)


@dataclass(frozen=True, eq=False)
class StepInputs:
    """One rank's inputs for a step (all on the rank's device).

    Attributes:
        tokens: ``[rows]`` input ids (used by the first root).
        slot_mapping: ``[own_rows]`` cache slots for this node's new K/V.
        freqs: ``[own_rows, 1, 1, rot_dim]`` RoPE angles of this node's rows.
        meta: attention metadata of this node's requests.
        last_rows: ``[R]`` row of each request's sampled token.
        sampling: the ``[R]`` sampling tensors of :func:`~tknp_megatron.sampling.sample`.
    """

    shape: StepShape
    tokens: torch.Tensor
    slot_mapping: torch.Tensor
    freqs: torch.Tensor
    meta: AttentionMetadata
    last_rows: torch.Tensor
    sampling: SamplingTensors

    def tensors(self):
        """Every tensor field, in a fixed order (for copying into static buffers)."""
        m = self.meta
        return (
            self.tokens, self.slot_mapping, self.freqs, m.query_start_loc, m.seq_lens,
            m.block_table, self.last_rows, *self.sampling,
        )

    def copy_(self, other: "StepInputs") -> None:
        """Fill these (static) buffers from ``other`` of the same shape."""
        for dst, src in zip(self.tensors(), other.tensors()):
            dst.copy_(src, non_blocking=True)


def prepare_inputs(
    plan: StepPlan,
    node: int,
    kv: PagedKVCache,
    rope: Rope,
    device: torch.device,
    max_seq_len: int = 0,
) -> StepInputs:
    """Build this rank's :class:`StepInputs` (host arithmetic, one copy to the device).

    ``max_seq_len`` overrides the attention grid bound (graphs capture with the cache's
    longest sequence so any later length fits).
    """
    lo, hi = plan.request_range(node)
    q_lens, start = plan.q_lens[lo:hi], plan.start_pos[lo:hi]
    rows = plan.rows_per_owner[node]
    cu = torch.zeros(hi - lo + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=cu[1:])
    row_req = torch.repeat_interleave(torch.arange(hi - lo), q_lens, output_size=rows)
    positions = start[row_req] + torch.arange(rows) - cu[row_req]
    slots = plan.slots[lo:hi].to(device)
    seq_lens = start + q_lens
    bound = int(seq_lens.max()) if hi > lo else 0
    meta = AttentionMetadata(
        query_start_loc=cu.to(device, torch.int32),
        seq_lens=seq_lens.to(device, torch.int32),
        block_table=kv.block_table[slots],
        max_query_len=int(q_lens.max()) if hi > lo else 0,
        max_seq_len=max(bound, max_seq_len),
    )
    positions = positions.to(device)
    shape = StepShape(
        plan.rows_per_owner, plan.requests_per_owner, bool((plan.temperature == 0).all())
    )
    return StepInputs(
        shape=shape,
        tokens=plan.tokens.to(device),
        slot_mapping=kv.slot_mapping(slots[row_req.to(device)], positions),
        freqs=rope.freqs(positions),
        meta=meta,
        last_rows=(torch.cumsum(plan.q_lens, 0) - 1).to(device),
        sampling=plan_sampling(plan, device),
    )


def plan_sampling(plan: StepPlan, device: torch.device) -> SamplingTensors:
    """The plan's ``[R]`` sampling tensors on ``device``."""
    return SamplingTensors(
        plan.temperature.to(device), plan.top_k.to(device), plan.top_p.to(device),
        plan.seeds.to(device), plan.request_ids.to(device), plan.sample_steps.to(device),
    )


_SMALL_BUCKETS = (1, 2, 4, 8)


def bucket(n: int, multiple: int = 8) -> int:
    """Graph bucket for ``n`` requests on one owner: 0, 1, 2, 4, 8, then multiples of 8."""
    if n <= 0:
        return 0
    for b in _SMALL_BUCKETS:
        if n <= b:
            return b
    return -(-n // multiple) * multiple


def pad_plan(plan: StepPlan, dummy_slot: int) -> Tuple[StepPlan, torch.Tensor]:
    """Pad a pure-decode plan so every owner holds the same bucketed request count.

    One bucket for all owners (that of the busiest) keeps the number of captured layouts
    to the number of buckets; the scheduler balances owners, so little is padded.
    Dummy requests use ``dummy_slot`` (whose block-table row points at a scratch block),
    position 0, token 0, greedy, request id -1. Returns the padded plan and ``[R]`` the
    index of each real request in the padded batch.
    """
    counts = plan.requests_per_owner
    padded = (bucket(max(counts)),) * len(counts)
    parts, index, at = {f: [] for f in _PER_REQUEST}, [], 0
    for node, (c, p) in enumerate(zip(counts, padded)):
        lo, hi = plan.request_range(node)
        for f in _PER_REQUEST:
            real = getattr(plan, f)[lo:hi]
            parts[f].append(real)
            parts[f].append(torch.full((p - c,), _DUMMY[f], dtype=real.dtype))
        index.append(torch.arange(at, at + c))
        at += p
    fields = {f: torch.cat(v) for f, v in parts.items()}
    fields["slots"][fields["request_ids"] < 0] = dummy_slot
    fields["tokens"] = _pad_tokens(plan, counts, padded)
    new = dataclasses.replace(
        plan, requests_per_owner=padded, rows_per_owner=padded, admissions=(), **fields
    )
    return new, torch.cat(index)


_PER_REQUEST = (
    "request_ids", "slots", "q_lens", "start_pos", "temperature", "top_k", "top_p",
    "seeds", "sample_steps",
)
_DUMMY = dict(
    request_ids=-1, slots=0, q_lens=1, start_pos=0, temperature=0.0, top_k=0, top_p=1.0,
    seeds=0, sample_steps=0,
)


def _pad_tokens(plan: StepPlan, counts, padded) -> torch.Tensor:
    out, at = [], 0
    for c, p in zip(counts, padded):
        out.append(plan.tokens[at : at + c])
        out.append(torch.zeros(p - c, dtype=plan.tokens.dtype))
        at += c
    return torch.cat(out)
