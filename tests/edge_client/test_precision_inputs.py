"""The precision policy's inputs across the link, on a real `autoglm-cloud serve`: the server's load, as the edge
learns it on a session it keeps open, and the prompt's length, as a client that leaves the compute variant to the
server tells it (docs/protocol.md, "Precision").

The server loads the int8 compute variant beside fp32 and runs 4 sequences, so 3 requests held open by other
sessions are a load of 0.75: the policy's int8 tier for short prompts (shared.precision)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import websockets

from edge_client.client import EdgeClient
from edge_client.demo import LocalCloud
from shared import protocol as P
from shared.codecs import get_codec
from shared.manifest import Manifest

PROMPT = [int(t) for t in np.random.RandomState(11).randint(4, 512, 20)]


@pytest.fixture(scope="module")
def busy_cloud(tiny_bundle, tmp_path_factory):
    with LocalCloud(tiny_bundle, extra_args=["--variants", "fp32,int8", "--max-num-seqs", "4"],
                    log_path=tmp_path_factory.mktemp("cloud-log") / "busy.log") as cloud:
        yield cloud


async def _hold(url: str, bundle, n: int) -> list:
    """``n`` sessions of another client, each with a request open: its first token sent, no DecodeStep back."""
    m = Manifest.load(bundle)
    links = []
    for _ in range(n):
        ws = await websockets.connect(url, max_size=None)
        await ws.send(P.encode_message(P.Hello(bundle_id=m.bundle_id, codecs=["fp16"])))
        assert isinstance(P.decode_message(await ws.recv()), P.Welcome)
        hidden = get_codec("fp16").encode(np.zeros((4, m.hidden_size), np.float32))  # [4, H]
        await ws.send(P.encode_message(P.Prefill(request_id="held", start=0, hidden=hidden,
                                                 params=P.SamplingParams(max_tokens=64))))
        assert isinstance(P.decode_message(await ws.recv()), P.Tokens)
        links.append(ws)
    return links


async def _plan(url: str, bundle, n: int, chunk: int, said: int | None) -> P.PrecisionPlan:
    """The plan the server reports for a client's request that names no compute: an ``n``-token prompt sent in
    chunks of ``chunk``, the first saying ``prompt_len=said``."""
    m = Manifest.load(bundle)
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(P.encode_message(P.Hello(bundle_id=m.bundle_id, codecs=["fp16"])))
        assert isinstance(P.decode_message(await ws.recv()), P.Welcome)
        for start in range(0, n, chunk):
            rows = min(chunk, n - start)
            hidden = get_codec("fp16").encode(np.zeros((rows, m.hidden_size), np.float32))  # [rows, H]
            first = {"params": P.SamplingParams(max_tokens=1), "prompt_len": said} if start == 0 else {}
            await ws.send(P.encode_message(P.Prefill(request_id="r", start=start, hidden=hidden,
                                                     last=start + rows == n, **first)))
        msg = P.decode_message(await ws.recv())
        assert isinstance(msg, P.Tokens) and msg.plan is not None, msg
        await ws.send(P.encode_message(P.Close()))
        return msg.plan


async def _release(links: list) -> None:
    for ws in links:  # a Close ends the session and its request at once (a dropped link would keep them a while)
        await ws.send(P.encode_message(P.Close()))
        await ws.close()


def test_a_long_lived_session_plans_its_requests_by_the_servers_load_of_late(tiny_bundle, busy_cloud):
    """The edge read the server's load once, from its Welcome: a session opened while the server was busy chose
    int8 compute (the lossiest variant, docs/quality.md) for every short prompt as long as it stayed open, the server
    long idle - and one opened while idle never took int8 however busy the server became. A request's final Tokens
    now says the load (``Tokens.load``), and the session's next request is planned by it."""
    loop = asyncio.new_event_loop()
    try:
        held = loop.run_until_complete(_hold(busy_cloud.ws_url, tiny_bundle, 3))
        with EdgeClient(tiny_bundle, busy_cloud.ws_url) as c:
            assert c.connect()["server"]["load"] == 0.75
            loop.run_until_complete(_release(held))
            # the Welcome's load is all the edge knows for its first request; its final Tokens says 1 of 4 (itself)
            assert c.complete(prompt_ids=PROMPT, max_tokens=2).stats.compute == "int8"
            assert c.complete(prompt_ids=PROMPT, max_tokens=2).stats.compute == "fp32"
            held = loop.run_until_complete(_hold(busy_cloud.ws_url, tiny_bundle, 3))
            assert c.complete(prompt_ids=PROMPT, max_tokens=2).stats.compute == "fp32"  # planned at 0.25; ends at 1
            assert c.complete(prompt_ids=PROMPT, max_tokens=2).stats.compute == "int8"
            loop.run_until_complete(_release(held))
    finally:
        loop.close()


def test_a_client_that_leaves_the_compute_to_the_server_gets_it_chosen_for_its_prompts_real_length(tiny_bundle,
                                                                                                   busy_cloud):
    """The server chose the compute variant of a request that names none at its first Prefill, and took a prompt
    not complete in it to fill at least max_prefill_chunk_tokens (2048): a 60-token prompt sent in two chunks of 30
    was planned as a long one (fp32, where the same prompt in one chunk got the busy server's int8 for short
    prompts; on a GPU server bf16 for fp16). The first Prefill may say the prompt's length (``prompt_len``); the
    server plans by it. Unsaid, the length is still unknown there, and the guess stands."""
    loop = asyncio.new_event_loop()
    try:
        held = loop.run_until_complete(_hold(busy_cloud.ws_url, tiny_bundle, 3))
        url = busy_cloud.ws_url
        assert loop.run_until_complete(_plan(url, tiny_bundle, 60, 60, None)).compute == "int8"
        assert loop.run_until_complete(_plan(url, tiny_bundle, 60, 30, 60)).compute == "int8"
        assert loop.run_until_complete(_plan(url, tiny_bundle, 60, 30, None)).compute == "fp32"
        assert loop.run_until_complete(_plan(url, tiny_bundle, 200, 100, 200)).compute == "fp32"  # not short
        loop.run_until_complete(_release(held))
    finally:
        loop.close()
