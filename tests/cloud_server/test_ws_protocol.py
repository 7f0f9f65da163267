"""cloud_server.ws_protocol (uvicorn's protocol without per-frame read pauses, with a synchronous send) and the
split endpoint's Outbox (frames in order, at once when the socket takes them, else through the writer)."""

from __future__ import annotations

import asyncio

import pytest
import websockets
from websockets.frames import Frame, Opcode
from cloud_support import ServerThread
from fastapi import FastAPI, WebSocket

from cloud_server.split_endpoint import Outbox, ws_send_now
from cloud_server.ws_protocol import FEED_SLICE, FRAMES_PER_TURN, PAUSE_AT, SEND_NOW, SplitWSProtocol, protocol_class

pytestmark = pytest.mark.skipif(SplitWSProtocol is None, reason="uvicorn without the websockets-sansio protocol")


def _protocols(srv: ServerThread) -> list:
    return [c for c in srv.server.server_state.connections if isinstance(c, SplitWSProtocol)]


@pytest.fixture
def echo():
    """An app whose socket answers every binary frame through SEND_NOW, once released (a slow app first)."""
    app = FastAPI()
    app.state.seen = []

    @app.websocket("/ws")
    async def ws_route(ws: WebSocket):
        await ws.accept()
        send_now = ws_send_now(ws)
        app.state.seen.append(send_now is not None)
        app.state.hold = asyncio.Event()
        app.state.loop = asyncio.get_running_loop()
        await app.state.hold.wait()
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            assert send_now(msg["bytes"])

    with ServerThread(app) as srv:
        srv.app = app
        yield srv


async def _connected(srv, hold: bool):
    ws = await websockets.connect(f"ws://127.0.0.1:{srv.port}/ws", compression=None)
    while getattr(srv.app.state, "loop", None) is None:
        await asyncio.sleep(0.01)
    if not hold:
        srv.app.state.loop.call_soon_threadsafe(srv.app.state.hold.set)
    return ws


def test_the_server_runs_the_split_protocol():
    assert protocol_class() is SplitWSProtocol
    with ServerThread(FastAPI()) as srv:
        assert srv.server.config.ws is SplitWSProtocol


def test_lockstep_frames_never_pause_reading_and_replies_go_out_at_once(echo):
    async def run():
        ws = await _connected(echo, hold=False)
        (proto,) = _protocols(echo)
        pauses = []

        class Counting:  # the transport, counting pauses (uvicorn's protocol pauses once per frame); a proxy, as
            def __init__(self, inner):  # uvloop's transports are C types whose methods cannot be replaced
                self._inner = inner

            def pause_reading(self):
                pauses.append(1)
                self._inner.pause_reading()

            def __getattr__(self, name):
                return getattr(self._inner, name)

        proto.transport = Counting(proto.transport)
        for i in range(20):
            await ws.send(bytes([i]) * 100)
            assert await ws.recv() == bytes([i]) * 100
        assert not proto.read_paused and pauses == []  # one frame in flight: the socket is never paused
        await ws.close()
    asyncio.run(run())
    assert echo.app.state.seen == [True]


def test_a_burst_the_app_does_not_read_pauses_reading_and_keeps_every_frame_in_order(echo):
    async def run():
        ws = await _connected(echo, hold=True)
        for i in range(50):
            await ws.send(bytes([i]) * 1000)
        await asyncio.sleep(0.3)
        (proto,) = _protocols(echo)
        assert proto.read_paused and proto.queue.qsize() >= PAUSE_AT  # backpressure, as uvicorn's
        echo.app.state.loop.call_soon_threadsafe(echo.app.state.hold.set)
        got = [await ws.recv() for _ in range(50)]
        assert got == [bytes([i]) * 1000 for i in range(50)]
        assert not proto.read_paused
        await ws.close()
    asyncio.run(run())


