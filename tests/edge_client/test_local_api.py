"""edge_client.local_api: the official openai client and langchain_openai.ChatOpenAI against the local
endpoint. The split runtime is replaced by a scripted client here (the real one is covered end to end in
test_end_to_end.py); what is tested is the HTTP/SSE surface: streaming, usage, stop, thinking, errors."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from local_server import local_server

from edge_client.errors import EdgeClientError
from edge_client.local_api import create_app
from edge_client.request import RequestSpec
from edge_client.tokenizer import ByteTokenizer
from shared.http_browsers import BrowserPolicy

SLOW_PROMPT = "a prompt that takes long to tokenize"
SCRIPT = ["<thi", "nk>I should gr", "eet.</th", "ink>Hel", "lo the", "re! STOP here", " and more"]


class _ScriptedGeneration:
    def __init__(self, owner, prompt: str, kw: dict):
        self.owner, self.prompt, self.kw = owner, prompt, kw
        self.stats = SimpleNamespace(prompt_tokens=len(prompt), completion_tokens=0, cached_tokens=3)
        self.finish_reason = None
        self._i = 0
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.owner.fail:
            raise EdgeClientError("cloud error bundle_mismatch: bundle ids differ", "bundle_mismatch")
        pieces = SCRIPT[: self.kw["max_tokens"]]
        if self._i >= len(pieces):
            self.finish_reason = "length" if self.kw["max_tokens"] < len(SCRIPT) else "stop"
            raise StopAsyncIteration
        piece = pieces[self._i]
        self._i += 1
        for s in self.kw["stop"]:  # what EdgeClient does with stop strings
            if s in piece:
                self.finish_reason = "stop"
                self._i = len(pieces)
                piece = piece[: piece.index(s)]
        self.stats.completion_tokens += 1
        await asyncio.sleep(0)
        return piece

    async def aclose(self):
        self.closed = True


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class _ScriptedClient:
    def __init__(self):
        self.manifest = SimpleNamespace(bundle_id="0123456789abcdef")
        self.tokenizer = ByteTokenizer(512, [2])
        self.connected = True
        self.calls: list[_ScriptedGeneration] = []
        self.fail = False
        self.slow_on_loop: list[bool] = []  # per SLOW_PROMPT: tokenized on the server's event loop?

    def agenerate(self, prompt=None, prompt_ids=None, messages=None, chat_template_kwargs=None, **kw):
        if messages is not None:  # what EdgeClient does with a chat: its tokenizer renders the messages
            prompt = self.tokenizer.render_chat(messages, **(chat_template_kwargs or {}))
        if prompt_ids is not None:  # what EdgeClient does with ids outside the vocabulary
            if max(prompt_ids) >= self.tokenizer.vocab_size:
                raise ValueError("prompt_ids: token id out of range")
            prompt = prompt_ids
        elif not prompt.strip():  # what EdgeClient does with a prompt that tokenizes to nothing
            raise ValueError("empty prompt")
        elif prompt == SLOW_PROMPT:  # EdgeClient tokenizes here: 0.5 s for SmolLM2's longest prompt
            self.slow_on_loop.append(_on_event_loop())
        RequestSpec(prompt_ids=[1], **{k: kw[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "seed",
                                                           "stop")})  # and with its sampling arguments
        g = _ScriptedGeneration(self, prompt, kw)
        self.calls.append(g)
        return g


@pytest.fixture(scope="module")
def server():
    client = _ScriptedClient()
    with local_server(create_app(client, model_name="split-test")) as url:
        yield SimpleNamespace(url=url, client=client)


def test_the_local_api_key_is_a_bearer_token_in_any_case_and_a_non_ascii_guess_is_a_401():
    """--local-api-key: the scheme's case does not matter (RFC 9110); a key with a non-ASCII byte was a 500
    (hmac.compare_digest refuses non-ASCII str) instead of a 401."""
    with local_server(create_app(_ScriptedClient(), api_key="local-secret")) as url:
        def status(header):
            return httpx.get(url + "/v1/models", headers={"Authorization": header}).status_code

        assert status("Bearer local-secret") == status("bearer local-secret") == 200
        assert status("Bearer wrong") == status("Basic local-secret") == 401
        assert status("Bearer café".encode()) == 401
        assert httpx.get(url + "/v1/models").status_code == 401


def test_models_and_health(server):
    r = httpx.get(f"{server.url}/v1/models")
    assert r.json()["data"][0]["id"] == "split-test"
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_openai_client_models_retrieve(server):
    """GET /v1/models/{id} (the openai client's models.retrieve) was a 404 for the served id too."""
    import openai

    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)
    assert oa.models.retrieve("split-test").id == "split-test"
    with pytest.raises(openai.NotFoundError) as ei:
        oa.models.retrieve("no-such-model")
    assert ei.value.body["code"] == "model_not_found" and ei.value.body["param"] == "model"


