"""Chaos soak of the edge's resume / replay guarantees: many concurrent ``EdgeClient`` generations against a real
``autoglm-cloud serve`` behind the rig's link emulator (``rig.link``) while a chaos thread cuts connections, stalls
them and half-closes them; every generation must end with the tokens of the same request run undisturbed.

The server runs on the CPU (``--variants fp32``, one compute thread), with ``--workers N``. Its requests come from a
seeded pool of specs (prompts of token ids, 24-64 new tokens; greedy, sampled with a fixed seed at temperature
0.8, and greedy with speculation), each run first undisturbed, one at a time, straight to the server: the reference.
Then ``--concurrency`` phones (one ``EdgeClient`` each, now and then a new one: a new session) run specs from the
pool through the link for ``--duration-s`` while the chaos thread, every ``--fault-every-s`` on average, picks one
fault (seeded):

* ``cut``            - one open connection reset (RST both ways), now and then every connection with the link down
                       for up to 1.5 s (new connections refused meanwhile);
* ``outage``         - every connection reset and the link down for the resume grace + 1 s: the sessions expire,
                       the phones replay;
* ``handshake_trip`` - the next connection to open (the reconnect this fault provokes by also cutting one) reset
                       after 0-3,000 bytes up (its HTTP upgrade, Hello, Resume, the inputs it resends) or 0-4,000
                       down (the upgrade's answer, Welcome, Resumed, the tokens resent);
* ``upload_trip``    - a connection reset after 1-4,000 more bytes up (mid prompt upload, mid frame);
* ``download_trip``  - a connection reset after 1-400 more bytes down (mid Tokens frame);
* ``stall``          - a delay spike: one connection (or all) delivers nothing for 0.1-2.5 s, then everything;
* ``blackhole``      - one connection delivers nothing for 45 s (found dead only by the keepalive or a timeout);
* ``half_close``     - one direction of a connection ends with a FIN, the other stays open.

Besides, before a request a phone arms (``PREFILL_TRIP_P``) a reset of its own connection inside that request's
prompt upload (``prefill_trip``), and some requests are cancelled after a random number of tokens (``CANCEL_P``;
their tokens must be the reference's first ones). A fault that takes the link down for a while (``outage``, a cut
of every connection with a down time) comes only once the phones' retry policy (``RetryPolicy()``, the documented
defaults) has had the time to ride the previous one out (about 11 s), and no handshake is tripped while the link
is down: whatever fails ``unreachable`` then saw the link up within its retries.

Each cut is named by what its phone was doing at that moment (``rig.link.LinkEmulator.on_cut``): ``handshake``
(no Welcome yet on that connection), ``prefill`` (no token of the request yet), ``decode``, ``idle``.

Checked, per generation: the same tokens as the reference (none missing or repeated), the same finish reason, and
no error (docs/edge.md: under these faults - the link back within the retry policy - none is allowed); for the
server: no traceback or ``ERROR`` line in its log, and at the end, after every phone closed and the resume grace
passed, ``/metrics`` shows no running or waiting request, an empty KV pool and no open session. Reported as JSON.

    autoglm-partition split tiny-glm4 --layer 2 --edge-quant fp32 --out /tmp/chaos/b
    python bench/chaos_soak.py --bundle /tmp/chaos/b --workers 1 --duration-s 300 --out /tmp/chaos/w1.json
    python bench/chaos_soak.py --bundle /tmp/chaos/b --workers 2 --duration-s 300 --out /tmp/chaos/w2.json

A before-chaos control (``--control-s``: the same concurrent phones, no faults) separates what concurrency or the
caches would change from what the faults change. ``tests/edge_client/test_chaos_soak.py`` runs a short soak
(slow-marked).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import os
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the server process inherits it: one compute thread
    os.environ.setdefault(_var, "1")

from edge_client.client import EdgeClient  # noqa: E402
from edge_client.config import RetryPolicy  # noqa: E402
from edge_client.demo import LocalCloud  # noqa: E402
from edge_client.errors import EdgeClientError  # noqa: E402
from rig.link import IDEAL, ConnectionInfo, LinkEmulator  # noqa: E402
from shared.link_profiles import LinkProfile  # noqa: E402

from results_io import emit  # noqa: E402  (bench/ is on sys.path when a bench script runs)

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "autoglm:sessions_open", "autoglm:tenant_sessions_open")
FAULTS = {"cut": 0.28, "outage": 0.02, "handshake_trip": 0.15, "upload_trip": 0.15, "download_trip": 0.10,
          "stall": 0.17, "blackhole": 0.01, "half_close": 0.12}
PREFILL_TRIP_P = 0.15  # chance that a phone's link is set to reset inside the prompt upload of its next request
CANCEL_P = 0.07  # chance that a phone cancels its request after a random number of tokens (gen.close())
BLACKHOLE_S = 45.0  # a connection that delivers nothing (a phone that changed networks: no RST, no FIN)
LOG_PROBLEM = re.compile(r"Traceback|\b(ERROR|CRITICAL)\b|Exception")  # a level, not error=<code>
log = logging.getLogger("chaos")
HANG_S = 240.0  # a generation running this long is cancelled and counted as hung


@dataclass(frozen=True, slots=True)
class Spec:
    """One request of the pool. ``chunk``: the phone's prefill chunk (phones are built per chunk size)."""

    name: str
    prompt: tuple[int, ...]
    max_tokens: int
    mode: str  # greedy | sampled | speculate
    chunk: int
    seed: int | None = None

    def kwargs(self) -> dict:
        if self.mode == "sampled":
            return {"temperature": 0.8, "seed": self.seed}
        return {"temperature": 0.0, "speculate": self.mode == "speculate"}


