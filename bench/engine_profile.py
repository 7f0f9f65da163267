"""Where the engine's slow steps spend their time: torch.profiler (CPU + CUDA) over three workloads, one process.

The issue-15 gaps this is for (``docs/performance.md``, "Overlap scheduling, sampling on the device, prefill
without stalls"): a mixed step (a prompt chunk beside 63 decode rows) costs far more than its arithmetic, the
sampled path costs ~20 % of greedy throughput at S = 64, and the engine's host time per lockstep step at S = 64
is ~1 ms over the direct loop. The engine is built as ``bench/cloud_gpu_bench.py --through-engine`` builds it
(``LLMEngine`` + the self-tuned ``FastGlmRunner``, glm4v-9b-random split at 12, bf16), then:

* ``mixed``: ``--sessions`` - 1 sessions decode at ~``--context`` positions while one ``--long-prompt`` prompt is
  prefilled ``P`` positions per step (``prefill_chunk_while_decoding = P``) for each P in ``--chunks``: every
  mixed step is timed (synchronized, without the profiler), and the second chunk (the first whose attention
  reads cached context) is profiled; a pure decode step of the same sessions beside it;
* ``sampling``: ``--sessions`` sessions decoding greedy, then sampled (temperature 0.7, top-p 0.9, seeded):
  step times side by side and a profile of ``--steps`` steps of each, plus ``Sampler.launch`` alone on the
  step's logits;
* ``decode_host``: the greedy lockstep decode step through the engine at ``--sessions``, with the host's
  phases timed (``perf_counter`` spans without the profiler, ``record_function`` ranges in the profile):
  ``add_input``, ``schedule``, ``build_batch``, ``runner.run`` (and inside it the uploads and the graph
  step), ``runner.continue_decode`` (a steady step), ``sampler.launch``, ``sampler.result`` (the wait for
  the device), ``postprocess``;
* ``decode_cprofile`` (last: it removes the ranges): the same step under cProfile at 1 and ``--sessions``
  sessions, host functions by own time.

The fast path's pieces are wrapped as well (``fast.linear``, ``attn.prefill``, ``attn.decode``,
``rope_store``, ``add_norm_norm``, ``silu_mul``), so a mixed step's table attributes device time to them. The
wrapping is done here, on the built objects; nothing in the engine changes. Per workload the top ops by device
time and by CPU time are printed and written to ``--out`` (JSON); ``--trace-dir`` also gets a Chrome trace of
each profiled window.

Usage::

    OUT=/tmp/p bench/gpu_session.sh profile                              # on the H200, ~3 minutes
    python bench/engine_profile.py --preset tiny-glm4v --split 1 --sessions 8 --context 40 --chunks 16,64 \\
        --long-prompt 128 --max-context 256 --steps 2 --out /tmp/prof.json  # CPU smoke, tiny model
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cloud_gpu_bench import BenchConfig, build_engine, env_info, log, model_config  # noqa: E402
from engine_workloads import GREEDY, SAMPLED, Phones  # noqa: E402

from cloud_server.engine import llm_engine as llm_engine_mod  # noqa: E402
from cloud_server.engine import sampler as sampler_mod  # noqa: E402
from cloud_server.engine.sampling_params import SamplingParams  # noqa: E402
from cloud_server.engine.sequence import InputChunk  # noqa: E402
from cloud_server.fast import glm as glm_mod  # noqa: E402
from cloud_server.fast import kernels as kernels_mod  # noqa: E402


@dataclass(slots=True)
class ProfileConfig:
    preset: str = "glm4v-9b-random"
    split: int = 12
    sessions: int = 64  # S of the sampling and decode-host workloads; the mixed step has S - 1 decoders
    context: int = 512  # prompt positions of every decoding session
    chunks: tuple[int, ...] = (128, 256, 2048)  # prompt positions per mixed step (128: the default cap)
    long_prompt: int = 4096
    max_context: int = 8192
    steps: int = 8  # profiled decode steps per workload (timed steps: 4x as many)
    top: int = 25  # rows per printed table
    seed: int = 0
    out: Path | None = None
    trace_dir: Path | None = None

    def __post_init__(self):
        if self.sessions < 2 or self.steps < 1 or self.context < 1 or not self.chunks:
            raise ValueError("need --sessions >= 2, --steps >= 1, --context >= 1 and at least one chunk size")
        if min(self.chunks) < 1 or max(self.chunks) * 2 > self.long_prompt:
            raise ValueError("every chunk size must be >= 1 and fit twice in --long-prompt (the second chunk is "
                             "profiled)")
        if self.long_prompt + 1 > self.max_context:
            raise ValueError("--long-prompt must be < --max-context")


# ------------------------------------------------------------------------------------------------
# spans: named host ranges (perf_counter totals, and record_function ranges when a profiler runs)


class Spans:
    """Wraps callables in named ranges: host seconds per name (``totals``), and a ``record_function`` range of
    that name so the profiler attributes the ops launched inside. :meth:`restore` puts the originals back."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.names: set[str] = set()  # every range name wrapped
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, obj, attr: str, name: str) -> None:
        inner = getattr(obj, attr)
        totals, counts = self.totals, self.counts
        self.names.add(name)

        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            with record_function(name):
                try:
                    return inner(*args, **kwargs)
                finally:
                    totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0
                    counts[name] = counts.get(name, 0) + 1

        # a class or module attribute is replaced (and put back as it was, descriptor included); on an instance
        # the wrapper shadows its class's method (and is deleted again)
        own = vars(obj).get(attr) if isinstance(obj, type) or attr in vars(obj) else None
        self._undo.append((obj, attr, own))
        setattr(obj, attr, wrapped)

    def reset(self) -> None:
        self.totals.clear()
        self.counts.clear()

    def per_step_ms(self, steps: int) -> dict[str, float]:
        return {k: round(1e3 * v / steps, 4) for k, v in sorted(self.totals.items(), key=lambda kv: -kv[1])}

    def restore(self) -> None:
        for obj, attr, inner in reversed(self._undo):
            if inner is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, inner)
        self._undo.clear()


