"""Real processes for the deployment tests: `autoglm-cloud serve` replicas and an nginx in front of them.

nginx is Debian's, installed by scripts/install_nginx.sh when it is missing (the test fails, never skips, if
that does not work: the routing config is part of what ships)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="session")
def nginx_bin() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if found:
        return found
    r = subprocess.run(["bash", str(ROOT / "scripts" / "install_nginx.sh")], capture_output=True, text=True,
                       timeout=600, check=False)
    if r.returncode != 0:
        pytest.fail(f"scripts/install_nginx.sh failed ({r.returncode}): {r.stderr[-2000:]}")
    return r.stdout.strip().splitlines()[-1]


class Router:
    """nginx with deploy/nginx/autoglm-split.conf, its upstream being ``replicas`` (host:port strings)."""

    def __init__(self, nginx: str, workdir: Path, upstreams: list[str]):
        self.nginx, self.dir, self.port = nginx, workdir, free_port()
        for sub in ("conf", "logs", "tmp"):
            (workdir / sub).mkdir(parents=True, exist_ok=True)
        (workdir / "conf" / "autoglm-upstreams.conf").write_text(
            "".join(f"server {u} max_fails=1 fail_timeout=30s;\n" for u in upstreams))
        split_conf = (DEPLOY / "nginx" / "autoglm-split.conf").read_text().replace("listen 8080;",
                                                                                   f"listen 127.0.0.1:{self.port};")
        (workdir / "conf" / "autoglm-split.conf").write_text(split_conf)
        t = workdir / "tmp"
        (workdir / "conf" / "nginx.conf").write_text(f"""
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
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if http_get(f"http://127.0.0.1:{self.port}/router/health")[0] == 200:
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("nginx did not start")

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGQUIT)  # graceful: finish the log lines
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/split"

    def access_log(self) -> list[str]:
        path = self.dir / "logs" / "access.log"
        return path.read_text().splitlines() if path.exists() else []