@dataclass(slots=True)
class Outcome:
    spec: str
    phase: str  # control | chaos
    tokens: list[int]
    finish: str | None
    error: str | None = None
    seconds: float = 0.0
    reconnects: int = 0
    resumes: int = 0
    replays: int = 0
    prefix_misses: int = 0
    cancel_at: int | None = None  # the phone cancelled after this many tokens
    phone: int = -1
    ended_at: float = 0.0  # seconds since the soak started (soak.log's clock)


@dataclass(slots=True)
class SoakConfig:
    bundle: Path
    workers: int = 1
    duration_s: float = 300.0
    control_s: float = 20.0
    concurrency: int = 8
    pool: int = 40
    fault_every_s: float = 0.6
    seed: int = 0
    rtt_ms: float = 10.0
    grace_s: float = 4.0
    new_client_p: float = 0.15  # chance that a phone starts its next request on a new client (a new session)
    log_dir: Path | None = None


def make_pool(cfg: SoakConfig, vocab: int) -> list[Spec]:
    rng = random.Random(cfg.seed)
    modes = ["greedy"] * 5 + ["sampled"] * 3 + ["speculate"] * 2
    pool = []
    for i in range(cfg.pool):
        n = rng.choice([rng.randint(3, 12), rng.randint(13, 40), rng.randint(41, 90)])
        if i % 5 == 4 and pool:  # a shared start (a system prompt): the edge and cloud prefix caches hit
            base = pool[rng.randrange(len(pool))].prompt
            prompt = tuple(base[:max(16, len(base) - 4)]) + tuple(rng.randrange(4, vocab) for _ in range(6))
        else:
            prompt = tuple(rng.randrange(4, vocab) for _ in range(n))
        pool.append(Spec(f"s{i}", prompt, rng.randint(24, 64), modes[rng.randrange(len(modes))],
                         chunk=(8, 128)[i % 2], seed=rng.randrange(1 << 31)))
    return pool


