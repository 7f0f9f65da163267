"""Where a decode step's hidden states are decoded: event-loop CPU per row for four strategies.

The split server's event loop caps the served path (docs/performance.md, "Cloud: the served path"); each
decoding session sends one [1, H] coded state per token. This bench times, for one step of N such states
(default N = 64 sessions, H = 4096, int8-outlier), the CPU the *event-loop thread* spends and the wall time
until every row is decoded:

* ``loop_each``: ``codec.decode`` per row on the loop (the server before ``SplitTranslator.flush_steps``);
* ``loop_rows``: one ``codec.decode_rows`` pass on the loop (what the server does now);
* ``pool_each``: ``codec.decode`` per row in a one-thread ``ThreadPoolExecutor`` (``run_in_executor``);
* ``pool_rows``: one ``decode_rows`` call in that executor per step.

Usage::

    python bench/step_decode_bench.py --out docs/results/step_decode.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.codecs import available_codecs  # noqa: E402


def states(codec_name: str, n: int, h: int, seed: int):
    rng = np.random.default_rng(seed)
    outliers = sorted(rng.choice(h, 8, replace=False).tolist())
    codec = available_codecs({"outlier_channels": outliers, "sink_threshold": 1e4})[codec_name]
    x = rng.standard_normal((n, h), dtype=np.float32)
    x[:, outliers] *= 100.0  # massive-activation channels, as at a real boundary
    return codec, [codec.encode(x[i:i + 1]) for i in range(n)]


async def one_step(strategy: str, codec, tensors, pool: ThreadPoolExecutor) -> np.ndarray:
    loop = asyncio.get_running_loop()
    if strategy == "loop_each":
        return np.concatenate([codec.decode(t) for t in tensors])
    if strategy == "loop_rows":
        return codec.decode_rows(tensors)
    if strategy == "pool_each":
        return np.concatenate(await asyncio.gather(*(loop.run_in_executor(pool, codec.decode, t) for t in tensors)))
    if strategy == "pool_rows":
        return await loop.run_in_executor(pool, codec.decode_rows, tensors)
    raise ValueError(strategy)


async def measure(strategy: str, codec, tensors, steps: int) -> dict:
    with ThreadPoolExecutor(1) as pool:
        ref = np.concatenate([codec.decode(t) for t in tensors])
        if not np.array_equal(await one_step(strategy, codec, tensors, pool), ref):
            raise RuntimeError(f"{strategy}: decoded rows differ from codec.decode")
        cpu, wall = [], []
        for _ in range(steps):
            c0, w0 = time.thread_time(), time.perf_counter()  # thread_time: this (the loop's) thread only
            await one_step(strategy, codec, tensors, pool)
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
    n = len(tensors)
    return {"strategy": strategy, "loop_cpu_us_per_row": 1e6 * statistics.median(cpu) / n,
            "wall_us_per_step": 1e6 * statistics.median(wall)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codec", default="int8-outlier")
    ap.add_argument("--rows", type=int, default=64, help="decoding sessions (rows per step)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per strategy (median kept)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    codec, tensors = states(a.codec, a.rows, a.hidden, 0)
    strategies = ("loop_each", "loop_rows", "pool_each", "pool_rows")
    records = [asyncio.run(measure(s, codec, tensors, a.steps)) for s in strategies]
    for r in records:
        print(f"{r['strategy']:>10}: loop CPU {r['loop_cpu_us_per_row']:7.1f} us/row, "
              f"wall {r['wall_us_per_step']:8.0f} us/step")
    res = {"command": shlex.join(["python", "bench/step_decode_bench.py", *(argv or sys.argv[1:])]),
           "config": {"codec": a.codec, "rows": a.rows, "hidden": a.hidden, "steps": a.steps},
           "env": {"python": platform.python_version(), "host_cpus": os.cpu_count(), "numpy": np.__version__},
           "records": records}
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
