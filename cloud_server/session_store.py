"""Split sessions on the cloud: who is connected, their open requests, and what a reconnect needs.

A :class:`Session` outlives its WebSocket: when the link drops the session is *detached* and keeps its
requests (and their KV in the engine) for ``grace_s`` so the edge can reconnect with its resume token
(``Hello.resume_token``) and ``Resume`` each request. After the grace period, or on ``Close``, everything is
aborted and the KV freed. :class:`SessionRegistry` enforces ``max_sessions`` over attached and detached
sessions alike (a session in its grace period still holds KV).

:class:`RequestRecord` is what the server remembers of one request for the wire: the tokens it generated
(so ``Resume`` can resend those the edge missed), the next position it expects, the finish reason.
Everything here runs on the event loop thread; the engine's outputs reach it via ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

FINISHED_KEPT = 16  # finished requests a session remembers (a Resume after the finish still gets its tokens)


@dataclass(slots=True)
class RequestRecord:
    request_id: str  # the edge's id (unique within the session)
    engine_id: str  # the engine's id: "<session id>/<request id>"
    codec: str  # codec of its first Prefill (metrics)
    compute: str  # the compute variant serving it
    received: int = 0  # positions [0, received) handed to the engine
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None  # wire finish reason once finished
    plan_sent: bool = False  # the first Tokens carries the plan actually used
    last_input: float = field(default_factory=time.monotonic)  # when its latest input arrived (timings)

    @property
    def active(self) -> bool:
        return self.finish is None


class Session:
    def __init__(self, session_id: str, resume_token: str, codecs: list[str], plan):
        self.session_id = session_id
        self.resume_token = resume_token
        self.codecs = codecs  # negotiated codec names
        self.plan = plan  # shared.precision.PrecisionPlan: the session's default
        self.requests: OrderedDict[str, RequestRecord] = OrderedDict()
        self.dead: OrderedDict[str, None] = OrderedDict()  # refused request ids: late chunks are dropped
        self.outq: asyncio.Queue | None = None  # frames for the attached WebSocket, in order
        self.ws = None  # the attached WebSocket
        self.generation = 0  # bumped per attach: a replaced connection's cleanup must not detach the new one
        self.expiry: asyncio.TimerHandle | None = None
        self.closed = False

    @property
    def attached(self) -> bool:
        return self.outq is not None

    def send(self, frame: bytes) -> None:
        """Queue a frame for the attached link; dropped when detached (Resume recovers tokens)."""
        if self.outq is not None:
            self.outq.put_nowait(frame)

    def active_requests(self) -> list[RequestRecord]:
        return [r for r in self.requests.values() if r.active]

    def finished(self, rec: RequestRecord) -> None:
        """Keep a bounded number of finished records for late Resumes."""
        done = [k for k, r in self.requests.items() if not r.active]
        for k in done[: max(0, len(done) - FINISHED_KEPT)]:
            del self.requests[k]

    def mark_dead(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.dead[request_id] = None
        while len(self.dead) > 64:
            self.dead.popitem(last=False)


class SessionRegistry:
    def __init__(self, max_sessions: int):
        self.max_sessions = max_sessions
        self.by_id: dict[str, Session] = {}
        self.by_token: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    @property
    def full(self) -> bool:
        return len(self.by_id) >= self.max_sessions

    def create(self, codecs: list[str], plan) -> Session:
        s = Session(secrets.token_hex(8), secrets.token_urlsafe(24), codecs, plan)
        self.by_id[s.session_id] = s
        self.by_token[s.resume_token] = s
        return s

    def for_resume(self, token: str | None) -> Session | None:
        """The live session holding ``token``. It may still look attached: a link that died without a close
        (a phone losing coverage) is only noticed later, and the reconnect takes the session over."""
        if not token:
            return None
        s = self.by_token.get(token)
        return s if s is not None and not s.closed else None

    def remove(self, s: Session) -> None:
        s.closed = True
        if s.expiry is not None:
            s.expiry.cancel()
            s.expiry = None
        self.by_id.pop(s.session_id, None)
        self.by_token.pop(s.resume_token, None)
