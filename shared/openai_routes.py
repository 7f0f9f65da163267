"""The OpenAI-compatible text routes, written once: ``POST /v1/chat/completions`` and ``POST /v1/completions``
over a :class:`TextBackend`. The edge's local endpoint (``edge_client.local_api``) and the cloud's full-model
mode (``cloud_server.full_api``) are adapters that supply the backend; parsing (:mod:`shared.openai_compat`),
the ``<think>`` split for ``return_reasoning``, JSON or SSE (``data: {chunk}`` lines, each on one line for any
line reader: :func:`shared.openai_compat.sse`; then ``data: [DONE]``; ``stream_options.include_usage`` adds a
usage-only chunk), usage and errors are here. No torch.

Contract:

* ``check_ready()``, ``render_chat(req)`` (the chat template's prompt text) and ``start(req, prompt, caller)`` (a
  running :class:`TextStream`; ``caller``: who sent it, what the app's auth dependency put on
  ``request.state.principal``, None without one - the cloud counts usage under its tenant) refuse by raising
  :class:`~shared.openai_compat.OpenAIRequestError`. The body's
  decoding, its checks and ``render_chat`` run on a worker thread (their cost grows with the body), never on the
  event loop; ``render_chat`` may run for several requests at once.
* A :class:`TextStream` yields text deltas with stop strings applied (the text ends before the stop string),
  raises :class:`GenerationError` when the generation fails, and at its end has ``finish_reason`` and
  ``usage()``. A stream with ``ids_only`` true (a model without a tokenizer, completions only) yields lists of
  token ids instead: the answer carries them as ``choices[].token_ids`` (vLLM's field) beside an empty ``text``. The routes ``aclose()`` every stream they start, however it ends (client gone included), and
  may call it more than once; an unfinished generation must be cancelled then.
* Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` and one set of statuses on
  both ends: 400 a request refused, 401 a wrong key (the app's auth), 413 a body over the adapter's limit
  (``install(max_body_bytes=...)``), 415 a compressed body (``Content-Encoding``), 503 not ready, draining or
  overloaded (with ``Retry-After``: the error's ``retry_after_s``, the wait the server or a peer asked for, as
  :func:`shared.http_limits.retry_after` rounds it; else 1 s),
  504 a timeout, 502 a failure upstream (the edge's cloud), 500 a failure here; a prompt that does not fit is a
  400 ``context_length_exceeded`` naming the request's prompt field (``param``: ``messages`` or ``prompt``,
  :attr:`~shared.openai_compat.ChatRequest.prompt_param`) whoever refused it, streamed or not. A stream's HTTP
  200 goes with its first delta: a generation that fails before it has its status too; after it, an error is one
  ``data: {"error": ...}`` event, then ``data: [DONE]``.
* A body is read as JSON only under ``Content-Type: application/json``: any other type, or none, is a 415
  ``unsupported_media_type`` before the body is read (text/plain, a form and none are what a web page may send to
  another site without a CORS preflight: :mod:`shared.http_browsers`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from shared import openai_compat as oc
from shared.http_browsers import json_content_type_problem
from shared.http_limits import retry_after

# Generation error codes (engine or wire) whose status is not "the server failed".
# codec_not_negotiated: a precision (codec or compute variant) the session does not offer - the request's choice.
_STATUS_BY_CODE = {"context_full": 400, "prompt_too_long": 400, "too_long": 400, "bad_input": 400,
                   "codec_not_negotiated": 400, "overloaded": 503, "draining": 503, "timeout": 504}


class GenerationError(Exception):
    """A generation that failed after it started. ``code`` is the engine's or the wire's error code;
    ``upstream`` says the failure is a peer's (the edge reports its cloud's errors so); ``retry_after_s``: for a
    refusal for load (503), the wait the server asks for (full mode: its replay's wait) or its peer did (the edge's
    cloud's ``retry_after_ms``); None: the default. The answer's ``Retry-After`` carries it."""

    def __init__(self, message: str, code: str, upstream: bool = False, retry_after_s: float | None = None):
        super().__init__(message)
        self.message, self.code, self.upstream = message, code, upstream
        self.retry_after_s = retry_after_s

    @property
    def status(self) -> int:
        return _STATUS_BY_CODE.get(self.code, 502 if self.upstream else 500)

    def to_dict(self, prompt_param: str | None = None) -> dict[str, Any]:
        """OpenAI's error body; a prompt that does not fit (``context_length_exceeded``) names ``prompt_param``, the
        request's prompt field, as a refusal before the generation started does: whoever refused it (the edge
        client, its cloud, the engine), streamed or not, the error reads the same."""
        err = oc.OpenAIRequestError(self.message, None, self.code, self.status)
        if err.code == oc.CONTEXT_LENGTH_EXCEEDED:
            err.param = prompt_param
        return err.to_dict()


class TextStream(Protocol):
    finish_reason: str | None  # "stop" | "length" once the stream has ended
    # optional (absent: False): the deltas are lists of token ids, not text

    def __aiter__(self) -> AsyncIterator[str] | AsyncIterator[list[int]]: ...
    def usage(self) -> dict[str, Any]: ...
    async def aclose(self) -> None: ...


class TextBackend(Protocol):
    model_name: str  # reported when the request names no model

    def check_ready(self) -> None: ...
    def render_chat(self, req: oc.ChatRequest) -> str: ...
    # may be a coroutine function (a backend that tokenizes off the event loop)
    def start(self, req: oc.ChatRequest | oc.CompletionRequest, prompt: str, caller: Any) -> TextStream: ...


log = logging.getLogger(__name__)


def _internal(e: Exception) -> GenerationError:
    """A failure of this server itself (a bug, here or in the backend): logged with its traceback and answered in
    OpenAI's shape, a 500 (starlette's own answer is a plain-text "Internal Server Error")."""
    log.error("OpenAI route failed: %s: %s", type(e).__name__, e, exc_info=e)
    return GenerationError(f"internal error: {type(e).__name__}", "internal")


UNSUPPORTED_ENCODING = "unsupported_content_encoding"  # a 415's code for a compressed body


def error_response(e: oc.OpenAIRequestError | GenerationError, prompt_param: str | None = None) -> JSONResponse:
    # ``prompt_param``: a GenerationError's request's prompt field (GenerationError.to_dict). A 503 (not ready,
    # draining, overloaded) says when to try again (the openai client honours it): the wait the server or its peer
    # asked for (``retry_after_s``) where there is one; a 415 for a compressed body: the codings taken, as RFC 9110 15.5.16 asks
    headers = ({"Retry-After": retry_after(e.retry_after_s)} if e.status == 503 else {"Accept-Encoding": "identity"}
               if e.code == UNSUPPORTED_ENCODING else {"Connection": "close"} if e.status == 408 else None)  # 408: the
    # body's rest will not come, and the server must not read it as the connection's next request: it closes it
    body = e.to_dict(prompt_param) if isinstance(e, GenerationError) else e.to_dict()
    return JSONResponse(body, status_code=e.status, headers=headers)


MIN_BODY_RATE = 500  # bytes/s a request body keeps up once read_body's stall_s has passed (Apache mod_reqtimeout's)


async def read_body(request: Request, max_bytes: int | None, stall_s: float | None = None) -> bytes:
    """The request's body; over ``max_bytes`` (None: no limit) an ``OpenAIRequestError`` with status 413, raised
    before the rest is read (a declared ``Content-Length`` over it: before any). A compressed body
    (``Content-Encoding: gzip``, ...) is a 415 before any is read: its bytes were parsed as JSON, and refused as
    'not valid JSON' that was valid once decompressed. A body none of which arrives for ``stall_s`` seconds (None:
    no limit) is a 408 (and the connection closes): a client that vanished mid-upload without a FIN or RST (a phone
    losing coverage) held its request - a ``--max-http-requests`` slot - and its socket forever. So is one that
    arrives slower than :data:`MIN_BODY_RATE` once ``stall_s`` has passed (its deadline: ``stall_s`` after the head,
    a second more for each ``MIN_BODY_RATE`` bytes that came): a slowloris dribbling a byte at a time, never silent
    for ``stall_s``, held its slot as long as it went on."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise oc.OpenAIRequestError(f"Content-Encoding {encoding!r} is not supported: send the JSON body "
                                    "uncompressed", None, UNSUPPORTED_ENCODING, 415)
    try:
        declared = request.headers.get("content-length", "")
        too_large = oc.OpenAIRequestError(f"request body over {max_bytes} bytes", None, "request_too_large", 413)
        if max_bytes is not None and declared.isdigit() and int(declared) > max_bytes:
            raise too_large
        chunks, size = [], 0
        stream = request.stream()
        loop = asyncio.get_running_loop()
        started = last = loop.time()
        while True:
            if stall_s is not None:  # a stall of stall_s, or the rate's deadline, whichever comes first
                stall_at, rate_at = last + stall_s, started + stall_s + size / MIN_BODY_RATE
            try:
                chunk = await asyncio.wait_for(anext(stream), None if stall_s is None else
                                               max(min(stall_at, rate_at) - loop.time(), 0.0))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                why = (f"stopped arriving ({size} bytes in {stall_s:g} s ago)" if stall_at <= rate_at else
                       f"arrives slower than {MIN_BODY_RATE} bytes/s ({size} bytes in {loop.time() - started:.1f} s)")
                raise oc.OpenAIRequestError(f"the request body {why}", None, "request_timeout", 408) from None
            last = loop.time()
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)
    except ClientDisconnect:  # gone mid-body: an answer nobody reads, not an unhandled exception in the log
        raise oc.OpenAIRequestError("the client went away before its request body was whole", None,
                                    "client_disconnected") from None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def parse_json_body(raw: bytes) -> Any:
    """The decoded JSON of a request body; ``OpenAIRequestError`` (400) for anything that is not JSON text a
    response can carry back: bad syntax or UTF-8, nesting past the parser's recursion, an integer past Python's
    4300-digit conversion limit (a plain ValueError), a ``\\uD800``-style escape of a lone surrogate (valid JSON
    syntax, but no UTF-8 text: the tokenizer and the response's encoder fail on it) or its bytes (``ED A0 80``:
    ``json.loads`` of bytes decodes them with ``surrogatepass``, so they came through as that surrogate)."""
    try:
        text = raw.decode(json.detect_encoding(raw))  # strict; UTF-8 (with or without a BOM), or UTF-16/32
    except UnicodeDecodeError:
        raise oc.OpenAIRequestError("request body is not valid JSON: not UTF-8 text") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise oc.OpenAIRequestError("request body is not valid JSON: nested too deeply") from None
    except ValueError:  # JSONDecodeError, int digits limit
        raise oc.OpenAIRequestError("request body is not valid JSON") from None
    # searched in the text (a UTF-16 body's escape is no run of ASCII bytes); a pair decodes to one character, only
    # a lone half fails here
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise oc.OpenAIRequestError("request body has a string with a lone UTF-16 surrogate (\\uD800-\\uDFFF), "
                                        "which is not text") from None
    return body


