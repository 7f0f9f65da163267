"""The catalogue of bad inputs over the WebSocket (docs/reliability.md): each case is answered with its documented
error (docs/protocol.md's codes and close codes, HTTP 401) while a bystander session on the same server streams
its tokens exactly as it does alone. One server for the module; ``-s`` prints the table.

    python -m pytest -s tests/cloud_server/test_bad_inputs.py
"""

from __future__ import annotations

import asyncio
import re
import socket
import time

import numpy as np
import pytest
import websockets
import zstandard
from cloud_support import EdgeSim, edge_front, serving
from websockets.exceptions import ConnectionClosed

from cloud_server import auth
from cloud_server.config import EngineConfig, ServerConfig
from shared import codecs as C
from shared import protocol as P
from shared.manifest import Manifest

H = 64  # tiny-glm4's hidden size
MAX_CONTEXT = 64
MAX_PROMPT = 48  # --max-prompt-tokens: below the context, so a prompt may be refused while generation goes on
HANDSHAKE_S = 1.0
BYSTANDER = [17, 200, 31, 5, 99, 140, 7, 63, 250]
FLOOD_TCP, FLOOD_WS = 200, 50


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    keys = tmp_path_factory.mktemp("cat-keys") / "keys.json"
    _, key = auth.add_key(keys, "catalogue")
    engine = EngineConfig(num_blocks=256, block_size=4, max_model_len=MAX_CONTEXT, max_num_batched_tokens=256)
    with serving(ServerConfig(bundle=tiny_bundle, engine=engine, keys_file=keys, handshake_timeout_s=HANDSHAKE_S,
                              session_grace_s=0.5, max_prompt_tokens=MAX_PROMPT)) as srv:
        srv.key, srv.bundle_id = key, Manifest.load(tiny_bundle).bundle_id
        yield srv


@pytest.fixture(scope="module")
def front(tiny_bundle):
    return edge_front(tiny_bundle)


def _h(n: int, width: int = H) -> P.EncodedTensor:
    return C.get_codec("fp16").encode(np.zeros((n, width), np.float32))


def _params(n: int = 4) -> P.SamplingParams:
    return P.SamplingParams(max_tokens=n, temperature=0.0)


class Probe:
    """A raw WebSocket to the server: send anything, read what comes back (an Error, then the close code)."""

    def __init__(self, server, key: str | None = "default"):
        self.server = server
        self.key = server.key if key == "default" else key
        self.ws = None

    async def open(self, hello: bool = True, **hello_kw):
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        self.ws = await websockets.connect(self.server.ws_url, additional_headers=headers, max_size=None)
        if hello:
            await self.send(P.Hello(bundle_id=hello_kw.pop("bundle_id", self.server.bundle_id),
                                    codecs=hello_kw.pop("codecs", ["fp16"]), **hello_kw))
            return await self.recv()
        return None

    async def send(self, msg) -> None:
        await self.ws.send(msg if isinstance(msg, (bytes, str)) else P.encode_message(msg))

    async def recv(self, timeout: float = 30.0):
        return P.decode_message(await asyncio.wait_for(self.ws.recv(), timeout))

    async def answer(self) -> tuple[str | None, int | None]:
        """(error code of the next Error, or None; close code if the server then closed, else None)."""
        code = None
        try:
            msg = await self.recv()
            code = msg.code if isinstance(msg, P.Error) else type(msg).__name__
            await asyncio.wait_for(self.ws.recv(), 0.5)  # the close follows a fatal Error
        except ConnectionClosed as e:
            return code, e.rcvd.code if e.rcvd else None
        except asyncio.TimeoutError:
            pass
        return code, None


async def _fatal_first_frame(server, frame) -> tuple:
    p = Probe(server)
    await p.open(hello=False)
    await p.send(frame)
    return await p.answer()


async def _per_request(server, msg) -> tuple:
    """Send ``msg`` on an open session: a request's fault fails that request and the session stays open (a
    Close then ends it cleanly); a frame that does not decode ends the session."""
    p = Probe(server)
    await p.open()
    await p.send(msg)
    out = await p.answer()
    if out[1] is None:
        await p.send(P.Close())
    return out