RETRY = RetryPolicy()  # the documented defaults: what an app gets
# the quiet time after a link-wide cut: the backoff's first six delays at their most (jitter up), ~11 s - every
# phone is back before the next one (the runs in reliability.md spaced them so, when six retries were all a phone
# had; now it retries for RETRY.reconnect_window_s)
RETRY_BUDGET_S = sum(min(RETRY.backoff_max_s, RETRY.backoff_initial_s * RETRY.backoff_multiplier ** k)
                     * (1 + RETRY.backoff_jitter) for k in range(6))


def new_client(cfg: SoakConfig, url: str, chunk: int, name: str = "") -> EdgeClient:
    client = EdgeClient(cfg.bundle, url, codec="fp16", threads=1, prefill_chunk=chunk, retry=RETRY,
                        verify_bundle=False)
    if name:
        client._thread.name = name  # the phone's name on its client's log lines (soak.log)
    return client


def run_one(client: EdgeClient, spec: Spec, phase: str, on_gen=None, cancel_at: int | None = None) -> Outcome:
    t0 = time.monotonic()
    out = Outcome(spec.name, phase, [], None, cancel_at=cancel_at)
    gen = None
    try:
        gen = client.generate(prompt_ids=list(spec.prompt), max_tokens=spec.max_tokens, **spec.kwargs())
        if on_gen is not None:
            on_gen(gen)
        for tok, _ in gen.iter_tokens():
            out.tokens.append(tok)
            if cancel_at is not None and len(out.tokens) >= cancel_at:
                gen.close()
                break
        out.tokens = list(gen.token_ids)  # close() may have taken a token more
        out.finish = gen.finish_reason
    except EdgeClientError as e:
        out.error = f"{e.code}: {e}"
    except Exception as e:  # noqa: BLE001 - anything else is a finding
        out.error = f"{type(e).__name__}: {e}"
    if gen is not None:
        s = gen.stats
        out.reconnects, out.resumes, out.replays, out.prefix_misses = s.reconnects, s.resumes, s.replays, s.prefix_misses
        if out.error is None and out.finish is None:
            out.finish = gen.finish_reason
    out.seconds = time.monotonic() - t0
    if out.error is not None:
        log.warning("%s failed after %.1f s: %s", spec.name, out.seconds, out.error)
    return out


class Phone:
    """One concurrent slot: its client, the generation it runs now (read by the chaos thread to name a cut)."""

    def __init__(self, idx: int, chunk: int):
        self.idx, self.chunk = idx, chunk
        self.client: EdgeClient | None = None
        self.gen = None
        self.started = 0.0
        self.lock = threading.Lock()

    def phase_of(self, port: int) -> str | None:
        """What this phone does on the connection from ``port``: None when it is not this phone's."""
        client = self.client
        if client is None:
            return None
        ws = client.session.link.ws
        try:
            mine = ws is not None and ws.local_address[1] == port
        except Exception:  # noqa: BLE001 - closing under us
            mine = False
        if not mine:
            return None
        if client.session.welcome is None:
            return "handshake"
        gen = self.gen
        if gen is None or gen._done:
            return "idle"
        return "prefill" if not gen.token_ids else "decode"