def get_route(app: FastAPI, path: str, **kwargs: Any) -> Callable:
    """``app.get(path, **kwargs)`` that answers HEAD too (the GET's status and headers; uvicorn sends no body), as RFC
    9110 (9.1) asks of a server wherever it answers GET: FastAPI's ``get`` takes GET alone, so ``curl -I`` and an
    uptime monitor's HEAD probe of ``/health`` got 405. Every GET route of both servers is declared with it."""
    return app.api_route(path, methods=["GET", "HEAD"], **kwargs)


def install(app: FastAPI, backend: TextBackend, dependencies: Sequence[Any] = (),
            max_body_bytes: int | Callable[[], int] | None = None, body_stall_s: float | None = None) -> None:
    """Add the two routes to ``app``; ``dependencies`` (e.g. an API-key check) run before each; a body over
    ``max_body_bytes`` (None: no limit; a function: asked once the backend is ready, for a limit that depends on
    what it loaded) is refused with 413, one that stops arriving for ``body_stall_s`` with 408 (:func:`read_body`)."""

    async def serve(request: Request, chat: bool):
        try:
            backend.check_ready()
            if (problem := json_content_type_problem(request.headers.get("content-type"))) is not None:
                raise oc.OpenAIRequestError(problem, None, "unsupported_media_type", 415)
            limit = max_body_bytes() if callable(max_body_bytes) else max_body_bytes
            raw = await read_body(request, limit, body_stall_s)
            # decoding, checking and the chat template cost in proportion to the body (a 32 MiB body of a million
            # one-letter messages took 4 s on the edge): on a worker thread, so the streams already running keep
            # their pace meanwhile
            req, prompt = await asyncio.to_thread(_prepare, backend, raw, chat)
            stream = backend.start(req, prompt, getattr(request.state, "principal", None))
            if inspect.isawaitable(stream):  # (an app gone while it prepares - media fetched - starts nothing)
                stream = await _unless_gone(stream, request)
        except _ClientGone:
            return error_response(_GONE)
        except oc.OpenAIRequestError as e:
            return error_response(e)
        except Exception as e:  # noqa: BLE001 - whatever it is, the client gets OpenAI's shape
            return error_response(_internal(e))
        reply = _Reply(req, prompt, req.model or backend.model_name, ids_only=getattr(stream, "ids_only", False))
        return await (_streamed if req.stream else _whole)(stream, reply, request)

    async def chat(request: Request):
        return await serve(request, chat=True)

    async def completions(request: Request):
        return await serve(request, chat=False)

    app.add_api_route("/v1/chat/completions", chat, methods=["POST"], dependencies=list(dependencies))
    app.add_api_route("/v1/completions", completions, methods=["POST"], dependencies=list(dependencies))


