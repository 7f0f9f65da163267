"""shared.openai_routes over a scripted backend: JSON and SSE shapes, the thinking split, echo, usage, one
set of error statuses, and that every started stream is closed (cancelled) whatever happens."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from shared import openai_compat as oc
from shared.openai_routes import GenerationError, install

SCRIPT = ["<think>I gr", "eet.</thi", "nk>Hel", "lo!"]


class ScriptedStream:
    def __init__(self, pieces: list[str], error: GenerationError | None):
        self.pieces, self.error = pieces, error
        self.finish_reason: str | None = None
        self.closed = False

    async def __aiter__(self):
        for p in self.pieces:
            yield p
        if self.error is not None:
            raise self.error
        self.finish_reason = "length"

    def usage(self):
        return oc.usage(3, len(self.pieces))

    async def aclose(self):
        self.closed = True


class ScriptedBackend:
    model_name = "scripted"

    def __init__(self):
        self.prompt_suffix = ""
        self.script = SCRIPT
        self.not_ready: oc.OpenAIRequestError | None = None
        self.error: GenerationError | None = None
        self.ids_only = False  # the script's pieces are lists of token ids (a model without a tokenizer)
        self.started: list[tuple[object, str, ScriptedStream]] = []

    def check_ready(self):
        self.loop = asyncio.get_running_loop()
        if self.not_ready is not None:
            raise self.not_ready

    def render_chat(self, req):
        if req.messages[-1]["content"] == "refuse":
            raise oc.OpenAIRequestError("the template refused", "messages")
        if req.messages[-1]["content"] == "needs the loop":  # a render that lasts until the event loop turns
            turned = threading.Event()
            self.loop.call_soon_threadsafe(turned.set)
            if not turned.wait(5):
                raise oc.OpenAIRequestError("the event loop stood still while the template rendered", "messages")
        return "PROMPT:" + req.messages[-1]["content"] + self.prompt_suffix

    def start(self, req, prompt, caller=None):
        stream = ScriptedStream(self.script, self.error)
        stream.ids_only = self.ids_only
        self.started.append((req, prompt, stream))
        return stream


@pytest.fixture
def api():
    backend = ScriptedBackend()
    app = FastAPI()
    install(app, backend)
    with TestClient(app) as client:
        yield client, backend


def _chat(**kw):
    return {"messages": [{"role": "user", "content": "hi"}], **kw}


def _events(client, path, body) -> list:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_chat_json_with_reasoning_split(api):
    client, backend = api
    r = client.post("/v1/chat/completions", json=_chat(return_reasoning=True, max_tokens=9))
    body = r.json()
    msg = body["choices"][0]["message"]
    assert r.status_code == 200 and body["object"] == "chat.completion" and body["model"] == "scripted"
    assert msg == {"role": "assistant", "content": "Hello!", "reasoning_content": "I greet."}
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 4
    req, prompt, stream = backend.started[-1]
    assert prompt == "PROMPT:hi" and req.sampling.max_tokens == 9 and stream.closed
    # without return_reasoning the text passes unchanged and there is no reasoning_content
    msg = client.post("/v1/chat/completions", json=_chat(model="m2")).json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "".join(SCRIPT)}


def test_a_prompt_that_opens_think_starts_in_reasoning(api):
    client, backend = api
    backend.prompt_suffix, backend.script = "<think>", ["I gr", "eet.</thi", "nk>Hel", "lo!"]
    msg = client.post("/v1/chat/completions", json=_chat(return_reasoning=True)).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "I greet." and msg["content"] == "Hello!"


def test_chat_stream_chunks_in_order(api):
    client, backend = api
    events = _events(client, "/v1/chat/completions",
                     _chat(return_reasoning=True, stream_options={"include_usage": True}))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [e["choices"][0]["delta"] for e in events[1:-2]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I greet."
    assert "".join(d.get("content", "") for d in deltas) == "Hello!"
    assert events[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 7
    assert all("usage" in e and e["usage"] is None for e in events[:-1])  # OpenAI's stream: null until the last
    assert {e["object"] for e in events} == {"chat.completion.chunk"} and len({e["id"] for e in events}) == 1
    plain = _events(client, "/v1/chat/completions", _chat())
    assert not any("usage" in e for e in plain)  # without include_usage: no usage field at all
    assert backend.started[-1][2].closed


def test_the_event_loop_turns_while_a_chat_template_renders(api):
    """Decoding, checking and rendering a body cost in proportion to it (a 32 MiB body of a million tiny messages
    held `autoglm-edge serve`'s event loop for 6 s, every running stream with it): they run on a worker thread."""
    client, backend = api
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "needs the loop"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "".join(SCRIPT)


def test_completions_json_and_stream_with_echo(api):
    client, backend = api
    body = client.post("/v1/completions", json={"prompt": "Once", "echo": True}).json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Once" + "".join(SCRIPT)
    assert backend.started[-1][1] == "Once"
    events = _events(client, "/v1/completions", {"prompt": "Once", "echo": True})
    assert [e["choices"][0]["text"] for e in events] == ["Once", *SCRIPT, ""]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and backend.started[-1][2].closed


def test_a_delta_holding_a_unicode_line_separator_stays_one_sse_line(api):
    """JSON leaves NEL (U+0085) and the Unicode line and paragraph separators (U+2028, U+2029) raw, and httpx's
    iter_lines (str.splitlines' rule) ends a line at each: an event whose text held one (an echoed prompt, a model's
    output) reached such a client as pieces of lines that are no JSON. They are escaped; CJK stays raw."""
    client, backend = api
    text = "上一行\u2028下一行\x85NEL\u2029段落 👨\u200d👩\u200d👧"
    backend.script = [text[:4], text[4:]]
    for path, body, field in (("/v1/completions", {"prompt": text, "echo": True}, "text"),
                              ("/v1/chat/completions", _chat(), "content")):
        events = _events(client, path, body)
        pieces = [e["choices"][0]["text"] if field == "text" else e["choices"][0]["delta"].get("content", "")
                  for e in events]
        assert "".join(pieces) == (text if field == "content" else text + text)
    raw = client.post("/v1/chat/completions", json=_chat(stream=True)).content.decode()
    assert "上一行" in raw and "\u2028" not in raw and "\\u2028" in raw


def test_a_stream_of_token_ids_is_answered_as_token_ids(api):
    """A stream with ids_only (full-model mode over a model without a tokenizer) yields token ids: the completion
    carries them as choices[].token_ids (vLLM's field) beside an empty text, whole and streamed."""
    client, backend = api
    backend.script, backend.ids_only = [[5, 6], [7]], True
    choice = client.post("/v1/completions", json={"prompt": [1, 2]}).json()["choices"][0]
    assert choice == {"index": 0, "text": "", "token_ids": [5, 6, 7], "logprobs": None, "finish_reason": "length"}
    events = _events(client, "/v1/completions", {"prompt": [1, 2], "stream_options": {"include_usage": True}})
    assert [(e["choices"][0]["text"], e["choices"][0]["token_ids"]) for e in events[:-1]] == [
        ("", [5, 6]), ("", [7]), ("", [])]
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1]["choices"] == []
    assert "token_ids" not in events[-1] and events[-1]["usage"]["completion_tokens"] == 2
    assert [e["usage"] for e in events[:-1]] == [None] * 3
    assert backend.started[-1][2].closed


