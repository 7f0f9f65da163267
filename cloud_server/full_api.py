"""Full-model mode: ``/v1/chat/completions`` and ``/v1/completions`` on the same engine, every layer in
the cloud (the all-cloud baseline, and the fallback for devices that cannot run the front).

The routes are :mod:`shared.openai_routes`, shared with the edge's local endpoint; this module adapts the
engine to them: the model's tokenizer and chat template make the prompt, the engine samples (and feeds each
token back itself), :class:`shared.detokenizer.StreamDecoder` makes text of its tokens and stop strings cut
it. A stream that ends early (stop string, client gone) aborts its engine request: its KV is freed at once.

A request the engine drops for load (``kv_cache_full``: running requests outgrew the KV pool together and it was the
youngest) is replayed here, as the edge replays a split request (docs/edge.md, "Dropped links"): after the wait a
split client is told (``RETRY_AFTER_S``), it goes to the engine again under a new id, its prompt followed by the
tokens generated so far, and the stream goes on at the next token - the same tokens as with a pool large enough
(greedy; sampled: the request keeps its key, so each token is drawn from the same uniforms at the same position;
penalties: the engine request carries those tokens as its output so far, ``LLMEngine.add_request``'s ``output_ids``,
so they are penalized and count towards ``max_tokens`` as in the first one).
:class:`ReplayPolicy` bounds it; a client gone meanwhile cancels it (the routes cancel the wait and ``aclose()``).

Each request is counted under its key's tenant (``cloud_server.usage``, :class:`~cloud_server.usage.RequestMeter`:
the prompt once, however often it is replayed, and each token as it is sampled) and traced by its first engine
request's id.

A model without a tokenizer (the random presets) serves ``/v1/completions`` with a prompt of token ids only: its
answer is token ids (``choices[].token_ids``, vLLM's field; ``text`` stays empty), and a chat request, a text
prompt or ``stop`` strings (all need text) are a 400 that says so.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import jinja2
import torch
from fastapi import FastAPI

from cloud_server.engine.async_engine import RequestStream
from cloud_server.engine.llm_engine import RequestOutput
from cloud_server.engine.sampling_params import SamplingParams, SamplingParamsError
from cloud_server.engine.sequence import InputChunk
from cloud_server.limits import RETRY_AFTER_MS, RETRY_AFTER_S
from cloud_server.split_translate import WIRE_CODES
from cloud_server.usage import TenantUsage
from shared import chat_tokens
from shared import openai_compat as oc
from shared import openai_routes
from shared.detokenizer import StreamDecoder

DEFAULT_MAX_TOKENS = 1024  # when the request names none (bounded by the context left)
# The bounds on a request's size follow from the tokens its prompt may fill (prompt_positions), never from a guess
# of bytes a token: a body over max_body_bytes is refused (413) before it is read whole, a prompt text longer than
# its positions of the tokenizer's longest token is refused (400 context_length_exceeded) before it is tokenized
# (about 1.5-4 s a MB, on the one tokenizer thread every request waits for). A fixed 64 bytes a position refused a
# prompt that fit (SmolLM2's lines of 80 spaces are 82 bytes a token; JSON may spell any character as \uXXXX)
# and tokenized bodies of 30 contexts' text.
JSON_BYTES_PER_UNIT = 6  # JSON's longest spelling of one UTF-16 code unit: \uXXXX (Python's ensure_ascii, Go's <>&)
ID_BYTES = 64  # a prompt token id in any usual JSON layout (indented, one a line)
MIN_BODY_BYTES = 1 << 20


def prompt_positions(config) -> int:
    """The most tokens a prompt may fill on a full-model server of ``config`` (a ``ServerConfig``): the prompt limit,
    and one position short of the context (the answer's first token)."""
    return min(config.prompt_limit, config.engine.max_context - 1)


def longest_token(tokenizer) -> int:
    """The most UTF-16 code units the text of one token of ``tokenizer`` takes (None: 0), added tokens included: its
    vocabulary string's, which is at least its text's (a byte-level vocabulary spells a byte as one character, a
    SentencePiece one spells its text, a byte-fallback token as ``<0xNN>``)."""
    return 0 if tokenizer is None else max(len(s.encode("utf-16-le")) // 2 for s in tokenizer.get_vocab())


def max_body_bytes(config, longest: int) -> int:
    """The largest ``/v1`` request body a full-model server of ``config`` reads, for a tokenizer whose longest token
    is ``longest`` code units (:func:`longest_token`): a prompt that fills its positions, every token's text in
    JSON's longest spelling (or every token an id)."""
    return max(MIN_BODY_BYTES, max(ID_BYTES, JSON_BYTES_PER_UNIT * longest) * prompt_positions(config))


@dataclass(frozen=True)
class ReplayPolicy:
    """How a request the engine dropped for load is replayed (module docstring). The bounds count from its last new
    token, as the edge's ``RetryPolicy`` does: a request that makes progress between drops is never failed for
    them."""

    max_replays: int = 8  # replays without a new token; the next drop fails the request (503 / an error event)
    window_s: float = 30.0  # from the first drop without a new token since: no replay, nor a wait for its token, past it
    wait_s: float = RETRY_AFTER_S  # before each replay: what a dropped split request's edge is told to wait


REPLAY = ReplayPolicy()  # the servers' (a backend reads it when it is made)


class _EngineStream:
    """One request as a :class:`shared.openai_routes.TextStream`: detokenized, stop strings applied; for a model
    without a tokenizer (``ids_only``) its deltas are the sampled token ids instead (no stop strings). It is one
    engine request, or several when the engine drops it for load and it is replayed (:class:`ReplayPolicy`)."""

    def __init__(self, rt, ids: list[int], params: SamplingParams, variant: str | None, stops: list[str],
                 replay: ReplayPolicy, caller=None):
        self.rt, self.prompt_tokens = rt, len(ids)
        self.eos = set(rt.eos_token_ids()) | set(params.stop_token_ids)
        self.ids_only = rt.tokenizer is None
        self.decoder = (None if self.ids_only
                        else StreamDecoder(partial(rt.tokenizer.decode, skip_special_tokens=True)))
        self.stop = oc.StopMatcher(stops)
        self.finish_reason: str | None = None
        self.completion_tokens = self.cached_tokens = 0
        if params.seed is None and not params.greedy:  # a key of its own, which its replays keep (the engine would
            params = replace(params, seed=secrets.randbits(63))  # give each engine request a fresh one)
        self.ids, self.params, self.variant, self.replay = list(ids), params, variant, replay
        self.tokens: list[int] = []  # every token sampled so far, in order (a replay's prompt ends with them)
        self.replays = 0
        self.dropped: tuple[float, int] | None = None  # (first drop, replays) since the last new token
        self.error_code: str | None = None  # the code of the GenerationError the stream ended with
        self._submit()
        # counted once the engine took it, under the key's tenant ``caller`` (an auth Principal; None: unkeyed)
        self.meter = (None if rt.metrics is None
                      else TenantUsage.of(rt.metrics).request(caller, self.rid, self.prompt_tokens))

    def _submit(self) -> None:
        """Hand the engine the request's context (the prompt, then the tokens sampled so far, which the engine request
        carries as its output so far: the rest of ``max_tokens``, penalized as the first) under a new id."""
        self.rid = oc.new_id("req")
        self.outputs = RequestStream()
        self.engine_done = False  # the engine finished this engine request (or was told to abort it)
        context = torch.tensor(self.ids + self.tokens)  # [P + generated]
        self.rt.engine.add_request(self.rid, self.outputs.sink, InputChunk(0, token_ids=context), self.params,
                                   self.variant, output_ids=list(self.tokens))

    def __aiter__(self):
        return self

    async def __anext__(self) -> str | list[int]:
        while self.finish_reason is None:
            out = await self._next()
            if out.error_code == "kv_cache_full" and self._may_replay():
                await asyncio.sleep(self.replay.wait_s)  # (cancelled when the client goes: nothing is replayed)
                self.replays += 1
                if self.rt.metrics is not None:
                    self.rt.metrics.on_preemption()
                self._submit()
                continue
            delta = self._consume(out)
            if delta:
                return delta
        raise StopAsyncIteration

    async def _next(self) -> RequestOutput:
        """The engine's next output; after a drop, within the replay window only (past it the request fails)."""
        if self.dropped is None:
            return await self.outputs.get()
        try:
            return await asyncio.wait_for(self.outputs.get(), self.dropped[0] + self.replay.window_s - time.monotonic())
        except asyncio.TimeoutError:
            self.finish_reason, self.error_code = "error", "overloaded"
            await self.aclose()
            raise openai_routes.GenerationError(f"the KV pool is exhausted: no token in {self.replay.window_s:g} s "
                                                f"after the request was replayed {self.dropped[1]} times",
                                                "overloaded", retry_after_s=self.replay.wait_s) from None

    def _may_replay(self) -> bool:
        """The engine dropped the request for load: whether to replay it (:class:`ReplayPolicy`'s bounds), counted."""
        now = time.monotonic()
        since, replays = self.dropped or (now, 0)
        if replays >= self.replay.max_replays or now + self.replay.wait_s >= since + self.replay.window_s:
            return False
        self.dropped = (since, replays + 1)
        return True

    def _consume(self, out: RequestOutput) -> str | list[int]:
        """The text ``out`` adds (``ids_only``: its token id, the end-of-sequence token left out as the text leaves
        it out); sets ``finish_reason`` when the stream ends here."""
        self.engine_done = self.engine_done or out.finished
        if not self.replays:  # (a replay's prompt is the first one's and its tokens)
            self.cached_tokens = out.num_cached_tokens
        if out.error_code is not None:
            self.finish_reason = "error"
            # the engine's code as the split endpoint sends it (kv_cache_full -> overloaded: a 503 with Retry-After)
            code = self.error_code = WIRE_CODES.get(out.error_code, out.error_code)
            message, wait_s = out.error_message or out.error_code, None
            if out.error_code == "kv_cache_full":  # dropped for load, and not replayed again (_may_replay)
                message += (f" (replayed {self.dropped[1]} times in {time.monotonic() - self.dropped[0]:.1f} s "
                            "without a new token)" if self.dropped else " (not replayed)")
                wait_s = self.replay.wait_s  # the client waits as this server waits before a replay
            raise openai_routes.GenerationError(message, code, retry_after_s=wait_s)
        sampled = None  # the token the answer shows
        if out.token_id is not None:
            self.completion_tokens += 1
            if self.meter is not None:
                self.meter.sampled()
            self.tokens.append(out.token_id)
            self.dropped = None
            if not (out.finish_reason == "stop" and out.token_id in self.eos):
                sampled = out.token_id
        if self.ids_only:
            if out.finished:
                self.finish_reason = "length" if out.finish_reason == "length" else "stop"
            return [sampled] if sampled is not None else []
        text = self.decoder.push(sampled) if sampled is not None else ""
        if out.finished:
            text += self.decoder.flush()
        safe, stopped = self.stop.feed(text)
        if stopped:
            self.finish_reason = "stop"  # aclose() aborts the engine request
        elif out.finished:
            self.finish_reason = "length" if out.finish_reason == "length" else "stop"
            safe += self.stop.flush()
        return safe

    def usage(self) -> dict[str, Any]:
        return oc.usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    async def aclose(self) -> None:
        self.outputs.close()  # (the current engine request's: a replay's wait is cancelled before this)
        if self.meter is not None:  # its trace line, once: unfinished here, the client went first
            self.meter.end(self.finish_reason or "cancelled", self.completion_tokens, self.error_code)
        if not self.engine_done:
            self.engine_done = True
            self.rt.engine.abort(self.rid)


class _EngineBackend:
    """The :class:`shared.openai_routes.TextBackend` of a full-model runtime."""

    def __init__(self, runtime):
        self.rt = runtime
        self.replay = REPLAY
        self._longest: int | None = None  # longest_token(rt.tokenizer), once the runtime has loaded it
        # the prompt's tokenization off the event loop (a long prompt takes ~1 s a MB there, stalling every
        # stream), one thread: one tokenizer object is never used by two threads at once
        self._tokenize = ThreadPoolExecutor(1, thread_name_prefix="autoglm-tokenize")

    @property
    def model_name(self) -> str:
        return self.rt.model_name

    @property
    def longest_token(self) -> int:
        if self._longest is None:
            self._longest = longest_token(self.rt.tokenizer)
        return self._longest

    def max_body_bytes(self) -> int:
        return max_body_bytes(self.rt.config, self.longest_token)

    def _no_tokenizer(self, what: str, param: str) -> oc.OpenAIRequestError:
        return oc.OpenAIRequestError(f"model {self.rt.model_name!r} has no tokenizer: {what}; /v1/completions takes a "
                                     "prompt of token ids (and answers token ids)", param)

    def check_ready(self) -> None:
        if self.rt.engine is None or not self.rt.engine.alive:
            raise oc.OpenAIRequestError("engine not running", None, "unavailable", 503)
        if self.rt.draining:
            raise oc.OpenAIRequestError("server is draining", None, "draining", 503,
                                        retry_after_s=RETRY_AFTER_MS["draining"] / 1000)  # as a split session's

    def render_chat(self, req: oc.ChatRequest) -> str:
        tok = self.rt.tokenizer
        if tok is None:
            raise self._no_tokenizer("chat needs one (and its chat template)", "messages")
        if not getattr(tok, "chat_template", None):
            raise oc.OpenAIRequestError("this model has no chat template: use /v1/completions")
        control = self._control()
        try:  # the messages' special tokens' strings marked: start() tokenizes them as text (shared.chat_tokens)
            return tok.apply_chat_template(chat_tokens.mark_messages(req.messages, control),
                                           add_generation_prompt=True, tokenize=False,
                                           **chat_tokens.mark(req.template_kwargs(), control))
        except (jinja2.TemplateError, ValueError, TypeError) as e:  # TypeError: a template variable of a bad type
            raise oc.OpenAIRequestError(f"chat template refused the messages: {e}", "messages") from None

    def _control(self):
        """The pattern of the strings that are text inside a message (``shared.chat_tokens.control_tokens``)."""
        tok = self.rt.tokenizer
        added = ((t.content, t.special) for t in tok.added_tokens_decoder.values())
        return chat_tokens.control_tokens(added, str(tok.chat_template or ""))

    def _encode(self, prompt: str, chat: bool) -> list[int]:
        """A raw prompt's ids, the tokenizer's own special tokens added; a chat's (a :meth:`render_chat` prompt):
        the template's special tokens as tokens, the messages' as text."""
        tok = self.rt.tokenizer
        if not chat:
            return tok(prompt, add_special_tokens=True).input_ids
        return chat_tokens.encode_chat(prompt, partial(tok.encode, add_special_tokens=False),
                                       partial(tok.encode, add_special_tokens=False, split_special_tokens=True),
                                       tok.added_tokens_decoder.__contains__)

    async def start(self, req: oc.ChatRequest | oc.CompletionRequest, prompt: str, caller=None) -> _EngineStream:
        param = req.prompt_param
        if isinstance(req, oc.CompletionRequest) and req.prompt_ids is not None:  # token ids: as given
            ids, facts = req.prompt_ids, getattr(self.rt, "facts", None)
            if facts is not None and max(ids) >= facts.vocab_size:
                raise oc.OpenAIRequestError(f"prompt: token id {max(ids)} is outside the vocabulary "
                                            f"[0, {facts.vocab_size})", param)
        elif self.rt.tokenizer is None:  # chat stopped in render_chat
            raise self._no_tokenizer("a text prompt needs one", param)
        else:  # a chat prompt carries its special tokens in the template; a raw prompt gets the tokenizer's
            self._check_length(prompt, param)
            encode = partial(self._encode, prompt, isinstance(req, oc.ChatRequest))
            try:
                ids = await asyncio.get_running_loop().run_in_executor(self._tokenize, encode)
            except ValueError as e:  # a message's text the tokenizer cannot keep as text (shared.chat_tokens)
                raise oc.OpenAIRequestError(str(e), param) from None
        if self.rt.tokenizer is None and req.sampling.stop:
            raise self._no_tokenizer("stop strings need text", "stop")
        return _EngineStream(self.rt, ids, self._params(req.sampling, len(ids), param),
                             self._variant(req.precision, len(ids)), req.sampling.stop, self.replay, caller)

    def _check_length(self, prompt: str, param: str) -> None:
        """Refuse a prompt whose text cannot fit its positions, before it is tokenized: every character but the
        markers (``shared.chat_tokens``) is in a token, and no token holds more than :attr:`longest_token` (so in a
        byte-level or byte-fallback vocabulary, every served family's; a WordPiece ``[UNK]`` or a fused ``<unk>``
        would swallow any run of characters)."""
        chars = len(prompt) - prompt.count(chat_tokens.START) - prompt.count(chat_tokens.END)
        positions = prompt_positions(self.rt.config)
        if chars > self.longest_token * positions:
            raise oc.OpenAIRequestError(f"prompt of {chars} characters is over {positions} tokens (no token of this "
                                        f"tokenizer holds more than {self.longest_token}), the most a prompt may "
                                        "fill here", param, oc.CONTEXT_LENGTH_EXCEEDED)

    def _params(self, s: oc.SamplingOptions, prompt_len: int, param: str) -> SamplingParams:
        limit, prompt_limit = self.rt.config.engine.max_context, self.rt.config.prompt_limit  # the pool bounds it too
        if prompt_len > prompt_limit:
            raise oc.OpenAIRequestError(f"prompt of {prompt_len} tokens is over the limit of {prompt_limit} "
                                        "(max_prompt_tokens)", param, oc.CONTEXT_LENGTH_EXCEEDED)
        if limit - prompt_len < 1:
            raise oc.OpenAIRequestError(f"prompt of {prompt_len} tokens leaves no room in the context of "
                                        f"{limit}", param, oc.CONTEXT_LENGTH_EXCEEDED)
        eos = getattr(self.rt.tokenizer, "eos_token_id", None)  # e.g. a chat model's end-of-turn token
        try:
            return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
                                  presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                                  repetition_penalty=s.repetition_penalty,
                                  max_tokens=min(s.max_tokens or DEFAULT_MAX_TOKENS, limit - prompt_len),
                                  stop_token_ids=[eos] if eos is not None else [])
        except SamplingParamsError as e:
            raise oc.OpenAIRequestError(str(e)) from None

    def _variant(self, precision: str | None, prompt_len: int) -> str:
        from cloud_server.precision_select import PrecisionError, compute_variant

        try:
            return compute_variant(precision, prompt_len, self.rt)
        except PrecisionError as e:
            raise oc.OpenAIRequestError(str(e), "precision") from None


def install(app: FastAPI, runtime, auth) -> None:
    """Add the OpenAI text routes over ``runtime`` (a full-model ``CloudRuntime``) behind ``auth``."""
    backend = _EngineBackend(runtime)
    openai_routes.install(app, backend, dependencies=[auth],
                          max_body_bytes=backend.max_body_bytes,
                          body_stall_s=runtime.config.handshake_timeout_s)  # a vanished client's upload ends