def _bomb() -> P.EncodedTensor:
    payload = zstandard.ZstdCompressor().compress(b"\0" * (256 << 20))  # 256 MiB of zeros in ~8 KiB
    return P.EncodedTensor(codec="fp16", shape=(4, H), data=payload, zstd=True)


def _nonfinite(value: float) -> P.EncodedTensor:
    """fp16 hidden states with one ``value`` (NaN, Inf) in them, written into the bytes (the encoder refuses)."""
    t = _h(4)
    data = bytearray(t.data)
    data[2:4] = np.array([value], np.float16).tobytes()
    return P.EncodedTensor(codec="fp16", shape=t.shape, data=bytes(data))


async def _http_status(server, key: str | None) -> tuple:
    with pytest.raises(websockets.InvalidStatus) as e:
        await Probe(server, key).open()
    return "http", e.value.response.status_code


async def _oversize(server, extra: int) -> tuple:
    p = Probe(server)
    await p.open()
    limit = P.SessionLimits().max_frame_bytes
    rows = (limit + extra) // (2 * H) + 1
    try:
        await p.send(P.Prefill(request_id="big", start=0, hidden=_h(rows), params=_params()))
    except websockets.ConnectionClosed as e:  # uncompressed (no permessage-deflate), the server's 1009 can come
        return None, e.rcvd.code if e.rcvd else None  # while the frame is still being written
    out = await p.answer()
    if out[1] is None:
        await p.send(P.Close())
    return out


