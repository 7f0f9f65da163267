"""The FastAPI app: the split WebSocket endpoint, health/readiness, Prometheus metrics, the OpenAI routes.

Routes:

* ``GET /health``   200 while the process is up (liveness);
* ``GET /ready``    200 once the model is loaded and the engine runs, 503 while loading, draining or after a
  fatal engine error (readiness: take the replica out of the load balancer);
* ``GET /metrics``  Prometheus text (``cloud_server.metrics``), unauthenticated like vLLM's;
* ``GET /v1/models`` the served model (``GET /v1/models/{id}``: one, or 404 ``model_not_found``);
* ``WS  /v1/split`` split mode: the edge's session (``cloud_server.split_endpoint``);
* ``GET /v1/bundles[/{id}/manifest | /{id}/files/{path}]`` split mode: the served bundles' edge halves, for
  phones to download or update (``cloud_server.bundle_files``);
* ``POST /v1/chat/completions``, ``POST /v1/completions``: full-model mode (``cloud_server.full_api``); in split
  mode a 404 that says where they are.

Split mode over several bundles (``ServerConfig.more_bundles`` with other ids): one runtime per bundle id, the
Hello's id picking its endpoint (``cloud_server.bundle_set``); the app starts and stops the further runtimes
itself, ``/ready`` needs them all, ``/metrics`` merges them, ``/v1/models`` lists them.

Front-end workers (``--workers N``, ``cloud_server.front_workers``): every worker serves every route over a
:class:`~cloud_server.worker_runtime.WorkerRuntime`; ``/ready`` answers for the worker the connection reached
(``worker`` in its body) and the engine; ``/metrics`` is every process's merged, by the engine process.

With a keys file or an API key configured (``cloud_server.auth``) every route but ``/health``, ``/ready`` and
``/metrics`` needs ``Authorization: Bearer <key>`` (a WebSocket presents it in the handshake headers, never in
the URL); ``open_probes=False`` puts those three behind the key too (``/metrics``, which names every tenant's
usage, behind an operator key when there is a keys file). The key's :class:`~cloud_server.auth.Principal`
is on ``websocket.state.principal`` for the split endpoint (its tenant scopes the prefix cache) and on
``request.state.principal`` for HTTP (full mode counts a request's usage under its tenant). HTTP ``/v1``
requests beyond ``max_http_requests`` in flight get 429 with ``Retry-After`` (``shared.http_limits``). A web
browser's request is a 403 unless its ``Host`` is a loopback name, the listen address or one of ``allowed_hosts`` and
its ``Origin``, if any, the server's own or one of ``allowed_origins``, WebSockets included (``shared.http_browsers``).

Graceful drain (:func:`drain`, on the first SIGTERM via :class:`DrainingServer`, and at shutdown): the app
stops admitting (``/ready`` -> 503, new sessions closed with 1013, new HTTP requests 503), sends ``Drain`` to
connected edges, waits up to ``drain_timeout_s`` for open requests to finish, then stops the engine.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from cloud_server.auth import Authenticator
from cloud_server.engine.async_engine import EngineDeadError
from cloud_server.limits import ConnectionLimit
from cloud_server.metrics import HttpRefusals
from cloud_server.ws_protocol import protocol_class
from shared import openai_compat as oc
from shared.http_browsers import BrowserGuard
from shared.http_limits import HttpConcurrencyLimit
from shared.http_protocol import protocol_class as http_protocol_class
from shared.openai_routes import get_route

log = logging.getLogger("autoglm.cloud")
GIL_SWITCH_S = 0.0005  # sys.setswitchinterval while serving (see DrainingServer.serve)
ENGINE_WATCH_S = 0.5  # how often a serving DrainingServer looks for a stopped engine
CHALLENGE = {"WWW-Authenticate": "Bearer"}  # on every 401 (RFC 9110 section 15.5.2: a 401 must name its scheme)


async def drain(app: FastAPI) -> None:
    """Stop admitting, tell connected edges (``Drain``), and wait up to ``drain_timeout_s`` for open requests
    to finish. Idempotent; runs on the first SIGTERM (:class:`DrainingServer`) and again at shutdown."""
    runtime = app.state.runtime
    runtimes = _runtimes(app)

    def active() -> int:
        return sum(rt.num_active_requests() for rt in runtimes)

    timeout = runtime.config.drain_timeout_s
    if not runtime.draining:
        runtime.draining = True
        split = getattr(app.state, "split", None)
        if split is not None:
            split.drain(int(timeout * 1000))
        log.info("draining: %d open requests, up to %.0f s", active(), timeout)
    deadline = time.monotonic() + timeout
    while active() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def _runtimes(app: FastAPI) -> list:
    """Every runtime the app serves: the primary one, and one per further bundle (``cloud_server.bundle_set``)."""
    bundles = getattr(app.state, "split", None)
    return bundles.all_runtimes if hasattr(bundles, "all_runtimes") else [app.state.runtime]


class DrainingServer(uvicorn.Server):
    """uvicorn, with a graceful drain on the first SIGTERM/SIGINT (``/ready`` turns 503, edges get ``Drain``,
    open requests finish) before the usual shutdown. A second signal cuts the drain short: the usual shutdown
    follows at once (connections closed, up to ``timeout_graceful_shutdown`` for their tasks, the runtime
    stopped) and ``interrupted`` is set (the CLI exits 130); a third skips the rest of it, as uvicorn's second
    Ctrl-C does. Signals are never re-raised after the shutdown (uvicorn's own handler does so, which ended a
    drained server in a KeyboardInterrupt traceback). An engine that stops (a fatal error: its open requests
    got ``internal``) ends the server as a SIGTERM does, with ``engine_failed`` set (the CLI exits 1), so that
    whatever supervises the process restarts it: a server without an engine answered nothing but 503s and
    ``/health`` 200, and a liveness probe never replaced it."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        split = getattr(app.state, "split", None)
        if split is not None:  # read over-size frames, so that they fail one request instead of the session
            config.ws_max_size = max(config.ws_max_size, split.max_message_bytes)
        # no permessage-deflate (docs/protocol.md, Transport): hidden states do not deflate, and a client that
        # offered it could send a 17 MiB frame as ~17 KB for the server to inflate (and have every Tokens deflated)
        config.ws_per_message_deflate = False
        if config.ws == "auto":  # fewer system calls per frame (cloud_server.ws_protocol); None: uvicorn's own
            config.ws = protocol_class() or "auto"
        runtime = getattr(app.state, "runtime", None)  # (None: an app not made by create_app)
        if config.http == "auto" and runtime is not None:  # a socket that never sends a whole request head is closed
            config.http = http_protocol_class(runtime.config.handshake_timeout_s)
        super().__init__(config)
        self.app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self.interrupted = False  # a second signal came: the drain was cut short
        self.engine_failed: str | None = None  # why an engine stopped, when that ended the server

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        # The event loop and the engine thread share the GIL. A thread that wants it waits for the holder's
        # switch interval (5 ms by default), so an engine step finishing while the loop parses frames would
        # wait up to 5 ms to deliver and launch the next; hand the GIL over 10x sooner.
        sys.setswitchinterval(GIL_SWITCH_S)
        watch = self._loop.create_task(self._watch_engines())
        try:
            await super().serve(sockets)
        finally:
            watch.cancel()

    async def _watch_engines(self) -> None:
        while not self._draining:
            await asyncio.sleep(ENGINE_WATCH_S)
            dead = [rt.engine.dead for rt in _runtimes(self.app) if rt.engine is not None and rt.engine.dead]
            if dead and not self._draining:
                self.engine_failed = dead[0]
                log.error("the engine stopped (%s): the server stops, to be restarted", dead[0])
                self.handle_exit(signal.SIGTERM, None)

    def handle_exit(self, sig, frame) -> None:  # may be called from any thread
        if self._loop is None:  # not serving yet: uvicorn's own handling
            super().handle_exit(sig, frame)
            return
        if self._draining:
            self.force_exit = self.interrupted  # the third signal
            self.interrupted = self.should_exit = True
            return
        self._draining = True

        async def drain_then_exit():
            await drain(self.app)
            self.should_exit = True

        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(drain_then_exit()))


