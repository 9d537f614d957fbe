"""CUDA graphs of the whole decode step, one per ownership layout bucket.

A decode step's shapes are fixed by the rows each owner holds. Every owner's request
count is padded to one bucket (:func:`~tknp_megatron.executor.step_inputs.pad_plan`), so a graph
is keyed by the padded ownership layout and the sampling mode.
Every rank derives the same key from the broadcast plan, so all ranks capture (and warm
up, which runs the step's collectives) together. Capture uses the executor's own
``forward``; replays copy the step's inputs into the captured buffers. With
``capture=False`` (CPU tests) the same padded inputs run eagerly, which checks the
padding and bucketing without a GPU.

On a GPU the engine captures every bucket when it is built (:meth:`DecodeGraphs.capture_buckets`,
as Megatron's and vLLM's engines capture their batch sizes at start-up): otherwise the
first step of each new batch size pays a capture (warm-up runs, then the capture itself)
while requests wait, and a server's stream of arrivals walks through many sizes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from tknp_megatron.executor.step_inputs import bucket, pad_plan
from tknp_megatron.host_to_device import to_device
from tknp_megatron.models.precision import dense_autocast
from tknp_megatron.plan import StepPlan

__all__ = ["DecodeGraphs"]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: object  # the executor's staged inputs (a GraphStep, PP's carry with one, or a tuple of them)
    tokens: torch.Tensor


class DecodeGraphs:
    """Captured decode steps of one executor."""

    WARMUP = 2

    def __init__(self, executor, capture: bool = True):
        self.ex = executor
        self.capture = capture
        spec = executor.kv.spec
        self.max_seq_len = spec.max_blocks_per_seq * spec.block_size
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.captured: Dict[object, _Captured] = {}  # keyed by the executor's padded layout
        self.captures = 0  # graphs captured so far (capture_buckets' included)
        self.replays = 0  # steps run through run()

    def run(self, plan: StepPlan, carry: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Replay (capturing on first sight) the step of a pure-decode ``plan``; returns the
        captured body's output at the real requests' rows (``[R]`` tokens, or a pipeline
        stage's ``[R, 1, D]`` hidden state).

        ``carry``: what the step takes from outside the graph, padded by the executor: the
        previous step's tokens for rows the plan feeds from them (TKNP), or the previous
        stage's hidden state (PP). The executor pads the plan and prepares the inputs
        (``graph_inputs``) and runs the captured body (``graph_forward``).
        """
        ex = self.ex
        key, inputs, index = ex.graph_inputs(plan, carry, self.max_seq_len)
        n = index.numel()
        prefix = n == 0 or int(index[-1]) == n - 1  # one owner: the real rows come first
        if not prefix:
            (index,) = to_device((index,), ex.device)
        self.replays += 1
        if not self.capture:
            out = ex.graph_forward(_stage(inputs, ex.device))
        else:
            entry = self.captured.get(key)
            if entry is None:
                entry = self._capture(_stage(inputs, ex.device))
                self.captured[key] = entry
            else:
                _copy_inputs(entry.inputs, inputs)
            entry.graph.replay()
            out = entry.tokens
        return out[:n] if prefix else out.index_select(0, index)

    def capture_buckets(self, max_requests_per_owner: int) -> int:
        """Capture the decode step of every bucket up to ``max_requests_per_owner`` requests
        per owner, greedy and sampling, largest first (the smaller graphs reuse its
        memory); returns how many were captured. Each step is all padding requests (they
        write to the scratch block only), so no request's KV is touched. Every rank of the
        pool must call it together (the steps run the pool's collectives). Off GPU the
        steps run eagerly once each, which checks them."""
        ex = self.ex
        with torch.no_grad(), dense_autocast(ex.model.config, ex.groups.tp_group):  # as execute runs
            return self._capture_buckets(max_requests_per_owner)

    def _capture_buckets(self, max_requests_per_owner: int) -> int:
        ex, done = self.ex, 0
        sizes = sorted({bucket(n) for n in range(1, max_requests_per_owner + 1)}, reverse=True)
        empty = dataclasses.replace(StepPlan.idle_plan(ex.plan_owners), idle=False)  # no requests
        for size in sizes:
            padded, _ = pad_plan(empty, ex.kv.dummy_slot, size)
            for greedy in (True, False):
                plan = padded if greedy else _sampling(padded)
                key, inputs, _ = ex.graph_inputs(plan, None, self.max_seq_len)
                if key in self.captured:
                    continue
                if self.capture:
                    self.captured[key] = self._capture(_stage(inputs, ex.device))
                else:
                    ex.graph_forward(_stage(inputs, ex.device))
                done += 1
        return done

    def _capture(self, inputs) -> _Captured:
        """Warm up on a side stream (compiles kernels, starts communicators), then capture."""
        stream = _warmup_stream(torch.cuda.current_device())
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.WARMUP):
                self.ex.graph_forward(inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            tokens = self.ex.graph_forward(inputs)
        self.captures += 1
        return _Captured(graph, inputs, tokens)


_WARMUP_STREAMS: Dict[int, torch.cuda.Stream] = {}


def _warmup_stream(device: int) -> torch.cuda.Stream:
    """The one side stream every capture on ``device`` warms up on. torch keeps a cuBLAS
    workspace for each stream a GEMM ran on until the process ends (tens of MiB each on a
    Hopper GPU), so a new stream per capture would keep one per graph, dozens per engine,
    and a later engine of the same process (a benchmark running mode after mode) would
    count them as allocated when it sizes its KV cache under a memory cap."""
    if device not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[device] = torch.cuda.Stream(device)
    return _WARMUP_STREAMS[device]


def _sampling(plan: StepPlan) -> StepPlan:
    """``plan`` with every request sampled at temperature 1 (the non-greedy graph)."""
    cols = plan.per_request
    return dataclasses.replace(plan, per_request=dataclasses.replace(
        cols, temperature=torch.ones_like(cols.temperature)))


def _stage(inputs, device: torch.device):
    """What a graph captures from an executor's inputs: host inputs with a ``stage``
    (:class:`~tknp_megatron.executor.step_inputs.GraphStep`) moved into fixed device
    buffers, device tensors and inputs already on the device as they are; tuples entry
    by entry."""
    if isinstance(inputs, tuple):
        return tuple(_stage(i, device) for i in inputs)
    return inputs.stage(device) if hasattr(inputs, "stage") else inputs


def _copy_inputs(dst, src) -> None:
    """Fill captured (static) inputs from a new step's: one inputs object with a ``copy_``
    (a GraphStep, a tensor) or a tuple of them (None entries skipped)."""
    if not isinstance(dst, tuple):
        dst.copy_(src)
        return
    for d, s in zip(dst, src):
        if d is not None:
            d.copy_(s)
