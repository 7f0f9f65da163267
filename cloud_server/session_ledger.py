"""Split sessions counted across front-end worker processes, in the engine process (``--workers N``).

Each worker keeps its own sessions (``cloud_server.session_store``: state machines, records, links); what must
hold over all of them lives here: ``max_sessions`` and the per-key session caps (``KeyEntry.max_sessions`` of
the keys file), and which worker holds a resume token. A worker asks :meth:`SessionLedger.admit` before it
opens a session and tells :meth:`release` when one closes.

Resume across workers: a reconnecting edge may land on another worker than the one holding its session. That
worker does not have the session's state, so it opens a new session (``Welcome.resumed`` false) and the edge
replays its context, as after a server restart (0 tokens lost). ``admit(replaces=token)`` frees the old
session at once: it names the worker and session to *reclaim* (the engine process tells that worker to close
it, aborting its requests), so the replay does not wait out the grace period beside a stale copy holding KV.
Only a key that may resume the session reclaims it: one acting as the key that opened it, the same tenant and
role (``cloud_server.auth.Principal.acts_as``, the rule of ``SessionRegistry.for_resume`` on the worker holding
it). Another key presenting the token opens its new session beside the old one, which runs on: a tenant key
holding its operator's token closed the operator's session on another worker (only the tenant was compared).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from cloud_server.auth import Principal


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    worker: int  # the link of the worker holding it (``WorkerPort.serial``)
    resume_token: str
    principal: Principal  # who opened it: its key (per-key caps; key_id None: no key of the store), tenant and role


@dataclass(frozen=True, slots=True)
class Admission:
    """``refusal``: None (admitted) or ``(metric reason, message)``; ``reclaim``: ``(worker, session_id)`` to
    close because its edge reconnected here (None: nothing to reclaim)."""

    refusal: tuple[str, str] | None
    reclaim: tuple[int, str] | None = None


class SessionLedger:
    """Thread-safe (the engine process's link threads call it)."""

    def __init__(self, max_sessions: int):
        self.max_sessions = max_sessions
        self._entries: dict[str, LedgerEntry] = {}  # session id -> entry
        self._by_token: dict[str, str] = {}  # resume token -> session id
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def admit(self, worker: int, session_id: str, entry: LedgerEntry, replaces: str | None = None) -> Admission:
        """Count ``session_id`` for ``worker`` unless the server or its key (``entry.principal.max_sessions``) is
        at its limit. ``replaces``: the resume token the edge presented, which ``worker`` does not hold (reclaimed
        from its holder first when ``entry.principal`` acts as the principal that opened it)."""
        with self._lock:
            reclaim = None
            old = self._by_token.get(replaces) if replaces else None
            prior = self._entries[old] if old is not None else None
            if prior is not None and prior.principal.acts_as(entry.principal) and prior.worker != worker:
                reclaim = (prior.worker, old)
                self._drop(old)
            if len(self._entries) >= self.max_sessions:
                return Admission(("overloaded", f"server at its limit of {self.max_sessions} sessions; retry later"),
                                 reclaim)
            key_id, key_cap = entry.principal.key_id, entry.principal.max_sessions
            if key_cap is not None and key_id is not None:
                held = sum(1 for e in self._entries.values() if e.principal.key_id == key_id)
                if held >= key_cap:
                    return Admission(("key_session_cap", f"API key {key_id} holds its limit of {key_cap} "
                                                         "sessions; retry later"), reclaim)
            self._entries[session_id] = entry
            self._by_token[entry.resume_token] = session_id
            return Admission(None, reclaim)

    def release(self, session_id: str) -> None:
        with self._lock:
            self._drop(session_id)

    def drop_worker(self, worker: int) -> list[str]:
        """Forget every session of ``worker`` (its process is gone); returns their ids."""
        with self._lock:
            gone = [sid for sid, e in self._entries.items() if e.worker == worker]
            for sid in gone:
                self._drop(sid)
            return gone

    def _drop(self, session_id: str) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._by_token.pop(entry.resume_token, None)
