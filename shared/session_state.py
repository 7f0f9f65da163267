"""The session state machine, as the server enforces it on what a client sends.

One :class:`SessionState` per session (it survives reconnects: call :meth:`SessionState.reconnect` when a
resumed client says Hello again). Feed it every client message with :meth:`on_client` *before* acting on it,
and every message the server sends with :meth:`on_server`. A violation raises :class:`SessionError`, whose
:meth:`~SessionError.to_error` is the ``Error`` message to send back (request-level unless ``fatal``).

Connection phases::

    AWAIT_HELLO --Hello--> AWAIT_WELCOME --Welcome--> READY --Drain--> DRAINING
         ^                                              |                  |
         +------------- reconnect (resume_token) -------+---- Close / fatal Error / socket closed --> CLOSED

Per request (client view of ``received`` = positions the server holds, ``tokens`` = tokens it sent)::

    (new id) --Prefill(params, start=0 or a prefix)--> PREFILL --Prefill(start=received)...--+
    PREFILL --Prefill(last=True)--> [server samples] --Tokens--> AWAIT_STEP --DecodeStep(position=received)-->
    [server samples] --Tokens--> AWAIT_STEP ... --Tokens(finish_reason) / Error(request_id)--> FINISHED
    Cancel: any time, idempotent (a request that already finished ignores it).

Messages cross in flight, so the rules only forbid what a correct client can never send: a second Hello,
a DecodeStep nobody asked for, positions that skip or repeat, a request opened without sampling parameters,
more open requests or context than ``Welcome.limits`` allow, a codec that was not negotiated.

References: docs/protocol.md ("Session state machine"); vLLM v1 (errors fatal for the engine vs for one
request).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .messages import (
    Cancel,
    Close,
    DecodeStep,
    Drain,
    Error,
    Hello,
    Prefill,
    Resume,
    Resumed,
    SessionLimits,
    Tokens,
    Welcome,
)

AWAIT_HELLO, AWAIT_WELCOME, READY, DRAINING, CLOSED = "await_hello", "await_welcome", "ready", "draining", "closed"
FINISHED_MEMORY = 4096  # ids of finished requests remembered (to refuse reuse); bounded


class SessionError(Exception):
    """A message not allowed in the session's state; ``code`` is a session error code (shared.errors)."""

    def __init__(self, code: str, message: str, request_id: str | None = None, fatal: bool = False):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.request_id, self.fatal = code, message, request_id, fatal

    def to_error(self) -> Error:
        return Error(code=self.code, message=self.message, request_id=self.request_id, fatal=self.fatal)


@dataclass(slots=True)
class RequestTrack:
    request_id: str
    received: int = 0  # positions [0, received) sent by the client (prefix-cache hits included)
    prompt_done: bool = False  # the Prefill with last=True arrived
    tokens: int = 0  # tokens the server has sent
    await_step: bool = False  # the server sent a token and waits for its DecodeStep
    cancelled: bool = False


