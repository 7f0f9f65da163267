"""Host time of one ``LLMEngine`` decode step on the CPU, with the model work taken out.

The engine runs against a stub runner whose ``run(batch)`` returns precomputed logits at once, so what is
timed is only the engine's own host work per step: the feed of every session's ``[1, H]`` float32 state (one
``add_inputs`` of the ``[S, H]`` array where the engine has it, as the GPU benchmark's direct loop takes its
inputs; ``--row-feed`` or an engine without it: one ``add_input`` per session), then ``step()``: schedule,
``build_batch``, greedy sampling of S rows, postprocess. S sessions first prefill a short prompt; the timed steps are pure decode steps with all
S sequences ready. Each step's host time is also split at the moment the runner is called (the launch):
``prelaunch_us`` (``add_input`` x S, schedule, ``build_batch``: the device idles through it) and
``after_launch_us`` (sampling, postprocess: with ``async_scheduling`` it runs while the device computes, and
for a step's own bookkeeping even in lockstep). Both engine modes are measured (``overlap`` on and off).
``thread_cpu_us`` is the CPU time the bench's thread spent on a step (``time.thread_time``): on a machine shared
with other jobs it moves less than the wall-clock figures, which also count the time the thread waited for a core.
Each session's ``[1, H]`` state is a row view made once (as a server's decoded frame is), so the timed row feed is
the ``InputChunk`` and the ``add_input`` call; the batched feed's array is made once too.

Usage::

    python bench/engine_host_bench.py --out /tmp/engine_host.json          # this tree only
    python bench/engine_host_bench.py --compare /tmp/engine_before --out docs/results/engine_host.json
    python bench/engine_host_bench.py --profile 64     # cProfile of 200 steps at S = 64 (PROFILE_ROWS=60: more rows)

``--compare DIR`` first runs the same measurement in a subprocess against the packages exported to ``DIR``
(e.g. ``git archive <rev> cloud_server partition_tools shared | tar -x -C DIR``: the code before a change),
labelled ``before``, then against this tree (``after``), and prints both side by side. Run it as a script
(``python bench/engine_host_bench.py``): ``PYTHONPATH=DIR`` must win over the editable install.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from cloud_server.config import EngineConfig
from cloud_server.engine.kv_cache import KVCachePool
from cloud_server.engine.llm_engine import LLMEngine
from cloud_server.engine.sampling_params import SamplingParams
from cloud_server.engine.sequence import InputChunk


# the engine takes (logits, greedy ids) from continue_decode; before session 9 (--compare) the logits alone
_CONT_IDS = hasattr(LLMEngine, "add_inputs")


class _StubModel:
    """What the engine reads of a model: sizes, eos ids, no embeddings (split mode), 1-D RoPE."""

    def __init__(self, hidden_size: int, vocab_size: int):
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.eos_token_ids = [0]
        self.embed_tokens = None
        self.mrope = False
        self.returns_states = False  # a model ending at the cloud's last layer: logits, not hidden states


class _StubRunner:
    """``run(batch)`` (and ``continue_decode``) return precomputed float32 logits [S, V] (greedy token 7; with
    ``continue_decode`` its ids [S], as the fast runner's graph computes them) without computing anything."""

    def __init__(self, hidden_size: int, vocab_size: int, max_rows: int, num_blocks: int, block_size: int):
        self.model = _StubModel(hidden_size, vocab_size)
        self.pool = KVCachePool(1, num_blocks, block_size, 1, 8, torch.float32)
        self.logits = torch.zeros(max_rows, vocab_size)  # [R, V]
        self.logits[:, 7] = 1.0
        self.ids = torch.full((max_rows,), 7)  # [R]
        self.calls = 0

    def run(self, batch) -> torch.Tensor:
        self.calls += 1
        self.launched_at = time.perf_counter()
        return self.logits[: int(batch.logits_indices.shape[0])]  # [S, V]

    # what the fast runner adds (the engine uses them where the runner has them, as on the GPU): the buffer the
    # batch's hidden states are concatenated into, and the steady decode step given only its hidden states
    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def continue_decode(self, hidden: torch.Tensor, grown=(), order=None, *sampling):
        self.calls += 1
        self.launched_at = time.perf_counter()
        n = hidden.shape[0] if order is None else len(order)
        if sampling:  # an engine that hands the graph its sampling columns (session 10 on): (logits, ids, missed)
            return self.logits[:n], self.ids[:n], None  # (greedy here: the columns are None)
        return (self.logits[:n], self.ids[:n]) if _CONT_IDS else self.logits[:n]  # [S, V], [S]


def _engine(sessions: int, prompt: int, steps: int, hidden: int, vocab: int, block_size: int, overlap: bool = True,
            metrics: bool = False):
    max_len = prompt + steps + 8
    num_blocks = sessions * (-(-max_len // block_size)) + 1
    cfg = EngineConfig(max_num_seqs=max(sessions, 1), max_num_batched_tokens=max(2048, sessions * prompt),
                       max_model_len=max_len, num_blocks=num_blocks, block_size=block_size,
                       enable_prefix_cache=False, **_overlap_kw(overlap))
    runner = _StubRunner(hidden, vocab, max(sessions, 1), num_blocks, block_size)
    eng = LLMEngine(cfg, {"fp32": runner}, sampler_seed=0)
    if metrics:  # the server's Prometheus hooks, as `autoglm-cloud serve` attaches them
        from cloud_server.metrics import ServerMetrics

        eng.metrics = ServerMetrics("bench")
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(sessions):
        out = eng.add_request(f"r{i}", InputChunk(0, hidden=torch.randn(prompt, hidden)), params)
        if out:
            raise RuntimeError(f"request refused: {out[0].error_message}")
    got = 0
    while got < sessions:
        got += sum(1 for o in eng.step() if o.token_id is not None)
    while getattr(eng, "has_work", lambda: False)():
        eng.step()
    return eng


def _overlap_kw(overlap: bool) -> dict:
    """``async_scheduling`` for the engine config, where the measured code has it (--compare runs older code)."""
    return {"async_scheduling": overlap} if "async_scheduling" in EngineConfig.__dataclass_fields__ else {}


def _decode_steps(eng, sessions: int, steps: int, hidden: int, states: torch.Tensor,
                  row_feed: bool = False, feeds: int = 1) -> tuple[list, list, list, list]:
    """Run ``steps`` decode steps; per-step host seconds of the feed (``add_inputs``, or the add_input loop), of the
    step() calls until every session has its token, from the start of the step to its launch (the runner's ``run``
    call), and the CPU time this thread spent on the whole step (what other processes on a loaded machine do not
    add to)."""
    ids = [f"r{i}" for i in range(sessions)]
    rows = [states[j: j + 1] for j in range(sessions)]  # [1, H] each, made once: the feed's own work is not timed
    batched = not row_feed and hasattr(eng, "add_inputs")
    cuts = [round(k * sessions / feeds) for k in range(feeds + 1)]  # the K feeds' row ranges
    parts = [(ids[a:b], states[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]
    runner = eng.runners["fp32"]
    t_add, t_step, t_pre, t_cpu = [], [], [], []
    for _ in range(steps):
        pos = [eng.seqs[rid].num_received for rid in ids]
        c0 = time.thread_time()
        t0 = time.perf_counter()
        if batched:
            at = 0
            for part_ids, part in parts:
                out = eng.add_inputs(part_ids, pos[at:at + len(part_ids)], part)
                at += len(part_ids)
                if out:
                    raise RuntimeError(f"add_inputs failed: {out[0].error_message}")
        for rid, p, row in zip(ids, pos, rows) if not batched else ():
            out = eng.add_input(rid, InputChunk(p, hidden=row))
            if out:
                raise RuntimeError(f"add_input failed: {out[0].error_message}")
        t1 = time.perf_counter()
        outs = eng.step()
        if not outs:  # overlap: the step was launched; the next call postprocesses it
            outs = eng.step()
        t2 = time.perf_counter()
        t_cpu.append(time.thread_time() - c0)
        if len(outs) != sessions or any(o.token_id != 7 for o in outs):
            raise RuntimeError(f"expected one token 7 per session, got {len(outs)} outputs")
        t_add.append(t1 - t0)
        t_step.append(t2 - t1)
        t_pre.append(runner.launched_at - t0)
    return t_add, t_step, t_pre, t_cpu


class _LinkThread:
    """A thread busy ``duty`` of the time unpickling rows frames (6 turns of 11 rows), as the engine process's link
    thread reads the workers' decode steps; sleeps the rest."""

    def __init__(self, duty: float, hidden: int):
        import pickle
        import threading

        import numpy as np

        self.duty, self.stop = duty, threading.Event()
        self.frame = pickle.dumps(("rows", [f"r{i}" for i in range(11)], list(range(11)),
                                   np.zeros((11, hidden), np.float32)), protocol=5)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import pickle

        while not self.stop.is_set():
            t = time.perf_counter()
            for _ in range(6):
                pickle.loads(self.frame)
            busy = time.perf_counter() - t
            time.sleep(busy * (1 - self.duty) / self.duty)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def measure(sessions: int, steps: int, repeats: int, prompt: int, hidden: int, vocab: int,
            block_size: int, overlap: bool = True, row_feed: bool = False, feeds: int = 1,
            metrics: bool = False, link_duty: float = 0.0) -> dict:
    if link_duty > 0:
        with _LinkThread(link_duty, hidden):
            return measure(sessions, steps, repeats, prompt, hidden, vocab, block_size, overlap, row_feed, feeds,
                           metrics) | {"link_duty": link_duty}
    states = torch.randn(sessions, hidden)  # [S, H]
    adds, stepss, pres, cpus = [], [], [], []
    for _ in range(repeats):
        eng = _engine(sessions, prompt, steps + 10, hidden, vocab, block_size, overlap, metrics)
        _decode_steps(eng, sessions, 10, hidden, states, row_feed, feeds)  # warm-up
        a, s, pre, cpu = _decode_steps(eng, sessions, steps, hidden, states, row_feed, feeds)
        adds.append(statistics.median(a))
        stepss.append(statistics.median(s))
        pres.append(statistics.median(pre))
        cpus.append(statistics.median(cpu))
    add_us, step_us, pre_us = min(adds) * 1e6, min(stepss) * 1e6, min(pres) * 1e6
    return {"sessions": sessions, "overlap": overlap, "feed": "rows" if row_feed or not hasattr(LLMEngine, "add_inputs")
            else "batched", "feeds": feeds, "metrics": metrics, "link_duty": 0.0, "add_input_us": round(add_us, 1), "step_us": round(step_us, 1),
            "total_us": round(add_us + step_us, 1), "per_session_us": round((add_us + step_us) / sessions, 2),
            "prelaunch_us": round(pre_us, 1), "after_launch_us": round(add_us + step_us - pre_us, 1),
            "thread_cpu_us": round(min(cpus) * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="1,8,64,256")
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps per repeat")
    ap.add_argument("--repeats", type=int, default=3, help="fresh engines; the best median is kept")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096, help="boundary hidden size (GLM-4.1V: 4096)")
    ap.add_argument("--vocab", type=int, default=512, help="stub logits width (kept small: sampling is not timed "
                                                          "on the GPU path either, it is one device argmax)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--row-feed", action="store_true", help="one add_input per session even where the engine "
                    "has add_inputs (the engine's own gain without the batched feed)")
    ap.add_argument("--feeds", default="1", help="comma list: the batched feed split into K add_inputs (K front-end "
                    "workers' turns)")
    ap.add_argument("--metrics", default="off", help="comma list of off,on: the server's ServerMetrics attached")
    ap.add_argument("--link-duty", default="0", help="comma list of link-thread busy shares in [0, 1) (0: none)")
    ap.add_argument("--label", default="after")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--merge", action="store_true", help="keep other labels already in --out")
    ap.add_argument("--compare", type=Path, help="first measure the packages exported to this folder (before)")
    ap.add_argument("--profile", type=int, help="cProfile 200 steps at this many sessions instead (PROFILE_ROWS: "
                    "rows printed, default 25)")
    args = ap.parse_args()
    if args.compare is not None:
        if not (args.compare / "cloud_server" / "engine" / "llm_engine.py").is_file():
            raise SystemExit(f"--compare: {args.compare} holds no exported cloud_server package")
        if args.out is None:
            raise SystemExit("--compare needs --out (the before run is read back from it)")
        cmd = ([sys.executable, str(Path(__file__).resolve()), "--label", "before", "--out", str(args.out),
               "--sessions", args.sessions, "--steps", str(args.steps), "--repeats", str(args.repeats),
               "--prompt", str(args.prompt), "--hidden", str(args.hidden), "--vocab", str(args.vocab),
               "--block-size", str(args.block_size), "--feeds", args.feeds, "--metrics", args.metrics,
               "--link-duty", args.link_duty]
               + (["--row-feed"] if args.row_feed else []))
        env = {**os.environ, "PYTHONPATH": str(args.compare.resolve())}
        subprocess.run(cmd, env=env, check=True)
        args.label, args.merge = "after", True
    torch.set_num_threads(1)
    if args.profile:  # (the first --feeds and --metrics value)
        states = torch.randn(args.profile, args.hidden)
        feeds, metrics = int(args.feeds.split(",")[0]), args.metrics.split(",")[0] == "on"
        eng = _engine(args.profile, args.prompt, 210, args.hidden, args.vocab, args.block_size, metrics=metrics)
        _decode_steps(eng, args.profile, 10, args.hidden, states, args.row_feed, feeds)
        prof = cProfile.Profile()
        prof.enable()
        _decode_steps(eng, args.profile, 200, args.hidden, states, args.row_feed, feeds)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(int(os.environ.get("PROFILE_ROWS", 25)))
        return
    rows, rows_sync = [], []
    modes = (True, False) if _overlap_kw(True) else (True,)
    duties = [float(d) for d in args.link_duty.split(",")]
    variants = [(int(k), m == "on", d) for k in args.feeds.split(",") for m in args.metrics.split(",") for d in duties]
    if any(k < 1 for k, _, _ in variants) or not set(args.metrics.split(",")) <= {"on", "off"}:
        raise SystemExit("--feeds takes counts >= 1, --metrics off and/or on")
    if any(not 0 <= d < 1 for d in duties):
        raise SystemExit("--link-duty takes shares in [0, 1)")
    for s, (feeds, metrics, duty), overlap in ((int(x), v, o) for x in args.sessions.split(",") for v in variants
                                              for o in modes):
        r = measure(s, args.steps, args.repeats, args.prompt, args.hidden, args.vocab, args.block_size, overlap,
                    args.row_feed, feeds, metrics, duty)
        (rows if overlap else rows_sync).append(r)
        print(f"[{args.label}{'' if overlap else ', sync'}] S={s:4d}  feed ({r['feed']} x{feeds}"
              f"{', metrics' if metrics else ''}{f', link thread {duty:.0%} busy' if duty else ''}) "
              f"{r['add_input_us']:9.1f} us  "
              f"step {r['step_us']:9.1f} us  total {r['total_us']:9.1f} us  ({r['per_session_us']:.2f} us/session)"
              f"  before launch {r['prelaunch_us']:9.1f} us, after {r['after_launch_us']:9.1f} us"
              f"  (thread CPU {r['thread_cpu_us']:9.1f} us)", flush=True)
    if args.out:
        data = json.loads(args.out.read_text()) if args.merge and args.out.exists() else {}
        import cloud_server

        data[args.label] = {"rows": rows, "rows_sync": rows_sync, "code": str(Path(cloud_server.__file__).parent.parent), "torch": torch.__version__, "python": platform.python_version(),
                            "cpu": platform.processor() or platform.machine(), "threads": 1,
                            "config": {"steps": args.steps, "repeats": args.repeats, "prompt": args.prompt,
                                       "hidden": args.hidden, "vocab": args.vocab, "block_size": args.block_size}}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if "before" in data and "after" in data:
            pairs = [(b, a) for b, a in zip(data["before"]["rows"], data["after"]["rows"], strict=False)
                     if b["sessions"] == a["sessions"]]
            data["speedup_total"] = {str(b["sessions"]): round(b["total_us"] / a["total_us"], 2) for b, a in pairs}
            if all("thread_cpu_us" in r for p in pairs for r in p):
                data["speedup_thread_cpu"] = {str(b["sessions"]): round(b["thread_cpu_us"] / a["thread_cpu_us"], 2)
                                              for b, a in pairs}
            print("S      before us/step   after us/step   speedup   before launch: before / after us   "
                  "thread CPU: before / after us")
            for b, a in zip(data["before"]["rows"], data["after"]["rows"], strict=False):
                print(f"{b['sessions']:<4d} {b['total_us']:15.1f} {a['total_us']:15.1f} "
                      f"{b['total_us'] / a['total_us']:8.2f}x   {b['prelaunch_us']:9.1f} / {a['prelaunch_us']:9.1f}"
                      f"          {b['thread_cpu_us']:9.1f} / {a['thread_cpu_us']:9.1f}")
        args.out.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
