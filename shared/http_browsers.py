"""What a web browser may ask of both servers (pure ASGI middleware, no torch): ``autoglm-edge serve``'s local
endpoint and ``autoglm-cloud serve``, their ``--allowed-hosts`` and ``--allowed-origins``.

A server on 127.0.0.1 without a key is reachable by every page the user's browser opens, two ways:

* a cross-site request: a page on evil.example POSTs to ``http://127.0.0.1:PORT/v1/chat/completions``. A "simple"
  request (``Content-Type`` text/plain or a form, or none) needs no CORS preflight: the browser sends it, only the
  answer stays unreadable - the generation (the user's compute, the cloud's quota, an agent's actions) ran all the
  same. Browsers send ``Origin`` on such a request and on every WebSocket handshake; apps (the ``openai`` client,
  httpx, curl, the edge's own WebSocket) send none.
* DNS rebinding: evil.example's name is rebound to 127.0.0.1, and its page reads the answers same-origin (a
  same-origin GET carries no ``Origin``). The request names the page's host: ``Host: evil.example:PORT``.

:class:`BrowserGuard` refuses both with a 403 in OpenAI's error shape before any route runs (a WebSocket: before
the upgrade): a ``Host`` that is not a loopback name or address (``localhost``, ``*.localhost``, ``127.0.0.0/8``,
``::1``), the listen address itself or one of :attr:`BrowserPolicy.allowed_hosts` (``forbidden_host``), and an
``Origin`` that is neither the server's own (same-origin) nor one of :attr:`BrowserPolicy.allowed_origins`
(``forbidden_origin``). A page on an allowed origin gets CORS: its preflight (``OPTIONS`` with
``Access-Control-Request-Method``) is answered 204 here, its requests carry ``Access-Control-Allow-Origin``.
:func:`json_content_type_problem` is the routes' rule for a JSON body (``shared.openai_routes``: 415 otherwise), so
that no simple request is parsed as JSON even where a browser's origin is allowed.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

ANY = "*"  # in either list: any host / any origin
CORS_MAX_AGE_S = 600  # how long a browser may keep a preflight's answer (Access-Control-Max-Age)
_DEFAULT_PORTS = {"http": 80, "https": 443}
_WEB_SCHEME = {"ws": "http", "wss": "https", "http": "http", "https": "https"}  # a request's scheme as an origin's


def names(value: str | Sequence[str]) -> tuple[str, ...]:
    """A list option's entries: a comma-separated string (the command line, a variable) or a sequence (a config
    file's array), each stripped, empty ones dropped."""
    items = value.split(",") if isinstance(value, str) else value
    return tuple(s.strip() for s in items if s.strip())


def _host_name(host: str) -> str:
    """The name or address of a ``Host`` header (``name[:port]``, ``[v6][:port]``), lower case, no final dot."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or address, no port) names this machine's loopback: ``localhost`` and its subdomains
    (RFC 6761: no resolver sends them elsewhere), an address in 127.0.0.0/8 or ``::1``."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _origin_key(origin: str) -> str | None:
    """``origin`` as compared: ``scheme://host:port`` in lower case with the scheme's default port written out (an
    http(s) origin), or the whole text in lower case (another scheme's: ``app://x``); None: no origin (``null``,
    text with a path, a query or credentials)."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:  # 'http://[x', a port past 65535
        return None
    if not parts.scheme or not parts.hostname or parts.path or parts.query or parts.fragment or "@" in parts.netloc:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    default = _DEFAULT_PORTS.get(parts.scheme.lower())
    if default is None:
        return origin.strip().lower()
    return f"{parts.scheme.lower()}://{host.rstrip('.')}:{port or default}"


def hosts_problem(hosts: Sequence[str]) -> str | None:
    """Why ``hosts`` (``--allowed-hosts``) is no list of host names or addresses, or None: each is a name or an
    address as a ``Host`` header names it, without a scheme, port or path, or ``*``."""
    for host in hosts:
        if host == ANY:
            continue
        try:
            ipaddress.ip_address(host)
            continue
        except ValueError:
            pass
        if not host.isprintable() or any(c in host for c in " /:[]@?#*"):
            return (f"{host!r} is no host name or address (give a name as browsers send it in Host, without a "
                    "scheme, port or path: api.example.com, 192.0.2.7; or * for any)")
    return None


def origins_problem(origins: Sequence[str]) -> str | None:
    """Why ``origins`` (``--allowed-origins``) is no list of origins, or None: each is ``scheme://host[:port]`` as a
    browser sends it in ``Origin`` (no path, not even ``/``), or ``*``."""
    for origin in origins:
        if origin != ANY and _origin_key(origin) is None:
            return (f"{origin!r} is no origin (give scheme://host[:port] as a browser sends it in Origin, without a "
                    "path or a final '/': https://app.example.com, http://localhost:3000; or * for any)")
    return None