class SessionState:
    def __init__(self):
        self.phase = AWAIT_HELLO
        self.limits = SessionLimits()
        self.codecs: set[str] = set()
        self.requests: dict[str, RequestTrack] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()

    # -- connection ---------------------------------------------------------------------------------------
    def reconnect(self) -> None:
        """A new connection for this (resumed) session: expect Hello again; open requests are kept."""
        self.phase = AWAIT_HELLO

    def close(self) -> None:
        self.phase = CLOSED

    @property
    def open_requests(self) -> int:
        return len(self.requests)

    # -- client -> server -----------------------------------------------------------------------------------
    def on_client(self, msg) -> RequestTrack | None:
        """Check a client message against the state and advance it; returns the request it concerns."""
        if self.phase == CLOSED:
            raise SessionError("bad_state", f"{type(msg).__name__} after the session closed", fatal=True)
        if isinstance(msg, Hello):
            if self.phase != AWAIT_HELLO:
                raise SessionError("bad_state", "Hello twice on one connection", fatal=True)
            self.phase = AWAIT_WELCOME
            return None
        if self.phase in (AWAIT_HELLO, AWAIT_WELCOME):
            raise SessionError("bad_state", f"{type(msg).__name__} before the Welcome", fatal=True)
        if isinstance(msg, Close):
            self.phase = CLOSED
            return None
        if isinstance(msg, Prefill):
            return self._prefill(msg)
        if isinstance(msg, DecodeStep):
            return self._decode_step(msg)
        if isinstance(msg, Cancel):
            req = self.requests.get(msg.request_id)
            if req is not None:
                req.cancelled = True
            return req  # None: finished or unknown - Cancel is idempotent, nothing to answer
        if isinstance(msg, Resume):
            req = self.requests.get(msg.request_id)
            if req is None:
                raise SessionError("resume_failed", f"request {msg.request_id} is not open here: replay it",
                                   msg.request_id)
            if msg.have_tokens > req.tokens:
                raise SessionError("bad_position", f"client claims {msg.have_tokens} tokens, server sent "
                                                   f"{req.tokens}", msg.request_id)
            return req
        raise SessionError("bad_state", f"{type(msg).__name__} is not a client message", fatal=True)

    def _check_tensor(self, msg, n: int, end: int) -> None:
        if msg.hidden.codec not in self.codecs:
            raise SessionError("codec_not_negotiated", f"codec {msg.hidden.codec!r} not in {sorted(self.codecs)}",
                               msg.request_id)
        if end > self.limits.max_context:
            raise SessionError("context_full", f"position {end} beyond max_context {self.limits.max_context}",
                               msg.request_id)

    def _prefill(self, msg: Prefill) -> RequestTrack:
        rid, n = msg.request_id, msg.n_tokens
        if n > self.limits.max_prefill_chunk_tokens:
            raise SessionError("too_large", f"{n} tokens in one Prefill (max {self.limits.max_prefill_chunk_tokens})",
                               rid)
        req = self.requests.get(rid)
        if req is None:
            if self.phase == DRAINING:
                raise SessionError("draining", "the server is draining: no new requests", rid)
            if rid in self.finished:
                raise SessionError("duplicate_request", f"request id {rid} was already used", rid)
            if len(self.requests) >= self.limits.max_concurrent_requests:
                raise SessionError("overloaded", f"{len(self.requests)} requests open "
                                                 f"(max {self.limits.max_concurrent_requests})", rid)
            if msg.params is None:
                raise SessionError("bad_state", "the first Prefill of a request carries params", rid)
            block = self.limits.prefix_block_tokens
            if msg.start and (msg.start % block or msg.start > len(msg.prefix_keys) * block):
                raise SessionError("bad_position", f"start {msg.start}: a prefix must be whole blocks of {block} "
                                                   f"covered by prefix_keys", rid)
            self._check_tensor(msg, n, msg.start + n)
            req = self.requests[rid] = RequestTrack(rid, received=msg.start)
        else:
            if req.prompt_done:
                raise SessionError("bad_state", "Prefill after the prompt was complete (use DecodeStep)", rid)
            self._check_tensor(msg, n, msg.start + n)
        if msg.start != req.received:
            raise SessionError("bad_position", f"Prefill starts at {msg.start}, the server holds {req.received}", rid)
        req.received += n
        req.prompt_done = msg.last
        return req

    def _decode_step(self, msg: DecodeStep) -> RequestTrack:
        rid = msg.request_id
        req = self.requests.get(rid)
        if req is None:
            raise SessionError("unknown_request", f"request {rid} is not open", rid)
        if not req.await_step:
            raise SessionError("bad_state", "DecodeStep without a token to feed", rid)
        if msg.position != req.received:
            raise SessionError("bad_position", f"DecodeStep at {msg.position}, the server holds {req.received}", rid)
        self._check_tensor(msg, 1, msg.position + 1)
        req.received += 1
        req.await_step = False
        return req

    # -- server -> client -----------------------------------------------------------------------------------
    def on_server(self, msg) -> None:
        """Record a message the server sends (it changes what the client may send next)."""
        if isinstance(msg, Welcome):
            self.phase = READY
            self.limits, self.codecs = msg.limits, set(msg.codecs)
        elif isinstance(msg, Tokens):
            req = self.requests.get(msg.request_id)
            if req is None:
                return
            req.tokens = max(req.tokens, msg.index + len(msg.token_ids))
            if msg.finish_reason is not None:
                self._finish(msg.request_id)
            elif msg.token_ids:
                req.await_step = True
        elif isinstance(msg, Resumed):
            req = self.requests.get(msg.request_id)
            if req is not None:
                req.received = msg.received
                if msg.finish_reason is not None:
                    self._finish(msg.request_id)
        elif isinstance(msg, Error):
            if msg.fatal:
                self.phase = CLOSED
            elif msg.request_id is not None and msg.request_id in self.requests:
                self._finish(msg.request_id)
        elif isinstance(msg, Drain):
            if self.phase != CLOSED:
                self.phase = DRAINING
        elif isinstance(msg, Close):
            self.phase = CLOSED

    def _finish(self, rid: str) -> None:
        self.requests.pop(rid, None)
        self.finished[rid] = None
        while len(self.finished) > FINISHED_MEMORY:
            self.finished.popitem(last=False)
