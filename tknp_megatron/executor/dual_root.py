"""Dual-active-root microbatching (paper section 4.5): two microbatches, two roots per layer.

With the dual placement (even N; block b on nodes b and (b + N/2) mod N) every layer has
two roots: ``root_of_layer(l, 0)`` serves microbatch 0 and ``root_of_layer(l, 1)``
microbatch 1. Each request belongs to one microbatch (fixed at admission) and keeps its
single owner. The two microbatches run half a layer apart, so one root's dense work
overlaps the owners' attention for the other microbatch. Per layer l, every rank issues:

  A  scatter mb0's QKV(l)                         (mb0 root -> owners)
  B  mb1 root: finish(l-1), handoff, QKV(l)       || all owners: attention mb0(l)
  C  gather mb0(l), scatter mb1's QKV(l)
  D  mb0 root: finish(l), handoff, QKV(l+1)       || all owners: attention mb1(l)
  E  gather mb1(l)

(``||``: on different nodes at once; a node that is both a root and an owner runs the two
in sequence.) Collectives are issued in the same order on every rank, so the schedule
needs no extra synchronisation. The last roots compute each microbatch's logits; tokens
come back in the plan's order (microbatch 0's requests, then microbatch 1's). Decode
steps replay from CUDA graphs keyed by both microbatches' padded layouts.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from tknp_megatron.executor.base import StepOutput
from tknp_megatron.executor.dense import finish_layer, qkv_projection
from tknp_megatron.executor.prompt_log_probs import PromptRows
from tknp_megatron.executor.step_inputs import GraphStep, StepInputs, host_inputs, pad_plan, prepare_inputs
from tknp_megatron.executor.tknp import TKNPExecutor
from tknp_megatron.models.precision import dense_autocast
from tknp_megatron.plan import StepPlan

__all__ = ["DualRootExecutor"]


class DualRootExecutor(TKNPExecutor):
    """:class:`~tknp_megatron.executor.tknp.TKNPExecutor` over a dual placement, two microbatches.

    Runs plans built with ``num_microbatches=2``; everything else (KV cache, admissions,
    owners' attention, the scatter / gather / handoff collectives) is the base executor's.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.placement.dual:
            raise ValueError("dual-active-root microbatching needs a dual placement "
                             "(balanced_placement(..., dual=True), even node count)")

    @torch.no_grad()
    def execute(self, plan: StepPlan, timer=None) -> StepOutput:
        """Run a two-microbatch ``plan``; every rank returns the same :class:`StepOutput`."""
        if len(plan.microbatches) != 2:
            raise ValueError("DualRootExecutor runs plans built with num_microbatches=2")
        self.apply_admissions(plan.admissions)
        with dense_autocast(self.model.config, self.groups.tp_group):  # FP8 GEMMs if stored FP8
            return self._execute(plan)

    def _execute(self, plan: StepPlan) -> StepOutput:
        if (self.graphs is not None and not plan.record_logits and plan.log_probs_top_n < 0
                and plan.max_query_len == 1):
            self.last_tokens = self.graphs.run(plan, self.last_tokens)
            return StepOutput(self.last_tokens)
        inputs = [
            prepare_inputs(p, self.node, self.kv, self.rope, self.device, last_tokens=self.last_tokens)
            if p.num_requests else None
            for p in plan.microbatches
        ]
        hidden = self._run_layers(inputs)
        parts = [self._sample(hidden[m], inp, plan.record_logits, self.placement.last_root(m),
                              plan.log_probs_top_n, PromptRows.of(plan.microbatches[m], self.device))
                 for m, inp in enumerate(inputs) if inp is not None]

        def cat(name):
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.cat(values)

        prompt = [p.prompt_log_probs for p in parts if p.prompt_log_probs is not None]  # the plan's order
        out = StepOutput(*(cat(f) for f in ("tokens", "logits", "log_probs", "top_log_probs", "top_ids")),
                         torch.cat(prompt) if prompt else None)
        self.last_tokens = out.tokens
        return out

    # ---------------------------------------------------------------- graphs
    def enable_cuda_graphs(self, max_requests_per_owner: int = 0) -> None:
        """Graphs captured on first sight only: a layout here is a pair of microbatch
        buckets, too many pairs to capture ahead of time."""
        super().enable_cuda_graphs(0)

    def graph_inputs(self, plan: StepPlan, last_tokens, max_seq_len: int):
        """Each microbatch padded to its bucket: ``(key, (GraphStep | None) x 2, [R] index)``;
        the previous step's tokens go to the fixed buffer the captured body reads."""
        steps, index, at = [], [], 0
        for part in plan.microbatches:
            if not part.num_requests:
                steps.append(None)
                continue
            padded, idx = pad_plan(part, self.kv.dummy_slot)
            steps.append(GraphStep(host_inputs(padded, self.node, pin=self.device.type == "cuda"), max_seq_len))
            index.append(idx + at)
            at += padded.num_requests
        if last_tokens is not None:
            self.graph_last[: last_tokens.shape[0]].copy_(last_tokens)
        key = tuple(None if s is None else s.key for s in steps)
        return key, tuple(steps), torch.cat(index)

    def graph_forward(self, steps) -> torch.Tensor:
        """The captured body: both microbatches' device inputs, layers and sampling, ``[R_padded]`` tokens."""
        inputs = [None if s is None else s.inputs(self.kv, self.rope, self.graph_last) for s in steps]
        hidden = self._run_layers(inputs)
        return torch.cat([self._sample(hidden[m], inp, False, self.placement.last_root(m)).tokens
                          for m, inp in enumerate(inputs) if inp is not None])

    # ---------------------------------------------------------------- the schedule
    def _run_layers(self, inputs: List[Optional[StepInputs]]) -> list:
        """Both microbatches through every layer (schedule in the module docstring).

        Returns each microbatch's final hidden state ``[rows, 1, D]`` on its last root
        (None elsewhere, and for an empty microbatch).
        """
        # each microbatch's attention schedule, once for every layer
        inputs = [None if inp is None else self.attend.prepare(inp) for inp in inputs]
        live = [m for m in (0, 1) if inputs[m] is not None]
        last = self.placement.num_layers - 1
        hidden = [None, None]  # per microbatch, on its current root: the layer's input
        qkv = [None, None]  # fused QKV of the layer in flight, on its root
        attn = [None, None]  # gathered attention output of the layer in flight, on its root
        for m in live:
            if self.node == self.placement.first_root(m):
                hidden[m] = self._embed(inputs[m])
        if 0 in live:
            qkv[0] = self._begin(0, 0, hidden[0])
        for layer in range(last + 1):
            mine0 = self._scatter(0, layer, qkv[0], inputs)                          # A
            if 1 in live:                                                            # B
                if layer > 0:
                    hidden[1] = self._finish(1, layer - 1, hidden[1], attn[1])
                    hidden[1] = self._move(1, layer - 1, hidden[1], inputs[1])
                qkv[1] = self._begin(1, layer, hidden[1])
            att0 = self._attend(layer, mine0, inputs[0])
            attn[0] = self._gather(0, layer, att0, inputs)                           # C
            mine1 = self._scatter(1, layer, qkv[1], inputs)
            if 0 in live:                                                            # D
                hidden[0] = self._finish(0, layer, hidden[0], attn[0])
                if layer < last:
                    hidden[0] = self._move(0, layer, hidden[0], inputs[0])
                    qkv[0] = self._begin(0, layer + 1, hidden[0])
            att1 = self._attend(layer, mine1, inputs[1])
            attn[1] = self._gather(1, layer, att1, inputs)                           # E
        if 1 in live:
            hidden[1] = self._finish(1, last, hidden[1], attn[1])
        return hidden

    def _is_root(self, m: int, layer: int) -> bool:
        return self.node == self.placement.root_of_layer(layer, m)

    def _begin(self, m: int, layer: int, hidden):
        """Root of ``layer`` for ``m``: fused QKV ``[rows, W]`` of ``hidden``; None elsewhere."""
        if not self._is_root(m, layer):
            return None
        return qkv_projection(self.model.layer(layer), hidden, self.fusion)

    def _finish(self, m: int, layer: int, resid, attn):
        """Root: output projection, residuals and MLP of ``layer`` over the gathered ``attn``."""
        if not self._is_root(m, layer):
            return None
        return finish_layer(self.model.layer(layer), attn.unsqueeze(1), resid, self.fusion)

    def _move(self, m: int, layer: int, hidden, inp: StepInputs):
        """Move ``m``'s hidden state to the root of ``layer + 1`` if it changes."""
        src = self.placement.root_of_layer(layer, m)
        dst = self.placement.root_of_layer(layer + 1, m)
        return hidden if src == dst else self._handoff(hidden, src, dst, inp)

    def _scatter(self, m: int, layer: int, qkv, inputs) -> Optional[torch.Tensor]:
        """Every owner's rows of ``m``'s QKV at ``layer`` (None for an empty microbatch)."""
        inp = inputs[m]
        return None if inp is None else self._scatter_qkv(qkv, self.placement.root_of_layer(layer, m), inp)

    def _attend(self, layer: int, mine, inp: Optional[StepInputs]):
        return None if inp is None else self.attend(layer, mine, inp)

    def _gather(self, m: int, layer: int, att, inputs):
        """Attention outputs of ``m`` in batch order on its root (None elsewhere)."""
        inp = inputs[m]
        return None if inp is None else self._gather_attention(att, self.placement.root_of_layer(layer, m), inp)