@pytest.mark.parametrize("error, status", [
    (GenerationError("engine died", "engine_error"), 500),
    (GenerationError("cloud error bundle_mismatch", "bundle_mismatch", upstream=True), 502),
    (GenerationError("cloud error internal", "internal", upstream=True), 502),
    (GenerationError("no reply in time", "timeout", upstream=True), 504),
    (GenerationError("too busy", "overloaded", upstream=True), 503),
    (GenerationError("too long for the context", "context_full", upstream=True), 400),
    (GenerationError("over the prompt limit", "prompt_too_long"), 400),
])
def test_generation_errors_have_one_shape_and_status(api, error, status):
    """A prompt that does not fit is OpenAI's context_length_exceeded (the code clients test), whoever refused it."""
    client, backend = api
    backend.error = error
    code = "context_length_exceeded" if error.code in ("context_full", "prompt_too_long") else error.code
    for path, body in (("/v1/chat/completions", _chat()), ("/v1/completions", {"prompt": "x"})):
        r = client.post(path, json=body)
        err = r.json()["error"]
        assert r.status_code == status and set(err) == {"message", "type", "param", "code"}
        assert err["code"] == code and err["message"] == error.message
        assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
        assert backend.started[-1][2].closed and (r.headers.get("retry-after") == "1") == (status == 503)
        # streamed: the text so far, then the same error body as an event, then [DONE]
        events = _events(client, path, body)
        assert events[-1] == r.json() and backend.started[-1][2].closed


