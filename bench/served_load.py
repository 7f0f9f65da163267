"""The served path under load: many simulated edges over real WebSockets against ``autoglm-cloud serve``.

What an operator gets is not the engine's loop but phones on WebSockets: every token crosses msgpack, a
codec, the event loop and the engine's input queue twice. This bench measures that path. Simulated edges run
in worker processes spread over the host's cores (``--procs``), each holding many asyncio sessions, and
speak the real protocol with its own encoder and decoder (``shared.protocol``, ``shared.chunking``,
``shared.codecs``; nothing re-implemented):

    Hello(bundle_id, codecs) -> Welcome(limits, codecs)
    Prefill chunks of the prompt's boundary states, sized by shared.chunking.prefill_messages within the
    negotiated frame limit, coded with a realistic codec (int8-outlier by default)
    <- Tokens(index 0) ; DecodeStep(position, hidden [1, H]) ; <- Tokens(index 1) ; ... until finish_reason

Decode steps travel in the codec the default ``EdgeClient`` picks for them (``--step-codec policy``:
``shared.precision.step_codec``, fp16 where the server offers it, the prompt's codec otherwise); ``--step-codec
same`` sends them in the prompt's codec as a client that pins its codec does (every run before session 17).

Hidden states are random but scaled like a real boundary (per-channel absmax from the bundle's calibration,
its outlier channels large, the first prompt row an attention sink above ``sink_threshold``), or recorded ones
from ``--states FILE.npy`` ([N, H] float32, e.g. saved from a real front). They are coded once per worker
before the clock starts (a phone codes each state once too; the server's decode cost is what is measured).

Per level of S concurrent sessions (all start together, greedy, ``ignore_eos``, exactly ``--gen`` tokens):

* ``served_tokens_per_s``: tokens received by all sessions in the steady window (from the moment every
  session has its first token to the moment the first one finishes) per second, the figure comparable with
  ``bench/cloud_gpu_bench.py --through-engine``'s lockstep decode (``engine_tokens_per_s``,
  ``direct_tokens_per_s``, read from its JSON with ``--engine-json``); ``served_tokens_per_s_overall`` counts
  every token from the first Prefill to the last token;
* ``ttft_*_ms``: first Prefill sent -> first Tokens received, per session; ``itl_*_ms``: gaps between a
  session's consecutive Tokens (a round trip: Tokens out, DecodeStep back, one engine step);
* ``server_cpu_s`` / ``client_cpu_s``: CPU seconds the server process and the load generator's workers used
  during the level (a generator that saturates its cores would measure itself);
* ``server_loop_cpu_s``: CPU seconds of the server's main thread, where uvicorn runs the event loop (every
  frame's WebSocket, msgpack, codec and dispatch work; the engine has its own thread), and
  ``loop_us_per_token``: that per generated token (the prompt's handling included), the cost that caps the
  served path when the loop saturates. With ``--workers N`` (the server's front-end processes, recorded as
  ``workers``) the loops are the workers' main threads, summed: each worker's share is about 1/N of it;
  ``server_cpu_s`` then counts the engine process and its workers.

``--workers 1,6`` measures every level against a one-process server, then against one with 6 front-end
processes (one server per value, records carry ``workers``), side by side in one run.

``--server-root DIR`` spawns the server from another checkout (e.g. a copy of the tree before a change) with
this bench's load generator, so two trees can be measured side by side: ``--compare-root DIR`` runs every
level against DIR's server first, then against this checkout's, in one run (records carry ``tree``).

Server: an already running one (``--url`` + ``--bundle``), one spawned from a bundle (``--serve BUNDLE``), or
a random-weight one (``--preset glm4v-9b-random --layer 12``, ``bench/random_weight_server.py``; ``--preset
wide-cpu --layer 1`` is the CPU proxy: the 9B boundary width on a back half that costs little).
``--py-spy FILE`` samples the server during the largest level of the first codec (``py-spy record
--nonblocking``, collapsed stacks) and records seconds per thread and category (``profile_s``: codec decode,
msgpack, websocket frames, asyncio, model forward, batch build, ...) to show where the served path spends
its time.

CPU smoke run (tiny bundle)::

    autoglm-partition split --preset tiny-glm4 --layer 2 --out /tmp/b
    python bench/served_load.py --serve /tmp/b --sessions 1,8 --prompt 32 --gen 16 --out /tmp/served.json

``--sweep-codecs int8-outlier,bf16`` runs every level once per wire codec (what the server's codec decode
costs, side by side). ``--gather-max-ms 0`` runs a ``--preset`` server with the engine's decode-cohort
gather window off (``AsyncEngine.gather_max_s``), for an A/B of it. ``--attach-engine ENGINE_JSON --to SERVED_JSON`` fills the engine/direct figures into a
finished served run afterwards (the GPU session measures the served path first, then the engine).

GPU (one H200, the issue's workload): ``bench/gpu_session.sh``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from child_process import stop_gracefully  # noqa: E402 - bench/, beside this script
from shared import protocol as P  # noqa: E402 - after the path fix, so the bench runs from a checkout
from shared.chunking import prefill_messages  # noqa: E402
from shared.codecs import CODEC_NAMES, available_codecs  # noqa: E402
from shared.manifest import Manifest  # noqa: E402
from shared.plan import PrecisionPlan  # noqa: E402
from shared.precision import DEFAULT_POLICY, step_codec  # noqa: E402

HERE = Path(__file__).resolve().parent
DECODE_BANK = 64  # distinct coded decode states per worker, reused round-robin
PROMPT_BANK = 4  # distinct prompts per worker
PY_SPY_RATE = 200  # samples per second of the server profile
DEFAULT_CODECS = ("int8-outlier", "int8-b32", "fp16")  # the outlier codec where the bundle is calibrated


@dataclass(slots=True)
class LoadConfig:
    """One bench run: which server, which load levels, what each simulated edge sends."""

    url: str | None = None  # ws://HOST:PORT/v1/split of a running server (needs bundle)
    bundle: Path | None = None  # the served bundle: bundle id, hidden size, calibration
    serve: Path | None = None  # spawn `autoglm-cloud serve BUNDLE` on a free port
    preset: str | None = None  # spawn a random-weight server of this preset (bench/random_weight_server.py)
    layer: int = 12  # split layer of the random-weight preset
    gather_max_ms: float | None = None  # the random-weight server's engine gather window cap (None: its default)
    server_args: list[str] = field(default_factory=list)  # extra `autoglm-cloud serve` options (win over ours)
    sessions: tuple[int, ...] = (1, 8, 64, 256)
    prompt: int = 512  # prompt positions per session (the engine bench's default)
    gen: int = 128  # tokens per session
    codecs: tuple[str, ...] = DEFAULT_CODECS  # preference order sent in Hello
    sweep_codecs: tuple[str, ...] = ()  # run every level once per codec named here (Hello offers only it)
    # the decode steps' codec: "policy" = shared.precision.step_codec over the negotiated codecs, what the
    # default EdgeClient sends (fp16 where offered; Hello then offers it too); "same" = the prompt's codec
    # (a client that pins its codec; every run before session 17); or a codec name
    step_codec: str = "policy"
    procs: int = 0  # worker processes; 0 = half the cores (the server needs the rest), at most one per session
    sweep_procs: tuple[int, ...] = ()  # run every level once per value (the load generator's own share of a round)
    # the server's front-end processes (`autoglm-cloud serve --workers N`); several: one server per value, in turn
    workers: tuple[int, ...] = (1,)
    # the server's event loop (`serve --loop`: auto, asyncio, uvloop); several: one server per value, in turn
    loops: tuple[str, ...] = ("auto",)
    api_key: str | None = None
    states: Path | None = None  # recorded boundary states [N, H] float32 (.npy) instead of synthetic ones
    seed: int = 0
    ready_timeout_s: float = 900.0  # a 9B random model builds and tunes on the GPU before /ready
    level_timeout_s: float = 600.0
    engine_json: Path | None = None  # cloud_gpu_bench --through-engine output: engine/direct tokens/s per S
    engine_cpu: bool = False  # also measure the engine alone, per tree in a child process (CPU: served/engine)
    py_spy: Path | None = None  # collapsed stacks of the server during the largest level
    server_root: Path = HERE.parent  # the checkout whose server is spawned (its cloud_server, shared, bench)
    compare_root: Path | None = None  # also measure this checkout's server, before server_root's, in one run
    out: Path | None = None

    def __post_init__(self):
        spawners = sum(x is not None for x in (self.url, self.serve, self.preset))
        if spawners != 1:
            raise ValueError("give exactly one of --url (with --bundle), --serve BUNDLE, --preset NAME")
        if self.url is not None and self.bundle is None:
            raise ValueError("--url needs --bundle (the served bundle's manifest and calibration)")
        if self.serve is not None:
            self.bundle = self.serve
        if not self.sessions or min(self.sessions) < 1:
            raise ValueError("--sessions: positive session counts")
        for name in ("prompt", "gen"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1")
        if self.procs < 0 or any(p < 0 for p in self.sweep_procs):
            raise ValueError("--procs must be >= 0")
        if not self.workers or min(self.workers) < 1:
            raise ValueError("--workers: positive front-end process counts")
        if self.url is not None and self.workers != (1,):
            raise ValueError("--workers sets a spawned server: give --serve or --preset, not --url")
        if not self.loops or any(x not in ("auto", "asyncio", "uvloop") for x in self.loops):
            raise ValueError("--loops: auto, asyncio or uvloop, comma-separated")
        if self.url is not None and self.loops != ("auto",):
            raise ValueError("--loops sets a spawned server: give --serve or --preset, not --url")
        if self.gather_max_ms is not None and self.preset is None:
            raise ValueError("--gather-max-ms sets the random-weight server's engine: give --preset")
        if self.compare_root is not None and self.url is not None:
            raise ValueError("--compare-root spawns both servers: give --serve or --preset, not --url")
        if self.step_codec not in ("policy", "same", *CODEC_NAMES):
            raise ValueError(f"--step-codec {self.step_codec!r}: policy, same or one of {', '.join(CODEC_NAMES)}")


# ------------------------------------------------------------------------------------------------
# what an edge sends


def boundary_states(n: int, hidden: int, calibration: dict | None, rng: np.random.Generator,
                    sink_first: bool) -> np.ndarray:
    """Synthetic boundary hidden states [n, hidden] float32, scaled like the bundle's calibration: channel c
    ~ N(0, (absmax_c / 4)^2) (outlier channels are the ones with a large absmax), and with ``sink_first`` row 0
    an attention sink (a few channels at 2x ``sink_threshold``, which the outlier codecs send as float16)."""
    calib = calibration or {}
    absmax = np.asarray(calib.get("channel_absmax") or [4.0] * hidden, np.float32)  # [H]
    if absmax.shape != (hidden,):
        raise ValueError(f"calibration channel_absmax has {absmax.size} channels, the bundle {hidden}")
    x = rng.standard_normal((n, hidden), dtype=np.float32) * (absmax / 4.0)  # [n, H]
    x = np.clip(x, -absmax, absmax)
    threshold = calib.get("sink_threshold")
    if sink_first and threshold:
        outliers = set(calib.get("outlier_channels") or [])
        regular = [c for c in range(hidden) if c not in outliers]
        x[0, regular[: max(1, hidden // 64)]] = 2.0 * float(threshold)
    return x


@dataclass(slots=True)
class EdgeInputs:
    """A worker's coded inputs: Prefill templates per prompt (request id filled in per session) and a bank
    of coded decode states, all coded before the clock starts."""

    codec: str
    prompts: list[list[P.Prefill]]
    decode: list[P.EncodedTensor]


def decode_codec(choice: str, prompt_codec: str, offered: list[str]) -> str:
    """The decode steps' codec for ``--step-codec`` ``choice`` (LoadConfig.step_codec) when the prompt travels in
    ``prompt_codec`` and the server accepts ``offered``."""
    if choice == "same":
        return prompt_codec
    if choice == "policy":
        return step_codec(PrecisionPlan(codec=prompt_codec, compute="bf16"), available_codecs=offered)
    if choice not in offered:
        raise RuntimeError(f"--step-codec {choice}: not accepted by the server ({offered})")
    return choice


def edge_inputs(spec: dict, welcome: P.Welcome, codec_name: str, step_name: str | None = None) -> EdgeInputs:
    calib = spec["calibration"]
    codec = available_codecs(calib)[codec_name]
    step = available_codecs(calib)[step_name or codec_name]
    rng = np.random.default_rng(spec["seed"])
    h, prompt = spec["hidden"], spec["prompt"]
    recorded = np.load(spec["states"]).astype(np.float32) if spec["states"] else None  # [N, H]
    if recorded is not None and (recorded.ndim != 2 or recorded.shape[1] != h or not len(recorded)):
        raise ValueError(f"--states {spec['states']}: expected [N, {h}] boundary states, got "
                         f"{list(recorded.shape)}")
    params = P.SamplingParams(max_tokens=spec["gen"], temperature=0.0, ignore_eos=True)

    def states(n: int, sink_first: bool) -> np.ndarray:
        if recorded is None:
            return boundary_states(n, h, calib, rng, sink_first)
        start = int(rng.integers(0, max(1, len(recorded) - n)))
        return np.resize(recorded[start:start + n], (n, h))  # rows repeat when the recording is shorter

    prompts = [prefill_messages("template", states(prompt, True), codec, welcome.limits, params=params)
               for _ in range(PROMPT_BANK)]
    decode = [step.encode(states(1, False)) for _ in range(DECODE_BANK)]  # [1, H] each
    return EdgeInputs(codec_name, prompts, decode)


# ------------------------------------------------------------------------------------------------
# worker process: many sessions on one event loop


class Edge:
    """One simulated phone: a WebSocket, its Welcome, and one request's timeline."""

    def __init__(self, index: int):
        self.index = index
        self.ws = None
        self.welcome: P.Welcome | None = None
        self.start = 0.0  # monotonic time of the first Prefill
        self.token_times: list[float] = []
        self.finish: str | None = None
        self.completion_tokens: int | None = None
        self.error: str | None = None
        self.up_bytes = 0
        self.client_s = 0.0  # this simulated phone's own time per token: Tokens received -> DecodeStep sent

    async def connect(self, spec: dict) -> None:
        from websockets.asyncio.client import connect

        headers = {"Authorization": f"Bearer {spec['api_key']}"} if spec["api_key"] else {}
        self.ws = await connect(spec["url"], additional_headers=headers, compression=None, max_size=64 << 20,
                                open_timeout=60, ping_interval=None, user_agent_header="autoglm-served-load")
        await self.ws.send(P.encode_message(P.Hello(bundle_id=spec["bundle_id"], codecs=list(spec["codecs"]),
                                                    hints=P.ClientHints(device_class="sim", client="served_load"))))
        reply = P.decode_message(await asyncio.wait_for(self.ws.recv(), 60))
        if not isinstance(reply, P.Welcome):
            raise RuntimeError(f"session {self.index}: expected Welcome, got {reply}")
        self.welcome = reply

    async def run(self, inputs: EdgeInputs, prompt: int, gen: int, timeout: float) -> None:
        rid = f"r{self.index}"
        frames = [P.encode_message(dataclasses.replace(m, request_id=rid))
                  for m in inputs.prompts[self.index % len(inputs.prompts)]]
        try:
            await asyncio.wait_for(self._generate(rid, frames, inputs, prompt, gen), timeout)
        except Exception as e:  # noqa: BLE001 - every failure is recorded; the level reports it
            self.error = self.error or f"{type(e).__name__}: {e}"
        finally:
            try:
                await self.ws.send(P.encode_message(P.Close(reason="done")))
                await asyncio.wait_for(self.ws.close(), 5)
            except Exception:  # noqa: BLE001 - the link may be gone already
                pass

    async def _generate(self, rid: str, frames: list[bytes], inputs: EdgeInputs, prompt: int, gen: int) -> None:
        ws = self.ws
        self.start = time.monotonic()
        for f in frames:
            await ws.send(f)
            self.up_bytes += len(f)
        bank = inputs.decode
        while True:
            msg = P.decode_message(await ws.recv())
            now = time.monotonic()
            if isinstance(msg, P.Error):
                raise RuntimeError(f"server error {msg.code}: {msg.message}")
            if not isinstance(msg, P.Tokens) or msg.request_id != rid:
                raise RuntimeError(f"unexpected {type(msg).__name__}")
            if msg.index != len(self.token_times) or len(msg.token_ids) > 1:
                raise RuntimeError(f"token index {msg.index} with {len(msg.token_ids)} ids after "
                                   f"{len(self.token_times)} tokens")
            self.token_times.extend([now] * len(msg.token_ids))
            if msg.finish_reason is not None:
                self.finish = msg.finish_reason
                self.completion_tokens = msg.usage.completion_tokens if msg.usage else None
                return
            k = len(self.token_times)
            frame = P.encode_message(P.DecodeStep(request_id=rid, position=prompt + k - 1,
                                                  hidden=bank[(self.index + k) % len(bank)]))
            await ws.send(frame)
            self.up_bytes += len(frame)
            self.client_s += time.monotonic() - now

    def result(self) -> dict:
        return {"index": self.index, "start": self.start, "token_times": self.token_times, "finish": self.finish,
                "completion_tokens": self.completion_tokens, "error": self.error, "up_bytes": self.up_bytes,
                "client_s": self.client_s}


