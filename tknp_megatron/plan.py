"""The step plan: what every rank needs to run one step, broadcast once per step.

Requests are in batch order, grouped by owner node (node 0's first), so each owner's rows
are one contiguous slice and the root's gather is a concatenation in batch order. A plan's
per-request tensors are one record, :class:`RequestColumns`.

A plan crosses the pool every step (pickled, host to host), so its tensors pickle as their
raw bytes (:func:`_to_bytes`): torch's own tensor pickling costs tens of microseconds per
tensor, several times the whole plan's bytes.

Plans are built one step ahead (overlapped scheduling, as in vLLM's async scheduler):
while step n runs on the GPUs the coordinator plans step n + 1 before it has read step
n's tokens. A request whose step-n token is still in flight is fed that token on the
device: ``prev_token_index`` points at its row of step n's output, which every rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from tknp_megatron.engine.request import Request
from tknp_megatron.sampling import SamplingTensors

__all__ = ["Admission", "RequestColumns", "StepPlan", "build_plan", "next_decode_plan", "take_rows"]


@dataclass(frozen=True)
class Admission:
    """A request placed on an owner this step.

    Attributes:
        request_id: the request.
        owner: owning node.
        slot: the owner's block-table row.
        blocks: reserved block ids on the owner.
        ingest_len: tokens of KV arriving from outside (0 = prefill in the pool).
        synthetic_seed: if set, the owner generates the ingested KV from this seed.
    """

    request_id: int
    owner: int
    slot: int
    blocks: Tuple[int, ...]
    ingest_len: int = 0
    synthetic_seed: Optional[int] = None


def _column(dtype: torch.dtype, pad, sampling: Optional[str] = None):
    """A per-request column: its dtype, its value for a padding (dummy) request, and the
    :class:`~tknp_megatron.sampling.SamplingTensors` field it feeds (None: none)."""
    return field(metadata={"dtype": dtype, "pad": pad, "sampling": sampling})


@dataclass(frozen=True, eq=False)
class RequestColumns:
    """A step's per-request ``[R]`` tensors, in batch order: the one list of them.

    Concatenating microbatches (:meth:`cat`), padding to a graph bucket (:meth:`take`),
    the sampling tensors (:meth:`sampling`) and with them the device copy all follow these
    fields, so a new per-request field is a line here plus its value in :func:`build_plan`.
    """

    request_ids: torch.Tensor = _column(torch.int64, -1)
    """The requests' ids; -1 marks a padding request."""
    noise_ids: torch.Tensor = _column(torch.int64, -1, "request_ids")
    """The ids the draws' noise is keyed by (``SamplingParams.noise_id``, else the request's id)."""
    slots: torch.Tensor = _column(torch.int64, 0)
    """Each request's block-table row on its owner."""
    q_lens: torch.Tensor = _column(torch.int64, 1)
    """Tokens fed this step: prompt length for prefill, 1 for decode."""
    start_pos: torch.Tensor = _column(torch.int64, 0)
    """Tokens already cached."""
    temperature: torch.Tensor = _column(torch.float32, 0.0, "temperature")
    top_k: torch.Tensor = _column(torch.int64, 0, "top_k")
    top_p: torch.Tensor = _column(torch.float32, 1.0, "top_p")
    seeds: torch.Tensor = _column(torch.int64, 0, "seeds")
    sample_steps: torch.Tensor = _column(torch.int64, 0, "steps")
    """Index of the token being generated (0 for the first)."""

    @classmethod
    def of(cls, **values: Sequence) -> "RequestColumns":
        """Columns from one sequence (or iterable) per field, each in its declared dtype
        (``noise_ids``, if not given: the request ids)."""
        if "noise_ids" not in values:
            values["request_ids"] = values["noise_ids"] = list(values["request_ids"])
        return cls(**{
            f.name: torch.from_numpy(np.array(list(values[f.name]), dtype=_NP[f.metadata["dtype"]]))
            for f in _FIELDS
        })

    @classmethod
    def empty(cls) -> "RequestColumns":
        return cls.of(**{f.name: () for f in _FIELDS})

    @classmethod
    def cat(cls, parts: Sequence["RequestColumns"]) -> "RequestColumns":
        """``parts`` back to back."""
        return cls(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in _FIELDS})

    def take(self, index: torch.Tensor, **pads) -> "RequestColumns":
        """Requests ``index`` ``[R']``; -1 is a padding request, whose value in each column
        is the column's pad value or ``pads[name]``."""
        safe, dummy = _take_index(index, len(self.request_ids))  # numpy: this runs on every graph step
        return RequestColumns(**{
            f.name: _take(getattr(self, f.name).numpy(), safe, dummy, pads.get(f.name, f.metadata["pad"]))
            for f in _FIELDS
        })

    def sampling(self) -> SamplingTensors:
        """The ``[R]`` sampling tensors of :func:`~tknp_megatron.sampling.sample` (host)."""
        return SamplingTensors(*[getattr(self, name) for name in _SAMPLING_SOURCES])

    def __reduce__(self):
        return _columns_from_bytes, (tuple(_to_bytes(getattr(self, f.name)) for f in _FIELDS),)


