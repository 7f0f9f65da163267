"""``bench/chaos_soak.py``, short: four phones against a real ``autoglm-cloud serve`` behind the rig's link emulator
for 30 s of random cuts (mid handshake, mid prompt upload, mid decode), delay spikes and half-closes; every request
ends with the tokens of its undisturbed run (greedy, seeded sampling, speculation; some cancelled midway), no error,
nothing in the server's log, and nothing held once the phones are gone. Slow-marked: a server start and 30 s of
faults at random moments (seeded, but the moments a cut lands on depend on the host's timing); the command in the
bench's docstring runs it for minutes, with ``--workers 2`` too."""

from __future__ import annotations

import bench_support
import pytest


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_short_chaos_soak_loses_no_token(tiny_bundle, tmp_path, workers):
    soak = bench_support.load_bench("chaos_soak")
    cfg = soak.SoakConfig(bundle=tiny_bundle, workers=workers, duration_s=30.0, control_s=5.0, concurrency=4,
                          pool=10, seed=3, log_dir=tmp_path)
    r = soak.soak(cfg, progress=lambda _: None)
    chaos = r["phases"]["chaos"]
    assert chaos["generations"] >= 20 and r["link"]["cuts"] >= 10 and chaos["reconnects"] >= 5, r
    assert r["wrong"] == [] and r["hung"] == [], r["wrong"] or r["hung"]
    assert r["server_log_problems"] == []
    assert all(v == 0 for v in r["gauges_after"].values()), r["gauges_after"]
    assert r["ok"]