async def worker_main(spec: dict) -> dict:
    """Connect ``spec['count']`` sessions, say ready, wait for ``go`` on stdin, run them all, return results."""
    loop = asyncio.get_running_loop()
    edges = [Edge(spec["first"] + i) for i in range(spec["count"])]
    await asyncio.gather(*(e.connect(spec) for e in edges))
    codec = next((c for c in spec["codecs"] if c in edges[0].welcome.codecs), None)
    if codec is None:
        raise RuntimeError(f"no codec of {spec['codecs']} accepted (server: {edges[0].welcome.codecs})")
    step = decode_codec(spec["step_codec"], codec, list(edges[0].welcome.codecs))
    inputs = edge_inputs(spec, edges[0].welcome, codec, step)
    print(json.dumps({"ready": len(edges), "codec": codec, "step_codec": step}), flush=True)
    line = await loop.run_in_executor(None, sys.stdin.readline)
    if line.strip() != "go":
        raise RuntimeError(f"expected 'go' from the parent, got {line!r}")
    cpu0 = sum(os.times()[:2])
    await asyncio.gather(*(e.run(inputs, spec["prompt"], spec["gen"], spec["timeout"]) for e in edges))
    return {"sessions": [e.result() for e in edges], "cpu_s": sum(os.times()[:2]) - cpu0, "codec": codec,
            "step_codec": step}