def _to_bytes(t: torch.Tensor) -> bytes:
    """A 1-D host tensor's raw bytes (its dtype is known where it is rebuilt)."""
    return t.cpu().numpy().tobytes()


def _from_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype)


def _columns_from_bytes(raw: Tuple[bytes, ...]) -> "RequestColumns":
    return RequestColumns(**{f.name: _from_bytes(b, f.metadata["dtype"]) for f, b in zip(_FIELDS, raw)})


_FIELDS = fields(RequestColumns)
_NP = {torch.int64: np.int64, torch.float32: np.float32}  # the columns' dtypes in numpy
_SAMPLING_SOURCES = tuple(  # the column behind each SamplingTensors field, in its order
    {f.metadata["sampling"]: f.name for f in _FIELDS}[name] for name in SamplingTensors._fields
)


def take_rows(values: torch.Tensor, index: torch.Tensor, pad) -> torch.Tensor:
    """``values[index]``, where index -1 gives ``pad`` (host tensors; in numpy, as a step's
    padding runs on every step's critical path)."""
    return _take(values.numpy(), *_take_index(index, len(values)), pad)


def _take_index(index: torch.Tensor, size: int) -> Tuple[np.ndarray, np.ndarray]:
    """``(safe, dummy)`` of a ``[R']`` index into ``size`` entries: -1 marks a padding entry
    (``dummy``), read at 0 and overwritten (``safe``)."""
    idx = index.numpy()
    dummy = idx < 0
    if not size and not dummy.all():
        raise IndexError(f"requests {idx[~dummy].tolist()} of columns holding none")
    return np.where(dummy, 0, idx), dummy


def _take(values: np.ndarray, safe: np.ndarray, dummy: np.ndarray, pad) -> torch.Tensor:
    """``values[safe]`` with ``pad`` where ``dummy`` (``safe`` is 0 there)."""
    out = values[safe] if len(values) else np.empty(len(safe), dtype=values.dtype)
    out[dummy] = pad
    return torch.from_numpy(out)


