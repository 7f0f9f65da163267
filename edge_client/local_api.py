"""``autoglm-edge serve``: a local OpenAI-compatible endpoint on the device, backed by the split runtime.

Existing apps (the ``openai`` client, ``langchain_openai.ChatOpenAI``) point their ``base_url`` at
``http://127.0.0.1:<port>/v1`` and work unchanged; every request runs the front layers here and the rest in
the cloud through one :class:`~edge_client.client.EdgeClient`.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``.
Streaming is SSE (``data: {chunk}`` lines, then ``data: [DONE]``); ``stream_options.include_usage`` adds a
last usage-only chunk. Thinking: ``enable_thinking`` (top level or ``chat_template_kwargs``) reaches the chat
template; ``return_reasoning`` moves the ``<think>...</think>`` text to ``reasoning_content``. ``stop``
strings end the stream and cancel the cloud request. ``precision`` (an extension) overrides the wire codec.
A client that disconnects mid-stream cancels its request. Requests run one at a time (the edge runtime holds
one sequence); later ones queue.

Request parsing and response shapes come from :mod:`shared.openai_compat` (shared with the cloud's
full-model endpoint).
"""

from __future__ import annotations

import hmac
import json
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from shared import openai_compat as oc

from .errors import EdgeClientError

if TYPE_CHECKING:
    from .client import AsyncGeneration, EdgeClient

DEFAULT_MAX_TOKENS = 512


def _err(e: oc.OpenAIRequestError) -> JSONResponse:
    return JSONResponse(e.to_dict(), status_code=e.status)


def _server_error(message: str, status: int = 502) -> JSONResponse:
    return _err(oc.OpenAIRequestError(message, None, "upstream_error", status))


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise oc.OpenAIRequestError("request body is not valid JSON") from None


def create_app(client: EdgeClient, model_name: str | None = None, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``client``; ``api_key`` (optional) is required as a Bearer token."""
    app = FastAPI(title="autoglm-edge", docs_url=None, redoc_url=None)
    model_id = model_name or f"autoglm-split-{client.manifest.bundle_id[:12]}"

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if (api_key and request.url.path.startswith("/v1/")
                and not hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {api_key}")):
            return _err(oc.OpenAIRequestError("invalid API key", None, "invalid_api_key", 401))
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", "bundle_id": client.manifest.bundle_id, "connected": client.connected}

    @app.get("/v1/models")
    async def models():
        return oc.model_list([model_id])

    def sampling_kwargs(s: oc.SamplingOptions, precision: str | None) -> dict[str, Any]:
        return dict(max_tokens=s.max_tokens or DEFAULT_MAX_TOKENS, temperature=s.temperature, top_p=s.top_p,
                    top_k=s.top_k, seed=s.seed, stop=s.stop, precision=precision)

    def usage_of(gen: AsyncGeneration) -> dict[str, Any]:
        st = gen.stats
        return oc.usage(st.prompt_tokens, st.completion_tokens, cached_tokens=st.cached_tokens)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            req = oc.parse_chat_request(await _json(request))
            messages = [{"role": m["role"], "content": m["content"]} for m in req.messages]
            prompt = client.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                          **req.template_kwargs())
        except oc.OpenAIRequestError as e:
            return _err(e)
        except ValueError as e:
            return _err(oc.OpenAIRequestError(str(e), "messages"))
        model = req.model or model_id
        rid, created = oc.new_id(), int(time.time())
        splitter = (oc.ThinkingSplitter(in_thinking=prompt.rstrip().endswith("<think>"))
                    if req.return_reasoning else None)

        def pieces(text: str, final: bool) -> list[tuple[str, str]]:
            if splitter is None:
                return [("content", text)] if text else []
            return splitter.feed(text) + (splitter.flush() if final else [])

        gen = client.agenerate(prompt=prompt, **sampling_kwargs(req.sampling, req.precision))

        if not req.stream:
            parts: dict[str, list[str]] = {"content": [], "reasoning": []}
            try:
                async for delta in gen:
                    for kind, t in pieces(delta, False):
                        parts[kind].append(t)
            except EdgeClientError as e:
                return _server_error(str(e))
            for kind, t in pieces("", True):
                parts[kind].append(t)
            reasoning = "".join(parts["reasoning"]) if req.return_reasoning else None
            return JSONResponse(oc.chat_response(rid, model, created, "".join(parts["content"]),
                                                 gen.finish_reason or "stop", usage_of(gen), reasoning))

        async def events():
            yield oc.sse(oc.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
            try:
                async for delta in gen:
                    for kind, t in pieces(delta, False):
                        yield oc.sse(oc.chat_chunk(rid, model, created,
                                                   {"reasoning_content" if kind == "reasoning" else "content": t}))
                for kind, t in pieces("", True):
                    yield oc.sse(oc.chat_chunk(rid, model, created,
                                               {"reasoning_content" if kind == "reasoning" else "content": t}))
                yield oc.sse(oc.chat_chunk(rid, model, created, {}, gen.finish_reason or "stop"))
                if req.include_usage:
                    yield oc.sse(oc.chat_chunk(rid, model, created, None, usage_obj=usage_of(gen)))
            except EdgeClientError as e:
                yield oc.sse(oc.OpenAIRequestError(str(e), None, "upstream_error", 502).to_dict())
            finally:
                await gen.aclose()  # client went away: cancel the cloud request
            yield oc.SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            req = oc.parse_completion_request(await _json(request))
        except oc.OpenAIRequestError as e:
            return _err(e)
        model = req.model or model_id
        rid, created = oc.new_id("cmpl"), int(time.time())
        gen = client.agenerate(prompt=req.prompt, **sampling_kwargs(req.sampling, req.precision))
        if not req.stream:
            try:
                text = "".join([d async for d in gen])
            except EdgeClientError as e:
                return _server_error(str(e))
            text = (req.prompt + text) if req.echo else text
            return JSONResponse(oc.completion_response(rid, model, created, text, gen.finish_reason or "stop",
                                                       usage_of(gen)))

        async def events():
            try:
                if req.echo:
                    yield oc.sse(oc.completion_chunk(rid, model, created, req.prompt))
                async for delta in gen:
                    yield oc.sse(oc.completion_chunk(rid, model, created, delta))
                yield oc.sse(oc.completion_chunk(rid, model, created, "", gen.finish_reason or "stop"))
                if req.include_usage:
                    yield oc.sse(oc.completion_chunk(rid, model, created, None, usage_obj=usage_of(gen)))
            except EdgeClientError as e:
                yield oc.sse(oc.OpenAIRequestError(str(e), None, "upstream_error", 502).to_dict())
            finally:
                await gen.aclose()
            yield oc.SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app
