"""The precision policy's inputs across the link, on a real `autoglm-cloud serve`: the server's load, as the edge
learns it on a session it keeps open (docs/protocol.md, "Precision").

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