class Chaos(threading.Thread):
    def __init__(self, link: LinkEmulator, phones: list[Phone], rng: random.Random, every_s: float, grace_s: float):
        super().__init__(name="chaos", daemon=True)
        self.link, self.phones, self.rng, self.every_s, self.grace_s = link, phones, rng, every_s, grace_s
        self.stop_event = threading.Event()
        self.faults: collections.Counter = collections.Counter()
        self.cut_phases: collections.Counter = collections.Counter()
        self.errors: list[str] = []
        self.down_until = 0.0  # monotonic: the link refuses connections until then
        self.quiet_until = 0.0  # no new down time before this (the phones' retries ride one out at a time)
        link.on_cut = self._on_cut

    def _on_cut(self, info: ConnectionInfo) -> None:
        for p in self.phones:
            phase = p.phase_of(info.peer_port)
            if phase is not None:
                self.cut_phases[phase] += 1
                log.info("cut connection %d of phone %d (%s)", info.index, p.idx, phase)
                return
        self.cut_phases["handshake"] += 1  # no phone's established link yet: its upgrade or Hello
        log.info("cut connection %d (port %d, %d B up, %d B down): handshake", info.index, info.peer_port,
                 info.bytes_up, info.bytes_down)

    def run(self) -> None:
        kinds, weights = list(FAULTS), list(FAULTS.values())
        while not self.stop_event.wait(self.rng.expovariate(1.0 / self.every_s)):
            kind = self.rng.choices(kinds, weights)[0]
            try:
                if self._fault(kind):
                    self.faults[kind] += 1
                    log.info("fault %s", kind)
            except Exception as e:  # noqa: BLE001 - a fault that could not be applied is reported, not fatal
                self.errors.append(f"{kind}: {type(e).__name__}: {e}")

    def _pick(self) -> ConnectionInfo | None:
        conns = self.link.connection_info()
        return self.rng.choice(conns) if conns else None

    def _fault(self, kind: str) -> bool:
        rng, link = self.rng, self.link
        now = time.monotonic()
        if kind == "outage" or (kind == "cut" and rng.random() < 0.1):
            if now < self.quiet_until:
                return False
            down = self.grace_s + 1.0 if kind == "outage" else rng.uniform(0.0, 1.5)
            self.down_until, self.quiet_until = now + down, now + down + RETRY_BUDGET_S
            log.info("%severy connection cut, the link down %.2f s", "outage: " if kind == "outage" else "", down)
            return link.cut(down_s=down)
        if kind == "cut":
            c = self._pick()
            return c is not None and link.cut(connection=c.index)
        if kind == "handshake_trip":
            c = self._pick()
            if c is None or now < self.down_until:
                return False
            direction = rng.choice(["up", "down"])  # upgrade, Hello, Resume, resent inputs | 101, Welcome, Resumed
            n = rng.randint(0, 3000 if direction == "up" else 4000)
            log.info("the next connection to open resets after %d B %s", n, direction)
            link.cut_after(direction, n)  # the next connection
            return link.cut(connection=c.index)  # provokes a reconnect
        if kind in ("upload_trip", "download_trip"):
            c = self._pick()
            if c is None:
                return False
            if kind == "upload_trip":
                return link.cut_after("up", c.bytes_up + rng.randint(1, 4000), connection=c.index)
            return link.cut_after("down", c.bytes_down + rng.randint(1, 400), connection=c.index)
        if kind == "blackhole":
            c = self._pick()
            return c is not None and link.stall(BLACKHOLE_S, connection=c.index)
        if kind == "stall":
            seconds = rng.uniform(0.1, 2.5)
            if rng.random() < 0.3:
                return link.stall(seconds)
            c = self._pick()
            return c is not None and link.stall(seconds, connection=c.index)
        if kind == "half_close":
            c = self._pick()
            return c is not None and link.half_close(c.index, rng.choice(["up", "down"]))
        raise AssertionError(kind)


def arm_prefill_trip(link: LinkEmulator, p: Phone, spec: Spec, rng: random.Random, chaos: Chaos) -> None:
    """Reset ``p``'s connection somewhere inside the upload of ``spec``'s prompt (fp16: 2 bytes a value)."""
    ws = p.client.session.link.ws if p.client is not None else None
    if ws is None or p.client.session.welcome is None:
        return
    try:
        port = ws.local_address[1]
    except Exception:  # noqa: BLE001 - closing under us
        return
    hidden = p.client.manifest.hidden_size
    for c in link.connection_info():
        if c.peer_port == port and link.cut_after("up", c.bytes_up + rng.randint(1, 2 * hidden * len(spec.prompt)),
                                                  connection=c.index):
            chaos.faults["prefill_trip"] += 1
            return


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for name in GAUGES:
        vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)]
        out[name] = sum(vals) if vals else float("nan")
    return out


