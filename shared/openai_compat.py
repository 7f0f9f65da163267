"""OpenAI-compatible request parsing and response formatting, under the routes that the edge's local endpoint
and the cloud's full-model mode share (:mod:`shared.openai_routes`). Pure Python (json + dataclasses): the
phone imports it without torch.

Contract:

* :func:`parse_chat_request` / :func:`parse_completion_request` turn a decoded JSON body into a validated
  :class:`ChatRequest` / :class:`CompletionRequest`, or raise :class:`OpenAIRequestError` whose
  :meth:`~OpenAIRequestError.to_dict` is the OpenAI error body (HTTP 400). Unknown fields are ignored, as
  OpenAI-compatible servers do; known fields with a bad type or range are refused, naming the field.
  Fields that ask for a feature not offered here (``tools``, a ``tool_choice`` other than none/auto,
  ``response_format`` other than text, ``modalities`` other than text, ``audio`` output, ``web_search_options``,
  ``logit_bias``, ``best_of`` > 1, ``suffix``, ``n`` > 1, ``logprobs``)
  are refused too, rather than answered as if absent; so is ``stream_options`` without ``stream: true``
  (OpenAI's rule).
* Thinking: ``enable_thinking`` is read from the top level or from ``chat_template_kwargs`` (vLLM / SGLang
  spelling); ``return_reasoning`` asks for the ``<think>...</think>`` part in ``reasoning_content``, apart
  from ``content`` (the AutoGLM / GLM-4.1V-Thinking serving convention).
* :class:`ThinkingSplitter` and :class:`StopMatcher` work on a stream of text deltas whose boundaries may
  fall anywhere, including inside a tag or a stop string: they hold back only the text that could still
  be the start of one.
* :func:`chat_chunk`, :func:`chat_response`, :func:`completion_chunk`, :func:`completion_response`,
  :func:`sse` and :data:`SSE_DONE` format the wire shapes of the Chat Completions / Completions APIs.

References: OpenAI API reference (chat/completions, completions, streaming); vLLM's reasoning parsers
(``reasoning_content``); GLM-4.1V-Thinking model card (``<think>``/``<answer>`` output format).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .messages import MAX_SEED

ROLES = ("system", "developer", "user", "assistant", "tool")
# apply_chat_template's own parameters: as chat_template_kwargs they would clash with the call (a TypeError) or
# replace the server's template with the client's (chat_template: arbitrary Jinja rendered here, a denial of service)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "self", "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


# vLLM's request extensions that change the answer (schema-constrained output, other sampling and stopping rules,
# the tokens allowed or banned, a prompt rendered or cut otherwise - continue_final_message's assistant prefix was
# answered as a new turn): refused, as OpenAI's unsupported fields are; the value that asks for nothing passes.
VLLM_EXTRAS = {"guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
               "structured_outputs": None, "structural_tag": None, "min_p": 0, "min_tokens": 0, "stop_token_ids": [],
               "ignore_eos": False, "use_beam_search": False, "include_stop_str_in_output": False,
               "prompt_logprobs": None, "allowed_token_ids": None, "bad_words": [], "logits_processors": None,
               "continue_final_message": False, "add_generation_prompt": True, "chat_template": None,
               "documents": None, "truncate_prompt_tokens": None}


INVALID_REQUEST = "invalid_request_error"
# A prompt that does not fit - the context (the engine's too_long, the wire's context_full) or the prompt limit
# (prompt_too_long) - has one code over HTTP, OpenAI's, which clients test (the openai client's
# BadRequestError.code) to shorten the conversation and retry; the rest keep theirs.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
_OPENAI_CODES = dict.fromkeys(("too_long", "context_full", "prompt_too_long"), CONTEXT_LENGTH_EXCEEDED)


class OpenAIRequestError(Exception):
    """An answer in OpenAI's error shape (:meth:`to_dict`) with HTTP ``status``: 400 for a request refused
    (``param`` names the offending field), or the status the caller gives (401, 503, ...). ``code`` is the
    engine's or the wire's, or OpenAI's (a prompt over the context is ``context_length_exceeded`` whatever
    refused it). ``retry_after_s``: for a 503, the server's own wait before another try (None: the default),
    which the answer's ``Retry-After`` carries (:func:`shared.http_limits.retry_after`)."""

    def __init__(self, message: str, param: str | None = None, code: str = INVALID_REQUEST,
                 status: int = 400, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = _OPENAI_CODES.get(code, code)
        self.status = status
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, Any]:
        err_type = INVALID_REQUEST if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": err_type, "param": self.param, "code": self.code}}


