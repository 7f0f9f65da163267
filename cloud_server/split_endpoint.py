"""The split WebSocket endpoint (``/v1/split``): WebSocket I/O and dispatch for the protocol in ``shared.protocol``.

Per connection::

    Hello  -> checks (version, bundle id, draining, max sessions, codecs) -> Welcome | Error + close
    loop:  frame -> decode -> the session's state machine (shared.session_state: every protocol rule)
                 -> dispatch: Prefill / DecodeStep / SpecStep / Cancel / Resume to the translator (cloud_server.split_translate)
           Close -> free everything, close 1000
    engine outputs -> Tokens | Error(request_id), by the translator

This module owns the socket side only: accept, handshake, the read loop, one writer task per connection,
detach and expiry, close codes, drain. The rules are the shared state machine's, the message <-> engine
translation the translator's, and what the engine is (variants, sizes) comes from ``runtime.facts``, fixed
at start: nothing here reads the running engine.

Refusals: a bundle mismatch closes with 1008, an overload (``max_sessions``) or a draining server with 1013,
a malformed frame or a fatal rule violation with 1002 (``version`` 1008, ``too_large`` 1009:
``shared.errors.fatal_close_code``); each after an ``Error`` naming the cause. A fatal ``Error`` the edge caused
(those two, a revoked key) ends its session at once, as a ``Close`` does: nothing to resume. A rule broken by one
request (``too_large``, ``bad_position``, ``context_full``, ...) fails that request and leaves the session open.
Frames up to :data:`OVERSIZE_SLACK` bytes over ``max_frame_bytes`` are still parsed, so an over-size chunk fails
its request (``too_large``) rather than the session; larger ones are not read: the ASGI server closes the link
(1009) and the session ends with it, as after a fatal ``too_large`` (a frame the server
could not read names no request it could fail: nothing to resume).

Disconnects: the session is detached, not dropped; its requests keep their KV for ``session_grace_s``
(``limits.resume_window_ms``) and a reconnect with the resume token reattaches it (``Welcome.resumed``,
``Welcome.requests``). The engine never waits for a link: outputs for a detached session are recorded and
resent on ``Resume`` - tokens; a u-shape request's ``States`` are not kept: its ``Resume`` rolls it back to the
positions the edge holds, which resends its inputs from there (``cloud_server.split_translate``).

Front-end workers (``--workers N``, ``cloud_server.front_workers``): the same endpoint runs in each worker over
a ``RemoteEngine``; the runtime's ``peers`` count sessions over every worker (admission, release), session ids
start with the worker's ``w<i>-``, and a resume token another worker holds opens a new session here (the edge
replays) while that worker closes the old one (``cloud_server.session_ledger``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

from cloud_server.config import ServerConfig
from cloud_server.auth import principal_of, still_authorized
from cloud_server.engine.async_engine import EngineDeadError
from cloud_server.engine.speculation import MAX_DRAFTS
from cloud_server.idle_deadline import IdleDeadline
from cloud_server.limits import RETRY_AFTER_MS, session_cap_refusal
from cloud_server.precision_select import load_fraction, session_plan
from cloud_server.session_store import Session, SessionRegistry
from cloud_server.split_translate import SplitTranslator
from cloud_server.usage import TenantUsage
from cloud_server.ws_protocol import ABORT, SEND_NOW
from shared import protocol as P
from shared.codecs import available_codecs, load_calibration
from shared.errors import fatal_close_code
from shared.prefix_keys import SHARED_SCOPE
from shared.session_state import SessionError, SessionState
from shared.version import __version__

log = logging.getLogger("autoglm.cloud.split")

CLOSE_NORMAL, CLOSE_PROTOCOL, CLOSE_POLICY, CLOSE_TOO_BIG, CLOSE_INTERNAL, CLOSE_TRY_LATER = (
    1000, 1002, 1008, 1009, 1011, 1013)
CLOSE_REASON_BYTES = 123  # RFC 6455 5.5: a close frame's payload is at most 125 bytes, 2 of them the code


def close_reason(text: str) -> str:
    """``text`` cut to what a close frame carries: 123 bytes of UTF-8, whole characters only. An Error message that
    echoes a peer's non-ASCII id, cut at 120 characters, was longer: the close failed and the peer got none (1006)."""
    return text.encode()[:CLOSE_REASON_BYTES].decode(errors="ignore")


