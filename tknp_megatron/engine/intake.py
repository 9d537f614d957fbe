"""What the engine checks before a request reaches the scheduler, and trace replay.

:func:`request_problem` names the request and the limit it breaks; a request with a
problem is rejected at once and never scheduled. :class:`ArrivalQueue` replays a trace:
each :class:`Arrival` is submitted once its time since the trace's release has passed.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from tknp_megatron.config import ModelPreset
from tknp_megatron.engine.request import Request
from tknp_megatron.sampling import SamplingParams

__all__ = ["Arrival", "ArrivalQueue", "integer_ids", "request_problem"]


def integer_ids(tokens: Sequence) -> Tuple[List[int], Optional[object]]:
    """``(ids, None)``: the tokens as Python ints (ints, numpy or 0-d torch integers; never
    rounded: 2.7 is not a token id), or ``([], first)`` with the first that is not an integer."""
    tokens = list(tokens)
    try:
        return [operator.index(t) for t in tokens], None
    except TypeError:
        return [], next(t for t in tokens if not _is_integer(t))


def _is_integer(value) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def request_problem(req: Request, preset: ModelPreset, max_fit_tokens: int,
                    max_len: Optional[int] = None) -> Optional[str]:
    """Why ``req`` can never be served (naming the request and the limit), or None.

    ``max_fit_tokens`` is the largest reservation any owner can ever hold; ``max_len`` the
    longest request served (default: the model's ``max_sequence_length``).
    """
    rid, prompt, p = req.request_id, req.prompt, req.params
    vocab = preset.vocab_size
    max_len = preset.gpt.max_sequence_length if max_len is None else max_len
    if not prompt:
        return f"request {rid}: empty prompt"
    try:
        ids = torch.as_tensor(prompt, dtype=torch.int64)
    except (OverflowError, RuntimeError, ValueError):  # an id beyond 64 bits
        ids = None
    if ids is None or bool(((ids < 0) | (ids >= vocab)).any()):
        bad = next(t for t in prompt if not 0 <= t < vocab)
        return f"request {rid}: token id {bad} outside the vocabulary [0, {vocab})"
    problems = p.problems()
    if problems:
        return f"request {rid}: " + "; ".join(problems)
    if p.return_prompt_log_probs and req.ingested:
        return (f"request {rid}: return_prompt_log_probs needs the prompt prefilled in the pool; its KV "
                "comes from outside")
    if p.top_n_logprobs > vocab:
        return f"request {rid}: top_n_logprobs {p.top_n_logprobs} exceeds the vocabulary ({vocab} tokens)"
    if req.reserved_tokens > max_len:
        return (
            f"request {rid}: prompt {len(prompt)} + max_new_tokens {p.max_new_tokens} = "
            f"{req.reserved_tokens} tokens exceeds max_sequence_length {max_len}"
        )
    if req.reserved_tokens > max_fit_tokens:
        return (
            f"request {rid}: needs {req.reserved_tokens} KV tokens (prompt {len(prompt)} + "
            f"max_new_tokens {p.max_new_tokens}), more than any node holds ({max_fit_tokens} tokens)"
        )
    if req.kv is not None and tuple(req.kv.shape[:3]) != (preset.num_layers, 2, len(prompt) - 1):
        return f"request {rid}: kv shape {tuple(req.kv.shape)} does not cover prompt[:-1]"
    return None


@dataclass(frozen=True)
class Arrival:
    """A request that enters the queue ``time_s`` after the trace is released."""

    time_s: float
    prompt: tuple
    params: SamplingParams
    request_id: int
    synthetic_kv: Optional[int] = None


class ArrivalQueue:
    """Arrivals not yet submitted, released against ``clock``."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.t0 = 0.0
        self._pending: List[Arrival] = []  # latest first

    def __bool__(self) -> bool:
        return bool(self._pending)

    def load(self, arrivals: Sequence[Arrival], t0: float) -> None:
        self.t0 = t0
        self._pending = sorted(arrivals, key=lambda a: a.time_s, reverse=True)

    def due(self) -> List[Arrival]:
        """Arrivals whose time has come, in arrival order."""
        now, out = self.clock(), []
        while self._pending and self.t0 + self._pending[-1].time_s <= now:
            out.append(self._pending.pop())
        return out

    def next_time(self) -> Optional[float]:
        """When the next arrival is due (the clock's time), or None if none is left."""
        return self.t0 + self._pending[-1].time_s if self._pending else None

    def sleep_until_next(self) -> None:
        due = self.next_time()
        if due is not None:
            time.sleep(max(0.0, due - self.clock()))
