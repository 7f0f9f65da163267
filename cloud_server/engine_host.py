"""The engine process's side of ``--workers N``: one :class:`WorkerPort` per front-end worker, over one engine.

The main process runs the :class:`~cloud_server.runtime.CloudRuntime` (model, ``AsyncEngine``, KV pool, prefix
cache, engine metrics); :class:`EngineHost` serves the workers' links (``cloud_server.engine_link``) **on the
engine thread itself**: the host is the engine's I/O pump (``AsyncEngine.drive``), so while the engine waits for
commands it waits on every worker's pipe (one ``selectors`` poll), and no second interpreter thread competes with
the engine's for the GIL (a link thread 25 % busy beside it nearly doubled its host work per step,
``bench/engine_host_bench.py --link-duty``):

* a worker's frames are read when they come (non-blocking, whatever the socket holds) and applied at once:
  ``add`` -> ``add_request`` with the port's sink, ``rows`` -> one ``add_rows`` (a loop turn's plain decode steps:
  their ``[S, H]`` array as it came), ``inputs`` -> ``add_inputs`` (chunks: prompt, 3-D RoPE, drafts),
  ``abort``, ``ask`` (an engine ``call``, a session admission, a metrics scrape), ``release``; the commands join
  the engine's queue and run in the same wait;
* the port's **sink** collects the outputs of one engine step for that worker and the first of them queues a
  ``call`` on the engine's queue, which runs right after the step's deliveries: the step's outputs for that worker
  leave as one frame, written at once (a worker slow to read: the rest is buffered and written when its pipe
  drains; the engine never blocks on it);
* other threads (the supervisor, a metrics scrape) post their messages to the engine thread and wake its poll.

Sessions over every worker are counted here (``cloud_server.session_ledger``). ``/metrics`` on any worker is
answered here: the engine's registry merged with every worker's (``cloud_server.metrics.render_merged``). A
worker whose link closes (its process died) has its requests aborted and its sessions released. After a fatal
engine error the engine thread goes on polling the links, so every worker hears it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import selectors
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection

import torch

from cloud_server.engine.async_engine import EngineDeadError
from cloud_server.engine.llm_engine import RequestOutput
from cloud_server.engine_link import FrameReader, facts_to_wire, frame, pack_output, take_socket, unpack_chunks
from cloud_server.metrics import lasting, merge, render_merged
from cloud_server.session_ledger import LedgerEntry, SessionLedger

log = logging.getLogger("autoglm.cloud.host")
RENDER_TIMEOUT_S = 2.0  # a scrape waits this long for the workers' metric families
READ_BYTES = 1 << 18  # one recv's most
TELL_WAIT_S = 1.0  # how long the supervisor waits for the engine thread to tell the workers the engine stopped


class WorkerPort:
    """The engine process's end of worker ``index``'s link (read and written on the engine thread); ``serial``
    names this link (a replaced worker's successor has the same index and a new serial: the session ledger counts
    by serial)."""

    def __init__(self, host: EngineHost, index: int, serial: int, conn: Connection):
        self.host, self.index, self.serial = host, index, serial
        self.sock = take_socket(conn)
        self.sock.setblocking(False)
        self.requests: set[str] = set()  # engine ids this worker opened and the engine still runs
        self._step: list[tuple] = []  # this step's packed outputs
        self._unsent = bytearray()  # frame bytes the pipe did not take yet
        self._closing = False  # close once the unsent bytes are out
        self._reader = FrameReader()
        self._gone = False
        self.families: list | None = None  # its worker's metric families as last sent (None: not started yet)

    def send(self, msg: tuple) -> None:
        """Send ``msg`` to this worker (any thread; in order): at once on the engine thread, else posted to it."""
        self.host.on_engine_thread(lambda: self._write(frame([msg])))

    def close(self) -> None:
        self.host.on_engine_thread(self._close)

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

    def _write(self, parts: list[bytes]) -> None:
        if self._gone:
            return
        if self._unsent:  # behind bytes still queued: keep the order
            for b in parts:
                self._unsent += b
            return
        try:
            sent = self.sock.sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._lost()
            return
        total = sum(len(b) for b in parts)
        if sent < total:
            data = b"".join(parts)
            self._unsent += memoryview(data)[sent:]
            self.host.want_write(self, True)

    def on_writable(self) -> None:
        try:
            sent = self.sock.send(self._unsent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._lost()
            return
        del self._unsent[:sent]
        if not self._unsent:
            self.host.want_write(self, False)
            if self._closing:
                self._lost()

    def _close(self) -> None:
        if self._unsent:
            self._closing = True
        else:
            self._lost()

    def on_readable(self) -> None:
        """Read what the pipe holds and apply its complete frames; a closed or corrupt link ends this worker."""
        while not self._gone:
            try:
                data = self.sock.recv(READ_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._lost()
                return
            try:
                for msgs in self._reader.feed(data):
                    for msg in msgs:
                        self._apply(msg)
            except Exception:
                log.exception("worker %d: bad frame on the engine link", self.index)
                self._lost()
                return
            if len(data) < READ_BYTES:
                return

    def _lost(self) -> None:
        if not self._gone:
            self._gone = True
            self.host.worker_gone(self)

    def _apply(self, msg: tuple) -> None:
        kind, engine = msg[0], self.host.engine
        try:
            if kind == "rows":  # a loop turn's plain decode steps: their [S, H] array (float32 / float16) as it came
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
                self.host.rendered(self, msg[1], msg[2])
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
    """The engine process's link server and the engine thread's I/O pump (``poll``, ``wake``).
    ``runtime``: a started :class:`~cloud_server.runtime.CloudRuntime`."""

    def __init__(self, runtime):
        self.rt = runtime
        self.engine = runtime.engine
        self.ledger = SessionLedger(runtime.config.max_sessions)
        self.ports: dict[int, WorkerPort] = {}  # serial -> port, while its link is open
        self._lock = threading.Lock()
        self._serials = itertools.count()
        self._tokens = itertools.count()
        self._renders: dict[int, tuple[threading.Event, set[int]]] = {}  # token -> (done, serials yet to answer)
        self._retired: list = []  # the counters and histograms of workers gone (metrics.lasting), merged
        self._scrapes = ThreadPoolExecutor(1, thread_name_prefix="autoglm-scrape")
        self._dead_told = False
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._posted: collections.deque[Callable[[], None]] = collections.deque()  # from other threads
        self._pump_thread: int | None = None  # the engine thread, once it polls
        self.engine.drive(self)

    # -- the pump (engine thread) ------------------------------------------------------------------------
    def poll(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the links (0: what is ready now): read and apply their frames, write
        what is pending, run what other threads posted. Returns when something happened or the time is up."""
        self._pump_thread = threading.get_ident()
        self._run_posted()
        for key, mask in self._sel.select(timeout):
            port = key.data
            if port is None:  # a wakeup
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, InterruptedError):
                    pass
                continue
            if mask & selectors.EVENT_WRITE:
                port.on_writable()
            if mask & selectors.EVENT_READ:
                port.on_readable()
        self._run_posted()

    def wake(self) -> None:
        """End a ``poll`` in progress (any thread)."""
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, InterruptedError):  # wakeups pending already
            pass
        except OSError:  # closed: stopped
            pass

    def on_engine_thread(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread: now if this is it, else at its next poll (in order)."""
        if threading.get_ident() == self._pump_thread:
            fn()
        else:
            self._posted.append(fn)
            self.wake()

    def _run_posted(self) -> None:
        posted = self._posted
        while posted:
            try:
                posted.popleft()()
            except Exception:
                log.exception("engine link: a posted action failed")

    def want_write(self, port: WorkerPort, on: bool) -> None:
        if not port._gone:
            self._sel.modify(port.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0), port)

    # -- the links -----------------------------------------------------------------------------------------
    def attach(self, index: int, conn: Connection) -> WorkerPort:
        """Serve worker ``index`` on its pipe end ``conn``: its hello (the engine's facts) goes out first."""
        port = WorkerPort(self, index, next(self._serials), conn)
        with self._lock:
            self.ports[port.serial] = port
        self.on_engine_thread(lambda: self._sel.register(port.sock, selectors.EVENT_READ, port))
        port.send(("hello", facts_to_wire(self.rt.facts), self.rt.model_name))
        return port

    def worker_gone(self, port: WorkerPort) -> None:
        """``port``'s link closed (engine thread): abort what its worker left running and forget its sessions;
        its counters stay in the scrapes' sums."""
        with self._lock:
            self.ports.pop(port.serial, None)
            if port.families is not None:
                self._retired = merge([self._retired, lasting(port.families)])
            for done, waiting in self._renders.values():  # a scrape in progress waits for it no longer
                waiting.discard(port.serial)
                if not waiting:
                    done.set()
        try:
            self._sel.unregister(port.sock)
        except (KeyError, ValueError):
            pass
        port.sock.close()
        for rid in list(port.requests):
            self.engine.abort(rid, "abort")
        dropped = self.ledger.drop_worker(port.serial)
        if port.requests or dropped:
            log.warning("worker %d gone: %d requests aborted, %d sessions released", port.index,
                        len(port.requests), len(dropped))

    def check_engine(self) -> bool:
        """Tell every worker once when the engine has stopped (called periodically by the supervisor); True when
        this call told them. A stalled engine (``AsyncEngine.stalled``) is told as ``engine_gone``: its requests did
        nothing wrong and their edges replay them elsewhere, as after a killed engine process; and since its thread
        is stuck in the step, the message is written from here when that thread does not take it."""
        if self.engine.dead is None or self._dead_told:
            return False
        self._dead_told = True
        msg = frame([("dead", self.engine.dead, "engine_gone" if self.engine.stalled else "engine_error")])
        told = threading.Event()

        def tell() -> None:
            for port in list(self.ports.values()):
                port._write(msg)
            told.set()

        self.on_engine_thread(tell)
        if not told.wait(TELL_WAIT_S):  # stuck in a step: were the workers told on it, their requests waited for ever
            log.warning("engine link: the engine thread is stuck; telling the workers from here")
            tell()
        return True

    def stop(self) -> None:
        """Send what is queued to every worker and close the links (on the engine thread while it polls)."""
        done = threading.Event()

        def close_all() -> None:
            for port in list(self.ports.values()):
                port._close()
            done.set()

        self.on_engine_thread(close_all)
        if not done.wait(5):  # the engine thread is not polling (stopped): close from here
            log.warning("engine link: the engine thread did not close the links; closing them here")
            for port in list(self.ports.values()):
                port._lost()
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
            session_id, token, principal, replaces = args
            got = self.ledger.admit(port.serial, session_id, LedgerEntry(port.serial, token, principal), replaces)
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
        """The engine's metric families and every worker's, merged into one exposition. Only started workers (they
        sent their families once, unasked) are asked and waited for: one still starting has counted nothing, and
        waiting for it held every scrape during a start for ``RENDER_TIMEOUT_S``. One that does not answer in
        time adds its last families, one that is gone its counters (``metrics.lasting``): no sum goes down."""
        token = next(self._tokens)
        done = threading.Event()
        with self._lock:
            ports = [p for p in self.ports.values() if p.families is not None]
            waiting = {p.serial for p in ports}
            self._renders[token] = (done, waiting)
        for port in ports:
            port.send(("render", token))
        if ports and not done.wait(RENDER_TIMEOUT_S):
            log.warning("metrics: %d of %d workers answered within %.0f s (their last metrics used)",
                        len(ports) - len(waiting), len(ports), RENDER_TIMEOUT_S)
        with self._lock:
            self._renders.pop(token, None)
            gathered = [p.families for p in self.ports.values() if p.families is not None]
            retired = self._retired
        return render_merged([list(self.rt.metrics.registry.collect()), *gathered, retired])

    def rendered(self, port: WorkerPort, token: int | None, families: list) -> None:
        """``port``'s worker sent its metric families: for the scrape ``token``, or unasked (None) once it started."""
        with self._lock:
            port.families = families
            entry = self._renders.get(token)
            if entry is None:  # unasked, or too late: that scrape has answered
                return
            done, waiting = entry
            waiting.discard(port.serial)
            if not waiting:
                done.set()
