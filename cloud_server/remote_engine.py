"""The engine as a front-end worker process sees it: :class:`AsyncEngine`'s commands over the engine link.

With ``--workers N`` (``cloud_server.front_workers``) the split endpoint runs in worker processes and the engine
in the main one. :class:`RemoteEngine` gives the endpoint and its translator the part of ``AsyncEngine`` they
use - ``add_request`` / ``add_input`` / ``add_inputs`` / ``add_rows`` / ``abort`` with per-request *sinks*, ``call(fn)`` for a
consistent read on the engine thread (``fn`` must pickle: a module-level function or a ``functools.partial``
of one), ``alive`` / ``dead`` - and, for what must be counted over every worker, the session ledger's
:meth:`admit` / :meth:`release` (``cloud_server.session_ledger``).

Batching (``cloud_server.engine_link``): the commands of one event-loop turn go out as one frame, at the
turn's end; ``add_inputs`` / ``add_rows`` (a turn's decode steps) send at once, with what was queued before it. The link is
the event loop's own: an asyncio protocol on the pipe's socket writes the frames through the loop's transport
(buffered, so the loop never waits on the link: a prompt's states are megabytes, and the engine process reads
them between its steps) and reads the engine's frames as they come: a step's outputs for this worker arrive as
one frame and are handed to the sinks in order on the loop, with no thread between the pipe and the sessions
(the writer and reader threads this replaced cost a thread hand-over each way per token and competed with the
loop for the interpreter). If the engine process goes away (killed), every open request gets an ``engine_gone``
output (on the wire ``draining``: its edge takes it to the restarted server or another replica, as after a
whole server's crash) and ``dead`` says so (the worker's server then stops: ``cloud_server.app.DrainingServer``).
A fatal engine error the engine process reports (``dead``) is ``engine_error`` (``internal``: not retried); a
stalled engine (a step that never came back, ``--engine-stall-s``) is ``engine_gone``, as a killed one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection

from cloud_server.auth import Principal
from cloud_server.engine.async_engine import EngineDeadError, Sink
from cloud_server.engine.llm_engine import RequestOutput
from cloud_server.engine_link import FrameReader, facts_from_wire, frame, pack_chunks, take_socket, unpack_output

log = logging.getLogger("autoglm.cloud.worker")


class RemoteEngine:
    """``conn``: this worker's end of the engine pipe; ``worker``: its index (session ids carry it)."""

    def __init__(self, conn: Connection, worker: int):
        self.conn, self.worker = conn, worker
        self.dead: str | None = None
        self.facts = None  # the engine's EngineFacts, from its hello
        self.model_name = ""
        self.open_requests_all = 0  # requests open in the engine over every worker, as of its last step
        self.on_reclaim: Callable[[str], None] | None = None  # event loop: close this session (resumed elsewhere)
        self.families: Callable[[], list] | None = None  # event loop: this worker's metric families
        self.loop: asyncio.AbstractEventLoop | None = None  # where on_reclaim runs (set by start)
        self._sinks: dict[str, Sink] = {}  # engine id -> sink, until its finished output
        self._replies: dict[int, Future] = {}
        self._ids = itertools.count()
        self._pending: list[tuple] = []  # this loop turn's commands (event-loop thread)
        self._flush_scheduled = False
        self._hello = threading.Event()
        self._transport: asyncio.Transport | None = None  # the pipe's socket on the loop (set by start)
        self._closing = False  # close() was called: the link's end is ours, not the engine's

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> RemoteEngine:
        """Attach the link to ``loop`` (running in another thread: call this from a thread, e.g. the loop's
        executor) and wait up to ``timeout_s`` for the engine's hello (its facts)."""
        if self._on_loop():
            raise RuntimeError("RemoteEngine.start waits for the loop: call it from another thread")
        self.loop = loop
        sock = take_socket(self.conn)
        asyncio.run_coroutine_threadsafe(loop.connect_accepted_socket(lambda: _LinkProtocol(self), sock),
                                         loop).result(timeout_s)
        if not self._hello.wait(timeout_s):
            raise RuntimeError(f"worker {self.worker}: no hello from the engine process within {timeout_s:g} s")
        if self.dead is not None:
            raise RuntimeError(f"worker {self.worker}: {self.dead}")
        return self

    def close(self) -> None:
        """Send what is queued, then close the link (the transport writes its buffer first)."""
        if self._transport is None:
            return
        if self.loop is not None and self.loop.is_running() and not self._on_loop():
            self.loop.call_soon_threadsafe(self._close_now)
        else:
            self._close_now()

    def _close_now(self) -> None:
        self._closing = True
        self._flush()
        if self._transport is not None:
            self._transport.close()

    @property
    def alive(self) -> bool:
        return self.dead is None and self.facts is not None

    @property
    def num_open(self) -> int:
        """Requests of this worker the engine still runs."""
        return len(self._sinks)

    # -- AsyncEngine's commands (event-loop thread) ----------------------------------------------------
    def add_request(self, request_id: str, sink: Sink, first, params, variant: str | None = None,
                    prefix_keys: list[str] | None = None) -> None:
        self._check()
        self._sinks[request_id] = sink
        self._post(("add", request_id, pack_chunks([first]), params, variant, prefix_keys))

    def add_input(self, request_id: str, chunk) -> None:
        self._check()
        self._post(("inputs", [request_id], pack_chunks([chunk])))

    def add_inputs(self, inputs: list[tuple[str, object]]) -> None:
        """A loop turn's inputs as one message, sent now (with the commands queued before it: order kept)."""
        if not inputs:
            return
        self._check()
        self._pending.append(("inputs", [rid for rid, _ in inputs], pack_chunks([c for _, c in inputs])))
        self._flush()

    def add_rows(self, request_ids: list[str], starts: list[int], hidden) -> None:
        """A loop turn's plain decode steps as one ``[S, H]`` float32 or float16 tensor (``AsyncEngine.add_rows``), sent now
        (with the commands queued before it: order kept); the engine process hands the array on as it comes."""
        if not request_ids:
            return
        self._check()
        self._pending.append(("rows", request_ids, starts, hidden.numpy()))
        self._flush()

    def abort(self, request_id: str, reason: str = "abort") -> None:
        if self.dead is None:
            self._post(("abort", request_id, reason))

    def call(self, fn: Callable) -> Future:
        """``fn(llm)`` on the engine thread between steps; ``fn`` must pickle."""
        return self._ask("call", fn)

    # -- sessions over every worker (event-loop thread) ------------------------------------------------
    async def admit(self, session_id: str, resume_token: str, principal: Principal,
                    replaces: str | None) -> tuple[str, str] | None:
        """Count a new session in the engine process's ledger: None, or ``(metric reason, message)``. The whole
        ``principal`` crosses: the ledger caps by its key and reclaims ``replaces``'s session only for a principal
        acting as its opener's (tenant and role)."""
        return await asyncio.wrap_future(self._ask("admit", (session_id, resume_token, principal, replaces)))

    def release(self, session_id: str) -> None:
        if self.dead is None:
            self._post(("release", session_id))

    def offer_metrics(self, families: Callable[[], list]) -> None:
        """This worker's metric families come from ``families`` (called on the event loop for each scrape); they
        are sent once now, unasked: from then on the engine process waits for this worker's at a scrape."""
        self.families = families
        self._send([("rendered", None, families())])

    async def metrics(self) -> bytes:
        """Every process's metrics merged into one Prometheus exposition (gathered by the engine process)."""
        return await asyncio.wrap_future(self._ask("metrics", None))

    # -- sending ---------------------------------------------------------------------------------------
    def _check(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"engine stopped: {self.dead}")

    def _ask(self, op: str, args) -> Future:
        self._check()
        cid, fut = next(self._ids), Future()
        self._replies[cid] = fut
        self._post(("ask", cid, op, args))
        return fut

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def _post(self, msg: tuple) -> None:
        if not self._on_loop():  # a thread, a test: the message goes out alone, through the loop
            self._send([msg])
            return
        self._pending.append(msg)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        msgs, self._pending = self._pending, []
        if msgs:
            self._send(msgs)

    def _send(self, msgs: list[tuple]) -> None:
        """Write one frame of ``msgs`` (any thread: from another one it is handed to the loop; order kept)."""
        if not self._on_loop():
            try:
                self.loop.call_soon_threadsafe(self._send, msgs)
            except RuntimeError:  # the loop is closed: so is the link
                self._fail("engine link closed")
            return
        t = self._transport
        if t is None or t.is_closing():
            self._fail("engine link closed")
            return
        t.writelines(frame(msgs))

    # -- receiving (event loop) ------------------------------------------------------------------------
    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "outputs":
            self.open_requests_all = msg[2]
            for t in msg[1]:
                self._deliver(unpack_output(t))
        elif kind == "reply":
            _, cid, ok, value = msg
            fut = self._replies.pop(cid, None)
            if fut is not None:
                fut.set_result(value) if ok else fut.set_exception(RuntimeError(value))
        elif kind == "hello":
            self.facts, self.model_name = facts_from_wire(msg[1]), msg[2]
            self._hello.set()
        elif kind == "reclaim":
            if self.on_reclaim is not None:
                self.on_reclaim(msg[1])
        elif kind == "render":  # collected off the event loop (tens of ms with many tenants), sent from there
            self.loop.run_in_executor(None, self._render, msg[1])
        elif kind == "dead":  # the engine's fatal error (engine_error), or a stalled engine (engine_gone)
            self._fail(msg[1], msg[2])

    def _render(self, token: int) -> None:
        self._send([("rendered", token, self.families() if self.families is not None else [])])

    def _deliver(self, out: RequestOutput) -> None:
        rid = out.request_id
        sink = self._sinks.pop(rid, None) if out.finished else self._sinks.get(rid)
        if sink is None:
            return
        try:
            sink(out)
        except Exception:
            log.exception("output sink of %s failed", rid)

    def _fail(self, message: str, code: str = "engine_error") -> None:
        """The engine is gone: every open request ends with ``code``, every pending call fails."""
        if self.dead is None:
            self.dead = message
        for rid in list(self._sinks):
            self._deliver(RequestOutput(rid, finish_reason="error", error_code=code, error_message=message))
        for cid in list(self._replies):
            fut = self._replies.pop(cid, None)
            if fut is not None:
                fut.set_exception(EngineDeadError(f"engine stopped: {message}"))


class _LinkProtocol(asyncio.Protocol):
    """The engine link's socket on the worker's event loop: frames in, handed to the :class:`RemoteEngine`."""

    def __init__(self, engine: RemoteEngine):
        self.engine = engine
        self.reader = FrameReader()

    def connection_made(self, transport) -> None:
        self.engine._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            for msgs in self.reader.feed(data):
                for msg in msgs:
                    self.engine._handle(msg)
        except Exception:  # a broken link: as if the engine went away (connection_lost follows)
            log.exception("worker %d: bad frame from the engine", self.engine.worker)
            self.engine._transport.abort()

    def connection_lost(self, exc) -> None:
        eng = self.engine
        eng._transport = None
        if eng._closing:
            eng._fail("engine link closed")
            return
        eng._fail(f"engine process gone ({type(exc).__name__ if exc else 'EOF'})", "engine_gone")
        eng._hello.set()