# --------------------------------------------------------------------------------------------
# requests


MAX_STOPS = 16


def stop_problem(stops: list[str]) -> str | None:
    """What is wrong with a request's stop strings (checked strings), or None: every path's one rule (the OpenAI
    routes and ``EdgeClient.generate``). An empty one would end every answer before its first character; one with a
    UTF-16 surrogate (``"\\ud800"``, or a pair's halves as two characters) is no text, so no answer's text holds it:
    the stop never matched and the answer ran to ``max_tokens`` (the OpenAI routes refuse it in the body already)."""
    if len(stops) > MAX_STOPS or not all(stops):
        return f"stop: at most {MAX_STOPS} non-empty strings"
    for s in stops:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            return "stop: a string with a lone UTF-16 surrogate (\\uD800-\\uDFFF), which is not text"
    return None


@dataclass(slots=True)
class SamplingOptions:
    """The sampling fields common to both endpoints (OpenAI names; ``top_k`` and ``seed`` as vLLM spells them)."""

    max_tokens: int | None = None  # None: the server's limit; >= 1 (_sampling checks it, naming the field sent)
    max_tokens_param: str = "max_tokens"  # the field it came in: max_tokens or max_completion_tokens (errors name it)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0  # OpenAI's, over generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension (HF semantics)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def __post_init__(self):
        if not 0.0 <= self.temperature <= 2.0:
            raise OpenAIRequestError("temperature must be in [0, 2]", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise OpenAIRequestError("top_p must be in (0, 1]", "top_p")
        if self.top_k < 0:
            raise OpenAIRequestError("top_k must be >= 0 (0 disables it)", "top_k")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise OpenAIRequestError(f"seed must be in [0, {MAX_SEED}]", "seed")
        if (problem := stop_problem(self.stop)) is not None:
            raise OpenAIRequestError(problem, "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise OpenAIRequestError(f"{name} must be in [-2, 2]", name)
        if not 1e-3 <= self.repetition_penalty <= 10.0:  # the split protocol's range
            raise OpenAIRequestError("repetition_penalty must be in [0.001, 10]", "repetition_penalty")


@dataclass(slots=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]  # each {"role": ..., "content": str}; content parts flattened to text
    sampling: SamplingOptions
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: one last chunk with usage, no choices
    enable_thinking: bool | None = None  # None: the chat template's default
    return_reasoning: bool = False  # reasoning in `reasoning_content`, not in `content`
    precision: str | None = None  # extension: client override of the wire codec ("fp16", "int8-b32", ...)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # the field the prompt comes in: OpenAI's ``param`` of an error about the prompt (context_length_exceeded)
    prompt_param: ClassVar[str] = "messages"

    def template_kwargs(self) -> dict[str, Any]:
        kw = dict(self.chat_template_kwargs)
        if self.enable_thinking is not None:
            kw["enable_thinking"] = self.enable_thinking
        return kw


@dataclass(slots=True)
class CompletionRequest:
    model: str
    prompt: str
    sampling: SamplingOptions
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    precision: str | None = None
    prompt_ids: list[int] | None = None  # a prompt given as token ids (``prompt`` is then "")
    prompt_param: ClassVar[str] = "prompt"  # as ChatRequest's


def _get(body: dict, name: str, types: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int subclass: refuse True where a number is expected, and 1 where a bool is.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise OpenAIRequestError(f"{name}: expected {_type_name(types)}, got a boolean", name)
    if not isinstance(value, types):
        raise OpenAIRequestError(f"{name}: expected {_type_name(types)}, got {type(value).__name__}", name)
    return value


def _type_name(types: type | tuple[type, ...]) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join({"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
                        "list": "an array", "dict": "an object"}.get(t.__name__, t.__name__) for t in types)


def _number(body: dict, name: str, default: float) -> float:
    """A float field; an integer too large for a float (JSON allows any digits) reads as +-inf, which the range
    checks then refuse by name (``float()`` would raise OverflowError: a 500)."""
    value = _get(body, name, (int, float), default)
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


MAX_TEMPLATE_KWARGS_DEPTH = 16  # nesting of a chat_template_kwargs value: deeper overflows the template's own
# recursive conversion of its variables (a RecursionError: a 500), and no template reads deeper
MAX_TEMPLATE_KWARGS_ITEMS = 256  # a chat_template_kwargs' keys and values, nested ones counted: a template reads a
# few flags (enable_thinking, a budget, a list of names); 900,000 keys (12 MB of body) cost the phone 7 s of CPU and
# 570 MB of memory, each variable copied into every render


def template_kwargs_problem(kwargs: dict[str, Any]) -> str | None:
    """What is wrong with a request's chat template variables, or None: every path's one rule (the OpenAI routes,
    both servers', and ``EdgeClient``'s ``chat_template_kwargs=``), checked before any render: none of the template
    call's own arguments (:data:`RESERVED_TEMPLATE_KWARGS`), at most :data:`MAX_TEMPLATE_KWARGS_DEPTH` levels of
    arrays/objects and :data:`MAX_TEMPLATE_KWARGS_ITEMS` keys and values in all (the walk stops past either bound,
    so a huge value costs no more than a refused one)."""
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        return f"chat_template_kwargs: {', '.join(reserved)} may not be set (the chat template call's own arguments)"
    level, items, todo = 0, 0, [kwargs]
    while todo:
        level, nxt = level + 1, []
        for v in todo:
            for x in (v.values() if isinstance(v, dict) else v):
                items += 1 + isinstance(v, dict)  # an object's entry: its key and its value
                if items > MAX_TEMPLATE_KWARGS_ITEMS:
                    return (f"chat_template_kwargs: more than {MAX_TEMPLATE_KWARGS_ITEMS} keys and values "
                            "(a chat template reads a few variables)")
                if isinstance(x, (list, dict)):
                    nxt.append(x)
        if nxt and level >= MAX_TEMPLATE_KWARGS_DEPTH:
            return f"chat_template_kwargs: nested deeper than {MAX_TEMPLATE_KWARGS_DEPTH} levels"
        todo = nxt
    return None


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """A 400 naming the field for a feature this server does not offer, where dropping it would change what the
    client gets back (a plain-text answer to a tool or JSON-mode request, unbiased sampling, one candidate of
    ``best_of``): OpenAI clients were answered as if they had not asked. Values that ask for nothing pass
    (``tools: []``, ``tool_choice: "none"``, ``response_format: {"type": "text"}``, ``logit_bias: {}``, ``best_of: 1``)."""
    def present(name: str) -> bool:
        return body.get(name) not in (None, [], {}, "")

    tool_choice = body.get("tool_choice")
    if chat and present("tools") and tool_choice != "none":
        raise OpenAIRequestError("tools: tool calling is not supported by this server (send no tools, or "
                                 "tool_choice 'none')", "tools")
    if chat and tool_choice not in (None, "none", "auto"):
        raise OpenAIRequestError("tool_choice: tool calling is not supported by this server", "tool_choice")
    if chat and (present("functions") or body.get("function_call") not in (None, "none", "auto")):
        name = "functions" if present("functions") else "function_call"
        raise OpenAIRequestError(f"{name}: function calling is not supported by this server", name)
    fmt = body.get("response_format")
    # both routes: vLLM's /v1/completions takes it too (JSON mode / a schema), answered unconstrained before
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type", "text") == "text"):
        raise OpenAIRequestError("response_format: only {'type': 'text'} is supported by this server (no JSON "
                                 "mode or schema-constrained output)", "response_format")
    modalities = body.get("modalities")
    if chat and modalities is not None and modalities != ["text"]:
        raise OpenAIRequestError("modalities: only [\"text\"] is supported by this server (no audio output)",
                                 "modalities")
    if chat and present("audio"):
        raise OpenAIRequestError("audio: not supported by this server (no audio output)", "audio")
    if chat and body.get("web_search_options") is not None:  # {} asks for a search with the defaults
        raise OpenAIRequestError("web_search_options: not supported by this server (no web search)",
                                 "web_search_options")
    if present("logit_bias"):
        raise OpenAIRequestError("logit_bias: not supported by this server", "logit_bias")
    if not chat and body.get("best_of") not in (None, 1):
        raise OpenAIRequestError("best_of: only best_of=1 is supported", "best_of")
    if not chat and present("suffix"):
        raise OpenAIRequestError("suffix: not supported by this server (no fill-in-the-middle)", "suffix")
    for name, neutral in VLLM_EXTRAS.items():  # vLLM clients send them in extra_body; they were silently dropped
        if body.get(name) not in (None, neutral):
            raise OpenAIRequestError(f"{name}: not supported by this server (vLLM's extension; this server "
                                     "offers only its top_k and repetition_penalty)", name)


def _sampling(body: dict, chat: bool) -> SamplingOptions:
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"  # it wins
    max_tokens = _get(body, max_name, int, None)
    if max_tokens is not None and max_tokens < 1:  # named as sent (the openai client sends max_completion_tokens)
        raise OpenAIRequestError(f"{max_name} must be >= 1", max_name)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise OpenAIRequestError("stop: expected a string or an array of strings", "stop")
    n = _get(body, "n", int, 1)
    if n != 1:
        raise OpenAIRequestError("n: only n=1 is supported", "n")
    for name in ("logprobs", "top_logprobs"):  # answered as null before: refused rather than silently dropped
        value = body.get(name)
        # chat's logprobs is a boolean; the completions API's is a count of alternatives, where 0 still asks for
        # the sampled token's own log-probability (it was answered as null)
        if not (value is None or value is False or (value == 0 and (chat or name == "top_logprobs"))):
            raise OpenAIRequestError(f"{name}: not supported by this server", name)
    return SamplingOptions(
        max_tokens=max_tokens,
        max_tokens_param=max_name,
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=max(0, _get(body, "top_k", int, 0)),  # vLLM uses -1 for "off"
        seed=_get(body, "seed", int, None),
        stop=stops,
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
    )


MEDIA_PARTS = ("image_url", "input_audio")  # content parts a media-capable backend takes (accepts_media)


def _flatten_content(content: Any, where: str, media: bool = False) -> str | list[dict[str, Any]]:
    """A message's content as text; with ``media``, a list holding image/audio parts is kept as parts (the
    backend places them: edge_client.media)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or "type" not in part:
                raise OpenAIRequestError(f"{where}.content[{i}]: expected an object with a 'type'", "messages")
        keep = media and any(part["type"] in MEDIA_PARTS for part in content)
        for i, part in enumerate(content):
            if keep and part["type"] != "text":  # the backend checks its media parts
                continue
            if part["type"] != "text":  # the edge's local API takes media too: it is no text-only endpoint
                accepted = "accepted: " + ", ".join(("text",) + MEDIA_PARTS) if media else "text only"
                raise OpenAIRequestError(f"{where}.content[{i}]: part type {part['type']!r} is not supported "
                                         f"by this endpoint ({accepted})", "messages")
            if not isinstance(part.get("text"), str):  # beside an image too (it was rendered as 'None')
                raise OpenAIRequestError(f"{where}.content[{i}].text: expected a string", "messages")
            texts.append(part["text"])
        return list(content) if keep else "".join(texts)
    raise OpenAIRequestError(f"{where}.content: expected a string or an array of parts", "messages")


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", bool, False)
    opts = _get(body, "stream_options", dict, None)
    if opts is not None and not stream:  # OpenAI's 400 too: it was silently ignored
        raise OpenAIRequestError("stream_options: only allowed when stream is true", "stream_options")
    opts = opts or {}
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise OpenAIRequestError("stream_options.include_usage: expected a boolean", "stream_options")
    return stream, include_usage and stream


def parse_chat_request(body: Any, media: bool = False) -> ChatRequest:
    """Validate a decoded ``/v1/chat/completions`` body (see the module docstring); ``media``: keep
    ``image_url`` / ``input_audio`` parts (the message's content stays a list of parts)."""
    if not isinstance(body, dict):
        raise OpenAIRequestError("request body must be a JSON object")
    model = _get(body, "model", str, "")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIRequestError("messages: expected a non-empty array", "messages")
    parsed = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise OpenAIRequestError(f"{where}: expected an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise OpenAIRequestError(f"{where}.role: {role!r} is not one of {', '.join(ROLES)}", "messages")
        content = m.get("content")
        if content is None:  # OpenAI's 400 too; it was read as empty text (no prompt at all: the model babbled)
            if not (role == "assistant" and m.get("tool_calls")):
                raise OpenAIRequestError(f"{where}.content: {'null' if 'content' in m else 'missing'}; expected a "
                                         "string or an array of parts (null only in an assistant turn with "
                                         "tool_calls)", "messages")
            content = ""  # an earlier tool-calling turn of the history: its text is empty (tool_calls not rendered)
        # developer: OpenAI's newer name for the system prompt (its clients send their instructions so); the chat
        # templates served here know no such role - SmolLM2's rendered it after its own default system prompt,
        # GLM's drops a role it does not know - so it is rendered as the system turn it is
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _flatten_content(content, where, media)}
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        parsed.append(msg)
    kwargs = _get(body, "chat_template_kwargs", dict, {}) or {}
    thinking = _get(body, "enable_thinking", bool, None)
    if thinking is None and "enable_thinking" in kwargs:
        if not isinstance(kwargs["enable_thinking"], bool):
            raise OpenAIRequestError("chat_template_kwargs.enable_thinking: expected a boolean",
                                     "chat_template_kwargs")
        thinking = kwargs["enable_thinking"]
    kwargs = {k: v for k, v in kwargs.items() if k != "enable_thinking"}
    if (problem := template_kwargs_problem(kwargs)) is not None:
        raise OpenAIRequestError(problem, "chat_template_kwargs")
    _refuse_unsupported(body, chat=True)
    stream, include_usage = _stream_flags(body)
    return ChatRequest(
        model=model, messages=parsed, sampling=_sampling(body, chat=True), stream=stream, include_usage=include_usage,
        enable_thinking=thinking, return_reasoning=_get(body, "return_reasoning", bool, False),
        precision=_get(body, "precision", str, None), chat_template_kwargs=kwargs,
    )


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a decoded ``/v1/completions`` body; the prompt is one string or one array of token ids (either
    may come as a batch of one, as the openai client sends them); a batch of several is refused."""
    if not isinstance(body, dict):
        raise OpenAIRequestError("request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    ids = None
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        ids, prompt = prompt, ""
        if min(ids) < 0 or max(ids) >= 1 << 31:
            raise OpenAIRequestError("prompt: token ids must be in [0, 2^31)", "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise OpenAIRequestError(f"prompt: a batch of {len(prompt)} prompts is not supported (one per request)",
                                 "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise OpenAIRequestError("prompt: expected a non-empty string or array of token ids", "prompt")
    _refuse_unsupported(body, chat=False)
    echo = _get(body, "echo", bool, False)
    if echo and ids is not None:
        raise OpenAIRequestError("echo: not supported with a prompt of token ids", "echo")
    stream, include_usage = _stream_flags(body)
    return CompletionRequest(model=_get(body, "model", str, ""), prompt=prompt, sampling=_sampling(body, chat=False),
                             stream=stream, include_usage=include_usage, echo=echo,
                             precision=_get(body, "precision", str, None), prompt_ids=ids)


# --------------------------------------------------------------------------------------------
# streaming text filters


def _held_suffix(text: str, patterns: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``patterns``."""
    best = 0
    for p in patterns:
        for k in range(min(len(p) - 1, len(text)), best, -1):
            if text.endswith(p[:k]):
                best = k
                break
    return best


class ThinkingSplitter:
    """Split streamed model text into ``("reasoning", text)`` and ``("content", text)`` pieces.

    Text between ``<think>`` and ``</think>`` is reasoning, the rest content; the tags themselves are
    dropped, as are GLM-4.1V's ``<answer>``/``</answer>`` markers when ``strip_answer_tags``. Use
    ``in_thinking=True`` when the prompt already opened the think block (templates that end the generation
    prompt with ``<think>``).
    """

    def __init__(self, in_thinking: bool = False, open_tag: str = "<think>", close_tag: str = "</think>",
                 strip_answer_tags: bool = True):
        if not open_tag or not close_tag:
            raise ValueError("thinking tags must be non-empty")
        self.in_thinking = in_thinking
        self.open_tag, self.close_tag = open_tag, close_tag
        self.answer_tags = ["<answer>", "</answer>"] if strip_answer_tags else []
        self._buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while True:
            kind = "reasoning" if self.in_thinking else "content"
            tags = [self.close_tag] if self.in_thinking else [self.open_tag, *self.answer_tags]
            hits = [(self._buf.find(t), t) for t in tags]
            hits = [(i, t) for i, t in hits if i >= 0]
            if not hits:
                keep = _held_suffix(self._buf, tags)
                emit, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                if emit:
                    out.append((kind, emit))
                return out
            i, tag = min(hits)
            if i:
                out.append((kind, self._buf[:i]))
            self._buf = self._buf[i + len(tag):]
            if tag == self.open_tag:
                self.in_thinking = True
            elif tag == self.close_tag:
                self.in_thinking = False

    def flush(self) -> list[tuple[str, str]]:
        """The held-back tail at the end of the stream (a partial tag is plain text after all)."""
        rest, self._buf = self._buf, ""
        return [("reasoning" if self.in_thinking else "content", rest)] if rest else []


class StopMatcher:
    """Find the first stop string in streamed text; hold back a tail that may start one.

    ``feed(text) -> (safe_text, stopped)``: ``safe_text`` may be emitted; once ``stopped`` is true the
    stream ends there (the stop string itself is not emitted, as in the OpenAI API).
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._buf = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        self._buf += text
        hits = [i for i in (self._buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self._buf = self._buf[: min(hits)], ""
            return out, True
        keep = _held_suffix(self._buf, self.stops)
        out, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return out, False

    def flush(self) -> str:
        rest, self._buf = ("" if self.stopped else self._buf), ""
        return rest

    def finish(self, text: str = "") -> str:
        """The stream's end: ``text`` (what a detokenizer still held) fed, then what was held back; what of both
        may be emitted."""
        return self.feed(text)[0] + self.flush()


# --------------------------------------------------------------------------------------------
# responses


def new_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI usage object; prefix-cache hits, if any, as ``prompt_tokens_details.cached_tokens``."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def _chunk(obj: str, rid: str, model: str, created: int, choice: dict[str, Any] | None,
           finish_reason: str | None, usage_obj: dict | None) -> dict[str, Any]:
    """One streamed chunk: ``choice`` (its content field) as choice 0, or, for ``choice=None``, the final
    usage-only chunk (no choices)."""
    chunk: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model}
    if choice is None:
        chunk["choices"] = []
        chunk["usage"] = usage_obj
    else:
        chunk["choices"] = [{"index": 0, **choice, "logprobs": None, "finish_reason": _finish(finish_reason)}]
    return chunk


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any] | None = None,
               finish_reason: str | None = None, usage_obj: dict | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``delta=None`` with ``usage_obj`` is the final usage-only chunk."""
    usage_only = delta is None and usage_obj is not None
    return _chunk("chat.completion.chunk", rid, model, created, None if usage_only else {"delta": delta or {}},
                  finish_reason, usage_obj)


def chat_response(rid: str, model: str, created: int, content: str, finish_reason: str,
                  usage_obj: dict, reasoning: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _finish(finish_reason)}],
            "usage": usage_obj}


def completion_chunk(rid: str, model: str, created: int, text: str | None,
                     finish_reason: str | None = None, usage_obj: dict | None = None,
                     token_ids: list[int] | None = None) -> dict[str, Any]:
    """One streamed ``text_completion``; ``token_ids`` (a model without a tokenizer): the choice's ids, vLLM's field."""
    usage_only = text is None and usage_obj is not None
    choice = {"text": text or ""} if token_ids is None else {"text": text or "", "token_ids": list(token_ids)}
    return _chunk("text_completion", rid, model, created, None if usage_only else choice, finish_reason, usage_obj)


def completion_response(rid: str, model: str, created: int, text: str, finish_reason: str,
                        usage_obj: dict, token_ids: list[int] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text}
    if token_ids is not None:  # a model without a tokenizer answers token ids (vLLM's field), its text empty
        choice["token_ids"] = list(token_ids)
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{**choice, "logprobs": None, "finish_reason": _finish(finish_reason)}],
            "usage": usage_obj}


