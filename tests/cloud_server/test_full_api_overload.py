"""Full-model mode's OpenAI routes when the KV pool runs out under concurrent requests: the request the engine
aborts (``kv_cache_full``, docs/cloud.md "Capacity and overload": "the youngest is aborted with `overloaded`")
gets a 503 ``overloaded`` with ``Retry-After`` (JSON) or that error event (SSE), as every other overload does -
it was a 500 ``server_error`` "kv_cache_full", which the openai client retried without a hint - while the other
requests finish and the pool empties. One tiny server for the module (a pool of 64 positions)."""

from __future__ import annotations

import contextlib
import copy
import json
import threading

import httpx
import pytest
from cloud_support import ServerThread

from cloud_server.app import create_app
from cloud_server.config import EngineConfig, ServerConfig
from cloud_server.runtime import CloudRuntime


class _Letters:
    """A tokenizer for prompts of token ids: every id decodes to a letter."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)

    def get_vocab(self):  # what the server bounds a body by (cloud_server.full_api.longest_token)
        return {chr(97 + i): i for i in range(26)}


@contextlib.contextmanager
def _serving(tiny_lm, num_blocks: int):
    """A full-model server of the tiny model (letters for text), pool ``num_blocks`` x 4 positions, context 48."""
    lm = copy.copy(tiny_lm)
    lm.tokenizer = _Letters()
    cfg = ServerConfig(full="tiny-glm4", model_name="tiny",
                       engine=EngineConfig(num_blocks=num_blocks, block_size=4, max_model_len=48))
    rt = CloudRuntime(cfg, loaded=lm).start()
    try:
        with ServerThread(create_app(rt)) as srv:
            srv.runtime = rt
            yield srv
    finally:
        rt.stop()


@pytest.fixture(scope="module")
def server(tiny_lm):
    with _serving(tiny_lm, 16) as srv:
        _ask(srv, False)  # the model's first steps (warm-up) here, not in a test
        yield srv


def _ask(srv, stream: bool) -> tuple[int, dict, dict]:
    """(status, error or None, headers) of one completion that wants 40 positions; 3 at once outgrow 64."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 36, "temperature": 0.0, "stream": stream}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    if not stream:
        return r.status_code, r.json().get("error"), r.headers
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return r.status_code, next((e["error"] for e in events if "error" in e), None), r.headers


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_aborted_for_kv_is_a_503_overloaded(server, stream):
    results = []
    threads = [threading.Thread(target=lambda: results.append(_ask(server, stream))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [(status, err, headers) for status, err, headers in results if err is not None]
    assert errors and len(errors) < 3  # the youngest went, the others finished
    for status, err, headers in errors:
        assert err["code"] == "overloaded" and err["type"] == "server_error"
        if not stream:
            assert status == 503 and headers["retry-after"] == "1"
    assert _ask(server, stream)[1] is None  # alone, it fits


@pytest.fixture(scope="module")
def small_pool_server(tiny_lm):
    """A pool of 32 positions under a max_model_len of 48."""
    with _serving(tiny_lm, 8) as srv:
        yield srv


def test_a_request_longer_than_the_pool_stops_at_it_or_is_refused(small_pool_server):
    """The context a request may fill is the pool's when that is smaller than max_model_len: the answer ends
    'length' at the pool, and a prompt that fills it is a 400 - it was a 503 overloaded on every try (the engine
    dropped it for load, alone on the server)."""
    body = {"prompt": list(range(5, 35)), "max_tokens": 36, "temperature": 0.0}  # 30 + 36 > 32 positions
    r = httpx.post(small_pool_server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 2
    body["prompt"] = list(range(5, 38))  # 33 positions
    r = httpx.post(small_pool_server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and "context of 32" in r.json()["error"]["message"]
