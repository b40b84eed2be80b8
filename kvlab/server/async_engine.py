"""AsyncEngine: the engine in a thread of its own, fed from the web server's event loop.

    event loop ──submit(request)──► inbox (queue.Queue) ──► engine thread: add, abort, step()
    event loop ◄──asyncio.Queue per request◄── call_soon_threadsafe(a step's StepOutputs) ◄──┘

Only the engine thread touches the engine (the scheduler, the KV pool, the model): no locks in the
engine itself. The thread blocks on the inbox while there is nothing to run. Woken from idle, it first
waits for the requests the server is still reading beside the one that woke it (`Arrivals`, at most
`burst_wait_s`), so that a burst of requests starts in one step; a lone request does not wait.

A request's queue receives StepOutputs (new text, new token ids) and, last, one with `finished` set
(and `error`, when its step failed); the `output` it carries is only read after that, when the engine
no longer writes it. An exception object in the queue means the request never reached the engine, or the
engine thread itself died.

No request can stop the thread: the engine ends a failing step's requests itself
(`LLMEngine.step`), and any request the engine forgot in a failed step is failed here. Only a
broken engine (its KV pool inconsistent) ends the thread; then every waiting request fails,
`is_alive` turns False (/health: 503) and `on_death` runs — the server exits, so that a supervisor
restarts it instead of watching a process that answers 503 forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kvlab.engine import LLMEngine
from kvlab.errors import KvlabError
from kvlab.output.processor import StepOutput
from kvlab.output.result import RequestOutput
from kvlab.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Listener:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


# How long the engine thread, woken from idle, waits at most for requests the server has begun reading
# but not yet queued. A client's burst reaches the engine over a few milliseconds (each request parsed,
# checked and tokenized in turn on the event loop), and the first one woke the engine thread, which ran
# its prompt alone while the others queued behind that step: 16 × (64 in, 64 out) on SmolLM2 through
# `kvlab serve` (2 threads, int8, kvlab's client) started 1 + 15, 4 + 12 or 3 + 13 prompts in 4 rounds
# of 8, and in 1 of 10 in a later run; waiting for the requests being read, all 16 in every round of
# both runs (output tok/s within the noise: medians 755 / 758 and 842 / 836; TTFT p50 355 -> 329 ms in
# the run with four splits). 20 ms: the longest burst seen took 18.
BURST_WAIT_S = 0.02


@dataclass
class _Arrival:
    engine: AsyncEngine
    done: bool = False


_ARRIVAL: contextvars.ContextVar[_Arrival | None] = contextvars.ContextVar("kvlab_arrival", default=None)


class EngineDead(RuntimeError):
    pass


class StepFailed(RuntimeError):
    """A request the engine forgot in a failed step (its final output was lost with the step)."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_death: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.on_death = on_death
        self._inbox: queue.Queue = queue.Queue()
        self._listeners: dict[str, _Listener] = {}
        self._thread = threading.Thread(target=self._run, name="kvlab-engine", daemon=True)
        self.error: BaseException | None = None
        self.stopped = threading.Event()
        self.draining = False  # shutting down: no new requests
        self.burst_wait_s = BURST_WAIT_S
        self._arriving = 0  # requests being read (Arrivals) that have not queued their prompts yet

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def is_serving(self) -> bool:
        """Alive and taking new requests (not shutting down)."""
        return self.is_alive and not self.draining

    def start(self) -> None:
        self._thread.start()

    # ---- called from the event loop ------------------------------------------------------------------

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               output: RequestOutput, cache_salt: str | None = None,
               client_id: str | None = None) -> asyncio.Queue:  # fmt: skip
        """Queue a request for the engine thread. `client_id`: the scheduler shares seats and prompt tokens fairly
        between clients (scheduler/fair.py); the server names one per HTTP request."""
        if not self.is_serving:
            raise EngineDead("the engine has stopped" if not self.is_alive else "the server is shutting down")
        listener = _Listener(asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(("add", request_id, prompt_token_ids, params, output, cache_salt, client_id, listener))
        return listener.queue

    @contextlib.contextmanager
    def arriving(self):
        """An HTTP request being read (Arrivals): until it has queued its prompts (`arrived`) or ends, the
        engine thread, woken from idle by another request, waits for it."""
        token = _ARRIVAL.set(_Arrival(self))
        self._arriving += 1
        try:
            yield
        finally:
            self.arrived()
            _ARRIVAL.reset(token)

    def arrived(self) -> None:
        """The current HTTP request has queued every prompt it will (or gives up): the engine thread no
        longer waits for it. Called once its prompts are submitted, and in any case when it ends."""
        arrival = _ARRIVAL.get()
        if arrival is not None and arrival.engine is self and not arrival.done:
            arrival.done = True
            self._arriving -= 1

    def abort(self, request_id: str) -> None:
        """Stop a request (a client went away); its queue gets the final output."""
        self._inbox.put(("abort", request_id))

    def abort_all(self) -> None:
        """Stop every request in flight (shutting down): each ends now (finish_reason "length", kvlab's "abort")."""
        self.draining = True
        self._inbox.put(("abort_all",))

    def num_in_flight(self) -> int:
        return len(self._listeners)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is still running and stop the thread."""
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout)

    # ---- the engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests
                if not self._drain(block=idle) or (idle and not self._gather_burst()):
                    break
                if self.engine.has_unfinished_requests:
                    self._deliver_step(self.engine.step())
                    self._fail_forgotten()  # a few dict lookups a step
        except BaseException as e:  # the engine is broken: fail every request rather than hang them
            if not isinstance(e, KvlabError):  # a KvlabError (a rank of the job gone) says it in one line
                logger.exception("the engine thread stopped")
            self.error = e
            for rid in list(self._listeners):
                self._deliver_error(rid, e)
            if self.on_death is not None:
                self.on_death(e)
        finally:
            for rid in list(self._listeners):  # shutting down: abort what is left
                out = self.engine.abort_request(rid)
                if out is not None:
                    self._deliver(out)
            self.stopped.set()

    def _fail_forgotten(self) -> None:
        """A request the engine no longer knows (its final output was lost in a failed step) fails now."""
        for rid in list(self._listeners):
            if not self.engine.has_request(rid):
                self._deliver_error(rid, StepFailed("the request was lost in a failed engine step"))

    def _gather_burst(self) -> bool:
        """Woken from idle with work: apply the commands of the requests still being read as they come, until
        none is left or `burst_wait_s` has passed; False once asked to stop."""
        deadline = time.monotonic() + self.burst_wait_s
        while self.engine.has_unfinished_requests and self._arriving > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if not self._drain(block=True, timeout=min(left, 0.002)):
                return False
        return True

    def _drain(self, block: bool, timeout: float | None = None) -> bool:
        """Apply every pending command (waiting for one if `block`, at most `timeout` seconds); False once
        asked to stop."""
        while True:
            try:
                command = self._inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                return True
            block = False
            if command[0] == "stop":
                return False
            if command[0] == "add":
                _, rid, ids, params, output, cache_salt, client_id, listener = command
                self._listeners[rid] = listener
                try:
                    self.engine.add_request(ids, params, request_id=rid, output=output, cache_salt=cache_salt,
                                            client_id=client_id)  # fmt: skip
                except Exception as e:  # checked before submit; anything left is reported to the request
                    self._deliver_error(rid, e)
            elif command[0] == "abort":
                out = self.engine.abort_request(command[1])
                if out is not None:
                    self._deliver(out)
            elif command[0] == "abort_all":
                for rid in list(self._listeners):
                    out = self.engine.abort_request(rid)
                    if out is not None:
                        self._deliver(out)

    def _deliver(self, out: StepOutput) -> None:
        self._deliver_step([out])

    def _deliver_step(self, outputs: list[StepOutput]) -> None:
        """A step's outputs, one wake-up of each listening event loop for all of them (a call per output
        woke the loop 16 times a step at 16 streams, on the cores the step's threads compute on)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            listener = self._listeners.get(out.request_id)
            if listener is None:
                continue
            if out.finished:
                del self._listeners[out.request_id]
            by_loop.setdefault(listener.loop, []).append((listener.queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                pass

    def _deliver_error(self, rid: str, error: BaseException) -> None:
        listener = self._listeners.pop(rid, None)
        if listener is not None:
            _put(listener, error)


def _put(listener: _Listener, item) -> None:
    try:
        listener.loop.call_soon_threadsafe(listener.queue.put_nowait, item)
    except RuntimeError:  # the event loop has closed: nobody is listening any more
        pass


def _put_all(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


class Arrivals:
    """ASGI middleware: each POST counts as a request being read (AsyncEngine.burst_wait_s) until it has
    queued its prompts (Generation.submit calls `arrived`) or, whatever it was, until it ends."""

    def __init__(self, app, engine: AsyncEngine):
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        with self.engine.arriving():
            await self.app(scope, receive, send)
