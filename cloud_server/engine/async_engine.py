"""Drive the engine from its own thread; sessions talk to it through a command queue and output sinks.

Network handlers (asyncio) never touch the engine's state: they enqueue commands (``add_request``,
``add_input`` / ``add_inputs``, ``abort``) and receive :class:`RequestOutput`s through a per-request *sink*, a
callable that must not block (the split endpoint's sinks hand outputs to its event loop through one
``cloud_server.loop_inbox.LoopInbox``: one wakeup per step). The engine
thread loops: apply every queued command, run one step if any sequence is ready, deliver the outputs; when
nothing is ready it sleeps on the queue. So a slow or dead WebSocket never blocks a step.

Decode cohorts (split mode): a decoding request's next input comes back from its edge only after its token
went out, so the requests of one step return over a spread of time. Stepping on the first arrival would split
them into small steps that each cost nearly a full one on a memory-bound GPU. So when some requests are ready
and others that were handed a token are still *awaiting* their next input, the loop waits for those up to the
*gather window* (the recent step time, at most ``gather_max_s``; 0 turns it off) and then steps on what has
arrived. A request still awaiting when the window closes is late (a slow or stalled edge): it holds no
further step until it sends an input again. With one request, or when all have arrived, nothing waits.

Edge round trips: the time from a decoding request's token leaving the engine (its delivery to the sink) to
its next input reaching the engine thread - the link both ways, the phone's front step and the server's front
end - goes to ``on_round_trip(seconds)`` (the server's ``autoglm:edge_round_trip_seconds``). In lockstep a
step's decode rows wait for it, so it is what separates the served path from the engine's own step rate.

Where the engine thread's time goes, per step that delivered outputs: ``on_step(step_s, wait_s)`` - the time in
``LLMEngine.step`` for it, and the time since the previous one spent taking commands while requests were open
(waiting for their inputs: the edges' round trips, the gather window). The server exports both
(``autoglm:engine_step_seconds``, ``autoglm:engine_input_wait_seconds``); ``step / (step + wait)`` is how busy the
engine was, and in lockstep decoding ``wait`` is what the served path adds to the engine's own step.

An I/O pump (``drive``): a process whose commands arrive on its own descriptors (the engine process of
``--workers N``: every worker's pipe, ``cloud_server.engine_host``) hands the engine thread a pump, and the thread
polls it wherever it would sleep on the command queue: ``pump.poll(timeout)`` reads what is ready (queuing
commands as any thread would), up to ``timeout`` seconds; ``pump.wake()`` ends a poll when another thread queues a
command. So the links are served by the engine thread itself, not by a second thread competing for the GIL.

A model-runner exception is fatal for the engine: every open request gets an ``engine_error`` output, the
loop stops and ``dead`` says why (``/ready`` turns false); a pump goes on being polled (its links hear it).
A step that runs longer than ``stall_s`` (a wedged device, a deadlock: the thread never comes back to say so) makes
``dead`` say that too, for whoever reads it next (the server's watch, ``/ready``), so the server stops to be
restarted instead of answering its probes while no request moves.
Requests idle longer than ``idle_timeout_s`` (an edge that stopped sending decode steps) are aborted with reason
``timeout``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from cloud_server.engine.llm_engine import LLMEngine, RequestOutput

log = logging.getLogger("autoglm.cloud.engine")

Sink = Callable[[RequestOutput], None]
GATHER_MAX_S = 0.02  # the longest a step waits for a decode cohort's awaited inputs


class Pump(Protocol):
    def poll(self, timeout: float) -> None: ...

    def wake(self) -> None: ...


class EngineDeadError(RuntimeError):
    """The engine thread stopped after a fatal error; no request can be served."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_timeout_s: float | None = None,
                 on_fatal: Callable[[str], None] | None = None, idle_hook: Callable[[], None] | None = None,
                 idle_hook_every_s: float = 20.0, gather_max_s: float | None = None,
                 on_round_trip: Callable[[float], None] | None = None,
                 on_step: Callable[[float, float], None] | None = None, stall_s: float | None = None):
        gather_max_s = GATHER_MAX_S if gather_max_s is None else gather_max_s  # None: the module's default
        if gather_max_s < 0:
            raise ValueError(f"gather_max_s must be >= 0, got {gather_max_s}")
        self.llm = engine
        # Called on the engine thread after idle_hook_every_s without a step (tensor-parallel heartbeat:
        # the workers wait in a collective with a timeout).
        self.idle_hook, self.idle_hook_every_s = idle_hook, idle_hook_every_s
        self.idle_timeout_s = idle_timeout_s
        self.on_fatal = on_fatal
        self.stall_s = stall_s  # a step running longer than this is a wedged engine (None: never)
        self._step_began: float | None = None  # when the step now running began (None: not in a step)
        self.stalled = False  # ``dead`` is a step that never came back (its requests may run elsewhere), not an error
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="autoglm-engine", daemon=True)
        self._dead: str | None = None
        self.steps = 0
        self.gather_max_s = gather_max_s
        self._awaiting: set[str] = set()  # decoding requests handed a token whose next input has not come yet
        self.on_round_trip = on_round_trip
        self._handed_at: dict[str, float] = {}  # awaiting request -> when its token was delivered (round trips)
        self._step_s = 0.0  # moving average of the time in step() per step that delivered: the gather window
        self._stepping_s = 0.0  # time in step() since the last step that delivered outputs
        self.on_step = on_step
        self._waiting_s = 0.0  # time taking commands while requests were open, since the last delivering step
        self._pump: Pump | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def drive(self, pump: Pump) -> None:
        """Poll ``pump`` on the engine thread wherever it waits for commands (module docstring)."""
        self._pump = pump
        self._cmds.put(("wake",))  # a sleep on the queue ends: the next wait polls the pump

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(("wake",))
        self._wake_pump()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def dead(self) -> str | None:
        """Why the engine stopped (None while it runs): a step raised, or the step now running has run for over
        ``stall_s`` - a wedged device or a deadlock, which no exception ever reports."""
        began = self._step_began
        if self._dead is None and self.stall_s is not None and began is not None \
                and time.monotonic() - began > self.stall_s:
            self._dead = f"an engine step has run for over {self.stall_s:g} s (a wedged device or a deadlock)"
            self.stalled = True
            log.error("engine stalled: %s", self._dead)
        return self._dead

    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    # -- commands (any thread) -----------------------------------------------------------------
    def add_request(self, request_id: str, sink: Sink, first, params, variant: str | None = None,
                    prefix_keys: list[str] | None = None, output_ids: list[int] | None = None) -> None:
        """``LLMEngine.add_request`` on the engine thread (``output_ids``, a replayed request's tokens so far: handed
        over, the caller no longer changes the list)."""
        self._put(("add", request_id, sink, first, params, variant, prefix_keys, output_ids))

    def add_input(self, request_id: str, chunk) -> None:
        self._put(("input", request_id, chunk))

    def add_inputs(self, inputs: list[tuple[str, object]]) -> None:
        """Several ``(request_id, chunk)`` inputs (a decode step's, one per session) as one command: one
        queue hand-off and one wakeup of the engine thread for all of them, applied in order."""
        if inputs:
            self._put(("inputs", inputs))

    def add_rows(self, request_ids: list[str], starts: list[int], hidden) -> None:
        """Decode steps of several requests as one ``[S, H]`` tensor (``LLMEngine.add_inputs``: row i is position
        ``starts[i]`` of ``request_ids[i]``), one command; the engine may read ``hidden`` until their step is out."""
        if request_ids:
            self._put(("rows", request_ids, starts, hidden))

    def abort(self, request_id: str, reason: str = "abort") -> None:
        if self.dead is None:
            self._cmds.put(("abort", request_id, reason))
            self._wake_pump()

    def call(self, fn: Callable[[LLMEngine], object]) -> Future:
        """Run ``fn(engine)`` on the engine thread between steps (consistent reads of its state)."""
        fut: Future = Future()
        self._put(("call", fn, fut))
        return fut

    def _put(self, cmd: tuple) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"engine stopped: {self.dead}")
        self._cmds.put(cmd)
        self._wake_pump()

    def _wake_pump(self) -> None:
        if self._pump is not None and threading.current_thread() is not self._thread:
            self._pump.wake()

    # -- the loop (engine thread) --------------------------------------------------------------
    def _apply(self, cmd: tuple) -> list[RequestOutput]:
        kind = cmd[0]
        if kind == "add":
            _, rid, sink, first, params, variant, keys, output_ids = cmd
            try:
                outs = self.llm.add_request(rid, first, params, variant, keys, output_ids)
            except Exception:
                self._sinks.setdefault(rid, sink)  # the engine dies of it (_loop): this request hears why too
                raise
            if not any(o.request_id == rid and o.finished for o in outs):
                self._sinks[rid] = sink
            else:
                for o in outs:
                    sink(o)
                return []
            return outs
        if kind == "input":
            self._arrived(cmd[1], time.monotonic())
            return self.llm.add_input(cmd[1], cmd[2])
        if kind == "inputs":
            outs, now = [], time.monotonic()
            for rid, chunk in cmd[1]:
                self._arrived(rid, now)
                outs += self.llm.add_input(rid, chunk)
            return outs
        if kind == "rows":
            now = time.monotonic()
            for rid in cmd[1]:
                self._arrived(rid, now)
            return self.llm.add_inputs(cmd[1], cmd[2], cmd[3])
        if kind == "abort":
            self._awaiting.discard(cmd[1])
            self._handed_at.pop(cmd[1], None)
            return self.llm.abort(cmd[1], cmd[2])
        if kind == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn(self.llm))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
        return []

    def _arrived(self, rid: str, now: float) -> None:
        """An input of ``rid`` reached the engine thread: no longer awaited; its round trip recorded."""
        self._awaiting.discard(rid)
        handed = self._handed_at.pop(rid, None)
        if handed is not None and self.on_round_trip is not None:
            self.on_round_trip(now - handed)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        seqs = self.llm.seqs
        now = time.monotonic()
        for o in outs:
            rid = o.request_id
            if o.finished:
                sink = self._sinks.pop(rid, None)
                self._awaiting.discard(rid)
                self._handed_at.pop(rid, None)
            else:
                sink = self._sinks.get(rid)
                seq = seqs.get(rid)
                if o.token_id is not None and seq is not None and not seq.pending:
                    self._awaiting.add(rid)  # its edge now computes the next input
                    self._handed_at[rid] = now
            if sink is None:
                continue
            try:
                sink(o)
            except Exception:
                log.exception("output sink of %s failed", o.request_id)

    def _get(self, timeout: float) -> tuple | None:
        """The next command, waiting up to ``timeout`` seconds for one (0: only what is queued); with a pump, the
        pump is polled first when the queue is empty, then waited on."""
        pump = self._pump
        if pump is None:
            try:
                return self._cmds.get(timeout=timeout) if timeout > 0 else self._cmds.get_nowait()
            except queue.Empty:
                return None
        if self._cmds.empty():
            pump.poll(0.0)
            if timeout > 0 and self._cmds.empty():
                pump.poll(timeout)
        try:
            return self._cmds.get_nowait()
        except queue.Empty:
            return None

    def _take_commands(self) -> list[RequestOutput]:
        """Apply the queued commands: sleep on the queue while nothing is ready, then take what is there, then
        (some ready, some awaited) wait for the awaited inputs up to the gather window (module docstring)."""
        outs: list[RequestOutput] = []
        block = not self.llm.has_work()  # nothing ready and no step in flight
        while (cmd := self._get(0.25 if block else 0.0)) is not None:
            block = False
            outs += self._apply(cmd)
        window = min(self.gather_max_s, self._step_s)
        if not self._awaiting or window <= 0 or self.llm.has_in_flight() or not self.llm.has_ready():
            return outs  # (a launched step's outputs are never held back for a gather)
        deadline = time.monotonic() + window
        while self._awaiting and not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                self._awaiting.clear()  # late: they hold no further step until they send again
                break
            cmd = self._get(left)
            if cmd is not None:
                outs += self._apply(cmd)
        return outs

    def _loop(self) -> None:
        last_sweep = last_busy = time.monotonic()
        try:
            while not self._stop.is_set():
                began, busy = time.monotonic(), bool(self._sinks)  # requests open: a wait is for their inputs
                outs = self._take_commands()
                if busy:
                    self._waiting_s += time.monotonic() - began
                self._deliver(outs)
                now = time.monotonic()
                if self.llm.has_work():
                    self._step_began = now
                    outs = self.llm.step()
                    self._step_began = None
                    self._stepping_s += time.monotonic() - now  # with overlap: a launch, then its postprocess
                    if outs:
                        self._step_s += (0.2 if self._step_s else 1.0) * (self._stepping_s - self._step_s)
                        if self.on_step is not None:
                            self.on_step(self._stepping_s, self._waiting_s)
                        self._stepping_s = self._waiting_s = 0.0
                    self._deliver(outs)
                    self.steps += 1
                    last_busy = now
                elif self.idle_hook is not None and now - last_busy > self.idle_hook_every_s:
                    self.idle_hook()
                    last_busy = now
                if self.idle_timeout_s is not None and now - last_sweep > 1.0:
                    last_sweep = now
                    self._deliver(self.llm.abort_idle(self.idle_timeout_s))
        except Exception as e:
            log.exception("engine step failed")
            self._step_began = None
            self._dead = f"{type(e).__name__}: {e}".splitlines()[0]
            for rid, sink in list(self._sinks.items()):
                try:
                    sink(RequestOutput(rid, finish_reason="error", error_code="engine_error",
                                       error_message=self.dead))
                except Exception:
                    log.exception("output sink of %s failed", rid)
            self._sinks.clear()
            if self.on_fatal is not None:
                self.on_fatal(self.dead)
            while self._pump is not None and not self._stop.is_set():  # its links still hear every worker
                self._pump.poll(0.25)


class RequestStream:
    """The asyncio end of one request: its sink hands outputs to the event loop's queue, never blocking."""

    def __init__(self, loop=None):
        import asyncio

        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.closed = False

    def sink(self, out: RequestOutput) -> None:
        if not self.closed:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)

    async def get(self) -> RequestOutput:
        return await self.queue.get()

    def close(self) -> None:
        self.closed = True