# name -> (coroutine factory, documented answer: (Error code, close code or None = session stays open))
CATALOGUE = {
    "malformed msgpack": (lambda s: _fatal_first_frame(s, b"\xc1\x93\xff\x00garbage"), ("bad_frame", 1002)),
    "text frame": (lambda s: _fatal_first_frame(s, "hello"), ("bad_frame", 1002)),
    "wrong order: Prefill before Hello": (
        lambda s: _fatal_first_frame(s, P.encode_message(P.Prefill(request_id="r", start=0, hidden=_h(2),
                                                                   params=_params()))), ("bad_state", 1002)),
    "wrong order: DecodeStep of no request": (
        lambda s: _per_request(s, P.DecodeStep(request_id="nope", position=3, hidden=_h(1))),
        ("unknown_request", None)),
    "frame over max_frame_bytes (within slack)": (lambda s: _oversize(s, 1024), ("too_large", None)),
    "frame over max_frame_bytes + 1 MiB": (lambda s: _oversize(s, 2 << 20), (None, 1009)),
    "zstd decompression bomb": (
        lambda s: _per_request(s, P.Prefill(request_id="z", start=0, hidden=_bomb(), params=_params())),
        ("decompress", 1002)),  # the frame's zstd header is checked before any allocation: fatal
    "NaN in hidden states": (
        lambda s: _per_request(s, P.Prefill(request_id="n", start=0, hidden=_nonfinite(np.nan), params=_params())),
        ("bad_tensor", None)),
    "Inf in hidden states": (
        lambda s: _per_request(s, P.Prefill(request_id="i", start=0, hidden=_nonfinite(np.inf), params=_params())),
        ("bad_tensor", None)),
    "wrong-shape hidden states": (
        lambda s: _per_request(s, P.Prefill(request_id="w", start=0, hidden=_h(3, width=H // 2), params=_params())),
        ("bad_input", None)),
    "wide hidden states, a few payload bytes": (  # the width is refused before the payload is decoded
        lambda s: _per_request(s, P.Prefill(request_id="wide", start=0, hidden=P.EncodedTensor(
            codec="fp16", shape=(3, 1 << 20), data=b"\0" * 6), params=_params())), ("bad_input", None)),
    "unknown codec (Hello)": (lambda s: _hello_refusal(s, codecs=["fp7"]), ("codec_not_negotiated", 1008)),
    "codec not negotiated (Prefill)": (
        lambda s: _per_request(s, P.Prefill(request_id="c", start=0, hidden=C.get_codec("int8-b32").encode(
            np.zeros((4, H), np.float32)), params=_params())), ("codec_not_negotiated", None)),
    "wrong bundle id": (lambda s: _hello_refusal(s, bundle_id="b" * 16), ("bundle_mismatch", 1008)),
    "missing API key": (lambda s: _http_status(s, None), ("http", 401)),
    "invalid API key": (lambda s: _http_status(s, "agk_" + "x" * 43), ("http", 401)),
    "prompt over max_context": (
        lambda s: _per_request(s, P.Prefill(request_id="long", start=0, hidden=_h(MAX_CONTEXT + 1),
                                            params=_params())), ("context_full", None)),
    "prompt over max_prompt_tokens": (
        lambda s: _per_request(s, P.Prefill(request_id="prompt", start=0, hidden=_h(MAX_PROMPT + 1),
                                            params=_params())), ("prompt_too_long", None)),
}


async def _hello_refusal(server, **hello_kw) -> tuple:
    p = Probe(server)
    first = await p.open(**hello_kw)
    try:
        await asyncio.wait_for(p.ws.recv(), 2.0)
    except ConnectionClosed as e:
        return (first.code if isinstance(first, P.Error) else type(first).__name__), e.rcvd.code if e.rcvd else None
    return first.code, None


async def _bystander(server, front, tiny_bundle, pause: float) -> list[int]:
    edge = EdgeSim(server.ws_url, tiny_bundle, server.bundle_id, front=front, api_key=server.key)
    await edge.connect()
    front_fork = edge.front.fork()
    await edge.prefill("b", front_fork, BYSTANDER, P.SamplingParams(max_tokens=24, temperature=0.0,
                                                                    ignore_eos=True))
    tokens: list[int] = []
    while True:
        msg = await edge.recv()
        assert isinstance(msg, P.Tokens), msg
        tokens += msg.token_ids
        if msg.finish_reason:
            break
        await asyncio.sleep(pause)  # a slow phone: its session spans the whole catalogue
        from cloud_support import boundary

        await edge.send(P.DecodeStep(request_id="b", position=len(BYSTANDER) + len(tokens) - 1,
                                     hidden=edge.encode(boundary(front_fork, [tokens[-1]]))))
    await edge.close()
    return tokens


def test_every_bad_input_gets_its_documented_answer_while_a_bystander_streams(server, front, tiny_bundle):
    async def main():
        alone = await _bystander(server, front, tiny_bundle, 0.0)
        beside = asyncio.create_task(_bystander(server, front, tiny_bundle, 0.1))
        seen = {name: await make(server) for name, (make, _) in CATALOGUE.items()}
        return alone, await beside, seen

    alone, beside, seen = asyncio.run(main())
    print(f"\n{'case':45s} {'answer':32s} documented")
    for name, (_, want) in CATALOGUE.items():
        print(f"{name:45s} {str(seen[name]):32s} {'yes' if seen[name] == want else 'NO: ' + str(want)}")
    assert {n: seen[n] for n in CATALOGUE} == {n: w for n, (_, w) in CATALOGUE.items()}
    assert beside == alone and len(alone) == 24  # the bystander's tokens did not change
    print(f"{len(CATALOGUE)} cases, each answered as documented; bystander: {len(beside)} tokens, identical")


def test_a_frame_too_large_to_read_ends_the_session(server):
    """A frame beyond max_frame_bytes + 1 MiB (not read: close 1009) left the session resumable, its open request
    holding KV, where a fatal too_large (a frame within the slack naming no request) ends it, as docs/protocol.md
    says of a fatal Error: a reconnect with the resume token is a new session."""
    async def main():
        p = Probe(server)
        welcome = await p.open()
        await p.send(P.Prefill(request_id="r", start=0, hidden=_h(4), params=_params(8)))
        assert isinstance(await p.recv(), P.Tokens)  # a request open, waiting for its next step
        try:
            await p.send(b"\0" * (P.SessionLimits().max_frame_bytes + (2 << 20)))
            closed = (await p.answer())[1]
        except ConnectionClosed as e:
            closed = e.rcvd.code if e.rcvd else None
        again = Probe(server)
        await again.open(hello=False)
        await again.send(P.Hello(bundle_id=server.bundle_id, codecs=["fp16"], resume_token=welcome.resume_token))
        resumed = await again.recv()
        await again.send(P.Close())
        return closed, resumed

    closed, resumed = asyncio.run(main())
    assert closed == 1009
    assert isinstance(resumed, P.Welcome) and not resumed.resumed, resumed


def test_a_fatal_too_large_closes_1009_wherever_it_is_found(server):
    """docs/protocol.md: a fatal ``too_large`` closes 1009, as the read loop's decoder limits did; a msgpack array over
    them as the first frame (the handshake) and a frame over max_frame_bytes naming no request (a Close with a large
    trailing field, "fatal (too_large)") were closed 1002, so a client could not tell them from a protocol error."""
    import msgpack

    async def main():
        first = await _fatal_first_frame(server, b"\xdd\xff\xff\xff\xff\x01")  # array32 of 2^32 - 1 entries
        p = Probe(server)
        await p.open()
        await p.send(msgpack.packb([10, "", b"\0" * (P.SessionLimits().max_frame_bytes + 100)], use_bin_type=True))
        return first, await p.answer()

    assert asyncio.run(main()) == (("too_large", 1009), ("too_large", 1009))


def test_a_hello_over_max_frame_bytes_is_a_fatal_too_large(server):
    """A frame over max_frame_bytes that names no request is fatal (docs/protocol.md, "Session state machine"): a Hello
    of 16 MiB and more (a large trailing field, which receivers otherwise ignore) was welcomed. The server now
    refuses any first message over 64 KiB as it arrives (1009, test below); the rulebook's own refusal
    (shared.session_state, the scripted server's too) is what a Hello between the two limits would meet."""
    import msgpack

    from shared.session_state import SessionError, SessionState

    pad = b"\0" * (P.SessionLimits().max_frame_bytes + 100)
    hello = msgpack.packb([1, 1, server.bundle_id, ["fp16"], [], None, pad], use_bin_type=True)
    with pytest.raises(SessionError) as refused:
        SessionState().on_client(P.decode_message(hello), len(hello))
    assert refused.value.code == "too_large" and refused.value.fatal

    async def main():
        p = Probe(server)
        await p.open(hello=False)
        try:
            await p.send(hello)
        except ConnectionClosed as e:  # refused while it was still being written
            return None, e.rcvd.code if e.rcvd else None
        return await p.answer()

    assert asyncio.run(main())[1] == 1009


def test_a_first_message_is_not_held_past_64_kib(server):
    """Before its Hello a connection could make the server hold a frame of up to max_frame_bytes + 1 MiB (17 MiB)
    until the handshake timeout: 20 such connections held 330 MB of RSS, --max-connections (2048) of them 34 GB.
    A first message - a Hello, a few hundred bytes - over 64 KiB now fails the link at once (close 1009)."""
    import base64
    import os
    import struct

    host, port = server.ws_url.split("//")[1].split("/")[0].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    try:
        sock.sendall((f"GET /v1/split HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
                      f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {server.key}\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 101"), head
        t0 = time.monotonic()
        sock.sendall(struct.pack("!BBQ", 0x82, 0x80 | 127, 16 << 20) + b"\0" * 4 + b"\0" * (100 << 10))  # masked
        got = head.partition(b"\r\n\r\n")[2]
        while len(got) < 4:
            more = sock.recv(4096)
            assert more, "closed without a close frame"
            got += more
        waited = time.monotonic() - t0
    finally:
        sock.close()
    assert got[0] == 0x88 and struct.unpack("!H", got[2:4])[0] == 1009, got[:40]  # a close frame, no Error first
    assert waited < HANDSHAKE_S, waited  # at once, not at the handshake timeout


def test_an_error_echoing_non_ascii_input_still_closes_with_its_code(server):
    """A fatal Error's message quotes the offending value (a request id of 64 'é', a bundle id of emoji); the close
    reason was that message cut to 120 characters - over the 123 bytes a close frame carries in UTF-8 - so the
    close failed and the client saw the link drop (1006, no code) instead of 1002."""
    import msgpack

    async def after_hello():
        p = Probe(server)
        await p.open()
        await p.send(msgpack.packb([6, "\u00e9" * 64], use_bin_type=True))  # Cancel: not an id
        return await p.answer()

    hello = msgpack.packb([1, 1, "\U0001F600" * 100, ["fp16"]], use_bin_type=True)
    assert asyncio.run(after_hello()) == ("bad_value", 1002)
    assert asyncio.run(_fatal_first_frame(server, hello)) == ("bad_value", 1002)


def _refused(server) -> dict[str, float]:
    import httpx

    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {r: float(v) for r, v in re.findall(r'^autoglm:sessions_refused_total\{[^}]*reason="([^"]+)"[^}]*\} (\S+)$',
                                               text, re.M)}


def test_every_refused_session_is_counted_by_its_reason(server):
    """autoglm:sessions_refused_total counted bundle_mismatch, draining and the session caps only: a fleet of phones
    refused for their protocol version or their codecs (an upgrade gone wrong), or for a bad first frame, showed
    no refusal on the dashboard."""
    async def main():
        await _hello_refusal(server, codecs=["fp7"])
        await _fatal_first_frame(server, b"\xc1\x93\xff\x00garbage")
        return await _hello_refusal(server, protocol_version=P.PROTOCOL_VERSION + 1)  # a later major version

    before = _refused(server)
    version = asyncio.run(main())
    after = _refused(server)
    assert version == ("version", 1008)
    assert {r: after.get(r, 0) - before.get(r, 0) for r in ("codec_not_negotiated", "bad_frame", "version")} == \
        {"codec_not_negotiated": 1, "bad_frame": 1, "version": 1}, (before, after)


def test_sockets_that_never_send_a_whole_request_head_are_closed_at_the_handshake_timeout(server):
    """A socket that sent nothing, or half a request head, and then went silent (a phone losing coverage during its
    upgrade: no FIN, no RST) was kept for ever - the server's descriptors only grew. Closed at the handshake timeout
    now; one that finished its request in time is answered, and its keep-alive connection is held to the same
    deadline for its next head."""
    port = int(server.url.rsplit(":", 1)[1])
    silent = socket.create_connection(("127.0.0.1", port))
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"GET /v1/split HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n")
    kept = socket.create_connection(("127.0.0.1", port))
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    time.sleep(HANDSHAKE_S / 2)
    kept.sendall(b"GET /hea")  # the next request's head, begun and never finished
    t0 = time.monotonic()
    ends = []
    for s in (silent, half, kept):
        s.settimeout(HANDSHAKE_S + 10)
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except ConnectionResetError:
            pass
        ends.append(got)
        s.close()
    assert ends[0] == ends[1] == b"" and ends[2].startswith(b"HTTP/1.1 200 ") and ends[2].count(b"HTTP/1.1") == 1
    assert time.monotonic() - t0 < HANDSHAKE_S + 5


def test_a_flood_of_idle_and_half_open_sockets_is_shed_and_a_session_still_serves(server, front, tiny_bundle):
    """Raw TCP sockets that never speak, half-sent HTTP upgrades, and WebSockets that never send Hello: the
    honest session is served through it, the WebSockets are closed at the handshake timeout (bad_state)."""
    async def main():
        tcp = [socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) for _ in range(FLOOD_TCP)]
        for s in tcp[: FLOOD_TCP // 2]:  # half-open upgrades: a request line and no end of headers
            s.sendall(b"GET /v1/split HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n")
        idle = [Probe(server) for _ in range(FLOOD_WS)]
        await asyncio.gather(*(p.open(hello=False) for p in idle))
        served = await _bystander(server, front, tiny_bundle, 0.0)
        answers = await asyncio.gather(*(p.answer() for p in idle))
        for s in tcp:
            s.close()
        return served, answers

    served, answers = asyncio.run(main())
    assert len(served) == 24
    assert answers == [("bad_state", 1002)] * FLOOD_WS  # closed at the handshake timeout
    print(f"\nflood: {FLOOD_TCP} idle/half-open TCP sockets + {FLOOD_WS} silent WebSockets; honest session served "
          f"{len(served)} tokens; silent WebSockets closed after {HANDSHAKE_S:g} s")
