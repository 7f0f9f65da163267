"""shared/ runs on the phone: it must import with numpy, msgpack and zstandard only (no torch)."""

from __future__ import annotations

import subprocess
import sys

MODULES = ["shared.protocol", "shared.codecs", "shared.compression", "shared.precision", "shared.chunking",
           "shared.session_state"]


def test_shared_imports_without_torch():
    code = ("import sys\n"
            "for name in ('torch', 'transformers'):\n"
            "    sys.modules[name] = None  # any import of these raises ImportError\n"
            + "".join(f"import {m}\n" for m in MODULES) +
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