def instrument(engine, runner) -> Spans:
    """Named ranges over the engine's host phases and the fast path's pieces (see the module docstring)."""
    sp = Spans()
    sp.wrap(engine, "add_input", "engine.add_input")
    if hasattr(engine, "add_inputs"):  # the batched feed (engine_workloads.Phones)
        sp.wrap(engine, "add_inputs", "engine.add_inputs")
    sp.wrap(engine.scheduler, "schedule", "engine.schedule")
    sp.wrap(llm_engine_mod, "build_batch", "engine.build_batch")
    sp.wrap(engine, "_postprocess", "engine.postprocess")
    sp.wrap(engine.sampler, "launch", "sampler.launch")
    sp.wrap(sampler_mod.PendingSample, "result", "sampler.result")
    sp.wrap(runner, "run", "runner.run")
    if hasattr(runner, "continue_decode"):  # the steady decode step the engine hands over without a batch
        sp.wrap(runner, "continue_decode", "runner.continue_decode")
    if hasattr(runner, "graphs"):  # the fast runner
        for attr in ("_upload", "_tables"):
            sp.wrap(runner, attr, "runner.upload")
        sp.wrap(runner.graphs, "step", "graphs.step")
        sp.wrap(runner.graphs, "step_next", "graphs.step_next")
        if hasattr(runner.graphs, "step_next_sampled"):  # the sampled graph (the sampler's rule captured)
            sp.wrap(runner.graphs, "step_next_sampled", "graphs.step_next_sampled")
        sp.wrap(runner.graphs, "_run", "graphs.replay")
        sp.wrap(runner.fast, "linear", "fast.linear")
        sp.wrap(runner.fast, "compute_logits", "fast.lm_head")
        sp.wrap(glm_mod, "prefill_attention", "attn.prefill")
        sp.wrap(glm_mod, "decode_attention", "attn.decode")
        sp.wrap(glm_mod.PrefillMeta, "build", "prefill_meta.build")
        for name in ("rope_store", "add_norm_norm", "silu_mul", "rmsnorm"):
            sp.wrap(kernels_mod, name, name)
    return sp


# ------------------------------------------------------------------------------------------------
# profiler plumbing


def _activities(dev: torch.device) -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])


def _attr(e, *names: str) -> float:
    for n in names:
        v = getattr(e, n, None)
        if v is not None:
            return float(v)
    return 0.0


def top_ops(prof, n: int, steps: int, ranges: set[str]) -> dict:
    """The profile's ops by self device time and by self CPU time, and the named ``ranges`` (record_function) by
    total CPU time; all per step, in us."""
    rows = []
    for e in prof.key_averages():
        rows.append({"name": e.key, "calls_per_step": round(e.count / steps, 2),
                     "self_device_us": round(_attr(e, "self_device_time_total", "self_cuda_time_total") / steps, 1),
                     "device_us": round(_attr(e, "device_time_total", "cuda_time_total") / steps, 1),
                     "self_cpu_us": round(_attr(e, "self_cpu_time_total") / steps, 1),
                     "cpu_us": round(_attr(e, "cpu_time_total") / steps, 1)})
    by_dev = sorted((r for r in rows if r["self_device_us"] > 0), key=lambda r: -r["self_device_us"])[:n]
    named = sorted((r for r in rows if r["name"] in ranges), key=lambda r: -r["cpu_us"])
    return {"by_self_device": by_dev, "by_self_cpu": sorted(rows, key=lambda r: -r["self_cpu_us"])[:n], "ranges": named,
            "device_total_us_per_step": round(sum(r["self_device_us"] for r in rows), 1)}


