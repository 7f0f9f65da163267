"""Load on CPU: S concurrent split sessions against one ``autoglm-cloud serve`` with a tiny model; every session's
tokens must equal what the same session produces alone, with no errors and bounded server memory.

Each simulated edge speaks the real protocol (``shared.protocol``) with deterministic synthetic boundary states:
the state at position p of session i is a fixed function of (i, p, the token that produced it), so a session's
inputs - and therefore its greedy output - do not depend on what else the server runs. The compute variant is
pinned (``Prefill.compute="fp32"``, the server loads only fp32), so the load-dependent precision policy cannot
change the answer; the CPU engine is batch-invariant (``EngineConfig.batch_invariant``).

Phases: (1) every session alone, one after another (the reference); (2) all S at once, ``--rounds`` times.
Reported: sessions, errors, mismatches, tokens, wall time, tokens/s (the last round), and the server process's
memory from ``/proc/<pid>/status`` (RSS before the load, then RSS and peak RSS (``VmHWM``) after each round:
bounded means flat from round to round) with the KV pool size, preallocated at start, which bounds the
sequence state whatever the load.

    autoglm-partition split --preset tiny-glm4 --layer 2 --out /tmp/tiny   # or any split bundle
    python bench/load_bench.py --serve /tmp/tiny --sessions 256 --out docs/results/load.json

``tests/cloud_server/test_load.py`` runs 16 sessions through :func:`run_load` in the default suite and the
256-session bench slow-marked.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from shared import codecs as C
from shared import protocol as P
from shared.manifest import Manifest

from results_io import emit  # bench/ is on sys.path when a bench script runs


@dataclass(slots=True)
class LoadSpec:
    sessions: int = 256
    prompt_tokens: int = 12  # prompt positions per session (lengths vary by +-50 % around this)
    gen_tokens: int = 8  # tokens generated per session (ignore_eos: exactly this many)
    codec: str = "fp16"
    compute: str = "fp32"  # pinned compute variant
    seed: int = 0


def _state(hidden: int, *key: int) -> np.ndarray:
    """A deterministic boundary state [1, hidden] for ``key`` (session, position, token)."""
    digest = hashlib.blake2b(np.array(key, np.int64).tobytes(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return rng.standard_normal((1, hidden), dtype=np.float32)


def _prompt_len(spec: LoadSpec, i: int) -> int:
    lo, hi = max(1, spec.prompt_tokens // 2), spec.prompt_tokens * 3 // 2
    return lo + (i * 7919 + spec.seed) % (hi - lo + 1)


async def one_session(url: str, bundle_id: str, hidden: int, spec: LoadSpec, i: int,
                      headers: dict | None = None) -> list[int]:
    """Session ``i`` start to end: Hello, one Prefill, a DecodeStep per token, Close; returns its tokens."""
    import websockets

    codec = C.get_codec(spec.codec)
    n = _prompt_len(spec, i)
    prompt = np.concatenate([_state(hidden, spec.seed, i, p, -1) for p in range(n)])  # [n, H]
    async with websockets.connect(url, additional_headers=headers or {}, max_size=None,
                                  open_timeout=60, ping_interval=None) as ws:
        async def recv():
            return P.decode_message(await asyncio.wait_for(ws.recv(), 120))

        await ws.send(P.encode_message(P.Hello(bundle_id=bundle_id, codecs=[spec.codec])))
        welcome = await recv()
        if not isinstance(welcome, P.Welcome):
            raise RuntimeError(f"session {i}: refused: {welcome}")
        params = P.SamplingParams(max_tokens=spec.gen_tokens, temperature=0.0, ignore_eos=True)
        await ws.send(P.encode_message(P.Prefill(request_id="r", start=0, hidden=codec.encode(prompt), params=params,
                                                 compute=spec.compute)))
        tokens: list[int] = []
        while True:
            msg = await recv()
            if isinstance(msg, P.Error):
                raise RuntimeError(f"session {i}: {msg.code}: {msg.message}")
            if not isinstance(msg, P.Tokens):
                continue
            tokens += msg.token_ids
            if msg.finish_reason is not None:
                break
            pos = n + len(tokens) - 1
            step = codec.encode(_state(hidden, spec.seed, i, pos, tokens[-1]))
            await ws.send(P.encode_message(P.DecodeStep(request_id="r", position=pos, hidden=step)))
        await ws.send(P.encode_message(P.Close()))
    return tokens


async def _gather(url, bundle_id, hidden, spec, ids, headers) -> dict[int, list[int] | str]:
    async def guarded(i):
        try:
            return i, await one_session(url, bundle_id, hidden, spec, i, headers)
        except Exception as e:  # noqa: BLE001 - an error is a result to report
            return i, f"{type(e).__name__}: {e}"

    return dict(await asyncio.gather(*(guarded(i) for i in ids)))


def run_load(url: str, bundle: Path, spec: LoadSpec, headers: dict | None = None, memory=None,
             rounds: int = 1) -> dict:
    """Phase 1 (each session alone), phase 2 (all at once, ``rounds`` times: memory must not grow from one
    round to the next); ``memory()`` -> dict samples the server after each phase."""
    manifest = Manifest.load(bundle)
    hid, bid = manifest.hidden_size, manifest.bundle_id
    mem_before = memory() if memory else None
    t0 = time.perf_counter()
    alone: dict[int, list[int] | str] = {}
    for i in range(spec.sessions):
        alone.update(asyncio.run(_gather(url, bid, hid, spec, [i], headers)))
    t_alone = time.perf_counter() - t0
    mem_rounds = []
    errors = [v for v in alone.values() if isinstance(v, str)]
    mismatches: set[int] = set()
    for _ in range(rounds):
        t1 = time.perf_counter()
        together = asyncio.run(_gather(url, bid, hid, spec, range(spec.sessions), headers))
        t_together = time.perf_counter() - t1
        errors += [v for v in together.values() if isinstance(v, str)]
        mismatches |= {i for i in range(spec.sessions) if together[i] != alone[i]}
        if memory:
            mem_rounds.append(memory())
    tokens = sum(len(v) for v in together.values() if not isinstance(v, str))
    out = {"spec": asdict(spec), "sessions": spec.sessions, "rounds": rounds, "errors": len(errors), "first_errors": errors[:3],
           "mismatches": len(mismatches), "tokens_concurrent": tokens,
           "all_full_length": all(len(v) == spec.gen_tokens for v in together.values() if not isinstance(v, str)),
           "alone_s": round(t_alone, 2), "concurrent_s": round(t_together, 2),
           "concurrent_tokens_per_s": round(tokens / t_together, 1) if t_together else None}
    if memory:
        out["memory"] = {"before": mem_before, "after_each_round": mem_rounds}
    return out


# -- the server process -------------------------------------------------------------------------------
def proc_memory(pid: int) -> dict:
    """RSS now and the peak RSS (VmHWM) of process ``pid``, MiB."""
    text = Path(f"/proc/{pid}/status").read_text()
    get = lambda name: round(int(re.search(rf"^{name}:\s+(\d+) kB", text, re.M).group(1)) / 1024, 1)  # noqa: E731
    return {"rss_mib": get("VmRSS"), "peak_rss_mib": get("VmHWM")}


def metric(base_url: str, name: str) -> float:
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def serve(bundle: Path, port: int, sessions: int, num_blocks: int) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "import sys; from cloud_server.cli import main; sys.exit(main())", "serve", str(bundle),
           "--port", str(port), "--device", "cpu", "--variants", "fp32", "--max-sessions", str(sessions + 8),
           "--max-num-seqs", str(min(256, sessions)), "--max-num-batched-tokens", str(max(2048, 4 * sessions)),
           "--num-blocks", str(num_blocks), "--block-size", "16", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2).status == 200:
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server not ready in 180 s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", type=Path, required=True, help="bundle to serve (a tiny split bundle)")
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=12)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="concurrent rounds (memory after each)")
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    spec = LoadSpec(sessions=args.sessions, prompt_tokens=args.prompt, gen_tokens=args.gen)
    proc = serve(args.serve, args.port, args.sessions, args.num_blocks)
    base = f"http://127.0.0.1:{args.port}"
    try:
        result = run_load(f"ws://127.0.0.1:{args.port}/v1/split", args.serve, spec,
                          memory=lambda: proc_memory(proc.pid), rounds=args.rounds)
        time.sleep(1.0)
        result["after_load"] = {"sessions_open": metric(base, "autoglm:sessions_open"),
                                "requests_running": metric(base, "vllm:num_requests_running"),
                                "kv_cache_usage_perc": metric(base, "vllm:kv_cache_usage_perc")}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    manifest = Manifest.load(args.serve)
    result["model"] = manifest.bundle_id
    result["kv_pool_blocks"] = args.num_blocks
    emit(result, args.out, "load_bench.py", argv)
    ok = result["errors"] == 0 and result["mismatches"] == 0 and result["all_full_length"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
