"""A scripted split server: the protocol without a model, for testing clients (ours, or one in Kotlin/Swift).

It speaks docs/protocol.md over a real WebSocket at ``/v1/split`` and enforces the same rules as the real
server (the shared state machine, ``shared.session_state``: every refusal has the documented code), but
instead of a model it runs a script anyone can reproduce without our code:

* **the next token is the index of the largest value in the last hidden row received** (after decoding the
  codec), so a client controls the tokens it gets back by what it sends (a one-hot row ``e_k`` -> token k);
* a request finishes with ``stop`` when that token is in ``params.stop_token_ids`` or in the server's
  ``--eos`` ids (unless ``ignore_eos``), with ``length`` after ``params.max_tokens`` tokens;
* the prefix cache publishes a prompt's full blocks under its ``prefix_keys`` once the prompt is complete
  (in memory, shared by all sessions); a first Prefill with ``start > 0`` whose blocks are unknown gets
  ``Error(prefix_miss)``;
* a dropped connection's session stays resumable (``Hello.resume_token``) until the server stops.

Run it::

    python -m tests.protocol_fake_server --port 8765 --bundle-id demo-bundle --hidden-size 8
    # prints  ws://127.0.0.1:8765/v1/split  (the base URL ws://127.0.0.1:8765 works too)

Other paths are refused with HTTP 404 (a client should then report "no split endpoint"). In Python,
:class:`ScriptedServer` is a context manager; subclasses replace :meth:`ScriptedServer.next_token`
(``tests/edge_client/edge_fake_cloud.py`` runs a real back half there) and may set the failure knobs.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import uuid
from dataclasses import dataclass, field

import numpy as np
import websockets
from websockets.asyncio.server import serve

from shared import codecs as C
from shared import protocol as P
from shared.errors import fatal_close_code
from shared.session_state import SessionError, SessionState

SPLIT_PATH = "/v1/split"


@dataclass
class ScriptedRequest:
    rid: str
    params: P.SamplingParams
    keys: list[str]
    hidden: list[np.ndarray] = field(default_factory=list)  # one [H] float32 row per position received
    out: list[int] = field(default_factory=list)  # tokens sent
    finish: str | None = None


@dataclass
class _Session:
    token: str
    state: SessionState
    requests: dict[str, ScriptedRequest] = field(default_factory=dict)


class ScriptedServer:
    """The scripted server on ``127.0.0.1:port`` (0: a free port) in a background thread (``with`` block)."""

    def __init__(self, bundle_id: str, hidden_size: int, codecs: dict | None = None, *, block_size: int = 16,
                 eos_token_ids: tuple[int, ...] = (), limits: P.SessionLimits | None = None, port: int = 0):
        self.bundle_id = bundle_id
        self.hidden_size = hidden_size
        self.codecs = codecs if codecs is not None else C.available_codecs(None)  # name -> codec
        self.eos = set(eos_token_ids)
        self.limits = limits or P.SessionLimits(prefix_block_tokens=block_size)
        self.block_size = self.limits.prefix_block_tokens
        self.wire_limits = P.Limits(max_frame_bytes=self.limits.max_frame_bytes + (1 << 20))
        self.sessions: dict[str, _Session] = {}  # resume token -> session
        self.prefix: dict[str, np.ndarray] = {}  # key -> [block, H]
        # failure knobs (tests of the client's recovery)
        self.garbage = False  # answer every Hello with junk bytes
        self.drop_after_tokens: int | None = None  # abort the TCP connection after this many tokens (once)
        self.forget_sessions = False  # treat every resume token as unknown
        self.compute_variants = ["fp32"]  # what the next Welcome offers (a replica restarted with other variants)
        self.api_key: str | None = None  # when set, the upgrade needs "Authorization: Bearer <key>"
        self.auth_headers: list[str | None] = []
        self.hellos = 0
        self.requested_port = port
        self.port: int | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self):
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    @property
    def base_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.base_url + SPLIT_PATH

    async def _start(self) -> int:
        self._server = await serve(self._handle, "127.0.0.1", self.requested_port, compression=None,
                                   max_size=self.wire_limits.max_frame_bytes, close_timeout=1,
                                   process_request=self._check_request)
        return self._server.sockets[0].getsockname()[1]

    async def _stop(self):
        self._server.close()
        await self._server.wait_closed()

    def _check_request(self, connection, request):
        if request.path.split("?")[0].rstrip("/") not in (SPLIT_PATH, ""):
            return connection.respond(404, f"no WebSocket route at {request.path}\n")
        header = request.headers.get("Authorization")
        self.auth_headers.append(header)
        if self.api_key is not None and header != f"Bearer {self.api_key}":
            return connection.respond(401, "missing or wrong API key\n")
        return None

    # -- the script -------------------------------------------------------------------------------
    def next_token(self, req: ScriptedRequest) -> int:
        """The scripted model: argmax of the last hidden row received."""
        return int(np.argmax(req.hidden[-1]))

    def _finish_reason(self, req: ScriptedRequest) -> str | None:
        t = req.out[-1]
        if t in req.params.stop_token_ids or (t in self.eos and not req.params.ignore_eos):
            return "stop"
        return "length" if len(req.out) >= req.params.max_tokens else None

    # -- connection -------------------------------------------------------------------------------
    async def _handle(self, ws):
        self.hellos += 1
        if self.garbage:
            await ws.recv()
            await ws.send(b"\x00\xffnot a protocol frame")
            await asyncio.sleep(0.5)
            return
        fresh = SessionState()
        try:
            frame = await ws.recv()
            hello = P.decode_message(frame, self.wire_limits)
            fresh.on_client(hello, len(frame))
        except (P.ProtocolError, SessionError) as e:
            await ws.send(P.encode_message(P.Error(code=e.code, message=e.message, fatal=True)))
            await ws.close(fatal_close_code(e.code))
            return
        except websockets.ConnectionClosed:
            return
        if hello.bundle_id != self.bundle_id:
            await ws.send(P.encode_message(P.Error(code="bundle_mismatch", message=f"this server serves "
                                                   f"{self.bundle_id}", fatal=True, bundle_ids=[self.bundle_id])))
            await ws.close(1008)
            return
        codecs = [c for c in hello.codecs if c in self.codecs]
        if not codecs:
            await ws.send(P.encode_message(P.Error(code="codec_not_negotiated", message="no common codec",
                                                   fatal=True)))
            await ws.close(1008)
            return
        sess = None if self.forget_sessions else self.sessions.get(hello.resume_token or "")
        resumed = sess is not None
        if resumed:
            sess.state.reconnect()
            sess.state.on_client(hello)
        else:
            sess = _Session(uuid.uuid4().hex, fresh)
            self.sessions[sess.token] = sess
        welcome = P.Welcome(
            session_id=sess.token[:16], resume_token=sess.token, resumed=resumed, limits=self.limits,
            plan=P.PrecisionPlan(codec=codecs[0], compute="fp32"), codecs=codecs,
            server=P.ServerInfo(name="scripted-fake", compute_variants=list(self.compute_variants)),
            requests=[P.RequestState(request_id=t.request_id, received=t.received, tokens=t.tokens)
                      for t in sess.state.requests.values()] if resumed else [])
        try:
            await self._send(ws, sess, welcome)
            await self._serve(ws, sess)
        except websockets.ConnectionClosed:
            pass

    async def _send(self, ws, sess: _Session, msg) -> None:
        sess.state.on_server(msg)
        await ws.send(P.encode_message(msg))

    async def _serve(self, ws, sess: _Session) -> None:
        async for frame in ws:
            try:
                if isinstance(frame, str):
                    raise P.ProtocolError("bad_frame", "frames are binary msgpack, got a text frame")
                msg = P.decode_message(frame, self.wire_limits)
                track = sess.state.on_client(msg, len(frame))
            except P.ProtocolError as e:
                await self._send(ws, sess, P.Error(code=e.code, message=e.message, fatal=True))
                await ws.close(fatal_close_code(e.code))
                return
            except SessionError as e:
                await self._send(ws, sess, e.to_error())
                if e.fatal:
                    await ws.close(fatal_close_code(e.code))
                    return
                continue
            if isinstance(msg, P.Close):
                await ws.close()
                return
            for out in self._on(sess, msg, track):
                await self._send(ws, sess, out)
                if isinstance(out, P.Tokens) and self.drop_after_tokens is not None:
                    if sum(len(r.out) for r in sess.requests.values()) >= self.drop_after_tokens:
                        self.drop_after_tokens = None
                        ws.transport.abort()
                        return

    # -- messages ---------------------------------------------------------------------------------
    def _rows(self, t: P.EncodedTensor) -> list[np.ndarray]:
        arr = self.codecs[t.codec].decode(t, self.wire_limits)  # [n, H]
        if arr.shape[1] != self.hidden_size:
            raise SessionError("bad_input", f"hidden width {arr.shape[1]}, the server's is {self.hidden_size}")
        return list(arr)

    def _on(self, sess: _Session, msg, track) -> list:
        if track is None:
            return []  # a late message about a finished request, a fatal Error from the client: nothing to do
        rid = track.request_id
        try:
            if isinstance(msg, P.Prefill):
                return self._prefill(sess, msg)
            if isinstance(msg, P.DecodeStep):
                req = sess.requests[rid]
                req.hidden += self._rows(msg.hidden)
                return [self._emit(req)]
        except (P.ProtocolError, SessionError) as e:
            sess.requests.pop(rid, None)
            return [P.Error(code=e.code, message=e.message, request_id=rid)]
        if isinstance(msg, (P.Cancel, P.Error)):  # the client's Error naming a request closes it as a Cancel
            req = sess.requests[rid]
            req.finish = "cancelled"
            return [P.Tokens(request_id=rid, index=len(req.out), token_ids=[], finish_reason="cancelled")]
        if isinstance(msg, P.Resume):
            req = sess.requests.get(rid)
            if req is None:
                return [P.Error(code="resume_failed", message="never admitted", request_id=rid)]
            return [P.Resumed(request_id=rid, received=track.received, index=msg.have_tokens,
                              token_ids=req.out[msg.have_tokens:], finish_reason=req.finish)]
        return []

    def _prefill(self, sess: _Session, msg: P.Prefill) -> list:
        rid = msg.request_id
        req = sess.requests.get(rid)
        if req is None:
            req = sess.requests[rid] = ScriptedRequest(rid, msg.params, list(msg.prefix_keys))
            if msg.start:
                blocks = [self.prefix.get(k) for k in req.keys[:msg.start // self.block_size]]
                if any(b is None for b in blocks):
                    del sess.requests[rid]
                    return [P.Error(code="prefix_miss", message="prefix blocks not held", request_id=rid)]
                req.hidden = [row for b in blocks for row in b]
        req.hidden += self._rows(msg.hidden)
        if not msg.last:
            return []
        for i, key in enumerate(req.keys):  # publish the prompt's full blocks
            if (i + 1) * self.block_size <= len(req.hidden):
                self.prefix.setdefault(key, np.stack(req.hidden[i * self.block_size:(i + 1) * self.block_size]))
        return [self._emit(req)]

    def _emit(self, req: ScriptedRequest) -> P.Tokens:
        req.out.append(self.next_token(req))
        req.finish = self._finish_reason(req)
        usage = P.Usage(prompt_tokens=len(req.hidden) - len(req.out) + 1, completion_tokens=len(req.out)) \
            if req.finish else None
        return P.Tokens(request_id=req.rid, index=len(req.out) - 1, token_ids=[req.out[-1]],
                        finish_reason=req.finish, usage=usage)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Scripted split-protocol server (docs/protocol.md, 'Testing a client')")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--bundle-id", default="demo-bundle")
    ap.add_argument("--hidden-size", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--eos", default="", help="comma-separated end-of-sequence token ids")
    args = ap.parse_args(argv)
    eos = tuple(int(t) for t in args.eos.split(",") if t.strip())
    with ScriptedServer(args.bundle_id, args.hidden_size, block_size=args.block_size, eos_token_ids=eos,
                        port=args.port) as srv:
        print(srv.url, flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
