"""Admission limits that refuse quickly instead of queueing: per-key session caps, HTTP concurrency.

Every limit here answers at once with a "try later" and never parks work in an unbounded queue:

* split sessions: the server's ``max_sessions`` (``SessionRegistry.full``) and, per API key, the key's
  ``max_sessions`` from the keys file (:func:`session_cap_refusal`), both refused at Hello with
  ``Error(overloaded, retry_after_ms)`` and close code 1013;
* HTTP ``/v1`` requests (full-model mode's OpenAI routes, ``/v1/models``): at most ``max_http_requests`` in
  flight (:class:`shared.http_limits.HttpConcurrencyLimit`, the edge's endpoint's too); the next gets ``429`` with
  ``Retry-After`` and an OpenAI error body;
* connections, WebSockets and HTTP requests alike: at most ``max_connections`` open (:class:`ConnectionLimit`);
  the next gets 503 with ``Retry-After`` (a WebSocket before its upgrade), and the handshake timeout closes a
  WebSocket that sends no Hello. The probes are neither counted nor refused.

Every HTTP refusal is counted by ``cloud_server.metrics.HttpRefusals`` (by its status and error code); a refused
WebSocket by ``on_refused``. Frame sizes, context length and timeouts are the session's ``Welcome.limits`` (``cloud_server.split_endpoint``).
"""

from __future__ import annotations

from collections.abc import Callable

from shared.http_limits import RETRY_AFTER_S, SlotLimit, refuse
# Error.retry_after_ms of the refusals worth retrying, at Hello and for a request alike (the edge waits at least this):
# a busy server soon has room; a draining one is going away, and another replica (a load balancer's next pick) or
# its replacement usually answers within a second - a longer wait would stall every drain's failover
RETRY_AFTER_MS = {"overloaded": RETRY_AFTER_S * 1000, "draining": 1000}


OWN_FILES = 1024  # descriptors beside the connections: bundle and model files, worker pipes, logs, the probes


def raise_open_files(max_connections: int) -> str | None:
    """Raise this process's soft open-file limit (``RLIMIT_NOFILE``; front-end workers inherit it) to hold
    ``max_connections`` sockets and :data:`OWN_FILES`, as far as the hard limit allows (vLLM's server raises it too).
    The usual soft limit, 1024, held about 1000 sockets: past them every accept failed (EMFILE, a log line each) and the
    probes timed out, far below the connection cap that answers 503 and lets them through. Returns a warning when the
    hard limit is lower than that, else None."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    want = max_connections + OWN_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError, OverflowError):  # above the kernel's nr_open; an absurd cap past a C long
            new = soft
        if new < want:
            return (f"the open-file limit is {new} (hard {hard}), below --max-connections {max_connections} + "
                    f"{OWN_FILES}: past ~{max(new - OWN_FILES, 0)} connections accepts fail and the probes with them; "
                    "raise it (ulimit -n, the container's nofile) or lower --max-connections")
    return None


def session_cap_refusal(registry, principal) -> str | None:
    """Why ``principal`` may not open another split session (None: it may). Counts the sessions its key holds,
    attached or within their resume grace (both hold KV)."""
    cap = getattr(principal, "max_sessions", None)
    if cap is None:
        return None
    held = sum(1 for s in registry.by_id.values()
               if getattr(s, "principal", None) is not None and s.principal.key_id == principal.key_id)
    if held >= cap:
        return f"API key {principal.key_id} holds its limit of {cap} sessions; retry later"
    return None


PROBES = ("/health", "/ready", "/metrics")


class ConnectionLimit(SlotLimit):
    """ASGI middleware: at most ``limit`` WebSockets and HTTP requests open at once; beyond, 503 + Retry-After (for a
    WebSocket, before the upgrade: a proxy tries its next replica). The probes pass uncounted, so a server at its
    cap stays alive and scraped. uvicorn's ``limit_concurrency`` did this job: it never refused a WebSocket (an
    upgrade skips its check) but counted them, so once the phones' sessions reached the cap every probe got 503 -
    the liveness probe restarted a busy pod and the autoscaler lost its metrics."""

    def __init__(self, app, limit: int, on_refused: Callable[[dict], None] | None = None):
        super().__init__(app, limit)
        self.on_refused = on_refused  # on_refused(scope): one refused (metrics)

    def counts(self, scope) -> bool:
        return scope["type"] in ("http", "websocket") and scope["path"] not in PROBES

    async def refused(self, scope, send) -> None:
        if self.on_refused is not None:
            self.on_refused(scope)
        await _unavailable(scope, send, self.limit)


async def _unavailable(scope, send, limit: int) -> None:
    if scope["type"] == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1013})  # no denial responses here: HTTP 403
        return
    await refuse(send, "websocket.http.response" if scope["type"] == "websocket" else "http.response", 503,
                 f"server at its limit of {limit} open connections; retry later", "server_error")
