"""A DCP rank's device inputs for one step: any step's, and a decode step's padded to a bucket.

:func:`prepare_dcp_inputs` serves every step eagerly: the rows whose position falls in
this rank's shard (``p % D == j``) are picked out by index, so their number changes from
step to step. A CUDA graph needs every shape fixed per batch bucket, so for pure-decode
steps :func:`dcp_decode_inputs` takes a plan already padded to a bucket
(:func:`~tknp_megatron.executor.step_inputs.pad_plan`: padding requests on the cache's
dummy slot, at position 0) and gives every tensor a shape fixed by the bucket alone.
It starts from the same host vectors as a TKNP step
(:class:`~tknp_megatron.executor.step_inputs.StepHost`, which cross as two copies into a
graph's fixed buffers) and derives the rest on the device, inside the captured body:

* every row writes its k/v; a row this shard does not hold writes to the scratch block
  (the dummy slot's block-table row), as padding requests do, so no real KV changes;
* partial attention runs over every row with the kernel's grid bound at the cache's
  longest shard-local sequence, not the step's; a padding request sees one token of the
  scratch block on shard 0 and none elsewhere, so its merge is finite, and its rows
  are dropped after the step (:class:`~tknp_megatron.executor.cuda_graphs.DecodeGraphs`).

Real rows are computed exactly as :func:`prepare_dcp_inputs` computes them: attention is
per row, and the dense layers treat rows independently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from tknp_megatron.baselines.dcp_attention import ShardMetadata, decode_metadata
from tknp_megatron.executor.rope import Rope
from tknp_megatron.executor.step_inputs import (
    HostInputs,
    StepHost,
    StepShape,
    feed_previous,
    host_inputs,
    plan_sampling,
    row_layout,
    step_tokens,
)
from tknp_megatron.host_to_device import to_device
from tknp_megatron.kv_cache import PagedKVCache
from tknp_megatron.plan import StepPlan
from tknp_megatron.sampling import SamplingTensors

__all__ = [
    "DCPStepInputs", "check_dcp_decode", "dcp_decode_inputs", "prepare_dcp_inputs", "prepare_dcp_decode_inputs",
]


@dataclass(frozen=True, eq=False)
class DCPStepInputs:
    """One rank's inputs for a DCP step (on its device).

    Attributes:
        shape: batch layout and sampling mode (one node owns every row).
        tokens: ``[rows]`` input ids.
        freqs: ``[rows, 1, 1, rot_dim]`` RoPE angles of every row.
        own_rows: ``[n]`` rows whose position falls in this shard; None: every row
            writes (``n = rows``; the rows this shard does not hold write to the scratch
            block), the fixed-shape form of :func:`prepare_dcp_decode_inputs`.
        write_slots: ``[n]`` flat cache slots of those rows' k/v.
        attn: partial-attention metadata of the local shard.
        last_rows: ``[R]`` sampled row of each request; sampling: its ``[R]`` sampling tensors.
        decode: host bool, every request has exactly one query row (row r is request r's
            newest token), so the Triton decode path may serve the step.
    """

    shape: StepShape
    tokens: torch.Tensor
    freqs: torch.Tensor
    own_rows: Optional[torch.Tensor]
    write_slots: torch.Tensor
    attn: ShardMetadata
    last_rows: torch.Tensor
    sampling: SamplingTensors
    decode: bool = False

    def tensors(self):
        """Every tensor field, in a fixed order."""
        a, k = self.attn, self.attn.kernel
        kernel = () if k is None else (k.query_start_loc, k.seq_lens, k.block_table)
        own = () if self.own_rows is None else (self.own_rows,)
        return (
            self.tokens, self.freqs, *own, self.write_slots, a.row_request, a.positions,
            a.local_lens, a.block_table, *kernel, self.last_rows, *self.sampling,
        )


def prepare_dcp_inputs(plan: StepPlan, dcp, kv: PagedKVCache, rope: Rope, device,
                       last_tokens=None) -> DCPStepInputs:
    """Host arithmetic from the plan (positions, shard membership), then one non-blocking
    copy per dtype to the device; a decode step's kernel metadata is built here, once.

    ``dcp``: the rank's :class:`~tknp_megatron.baselines.dcp.DCPGroups` (degree D, shard j);
    ``last_tokens``: ``[R_prev]`` previous step's tokens on the device (rows fed from them).
    """
    d, j = dcp.degree, dcp.shard
    n_req, rows = plan.num_requests, plan.num_rows
    cols = plan.per_request
    cu, row_req, positions = row_layout(cols.q_lens, cols.start_pos, rows)
    own = torch.nonzero(positions % d == j).flatten()
    seq_lens = cols.start_pos + cols.q_lens
    local_lens = torch.clamp(seq_lens - j + d - 1, min=0) // d
    max_local = int(local_lens.max()) if n_req else 0
    decode = n_req > 0 and rows == n_req and plan.max_query_len == 1
    slots, own_req, own_pos, row_req, positions, local_lens, own, last_rows = to_device(
        (cols.slots, row_req[own], positions[own] // d, row_req, positions, local_lens, own, cu[1:] - 1),
        device,
    )
    spans = None
    if not decode:  # host: the plan's rows are request by request
        starts = cu.tolist()
        spans = tuple((a, b - a) for a, b in zip(starts, starts[1:]))
    attn = ShardMetadata(
        row_request=row_req, positions=positions, local_lens=local_lens,
        block_table=kv.block_table[slots], max_local_len=max_local, shard=j, degree=d, row_spans=spans,
    )
    if decode:
        attn = dataclasses.replace(attn, kernel=decode_metadata(attn))
    shape = StepShape((rows,), (n_req,), bool((cols.temperature == 0).all()))
    return DCPStepInputs(
        shape=shape, tokens=step_tokens(plan, device, last_tokens), freqs=rope.freqs(positions),
        own_rows=own, write_slots=kv.slot_mapping(slots[own_req], own_pos), attn=attn,
        last_rows=last_rows, sampling=plan_sampling(plan, device), decode=decode,
    )


def check_dcp_decode(host: HostInputs, dcp, max_local_len: int) -> None:
    """Refuse (ValueError) host inputs the fixed-shape decode path cannot take: a plan that
    is not pure decode (one row per request), or a shard-local length over the grid bound."""
    if host.max_query_len > 1 or host.shape.num_rows != sum(host.shape.requests_per_owner):
        raise ValueError("DCP decode inputs: a pure-decode plan (one row per request)")
    d, j = dcp.degree, dcp.shard
    longest = max(host.max_seq_len - j + d - 1, 0) // d
    if longest > max_local_len:
        raise ValueError(f"a shard-local length {longest} over the bound {max_local_len}")


def dcp_decode_inputs(shape: StepShape, dev: StepHost, dcp, kv: PagedKVCache, rope: Rope,
                      max_local_len: int, last_tokens: Optional[torch.Tensor] = None) -> DCPStepInputs:
    """The fixed-shape :class:`DCPStepInputs` of a padded pure-decode step from its
    :class:`~tknp_megatron.executor.step_inputs.StepHost` tensors on the device: device
    work only (no host sync), so a graph's captured body begins with it. Every tensor's
    shape depends on the bucket ``R`` only (``[R]``, ``[R, 1, 1, rot_dim]``, block tables
    ``[R, max_blocks]``); see the module docstring for what padding and non-held rows do.

    ``max_local_len``: the kernel's grid bound, at least every shard-local length the
    cache can hold (the cache's longest sequence in its own, shard-local, tokens);
    ``last_tokens``: the previous step's tokens (a graph's fixed buffer), which rows with
    ``prev_index >= 0`` take.
    """
    d, j = dcp.degree, dcp.shard
    positions = dev.positions  # [R]: row r is request r's newest token
    mine = positions % d == j
    local_lens = (positions + 1 - j + d - 1).clamp(min=0) // d
    write_slot = torch.where(mine, dev.slots, kv.dummy_slot)  # not held here: the scratch block
    write_pos = torch.where(mine, positions // d, 0)
    rows = dev.last_rows  # [R]: one row per request, so request r's row is r
    attn = ShardMetadata(
        row_request=rows, positions=positions, local_lens=local_lens,
        block_table=kv.block_table[dev.slots], max_local_len=max_local_len, shard=j, degree=d,
    )
    attn = dataclasses.replace(attn, kernel=decode_metadata(attn))
    tokens = dev.tokens if last_tokens is None else feed_previous(dev.tokens, dev.prev_index, last_tokens)
    return DCPStepInputs(
        shape=shape, tokens=tokens, freqs=rope.freqs(positions), own_rows=None,
        write_slots=kv.slot_mapping(write_slot, write_pos), attn=attn, last_rows=rows,
        sampling=dev.sampling, decode=True,
    )


def prepare_dcp_decode_inputs(plan: StepPlan, dcp, kv: PagedKVCache, rope: Rope, device,
                              max_local_len: int, last_tokens=None) -> DCPStepInputs:
    """The fixed-shape inputs of a pure-decode ``plan`` padded to a bucket of ``R``
    requests (one row each), eagerly: :func:`~tknp_megatron.executor.step_inputs.host_inputs`,
    two non-blocking copies, :func:`dcp_decode_inputs` (what a graph's body runs on its
    fixed buffers)."""
    host = host_inputs(plan, 0)
    check_dcp_decode(host, dcp, max_local_len)
    if host.feeds_previous and last_tokens is None:
        raise RuntimeError("the plan feeds tokens of a previous step this rank has not run")
    dev = StepHost(*to_device(host.tensors, device))
    return dcp_decode_inputs(host.shape, dev, dcp, kv, rope, max_local_len,
                             last_tokens if host.feeds_previous else None)
