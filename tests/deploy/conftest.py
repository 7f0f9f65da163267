"""Fixtures for the deployment tests. nginx is Debian's, installed by scripts/install_nginx.sh when it is
missing (the tests fail, never skip, if that does not work: the routing config is part of what ships)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# deploy_support.py (the test helpers) imports as a top-level module under any pytest import mode.
sys.path.insert(0, str(Path(__file__).parent))

from deploy_support import ROOT, Replica, metric_sum  # noqa: E402


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


class ReplicaPool:
    """`autoglm-cloud serve` processes of one bundle, shared by the deploy tests (a replica starts in seconds
    only on an idle machine): started on first use, a killed one replaced on the next ``get``, all stopped when
    the last deploy test is done (``pytest_runtest_teardown`` below)."""

    def __init__(self, bundle: Path, logs: Path):
        self.bundle, self.logs, self.reps, self.started = bundle, logs, [], 0

    def get(self, n: int) -> list[Replica]:
        """``n`` live, idle replicas (no session open, no request running)."""
        self.reps = [r for r in self.reps if r.proc.poll() is None]
        new = []
        while len(self.reps) + len(new) < n:
            new.append(Replica(self.bundle, self.logs / f"replica{self.started}.log"))
            self.started += 1
        self.reps += [r.wait_ready() for r in new]  # all started before the first wait: they load side by side
        for r in self.reps[:n]:
            _wait_idle(r)
        return self.reps[:n]

    def close(self) -> None:
        for r in self.reps:
            if r.proc.poll() is None:
                r.stop()
            else:
                r.kill()  # already gone: reaps it and closes its log
        self.reps = []


def _wait_idle(rep: Replica, within_s: float = 60.0) -> None:
    """Until ``rep`` holds no session and runs no request (a previous test's closed sessions are gone)."""
    deadline = time.monotonic() + within_s
    while True:
        text = rep.metrics()
        busy = metric_sum(text, "autoglm:sessions_open") + metric_sum(text, "vllm:num_requests_running")
        if not busy:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"replica on {rep.port} still busy after {within_s:.0f} s: {busy}")
        time.sleep(0.1)


_pools: list[ReplicaPool] = []


@pytest.fixture(scope="session")
def replica_pool(tiny_glm4_fp32_bundle, tmp_path_factory) -> ReplicaPool:
    """Replicas of the shared tiny-glm4 fp32 bundle, for every deploy test module."""
    pool = ReplicaPool(tiny_glm4_fp32_bundle, tmp_path_factory.mktemp("replicas"))
    _pools.append(pool)
    yield pool
    pool.close()


def pytest_runtest_teardown(item, nextitem):
    """Stop the shared replicas once the next test is not a deploy test (they would idle through the rest of the
    session otherwise)."""
    here = Path(__file__).parent
    if nextitem is None or here not in Path(nextitem.path).parents:
        while _pools:
            _pools.pop().close()
