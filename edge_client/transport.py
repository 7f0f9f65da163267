"""The edge's WebSocket link to the cloud: connect, handshake, framed messages, keepalive, reconnect.

One :class:`Link` is one WebSocket (the ``websockets`` asyncio client) carrying binary frames of
``shared.protocol`` messages, one message per frame. WebSocket compression is off: hidden states are
already coded, and deflating them costs phone CPU for nothing. Keepalive is the WebSocket ping/pong (a
missed pong closes the link, which the client treats as a drop).

Failure classes (the client's retry decisions hang on them):

* :class:`LinkDown` - the connection dropped, timed out or could not be opened, or the server said "not now"
  (:data:`RETRYABLE_REFUSALS`): retry with backoff, never sooner than the server's ``retry_after_ms``.
* :class:`HandshakeRefused` - the server said no (bundle mismatch, bad API key, at capacity): not retried.
* :class:`GarbageFromServer` - the peer is not speaking our protocol (a non-WebSocket HTTP reply, an
  undecodable frame): not retried; the message says what arrived.

The URL may be the server's base URL (``ws://host:port``, as an OpenAI client takes ``base_url``; its ``http(s)://``
is ``ws(s)://``) or the split endpoint itself (``ws://host:port/v1/split``); :func:`~edge_client.config.split_url`
resolves the first to the second. A URL with no split endpoint behind it (HTTP 403/404 on the upgrade) says so.

Routing: with :attr:`Link.route_key` set (the first prefix key of the system prompt the edge preloaded, scoped
by tenant: :func:`route_key`), every upgrade carries it in :data:`ROUTE_HEADER`, so a proxy that hashes on it
(deploy/nginx/autoglm-split.conf) sends phones that share a system prompt to the replica that caches it. The
key is a hash chain over the prompt's token ids and the bundle id, never the ids; without a preloaded prompt
no header is sent (the proxy balances round-robin), nor on a connection opened for a request at a private level
(``connect(route=False)``): the key is unsalted, and would confirm a guessed system prompt; nor on the upgrade
after the hashed replica refused the session for now or drains, or left the upgrade unanswered (:class:`ServerBusy`,
:class:`NoAnswer`: the hash would pick it again).

Byte counters include every frame in both directions, so the client's "bytes up/down" are what the link
carried, not what the payloads weighed.
"""

from __future__ import annotations

import asyncio
import ssl

import websockets
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from shared import protocol as P
from shared.prefix_keys import KeyScope, block_keys, tenant_of, tenant_scoped

from . import tls
from .config import RetryPolicy, split_url

# Refusals at Hello that say "not now" rather than "never": reconnecting later may succeed.
RETRYABLE_REFUSALS = ("draining", "overloaded", "internal")
ROUTE_HEADER = "X-Autoglm-Prefix-Key"  # the upgrade header a prefix-aware proxy hashes on


def route_key(ids, scope: KeyScope, block_tokens: int, api_key: str | None) -> str | None:
    """The routing key of a system prompt ``ids``: its first prefix key (``shared.prefix_keys.block_keys``) in
    the namespace of the API key's tenant (``tenant_scoped``); None when the prompt is shorter than a block."""
    keys = block_keys(ids, scope, block_tokens)
    if not keys:
        return None
    return tenant_scoped(tenant_of(f"Bearer {api_key}" if api_key else None), keys[0])


