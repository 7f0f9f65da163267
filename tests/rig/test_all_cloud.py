"""rig.all_cloud.FullModelClient against a scripted HTTP server: SSE parsing, timing, byte counts, keep-alive,
error statuses."""

from __future__ import annotations

import asyncio
import json

import pytest

from rig.all_cloud import CloudAPIError, FullModelClient


def _chunked(body: bytes) -> bytes:
    out = b""
    for i in range(0, len(body), 50):  # chunk boundaries that cut SSE events in half
        part = body[i:i + 50]
        out += f"{len(part):x}\r\n".encode() + part + b"\r\n"
    return out + b"0\r\n\r\n"


def _sse(deltas: list[str]) -> bytes:
    events = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]}]
    events += [{"choices": [{"delta": {"content": d}}]} for d in deltas]
    events += [{"choices": [{"delta": {}, "finish_reason": "length"}]},
               {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": len(deltas),
                                         "prompt_tokens_details": {"cached_tokens": 8}}}]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


async def _serve(reader, writer, connections: list, status: int):
    connections.append(1)
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            n = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
            body = json.loads(await reader.readexactly(n))
            if status != 200:
                msg = b'{"error": "nope"}'
                writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(msg), msg))
                await writer.drain()
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            chunked = _chunked(_sse(["Hel", "lo", " world"][:body["max_tokens"]]))
            for i in range(0, len(chunked), 120):  # the body trickles in: deltas arrive at different times
                writer.write(chunked[i:i + 120])
                await writer.drain()
                await asyncio.sleep(0.005)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass


def test_stream_two_requests_on_one_connection():
    async def main():
        conns: list = []
        server = await asyncio.start_server(lambda r, w: _serve(r, w, conns, 200), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = FullModelClient(f"http://127.0.0.1:{port}")
        deltas: list[str] = []
        a = await client.chat([{"role": "user", "content": "hi"}], 3, deltas.append)
        b = await client.chat([{"role": "user", "content": "again"}], 2)
        await client.close()
        server.close()
        return a, b, deltas, conns

    a, b, deltas, conns = asyncio.run(main())
    assert a.text == "Hello world" and deltas == ["Hel", "lo", " world"] and len(a.itl_s) == 2
    assert a.completion_tokens == 3 and a.prompt_tokens == 11 and a.cached_tokens == 8
    assert a.finish_reason == "length" and a.ttft_s > 0 and a.total_s >= a.ttft_s and all(g > 0 for g in a.itl_s)
    assert a.bytes_up > 100 and a.bytes_down > len(_sse(["Hel", "lo", " world"]))
    assert b.text == "Hello" and len(conns) == 1  # keep-alive: one connection for both


def test_error_status_is_raised():
    async def main():
        server = await asyncio.start_server(lambda r, w: _serve(r, w, [], 400), "127.0.0.1", 0)
        client = FullModelClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            await client.chat([{"role": "user", "content": "hi"}], 3)
        finally:
            await client.close()
            server.close()

    with pytest.raises(CloudAPIError, match="HTTP 400"):
        asyncio.run(main())


def test_bad_url():
    with pytest.raises(ValueError, match="http://"):
        FullModelClient("ws://127.0.0.1:1")


def test_a_cut_link_is_retried_and_the_answer_shows_once():
    """A scenario's disconnects cut the all-cloud phone's connection as they cut the split phone's, which resumes;
    the all-cloud phone failed (CloudAPIError: ConnectionResetError) and with it the whole run (exit 1). It sends
    the request again, as the split's client retries, and the user sees the answer once, from where it stopped."""
    from rig.link import Disconnect, LinkEmulator

    async def main(link_port: int, link):
        client = FullModelClient(f"http://127.0.0.1:{link_port}")
        deltas: list[str] = []

        def on_delta(text):
            deltas.append(text)
            if len(deltas) == 1:
                link.cut(down_s=0.3)  # mid-answer, and the reconnect is refused for a while

        run = await client.chat([{"role": "user", "content": "hi"}], 3, on_delta)
        after = await client.chat([{"role": "user", "content": "again"}], 2)
        await client.close()
        return run, after, deltas

    async def serve():
        return await asyncio.start_server(lambda r, w: _serve(r, w, conns, 200), "127.0.0.1", 0)

    conns: list = []
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(serve())
    import threading

    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        with LinkEmulator(server.sockets[0].getsockname()[1], disconnects=[Disconnect(at_s=600)]) as link:
            run, after, deltas = asyncio.run(main(link.port, link))
    finally:
        async def shut():
            server.close()
            for task in asyncio.all_tasks(loop) - {asyncio.current_task()}:
                task.cancel()
            loop.stop()

        loop.call_soon_threadsafe(lambda: loop.create_task(shut()))
    assert run.text == "Hello world" and "".join(deltas) == "Hello world" and deltas[0] == "Hel"
    assert run.reconnects >= 1 and len(run.itl_s) == len(deltas) - 1 and run.total_s > 0.3  # the refused ones too
    assert after.text == "Hello" and after.reconnects == 0 and len(conns) == 2  # the cut one, the one after it
