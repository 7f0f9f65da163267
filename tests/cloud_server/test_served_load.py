"""``bench/served_load.py``: simulated edges over real WebSockets against a real ``autoglm-cloud serve``.

The bench spawns the server and its worker processes itself; these tests run it on the tiny bundle (and the
random-weight launcher on the tiny preset) and check that every session completes with exactly the tokens it
asked for, that the figures it reports are consistent, and that a short or failed session is reported as a
failure rather than averaged in."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from bench_support import load_bench

from shared.codecs import get_codec
from shared.manifest import Manifest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    return load_bench(name)


served_load = _load("served_load")
random_weight_server = _load("random_weight_server")


def test_four_sessions_against_a_real_server(tiny_bundle, tmp_path):
    out = tmp_path / "served.json"
    rc = served_load.main(["--serve", str(tiny_bundle), "--sessions", "4", "--prompt", "40", "--gen", "9",
                           "--procs", "2", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    (rec,) = res["records"]
    assert rec["sessions"] == 4 and rec["completed"] == 4 and rec["errors"] == []
    assert rec["tokens"] == 4 * 9  # every session got exactly --gen tokens, indices in order, finish "length"
    assert rec["procs"] == 2
    assert rec["codec"] == "int8-outlier"  # the tiny bundle is calibrated: the realistic codec was negotiated
    assert rec["step_codec"] == "fp16"  # decode steps as the default EdgeClient sends them (--step-codec policy)
    assert rec["served_tokens_per_s_overall"] > 0
    # the steady window: every session decoding at once; on a loaded host one can finish before another's first token
    assert (rec["served_tokens_per_s"] or 1) > 0 and (rec["served_tokens_per_s"] is None) == (rec["steady_window_s"] <= 0)
    assert 0 < rec["itl_p50_ms"] <= rec["itl_p99_ms"]
    assert 0 < rec["ttft_p50_ms"] <= rec["ttft_p99_ms"]
    assert rec["engine_tokens_per_s"] is None and rec["direct_tokens_per_s"] is None  # no --engine-json given
    assert rec["server_cpu_s"] > 0
    # the engine's view of the edges' round trips: one per decode step sent (8 per session), never below the
    # simulated phone's own share of it
    assert rec["round_trip_count"] == 4 * 8 and rec["loop"] == "auto"
    assert 0 < rec["client_ms_per_token"] <= rec["round_trip_mean_ms"]
    assert 0 < rec["round_trip_p50_ms"] <= rec["round_trip_p99_ms"]
    # 40 prompt rows at ~1 byte per element plus 8 decode steps: the uplink is int8-sized, not float32-sized
    h = Manifest.load(tiny_bundle).hidden_size
    assert 40 * h < rec["uplink_bytes_per_session"] < 2 * 48 * h + 2048
    assert res["server"]["bundle_id"] == Manifest.load(tiny_bundle).bundle_id


def test_step_codec_choices_follow_the_client_policy():
    offered = ["int8-outlier", "int8-b32", "fp16"]
    assert served_load.decode_codec("policy", "int8-outlier", offered) == "fp16"
    assert served_load.decode_codec("policy", "int8-outlier", ["int8-outlier"]) == "int8-outlier"  # no fp16 offered
    assert served_load.decode_codec("policy", "int4-outlier", offered + ["int4-outlier"]) == "int4-outlier"  # compact
    assert served_load.decode_codec("same", "int8-outlier", offered) == "int8-outlier"
    assert served_load.decode_codec("int8-b32", "int8-outlier", offered) == "int8-b32"
    with pytest.raises(RuntimeError, match="not accepted"):
        served_load.decode_codec("bf16", "int8-outlier", offered)
    with pytest.raises(SystemExit):
        served_load.parse_args(["--preset", "tiny-glm4", "--step-codec", "zip"])


@pytest.mark.slow  # two servers' sweeps; the default suite keeps test_four_sessions_against_a_real_server
def test_workers_sweep_measures_one_server_per_front_end_count(tiny_bundle, tmp_path):
    out = tmp_path / "served.json"
    rc = served_load.main(["--serve", str(tiny_bundle), "--sessions", "3", "--prompt", "20", "--gen", "6",
                           "--procs", "1", "--workers", "1,2", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["workers"] for r in res["records"]] == [1, 2] and len(res["servers"]) == 2
    assert "--workers 2" in res["servers"][1]["command"] and "--workers" not in res["servers"][0]["command"]
    for rec in res["records"]:
        assert rec["completed"] == 3 and rec["tokens"] == 3 * 6
        assert 0 <= rec["server_loop_cpu_s"] <= rec["server_cpu_s"]  # the loops: the workers' main threads
    with pytest.raises(ValueError, match="--workers"):
        served_load.LoadConfig(url="ws://127.0.0.1:1/v1/split", bundle=Path("b"), workers=(2,))


def test_random_weight_server_serves_a_stub_bundle(tmp_path):
    out = tmp_path / "served.json"
    rc = served_load.main(["--preset", "tiny-glm4", "--layer", "2", "--sessions", "2", "--prompt", "17",
                           "--gen", "5", "--procs", "1", "--out", str(out)])
    assert rc == 0
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["completed"] == 2 and rec["tokens"] == 10


def test_stub_bundle_is_a_valid_manifest_with_a_matching_calibration(tmp_path):
    m = random_weight_server.write_stub_bundle(tmp_path / "stub", "glm4v-9b-random", 12)
    loaded = Manifest.load(tmp_path / "stub")  # the bundle id check passes
    assert loaded.bundle_id == m.bundle_id and loaded.hidden_size == 4096 and loaded.split_layer == 12
    calib = json.loads((tmp_path / "stub" / "calibration.json").read_text())
    assert len(calib["channel_absmax"]) == 4096 and len(calib["outlier_channels"]) == 8
    with pytest.raises(ValueError, match="--layer"):
        random_weight_server.write_stub_bundle(tmp_path / "bad", "glm4v-9b-random", 40)


def test_synthetic_states_have_a_sink_row_the_outlier_codec_keeps_in_float16():
    calib = random_weight_server.synthetic_calibration(256, 4, seed=1)
    x = served_load.boundary_states(20, 256, calib, np.random.default_rng(0), sink_first=True)  # [20, 256]
    codec = get_codec("int8-outlier", outlier_channels=calib["outlier_channels"],
                      sink_threshold=calib["sink_threshold"])
    bitmap = codec.encode(x).data[0]
    assert bitmap == 0b1  # row 0 only: a sink; the other rows are int8-coded
    big = np.abs(x[1:]).max(axis=0)  # outlier channels carry the large values, as in a real boundary
    assert big[calib["outlier_channels"]].mean() > 5 * np.median(big)
    assert np.abs(codec.decode(codec.encode(x)) - x).max() < 0.05 * np.abs(x).max()


def _session(index, n, gen, error=None, finish="length"):
    times = [1.0 + 0.01 * (k + 1) + 0.001 * index for k in range(n)]
    return {"index": index, "start": 1.0, "token_times": times, "finish": finish,
            "completion_tokens": n, "error": error, "up_bytes": 100, "client_s": 0.0001 * max(0, n - 1)}


def test_summary_counts_the_steady_window_and_reports_short_sessions_as_failures():
    cfg = served_load.LoadConfig(url="ws://x/v1/split", bundle=Path("."), sessions=(3,), prompt=8, gen=10)
    good = served_load.summarize(2, [_session(0, 10, 10), _session(1, 10, 10)], cfg)
    assert good["completed"] == 2 and good["errors"] == []
    assert good["itl_p50_ms"] == pytest.approx(10.0)
    # steady window: from the last first token (1.011) to the first last token (1.100); 2 sessions at 100 tok/s
    assert good["served_tokens_per_s"] == pytest.approx(200.0, rel=0.05)
    assert good["client_ms_per_token"] == pytest.approx(0.1)  # the phones' own time per decode step
    bad = served_load.summarize(3, [_session(0, 10, 10), _session(1, 7, 10, finish="stop"),
                                    _session(2, 3, 10, error="RuntimeError: server error internal")], cfg)
    assert bad["completed"] == 1 and len(bad["errors"]) == 2
    assert "RuntimeError" in bad["errors"][1]


@pytest.mark.slow  # two servers' sweeps; the default suite keeps test_four_sessions_against_a_real_server
def test_compare_root_measures_both_trees_and_engine_cpu_fills_the_ratio(tiny_bundle, tmp_path):
    out = tmp_path / "served.json"
    root = BENCH.parent
    rc = served_load.main(["--serve", str(tiny_bundle), "--sessions", "2", "--prompt", "20", "--gen", "6",
                           "--procs", "1", "--compare-root", str(root), "--engine-cpu", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["tree"] for r in res["records"]] == [str(root), str(root)] and len(res["servers"]) == 2
    (eng,) = res["engine_cpu"]  # one per tree, imported from that checkout (here both trees are the same one)
    assert eng["tree"] == str(root) and eng["sessions"] == 2 and eng["completed"] == 2
    assert eng["engine_tokens_per_s"] > 0
    for rec in res["records"]:
        assert rec["completed"] == 2 and rec["engine_tokens_per_s"] == eng["engine_tokens_per_s"]
        assert rec["served_vs_engine"] == pytest.approx(rec["served_tokens_per_s"] / eng["engine_tokens_per_s"])
        assert 0 <= rec["server_loop_cpu_s"] <= rec["server_cpu_s"]  # the loop thread is part of the process
        assert rec["loop_us_per_token"] == pytest.approx(1e6 * rec["server_loop_cpu_s"] / rec["tokens"])


def test_config_refuses_ambiguous_servers():
    with pytest.raises(ValueError, match="exactly one"):
        served_load.LoadConfig(serve=Path("b"), preset="tiny-glm4")
    with pytest.raises(ValueError, match="--bundle"):
        served_load.LoadConfig(url="ws://127.0.0.1:1/v1/split")
    served_load.LoadConfig(preset="tiny-glm4", engine_cpu=True)  # the engine alone: the preset's random weights
    with pytest.raises(ValueError, match="--compare-root"):
        served_load.LoadConfig(url="ws://127.0.0.1:1/v1/split", bundle=Path("b"), compare_root=Path("/tmp"))


def test_recorded_states_are_used_and_checked(tmp_path):
    h = 64
    rec = np.random.default_rng(2).standard_normal((30, h), dtype=np.float32)  # [30, H]
    np.save(tmp_path / "states.npy", rec)
    welcome = served_load.P.Welcome(session_id="s", resume_token="t")
    spec = {"calibration": None, "seed": 0, "hidden": h, "prompt": 40, "gen": 4, "states": str(tmp_path / "states.npy")}
    inputs = served_load.edge_inputs(spec, welcome, "fp16")
    codec = get_codec("fp16")
    prompt = np.concatenate([codec.decode(m.hidden) for m in inputs.prompts[0]])  # [40, H]: 30 rows, repeated
    assert prompt.shape == (40, h) and np.allclose(prompt[:30], rec, atol=1e-2)
    np.save(tmp_path / "wide.npy", np.zeros((5, h + 1), np.float32))
    with pytest.raises(ValueError, match=r"\[N, 64\]"):
        served_load.edge_inputs(spec | {"states": str(tmp_path / "wide.npy")}, welcome, "fp16")


def test_round_trip_figures_are_the_levels_increase_of_the_histogram():
    before = {0.001: 10.0, 0.002: 10.0, 0.004: 10.0, float("inf"): 10.0, -1.0: 0.005}
    # the level adds 100 round trips: 50 under 1 ms, 40 in (1, 2] ms, 10 in (2, 4] ms; 0.15 s in all
    after = {0.001: 60.0, 0.002: 100.0, 0.004: 110.0, float("inf"): 110.0, -1.0: 0.155}
    got = served_load.round_trip_figures(before, after)
    assert got["round_trip_count"] == 100 and got["round_trip_mean_ms"] == pytest.approx(1.5)
    assert got["round_trip_p50_ms"] == pytest.approx(1.0)  # the 50th of 100 sits at the first bucket's bound
    assert 2.0 < got["round_trip_p99_ms"] <= 4.0
    assert served_load.round_trip_figures(None, after) == {} and served_load.round_trip_figures(before, before) == {}


def test_engine_time_figures_split_each_step_into_its_time_and_its_wait_for_inputs():
    """The exposition's histograms (two processes' samples of one series add up) -> the level's increase: per step
    the mean time stepping and waiting for inputs, and the busy share."""
    def text(steps: float, step_sum: float, wait_sum: float) -> str:
        lines = []
        for name, total in (("autoglm:engine_step_seconds", step_sum), ("autoglm:engine_input_wait_seconds", wait_sum)):
            lines += [f'# TYPE {name} histogram', f'{name}_bucket{{le="0.004",model_name="m"}} {steps / 2}',
                      f'{name}_bucket{{le="+Inf",model_name="m"}} {steps}', f'{name}_count{{model_name="m"}} {steps}',
                      f'{name}_sum{{model_name="m"}} {total}', f'{name}_created{{model_name="m"}} 1.7e9']
        name = "autoglm:engine_device_step_seconds"  # the device: 0.25 ms buckets
        lines += [f'{name}_bucket{{le="0.0045",model_name="m"}} 0', f'{name}_bucket{{le="0.00475",model_name="m"}} {steps / 2}',
                  f'{name}_bucket{{le="+Inf",model_name="m"}} {steps}', f'{name}_sum{{model_name="m"}} {steps * 0.0047}']
        lines.append('autoglm:edge_round_trip_seconds_bucket{le="+Inf",model_name="m"} 3.0')
        lines.append('autoglm:edge_round_trip_seconds_sum{model_name="m"} 0.01')
        lines.append('vllm:inter_token_latency_seconds_sum{model_name="m"} 9.0')
        lines.append(f'autoglm:engine_forward_passes_total{{batch="persistent",model_name="m"}} {steps * 3 / 4}')
        lines.append(f'autoglm:engine_forward_passes_total{{batch="rebuilt",model_name="m"}} {steps / 4}')
        return "\n".join(lines)
    before = served_load.parse_histograms(text(10, 0.05, 0.02))
    assert set(before) == {*served_load.SCRAPED, served_load.PASSES} and before[served_load.SCRAPED[0]][-1.0] == pytest.approx(0.01)
    after = served_load.parse_histograms(text(110, 0.55, 0.42))  # 100 steps: 5 ms each, 4 ms waiting before each
    got = served_load.engine_time_figures(before, after)
    assert got["engine_steps"] == 100
    assert got["engine_step_ms"] == pytest.approx(5.0) and got["engine_wait_ms"] == pytest.approx(4.0)
    assert got["engine_busy_fraction"] == pytest.approx(5 / 9)
    assert got["engine_step_p50_ms"] == pytest.approx(4.0)  # half the steps at or under the 4 ms bound
    assert got["engine_rebuilt_fraction"] == pytest.approx(0.25)
    assert got["engine_device_p50_ms"] == pytest.approx(4.75)  # the device's median, beside the step's
    assert served_load.engine_time_figures({}, after) == {} and served_load.engine_time_figures(after, after) == {}


def test_profile_summary_names_the_workers_threads_and_counts_uvloops_wait_as_idle(tmp_path):
    server = 'process 10:"python -m cloud_server.cli serve b --workers 2"'
    worker = 'process 11:"python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=4) --fork"'
    raw = tmp_path / "spy.txt"
    raw.write_text("\n".join([
        f"{server};thread (10): autoglm-engine;AsyncEngine._loop (cloud_server/engine/async_engine.py:1);"
        "Linear.forward (torch/nn/modules/linear.py:1) 20",
        f"{server};{worker};thread (11): MainThread;worker_main (cloud_server/front_workers.py:1);"
        "Runner.run (asyncio/runners.py:118) 30",  # uvloop idles in C under Runner.run
        f"{server};{worker};thread (11): MainThread;Runner.run (asyncio/runners.py:118);"
        "decode_message (shared/wire.py:1) 10",
    ]) + "\n")
    got = served_load.profile_summary(raw, 10)
    assert got["autoglm-engine"] == {"model forward": 2.0}
    assert got["front-end workers / MainThread"] == {"idle: event loop waiting": 3.0,
                                                     "msgpack decode + validation": 1.0}


def test_the_stack_floor_bench_echoes_every_message_and_counts_the_loops_cpu(tmp_path):
    """``bench/ws_floor.py``: lockstep clients against an echo server on the served stack (uvicorn and the
    server's own WebSocket protocol class); every message pair is answered and the per-pair CPU is positive."""
    ws_floor = _load("ws_floor")
    out = tmp_path / "floor.json"
    assert ws_floor.main(["--sessions", "3", "--messages", "30", "--procs", "2", "--json", str(out)]) == 0
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["sessions"] == 3 and rec["procs"] == 2 and rec["messages_per_session"] == 30
    assert 0 < rec["loop_us_per_message_pair"] < 1e5 and rec["pairs_per_s"] > 0
    assert 0 < rec["round_trip_p50_ms"] <= rec["round_trip_p99_ms"]