def test_openai_client_non_streaming_with_reasoning(server):
    import openai

    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY")
    r = oa.chat.completions.create(model="split-test", messages=[{"role": "user", "content": "hi"}],
                                   extra_body={"enable_thinking": True, "return_reasoning": True})
    msg = r.choices[0].message
    assert msg.content == "Hello there! STOP here and more"
    assert msg.model_extra["reasoning_content"] == "I should greet."
    assert r.usage.completion_tokens == len(SCRIPT) and r.usage.prompt_tokens_details.cached_tokens == 3
    assert r.choices[0].finish_reason == "stop"
    # the thinking flag reached the chat template call (ByteTokenizer ignores it, but it was passed)
    assert server.client.calls[-1].prompt.endswith("<|assistant|>\n")


def test_openai_client_streaming_stop_and_usage(server):
    import openai

    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY")
    stream = oa.chat.completions.create(model="split-test", messages=[{"role": "user", "content": "hi"}],
                                        stream=True, stop=["STOP"], stream_options={"include_usage": True})
    content, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                content.append(c.delta.content)
            finish = c.finish_reason or finish
    # without return_reasoning the text is passed through unchanged, tags included
    assert "".join(content) == "<think>I should greet.</think>Hello there! "
    assert finish == "stop" and usage is not None and usage.completion_tokens == 6
    assert server.client.calls[-1].kw["stop"] == ["STOP"]


def test_langchain_chat_openai_streaming(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="split-test", base_url=f"{server.url}/v1", api_key="EMPTY", streaming=True,
                     extra_body={"enable_thinking": True, "return_reasoning": True}, max_tokens=5)
    chunks = list(llm.stream("hello"))
    text = "".join(c.content for c in chunks)
    assert text == "Hello the"  # 5 scripted pieces, reasoning kept out of content
    assert server.client.calls[-1].kw["max_tokens"] == 5
    assert llm.invoke("hello").content == "Hello the"


def test_completions_endpoint(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "Once", "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "<think>I should gr" and r.json()["choices"][0]["finish_reason"] == "length"


def test_completions_of_token_ids(server):
    """A prompt of token ids (the openai client's completions.create(prompt=[ids])) was a 400 "expected a
    non-empty string"; it now reaches EdgeClient as prompt_ids, and ids outside the vocabulary are a 400."""
    import openai

    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)
    r = oa.completions.create(model="split-test", prompt=[72, 105], max_tokens=2)
    assert r.choices[0].text == "<think>I should gr" and server.client.calls[-1].prompt == [72, 105]
    with pytest.raises(openai.BadRequestError) as ei:
        oa.completions.create(model="split-test", prompt=[72, 100000], max_tokens=2)
    assert ei.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="batch of 2"):
        oa.completions.create(model="split-test", prompt=["a", "b"], max_tokens=2)


def test_bad_requests_get_openai_errors(server):
    import openai

    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)
    with pytest.raises(openai.BadRequestError) as ei:
        oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], temperature=5)
    assert "temperature" in str(ei.value)
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "   "})
    assert r.status_code == 400 and r.json()["error"] == {"message": "empty prompt", "type": "invalid_request_error",
                                                          "param": "prompt", "code": "invalid_request_error"}
    # a template variable named as the template call's own argument (`self` was a plain-text 500)
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                              "chat_template_kwargs": {"self": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_upstream_failure_is_a_clear_error(server):
    """Streamed too: a generation that fails before its first token has its status (the openai client raises it
    and retries a 5xx); it was a 200 with an error event, an APIError the client neither classified nor retried."""
    import openai

    server.client.fail = True
    try:
        oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)
        with pytest.raises(openai.APIStatusError) as ei:
            oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert ei.value.status_code == 502 and "bundle_mismatch" in str(ei.value)
        calls = len(server.client.calls)
        with pytest.raises(openai.APIStatusError) as ei:
            list(oa.with_options(max_retries=1).chat.completions.create(
                model="m", stream=True, messages=[{"role": "user", "content": "x"}]))
        assert ei.value.status_code == 502 and ei.value.code == "bundle_mismatch"
        assert len(server.client.calls) == calls + 2  # retried once, as a non-streamed request is
    finally:
        server.client.fail = False


