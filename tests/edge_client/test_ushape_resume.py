"""Resume of u-shape requests, end to end: a real `autoglm-cloud serve` of a bundle split with ``--tail``, the edge
client, the rig's link emulator.

A cut of the link while the session survives resumes the request - the edge says which positions' States it
holds, the cloud drops its KV from there and the edge resends its inputs from there - and gives the tokens of
the uncut run: mid-decode (the step lost on the way up, or its States on the way down), mid prompt upload (some
chunks' States back, some not), with a speculative StatesStep or its States in flight. A cloud that restarted
still replays. The server refuses a claim beyond the States it returned and recomputes a lost prompt chunk's
States exactly (the raw protocol).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import websockets
from test_speculation_e2e import K, PROMPT, RETRY, SLOW

from edge_client.client import EdgeClient
from rig.link import LinkEmulator
from shared import codecs as C
from shared import protocol as P
from shared.manifest import Manifest

N_NEW = 8  # a round trip of the slow link per token: short runs
N_SPEC = 24  # enough for prompt lookup to find drafts


@pytest.fixture(scope="module")
def cloud(ushape_cloud):
    return ushape_cloud  # one server for the u-shape modules (conftest)


@pytest.fixture(scope="module")
def reference(tiny_glm4_lm, greedy_continuation) -> list[int]:
    return greedy_continuation(tiny_glm4_lm, PROMPT, N_SPEC)


def _cutting(client: EdgeClient, proxy: LinkEmulator, when, delay_s: float, prefill_pause_s: float = 0.0) -> list:
    """Every message the client sends from now on (``None`` marks the cut), cutting ``proxy`` ``delay_s`` after the
    first message for which ``when(msg, sent)`` holds; until the cut each Prefill is followed by a pause of
    ``prefill_pause_s`` (a slow front: the States of the first chunks come back while the prompt goes up)."""
    s = client.session
    sent: list = []
    real_send = s._send

    def cut():
        sent.append(None)
        proxy.cut()

    async def send(msg):
        n = await real_send(msg)
        sent.append(msg)
        if None not in sent and proxy.cuts == 0 and when(msg, sent):
            asyncio.get_running_loop().call_later(delay_s, cut)
        if prefill_pause_s and isinstance(msg, P.Prefill) and None not in sent:
            await asyncio.sleep(prefill_pause_s)
        return n

    s._send = send
    return sent


def _after_cut(sent: list) -> list:
    return sent[sent.index(None) + 1:]


def _client(bundle, proxy, **kw) -> EdgeClient:
    return EdgeClient(bundle, f"ws://127.0.0.1:{proxy.port}/v1/split", codec="fp16", retry=RETRY, **kw)


def _resumed_not_replayed(gen, proxy) -> None:
    st = gen.stats
    assert proxy.cuts == 1 and st.reconnects >= 1 and st.resumes >= 1 and st.replays == 0, st


@pytest.mark.parametrize("delay_s,lost", [(0.0, "the step"), (0.3, "its States")])
def test_cut_mid_decode_resumes_with_parity(tiny_glm4_ushape_bundle, cloud, reference, delay_s, lost):
    with LinkEmulator(cloud.port, SLOW) as proxy, _client(tiny_glm4_ushape_bundle, proxy) as c:
        sent = _cutting(c, proxy, lambda m, sent: sum(isinstance(x, P.StatesStep) for x in sent) == 3, delay_s)
        gen = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
    assert gen.token_ids == reference[:N_NEW], lost
    _resumed_not_replayed(gen, proxy)
    third = [m for m in sent if isinstance(m, P.StatesStep)][2]
    after = _after_cut(sent)
    assert not any(isinstance(m, P.Prefill) for m in after)  # nothing of the context went up again
    resent = next(m for m in after if isinstance(m, P.StatesStep))  # the step whose States the edge lacks, as sent
    assert (resent.position, resent.hidden.data) == (third.position, third.hidden.data)


def test_cut_mid_prompt_upload_resumes_with_parity(tiny_glm4_ushape_bundle, cloud, reference):
    # 8-position chunks: 6 Prefills. Cut 0.3 s after the 4th: the States of the first three have reached the
    # edge (unread: it reads after the upload), the 4th chunk's are computed but still on the way down.
    with LinkEmulator(cloud.port, SLOW) as proxy, _client(tiny_glm4_ushape_bundle, proxy, prefill_chunk=8) as c:
        sent = _cutting(c, proxy, lambda m, sent: sum(isinstance(x, P.Prefill) for x in sent) == 4, 0.3,
                        prefill_pause_s=0.5)
        gen = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
    assert gen.token_ids == reference[:N_NEW]
    _resumed_not_replayed(gen, proxy)
    before = [m.start for m in sent[:sent.index(None)] if isinstance(m, P.Prefill)]
    again = [m.start for m in _after_cut(sent) if isinstance(m, P.Prefill)]
    assert before[:4] == [0, 8, 16, 24] and again and again[0] > 0  # the held chunks' States were kept
    assert again[0] <= before[-1] and again == list(range(again[0], len(PROMPT), 8))  # the rest, once each
    assert all(m.params is None for m in _after_cut(sent) if isinstance(m, P.Prefill))  # the same request


@pytest.mark.parametrize("delay_s,lost", [pytest.param(0.0, "the speculative step", marks=pytest.mark.slow),
                                          (0.3, "its States")])
def test_cut_with_a_speculative_step_in_flight_resumes_with_parity(tiny_glm4_ushape_bundle, cloud, reference,
                                                                   delay_s, lost):
    n = N_SPEC
    with LinkEmulator(cloud.port, SLOW) as proxy, _client(tiny_glm4_ushape_bundle, proxy, draft_k=K) as c:
        sent = _cutting(c, proxy, lambda m, sent: isinstance(m, P.StatesStep) and m.n_tokens > 1, delay_s)
        gen = c.complete(prompt_ids=PROMPT, max_tokens=n, speculate=True)
    assert gen.token_ids == reference[:n], lost
    _resumed_not_replayed(gen, proxy)
    spec = next(m for m in sent if isinstance(m, P.StatesStep) and m.n_tokens > 1)
    resent = next(m for m in _after_cut(sent) if isinstance(m, P.StatesStep))
    assert (resent.position, resent.n_tokens, resent.hidden.data) == (spec.position, spec.n_tokens, spec.hidden.data)
    assert gen.stats.accepted_draft_tokens > 0


def test_a_restarted_server_replays_with_parity(tiny_glm4_ushape_bundle, cloud, reference):
    # the module's server (shared, conftest): killed mid-generation and restarted on its port, it stays up after
    with EdgeClient(tiny_glm4_ushape_bundle, cloud.ws_url, codec="fp16", retry=RETRY) as c:
        s = c.session
        real_send = s._send
        steps = []

        async def send(msg):
            if isinstance(msg, P.StatesStep):
                steps.append(msg.position)
                if len(steps) == 3:
                    await asyncio.to_thread(cloud.kill)  # the server dies as the step goes out...
                    await asyncio.to_thread(cloud.start)  # ...and a fresh one comes up on the same port
            return await real_send(msg)  # (the third on the dead connection: lost)

        s._send = send
        gen = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
    assert gen.token_ids == reference[:N_NEW]
    assert gen.stats.replays == 1 and gen.stats.resumes == 0


# -- the raw protocol ---------------------------------------------------------------------------------


def _rows(bundle, n: int, seed: int) -> np.ndarray:
    h = Manifest.load(bundle).hidden_size
    return np.random.RandomState(seed).standard_normal((n, h)).astype(np.float32)


async def _link(url: str, bundle_id: str, token: str | None = None):
    ws = await websockets.connect(url, max_size=None)
    await ws.send(P.encode_message(P.Hello(bundle_id=bundle_id, codecs=["fp16"], resume_token=token)))
    welcome = P.decode_message(await ws.recv())
    assert isinstance(welcome, P.Welcome), welcome
    return ws, welcome


async def _next(ws, kind):
    while True:
        msg = P.decode_message(await asyncio.wait_for(ws.recv(), 30))
        if isinstance(msg, kind) or isinstance(msg, P.Error):
            return msg


def test_the_server_rolls_a_prompt_back_and_refuses_claims_beyond_its_states(tiny_glm4_ushape_bundle, cloud):
    bundle_id = Manifest.load(tiny_glm4_ushape_bundle).bundle_id
    fp16 = C.get_codec("fp16")
    rows = _rows(tiny_glm4_ushape_bundle, 12, 5)

    def prefill(rid, start, n, last=False, **kw):
        return P.encode_message(P.Prefill(request_id=rid, start=start, hidden=fp16.encode(rows[start:start + n]),
                                          last=last, **kw))

    async def run():
        ws, w = await _link(cloud.ws_url, bundle_id)
        first = {"params": P.SamplingParams(max_tokens=4), "return_states": True}
        await ws.send(prefill("u", 0, 4, **first))
        await ws.send(prefill("u", 4, 4))
        got = [await _next(ws, P.States), await _next(ws, P.States)]
        await ws.send(prefill("v", 0, 4, **first))
        v_states = await _next(ws, P.States)
        await ws.close()  # the link drops: the session waits for its resume

        ws, w2 = await _link(cloud.ws_url, bundle_id, w.resume_token)
        assert w2.resumed
        await ws.send(P.encode_message(P.Resume(request_id="v", have_tokens=5)))  # beyond the 4 returned
        refused = await _next(ws, P.Resumed)
        await ws.send(P.encode_message(P.Resume(request_id="u", have_tokens=4)))  # [4, 8)'s States "lost"
        resumed = await _next(ws, P.Resumed)
        await ws.send(prefill("u", 4, 4))  # resent as first sent: computed again over the kept [0, 4)
        again = await _next(ws, P.States)
        await ws.send(prefill("u", 8, 4, last=True))
        tail = await _next(ws, P.States)
        await ws.send(P.encode_message(P.Close(reason="done")))  # the session ends: nothing left to drain
        await ws.close()
        return got, v_states, refused, resumed, again, tail

    got, v_states, refused, resumed, again, tail = asyncio.run(run())
    assert [(m.start, m.n_tokens) for m in got] == [(0, 4), (4, 4)] and isinstance(v_states, P.States)
    assert isinstance(refused, P.Error) and (refused.code, refused.request_id) == ("bad_position", "v")
    assert isinstance(resumed, P.Resumed) and (resumed.request_id, resumed.received) == ("u", 4)
    assert isinstance(again, P.States) and (again.start, again.n_tokens) == (4, 4)
    np.testing.assert_allclose(fp16.decode(again.hidden), fp16.decode(got[1].hidden), atol=2e-3)
    assert isinstance(tail, P.States) and (tail.start, tail.n_tokens) == (8, 4)