def test_a_flood_of_tiny_frames_is_parsed_a_bounded_number_per_turn_of_the_loop_in_order(echo):
    """One read of a tiny-frame flood (a peer's 20,000 one-byte messages, or one message cut into 20,000 empty
    fragments) was parsed whole, and its messages taken by the app, in one turn of the event loop: every other
    session on the server waited seconds. Frames parsed per turn are bounded, and every message still arrives."""
    turns = [0]
    per_turn: dict[int, int] = {}

    def tick():  # counts the server loop's turns
        turns[0] += 1
        echo.app.state.loop.call_soon(tick)

    def counting(handler):
        def handle(*args):
            per_turn[turns[0]] = per_turn.get(turns[0], 0) + 1
            return handler(*args)
        return handle

    async def run():
        ws = await _connected(echo, hold=False)
        (proto,) = _protocols(echo)
        proto.handle_bytes, proto.handle_cont = counting(proto.handle_bytes), counting(proto.handle_cont)
        echo.app.state.loop.call_soon_threadsafe(tick)
        n = 20_000
        flood = b"".join(Frame(Opcode.BINARY, i.to_bytes(2, "big")).serialize(mask=True, extensions=[])
                         for i in range(n))
        ws.transport.write(flood)  # one write: the server reads it in a few large reads
        got = [await ws.recv() for _ in range(n)]
        assert got == [i.to_bytes(2, "big") for i in range(n)]
        fragments = [Frame(Opcode.BINARY, b"<", fin=False)] + [Frame(Opcode.CONT, b"", fin=False)] * n
        ws.transport.write(b"".join(f.serialize(mask=True, extensions=[])
                                    for f in fragments + [Frame(Opcode.CONT, b">")]))
        assert await ws.recv() == b"<>"
        await ws.close()
    asyncio.run(run())
    most = max(per_turn.values())
    assert sum(per_turn.values()) == 2 * 20_000 + 2
    assert most <= FRAMES_PER_TURN + FEED_SLICE // 6, most  # 6 bytes: the smallest client frame


def test_send_now_refuses_what_must_wait():
    class Transport:
        def __init__(self):
            self.closing, self.written = False, []

        def is_closing(self):
            return self.closing

        def write(self, data):
            self.written.append(data)

    proto = SplitWSProtocol.__new__(SplitWSProtocol)  # the state send_bytes_now reads, without a server
    proto.disconnected = proto.close_sent = False
    proto.handshake_complete, proto.initial_response = True, None
    proto.writable = asyncio.Event()
    proto.transport = Transport()

    class Conn:
        def send_binary(self, data):
            self.out = data

        def data_to_send(self):
            return [b"frame:", self.out]
    proto.conn = Conn()
    assert not proto.send_bytes_now(b"x")  # paused for writing: the ASGI send waits for it
    proto.writable.set()
    assert proto.send_bytes_now(b"x") and proto.transport.written == [b"frame:x"]
    proto.close_sent = True
    assert not proto.send_bytes_now(b"y")


def test_outbox_keeps_order_when_the_socket_takes_some_frames_and_not_others():
    async def run():
        taken, sent = [], []
        accept = [True]

        def send_now(frame):
            if accept[0]:
                taken.append(frame)
            return accept[0]
        box = Outbox(send_now, sent.append)
        box.put_nowait(b"a")  # nothing waits: straight out
        accept[0] = False
        box.put_nowait(b"b")  # the socket refuses: queued
        accept[0] = True
        box.put_nowait(b"c")  # behind b: queued too, though the socket would take it
        assert taken == [b"a"] and sent == [1] and box.qsize() == 2
        assert [box.get_nowait(), box.get_nowait()] == [b"b", b"c"]
        box.writing = True  # the writer still holds a frame: the next one waits behind it
        box.put_nowait(b"d")
        assert box.qsize() == 1
        box.writing = False
        box.get_nowait()
        box.put_nowait(b"e")
        assert taken == [b"a", b"e"]
        plain = Outbox(None, sent.append)  # another server (a test client): always the writer's queue
        plain.put_nowait(b"f")
        assert plain.qsize() == 1
    asyncio.run(run())
    assert ws_send_now(object()) is None
    assert SEND_NOW.startswith("autoglm.")
