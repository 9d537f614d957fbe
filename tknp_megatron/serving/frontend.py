"""Megatron-Core's own coordinator and HTTP front end, started on rank 0 for the pools.

Megatron's maintained server (``POST /v1/completions``, ``/v1/chat/completions``,
``GET /health``) talks over ZMQ to its ``DataParallelInferenceCoordinator``, which routes
each request to a registered engine (here: a pool, see
:mod:`tknp_megatron.serving.coordinator_link`). :class:`Frontend` starts both, as
Megatron's ``DynamicInferenceEngine.start_listening_to_data_parallel_coordinator`` and
its server launchers do:

- the coordinator: ``DataParallelInferenceCoordinator.entrypoint`` in a helper process
  (arguments filtered to what the installed version takes);
- the HTTP server: Megatron's endpoint blueprints and its ``InferenceClient`` in one app,
  built as Megatron's own launchers build it (Flask in megatron-core 0.16, Quart from
  0.17), served by hypercorn in helper processes: as many replicas of it as Megatron's
  own ``start_text_gen_server`` starts by default (one in 0.16, four from 0.17, each with
  its own client of the coordinator), all on one port (``SO_REUSEPORT``: the kernel
  spreads connections over them), so a burst of requests is parsed, tokenized and
  answered in parallel. Additions: a body the blueprints would fail on, or take and not
  act on, is answered 400 naming the field before them (:func:`_body_problem`); because
  0.16's completions endpoint answers a FAILED request with empty text and status 200, its
  client raises the request's failure reason instead, which the endpoint returns as an
  error response: 400 for a request refused for what it asks, 500 for one a stop or a
  failing pool ended, as 0.17 and later answer them (they check the status themselves);
  the body's ``stop`` reaches 0.16's requests as later versions pass it on, and its
  ``seed``, which every version drops, reaches each request with the choice's index
  (:func:`_add_seed`); 0.16's Flask app runs in :data:`HTTP_THREADS` worker threads;
  Megatron's legacy ``PUT /api`` is served as well (:mod:`.legacy_api`).

The helper processes are forks of one server process (:func:`helper_context`) that has
imported what they run once, so none of them imports Megatron-Core again (seconds of CPU
each). They die with rank 0 (the server exits when rank 0 does, and they with it: Linux
``PR_SET_PDEATHSIG``), so a killed pool leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import faulthandler
import importlib.util
import inspect
import math
import multiprocessing as mp
import signal
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from tknp_megatron.serving.coordinator_link import unbounded_queues
from tknp_megatron.serving.legacy_api import legacy_blueprint
from tknp_megatron.serving.megatron_types import REPLIES_ARE_RECORDS

GRACEFUL_S = 10.0  # how long a stopping HTTP server may take to answer the requests it holds
HTTP_THREADS = 2048
"""Worker threads of one HTTP process: with megatron-core 0.16's Flask app, the most requests
it holds at once (each open request keeps one until its reply; threads start as needed)."""
MAX_BODY_BYTES = 2**30  # a request body's limit (a batch of long token-id prompts is large)

__all__ = ["Frontend", "default_replicas", "helper_context"]

# What the helper processes run, imported by their server before it forks the first one
# (modules a megatron-core version lacks are skipped); the last entry freezes what they made.
HELPER_PRELOAD = (
    "tknp_megatron", "torch", "torch.distributed", "megatron.core.inference.data_parallel_inference_coordinator",
    "megatron.core.inference.inference_client",
    "megatron.core.inference.text_generation_server.dynamic_text_gen_server.endpoints",
    "hypercorn.asyncio", "hypercorn.config", "tknp_megatron.serving.frontend",
    "tknp_megatron.forkserver_heap",
)


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def helper_context():
    """The helper processes' multiprocessing context, its server started: a forkserver that
    imports :data:`HELPER_PRELOAD` once, then forks each helper (``spawn`` where there can be
    none: :func:`~tknp_megatron.launch.forkserver_context`). Rank 0 calls it before building
    its engine, so those imports run meanwhile. The server ignores SIGTERM and SIGINT, as the
    helpers do (see :func:`_child`), and exits when rank 0 does."""
    from multiprocessing import forkserver

    from tknp_megatron.launch import forkserver_context

    ctx = forkserver_context(HELPER_PRELOAD)
    if ctx.get_start_method() != "forkserver":
        return ctx
    # An ignored signal stays ignored across exec: launchers such as torchrun send SIGTERM
    # to the whole process group, and the helpers must outlive rank 0's orderly stop.
    # (The forkserver ignores SIGINT itself.)
    term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, term)
    return ctx


def _child(target: Callable, kwargs: Dict[str, Any]) -> None:
    """A helper process of rank 0. Rank 0 ends it after its orderly stop (so the last
    replies still reach their clients), or Linux does when rank 0 dies; so it ignores
    SIGTERM and SIGINT, which launchers such as torchrun send to the whole process group.
    Megatron's coordinator module registers stack dumps on both when first imported."""
    _die_with_parent()
    import megatron.core.inference.data_parallel_inference_coordinator  # noqa: F401

    for sig in (signal.SIGTERM, signal.SIGINT):
        faulthandler.unregister(sig)
        signal.signal(sig, signal.SIG_IGN)
    target(**kwargs)