def test_a_prompt_is_tokenized_off_the_event_loop(server):
    """start() ran EdgeClient.agenerate - tokenizing the prompt, 0.5 s for SmolLM2's longest - on the event loop:
    every open stream waited that long. Checked by where it runs, not by a latency (a loaded box stretches any
    bound): not in a thread running an event loop."""
    server.client.slow_on_loop.clear()
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": SLOW_PROMPT, "max_tokens": 1},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert server.client.slow_on_loop == [False]


def test_penalties_and_logprobs_are_refused_by_name_not_dropped(server):
    """The split path samples without penalties and returns no logprobs: a request asking for them gets a 400
    naming the field (it used to be answered as if they were not there); zero values are the defaults."""
    for field, value in (("frequency_penalty", 0.5), ("presence_penalty", -1.0), ("repetition_penalty", 1.2),
                         ("logprobs", True), ("top_logprobs", 3)):
        r = httpx.post(f"{server.url}/v1/chat/completions",
                       json={"model": "m", "messages": [{"role": "user", "content": "x"}], field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "Once", "max_tokens": 2,
                                                         "frequency_penalty": 0, "presence_penalty": 0.0})
    assert r.status_code == 200


def test_vllm_extensions_that_change_the_answer_are_refused_by_name(server):
    """A vLLM client's extra_body (guided_json, min_p, stop_token_ids, ...) was dropped without a word: free text for
    a schema, sampling and stopping other than asked. A 400 names the field; the neutral values pass."""
    for field, value in (("guided_json", {"type": "object"}), ("guided_choice", ["yes", "no"]), ("min_p", 0.1),
                         ("min_tokens", 5), ("stop_token_ids", [2]), ("ignore_eos", True)):
        r = httpx.post(f"{server.url}/v1/chat/completions",
                       json={"model": "m", "messages": [{"role": "user", "content": "x"}], field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "Once", "max_tokens": 2, "min_p": 0,
                                                         "stop_token_ids": [], "ignore_eos": False, "top_k": 5})
    assert r.status_code == 200


