"""Served lockstep decoding, modelled on the CPU: the real ``AsyncEngine`` + ``LLMEngine`` scheduling S phones whose
round trips are drawn from a distribution, against a simulated GPU.

What it is for: the served path's question the H200 could not answer in session 11 (docs/performance.md,
"Session 11", the straggler hypothesis): when phones' next states come back spread out, do the engine's policies
(overlap scheduling, the gather window) keep one cohort per step, or fragment it into steps of a few rows that cost
nearly a full memory-bound step each? This runs the engine's own code for every decision; only two parts are
models, and they are stated here:

* **the device**: a stub runner whose steps take the H200's measured direct-loop step time for their row count
  (``DEVICE_MS``, interpolated; ``docs/results/cloud_gpu.json``), one stream (a step starts when the previous one
  ends), the sampled ids readable when it ends (the sampler's wait is a sleep until then);
* **the phones and the front end**: each token's next state reaches the engine (``AsyncEngine.add_rows``) after a
  round trip drawn from a log-normal with the given median and p99 (the served runs measured 1.5 / 3.8 ms at 8
  sessions, 3.5 / 4-8 ms at 64, both including the engine's own wait), independently per token.

It prints tokens/s and ITL per configuration, the engine's steps per token round, and the ratio to the device's
lockstep limit (S rows every ``DEVICE_MS(S)``). A model: it ranks policies, it does not measure the served path.

Usage::

    python bench/lockstep_model.py --sessions 64 --tokens 96 --rt-ms 1.0,1.5,2.5 --rt-p99-ms 2,3.8,6 --seeds 0,1 \\
        --json docs/results/lockstep_model.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cloud_server.config import EngineConfig  # noqa: E402
from cloud_server.engine.async_engine import AsyncEngine  # noqa: E402
from cloud_server.engine.kv_cache import KVCachePool  # noqa: E402
from cloud_server.engine.llm_engine import LLMEngine  # noqa: E402
from cloud_server.engine.sampling_params import SamplingParams  # noqa: E402
from cloud_server.engine.sequence import InputChunk  # noqa: E402
from engine_host_bench import _StubModel  # noqa: E402  (what the engine reads of a model)

# the H200's direct decode loop (glm4v-9b-random split at 12, bf16): rows -> ms per step (session 11, run e1)
DEVICE_MS = ((1, 3.737), (8, 4.175), (64, 4.794), (256, 8.216))


def device_ms(rows: int) -> float:
    pts = DEVICE_MS
    if rows <= pts[0][0]:
        return pts[0][1]
    for (r0, m0), (r1, m1) in zip(pts, pts[1:]):
        if rows <= r1:
            return m0 + (m1 - m0) * (rows - r0) / (r1 - r0)
    return pts[-1][1]


class SimulatedDevice:
    """The engine's runner: logits of token 7, and a clock: each step ends ``device_ms(rows)`` after the later of
    its launch and the previous step's end (``last_done``)."""

    def __init__(self, hidden: int, vocab: int, rows: int, num_blocks: int, block_size: int):
        self.model = _StubModel(hidden, vocab)
        self.pool = KVCachePool(1, num_blocks, block_size, 1, 8, torch.float32)
        self.logits = torch.zeros(rows, vocab)  # [R, V]
        self.logits[:, 7] = 1.0
        self.ids = torch.full((rows,), 7)  # [R]
        self.free_at = self.last_done = 0.0
        self.steps: list[int] = []  # rows of each step

    def _clock(self, n: int) -> None:
        start = max(time.perf_counter(), self.free_at)
        self.free_at = self.last_done = start + device_ms(n) / 1e3
        self.steps.append(n)

    def run(self, batch) -> torch.Tensor:
        n = int(batch.logits_indices.shape[0])
        self._clock(n)
        return self.logits[:n]  # [S, V]

    def host_buffer(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def continue_decode(self, hidden, grown=(), order=None, sampling=None):
        n = hidden.shape[0] if order is None else len(order)
        self._clock(n)
        return self.logits[:n], self.ids[:n], None


def _waiting_sampler(engine: LLMEngine, dev: SimulatedDevice) -> None:
    """The sampled ids of a step become readable when the simulated device finishes it."""
    launch = engine.sampler.launch

    def wrapped(*args, **kwargs):
        pending = launch(*args, **kwargs)
        done, ids, result = dev.last_done, pending.token_ids, pending.result

        def wait():
            left = done - time.perf_counter()
            if left > 0:
                time.sleep(left)

        pending.token_ids = lambda: (wait(), ids())[1]
        pending.result = lambda: (wait(), result())[1]
        return pending

    engine.sampler.launch = wrapped


def run_config(sessions: int, tokens: int, rt_median_ms: float, rt_p99_ms: float, async_scheduling: bool,
               gather_max_s: float | None, hidden: int = 256, prompt: int = 32, seed: int = 0) -> dict:
    """One configuration: S phones decoding ``tokens`` each against the real engine and the simulated device."""
    block = 16
    max_len = prompt + tokens + 8
    num_blocks = sessions * (-(-max_len // block)) + 1
    cfg = EngineConfig(max_num_seqs=sessions, max_num_batched_tokens=max(2048, sessions * prompt),
                       max_model_len=max_len, num_blocks=num_blocks, block_size=block, enable_prefix_cache=False,
                       async_scheduling=async_scheduling)
    dev = SimulatedDevice(hidden, 512, sessions, num_blocks, block)
    llm = LLMEngine(cfg, {"fp32": dev}, sampler_seed=seed)
    _waiting_sampler(llm, dev)
    eng = AsyncEngine(llm, gather_max_s=gather_max_s).start()
    rng = random.Random(seed)
    sigma = math.log(rt_p99_ms / rt_median_ms) / 2.326
    mu = math.log(rt_median_ms / 1e3)
    rows = torch.randn(sessions, hidden)  # [S, H] every session's state (the values do not matter)
    due: list[tuple[float, int, int]] = []  # (time, session, position) heap: states on their way back
    lock, more = threading.Lock(), threading.Condition()
    times: list[list[float]] = [[] for _ in range(sessions)]
    finished = threading.Event()
    left = [sessions]

    def sink(i: int):
        def on(out):
            now = time.perf_counter()
            if out.token_id is not None:
                times[i].append(now)
            if out.finished:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        finished.set()
                return
            if out.token_id is not None:
                with more:
                    heapq.heappush(due, (now + rng.lognormvariate(mu, sigma), i, prompt + len(times[i]) - 1))
                    more.notify()
        return on

    def phones():  # hand the states back when their round trip is over, those due together in one add_rows
        while not finished.is_set():
            with more:
                while not due and not finished.is_set():
                    more.wait(0.05)
                if not due:
                    continue
                wait = due[0][0] - time.perf_counter()
                if wait > 0:
                    more.wait(wait)
                    continue
                batch = []
                now = time.perf_counter()
                while due and due[0][0] <= now:
                    batch.append(heapq.heappop(due))
            ids = [f"s{i}" for _, i, _ in batch]
            eng.add_rows(ids, [p for _, _, p in batch], rows[[i for _, i, _ in batch]].clone())

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    threading.Thread(target=phones, daemon=True).start()
    t0 = time.perf_counter()
    for i in range(sessions):
        eng.add_request(f"s{i}", sink(i), InputChunk(0, hidden=torch.randn(prompt, hidden)), params)
    if not finished.wait(600):
        raise RuntimeError("the model run did not finish")
    wall = time.perf_counter() - t0
    eng.shutdown()
    first = max(t[0] for t in times)  # every session decoding from here on
    last = min(t[-1] for t in times)
    steady = sum(sum(1 for x in t if first <= x <= last) for t in times) / max(last - first, 1e-9)
    itl = [1e3 * (b - a) for t in times for a, b in zip(t, t[1:]) if a >= first]
    decode_steps = [n for n in dev.steps if n <= sessions]
    limit = sessions / (device_ms(sessions) / 1e3)
    return {"sessions": sessions, "tokens": tokens, "rt_median_ms": rt_median_ms, "rt_p99_ms": rt_p99_ms,
            "async_scheduling": async_scheduling, "gather_max_s": gather_max_s, "wall_s": wall,
            "steady_tokens_per_s": steady, "lockstep_limit_tokens_per_s": limit, "of_limit": steady / limit,
            "itl_p50_ms": statistics.median(itl), "itl_p90_ms": float(np.percentile(itl, 90)),
            "device_steps": len(dev.steps), "steps_per_token_round": len(dev.steps) / tokens,
            "rows_per_step_median": statistics.median(decode_steps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=96, help="tokens per session")
    ap.add_argument("--rt-ms", default="1.5,2.5", help="round-trip medians, one configuration each")
    ap.add_argument("--rt-p99-ms", default="3.8,6", help="their p99s (same count)")
    ap.add_argument("--gather-max-ms", default="default", help="AsyncEngine gather caps: 'default' or ms")
    ap.add_argument("--seeds", default="0", help="round-trip draws, one run each")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    meds, p99s = [float(x) for x in a.rt_ms.split(",")], [float(x) for x in a.rt_p99_ms.split(",")]
    if len(meds) != len(p99s) or any(q <= m for m, q in zip(meds, p99s)):
        ap.error("--rt-ms and --rt-p99-ms: the same count, each p99 above its median")
    gathers = [None if g == "default" else float(g) / 1e3 for g in a.gather_max_ms.split(",")]
    out = {"command": "python bench/lockstep_model.py " + " ".join(sys.argv[1:]), "device_ms": DEVICE_MS, "runs": []}
    print(f"{'rt p50/p99 ms':>14} {'seed':>4} {'overlap':>7} {'gather':>8} {'tok/s':>8} {'of limit':>8} "
          f"{'ITL p50':>8} {'steps/round':>11} {'rows/step':>9}")
    for m, q in zip(meds, p99s):
        for seed in [int(x) for x in a.seeds.split(",")]:
            for gather in gathers:
                for overlap in (True, False):
                    r = run_config(a.sessions, a.tokens, m, q, overlap, gather, seed=seed)
                    r["seed"] = seed
                    out["runs"].append(r)
                    print(f"{m:>6.1f} / {q:<5.1f} {seed:>4} {str(overlap):>7} {str(gather):>8} "
                          f"{r['steady_tokens_per_s']:>8.0f} {r['of_limit']:>8.3f} {r['itl_p50_ms']:>8.2f} "
                          f"{r['steps_per_token_round']:>11.2f} {r['rows_per_step_median']:>9.1f}", flush=True)
                    if a.json:
                        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
