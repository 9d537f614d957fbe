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
from typing import Optional, Tuple

import torch

from tknp_megatron.attention import AttentionMetadata
from tknp_megatron.executor.rope import Rope
from tknp_megatron.host_to_device import to_device
from tknp_megatron.kv_cache import PagedKVCache
from tknp_megatron.plan import StepPlan
from tknp_megatron.sampling import SamplingTensors

__all__ = [
    "StepInputs", "StepShape", "prepare_inputs", "plan_sampling", "step_tokens", "pad_plan", "bucket",
]


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
    last_tokens: Optional[torch.Tensor] = None,
) -> StepInputs:
    """Build this rank's :class:`StepInputs`: host arithmetic, then one non-blocking copy
    per dtype to the device (no host sync, so it can run while the previous step does).

    ``max_seq_len`` overrides the attention grid bound (graphs capture with the cache's
    longest sequence so any later length fits). ``last_tokens`` ``[R_prev]`` are the
    previous step's sampled tokens on the device, which rows with a
    ``plan.prev_token_index`` take as their input.
    """
    lo, hi = plan.request_range(node)
    q_lens, start = plan.q_lens[lo:hi], plan.start_pos[lo:hi]
    rows = plan.rows_per_owner[node]
    cu = torch.zeros(hi - lo + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=cu[1:])
    row_req = torch.repeat_interleave(torch.arange(hi - lo), q_lens, output_size=rows)
    positions = start[row_req] + torch.arange(rows) - cu[row_req]
    slots = plan.slots[lo:hi]
    seq_lens = start + q_lens
    bound = int(seq_lens.max()) if hi > lo else 0
    host = (
        cu.to(torch.int32), seq_lens.to(torch.int32), slots, slots[row_req], positions,
        torch.cumsum(plan.q_lens, 0) - 1, plan.tokens, *_prev_index(plan), *_sampling_host(plan),
    )
    cu, seq_lens, slots, row_slots, positions, last_rows, tokens, *rest = to_device(host, device)
    if plan.prev_token_index is not None:
        tokens = _feed_previous(tokens, rest.pop(0), last_tokens)
    meta = AttentionMetadata(
        query_start_loc=cu,
        seq_lens=seq_lens,
        block_table=kv.block_table[slots],
        max_query_len=int(q_lens.max()) if hi > lo else 0,
        max_seq_len=max(bound, max_seq_len),
    )
    shape = StepShape(
        plan.rows_per_owner, plan.requests_per_owner, bool((plan.temperature == 0).all())
    )
    return StepInputs(
        shape=shape,
        tokens=tokens,
        slot_mapping=kv.slot_mapping(row_slots, positions),
        freqs=rope.freqs(positions),
        meta=meta,
        last_rows=last_rows,
        sampling=SamplingTensors(*rest),
    )


def _prev_index(plan: StepPlan) -> Tuple[torch.Tensor, ...]:
    return () if plan.prev_token_index is None else (plan.prev_token_index,)


def _feed_previous(tokens: torch.Tensor, index: torch.Tensor, last: Optional[torch.Tensor]) -> torch.Tensor:
    """``[rows]`` input ids: ``last[index]`` where ``index >= 0``, else ``tokens``."""
    if last is None:
        raise RuntimeError("the plan feeds tokens of a previous step this rank has not run")
    return torch.where(index >= 0, last[index.clamp(min=0)], tokens)


def step_tokens(plan: StepPlan, device: torch.device, last_tokens: Optional[torch.Tensor]) -> torch.Tensor:
    """``[rows]`` input ids of ``plan`` on ``device`` (executors without :class:`StepInputs`)."""
    tokens, *prev = to_device((plan.tokens, *_prev_index(plan)), device)
    return _feed_previous(tokens, prev[0], last_tokens) if prev else tokens


def _sampling_host(plan: StepPlan) -> Tuple[torch.Tensor, ...]:
    """The plan's ``[R]`` sampling tensors, in :class:`SamplingTensors` order (host)."""
    return (
        plan.temperature, plan.top_k, plan.top_p, plan.seeds, plan.request_ids, plan.sample_steps,
    )


def plan_sampling(plan: StepPlan, device: torch.device) -> SamplingTensors:
    """The plan's ``[R]`` sampling tensors on ``device``."""
    return SamplingTensors(*to_device(_sampling_host(plan), device))


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
    fields["tokens"] = _pad_rows(plan.tokens, counts, padded, 0)
    if plan.prev_token_index is not None:
        fields["prev_token_index"] = _pad_rows(plan.prev_token_index, counts, padded, -1)
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


def _pad_rows(values: torch.Tensor, counts, padded, fill: int) -> torch.Tensor:
    """``[rows]`` per-row values of a pure-decode plan, each owner padded with ``fill``."""
    out, at = [], 0
    for c, p in zip(counts, padded):
        out.append(values[at : at + c])
        out.append(torch.full((p - c,), fill, dtype=values.dtype))
        at += c
    return torch.cat(out)
