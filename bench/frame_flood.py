"""A flood of tiny WebSocket frames on one connection beside an honest decoding session: how long the honest
session waits between tokens during each flood, against the same session's gaps before any flood (same run).

The honest session speaks the real protocol (``bench/load_bench.py``'s deterministic boundary states, greedy,
requests of ``--gen`` tokens one after another) from a process of its own; each flood opens its own session (Hello,
Welcome) on a plain socket and then writes all its frames in one go: ``cancels`` (``Cancel`` of a request that
does not exist), ``fragments`` (one message cut into empty continuation frames), ``resumes`` (``Resume`` of an
unknown request, each answered) and ``pings``. Each flood's last frame is answered, so the server has read the whole
flood when that answer comes; its window runs from its write until ``--settle`` seconds after its last reply byte.

    autoglm-partition split --preset tiny-glm4 --layer 2 --out /tmp/tiny
    python bench/frame_flood.py --serve /tmp/tiny --out /tmp/frame_flood.json

Timings on a shared host are noisy: compare the flood windows' gaps with the baseline window of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import multiprocessing
import os
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
import websockets
from websockets.frames import Frame, Opcode

from shared import codecs as C
from shared import protocol as P
from shared.manifest import Manifest

from load_bench import _state, serve  # bench/ is on sys.path when a bench script runs
from results_io import emit

_RESUME = Frame(Opcode.BINARY, P.encode_message(P.Resume(request_id="zz", have_tokens=0)))  # answered at once
FLOODS = {  # name -> its frames; the last one is answered, so the reply to it ends the flood's window
    "cancels": lambda n: [Frame(Opcode.BINARY, P.encode_message(P.Cancel(request_id="zz")))] * n + [_RESUME],
    # one message of n empty fragments; the empty message they end in is refused (bad_frame) and the link closed
    "fragments": lambda n: ([Frame(Opcode.BINARY, b"", fin=False)] + [Frame(Opcode.CONT, b"", fin=False)] * n
                            + [Frame(Opcode.CONT, b"")]),
    "resumes": lambda n: [_RESUME] * n,
    "pings": lambda n: [Frame(Opcode.PING, b"x")] * n,
}


async def honest(url: str, bundle_id: str, hidden: int, gen: int, stop: asyncio.Event, stamps: list[float]) -> int:
    """Greedy requests of ``gen`` tokens until ``stop``; ``stamps``: the time of every Tokens message."""
    codec = C.get_codec("fp16")
    params = P.SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    async with websockets.connect(url, max_size=None, ping_interval=None) as ws:
        async def recv():
            return P.decode_message(await asyncio.wait_for(ws.recv(), 120))
        await ws.send(P.encode_message(P.Hello(bundle_id=bundle_id, codecs=["fp16"])))
        assert isinstance(await recv(), P.Welcome)
        n, k = 8, 0
        while not stop.is_set():
            k += 1
            prompt = np.concatenate([_state(hidden, k, p, -1) for p in range(n)])  # [n, H]
            await ws.send(P.encode_message(P.Prefill(request_id=f"r{k}", start=0, hidden=codec.encode(prompt),
                                                     params=params, compute="fp32")))
            tokens: list[int] = []
            while True:
                msg = await recv()
                if isinstance(msg, P.Error):
                    raise RuntimeError(f"honest session: {msg.code}: {msg.message}")
                if not isinstance(msg, P.Tokens) or not msg.token_ids:
                    continue
                stamps.append(time.perf_counter())
                tokens += msg.token_ids
                if msg.finish_reason is not None:
                    break
                pos = n + len(tokens) - 1
                await ws.send(P.encode_message(P.DecodeStep(request_id=f"r{k}", position=pos,
                                                            hidden=codec.encode(_state(hidden, k, pos, tokens[-1])))))
        await ws.send(P.encode_message(P.Close()))
    return k


def flood(host: str, port: int, bundle_id: str, name: str, n: int, settle: float) -> tuple[float, float, int]:
    """One flood on its own session, from a blocking socket: (start, end of its window, reply bytes read)."""
    hello = Frame(Opcode.BINARY, P.encode_message(P.Hello(bundle_id=bundle_id, codecs=["fp16"])))
    payload = b"".join(f.serialize(mask=True, extensions=[]) for f in FLOODS[name](n))  # before the window opens
    with socket.create_connection((host, port)) as s:
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall((f"GET /v1/split HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                   ).encode())
        s.settimeout(10.0)
        answer = b""
        for want in (b"\r\n\r\n", None):  # the upgrade's answer (a client sends nothing before it), the Welcome
            while not (head := answer.partition(b"\r\n\r\n"))[1 if want else 2]:
                if not (data := s.recv(1 << 16)):
                    raise RuntimeError(f"the server closed the flood's connection: {answer[:200]!r}")
                answer += data
            if want:
                if not head[0].startswith(b"HTTP/1.1 101"):
                    raise RuntimeError(f"the flood's upgrade was refused: {head[0][:200]!r}")
                s.sendall(hello.serialize(mask=True, extensions=[]))
        t0 = time.perf_counter()
        s.sendall(payload)  # in one go: the server reads it as fast as its socket buffer fills
        got = 0
        s.settimeout(120.0)  # the first answer: to the last frame, or to any before it
        try:
            while data := s.recv(1 << 16):
                got += len(data)
                s.settimeout(settle)
        except (TimeoutError, ConnectionError):
            pass
        return t0, time.perf_counter(), got


def _honest_process(url: str, bundle_id: str, hidden: int, gen: int, stop, out) -> None:
    """The honest session in a process of its own, so that the flood's client work never delays its tokens."""
    async def session():
        flag, stamps = asyncio.Event(), []
        task = asyncio.create_task(honest(url, bundle_id, hidden, gen, flag, stamps))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        flag.set()
        await task
        return stamps
    out.put(asyncio.run(session()))


