"""The engine's knobs and the per-request result it returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tknp_megatron.engine.request import RequestStatus
from tknp_megatron.engine.scheduler import LoadPolicy

__all__ = ["EngineConfig", "GenerationResult", "sequence_limit_problem"]


def sequence_limit_problem(limit: int, preset) -> Optional[str]:
    """Why ``limit`` cannot be ``EngineConfig.max_sequence_length`` with ``preset``'s model
    (for a front end to prefix with its flag), or None."""
    model = preset.gpt.max_sequence_length
    if not 1 <= limit <= model:
        return f"must be in [1, {model}] ({preset.name}'s max_sequence_length)"
    return None


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs.

    Attributes:
        block_size: tokens per KV block.
        kv_tokens_per_node: KV budget per node in tokens (CPU); None sizes the cache
            from free GPU memory after weights.
        gpu_memory_utilization: fraction of GPU memory the process may use in total.
        gpu_memory_cap_gib: if set, size the KV cache as if each GPU had only this much
            memory (weights included): a smaller model then reproduces a large model's
            capacity regime.
        max_requests_per_node: request slots per node.
        max_prefill_tokens: prompt tokens admitted per step.
        policy: owner choice among eligible nodes (``usage`` or ``reserved``).
        attention_backend: backend name; None picks the device default.
        record_logits: return each generated token's logits (tests).
        cuda_graphs: replay decode steps from CUDA graphs (on CPU: the same bucketed,
            padded decode path, run eagerly).
        capture_at_start: with ``cuda_graphs`` on a GPU, capture the decode step of every
            batch bucket up to ``max_requests_per_node`` while the engine is built (as
            Megatron's and vLLM's engines do), rather than on each bucket's first step.
        freeze_gc: once the engine is built (graphs captured), move every object then
            alive into the garbage collector's permanent generation (``gc.freeze``), as
            vLLM's and SGLang's engines do: a full collection then scans only what was
            allocated since, instead of the hundreds of thousands of objects torch,
            Megatron and the engine hold (0.1-0.25 s per full collection, inside
            whichever step it fell in).
        microbatches: 2 runs dual-active-root microbatching (needs a dual placement;
            :mod:`tknp_megatron.executor.dual_root`), 1 the single-copy schedule.
        fused_elementwise: the element-wise work between the root's GEMMs (norms, residual
            adds, activation) as fused Triton kernels on the same modules' parameters
            (:mod:`tknp_megatron.executor.dense_fusion`): None on GPUs only, True wherever
            Triton runs (GPUs, or CPUs under ``TRITON_INTERPRET=1``: tests), False never
            (Megatron's modules).
        fused_rope: with those kernels, the owners' RoPE and K/V append too, as one Triton
            kernel per layer (:meth:`~tknp_megatron.executor.rope.Rope.rotate_and_append`;
            equal to Megatron's rotation and cache write bit for bit in the CPU tests, and
            3-5 % off a one-GPU decode step on an H200: ``benchmarks/RESULTS.md``). False
            keeps Megatron's rotation beside the other fused kernels.
        max_sequence_length: the longest request (prompt + max_new_tokens) served; None is
            the model's ``max_sequence_length``. A smaller limit (vLLM's ``max_model_len``)
            refuses longer requests, sizes each request's block table, and bounds the
            attention launches captured in CUDA graphs, which are sized for the longest
            sequence: the ``auto`` attention backend chooses its kernel by that bound
            (``attention/per_shape.py``).
    """

    block_size: int = 16
    kv_tokens_per_node: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    gpu_memory_cap_gib: Optional[float] = None
    max_requests_per_node: int = 256
    max_prefill_tokens: int = 16384
    policy: LoadPolicy = LoadPolicy.USAGE
    attention_backend: Optional[str] = None
    record_logits: bool = False
    cuda_graphs: bool = False
    capture_at_start: bool = True
    freeze_gc: bool = True
    microbatches: int = 1
    fused_elementwise: Optional[bool] = None
    fused_rope: bool = True
    max_sequence_length: Optional[int] = None

    def __post_init__(self):
        problem = self._problem()
        if problem:
            raise ValueError(f"EngineConfig {problem}")
        object.__setattr__(self, "policy", LoadPolicy(self.policy))

    def _problem(self) -> Optional[str]:
        """The first field whose value is of the wrong type or out of range, as
        ``"<field> <value>: <rule>"``, or None."""
        def whole(value, low: int, optional: bool = False) -> bool:
            return (optional and value is None) or (
                isinstance(value, int) and not isinstance(value, bool) and value >= low)

        for name in ("block_size", "max_requests_per_node", "max_prefill_tokens"):
            if not whole(getattr(self, name), 1):
                return f"{name} {getattr(self, name)!r}: must be an integer >= 1"
        if not whole(self.kv_tokens_per_node, self.block_size, optional=True):
            return (f"kv_tokens_per_node {self.kv_tokens_per_node!r}: must be None or an integer "
                    f">= block_size {self.block_size} (one block)")
        if not whole(self.max_sequence_length, 1, optional=True):
            return f"max_sequence_length {self.max_sequence_length!r}: must be None or an integer >= 1"
        if self.microbatches not in (1, 2) or isinstance(self.microbatches, bool):
            return f"microbatches {self.microbatches!r}: must be 1 or 2 (dual active roots)"
        fraction = self.gpu_memory_utilization
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            return f"gpu_memory_utilization {fraction!r}: must be in (0, 1]"
        cap = self.gpu_memory_cap_gib
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                                or not 0 < cap < float("inf")):
            return f"gpu_memory_cap_gib {cap!r}: must be None or a positive number of GiB"
        if self.policy not in {p.value for p in LoadPolicy}:
            return f"policy {self.policy!r}: choose one of {', '.join(p.value for p in LoadPolicy)}"
        if self.attention_backend is not None and not isinstance(self.attention_backend, str):
            return f"attention_backend {self.attention_backend!r}: must be None or a backend name"
        for name in ("record_logits", "cuda_graphs", "capture_at_start", "freeze_gc", "fused_rope"):
            if not isinstance(getattr(self, name), bool):
                return f"{name} {getattr(self, name)!r}: must be True or False"
        if self.fused_elementwise is not None and not isinstance(self.fused_elementwise, bool):
            return f"fused_elementwise {self.fused_elementwise!r}: must be None, True or False"
        return None

    def sequence_limit(self, preset) -> int:
        """The longest request served with ``preset``'s model (``max_sequence_length``);
        ``ValueError`` in one line if this config's limit is over the model's."""
        model = preset.gpt.max_sequence_length
        if self.max_sequence_length is None:
            return model
        if self.max_sequence_length > model:
            raise ValueError(f"max_sequence_length {self.max_sequence_length}: over the model's "
                             f"max_sequence_length {model} ({preset.name})")
        return self.max_sequence_length


@dataclass(frozen=True)
class GenerationResult:
    """How one request ended.

    ``log_probs`` (one per generated token) and ``top_log_probs`` (per token, the
    ``top_n_logprobs`` most likely ``(id, log-prob)`` pairs) are set when the request
    asked for them; ``finish_reason`` is ``"length"``, ``"eos"`` or ``"stop"`` once
    completed. ``prompt_log_probs`` (one per prompt token after the first) and
    ``prompt_top_log_probs`` (their top pairs, with ``top_n_logprobs``) likewise, with
    ``return_prompt_log_probs``.
    """

    request_id: int
    status: RequestStatus
    prompt_tokens: tuple
    tokens: tuple
    owner: int
    reject_reason: Optional[str] = None
    logits: Optional[torch.Tensor] = None
    log_probs: Optional[tuple] = None
    top_log_probs: Optional[tuple] = None
    finish_reason: Optional[str] = None
    prompt_log_probs: Optional[tuple] = None
    prompt_top_log_probs: Optional[tuple] = None
