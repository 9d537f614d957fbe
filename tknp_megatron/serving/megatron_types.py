"""Megatron-Core's request types in and out of a TKNP pool.

In: Megatron's ``SamplingParams`` (as its coordinator forwards them, a dict) and a prompt
(token ids, or text Megatron's engine would tokenize) become this library's
:class:`~tknp_megatron.sampling.SamplingParams` with Megatron's conventions applied
(:func:`to_engine_request`). Out: an ended request becomes the installed megatron-core's
own ``DynamicInferenceRequest``, serialized by its own ``serialize`` (:func:`reply_item`),
so the wire format follows the installed version:

- megatron-core 0.16 replies with request *records* (``DynamicInferenceRequestRecord``,
  ``{"requests": [request]}``) and its coordinator expects PAUSE_ACK / STOP_ACK;
- 0.17 and later reply with merged requests and have no acknowledgements.

Nothing here is copied from Megatron: the classes, headers and enums are imported.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from packaging.version import Version

from tknp_megatron.engine.config import GenerationResult
from tknp_megatron.engine.request import RequestStatus
from tknp_megatron.sampling import GREEDY_BELOW, SamplingParams

__all__ = [
    "MEGATRON_VERSION",
    "REPLIES_ARE_RECORDS",
    "EngineRequest",
    "RequestRefused",
    "reply_item",
    "to_engine_request",
    "tokenize_prompt",
]


def _megatron_version() -> Version:
    import megatron.core

    return Version(megatron.core.__version__)


MEGATRON_VERSION = _megatron_version()
REPLIES_ARE_RECORDS = MEGATRON_VERSION < Version("0.17")
"""megatron-core 0.16 sends ``DynamicInferenceRequestRecord``\\ s through its coordinator;
0.17 and later send the merged ``DynamicInferenceRequest``."""


class RequestRefused(ValueError):
    """A request the pool can never serve; the message names the field, value and limit."""


@dataclass(frozen=True)
class EngineRequest:
    """A Megatron request as this library's engine takes it."""

    prompt: Tuple[int, ...]
    params: SamplingParams


def tokenize_prompt(tokenizer, text: str, add_bos: bool) -> List[int]:
    """Text -> ids as Megatron's ``TextGenerationController.tokenize_prompt`` does it:
    leading BOS tokens are dropped, then one BOS is put in front when ``add_bos``."""
    ids = list(tokenizer.tokenize(text))
    bos = getattr(tokenizer, "bos", None)
    if add_bos and bos is None:
        raise RequestRefused("add_BOS is set but the tokenizer has no BOS token")
    while ids and bos is not None and ids[0] == bos:
        ids.pop(0)
    return [bos] + ids if add_bos else ids


def megatron_sampling_params(params: Dict[str, Any]):
    """The installed megatron-core's ``SamplingParams`` of ``params`` (as its client sent
    them); :class:`RequestRefused` with its own reason where that class refuses them (its
    checks are assertions, e.g. prompt top-n log-probs with ``skip_prompt_log_probs``)."""
    from megatron.core.inference.sampling_params import SamplingParams as MegatronSamplingParams

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return MegatronSamplingParams.deserialize(dict(params))
    except (AssertionError, TypeError, ValueError, AttributeError) as err:
        raise RequestRefused(f"sampling parameters Megatron's SamplingParams refuses: "
                             f"{err or type(err).__name__}") from None


def _field(params: Dict[str, Any], name: str, default):
    value = params.get(name, default)
    return default if value is None and default is not None else value


