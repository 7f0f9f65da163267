"""Full-model mode's OpenAI routes when the KV pool runs out under concurrent requests: the request the engine
aborts (``kv_cache_full``, docs/cloud.md "Capacity and overload": "the youngest is aborted with `overloaded`")
is replayed by the server (``cloud_server.full_api.ReplayPolicy``) with the tokens it has, so every answer is the one
a large pool gives - it was a 503 ``overloaded`` (JSON) or that error event mid-stream (SSE), the answer lost; a
request with penalties too (it failed so until the engine request could carry its output so far). A request past the
replays' bounds still gets that 503 / event. One tiny server for the module (a pool of 64 positions) beside one with
a pool that holds them all."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import threading
import time

import httpx
import pytest
from cloud_support import ServerThread

from cloud_server import full_api, limits
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


_QUICK = full_api.ReplayPolicy(wait_s=0.05)  # the tests' replays wait less than a client is told to (1 s)


@pytest.fixture(scope="module")
def server(tiny_lm):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(full_api, "REPLAY", _QUICK)
        with _serving(tiny_lm, 16) as srv:
            _ask(srv, False)  # the model's first steps (warm-up) here, not in a test
            yield srv


@pytest.fixture(scope="module")
def large_pool_server(tiny_lm):
    """A pool of 1024 positions: every answer of these tests undisturbed."""
    with _serving(tiny_lm, 256) as srv:
        yield srv


def _ask(srv, stream: bool, **sampling) -> tuple[int, dict, dict, str]:
    """(status, error or None, headers, text) of one completion that wants 40 positions; 3 at once outgrow 64."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 36, "temperature": 0.0, "stream": stream, **sampling}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    if not stream:
        answer = r.json()
        return r.status_code, answer.get("error"), r.headers, answer["choices"][0]["text"] if "choices" in answer \
            else ""
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return (r.status_code, next((e["error"] for e in events if "error" in e), None), r.headers,
            "".join(c["text"] for e in events for c in e.get("choices", [])))