HELLO_TIMEOUT_S = 30.0  # a connection that sends no Hello within this is closed (bad_state)
IDLE_FLOOR_S = 300.0  # a quiet session (a user reading) is closed after max(step timeout, this); it stays resumable
OVERSIZE_SLACK = 1 << 20  # frames this far over max_frame_bytes are parsed and refused per request
OUTBOX_PAUSE_BYTES = 4 << 20  # frames waiting for a peer that does not read them: its link is not read meanwhile
OUTBOX_STALL_S = 30.0  # ...and is dropped if they still wait after this (the session stays resumable)
# progress Tokens (docs/protocol.md, "Progress"): checked every tick, sent for a request quiet this long, so
# no request waits longer than P.PROGRESS_INTERVAL_S for a sign of life
PROGRESS_TICK_S = P.PROGRESS_INTERVAL_S / 3
PROGRESS_QUIET_S = P.PROGRESS_INTERVAL_S - PROGRESS_TICK_S
DEFAULTS = P.SessionLimits()  # the protocol's documented defaults: the reference configuration must produce them


def session_limits(cfg: ServerConfig) -> P.SessionLimits:
    """What this server accepts on a session (``Welcome.limits``), from its configuration."""
    ecfg = cfg.engine
    return P.SessionLimits(
        # the pool bounds a request's context too (EngineConfig.max_context): the edge stops there (finish "length")
        max_frame_bytes=DEFAULTS.max_frame_bytes, max_context=ecfg.max_context,
        max_prefill_chunk_tokens=ecfg.max_num_batched_tokens,
        max_concurrent_requests=max(1, min(ecfg.max_num_seqs, DEFAULTS.max_concurrent_requests)),
        prefix_block_tokens=ecfg.block_size,
        idle_timeout_ms=int(max(cfg.step_timeout_s, IDLE_FLOOR_S) * 1000),
        resume_window_ms=int(cfg.session_grace_s * 1000),
        max_prompt_tokens=cfg.max_prompt_tokens or 0)  # 0: max_context bounds the prompt


def held_prefix_keys(engine, variant: str, scopes: tuple[str, ...], limit: int) -> list[str]:
    """Up to ``limit`` prefix keys the pool of compute ``variant`` holds in the key scopes ``scopes`` (scope
    stripped), the most recently used first (a busy tenant's hot system prompt is listed, not its oldest blocks), on
    the engine thread; module-level so a front-end worker can send it (``engine.call``). It reads those scopes' first
    keys only: a ``Hello`` costs the engine thread the same however many blocks other tenants keep cached."""
    keys = (k.partition("/")[2] for k in engine.block_managers[variant].keys_by_recency(scopes))
    return list(dict.fromkeys(k for _, k in zip(range(limit), keys)))


def ws_send_now(ws) -> Callable[[bytes], bool] | None:
    """The connection's synchronous binary send (``cloud_server.ws_protocol``), or None (another server)."""
    extensions = getattr(ws, "scope", {}).get("extensions") or {}
    return extensions.get(SEND_NOW)


def ws_abort(ws) -> Callable[[], None] | None:
    """The connection's abort (``cloud_server.ws_protocol``: drop it without a close handshake), or None."""
    extensions = getattr(ws, "scope", {}).get("extensions") or {}
    return extensions.get(ABORT)


