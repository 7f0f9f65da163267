"""``autoglm-edge serve`` against a real cloud near the end of the context, as an OpenAI client meets it: a
``max_tokens`` (or the default) over the context left is cut to it (``finish_reason: length``, docs/cloud.md's
OpenAI table), a prompt that leaves no room is a 400, and a request that fails on the phone mid-generation
cancels its cloud request at once (it used to hold the cloud's KV until ``--step-timeout-s``). One edge endpoint
for the module, on the shared tiny cloud."""

from __future__ import annotations

import itertools
import re
import signal
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from local_server import local_server

from edge_client.client import EdgeClient
from edge_client.local_api import ClosingServer, create_app


@pytest.fixture(scope="module")
def edge(tiny_bundle, tiny_cloud):
    with EdgeClient(tiny_bundle, tiny_cloud.ws_url) as client, local_server(create_app(client, model_name="e")) as url:
        yield client, openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=60)


def _prompt(n: int) -> list[int]:
    return [int(t) for t in np.random.RandomState(n).randint(4, 512, n)]


def _running(cloud) -> float:
    text = httpx.get(cloud.http_url + "/metrics", timeout=10).text
    return float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1))


def test_max_tokens_over_the_context_left_is_cut_to_it(edge):
    client, oa = edge
    room = 6
    ids = _prompt(client.runtime.max_positions - room)
    r = oa.completions.create(model="e", prompt=ids, max_tokens=50, temperature=0)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", room)
    # the default max_tokens (512) too, streamed
    chunks = list(oa.completions.create(model="e", prompt=ids, temperature=0, stream=True,
                                        stream_options={"include_usage": True}))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == room


def test_a_prompt_that_leaves_no_room_is_a_400(edge):
    client, oa = edge
    with pytest.raises(openai.BadRequestError, match="positions"):
        oa.completions.create(model="e", prompt=_prompt(client.runtime.max_positions), max_tokens=1)


def test_a_prompt_over_the_context_is_openais_context_length_exceeded(edge):
    """OpenAI's code for a prompt that does not fit, which clients test (the openai client's BadRequestError.code)
    to shorten the conversation and retry: the edge answered invalid_request_error (full mode prompt_too_long)."""
    client, oa = edge
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            oa.completions.create(model="e", prompt=_prompt(client.runtime.max_positions), max_tokens=1,
                                  stream=stream)
        assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "prompt")


def test_a_request_failing_on_the_phone_cancels_its_cloud_request(edge, tiny_cloud, monkeypatch):
    client, oa = edge

    def broken(*a, **k):
        raise RuntimeError("the phone's front failed")

    monkeypatch.setattr(client.session.runtime, "decode", broken)
    with pytest.raises(openai.APIStatusError, match="front failed"):
        oa.completions.create(model="e", prompt=_prompt(20), max_tokens=30, temperature=0)
    deadline = time.monotonic() + 5
    while _running(tiny_cloud) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(tiny_cloud) == 0
    monkeypatch.undo()
    r = oa.completions.create(model="e", prompt=_prompt(20), max_tokens=3, temperature=0)  # and it serves on
    assert r.usage.completion_tokens == 3


def test_a_precision_the_session_lacks_is_a_400_naming_precision(edge):
    """``precision`` is the app's choice: a compute variant this cloud did not load (a CPU server loads fp32 only)
    was a 502 'the cloud failed', and an unknown name a 400 blaming ``messages``."""
    _, oa = edge
    with pytest.raises(openai.BadRequestError, match="int8") as refused:
        oa.completions.create(model="e", prompt=_prompt(8), max_tokens=2, extra_body={"precision": "int8"})
    assert refused.value.body["code"] == "codec_not_negotiated"
    with pytest.raises(openai.BadRequestError, match="expected a codec") as unknown:
        oa.completions.create(model="e", prompt=_prompt(8), max_tokens=2, extra_body={"precision": "int9"})
    assert unknown.value.body["param"] == "precision"
    r = oa.completions.create(model="e", prompt=_prompt(8), max_tokens=2, extra_body={"precision": "fp16"})
    assert r.usage.completion_tokens == 2


def test_stopping_the_server_ends_its_open_streams_at_once(tiny_bundle, tiny_cloud, capsys):
    """Ctrl-C / SIGTERM on `autoglm-edge serve` waited for every open stream to finish (uvicorn's shutdown): a long
    answer held the stopped server for minutes. The signal closes the client: the stream ends with an error event,
    its cloud request is cancelled, and the server stops. And `--port 0` (a free port): the banner named port 0."""
    client = EdgeClient(tiny_bundle, tiny_cloud.ws_url)
    srv = ClosingServer(create_app(client, model_name="e"), client, host="127.0.0.1", port=0, log_level="error")
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline, banner = time.monotonic() + 30, None
    while banner is None and time.monotonic() < deadline:
        time.sleep(0.02)
        banner = re.search(r"endpoint on http://127\.0\.0\.1:(\d+)/v1 ", capsys.readouterr().err)
    port = int(banner.group(1))
    assert port == srv.servers[0].sockets[0].getsockname()[1] != 0
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0, timeout=60)
    stream = oa.completions.create(model="e", prompt=_prompt(20), max_tokens=2000, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)
    t0 = time.monotonic()
    srv.handle_exit(signal.SIGINT, None)  # what the signal handler calls (uvicorn's own on the main thread)
    with pytest.raises(openai.APIError, match="client was closed"):
        for _ in chunks:
            pass
    th.join(10)
    assert not th.is_alive() and time.monotonic() - t0 < 10
    deadline = time.monotonic() + 5
    while _running(tiny_cloud) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(tiny_cloud) == 0



def test_a_prompt_the_cloud_refuses_reads_the_same_streamed_or_not(tiny_bundle, tmp_path):
    """A prompt over the cloud's prompt limit (16 here, under the edge graph's positions) is refused by the cloud on
    a client's first request (no Welcome yet to check it against) and by the client itself once its session is
    open: either way, streamed or not, OpenAI's error is context_length_exceeded with param "prompt" (completions)
    or "messages" (chat). The cloud's refusal read param null: the same prompt's error differed by who refused it."""
    from edge_client.demo import LocalCloud

    def ask(oa, chat: bool, stream: bool):
        if chat:
            return oa.chat.completions.create(model="e", messages=[{"role": "user", "content": "x " * 40}],
                                              max_tokens=1, stream=stream)
        return oa.completions.create(model="e", prompt=_prompt(40), max_tokens=1, stream=stream)

    with LocalCloud(tiny_bundle, extra_args=["--max-prompt-tokens", "16"], log_path=tmp_path / "cloud.log") as cloud:
        for chat, stream in itertools.product((False, True), (False, True)):
            with EdgeClient(tiny_bundle, cloud.ws_url) as client, \
                    local_server(create_app(client, model_name="e")) as url:
                oa = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=60)
                for who in ("the cloud", "the client"):  # the first request meets the cloud's limit
                    with pytest.raises(openai.BadRequestError) as refused:
                        ask(oa, chat, stream)
                    assert (refused.value.code, refused.value.param) == \
                        ("context_length_exceeded", "messages" if chat else "prompt"), (chat, stream, who)
                    assert "limit of 16" in refused.value.message, who