@dataclass(frozen=True)
class StepPlan:
    """One step for the whole pool.

    ``per_request`` holds the ``[R]`` per-request tensors (batch order). ``tokens`` is
    ``[rows]``, rows = sum(per_request.q_lens). ``prev_token_index`` is None when every
    input token is in ``tokens``; otherwise ``[rows]``: the index into the previous step's
    sampled tokens (batch order) of the row's input token, or -1 to take ``tokens``' entry.
    ``requests_per_owner`` / ``rows_per_owner`` are per node.

    With dual-active-root microbatching, ``microbatches`` holds one plan per microbatch
    (each grouped by owner, no admissions) and this plan is their concatenation in that
    order, for booking; its rows are then grouped by microbatch first, so
    :meth:`request_range` is only meaningful on the microbatches' plans.

    ``log_probs_top_n`` is -1 when no request of the step asks for log-probs, else the
    largest ``top_n_logprobs`` among those that do (the last root returns that many top
    tokens for every row). ``idle`` marks a plan with nothing to run (:meth:`idle_plan`).
    ``follows`` is the step of the plan this one was derived from by
    :func:`next_decode_plan` (the same requests, one position further: the step before, or
    with PP's microbatches the microbatch's step before), -1 for a plan built request by
    request, so that every rank can derive what it computes from that plan's too
    (``executor/step_inputs.padded_step``).

    ``prompt_rows`` is None unless a request prefilled in this step asks for its prompt's
    log-probs (``SamplingParams.return_prompt_log_probs``); then ``[P]`` rows (batch order)
    whose logits give a prompt token's log-prob, ``prompt_targets`` ``[P]`` that token (the
    row's next prompt token) and ``prompt_requests`` ``[P]`` the request's index in batch
    order. The last root returns those log-probs, with ``log_probs_top_n`` top tokens each.
    """

    step: int
    admissions: Tuple[Admission, ...]
    per_request: RequestColumns
    tokens: torch.Tensor
    requests_per_owner: Tuple[int, ...]
    rows_per_owner: Tuple[int, ...]
    record_logits: bool = False
    stop: bool = False
    prev_token_index: Optional[torch.Tensor] = None
    microbatches: Tuple["StepPlan", ...] = ()
    log_probs_top_n: int = -1
    idle: bool = False
    follows: int = -1
    prompt_rows: Optional[torch.Tensor] = None
    prompt_targets: Optional[torch.Tensor] = None
    prompt_requests: Optional[torch.Tensor] = None

    @classmethod
    def idle_plan(cls, num_nodes: int) -> "StepPlan":
        """The plan an idle coordinator broadcasts now and then: nothing to run, but every
        rank's wait ends well inside the collective timeout."""
        return replace(cls.stop_plan(num_nodes), stop=False, idle=True)

    @classmethod
    def stop_plan(cls, num_nodes: int) -> "StepPlan":
        """The plan that tells every rank to leave its serve loop."""
        none = (0,) * num_nodes
        return cls(
            step=-1, admissions=(), per_request=RequestColumns.empty(),
            tokens=torch.zeros(0, dtype=torch.int64), requests_per_owner=none,
            rows_per_owner=none, stop=True,
        )

    @property
    def num_requests(self) -> int:
        return int(self.per_request.request_ids.numel())

    @property
    def num_rows(self) -> int:
        return int(self.tokens.numel())

    @property
    def max_query_len(self) -> int:
        return int(self.per_request.q_lens.max()) if self.num_requests else 0

    def __reduce__(self):
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in _LONG_FIELDS:
            if state[name] is not None:
                state[name] = _to_bytes(state[name])
        return _plan_from_state, (state,)

    def request_range(self, node: int) -> Tuple[int, int]:
        lo = sum(self.requests_per_owner[:node])
        return lo, lo + self.requests_per_owner[node]

    def cached_tokens_per_owner(self) -> List[int]:
        """KV tokens each owner holds for this step's requests, this step's included
        (over every microbatch)."""
        used = [0] * len(self.requests_per_owner)
        for part in self.microbatches or (self,):
            cols = part.per_request
            cached = (cols.start_pos + cols.q_lens).tolist()
            for node in range(len(used)):
                lo, hi = part.request_range(node)
                used[node] += sum(cached[lo:hi])
        return used


def build_plan(
    step: int,
    batch: Sequence[Request],
    admissions: Sequence[Admission],
    num_nodes: int,
    record_logits: bool = False,
    num_microbatches: int = 1,
) -> StepPlan:
    """Plan for ``batch``; requests are reordered so each owner's rows are contiguous.

    A request with a step in flight (``inflight_rows > 0``) is fed its in-flight token
    from the device (one row, ``prev_token_index``); the others are fed their pending
    host tokens. With ``num_microbatches`` > 1 the batch is split by ``Request.microbatch``
    into per-microbatch plans (see :class:`StepPlan`).
    """
    feed_prev = any(r.inflight_rows for r in batch)
    top_n = max((r.params.log_probs_top_n for r in batch), default=-1)
    if num_microbatches == 1:
        return _plan(step, batch, admissions, num_nodes, record_logits, feed_prev, top_n)
    parts = tuple(
        _plan(step, [r for r in batch if r.microbatch == m], (), num_nodes, record_logits, feed_prev,
              top_n)
        for m in range(num_microbatches)
    )
    return _concat(parts, admissions)