T0 = time.monotonic() - (time.time() - logging._startTime)  # soak.log's clock (logging's relativeCreated)


def drive(cfg: SoakConfig, url: str, pool: list[Spec], seconds: float, phase: str, rng: random.Random,
          phones: list[Phone], results: list[Outcome], hung: list[str], link: LinkEmulator | None = None,
          chaos: Chaos | None = None) -> None:
    """Run the phones for ``seconds`` (each finishes the request it has started)."""
    deadline = time.monotonic() + seconds
    by_chunk = {c: [s for s in pool if s.chunk == c] for c in {s.chunk for s in pool}}
    seeds = [rng.randrange(1 << 30) for _ in phones]

    def phone_loop(p: Phone, seed: int) -> None:
        prng = random.Random(seed)
        while time.monotonic() < deadline:
            if p.client is None or prng.random() < cfg.new_client_p:
                old, p.client = p.client, None
                if old is not None:
                    old.close()
                p.client = new_client(cfg, url, p.chunk, f"phone{p.idx}")
            spec = prng.choice(by_chunk[p.chunk])
            if chaos is not None and prng.random() < PREFILL_TRIP_P:
                arm_prefill_trip(link, p, spec, prng, chaos)
            p.started = time.monotonic()
            cancel_at = prng.randint(1, spec.max_tokens - 1) if prng.random() < CANCEL_P else None

            def on_gen(gen, p=p):
                p.gen = gen
            out = run_one(p.client, spec, phase, on_gen, cancel_at)
            out.phone, out.ended_at = p.idx, time.monotonic() - T0
            p.gen = None
            results.append(out)

    def watchdog() -> None:
        while any(t.is_alive() for t in threads):
            for p in phones:
                gen = p.gen
                if gen is not None and not gen._done and time.monotonic() - p.started > HANG_S:
                    hung.append(f"phone {p.idx}: {gen.spec.max_tokens} tokens, {len(gen.token_ids)} got")
                    gen.cancel()
            time.sleep(1.0)

    threads = [threading.Thread(target=phone_loop, args=(p, s), daemon=True) for p, s in zip(phones, seeds)]
    for t in threads:
        t.start()
    dog = threading.Thread(target=watchdog, daemon=True)
    dog.start()
    for t in threads:
        t.join()
    dog.join()


def soak(cfg: SoakConfig, progress=print) -> dict:
    """Reference, control, chaos, the server's state after it (the module docstring); the JSON result. The server's
    log and ``soak-w<N>.log`` (every fault, every cut with its phone and phase, each phone's reconnect attempts, on
    logging's clock) go to ``cfg.log_dir``."""
    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="chaos-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_dir / f"soak-w{cfg.workers}.log", mode="w")
    handler.setFormatter(logging.Formatter("%(relativeCreated)9.0f %(threadName)s %(name)s %(message)s"))
    loggers = [logging.getLogger(name) for name in ("chaos", "edge_client")]  # faults; drops and reconnects
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        return _soak(cfg, progress, log_dir)
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
        handler.close()


