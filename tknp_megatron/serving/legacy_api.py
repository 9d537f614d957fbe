"""Megatron's legacy text-generation API, ``PUT /api``, on the same front end.

Megatron-LM's ``tools/run_text_generation_server.py`` serves its model with
``megatron.core.inference.text_generation_server.MegatronServer``, whose ``PUT /api`` takes
``{"prompts": [...], "tokens_to_generate": N, ...}`` and answers ``{"text": [...],
"tokens": [...], "logprobs": [...], "segments": [...]}`` per prompt (Megatron-LM's
``tools/text_generation_cli.py`` is its client). That server drives one engine in its own
process; here the route is one more blueprint of the front end (:mod:`.frontend`), whose
requests go to the pools through Megatron's ``InferenceClient`` like the completions'.

The body is checked as ``MegatronGenerate.put`` checks it, with its messages, and every
refusal is a 400 (Megatron answers some of them with status 200). Its values mean what they
mean there: ``temperature`` in ``(0, 100]`` (default 1.0: sampling; ``top_k`` 1 is greedy),
``top_k`` in ``[0, 1000]``, ``top_p`` in ``[0, 1]``, not both; ``logprobs`` returns every
token's log-prob after the first, the prompt's included (``len(prompt) - 1 + N`` values);
``tokens_to_generate`` 0 with ``logprobs`` scores the prompt alone; ``add_BOS`` puts the
tokenizer's BOS first. ``random_seed`` keys the draws (Megatron's path drops it). Fields
Megatron's engine path takes but never acts on (``top_p_decay``, ``top_p_bound``,
``stop_on_eol``, ``stop_on_double_eol``, ``prevent_newline_after_colon``) are refused when
set; ``stop_token``, ``length_penalty`` and ``no_log`` are taken and, as there, unused.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["MAX_PROMPTS", "legacy_blueprint", "legacy_problem"]

MAX_PROMPTS = 128  # MegatronGenerate's limit
_UNUSED_WHEN_SET = ("top_p_decay", "top_p_bound", "stop_on_eol", "stop_on_double_eol",
                    "prevent_newline_after_colon")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def legacy_problem(body: Any) -> Optional[str]:
    """Why ``body`` is not a request ``MegatronGenerate.put`` serves (its message), or None."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    if "prompts" not in body:
        return "prompts argument required"
    if "max_len" in body:
        return "max_len is no longer used.  Replace with tokens_to_generate"
    if "sentences" in body:
        return "sentences is no longer used.  Replace with prompts"
    if "beam_width" in body:
        return "Beam search is no longer supported."
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        return "prompts is not a list of strings"
    if not prompts:
        return "prompts is empty"
    if len(prompts) > MAX_PROMPTS:
        return f"Maximum number of prompts is {MAX_PROMPTS}"
    n = body.get("tokens_to_generate", 64)
    if not _is_int(n) or n < 0:
        return "tokens_to_generate must be an integer greater than or equal to 0"
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        return "logprobs must be a boolean value"
    if n == 0 and not logprobs:
        return "tokens_to_generate=0 implies logprobs should be True"
    temperature = body.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0.0 < temperature <= 100.0:
        return "temperature must be a positive number less than or equal to 100.0"
    top_k = body.get("top_k", 0)
    if not _is_int(top_k) or not 0 <= top_k <= 1000:
        return "top_k must be an integer equal to or greater than 0 and less than or equal to 1000"
    top_p = body.get("top_p", 0.0)
    if not isinstance(top_p, float) or not 0.0 <= top_p <= 1.0:
        return "top_p must be a positive float less than or equal to 1.0"
    if top_p > 0.0 and top_k > 0:
        return "cannot set both top-k and top-p samplings."
    for key in _UNUSED_WHEN_SET:
        if body.get(key):
            return f"{key} {body[key]!r}: not acted on by Megatron's engine path (leave it unset)"
    for key in ("add_BOS", "no_log"):
        if not isinstance(body.get(key, False), bool):
            return f"{key} must be a boolean value"
    if any(not p for p in prompts) and not body.get("add_BOS", False):
        return "Empty prompts require add_BOS=true"
    seed = body.get("random_seed", -1)
    if not _is_int(seed) or not -1 <= seed < 2**63:
        return "random_seed must be a non-negative 64-bit integer"
    if not _is_int(body.get("stop_token", 50256)):
        return "stop_token must be an integer"
    if not isinstance(body.get("length_penalty", 1.0), (int, float)) or isinstance(body.get("length_penalty"), bool):
        return "length_penalty must be a float"
    return None


