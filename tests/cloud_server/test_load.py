"""``bench/load_bench.py``: concurrent split sessions on CPU with the tiny model, every session's tokens equal to
its tokens alone, no errors, the pool empty afterwards. 16 sessions in the default suite (one in-process server);
the 256-session run against a real ``autoglm-cloud serve`` process is slow-marked (and is the bench command)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import bench_support
from cloud_support import ServerThread

from cloud_server.app import create_app
from cloud_server.config import EngineConfig, ServerConfig
from cloud_server.runtime import CloudRuntime

@pytest.fixture(scope="module")
def load_bench():
    return bench_support.load_bench("load_bench")


def test_sixteen_concurrent_sessions_equal_their_single_session_output(load_bench, tiny_bundle):
    engine = EngineConfig(num_blocks=256, block_size=4, variants=("fp32",), max_num_seqs=16)
    rt = CloudRuntime(ServerConfig(bundle=tiny_bundle, engine=engine)).start()
    try:
        with ServerThread(create_app(rt)) as srv:
            result = load_bench.run_load(srv.ws_url, tiny_bundle, load_bench.LoadSpec(sessions=16, gen_tokens=6))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # closes and aborts are asynchronous
                used = rt.engine.call(lambda e: (len(e.seqs), e.num_used_blocks())).result(10)
                if used == (0, 0):
                    break
                time.sleep(0.05)
    finally:
        rt.stop()
    assert result["errors"] == 0, result["first_errors"]
    assert result["mismatches"] == 0 and result["all_full_length"] and result["tokens_concurrent"] == 16 * 6
    assert used == (0, 0)  # every session's KV went back to the pool


def test_a_changed_input_changes_the_output(load_bench, tiny_bundle):
    """The equality above can fail: another seed (other boundary states) gives other tokens."""
    engine = EngineConfig(num_blocks=64, block_size=4, variants=("fp32",))
    rt = CloudRuntime(ServerConfig(bundle=tiny_bundle, engine=engine)).start()
    try:
        with ServerThread(create_app(rt)) as srv:
            from shared.manifest import Manifest

            m = Manifest.load(tiny_bundle)
            runs = [asyncio.run(load_bench.one_session(srv.ws_url, m.bundle_id, m.hidden_size,
                                                       load_bench.LoadSpec(seed=s, gen_tokens=6), 0)) for s in (0, 0, 1)]
    finally:
        rt.stop()
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.slow
def test_256_concurrent_sessions_against_a_served_process(load_bench, tiny_bundle, tmp_path):
    out = tmp_path / "load.json"
    assert load_bench.main(["--serve", str(tiny_bundle), "--sessions", "256", "--port", "8771",
                            "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["errors"] == 0 and result["mismatches"] == 0 and result["sessions"] == 256
    assert result["after_load"]["sessions_open"] == 0 and result["after_load"]["requests_running"] == 0