def print_top(title: str, table: dict, n: int) -> None:
    print(f"\n== {title} == (per step; device total {table['device_total_us_per_step']:.0f} us)")
    for key, col in (("by_self_device", "self_device_us"), ("by_self_cpu", "self_cpu_us"), ("ranges", "cpu_us")):
        print(f"-- {key} --")
        for r in table[key][:n]:
            print(f"  {r[col]:10.1f} us  x{r['calls_per_step']:<7g} dev {r['device_us']:9.1f} cpu {r['cpu_us']:9.1f}  "
                  f"{r['name'][:90]}")


def profiled(fn, dev, trace: Path | None):
    """Run ``fn()`` under torch.profiler; returns the profile (and writes its Chrome trace to ``trace``)."""
    with profile(activities=_activities(dev), record_shapes=False) as prof:
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    return prof


# ------------------------------------------------------------------------------------------------
# workloads


class Bench:
    def __init__(self, pc: ProfileConfig):
        self.pc = pc
        self.dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        variant = "bf16" if self.dev.type == "cuda" else "fp32"
        cfg, hf_full = model_config(pc.preset, pc.split)
        bc = BenchConfig(preset=pc.preset, split=pc.split, sessions=(pc.sessions,), prompt=pc.context,
                         gen=4 * pc.steps + 16, max_context=pc.max_context, pool_sessions=pc.sessions,
                         prefill_chunk_tokens=max(8192, pc.context, max(pc.chunks) + pc.sessions),
                         prefill_stall=True, stall_prompt=pc.long_prompt, seed=pc.seed)
        t0 = time.perf_counter()
        self.engine, self.runner, self.build = build_engine(bc, hf_full, self.dev, variant)
        self.build["seconds"] = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(pc.seed + 3)
        h = cfg.hidden_size
        self.prompts = [torch.randn(pc.context, h, generator=gen) for _ in range(4)]  # [P, H] float32
        self.steps_in = [torch.randn(1, h, generator=gen) for _ in range(16)]  # [1, H] float32
        self.long = torch.randn(pc.long_prompt, h, generator=gen)  # [P, H]
        self.range_names: set[str] = set()  # the instrumented ranges (set by main)
        self.res: dict = {"config": {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                                     for k, v in ((f, getattr(pc, f)) for f in pc.__dataclass_fields__)},
                          "env": env_info(self.dev), "build": self.build,
                          "command": "python3 bench/engine_profile.py " + " ".join(sys.argv[1:])}

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def trace(self, name: str) -> Path | None:
        return None if self.pc.trace_dir is None else self.pc.trace_dir / f"{name}.json"

    def timed_steps(self, phones: Phones, steps: int, k0: int = 0) -> list[float]:
        """``steps`` lockstep decode steps, each synchronized: seconds from the first input to the last token."""
        out = []
        for k in range(steps):
            self.sync()
            t0 = time.perf_counter()
            phones.feed(k0 + k)
            phones.step_until_tokens()
            self.sync()
            out.append(time.perf_counter() - t0)
        return out

    def record(self, key: str, prof, steps: int, extra: dict) -> None:
        table = top_ops(prof, self.pc.top, steps, self.range_names)
        print_top(key, table, self.pc.top)
        self.res[key] = {**extra, "profile": table}
        self.save()

    def save(self) -> None:
        if self.pc.out is not None:
            self.pc.out.parent.mkdir(parents=True, exist_ok=True)
            self.pc.out.write_text(json.dumps(self.res, indent=1, default=str) + "\n")

    # -- 1. mixed steps -------------------------------------------------------------------------
    def mixed(self, chunk: int, spans: Spans) -> None:
        """``chunk`` prompt positions beside S - 1 decode rows, step by step (synchronous engine: one
        ``step()`` = one forward pass); the second chunk profiled."""
        eng, pc = self.engine, self.pc
        saved = eng.config.prefill_chunk_while_decoding, eng.config.async_scheduling
        eng.config.prefill_chunk_while_decoding, eng.config.async_scheduling = chunk, False
        phones = Phones(eng, f"mixed{chunk}", pc.sessions - 1, self.steps_in)
        try:
            phones.admit(self.prompts, GREEDY, 8 * pc.steps + pc.long_prompt // chunk + 16)
            decode_ms = [1e3 * t for t in self.timed_steps(phones, 2 * pc.steps)]
            rid = f"long{chunk}"
            phones.check(eng.add_request(rid, InputChunk(0, hidden=self.long),
                                         SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
            mixed_ms, k, prof, host = [], 2 * pc.steps, None, None
            while rid in eng.seqs:
                self.sync()
                t0 = time.perf_counter()
                phones.feed(k)
                if len(mixed_ms) == 1:  # the second chunk: the first that attends to cached context
                    spans.reset()
                    prof = profiled(phones.step_until_tokens, self.dev, self.trace(f"mixed{chunk}"))
                    host = spans.per_step_ms(1)
                else:
                    phones.step_until_tokens()
                self.sync()
                mixed_ms.append(1e3 * (time.perf_counter() - t0))
                k += 1
            extra = {"chunk": chunk, "decoders": pc.sessions - 1, "decode_step_ms_median": statistics.median(decode_ms),
                     "mixed_step_ms": [round(x, 3) for x in mixed_ms], "mixed_steps": len(mixed_ms),
                     "mixed_step_ms_median": statistics.median(mixed_ms),
                     "mixed_over_decode": statistics.median(mixed_ms) / statistics.median(decode_ms),
                     "profiled_step_ms_with_profiler_off": mixed_ms[1] if len(mixed_ms) > 1 else None,
                     "profiled_step_host_ms": host}
            log(f"mixed chunk {chunk}: decode step {extra['decode_step_ms_median']:.2f} ms, mixed step median "
                f"{extra['mixed_step_ms_median']:.2f} ms ({extra['mixed_over_decode']:.1f}x), steps {mixed_ms[:4]}...")
            if prof is not None:
                self.record(f"mixed_{chunk}", prof, 1, extra)
        finally:
            phones.finish()
            eng.config.prefill_chunk_while_decoding, eng.config.async_scheduling = saved

    # -- 2. sampled vs greedy -----------------------------------------------------------------------
    def sampling(self, spans: Spans) -> None:
        pc, eng = self.pc, self.engine
        times = {}
        for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
            phones = Phones(eng, f"prof-{name}", pc.sessions, self.steps_in)
            try:
                phones.admit(self.prompts, params, 8 * pc.steps + 8)
                self.timed_steps(phones, 2)  # warm
                spans.reset()
                t = self.timed_steps(phones, 4 * pc.steps, 2)
                times[name] = {"step_ms_median": 1e3 * statistics.median(t), "step_ms_mean": 1e3 * statistics.mean(t),
                               "host_ms_per_step": spans.per_step_ms(4 * pc.steps)}
                spans.reset()
                prof = profiled(lambda ph=phones: self.timed_steps(ph, pc.steps, 2 + 4 * pc.steps), self.dev,
                                self.trace(f"decode_{name}"))
                self.record(f"decode_{name}", prof, pc.steps, times[name])
            finally:
                phones.finish()
        ratio = times["greedy"]["step_ms_median"] / times["sampled"]["step_ms_median"]
        self.res["sampled_over_greedy_step"] = ratio
        log(f"S={pc.sessions}: greedy step {times['greedy']['step_ms_median']:.3f} ms, sampled "
            f"{times['sampled']['step_ms_median']:.3f} ms: sampled/greedy throughput {ratio:.3f}")
        self.sampler_alone()

    def sampler_alone(self) -> None:
        """``Sampler.launch`` + ``result`` alone on [S, V] logits (the runner's output dtype and device)."""
        pc, eng = self.pc, self.engine
        g = torch.Generator().manual_seed(pc.seed)
        logits = (1.3 * torch.randn(pc.sessions, eng.vocab_size, generator=g)).to(self.dev)  # [S, V] flat, as random
        params = [SamplingParams(temperature=0.7, top_p=0.9, seed=i) for i in range(pc.sessions)]
        positions = [pc.context + 1] * pc.sessions

        def run(n):
            for _ in range(n):
                eng.sampler.launch(logits, params, positions).result()

        run(3)
        self.sync()
        t0 = time.perf_counter()
        run(4 * pc.steps)
        self.sync()
        ms = 1e3 * (time.perf_counter() - t0) / (4 * pc.steps)
        prof = profiled(lambda: run(pc.steps), self.dev, self.trace("sampler_alone"))
        log(f"sampler alone, S={pc.sessions} sampled: {ms:.3f} ms per step")
        self.record("sampler_alone", prof, pc.steps, {"step_ms": ms})

    # -- 3. host breakdown of the greedy decode step ----------------------------------------------
    def decode_host(self, spans: Spans) -> None:
        pc, eng = self.pc, self.engine
        out = {}
        for overlap in (True, False):
            eng.config.async_scheduling = overlap
            phones = Phones(eng, f"host{overlap}", pc.sessions, self.steps_in)
            try:
                phones.admit(self.prompts, GREEDY, 8 * pc.steps + 8)
                self.timed_steps(phones, 2)
                spans.reset()
                t = self.timed_steps(phones, 4 * pc.steps, 2)
                out["overlap" if overlap else "sync"] = {"step_ms_median": 1e3 * statistics.median(t),
                                                         "host_ms_per_step": spans.per_step_ms(4 * pc.steps)}
            finally:
                phones.finish()
        eng.config.async_scheduling = True
        for k, v in out.items():
            log(f"decode S={pc.sessions} ({k}): step {v['step_ms_median']:.3f} ms; host ms/step {v['host_ms_per_step']}")
        self.res["decode_host"] = out
        self.save()


    # -- 4. the greedy lockstep step's host work under cProfile, 1 session and S ----------------------
    def decode_cprofile(self, spans: Spans) -> None:
        """The greedy lockstep decode step (overlap on) under cProfile at 1 and ``--sessions`` sessions, the
        spans' wrappers removed: the host functions by own time per step (where the engine's time over the
        direct loop goes, function by function)."""
        import cProfile
        import io
        import pstats

        spans.restore()
        pc, eng = self.pc, self.engine
        out = {}
        for s in (1, pc.sessions):
            phones = Phones(eng, f"cprof{s}", s, self.steps_in)
            try:
                phones.admit(self.prompts, GREEDY, 8 * pc.steps + 8)
                self.timed_steps(phones, 2)
                t = self.timed_steps(phones, 2 * pc.steps, 2)
                prof = cProfile.Profile()
                prof.enable()
                self.timed_steps(phones, 4 * pc.steps, 2 + 2 * pc.steps)
                prof.disable()
            finally:
                phones.finish()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(pc.top)
            text = buf.getvalue()
            print(f"== cProfile, S={s}, {4 * pc.steps} steps (median step without the profiler "
                  f"{1e3 * statistics.median(t):.3f} ms)\n{text}", flush=True)
            out[str(s)] = {"step_ms_median": 1e3 * statistics.median(t), "steps": 4 * pc.steps, "top": text}
        self.res["decode_cprofile"] = out
        self.save()


def parse_args(argv=None) -> tuple[ProfileConfig, list[str]]:
    d = ProfileConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    plain = ("preset", "split", "sessions", "context", "long_prompt", "max_context", "steps", "top", "seed")
    for name in plain:  # each a ProfileConfig field of the same name and type
        p.add_argument("--" + name.replace("_", "-"), type=type(getattr(d, name)), default=getattr(d, name))
    p.add_argument("--chunks", default=",".join(map(str, d.chunks)), help="prompt positions per mixed step")
    p.add_argument("--only", default="mixed,sampling,decode_host", help="workloads to run, in this order")
    p.add_argument("--out", type=Path)
    p.add_argument("--trace-dir", type=Path)
    a = p.parse_args(argv)
    pc = ProfileConfig(**{n: getattr(a, n) for n in plain}, chunks=tuple(int(x) for x in a.chunks.split(",") if x),
                       out=a.out, trace_dir=a.trace_dir)
    return pc, [w for w in a.only.split(",") if w]


def main(argv=None) -> int:
    pc, only = parse_args(argv)
    bad = set(only) - {"mixed", "sampling", "decode_host", "decode_cprofile"}
    if bad:
        raise SystemExit(f"--only: unknown workloads {sorted(bad)}")
    b = Bench(pc)
    log(f"engine built in {b.build['seconds']:.1f} s: {b.build}")
    spans = instrument(b.engine, b.runner)
    b.range_names = spans.names
    errors = b.res["errors"] = {}
    try:
        for w in only:
            for fn in ([lambda c=c: b.mixed(c, spans) for c in pc.chunks] if w == "mixed"
                       else [lambda: b.sampling(spans)] if w == "sampling"
                       else [lambda: b.decode_cprofile(spans)] if w == "decode_cprofile"
                       else [lambda: b.decode_host(spans)]):
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - one run must yield all it can
                    errors[w] = traceback.format_exc()
                    log(f"{w} FAILED: {e}")
                    with contextlib.suppress(Exception):
                        while b.engine.has_work():
                            b.engine.step()
    finally:
        spans.restore()
        b.save()
    if errors:
        print("errors in:", ", ".join(errors))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