@pytest.mark.parametrize("wait_s, header", [(None, "1"), (0.0, "1"), (0.2, "1"), (1.0, "1"), (2.5, "3"), (30.0, "30")])
def test_a_503s_retry_after_is_the_wait_the_peer_asked_for_in_whole_seconds_rounded_up(api, wait_s, header):
    """A refusal for load carries the wait its peer asked for (the edge's cloud: ``retry_after_ms``); its
    ``Retry-After`` is that wait in whole seconds (HTTP's delay-seconds), rounded up - a client never comes back
    sooner than asked - and at least 1. It was 1 whatever the peer asked."""
    client, backend = api
    backend.script = []  # refused before a first delta: a stream has the status too
    backend.error = GenerationError("too busy", "overloaded", upstream=True, retry_after_s=wait_s)
    for path, body in (("/v1/chat/completions", _chat()), ("/v1/completions", {"prompt": "x", "stream": True})):
        r = client.post(path, json=body)
        assert (r.status_code, r.headers["retry-after"]) == (503, header)


def test_refusals_before_any_generation(api):
    client, backend = api
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json=_chat(temperature=7))
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "refuse"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    backend.not_ready = oc.OpenAIRequestError("server is draining", None, "draining", 503)
    r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    assert r.headers["retry-after"] == "1"  # the openai client waits that long before its retry (it had no hint)
    assert backend.started == []  # nothing was started, so nothing needs closing


_DEEP = "[" * 900 + "]" * 900  # parses (under json's recursion limit), but no template variable is that deep
BAD_JSON_TEXT = {  # name -> (path, raw body, param); each was a 500 with a traceback
    "temperature of 400 digits": ("/v1/completions", '{"prompt": "a", "temperature": %s}' % ("9" * 400), "temperature"),
    "top_p of 400 digits": ("/v1/completions", '{"prompt": "a", "top_p": -%s}' % ("9" * 400), "top_p"),
    "penalty of 400 digits": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], '
                              '"repetition_penalty": %s}' % ("9" * 400), "repetition_penalty"),
    "an integer of 5000 digits": ("/v1/completions", '{"prompt": "a", "max_tokens": %s}' % ("9" * 5000), None),
    "a lone surrogate in the prompt": ("/v1/completions", '{"prompt": "a\\ud800"}', None),
    "a lone surrogate in the model": ("/v1/chat/completions", '{"model": "\\udfff", "messages": '
                                      '[{"role": "user", "content": "a"}]}', None),
    "chat_template_kwargs 900 deep": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], '
                                      '"chat_template_kwargs": {"x": ' + _DEEP + "}}", "chat_template_kwargs"),
    # raw bytes: json.loads took a surrogate's (invalid UTF-8: a 500 echoing the model) and missed a UTF-16 escape
    "a surrogate's bytes in the model": ("/v1/chat/completions", b'{"model": "\xed\xa0\x80", "messages": '
                                         b'[{"role": "user", "content": "a"}]}', None),
    "a surrogate's bytes in the prompt": ("/v1/completions", b'{"prompt": "a\xed\xbf\xbf"}', None),
    "a lone surrogate in a UTF-16 body": ("/v1/completions", '{"prompt": "a\\ud800"}'.encode("utf-16"), None),
}