class Outbox(asyncio.Queue):
    """``Session.outq``: one connection's frames, in order. A frame goes out at once through ``send_now`` (the
    protocol's own write) when nothing waits before it; the others - no ``send_now``, the transport paused
    for writing, frames queued or being sent - wait for the connection's writer task (``writing``: it holds a
    frame it has not finished sending). ``on_sent(nbytes)`` counts what went out at once.

    ``room`` is clear while more than :data:`OUTBOX_PAUSE_BYTES` wait: the connection's read loop then reads nothing more
    from the peer (a client that sends without reading what comes back would otherwise grow this queue with
    every reply, without bound) until the writer has sent them, or the writer is gone (``close``)."""

    def __init__(self, send_now: Callable[[bytes], bool] | None, on_sent: Callable[[int], None]):
        super().__init__()
        self._send_now, self._on_sent, self._pause_bytes = send_now, on_sent, OUTBOX_PAUSE_BYTES
        self.writing = False
        self.waiting_bytes = 0
        self.room = asyncio.Event()
        self.room.set()
        self._closed = False

    def put_nowait(self, frame: bytes) -> None:
        if self._send_now is not None and not self.writing and self.empty() and self._send_now(frame):
            self._on_sent(len(frame))
            return
        super().put_nowait(frame)
        self.waiting_bytes += len(frame)
        if self.waiting_bytes > self._pause_bytes and not self._closed:
            self.room.clear()

    def sent(self, nbytes: int) -> None:
        """The writer sent a queued frame of ``nbytes``."""
        self.waiting_bytes -= nbytes
        if self.waiting_bytes <= self._pause_bytes:
            self.room.set()

    def close(self) -> None:
        """The writer is gone (the link closed, or another took the session over): nothing waits for room."""
        self._closed = True
        self.room.set()


def transport_max_frame_bytes(limits: P.SessionLimits) -> int:
    """The largest WebSocket message the server reads at all (the ASGI server's ``ws_max_size``)."""
    return limits.max_frame_bytes + OVERSIZE_SLACK


