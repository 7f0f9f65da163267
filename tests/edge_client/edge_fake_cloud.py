"""A small reference cloud for edge tests: the split protocol over a real WebSocket, the back half recomputed
over the whole context each step (slow, obviously correct), and knobs for failures the real server should
never show on purpose (garbage frames, dropping a session, losing its prefix cache).

It is a test double for the *edge*: the real server (cloud_server) is exercised end to end elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import websockets
from websockets.asyncio.server import serve

from shared import codecs as C
from shared import protocol as P


@dataclass
class _Req:
    rid: str
    params: object
    keys: list[str]
    hidden: list[np.ndarray] = field(default_factory=list)  # per position [H]
    out: list[int] = field(default_factory=list)


class FakeCloud:
    def __init__(self, bundle, block_size: int = 16):
        from cloud_server.back_half import BackHalf

        self.back = BackHalf.from_bundle(bundle)
        self.codecs = C.available_codecs(json.loads((Path(bundle) / "calibration.json").read_text()))
        self.bundle_id = self.back.manifest.bundle_id
        self.eos = set(self.back.manifest.eos_token_ids)
        self.block_size = block_size
        self.sessions: dict[str, dict] = {}  # resume token -> {rid: _Req}
        self.prefix: dict[str, np.ndarray] = {}  # key -> [bs, H]
        self.garbage = False  # answer every frame with junk bytes
        self.drop_after_tokens: int | None = None  # close the socket after sending this many tokens (once)
        self.forget_sessions = False  # treat every resume token as unknown
        self.hellos = 0
        self.api_key: str | None = None  # when set, the upgrade needs "Authorization: Bearer <key>"
        self.auth_headers: list[str | None] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.port = None

    def __enter__(self):
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self.port = fut.result(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/split"

    async def _start(self):
        self._server = await serve(self._handle, "127.0.0.1", 0, compression=None, max_size=64 << 20,
                                   close_timeout=1, process_request=self._check_auth)
        return self._server.sockets[0].getsockname()[1]

    def _check_auth(self, connection, request):
        header = request.headers.get("Authorization")
        self.auth_headers.append(header)
        if self.api_key is not None and header != f"Bearer {self.api_key}":
            return connection.respond(401, "missing or wrong API key\n")
        return None

    async def _stop(self):
        self._server.close()
        await self._server.wait_closed()

    # -- model ----------------------------------------------------------------------------------
    def _next_token(self, req: _Req) -> int:
        h = torch.from_numpy(np.stack(req.hidden))[None]  # [1, S, H]
        pos = torch.arange(h.shape[1])[None]
        logits = self.back(h, pos)[0, -1]
        return int(torch.argmax(logits))  # greedy only: this double checks the edge, not sampling

    # -- protocol -------------------------------------------------------------------------------
    async def _handle(self, ws):
        self.hellos += 1
        if self.garbage:
            await ws.recv()
            await ws.send(b"\x00\xffnot a protocol frame")
            await asyncio.sleep(0.5)
            return
        hello = P.decode_message(await ws.recv())
        if hello.bundle_id != self.bundle_id:
            await ws.send(P.encode_message(P.Error(code="bundle_mismatch", message="bundle ids differ",
                                                   fatal=True)))
            return
        token = hello.resume_token
        resumed = token in self.sessions and not self.forget_sessions
        if not resumed:
            token = uuid.uuid4().hex
            self.sessions[token] = {}
        reqs = self.sessions[token]
        await ws.send(P.encode_message(P.Welcome(
            session_id=token[:8], resume_token=token, resumed=resumed,
            limits=P.SessionLimits(prefix_block_tokens=self.block_size), codecs=list(hello.codecs),
            plan=P.PrecisionPlan(codec="fp16", compute="fp32"), server=P.ServerInfo(compute_variants=["fp32"]))))
        try:
            async for frame in ws:
                msg = P.decode_message(frame)
                if isinstance(msg, P.Close):
                    await ws.close()
                    return
                for out in self._on(reqs, msg):
                    await ws.send(P.encode_message(out))
                    if isinstance(out, P.Tokens) and self.drop_after_tokens is not None:
                        sent = sum(len(r.out) for r in reqs.values())
                        if sent >= self.drop_after_tokens:
                            self.drop_after_tokens = None
                            ws.transport.abort() if hasattr(ws, "transport") else None
                            return
        except websockets.ConnectionClosed:
            pass

    def _on(self, reqs: dict, msg):
        if isinstance(msg, P.Prefill):
            req = reqs.get(msg.request_id)
            if req is None:
                req = reqs[msg.request_id] = _Req(msg.request_id, msg.params, list(msg.prefix_keys))
                if msg.start > 0:
                    n = msg.start // self.block_size
                    blocks = [self.prefix.get(k) for k in req.keys[:n]]
                    if msg.start % self.block_size or any(b is None for b in blocks):
                        del reqs[msg.request_id]
                        return [P.Error(code="prefix_miss", message="not cached", request_id=msg.request_id)]
                    req.hidden = [row for b in blocks for row in b]
            if msg.start != len(req.hidden):
                return [P.Error(code="bad_position", message=f"{msg.start} != {len(req.hidden)}",
                                request_id=msg.request_id)]
            req.hidden += list(self.codecs[msg.hidden.codec].decode(msg.hidden))
            if not msg.last:
                return []
            for i, k in enumerate(req.keys):  # publish the full blocks of the prompt
                if (i + 1) * self.block_size <= len(req.hidden) - 1:
                    self.prefix.setdefault(k, np.stack(req.hidden[i * self.block_size:(i + 1) * self.block_size]))
            return [self._emit(reqs, req)]
        if isinstance(msg, P.DecodeStep):
            req = reqs.get(msg.request_id)
            if req is None or msg.position != len(req.hidden):
                return [P.Error(code="bad_position", message="?", request_id=msg.request_id)]
            req.hidden += list(self.codecs[msg.hidden.codec].decode(msg.hidden))
            return [self._emit(reqs, req)]
        if isinstance(msg, P.Resume):
            req = reqs.get(msg.request_id)
            if req is None:
                return [P.Error(code="unknown_request", message="gone", request_id=msg.request_id)]
            return [P.Resumed(request_id=req.rid, received=len(req.hidden), index=msg.have_tokens,
                              token_ids=req.out[msg.have_tokens:], finish_reason=self._finish(req))]
        if isinstance(msg, P.Cancel):
            reqs.pop(msg.request_id, None)
        return []

    def _finish(self, req: _Req):
        if req.out and req.out[-1] in self.eos:
            return "stop"
        if len(req.out) >= req.params.max_tokens:
            return "length"
        return None

    def _emit(self, reqs, req: _Req):
        t = self._next_token(req)
        req.out.append(t)
        fin = self._finish(req)
        return P.Tokens(request_id=req.rid, index=len(req.out) - 1, token_ids=[t], finish_reason=fin)
