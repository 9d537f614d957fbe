"""Per-request sampling: greedy, temperature, top-k, top-p, drawn without host sync.

The draw is a Gumbel-max (exponential race) whose noise comes from a counter-based
hash of ``(seed, request_id, step, vocab index)``, not from a ``torch.Generator``
(``request_id`` is the request's ``SamplingParams.noise_id`` where it has one).
So a row's token depends only on its own logits and those four numbers: it is the
same whatever the batch composition or row order, the uniforms are bit-identical on
CPU and CUDA, and :func:`sample` has fixed shapes, no ``.item()`` and no generator
state, so it can be captured in a CUDA graph or compiled.

The hash works on 32-bit lanes stored in int64 tensors, with multipliers below 2**31,
so no product reaches 2**63: the result never relies on int64 overflow behaviour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from tknp_megatron.hashing import MASK32, mix32

__all__ = [
    "GREEDY_BELOW",
    "SamplingParams",
    "SamplingTensors",
    "sampling_tensors",
    "greedy",
    "sample",
    "hash_uniform",
    "token_log_probs",
    "pack_log_probs",
    "unpack_log_probs",
]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy, as in vLLM: the draw's limit as the temperature goes to
0 is the argmax, and logits divided by a temperature near float32's smallest normal overflow
to infinity, where the argmax would take the first infinite one, not the largest logit."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Names follow Megatron-Core's ``megatron.core.inference.sampling_params.SamplingParams``
    where they overlap: ``temperature``, ``top_k`` and ``top_p`` mean the same, but here
    ``temperature == 0`` is greedy (Megatron: ``top_k=1``) and ``top_p == 1.0`` is off
    (Megatron: ``top_p=0.0``); ``max_new_tokens`` is Megatron's ``num_tokens_to_generate``,
    ``eos_id`` its ``termination_id``; ``stop_sequences`` are its ``stop_words`` already
    tokenized; ``return_log_probs`` and ``top_n_logprobs`` mean the same (log-probs of the
    generated tokens under the model's unscaled distribution); ``seed`` and ``noise_id`` have
    no Megatron counterpart. :mod:`tknp_megatron.serving.megatron_types` converts Megatron's own.

    ``__post_init__`` rejects bad values of every field except ``max_new_tokens``: the
    engine rejects ``max_new_tokens < 1`` per request with a message naming the request,
    using :meth:`problems`.
    """

    temperature: float = 0.0
    """Softmax temperature; 0 means greedy (argmax), and so does any temperature below
    :data:`GREEDY_BELOW` (stored as 0)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 means off."""
    top_p: float = 1.0
    """Nucleus: keep the smallest prefix of sorted tokens whose mass reaches top_p; 1 = off."""
    max_new_tokens: int = 16
    """Tokens to generate, the first included (must be >= 1; checked by the engine)."""
    eos_id: Optional[int] = None
    """Generation stops after this token; None means never."""
    seed: int = 0
    """Seed of the counter-based noise; any int64."""
    noise_id: Optional[int] = None
    """The id the noise is keyed by, with ``seed`` and the token's index; None: the request's
    own id. Requests given the same seed and noise id draw the same tokens from the same
    logits (an API's seeded request, whose id differs from run to run)."""
    return_log_probs: bool = False
    """Return each generated token's log-prob (log-softmax of the unscaled logits)."""
    top_n_logprobs: int = 0
    """Also return the n most likely tokens and their log-probs at each step (needs
    ``return_log_probs``)."""
    return_prompt_log_probs: bool = False
    """Also return each prompt token's log-prob given the tokens before it, from the
    prompt's prefill (``len(prompt) - 1`` values: the first token has none), and with
    ``top_n_logprobs`` the n most likely tokens at each of those positions (needs
    ``return_log_probs``; Megatron's ``skip_prompt_log_probs=False``)."""
    stop_sequences: Tuple[Tuple[int, ...], ...] = ()
    """Generation stops once the generated tokens end with one of these (kept in the
    output, as Megatron's engine keeps a stop word)."""

    def __post_init__(self) -> None:
        if 0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        bad = [p for p in self.problems() if not p.startswith("max_new_tokens")]
        if bad:
            raise ValueError("invalid SamplingParams: " + "; ".join(bad))

    def problems(self) -> list[str]:
        """Every invalid field as a message, ``max_new_tokens < 1`` included; [] if valid."""
        out = []
        if self.max_new_tokens < 1:
            out.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            out.append(f"temperature must be finite and >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            out.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= _INT64_MAX:
            out.append(f"top_k must be in [0, 2**63), got {self.top_k}")
        if self.eos_id is not None and not 0 <= self.eos_id <= _INT64_MAX:
            out.append(f"eos_id must be None or in [0, 2**63), got {self.eos_id}")
        if not (_INT64_MIN <= self.seed <= _INT64_MAX):
            out.append(f"seed must fit in int64, got {self.seed}")
        if self.noise_id is not None and not (_INT64_MIN <= self.noise_id <= _INT64_MAX):
            out.append(f"noise_id must be None or fit in int64, got {self.noise_id}")
        if self.top_n_logprobs < 0:
            out.append(f"top_n_logprobs must be >= 0, got {self.top_n_logprobs}")
        if self.top_n_logprobs > 0 and not self.return_log_probs:
            out.append(f"top_n_logprobs {self.top_n_logprobs} needs return_log_probs")
        if self.return_prompt_log_probs and not self.return_log_probs:
            out.append("return_prompt_log_probs needs return_log_probs")
        if any(len(s) == 0 for s in self.stop_sequences):
            out.append("stop_sequences must not hold an empty sequence")
        return out

    @property
    def log_probs_top_n(self) -> int:
        """-1 when no log-probs are asked for, else how many top tokens to return."""
        return self.top_n_logprobs if self.return_log_probs else -1

    @property
    def is_greedy(self) -> bool:
        """True when the token is the argmax of the logits."""
        return self.temperature == 0.0


class SamplingTensors(NamedTuple):
    """Per-row sampling inputs of :func:`sample`, each of shape ``[B]``."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float32
    seeds: torch.Tensor  # int64
    request_ids: torch.Tensor  # int64
    steps: torch.Tensor  # int64


def sampling_tensors(
    params: Sequence[SamplingParams],
    request_ids: Sequence[int] | torch.Tensor,
    steps: Sequence[int] | torch.Tensor,
    device: torch.device | str = "cpu",
) -> SamplingTensors:
    """Build the ``[B]`` tensors of :func:`sample` for B rows (host side, once per plan).

    ``steps[i]`` is the index of the token being drawn for request ``request_ids[i]``
    (0 for the first generated token).
    """
    if not (len(params) == len(request_ids) == len(steps)):
        raise ValueError(
            f"lengths differ: {len(params)} params, {len(request_ids)} request ids, "
            f"{len(steps)} steps"
        )

    def make(values, dtype):
        return torch.as_tensor(values, dtype=dtype).to(device)

    return SamplingTensors(
        temperature=make([p.temperature for p in params], torch.float32),
        top_k=make([p.top_k for p in params], torch.int64),
        top_p=make([p.top_p for p in params], torch.float32),
        seeds=make([p.seed for p in params], torch.int64),
        request_ids=make(request_ids, torch.int64),
        steps=make(steps, torch.int64),
    )


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` logits -> ``[B]`` int64 argmax (the first index on ties)."""
    return torch.argmax(logits, dim=-1)


# --- counter-based hash on 32-bit lanes held in int64 --------------------------------


def _row_key(seeds: torch.Tensor, request_ids: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 -> ``[B, 1]`` 32-bit key.

    Each of the six 32-bit lanes of (seed, request id, step) is salted by its position and
    mixed on its own, the results are summed mod 2**32 and mixed again: a few wide ops
    rather than a long chain of tiny ones, since kernel launches dominate on ``[B]``.
    Salts come from ``arange`` (a kernel), not a host tensor, so CUDA-graph capture works.
    """
    x = torch.stack((seeds, request_ids, steps))  # [3, B]
    lanes = torch.cat((x & MASK32, (x >> 32) & MASK32))  # [6, B]; arithmetic shift, masked
    salts = (torch.arange(1, 7, device=x.device, dtype=torch.int64) * 0x9E3779B1) & MASK32
    mixed = mix32(mix32(lanes ^ salts[:, None]))
    return mix32(mix32(mixed.sum(0) & MASK32))[:, None]


def hash_uniform(
    seeds: torch.Tensor, request_ids: torch.Tensor, steps: torch.Tensor, vocab: int
) -> torch.Tensor:
    """Uniforms in (0, 1), ``[B, vocab]`` float32, a pure function of each row's numbers.

    ``seeds``, ``request_ids``, ``steps``: ``[B]`` int64. Each value is
    ``(m + 0.5) / 2**24`` for a 24-bit hash ``m`` of (seed, request id, step, index),
    so it is exact in float32 and never 0 or 1. The per-row work is done on ``[B]`` and
    the index hash on ``[vocab]``; only one mixing round runs on ``[B, vocab]``.
    """
    index = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    index_hash = mix32(mix32(index ^ 0x5BD1E995))[None, :]
    h = mix32(_row_key(seeds, request_ids, steps) ^ index_hash)
    return ((h >> 8).to(torch.float32) + 0.5) * (2.0**-24)


# --- filtering and the draw ------------------------------------------------------------


def _filter_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` bool: the tokens that survive top-k then top-p, in vocab order.

    Sorting is stable, so among equal logits the lower index ranks first, on any device.
    The most likely token always survives.
    """
    vocab = scaled.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)[:, None]
    keep_sorted = rank < k
    probs = torch.softmax(sorted_logits.masked_fill(~keep_sorted, -math.inf), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # exclusive prefix sum
    in_nucleus = (mass_before < top_p[:, None]) | (rank == 0) | (top_p[:, None] >= 1.0)
    keep_sorted &= in_nucleus
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    request_ids: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """Draw one token per row; ``[B, V]`` logits (any float dtype) -> ``[B]`` int64.

    Per row: greedy when ``temperature < GREEDY_BELOW``; otherwise scale by ``1 / temperature``,
    keep the ``top_k`` largest (0 = all), keep the nucleus of mass ``top_p``, then take
    ``argmax(logit / T - log(-log u))`` over the kept tokens, with ``u`` from
    :func:`hash_uniform` (a Gumbel-max draw from the filtered softmax).

    Args:
        temperature: ``[B]`` float, >= 0.
        top_k: ``[B]`` int64, >= 0.
        top_p: ``[B]`` float in (0, 1].
        seeds, request_ids, steps: ``[B]`` int64; the noise of a row depends only on them.

    Top-k and top-p act on the temperature-scaled logits; ties at their boundary go to
    the lower vocab index. The uniforms are bit-identical on CPU and CUDA; the token can
    differ only if two kept tokens' scores agree to within float32 rounding of ``log``.
    """
    x = logits.to(torch.float32)
    hot = temperature >= GREEDY_BELOW
    safe_t = torch.where(hot, temperature.to(torch.float32), 1.0)[:, None]
    scaled = x / safe_t
    keep = _filter_mask(scaled, top_k, top_p.to(torch.float32))
    u = hash_uniform(seeds, request_ids, steps, x.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    drawn = torch.argmax((scaled + gumbel).masked_fill(~keep, -math.inf), dim=-1)
    return torch.where(hot, drawn, greedy(x))


def token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, top_n: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs under the unscaled distribution, as Megatron's engine returns them.

    ``logits`` ``[R, V]`` (any float dtype), ``tokens`` ``[R]`` int64 ->
    ``(chosen [R] float32, top_values [R, top_n] float32, top_ids [R, top_n] int64)``:
    the log-softmax at each row's token and its ``top_n`` largest entries.
    """
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)
    values, ids = torch.topk(lp, top_n, dim=-1, sorted=True) if top_n > 0 else (
        lp.new_empty(lp.shape[0], 0), tokens.new_empty(lp.shape[0], 0))
    return chosen, values, ids


def pack_log_probs(chosen: torch.Tensor, values: torch.Tensor, ids: torch.Tensor,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`token_log_probs`' three outputs as one ``[R, 1 + 2 top_n]`` float32 tensor,
    for one collective (ids travel as float32: exact below 2**24, far above any vocabulary)."""
    return torch.cat((chosen[:, None], values, ids.to(torch.float32)), dim=1, out=out)


def unpack_log_probs(packed: torch.Tensor, top_n: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_log_probs`: ``(chosen [R], values [R, top_n], ids [R, top_n])``."""
    return packed[:, 0], packed[:, 1:1 + top_n], packed[:, 1 + top_n:].to(torch.int64)
