"""Megatron-Core's own coordinator and HTTP front end, started on rank 0 for the pools.

Megatron's maintained server (``POST /v1/completions``, ``/v1/chat/completions``,
``GET /health``) talks over ZMQ to its ``DataParallelInferenceCoordinator``, which routes
each request to a registered engine (here: a pool, see
:mod:`tknp_megatron.serving.coordinator_link`). :class:`Frontend` starts both, as
Megatron's ``DynamicInferenceEngine.start_listening_to_data_parallel_coordinator`` and
its server launchers do:

- the coordinator: ``DataParallelInferenceCoordinator.entrypoint`` in a spawned process
  (arguments filtered to what the installed version takes);
- megatron-core 0.17 and later: ``start_text_gen_server`` (Quart + hypercorn);
- megatron-core 0.16: its Flask blueprints and ``InferenceClient`` served by hypercorn
  in a spawned process, as its ``run_flask_server`` does, with one addition: 0.16's
  completions endpoint answers a FAILED request with empty text and status 200, so the
  client handed to the blueprints raises the request's failure reason instead, which the
  endpoint returns as an error response (0.17 and later check the status themselves).
  A body that is not JSON or has an empty prompt is answered 400 before the blueprints.

The spawned processes die with rank 0 (Linux ``PR_SET_PDEATHSIG``), so a killed pool
leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing as mp
import socket
import time
import urllib.request
from typing import Any, Callable, Dict, Optional

from tknp_megatron.serving.megatron_types import REPLIES_ARE_RECORDS

__all__ = ["Frontend"]


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (no-op elsewhere)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _child(target: Callable, kwargs: Dict[str, Any]) -> None:
    _die_with_parent()
    target(**kwargs)


def _accepted(fn: Callable, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``kwargs`` that ``fn`` takes (Megatron's signatures differ between versions)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


class Frontend:
    """Megatron's coordinator (and, after :meth:`serve_http`, its HTTP server) on rank 0.

    Args:
        num_pools: engines the coordinator waits for (one per pool).
        tokenizer: Megatron's tokenizer interface, picklable.
        host: interface and host name for the coordinator and the HTTP server.
        coordinator_port: the coordinator's port (None: any free port).
        max_requests: requests in flight per pool (0.17+ uses it to balance load).
    """

    def __init__(self, num_pools: int, tokenizer, host: str, coordinator_port: Optional[int],
                 max_requests: int):
        from megatron.core.inference.data_parallel_inference_coordinator import (
            DataParallelInferenceCoordinator,
        )

        self.tokenizer, self.host = tokenizer, host
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._ready = ctx.Event()
        entry = DataParallelInferenceCoordinator.entrypoint
        kwargs = _accepted(entry, dict(
            pipe_connection=child, ready_event=self._ready, data_parallel_size=num_pools,
            tokenizer=tokenizer, inference_coordinator_port=coordinator_port,
            max_requests=max_requests, hostname=host,
        ))
        self._coordinator = ctx.Process(target=_child, args=(entry, kwargs), daemon=True)
        self._coordinator.start()
        if not parent.poll(120):
            raise RuntimeError("Megatron's coordinator did not report its address within 120 s")
        self.address: str = parent.recv()
        self._http: Optional[mp.process.BaseProcess] = None
        self.url: Optional[str] = None

    def wait_for_engines(self, timeout_s: float) -> None:
        """Block until every pool has registered (the coordinator then serves clients)."""
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"not every pool registered with the coordinator within {timeout_s:.0f} s")

    def serve_http(self, port: int, timeout_s: float = 120.0) -> str:
        """Start Megatron's HTTP server on ``port``; returns its URL once ``/health`` answers."""
        if REPLIES_ARE_RECORDS:
            ctx = mp.get_context("spawn")
            self._http = ctx.Process(target=_child, args=(_serve_flask, dict(
                address=self.address, tokenizer=self.tokenizer, host=self.host, port=port)), daemon=True)
            self._http.start()
        else:
            from megatron.core.inference.text_generation_server.dynamic_text_gen_server import (
                text_generation_server as server,
            )

            server.start_text_gen_server(**_accepted(server.start_text_gen_server, dict(
                coordinator_addr=self.address, tokenizer=self.tokenizer, rank=0, server_port=port,
                num_replicas=1, hostname=self.host)))
        self.url = f"http://{self.host}:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
                pass
            if self._http is not None and not self._http.is_alive():
                raise RuntimeError(f"Megatron's HTTP server exited with code {self._http.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Megatron's HTTP server did not answer {self.url}/health "
                                   f"within {timeout_s:.0f} s")
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop the HTTP server, then the coordinator (it holds no state of its own)."""
        if self._http is not None:
            self._http.kill()  # as below: Megatron's modules make SIGTERM dump tracebacks
            self._http.join(10)
        elif self.url is not None:
            from megatron.core.inference.text_generation_server.dynamic_text_gen_server import (
                text_generation_server as server,
            )

            server.stop_text_gen_server()
        self._coordinator.kill()  # Megatron's faulthandler would dump a traceback on SIGTERM
        self._coordinator.join(10)


# ---------------------------------------------------------------- megatron-core 0.16
class _FailedAsError:
    """The client handed to 0.16's blueprints: a FAILED request raises its reason."""

    def __init__(self, client):
        self._client = client

    def add_request(self, prompt, sampling_params):
        return _raise_if_failed(self._client.add_request(prompt, sampling_params))

    def __getattr__(self, name):
        return getattr(self._client, name)


async def _raise_if_failed(future):
    from megatron.core.inference.inference_request import DynamicInferenceEventType, Status

    record = await future
    for request in record.requests:
        if request.status == Status.FAILED:
            errors = [e.payload for e in request.events
                      if e.type == DynamicInferenceEventType.ERROR_NONTRANSIENT and e.payload]
            raise RuntimeError(errors[-1].message if errors else "request failed")
    return record


def _check_body():
    """400 for a body that is not a JSON object or has an empty prompt (0.16's endpoints
    would answer "Missing 'prompt' field" or an HTML page)."""
    from flask import request

    if request.method != "POST":
        return None
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        return "request body is not a JSON object", 400
    prompt = body.get("prompt", body.get("messages"))
    if prompt is not None and len(prompt) == 0:
        return "'prompt' is empty", 400
    return None


def _serve_flask(address: str, tokenizer, host: str, port: int) -> None:
    asyncio.run(_flask_main(address, tokenizer, host, port))


async def _flask_main(address: str, tokenizer, host: str, port: int) -> None:
    import warnings

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed")
    from flask import Flask
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    import megatron.core.inference.text_generation_server.dynamic_text_gen_server.endpoints as endpoints
    from megatron.core.inference.inference_client import InferenceClient

    client = InferenceClient(address)
    await client.start()
    app = Flask("tknp_megatron.serving")
    app.config["client"] = _FailedAsError(client)
    app.config["tokenizer"] = tokenizer
    app.before_request(_check_body)
    for blueprint in endpoints.__all__:
        app.register_blueprint(blueprint)
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    await serve(app, config)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
