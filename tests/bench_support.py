"""Load a script of ``bench/`` as a module, the way ``python bench/<name>.py`` sees the world.

``bench/`` is not a package: its scripts run from the command line, where Python puts their folder first on
``sys.path`` (so one script can import another, e.g. ``results_io``). Tests that drive a benchmark's small
version load it here, under the same rule.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str):
    """``bench/<name>.py`` as the module ``name`` (registered in ``sys.modules``, loaded once)."""
    if name in sys.modules:
        return sys.modules[name]
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