class LinkDown(Exception):
    """The link is gone (closed, timed out, unreachable) or the server refused it for now; reconnecting may help,
    not before ``retry_after_s`` (the refusal's ``retry_after_ms``; None: the backoff alone)."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServerBusy(LinkDown):
    """The server refused the session for now (:data:`RETRYABLE_REFUSALS`: full, draining, its engine not running),
    or is draining: another replica may take it. Behind a proxy that hashes on :data:`ROUTE_HEADER` the next upgrade
    goes without it (``Session.connect``), or every retry would reach this same replica. ``code``: the refusal's
    wire code (``overloaded``, ``draining``, ``internal``); None when nothing answered (:class:`NoAnswer`)."""

    def __init__(self, message: str, retry_after_s: float | None = None, code: str | None = None):
        super().__init__(message, retry_after_s)
        self.code = code


class NoAnswer(ServerBusy):
    """The WebSocket upgrade went unanswered within ``connect_timeout_s``. Behind a proxy that is a replica which takes
    connections and answers nothing (hung: the proxy sees no error, so it never skips it); as after a refusal, the next
    upgrade goes without :data:`ROUTE_HEADER`, which pinned every retry to it."""


class HandshakeRefused(Exception):
    """The server refused the session; ``code`` is the wire error code (or the HTTP status). ``bundle_ids``:
    for ``bundle_mismatch``, the bundles the server serves (``Error.bundle_ids``)."""

    def __init__(self, code: str, message: str, bundle_ids: list[str] | None = None):
        super().__init__(message)
        self.code = code
        self.bundle_ids = list(bundle_ids or [])


class GarbageFromServer(Exception):
    """The peer answered something that is not our protocol."""


class Link:
    """One WebSocket session to the cloud (see the module docstring)."""

    def __init__(self, url: str, api_key: str | None, retry: RetryPolicy, max_frame_bytes: int = 64 << 20,
                 ca_file=None):
        self.url = split_url(url)
        self.api_key = api_key
        self.ca_file = ca_file  # wss://: trust only this CA file (else the system store / SSL_CERT_FILE)
        self.retry = retry
        self.max_frame_bytes = max_frame_bytes  # the largest frame we accept; the server's limit is in Welcome
        self.ws: ClientConnection | None = None
        self.bytes_up = 0
        self.bytes_down = 0
        self.route_key: str | None = None  # sent as ROUTE_HEADER on every upgrade when set (:func:`route_key`)

    @property
    def open(self) -> bool:
        return self.ws is not None and self.ws.state is websockets.protocol.State.OPEN

    async def connect(self, hello: P.Hello, route: bool = True) -> P.Welcome:
        """Open the WebSocket and run Hello -> Welcome (``route``: send the route key, if any); raises LinkDown /
        HandshakeRefused / GarbageFromServer."""
        await self.close()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if route and self.route_key is not None:
            headers[ROUTE_HEADER] = self.route_key
        try:
            context = tls.client_context(self.url, self.ca_file)
        except (FileNotFoundError, ValueError) as e:  # the CA file went missing or holds no certificate
            raise HandshakeRefused("tls_error", str(e)) from None
        try:
            self.ws = await asyncio.wait_for(
                connect(self.url, ssl=context, additional_headers=headers, compression=None,
                        max_size=self.max_frame_bytes,
                        open_timeout=self.retry.connect_timeout_s, ping_interval=self.retry.keepalive_interval_s,
                        ping_timeout=self.retry.keepalive_timeout_s, close_timeout=2.0,
                        user_agent_header="autoglm-edge"),
                self.retry.connect_timeout_s + 1.0)
        except InvalidStatus as e:
            status = e.response.status_code
            body = (e.response.body or b"")[:200].decode("utf-8", "replace").strip()
            if status == 401:
                raise HandshakeRefused("unauthorized", f"{self.url}: HTTP 401: API key refused"
                                       + (f" ({body})" if body else "")) from None
            if status in (403, 404):  # an ASGI server refuses an upgrade to a path it has no WebSocket route for
                raise HandshakeRefused("no_split_endpoint", f"no split endpoint at {self.url} (HTTP {status} on the "
                                       f"WebSocket upgrade); the cloud serves it at <base URL>/v1/split, unless "
                                       f"it runs in full-model mode (--full), which has none"
                                       + (f" ({body})" if body else "")) from None
            if status >= 500 or status == 429:
                raise LinkDown(f"{self.url}: HTTP {status} at connect" + (f" ({body})" if body else "")) from None
            raise GarbageFromServer(f"{self.url}: HTTP {status} instead of a WebSocket upgrade"
                                    + (f" ({body})" if body else "") + "; is this the cloud's split endpoint?") from None
        except InvalidURI as e:
            raise HandshakeRefused("bad_url", f"{self.url}: {e}") from None
        except InvalidHandshake as e:
            why = await asyncio.to_thread(tls.explain, self.url, e, self.ca_file)  # ws:// to a TLS server?
            if why is not None:
                raise HandshakeRefused(*why) from None
            if isinstance(e.__cause__, EOFError):  # closed before any reply: a proxy with its backend down
                raise LinkDown(f"{self.url}: connection closed before the HTTP upgrade was answered") from None
            raise GarbageFromServer(f"{self.url}: not a WebSocket server ({type(e).__name__}: {e})") from None
        except ssl.SSLError as e:  # an unverifiable certificate, or no TLS behind wss://: retrying will not help
            raise HandshakeRefused(*tls.explain(self.url, e, self.ca_file)) from None
        except asyncio.TimeoutError as e:  # (an OSError too)
            raise NoAnswer(f"{self.url}: cannot connect ({type(e).__name__}: {e or 'timed out'})") from None
        except (OSError, ConnectionClosed) as e:
            raise LinkDown(f"{self.url}: cannot connect ({type(e).__name__}: {e or 'timed out'})") from None
        await self.send(hello)
        reply = await self.recv(self.retry.connect_timeout_s)
        if isinstance(reply, P.Error):
            await self.close()
            if reply.code in RETRYABLE_REFUSALS:  # another attempt (or replica) may be accepted
                raise ServerBusy(f"server busy: {reply.code}: {reply.message}", retry_after_s(reply), reply.code)
            raise HandshakeRefused(reply.code, f"server refused the session: {reply.code}: {reply.message}",
                                   reply.bundle_ids)
        if not isinstance(reply, P.Welcome):
            await self.close()
            raise GarbageFromServer(f"{self.url}: expected Welcome, got {type(reply).__name__}")
        return reply

    async def send(self, msg) -> int:
        return await self.send_frame(P.encode_message(msg))

    async def send_frame(self, frame: bytes) -> int:
        """Send one encoded message; returns its size."""
        if self.ws is None:
            raise LinkDown("not connected")
        try:
            await self.ws.send(frame)
        except ConnectionClosed as e:
            raise LinkDown(f"connection closed while sending ({e})") from None
        self.bytes_up += len(frame)
        return len(frame)

    async def recv(self, timeout: float):
        """The next message; LinkDown on close or when nothing arrives within ``timeout`` seconds."""
        if self.ws is None:
            raise LinkDown("not connected")
        try:
            frame = await asyncio.wait_for(self.ws.recv(), timeout)
        except asyncio.TimeoutError:
            await self.close()
            raise LinkDown(f"no reply from the server in {timeout:.1f} s") from None
        except ConnectionClosed as e:
            raise LinkDown(f"connection closed ({e})") from None
        if isinstance(frame, str):
            raise GarbageFromServer(f"server sent a text frame ({frame[:60]!r}); the protocol is binary")
        self.bytes_down += len(frame)
        try:
            return P.decode_message(frame)
        except P.ProtocolError as e:
            raise GarbageFromServer(f"server sent an undecodable frame ({e})") from None

    async def wait_closed(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the peer to close the connection (after we sent Close)."""
        if self.ws is not None:
            try:
                await asyncio.wait_for(self.ws.wait_closed(), timeout)
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            try:
                await asyncio.wait_for(ws.close(), 2.0)
            except (asyncio.TimeoutError, ConnectionClosed, OSError):
                pass


def retry_after_s(error: P.Error) -> float | None:
    """The wait an ``Error`` asks for before another attempt, in seconds (None: it names none)."""
    return error.retry_after_ms / 1000 if error.retry_after_ms is not None else None