def _soak(cfg: SoakConfig, progress, log_dir: Path) -> dict:
    from shared.manifest import Manifest

    manifest = Manifest.load(cfg.bundle)
    pool = make_pool(cfg, manifest.vocab_size)
    log_path = log_dir / f"serve-w{cfg.workers}.log"
    args = ["--device", "cpu", "--variants", "fp32", "--workers", str(cfg.workers),
            "--session-grace-s", str(cfg.grace_s), "--num-blocks", "512"]
    result: dict = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
                    "server_log": str(log_path)}
    t_start = time.monotonic()
    with LocalCloud(cfg.bundle, extra_args=args, log_path=log_path) as cloud:
        url = f"ws://127.0.0.1:{cloud.port}"
        # 1. the reference: each spec alone, straight to the server
        reference: dict[str, Outcome] = {}
        refs = {c: new_client(cfg, url, c) for c in {s.chunk for s in pool}}
        try:
            for s in pool:
                reference[s.name] = run_one(refs[s.chunk], s, "reference")
                if reference[s.name].error:
                    raise RuntimeError(f"reference run of {s.name} failed: {reference[s.name].error}")
        finally:
            for c in refs.values():
                c.close()
        progress(f"reference: {len(pool)} specs ({time.monotonic() - t_start:.0f} s)")
        rng = random.Random(cfg.seed + 1)
        profile = LinkProfile("chaos", rtt_ms=cfg.rtt_ms, jitter_ms=cfg.rtt_ms / 4, down_mbps=50.0, up_mbps=20.0,
                              loss=0.0, source="chaos soak") if cfg.rtt_ms > 0 else IDEAL
        results: list[Outcome] = []
        hung: list[str] = []
        peaks = {"running": 0.0, "running_over_active_phones": -1e9, "sessions_open": 0.0, "kv_cache_usage_perc": 0.0}
        with LinkEmulator(cloud.port, profile, seed=cfg.seed) as link:
            link_url = f"ws://127.0.0.1:{link.port}"
            phones = [Phone(i, (8, 128)[i % 2]) for i in range(cfg.concurrency)]
            try:
                # 2. the control: concurrent phones, no faults
                if cfg.control_s > 0:
                    drive(cfg, link_url, pool, cfg.control_s, "control", rng, phones, results, hung)
                    progress(f"control: {len(results)} generations")
                # 3. the soak
                chaos = Chaos(link, phones, random.Random(cfg.seed + 2), cfg.fault_every_s, cfg.grace_s)
                chaos.start()
                t_chaos = time.monotonic()
                sampler_stop = threading.Event()

                def sample() -> None:  # the gauges while the phones run (orphaned requests would show)
                    while not sampler_stop.wait(2.0):
                        try:
                            g = metrics(cloud.port)
                        except OSError:
                            continue
                        active = sum(p.gen is not None and not p.gen._done for p in phones)
                        peaks["running"] = max(peaks["running"], g["vllm:num_requests_running"])
                        peaks["running_over_active_phones"] = max(peaks["running_over_active_phones"],
                                                                  g["vllm:num_requests_running"] - active)
                        peaks["sessions_open"] = max(peaks["sessions_open"], g["autoglm:sessions_open"])
                        peaks["kv_cache_usage_perc"] = max(peaks["kv_cache_usage_perc"], g["vllm:kv_cache_usage_perc"])
                threading.Thread(target=sample, daemon=True).start()

                def report() -> None:
                    while not sampler_stop.wait(30.0):
                        done = sum(r.phase == "chaos" for r in results)
                        progress(f"  {time.monotonic() - t_chaos:.0f} s: {done} generations, faults "
                                 f"{dict(chaos.faults)}, cuts {link.cuts}")
                threading.Thread(target=report, daemon=True).start()
                drive(cfg, link_url, pool, cfg.duration_s, "chaos", rng, phones, results, hung, link, chaos)
                chaos.stop_event.set()
                chaos.join(10)
                sampler_stop.set()
                chaos_s = time.monotonic() - t_chaos
            finally:
                for p in phones:
                    if p.client is not None:
                        p.client.close()
            link_stats = {"connections": link.connections, "cuts": link.cuts, "refused": link.refused,
                          "bytes_up": link.bytes_up, "bytes_down": link.bytes_down}
        # 4. the server after the soak: every session closed or expired, nothing held
        deadline = time.monotonic() + cfg.grace_s + 20
        while True:
            gauges = metrics(cloud.port)
            if all(v == 0 for v in gauges.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    log_text = log_path.read_text(errors="replace")
    problems = [line for line in log_text.splitlines() if LOG_PROBLEM.search(line)]

    bad = []
    per_phase: dict[str, collections.Counter] = {}
    for r in results:
        ref = reference[r.spec]
        c = per_phase.setdefault(r.phase, collections.Counter())
        c["generations"] += 1
        c[f"mode_{next(s.mode for s in pool if s.name == r.spec)}"] += 1
        for k in ("reconnects", "resumes", "replays", "prefix_misses"):
            c[k] += getattr(r, k)
        c["tokens"] += len(r.tokens)
        if r.error is not None:
            c["errors"] += 1
        mode = next(s.mode for s in pool if s.name == r.spec)
        if r.replays:
            c[f"replayed_{mode}"] += 1
        if r.resumes:
            c[f"resumed_{mode}"] += 1
        if r.cancel_at is not None:
            c["cancelled"] += 1
            # the reference's first tokens; cancelled, unless it ended first
            same = (r.error is None and r.tokens == ref.tokens[:len(r.tokens)] and len(r.tokens) >= min(
                r.cancel_at, len(ref.tokens)) and r.finish in ("cancelled", ref.finish))
        else:
            same = r.error is None and r.tokens == ref.tokens and r.finish == ref.finish
        if not same:
            c["wrong"] += 1
            first = next((i for i, (a, b) in enumerate(zip(r.tokens, ref.tokens)) if a != b),
                         min(len(r.tokens), len(ref.tokens)))
            bad.append({"phase": r.phase, "spec": r.spec, "mode": mode, "cancel_at": r.cancel_at,
                        "error": r.error, "finish": r.finish, "want_finish": ref.finish, "got": len(r.tokens),
                        "want": len(ref.tokens), "first_difference": first, "reconnects": r.reconnects,
                        "resumes": r.resumes, "replays": r.replays, "seconds": round(r.seconds, 1),
                        "phone": r.phone, "ended_at_ms": round(r.ended_at * 1000)})
    chaos_runs = [r for r in results if r.phase == "chaos"]
    result.update({
        "pool": len(pool),
        "phases": {k: dict(v) for k, v in per_phase.items()},
        "chaos_seconds": round(chaos_s, 1),
        "faults": dict(chaos.faults),
        "fault_errors": chaos.errors[:20],
        "cuts_by_phase": dict(chaos.cut_phases),
        "link": link_stats,
        "slowest_generation_s": round(max((r.seconds for r in chaos_runs), default=0.0), 1),
        "wrong": bad[:50],
        "wrong_total": len(bad),
        "hung": hung,
        "gauges_after": gauges,
        "gauge_peaks_during_chaos": peaks,
        "server_log_problems": problems[:40],
        "server_log_problem_lines": len(problems),
        "wall_s": round(time.monotonic() - t_start, 1),
    })
    result["ok"] = (not bad and not hung and not problems and all(v == 0 for v in gauges.values()))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--bundle", type=Path, required=True, help="a split bundle (tiny-glm4, fp32 edge)")
    helps = {"workers": "the server's --workers", "duration_s": "seconds of chaos",
             "control_s": "seconds of concurrent phones before it, no faults", "concurrency": "phones at once",
             "pool": "specs in the request pool", "fault_every_s": "mean seconds between faults",
             "seed": "the pool's and the chaos' seed", "rtt_ms": "the link's round trip (0: loopback)",
             "grace_s": "the server's --session-grace-s",
             "new_client_p": "chance that a phone starts its next request on a new client (a new session)"}
    for f in dataclasses.fields(SoakConfig):  # the config's defaults, named once
        if f.name in helps:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                            help=helps[f.name])
    ap.add_argument("--log-dir", type=Path, default=None, help="where the server log goes (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here too")
    a = ap.parse_args(argv)
    cfg = SoakConfig(bundle=a.bundle, log_dir=a.log_dir, **{name: getattr(a, name) for name in helps})
    result = soak(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    emit(result, a.out, "chaos_soak.py", argv)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