def to_engine_request(
    prompt: Union[str, Sequence[int]],
    params: Dict[str, Any],
    tokenizer,
    max_sequence_length: int,
) -> EngineRequest:
    """Megatron's ``(prompt, SamplingParams.serialize())`` -> the engine's request.

    Megatron's conventions, applied as its engine applies them: ``top_k == 1`` or
    ``temperature == 0`` is greedy (here any temperature below ``GREEDY_BELOW``); ``top_p ==
    0`` is off; ``termination_id`` None is the tokenizer's ``eod`` and -1 is none;
    ``num_tokens_total`` (with ``num_tokens_to_generate`` None: Megatron's engine takes one of
    the two) generates ``num_tokens_total - len(prompt)``, neither up to
    ``max_sequence_length``; stop words are tokenized without BOS. ``seed`` (an HTTP body's,
    which the front end adds, with ``seed_choice``, the index of the choice) keys the draws'
    noise with the choice's index instead of the request's id, so the same seeded request
    draws the same tokens again. ``return_log_probs`` without ``skip_prompt_log_probs``
    (an HTTP completion with ``echo`` and ``logprobs``) returns the prompt's log-probs too,
    read from its prefill in the pool.

    Raises:
        RequestRefused: naming the field, its value and what is allowed.
    """
    if isinstance(prompt, str):
        ids = tokenize_prompt(tokenizer, prompt, bool(params.get("add_BOS", False)))
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
        ids = list(prompt)
    else:
        raise RequestRefused(f"prompt of type {type(prompt).__name__}: expected text or a list of "
                             "token ids")
    try:
        temperature = float(_field(params, "temperature", 1.0))
        top_k = int(_field(params, "top_k", 0))
        top_p = float(_field(params, "top_p", 0.0))
    except (TypeError, ValueError) as err:
        raise RequestRefused(f"sampling parameters: {err}") from None
    if not math.isfinite(temperature) or temperature < 0:
        raise RequestRefused(f"temperature {temperature}: must be finite and >= 0")
    if not 0.0 <= top_p <= 1.0:
        raise RequestRefused(f"top_p {top_p}: must be in [0, 1] (0 is off)")
    if top_k < 0:
        raise RequestRefused(f"top_k {top_k}: must be >= 0 (0 is off)")
    greedy = top_k == 1 or temperature < GREEDY_BELOW
    try:
        new_tokens = _optional_int(params, "num_tokens_to_generate")
        total = _optional_int(params, "num_tokens_total")
        termination = _optional_int(params, "termination_id")
        seed = _optional_int(params, "seed")  # not Megatron's: the front end's (an API's seed)
        choice = _optional_int(params, "seed_choice") or 0
    except (TypeError, ValueError) as err:
        raise RequestRefused(str(err)) from None
    if new_tokens is not None and total is not None:  # Megatron's engine asserts one of the two
        raise RequestRefused(f"num_tokens_to_generate {new_tokens} and num_tokens_total {total}: set one "
                             "(the other None)")
    if total is not None:
        new_tokens = total - len(ids)
        if new_tokens < 1:
            raise RequestRefused(f"num_tokens_total {total}: must exceed the prompt's {len(ids)} tokens")
    elif new_tokens is None:
        new_tokens = max_sequence_length - len(ids)
    elif new_tokens == 0 and prompt_scored(params):
        new_tokens = 1  # the pool generates one; the reply keeps none (reply_item)
    elif new_tokens < 1:
        raise RequestRefused(f"num_tokens_to_generate {new_tokens}: must be at least 1 (0 only with the "
                             "prompt's log-probs: return_log_probs without skip_prompt_log_probs)")
    tokenizers_end = termination is None  # the tokenizer's end: its eod and its other end ids
    if tokenizers_end:
        termination = getattr(tokenizer, "eod", None)
    return_log_probs = bool(params.get("return_log_probs", False))
    prompt_log_probs = prompt_scored(params)
    stop = tuple(tuple(tokenize_prompt(tokenizer, word, False)) for word in params.get("stop_words") or ())
    if any(not s for s in stop):
        raise RequestRefused(f"stop_words {params.get('stop_words')}: a stop word has no tokens")
    if tokenizers_end:
        stop += tuple((i,) for i in getattr(tokenizer, "stop_ids", ()))
    try:
        engine_params = SamplingParams(
            temperature=0.0 if greedy else temperature,
            top_k=0 if greedy else top_k,
            top_p=1.0 if greedy or top_p == 0.0 else top_p,
            max_new_tokens=int(new_tokens),
            eos_id=None if termination is None or termination < 0 else int(termination),
            return_log_probs=return_log_probs,
            return_prompt_log_probs=prompt_log_probs,
            top_n_logprobs=_optional_int(params, "top_n_logprobs") or 0,
            stop_sequences=stop,
            seed=0 if seed is None else seed,
            noise_id=None if seed is None else choice,
        )
    except (TypeError, ValueError) as err:
        raise RequestRefused(str(err).replace("invalid SamplingParams: ", "")) from None
    megatron_sampling_params(params)  # the reply carries them: Megatron's class must take them
    return EngineRequest(tuple(ids), engine_params)


def _optional_int(params: Dict[str, Any], name: str) -> Optional[int]:
    """``params[name]`` as an int, None where absent or None; raises ``ValueError`` naming
    the field for a value that is not a whole number."""
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{name} {value!r}: expected a whole number")
    return int(value)


def _echoed_ids(prompt) -> list:
    """A refused request's prompt as its reply carries it: the ids when it is a list of 64-bit
    ints, else none (text, or an id no int64 tensor holds)."""
    ok = isinstance(prompt, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) and -2**63 <= t < 2**63 for t in prompt)
    return list(prompt) if ok else []


def prompt_scored(params: Dict[str, Any]) -> bool:
    """Whether Megatron's ``params`` ask for the prompt's log-probs: ``return_log_probs``
    without ``skip_prompt_log_probs`` (then ``num_tokens_to_generate`` 0 scores the prompt
    alone, as OpenAI's ``echo`` with ``max_tokens`` 0 does)."""
    return bool(params.get("return_log_probs", False)) and not params.get("skip_prompt_log_probs", False)


