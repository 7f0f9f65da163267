"""Split sessions on the cloud: who is connected, the protocol state of each, and what a reconnect needs.

A :class:`Session` outlives its WebSocket: when the link drops the session is *detached* and keeps its
requests (and their KV in the engine) for ``grace_s`` so the edge can reconnect with its resume token
(``Hello.resume_token``) and ``Resume`` each request. After the grace period, or on ``Close``, everything is
aborted and the KV freed. :class:`SessionRegistry` enforces ``max_sessions`` over attached and detached
sessions alike (a session in its grace period still holds KV).

The protocol rules live in one place, the shared state machine (``shared.session_state.SessionState``), one
per session: every message received passes its ``on_client`` before it is acted on, and every message sent
goes through :meth:`Session.send`, which records it with ``on_server``. What the server remembers beyond the
rules - the engine's id for a request, its tokens (so ``Resume`` can resend those the edge missed), its plan
- is the :class:`RequestRecord` hung on the request's track (``RequestTrack.owner``), so records and tracks
are kept and forgotten together. Everything here runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field

from shared import protocol as P
from shared.session_state import RequestTrack, SessionState


@dataclass(slots=True, eq=False)
class RequestRecord:
    track: RequestTrack  # the protocol's view (positions, tokens sent, finish)
    engine_id: str  # the engine's id: "<session id>/<request id>"
    codec: str  # codec of its first Prefill (metrics, the plan report)
    compute: str  # the compute variant serving it
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    plan_sent: bool = False  # the first Tokens carries the plan actually used
    last_input: float = field(default_factory=time.monotonic)  # when its latest input arrived (timings)
    last_output: float = 0.0  # when its latest answer (Tokens, States, Error) went out
    last_progress: float = 0.0  # when its latest progress Tokens went out (SplitTranslator.send_progress)

    @property
    def request_id(self) -> str:
        return self.track.request_id

    @property
    def active(self) -> bool:
        return self.track.finish is None

    def progress_due(self, now: float, interval_s: float) -> bool:
        """It owes the edge an answer (input came after its last one) and the link has been quiet about it
        for ``interval_s``."""
        return self.active and self.last_input >= self.last_output and \
            now - max(self.last_input, self.last_progress) >= interval_s


class Session:
    def __init__(self, session_id: str, resume_token: str, codecs: list[str], plan, tenant: str):
        self.session_id = session_id
        self.resume_token = resume_token
        self.tenant = tenant  # cloud_server.auth.Principal.tenant of its API key: the namespace of its prefix blocks
        self.principal = None  # cloud_server.auth.Principal: its key (per-key session cap, usage label)
        self.usage = None  # cloud_server.usage.TenantUsage: per-tenant counters and the trace log
        self.codecs = codecs  # negotiated codec names
        self.plan = plan  # shared.precision.PrecisionPlan: the session's default
        self.state = SessionState()
        self.outq: asyncio.Queue | None = None  # frames for the attached WebSocket, in order
        self.ws = None  # the attached WebSocket
        self.generation = 0  # bumped per attach: a replaced connection's cleanup must not detach the new one
        self.expiry: asyncio.TimerHandle | None = None
        self.closed = False

    @property
    def attached(self) -> bool:
        return self.outq is not None

    @property
    def prefix_scope(self) -> str:
        """Where its prompt blocks are published: its tenant's namespace, or the shared one for an operator's key
        (``cloud_server.auth.Principal.prefix_scope``)."""
        return self.tenant if self.principal is None else self.principal.prefix_scope

    def send(self, msg) -> None:
        """Record ``msg`` in the protocol state and queue it for the attached link. Dropped while detached:
        the state still advances, and ``Resume`` recovers the tokens."""
        self.state.on_server(msg)
        frame = P.encode_message(msg) if self.outq is not None else b""
        if self.usage is not None:
            self.usage.on_sent(self, msg, len(frame))
        if self.outq is not None:
            self.outq.put_nowait(frame)

    def record(self, request_id: str) -> RequestRecord | None:
        """The server's record of an open or recently finished request (None: unknown, or not admitted)."""
        track = self.state.track(request_id)
        return None if track is None else track.owner

    def active_requests(self) -> list[RequestRecord]:
        return [t.owner for t in self.state.requests.values() if t.owner is not None]


class SessionRegistry:
    """``id_prefix``: what every session id starts with (a front-end worker's ``w<i>-``: which one holds it)."""

    def __init__(self, max_sessions: int, id_prefix: str = ""):
        self.max_sessions = max_sessions
        self.id_prefix = id_prefix
        self.by_id: dict[str, Session] = {}
        self.by_token: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    @property
    def full(self) -> bool:
        return len(self.by_id) >= self.max_sessions

    def open_requests(self) -> int:
        """Requests open over every session (the server's load, as the network side counts it)."""
        return sum(s.state.open_requests for s in self.by_id.values())

    def mint(self) -> tuple[str, str]:
        """A new session id and resume token (what :meth:`create` takes; admission may need them first)."""
        return self.id_prefix + secrets.token_hex(8), secrets.token_urlsafe(24)

    def create(self, codecs: list[str], plan, tenant: str, session_id: str | None = None,
               resume_token: str | None = None) -> Session:
        """Register a new session; ``session_id`` / ``resume_token`` from :meth:`mint` (None: minted here)."""
        if session_id is None or resume_token is None:
            session_id, resume_token = self.mint()
        s = Session(session_id, resume_token, codecs, plan, tenant)
        self.by_id[s.session_id] = s
        self.by_token[s.resume_token] = s
        return s

    def for_resume(self, token: str | None, principal) -> Session | None:
        """The live session holding ``token`` that ``principal`` (``cloud_server.auth.Principal``: the reconnecting
        key's) may take over: one it acts as (the same tenant and role, ``Principal.acts_as``); another tenant's key, or
        a tenant key presenting an operator session's token, opens a new session instead. It may still look attached:
        a link that died without a close (a phone losing coverage) is only noticed later, and the reconnect takes it
        over."""
        if not token:
            return None
        s = self.by_token.get(token)
        return s if s is not None and not s.closed and s.principal.acts_as(principal) else None

    def remove(self, s: Session) -> None:
        s.closed = True
        s.state.close()
        if s.expiry is not None:
            s.expiry.cancel()
            s.expiry = None
        self.by_id.pop(s.session_id, None)
        self.by_token.pop(s.resume_token, None)