def gaps_in(stamps: list[float], t0: float, t1: float) -> list[float]:
    s = [t for t in stamps if t0 <= t <= t1]
    return list(np.diff(s) * 1000) if len(s) > 1 else []


def summary(gaps: list[float]) -> dict:
    if not gaps:
        return {"tokens": 0}
    return {"tokens": len(gaps) + 1, "gap_p50_ms": round(float(np.median(gaps)), 2),
            "gap_p99_ms": round(float(np.percentile(gaps, 99)), 2), "gap_max_ms": round(float(max(gaps)), 2)}


def run(host: str, port: int, bundle: Path, names: list[str], n: int, gen: int, baseline_s: float,
        settle: float) -> dict:
    manifest = Manifest.load(bundle)
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_honest_process, args=(f"ws://{host}:{port}/v1/split", manifest.bundle_id,
                                                     manifest.hidden_size, gen, stop, out))
    proc.start()
    try:
        time.sleep(3.0)  # the process up and its first request under way
        b0 = time.perf_counter()
        time.sleep(baseline_s)
        b1 = time.perf_counter()
        windows = {name: flood(host, port, manifest.bundle_id, name, n, settle) for name in names}
        stop.set()
        stamps = out.get(timeout=300)  # perf_counter is CLOCK_MONOTONIC: one clock for both processes
    finally:
        stop.set()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    result = {"baseline": summary(gaps_in(stamps, b0, b1)), "floods": {}}
    for name, (t0, t1, got) in windows.items():
        row = summary(gaps_in(stamps, t0, t1))
        row.update(frames=n, reply_bytes=got, window_s=round(t1 - t0, 2))
        if "gap_max_ms" in row and "gap_max_ms" in result["baseline"]:
            row["max_gap_over_baseline_max"] = round(row["gap_max_ms"] / result["baseline"]["gap_max_ms"], 2)
        result["floods"][name] = row
        print(f"{name:10s} {row}", file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", type=Path, required=True, help="bundle to serve (a tiny split bundle)")
    ap.add_argument("--floods", default=",".join(FLOODS), help=f"comma-separated, of {', '.join(FLOODS)}")
    ap.add_argument("--frames", type=int, default=100_000, help="frames per flood")
    ap.add_argument("--gen", type=int, default=256, help="tokens per honest request")
    ap.add_argument("--baseline-s", type=float, default=3.0, help="undisturbed window before the floods")
    ap.add_argument("--settle", type=float, default=0.5, help="a flood's window ends this long after its last reply")
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    names = [s for s in args.floods.split(",") if s]
    if unknown := [s for s in names if s not in FLOODS]:
        ap.error(f"--floods: unknown {unknown}; known: {', '.join(FLOODS)}")
    proc = serve(args.serve, args.port, sessions=8, num_blocks=1024)
    try:
        result = run("127.0.0.1", args.port, args.serve, names, args.frames, args.gen, args.baseline_s, args.settle)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    result["model"] = Manifest.load(args.serve).bundle_id
    emit(result, args.out, "frame_flood.py", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
