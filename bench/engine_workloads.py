"""Engine-level workloads shared by the GPU benchmark and its CPU smoke runs: S phones fed through ``LLMEngine``.

Every workload drives the engine's public API as the split endpoint does (``add_request`` with a prompt's
boundary states, then per decode step every session's state - one ``add_inputs`` of an ``[S, H]`` array in the
engine's ``input_buffer``, as the direct loop takes its pinned ``[S, H]`` inputs; one ``add_input`` per session
for an engine without it - and ``step()`` calls until each session has its token), so with ``async_scheduling``
a decode step may take two ``step()`` calls (launch, then the postprocess): what a phone sees is the time from
its input to its token, which is what is timed.

* :func:`lockstep` -- S sessions decoding in lockstep: tokens/s, step time split into ``add_input`` and
  ``step()``, and the host time spent inside the runner's ``run`` (launching, not waiting: no sync is added);
* :func:`sampled_vs_greedy` -- the same S sessions greedy and with temperature 0.7 / top-p 0.9 (seeded),
  alternated twice, side by side: the cost of sampling on the device;
* :func:`prefill_stall` -- ``decoders`` sessions decoding while one long prompt arrives, per prefill chunk cap
  (``EngineConfig.prefill_chunk_while_decoding``; 0 = no cap, the whole token budget): their inter-token latency
  p50 / p99 / max with and without the arrival, and the long prompt's time to its first token (the issue's
  "prefill without stalls": p99 within 2x of steady).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from cloud_server.engine.sampling_params import SamplingParams
from cloud_server.engine.sequence import InputChunk

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


class TimedRun:
    """Wraps ``runner.run`` (and ``continue_decode``, the steady decode step the engine hands a fast runner
    without a batch): host seconds spent inside them (building and launching the step; they do not wait for
    the device, so the engine's overlap is kept)."""

    def __init__(self, runner):
        self.runner, self.total = runner, 0.0
        self.names = [n for n in ("run", "continue_decode") if hasattr(runner, n)]
        self.own = {n: vars(runner)[n] for n in self.names if n in vars(runner)}  # instance attributes to put back
        for name in self.names:
            setattr(runner, name, self._timed(getattr(runner, name)))

    def _timed(self, inner):
        def call(*args):
            t0 = time.perf_counter()
            out = inner(*args)
            self.total += time.perf_counter() - t0
            return out

        return call

    def remove(self) -> None:
        for name in self.names:
            if name in self.own:
                setattr(self.runner, name, self.own[name])
            else:
                delattr(self.runner, name)  # the wrapper was an instance attribute: the class's method shows again


def _params(base: SamplingParams, max_tokens: int, seed: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=base.temperature, top_p=base.top_p, top_k=base.top_k, seed=seed,
                          max_tokens=max_tokens, ignore_eos=True)


class Phones:
    """Sessions of one workload: admitted with a prompt, fed one ``[1, H]`` state per decode step."""

    def __init__(self, engine, tag: str, n: int, steps_in: list[torch.Tensor]):
        self.engine, self.steps_in = engine, steps_in
        self.ids = [f"{tag}-{i}" for i in range(n)]
        self.tokens: dict[str, list[int]] = {rid: [] for rid in self.ids}
        self.pos: dict[str, int] = {}
        # the batched feed: step k's [n, H] states (session i's row steps_in[(k + i) % len]), made once
        self.batches = None
        if hasattr(engine, "add_inputs"):
            self.batches = []
            for k in range(len(steps_in)):
                rows = engine.input_buffer(n)  # [n, H]
                torch.cat([steps_in[(k + i) % len(steps_in)] for i in range(n)], out=rows)
                self.batches.append(rows)

    def check(self, outs):
        bad = [o for o in outs if o.error_code is not None]
        if bad:
            raise RuntimeError(f"engine refused {bad[0].request_id}: {bad[0].error_code}: {bad[0].error_message}")
        for o in outs:
            if o.token_id is not None and o.request_id in self.tokens:
                self.tokens[o.request_id].append(o.token_id)
        return outs

    def admit(self, prompts: list[torch.Tensor], params: SamplingParams, max_tokens: int) -> int:
        """Admit every session and step until each has its first token; returns the steps taken."""
        for i, rid in enumerate(self.ids):
            p = prompts[i % len(prompts)]
            self.check(self.engine.add_request(rid, InputChunk(0, hidden=p), _params(params, max_tokens, seed=i)))
            self.pos[rid] = p.shape[0]
        steps = 0
        while any(not self.tokens[rid] for rid in self.ids):
            self.check(self.engine.step())
            steps += 1
        return steps

    def feed(self, k: int) -> None:
        """Every session's boundary state for its next position (a phone's reply to its last token)."""
        if self.batches is not None:
            self.check(self.engine.add_inputs(self.ids, [self.pos[rid] for rid in self.ids],
                                              self.batches[k % len(self.batches)]))
        else:
            for i, rid in enumerate(self.ids):
                self.check(self.engine.add_input(rid, InputChunk(self.pos[rid], hidden=self.steps_in[(k + i) % len(self.steps_in)])))
        for rid in self.ids:
            self.pos[rid] += 1

    def step_until_tokens(self, extra: Callable[[list], None] | None = None) -> int:
        """``step()`` until every session has one more token; returns the calls made."""
        want = {rid: len(self.tokens[rid]) + 1 for rid in self.ids}
        calls = 0
        while any(len(self.tokens[rid]) < want[rid] for rid in self.ids):
            outs = self.check(self.engine.step())
            if extra is not None:
                extra(outs)
            calls += 1
        return calls

    def finish(self) -> None:
        for rid in self.ids:
            self.engine.abort(rid)
        while self.engine.has_work():
            self.engine.step()


def _ms(xs: list[float]) -> float:
    return 1e3 * statistics.mean(xs)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return 1e3 * s[min(len(s) - 1, int(q * len(s)))]


def lockstep(engine, s: int, prompts: list[torch.Tensor], steps_in: list[torch.Tensor], gen: int, tag: str,
             sync: Callable[[], None], params: SamplingParams = GREEDY, tokens: list | None = None) -> dict:
    """``s`` sessions: admitted (prefill), then ``gen`` lockstep decode steps, each timed from the first
    ``add_input`` to the last session's token. ``tokens`` (a list), if given, receives each session's ids."""
    phones = Phones(engine, tag, s, steps_in)
    sync()
    t0 = time.perf_counter()
    prefill_steps = phones.admit(prompts, params, gen + 1)
    sync()
    t_prefill = time.perf_counter() - t0
    timer = TimedRun(engine.runners[engine.default_variant])
    feed, step_t, runner_t, calls = [], [], [], 0
    t_start = time.perf_counter()
    try:
        for k in range(gen):
            t0 = time.perf_counter()
            phones.feed(k)
            t1 = time.perf_counter()
            r0 = timer.total
            calls += phones.step_until_tokens()
            feed.append(t1 - t0)
            step_t.append(time.perf_counter() - t1)
            runner_t.append(timer.total - r0)
    finally:
        timer.remove()
    total = time.perf_counter() - t_start
    while engine.has_work():
        engine.step()
    if engine.seqs:
        raise RuntimeError(f"{len(engine.seqs)} sessions still active after their last token")
    if tokens is not None:
        tokens.extend(phones.tokens[rid] for rid in phones.ids)
    prompt = prompts[0].shape[0]
    return {"sessions": s, "steps": gen, "total_s": total, "tokens_per_s": s * gen / total,
            "step_ms_mean": 1e3 * total / gen,
            "step_ms_median": 1e3 * statistics.median([a + b for a, b in zip(feed, step_t, strict=True)]),
            "slowest_steps_ms": sorted(((round(1e3 * (a + b), 2), k) for k, (a, b) in
                                        enumerate(zip(feed, step_t, strict=True))), reverse=True)[:5],
            "add_input_ms_mean": _ms(feed), "engine_step_ms_mean": _ms(step_t),
            "runner_host_ms_mean": _ms(runner_t), "step_calls_per_token": calls / gen,
            "async_scheduling": engine.config.async_scheduling, "prefill_s": t_prefill,
            "prefill_steps": prefill_steps, "prefill_tokens_per_s": s * prompt / t_prefill}


SAMPLED = SamplingParams(temperature=0.7, top_p=0.9)


def sampled_vs_greedy(engine, s: int, prompts, steps_in, gen: int, sync, rounds: int = 2) -> dict:
    """The same ``s`` sessions greedy and sampled (temperature 0.7, top-p 0.9, each session seeded),
    alternated ``rounds`` times; tokens/s of each (mean over rounds) and their ratio (goal >= 0.95)."""
    runs: dict[str, list[dict]] = {"greedy": [], "sampled": []}
    for r in range(rounds):
        for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
            runs[name].append(lockstep(engine, s, prompts, steps_in, gen, f"{name}{r}-s{s}", sync, params))
    mean = {k: statistics.mean(x["tokens_per_s"] for x in v) for k, v in runs.items()}
    med = {k: statistics.median(x["step_ms_median"] for x in v) for k, v in runs.items()}
    return {"sessions": s, "gen": gen, "rounds": rounds, "sampled_params": {"temperature": 0.7, "top_p": 0.9},
            "greedy_tokens_per_s": mean["greedy"], "sampled_tokens_per_s": mean["sampled"],
            "sampled_over_greedy": mean["sampled"] / mean["greedy"],
            # the rounds' median steps (a round's slow spell weighs less than in the means above)
            "sampled_over_greedy_median_step": med["greedy"] / med["sampled"],
            "per_round_ratio": [x["tokens_per_s"] / g["tokens_per_s"]
                                for g, x in zip(runs["greedy"], runs["sampled"], strict=True)],
            "step_ms": {k: [x["step_ms_mean"] for x in v] for k, v in runs.items()},
            "step_ms_median": {k: [x["step_ms_median"] for x in v] for k, v in runs.items()},
            "slowest_steps_ms": {k: [x["slowest_steps_ms"] for x in v] for k, v in runs.items()}}


def prefill_stall(engine, decoders: int, prompts, steps_in, long_prompt: torch.Tensor, chunks: list[int],
                  steps: int, arrive: int, sync, served: tuple[int, int] | None = None) -> dict:
    """Per prefill chunk cap: ``decoders`` sessions decode ``steps`` lockstep steps alone (steady), then ``steps``
    more during which ``long_prompt`` (``[P, H]``) arrives at step ``arrive``. Inter-token latency of the
    decoders (time from their inputs to their tokens, one sample per session per step) p50 / p99 / max in both
    phases, and the long prompt's time to first token (wall and steps).

    ``served`` = (step token budget, chunk cap) of the server's own defaults (``EngineConfig()``): measured first,
    under the key ``"default"``, with the engine's budget set to it for that phase (the other caps keep the
    engine's budget)."""
    cfg = engine.config
    out = {"decoders": decoders, "long_prompt": int(long_prompt.shape[0]), "steps": steps, "arrive": arrive,
           "budget": cfg.max_num_batched_tokens, "chunks": {}}
    runs = ([("default", *served)] if served is not None else []) + [(str(b), cfg.max_num_batched_tokens, b)
                                                                     for b in chunks]
    saved = cfg.prefill_chunk_while_decoding, cfg.max_num_batched_tokens
    try:
        for key, budget, b in runs:
            # the scheduler reads the engine's config every step
            cfg.prefill_chunk_while_decoding, cfg.max_num_batched_tokens = b, max(budget, decoders + 1)
            phones = Phones(engine, f"stall{key}", decoders, steps_in)
            phones.admit(prompts, GREEDY, 2 * steps + arrive + 4)
            phases = {}
            for phase in ("steady", "arrival"):
                itl, first = [], {}
                t_arrive = None
                for k in range(steps):
                    if phase == "arrival" and k == arrive:
                        t_arrive = time.perf_counter()
                        phones.check(engine.add_request(f"long{key}", InputChunk(0, hidden=long_prompt),
                                                        _params(GREEDY, 1)))
                    sync()
                    t0 = time.perf_counter()
                    phones.feed(k)

                    def seen(outs, k=k, rid=f"long{key}", first=first):
                        for o in outs:
                            if o.request_id == rid and o.token_id is not None:
                                first.update(t=time.perf_counter(), step=k)

                    phones.step_until_tokens(seen)
                    itl.append(time.perf_counter() - t0)
                phases[phase] = {"itl_p50_ms": _pct(itl, 0.5), "itl_p99_ms": _pct(itl, 0.99),
                                 "itl_max_ms": 1e3 * max(itl), "itl_ms": [round(1e3 * x, 3) for x in itl]}
                if phase == "arrival":  # None: no first token within the phase (a cap too small for it)
                    phases[phase]["long_ttft_ms"] = 1e3 * (first["t"] - t_arrive) if first else None  # [ms]
                    phases[phase]["long_ttft_steps"] = first["step"] - arrive + 1 if first else None
            engine.abort(f"long{key}")
            phones.finish()
            steady, arr = phases["steady"], phases["arrival"]
            out["chunks"][key] = {**phases, "p99_over_steady_p99": arr["itl_p99_ms"] / steady["itl_p99_ms"],
                                  "budget": cfg.max_num_batched_tokens, "cap": b}
    finally:
        cfg.prefill_chunk_while_decoding, cfg.max_num_batched_tokens = saved
    return out
