"""A long-running TKNP pool behind Megatron-Core's coordinator (the pool's coordinator rank).

:meth:`PoolServer.run` is the engine loop Megatron's ``DynamicInferenceEngine`` runs under
its coordinator, for a pool: take what the coordinator sent (requests, control headers),
step the pool while it has work, reply with every request that ended. The other ranks of
the pool follow from :meth:`~tknp_megatron.engine.base.InferenceEngine.serve` as in any run.

- Requests arrive while others decode: each loop turn drains the link without waiting
  when the pool is busy.
- An idle pool waits on the link for at most ``idle_tick_s`` and then broadcasts an idle
  plan, so no rank's wait for the next step ever reaches the collective timeout.
- Every request ends with a reply: COMPLETED, or FAILED with the reason: refused at once or
  rejected by the engine for what it asks (a non-transient error: Megatron's endpoints
  answer 400), or ended by a stop or a pool failure (transient: 500).
- PAUSE stops stepping (requests are kept, new ones queue) until UNPAUSE; STOP, or
  ``should_stop()`` (a signal), ends the remaining requests and stops the pool's ranks;
  requests that still arrive afterwards are refused with the reason until the link has
  been quiet for two seconds (the front end may still hold some it had queued).
  SUSPEND / RESUME (Megatron's GPU-memory offload) change nothing here.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from tknp_megatron.engine.base import freeze_heap
from tknp_megatron.engine.engine import LockstepEngine
from tknp_megatron.engine.request import RequestStatus
from tknp_megatron.serving.coordinator_link import CoordinatorLink, Message
from tknp_megatron.serving.megatron_types import RequestRefused, reply_item, to_engine_request

__all__ = ["PoolServer", "ServeSummary"]


@dataclass(frozen=True)
class ServeSummary:
    """What one pool did while it served."""

    pool: int
    completed: int
    failed: int
    steps: int
    stopped_by: str
    host_ms: float = 0.0  # per step: the engine's host work (plan, launch, book)
    wait_ms: float = 0.0  # per step: the engine's wait for the GPU's tokens
    server_ms: float = 0.0  # per step: this loop's own work (messages in, replies out)
    graph_steps: int = 0  # steps on the graph path (replayed from CUDA graphs on a GPU; the rest eager)
    graph_captures: int = 0  # CUDA graphs captured while serving (none once captured at start)


class PoolServer:
    """The engine loop of one pool's coordinator rank.

    Args:
        engine: the pool's engine (this rank is its coordinator); a lockstep engine, whose
            idle plan keeps the other ranks' waits short.
        link: connection to Megatron's coordinator.
        tokenizer: Megatron's tokenizer interface (text prompts, stop words, top-n text).
        max_sequence_length: the longest request served (the engine's limit; Megatron's
            default output length).
        idle_tick_s: longest wait without a collective when idle.
        should_stop: polled every loop turn; True stops the pool (e.g. after SIGTERM).
    """

    def __init__(self, engine: LockstepEngine, link: CoordinatorLink, tokenizer,
                 max_sequence_length: int, idle_tick_s: float = 1.0,
                 should_stop: Callable[[], bool] = lambda: False, step_log: Optional[str] = None):
        self.engine, self.link, self.tokenizer = engine, link, tokenizer
        self.max_sequence_length, self.idle_tick_s, self.should_stop = (
            max_sequence_length, idle_tick_s, should_stop)
        self.step_log = step_log
        self._events: List[tuple] = []  # with step_log: (kind, perf_counter time, ...)
        self._gc_start = 0.0
        self.paused = False
        self._stop_by = ""
        self._open: Dict[int, Tuple[tuple, dict]] = {}  # id -> (prompt, Megatron params)
        self._completed = self._failed = self._steps = 0

    # ------------------------------------------------------------------ the loop
    def run(self) -> ServeSummary:
        """Serve until STOP or ``should_stop()``; re-raises a pool failure after replying
        FAILED to every open request."""
        engine = self.engine
        if engine.config.freeze_gc:  # again: the server's own set-up since the engine froze its heap
            freeze_heap()
        last_collective = time.monotonic()
        engine.loop_timing.clear()
        replays0, captures0 = self._graph_counts()
        server_s = 0.0  # busy turns' time outside engine.step
        if self.step_log:
            gc.callbacks.append(self._log_gc)
        try:
            while True:
                busy = not self.paused and engine.has_unfinished_requests()
                turn = time.perf_counter()
                for message in self.link.receive(0 if busy else int(self.idle_tick_s * 1000)):
                    self._handle(message)
                if not self._stop_by and self.should_stop():
                    self._stop_by = "signal"
                if self._stop_by:
                    break
                if not self.paused and engine.has_unfinished_requests():
                    replays, stepped = self._graph_counts()[0], time.perf_counter()
                    finished = engine.step()
                    done = time.perf_counter()
                    if self.step_log:
                        self._log_step(stepped, done, self._graph_counts()[0] > replays)
                    self._reply(finished)
                    server_s += (stepped - turn if busy else 0.0) + time.perf_counter() - done
                    self._steps += 1
                    last_collective = time.monotonic()
                elif time.monotonic() - last_collective >= self.idle_tick_s:
                    engine.idle()
                    last_collective = time.monotonic()
        except Exception as err:
            reason = f"pool {self.link.dp_rank} failed: {type(err).__name__}: {err}"
            self._end_open(reason)
            self._refuse_late_arrivals(reason)
            raise
        finally:
            if self._log_gc in gc.callbacks:
                gc.callbacks.remove(self._log_gc)
        reason = f"the server stopped ({self._stop_by}) before the request finished"
        self._end_open(reason)
        engine.shutdown()
        self._refuse_late_arrivals(reason)
        host_ms, wait_ms = engine.loop_timing.per_step_ms()
        replays, captures = self._graph_counts()
        summary = ServeSummary(self.link.dp_rank, self._completed, self._failed, self._steps, self._stop_by,
                               host_ms, wait_ms, 1e3 * server_s / max(1, self._steps),
                               replays - replays0, captures - captures0)
        self._write_step_log(summary)
        return summary

    def _graph_counts(self) -> Tuple[int, int]:
        """(steps run through the graph path, graphs captured) so far (0, 0 without graphs)."""
        graphs = getattr(self.engine.executor, "graphs", None)
        return (graphs.replays, graphs.captures) if graphs is not None else (0, 0)

    # ------------------------------------------------------------------ messages
    def _handle(self, message: Message) -> None:
        name = message.header
        if name == "SUBMIT_REQUEST":
            self._submit(*message.fields)
        elif name == "PAUSE":
            self.paused = True
            if self.link.has_header("PAUSE_ACK"):  # megatron-core 0.16 waits for it
                self.link.send("PAUSE_ACK")
        elif name == "UNPAUSE":
            self.paused = False
        elif name == "STOP":
            if self.link.has_header("STOP_ACK"):
                self.link.send("STOP_ACK")
            self._stop_by = "STOP"
        # PAUSE_ACK / STOP_ACK (0.16 relays them back), SUSPEND / RESUME, generation
        # epochs and profiler marks need nothing from a pool.

    def _submit(self, request_id: int, prompt, params: dict) -> None:
        if self.step_log:
            self._events.append(("arrive", time.perf_counter()))
        try:
            req = to_engine_request(prompt, params, self.tokenizer, self.max_sequence_length)
            self.engine.add_request(req.prompt, req.params, request_id=request_id)
        except RequestRefused as err:
            self._fail(request_id, prompt, params, str(err))
            return
        except Exception as err:  # a value no check foresaw: this request fails, the pool serves on
            self._fail(request_id, prompt, params, f"not accepted ({type(err).__name__}: {err})")
            return
        self._open[request_id] = (req.prompt, params)
        if self.engine.requests[request_id].status is RequestStatus.REJECTED:
            self._reply([request_id])

    def _fail(self, request_id: int, prompt, params: dict, reason: str) -> None:
        """Answer a request the engine never took FAILED with ``reason``."""
        self._send([reply_item(request_id, prompt, params, self.tokenizer,
                               failure=f"request {request_id}: {reason}")])

    def _reply(self, request_ids: List[int], transient: bool = False) -> None:
        """Reply with ended requests and forget them (a server runs indefinitely);
        ``transient``: those that failed were ended by the server, not for what they ask."""
        items = []
        for rid in request_ids:
            prompt, params = self._open.pop(rid)
            try:
                items.append(reply_item(rid, prompt, params, self.tokenizer, self.engine.result(rid),
                                        transient=transient))
            except Exception as err:  # a reply no check foresaw: it fails alone, the pool serves on
                items.append(reply_item(rid, prompt, params, self.tokenizer, transient=True,
                                        failure=f"request {rid}: its reply could not be built "
                                                f"({type(err).__name__}: {err})"))
            self.engine.forget(rid)
        self._send(items)

    def _send(self, items: list) -> None:
        if self.step_log and items:
            self._events.append(("reply", time.perf_counter(), len(items)))
        for item in items:
            status = item["requests"][0]["status"] if "requests" in item else item["status"]
            if status == "COMPLETED":
                self._completed += 1
            else:
                self._failed += 1
        self.link.reply(items)

    # ------------------------------------------------------------------ step log
    def _log_step(self, start: float, end: float, graph: bool) -> None:
        """One call of ``engine.step``: its start and end (perf_counter, comparable across
        this host's processes), and the step it queued: its batch, the requests it admits,
        whether a CUDA graph runs it."""
        plan = self.engine.queued_plan
        self._events.append(("step", start, end, plan.num_requests if plan else 0,
                             len(plan.admissions) if plan else 0, graph))

    def _log_gc(self, phase: str, info: dict) -> None:
        """``gc.callbacks`` hook: each collection's start and end and its generation."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._events.append(("gc", self._gc_start, time.perf_counter(), info["generation"]))

    def _write_step_log(self, summary: ServeSummary) -> None:
        """The events as JSON lines (``step_log``), then the summary, once the pool stopped."""
        if not self.step_log:
            return
        names = {"arrive": ("t",), "reply": ("t", "requests"),
                 "step": ("start", "end", "batch", "admitted", "graph"),
                 "gc": ("start", "end", "generation")}
        with open(self.step_log, "w") as f:
            for kind, *values in self._events:
                f.write(json.dumps(dict(kind=kind, **dict(zip(names[kind], values)))) + "\n")
            f.write(json.dumps(dict(kind="summary", **dataclasses.asdict(summary))) + "\n")

    def _refuse_late_arrivals(self, reason: str, quiet_s: float = 2.0, limit_s: float = 30.0) -> None:
        """After the pool stopped: answer every request still arriving FAILED with
        ``reason`` (the front end may still be handing over requests it had queued) until
        none has come for ``quiet_s``."""
        start = last = time.monotonic()
        while time.monotonic() - last < quiet_s and time.monotonic() - start < limit_s:
            for message in self.link.receive(200):
                last = time.monotonic()
                if message.header == "SUBMIT_REQUEST":
                    request_id, prompt, params = message.fields
                    self._send([reply_item(request_id, prompt, params, self.tokenizer, transient=True,
                                           failure=f"request {request_id}: {reason}")])

    def _end_open(self, reason: str) -> None:
        """Every open request ends FAILED with ``reason`` (no collective is run)."""
        ended = self.engine.abort_all(reason)
        self._reply([rid for rid in ended if rid in self._open], transient=True)