class SplitEndpoint:
    def __init__(self, runtime):
        self.rt = runtime
        cfg = runtime.config
        # front-end workers (--workers): sessions are counted over every worker, their ids say which one
        self.peers = getattr(runtime, "peers", None)
        self.registry = SessionRegistry(cfg.max_sessions, "" if self.peers is None else f"w{self.peers.worker}-")
        calib = load_calibration(cfg.bundle) if cfg.bundle is not None else None
        self.codecs = available_codecs(calib)  # name -> codec able to decode
        self.limits = session_limits(cfg)
        self.max_message_bytes = transport_max_frame_bytes(self.limits)
        self.wire_limits = P.Limits(max_frame_bytes=self.max_message_bytes, max_items=P.CLIENT_MESSAGE_ITEMS)
        self.translate = SplitTranslator(runtime, self.codecs, self.wire_limits, self._load)
        self.served_bundle_ids: list[str] = []  # every bundle this process serves (set by cloud_server.bundle_set)
        self.drain_grace_ms = 0  # the Drain's grace, once draining
        self.translate.on_engine_dead = self._engine_dead
        self._progress: asyncio.TimerHandle | None = None  # the next progress check, while sessions are open
        if self.peers is not None:
            self.peers.on_reclaim = self._reclaimed

    def _load(self) -> float:
        n = self.registry.open_requests()
        if self.peers is not None:  # every worker's, as the engine last counted them
            n = max(n, self.peers.open_requests_all)
        return load_fraction(n, self.rt.facts)

    # -- connection -------------------------------------------------------------------------------
    async def serve(self, ws: WebSocket, first: dict | None = None) -> None:
        """One connection. ``first``: its first frame, already read off an accepted socket by a router that
        picked this endpoint by the Hello's bundle id (``cloud_server.bundle_set``)."""
        if first is None:
            await ws.accept()
        session = await self._handshake(ws, first)
        if session is None:
            return
        generation = session.generation
        self._arm_progress()
        writer = asyncio.create_task(self._writer(ws, session.outq))
        try:
            await self._read_loop(ws, session)
        finally:
            if session.generation == generation:  # not taken over by a newer connection
                self._detach(session)
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)  # the link is gone either way

    async def _refuse(self, ws: WebSocket, code: str, message: str, close_code: int,
                      retry_after_ms: int | None = None, bundle_ids: list[str] | None = None,
                      reason: str | None = None) -> None:
        """A connection's session refused at its handshake: a fatal ``Error(code)``, the close, and one count in
        ``autoglm:sessions_refused_total{reason}`` (``reason``: ``code`` unless told; every refusal, so that a
        fleet of phones refused for their protocol version or codecs shows on the dashboard)."""
        if self.rt.metrics is not None:
            self.rt.metrics.on_refused(reason or code)
        try:
            await ws.send_bytes(P.encode_message(P.Error(code=code, message=message, fatal=True,
                                                         retry_after_ms=retry_after_ms,
                                                         bundle_ids=list(bundle_ids or []))))
            await ws.close(code=close_code, reason=close_reason(message))
        except Exception:  # the peer may already be gone
            log.debug("refusal not delivered", exc_info=True)

    async def _handshake(self, ws: WebSocket, first_frame: dict | None = None) -> Session | None:
        rt, metrics = self.rt, self.rt.metrics
        first = SessionState()  # the rulebook from the first frame on: only a Hello opens a session
        try:
            frame = first_frame if first_frame is not None else await asyncio.wait_for(
                ws.receive(), rt.config.handshake_timeout_s)
            if frame.get("type") == "websocket.disconnect":
                return None
            if frame.get("bytes") is None:
                raise P.ProtocolError("bad_frame", "frames are binary msgpack, got a text frame")
            hello = P.decode_message(frame["bytes"], self.wire_limits)
            first.on_client(hello, len(frame["bytes"]))
        except asyncio.TimeoutError:
            await self._refuse(ws, "bad_state", f"no Hello within {rt.config.handshake_timeout_s:g} s", CLOSE_PROTOCOL)
            return None
        except (P.ProtocolError, SessionError) as e:
            await self._refuse(ws, e.code, e.message, fatal_close_code(e.code))
            return None
        if hello.bundle_id != rt.bundle_id:
            served = self.served_bundle_ids or [rt.bundle_id]  # GET /v1/bundles has them
            # every served id in the words too: naming the default alone said a several-bundle server served it only
            await self._refuse(ws, "bundle_mismatch", f"this server serves bundle{'s' * (len(served) > 1)} "
                                                      f"{', '.join(served)}, the edge has {hello.bundle_id}",
                               CLOSE_POLICY, bundle_ids=served)
            return None
        if rt.engine is None or not rt.engine.alive:
            await self._refuse(ws, "internal", f"engine not running: {rt.engine.dead if rt.engine else 'starting'}",
                               CLOSE_INTERNAL)
            return None
        codecs = [c for c in hello.codecs if c in self.codecs]
        if not codecs:
            await self._refuse(ws, "codec_not_negotiated", f"none of the edge's codecs {hello.codecs} is "
                                                           f"supported (server: {sorted(self.codecs)})",
                               CLOSE_POLICY)
            return None
        principal = principal_of(ws)  # cloud_server.auth: who the key says this is; its tenant scopes the cache
        tenant = principal.tenant
        session = self.registry.for_resume(hello.resume_token, principal)
        resumed = session is not None
        if rt.draining and not resumed:  # a session held here resumes, so that its open requests can finish
            await self._refuse(ws, "draining", "server is draining; connect to another replica",
                               CLOSE_TRY_LATER, retry_after_ms=RETRY_AFTER_MS["draining"])
            return None
        if not resumed:
            session_id, token = self.registry.mint()
            try:
                refusal = await self._admit(principal, session_id, token, hello.resume_token)
            except EngineDeadError as e:
                await self._refuse(ws, "internal", str(e), CLOSE_INTERNAL)
                return None
            if refusal is not None:
                await self._refuse(ws, "overloaded", refusal[1], CLOSE_TRY_LATER,
                                   retry_after_ms=RETRY_AFTER_MS["overloaded"], reason=refusal[0])
                return None
            session = self.registry.create(codecs, session_plan(hello, codecs, rt.facts, self._load()), tenant,
                                           session_id, token)
            session.state = first
            session.principal, session.usage = principal, TenantUsage.of(metrics)
            session.usage.on_open(session)
        else:
            session.codecs = codecs
            session.state.reconnect()
            session.state.on_client(hello)
        if session.expiry is not None:
            session.expiry.cancel()
            session.expiry = None
        # read before attaching: an engine output queued during this await would reach the edge before Welcome
        cached = await self._cached_keys(session.prefix_scope, session.plan.compute)
        if session.closed:  # closed while we waited (a Close on the link this one replaces)
            await self._refuse(ws, "bad_state", "the session closed while resuming; open a new one", CLOSE_NORMAL)
            return None
        if session.attached:  # after the await: a link that died silently, or a concurrent resume of the same
            # token that attached first - this reconnect takes the session over, so one link serves it
            old = session.ws
            session.outq.close()  # its read loop may wait for room that its writer will never make
            asyncio.get_running_loop().create_task(self._close(old, CLOSE_NORMAL, "replaced by a new connection",
                                                               flush=False))
        session.generation += 1
        session.outq, session.ws = Outbox(ws_send_now(ws), self.rt.metrics.on_downlink), ws
        metrics.sessions.labels(rt.model_name).set(len(self.registry))
        session.send(P.Welcome(
            session_id=session.session_id, resume_token=session.resume_token, resumed=resumed, limits=self.limits,
            plan=session.plan, codecs=codecs, server=self._server_info(), cached_prefixes=cached,
            requests=[P.RequestState(request_id=t.request_id, received=t.received, tokens=t.tokens)
                      for t in session.state.requests.values()] if resumed else []))
        if rt.draining:  # resumed while draining: no new requests on it either
            session.send(self._drain_message())
        return session

    async def _admit(self, principal, session_id: str, token: str, presented: str | None) -> tuple[str, str] | None:
        """Why a new session may not open (``(metric reason, message)``), or None. One process counts its own
        sessions; front-end workers (``--workers``) ask the engine process, which counts them all
        (``cloud_server.session_ledger``) and reclaims the session of ``presented``, a resume token this
        worker does not hold, from the worker that does: the edge replays here."""
        if self.peers is not None:
            return await self.peers.admit(session_id, token, principal, presented)
        if self.registry.full:
            return "overloaded", f"server at its limit of {self.registry.max_sessions} sessions; retry later"
        capped = session_cap_refusal(self.registry, principal)
        return None if capped is None else ("key_session_cap", capped)

    def _reclaimed(self, session_id: str) -> None:
        """(``--workers``) This session's edge reconnected to another worker, which serves it from now on."""
        session = self.registry.by_id.get(session_id)
        if session is None:
            return
        ws = session.ws
        self._close_session(session)
        if ws is not None:
            asyncio.get_running_loop().create_task(self._close(ws, CLOSE_NORMAL, "resumed on another worker",
                                                               flush=False))

    @staticmethod
    async def _close(ws: WebSocket, code: int, reason: str = "", flush: bool = True) -> None:
        """Close the link (after letting the writer flush a last Error); the peer may be gone already."""
        if flush:
            await asyncio.sleep(0.05)
        try:
            await ws.close(code=code, reason=close_reason(reason))
        except Exception:  # a disconnected peer: nothing to close
            log.debug("close after disconnect", exc_info=True)

    def _server_info(self) -> P.ServerInfo:
        return P.ServerInfo(version=__version__, compute_variants=list(self.rt.facts.variants),
                            load=float(self._load()), max_draft_tokens=MAX_DRAFTS,
                            cloud_drafts=self.rt.facts.cloud_drafts, prefix_cache=self.rt.facts.prefix_cache)

    async def _cached_keys(self, scope: str, variant: str, limit: int = 256) -> list[str]:
        """Prefix keys the pool of ``variant`` (the session plan's compute, ``Welcome.plan.compute``: the edge notes
        them for that variant only) holds that a session of prefix ``scope`` can hit: its own and the shared scope's
        (advisory: the edge may skip uploading those blocks), read on the engine thread."""
        try:
            fut = self.rt.engine.call(functools.partial(held_prefix_keys, variant=variant, scopes=(scope, SHARED_SCOPE),
                                                        limit=limit))
            return await asyncio.wait_for(asyncio.wrap_future(fut), 5.0)
        except (EngineDeadError, asyncio.TimeoutError):
            return []

    async def _writer(self, ws: WebSocket, queue: Outbox) -> None:
        """The frames the socket did not take at once (a slow reader, or no ``send_now``), in order."""
        try:
            while True:
                frame = await queue.get()
                queue.writing = True
                try:
                    await ws.send_bytes(frame)
                finally:
                    queue.writing = False
                queue.sent(len(frame))
                self.rt.metrics.on_downlink(len(frame))
        finally:
            queue.close()

    def _arm_progress(self) -> None:
        if self._progress is None:
            self._progress = asyncio.get_running_loop().call_later(PROGRESS_TICK_S, self._send_progress)

    def _send_progress(self) -> None:
        """Progress Tokens for the requests that owe an answer and have been quiet (a long prefill, a queue); a
        stopped engine sends none (its requests fail instead). Re-armed while any session is open."""
        self._progress = None
        if not self.registry.by_id:
            return
        if self.rt.engine is not None and self.rt.engine.alive:
            now = time.monotonic()
            for session in list(self.registry.by_id.values()):
                if session.attached:
                    self.translate.send_progress(session, now, PROGRESS_QUIET_S)
        self._arm_progress()

    def _detach(self, session: Session) -> None:
        session.outq, session.ws = None, None
        if session.closed:
            return
        grace = self.rt.config.session_grace_s
        session.expiry = asyncio.get_running_loop().call_later(grace, self._expire, session)

    def _expire(self, session: Session) -> None:
        if not session.attached:
            self._close_session(session)

    def _close_session(self, session: Session) -> None:
        for rec in session.active_requests():
            self.rt.engine.abort(rec.engine_id)
        self.registry.remove(session)  # the state closes: late engine outputs are dropped
        if self.peers is not None:
            self.peers.release(session.session_id)
        session.usage.on_close(session)
        self.rt.metrics.sessions.labels(self.rt.model_name).set(len(self.registry))

    # -- messages ---------------------------------------------------------------------------------
    async def _read_loop(self, ws: WebSocket, session: Session) -> None:
        loop = asyncio.get_running_loop()
        # a quiet link is closed (the session stays resumable); receive() then returns the disconnect
        deadline = IdleDeadline(max(1.0, self.limits.idle_timeout_ms / 1000),
                                lambda: loop.create_task(self._close(ws, CLOSE_NORMAL, "idle", flush=False)))
        try:
            await self._read_frames(ws, session, session.outq, deadline)
        finally:
            deadline.cancel()

    async def _read_frames(self, ws: WebSocket, session: Session, outbox: Outbox, deadline: IdleDeadline) -> None:
        while True:
            if not outbox.room.is_set():  # a peer that does not read its replies is not read either
                try:
                    await asyncio.wait_for(outbox.room.wait(), OUTBOX_STALL_S)
                except asyncio.TimeoutError:  # nor kept: its session's slot is free to resume elsewhere
                    log.info("session %s: %d bytes unread for %.0f s, dropping the link", session.session_id,
                             outbox.waiting_bytes, OUTBOX_STALL_S)
                    if (abort := ws_abort(ws)) is not None:
                        abort()
                    await outbox.room.wait()  # the lost link ends the writer, which makes room
            try:
                frame = await ws.receive()
            except WebSocketDisconnect as e:
                frame = {"type": "websocket.disconnect", "code": e.code}
            if frame.get("type") == "websocket.disconnect":
                if frame.get("code") == CLOSE_TOO_BIG:  # a frame over what the server reads at all: a fatal too_large
                    self._close_session(session)
                return
            deadline.touch()
            data = frame.get("bytes")
            try:
                if data is None:
                    raise P.ProtocolError("bad_frame", "frames are binary msgpack, got a text frame")
                msg = P.decode_message(data, self.wire_limits)
                track = session.state.on_client(msg, len(data))
                session.usage.on_received(session, msg, len(data))
            except P.ProtocolError as e:
                await self._end(session, ws, P.Error(code=e.code, message=e.message, fatal=True),
                                fatal_close_code(e.code))
                return
            except SessionError as e:
                if e.fatal:
                    await self._end(session, ws, e.to_error(), fatal_close_code(e.code))
                    return
                if e.request_id is None:  # no request to fail: answer and go on
                    session.send(e.to_error())
                else:
                    self.translate.fail(session, e.request_id, e.code, e.message, e.retry_after_ms)
                continue
            if isinstance(msg, P.Close) or isinstance(msg, P.Error) and msg.fatal:  # the edge ends the session
                self._close_session(session)
                await self._close(ws, CLOSE_NORMAL)
                return
            if isinstance(msg, P.Prefill) and track is not None and track.owner is None and \
                    not still_authorized(ws, session.principal):
                await self._end(session, ws, P.Error(code="unauthorized", fatal=True,
                                                     message="the API key of this session was revoked, or its keys "
                                                             "file entry now names another tenant or role; open a "
                                                             "new session"), CLOSE_POLICY)
                return
            try:
                self._dispatch(session, msg, track, len(data))
            except EngineDeadError as e:
                session.send(P.Error(code="internal", message=str(e), fatal=True))
                await self._close(ws, CLOSE_INTERNAL, "engine stopped")
                return

    async def _end(self, session: Session, ws: WebSocket, error: P.Error, close_code: int) -> None:
        """A fatal ``error`` of the edge's making ends the session, as the protocol says: its requests are aborted and
        its resume token is forgotten (a reconnect with it opens a new session), then the link closes."""
        session.send(error)
        self._close_session(session)
        await self._close(ws, close_code, error.message)

    def _engine_dead(self, session: Session, e: EngineDeadError) -> None:
        """The engine stopped while the translator handed it held steps: as in the read loop, tell and close."""
        session.send(P.Error(code="internal", message=str(e), fatal=True))
        if session.ws is not None:
            asyncio.get_running_loop().create_task(self._close(session.ws, CLOSE_INTERNAL, "engine stopped"))

    def _dispatch(self, session: Session, msg, track, nbytes: int) -> None:
        """Act on a message the state machine accepted; ``track`` None: nothing to do (a late message)."""
        if isinstance(msg, P.Error):  # its message is the peer's text: quoted and escaped, one line (a newline in it
            # wrote a log line of the sender's making, e.g. a trace line billing another tenant's tokens)
            log.info("edge %s reports %s: %r", session.session_id, msg.code, msg.message)
        if track is None:
            return
        if isinstance(msg, P.Prefill) and track.owner is None:
            self.translate.open(session, track, msg, nbytes)
        elif isinstance(msg, (P.Prefill, P.DecodeStep, P.SpecStep, P.StatesStep)):
            self.translate.more_input(session, track, msg, nbytes)
        elif isinstance(msg, (P.Cancel, P.Error)):  # an edge's Error naming an open request closes it as a Cancel
            self.translate.cancel(track)
        elif isinstance(msg, P.Resume):
            self.translate.resume(session, track, msg)

    # -- drain ------------------------------------------------------------------------------------
    def drain(self, grace_ms: int) -> None:
        """Tell every edge the server is going away (on the event loop thread): no new requests from now. New
        sessions are refused (``draining``); one held here may still resume (a phone's link that dropped during the
        drain), so that its open requests finish here."""
        self.drain_grace_ms = grace_ms
        for s in list(self.registry.by_id.values()):
            s.send(self._drain_message())

    def _drain_message(self) -> P.Drain:
        return P.Drain(grace_ms=self.drain_grace_ms, reason="server shutting down")
