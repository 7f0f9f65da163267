"""The Python WebSocket stack's own cost per lockstep token, beside the split endpoint's (one run, one machine).

The served path's round trip at S sessions over W front-end processes is at least the event loop's serial work
for its S / W sessions' frames (docs/performance.md, "what bounds served / engine"). How much of a worker's
per-token loop CPU is the stack itself - uvicorn, websockets' sans-I/O protocol (the server's own
``SplitWSProtocol``), asyncio - and how much is the split endpoint's work on top? This runs an **echo server on
the same stack** (the same uvicorn settings and protocol class, an app that answers each binary message with a
Tokens-sized one through the same ``send_bytes_now``, nothing else) against lockstep clients that send a
DecodeStep-sized message and wait for the answer, like the load generator's phones; it reports the echo loop's
main-thread CPU per message pair and the round trip.

Put beside ``bench/served_load.py``'s ``loop_us_per_token`` from the same machine: the difference is the endpoint's
own per-token work (msgpack, state machine, codec decode, engine link, metrics).

    python bench/ws_floor.py --sessions 8,64 --messages 400 --procs 3 --json docs/results/ws_floor.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

UP_BYTES = 4_400  # a DecodeStep of H = 4,096 in int8-outlier (~1.07 B/element) with its envelope
DOWN_BYTES = 40  # a Tokens message


def _serve(sock: socket.socket, loop_name: str, total: int, marks: mp.Queue) -> None:  # server process
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import WebSocketRoute

    from cloud_server.app import loop_factory
    from cloud_server.ws_protocol import SEND_NOW, protocol_class

    reply = b"t" * DOWN_BYTES
    count = [0]
    warm = total // 10  # the first tenth of the messages: warm-up (connections, first allocations)

    async def echo(ws) -> None:
        await ws.accept()
        send_now = ws.scope.get("extensions", {}).get(SEND_NOW)
        try:
            while True:
                await ws.receive_bytes()
                if send_now is None or not send_now(reply):
                    await ws.send_bytes(reply)
                count[0] += 1
                if count[0] in (warm, total):  # the loop thread's CPU and the clock at both marks
                    marks.put((time.thread_time(), time.perf_counter()))
        except Exception:  # noqa: BLE001 - the client went away
            return

    app = Starlette(routes=[WebSocketRoute("/echo", echo)])
    ws_cls = protocol_class()
    config = uvicorn.Config(app, log_level="warning", loop=loop_name, **({"ws": ws_cls} if ws_cls else {}))
    server = uvicorn.Server(config)
    with asyncio.Runner(loop_factory=loop_factory(loop_name)) as runner:
        runner.run(server.serve(sockets=[sock]))


def _clients(url: str, sessions: int, messages: int, out: mp.Queue) -> None:  # load-generator process
    import websockets

    from cloud_server.app import loop_factory

    payload = os.urandom(UP_BYTES)

    async def one() -> list[float]:
        trips = []
        async with websockets.connect(url, max_size=None, compression=None) as ws:
            for _ in range(messages):
                t = time.perf_counter()
                await ws.send(payload)
                await ws.recv()
                trips.append(time.perf_counter() - t)
        return trips

    async def main() -> list[float]:
        per = await asyncio.gather(*(one() for _ in range(sessions)))
        return [t for trips in per for t in trips[messages // 10:]]  # the first tenth: warm-up

    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        out.put(runner.run(main()))


def measure(sessions: int, messages: int, procs: int, loop_name: str = "auto") -> dict:
    ctx = mp.get_context("spawn")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    pairs = sessions * messages
    marks = ctx.Queue()
    server = ctx.Process(target=_serve, args=(sock, loop_name, pairs, marks), daemon=True)
    server.start()
    url = f"ws://127.0.0.1:{port}/echo"
    q = ctx.Queue()
    share = [sessions // procs + (i < sessions % procs) for i in range(procs)]
    clients = [ctx.Process(target=_clients, args=(url, n, messages, q)) for n in share if n]
    for c in clients:
        c.start()
    trips = [t for _ in clients for t in q.get(timeout=600)]
    (cpu0, t0), (cpu1, t1) = marks.get(timeout=60), marks.get(timeout=60)
    counted = pairs - pairs // 10
    for c in clients:
        c.join()
    server.terminate()
    server.join(5)
    sock.close()
    trips_ms = sorted(1e3 * t for t in trips)
    return {"sessions": sessions, "messages_per_session": messages, "procs": len(clients), "loop": loop_name,
            "up_bytes": UP_BYTES, "down_bytes": DOWN_BYTES,
            "loop_us_per_message_pair": 1e6 * (cpu1 - cpu0) / counted, "pairs_per_s": counted / (t1 - t0),
            "round_trip_p50_ms": statistics.median(trips_ms),
            "round_trip_p99_ms": trips_ms[min(len(trips_ms) - 1, int(0.99 * len(trips_ms)))]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="8,64", help="lockstep sessions, one level each")
    ap.add_argument("--messages", type=int, default=400, help="message pairs per session")
    ap.add_argument("--procs", type=int, default=3, help="client processes")
    ap.add_argument("--loop", default="auto", help="the server's event loop (auto, asyncio, uvloop)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    levels = [int(s) for s in a.sessions.split(",") if s]
    if not levels or min(levels) < 1 or a.messages < 10 or a.procs < 1:
        ap.error("--sessions: positive counts; --messages >= 10; --procs >= 1")
    res = {"command": "python bench/ws_floor.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "host_cpus": os.cpu_count(), "records": []}
    for s in levels:
        r = measure(s, a.messages, min(a.procs, s), a.loop)
        res["records"].append(r)
        print(f"[ws_floor] S={s:>4} echo loop {r['loop_us_per_message_pair']:.0f} us per message pair, "
              f"{r['pairs_per_s']:.0f} pairs/s, round trip p50 {r['round_trip_p50_ms']:.2f} / p99 "
              f"{r['round_trip_p99_ms']:.2f} ms", flush=True)
        if a.json:
            a.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