def worker_entry() -> int:
    """``served_load.py --worker``: one JSON spec line on stdin, JSON lines out (never pickle); the result, which
    holds every token's time, is written to ``spec['result_path']`` (a line of a few hundred KB through the
    stdout pipe came back cut at 64 KB under uvloop on the GPU host)."""
    spec = json.loads(sys.stdin.readline())
    try:  # the simulated phones as cheap as can be (each real phone has a CPU of its own): uvloop if installed
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        result = runner.run(worker_main(spec)) | {"client_loop": factory.__module__.split(".")[0]}
    Path(spec["result_path"]).write_text(json.dumps(result))
    print(json.dumps({"result": spec["result_path"]}), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# the server


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_sizing(cfg: LoadConfig) -> list[str]:
    """Server options that let the largest level run as one decode batch (user options come after, and win)."""
    smax = max(cfg.sessions)
    per_seq = -(-(cfg.prompt + cfg.gen + 1) // 16)
    return ["--max-sessions", str(smax + 16), "--max-num-seqs", str(smax), "--block-size", "16",
            "--num-blocks", str((smax + 2) * per_seq + 16), "--max-num-batched-tokens", str(max(2048, smax)),
            "--max-model-len", str(max(8192, cfg.prompt + cfg.gen + 16)), "--session-grace-s", "5"]


class ServerProcess:
    """A spawned server (bundle or random-weight preset) on a free port; ``stop`` drains it (SIGTERM)."""

    def __init__(self, cfg: LoadConfig, workdir: Path):
        self.port = _free_port()
        (workers,), (loop,) = cfg.workers, cfg.loops  # one server per value (_run_server's caller sweeps them)
        common = ["--host", "127.0.0.1", "--port", str(self.port), *server_sizing(cfg), "--log-level", "warning",
                  *(["--workers", str(workers)] if workers > 1 else []),  # an older tree has no --workers
                  *(["--loop", loop] if loop != "auto" else []),  # nor --loop
                  *(["--api-key", cfg.api_key] if cfg.api_key else []), *cfg.server_args]
        if cfg.preset is not None:
            stub = workdir / "stub-bundle"
            self.cmd = [sys.executable, str(Path(cfg.server_root) / "bench" / "random_weight_server.py"), "--preset", cfg.preset, "--layer",
                        str(cfg.layer), "--stub", str(stub), "--seed", str(cfg.seed),
                        *([] if cfg.gather_max_ms is None else ["--gather-max-ms", str(cfg.gather_max_ms)]),
                        "--", *common]
            self.bundle = stub
        else:
            self.cmd = [sys.executable, "-m", "cloud_server.cli", "serve", str(cfg.serve), *common]
            self.bundle = cfg.serve
        self.log_path = workdir / "server.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        # `-m cloud_server.cli` and the script resolve in the server root (the cwd comes first on sys.path)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=cfg.server_root)
        self.url = f"ws://127.0.0.1:{self.port}/v1/split"
        self.http = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.http + "/ready", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 6000) -> str:
        self.log.flush()
        return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")

    def stop(self) -> None:
        stop_gracefully(self.proc, 60)
        self.log.close()


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), or of its thread ``tid``, from /proc."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def front_end_pids(pid: int) -> list[int]:
    """The processes running the server's event loops: its front-end workers (``--workers N``: the children
    started by multiprocessing's spawn; not its resource tracker), else the server itself."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    fronts = [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return sorted(fronts) or [pid]


def loop_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds of the main threads (the event loops) of ``pids``, summed."""
    return sum(cpu_seconds(p, p) for p in pids)


