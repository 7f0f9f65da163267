"""Protocol abuse against the real server: one test per rule of the session state machine (docs/protocol.md,
"Session state machine"), each refused with its documented error code while an honest session on the same
server keeps streaming the unsplit model's greedy tokens. One server for the whole module."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import websockets
from cloud_support import EdgeSim, edge_front, greedy_reference, serving

from cloud_server import split_endpoint
from cloud_server.config import EngineConfig, ServerConfig
from cloud_server.split_endpoint import HELLO_TIMEOUT_S, OVERSIZE_SLACK, session_limits
from shared import codecs as C
from shared import protocol as P
from shared.manifest import Manifest

H = 64  # tiny-glm4's hidden size
MAX_CONTEXT, MAX_CHUNK, MAX_SEQS, STEP_TIMEOUT_S = 64, 32, 8, 3.0
HONEST = [17, 200, 31, 5, 99, 140, 7, 63, 250]  # the bystander's prompt
DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


@pytest.fixture(scope="module")
def server(tiny_bundle):
    engine = EngineConfig(num_blocks=256, block_size=4, max_model_len=MAX_CONTEXT, max_num_batched_tokens=MAX_CHUNK,
                          max_num_seqs=MAX_SEQS)
    with serving(ServerConfig(bundle=tiny_bundle, engine=engine, step_timeout_s=STEP_TIMEOUT_S,
                              session_grace_s=0.5)) as srv:
        yield srv


@pytest.fixture(scope="module")
def front(tiny_bundle):
    return edge_front(tiny_bundle)


@pytest.fixture(scope="module")
def honest_reference(tiny_lm):
    return greedy_reference(tiny_lm.model, HONEST, 12, [2, 3])


def _edge(server, bundle, front) -> EdgeSim:
    return EdgeSim(server.ws_url, bundle, Manifest.load(bundle).bundle_id, front=front)


def _h(n: int, width: int = H) -> P.EncodedTensor:
    return C.get_codec("fp16").encode(np.zeros((n, width), np.float32))


def _prefill(rid: str, start: int, n: int, last: bool = True, params: bool = True, **kw) -> P.Prefill:
    return P.Prefill(request_id=rid, start=start, hidden=_h(n), last=last,
                     params=P.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True) if params else None, **kw)


async def _error(edge: EdgeSim, code: str, rid: str | None) -> P.Error:
    """The next message for ``rid`` must be a non-fatal Error with ``code`` (Tokens of other requests skipped)."""
    while True:
        msg = await edge.recv(timeout=30)
        if isinstance(msg, P.Tokens) and msg.request_id != rid:
            continue
        assert isinstance(msg, P.Error), msg
        assert (msg.code, msg.request_id, msg.fatal) == (code, rid, False), msg
        return msg


async def _first_token(edge: EdgeSim, rid: str) -> P.Tokens:
    msg = await edge.recv(timeout=30)
    assert isinstance(msg, P.Tokens) and msg.request_id == rid, msg
    return msg


def _abuse(server, bundle, front, reference, abuse) -> object:
    """Run ``abuse(edge)`` on its own session while an honest session streams; then the abusive session must
    still serve a correct request. Returns what ``abuse`` returned."""

    async def honest():
        edge = _edge(server, bundle, front)
        await edge.connect()
        tokens, _, _ = await edge.generate("honest", HONEST, 12)
        await edge.close()
        return tokens

    async def abusive():
        edge = _edge(server, bundle, front)
        await edge.connect()
        out = await abuse(edge)
        if edge.ws.close_code is None:  # a non-fatal refusal: the session serves on
            tokens, _, _ = await edge.generate("after", HONEST, 12)
            assert tokens == reference
            await edge.close()
        return out

    async def main():
        return await asyncio.gather(honest(), abusive())

    honest_tokens, out = asyncio.run(main())
    assert honest_tokens == reference
    return out


def test_welcome_sends_the_documented_defaults(server, tiny_bundle, front):
    """One source of the numbers: the server's derivation from its configuration, whose defaults give the
    protocol's SessionLimits defaults, which docs/protocol.md lists; and the Welcome carries exactly it."""
    defaults = session_limits(ServerConfig(bundle=tiny_bundle))
    assert defaults == P.SessionLimits()
    table = dict(re.findall(r"^\| `(\w+)` \| (\d+) \|", DOC.read_text(), re.M))
    documented = {k: int(v) for k, v in table.items()}
    for name in P.SessionLimits.__dataclass_fields__:
        assert documented[name] == getattr(defaults, name), name
    assert documented["hello_timeout_ms"] == HELLO_TIMEOUT_S * 1000
    assert documented["step_timeout_ms"] == ServerConfig(bundle=tiny_bundle).step_timeout_s * 1000
    assert documented["oversize_slack_bytes"] == OVERSIZE_SLACK
    assert documented["outbox_pause_bytes"] == split_endpoint.OUTBOX_PAUSE_BYTES
    assert documented["outbox_stall_s"] == split_endpoint.OUTBOX_STALL_S

    async def main():
        edge = _edge(server, tiny_bundle, front)
        welcome = await edge.connect()
        await edge.close()
        return welcome

    assert asyncio.run(main()).limits == session_limits(server.runtime.config)


