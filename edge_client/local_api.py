"""``autoglm-edge serve``: a local OpenAI-compatible endpoint on the device, backed by the split runtime.

Existing apps (the ``openai`` client, ``langchain_openai.ChatOpenAI``) point their ``base_url`` at
``http://127.0.0.1:<port>/v1`` and work unchanged. Routes: ``GET /health``, ``GET /v1/models`` (and
``/v1/models/{id}``), and the chat
and completion routes of :mod:`shared.openai_routes` (shared with the cloud's full-model mode), which this
module adapts to one :class:`~edge_client.client.EdgeClient`: the bundle's chat template makes the prompt,
:meth:`EdgeClient.agenerate` runs it (front layers here, the rest in the cloud; stop strings cancel the cloud
request), and the cloud's failures are ``upstream`` (502; a refusal for load, ``overloaded`` / ``draining``, is a
503 whose ``Retry-After`` is the cloud's ``retry_after_ms`` in whole seconds, rounded up, at least 1). ``precision``
(an extension) overrides the wire codec. Requests run one at a time (the edge runtime holds one sequence); later
ones queue, up to ``max_http_requests`` ``/v1/`` requests in flight (``autoglm-edge serve --max-http-requests``, as
the cloud's flag): the next is a 429 with ``Retry-After`` (:class:`shared.http_limits.HttpConcurrencyLimit`), which
the ``openai`` client retries. Each request waiting its turn held its body (up to :data:`MAX_BODY_BYTES`) and its
socket: an app sending many at once grew the endpoint's memory without bound (20 requests of 25 MiB at once: 1.1 GB
more).

Every connection has ``handshake_timeout_s`` (``autoglm-edge serve --handshake-timeout-s``, as the cloud's flag) to
send a whole request head (:mod:`shared.http_protocol`, applied by :class:`ClosingServer`), and a request body that
stops arriving for that long, or arrives slower than :data:`shared.openai_routes.MIN_BODY_RATE` once that long has
passed, is a 408 (``openai_routes.read_body``): anything reaching the port - a local app that opens connections and
leaves them, sends half a request line, or dribbles a body a byte at a time - held its socket and request for ever.

Web pages in the device's browser are refused (:mod:`shared.http_browsers`, ``autoglm-edge serve --allowed-hosts``
and ``--allowed-origins``, as the cloud's flags): a request whose ``Host`` is no loopback name (DNS rebinding) or
whose ``Origin`` is another site's is a 403 before anything runs, and a body is read as JSON only under
``Content-Type: application/json``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hmac
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared import openai_compat as oc
from shared import openai_routes
from shared.cli_exit import duration_problem
from shared.http_browsers import BrowserGuard, BrowserPolicy
from shared.http_limits import HttpConcurrencyLimit, limit_problem
from shared.http_protocol import protocol_class as http_protocol_class
from shared.precision import PrecisionError
from shared.prefix_keys import bearer_token

from .errors import EdgeClientError

if TYPE_CHECKING:
    from .client import AsyncGeneration, EdgeClient

DEFAULT_MAX_TOKENS = 512
# A request body over this is refused (413) before it is read whole: room for an image at the media limit as a
# base64 data URL (20 MiB -> 27 MiB) beside the text; a text prompt itself is at most the tokenizer's longest
# token (EdgeTokenizer.max_token_chars) a position.
MAX_BODY_BYTES = 32 << 20
# Requests whose media are prepared at once (read and fetched side by side, decoded and encoded one request at a
# time: MediaEncoders.turn); more wait for a thread. Their own threads: slow image_urls never hold the ones text
# prompts are tokenized on.
MEDIA_THREADS = 4
# Seconds a connection has to send a whole request head, and a request body to keep arriving (the cloud's default)
HANDSHAKE_TIMEOUT_S = 30.0
# /v1/ requests in flight, the one running and those waiting their turn; beyond, 429 (worst case: as many bodies of
# MAX_BODY_BYTES, read and decoded, in memory at once)
MAX_HTTP_REQUESTS = 8


class _EdgeStream:
    """An :class:`AsyncGeneration` as a :class:`shared.openai_routes.TextStream`."""

    def __init__(self, gen: AsyncGeneration):
        self.gen = gen

    @property
    def finish_reason(self) -> str | None:
        return self.gen.finish_reason

    def __aiter__(self) -> _EdgeStream:
        return self

    async def __anext__(self) -> str:
        try:
            return await self.gen.__anext__()
        except EdgeClientError as e:
            # a refusal for load (overloaded, draining) keeps the cloud's wait: the answer's Retry-After
            raise openai_routes.GenerationError(str(e), e.code, upstream=True,
                                                retry_after_s=e.retry_after_s) from None

    def usage(self) -> dict[str, Any]:
        st = self.gen.stats
        out = oc.usage(st.prompt_tokens, st.completion_tokens, st.cached_tokens)
        image, audio = getattr(st, "image_tokens", 0), getattr(st, "audio_tokens", 0)
        if image or audio:  # of prompt_tokens: encoder rows (images, audio clips)
            out.setdefault("prompt_tokens_details", {}).update(image_tokens=image, audio_tokens=audio)
        return out

    async def aclose(self) -> None:
        await self.gen.aclose()  # cancels the cloud request if it has not finished


async def _unless_abandoned(loop, executor, run) -> AsyncGeneration:
    """``run(loop=, abandoned=)`` on ``executor``'s thread. Cancelled meanwhile (the app went away while its
    prompt was tokenized or its media fetched and encoded: ``openai_routes``), it starts nothing - nothing goes to
    the cloud - or, started already, its generation is closed at once (it ran until garbage-collected)."""
    abandoned = threading.Event()
    work = loop.run_in_executor(executor, functools.partial(run, loop=loop, abandoned=abandoned))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        abandoned.set()
        work.add_done_callback(_close_abandoned)
        raise


def _close_abandoned(work: asyncio.Future) -> None:
    if work.exception() is None:  # (its error, EdgeClientError cancelled among them: no one to tell)
        asyncio.ensure_future(work.result().aclose())


def _has_media(req) -> bool:
    return isinstance(req, oc.ChatRequest) and any(isinstance(m["content"], list) for m in req.messages)


class _EdgeBackend:
    """The :class:`shared.openai_routes.TextBackend` of one :class:`EdgeClient`. Chat messages may carry
    ``image_url`` / ``input_audio`` parts (encoded here on the device, ``edge_client.media``); a bad one is a
    400 with the media error's code."""

    accepts_media = True

    def __init__(self, client: EdgeClient, model_name: str):
        self.client, self.model_name = client, model_name
        self._media_threads = concurrent.futures.ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="edge-media")

    def check_ready(self) -> None:
        """Always ready: the client connects (and reconnects) to the cloud per request."""

    def render_chat(self, req: oc.ChatRequest) -> str:
        if _has_media(req):
            return ""  # rendered in start(), where the media parts become placeholder tokens
        try:  # the routes' text of the prompt; start() has the client render and tokenize the messages themselves
            return self.client.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True,
                                                             **req.template_kwargs())
        except ValueError as e:
            raise oc.OpenAIRequestError(str(e), "messages") from None

    async def start(self, req: oc.ChatRequest | oc.CompletionRequest, prompt: str, caller=None) -> _EdgeStream:
        # (caller: unused, the phone's one user; the cloud meters the session's key)
        s = req.sampling
        if s.penalized:  # a replay after a dropped link would lose the penalties' history: not offered here
            name = next(n for n, d in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                                       ("repetition_penalty", 1.0)) if getattr(s, n) != d)
            raise oc.OpenAIRequestError(f"{name}: not supported by the edge's API (the split path samples "
                                        "without penalties)", name)
        # a chat as its messages: the client tokenizes their text as text (shared.chat_tokens), never as the tokens
        # it may spell; a completion's prompt is the app's own text, special tokens included
        source = ({"messages": req.messages, "chat_template_kwargs": req.template_kwargs()}
                  if isinstance(req, oc.ChatRequest)
                  else {"prompt_ids": req.prompt_ids} if req.prompt_ids is not None
                  else {"prompt": prompt})
        run = functools.partial(self.client.agenerate, **source, max_tokens=s.max_tokens or DEFAULT_MAX_TOKENS,
                                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, stop=s.stop,
                                precision=req.precision)
        loop = asyncio.get_running_loop()
        try:
            # the prompt is tokenized (0.5 s for SmolLM2's longest: every open stream stalled that long) and media
            # are read, fetched (up to MediaPolicy.fetch_timeout_s) and encoded off the event loop, each request's
            # on its own (MEDIA_THREADS at once): the endpoint keeps answering meanwhile - an image_url naming this
            # very server is fetched like any other - and one request's media never wait for another's slow fetch
            return _EdgeStream(await _unless_abandoned(loop, self._media_threads if _has_media(req) else None, run))
        except EdgeClientError as e:  # a bad image / audio clip (or a placeholder without one), before any traffic
            raise oc.OpenAIRequestError(str(e), req.prompt_param, e.code) from None
        except ValueError as e:  # e.g. a prompt that tokenizes to nothing, or a sampling value the wire cannot carry
            param = getattr(e, "param", None) or ("precision" if isinstance(e, PrecisionError) else req.prompt_param)
            message = str(e)
            if param == "max_tokens":  # EdgeClient's name for it: the error names the field the client sent
                param, message = s.max_tokens_param, message.replace("max_tokens", s.max_tokens_param, 1)
            raise oc.OpenAIRequestError(message, param, getattr(e, "code", oc.INVALID_REQUEST)) from None


