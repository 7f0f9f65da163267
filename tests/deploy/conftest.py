"""Fixtures for the deployment tests. nginx is Debian's, installed by scripts/install_nginx.sh when it is
missing (the tests fail, never skip, if that does not work: the routing config is part of what ships)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# deploy_support.py (the test helpers) imports as a top-level module under any pytest import mode.
sys.path.insert(0, str(Path(__file__).parent))

from deploy_support import ROOT  # noqa: E402


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