def _together(srv, stream: bool, samplings: list[dict]) -> list[tuple[int, dict, dict, str]]:
    """The answers of one request per entry of ``samplings``, all sent at once (in that order)."""
    results = [None] * len(samplings)

    def ask(i):
        results[i] = _ask(srv, stream, **samplings[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(samplings))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _replays(srv) -> float:
    return srv.runtime.metrics.registry.get_sample_value("vllm:num_preemptions_total", {"model_name": "tiny"})


# one request's penalties each, then all three
_PENALTIES = [{"repetition_penalty": 1.3}, {"frequency_penalty": 0.7}, {"presence_penalty": 0.9},
              {"repetition_penalty": 1.2, "frequency_penalty": 0.4, "presence_penalty": 0.3}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", ["greedy", "seeded", "unseeded", "penalized", "penalized seeded"])
def test_requests_that_outgrow_the_pool_together_all_get_the_large_pools_answers(server, large_pool_server, stream,
                                                                                   sampling, monkeypatch):
    """Four requests on a pool for one and a half: the ones the engine drops are replayed with their tokens and
    answer what they answer alone on a large pool. Sampled: a seeded request draws the same tokens, and so does an
    unseeded one (its key, here made known, is kept by its replays). Penalized (repetition, frequency, presence): the
    replay's engine request carries the tokens so far as its output, so they are penalized as in the first."""
    monkeypatch.setattr(full_api.secrets, "randbits", lambda bits: 1234)  # an unseeded request's key
    samplings = [{"greedy": {}, "seeded": {"temperature": 0.9, "seed": 7 + i}, "unseeded": {"temperature": 0.9},
                  "penalized": _PENALTIES[i],
                  "penalized seeded": {"temperature": 0.9, "seed": 7 + i, **_PENALTIES[i]}}[sampling]
                 for i in range(4)]
    for s, first in zip(samplings, (5, 9, 13, 17)):
        s["prompt"] = [first, 6, 7, 8]
    engine, carried = server.runtime.engine, []  # each engine request's tokens generated before it

    def add_request(*args, **kw):
        carried.append(len(kw.get("output_ids") or ()))
        return type(engine).add_request(engine, *args, **kw)

    monkeypatch.setattr(engine, "add_request", add_request)
    before = _replays(server)
    answers = _together(server, stream, samplings)
    wanted = [_ask(large_pool_server, stream, **(s if sampling != "unseeded" else {**s, "seed": 1234}))
              for s in samplings]
    for (status, err, _, text), (_, _, _, alone) in zip(answers, wanted):
        assert status == 200 and err is None and text
        assert text == alone
    assert _replays(server) == before + sum(n > 0 for n in carried) > before  # the pool did run out, mid-answer
    assert server.runtime.engine.llm.num_used_blocks() == 0


def _unkeyed(srv, series: str) -> float:
    return srv.runtime.metrics.registry.get_sample_value(f"autoglm:tenant_{series}_total",
                                                         {"model_name": "tiny", "tenant": "unkeyed"}) or 0.0


def test_a_replayed_request_counts_its_prompt_once_and_each_token_once(server):
    """Usage (cloud_server.usage, full mode): what the tenant was served, not what the server recomputed - a replay
    re-prefills the prompt and the tokens so far, which is not billed again; the counters are the answers' usage."""
    before = {k: _unkeyed(server, k) for k in ("requests", "prompt_tokens", "generation_tokens")}
    replays, usages = _replays(server), []

    def ask(first):
        body = {"prompt": [first, 6, 7, 8], "max_tokens": 36, "temperature": 0.0}
        usages.append(httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["usage"])

    threads = [threading.Thread(target=ask, args=(first,)) for first in (5, 9, 13)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _replays(server) > replays  # the pool did run out
    assert [u["prompt_tokens"] for u in usages] == [4, 4, 4]
    assert {k: _unkeyed(server, k) - v for k, v in before.items()} == {
        "requests": 3, "prompt_tokens": 12, "generation_tokens": sum(u["completion_tokens"] for u in usages)}


def test_a_request_past_its_replays_fails_overloaded_with_a_503(tiny_lm, monkeypatch, caplog):
    monkeypatch.setattr(full_api, "REPLAY", full_api.ReplayPolicy(max_replays=0))
    with _serving(tiny_lm, 16) as srv, caplog.at_level(logging.INFO, logger="autoglm.cloud.trace"):
        status, err, headers, _ = next(r for r in _together(srv, False, [{}] * 3) if r[1] is not None)
        assert status == 503 and headers["retry-after"] == "1"
        assert err["code"] == "overloaded" and "not replayed" in err["message"]
        # the failed request counts what it had: its prompt, and the tokens sampled before the drop (its trace line)
        failed = [m for r in caplog.records if "error=overloaded" in (m := r.getMessage())]
        assert failed and _unkeyed(srv, "prompt_tokens") == 12, failed
        answered = sum(int(m.rsplit("tokens=", 1)[1]) for r in caplog.records
                       if "finish=" in (m := r.getMessage()) or "error=" in m)
        assert _unkeyed(srv, "generation_tokens") == answered


def test_a_503_for_load_or_drain_asks_the_servers_own_wait(tiny_lm, monkeypatch):
    """Every 503 says the wait this server itself keeps (shared.http_limits.retry_after's one rule, rounded up): a
    request the full KV pool dropped past its replays, the wait before a replay (ReplayPolicy.wait_s), and a draining
    server's refusal what a split session's Drain refusal asks (RETRY_AFTER_MS). Both said the default, 1 s."""
    monkeypatch.setattr(full_api, "REPLAY", full_api.ReplayPolicy(max_replays=0, wait_s=2.5))
    monkeypatch.setitem(limits.RETRY_AFTER_MS, "draining", 4200)  # (the one dict: full_api and the split endpoint)
    with _serving(tiny_lm, 16) as srv:
        status, err, headers, _ = next(r for r in _together(srv, False, [{}] * 3) if r[1] is not None)
        assert (status, err["code"], headers["retry-after"]) == (503, "overloaded", "3")
        srv.runtime.draining = True
        try:
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 1}, timeout=60)
        finally:
            srv.runtime.draining = False
        assert (r.status_code, r.json()["error"]["code"], r.headers["retry-after"]) == (503, "draining", "5")


def test_a_client_gone_while_its_request_waits_for_its_replay_cancels_it(tiny_lm, monkeypatch):
    """Streams closed while the dropped request waits: it is not replayed, and the pool empties."""
    monkeypatch.setattr(full_api, "REPLAY", full_api.ReplayPolicy(wait_s=2.0))
    with _serving(tiny_lm, 16) as srv, httpx.Client(timeout=60) as client:
        dropped = {"model_name": "tiny", "finished_reason": "error"}
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 36, "temperature": 0.0, "stream": True}
        streams = [client.stream("POST", srv.url + "/v1/completions", json=body) for _ in range(3)]
        with contextlib.ExitStack() as stack:
            for s in streams:
                stack.enter_context(s)
            deadline = time.monotonic() + 30
            while not srv.runtime.metrics.registry.get_sample_value("vllm:request_success_total", dropped):
                assert time.monotonic() < deadline
                time.sleep(0.01)
        # every stream closed within the replay's wait
        time.sleep(2.5)
        assert _replays(srv) == 0
        assert srv.runtime.engine.llm.num_used_blocks() == 0 and not srv.runtime.engine.llm.seqs


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