def create_app(client: EdgeClient, model_name: str | None = None, api_key: str | None = None,
               media_dir: str | Path | None = None, fetch_urls: bool = True,
               handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
               max_http_requests: int = MAX_HTTP_REQUESTS, browsers: BrowserPolicy | None = None) -> FastAPI:
    """The FastAPI app serving ``client``; ``api_key`` (optional) is required as a Bearer token.
    ``media_dir``: the one folder whose files ``image_url`` may name by local path (default: none);
    ``fetch_urls=False``: http(s) ``image_url``s are refused (``url_refused``) instead of fetched.
    ``handshake_timeout_s``: a request body that stalls this long is a 408 (the module docstring); kept as
    ``app.state.handshake_timeout_s``, the request heads' deadline under :class:`ClosingServer`.
    ``max_http_requests``: ``/v1/`` requests in flight before 429 (the module docstring).
    ``browsers``: the hosts and web pages served (None: loopback names, no other site's pages;
    ``BrowserPolicy.serving(host, ...)`` for the address it listens on)."""
    if (problem := duration_problem(handshake_timeout_s)) is not None:
        raise ValueError(f"handshake_timeout_s {problem}")
    if (problem := limit_problem(max_http_requests)) is not None:
        raise ValueError(f"max_http_requests {problem}")
    if media_dir is not None:
        client.media_policy = replace(client.media_policy, local_dir=Path(media_dir))
    if not fetch_urls:
        client.media_policy = replace(client.media_policy, allow_http=False)
    # no /docs, /redoc, /openapi.json: routes outside the API (docs/edge.md) are 404s, as on the cloud
    app = FastAPI(title="autoglm-edge", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.handshake_timeout_s = handshake_timeout_s
    model_id = model_name or f"autoglm-split-{client.manifest.bundle_id[:12]}"

    @app.exception_handler(StarletteHTTPException)  # the router's own 404 / 405, in OpenAI's error shape as well
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "error")
        err = oc.OpenAIRequestError(str(exc.detail), None, code, exc.status_code)
        return JSONResponse(err.to_dict(), status_code=exc.status_code, headers=exc.headers)  # 405: Allow

    @app.middleware("http")
    async def auth(request: Request, call_next):
        token = bearer_token(request.headers.get("authorization"))  # decoded as latin-1: its bytes as sent
        keyed = bool(api_key) and hmac.compare_digest((token or "").encode("latin-1"), api_key.encode())
        if api_key and request.url.path.startswith("/v1/") and not keyed:
            refused = oc.OpenAIRequestError("invalid API key", None, "invalid_api_key", 401)
            return openai_routes.error_response(refused)
        return await call_next(request)

    @openai_routes.get_route(app, "/health")
    async def health():
        return {"status": "ok", "bundle_id": client.manifest.bundle_id, "connected": client.connected}

    @openai_routes.get_route(app, "/v1/models")
    async def models():
        return oc.model_list([model_id])

    @openai_routes.get_route(app, "/v1/models/{name:path}")  # the openai client's models.retrieve()
    async def model(name: str):
        if name == model_id:
            return oc.model_list([model_id])["data"][0]
        return openai_routes.error_response(oc.model_not_found(name))

    openai_routes.install(app, _EdgeBackend(client, model_id), max_body_bytes=MAX_BODY_BYTES,
                          body_stall_s=handshake_timeout_s)
    app.add_middleware(HttpConcurrencyLimit, limit=max_http_requests)  # before the key's check
    app.add_middleware(BrowserGuard, policy=browsers or BrowserPolicy())  # outermost: a refused page holds no slot
    return app


class ClosingServer(uvicorn.Server):
    """uvicorn for ``autoglm-edge serve``: Ctrl-C / SIGTERM also closes the client, so the answers still streaming
    end at once with an error event (``closed``; their cloud requests cancelled) and the server stops. uvicorn
    alone waited for every open stream to finish: a long answer held a stopped server for minutes. Its HTTP
    protocol closes a connection without a whole request head within the app's ``handshake_timeout_s``
    (:mod:`shared.http_protocol`)."""

    def __init__(self, app: FastAPI, client: EdgeClient, **config: Any):
        http = http_protocol_class(app.state.handshake_timeout_s)
        super().__init__(uvicorn.Config(app, http=http, **config))
        self.client = client

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # the address bound: --port 0 takes a free port, which the banner names (it said 0)
            port = self.servers[0].sockets[0].getsockname()[1]
            host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host  # IPv6 in a URL
            print(f"autoglm-edge: OpenAI-compatible endpoint on http://{host}:{port}/v1 "
                  f"(cloud {self.client.config.url})", file=sys.stderr, flush=True)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        threading.Thread(target=self.client.close, name="edge-close", daemon=True).start()  # close() blocks
