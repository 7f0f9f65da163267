"""The split WebSocket endpoint over a real uvicorn server: greedy equality through the wire, concurrency,
refusals (bundle mismatch 1008, overload 1013, bad frames 1002), prefix cache, cancel / disconnect / resume,
and the pool's accounting returning to zero."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch
import websockets
from cloud_support import EdgeSim, ServerThread, boundary, edge_front, greedy_reference

from cloud_server.app import create_app
from cloud_server.config import EngineConfig, ServerConfig
from cloud_server.runtime import CloudRuntime
from cloud_server.step_pipeline import POOL_MIN_ROWS
from shared import protocol as P
from shared.manifest import Manifest


def _serve(bundle, **kw):
    engine = EngineConfig(**{"num_blocks": 256, "block_size": 4, **kw.pop("engine", {})})
    rt = CloudRuntime(ServerConfig(bundle=bundle, engine=engine, **kw)).start()
    app = create_app(rt)
    srv = ServerThread(app).__enter__()
    srv.runtime, srv.app = rt, app
    return srv


def _stop(srv):
    srv.__exit__(None, None, None)
    srv.runtime.stop()


@pytest.fixture(scope="module")
def server(tiny_bundle):
    srv = _serve(tiny_bundle, max_sessions=128, session_grace_s=0.5)
    yield srv
    _stop(srv)


@pytest.fixture(scope="module")
def loaded_front(tiny_bundle):
    """The edge's front runtime, loaded once; every simulated request forks it."""
    return edge_front(tiny_bundle)


def _edge(srv, bundle, loaded_front, **kw):
    return EdgeSim(srv.ws_url, bundle, Manifest.load(bundle).bundle_id, front=loaded_front, **kw)


def _prompts(n, seed=0, lo=3, hi=20):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 512, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


