"""CUDA graphs of the whole decode step, one per ownership layout bucket.

A decode step's shapes are fixed by the rows each owner holds. Every owner's request
count is padded to one bucket (:func:`~tknp_megatron.step_inputs.pad_plan`), so a graph
is keyed by the padded ownership layout and the sampling mode.
Every rank derives the same key from the broadcast plan, so all ranks capture (and warm
up, which runs the step's collectives) together. Capture uses the executor's own
``forward``; replays copy the step's inputs into the captured buffers. With
``capture=False`` (CPU tests) the same padded inputs run eagerly, which checks the
padding and bucketing without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from .host_to_device import to_device
from .plan import StepPlan
from .step_inputs import StepInputs, StepShape, pad_plan, prepare_inputs

__all__ = ["DecodeGraphs"]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: StepInputs
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
        self.captured: Dict[StepShape, _Captured] = {}

    def run(self, plan: StepPlan, last_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Replay (capturing on first sight) the step of a pure-decode ``plan``: ``[R]`` tokens.

        ``last_tokens``: the previous step's tokens, for rows the plan feeds from them.
        """
        ex = self.ex
        padded, index = pad_plan(plan, ex.kv.dummy_slot)
        inputs = prepare_inputs(padded, ex.node, ex.kv, ex.rope, ex.device, self.max_seq_len, last_tokens)
        (index,) = to_device((index,), ex.device)
        if not self.capture:
            tokens, _ = ex.forward(inputs)
            return tokens.index_select(0, index)
        entry = self.captured.get(inputs.shape)
        if entry is None:
            entry = self._capture(inputs)
            self.captured[inputs.shape] = entry
        else:
            entry.inputs.copy_(inputs)
        entry.graph.replay()
        return entry.tokens.index_select(0, index)

    def _capture(self, inputs: StepInputs) -> _Captured:
        """Warm up on a side stream (compiles kernels, starts communicators), then capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.WARMUP):
                self.ex.forward(inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            tokens, _ = self.ex.forward(inputs)
        return _Captured(graph, inputs, tokens)
