"""The split WebSocket endpoint (``/v1/split``): the cloud side of the protocol in ``shared.protocol``.

Per connection::

    Hello  -> checks (version, bundle id, draining, max sessions, codecs) -> Welcome | Error + close
    loop:  Prefill    -> open a request (first chunk: params, prefix keys) or continue its prompt
           DecodeStep -> the hidden state of the token we sent last
           Cancel     -> abort; final Tokens(finish_reason="cancelled")
           Resume     -> Resumed(received, tokens the edge lacks) | Error(resume_failed)
           Close      -> free everything, close 1000
    engine outputs -> Tokens (one per sampled token; usage on the last) | Error(request_id)

Refusals: a bundle mismatch closes with 1008, an overload (``max_sessions``) or a draining server with 1013,
a malformed frame with 1002; each after an ``Error`` naming the cause. Errors about one request
(``prefix_miss``, ``bad_position``, ``context_full``, ...) leave the session open.

Disconnects: the session is detached, not dropped; its requests keep their KV for ``session_grace_s``
(``limits.resume_window_ms``) and a reconnect with the resume token reattaches it (``Welcome.resumed``,
``Welcome.requests``). The engine never waits for a link: outputs for a detached session are recorded and
resent on ``Resume``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import numpy as np
import torch
from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

from cloud_server.engine.async_engine import EngineDeadError
from cloud_server.engine.llm_engine import RequestOutput
from cloud_server.engine.sampling_params import SamplingParams, SamplingParamsError
from cloud_server.engine.sequence import InputChunk
from cloud_server.precision_select import request_compute, session_plan
from cloud_server.session_store import RequestRecord, Session, SessionRegistry
from shared import protocol as P
from shared.codecs import available_codecs
from shared.version import __version__

log = logging.getLogger("autoglm.cloud.split")

CLOSE_NORMAL, CLOSE_PROTOCOL, CLOSE_POLICY, CLOSE_INTERNAL, CLOSE_TRY_LATER = 1000, 1002, 1008, 1011, 1013
HELLO_TIMEOUT_S = 30.0
MAX_FRAME_BYTES = 16 << 20

# engine error code -> wire code (shared.errors.SESSION_ERROR_CODES)
_WIRE_CODES = {"too_long": "context_full", "kv_cache_full": "overloaded", "engine_error": "internal",
               "timeout": "internal", "bad_input": "bad_value", "unknown_request": "unknown_request",
               "duplicate_request": "duplicate_request", "prefix_miss": "prefix_miss"}
# engine finish reason -> wire finish reason
_WIRE_FINISH = {"stop": "stop", "length": "length", "abort": "cancelled", "cancelled": "cancelled"}


def to_engine_params(p: P.SamplingParams | None, max_context: int) -> SamplingParams:
    p = p or P.SamplingParams()
    want_lp = p.logprobs or p.top_logprobs > 0
    return SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                          max_tokens=min(p.max_tokens, max_context), stop_token_ids=list(p.stop_token_ids),
                          ignore_eos=p.ignore_eos, logprobs=p.top_logprobs if want_lp else None,
                          presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                          repetition_penalty=p.repetition_penalty)


class SplitEndpoint:
    def __init__(self, runtime):
        self.rt = runtime
        cfg = runtime.config
        self.registry = SessionRegistry(cfg.max_sessions)
        calib = None
        if cfg.bundle is not None and (cfg.bundle / "calibration.json").is_file():
            calib = json.loads((cfg.bundle / "calibration.json").read_text())
        self.codecs = available_codecs(calib)  # name -> codec able to decode
        ecfg = cfg.engine
        self.limits = P.SessionLimits(
            max_frame_bytes=MAX_FRAME_BYTES, max_context=ecfg.max_model_len,
            max_prefill_chunk_tokens=ecfg.max_num_batched_tokens,
            max_concurrent_requests=max(1, min(ecfg.max_num_seqs, 16)), prefix_block_tokens=ecfg.block_size,
            # A quiet session (a user reading) is closed after max(step timeout, 5 min); it stays resumable.
            idle_timeout_ms=int(max(cfg.step_timeout_s, 300.0) * 1000),
            resume_window_ms=int(cfg.session_grace_s * 1000))
        self.wire_limits = P.Limits(max_frame_bytes=MAX_FRAME_BYTES + 4096)

    # -- connection -------------------------------------------------------------------------------
    async def serve(self, ws: WebSocket) -> None:
        await ws.accept()
        session = await self._handshake(ws)
        if session is None:
            return
        generation = session.generation
        writer = asyncio.create_task(self._writer(ws, session.outq))
        try:
            await self._read_loop(ws, session)
        finally:
            if session.generation == generation:  # not taken over by a newer connection
                self._detach(session)
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)  # the link is gone either way

    async def _refuse(self, ws: WebSocket, code: str, message: str, close_code: int,
                      retry_after_ms: int | None = None) -> None:
        try:
            await ws.send_bytes(P.encode_message(P.Error(code=code, message=message, fatal=True,
                                                         retry_after_ms=retry_after_ms)))
            await ws.close(code=close_code, reason=message[:120])
        except Exception:  # the peer may already be gone
            log.debug("refusal not delivered", exc_info=True)

    async def _handshake(self, ws: WebSocket) -> Session | None:
        rt, metrics = self.rt, self.rt.metrics
        try:
            frame = await asyncio.wait_for(ws.receive(), HELLO_TIMEOUT_S)
            if frame.get("type") == "websocket.disconnect":
                return None
            if frame.get("bytes") is None:
                raise P.ProtocolError("bad_frame", "frames are binary msgpack, got a text frame")
            hello = P.decode_message(frame["bytes"], self.wire_limits)
        except asyncio.TimeoutError:
            await self._refuse(ws, "bad_state", f"no Hello within {HELLO_TIMEOUT_S:g} s", CLOSE_PROTOCOL)
            return None
        except P.ProtocolError as e:
            close = CLOSE_POLICY if e.code == "version" else CLOSE_PROTOCOL
            await self._refuse(ws, e.code, e.message, close)
            return None
        if not isinstance(hello, P.Hello):
            await self._refuse(ws, "bad_state", f"expected Hello, got {type(hello).__name__}", CLOSE_PROTOCOL)
            return None
        if hello.bundle_id != rt.bundle_id:
            metrics.refused.labels(rt.model_name, "bundle_mismatch").inc()
            await self._refuse(ws, "bundle_mismatch", f"this server serves bundle {rt.bundle_id}, the edge has "
                                                      f"{hello.bundle_id}", CLOSE_POLICY)
            return None
        if rt.draining:
            metrics.refused.labels(rt.model_name, "draining").inc()
            await self._refuse(ws, "draining", "server is draining; connect to another replica",
                               CLOSE_TRY_LATER, retry_after_ms=5000)
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
        session = self.registry.for_resume(hello.resume_token)
        resumed = session is not None
        if not resumed:
            if self.registry.full:
                metrics.refused.labels(rt.model_name, "overloaded").inc()
                await self._refuse(ws, "overloaded", f"server at its limit of {self.registry.max_sessions} "
                                                     "sessions; retry later", CLOSE_TRY_LATER, retry_after_ms=1000)
                return None
            session = self.registry.create(codecs, session_plan(hello, codecs, rt))
        else:
            session.codecs = codecs
            if session.attached:  # the old link died silently: this reconnect takes the session over
                old = session.ws
                asyncio.get_running_loop().create_task(self._close(old, CLOSE_NORMAL, "replaced by a new "
                                                                                     "connection", flush=False))
        if session.expiry is not None:
            session.expiry.cancel()
            session.expiry = None
        session.generation += 1
        session.outq, session.ws = asyncio.Queue(), ws
        metrics.sessions.labels(rt.model_name).set(len(self.registry))
        welcome = P.Welcome(
            session_id=session.session_id, resume_token=session.resume_token, resumed=resumed, limits=self.limits,
            plan=session.plan, codecs=codecs, server=self._server_info(), cached_prefixes=await self._cached_keys(),
            requests=[P.RequestState(request_id=r.request_id, received=r.received, tokens=len(r.tokens))
                      for r in session.active_requests()] if resumed else [])
        session.send(P.encode_message(welcome))
        return session

    @staticmethod
    async def _close(ws: WebSocket, code: int, reason: str = "", flush: bool = True) -> None:
        """Close the link (after letting the writer flush a last Error); the peer may be gone already."""
        if flush:
            await asyncio.sleep(0.05)
        try:
            await ws.close(code=code, reason=reason[:120])
        except Exception:  # a disconnected peer: nothing to close
            log.debug("close after disconnect", exc_info=True)

    def _server_info(self) -> P.ServerInfo:
        eng = self.rt.engine.llm
        load = min(1.0, len(eng.seqs) / max(1, self.rt.config.engine.max_num_seqs))
        return P.ServerInfo(version=__version__, compute_variants=list(eng.runners), load=float(load))

    async def _cached_keys(self, limit: int = 256) -> list[str]:
        """Prefix keys the default variant holds (advisory: the edge may skip uploading those blocks)."""
        try:
            fut = self.rt.engine.call(lambda e: list(e.block_managers[e.default_variant].block_of_key)[:limit])
            return await asyncio.wait_for(asyncio.wrap_future(fut), 5.0)
        except (EngineDeadError, asyncio.TimeoutError):
            return []

    async def _writer(self, ws: WebSocket, queue: asyncio.Queue) -> None:
        while True:
            frame = await queue.get()
            await ws.send_bytes(frame)
            self.rt.metrics.on_downlink(len(frame))

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
            rec.finish = "cancelled"
            self.rt.engine.abort(rec.engine_id)
        self.registry.remove(session)
        self.rt.metrics.sessions.labels(self.rt.model_name).set(len(self.registry))

    # -- messages ---------------------------------------------------------------------------------
    async def _read_loop(self, ws: WebSocket, session: Session) -> None:
        idle = max(1.0, self.limits.idle_timeout_ms / 1000)
        while True:
            try:
                frame = await asyncio.wait_for(ws.receive(), idle)
            except asyncio.TimeoutError:
                await self._close(ws, CLOSE_NORMAL, "idle", flush=False)
                return
            except WebSocketDisconnect:
                return
            if frame.get("type") == "websocket.disconnect":
                return
            data = frame.get("bytes")
            try:
                if data is None:
                    raise P.ProtocolError("bad_frame", "frames are binary msgpack, got a text frame")
                msg = P.decode_message(data, self.wire_limits)
            except P.ProtocolError as e:
                session.send(P.encode_message(P.Error(code=e.code, message=e.message, fatal=True)))
                await self._close(ws, CLOSE_PROTOCOL, e.message)
                return
            if isinstance(msg, P.Close):
                self._close_session(session)
                await self._close(ws, CLOSE_NORMAL)
                return
            try:
                self._dispatch(session, msg, len(data))
            except EngineDeadError as e:
                session.send(P.encode_message(P.Error(code="internal", message=str(e), fatal=True)))
                await self._close(ws, CLOSE_INTERNAL, "engine stopped")
                return

    def _dispatch(self, session: Session, msg, nbytes: int) -> None:
        if isinstance(msg, P.Prefill):
            self._on_prefill(session, msg, nbytes)
        elif isinstance(msg, P.DecodeStep):
            self._on_decode(session, msg, nbytes)
        elif isinstance(msg, P.Cancel):
            rec = session.requests.get(msg.request_id)
            if rec is not None and rec.active:
                self.rt.engine.abort(rec.engine_id, "cancelled")
        elif isinstance(msg, P.Resume):
            self._on_resume(session, msg)
        elif isinstance(msg, P.Error):
            log.info("edge %s reports %s: %s", session.session_id, msg.code, msg.message)
        else:
            self._error(session, "bad_state", f"{type(msg).__name__} is not sent by an edge",
                        getattr(msg, "request_id", None))

    def _error(self, session: Session, code: str, message: str, request_id: str | None,
               retry_after_ms: int | None = None) -> None:
        session.send(P.encode_message(P.Error(code=code, message=message, request_id=request_id,
                                              retry_after_ms=retry_after_ms)))

    def _decode_hidden(self, session: Session, t: P.EncodedTensor) -> torch.Tensor:
        if t.codec not in session.codecs:
            raise P.ProtocolError("codec_not_negotiated", f"codec {t.codec!r} was not negotiated "
                                                          f"(session: {session.codecs})")
        arr = self.codecs[t.codec].decode(t, self.wire_limits)  # [n, H] float32
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))

    @staticmethod
    def _rope(w: P.WireArray | None) -> torch.Tensor | None:
        return None if w is None else torch.from_numpy(w.to_numpy().astype(np.int64))  # [3, n]

    def _decode_inputs(self, session: Session, rid: str, msg: P.Prefill | P.DecodeStep):
        """The message's hidden states and optional 3-D rope positions, or None after failing the request."""
        try:
            return self._decode_hidden(session, msg.hidden), self._rope(msg.rope_positions)
        except P.ProtocolError as e:
            self._fail_request(session, rid, e.code, e.message)
            return None

    def _on_prefill(self, session: Session, msg: P.Prefill, nbytes: int) -> None:
        rid = msg.request_id
        if rid in session.dead:
            return  # a late chunk of a request we refused (e.g. after prefix_miss): the edge knows
        rec = session.requests.get(rid)
        if rec is not None and not rec.active:
            self._error(session, "duplicate_request", f"request {rid!r} already finished", rid)
            return
        inputs = self._decode_inputs(session, rid, msg)
        if inputs is None:
            return
        hidden, rope = inputs
        self.rt.metrics.on_uplink(nbytes, msg.hidden.codec, msg.n_tokens)
        end = msg.start + msg.n_tokens
        if end > self.limits.max_context:
            self._fail_request(session, rid, "context_full", f"positions up to {end} exceed max_context "
                                                             f"{self.limits.max_context}")
            return
        if rec is not None:  # a later chunk of the prompt
            if msg.start != rec.received:
                self._fail_request(session, rid, "bad_position", f"Prefill at {msg.start}, the server expects "
                                                                 f"position {rec.received}")
                return
            rec.received, rec.last_input = end, time.monotonic()
            self.rt.engine.add_input(rec.engine_id, InputChunk(msg.start, hidden=hidden, last=msg.last,
                                                               rope_positions=rope))
            return
        # a new request
        if self.rt.draining:
            self._error(session, "draining", "server is draining: no new requests", rid, retry_after_ms=5000)
            session.mark_dead(rid)
            return
        if len(session.active_requests()) >= self.limits.max_concurrent_requests:
            self._error(session, "overloaded", f"at most {self.limits.max_concurrent_requests} open requests "
                                               "per session", rid, retry_after_ms=500)
            session.mark_dead(rid)
            return
        try:
            params = to_engine_params(msg.params, self.limits.max_context)
        except SamplingParamsError as e:
            self._fail_request(session, rid, "bad_value", str(e))
            return
        engine = self.rt.engine.llm
        # The prompt's length is known when its first message is also its last; else it is at least a chunk.
        prompt_guess = end if msg.last else max(end, self.limits.max_prefill_chunk_tokens)
        planned = msg.compute or request_compute(self.rt, session, prompt_guess, msg.rope_positions is not None)
        compute = engine.resolve_variant(planned)
        rec = RequestRecord(rid, f"{session.session_id}/{rid}", msg.hidden.codec, compute, received=end,
                            prompt_tokens=end)
        session.requests[rid] = rec
        loop = asyncio.get_running_loop()

        def sink(out: RequestOutput, s=session, r=rec) -> None:  # engine thread -> event loop
            loop.call_soon_threadsafe(self._on_output, s, r, out)

        self.rt.engine.add_request(rec.engine_id, sink, InputChunk(msg.start, hidden=hidden, last=msg.last,
                                                                   rope_positions=rope),
                                   params, compute, list(msg.prefix_keys))

    def _on_decode(self, session: Session, msg: P.DecodeStep, nbytes: int) -> None:
        rid = msg.request_id
        if rid in session.dead:
            return
        rec = session.requests.get(rid)
        if rec is None or not rec.active:
            self._error(session, "unknown_request", f"no open request {rid!r}", rid)
            return
        inputs = self._decode_inputs(session, rid, msg)
        if inputs is None:
            return
        hidden, rope = inputs
        self.rt.metrics.on_uplink(nbytes, msg.hidden.codec, 1)
        if msg.position != rec.received:
            self._fail_request(session, rid, "bad_position", f"DecodeStep at {msg.position}, the server "
                                                             f"expects position {rec.received}")
            return
        rec.received, rec.last_input = msg.position + 1, time.monotonic()
        self.rt.engine.add_input(rec.engine_id, InputChunk(msg.position, hidden=hidden, last=True,
                                                           rope_positions=rope))

    def _fail_request(self, session: Session, rid: str, code: str, message: str) -> None:
        rec = session.requests.get(rid)
        if rec is not None and rec.active:
            rec.finish = "error"
            self.rt.engine.abort(rec.engine_id, "error")
            session.finished(rec)
        else:
            session.mark_dead(rid)
        self._error(session, code, message, rid)

    def _on_resume(self, session: Session, msg: P.Resume) -> None:
        rec = session.requests.get(msg.request_id)
        if rec is None:
            self._error(session, "resume_failed", f"request {msg.request_id!r} is not held by this session; "
                                                  "replay it as a new request", msg.request_id)
            return
        have = min(msg.have_tokens, len(rec.tokens))
        session.send(P.encode_message(P.Resumed(request_id=rec.request_id, received=rec.received, index=have,
                                                token_ids=rec.tokens[have:], finish_reason=rec.finish)))

    # -- engine outputs (event loop thread) -------------------------------------------------------
    def _on_output(self, session: Session, rec: RequestRecord, out: RequestOutput) -> None:
        if out.error_code is not None and out.token_id is None:
            if not rec.active:
                return  # we already told the edge (cancel / bad input raced with the engine)
            if out.error_code == "prefix_miss":
                session.mark_dead(rec.request_id)  # never admitted: the edge resends under a new id
            else:
                rec.finish = "error"
                session.finished(rec)
            code = _WIRE_CODES.get(out.error_code, "internal")
            retry = 1000 if code == "overloaded" else None
            self._error(session, code, out.error_message or out.error_code, rec.request_id, retry)
            return
        rec.cached_tokens = out.num_cached_tokens
        if out.token_id is None:  # finished without a token: cancelled, aborted
            if rec.active:
                rec.finish = _WIRE_FINISH.get(out.finish_reason or "", "error")
                session.send(self._tokens(rec, [], out))
                session.finished(rec)
            return
        rec.tokens.append(out.token_id)
        if out.finished:
            rec.finish = _WIRE_FINISH.get(out.finish_reason or "", "error")
            session.finished(rec)
        session.send(self._tokens(rec, [out.token_id], out))

    def _tokens(self, rec: RequestRecord, ids: list[int], out: RequestOutput) -> bytes:
        total_ms = (time.monotonic() - rec.last_input) * 1000
        msg = P.Tokens(
            request_id=rec.request_id, index=len(rec.tokens) - len(ids), token_ids=ids,
            logprobs=[max(-1e4, out.logprob)] if ids and out.logprob is not None else None,
            top_logprobs=[[P.TopLogprob(token_id=t, logprob=max(-1e4, lp)) for t, lp in out.top_logprobs]]
            if ids and out.top_logprobs is not None else None,
            finish_reason=rec.finish,
            usage=P.Usage(prompt_tokens=rec.prompt_tokens, completion_tokens=len(rec.tokens),
                          cached_tokens=rec.cached_tokens) if rec.finish is not None else None,
            timings=P.ServerTimings(total_ms=max(0.0, total_ms)),
            plan=None if rec.plan_sent else P.PrecisionPlan(codec=rec.codec, compute=rec.compute))
        rec.plan_sent = True
        return P.encode_message(msg)

    # -- drain ------------------------------------------------------------------------------------
    def drain(self, grace_ms: int) -> None:
        """Tell every attached edge the server is going away (on the event loop thread)."""
        frame = P.encode_message(P.Drain(grace_ms=grace_ms, reason="server shutting down"))
        for s in list(self.registry.by_id.values()):
            s.send(frame)
