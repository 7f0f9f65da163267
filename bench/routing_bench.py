"""Prefix-aware routing, measured: replicas of a bundle behind a real nginx (deploy/nginx/autoglm-split.conf).

Phones that share a system prompt should land on the replica that caches its KV blocks. Per replica count N,
the same workload runs twice through nginx, each time with fresh system prompts so nothing carries over:

* hashed: each session's WebSocket upgrade carries ``X-Autoglm-Prefix-Key`` (its prompt's first prefix key,
  ``shared.prefix_keys``), which nginx hashes onto a consistent ring of the replicas;
* round-robin: no header; nginx's hash balancer falls back to round-robin for an empty key.

Workload: P system prompts of 64 tokens (4 blocks of 16), K new sessions per prompt, interleaved as phones
arrive, each the system prompt plus 8 user tokens, sent whole (start 0, fp16 states) with its prefix keys, 2
tokens generated. The hit rate is the replicas' own counters: ``vllm:prefix_cache_hits_total /
vllm:prefix_cache_queries_total`` (prompt tokens), summed over the replicas, before and after.

    scripts/install_nginx.sh                      # Debian's nginx, if it is not there
    autoglm-partition split --preset tiny-glm4 --layer 2 --out /tmp/b
    python bench/routing_bench.py --bundle /tmp/b --replicas 2,4 --out docs/results/routing.json

The replica and nginx helpers here are also what tests/deploy/ runs (the failover test, the routing test).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
sys.path.insert(0, str(ROOT))

from child_process import stop_gracefully  # noqa: E402 - bench/, beside this script
from shared import protocol as P  # noqa: E402 - after the path fix, so the bench runs from a checkout
from shared.codecs import get_codec  # noqa: E402
from shared.manifest import Manifest  # noqa: E402
from shared.prefix_keys import KeyScope, block_keys  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    """GET ``url``: (status, body); an https:// certificate is not verified (test certificates)."""
    context = ssl._create_unverified_context() if url.startswith("https:") else None  # noqa: S323
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Replica:
    """One `autoglm-cloud serve BUNDLE` process on a free port (``kill`` is the crash, ``stop`` the drain)."""

    def __init__(self, bundle: Path, log: Path, *extra: str):
        self.port = free_port()
        self.log = open(log, "wb")  # noqa: SIM115 - closed in stop()/kill()
        self.proc = subprocess.Popen([sys.executable, "-m", "cloud_server.cli", "serve", str(bundle), "--host",
                                      "127.0.0.1", "--port", str(self.port), "--log-level", "warning", *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.log_path = log

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120.0) -> Replica:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica exited ({self.proc.returncode}): {self.log_path.read_text()[-2000:]}")
            try:
                if http_get(self.http + "/ready")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"replica on {self.port} not ready in {timeout:.0f} s")

    def metrics(self) -> str:
        return http_get(self.http + "/metrics")[1]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()

    def stop(self) -> None:
        stop_gracefully(self.proc, 30)
        self.log.close()