@pytest.mark.parametrize("name", BAD_JSON_TEXT)
def test_json_the_server_cannot_take_is_a_400_naming_its_field(api, name):
    client, backend = api
    path, raw, param = BAD_JSON_TEXT[name]
    r = client.post(path, content=raw if isinstance(raw, bytes) else raw.encode(),
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    assert backend.started == []
    # a surrogate pair is one character, and template variables a few levels deep are fine
    ok = client.post("/v1/chat/completions", content=b'{"model": "\\ud83d\\ude00", "messages": [{"role": "user", '
                     b'"content": "a"}], "chat_template_kwargs": {"x": [[{"y": 1}]]}}',
                     headers={"content-type": "application/json"})
    assert ok.status_code == 200 and ok.json()["model"] == "\U0001f600"


@pytest.mark.parametrize("content_type", ["text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None, "application/jsonp"])
def test_a_body_that_is_not_application_json_is_a_415_not_parsed(api, content_type):
    """A body of any Content-Type, or none, was parsed as JSON: what a web page may send to another site without a
    CORS preflight (text/plain, a form, a Blob without a type) ran a generation on both servers. Only
    application/json (any parameters) is read as JSON; the rest is a 415 before the body is read."""
    client, backend = api
    body = json.dumps(_chat()).encode()
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": content_type} if content_type
                    else {})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
    assert "accept-encoding" not in r.headers  # a compressed body's 415 names the codings taken
    gz = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json",
                                                                    "content-encoding": "gzip"})
    assert gz.status_code == 415 and gz.headers["accept-encoding"] == "identity"
    assert backend.started == []
    ok = client.post("/v1/chat/completions", content=body, headers={"content-type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("limit", [None, 1 << 20])
def test_a_client_gone_mid_body_is_answered_not_raised(limit):
    """A client that sends part of its body and disconnects: starlette's ClientDisconnect escaped the route (an
    "Exception in ASGI application" traceback in the server's log for every such client)."""
    import asyncio

    backend = ScriptedBackend()
    app = FastAPI()
    install(app, backend, max_body_bytes=limit)
    events = iter([{"type": "http.request", "body": b'{"prompt": "a', "more_body": True}, {"type": "http.disconnect"}])
    sent = []

    async def receive():
        return next(events, {"type": "http.disconnect"})

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400
    assert backend.started == []



def test_a_client_gone_before_a_whole_answer_cancels_its_generation():
    """A non-streamed request whose client goes away (the openai client's timeout, which it then retries) ran its
    generation to the end; each retry added one more. It is now cancelled, as a dropped stream is."""
    import asyncio

    class Endless(ScriptedStream):
        async def __aiter__(self):
            yield "a"
            await asyncio.Event().wait()  # a long generation
            yield "never"

    class Backend(ScriptedBackend):
        def start(self, req, prompt, caller=None):
            stream = Endless([], None)
            self.started.append((req, prompt, stream))
            return stream

    backend = Backend()
    app = FastAPI()
    install(app, backend)
    body = b'{"prompt": "a", "max_tokens": 400}'
    sent = []

    async def run():
        first = True

        async def receive():
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(0.05)  # the client waits a little, then gives up
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"),
                                              (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await asyncio.wait_for(app(scope, receive, send), 5)

    asyncio.run(run())
    assert backend.started and backend.started[-1][2].closed  # closed: the backend cancels the generation
    assert sent[0]["status"] == 400


def test_a_failure_of_the_server_itself_is_an_openai_500_not_plain_text(api):
    """A bug in the backend (before the stream, while it runs, mid-SSE) is a 500 / an error event in OpenAI's
    shape: starlette answered a plain-text "Internal Server Error" (a TypeError in the edge's template render was
    one) that no OpenAI client parses as an error body."""
    client, backend = api
    backend.render_chat = lambda req: 1 / 0
    r = client.post("/v1/chat/completions", json=_chat())
    assert r.status_code == 500 and r.json()["error"] == {"message": "internal error: ZeroDivisionError",
                                                          "type": "server_error", "param": None, "code": "internal"}
    backend.error = RuntimeError("boom")
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal" and backend.started[-1][2].closed
    events = _events(client, "/v1/completions", {"prompt": "x"})
    assert events[-1]["error"]["code"] == "internal" and backend.started[-1][2].closed
