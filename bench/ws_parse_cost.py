"""The WebSocket frame parser's cost per decode step and per flood slice, side by side in one run.

``cloud_server.ws_protocol`` hands a connection's bytes to websockets' parser a slice at a time (``FEED_SLICE``,
4 KiB) so that a flood of tiny frames cannot hold the event loop. A lockstep decode step of a 4,096-wide model is
larger than that (4.4 KB in int8-outlier, 8.3 KB in bf16) and goes to the parser in two calls. This measures both
sides of the slice's size with the parser the server runs (websockets' sans-I/O ``ServerProtocol``), against a
larger slice (``--alt-slice``, default 8.5 KiB: one whole bf16 step):

* a decode step (one frame of each of ``--sizes`` bytes) fed whole, cut at ``FEED_SLICE`` and cut at the larger
  slice: microseconds per frame;
* one slice of a flood of empty frames (6 bytes each) at each size: frames and milliseconds, the longest one parser
  call holds the loop.

Run as ``python bench/ws_parse_cost.py [--frames 2000] [--repeats 5] [--alt-slice 8704] [--json out.json]``; the
numbers are this CPU's, so read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from websockets.client import ClientProtocol
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.uri import parse_uri

from cloud_server.ws_protocol import FEED_SLICE

def client_frames(payloads: list[bytes]) -> list[bytes]:
    """Each payload as the masked binary frame a client sends."""
    client = ClientProtocol(parse_uri("ws://bench/"), state=State.OPEN)
    out = []
    for p in payloads:
        client.send_binary(p)
        out.append(b"".join(client.data_to_send()))
    return out


def us_per_frame(frames: list[bytes], cut: int | None) -> float:
    server = ServerProtocol(state=State.OPEN, max_size=None)
    t = time.perf_counter()
    for f in frames:
        for start in range(0, len(f), cut or len(f)):
            server.receive_data(f[start:start + (cut or len(f))])
            server.events_received()
    return (time.perf_counter() - t) / len(frames) * 1e6


def flood_slice_ms(blob: bytes, size: int) -> tuple[int, float]:
    server = ServerProtocol(state=State.OPEN)
    t = time.perf_counter()
    server.receive_data(blob[:size])
    n = len(server.events_received())
    return n, (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default="4400,8300")
    ap.add_argument("--alt-slice", type=int, default=(8 << 10) + 512)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {"command": "python bench/ws_parse_cost.py " + " ".join(
        f"--{k} {v}" for k, v in (("frames", args.frames), ("repeats", args.repeats), ("sizes", args.sizes),
                                            ("alt-slice", args.alt_slice))),
        "feed_slice": FEED_SLICE, "alt_slice": args.alt_slice, "decode_step": {}, "flood_slice": {}}
    for size in map(int, args.sizes.split(",")):
        frames = client_frames([os.urandom(size) for _ in range(args.frames)])
        runs = {name: [us_per_frame(frames, cut) for _ in range(args.repeats)]
                for name, cut in (("whole", None), ("feed_slice", FEED_SLICE), ("alt_slice", args.alt_slice))}
        med = {k: statistics.median(v) for k, v in runs.items()}
        out["decode_step"][size] = {"us_per_frame_median": med, "runs": runs,
                                    "feed_vs_whole": med["feed_slice"] / med["whole"],
                                    "alt_vs_whole": med["alt_slice"] / med["whole"]}
        print(f"decode step {size:>6} B: whole {med['whole']:.1f} us, FEED_SLICE {med['feed_slice']:.1f} us "
              f"({med['feed_slice'] / med['whole']:.2f}x), {args.alt_slice} B slices {med['alt_slice']:.1f} us "
              f"({med['alt_slice'] / med['whole']:.2f}x)")
    blob = b"".join(client_frames([b""] * (max(FEED_SLICE, args.alt_slice) // 6 + 10)))
    for name, size in (("feed_slice", FEED_SLICE), ("alt_slice", args.alt_slice)):
        got = [flood_slice_ms(blob, size) for _ in range(args.repeats)]
        ms = statistics.median(t for _, t in got)
        out["flood_slice"][name] = {"bytes": size, "frames": got[0][0], "ms_median": ms}
        print(f"flood slice {name:>10} ({size} B): {got[0][0]} frames in one parser call, {ms:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
