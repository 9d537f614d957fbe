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
from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch

from tknp_megatron.attention import AttentionMetadata
from tknp_megatron.executor.rope import Rope
from tknp_megatron.host_to_device import Packed, StaticInputs, pack, to_device
from tknp_megatron.kv_cache import PagedKVCache
from tknp_megatron.plan import StepPlan, take_rows
from tknp_megatron.sampling import SamplingTensors

__all__ = [
    "GraphStep", "HostInputs", "PaddedStep", "RowLayout", "StepHost", "StepInputs", "StepShape", "bucket",
    "device_inputs", "feed_previous", "host_inputs", "pad_plan", "padded_step", "plan_sampling", "prepare_inputs",
    "row_layout", "step_tokens",
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
        cos_sin: ``[own_rows, 2, rot_dim]`` float32 their cosines and sines
            (:meth:`~tknp_megatron.executor.rope.Rope.cos_sin`, for the fused RoPE + KV append).
        meta: attention metadata of this node's requests.
        last_rows: ``[R]`` row of each request's sampled token.
        sampling: the ``[R]`` sampling tensors of :func:`~tknp_megatron.sampling.sample`.
    """

    shape: StepShape
    tokens: torch.Tensor
    slot_mapping: torch.Tensor
    freqs: torch.Tensor
    cos_sin: torch.Tensor
    meta: AttentionMetadata
    last_rows: torch.Tensor
    sampling: SamplingTensors

    def tensors(self):
        """Every tensor field, in a fixed order (for copying into static buffers)."""
        m = self.meta
        return (
            self.tokens, self.slot_mapping, self.freqs, self.cos_sin, m.query_start_loc, m.seq_lens,
            m.block_table, self.last_rows, *self.sampling,
        )

    def copy_(self, other: "StepInputs") -> None:
        """Fill these (static) buffers from ``other`` of the same shape."""
        for dst, src in zip(self.tensors(), other.tensors()):
            dst.copy_(src, non_blocking=True)


class RowLayout(NamedTuple):
    """Where each query row of a batch sits (host tensors, int64)."""

    cu_seqlens: torch.Tensor
    """``[R + 1]`` first row of each request, then the row count."""
    row_request: torch.Tensor
    """``[rows]`` the request of each row."""
    positions: torch.Tensor
    """``[rows]`` the sequence position of each row."""


def row_layout(q_lens: torch.Tensor, start_pos: torch.Tensor, rows: int) -> RowLayout:
    """The rows of requests fed ``q_lens`` ``[R]`` tokens from ``start_pos`` ``[R]`` on
    (``rows = sum(q_lens)``)."""
    return RowLayout(*map(torch.from_numpy, _row_layout(q_lens.numpy(), start_pos.numpy(), rows)))


def _row_layout(q_lens: np.ndarray, start_pos: np.ndarray, rows: int):
    """:func:`row_layout` over numpy arrays."""
    if rows == q_lens.size and (q_lens == 1).all():  # a decode step: one row per request
        return np.arange(rows + 1, dtype=np.int64), np.arange(rows), start_pos
    cu = np.zeros(q_lens.size + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    steps = np.arange(rows)
    # row r belongs to the request whose rows end first after r (requests of no rows skipped)
    row_req = np.searchsorted(cu[1:], steps, side="right")
    return cu, row_req, start_pos[row_req] + steps - cu[row_req]


class StepHost(NamedTuple):
    """One rank's step inputs as they cross to the device: small host tensors, int64 but
    for the two float32 sampling knobs, so the crossing is two copies
    (:func:`~tknp_megatron.host_to_device.to_device`, or into a graph's
    :class:`~tknp_megatron.host_to_device.StaticInputs`). :func:`device_inputs` derives
    the rest (block tables, cache slots, RoPE angles) on the device.

    ``R``, ``own_rows``: this node's requests and rows; ``R_all``, ``rows``: the plan's.
    """

    query_start_loc: torch.Tensor
    """``[R + 1]`` first row of each of this node's requests, then their row count."""
    seq_lens: torch.Tensor
    """``[R]`` context length including this step's tokens."""
    slots: torch.Tensor
    """``[R]`` block-table row of each request."""
    row_slots: torch.Tensor
    """``[own_rows]`` block-table row of each row's request."""
    positions: torch.Tensor
    """``[own_rows]`` sequence position of each row."""
    last_rows: torch.Tensor
    """``[R_all]`` row of each request's sampled token."""
    tokens: torch.Tensor
    """``[rows]`` input ids."""
    prev_index: torch.Tensor
    """``[rows]`` index into the previous step's tokens of a row's input, -1: ``tokens``'."""
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    request_ids: torch.Tensor
    steps: torch.Tensor

    @property
    def sampling(self) -> SamplingTensors:
        """The ``[R_all]`` sampling tensors (in :class:`SamplingTensors`' order)."""
        return SamplingTensors(self.temperature, self.top_k, self.top_p, self.seeds,
                               self.request_ids, self.steps)


@dataclass(frozen=True)
class HostInputs:
    """What :func:`host_inputs` derives from a plan for one rank.

    Attributes:
        shape: the step's layout and sampling mode.
        packed: the host tensors (:attr:`tensors`) as one buffer per dtype (what crosses
            to the device).
        max_query_len: most rows of one of this node's requests (1: pure decode).
        max_seq_len: longest context of this node's requests (a grid bound).
        feeds_previous: some row takes the previous step's token (``prev_index >= 0``).
    """

    shape: StepShape
    packed: Packed
    max_query_len: int
    max_seq_len: int
    feeds_previous: bool

    @property
    def tensors(self) -> StepHost:
        """The :class:`StepHost` tensors (views into :attr:`packed`; a graph's replay needs
        only the buffers)."""
        return StepHost(*self.packed.views())


def host_inputs(plan: StepPlan, node: int, pin: bool = False) -> HostInputs:
    """Node ``node``'s :class:`HostInputs` of ``plan``: host arithmetic only (numpy over
    the plan's columns: a step's dozen small vectors cost microseconds, not a torch
    dispatch each), written straight into one buffer per dtype (pinned with ``pin``, for
    a copy to a GPU)."""
    lo, hi = plan.request_range(node)
    cols = plan.per_request
    q_all = cols.q_lens.numpy()
    q_lens, start = q_all[lo:hi], cols.start_pos.numpy()[lo:hi]
    cu, row_req, positions = _row_layout(q_lens, start, plan.rows_per_owner[node])
    slots = cols.slots.numpy()[lo:hi]
    seq_lens = start + q_lens
    prev = plan.prev_token_index
    prev = np.full(plan.num_rows, -1, dtype=np.int64) if prev is None else prev.numpy()
    temperature = cols.temperature.numpy()
    packed = pack((
        cu, seq_lens, slots, slots[row_req], positions, np.cumsum(q_all) - 1, plan.tokens.numpy(), prev,
        temperature, cols.top_k.numpy(), cols.top_p.numpy(), cols.seeds.numpy(),
        cols.noise_ids.numpy(), cols.sample_steps.numpy()), pin)
    return HostInputs(
        shape=StepShape(plan.rows_per_owner, plan.requests_per_owner, bool((temperature == 0).all())),
        packed=packed,
        max_query_len=int(q_lens.max()) if hi > lo else 0,
        max_seq_len=int(seq_lens.max()) if hi > lo else 0,
        feeds_previous=plan.prev_token_index is not None,
    )


def device_inputs(shape: StepShape, dev: StepHost, kv: PagedKVCache, rope: Rope, max_query_len: int,
                  max_seq_len: int, last_tokens: Optional[torch.Tensor] = None) -> StepInputs:
    """:class:`StepInputs` from :class:`StepHost` tensors on the device: device work only
    (no host sync), so a graph's captured body can begin with it.

    ``last_tokens`` ``[R_prev]`` (None: no row takes a previous token): the previous
    step's sampled tokens, which rows with ``prev_index >= 0`` take as their input.
    """
    tokens = dev.tokens if last_tokens is None else feed_previous(dev.tokens, dev.prev_index, last_tokens)
    meta = AttentionMetadata(
        query_start_loc=dev.query_start_loc.to(torch.int32),
        seq_lens=dev.seq_lens.to(torch.int32),
        block_table=kv.block_table[dev.slots],
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
    )
    freqs = rope.freqs(dev.positions)
    return StepInputs(
        shape=shape,
        tokens=tokens,
        slot_mapping=kv.slot_mapping(dev.row_slots, dev.positions),
        freqs=freqs,
        cos_sin=rope.cos_sin(freqs),
        meta=meta,
        last_rows=dev.last_rows,
        sampling=dev.sampling,
    )


def prepare_inputs(
    plan: StepPlan,
    node: int,
    kv: PagedKVCache,
    rope: Rope,
    device: torch.device,
    max_seq_len: int = 0,
    last_tokens: Optional[torch.Tensor] = None,
) -> StepInputs:
    """Build this rank's :class:`StepInputs`: :func:`host_inputs`, two non-blocking
    copies to the device, :func:`device_inputs` (no host sync, so it can run while the
    previous step does).

    ``max_seq_len`` overrides the attention grid bound (graphs capture with the cache's
    longest sequence so any later length fits). ``last_tokens`` ``[R_prev]`` are the
    previous step's sampled tokens on the device, which rows with a
    ``plan.prev_token_index`` take as their input.
    """
    host = host_inputs(plan, node)
    if host.feeds_previous and last_tokens is None:
        raise RuntimeError("the plan feeds tokens of a previous step this rank has not run")
    dev = StepHost(*to_device(host.tensors, device))
    return device_inputs(host.shape, dev, kv, rope, host.max_query_len, max(host.max_seq_len, max_seq_len),
                         last_tokens if host.feeds_previous else None)


class GraphStep:
    """A decode step's inputs for a CUDA graph (:mod:`~tknp_megatron.executor.cuda_graphs`):
    the :class:`StepHost` tensors of a padded plan, crossing into fixed device buffers.

    :meth:`stage` gives the captured buffers; :meth:`copy_` refills them from a later
    step's host tensors of the same layout; :meth:`inputs` is what the captured body
    derives from them. The previous step's tokens enter through ``last``, a fixed
    ``[max_requests]`` device buffer that the executor fills before each replay.

    Args:
        host: the padded plan's host inputs.
        max_seq_len: the grid bound the graph is captured with (the cache's longest sequence).
    """

    def __init__(self, host: HostInputs, max_seq_len: int, static: Optional[StaticInputs] = None):
        self.host, self.max_seq_len, self.static = host, max_seq_len, static

    @property
    def key(self) -> StepShape:
        return self.host.shape

    def stage(self, device: torch.device) -> "GraphStep":
        """A copy whose tensors live in fixed device buffers (what a graph captures)."""
        return GraphStep(self.host, self.max_seq_len, StaticInputs(self.host.tensors, device))

    def copy_(self, other: "GraphStep") -> None:
        """Refill the staged buffers from ``other``'s host tensors (same layout)."""
        if other.key != self.key:
            raise ValueError(f"graph inputs of another layout: {other.key}, not {self.key}")
        self.static.copy_(other.host.packed)

    @property
    def staged(self) -> StepHost:
        """The fixed device buffers, as :class:`StepHost` tensors (after :meth:`stage`)."""
        return StepHost(*self.static.views)

    def inputs(self, kv: PagedKVCache, rope: Rope, last: Optional[torch.Tensor]) -> StepInputs:
        """The staged step's :class:`StepInputs` (device work: the captured body's first part)."""
        return device_inputs(self.key, self.staged, kv, rope, 1, self.max_seq_len, last)


def _prev_index(plan: StepPlan) -> Tuple[torch.Tensor, ...]:
    return () if plan.prev_token_index is None else (plan.prev_token_index,)


def feed_previous(tokens: torch.Tensor, index: torch.Tensor, last: Optional[torch.Tensor]) -> torch.Tensor:
    """``[rows]`` input ids: ``last[index]`` where ``index >= 0``, else ``tokens`` (device
    work only: a graph's fixed ``last`` buffer may be longer than the previous step)."""
    if last is None:
        raise RuntimeError("the plan feeds tokens of a previous step this rank has not run")
    return torch.where(index >= 0, last[index.clamp(min=0)], tokens)


def step_tokens(plan: StepPlan, device: torch.device, last_tokens: Optional[torch.Tensor]) -> torch.Tensor:
    """``[rows]`` input ids of ``plan`` on ``device`` (executors without :class:`StepInputs`)."""
    tokens, *prev = to_device((plan.tokens, *_prev_index(plan)), device)
    return feed_previous(tokens, prev[0], last_tokens) if prev else tokens


def plan_sampling(plan: StepPlan, device: torch.device) -> SamplingTensors:
    """The plan's ``[R]`` sampling tensors on ``device``."""
    return SamplingTensors(*to_device(plan.per_request.sampling(), device))


_SMALL_BUCKETS = (1, 2, 4, 8)


def bucket(n: int, multiple: int = 8) -> int:
    """Graph bucket for ``n`` requests on one owner: 0, 1, 2, 4, 8, then multiples of 8."""
    if n <= 0:
        return 0
    for b in _SMALL_BUCKETS:
        if n <= b:
            return b
    return -(-n // multiple) * multiple


@dataclass(frozen=True, eq=False)
class PaddedStep:
    """A pure-decode plan padded to its graph bucket and one rank's host inputs of it
    (:func:`padded_step`).

    Attributes:
        step: the plan's step.
        padded: the padded plan (:func:`pad_plan`).
        index: ``[R]`` the place of each real request in the padded batch.
        real: ``[R_padded]`` int64, 1 at a real request, 0 at a padding one.
        host: the rank's :class:`HostInputs` of ``padded``.
        arrays: ``host``'s vectors as numpy arrays (what the next step's are derived from).
    """

    step: int
    padded: StepPlan
    index: torch.Tensor
    real: np.ndarray
    host: HostInputs
    arrays: StepHost


def padded_step(plan: StepPlan, node: int, dummy_slot: int, pin: bool = False,
                previous: Optional[PaddedStep] = None) -> PaddedStep:
    """``plan`` padded (:func:`pad_plan`) and node ``node``'s :func:`host_inputs` of it.

    A plan derived from the plan of step ``plan.follows``
    (:func:`~tknp_megatron.plan.next_decode_plan`: the same requests, each one position
    further) is derived from ``previous``, that plan's :class:`PaddedStep`, where it is
    that one: the same padding, each real request's position, context length and sample
    index one further, its input token the one booked where the plan feeds tokens from the
    host, every other input as it was. Three vector adds and a pack instead of the padding
    and the inputs' arithmetic (the tests check it gives what :func:`pad_plan` and
    :func:`host_inputs` do). The padded plan itself is derived alongside (two more adds),
    for callers that read it.
    """
    if plan.follows >= 0 and previous is not None and previous.step == plan.follows:
        return _advance(previous, plan, node, pin)
    padded, index = pad_plan(plan, dummy_slot)
    real = np.zeros(padded.num_requests, dtype=np.int64)
    real[index.numpy()] = 1
    host = host_inputs(padded, node, pin)
    return PaddedStep(plan.step, padded, index, real, host, StepHost(*(t.numpy() for t in host.tensors)))


def _advance(previous: PaddedStep, plan: StepPlan, node: int, pin: bool) -> PaddedStep:
    """:func:`padded_step` of ``plan``, derived from ``previous``: the plan it follows."""
    real, cols, was = previous.real, previous.padded.per_request, previous.arrays
    tokens, arrays_tokens = previous.padded.tokens, was.tokens
    if plan.prev_token_index is None:  # fed from the host: the tokens just booked, at the real rows
        padded_tokens = tokens.numpy().copy()
        padded_tokens[previous.index.numpy()] = plan.tokens.numpy()  # decode: row i is request i
        tokens, arrays_tokens = torch.from_numpy(padded_tokens), padded_tokens  # every node's rows: [rows]
    padded = dataclasses.replace(
        previous.padded, step=plan.step, follows=previous.step, tokens=tokens,
        per_request=dataclasses.replace(cols, start_pos=torch.from_numpy(cols.start_pos.numpy() + real),
                                        sample_steps=torch.from_numpy(cols.sample_steps.numpy() + real)))
    lo, hi = padded.request_range(node)
    own = real[lo:hi]  # a decode step: one row per request, so rows and requests align
    # the other vectors are shared as they are (never written)
    arrays = was._replace(seq_lens=was.seq_lens + own, positions=was.positions + own, steps=was.steps + real,
                          tokens=arrays_tokens)
    host = dataclasses.replace(previous.host, packed=pack(arrays, pin),
                               max_seq_len=int(arrays.seq_lens.max()) if hi > lo else 0)
    return PaddedStep(plan.step, padded, previous.index, real, host, arrays)


def pad_plan(plan: StepPlan, dummy_slot: int, size: Optional[int] = None) -> Tuple[StepPlan, torch.Tensor]:
    """Pad a pure-decode plan so every owner holds the same bucketed request count.

    One bucket for all owners (that of the busiest) keeps the number of captured layouts
    to the number of buckets; the scheduler balances owners, so little is padded.
    ``size`` sets the count instead (at least the busiest owner's; a plan of no requests
    padded to ``size`` is all dummies, what graphs are captured on ahead of time).
    Dummy requests use ``dummy_slot`` (whose block-table row points at a scratch block),
    and each column's pad value (:class:`~tknp_megatron.plan.RequestColumns`): position 0,
    token 0, greedy, request id -1. Returns the padded plan and ``[R]`` the index of each
    real request in the padded batch.
    """
    counts = plan.requests_per_owner
    if size is None:
        size = bucket(max(counts))
    elif size < max(counts):
        raise ValueError(f"pad_plan: size {size} below the busiest owner's {max(counts)} requests")
    padded = (size,) * len(counts)
    n = np.asarray(counts, dtype=np.int64)[:, None]  # [N, 1]
    k = np.arange(size)
    real = k < n  # [N, size]: which padded entries hold a real request
    take = torch.from_numpy(np.where(real, np.cumsum(n, 0) - n + k, -1).ravel())  # -1: a dummy
    prev = plan.prev_token_index
    new = dataclasses.replace(
        plan, requests_per_owner=padded, rows_per_owner=padded, admissions=(),
        per_request=plan.per_request.take(take, slots=dummy_slot),
        tokens=take_rows(plan.tokens, take, 0),  # one row per request: rows pad alike
        prev_token_index=None if prev is None else take_rows(prev, take, -1),
    )
    return new, torch.from_numpy(np.flatnonzero(real))
