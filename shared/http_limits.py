"""HTTP admission limits that refuse at once instead of queueing, both servers' (pure ASGI middleware, no torch).

:class:`HttpConcurrencyLimit`: at most ``limit`` HTTP requests under ``/v1/`` in flight; the next gets ``429`` with
``Retry-After`` and an OpenAI error body (``overloaded``), which the ``openai`` client retries. The cloud's
``--max-http-requests`` and the edge's (``autoglm-edge serve --max-http-requests``: its runtime answers one request at
a time, and each one waiting its turn held its body - up to 32 MiB - and its socket, so a local app sending many at
once grew the endpoint's memory without bound). :class:`SlotLimit` is their base, the cloud's ``ConnectionLimit``'s
too (``cloud_server.limits``).
"""

from __future__ import annotations

import json
import math

RETRY_AFTER_S = 1  # what a refused client is told to wait (Retry-After) when nothing says how long


def retry_after(wait_s: float | None = None) -> str:
    """``Retry-After``'s value for a wait of ``wait_s`` seconds (None: :data:`RETRY_AFTER_S`), the one rule of every
    refusal both servers answer with it: whole seconds (HTTP's delay-seconds), rounded up so a client never comes
    back sooner than asked, and at least 1 (0 would have the ``openai`` client retry on its own backoff instead)."""
    return str(max(1, math.ceil(RETRY_AFTER_S if wait_s is None else wait_s)))


def limit_problem(limit: int) -> str | None:
    """Why ``limit`` is no cap on what is in flight (None: it is one)."""
    return None if limit >= 1 else f"must be >= 1 (got {limit})"


class SlotLimit:
    """ASGI middleware holding one slot per request it :meth:`counts` while it runs; with ``limit`` held, the next is
    :meth:`refused` at once."""

    def __init__(self, app, limit: int):
        if (problem := limit_problem(limit)) is not None:
            raise ValueError(f"limit {problem}")
        self.app, self.limit = app, limit
        self.held = 0  # event-loop thread only

    def counts(self, scope) -> bool:
        raise NotImplementedError

    async def refused(self, scope, send) -> None:
        raise NotImplementedError

    async def __call__(self, scope, receive, send):
        if not self.counts(scope):
            await self.app(scope, receive, send)
            return
        if self.held >= self.limit:
            await self.refused(scope, send)
            return
        self.held += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.held -= 1


class HttpConcurrencyLimit(SlotLimit):
    """ASGI middleware: at most ``limit`` HTTP requests under ``prefix`` in flight; beyond, 429 + Retry-After.

    Probes (``/health``, ``/ready``, ``/metrics``) and WebSockets are not counted: a probe must answer under
    load, and sessions have their own caps. A streamed response holds its slot until its last byte."""

    def __init__(self, app, limit: int, prefix: str = "/v1/"):
        super().__init__(app, limit)
        self.prefix = prefix

    def counts(self, scope) -> bool:
        return scope["type"] == "http" and scope["path"].startswith(self.prefix)

    async def refused(self, scope, send) -> None:
        await refuse(send, "http.response", 429, f"server at its limit of {self.limit} concurrent requests; retry "
                     "later", "rate_limit_error")


async def refuse(send, kind: str, status: int, message: str, error_type: str) -> None:
    """An ``overloaded`` refusal in OpenAI's error shape, with Retry-After (``kind``: the ASGI response type)."""
    body = json.dumps({"error": {"message": message, "type": error_type, "param": None,
                                 "code": "overloaded"}}).encode()
    await send({"type": f"{kind}.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", retry_after().encode()),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": f"{kind}.body", "body": body})