# ------------------------------------------------------------------------------------------------
# one level: S sessions over W workers


def run_level(cfg: LoadConfig, url: str, manifest: Manifest, calibration: dict | None, s: int,
              codecs: tuple[str, ...], server_pid: int | None, py_spy_out: Path | None) -> dict:
    procs = min(s, cfg.procs or max(1, (os.cpu_count() or 2) // 2))  # the other half: the server's threads
    share = [s // procs + (i < s % procs) for i in range(procs)]
    workers, first = [], 0
    outdir = Path(tempfile.mkdtemp(prefix="served-load-level-"))  # each worker's result file
    for w, count in enumerate(share):
        spec = {"url": url, "api_key": cfg.api_key, "bundle_id": manifest.bundle_id, "hidden": manifest.hidden_size,
                "calibration": calibration, "codecs": list(codecs), "step_codec": cfg.step_codec,
                "first": first, "count": count,
                "prompt": cfg.prompt, "gen": cfg.gen, "seed": cfg.seed * 1000 + w,
                "states": str(cfg.states) if cfg.states else None, "timeout": cfg.level_timeout_s,
                "result_path": str(outdir / f"worker{w}.json")}
        first += count
        p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=HERE.parent)
        p.stdin.write(json.dumps(spec) + "\n")
        p.stdin.flush()
        workers.append(p)
    try:
        ready = [_read_line(p, "ready", cfg.level_timeout_s) for p in workers]
        used = {r["codec"] for r in ready}
        steps = {r["step_codec"] for r in ready}
        spy = None
        if py_spy_out is not None and server_pid is not None:
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(server_pid), "--subprocesses", "--nonblocking",
                                    "--threads",
                                    "--format", "raw", "--rate", str(PY_SPY_RATE), "-o", str(py_spy_out)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # attached before the load starts
        scraped0 = scrape_histograms(url)
        fronts = front_end_pids(server_pid) if server_pid else []  # where the event loops run
        everyone = sorted({server_pid, *fronts}) if server_pid else []
        cpu0 = sum(cpu_seconds(p) for p in everyone) if server_pid else None
        loop0 = loop_cpu_seconds(fronts) if server_pid else None
        t0 = time.monotonic()
        for p in workers:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [json.loads(Path(_read_line(p, "result", cfg.level_timeout_s + 60)).read_text()) for p in workers]
        wall = time.monotonic() - t0
        scraped = scrape_histograms(url)
        server_cpu = sum(cpu_seconds(p) for p in everyone) - cpu0 if server_pid else None
        loop_cpu = loop_cpu_seconds(fronts) - loop0 if server_pid else None
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
    finally:
        for p in workers:
            if p.poll() is None:
                p.kill()
            p.wait()
        shutil.rmtree(outdir, ignore_errors=True)
    rec = summarize(s, [x for r in results for x in r["sessions"]], cfg)
    rec.update(round_trip_figures(scraped0.get(SCRAPED[0]), scraped.get(SCRAPED[0])))
    rec.update(engine_time_figures(scraped0, scraped))
    if spy is not None and py_spy_out.is_file():
        rec["profile_s"] = profile_summary(py_spy_out, PY_SPY_RATE)
    rec.update(procs=procs, workers=cfg.workers[0], loop=cfg.loops[0], codec=",".join(sorted(used)),
               step_codec=",".join(sorted(steps)), wall_s=wall,
               server_cpu_s=server_cpu, server_loop_cpu_s=loop_cpu,
               loop_us_per_token=1e6 * loop_cpu / rec["tokens"] if loop_cpu is not None and rec["tokens"] else None,
               client_cpu_s=sum(r["cpu_s"] for r in results),
               client_loop=",".join(sorted({r.get("client_loop", "asyncio") for r in results})))
    return rec


def _read_line(p: subprocess.Popen, key: str, timeout: float) -> dict:
    """The next JSON line of worker ``p`` carrying ``key`` (a worker that dies or stalls is an error)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(left):
            raise RuntimeError(f"worker {p.pid}: no '{key}' within {timeout:.0f} s")
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {p.pid} exited ({p.wait()}) before '{key}'")
        msg = json.loads(line)
        if key in msg:
            return msg if key == "ready" else msg[key]


SCRAPED = ("autoglm:edge_round_trip_seconds", "autoglm:engine_step_seconds", "autoglm:engine_input_wait_seconds",
           "autoglm:engine_device_step_seconds")
PASSES = "autoglm:engine_forward_passes_total"


def scrape_histograms(url: str) -> dict[str, dict[float, float]]:
    """The server's histograms in :data:`SCRAPED` now, each as cumulative count per bucket bound (``inf``: all)
    and ``sum`` under key -1; a name is missing where the server has no such series (an older tree), all are
    where it has no open /metrics. Several processes' samples of one bucket add up."""
    base = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rsplit("/v1/", 1)[0]
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            return parse_histograms(r.read().decode())
    except OSError:
        return {}


def parse_histograms(text: str) -> dict[str, dict[float, float]]:
    """:func:`scrape_histograms`' reading of one Prometheus exposition."""
    out: dict[str, dict[float, float]] = {}
    for line in text.splitlines():
        if line.startswith(PASSES + "{"):  # the forward-pass counter: by batch label, under key -2 / -3
            key = -3.0 if 'batch="rebuilt"' in line else -2.0
            h = out.setdefault(PASSES, {})
            h[key] = h.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
            continue
        name, _, rest = line.partition("_seconds_")
        name += "_seconds"
        if name not in SCRAPED:
            continue
        h = out.setdefault(name, {})
        value = float(line.rsplit(" ", 1)[1])
        if rest.startswith("bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            key = float("inf") if le == "+Inf" else float(le)
            h[key] = h.get(key, 0.0) + value
        elif rest.startswith("sum"):
            h[-1.0] = h.get(-1.0, 0.0) + value
    return out


def engine_time_figures(before: dict, after: dict) -> dict:
    """Where the engine thread's time went over the level (the histograms' increase): per step, its mean time in
    the step and waiting for inputs, in ms, and the share of the two it spent stepping."""
    step0, step1 = before.get(SCRAPED[1]), after.get(SCRAPED[1])
    wait0, wait1 = before.get(SCRAPED[2]), after.get(SCRAPED[2])
    if not (step0 and step1 and wait0 and wait1):
        return {}
    n = step1.get(float("inf"), 0.0) - step0.get(float("inf"), 0.0)
    step, wait = step1[-1.0] - step0[-1.0], wait1[-1.0] - wait0[-1.0]
    if n <= 0 or step + wait <= 0:
        return {}
    return {"engine_steps": int(n), "engine_step_ms": 1e3 * step / n, "engine_wait_ms": 1e3 * wait / n,
            "engine_busy_fraction": step / (step + wait),
            # the median step: the level's prompt steps (tens of ms) pull the mean up, not the median
            "engine_step_p50_ms": 1e3 * histogram_quantile(_increase(step0, step1), 0.5),
            "engine_wait_p50_ms": 1e3 * histogram_quantile(_increase(wait0, wait1), 0.5),
            **_device_time(before.get(SCRAPED[3]), after.get(SCRAPED[3])),
            **_rebuilt_share(before.get(PASSES), after.get(PASSES))}


def _device_time(before: dict | None, after: dict | None) -> dict:
    """The level's forward passes on the device (CUDA only): their median time, beside the engine step's."""
    if not before or not after:
        return {}
    delta = _increase(before, after)
    q = histogram_quantile(delta, 0.5)
    return {} if q is None else {"engine_device_p50_ms": 1e3 * q}


def _rebuilt_share(before: dict | None, after: dict | None) -> dict:
    """The share of the level's forward passes whose batch was rebuilt from its chunks (not the persistent one)."""
    if not before or not after:
        return {}
    rebuilt = after.get(-3.0, 0.0) - before.get(-3.0, 0.0)
    total = rebuilt + after.get(-2.0, 0.0) - before.get(-2.0, 0.0)
    return {"engine_rebuilt_fraction": rebuilt / total} if total > 0 else {}


def histogram_quantile(delta: dict[float, float], q: float) -> float | None:
    """Quantile ``q`` of a histogram's increase (cumulative count per bound), interpolated within its bucket, in
    the histogram's unit; None when it saw nothing."""
    n = delta.get(float("inf"), 0.0)
    if n <= 0:
        return None
    rank, lo, below = q * n, 0.0, 0.0
    for b in sorted(k for k in delta if k >= 0):
        if delta[b] >= rank:
            if b == float("inf"):
                return lo
            return lo + (b - lo) * (rank - below) / max(delta[b] - below, 1e-12)
        lo, below = b, delta[b]
    return lo


def _increase(before: dict, after: dict) -> dict[float, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def round_trip_figures(before: dict | None, after: dict | None) -> dict:
    """The level's edge round trips as the engine saw them (the histogram's increase): mean, and p50 / p99
    interpolated within their buckets, in ms; the client's own share is ``client_ms_per_token``."""
    if not before or not after:
        return {}
    delta = _increase(before, after)
    n = delta.get(float("inf"), 0.0)
    if n <= 0:
        return {}
    return {"round_trip_count": int(n), "round_trip_mean_ms": 1e3 * delta[-1.0] / n,
            "round_trip_p50_ms": 1e3 * histogram_quantile(delta, 0.5),
            "round_trip_p99_ms": 1e3 * histogram_quantile(delta, 0.99)}


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize(s: int, sessions: list[dict], cfg: LoadConfig) -> dict:
    """Throughput, TTFT and ITL of one level from every session's token timeline (monotonic seconds)."""
    ok = [x for x in sessions if x["error"] is None and len(x["token_times"]) == cfg.gen
          and x["completion_tokens"] == cfg.gen and x["finish"] == "length"]
    errors = [f"session {x['index']}: {x['error'] or 'finish ' + str(x['finish'])}, {len(x['token_times'])} tokens"
              for x in sessions if x not in ok]
    rec: dict = {"sessions": s, "completed": len(ok), "errors": errors[:8], "prompt": cfg.prompt, "gen": cfg.gen,
                 "tokens": sum(len(x["token_times"]) for x in sessions)}
    if not ok:
        return rec | {"served_tokens_per_s": None}
    ttft = [1e3 * (x["token_times"][0] - x["start"]) for x in ok]
    itl = [1e3 * g for x in ok for g in np.diff(x["token_times"]).tolist()]
    all_first = max(x["token_times"][0] for x in ok)  # every session is decoding from here...
    first_done = min(x["token_times"][-1] for x in ok)  # ...until the first one finishes
    window = first_done - all_first
    steady = sum(1 for x in ok for t in x["token_times"] if all_first < t <= first_done)
    begin, end = min(x["start"] for x in ok), max(x["token_times"][-1] for x in ok)
    rec.update(served_tokens_per_s=steady / window if window > 0 else None,
               served_tokens_per_s_overall=rec["tokens"] / (end - begin), steady_window_s=window,
               ttft_p50_ms=_pct(ttft, 50), ttft_p99_ms=_pct(ttft, 99), itl_p50_ms=_pct(itl, 50),
               itl_p99_ms=_pct(itl, 99), itl_mean_ms=float(np.mean(itl)) if itl else None,
               uplink_bytes_per_session=float(np.mean([x["up_bytes"] for x in ok])),
               client_ms_per_token=1e3 * sum(x["client_s"] for x in ok) / max(1, sum(len(x["token_times"]) - 1
                                                                                   for x in ok)))
    return rec


# leaf frames of an event loop waiting in uvloop's C code (no selectors.py frame to see)
UVLOOP_IDLE_LEAVES = ("Runner.run (asyncio/runners.py", "run_until_complete (uvloop")
# (category, substrings of a frame); a sample goes to the first category that matches, leaf frame first
PROFILE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("idle: event loop waiting", ("select (selectors.py",)),
    ("codec decode", ("(shared/codec",)),
    ("msgpack decode + validation", ("decode_message (shared/wire.py", "(shared/messages.py", "(shared/tensors.py")),
    ("msgpack encode", ("encode_message (shared/wire.py",)),
    ("metrics", ("(prometheus_client/",)),
    ("websocket frames", ("(websockets/", "(uvicorn/protocols/")),
    ("model forward", ("(torch/nn/modules/", "(cloud_server/fast/", "(cloud_server/attention.py",
                       "(transformers/models/")),
    ("engine: batch build + host->device", ("(cloud_server/engine/model_runner.py",)),
    ("engine: scheduler", ("(cloud_server/engine/scheduler.py", "(cloud_server/engine/block_manager.py")),
    ("engine: other", ("(cloud_server/engine/",)),
    ("split endpoint", ("(cloud_server/split",)),
    ("asyncio", ("(asyncio/",)),
)


def profile_summary(path: Path, rate: int) -> dict:
    """Seconds per thread and category from ``py-spy record --subprocesses --format raw`` collapsed stacks (see
    :data:`PROFILE_RULES`); a thread's busy time is every sample but the event loop's idle wait. The server's
    front-end workers (``--workers N``) are summed as ``front-end workers / <thread>``."""
    threads: dict[str, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        role = ""
        while frames and not frames[0].startswith("thread ("):  # the sample's process and its parents (a
            if "spawn_main" in frames[0]:  # command line may hold ";"): a worker's is multiprocessing's spawn
                role = "front-end workers / "
            frames = frames[1:]
        if not frames:
            continue
        thread = role + frames[0].split(": ", 1)[-1]
        if any(k in frames[-1] for k in UVLOOP_IDLE_LEAVES):  # uvloop waits in C, below its Python caller
            cat = "idle: event loop waiting"
        else:
            cat = next((name for f in reversed(frames[1:]) for name, keys in PROFILE_RULES
                        if any(k in f for k in keys)), "other")
        per = threads.setdefault(thread, {})
        per[cat] = per.get(cat, 0.0) + int(count) / rate
    return {t: dict(sorted(c.items(), key=lambda kv: -kv[1])) for t, c in threads.items()}


def engine_direct_cpu(cfg: LoadConfig, s: int) -> dict:
    """The engine alone on this host (``--engine-cpu``): S sessions fed through ``AsyncEngine`` as the server
    feeds them (a prompt chunk, then one [1, H] state per returned token, from the engine's output callback),
    with no sockets, msgpack or codecs; the same steady-window tokens/s as the served levels (:func:`summarize`).
    The CPU counterpart of ``cloud_gpu_bench --through-engine``'s figure, for the served/engine ratio. With
    ``--preset`` the engine is the random-weight server's (a stub bundle, the same seeded back half)."""
    import threading

    import torch

    from cloud_server.config import EngineConfig, ServerConfig
    from cloud_server.engine.sampling_params import SamplingParams
    from cloud_server.engine.sequence import InputChunk
    from cloud_server.runtime import CloudRuntime

    smax = max(cfg.sessions)
    per_seq = -(-(cfg.prompt + cfg.gen + 1) // 16)
    ecfg = EngineConfig(block_size=16, num_blocks=(smax + 2) * per_seq + 16, max_num_seqs=smax,
                        max_num_batched_tokens=max(2048, smax), max_model_len=max(8192, cfg.prompt + cfg.gen + 16))
    with tempfile.TemporaryDirectory(prefix="served-load-engine-") as tmp:
        bundle = cfg.bundle
        if cfg.preset is not None:
            import random_weight_server as rws  # bench/, beside this script

            bundle = Path(tmp) / "stub-bundle"
            rws.write_stub_bundle(bundle, cfg.preset, cfg.layer, cfg.seed)
            rws.install_random_weights(cfg.preset, cfg.layer, cfg.seed)
        rt = CloudRuntime(ServerConfig(bundle=bundle, engine=ecfg)).start()
    try:
        h = rt.facts.hidden_size
        g = torch.Generator().manual_seed(cfg.seed)
        prompt = torch.randn(cfg.prompt, h, generator=g)  # [P, H]
        step = torch.randn(1, h, generator=g)  # [1, H]
        done = threading.Event()
        sessions = [{"index": i, "start": 0.0, "token_times": [], "finish": None, "completion_tokens": None,
                     "error": None, "up_bytes": 0, "client_s": 0.0} for i in range(s)]  # no phone: no client time
        left = [s]

        def sink(out, x) -> None:  # engine thread
            if out.error_code is not None:
                x["error"] = out.error_code
            elif out.token_id is not None:
                x["token_times"].append(time.monotonic())
            if out.finished or out.error_code is not None:
                x["finish"], x["completion_tokens"] = out.finish_reason, len(x["token_times"])
                left[0] -= 1
                if not left[0]:
                    done.set()
                return
            rt.engine.add_input(f"e{x['index']}", InputChunk(cfg.prompt + len(x["token_times"]) - 1, hidden=step))

        params = SamplingParams(max_tokens=cfg.gen, temperature=0.0, ignore_eos=True)
        for x in sessions:
            x["start"] = time.monotonic()
            rt.engine.add_request(f"e{x['index']}", lambda out, x=x: sink(out, x),
                                  InputChunk(0, hidden=prompt, last=True), params)
        if not done.wait(cfg.level_timeout_s):
            raise RuntimeError(f"engine-direct S={s}: not finished within {cfg.level_timeout_s:.0f} s")
    finally:
        rt.stop()
    rec = summarize(s, sessions, cfg)
    return {"sessions": s, "engine_tokens_per_s": rec.get("served_tokens_per_s"), "completed": rec["completed"]}


def engine_cpu_of_tree(cfg: LoadConfig, root: Path, s: int) -> dict:
    """:func:`engine_direct_cpu` in a child process that imports the engine from checkout ``root`` (so each
    tree of a ``--compare-root`` run is divided by its own engine: ``served_vs_engine`` per tree)."""
    spec = {"root": str(root), "s": s, "preset": cfg.preset, "layer": cfg.layer,
            "bundle": str(cfg.bundle) if cfg.bundle is not None else None, "sessions": list(cfg.sessions),
            "prompt": cfg.prompt, "gen": cfg.gen, "seed": cfg.seed, "timeout": cfg.level_timeout_s}
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--engine-worker"], input=json.dumps(spec),
                       capture_output=True, text=True, cwd=root, timeout=cfg.level_timeout_s + 300)
    if p.returncode != 0:
        raise RuntimeError(f"engine-direct S={s} in {root} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def engine_worker_entry() -> int:
    """``served_load.py --engine-worker``: one JSON spec on stdin (:func:`engine_cpu_of_tree`), the engine
    imported from the spec's checkout, one JSON result line out."""
    spec = json.loads(sys.stdin.read())
    sys.path.insert(0, spec["root"])  # ahead of this checkout: cloud_server and partition_tools come from root
    bundle = Path(spec["bundle"]) if spec["bundle"] else None
    cfg = LoadConfig(serve=bundle if spec["preset"] is None else None, preset=spec["preset"], layer=spec["layer"],
                     sessions=tuple(spec["sessions"]), prompt=spec["prompt"], gen=spec["gen"], seed=spec["seed"],
                     level_timeout_s=spec["timeout"], engine_cpu=True)
    engine_direct_cpu(dataclasses.replace(cfg, gen=min(cfg.gen, 8)), 1)  # warm-up: a fresh process's first calls
    print(json.dumps(engine_direct_cpu(cfg, spec["s"])), flush=True)
    return 0


def engine_figures(path: Path | None) -> dict[str, dict]:
    """Per S, the engine and direct-loop tokens/s of a ``cloud_gpu_bench.py --through-engine`` JSON."""
    if path is None:
        return {}
    if not path.is_file():
        raise FileNotFoundError(f"--engine-json {path}: no such file")
    return json.loads(path.read_text()).get("engine", {}).get("summary", {})


def attach_engine(res: dict, engine_json: Path) -> dict:
    """Fill each record's ``engine_tokens_per_s`` / ``direct_tokens_per_s`` (and the served/engine ratio) from
    the engine bench of the same run; the served figures are untouched."""
    engine = engine_figures(engine_json)
    for rec in res["records"]:
        e = engine.get(str(rec["sessions"]), {})
        rec["engine_tokens_per_s"] = e.get("engine_tokens_per_s")
        rec["direct_tokens_per_s"] = e.get("direct_tokens_per_s")
        rec["served_vs_engine"] = (rec["served_tokens_per_s"] / rec["engine_tokens_per_s"]
                                   if rec.get("served_tokens_per_s") and rec["engine_tokens_per_s"] else None)
    res["engine_json"] = str(engine_json)
    return res


# ------------------------------------------------------------------------------------------------
# the run


def run(cfg: LoadConfig, command: str) -> dict:
    """Every level against the server (``--compare-root``: first against that tree's, then this one's; records
    carry ``tree``; several ``--workers``: one server per value, in turn), then ``--engine-cpu``'s engine-alone
    figures beside them."""
    res = None
    roots = ([cfg.compare_root] if cfg.compare_root is not None else []) + [cfg.server_root]
    servers = [(root, w, loop) for root in roots for w in cfg.workers for loop in cfg.loops]
    for root, workers, loop in servers:
        # one server: its levels are written as they finish (a run cut short keeps them); several: after each
        out = cfg.out if len(servers) == 1 else None
        one = _run_server(dataclasses.replace(cfg, server_root=root, compare_root=None, out=out, workers=(workers,),
                                              loops=(loop,)), command)
        for rec in one["records"]:
            rec["tree"] = str(root)
        if res is None:
            res = one | {"servers": [one["server"]]}
        else:
            res["records"] += one["records"]
            res["servers"].append(one["server"])
        if cfg.out is not None:
            _write(cfg.out, res)
    res["config"] = _jsonable(asdict(cfg))
    if cfg.engine_cpu:
        roots = [cfg.server_root] if cfg.compare_root is None else [cfg.compare_root, cfg.server_root]
        engine = {(str(r), s): engine_cpu_of_tree(cfg, r, s) for r in roots for s in cfg.sessions}
        res["engine_cpu"] = [e | {"tree": r} for (r, _), e in engine.items()]
        for rec in res["records"]:
            e = engine[(rec["tree"], rec["sessions"])]["engine_tokens_per_s"]
            rec["engine_tokens_per_s"] = e
            rec["served_vs_engine"] = rec["served_tokens_per_s"] / e if rec.get("served_tokens_per_s") and e else None
            print(_row(rec) + f", engine {e or 0:.0f} tok/s, served/engine {rec['served_vs_engine'] or 0:.2f}"
                  + (f" [{rec['tree']}]" if cfg.compare_root else ""), flush=True)
    return res


def _run_server(cfg: LoadConfig, command: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="served-load-") as tmp:
        server = None
        try:
            if cfg.url is None:
                server = ServerProcess(cfg, Path(tmp))
                print(f"[served_load] server: {shlex.join(server.cmd)}", flush=True)
                ready_s = server.wait_ready(cfg.ready_timeout_s)
                url, bundle, pid = server.url, server.bundle, server.proc.pid
                print(f"[served_load] ready after {ready_s:.1f} s", flush=True)
            else:
                url, bundle, pid, ready_s = cfg.url, cfg.bundle, None, None
            manifest = Manifest.load(bundle)
            calib_path = Path(bundle) / "calibration.json"
            calibration = json.loads(calib_path.read_text()) if calib_path.is_file() else None
            res = {"command": command, "config": _jsonable(asdict(cfg)),
                   "env": {"python": platform.python_version(), "host_cpus": os.cpu_count(),
                           "machine": platform.machine()},
                   "server": {"command": shlex.join(server.cmd) if server else None, "url": url,
                              "ready_s": ready_s, "bundle_id": manifest.bundle_id, "hidden": manifest.hidden_size,
                              "source": manifest.source},
                   "records": []}
            run_level(cfg, url, manifest, calibration, 1, cfg.codecs, None, None)  # warm-up: first-call costs
            # a swept codec is the only prompt codec offered; the policy's step codecs are offered beside it
            extra = DEFAULT_POLICY.step_codecs if cfg.step_codec == "policy" else (
                () if cfg.step_codec == "same" else (cfg.step_codec,))
            sweep = [(c, *(x for x in extra if x != c)) for c in cfg.sweep_codecs] or [cfg.codecs]
            procs_sweep = cfg.sweep_procs or (cfg.procs,)
            for codecs in sweep:
                for s, procs in ((s, p) for s in cfg.sessions for p in procs_sweep):
                    # the profile: the first codec's largest level, once
                    spy = cfg.py_spy if codecs == sweep[0] and s == max(cfg.sessions) and procs == procs_sweep[0] \
                        else None
                    rec = run_level(dataclasses.replace(cfg, procs=procs), url, manifest, calibration, s, codecs,
                                    pid, spy)
                    rec.update(engine_tokens_per_s=None, direct_tokens_per_s=None, served_vs_engine=None)
                    res["records"].append(rec)
                    if cfg.engine_json is not None:
                        attach_engine(res, cfg.engine_json)
                    print(_row(rec), flush=True)
                    if cfg.out is not None:
                        _write(cfg.out, res)
            return res
        except Exception:
            if server is not None:
                print(f"[served_load] server log (tail):\n{server.tail()}", file=sys.stderr, flush=True)
            raise
        finally:
            if server is not None:
                server.stop()


def _row(r: dict) -> str:
    def f(v, fmt=".1f"):
        return "-" if v is None else format(v, fmt)
    return (f"[served_load] {r.get('codec', '?')} workers={r.get('workers', 1)} loop={r.get('loop', 'auto')} S={r['sessions']:4d} completed {r['completed']}/{r['sessions']} "
            f"served {f(r.get('served_tokens_per_s'), '.0f')} tok/s (overall {f(r.get('served_tokens_per_s_overall'), '.0f')})"
            f" TTFT p50 {f(r.get('ttft_p50_ms'))} ms, ITL p50 {f(r.get('itl_p50_ms'), '.2f')} / p99 "
            f"{f(r.get('itl_p99_ms'), '.2f')} ms, edge round trip p50 {f(r.get('round_trip_p50_ms'), '.2f')} / p99 "
            f"{f(r.get('round_trip_p99_ms'), '.2f')} ms (client {f(r.get('client_ms_per_token'), '.2f')} ms), "
            f"engine step {f(r.get('engine_step_ms'), '.2f')} (p50 {f(r.get('engine_step_p50_ms'), '.2f')}) + input "
            f"wait {f(r.get('engine_wait_ms'), '.2f')} (p50 {f(r.get('engine_wait_p50_ms'), '.2f')}) ms, device "
            f"p50 {f(r.get('engine_device_p50_ms'), '.2f')} ms "
            f"(busy {f(r.get('engine_busy_fraction'), '.2f')}, rebuilt batches {f(r.get('engine_rebuilt_fraction'), '.2f')}), server CPU {f(r.get('server_cpu_s'), '.1f')} s (loop "
            f"{f(r.get('loop_us_per_token'), '.0f')} us/token), "
            f"client CPU {f(r.get('client_cpu_s'), '.1f')} s over {f(r.get('wall_s'), '.1f')} s")


def _jsonable(d: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v) for k, v in d.items()}


def _write(path: Path, res: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(path)


def parse_args(argv: list[str] | None = None) -> LoadConfig:
    d = LoadConfig.__dataclass_fields__
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    src = ap.add_argument_group("server (one of)")
    src.add_argument("--url", help="ws://HOST:PORT/v1/split of a running server (with --bundle)")
    src.add_argument("--serve", type=Path, help="spawn `autoglm-cloud serve BUNDLE` on a free port")
    src.add_argument("--preset", help="spawn a random-weight server: tiny-glm4 | tiny-glm4v | glm4v-9b-random")
    ap.add_argument("--bundle", type=Path, help="the bundle a --url server serves")
    ap.add_argument("--layer", type=int, default=d["layer"].default, help="split layer of --preset")
    ap.add_argument("--gather-max-ms", type=float, default=None,
                    help="--preset server: cap of the engine's decode-cohort gather window (0: off)")
    ap.add_argument("--server-arg", action="append", default=[], dest="server_args",
                    help="extra `autoglm-cloud serve` option, repeatable (e.g. --server-arg=--variants=bf16)")
    ap.add_argument("--sessions", default="1,8,64,256", help="concurrent sessions per level")
    ap.add_argument("--prompt", type=int, default=d["prompt"].default, help="prompt positions per session")
    ap.add_argument("--gen", type=int, default=d["gen"].default, help="tokens per session")
    ap.add_argument("--codecs", default=",".join(DEFAULT_CODECS), help="codec preference order (Hello)")
    ap.add_argument("--sweep-codecs", default="", help="run every level once per codec (e.g. int8-outlier,bf16)")
    ap.add_argument("--step-codec", default=d["step_codec"].default,
                    help="decode steps' codec: policy (what the default EdgeClient sends: fp16 where offered), "
                         "same (the prompt's codec), or a codec name")
    ap.add_argument("--procs", type=int, default=0, help="load-generator processes (0: half the cores)")
    ap.add_argument("--sweep-procs", default="",
                    help="run every level once per load-generator process count, in the order given (e.g. 3,8,3,8: "
                         "is the load generator's own serial work part of the round trip?)")
    ap.add_argument("--workers", default="1", help="the server's front-end processes (`serve --workers`); several, "
                                                  "comma-separated: one server per value, in turn")
    ap.add_argument("--loops", default="auto", help="the server's event loop (`serve --loop`: auto, asyncio, "
                                                    "uvloop); several, comma-separated: one server per value")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--states", type=Path, help="recorded boundary states [N, H] float32 .npy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-timeout-s", type=float, default=d["ready_timeout_s"].default)
    ap.add_argument("--level-timeout-s", type=float, default=d["level_timeout_s"].default)
    ap.add_argument("--engine-json", type=Path, help="cloud_gpu_bench --through-engine JSON of the same run")
    ap.add_argument("--py-spy", type=Path, help="collapsed-stack profile of the server at the largest level")
    ap.add_argument("--engine-cpu", action="store_true",
                    help="also measure the engine alone (per tree, a child process): served/engine")
    ap.add_argument("--server-root", type=Path, default=d["server_root"].default,
                    help="the checkout whose server is spawned (default: this one)")
    ap.add_argument("--compare-root", type=Path, help="also measure this checkout's server, first, in one run")
    ap.add_argument("--out", type=Path, help="result JSON (rewritten after every level)")
    a = ap.parse_args(argv)
    try:
        return LoadConfig(url=a.url, bundle=a.bundle, serve=a.serve, preset=a.preset, layer=a.layer,
                          gather_max_ms=a.gather_max_ms,
                          server_args=a.server_args, sessions=tuple(int(x) for x in a.sessions.split(",") if x),
                          prompt=a.prompt, gen=a.gen, codecs=tuple(c for c in a.codecs.split(",") if c),
                          sweep_codecs=tuple(c for c in a.sweep_codecs.split(",") if c), step_codec=a.step_codec,
                          procs=a.procs, sweep_procs=tuple(int(x) for x in a.sweep_procs.split(",") if x),
                          workers=tuple(int(x) for x in a.workers.split(",") if x),
                          loops=tuple(x for x in a.loops.split(",") if x),
                          api_key=a.api_key, states=a.states, seed=a.seed,
                          ready_timeout_s=a.ready_timeout_s, level_timeout_s=a.level_timeout_s,
                          engine_json=a.engine_json, py_spy=a.py_spy, out=a.out, engine_cpu=a.engine_cpu,
                          server_root=a.server_root, compare_root=a.compare_root)
    except ValueError as e:
        ap.error(str(e))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--worker"]:
        return worker_entry()
    if argv == ["--engine-worker"]:
        return engine_worker_entry()
    if argv and argv[0] == "--attach-engine":  # --attach-engine ENGINE_JSON --to SERVED_JSON
        if len(argv) != 4 or argv[2] != "--to":
            print("usage: served_load.py --attach-engine ENGINE_JSON --to SERVED_JSON", file=sys.stderr)
            return 2
        served = Path(argv[3])
        _write(served, attach_engine(json.loads(served.read_text()), Path(argv[1])))
        for r in json.loads(served.read_text())["records"]:
            print(_row(r) + f", engine {r['engine_tokens_per_s']}, direct {r['direct_tokens_per_s']}")
        return 0
    cfg = parse_args(argv)
    res = run(cfg, shlex.join(["python", "bench/served_load.py", *argv]))
    bad = [r for r in res["records"] if r["completed"] != r["sessions"]]
    if cfg.out is not None:
        _write(cfg.out, res)
    for r in bad:
        print(f"[served_load] S={r['sessions']}: {r['sessions'] - r['completed']} sessions failed: {r['errors']}",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
