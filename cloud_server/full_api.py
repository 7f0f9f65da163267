"""Full-model mode: ``/v1/chat/completions`` and ``/v1/completions``, OpenAI-compatible, on the same engine.

The all-cloud baseline and the fallback for devices that cannot run the front: the engine runs every layer
(token embeddings included) and feeds each sampled token back itself. Request parsing, SSE chunk shapes,
the thinking splitter and stop-string matching are shared with the edge's local endpoint
(``shared.openai_compat``); this module adds tokenization, the chat template and streaming from the engine.

Thinking: ``enable_thinking`` (top level or in ``chat_template_kwargs``) goes to the chat template;
with ``return_reasoning`` the ``<think>...</think>`` part of the output is returned as
``reasoning_content`` (streamed as ``delta.reasoning_content``), the rest as ``content``.
A client that disconnects mid-stream has its request aborted (its KV freed at once).
"""

from __future__ import annotations

import json
import time
from contextlib import aclosing

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from cloud_server.engine.async_engine import RequestStream
from cloud_server.engine.sampling_params import SamplingParams, SamplingParamsError
from cloud_server.engine.sequence import InputChunk
from shared import openai_compat as oc

DEFAULT_MAX_TOKENS = 1024  # when the request names none (bounded by the context left)


class Detokenizer:
    """Incremental detokenization: text deltas for a growing list of ids; holds back a split UTF-8 char."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def feed(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
            return ""
        delta, self.text = text[len(self.text):], text
        return delta


def _error(status: int, message: str, code: str = "invalid_request_error", param: str | None = None):
    return JSONResponse(oc.OpenAIRequestError(message, param, code, status).to_dict(), status_code=status)


class OpenAIServer:
    """The OpenAI routes of a full-model runtime (``cloud_server.runtime.CloudRuntime``)."""

    def __init__(self, runtime):
        self.rt = runtime

    def install(self, app: FastAPI, auth) -> None:
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"], dependencies=[auth])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], dependencies=[auth])

    # -- shared plumbing ----------------------------------------------------------------------
    def _params(self, s: oc.SamplingOptions, prompt_len: int) -> SamplingParams:
        room = self.rt.config.engine.max_model_len - prompt_len
        if room < 1:
            raise oc.OpenAIRequestError(f"prompt of {prompt_len} tokens leaves no room in the context of "
                                        f"{self.rt.config.engine.max_model_len}", "messages")
        max_tokens = min(s.max_tokens or DEFAULT_MAX_TOKENS, room)
        eos = getattr(self.rt.tokenizer, "eos_token_id", None)  # e.g. a chat model's end-of-turn token
        try:
            return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
                                  max_tokens=max_tokens, stop_token_ids=[eos] if eos is not None else [])
        except SamplingParamsError as e:
            raise oc.OpenAIRequestError(str(e)) from None

    def _variant(self, precision: str | None, prompt_len: int) -> str:
        from cloud_server.precision_select import PrecisionError, compute_variant

        try:
            return compute_variant(precision, prompt_len, self.rt)
        except PrecisionError as e:
            raise oc.OpenAIRequestError(str(e), "precision") from None

    async def _outputs(self, request: Request, ids: list[int], params: SamplingParams, variant: str | None):
        """Engine outputs of one request; aborts it if the consumer stops early (client gone, stop string)."""
        rid = oc.new_id("req")
        stream = RequestStream()
        self.rt.engine.add_request(rid, stream.sink, InputChunk(0, token_ids=torch.tensor(ids)), params, variant)
        finished = False
        try:
            while True:
                out = await stream.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            stream.close()
            if not finished:
                self.rt.engine.abort(rid)

    async def _body(self, request: Request):
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise oc.OpenAIRequestError("request body is not valid JSON") from None

    def _check_ready(self):
        if self.rt.tokenizer is None:
            return _error(400, f"model {self.rt.model_name!r} has no tokenizer: text endpoints are unavailable")
        if self.rt.engine is None or not self.rt.engine.alive:
            return _error(503, "engine not running", "server_error")
        if self.rt.draining:
            return _error(503, "server is draining", "server_error")
        return None

    # -- /v1/chat/completions ---------------------------------------------------------------
    async def chat(self, request: Request):
        refused = self._check_ready()
        if refused is not None:
            return refused
        tok = self.rt.tokenizer
        try:
            req = oc.parse_chat_request(await self._body(request))
            if not getattr(tok, "chat_template", None):
                raise oc.OpenAIRequestError("this model has no chat template: use /v1/completions")
            prompt = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False,
                                             **req.template_kwargs())
            ids = tok(prompt, add_special_tokens=False).input_ids
            params = self._params(req.sampling, len(ids))
            variant = self._variant(req.precision, len(ids))
        except oc.OpenAIRequestError as e:
            return JSONResponse(e.to_dict(), status_code=e.status)
        in_thinking = prompt.rstrip().endswith("<think>")
        splitter = oc.ThinkingSplitter(in_thinking=in_thinking) if req.return_reasoning else None
        gen = _TextGen(self, request, ids, params, variant, req.sampling.stop)
        model, rid, created = req.model or self.rt.model_name, oc.new_id(), int(time.time())

        def pieces(text: str, flush: bool = False) -> list[tuple[str, str]]:
            if splitter is None:
                return [("content", text)] if text else []
            return splitter.feed(text) + (splitter.flush() if flush else [])

        if req.stream:
            async def events():
                yield oc.sse(oc.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
                async for text, final in gen.run():
                    for kind, t in pieces(text, flush=final):
                        key = "reasoning_content" if kind == "reasoning" else "content"
                        yield oc.sse(oc.chat_chunk(rid, model, created, {key: t}))
                if gen.error is not None:
                    yield oc.sse({"error": gen.error})
                else:
                    yield oc.sse(oc.chat_chunk(rid, model, created, {}, gen.finish_reason))
                if req.include_usage:
                    yield oc.sse(oc.chat_chunk(rid, model, created, None, usage_obj=gen.usage()))
                yield oc.SSE_DONE

            return StreamingResponse(events(), media_type="text/event-stream")
        content, reasoning = [], []
        async for text, final in gen.run():
            for kind, t in pieces(text, flush=final):
                (reasoning if kind == "reasoning" else content).append(t)
        if gen.error is not None:
            return JSONResponse({"error": gen.error}, status_code=500)
        return JSONResponse(oc.chat_response(rid, model, created, "".join(content), gen.finish_reason,
                                             gen.usage(), "".join(reasoning) if splitter is not None else None))

    # -- /v1/completions --------------------------------------------------------------------
    async def completions(self, request: Request):
        refused = self._check_ready()
        if refused is not None:
            return refused
        tok = self.rt.tokenizer
        try:
            req = oc.parse_completion_request(await self._body(request))
            ids = tok(req.prompt).input_ids
            params = self._params(req.sampling, len(ids))
            variant = self._variant(req.precision, len(ids))
        except oc.OpenAIRequestError as e:
            return JSONResponse(e.to_dict(), status_code=e.status)
        gen = _TextGen(self, request, ids, params, variant, req.sampling.stop)
        model, rid, created = req.model or self.rt.model_name, oc.new_id("cmpl"), int(time.time())
        if req.stream:
            async def events():
                if req.echo:
                    yield oc.sse(oc.completion_chunk(rid, model, created, req.prompt))
                async for text, _ in gen.run():
                    if text:
                        yield oc.sse(oc.completion_chunk(rid, model, created, text))
                if gen.error is not None:
                    yield oc.sse({"error": gen.error})
                else:
                    yield oc.sse(oc.completion_chunk(rid, model, created, "", gen.finish_reason))
                if req.include_usage:
                    yield oc.sse(oc.completion_chunk(rid, model, created, None, usage_obj=gen.usage()))
                yield oc.SSE_DONE

            return StreamingResponse(events(), media_type="text/event-stream")
        parts = [req.prompt] if req.echo else []
        async for text, _ in gen.run():
            parts.append(text)
        if gen.error is not None:
            return JSONResponse({"error": gen.error}, status_code=500)
        return JSONResponse(oc.completion_response(rid, model, created, "".join(parts), gen.finish_reason,
                                                   gen.usage()))


class _TextGen:
    """One generation as text deltas: detokenize, apply stop strings, keep usage and the finish reason."""

    def __init__(self, server: OpenAIServer, request: Request, ids: list[int], params: SamplingParams,
                 variant: str | None, stops: list[str]):
        self.server, self.request, self.ids, self.params, self.variant = server, request, ids, params, variant
        self.detok = Detokenizer(server.rt.tokenizer)
        self.stop = oc.StopMatcher(stops)
        self.finish_reason = "stop"
        self.error: dict | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0

    async def run(self):
        """Yield ``(text, final)``; ``final`` is True on the last piece."""
        async with aclosing(self.server._outputs(self.request, self.ids, self.params, self.variant)) as outs:
            async for out in outs:
                self.cached_tokens = out.num_cached_tokens
                if out.error_code is not None:
                    self.error = {"message": out.error_message, "type": "server_error", "code": out.error_code}
                    break
                text = ""
                if out.token_id is not None:
                    self.completion_tokens += 1
                    eos = out.finish_reason == "stop" and (out.token_id in self.server.rt.eos_token_ids()
                                                           or out.token_id in self.params.stop_token_ids)
                    text = "" if eos else self.detok.feed(out.token_id)
                safe, stopped = self.stop.feed(text)
                if stopped:
                    self.finish_reason = "stop"
                    yield safe, True
                    return  # leaving the generator aborts the engine request
                if out.finished:
                    self.finish_reason = "length" if out.finish_reason == "length" else "stop"
                    yield safe + self.stop.flush(), True
                    return
                if safe:
                    yield safe, False

    def usage(self) -> dict:
        extra = {"cached_tokens": self.cached_tokens} if self.cached_tokens else {}
        return oc.usage(len(self.ids), self.completion_tokens, **extra)
