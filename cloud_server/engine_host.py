"""The engine process's side of ``--workers N``: one :class:`WorkerPort` per front-end worker, over one engine.

The main process runs the :class:`~cloud_server.runtime.CloudRuntime` (model, ``AsyncEngine``, KV pool, prefix
cache, engine metrics); :class:`EngineHost` serves the workers' links (``cloud_server.engine_link``):

* one **link thread** runs an asyncio loop over every worker's pipe (the workers' end is the same: their event
  loop's, ``cloud_server.remote_engine``); frames are written through the loop's transports (buffered: a worker
  that is slow to read never blocks the engine thread) and read as they come, so the engine process has two
  busy threads (the engine's and this one) however many workers there are, not two more per worker;
* a worker's frames are applied to the engine as they are read: ``add`` -> ``add_request`` with the port's
  sink, ``rows`` -> one ``add_rows`` (a loop turn's plain decode steps: their ``[S, H]`` array as it came),
  ``inputs`` -> ``add_inputs`` (chunks: prompt, 3-D RoPE, drafts), ``abort``,
  ``ask`` (an engine ``call``, a session admission, a metrics scrape), ``release``;
* the port's **sink** collects the outputs of one engine step for that worker (engine thread) and hands them
  over as one message when the step's deliveries are done: the first output of a step queues a ``call`` on
  the engine's own command queue, which the engine thread runs right after delivering the step; the step's
  messages for every worker reach the link thread through one ``LoopInbox`` (one wakeup per step), and each
  worker's go out as one frame.

Sessions over every worker are counted here (``cloud_server.session_ledger``). ``/metrics`` on any worker is
answered here: the engine's registry merged with every worker's (``cloud_server.metrics.render_merged``). A
worker whose link closes (its process died) has its requests aborted and its sessions released.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection

import torch

from cloud_server.engine.async_engine import EngineDeadError
from cloud_server.engine.llm_engine import RequestOutput
from cloud_server.engine_link import FrameReader, facts_to_wire, frame, pack_output, take_socket, unpack_chunks
from cloud_server.loop_inbox import LoopInbox
from cloud_server.metrics import render_merged
from cloud_server.session_ledger import LedgerEntry, SessionLedger

log = logging.getLogger("autoglm.cloud.host")
RENDER_TIMEOUT_S = 2.0  # a scrape waits this long for the workers' metric families


class WorkerPort(asyncio.Protocol):
    """The engine process's end of worker ``index``'s link (an asyncio protocol on the host's link loop);
    ``serial`` names this link (a replaced worker's successor has the same index and a new serial: the session
    ledger counts by serial)."""

    def __init__(self, host: EngineHost, index: int, serial: int, conn: Connection):
        self.host, self.index, self.serial, self.conn = host, index, serial, conn
        self.requests: set[str] = set()  # engine ids this worker opened and the engine still runs
        self._step: list[tuple] = []  # this step's packed outputs (engine thread)
        self._out: list[tuple] = []  # messages for the next frame (link thread)
        self._transport: asyncio.Transport | None = None
        self._reader = FrameReader()
        self._gone = False

    def start(self) -> WorkerPort:
        """Put the pipe's socket on the host's link loop (blocks until it is there)."""
        sock = take_socket(self.conn)
        loop = self.host.loop
        asyncio.run_coroutine_threadsafe(loop.connect_accepted_socket(lambda: self, sock), loop).result(10)
        return self

    def send(self, msg: tuple) -> None:
        """Queue ``msg`` for this worker (any thread; in order): the messages queued together leave as one frame."""
        self.host.outbox.put((self, msg))

    def close(self) -> None:
        self.host.outbox.put((self, None))

    # -- engine thread -----------------------------------------------------------------------------------
    def sink(self, out: RequestOutput) -> None:
        """An output for one of this worker's requests; the step's outputs leave together (module docstring)."""
        if out.finished:
            self.requests.discard(out.request_id)
        first = not self._step
        self._step.append(pack_output(out))
        if first:
            try:
                self.host.engine.call(self._flush_step)
            except EngineDeadError:  # the engine's last words (engine_error outputs): no step follows
                self._flush_step(None)

    def _flush_step(self, llm) -> None:
        outs, self._step = self._step, []
        if outs:
            self.send(("outputs", outs, len(llm.seqs) if llm is not None else 0))

    # -- link thread -------------------------------------------------------------------------------------
    def queue_out(self, msg: tuple | None) -> None:
        """(LoopInbox handler) ``msg`` joins this worker's next frame; None: close the link after it."""
        if not self._out:
            self.host.loop.call_soon(self._write)  # after the inbox's drain: one frame for what it brought
        self._out.append(msg)

    def _write(self) -> None:
        msgs, self._out = self._out, []
        close = None in msgs
        msgs = [m for m in msgs if m is not None]
        t = self._transport
        if t is None or t.is_closing():
            return
        if msgs:
            t.writelines(frame(msgs))
        if close:
            t.close()

    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            for msgs in self._reader.feed(data):
                for msg in msgs:
                    self._apply(msg)
        except Exception:
            log.exception("worker %d: bad frame on the engine link", self.index)
            self._transport.abort()

    def connection_lost(self, exc) -> None:
        self._transport = None
        if not self._gone:
            self._gone = True
            self.host.worker_gone(self)

    def _apply(self, msg: tuple) -> None:
        kind, engine = msg[0], self.host.engine
        try:
            if kind == "rows":  # a loop turn's plain decode steps: their [S, H] float32 array as it came
                engine.add_rows(msg[1], msg[2], torch.from_numpy(msg[3]))
            elif kind == "inputs":
                engine.add_inputs(list(zip(msg[1], unpack_chunks(msg[2]), strict=True)))
            elif kind == "add":
                _, rid, packed, params, variant, keys = msg
                self.requests.add(rid)
                engine.add_request(rid, self.sink, unpack_chunks(packed)[0], params, variant, keys)
            elif kind == "abort":
                engine.abort(msg[1], msg[2])
            elif kind == "ask":
                self.host.answer(self, msg[1], msg[2], msg[3])
            elif kind == "release":
                self.host.ledger.release(msg[1])
            elif kind == "rendered":
                self.host.rendered(msg[1], msg[2])
            else:
                raise ValueError(f"unknown engine-link message {kind!r}")
        except EngineDeadError as e:  # the worker hears "dead" too; requests it just sent end here
            if kind == "add":
                self.send(("outputs", [pack_output(RequestOutput(msg[1], finish_reason="error",
                                                                 error_code="engine_error", error_message=str(e)))],
                           0))

    def reply(self, cid: int, fut: Future) -> None:
        try:
            self.send(("reply", cid, True, fut.result()))
        except Exception as e:  # noqa: BLE001 - handed to the asking worker
            self.send(("reply", cid, False, f"{type(e).__name__}: {e}"))


class EngineHost:
    """The engine process's link server. ``runtime``: a started :class:`~cloud_server.runtime.CloudRuntime`."""

    def __init__(self, runtime):
        self.rt = runtime
        self.engine = runtime.engine
        self.ledger = SessionLedger(runtime.config.max_sessions)
        self.ports: dict[int, WorkerPort] = {}  # serial -> port, while its link is open
        self._lock = threading.Lock()
        self._serials = itertools.count()
        self._tokens = itertools.count()
        self._renders: dict[int, tuple[threading.Event, list, int]] = {}  # token -> (done, families, expected)
        self._scrapes = ThreadPoolExecutor(1, thread_name_prefix="autoglm-scrape")
        self._dead_told = False
        self.loop = asyncio.new_event_loop()  # every worker's link (module docstring)
        self._link_thread = threading.Thread(target=self.loop.run_forever, name="autoglm-links", daemon=True)
        self._link_thread.start()
        self.outbox = LoopInbox(self.loop, lambda item: item[0].queue_out(item[1]))  # (port, msg | None)

    def attach(self, index: int, conn: Connection) -> WorkerPort:
        """Serve worker ``index`` on its pipe end ``conn``: its hello (the engine's facts) goes out first."""
        port = WorkerPort(self, index, next(self._serials), conn)
        with self._lock:
            self.ports[port.serial] = port
        port.start()
        port.send(("hello", facts_to_wire(self.rt.facts), self.rt.model_name))
        return port

    def worker_gone(self, port: WorkerPort) -> None:
        """``port``'s link closed: abort what its worker left running and forget its sessions."""
        with self._lock:
            self.ports.pop(port.serial, None)
        for rid in list(port.requests):
            self.engine.abort(rid, "abort")
        dropped = self.ledger.drop_worker(port.serial)
        if port.requests or dropped:
            log.warning("worker %d gone: %d requests aborted, %d sessions released", port.index,
                        len(port.requests), len(dropped))

    def check_engine(self) -> None:
        """Tell every worker once when the engine has stopped (called periodically by the supervisor)."""
        if self.engine.dead is not None and not self._dead_told:
            self._dead_told = True
            for port in list(self.ports.values()):
                port.send(("dead", self.engine.dead))

    def stop(self) -> None:
        """Send what is queued to every worker, close the links, stop the link thread."""
        for port in list(self.ports.values()):
            port.close()
        done = threading.Event()
        try:
            self.loop.call_soon_threadsafe(lambda: self.loop.call_soon(done.set))  # after the closes' writes
            done.wait(5)
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # the loop is closed already
            pass
        self._link_thread.join(5)
        self._scrapes.shutdown(wait=False)

    # -- requests from workers (the link thread) ----------------------------------------------------
    def answer(self, port: WorkerPort, cid: int, op: str, args) -> None:
        if op == "call":
            try:
                fut = self.engine.call(args)
            except EngineDeadError as e:
                port.send(("reply", cid, False, str(e)))
                return
            fut.add_done_callback(lambda f: port.reply(cid, f))
        elif op == "admit":
            session_id, token, tenant, key_id, key_cap, replaces = args
            got = self.ledger.admit(port.serial, session_id, LedgerEntry(port.serial, token, tenant, key_id),
                                    key_cap, replaces)
            if got.reclaim is not None:
                holder = self.ports.get(got.reclaim[0])
                if holder is not None:
                    holder.send(("reclaim", got.reclaim[1]))
            port.send(("reply", cid, True, got.refusal))
        elif op == "metrics":
            fut = self._scrapes.submit(self._scrape)
            fut.add_done_callback(lambda f: port.reply(cid, f))
        else:
            port.send(("reply", cid, False, f"unknown request {op!r}"))

    def _scrape(self) -> bytes:
        """The engine's metric families and every worker's, merged into one exposition."""
        token = next(self._tokens)
        ports = list(self.ports.values())
        done, families = threading.Event(), []
        with self._lock:
            self._renders[token] = (done, families, len(ports))
        for port in ports:
            port.send(("render", token))
        if ports and not done.wait(RENDER_TIMEOUT_S):
            log.warning("metrics: %d of %d workers answered within %.0f s", len(families), len(ports),
                        RENDER_TIMEOUT_S)
        with self._lock:
            self._renders.pop(token, None)
            gathered = list(families)
        return render_merged([list(self.rt.metrics.registry.collect()), *gathered])

    def rendered(self, token: int, families: list) -> None:
        with self._lock:
            entry = self._renders.get(token)
            if entry is None:  # too late: that scrape has answered
                return
            done, got, expected = entry
            got.append(families)
            if len(got) >= expected:
                done.set()