def next_decode_plan(step: int, previous: Optional[StepPlan], previous_batch: Sequence[Request],
                     batch: Sequence[Request], admissions: Sequence[Admission],
                     booked: Optional[Sequence[int]] = None) -> Optional[StepPlan]:
    """:func:`build_plan` for the step after ``previous`` without reading the requests, where
    it can be derived: None where it cannot, and :func:`build_plan` must run.

    It can when the step is pure decode in steady state: nothing is admitted, ``batch`` holds
    the very requests (in the same order) that ``previous`` was built from
    (``previous_batch``), and in ``previous`` each request fed one row. Between the two plans
    the engine books exactly one step of each request, so each one's cached tokens and
    sample index grow by one and every other column is what it was. The input token of
    each row is either

    - (``booked`` None: the overlapped loop, which plans step n + 1 before it books step n)
      the token in flight, at the same row of ``previous``'s output (``previous`` fed its
      rows the same way: ``prev_token_index`` is ``0 .. R-1``); or
    - (PP's loop, which books a microbatch's step before it plans the next) the token just
      booked: ``booked`` ``[R]``, the tokens sampled by ``previous``, in its order
      (``previous`` fed its rows from the host: ``prev_token_index`` None).

    The same numbers :func:`build_plan` computes one request at a time (checked against it
    in the tests), in two vector adds: at a few hundred requests the per-request reads were
    about a fifth of the coordinator's work per step. The plan records ``follows =
    previous.step``.
    """
    if previous is not None and step <= previous.step:
        raise ValueError(f"next_decode_plan: step {step} does not come after step {previous.step}")
    if (admissions or previous is None or previous.microbatches
            or len(batch) != previous.num_requests or previous.num_rows != len(batch)):
        return None
    if booked is None:
        if previous.prev_token_index is None:
            return None
        if not np.array_equal(previous.prev_token_index.numpy(), np.arange(len(batch))):
            return None
        tokens = previous.tokens
    else:
        if previous.prev_token_index is not None or len(booked) != len(batch):
            return None
        tokens = torch.from_numpy(np.asarray(booked, dtype=np.int64))
    if tuple(batch) != tuple(previous_batch):  # identity: Request compares by object
        return None
    cols = previous.per_request
    per_request = replace(cols, start_pos=torch.from_numpy(cols.start_pos.numpy() + 1),
                          sample_steps=torch.from_numpy(cols.sample_steps.numpy() + 1))
    return replace(previous, step=step, admissions=(), per_request=per_request, tokens=tokens,
                   follows=previous.step, prompt_rows=None, prompt_targets=None, prompt_requests=None)


_LONG_FIELDS = ("tokens", "prev_token_index", "prompt_rows", "prompt_targets",
                "prompt_requests")  # the plan's own int64 tensors


def _plan_from_state(state: dict) -> StepPlan:
    for name in _LONG_FIELDS:
        if state[name] is not None:
            state[name] = _from_bytes(state[name], torch.int64)
    return StepPlan(**state)


def _concat(parts: Tuple[StepPlan, ...], admissions: Sequence[Admission]) -> StepPlan:
    """One plan holding ``parts`` back to back (the engine books it; executors run parts)."""
    prev = None
    if parts[0].prev_token_index is not None:
        prev = torch.cat([p.prev_token_index for p in parts])
    prompt = _cat_prompt_rows(parts)
    return StepPlan(
        step=parts[0].step, admissions=tuple(admissions),
        per_request=RequestColumns.cat([p.per_request for p in parts]),
        tokens=torch.cat([p.tokens for p in parts]),
        requests_per_owner=tuple(map(sum, zip(*(p.requests_per_owner for p in parts)))),
        rows_per_owner=tuple(map(sum, zip(*(p.rows_per_owner for p in parts)))),
        record_logits=parts[0].record_logits, prev_token_index=prev, microbatches=parts,
        log_probs_top_n=parts[0].log_probs_top_n, **prompt,
    )