@dataclass(frozen=True)
class BrowserPolicy:
    """Who a browser's request may come from (the module docstring). ``listen_host``: the server's listen address,
    always an allowed ``Host``. ``allowed_hosts``: further names or addresses a request's ``Host`` may be (``*``:
    any), beside loopback; :meth:`serving` makes it ``*`` when none is given and the server listens beyond loopback.
    ``allowed_origins``: origins of pages whose requests are served (``*``: any page), beside the server's own."""

    listen_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self):
        if (problem := hosts_problem(self.allowed_hosts)) is not None:
            raise ValueError(f"allowed_hosts: {problem}")
        if (problem := origins_problem(self.allowed_origins)) is not None:
            raise ValueError(f"allowed_origins: {problem}")

    @classmethod
    def serving(cls, listen_host: str, allowed_hosts: str | Sequence[str] = (),
                allowed_origins: str | Sequence[str] = ()) -> BrowserPolicy:
        """The policy of a server listening on ``listen_host`` with these options (comma-separated strings or
        sequences): without ``allowed_hosts``, loopback names only where it listens on loopback, any ``Host`` where
        it listens beyond (a rebinding page gains nothing the network does not give it already)."""
        hosts, origins = names(allowed_hosts), names(allowed_origins)
        if not hosts and not is_loopback(listen_host):
            hosts = (ANY,)
        return cls(listen_host, hosts, origins)

    def host_allowed(self, host: str) -> bool:
        name = _host_name(host)
        return (ANY in self.allowed_hosts or is_loopback(name) or name == _host_name(self.listen_host)
                or name in (h.lower().rstrip(".") for h in self.allowed_hosts))

    def origin_allowed(self, origin: str, scheme: str, host: str | None) -> bool:
        """Whether a request with this ``Origin``, arriving over ``scheme`` (the ASGI scope's) with this ``Host``,
        is served: any listed origin, or the server's own (same-origin)."""
        if ANY in self.allowed_origins:
            return True
        key = _origin_key(origin)
        if key is None:
            return False
        own = None if host is None else _origin_key(f"{_WEB_SCHEME.get(scheme, scheme)}://{host.strip()}")
        return key == own or key in (_origin_key(o) for o in self.allowed_origins)


class BrowserGuard:
    """ASGI middleware applying a :class:`BrowserPolicy` to every HTTP request and WebSocket handshake (the module
    docstring); outside every route and limit, so that a refused page holds no slot."""

    def __init__(self, app, policy: BrowserPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k in (b"host", b"origin", b"access-control-request-method",
                            b"access-control-request-headers", b"access-control-request-private-network")}
        host, origin = headers.get("host"), headers.get("origin")
        if host is not None and not self.policy.host_allowed(host):
            await _refuse(scope, send, f"Host {host[:100]!r} is not served here: a request names this server by a "
                          "loopback name or address, its listen address or one of --allowed-hosts (a page whose "
                          "name was rebound to this address names its own)", "forbidden_host")
            return
        if origin is None:
            await self.app(scope, receive, send)
            return
        if not self.policy.origin_allowed(origin, scope.get("scheme", "http"), host):
            await _refuse(scope, send, f"requests from web pages are refused here (Origin: {origin[:100]}): the "
                          "server serves its own pages and those of --allowed-origins; apps send no Origin",
                          "forbidden_origin")
            return
        if scope["type"] == "websocket":  # (no CORS: a page's WebSocket reads what it is sent)
            await self.app(scope, receive, send)
            return
        cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:  # a preflight
            asked = headers.get("access-control-request-headers")
            cors += [(b"access-control-allow-methods", b"GET, HEAD, POST"),
                     (b"access-control-max-age", str(CORS_MAX_AGE_S).encode())]
            if asked:  # Authorization, Content-Type, the openai client's own
                cors.append((b"access-control-allow-headers", asked.encode("latin-1")))
            if headers.get("access-control-request-private-network") == "true":  # Chrome's Private Network Access
                cors.append((b"access-control-allow-private-network", b"true"))
            await send({"type": "http.response.start", "status": 204, "headers": cors})
            await send({"type": "http.response.body", "body": b""})
            return

        async def with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, with_cors)


async def _refuse(scope, send, message: str, code: str) -> None:
    """A 403 in OpenAI's error shape; a WebSocket's before its upgrade (a close where the server has no denial
    responses: the server answers the handshake 403)."""
    kind = "http.response"
    if scope["type"] == "websocket":
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 1008})
            return
        kind = "websocket.http.response"
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": f"{kind}.start", "status": 403,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": f"{kind}.body", "body": body})


def json_content_type_problem(content_type: str | None) -> str | None:
    """Why a request body with this ``Content-Type`` is not read as JSON, or None: only ``application/json`` (any
    parameters, ``charset=utf-8``) is. text/plain, a form's types and none at all are what a page may send across
    sites without a preflight: read as JSON, they made any web page a client of the server."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "application/json":
        return None
    return (f"Content-Type {content_type[:100]!r} is not JSON" if content_type else "no Content-Type") + \
        ": send the body as application/json"