def _run_coordinator(**kwargs) -> None:
    """Megatron's ``DataParallelInferenceCoordinator.entrypoint`` (in a helper process),
    with :func:`unbounded_queues` on its ROUTER socket, set as soon as it is made, before
    its address reaches any pool."""
    from megatron.core.inference.data_parallel_inference_coordinator import (
        DataParallelInferenceCoordinator,
    )

    class UnboundedCoordinator(DataParallelInferenceCoordinator):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            unbounded_queues(self.router_socket)

    UnboundedCoordinator.entrypoint(**kwargs)


def _accepted(fn: Callable, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``kwargs`` that ``fn`` takes (Megatron's signatures differ between versions)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


class Frontend:
    """Megatron's coordinator (and, after :meth:`serve_http`, its HTTP server) on rank 0.

    Args:
        num_pools: engines the coordinator waits for (one per pool).
        tokenizer: Megatron's tokenizer interface, picklable.
        host: interface of the HTTP server. The coordinator binds where Megatron's own
            does by default, to this machine's host name, so pools on other hosts reach it.
        coordinator_port: the coordinator's port (None: any free port).
        max_requests: requests in flight per pool (0.17+ uses it to balance load).
    """

    def __init__(self, num_pools: int, tokenizer, host: str, coordinator_port: Optional[int],
                 max_requests: int):
        from megatron.core.inference.data_parallel_inference_coordinator import (
            DataParallelInferenceCoordinator,
        )

        self.tokenizer, self.host = tokenizer, host
        ctx = helper_context()
        parent, child = ctx.Pipe()
        self._ready = ctx.Event()
        kwargs = _accepted(DataParallelInferenceCoordinator.entrypoint, dict(
            pipe_connection=child, ready_event=self._ready, data_parallel_size=num_pools,
            tokenizer=tokenizer, inference_coordinator_port=coordinator_port,
            max_requests=max_requests,
        ))
        self._coordinator = ctx.Process(target=_child, args=(_run_coordinator, kwargs), daemon=True)
        self._coordinator.start()
        if not parent.poll(120):
            raise RuntimeError("Megatron's coordinator did not report its address within 120 s")
        self.address: str = parent.recv()
        self._http: List[mp.process.BaseProcess] = []
        self.url: Optional[str] = None

    def wait_for_engines(self, timeout_s: float) -> None:
        """Block until every pool has registered (the coordinator then serves clients)."""
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"not every pool registered with the coordinator within {timeout_s:.0f} s")

    def serve_http(self, port: int, replicas: Optional[int] = None, timeout_s: float = 120.0) -> str:
        """Start Megatron's HTTP server on ``port`` (``replicas`` processes; None: as many
        as the installed megatron-core's own launcher starts); returns its URL once every
        replica listens and ``/health`` answers."""
        ctx = helper_context()
        self._http_stop = ctx.Event()
        listening = [ctx.Event() for _ in range(replicas or default_replicas())]
        self._http = [ctx.Process(target=_child, args=(_serve_http, dict(
            address=self.address, tokenizer=self.tokenizer, host=self.host, port=port,
            stop=self._http_stop, listening=event, shared=len(listening) > 1)), daemon=True)
            for event in listening]
        for proc in self._http:
            proc.start()
        self.url = f"http://{self.host}:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            if all(event.is_set() for event in listening):
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                        if r.status == 200:
                            return self.url
                except OSError:
                    pass
            dead = [p.exitcode for p in self._http if not p.is_alive()]
            if dead:
                raise RuntimeError(f"Megatron's HTTP server exited with code {dead[0]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Megatron's HTTP server did not answer {self.url}/health "
                                   f"within {timeout_s:.0f} s")
            time.sleep(0.2)

    @property
    def http_pids(self) -> List[int]:
        """The HTTP server's processes."""
        return [p.pid for p in self._http]

    def stop(self) -> None:
        """Stop the HTTP server, letting it finish the requests it holds (their replies are
        on their way through the coordinator) for up to ``GRACEFUL_S``, then the
        coordinator (it holds no state of its own)."""
        if self._http:
            self._http_stop.set()
            deadline = time.monotonic() + GRACEFUL_S + 5
            for proc in self._http:
                proc.join(max(0.0, deadline - time.monotonic()))
            for proc in self._http:
                if proc.is_alive():
                    proc.kill()  # it ignores SIGTERM (see _child)
                    proc.join(10)
        self._coordinator.kill()
        self._coordinator.join(10)


def default_replicas() -> int:
    """HTTP processes Megatron's own ``start_text_gen_server`` starts by default: its
    ``num_replicas`` (4 from megatron-core 0.17), 1 where it has none (0.16)."""
    try:
        from megatron.core.inference.text_generation_server.dynamic_text_gen_server import (
            text_generation_server,
        )
    except ImportError:  # 0.16: flask_server.py, one process
        return 1
    param = inspect.signature(text_generation_server.start_text_gen_server).parameters.get("num_replicas")
    return param.default if param is not None and isinstance(param.default, int) else 1


# ---------------------------------------------------------------- the HTTP process
class _FailedAsError:
    """megatron-core 0.16's client for its blueprints: a FAILED request raises its reason,
    a request is registered before it is sent, and a chat request asks for no prompt
    log-probs (its endpoint never returns them, and a decode pool does not compute them).

    0.16 serves its blueprints with Flask, so hypercorn runs each handler, and its
    ``add_request``, in a worker thread, while the client's reply listener runs on the main
    event loop. ``InferenceClient.add_request`` sends first and then records the request's
    future and submission time: a reply that arrives in between finds no entry and kills the
    listener (``KeyError`` in ``_recv_task``; every later request gets no reply). Here the
    entries are made first, and the message is sent by the listener's own thread (the main
    loop, between its receives): a ZMQ socket is not thread-safe, and a send from a worker
    thread racing the listener's receive on the same socket can lose a message, and with it
    a request that then never ends.
    """

    def __init__(self, client):
        self._client = client
        self._lock = threading.Lock()

    def add_request(self, prompt, sampling_params):
        import msgpack
        from megatron.core.inference.headers import Headers

        from flask import has_request_context, request

        client = self._client
        if not client.running.is_set():
            raise RuntimeError("InferenceClient is not currently running.")
        if has_request_context() and request.path.rstrip("/").endswith("chat/completions"):
            # the chat endpoint returns the generated tokens' log-probs only, but leaves
            # skip_prompt_log_probs at False, which asks for the prompt's as well
            sampling_params.add_attributes(dict(return_prompt_top_n_logprobs=False,
                                                skip_prompt_log_probs=True))
        if has_request_context():
            from flask import g

            body = request.get_json(silent=True) or {}
            stop = body.get("stop")
            if stop and not sampling_params.stop_words:  # 0.16's endpoints drop it; 0.17+ pass it on
                sampling_params.add_attributes(dict(stop_words=[stop] if isinstance(stop, str) else list(stop)))
            _add_seed(sampling_params, body, g)
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            request_id = client.next_request_id
            # packed before anything is recorded: a value msgpack cannot carry raises here
            # and leaves no entry that no reply would ever clear
            message = msgpack.packb([Headers.SUBMIT_REQUEST.value, request_id, prompt,
                                     sampling_params.serialize()], use_bin_type=True)
            client.next_request_id += 1
            client.completion_futures[request_id] = future
            client.request_submission_times[request_id] = time.perf_counter()
            client._loop.call_soon_threadsafe(client.socket.send, message)  # in order: FIFO
        return _raise_if_failed(future)

    def __getattr__(self, name):
        return getattr(self._client, name)


def _add_seed(sampling_params, body: dict, g) -> None:
    """The body's ``seed``, which Megatron's endpoints drop (its ``SamplingParams`` has no such
    field), onto the request's ``SamplingParams`` with the index of the choice among the
    request's (counted on the HTTP request's ``g``): the pool keys the draws' noise by the two,
    so a seeded request draws what it drew before, and a chat request's ``n`` choices draw
    apart (:func:`~tknp_megatron.serving.megatron_types.to_engine_request`)."""
    seed = body.get("seed")
    if seed is None:
        return
    choice = g.get("tknp_choices", 0)
    g.tknp_choices = choice + 1
    sampling_params.add_attributes(dict(seed=seed, seed_choice=choice))


class _Seeded:
    """megatron-core 0.17 and later's client for their blueprints: each request with the
    body's seed (:func:`_add_seed`; the endpoints report failures themselves)."""

    def __init__(self, client):
        self._client = client

    def add_request(self, prompt, sampling_params, *args, **kwargs):
        from quart import g, has_request_context

        if has_request_context():
            _add_seed(sampling_params, g.get("tknp_body") or {}, g)
        return self._client.add_request(prompt, sampling_params, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


async def _raise_if_failed(future):
    """The request's record once it ends; if it failed, ``RuntimeError`` with the pool's
    reason, and where the failure is non-transient (refused for what the request asks, so
    it would be refused again; not a stop or a failing pool) the request's Flask context
    notes that for :func:`_status_of_failures`."""
    from megatron.core.inference.inference_request import DynamicInferenceEventType, Status

    record = await future
    errors = (DynamicInferenceEventType.ERROR_NONTRANSIENT, DynamicInferenceEventType.ERROR_TRANSIENT)
    for request in record.requests:
        if request.status == Status.FAILED:
            events = [e for e in request.events if e.type in errors and e.payload]
            refused = any(e.type == DynamicInferenceEventType.ERROR_NONTRANSIENT for e in events)
            if refused:
                from flask import g, has_app_context

                if has_app_context():
                    g.tknp_refused = True
            raise RuntimeError(events[-1].payload.message if events else "request failed")
    return record


def _status_of_failures(response):
    """megatron-core 0.16's endpoints answer a request whose inference raised with 500; for
    one the pools refused for what it asks, 400, as 0.17 and later answer a request FAILED
    with a non-transient error; and for one whose prompt or messages the tokenizer refused,
    400 (Flask ``after_request``)."""
    from flask import g

    if response.status_code == 500 and (g.get("tknp_refused") or _tokenizer_failure(response.get_data())):
        response.status_code = 400
    return response


def _tokenizer_failure(body: bytes) -> bool:
    """Whether a 500's body is Megatron's endpoint saying the tokenizer raised on the prompt or
    on the chat messages (:data:`_TOKENIZER_FAILURES`)."""
    return body.decode("utf-8", "replace").startswith(_TOKENIZER_FAILURES)


_INT64 = 2**63
MAX_CHOICES = 128
"""Most choices (``n``) one request may ask for: OpenAI's API limit. Megatron's chat endpoint
submits one engine request per choice, so an unbounded ``n`` lets a body of a few bytes queue
millions of requests in the front end."""

_NUMBER_RULES = {  # field -> (integer?, lowest, highest or None, the rule in words)
    "max_tokens": (True, 1, None, "at least 1"),
    "temperature": (False, 0, None, "finite and >= 0"),
    "top_p": (False, 0, 1, "in [0, 1] (0 is off)"),
    "top_k": (True, 0, None, ">= 0 (0 is off)"),
    "n": (True, 1, MAX_CHOICES, f"in [1, {MAX_CHOICES}]"),
    "logprobs": (True, 0, "vocab", "in [0, the vocabulary {vocab}]"),
    "top_logprobs": (True, 0, "vocab", "in [0, the vocabulary {vocab}]"),
    "seed": (True, -_INT64, _INT64 - 1, "a 64-bit integer"),
}
"""The numeric fields Megatron's completion endpoints convert with ``int()`` / ``float()``,
and the values a request can carry to the pools. Chat's ``logprobs`` is a boolean."""

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
COMPLETION_ROUTES = ("/completions", "/v1/completions", "/v1/chat/completions", "/chat/completions")
_TOKENIZER_FAILURES = ("Error tokenizing prompt", "Error processing 'messages'")
"""How Megatron's endpoints begin the 500 they answer when the tokenizer raises on a prompt
or on chat messages: the request's fault, answered 400 here (:func:`_status_of_failures`)."""


@dataclass(frozen=True)
class BodyRules:
    """What a completion request's body may hold on this server (:func:`_body_problem`)."""

    vocab: int
    """Token ids lie in ``[0, vocab)``."""
    text_is_ids: bool = False
    """The tokenizer is Megatron's null tokenizer: a text prompt is token ids separated by
    single spaces (it parses them with ``int()``)."""
    streams: bool = False
    """The installed endpoints answer ``"stream": true`` with a stream (not 0.16-0.19)."""


def _shown(value) -> str:
    """A value as a one-line message shows it: a long one by its head and its length."""
    text = repr(value)
    if isinstance(value, int):
        return _digits(text)
    return text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"


def _digits(number: str) -> str:
    """A number's digits as a message shows them: over 40, the first 12 and how many."""
    return number if len(number) <= 40 else f"{number[:12]}... ({len(number)} digits)"


def _number_problem(field: str, value, vocab: int) -> Optional[str]:
    integer, low, high, rule = _NUMBER_RULES[field]
    if value is None:
        return f"'{field}' is null: give a number or leave the field out"
    if isinstance(value, bool):
        if field == "logprobs":  # chat: on or off
            return None
        return f"'{field}' {value}: expected a number, got a boolean"
    if not isinstance(value, (int, float)):
        return f"'{field}' {value!r}: expected a number, got {type(value).__name__}"
    high = vocab if high == "vocab" else high
    try:
        real = float(value)
    except OverflowError:  # an integer beyond any float: JSON allows any number of digits
        real = math.inf if value > 0 else -math.inf
    if integer and (isinstance(value, int) or math.isfinite(real)) and not -_INT64 <= value < _INT64:
        return f"'{field}' {_shown(value)}: outside the 64-bit integer range"
    if integer and math.isfinite(real) and value != int(value):
        return f"'{field}' {value}: must be a whole number"
    if not math.isfinite(real) or real < low or (high is not None and real > high):
        return f"'{field}' {_shown(value)}: must be {rule.format(vocab=vocab)}"
    return None


def _text_problem(key: str, text: str, ids_below: Optional[int] = None) -> Optional[str]:
    """Text no tokenizer can take: not Unicode (a lone surrogate, which JSON's escapes can
    carry); with ``ids_below`` (Megatron's null tokenizer), not token ids below it separated
    by single spaces."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"'{key}': not valid Unicode ({err.reason} at character {err.start})"
    if ids_below is not None:
        for word in text.split(" "):
            if not (word.isascii() and word.isdigit()):
                return (f"'{key}' {_shown(text)}: {_shown(word)} is not a token id; Megatron's null "
                        f"tokenizer takes ids in [0, {ids_below}) separated by single spaces")
            if len(word) > 18 or int(word) >= ids_below:  # int() refuses over 4300 digits
                return f"'{key}': token id {_digits(word)} outside the vocabulary [0, {ids_below})"
    return None


def _messages_problem(messages: list) -> Optional[str]:
    """Chat messages a chat template cannot render as asked: each an object with a known
    ``role`` and text ``content`` (absent or null only beside an assistant's tool calls)."""
    for i, message in enumerate(messages):
        where = f"'messages'[{i}]"
        if not isinstance(message, dict):
            return f"{where} {_shown(message)}: expected an object with 'role' and 'content'"
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            return f"{where}.role {_shown(role)}: must be one of {', '.join(CHAT_ROLES)}"
        if content is None and message.get("tool_calls"):
            continue
        if not isinstance(content, str):
            kind = "a list of content parts" if isinstance(content, list) else type(content).__name__
            return f"{where}.content: expected text, got {kind}"
    return None


def _body_problem(method: str, body, rules: BodyRules, path: str = "/v1/completions") -> Optional[tuple]:
    """400, naming the field and the value, for a completion request's body that Megatron's
    endpoints would answer with a bare 500 or a generic page, would take but ignore, or
    whose values the request cannot carry to the pools: not a JSON object; a prompt (or chat
    messages) empty or neither text nor a list; text no tokenizer takes
    (:func:`_text_problem`); a prompt's token id outside the vocabulary (the endpoint
    detokenizes the ids first, and a Hugging Face tokenizer fails on one beyond 32 bits
    without naming it); chat messages a template cannot render (:func:`_messages_problem`);
    a numeric field that is null, not a number, or outside what the request takes
    (:data:`_NUMBER_RULES`); ``stop`` that is not text or a list of texts; ``n`` above 1 on
    the completions route (Megatron's completions endpoint gives one choice per prompt);
    ``stream`` where the endpoints cannot stream. ``max_tokens`` 0 is taken with ``echo``
    and ``logprobs`` (the prompt scored alone, as OpenAI's API takes it). Other routes
    (``/health``, an unknown path) are left to the app, which answers them itself (404, 405)."""
    route = path.rstrip("/")
    if method != "POST" or route not in COMPLETION_ROUTES:
        return None
    if not isinstance(body, dict):
        return "request body is not a JSON object", 400
    chat = route.endswith("chat/completions")
    key = "messages" if chat else "prompt"
    prompt = body.get(key)
    if prompt is not None:
        if not isinstance(prompt, (str, list)) or chat and not isinstance(prompt, list):
            expected = "a list of messages" if chat else "text or a list"
            return f"'{key}' {_shown(prompt)}: expected {expected}, got {type(prompt).__name__}", 400
        if len(prompt) == 0:
            return f"'{key}' is empty", 400
        if chat:
            problem = _messages_problem(prompt) or next(filter(None, (
                _text_problem(key, m["content"]) for m in prompt if isinstance(m.get("content"), str))), None)
        elif isinstance(prompt, str) or all(isinstance(p, str) for p in prompt):
            ids_below = rules.vocab if rules.text_is_ids else None
            problem = next(filter(None, (_text_problem(key, t, ids_below)
                                         for t in ([prompt] if isinstance(prompt, str) else prompt))), None)
        else:  # token ids, or lists of them (a batch of prompts)
            ids = [t for item in prompt for t in (item if isinstance(item, list) else [item])
                   if isinstance(t, int) and not isinstance(t, bool)]
            bad = next((t for t in ids if not 0 <= t < rules.vocab), None)
            problem = None if bad is None else f"'{key}': token id {_shown(bad)} outside the vocabulary [0, {rules.vocab})"
        if problem:
            return problem, 400
    scored = (not chat and body.get("echo") is True and body.get("logprobs") is not None
              and type(body.get("max_tokens")) is int and body["max_tokens"] == 0)  # the prompt scored alone
    for field in _NUMBER_RULES:
        if field in body and not (scored and field == "max_tokens"):
            problem = _number_problem(field, body[field], rules.vocab)
            if problem:
                return problem, 400
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or isinstance(stop, list) and all(
            isinstance(s, str) for s in stop)):
        return f"'stop' {_shown(stop)}: expected text or a list of texts", 400
    if not chat and body.get("n", 1) > 1:
        return (f"'n' {body['n']}: Megatron's completions endpoint gives one choice per prompt; repeat the "
                "prompt in a list, or ask /v1/chat/completions, which takes n"), 400
    if body.get("stream") and not rules.streams:
        return ("'stream' true: this megatron-core's endpoints answer in one response, not as a stream; "
                "leave it out or false"), 400
    return None


def _serve_http(address: str, tokenizer, host: str, port: int, stop, listening, shared: bool) -> None:
    asyncio.run(_http_main(address, tokenizer, host, port, stop, listening, shared))


def _listen(host: str, port: int, shared: bool) -> socket.socket:
    """A listening socket on ``host:port``; ``shared``: other replicas bind it too
    (``SO_REUSEPORT``; a lone replica does not, so a port in use fails loudly)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2**14)
    return sock


async def _http_main(address: str, tokenizer, host: str, port: int, stop, listening,
                     shared: bool) -> None:
    """One replica: Megatron's blueprints and ``InferenceClient`` in one app, as its own
    launchers build it: Flask for megatron-core 0.16 (``run_flask_server``), Quart from
    0.17 (``_run_text_gen_server``), served by hypercorn until ``stop`` (an event) is set;
    then hypercorn finishes the requests it holds (up to ``GRACEFUL_S``) and exits.
    ``listening`` is set once its socket takes connections (they queue until served)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed")
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    import megatron.core.inference.text_generation_server.dynamic_text_gen_server.endpoints as endpoints
    from megatron.core.inference.inference_client import InferenceClient

    from tknp_megatron.models.tokenizer import Tokenizer

    loop = asyncio.get_running_loop()
    # 0.16's Flask app runs in hypercorn's worker threads (the loop's default executor), each
    # request's handler holding one until its reply: asyncio's default of min(32, CPUs + 4)
    # threads would cap the requests in flight there, and queue /health behind them
    loop.set_default_executor(ThreadPoolExecutor(HTTP_THREADS, thread_name_prefix="http"))
    rules = BodyRules(tokenizer.vocab_size, text_is_ids=not isinstance(tokenizer, Tokenizer),
                      streams=importlib.util.find_spec(f"{endpoints.__name__.rsplit('.', 1)[0]}.openai_streaming")
                      is not None)
    client = InferenceClient(address)
    unbounded_queues(client.socket)
    started = client.start()
    if inspect.isawaitable(started):  # async in 0.16
        await started
    if REPLIES_ARE_RECORDS:
        from flask import Flask, request

        app = Flask("tknp_megatron.serving")
        app.config["client"] = _FailedAsError(client)
        app.before_request(lambda: _body_problem(request.method, request.get_json(silent=True),
                                                 rules, request.path))
        app.after_request(_status_of_failures)
    else:
        from quart import Quart, request

        app = Quart("tknp_megatron.serving")
        app.config["client"] = _Seeded(client)  # 0.17+ endpoints report FAILED requests themselves
        app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
        app.config["parsers"], app.config["verbose"] = None, False

        @app.before_request
        async def _check():
            from quart import g

            g.tknp_body = body = await request.get_json(force=True, silent=True)
            return _body_problem(request.method, body, rules, request.path)

        @app.after_request
        async def _tokenizer_failures(response):  # see _status_of_failures
            if response.status_code == 500 and _tokenizer_failure(await response.get_data()):
                response.status_code = 400
            return response
    app.config["tokenizer"] = tokenizer
    for blueprint in endpoints.__all__:
        app.register_blueprint(blueprint)
    app.register_blueprint(legacy_blueprint(quart=not REPLIES_ARE_RECORDS))  # PUT /api
    sock = _listen(host, port, shared)
    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.keep_alive_timeout = 30.0
    config.backlog = 2**14
    config.accesslog = None
    config.graceful_timeout = GRACEFUL_S
    config.wsgi_max_body_size = MAX_BODY_BYTES  # the Flask app's (0.16) limit, as Quart's

    stopping = asyncio.Event()  # set from a thread of its own, not one of the handlers' threads
    threading.Thread(target=lambda: (stop.wait(), loop.call_soon_threadsafe(stopping.set)),
                     name="http-stop", daemon=True).start()

    async def stopped():  # no signal handlers (see _child): the parent sets the event
        await stopping.wait()
        # Shut down once no request still awaits its reply from the coordinator (the pool
        # has sent them all by now), so every handler answers before hypercorn stops it.
        deadline = time.monotonic() + GRACEFUL_S
        while client.completion_futures and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    listening.set()
    await serve(app, config, shutdown_trigger=stopped)
