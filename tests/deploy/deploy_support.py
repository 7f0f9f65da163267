"""Test support for deploy/: the replica and nginx helpers of ``bench/routing_bench.py`` (one copy of the code
that starts `autoglm-cloud serve` replicas as real processes and nginx in front of them)."""

from __future__ import annotations

from pathlib import Path

from bench_support import load_bench

ROOT = Path(__file__).resolve().parents[2]

routing_bench = load_bench("routing_bench")
DEPLOY = routing_bench.DEPLOY
Replica = routing_bench.Replica
Router = routing_bench.Router
http_get = routing_bench.http_get
hit_rate = routing_bench.hit_rate
metric_sum = routing_bench.metric_sum