def _prepare(backend: TextBackend, raw: bytes, chat: bool) -> tuple[oc.ChatRequest | oc.CompletionRequest, str]:
    """The request in ``raw`` and its prompt text (the chat template's, for chat), or ``OpenAIRequestError``."""
    body = parse_json_body(raw)
    if not chat:
        req = oc.parse_completion_request(body)
        return req, req.prompt
    req = oc.parse_chat_request(body, media=getattr(backend, "accepts_media", False))
    return req, backend.render_chat(req)


class _ClientGone(Exception):
    pass


async def _unless_gone(work: Awaitable[Any], request: Request) -> Any:
    """``work``'s result, or :class:`_ClientGone` once the client has gone away first (``work`` cancelled)."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise _ClientGone
        return task.result()
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


_GONE = oc.OpenAIRequestError("the client went away before the answer was whole", None, "client_disconnected")


async def _whole(stream: TextStream, reply: _Reply, request: Request) -> JSONResponse:
    """The whole answer as one JSON response. A client that goes away first (the openai client's timeout, which
    it then retries) cancels the generation, as a stream's does: it ran to its end before, so each retry added
    one more running generation."""
    async def consume() -> None:
        async for delta in stream:
            reply.add(delta)

    try:
        await _unless_gone(consume(), request)
    except _ClientGone:
        return error_response(_GONE)
    except GenerationError as e:
        return error_response(e, reply.prompt_param)
    except Exception as e:  # noqa: BLE001
        return error_response(_internal(e))
    finally:
        await stream.aclose()
    return JSONResponse(reply.response(stream.finish_reason or "stop", stream.usage()))


_END = object()  # a stream that ended before its first delta


async def _streamed(stream: TextStream, reply: _Reply, request: Request) -> StreamingResponse | JSONResponse:
    """SSE events of ``stream``, sent once its first delta (or its end) is there: a generation that fails before
    it (the edge's cloud unreachable or busy, a prompt the cloud refuses) is answered with its status as a JSON
    error, as a request refused before it started is, so the openai client raises the status's error and retries
    a 5xx; it was a 200 and an error event, which clients neither classify nor retry. After it, an error is an
    event, then ``[DONE]``."""
    deltas = aiter(stream)
    try:
        head = await _unless_gone(anext(deltas, _END), request)
    except Exception as e:  # noqa: BLE001
        await stream.aclose()
        return error_response(_GONE if isinstance(e, _ClientGone) else e if isinstance(e, GenerationError)
                              else _internal(e), reply.prompt_param)

    async def events():
        try:
            for chunk in reply.opening():
                yield oc.sse(chunk)
            if head is not _END:
                for chunk in reply.chunks(head):
                    yield oc.sse(chunk)
                async for delta in deltas:
                    for chunk in reply.chunks(delta):
                        yield oc.sse(chunk)
            for chunk in reply.chunks(None):
                yield oc.sse(chunk)
            yield oc.sse(reply.chunk({} if reply.chat else "", stream.finish_reason or "stop"))
            if reply.include_usage:
                yield oc.sse(reply.chunk(None, usage=stream.usage()))
        except GenerationError as e:
            yield oc.sse(e.to_dict(reply.prompt_param))
        except Exception as e:  # noqa: BLE001
            yield oc.sse(_internal(e).to_dict())
        finally:
            await stream.aclose()  # also when the client went away: cancels the generation
        yield oc.SSE_DONE

    # The background close also covers a client gone before the first event (events() never started).
    return StreamingResponse(events(), media_type="text/event-stream",
                             background=BackgroundTask(stream.aclose),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _Reply:
    """The wire shapes of one chat or completion response; with ``return_reasoning`` the text goes through a
    :class:`~shared.openai_compat.ThinkingSplitter` (in the think block from the start when the prompt
    opened it). ``ids_only`` (completions only): the deltas are token ids, carried as ``token_ids``."""

    def __init__(self, req: oc.ChatRequest | oc.CompletionRequest, prompt: str, model: str, ids_only: bool = False):
        self.chat = isinstance(req, oc.ChatRequest)
        self.prompt_param = req.prompt_param
        self.ids: list[int] | None = [] if ids_only and not self.chat else None  # the token ids answered so far
        self.model, self.created = model, int(time.time())
        self.rid = oc.new_id() if self.chat else oc.new_id("cmpl")
        self.include_usage = req.include_usage
        self.thinking = (oc.ThinkingSplitter(in_thinking=prompt.rstrip().endswith("<think>"))
                         if self.chat and req.return_reasoning else None)
        self.echo = req.prompt if not self.chat and req.echo else ""
        self.parts: dict[str, list[str]] = {"content": [], "reasoning": []}

    def pieces(self, delta: str | None) -> list[tuple[str, str]]:
        """``(kind, text)`` pieces of ``delta``; ``None`` marks the end (the splitter's held tail)."""
        if self.thinking is not None:
            return self.thinking.flush() if delta is None else self.thinking.feed(delta)
        return [("content", delta)] if delta else []

    def add(self, delta: str | list[int] | None) -> None:
        if self.ids is not None:
            self.ids.extend(delta or ())
            return
        for kind, text in self.pieces(delta):
            self.parts[kind].append(text)

    def chunk(self, body: Any, finish_reason: str | None = None, usage: dict | None = None,
              token_ids: list[int] | None = None) -> dict:
        if self.chat:
            out = oc.chat_chunk(self.rid, self.model, self.created, body, finish_reason, usage_obj=usage)
        else:
            if self.ids is not None and body is not None:  # not the usage-only chunk
                token_ids = token_ids or []
            out = oc.completion_chunk(self.rid, self.model, self.created, body, finish_reason, usage_obj=usage,
                                      token_ids=token_ids)
        if self.include_usage:  # OpenAI's stream: "usage": null on every chunk before the usage-only one
            out.setdefault("usage", None)
        return out

    def opening(self) -> list[dict]:
        if self.chat:
            return [self.chunk({"role": "assistant", "content": ""})]
        return [self.chunk(self.echo)] if self.echo else []

    def chunks(self, delta: str | list[int] | None) -> list[dict]:
        if self.ids is not None:
            return [self.chunk("", token_ids=delta)] if delta else []
        return [self.chunk({"reasoning_content" if kind == "reasoning" else "content": text} if self.chat
                           else text) for kind, text in self.pieces(delta)]

    def response(self, finish_reason: str, usage: dict) -> dict:
        self.add(None)
        content = "".join(self.parts["content"])
        if not self.chat:
            return oc.completion_response(self.rid, self.model, self.created, self.echo + content,
                                          finish_reason, usage, token_ids=self.ids)
        reasoning = "".join(self.parts["reasoning"]) if self.thinking is not None else None
        return oc.chat_response(self.rid, self.model, self.created, content, finish_reason, usage, reasoning)
