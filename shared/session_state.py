"""The session state machine: the one rulebook both ends run over what the client sends.

One :class:`SessionState` per session, on each side. It survives reconnects (call :meth:`SessionState.reconnect`
when a resumed client says Hello again). Feed it every client message with :meth:`~SessionState.on_client`
*before* acting on it (the server on what it received, the edge on what it is about to send), and every
server message with :meth:`~SessionState.on_server` (the server on what it sends, the edge on what it
received). A violation raises :class:`SessionError`, whose :meth:`~SessionError.to_error` is the ``Error``
message to send back (request-level unless ``fatal``). A request-level error closes that request: the server
aborts it, and the ``Error`` it sends (through ``on_server``) closes it here too.

Connection phases::

    AWAIT_HELLO --Hello--> AWAIT_WELCOME --Welcome--> READY --Drain--> DRAINING
         ^                                              |                  |
         +------------- reconnect (resume_token) -------+---- Close / fatal Error / socket closed --> CLOSED

Per request (``received`` = positions the server holds, ``tokens`` = tokens the server sent, ``prompt_len``
known once the Prefill with ``last`` arrived)::

    (new id) --Prefill(params, start=0 or a prefix)--> PREFILL --Prefill(start=received)...--+
    PREFILL --Prefill(last=True)--> [server samples] --Tokens--> AWAIT_STEP --DecodeStep(position=received)-->
    [server samples] --Tokens--> AWAIT_STEP ... --Tokens(finish_reason) / Error(request_id)--> FINISHED
    Cancel: any time, idempotent (a request that already finished ignores it).

A ``SpecStep`` stands where a DecodeStep may (AWAIT_STEP, ``position = received``) and carries k + 1
positions, at most ``Welcome.server.max_draft_tokens`` drafts. The server keeps only the accepted ones: its
``Tokens`` answer (a + 1 tokens: a accepted drafts and its own next one) sets ``received`` back to
``prompt_len + tokens - 1`` (the KV of the k - a rejected drafts is dropped on both sides). One SpecStep is in
flight at a time, as one DecodeStep is.

A **u-shape** request (first Prefill with ``return_states``) never gets tokens: the server answers every span
it computes with ``States`` (``answered`` = positions returned). Its steps are ``StatesStep``\\ s (DecodeStep and
SpecStep are refused), each allowed once the server has returned every position it holds (``answered =
received``), at a ``position`` in ``[prompt_len, received]`` - the server drops its KV from ``position`` on
first, which is how the edge rolls back rejected drafts - with at most ``max_draft_tokens + 1`` rows. The edge
ends it with ``Cancel`` (it samples, so it alone knows when to stop). Its ``Resume.have_tokens`` counts
*positions*: the edge holds the ``States`` of ``[0, have)``, so ``have <= answered`` (``bad_position``
otherwise; a finished one is ``resume_failed``: the edge replays it). ``Resumed.received = have`` rolls both
records back (``received = answered = have``: the server drops its KV from ``have`` on, and the States lost in
flight are recomputed from the inputs the edge resends); until the ``Resumed`` no input for it may stand
(``bad_state``), so the rollback never races an input.

Messages cross in flight, so the rules only forbid what a correct client can never send: a second Hello,
a DecodeStep nobody asked for, positions that skip or repeat, a request opened without sampling parameters
or under a used id, a later Prefill carrying what the first decides (params, return_states, prefix_keys,
prompt_len), a prompt ending elsewhere than its first Prefill's ``prompt_len`` said, more open requests, tokens per
chunk, frame bytes or context than ``Welcome.limits`` allow (a said ``prompt_len`` too), a codec that was not
negotiated. What a correct client *can* send - a later chunk or decode step of a
request the server has just finished or refused, a Cancel for it - is ignored (``on_client`` returns None).

References: docs/protocol.md ("Session state machine"); vLLM v1 (errors fatal for the engine vs for one
request).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from .errors import TOO_LARGE
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
    SpecStep,
    States,
    StatesStep,
    Tokens,
    Welcome,
)

AWAIT_HELLO, AWAIT_WELCOME, READY, DRAINING, CLOSED = "await_hello", "await_welcome", "ready", "draining", "closed"
FINISHED_MEMORY = 4096  # ids of finished or refused requests remembered (reuse refused, late messages ignored)
FINISHED_KEPT = 16  # finished requests whose track is kept: a Resume after the finish still gets its tokens


class SessionError(Exception):
    """A message not allowed in the session's state; ``code`` is a session error code (shared.errors)."""

    def __init__(self, code: str, message: str, request_id: str | None = None, fatal: bool = False,
                 retry_after_ms: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.request_id, self.fatal = code, message, request_id, fatal
        self.retry_after_ms = retry_after_ms  # the wait to ask for (a Resume of a request dropped for load)

    def to_error(self, retry_after_ms: int | None = None) -> Error:
        return Error(code=self.code, message=self.message, request_id=self.request_id, fatal=self.fatal,
                     retry_after_ms=retry_after_ms if retry_after_ms is not None else self.retry_after_ms)


@dataclass(slots=True, eq=False)
class RequestTrack:
    """One request as the protocol sees it. ``owner`` is the side's own record of it (opaque here)."""

    request_id: str
    received: int = 0  # positions [0, received) sent by the client (prefix-cache hits included)
    prompt_len: int | None = None  # set by the Prefill with last=True
    said_len: int | None = None  # the first Prefill's prompt_len: where the Prefill with last=True ends
    tokens: int = 0  # tokens the server has sent
    cancelled: bool = False
    finish: str | None = None  # finish reason ("stop", ..., "error") once finished
    owner: object = None
    spec_position: int | None = None  # a SpecStep at this position awaits its Tokens (received is provisional)
    states: bool = False  # u-shape: the server returns States, never tokens
    answered: int = 0  # u-shape: positions [0, answered) whose States the server sent
    resume_at: int | None = None  # u-shape: a Resume to this position awaits its Resumed (no input until then)
    failed: Error | None = None  # the Error that ended it: a Resume of it says why (retry_after_ms: overloaded)

    @property
    def prompt_done(self) -> bool:
        return self.prompt_len is not None

    @property
    def awaits_step(self) -> bool:
        """The server sent a token whose DecodeStep it has not received yet (u-shape: it returned the states of
        every position it holds)."""
        if self.finish is not None or self.prompt_len is None:
            return False
        if self.states:
            return self.answered >= self.received
        return self.received < self.prompt_len + self.tokens


def _failed_while_away(req: RequestTrack) -> SessionError:
    """A Resume's answer for a request an Error ended while the link was down (the Error went nowhere): replay it,
    after the wait that Error asked for - a request dropped for load (``overloaded``) replayed at once met the
    same full pool."""
    why = f" ({req.failed.code}: {req.failed.message})" if req.failed is not None else ""
    return SessionError("resume_failed", f"request {req.request_id} failed while the link was down{why}: replay it",
                        req.request_id, retry_after_ms=req.failed.retry_after_ms if req.failed is not None else None)


class SessionState:
    def __init__(self):
        self.phase = AWAIT_HELLO
        self.limits = SessionLimits()
        self.max_draft_tokens = 0  # Welcome.server.max_draft_tokens: 0 refuses every SpecStep
        self.codecs: set[str] = set()
        self.requests: dict[str, RequestTrack] = {}  # open requests
        self.finished: OrderedDict[str, RequestTrack | None] = OrderedDict()  # the latest FINISHED_KEPT keep tracks
        self._kept: deque[str] = deque()

    # -- connection ---------------------------------------------------------------------------------------
    def reconnect(self) -> None:
        """A new connection for this (resumed) session: expect Hello again; open requests are kept."""
        self.phase = AWAIT_HELLO

    def close(self) -> None:
        """The session ends: open requests finish as cancelled (nothing more is sent for them)."""
        self.phase = CLOSED
        for req in list(self.requests.values()):
            self._finish(req, "cancelled")

    @property
    def open_requests(self) -> int:
        return len(self.requests)

    def track(self, request_id: str) -> RequestTrack | None:
        """The request's track: open, or finished recently enough to be kept."""
        return self.requests.get(request_id) or self.finished.get(request_id)

    # -- client -> server -----------------------------------------------------------------------------------
    def _cancel(self, rid: str | None) -> RequestTrack | None:
        """Mark an open request cancelled (a Cancel, or the client's Error naming it); None when none is open."""
        req = self.requests.get(rid)
        if req is not None:
            req.cancelled = True
        return req

    def on_client(self, msg, frame_bytes: int | None = None) -> RequestTrack | None:
        """Check a client message (of ``frame_bytes`` bytes on the wire, if known) against the state and
        advance it. Returns the request it concerns, or None when nothing is to be done (Hello, Close, a fatal Error,
        and late messages about a request that already finished)."""
        if self.phase == CLOSED:
            raise SessionError("bad_state", f"{type(msg).__name__} after the session closed", fatal=True)
        rid = getattr(msg, "request_id", None)
        if frame_bytes is not None and frame_bytes > self.limits.max_frame_bytes and rid is None:  # a Hello too
            raise SessionError(TOO_LARGE, f"{frame_bytes}-byte frame (max_frame_bytes {self.limits.max_frame_bytes})",
                               fatal=True)
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
        if isinstance(msg, Error):  # the client reports a failure: fatal ends the session, else its request
            if msg.fatal:
                self.phase = CLOSED
                return None
            return self._cancel(rid)  # closed as by a Cancel (its final Tokens follow); None: nothing open
        if isinstance(msg, Prefill):
            return self._prefill(msg, frame_bytes)
        if isinstance(msg, (DecodeStep, SpecStep)):
            return self._decode_step(msg, frame_bytes)
        if isinstance(msg, StatesStep):
            return self._states_step(msg, frame_bytes)
        if isinstance(msg, Cancel):
            return self._cancel(rid)  # None: finished or unknown - Cancel is idempotent, nothing to answer
        if isinstance(msg, Resume):
            req = self.track(rid)
            if req is None:
                raise SessionError("resume_failed", f"request {rid} is not held here: replay it", rid)
            if req.states:
                return self._resume_states(req, msg)
            if req.finish == "error":  # failed while the link was down (its Error went nowhere): no tokens to resend
                raise _failed_while_away(req)
            if msg.have_tokens > req.tokens:
                raise SessionError("bad_position", f"client claims {msg.have_tokens} tokens, server sent "
                                                   f"{req.tokens}", rid)
            return req
        raise SessionError("bad_state", f"{type(msg).__name__} is not a client message", fatal=True)

    @staticmethod
    def _resume_states(req: RequestTrack, msg: Resume) -> RequestTrack:
        """u-shape: ``have_tokens`` = positions whose States the client holds; the server rolls back to it."""
        rid = req.request_id
        if req.finish == "error":
            raise _failed_while_away(req)
        if req.finish is not None:
            raise SessionError("resume_failed", f"u-shape request {rid} finished ({req.finish}): replay it", rid)
        if msg.have_tokens > req.answered:
            raise SessionError("bad_position", f"client claims the states of {msg.have_tokens} positions, the "
                                               f"server returned {req.answered}", rid)
        req.resume_at = msg.have_tokens
        return req

    @staticmethod
    def _check_not_resuming(req: RequestTrack, what: str) -> None:
        if req.resume_at is not None:
            raise SessionError("bad_state", f"{what} before the Resumed of u-shape request {req.request_id}",
                               req.request_id)

    def _check_frame(self, rid: str, frame_bytes: int | None) -> None:
        if frame_bytes is not None and frame_bytes > self.limits.max_frame_bytes:
            raise SessionError(TOO_LARGE, f"{frame_bytes}-byte frame (max_frame_bytes "
                                          f"{self.limits.max_frame_bytes})", rid)

    def _check_tensor(self, msg, end: int) -> None:
        if msg.hidden.codec not in self.codecs:
            raise SessionError("codec_not_negotiated", f"codec {msg.hidden.codec!r} not in {sorted(self.codecs)}",
                               msg.request_id)
        self._check_context(msg.request_id, end)

    def _prefill(self, msg: Prefill, frame_bytes: int | None) -> RequestTrack | None:
        rid, n = msg.request_id, msg.n_tokens
        req = self.requests.get(rid)
        if req is None:
            if rid in self.finished:
                if msg.params is None:
                    return None  # a late chunk of a request that finished or was refused: the client knows
                raise SessionError("duplicate_request", f"request id {rid} was already used", rid)
            if msg.params is None:
                raise SessionError("unknown_request", f"Prefill for request {rid}, which is not open (the first "
                                                      "Prefill of a request carries params)", rid)
            try:
                return self._open(msg, frame_bytes)
            except SessionError:
                self._remember(rid, None)  # refused: its later chunks are ignored, its id stays used
                raise
        if msg.params is not None:
            raise SessionError("duplicate_request", f"request {rid} is already open (params travel on its first "
                                                    "Prefill only)", rid)
        if msg.return_states or msg.prefix_keys or msg.prompt_len is not None:  # as params: the first Prefill
            field = ("return_states" if msg.return_states else  # decides them, later ones carry none
                     "prefix_keys" if msg.prefix_keys else "prompt_len")
            raise SessionError("bad_state", f"{field} on a later Prefill of request {rid} (the first Prefill alone "
                                            "carries it)", rid)
        self._check_frame(rid, frame_bytes)
        self._check_not_resuming(req, "Prefill")
        if req.prompt_done:
            raise SessionError("bad_state", "Prefill after the one with last=true (use DecodeStep)", rid)
        self._check_chunk(msg)
        if msg.start != req.received:
            raise SessionError("bad_position", f"Prefill starts at {msg.start}, the server holds {req.received}", rid)
        self._check_tensor(msg, msg.start + n)
        self._check_prompt(rid, msg.start + n)
        self._check_said_len(msg, req.said_len)
        self._advance(req, msg)
        return req

    def _check_context(self, rid: str, end: int) -> None:
        if end > self.limits.max_context:
            raise SessionError("context_full", f"position {end} beyond max_context {self.limits.max_context}", rid)

    def _check_prompt(self, rid: str, end: int) -> None:
        cap = self.limits.prompt_limit
        if end > cap:
            raise SessionError("prompt_too_long", f"prompt reaches position {end}, beyond max_prompt_tokens {cap}",
                               rid)

    @staticmethod
    def _check_said_len(msg: Prefill, said: int | None) -> None:
        """A prompt whose first Prefill said its length (``prompt_len``, ``said``) ends there: no chunk reaches past
        it, and the one that reaches it is the one with ``last`` (a chunk holds a row at least, so none could follow:
        the request would wait for its sampling until it timed out)."""
        end = msg.start + msg.n_tokens
        if said is not None and (end > said or msg.last and end < said):
            raise SessionError("bad_position", f"Prefill {'ends the prompt' if msg.last else 'reaches'} at {end}; its "
                                               f"first Prefill said prompt_len {said}", msg.request_id)
        if said is not None and not msg.last and end == said:
            raise SessionError("bad_position", f"Prefill reaches the said prompt_len {said} without last=true (the "
                                               "chunk that completes the prompt is the last)", msg.request_id)

    def _check_chunk(self, msg: Prefill) -> None:
        if msg.n_tokens > self.limits.max_prefill_chunk_tokens:
            raise SessionError(TOO_LARGE, f"{msg.n_tokens} tokens in one Prefill (max_prefill_chunk_tokens "
                                          f"{self.limits.max_prefill_chunk_tokens})", msg.request_id)

    def _open(self, msg: Prefill, frame_bytes: int | None) -> RequestTrack:
        rid = msg.request_id
        self._check_frame(rid, frame_bytes)
        if self.phase == DRAINING:
            raise SessionError("draining", "the server is draining: no new requests", rid)
        if len(self.requests) >= self.limits.max_concurrent_requests:
            raise SessionError("overloaded", f"{len(self.requests)} requests open "
                                             f"(max_concurrent_requests {self.limits.max_concurrent_requests})", rid)
        self._check_chunk(msg)
        if msg.return_states and msg.start:
            raise SessionError("bad_position", f"a u-shape request starts at 0 (its tail needs every position's "
                                               f"states), not {msg.start}", rid)
        block = self.limits.prefix_block_tokens
        if msg.start and (msg.start % block or msg.start > len(msg.prefix_keys) * block):
            raise SessionError("bad_position", f"start {msg.start}: a prefix must be whole blocks of {block} "
                                               f"covered by prefix_keys ({len(msg.prefix_keys)})", rid)
        self._check_tensor(msg, msg.start + msg.n_tokens)
        self._check_prompt(rid, msg.start + msg.n_tokens)
        if msg.prompt_len is not None:  # the whole prompt's length, said up front: held to the limits before its upload
            self._check_said_len(msg, msg.prompt_len)
            self._check_context(rid, msg.prompt_len)
            self._check_prompt(rid, msg.prompt_len)
        req = self.requests[rid] = RequestTrack(rid, received=msg.start, states=msg.return_states,
                                                answered=msg.start, said_len=msg.prompt_len)
        self._advance(req, msg)
        return req

    @staticmethod
    def _advance(req: RequestTrack, msg: Prefill) -> None:
        req.received += msg.n_tokens
        if msg.last:
            req.prompt_len = req.received

    def _decode_step(self, msg: DecodeStep | SpecStep, frame_bytes: int | None) -> RequestTrack | None:
        rid, spec = msg.request_id, isinstance(msg, SpecStep)
        what = "SpecStep" if spec else "DecodeStep"
        req = self.requests.get(rid)
        if req is None:
            if rid in self.finished:
                return None  # answers a token sent just before the request finished or failed
            raise SessionError("unknown_request", f"request {rid} is not open", rid)
        self._check_frame(rid, frame_bytes)
        if not req.prompt_done:
            raise SessionError("bad_state", f"{what} before the Prefill with last=true", rid)
        if req.states:
            raise SessionError("bad_state", f"{what} for a u-shape request (send StatesStep)", rid)
        if req.spec_position is not None or not req.awaits_step:
            raise SessionError("bad_state", f"{what} without a token to feed (one per generated token)", rid)
        if msg.position != req.received:
            raise SessionError("bad_position", f"{what} at {msg.position}, the server holds {req.received}", rid)
        n = 1
        if spec:
            n = msg.n_tokens
            if len(msg.draft_ids) > self.max_draft_tokens:
                raise SessionError(TOO_LARGE, f"{len(msg.draft_ids)} drafts in one SpecStep (the server takes "
                                              f"{self.max_draft_tokens})", rid)
            req.spec_position = msg.position
        self._check_tensor(msg, msg.position + n)
        req.received += n
        return req

    def _states_step(self, msg: StatesStep, frame_bytes: int | None) -> RequestTrack | None:
        rid = msg.request_id
        req = self.requests.get(rid)
        if req is None:
            if rid in self.finished:
                return None  # crossed the request's end in flight
            raise SessionError("unknown_request", f"request {rid} is not open", rid)
        self._check_frame(rid, frame_bytes)
        if not req.states:
            raise SessionError("bad_state", "StatesStep for a request that samples (send DecodeStep)", rid)
        self._check_not_resuming(req, "StatesStep")
        if not req.awaits_step:
            raise SessionError("bad_state", f"StatesStep before the server returned every position (it returned "
                                            f"{req.answered} of {req.received}, prompt done: {req.prompt_done})", rid)
        if not req.prompt_len <= msg.position <= req.received:
            raise SessionError("bad_position", f"StatesStep at {msg.position}: must be in [{req.prompt_len}, "
                                               f"{req.received}] (the prompt's end .. the server's positions)", rid)
        if msg.n_tokens > self.max_draft_tokens + 1:
            raise SessionError(TOO_LARGE, f"{msg.n_tokens} rows in one StatesStep (the server takes "
                                          f"{self.max_draft_tokens + 1})", rid)
        self._check_tensor(msg, msg.position + msg.n_tokens)
        req.received = msg.position + msg.n_tokens
        req.answered = msg.position  # positions from here on are dropped and recomputed
        return req

    # -- server -> client -----------------------------------------------------------------------------------
    def on_server(self, msg) -> None:
        """Record a message the server sends (it changes what the client may send next)."""
        if isinstance(msg, Welcome):
            self.phase = READY
            self.limits, self.codecs = msg.limits, set(msg.codecs)
            self.max_draft_tokens = msg.server.max_draft_tokens
        elif isinstance(msg, States):
            req = self.requests.get(msg.request_id)
            if req is not None:
                req.answered = max(req.answered, msg.start + msg.n_tokens)
        elif isinstance(msg, Tokens):
            req = self.requests.get(msg.request_id)
            if req is None:
                return
            req.tokens = max(req.tokens, msg.index + len(msg.token_ids))
            if req.spec_position is not None and msg.token_ids:  # the verdict: the rejected drafts' KV is gone
                req.spec_position = None
                req.received = req.prompt_len + req.tokens - 1
            if msg.finish_reason is not None:
                self._finish(req, msg.finish_reason)
        elif isinstance(msg, Resumed):
            req = self.track(msg.request_id)
            if req is None:
                return
            req.tokens = max(req.tokens, msg.index + len(msg.token_ids))
            req.received = msg.received  # the server's word: what it holds (a lost link may have eaten some)
            req.spec_position = None
            if req.states:  # u-shape: rolled back to the client's positions; their States were all returned
                req.answered, req.resume_at = msg.received, None
            if req.prompt_len is not None and msg.received < req.prompt_len:
                req.prompt_len = None  # the prompt's last chunk never arrived: it is resent
            if msg.finish_reason is not None and req.finish is None:
                self._finish(req, msg.finish_reason)
        elif isinstance(msg, Error):
            if msg.fatal:
                self.phase = CLOSED
            elif msg.request_id is not None and msg.request_id in self.requests:
                self.requests[msg.request_id].failed = msg
                self._finish(self.requests[msg.request_id], "error")
        elif isinstance(msg, Drain):
            if self.phase != CLOSED:
                self.phase = DRAINING
        elif isinstance(msg, Close):
            self.phase = CLOSED

    def _finish(self, req: RequestTrack, reason: str) -> None:
        req.finish = reason
        self.requests.pop(req.request_id, None)
        self._remember(req.request_id, req)

    def _remember(self, rid: str, req: RequestTrack | None) -> None:
        self.finished[rid] = req
        self.finished.move_to_end(rid)
        if req is not None:
            self._kept.append(rid)
            if len(self._kept) > FINISHED_KEPT:  # keep the tracks of the latest FINISHED_KEPT only
                old = self._kept.popleft()
                if old in self.finished:
                    self.finished[old] = None
        while len(self.finished) > FINISHED_MEMORY:
            self.finished.popitem(last=False)
