"""The engine process's side of ``--workers N``: one :class:`WorkerPort` per front-end worker, over one engine.

The main process runs the :class:`~cloud_server.runtime.CloudRuntime` (model, ``AsyncEngine``, KV pool, prefix
cache, engine metrics); :class:`EngineHost` serves the workers' links (``cloud_server.engine_link``):

* a **reader thread** per worker applies its frames to the engine: ``add`` -> ``add_request`` with the port's
  sink, ``inputs`` -> one ``add_rows`` (a loop turn's plain decode steps: their ``[S, H]`` array as it came) or
  ``add_inputs`` (chunks of several rows, 3-D RoPE, drafts), ``abort``,
  ``ask`` (an engine ``call``, a session admission, a metrics scrape), ``release``;
* the port's **sink** collects the outputs of one engine step for that worker (engine thread) and hands them
  over as one message when the step's deliveries are done: the first output of a step queues a ``call`` on
  the engine's own command queue, which the engine thread runs right after delivering the step (the
  ``LoopInbox`` idea across a process boundary: one frame per step per worker, no hook in the engine);
* a **writer thread** per worker pickles and sends what is queued for it, coalescing bursts into one frame.

Sessions over every worker are counted here (``cloud_server.session_ledger``). ``/metrics`` on any worker is
answered here: the engine's registry merged with every worker's (``cloud_server.metrics.render_merged``). A
worker whose link closes (its process died) has its requests aborted and its sessions released.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from cloud_server.engine.async_engine import EngineDeadError
from cloud_server.engine.llm_engine import RequestOutput
from cloud_server.engine_link import Link, facts_to_wire, pack_output, unpack_chunks
from cloud_server.metrics import render_merged
from cloud_server.session_ledger import LedgerEntry, SessionLedger

log = logging.getLogger("autoglm.cloud.host")
RENDER_TIMEOUT_S = 2.0  # a scrape waits this long for the workers' metric families


class WorkerPort:
    """The engine process's end of worker ``index``'s link; ``serial`` names this link (a replaced worker's
    successor has the same index and a new serial: the session ledger counts by serial)."""

    def __init__(self, host: EngineHost, index: int, serial: int, link: Link):
        self.host, self.index, self.serial, self.link = host, index, serial, link
        self.requests: set[str] = set()  # engine ids this worker opened and the engine still runs
        self._step: list[tuple] = []  # this step's packed outputs (engine thread)
        self._sendq: queue.SimpleQueue = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name=f"autoglm-port-{index}-in", daemon=True)
        self._writer = threading.Thread(target=self._write, name=f"autoglm-port-{index}-out", daemon=True)

    def start(self) -> WorkerPort:
        self._writer.start()
        self._reader.start()
        return self

    def send(self, msg: tuple | None) -> None:
        """Queue ``msg`` for the writer thread (None: stop it, after what is queued)."""
        self._sendq.put(msg)

    def close(self) -> None:
        self._sendq.put(None)
        self._writer.join(5)
        self.link.close()

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

    # -- threads -----------------------------------------------------------------------------------------
    def _write(self) -> None:
        while True:
            batch = [self._sendq.get()]
            while True:
                try:
                    batch.append(self._sendq.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            batch = [m for m in batch if m is not None]
            try:
                if batch:
                    self.link.send(batch)
            except OSError:
                return
            if stop:
                return

    def _read(self) -> None:
        try:
            while True:
                for msg in self.link.recv():
                    self._apply(msg)
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("worker %d: bad frame on the engine link", self.index)
        finally:
            self.host.worker_gone(self)

    def _apply(self, msg: tuple) -> None:
        kind, engine = msg[0], self.host.engine
        try:
            if kind == "inputs":
                rows, starts, lasts, stacked, ropes, drafts, asks = msg[2]
                if ropes is None and drafts is None and asks is None and all(lasts) and rows.count(1) == len(rows):
                    engine.add_rows(msg[1], starts, torch.from_numpy(stacked))  # plain decode steps: [S, H]
                else:
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

    def attach(self, index: int, link: Link) -> WorkerPort:
        """Serve worker ``index`` on ``link``: its hello (the engine's facts) goes out first."""
        port = WorkerPort(self, index, next(self._serials), link)
        with self._lock:
            self.ports[port.serial] = port
        port.send(("hello", facts_to_wire(self.rt.facts), self.rt.model_name))
        return port.start()

    def worker_gone(self, port: WorkerPort) -> None:
        """``port``'s link closed: abort what its worker left running and forget its sessions."""
        with self._lock:
            self.ports.pop(port.serial, None)
        port.send(None)  # ends its writer thread
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
        for port in list(self.ports.values()):
            port.close()
        self._scrapes.shutdown(wait=False)

    # -- requests from workers (their reader threads) ----------------------------------------------------
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