def test_values_the_wire_cannot_carry_and_unknown_routes_get_openai_errors(server):
    """max_tokens past 2^31 - 1 and top_k past 2^24 passed the OpenAI checks, then failed on the way to the cloud
    as an 'internal' 502 (with a traceback in the log); the router's 404 / 405 were FastAPI's {"detail": ...}."""
    for field, value in (("max_tokens", 2**31), ("max_tokens", 10**30), ("top_k", 2**24 + 1), ("top_p", 1e-12)):
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "Once", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "Once", "max_tokens": 2,
                                                         "top_k": 2**24})
    assert r.status_code == 200
    r = httpx.get(f"{server.url}/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.get(f"{server.url}/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_get_routes_answer_head(server):
    """HEAD /health (``curl -I``, an uptime monitor's probe) and HEAD /v1/models were 405s: FastAPI's ``get`` takes
    GET alone, where RFC 9110 asks a server to answer HEAD wherever it answers GET."""
    for path in ("/health", "/v1/models", "/v1/models/split-test", "/v1/models/nope"):
        got, head = httpx.get(server.url + path), httpx.head(server.url + path)
        assert (head.status_code, head.content) == (got.status_code, b""), (path, head.status_code)
        assert head.headers["content-length"] == str(len(got.content)), path
    assert httpx.head(f"{server.url}/v1/completions").status_code == 405  # a POST route takes no HEAD


def test_routes_outside_the_api_are_404s_without_or_with_a_key():
    """/openapi.json, a route outside the documented API, answered 200 with the app's schema - without the
    --local-api-key too (the key guards /v1/ only); the cloud serves none. Now a 404 in OpenAI's shape."""
    client = _ScriptedClient()
    with local_server(create_app(client, model_name="m", api_key="sk-local")) as url:
        for headers in ({}, {"Authorization": "Bearer sk-local"}):
            r = httpx.get(f"{url}/openapi.json", headers=headers)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text[:80]


def test_a_web_page_in_the_devices_browser_cannot_drive_the_endpoint(server):
    """Any page open in the phone's browser could POST to http://127.0.0.1:8001/v1/...: a text/plain body needs no
    CORS preflight (its answer unreadable, the generation and the cloud's quota spent all the same), and a page
    whose name was rebound to 127.0.0.1 (DNS rebinding) read the answers too. An Origin check alone (any loopback
    page's origin served) left the rebound page reading /health and /v1/models (a same-origin GET carries no
    Origin; Host: evil.example), any other local web app's page driving the endpoint, and a text/plain body parsed
    as JSON. Now a Host that is no loopback name, an Origin not the endpoint's own and a body not application/json
    are refused before anything runs; apps (no Origin, JSON) are served as before."""
    body = b'{"model": "m", "prompt": "Once", "max_tokens": 2}'
    url, port = f"{server.url}/v1/completions", server.url.rsplit(":", 1)[1]
    calls = len(server.client.calls)
    for headers in ({"Origin": "https://evil.example", "Content-Type": "text/plain;charset=UTF-8"},
                    {"Origin": "https://evil.example", "Content-Type": "application/x-www-form-urlencoded"},
                    {"Origin": "https://evil.example"},  # a Blob body: no Content-Type at all
                    {"Origin": "null"},  # a sandboxed frame, a file:// page
                    {"Origin": "http://127.0.0.1:3000", "Content-Type": "text/plain"}):  # another local web app
        r = httpx.post(url, content=body, headers={"Sec-Fetch-Site": "cross-site", **headers})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_origin", (headers, r.text[:100])
    rebound = {"Host": f"evil.example:{port}", "Sec-Fetch-Site": "same-origin"}
    for path in ("/health", "/v1/models"):
        r = httpx.get(server.url + path, headers=rebound)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_host", (path, r.text[:100])
    r = httpx.post(url, content=body, headers={**rebound, "Origin": f"http://evil.example:{port}",
                                               "Content-Type": "text/plain"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_host"
    r = httpx.post(url, content=body, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text[:100]
    assert len(server.client.calls) == calls  # nothing ran
    for headers in ({}, {"Origin": f"http://127.0.0.1:{port}"}, {"Host": f"localhost:{port}",
                                                                 "Origin": f"http://localhost:{port}"}):
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json", **headers})
        assert r.status_code == 200, headers


def test_allowed_origins_are_served_with_cors_and_a_key_opens_no_other_page():
    """--allowed-origins: a listed page (the app's own UI in a WebView) has its preflight answered and reads the
    answers; the --local-api-key is no pass for an unlisted page (a preflight carries no key: such a page was served
    yet could never read an answer)."""
    client = _ScriptedClient()
    app = create_app(client, model_name="m", api_key="sk-local",
                     browsers=BrowserPolicy.serving("127.0.0.1", (), "http://localhost:3000"))
    with local_server(app) as url:
        ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
        pre = httpx.options(f"{url}/v1/completions", headers={"Origin": "http://localhost:3000", **ask})
        assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        page = {"Authorization": "Bearer sk-local", "Content-Type": "application/json"}
        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "Once", "max_tokens": 2},
                       headers={"Origin": "http://localhost:3000", **page})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "Once", "max_tokens": 2},
                       headers={"Origin": "https://evil.example", **page})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_origin"


def test_max_completion_tokens_past_the_wire_limit_is_refused_by_its_name(server):
    """max_completion_tokens (what the openai client sends) past 2^31 - 1 was a 400 naming max_tokens, a field the
    client never sent: the error names the field as sent, in param and message."""
    for field in ("max_completion_tokens", "max_tokens"):
        r = httpx.post(f"{server.url}/v1/chat/completions",
                       json={"model": "m", "messages": [{"role": "user", "content": "x"}], field: 2**31})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and err["message"].startswith(field + " "), r.text
    import openai

    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)
    with pytest.raises(openai.BadRequestError) as ei:
        oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                   max_completion_tokens=10**30)
    assert ei.value.body["param"] == "max_completion_tokens" and "max_tokens" not in ei.value.body["message"]


def test_stream_options_without_stream_is_a_400_naming_it(server):
    """stream_options without stream: true was silently ignored; OpenAI answers 400 naming it, and so does this."""
    import openai

    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)
    calls = len(server.client.calls)
    with pytest.raises(openai.BadRequestError) as ei:
        oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                   stream_options={"include_usage": True})
    assert ei.value.body["param"] == "stream_options" and ei.value.body["type"] == "invalid_request_error"
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "Once", "stream": False,
                                                         "stream_options": {"include_usage": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    assert len(server.client.calls) == calls  # refused before anything ran


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    from edge_client.local_api import MAX_BODY_BYTES

    r = httpx.post(f"{server.url}/v1/completions", headers={"content-type": "application/json"},
                   content=b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}', timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