def test_a_prefill_over_max_prefill_chunk_tokens_is_too_large(server, tiny_bundle, front, honest_reference):
    async def abuse(edge):
        await edge.send(_prefill("big", 0, MAX_CHUNK + 1))
        await _error(edge, "too_large", "big")
        await edge.send(_prefill("big", MAX_CHUNK + 1, 2, params=False))  # its late chunk: ignored silently

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def test_a_frame_over_max_frame_bytes_fails_its_request_only(server, tiny_bundle, front, honest_reference):
    limit = P.SessionLimits().max_frame_bytes
    width = (limit + 64 * 1024) // 2  # one fp16 row: a frame just over the limit, within the slack the server reads

    async def abuse(edge):
        wide = P.EncodedTensor(codec="fp16", shape=(1, width), data=bytes(2 * width))
        frame = P.encode_message(P.Prefill(request_id="huge", start=0, hidden=wide, params=P.SamplingParams()))
        assert limit < len(frame) < limit + OVERSIZE_SLACK
        await edge.ws.send(frame)
        err = await _error(edge, "too_large", "huge")
        assert "frame" in err.message

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def test_a_prefill_after_the_last_one_is_bad_state(server, tiny_bundle, front, honest_reference):
    async def abuse(edge):
        await edge.send(_prefill("r", 0, 3))
        await _first_token(edge, "r")
        await edge.send(_prefill("r", 3, 1, params=False))
        await _error(edge, "bad_state", "r")

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def test_a_decode_step_before_its_prefill_is_complete_is_bad_state(server, tiny_bundle, front, honest_reference):
    async def abuse(edge):
        await edge.send(_prefill("r", 0, 3, last=False))
        await edge.send(P.DecodeStep(request_id="r", position=3, hidden=_h(1)))
        await _error(edge, "bad_state", "r")

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def test_a_second_decode_step_for_one_token_is_bad_state(server, tiny_bundle, front, honest_reference):
    async def abuse(edge):
        # The two steps are two frames: if the server reads the second only after token 1 went out (a loaded
        # machine), that step was due and the rule is not exercised - that attempt is cancelled and another made.
        for attempt in range(5):
            rid = f"r{attempt}"
            await edge.send(P.Prefill(request_id=rid, start=0, hidden=_h(3),
                                      params=P.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
            await _first_token(edge, rid)
            await edge.send(P.DecodeStep(request_id=rid, position=3, hidden=_h(1)))
            await edge.send(P.DecodeStep(request_id=rid, position=4, hidden=_h(1)))  # nobody asked for this one
            while True:
                msg = await edge.recv(timeout=30)
                if isinstance(msg, P.Error):
                    assert (msg.code, msg.request_id, msg.fatal) == ("bad_state", rid, False)
                    return
                assert isinstance(msg, P.Tokens) and msg.request_id == rid, msg
                if msg.index == 2:  # the second step was read after token 1: it was due
                    break
                assert msg.index == 1  # the answer to the first step may come first
            await edge.send(P.Cancel(request_id=rid))
            while not (isinstance(msg, P.Tokens) and msg.finish_reason is not None):
                msg = await edge.recv(timeout=30)
        raise AssertionError("in every attempt token 1 went out before the second step was read")

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def test_messages_for_an_unknown_request_are_unknown_request(server, tiny_bundle, front, honest_reference):
    async def abuse(edge):
        await edge.send(P.DecodeStep(request_id="ghost", position=0, hidden=_h(1)))
        await _error(edge, "unknown_request", "ghost")
        await edge.send(_prefill("ghost2", 4, 2, params=False))  # a continuation of nothing
        await _error(edge, "unknown_request", "ghost2")

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def test_a_used_request_id_is_duplicate_request(server, tiny_bundle, front, honest_reference):
    async def abuse(edge):
        await edge.send(_prefill("r", 0, 3, last=False))
        await edge.send(_prefill("r", 3, 1))  # params again on an open request
        await _error(edge, "duplicate_request", "r")
        await edge.send(_prefill("r", 0, 3))  # and after it closed: the id stays used
        await _error(edge, "duplicate_request", "r")

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def test_a_later_chunk_with_return_states_or_prefix_keys_is_bad_state(server, tiny_bundle, front, honest_reference):
    """Fields only the first Prefill decides, sent again on a later chunk, were silently ignored."""
    async def abuse(edge):
        for rid, change in (("u", {"return_states": True}), ("k", {"prefix_keys": ["k0"]})):
            await edge.send(_prefill(rid, 0, 3, last=False))
            await edge.send(_prefill(rid, 3, 1, params=False, **change))
            err = await _error(edge, "bad_state", rid)
            assert next(iter(change)) in err.message
            await edge.send(_prefill(rid, 4, 1, params=False))  # the request closed: its late chunks are ignored

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def test_positions_that_skip_or_repeat_are_bad_position(server, tiny_bundle, front, honest_reference):
    async def abuse(edge):
        await edge.send(_prefill("gap", 0, 3, last=False))
        await edge.send(_prefill("gap", 4, 2, params=False))
        await _error(edge, "bad_position", "gap")
        await edge.send(_prefill("step", 0, 3))
        await _first_token(edge, "step")
        await edge.send(P.DecodeStep(request_id="step", position=2, hidden=_h(1)))
        await _error(edge, "bad_position", "step")
        await edge.send(_prefill("pfx", 6, 2, prefix_keys=["a", "b"]))  # a prefix of 6: not whole blocks of 4
        await _error(edge, "bad_position", "pfx")
        await edge.send(_prefill("pfx2", 12, 2, prefix_keys=["a", "b"]))  # 3 blocks named by 2 keys
        await _error(edge, "bad_position", "pfx2")

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def test_positions_beyond_max_context_are_context_full(server, tiny_bundle, front, honest_reference):
    async def abuse(edge):
        await edge.send(_prefill("long", 0, MAX_CHUNK, last=False))
        await edge.send(_prefill("long", MAX_CHUNK, MAX_CHUNK, last=False, params=False))
        await edge.send(_prefill("long", 2 * MAX_CHUNK, 1, params=False))  # position 64 = max_context
        await _error(edge, "context_full", "long")

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def test_a_codec_not_negotiated_is_refused(server, tiny_bundle, front, honest_reference):
    async def abuse(edge):
        t = C.get_codec("bf16").encode(np.zeros((2, H), np.float32))  # the session negotiated fp16 only
        await edge.send(P.Prefill(request_id="r", start=0, hidden=t, params=P.SamplingParams()))
        await _error(edge, "codec_not_negotiated", "r")

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def _raw_frame(payload: bytes) -> bytes:
    """One masked (key 0) binary WebSocket frame of ``payload`` (< 64 KiB), as a client sends it."""
    n = len(payload)
    return bytes([0x82, 0x80 | n]) + bytes(4) + payload if n < 126 else \
        bytes([0x82, 0xFE]) + n.to_bytes(2, "big") + bytes(4) + payload


def test_a_client_that_does_not_read_its_replies_is_not_read_either(server, tiny_bundle, front, honest_reference,
                                                                    monkeypatch):
    """A client that sends frames which each get a reply (here Resume of an unknown request) and never reads
    any: the server stops reading its link once OUTBOX_PAUSE_BYTES of replies wait, instead of queueing every
    reply (it grew ~230 bytes per 69-byte frame, over 200 MB in 40 s; a Resume of a long answer ~4 KB per 5-byte
    frame); an honest session streams meanwhile. Still unread after OUTBOX_STALL_S, the link is dropped: the
    session's slot was held for as long as the client's process lived (a close handshake waits behind the unread
    bytes)."""
    pause = 32 << 10
    monkeypatch.setattr(split_endpoint, "OUTBOX_PAUSE_BYTES", pause)
    monkeypatch.setattr(split_endpoint, "OUTBOX_STALL_S", 1.0)
    dropped = []
    registry = server.app.state.split.registry
    rid = "n" * 64
    reply = len(P.encode_message(P.Error(code="resume_failed", message=f"request {rid} is not held here: replay it",
                                         request_id=rid)))
    burst = _raw_frame(P.encode_message(P.Resume(request_id=rid, have_tokens=0))) * 1000

    def waiting(session) -> int:
        outq = session.outq  # None once the link is dropped
        return 0 if outq is None else sum(map(len, list(outq._queue)))

    def flood(bundle_id: str) -> int:
        """A raw socket that never reads after the Welcome: the most reply bytes seen waiting."""
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /v1/split HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
        sock.settimeout(10.0)
        head = b""
        while b"\r\n\r\n" not in head:  # the 101 first: a client sends no frame before it (RFC 6455, 4.1)
            head += sock.recv(4096)
        sock.sendall(_raw_frame(P.encode_message(P.Hello(bundle_id=bundle_id, codecs=["fp16"]))))
        welcome = head[head.index(b"\r\n\r\n") + 4:]
        while len(welcome) < 4 or len(welcome) < 4 + int.from_bytes(welcome[2:4], "big"):  # 126..64 KiB bytes
            welcome += sock.recv(4096)
        session = registry.by_id[P.decode_message(welcome[4:4 + int.from_bytes(welcome[2:4], "big")]).session_id]
        sock.setblocking(False)
        most, offset, stream = 0, 0, memoryview(burst)
        end = time.monotonic() + 30
        # sending whole frames, in order, until the server drops the link: a client that stopped at the first send that
        # waited (the server not reading for a moment) let the server's writer drain the replies into its socket
        # buffer, and a link neither sending nor reading is only idle, not dropped (clean-clone CI runs: attached after
        # 15 s, twice)
        while session.attached and time.monotonic() < end:
            try:
                offset = (offset + sock.send(stream[offset:])) % len(burst)  # burst holds whole frames
            except BlockingIOError:  # the server is not reading: replies wait
                time.sleep(0.02)
            except ConnectionError:  # dropped
                break
            most = max(most, waiting(session))
        while session.attached and time.monotonic() < end + 5:  # an abort seen by the client first
            time.sleep(0.1)
        dropped.append(not session.attached)
        sock.close()
        return most

    async def abuse(edge):
        return await asyncio.to_thread(flood, edge.bundle_id)

    assert _abuse(server, tiny_bundle, front, honest_reference, abuse) <= pause + reply
    assert dropped == [True]


def test_more_open_requests_than_allowed_are_overloaded(server, tiny_bundle, front, honest_reference):
    async def abuse(edge):
        n = edge.welcome.limits.max_concurrent_requests
        assert n == MAX_SEQS
        for i in range(n):
            await edge.send(_prefill(f"open{i}", 0, 2, last=False))
        await edge.send(_prefill("one-too-many", 0, 2, last=False))
        err = await _error(edge, "overloaded", "one-too-many")
        assert err.retry_after_ms
        for i in range(n):  # cancelling frees the slots for the check that the session serves on
            await edge.send(P.Cancel(request_id=f"open{i}"))
        for _ in range(n):
            msg = await edge.recv(timeout=30)
            assert isinstance(msg, P.Tokens) and msg.finish_reason == "cancelled"

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def test_errors_for_ids_never_opened_write_no_trace_line(server, tiny_bundle, front, honest_reference, caplog):
    """The trace log has a line when a request opens and one when it ends (cloud_server.usage); an Error about an
    id the session never opened (Resume or DecodeStep of a stranger) wrote one too, ~110 bytes of log per 8-byte
    frame, for as long as a client kept sending them."""
    async def abuse(edge):
        for i in range(50):
            await edge.send(P.Resume(request_id=f"s{i}", have_tokens=0))
            await _error(edge, "resume_failed", f"s{i}")
        await edge.send(P.DecodeStep(request_id="d", position=0, hidden=_h(1)))
        await _error(edge, "unknown_request", "d")
        await edge.send(P.Prefill(request_id="w", start=0, hidden=_h(2, H + 1), last=True,
                                  params=P.SamplingParams(max_tokens=4)))
        await _error(edge, "bad_input", "w")

    with caplog.at_level("INFO", logger="autoglm.cloud.trace"):
        _abuse(server, tiny_bundle, front, honest_reference, abuse)
    traced = {m.split()[0] for m in caplog.messages if m.startswith("trace=")}
    assert "trace=w" in traced and "trace=honest" in traced
    assert not {t for t in traced if t.startswith(("trace=s", "trace=d"))}


def test_resume_of_an_unknown_request_or_of_tokens_never_sent(server, tiny_bundle, front, honest_reference):
    async def abuse(edge):
        await edge.send(P.Resume(request_id="nobody", have_tokens=0))
        await _error(edge, "resume_failed", "nobody")
        await edge.send(_prefill("r", 0, 3))
        await _first_token(edge, "r")
        await edge.send(P.Resume(request_id="r", have_tokens=5))  # one token was sent
        await _error(edge, "bad_position", "r")

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def test_hidden_states_the_model_cannot_take_are_bad_input(server, tiny_bundle, front, honest_reference):
    async def abuse(edge):
        await edge.send(P.Prefill(request_id="wide", start=0, hidden=_h(2, width=H + 1), params=P.SamplingParams()))
        await _error(edge, "bad_input", "wide")
        rope = P.WireArray.from_numpy(np.zeros((3, 2), np.int32))  # 3-D RoPE to a 1-D RoPE model
        await edge.send(_prefill("rope", 0, 2, rope_positions=rope))
        await _error(edge, "bad_input", "rope")

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def test_no_new_request_after_drain(server, tiny_bundle, front, honest_reference):
    async def abuse(edge):
        await edge.send(_prefill("before", 0, 3))
        await _first_token(edge, "before")
        session = server.app.state.split.registry.by_id[edge.welcome.session_id]
        server.server._loop.call_soon_threadsafe(session.send, P.Drain(grace_ms=1000))  # this session only
        assert isinstance(await edge.recv(timeout=30), P.Drain)
        await edge.send(_prefill("after-drain", 0, 3))
        err = await _error(edge, "draining", "after-drain")
        assert err.retry_after_ms
        await edge.send(P.DecodeStep(request_id="before", position=3, hidden=_h(1)))  # open ones carry on
        assert (await _first_token(edge, "before")).index == 1
        await edge.close()

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def test_a_request_left_waiting_times_out_with_timeout(server, tiny_bundle, front, honest_reference):
    async def abuse(edge):
        await edge.send(P.Prefill(request_id="idle", start=0, hidden=_h(3),
                                  params=P.SamplingParams(max_tokens=8, ignore_eos=True)))
        await _first_token(edge, "idle")
        err = await _error(edge, "timeout", "idle")  # no DecodeStep: the engine gives up (not "internal")
        assert str(int(STEP_TIMEOUT_S)) in err.message

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


@pytest.mark.parametrize("first", ["prefill", "text"])
def test_anything_but_hello_first_is_fatal(server, tiny_bundle, first, honest_reference, front):
    async def abuse(edge):
        return None

    async def main():
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.send(P.encode_message(_prefill("r", 0, 2)) if first == "prefill" else "hello")
            err = P.decode_message(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            return err, closed.value.rcvd.code

    err, code = asyncio.run(main())
    assert err.fatal and err.code == ("bad_state" if first == "prefill" else "bad_frame") and code == 1002
    _abuse(server, tiny_bundle, front, honest_reference, abuse)  # the server serves on


def test_a_second_hello_is_fatal(server, tiny_bundle, front, honest_reference):
    async def abuse(edge):
        await edge.send(P.Hello(bundle_id=edge.bundle_id, codecs=["fp16"]))
        err = await edge.recv()
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await edge.recv()
        assert err.fatal and err.code == "bad_state" and closed.value.rcvd.code == 1002

    _abuse(server, tiny_bundle, front, honest_reference, abuse)


def test_the_engine_facts_are_fixed_at_start(server):
    facts = server.runtime.facts
    assert facts.hidden_size == H and facts.variants == ("fp32",) and facts.max_context == MAX_CONTEXT
    with pytest.raises(AttributeError):
        facts.hidden_size = 1  # frozen: handlers cannot change (or mistake) what the engine is
    assert facts.resolve_variant("bf16") == "fp32" and facts.resolve_variant(None) == "fp32"
