"""Test support for deploy/: the replica and nginx helpers of ``bench/routing_bench.py`` (one copy of the code
that starts `autoglm-cloud serve` replicas as real processes and nginx in front of them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


routing_bench = _load_bench("routing_bench")
DEPLOY = routing_bench.DEPLOY
Replica = routing_bench.Replica
Router = routing_bench.Router
http_get = routing_bench.http_get
hit_rate = routing_bench.hit_rate
metric_sum = routing_bench.metric_sum