def _cat_prompt_rows(parts: Tuple[StepPlan, ...]) -> dict:
    """The parts' prompt log-prob rows in the concatenated plan's rows and requests."""
    if all(p.prompt_rows is None for p in parts):
        return {}
    rows, targets, requests, row0, req0 = [], [], [], 0, 0
    for p in parts:
        if p.prompt_rows is not None:
            rows.append(p.prompt_rows + row0)
            targets.append(p.prompt_targets)
            requests.append(p.prompt_requests + req0)
        row0, req0 = row0 + p.num_rows, req0 + p.num_requests
    return dict(prompt_rows=torch.cat(rows), prompt_targets=torch.cat(targets), prompt_requests=torch.cat(requests))


def _plan(step, batch, admissions, num_nodes: int, record_logits: bool, feed_prev: bool,
          top_n: int = -1) -> StepPlan:
    batch = sorted(batch, key=_owner)  # stable: keeps admission order per owner
    pending = [_PREV if r.inflight_rows else r.pending_tokens() for r in batch]
    # one pass over the requests into flat lists (numpy converts a flat list several times
    # faster than a list of tuples), then [9, R] int64 and [2, R] float32 rows
    ints = np.array([x for r, toks in zip(batch, pending) for x in (
        r.request_id, r.slot, len(toks), r.num_cached + r.inflight_rows, r.params.top_k, r.params.seed,
        len(r.generated) + (r.inflight_rows > 0), r.owner,
        r.request_id if r.params.noise_id is None else r.params.noise_id)],
        dtype=np.int64).reshape(-1, 9).T.copy()
    floats = np.array([x for r in batch for x in (r.params.temperature, r.params.top_p)],
                      dtype=np.float32).reshape(-1, 2).T.copy()
    ids, slots, q_lens, start, top_k, seeds, sample_steps, owners, noise_ids = ints
    temperature, top_p = floats
    prev = None
    if feed_prev:
        prev = _longs(
            i for r, toks in zip(batch, pending)
            for i in ((r.inflight_index,) if r.inflight_rows else (-1,) * len(toks))
        )
    per_request = RequestColumns(**{name: torch.from_numpy(col) for name, col in (
        ("request_ids", ids), ("noise_ids", noise_ids), ("slots", slots), ("q_lens", q_lens), ("start_pos", start),
        ("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seeds", seeds),
        ("sample_steps", sample_steps))})
    return StepPlan(
        step=step,
        admissions=tuple(admissions),
        per_request=per_request,
        tokens=_longs(t for toks in pending for t in toks),
        **_prompt_rows(batch, q_lens),
        requests_per_owner=tuple(np.bincount(owners, minlength=num_nodes).tolist()),
        rows_per_owner=tuple(np.bincount(owners, weights=q_lens, minlength=num_nodes).astype(np.int64).tolist()),
        record_logits=record_logits,
        prev_token_index=prev,
        log_probs_top_n=top_n,
    )


def _prompt_rows(batch: Sequence[Request], q_lens: np.ndarray) -> dict:
    """``prompt_rows`` / ``prompt_targets`` / ``prompt_requests`` of a plan of ``batch``
    (in batch order, fed ``q_lens`` rows each); {} when none of them asks this step."""
    counts = [r.prompt_log_prob_positions() for r in batch]
    if not any(counts):
        return {}
    first = np.concatenate(([0], np.cumsum(q_lens)[:-1]))
    rows, targets, requests = [], [], []
    for i, (r, n) in enumerate(zip(batch, counts)):
        if n:  # the prefill feeds the prompt from its first token: row j predicts prompt[j + 1]
            rows.append(np.arange(first[i], first[i] + n))
            targets.append(np.asarray(r.prompt[1 : n + 1], dtype=np.int64))
            requests.append(np.full(n, i))
    return dict(prompt_rows=torch.from_numpy(np.concatenate(rows).astype(np.int64)),
                prompt_targets=torch.from_numpy(np.concatenate(targets)),
                prompt_requests=torch.from_numpy(np.concatenate(requests).astype(np.int64)))


def _owner(request: Request) -> int:
    return request.owner


def _longs(xs) -> torch.Tensor:
    return torch.from_numpy(np.array(list(xs), dtype=np.int64))


_PREV = (0,)  # placeholder host token of a row fed from the previous step's output
