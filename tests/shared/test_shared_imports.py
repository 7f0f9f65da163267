"""shared/ runs on the phone: every one of its modules imports without loading torch or transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
MODULES = ["shared"] + sorted(f"shared.{p.stem}" for p in SHARED.glob("*.py") if p.stem != "__init__")


def heavy_modules_after_importing(modules: list[str]) -> list[str]:
    """Import ``modules`` in a fresh interpreter; which of torch / transformers did that load?"""
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "print(','.join(sorted({k.split('.')[0] for k in sys.modules} & {'torch', 'transformers'})))\n")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return [m for m in r.stdout.strip().split(",") if m]


def test_shared_imports_without_torch():
    assert {"shared.protocol", "shared.codecs", "shared.manifest"} <= set(MODULES)
    assert heavy_modules_after_importing(MODULES) == []


def test_the_check_sees_a_torch_import():
    # a shared module that pulled torch in (directly or through a dependency) must be caught
    assert heavy_modules_after_importing(["shared.protocol", "torch"]) == ["torch"]