def model_list(model_ids: list[str], owned_by: str = "autoglm-split") -> dict[str, Any]:
    now = int(time.time())
    return {"object": "list",
            "data": [{"id": m, "object": "model", "created": now, "owned_by": owned_by} for m in model_ids]}


def model_not_found(model_id: str) -> OpenAIRequestError:
    """The 404 of ``GET /v1/models/{model_id}`` for an id this server does not serve (OpenAI's code)."""
    return OpenAIRequestError(f"The model '{model_id}' does not exist (GET /v1/models lists the served ones)", "model",
                              "model_not_found", 404)


def _finish(reason: str | None) -> str | None:
    # The OpenAI enum has no "cancelled"/"error": a cut-short stream reports "stop" like vLLM does on abort.
    if reason is None or reason in ("stop", "length"):
        return reason
    return "stop"


# Characters JSON leaves raw in a string that line readers end a line at: the SSE spec ends a line at CR and LF only
# (which JSON escapes), but Python's str.splitlines also at NEL and the Unicode line and paragraph separators, and
# httpx's Response.iter_lines (httpx-sse's reader before 0.4.1, requests' iter_lines(decode_unicode=True)) splits so:
# an event whose text held one came to such a client as two lines, neither of them JSON.
_LINE_BREAKS_IN_JSON = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying ``obj`` as JSON, on one line for every line reader (CJK and the rest raw,
    :data:`_LINE_BREAKS_IN_JSON` escaped)."""
    data = json.dumps(obj, ensure_ascii=False, separators=(',', ':')).translate(_LINE_BREAKS_IN_JSON)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"