def _stop_trim(result: GenerationResult, megatron_params: Dict[str, Any], tokenizer) -> int:
    """How many trailing tokens Megatron's engine drops from a request that ended on a stop
    word: none in 0.16 (the stop word is kept), the stop word in 0.17 and later unless
    ``detokenize_stop_sequence`` asks to keep it."""
    from megatron.core.inference.sampling_params import SamplingParams as MegatronSamplingParams

    if result.finish_reason != "stop" or megatron_params.get("detokenize_stop_sequence", False):
        return 0
    if "detokenize_stop_sequence" not in MegatronSamplingParams.__dataclass_fields__:
        return 0
    for word in megatron_params.get("stop_words") or ():
        ids = tuple(tokenize_prompt(tokenizer, word, False))
        if ids and tuple(result.tokens[-len(ids):]) == ids:
            return len(ids)
    return 0


def reply_item(
    request_id: int,
    prompt: Sequence[int],
    megatron_params: Dict[str, Any],
    tokenizer,
    result: Optional[GenerationResult] = None,
    failure: Optional[str] = None,
    transient: bool = False,
) -> Dict[str, Any]:
    """One ended request as the installed megatron-core serializes it for its coordinator.

    ``result`` is the engine's (completed, rejected or aborted); ``failure`` a reason for a
    request that never reached the engine. A completed request is COMPLETED with its
    generated tokens, their log-probs and top-n log-probs (``{token text: log-prob}`` per
    token, as Megatron's engine detokenizes them), the prompt's where asked (and its top-n
    where ``return_prompt_top_n_logprobs``), a stop word kept or trimmed as the
    installed version's engine does; anything else is FAILED with an error event carrying
    the reason, which Megatron's front end reports: ERROR_NONTRANSIENT for a request refused
    for what it asks (the same request would be refused again; Megatron's endpoints answer
    400), ERROR_TRANSIENT where ``transient`` (the server stopped or a pool failed under it:
    sent again, it may complete; they answer 500).
    """
    from megatron.core.inference.contexts.dynamic_context import ContextOverflowError
    from megatron.core.inference.inference_request import (
        DynamicInferenceRequest,
        DynamicInferenceRequestRecord,
        Status,
    )
    from tknp_megatron.models.cpu_shims import allow_nvtx_without_cuda

    allow_nvtx_without_cuda()
    completed = result is not None and result.status is RequestStatus.COMPLETED
    request = DynamicInferenceRequest(
        request_id=request_id,
        prompt_tokens=torch.tensor(list(prompt) if completed else _echoed_ids(prompt), dtype=torch.int64),
        sampling_params=_reply_params(megatron_params),
    )
    # the arrival event: add_event_add in 0.16, add_event_add_engine from 0.17
    (getattr(request, "add_event_add", None) or request.add_event_add_engine)()
    if completed:
        keep = len(result.tokens) - _stop_trim(result, megatron_params, tokenizer)
        if megatron_params.get("num_tokens_to_generate") == 0:  # the prompt scored alone
            keep = 0
        request.status = Status.COMPLETED
        request.generated_tokens = list(result.tokens[:keep])
        request.generated_length = keep
        if result.log_probs is not None:
            request.generated_log_probs = list(result.log_probs[:keep])
        if result.top_log_probs is not None:
            request.generated_top_n_logprobs = [
                {tokenizer.detokenize([tid]): lp for tid, lp in top} for top in result.top_log_probs[:keep]
            ]
        if result.prompt_log_probs is not None:  # one per prompt token after the first, as Megatron's
            request.prompt_log_probs = list(result.prompt_log_probs)
        if result.prompt_top_log_probs is not None and request.sampling_params.return_prompt_top_n_logprobs:
            request.prompt_top_n_logprobs = [
                {tokenizer.detokenize([tid]): lp for tid, lp in top} for top in result.prompt_top_log_probs
            ]
        request.add_event_finish()
    else:
        reason = failure or (result.reject_reason if result is not None else None) or "request failed"
        request.status = Status.FAILED
        error = ContextOverflowError(request_id, message=reason, is_transient=transient)
        if transient:
            request.add_event_error_transient(error)
        else:
            request.add_event_error_nontransient(error)
        request.add_event_fail()
    if REPLIES_ARE_RECORDS:
        return DynamicInferenceRequestRecord.from_request(request).serialize()
    return request.serialize()


def _reply_params(params: Dict[str, Any]):
    """The sampling parameters a reply carries: the request's, or Megatron's defaults where
    its class refuses them (the reply of a request refused for that reason)."""
    from megatron.core.inference.sampling_params import SamplingParams as MegatronSamplingParams

    try:
        return megatron_sampling_params(params)
    except RequestRefused:
        return MegatronSamplingParams()