class Router:
    """nginx with deploy/nginx/autoglm-split.conf, its upstream being ``replicas`` (host:port strings); with ``tls``
    (certificate, key) it listens as the cluster's router does (deploy/nginx/k8s/autoglm-listen.conf), on TLS."""

    START_S = 20.0  # how long nginx may take to answer /router/health

    def __init__(self, nginx: str, workdir: Path, upstreams: list[str], tls: tuple[Path, Path] | None = None):
        self.nginx, self.dir, self.port = nginx, workdir, free_port()
        self.scheme = "https" if tls else "http"
        for sub in ("conf", "logs", "tmp"):
            (workdir / sub).mkdir(parents=True, exist_ok=True)
        (workdir / "conf" / "autoglm-upstreams.conf").write_text(
            "".join(f"server {u} max_fails=1 fail_timeout=30s;\n" for u in upstreams))
        listen = f"listen 127.0.0.1:{self.port};\n"
        if tls:
            listen = (DEPLOY / "nginx" / "k8s" / "autoglm-listen.conf").read_text().replace(
                "listen 8443 ", f"listen 127.0.0.1:{self.port} ").replace(
                "/etc/nginx/tls/tls.crt", str(tls[0])).replace("/etc/nginx/tls/tls.key", str(tls[1]))
        (workdir / "conf" / "autoglm-listen.conf").write_text(listen)
        (workdir / "conf" / "autoglm-split.conf").write_text((DEPLOY / "nginx" / "autoglm-split.conf").read_text())
        t = workdir / "tmp"
        # run as root (a test box), the workers would be `nobody`, who cannot read the test certificate under a private
        # temporary directory: the listen conf reads it at each handshake, in the worker (deploy/nginx/k8s)
        user = "user root;" if os.geteuid() == 0 else ""
        (workdir / "conf" / "nginx.conf").write_text(f"""
{user}
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/logs/error.log info;
events {{ worker_connections 1024; }}
http {{
    client_body_temp_path {t}/body; proxy_temp_path {t}/proxy; fastcgi_temp_path {t}/fcgi;
    uwsgi_temp_path {t}/uwsgi; scgi_temp_path {t}/scgi;
    include {workdir}/conf/autoglm-split.conf;
    access_log {workdir}/logs/access.log autoglm_route;
}}
""")
        self.conf = workdir / "conf" / "nginx.conf"
        self.proc = None

    def check(self) -> subprocess.CompletedProcess:
        return subprocess.run([self.nginx, "-t", "-p", str(self.dir), "-c", str(self.conf)], capture_output=True,
                              text=True, timeout=30, check=False)

    def __enter__(self) -> Router:
        self.proc = subprocess.Popen([self.nginx, "-p", str(self.dir), "-c", str(self.conf), "-g", "daemon off;"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + self.START_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if http_get(f"{self.scheme}://127.0.0.1:{self.port}/router/health")[0] == 200:
                    return self
            except OSError:
                pass
            if time.monotonic() > deadline:  # stopped, not left running (an orphan nginx after the failed test)
                self.__exit__(None, None, None)
                error_log = self.dir / "logs" / "error.log"
                raise RuntimeError(f"nginx did not answer /router/health in {self.START_S:.0f} s: "
                                   f"{error_log.read_text(errors='replace')[-2000:] if error_log.exists() else ''}")
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGQUIT)  # graceful: finish the log lines
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    @property
    def ws_url(self) -> str:
        return f"{'wss' if self.scheme == 'https' else 'ws'}://127.0.0.1:{self.port}/v1/split"

    def access_log(self) -> list[str]:
        path = self.dir / "logs" / "access.log"
        return path.read_text().splitlines() if path.exists() else []


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets) in Prometheus text ``text``."""
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))


# ------------------------------------------------------------------------------------------------
# the measurement


async def one_session(url: str, manifest: Manifest, ids: list[int], route: bool, block: int = 16) -> None:
    """One new session through the router: the whole prompt (start 0) with its prefix keys, 2 tokens."""
    keys = block_keys(ids, KeyScope(manifest.bundle_id, manifest.states_variant, "fp16"), block)
    headers = {"X-Autoglm-Prefix-Key": keys[0]} if route and keys else {}
    codec = get_codec("fp16")
    hidden = np.random.default_rng(len(ids)).standard_normal((len(ids), manifest.hidden_size), np.float32)
    from websockets.asyncio.client import connect

    async with connect(url, additional_headers=headers, compression=None) as ws:
        await ws.send(P.encode_message(P.Hello(bundle_id=manifest.bundle_id, codecs=["fp16"])))
        welcome = P.decode_message(await ws.recv())
        if not isinstance(welcome, P.Welcome):
            raise RuntimeError(f"expected Welcome, got {welcome}")
        await ws.send(P.encode_message(P.Prefill(
            request_id="r", start=0, hidden=codec.encode(hidden), last=True, prefix_keys=keys,
            params=P.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))))
        while True:
            msg = P.decode_message(await ws.recv())
            if not isinstance(msg, P.Tokens):
                raise RuntimeError(f"expected Tokens, got {msg}")
            if msg.finish_reason is not None:
                break
            step = hidden[-1:]  # [1, H]: any state will do, the cache's hit rate does not depend on it
            await ws.send(P.encode_message(P.DecodeStep(request_id="r", position=len(ids) + msg.index,
                                                        hidden=codec.encode(step))))
        await ws.send(P.encode_message(P.Close()))


def hit_rate(replicas: list[Replica], url: str, manifest: Manifest, system_prompts: list[list[int]], route: bool,
             per_prompt: int, seed: int = 5) -> float:
    """Prefix-cache hit rate (prompt tokens) of ``per_prompt`` new sessions per system prompt, interleaved."""
    def counters() -> tuple[float, float]:
        texts = [r.metrics() for r in replicas]
        return (sum(metric_sum(t, "vllm:prefix_cache_hits_total") for t in texts),
                sum(metric_sum(t, "vllm:prefix_cache_queries_total") for t in texts))

    h0, q0 = counters()
    rng = np.random.RandomState(seed)
    for _ in range(per_prompt):
        for sp in system_prompts:  # interleaved, as phones arrive
            asyncio.run(one_session(url, manifest, sp + [int(t) for t in rng.randint(4, 512, 8)], route))
    time.sleep(0.2)  # the engine thread publishes its counters after the last step
    h1, q1 = counters()
    return (h1 - h0) / (q1 - q0)


@dataclass(slots=True)
class RoutingConfig:
    bundle: Path
    replicas: tuple[int, ...] = (2, 4)
    prompts: int = 3  # system prompts (an odd count: round-robin does not pin a prompt by coincidence)
    per_prompt: int = 6  # new sessions per system prompt
    nginx: str = "nginx"
    out: Path | None = None

    def __post_init__(self):
        if min(self.replicas) < 1 or self.prompts < 1 or self.per_prompt < 2:
            raise ValueError("--replicas >= 1, --prompts >= 1, --per-prompt >= 2")


def run(cfg: RoutingConfig, command: str) -> dict:
    manifest = Manifest.load(cfg.bundle)
    rng = np.random.RandomState(9)
    res: dict = {"command": command, "bundle_source": manifest.source, "records": []}
    for n in cfg.replicas:
        with tempfile.TemporaryDirectory(prefix="routing-") as tmp:
            reps = [Replica(cfg.bundle, Path(tmp) / f"replica{i}.log") for i in range(n)]
            try:
                for r in reps:
                    r.wait_ready()
                with Router(cfg.nginx, Path(tmp) / "nginx", [f"127.0.0.1:{r.port}" for r in reps]) as router:
                    rates = {}
                    for mode in ("hash", "round_robin"):  # fresh prompts per mode: no carry-over
                        prompts = [[int(t) for t in rng.randint(4, 512, 64)] for _ in range(cfg.prompts)]
                        rates[mode] = hit_rate(reps, router.ws_url, manifest, prompts, mode == "hash",
                                               cfg.per_prompt)
            finally:
                for r in reps:
                    r.stop()
        rec = {"replicas": n, "system_prompts": cfg.prompts, "sessions_per_prompt": cfg.per_prompt,
               "prompt_tokens": 72, "cacheable_tokens": 64, "hit_rate_hash": rates["hash"],
               "hit_rate_round_robin": rates["round_robin"],
               # hashed, only a prompt's first session misses; that bound, for reference
               "hit_rate_hash_ideal": (cfg.per_prompt - 1) / cfg.per_prompt * 64 / 72}
        res["records"].append(rec)
        print(f"[routing] {n} replicas: hit rate hashed {rec['hit_rate_hash']:.3f}, round-robin "
              f"{rec['hit_rate_round_robin']:.3f}", flush=True)
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(res, indent=1) + "\n")
    return res


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True, help="the bundle every replica serves")
    ap.add_argument("--replicas", default="2,4", help="replica counts to measure")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--per-prompt", type=int, default=6)
    ap.add_argument("--nginx", default="nginx", help="the nginx binary (scripts/install_nginx.sh prints it)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    cfg = RoutingConfig(bundle=a.bundle, replicas=tuple(int(x) for x in a.replicas.split(",") if x),
                        prompts=a.prompts, per_prompt=a.per_prompt, nginx=a.nginx, out=a.out)
    run(cfg, shlex.join(["python", "bench/routing_bench.py", *argv]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