def uvicorn_config(app: FastAPI, config, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for ``app`` under ``autoglm-cloud serve`` (a :class:`~cloud_server.config.ServerConfig`):
    address, TLS, the event loop, a 5 s graceful shutdown after the drain."""
    tls = {"ssl_certfile": str(config.ssl_certfile), "ssl_keyfile": str(config.ssl_keyfile)} \
        if config.ssl_certfile else {}
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, timeout_graceful_shutdown=5,
                          loop=config.loop, **tls)  # max_connections: cloud_server.limits.ConnectionLimit


def loop_factory(name: str):
    """A new event loop of ``name`` (:data:`cloud_server.config.LOOPS`, uvicorn's --loop): ``auto`` is uvloop
    when it is installed, else asyncio's own."""
    if name != "asyncio":
        try:
            import uvloop
        except ImportError:
            if name == "uvloop":
                raise
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def create_app(runtime, owns_runtime: bool = False) -> FastAPI:
    """The app over ``runtime`` (a :class:`~cloud_server.runtime.CloudRuntime`). With ``owns_runtime`` the
    app starts it on startup and drains + stops it on shutdown; otherwise the caller does (tests)."""
    cfg = runtime.config

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        extra = _runtimes(app)[1:]  # further bundles' runtimes: always the app's own
        if owns_runtime:
            await loop.run_in_executor(None, runtime.start)
        for rt in extra:
            await loop.run_in_executor(None, rt.start)
        try:
            yield
        finally:
            await drain(app)
            for rt in [*extra, *([runtime] if owns_runtime else [])]:
                await loop.run_in_executor(None, rt.stop)

    # no /docs, /redoc, /openapi.json: routes outside the API table (docs/cloud.md) are 404s, and the Swagger
    # page would be one more open path beside the probes
    app = FastAPI(title="autoglm-split cloud server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.runtime = runtime
    app.state.auth = authn = Authenticator(cfg.keys_file, cfg.api_key)
    app.add_middleware(HttpConcurrencyLimit, limit=cfg.max_http_requests)

    def refused_at_the_cap(scope) -> None:  # a phone's session refused for load, as the split endpoint counts its own
        if scope["type"] == "websocket" and runtime.metrics is not None:
            runtime.metrics.on_refused("max_connections")

    # outside the admission limits: counts every connection
    app.add_middleware(ConnectionLimit, limit=cfg.max_connections, on_refused=refused_at_the_cap)
    # a web page's request (another site's Origin, a rebound name's Host) is a 403 before it takes a connection slot
    app.add_middleware(BrowserGuard, policy=cfg.browsers)
    # outermost: counts every HTTP refusal, the limits' included (autoglm:http_requests_refused_total)
    app.add_middleware(HttpRefusals, metrics=lambda: runtime.metrics)

    async def require_key(request: Request):  # the key's Principal on request.state (full mode's usage label)
        principal = authn.authenticate(request.headers.get("authorization"))
        if principal is None:
            raise HTTPException(401, detail="missing or wrong API key (Authorization: Bearer <key>)",
                                headers=CHALLENGE)
        request.state.principal = principal

    async def require_operator_key(request: Request):  # /metrics names every tenant and its usage
        principal = authn.authenticate(request.headers.get("authorization"))
        if principal is None:
            raise HTTPException(401, detail="missing or wrong API key (Authorization: Bearer <key>)",
                                headers=CHALLENGE)
        if authn.store is not None and principal.role != "operator":
            raise HTTPException(403, detail="/metrics names every tenant's usage: it takes an operator key")

    auth = Depends(require_key)
    probe = [] if cfg.open_probes else [auth]
    metrics_probe = [] if cfg.open_probes else [Depends(require_operator_key)]

    @app.exception_handler(StarletteHTTPException)  # also the router's own 404 / 405 (FastAPI's is a subclass)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {401: "invalid_api_key", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
                503: "unavailable"}.get(exc.status_code, "error")
        err = oc.OpenAIRequestError(str(exc.detail), None, code, exc.status_code)
        return JSONResponse(err.to_dict(), status_code=exc.status_code, headers=exc.headers)  # 405: Allow

    @get_route(app, "/health", dependencies=probe)
    async def health():
        return {"status": "ok"}

    @get_route(app, "/ready", dependencies=probe)
    async def ready():
        runtimes = _runtimes(app)
        is_ready = all(rt.ready for rt in runtimes)
        body = {"ready": is_ready, "mode": cfg.mode, "model": runtime.model_name,
                "draining": runtime.draining, "bundle_id": runtime.bundle_id}
        if getattr(runtime, "worker", None) is not None:  # which front-end worker answered (--workers)
            body["worker"] = runtime.worker
        if len(runtimes) > 1:
            body["bundle_ids"] = [rt.bundle_id for rt in runtimes]
        dead = [rt.engine.dead for rt in runtimes if rt.engine is not None and rt.engine.dead]
        if dead:
            body["error"] = "; ".join(dead)
        return JSONResponse(body, status_code=200 if is_ready else 503)

    @get_route(app, "/metrics", dependencies=metrics_probe)
    async def metrics():
        if runtime.metrics is None:
            return Response(b"", media_type="text/plain")
        peers = getattr(runtime, "peers", None)
        if peers is not None:  # a front-end worker (--workers): the engine process merges every process's
            try:
                body = await asyncio.wait_for(peers.metrics(), 10.0)
            except (EngineDeadError, RuntimeError, asyncio.TimeoutError) as e:
                # a failed scrape, not this worker's share alone: the engine's series would vanish and every sum
                # drop to one worker's, which Prometheus reads as counter resets (rates counted twice)
                return Response(f"metrics: the engine process did not answer ({str(e) or 'timed out'})",
                                status_code=503, media_type="text/plain")
            return Response(body, media_type=runtime.metrics.content_type)
        # rendered off the event loop: ~1 ms bare, ~45 ms with a keys file of 1000 tenants (six series each), which
        # every session's decode step on this loop waited for at each scrape
        render = app.state.split.render_metrics if len(_runtimes(app)) > 1 else runtime.metrics.render
        return Response(await asyncio.to_thread(render), media_type=runtime.metrics.content_type)

    @get_route(app, "/v1/models", dependencies=[auth])
    async def models():
        return oc.model_list([rt.model_name for rt in _runtimes(app) if rt.model_name])

    @get_route(app, "/v1/models/{model_id:path}", dependencies=[auth])  # the openai client's models.retrieve()
    async def model(model_id: str):
        found = [m for m in (await models())["data"] if m["id"] == model_id]
        if found:
            return found[0]
        err = oc.model_not_found(model_id)
        return JSONResponse(err.to_dict(), status_code=err.status)

    if cfg.mode == "full":
        from cloud_server import full_api

        full_api.install(app, runtime, auth)

    else:
        from cloud_server import bundle_files
        from cloud_server.bundle_set import BundleSet

        # the edge halves of the served bundles, for phones to download or update (GET /v1/bundles/...)
        catalog = bundle_files.BundleCatalog([cfg.bundle, *cfg.more_bundles], cfg.model_name)
        bundle_files.install(app, catalog, auth)
        bundles = BundleSet(runtime, catalog)  # one engine per bundle id; the Hello's id picks one

        # an OpenAI client pointed here (the model is in /v1/models) got a bare 404 'Not Found': say where chat is
        @app.post("/v1/chat/completions", dependencies=[auth])
        @app.post("/v1/completions", dependencies=[auth])
        async def full_mode_only(request: Request):
            err = oc.OpenAIRequestError(
                f"{request.url.path} is served in full-model mode (autoglm-cloud serve --full); this server runs "
                "split mode: apps reach the model through the edge's local API (autoglm-edge serve), which "
                "streams to WS /v1/split here", None, "not_found", 404)
            return JSONResponse(err.to_dict(), status_code=err.status)
        endpoint = bundles if len(bundles.endpoints) > 1 else bundles.default
        app.state.split = endpoint

        # an HTTP request to the WebSocket's path (curl, or a proxy that does not pass Upgrade and Connection on) got
        # 404 'Not Found', and the edge sent the operator to check a right URL and mode: say what it lacked
        @get_route(app, "/v1/split", dependencies=[auth])
        async def split_without_upgrade():
            err = oc.OpenAIRequestError(
                "/v1/split takes a WebSocket upgrade: this request lacked 'Upgrade: websocket' (a proxy that does not "
                "pass Upgrade and Connection on?)", None, "upgrade_required", 426)  # (the edge shows 200 bytes of it)
            return JSONResponse(err.to_dict(), status_code=err.status,
                                headers={"Upgrade": "websocket", "Connection": "Upgrade"})

        @app.websocket("/v1/split")
        async def split(ws: WebSocket):
            principal = authn.authenticate(ws.headers.get("authorization"))
            if principal is None:
                if runtime.metrics is not None:  # a session refused at its handshake, as the endpoint counts its own
                    runtime.metrics.on_refused("unauthorized")
                err = oc.OpenAIRequestError("missing or wrong API key (Authorization: Bearer <key>)", None,
                                            "unauthorized", 401)
                try:  # an HTTP 401 before the upgrade, where the server supports denial responses
                    await ws.send_denial_response(JSONResponse(err.to_dict(), status_code=401, headers=CHALLENGE))
                except RuntimeError:
                    await ws.close(code=1008, reason="missing or wrong API key")  # HTTP 403
                return
            ws.state.principal, ws.state.authenticator = principal, authn  # auth.still_authorized re-checks
            await endpoint.serve(ws)

    return app