async def _open_request(edge, loaded_front, prompt, max_tokens: int):
    """Connect, start greedy request "r" on a fresh fork of the front: (welcome, front, its first Tokens)."""
    welcome = await edge.connect()
    front = loaded_front.fork()
    await edge.prefill("r", front, prompt, P.SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return welcome, front, await edge.recv()


async def _decode_to_end(edge, front, prompt_len: int, tokens: list[int]) -> None:
    """Feed request "r" one decode step per returned token until it finishes; ``tokens`` grows in place."""
    while True:
        hidden = edge.encode(boundary(front, [tokens[-1]]))
        await edge.send(P.DecodeStep(request_id="r", position=prompt_len + len(tokens) - 1, hidden=hidden))
        msg = await edge.recv()
        tokens += msg.token_ids
        if msg.finish_reason:
            return


async def _settle(rt, timeout=10.0):
    """Wait until the engine holds no request and no KV block (aborts are asynchronous)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        used = await asyncio.wrap_future(rt.engine.call(lambda e: (len(e.seqs), e.num_used_blocks())))
        if used == (0, 0):
            return used
        await asyncio.sleep(0.05)
    return used


@pytest.mark.parametrize("step_decode", ["inline", "worker"])
def test_one_and_eight_staggered_sessions_match_the_unsplit_model(server, tiny_bundle, tiny_lm, loaded_front,
                                                                 step_decode):
    # "worker": every batch of decode steps is decoded on the pipeline's thread (cloud_server.step_pipeline),
    # so the later sessions' Prefills wait behind the earlier ones' steps and must still keep their order
    pipeline = server.server.app.state.split.translate._pipeline
    pipeline.pool_min_rows = 1 if step_decode == "worker" else POOL_MIN_ROWS
    try:
        _staggered_sessions(server, tiny_bundle, tiny_lm, loaded_front)
    finally:
        pipeline.pool_min_rows = POOL_MIN_ROWS


def _staggered_sessions(server, tiny_bundle, tiny_lm, loaded_front):
    prompts = _prompts(8, seed=1)
    refs = [greedy_reference(tiny_lm.model, p, 12, [2, 3]) for p in prompts]

    async def phone(i, delay):
        await asyncio.sleep(delay)
        edge = _edge(server, tiny_bundle, loaded_front)
        welcome = await edge.connect()
        assert isinstance(welcome, P.Welcome) and welcome.limits.prefix_block_tokens == 4
        tokens, finish, last = await edge.generate(f"r{i}", prompts[i], 12)
        await edge.close()
        return tokens, finish, last

    async def main():
        solo = await phone(0, 0)
        many = await asyncio.gather(*(phone(i, 0.05 * i) for i in range(8)))
        return solo, many

    (solo, finish, last), many = asyncio.run(main())
    assert solo == refs[0] and finish in ("stop", "length")
    assert last.usage.prompt_tokens == len(prompts[0]) and last.usage.completion_tokens == len(solo)
    assert [m[0] for m in many] == refs
    assert asyncio.run(_settle(server.runtime)) == (0, 0)


@pytest.mark.slow  # the default suite keeps test_one_and_eight_staggered_sessions_match_the_unsplit_model
def test_smollm2_eight_sessions_through_the_wire_match_the_unsplit_model(smol_bundle, smol_lm):
    from cloud_support import greedy_reference_batch

    tok = smol_lm.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at",
             "The quick brown fox", "import numpy as np", "My favourite colour is", "1, 2, 3, 4,"]
    prompts = [tok(t).input_ids for t in texts]
    refs = greedy_reference_batch(smol_lm.model, prompts, 12, [tok.eos_token_id])
    srv = _serve(smol_bundle, engine={"block_size": 16})
    front = edge_front(smol_bundle)
    try:
        async def phone(i):
            await asyncio.sleep(0.1 * i)
            edge = _edge(srv, smol_bundle, front)
            await edge.connect()
            tokens, _, _ = await edge.generate(f"r{i}", prompts[i], 12)
            await edge.close()
            return tokens

        async def main():
            return await asyncio.gather(*(phone(i) for i in range(8)))

        assert asyncio.run(main()) == refs  # fp16 on the wire, fp32 edge and cloud
    finally:
        _stop(srv)


def test_metrics_are_rendered_off_the_event_loop(server, monkeypatch):
    """/metrics rendered the registry on the event loop: ~45 ms with a keys file of 1000 tenants, which every
    session's decode step waited for at each scrape. Checked by where it runs, not by a latency (a loaded box
    stretches any bound): not in a thread running an event loop."""
    from cloud_server.metrics import ServerMetrics

    on_loop, render = [], ServerMetrics.render

    def spy(self):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return render(self)

    monkeypatch.setattr(ServerMetrics, "render", spy)
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and "vllm:num_requests_running" in r.text
    assert on_loop == [False]


def test_bundle_mismatch_is_refused_with_1008(server, tiny_bundle, loaded_front):
    async def main():
        edge = EdgeSim(server.ws_url, tiny_bundle, "0" * 32, front=loaded_front)
        err = await edge.connect()
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await edge.recv()
        return err, closed.value.rcvd.code

    err, code = asyncio.run(main())
    assert isinstance(err, P.Error) and err.code == "bundle_mismatch" and err.fatal and code == 1008


def test_garbage_frames_get_an_error_and_1002(server):
    async def main():
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(b"\xc1not msgpack")
            err = P.decode_message(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            return err, closed.value.rcvd.code

    err, code = asyncio.run(main())
    assert isinstance(err, P.Error) and err.code == "bad_frame" and code == 1002


@pytest.mark.parametrize("bad, code", [(b"\xc1garbage", "bad_frame"), ("hello", "bad_state")])
def test_a_session_ended_by_a_fatal_error_cannot_be_resumed(server, tiny_bundle, loaded_front, bad, code):
    async def main():
        edge = _edge(server, tiny_bundle, loaded_front)
        welcome = await edge.connect()
        await edge.generate("r", _prompts(1, seed=7)[0], 20, stop_after=1)
        await edge.ws.send(P.encode_message(P.Hello(bundle_id=edge.bundle_id, codecs=["fp16"])) if bad == "hello"
                           else bad)
        err = await edge.recv()
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await edge.recv()
        again = _edge(server, tiny_bundle, loaded_front)  # at once: well inside the grace period
        w2 = await again.connect(resume_token=welcome.resume_token)
        await again.send(P.Resume(request_id="r", have_tokens=1))
        gone = await again.recv()
        await again.close()
        return err, closed.value.rcvd.code, w2, gone

    err, close_code, w2, gone = asyncio.run(main())
    assert err.code == code and err.fatal and close_code == 1002
    assert not w2.resumed and w2.requests == [] and gone.code == "resume_failed"
    assert asyncio.run(_settle(server.runtime)) == (0, 0)  # its request was aborted, its KV freed


def test_an_edges_fatal_error_ends_its_session(server, tiny_bundle, loaded_front):
    async def main():
        edge = _edge(server, tiny_bundle, loaded_front)
        welcome = await edge.connect()
        await edge.generate("r", _prompts(1, seed=8)[0], 20, stop_after=1)
        await edge.send(P.Error(code="internal", message="the phone gives up", fatal=True))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await edge.recv(timeout=5)
        again = _edge(server, tiny_bundle, loaded_front)
        w2 = await again.connect(resume_token=welcome.resume_token)
        await again.close()
        return closed.value.rcvd.code, w2

    code, w2 = asyncio.run(main())
    assert code == 1000 and not w2.resumed
    assert asyncio.run(_settle(server.runtime)) == (0, 0)


def test_overload_refuses_with_1013_and_existing_sessions_are_unaffected(tiny_bundle, tiny_lm, loaded_front):
    srv = _serve(tiny_bundle, max_sessions=2, session_grace_s=0.5)
    prompts = _prompts(2, seed=2)
    try:
        async def main():
            a, b = _edge(srv, tiny_bundle, loaded_front), _edge(srv, tiny_bundle, loaded_front)
            await a.connect()
            await b.connect()
            ta = asyncio.create_task(a.generate("x", prompts[0], 10))
            await asyncio.sleep(0.05)
            c = _edge(srv, tiny_bundle, loaded_front)
            err = await c.connect()
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await c.recv()
            tb = await b.generate("y", prompts[1], 10)
            return err, closed.value.rcvd, await ta, tb

        err, close, ra, rb = asyncio.run(main())
        assert isinstance(err, P.Error) and err.code == "overloaded" and err.fatal and err.retry_after_ms
        assert close.code == 1013 and "2 sessions" in close.reason
        assert ra[0] == greedy_reference(tiny_lm.model, prompts[0], 10, [2, 3])
        assert rb[0] == greedy_reference(tiny_lm.model, prompts[1], 10, [2, 3])
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'autoglm:sessions_refused_total{model_name="b",reason="overloaded"} 1.0' in metrics
    finally:
        _stop(srv)


def test_100_sessions_opened_cancelled_closed_and_killed_leave_the_pool_empty(server, tiny_bundle, loaded_front):
    prompts = _prompts(100, seed=3, lo=2, hi=30)

    async def phone(i):
        edge = _edge(server, tiny_bundle, loaded_front)
        await edge.connect()
        kind = i % 4
        if kind == 3:  # runs to the end
            _, finish, _ = await edge.generate(f"q{i}", prompts[i], 4)
            await edge.close()
            return finish
        _, finish, _ = await edge.generate(f"q{i}", prompts[i], 50, stop_after=1 + i % 3)
        if kind == 0:  # cancel, then wait for the server's confirmation
            await edge.send(P.Cancel(request_id=f"q{i}"))
            while True:
                msg = await edge.recv()
                if isinstance(msg, P.Tokens) and msg.finish_reason:
                    await edge.close()
                    return msg.finish_reason
        if kind == 1:  # orderly Close mid-generation
            await edge.close()
            return "closed"
        edge.kill()  # the phone vanishes: the session waits out its grace period
        return "killed"

    async def main():
        results = []
        for k in range(0, 100, 20):  # 20 phones at a time
            results += await asyncio.gather(*(phone(i) for i in range(k, k + 20)))
        await asyncio.sleep(0.8)  # > session_grace_s
        return results, await _settle(server.runtime)

    results, settled = asyncio.run(main())
    assert results.count("cancelled") == 25 and results.count("killed") == 25 and results.count("closed") == 25
    assert settled == (0, 0)
    assert len(server.app.state.split.registry) == 0
    bm = server.runtime.engine.llm.block_managers["fp32"]
    bm.check()


def test_prefix_cache_over_the_wire(server, tiny_bundle, tiny_lm, loaded_front):
    prompt = _prompts(1, seed=4, lo=18, hi=19)[0]  # 4 full blocks of 4 + 2
    keys = [f"sys-{i}" for i in range(4)]
    ref = greedy_reference(tiny_lm.model, prompt, 8, [2, 3])

    async def main():
        edge = _edge(server, tiny_bundle, loaded_front)
        await edge.connect()
        first = await edge.generate("a", prompt, 8, keys=keys)  # computes and publishes the blocks
        second = await edge.generate("b", prompt, 8, start=16, keys=keys)  # omits [0, 16)
        miss = await edge.generate("c", prompt, 8, start=16, keys=["nope"] + keys[1:])
        again = await edge.generate("d", prompt, 8, keys=["nope"] + keys[1:])  # resend in full: fine
        await edge.close()
        return first, second, miss, again

    first, second, miss, again = asyncio.run(main())
    assert first[0] == ref and second[0] == ref and again[0] == ref
    assert second[2].usage.cached_tokens == 16 and first[2].usage.cached_tokens == 0
    assert miss[1] == "error:prefix_miss" and miss[2].request_id == "c" and not miss[2].fatal
    metrics = httpx.get(server.url + "/metrics").text
    assert "vllm:prefix_cache_hits_total" in metrics


def test_resume_after_a_dropped_link_continues_without_losing_tokens(server, tiny_bundle, tiny_lm, loaded_front):
    prompt = _prompts(1, seed=5, lo=9, hi=10)[0]
    ref = greedy_reference(tiny_lm.model, prompt, 12, [2, 3])

    async def main():
        edge = _edge(server, tiny_bundle, loaded_front)
        welcome = await edge.connect()
        front = loaded_front.fork()
        await edge.prefill("r", front, prompt, P.SamplingParams(max_tokens=12, temperature=0.0))
        tokens = []
        for _ in range(3):  # three tokens, each answered with its DecodeStep
            msg = await edge.recv()
            tokens += msg.token_ids
            hidden = edge.encode(boundary(front, [msg.token_ids[-1]]))
            await edge.send(P.DecodeStep(request_id="r", position=len(prompt) + len(tokens) - 1, hidden=hidden))
        edge.kill()  # the fourth token is generated while we are away
        await asyncio.sleep(0.2)
        again = _edge(server, tiny_bundle, loaded_front)
        w2 = await again.connect(resume_token=welcome.resume_token)
        assert w2.resumed and w2.session_id == welcome.session_id
        assert [(r.request_id, r.received) for r in w2.requests] == [("r", len(prompt) + 3)]
        await again.send(P.Resume(request_id="r", have_tokens=len(tokens)))
        resumed = await again.recv()
        tokens += resumed.token_ids
        assert resumed.received == len(prompt) + 3 and resumed.index == 3
        await _decode_to_end(again, front, len(prompt), tokens)
        await again.send(P.Resume(request_id="zz", have_tokens=0))
        unknown = await again.recv()
        await again.close()
        return tokens, resumed, unknown

    tokens, resumed, unknown = asyncio.run(main())
    assert len(resumed.token_ids) == 1  # the token generated while the link was down
    assert tokens == ref
    assert isinstance(unknown, P.Error) and unknown.code == "resume_failed"


def test_a_session_gone_past_its_grace_period_cannot_be_resumed(server, tiny_bundle, loaded_front):
    async def main():
        edge = _edge(server, tiny_bundle, loaded_front)
        welcome = await edge.connect()
        await edge.generate("r", _prompts(1, seed=6)[0], 20, stop_after=1)
        edge.kill()
        await asyncio.sleep(0.9)
        again = _edge(server, tiny_bundle, loaded_front)
        w2 = await again.connect(resume_token=welcome.resume_token)
        await again.send(P.Resume(request_id="r", have_tokens=1))
        err = await again.recv()
        await again.close()
        return w2, err

    w2, err = asyncio.run(main())
    assert not w2.resumed and w2.requests == []
    assert err.code == "resume_failed"
    assert asyncio.run(_settle(server.runtime)) == (0, 0)


def test_per_request_errors_keep_the_session(server, tiny_bundle, loaded_front):
    async def main():
        edge = _edge(server, tiny_bundle, loaded_front)
        await edge.connect()
        front = loaded_front.fork()
        h = edge.encode(boundary(front, [5, 6, 7]))
        await edge.send(P.Prefill(request_id="p", start=0, hidden=h, params=P.SamplingParams(max_tokens=5)))
        await edge.recv()  # first token
        await edge.send(P.DecodeStep(request_id="p", position=7, hidden=edge.encode(boundary(front, [9]))))
        bad_pos = await edge.recv()
        other = P.EncodedTensor(codec="int8-b32", shape=(1, 64), data=b"\x00" * 66)  # not negotiated
        await edge.send(P.Prefill(request_id="q", start=0, hidden=other, params=P.SamplingParams()))
        bad_codec = await edge.recv()
        tokens, finish, _ = await edge.generate("ok", [5, 6, 7], 3)
        await edge.close()
        return bad_pos, bad_codec, tokens, finish

    bad_pos, bad_codec, tokens, finish = asyncio.run(main())
    assert bad_pos.code == "bad_position" and bad_pos.request_id == "p" and not bad_pos.fatal
    assert bad_codec.code == "codec_not_negotiated" and bad_codec.request_id == "q"
    assert len(tokens) >= 1 and finish in ("stop", "length")


def test_probes_metrics_and_api_key(tiny_bundle, loaded_front):
    srv = _serve(tiny_bundle, api_key="sk-x", model_name="tiny")
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        ready = httpx.get(srv.url + "/ready").json()
        assert ready["ready"] and ready["mode"] == "split" and ready["bundle_id"] == Manifest.load(tiny_bundle).bundle_id
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        models = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer sk-x"}).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]

        async def main():
            bad = _edge(srv, tiny_bundle, loaded_front, api_key="wrong")
            with pytest.raises(websockets.InvalidStatus) as refused:
                await bad.connect()
            good = _edge(srv, tiny_bundle, loaded_front, api_key="sk-x")
            await good.connect()
            out = await good.generate("m", [5, 6, 7, 8], 3)
            await good.close()
            return refused.value.response, out

        refused, out = asyncio.run(main())
        assert refused.status_code == 401 and b"unauthorized" in refused.body and out[0]
        text = httpx.get(srv.url + "/metrics").text
        for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                     "vllm:e2e_request_latency_seconds_count", "vllm:num_requests_running",
                     "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total",
                     'autoglm:uplink_bytes_total{codec="fp16",model_name="tiny"}', "autoglm:downlink_bytes_total",
                     'autoglm:uplink_bytes_per_token_count{codec="fp16",model_name="tiny"}'):
            assert name in text, name
    finally:
        _stop(srv)


def test_sigterm_drains_open_requests_refuses_new_sessions_then_exits(tiny_bundle, tiny_lm, loaded_front):
    import signal

    srv = _serve(tiny_bundle, drain_timeout_s=20)
    prompt = _prompts(1, seed=7)[0]
    try:
        async def main():
            edge = _edge(srv, tiny_bundle, loaded_front)
            await edge.connect()
            front = loaded_front.fork()
            await edge.prefill("r", front, prompt, P.SamplingParams(max_tokens=10, temperature=0.0))
            first = await edge.recv()
            srv.server.handle_exit(signal.SIGTERM, None)  # what the signal handler does
            drain = await edge.recv()
            ready = await asyncio.to_thread(httpx.get, srv.url + "/ready")
            late = _edge(srv, tiny_bundle, loaded_front)
            refused = await late.connect()
            tokens = list(first.token_ids)
            await _decode_to_end(edge, front, len(prompt), tokens)  # the open request still runs to its end
            return drain, ready, refused, tokens

        drain, ready, refused, tokens = asyncio.run(main())
        assert isinstance(drain, P.Drain) and drain.grace_ms == 20_000
        assert ready.status_code == 503 and ready.json()["draining"] is True
        assert isinstance(refused, P.Error) and refused.code == "draining" and refused.retry_after_ms
        assert tokens == greedy_reference(tiny_lm.model, prompt, 10, [2, 3])
        srv.thread.join(timeout=10)
        assert not srv.thread.is_alive()  # the server exited by itself once the request finished
    finally:
        _stop(srv)


def test_a_server_whose_engine_stopped_stops_to_be_restarted(tiny_bundle, loaded_front):
    """A fatal engine error (an injected CUDA error): the open request gets ``internal`` and the server stops by
    itself, ``engine_failed`` set (``autoglm-cloud serve`` exits 1), for its supervisor to restart it - it stayed
    up answering 503 with ``/health`` 200, which a liveness probe never replaced."""
    srv = _serve(tiny_bundle)

    def failing_step(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    try:
        srv.runtime.engine.llm.step = failing_step

        async def main():
            edge = _edge(srv, tiny_bundle, loaded_front)
            await edge.connect()
            await edge.prefill("r", loaded_front.fork(), [5, 6, 7], P.SamplingParams(max_tokens=4))
            return await edge.recv()

        err = asyncio.run(main())
        srv.thread.join(timeout=10)
        assert isinstance(err, P.Error) and err.code == "internal"
        assert not srv.thread.is_alive() and "CUDA error" in srv.server.engine_failed
    finally:
        _stop(srv)


def test_a_link_that_drops_during_the_drain_resumes_and_its_request_finishes_there(tiny_bundle, tiny_lm,
                                                                                   loaded_front):
    """The drain waits for open requests; one whose phone's link dropped meanwhile could not resume (the draining
    server refused every Hello), so it never finished: the phone failed 'unreachable' and the server waited out
    its drain timeout. A session held here now resumes (and is told Drain again); new sessions are refused."""
    import signal

    srv = _serve(tiny_bundle, drain_timeout_s=20, session_grace_s=10)
    prompt = _prompts(1, seed=13)[0]
    try:
        async def main():
            edge = _edge(srv, tiny_bundle, loaded_front)
            welcome, front, first = await _open_request(edge, loaded_front, prompt, 8)
            srv.server.handle_exit(signal.SIGTERM, None)  # what the signal handler does
            assert isinstance(await edge.recv(), P.Drain)
            edge.kill()  # the phone's link drops during the drain
            back = _edge(srv, tiny_bundle, loaded_front)
            again = await back.connect(resume_token=welcome.resume_token)
            drain = await back.recv()
            late = await _edge(srv, tiny_bundle, loaded_front).connect()  # a new session: still refused
            await back.send(P.Resume(request_id="r", have_tokens=1))
            assert (await back.recv()).token_ids == []
            tokens = list(first.token_ids)
            await _decode_to_end(back, front, len(prompt), tokens)
            await back.send(P.Prefill(request_id="new", start=0, hidden=back.encode(boundary(front, prompt[:2])),
                                      params=P.SamplingParams(max_tokens=2)))
            return again, drain, late, tokens, await back.recv()

        again, drain, late, tokens, refused = asyncio.run(main())
        assert again.resumed and isinstance(drain, P.Drain)
        assert isinstance(late, P.Error) and late.code == "draining"
        assert tokens == greedy_reference(tiny_lm.model, prompt, 8, [2, 3])
        assert isinstance(refused, P.Error) and refused.code == "draining"  # no new request on it either
        srv.thread.join(timeout=10)
        assert not srv.thread.is_alive()  # the request finished: the drain ended well before its timeout
    finally:
        _stop(srv)


def test_a_drained_servers_edges_send_their_next_request_to_the_next_replica(server, tiny_bundle, loaded_front):
    """A rolling update: the old replica drains (SIGTERM) and the balancer sends new connections to the next one.
    An edge that read the Drain during its request, and one whose Drain was still unread (idle), each run their
    next request on the next replica with the tokens the old one gave - they failed 'draining' before."""
    import signal

    from edge_client.client import EdgeClient
    from edge_client.config import RetryPolicy
    from rig.link import LinkEmulator

    old = _serve(tiny_bundle, drain_timeout_s=30)
    prompt = _prompts(1, seed=12)[0]
    retry = RetryPolicy(connect_timeout_s=5, max_retries=10, backoff_initial_s=0.05, backoff_max_s=0.2)
    held, release = threading.Event(), threading.Event()

    async def hold():
        holder = _edge(old, tiny_bundle, loaded_front)
        await holder.connect()
        await holder.prefill("h", loaded_front.fork(), prompt, P.SamplingParams(max_tokens=6))
        await holder.recv()
        held.set()
        await asyncio.to_thread(release.wait, 30)
        await holder.close()  # its request ends: the old replica's drain is over

    holding = threading.Thread(target=asyncio.run, args=(hold(),), daemon=True)
    try:
        with LinkEmulator(old.port) as balancer, \
                EdgeClient(tiny_bundle, f"ws://127.0.0.1:{balancer.port}", codec="fp16", retry=retry) as busy, \
                EdgeClient(tiny_bundle, f"ws://127.0.0.1:{balancer.port}", codec="fp16", retry=retry) as idle:
            want = idle.complete(prompt_ids=prompt, max_tokens=6).token_ids  # on the old replica
            holding.start()  # a request left open keeps the old one draining until the end
            assert held.wait(30)
            gen = busy.generate(prompt_ids=prompt, max_tokens=6)
            for n, _ in enumerate(gen.iter_tokens()):
                if n == 0:
                    old.server.handle_exit(signal.SIGTERM, None)  # what the signal handler does
                    time.sleep(0.2)
                    balancer.target = ("127.0.0.1", server.port)  # the old one left the Service
            assert gen.token_ids == want  # the request open at the drain ran to its end on the old replica
            got = {c: c.complete(prompt_ids=prompt, max_tokens=6) for c in (busy, idle)}
        assert all(g.token_ids == want and g.finish_reason == "length" for g in got.values())
        assert got[idle].stats.replays == 1  # refused 'draining' by the old replica, then sent to the next
    finally:
        release.set()
        if holding.is_alive():
            holding.join(10)
        _stop(old)


def test_a_request_the_draining_server_cannot_resume_goes_to_the_next_replica(server, tiny_bundle, loaded_front):
    """The phone's link drops during a drain for longer than the step timeout: its session resumes on the old
    replica, which no longer holds the request (timed out: ``resume_failed``) and takes no replay (draining) - the
    edge broke the protocol there ('draining'); it now replays it on the next replica, with the same tokens."""
    import signal

    from edge_client.client import EdgeClient
    from edge_client.config import RetryPolicy
    from rig.link import LinkEmulator

    old = _serve(tiny_bundle, drain_timeout_s=30, session_grace_s=30, step_timeout_s=1)
    prompt = _prompts(1, seed=14)[0]
    retry = RetryPolicy(connect_timeout_s=5, max_retries=20, backoff_initial_s=0.1, backoff_max_s=0.3)
    held, release = threading.Event(), threading.Event()

    async def hold():  # a session decoding slowly (within the step timeout) keeps the old replica draining
        holder, front = _edge(old, tiny_bundle, loaded_front), loaded_front.fork()
        await holder.connect()
        await holder.prefill("h", front, prompt, P.SamplingParams(max_tokens=200, temperature=0.0))
        tokens = (await holder.recv()).token_ids
        held.set()
        while not release.is_set():
            await asyncio.sleep(0.3)
            hidden = holder.encode(boundary(front, [tokens[-1]]))
            await holder.send(P.DecodeStep(request_id="h", position=len(prompt) + len(tokens) - 1, hidden=hidden))
            while not isinstance(msg := await holder.recv(), P.Tokens):  # (its Drain)
                pass
            tokens += msg.token_ids
        await holder.close()

    holding = threading.Thread(target=asyncio.run, args=(hold(),), daemon=True)
    try:
        with LinkEmulator(old.port) as balancer, \
                EdgeClient(tiny_bundle, f"ws://127.0.0.1:{balancer.port}", codec="fp16", retry=retry) as phone:
            want = phone.complete(prompt_ids=prompt, max_tokens=12).token_ids
            holding.start()
            assert held.wait(30)
            gen = phone.generate(prompt_ids=prompt, max_tokens=12)
            for n, _ in enumerate(gen.iter_tokens()):
                if n == 1:
                    old.server.handle_exit(signal.SIGTERM, None)
                    balancer.cut(down_s=3.0)  # the request times out on the old replica meanwhile
                    threading.Timer(4.0, lambda: setattr(balancer, "target", ("127.0.0.1", server.port))).start()
        assert gen.token_ids == want and gen.finish_reason == "length" and gen.stats.replays >= 1
    finally:
        release.set()
        if holding.is_alive():
            holding.join(10)
        _stop(old)


def test_a_reconnect_takes_over_a_session_whose_old_link_is_not_yet_seen_dead(server, tiny_bundle, tiny_lm,
                                                                               loaded_front):
    prompt = _prompts(1, seed=8)[0]

    async def main():
        old = _edge(server, tiny_bundle, loaded_front)
        welcome, front, first = await _open_request(old, loaded_front, prompt, 6)
        new = _edge(server, tiny_bundle, loaded_front)  # the old socket is still open as far as anyone knows
        w2 = await new.connect(resume_token=welcome.resume_token)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await old.recv(timeout=10)
        tokens = list(first.token_ids)
        await new.send(P.Resume(request_id="r", have_tokens=1))
        assert (await new.recv()).token_ids == []
        await _decode_to_end(new, front, len(prompt), tokens)
        await new.close()
        return w2, closed.value.rcvd, tokens

    w2, close, tokens = asyncio.run(main())
    assert w2.resumed and close.code == 1000 and "replaced" in close.reason
    assert tokens == greedy_reference(tiny_lm.model, prompt, 6, [2, 3])


def test_the_edge_link_takes_the_base_url_and_names_a_missing_endpoint(server, tiny_bundle):
    from edge_client.config import RetryPolicy
    from edge_client.transport import HandshakeRefused, Link

    hello = P.Hello(bundle_id=Manifest.load(tiny_bundle).bundle_id, codecs=["fp16"])
    base = server.ws_url.removesuffix("/v1/split")

    async def main():
        link = Link(base, None, RetryPolicy())
        welcome = await link.connect(hello)
        await link.send(P.Close())
        await link.close()
        with pytest.raises(HandshakeRefused) as refused:
            await Link(base + "/v2/split", None, RetryPolicy()).connect(hello)
        return link.url, welcome, refused.value

    url, welcome, refused = asyncio.run(main())
    assert url == server.ws_url and isinstance(welcome, P.Welcome)
    assert refused.code == "no_split_endpoint" and f"no split endpoint at {base}/v2/split" in str(refused)
    assert "API key" not in str(refused)
    # the other way to get here is a right URL to a server in full-model mode: the message said only to fix the URL
    assert "full-model mode (--full)" in str(refused)


def test_answers_do_not_depend_on_who_warmed_the_caches(tiny_bundle, tiny_glm4_int8_bundle, tmp_path):
    """The same request (int8 edge, int8-b32 wire) on a fresh server, and after an fp32 edge and other codecs
    warmed both caches (one shared edge cache directory): the same tokens, and no block of theirs reused."""
    from edge_client.client import EdgeClient
    from edge_client.config import RetryPolicy

    assert Manifest.load(tiny_bundle).bundle_id == Manifest.load(tiny_glm4_int8_bundle).bundle_id  # one split
    prompt = [int(t) for t in torch.randint(4, 512, (40,), generator=torch.Generator().manual_seed(9))]
    retry = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=30.0, max_retries=2)

    def run(srv, bundle, codec, cache_dir):
        with EdgeClient(bundle, srv.ws_url, codec=codec, cache_dir=cache_dir, retry=retry) as c:
            return c.complete(prompt_ids=prompt, max_tokens=12)

    fresh = _serve(tiny_bundle, engine={"block_size": 16})
    try:
        ref = run(fresh, tiny_glm4_int8_bundle, "int8-b32", tmp_path / "fresh")
    finally:
        _stop(fresh)
    warm = _serve(tiny_bundle, engine={"block_size": 16})
    shared_dir = tmp_path / "shared"
    try:
        for bundle, codec in ((tiny_bundle, "fp16"), (tiny_bundle, "int8-b32"), (tiny_glm4_int8_bundle, "fp16")):
            assert run(warm, bundle, codec, shared_dir).token_ids  # the others warm both caches
        got = run(warm, tiny_glm4_int8_bundle, "int8-b32", shared_dir)
        again = run(warm, tiny_glm4_int8_bundle, "int8-b32", shared_dir)
    finally:
        _stop(warm)
    assert got.token_ids == ref.token_ids and again.token_ids == ref.token_ids
    # the int8 front's own raw states (from its fp16 run) are reused on the edge: they are what it computes
    assert got.stats.cached_tokens == 32
    # but no cloud block made from another front's or another codec's states: its Welcome listed none of its keys,
    # so the whole prompt went up at once (no prefix_miss)
    assert got.stats.cloud_cached_tokens == 0 and got.stats.prefix_misses == 0
    assert got.stats.uploaded_prompt_tokens == len(prompt)
    assert again.stats.cloud_cached_tokens == 32 and again.stats.prefix_misses == 0  # its own blocks are


def test_a_tenant_cannot_plant_prefix_blocks_for_another(server, tiny_bundle, tiny_lm, loaded_front):
    prompt = _prompts(1, seed=10, lo=18, hi=19)[0]  # 4 full blocks of 4 + 2
    keys = [f"system-{i}" for i in range(4)]
    ref = greedy_reference(tiny_lm.model, prompt, 8, [2, 3])

    async def main():
        mallory = _edge(server, tiny_bundle, loaded_front, api_key="sk-mallory")
        await mallory.connect()
        poison = P.EncodedTensor(codec="fp16", shape=(len(prompt), 64), data=bytes(2 * 64 * len(prompt)))
        await mallory.send(P.Prefill(request_id="m", start=0, hidden=poison, prefix_keys=keys,
                                     params=P.SamplingParams(max_tokens=1)))
        await mallory.recv()  # its token: the blocks are published in mallory's namespace
        alice = _edge(server, tiny_bundle, loaded_front, api_key="sk-alice")
        welcome = await alice.connect()
        hit = await alice.generate("a1", prompt, 8, start=16, keys=keys)  # asks for the "system prompt" blocks
        full = await alice.generate("a2", prompt, 8, keys=keys)
        own = await alice.generate("a3", prompt, 8, start=16, keys=keys)  # now its own blocks exist
        mallory_hit = await mallory.generate("m2", prompt, 8, start=16, keys=keys)
        await alice.close()
        await mallory.close()
        return welcome, hit, full, own, mallory_hit

    welcome, hit, full, own, mallory_hit = asyncio.run(main())
    assert not set(keys) & set(welcome.cached_prefixes)  # another tenant's keys are not even listed
    assert hit[1] == "error:prefix_miss"  # mallory's states were never served to alice
    assert full[0] == ref and own[0] == ref and own[2].usage.cached_tokens == 16
    assert mallory_hit[2].usage.cached_tokens == 16 and mallory_hit[0] != ref  # mallory gets its own poison