def _sampling_params(body: Dict[str, Any]):
    """Megatron's ``SamplingParams`` of a checked body, one engine request per prompt."""
    from megatron.core.inference.sampling_params import SamplingParams

    logprobs = body.get("logprobs", False)
    return SamplingParams(
        temperature=float(body.get("temperature", 1.0)),
        top_k=body.get("top_k", 0),
        top_p=body.get("top_p", 0.0),
        return_log_probs=logprobs,
        skip_prompt_log_probs=not logprobs,  # the legacy answer's logprobs start at the prompt
        num_tokens_to_generate=max(1, body.get("tokens_to_generate", 64)),
    )


def _failure(reply) -> Optional[Tuple[str, bool]]:
    """``(reason, refused)`` of a megatron-core 0.17+ reply that FAILED (``refused``: for what
    it asks, non-transient), else None."""
    if not isinstance(reply, dict) or reply.get("status") != "FAILED":
        return None
    errors = [e for e in reply.get("events", []) if e.get("type") in ("ERROR_NONTRANSIENT", "ERROR_TRANSIENT")]
    payload = errors[-1].get("payload") if errors else None
    reason = payload.get("message") if isinstance(payload, dict) else payload
    return str(reason or "request failed"), any(e.get("type") == "ERROR_NONTRANSIENT" for e in errors)


def _fields(reply) -> Dict[str, Any]:
    """The generated tokens and log-probs of a completed reply: a 0.16 record (its request's
    attributes) or a 0.17+ serialized request (a dict; Megatron's own
    ``unwrap_serialized_tensors`` turns its tensors back into lists)."""
    if hasattr(reply, "requests"):
        request = reply.requests[-1]
        get = lambda name: getattr(request, name, None)  # noqa: E731
    else:
        from megatron.core.inference.inference_request import unwrap_serialized_tensors

        get = unwrap_serialized_tensors(reply).get

    def values(name) -> List:
        value = get(name)
        return [] if value is None else list(value.tolist() if hasattr(value, "tolist") else value)

    return dict(tokens=[int(t) for t in values("generated_tokens")], log_probs=values("generated_log_probs"),
                prompt_log_probs=values("prompt_log_probs"))


def legacy_blueprint(quart: bool):
    """The ``PUT /api`` route as a Flask (megatron-core 0.16) or Quart (0.17+) blueprint; it
    reads the app's ``client`` and ``tokenizer`` as Megatron's blueprints do."""
    if quart:
        from quart import Blueprint, current_app, g, jsonify, request
    else:
        from flask import Blueprint, current_app, g, jsonify, request

    from tknp_megatron.serving.megatron_types import RequestRefused, tokenize_prompt

    bp = Blueprint("tknp_legacy_api", __name__)

    @bp.route("/api", methods=["PUT"])
    async def generate():
        body = request.get_json(force=True, silent=True)
        if inspect.isawaitable(body):
            body = await body
        problem = legacy_problem(body)
        if problem:
            return jsonify(message=problem), 400
        client, tokenizer = current_app.config["client"], current_app.config["tokenizer"]
        try:
            prompts = [tokenize_prompt(tokenizer, p, body.get("add_BOS", False)) for p in body["prompts"]]
        except (RequestRefused, ValueError, TypeError, KeyError) as err:
            return jsonify(message=f"prompts: {err}"), 400
        if any(not ids for ids in prompts):
            return jsonify(message="a prompt has no tokens"), 400
        seed = body.get("random_seed", -1)
        requests = []
        for i, ids in enumerate(prompts):
            params = _sampling_params(body)
            if seed >= 0:  # the draws keyed by the seed and the prompt's index (frontend._add_seed)
                params.add_attributes(dict(seed=seed, seed_choice=i))
            requests.append(client.add_request(ids, params))
        replies = await asyncio.gather(*requests, return_exceptions=True)
        failures = []
        for i, reply in enumerate(replies):
            if isinstance(reply, BaseException):  # 0.16: FAILED raised (frontend._raise_if_failed)
                failures.append((f"prompt {i}: {reply}", bool(g.get("tknp_refused"))))
            elif (failed := _failure(reply)) is not None:
                failures.append((f"prompt {i}: {failed[0]}", failed[1]))
        if failures:
            return jsonify(message="; ".join(r for r, _ in failures)), 400 if any(f for _, f in failures) else 500
        keep = body.get("tokens_to_generate", 64)
        out: Dict[str, list] = {"text": [], "tokens": [], "segments": []}
        if body.get("logprobs", False):
            out["logprobs"] = []
        for ids, reply in zip(prompts, replies):
            got = _fields(reply)
            tokens = ids + got["tokens"][:keep]
            out["text"].append(tokenizer.detokenize(tokens))  # the prompt's text and what follows it
            out["tokens"].append(tokens)
            out["segments"].append([tokenizer.detokenize([t]) for t in tokens])
            if "logprobs" in out:
                out["logprobs"].append(got["prompt_log_probs"] + got["log_probs"][:keep])
        return jsonify(out)

    return bp
