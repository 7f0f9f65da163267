"""A small rig run end to end: a real split cloud server process, a burst of two phone processes each behind
its own emulated wifi link, the all-edge baseline in two more; the report, its summary rows and its plots."""

from __future__ import annotations

from cli_support import undocumented

import json
import os
import re
from pathlib import Path

import pytest

from rig.cli import write_report
from rig.report import format_table
from rig.runner import Progress, run_scenario
from rig.scenario import Scenario


def test_small_rig_run(tiny_glm4_fp32_bundle, tiny_whole, tmp_path, capsys):
    sc = Scenario.from_dict({
        "name": "tiny", "model": "tiny-glm4", "split_layer": 2, "edge_quant": "fp32", "profiles": ["wifi"],
        "modes": ["split", "all-edge"], "phones": 2, "edge_threads": 1,
        "workloads": [{"kind": "chat", "requests": 2, "max_tokens": 6}],
        # from the burst's start: counted from the link's, it fell in the phones' setup (or failed their connect)
        "disconnects": [{"at_s": 0.0, "down_s": 0.3}],
        # the split phones speculate (a scenario could not ask for it: the phones decoded one token per round trip)
        "speculate": True,
    })
    streamed = []
    stale = [tmp_path / "logs" / "phone-wifi-chat-split-0.log", tmp_path / "logs" / "cloud-split-wifi.log"]
    for f in stale:  # an earlier run's logs in the same --out: the processes append, so its lines mixed in
        f.parent.mkdir(exist_ok=True)
        f.write_text("a line of an earlier run\n")
    report = run_scenario(sc, tmp_path, Progress(), on_delta=streamed.append, bundle=tiny_glm4_fp32_bundle,
                          whole=tiny_whole)
    assert all("an earlier run" not in f.read_text() for f in stale)
    key = lambda r: (r["phone"], r["label"])  # noqa: E731
    recs = {m: sorted((r for r in report["records"] if r["mode"] == m), key=key) for m in ("split", "all-edge")}
    assert [len(v) for v in recs.values()] == [4, 4]
    assert {r["label"] for r in recs["split"] if r["phone"] == 1} == {"chat/1", "chat/2"}  # phone 1 starts at 1
    # fp32 edge, fp32 cloud half, fp32 whole model: the split's greedy tokens are the whole model's, speculating too
    for a, b in zip(recs["split"], recs["all-edge"]):
        assert key(a) == key(b) and a["token_ids"] == b["token_ids"] and len(a["token_ids"]) > 0
    assert sum(r["draft_tokens"] for r in recs["split"]) > 0
    split = next(r for r in recs["split"] if r["phone"] == 0 and r["label"] == "chat/0")
    assert split["ttft_s"] >= 0.020  # at least the wifi RTT (20 ms) went by before the first token
    assert split["bytes_up"] > split["prompt_tokens"] * 64 and split["bytes_down"] > 0
    assert all(r["bytes_up"] == 0 and r["bytes_down"] == 0 for r in recs["all-edge"])
    assert "".join(streamed) == split["text"]  # the first answer streamed as it came
    rows = {r["mode"]: r for r in report["summary"]}
    assert set(rows) == {"split", "all-edge"} and rows["split"]["requests"] == 4
    assert rows["split"]["ttft_ms_p50"] > rows["all-edge"]["ttft_ms_p50"]  # loopback compute vs a link
    # the progress line's p50 is the table's (it took the upper middle of an even count)
    assert f"[wifi/chat/split] 4 requests, TTFT p50 {rows['split']['ttft_ms_p50']:.0f} ms" in capsys.readouterr().err
    link = report["links"][0]
    # the link reads at least what the phones counted, less what a cut lost in flight (sent, counted by the phone,
    # never read by the link: at most about one request's upload per cut; a double count would be far over)
    lost = link["cuts"] * max(r["bytes_up"] for r in recs["split"])
    assert link["bytes_up"] >= sum(r["bytes_up"] for r in recs["split"]) - lost
    assert link["cuts"] == 2 and link["connections"] > 2  # each phone's link was cut once, and it reconnected
    assert min(r["total_s"] for r in recs["split"] if r["label"] == f"chat/{r['phone']}") >= 0.3  # (down 0.3 s)
    files = write_report(report, tmp_path / "out")
    assert json.loads(files[0].read_text())["summary"] == report["summary"]
    assert [f.name for f in files[1:]] == ["rig_chat.png"] and files[1].stat().st_size > 10_000
    print(format_table(report["summary"]))
    assert "split" in capsys.readouterr().out


@pytest.mark.slow
def test_plan_check_calibrates_on_loopback_and_predicts(tiny_glm4_fp32_bundle, tiny_whole, tmp_path):
    from rig.plan_check import check_plan, format_check

    sc = Scenario.from_dict({
        "name": "tiny-plan", "model": "tiny-glm4", "split_layer": 2, "edge_quant": "fp32", "profiles": ["4g"],
        "modes": ["split", "all-edge"], "plan_check": True, "edge_threads": 1,
        "workloads": [{"kind": "chat", "requests": 2, "max_tokens": 6}],
    })
    report = run_scenario(sc, tmp_path, Progress(), bundle=tiny_glm4_fp32_bundle, whole=tiny_whole)
    assert {r["profile"] for r in report["records"]} == {"loopback", "4g"}  # the calibration run came first
    check = check_plan(report, sc, tiny_glm4_fp32_bundle, tiny_whole)
    rows = {(r["profile"], r["mode"]): r for r in check["rows"]}
    assert set(rows) == {("4g", "split"), ("4g", "all-edge")} and "chat/split" in check["calibration_ms"]
    split = rows[("4g", "split")]
    # the link dominates a tiny model's step: the planner's link model must land near the measurement
    assert split["per_token_ms_predicted"] > 60 and abs(split["per_token_error"]) < 0.5
    assert abs(split["ttft_error"]) < 0.5
    assert "planner vs rig" in format_check(check)


def _scenario_file(tmp_path, bundle, **extra) -> str:
    data = {"name": "bad", "model": "tiny-glm4", "split_layer": 2, "bundle": bundle and str(bundle),
            "profiles": ["wifi"], "modes": ["split"], "workloads": [{"kind": "chat", "requests": 1, "max_tokens": 2}],
            **extra}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_cloud_server_that_fails_to_start_is_exit_1_with_its_log(tiny_glm4_fp32_bundle, tmp_path, capsys):
    from rig.cli import main

    path = _scenario_file(tmp_path, tiny_glm4_fp32_bundle, cloud_args=["--no-such-flag"])
    out = tmp_path / "out"
    stale = [out / "report.json", out / "rig_chat.png"]  # an earlier, successful run's, in the same --out: they
    for f in stale:  # stayed beside this run's fresh logs, a report.json of success after a run that failed
        f.parent.mkdir(exist_ok=True)
        f.write_text("{}")
    assert main(["run", path, "--out", str(out), "--no-plots"]) == 1  # was a RuntimeError traceback
    err = capsys.readouterr().err
    assert "split cloud server" in err and "cloud-split-wifi.log" in err
    assert not any(f.exists() for f in stale)


@pytest.mark.parametrize("extra, match", [
    ({"model": "tiny-glm5"}, "model: tiny-glm5: no such preset"),  # was a ModelLoadError traceback
    ({"split_layer": 9}, r"split_layer 9.*between 1 and 3"),  # was a BundleError traceback
    # the full server of a random preset has no tokenizer: the run failed at its first all-cloud phone (exit 1)
    ({"modes": ["split", "all-cloud"]}, "all-cloud needs a model with a tokenizer"),
])
def test_a_model_the_run_cannot_use_is_exit_2_before_anything_starts(tmp_path, monkeypatch, capsys, extra, match):
    from rig.cli import main

    monkeypatch.setenv("AUTOGLM_CACHE", str(tmp_path / "cache"))
    data = {"name": "bad", "model": "tiny-glm4", "split_layer": 2, "profiles": ["wifi"], "modes": ["split"],
            "workloads": [{"kind": "chat", "requests": 1, "max_tokens": 2}], **extra}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoglm-rig run: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(match, err) and "starting" not in err


@pytest.mark.parametrize("extra, match", [
    ({"model": "tiny-glm4v"}, r"bundle .*: split from another model \(preset:tiny-glm4@seed0\), not model tiny-glm4v"),
    ({"split_layer": 1}, r"bundle .*: split at layer 2, not at split_layer 1"),
    ({"model": "tiny-glm4v", "modes": ["all-edge"]},
     r"whole .*: exported from another model \(preset:tiny-glm4@seed0\), not model tiny-glm4v"),
])
def test_a_bundle_or_export_of_another_model_is_exit_2_before_anything_starts(
        tiny_glm4_fp32_bundle, tiny_whole, tmp_path, monkeypatch, capsys, extra, match):
    """The scenario's bundle and whole were used as they were: the run measured another model's split (or
    another layer's) than the scenario, its report and the plan check named."""
    from rig.cli import main

    monkeypatch.setenv("AUTOGLM_CACHE", str(tmp_path / "cache"))
    path = _scenario_file(tmp_path, None if "modes" in extra else tiny_glm4_fp32_bundle, whole=str(tiny_whole),
                          **extra)
    assert main(["run", path, "--out", str(tmp_path / "out"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoglm-rig run: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(match, err) and "starting" not in err and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_output_path_that_cannot_be_written_is_exit_2_before_anything_starts(tiny_glm4_fp32_bundle, tmp_path,
                                                                                 capsys, where):
    from rig.cli import main

    blocker = tmp_path / "taken"
    blocker.write_text("not a directory")
    out = blocker if where == "a file" else blocker / "report"
    path = _scenario_file(tmp_path, tiny_glm4_fp32_bundle)
    assert main(["run", path, "--out", str(out)]) == 2  # was a FileExistsError / NotADirectoryError traceback
    err = capsys.readouterr().err
    assert "autoglm-rig run: error: --out" in err and "starting" not in err


def test_an_output_path_under_home_from_the_environment_is_the_home(tmp_path, monkeypatch):
    """AUTOGLM_RIG_OUT=~/reports (no shell expands a variable's ~) made a folder named '~' in the working directory."""
    from rig.cli import check_out_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert check_out_dir(Path("~/reports")) == tmp_path / "home" / "reports"
    assert (tmp_path / "home" / "reports" / "logs").is_dir() and not (tmp_path / "~").exists()

def test_the_operators_own_cloud_settings_do_not_reach_the_rigs_servers(tiny_glm4_fp32_bundle, tmp_path,
                                                                          monkeypatch):
    """An AUTOGLM_CLOUD_API_KEY (or keys file, TLS, closed probes) exported for the operator's own server locked the
    rig's keyless phones out; an AUTOGLM_CLOUD_BUNDLE beside the all-cloud server's --full stopped it."""
    import httpx

    from rig.servers import CloudProcess

    monkeypatch.setenv("AUTOGLM_CLOUD_API_KEY", "operators-key")
    monkeypatch.setenv("AUTOGLM_CLOUD_OPEN_PROBES", "false")
    monkeypatch.setenv("AUTOGLM_CLOUD_BUNDLE", str(tmp_path))
    with CloudProcess(bundle=tiny_glm4_fp32_bundle, log_path=tmp_path / "cloud.log",
                      extra_args=["--num-blocks", "16", "--block-size", "4"]) as cloud:
        assert httpx.get(f"http://127.0.0.1:{cloud.port}/v1/models", timeout=10).status_code == 200

def _children(pid: int) -> set[int]:
    try:
        return {int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()}
    except OSError:
        return set()


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _reap(rig, kids: set[int]) -> None:
    """Whatever a failed test left running: the rig, then the processes it started."""
    import signal

    if rig.poll() is None:
        rig.kill()
    for k in kids:
        if _alive(k):
            os.kill(k, signal.SIGKILL)


def _wait_for_a_running_request(kids: set[int], deadline: float) -> None:
    """Until the cloud server among ``kids`` (the rig's ``serve --port P``) runs a request: the phone connected and
    asked (a fixed sleep was too short on a loaded host, and a waste on a quiet one)."""
    import time

    import httpx

    argv = next(a for k in kids if "serve" in (a := open(f"/proc/{k}/cmdline").read().split("\0")))
    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}/metrics"
    while time.monotonic() < deadline:
        running = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", httpx.get(url, timeout=10).text, re.M)
        if running and float(running[1]) > 0:
            return
        time.sleep(0.05)
    raise AssertionError("the rig's phone never had a request running on its server")


def test_sigterm_stops_the_servers_and_phones_it_started(tiny_glm4_fp32_bundle, tmp_path):
    """SIGTERM (a CI cancel, `timeout`, systemd) cleans up as Ctrl-C does; it left the cloud server (its own
    session) and the phones running. A second one during the server's drain (an impatient Ctrl-C) left the server
    running, orphaned; and the interrupted run said only "interrupted", keeping nothing of what it had measured."""
    import signal
    import subprocess
    import sys
    import time

    path = _scenario_file(tmp_path, tiny_glm4_fp32_bundle,
                          workloads=[{"kind": "chat", "requests": 500, "max_tokens": 64}])
    out = tmp_path / "out"
    rig = subprocess.Popen([sys.executable, "-m", "rig.cli", "run", path, "--out", str(out), "--no-plots"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    kids: set[int] = set()
    try:
        deadline = time.monotonic() + 120  # (a busy host: the server's start takes a while)
        while not (out / "logs" / "phone-wifi-chat-split-0.log").exists() and time.monotonic() < deadline:
            kids |= _children(rig.pid)
            time.sleep(0.1)
        kids |= _children(rig.pid)
        assert len(kids) == 2, "the rig started no server and phone"
        _wait_for_a_running_request(kids, deadline)  # the server's drain then takes a while
        rig.send_signal(signal.SIGTERM)
        err = []
        while not any("stopping the cloud server" in line for line in err):
            err.append(rig.stderr.readline())
            assert err[-1], err
        rig.send_signal(signal.SIGTERM)  # the second one, during the drain
        assert rig.wait(30) == 130
        assert not [k for k in kids if _alive(k)]
        err = "".join(err) + rig.stderr.read()
        report = json.loads((out / "report.json").read_text())
        assert report["interrupted"] is True and report["records"] == [], err
        assert f"partial report (the 0 requests of the runs that finished): {out / 'report.json'}" in err
    finally:
        _reap(rig, kids)


def test_a_killed_rig_takes_its_cloud_server_with_it(tiny_glm4_fp32_bundle, tmp_path):
    """SIGKILL (the OOM killer, a CI runner's hard stop) leaves no chance to clean up: the cloud server, in its own
    session, served on, orphaned."""
    import subprocess
    import sys
    import time

    path = _scenario_file(tmp_path, tiny_glm4_fp32_bundle)
    rig = subprocess.Popen([sys.executable, "-m", "rig.cli", "run", path, "--out", str(tmp_path / "out"), "--no-plots"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kids: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while not (kids := _children(rig.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kids, "the rig started no server"
        rig.kill()
        rig.wait(10)
        deadline = time.monotonic() + 20
        while [k for k in kids if _alive(k)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [k for k in kids if _alive(k)]
    finally:
        _reap(rig, kids)


@pytest.mark.parametrize("value", ["0", "-3", "100000", "abc"])
def test_a_bad_demo_threads_is_a_usage_error_naming_the_flag(capsys, value):
    """--threads 0 was refused as "edge_threads 0", a key the demo's user never wrote."""
    from rig.cli import main

    with pytest.raises(SystemExit) as e:
        main(["demo", "--threads", value])
    assert e.value.code == 2
    assert f"argument --threads: expected an integer in [1, 256], got '{value}'" in capsys.readouterr().err


def test_every_subcommand_and_option_has_help_text():
    """run --help and demo --help had no description."""
    from rig.cli import build_parser

    assert undocumented(build_parser()) == []


def test_a_failed_run_keeps_the_runs_that_finished_before_it(tiny_glm4_fp32_bundle, tmp_path, monkeypatch, capsys):
    """A phone that failed in the second run (of two) threw the first run's records away with it: a long scenario
    failing near its end left nothing but logs."""
    import rig.runner
    from rig.cli import main
    from rig.runner import RigError

    real, calls = rig.runner.run_phones, []

    def second_fails(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RigError("[wifi/agent/split] phone 0: an injected failure")
        return real(*args, **kw)

    monkeypatch.setattr(rig.runner, "run_phones", second_fails)
    path = _scenario_file(tmp_path, tiny_glm4_fp32_bundle, workloads=[{"kind": "chat", "requests": 1, "max_tokens": 2},
                                                                      {"kind": "agent", "requests": 1, "max_tokens": 2}])
    out = tmp_path / "out"
    assert main(["run", path, "--out", str(out), "--no-plots"]) == 1
    err = capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["failed"] == "[wifi/agent/split] phone 0: an injected failure"
    assert [r["workload"] for r in report["records"]] == ["chat"]
    assert f"partial report (the 1 requests of the runs that finished): {out / 'report.json'}" in err


def test_a_split_phone_on_a_slow_uplink_gives_its_edge_client_the_links_rate(tiny_glm4_fp32_bundle, tmp_path,
                                                                             monkeypatch):
    """The rig's split phones gave their EdgeClient no link rate (EdgeConfig.link_kbps, as an app sets it from the
    platform's estimate of its uplink), so the precision policy's slow-link tier never ran in the rig: a bulk
    prompt over a 100 kbit/s uplink went up in the fast link's int8-outlier."""
    import rig.runner
    from rig.workloads import Request

    bulk = [Request([{"role": "user", "content": "Describe this. " * 45}], 2, "chat/bulk")]  # ~690 tokens x 64 x
    # 1.02 B: 3.5 s up at 100 kbit/s, over the policy's 1.5 s
    monkeypatch.setattr(rig.runner, "build", lambda kind, count, max_tokens, offset=0: bulk)
    sc = Scenario.from_dict({
        "name": "slow-up", "model": "tiny-glm4", "split_layer": 2, "edge_quant": "fp32", "modes": ["split"],
        "profiles": [{"name": "slow-up", "rtt_ms": 10, "down_mbps": 10, "up_mbps": 0.1}],
        "workloads": [{"kind": "chat", "requests": 1, "max_tokens": 2}],
    })
    report = run_scenario(sc, tmp_path, Progress(), bundle=tiny_glm4_fp32_bundle)
    [rec] = report["records"]
    assert rec["prompt_tokens"] > 600 and rec["codec"] == "int4-outlier"


def test_an_interrupt_during_the_plan_check_keeps_every_runs_records(tmp_path, monkeypatch, capsys):
    """Ctrl-C or SIGTERM while the planner's costs were measured, after every run had finished, exited 130 with no
    report.json: the whole run's records were lost (an interrupt during the runs keeps those that finished)."""
    import rig.plan_check
    import rig.runner
    from rig.cli import main

    records = [{"profile": "wifi", "workload": "chat", "mode": "split", "ttft_s": 0.1}]
    finished = {"scenario": {}, "bundle": str(tmp_path / "b"), "whole": None, "summary": [], "links": [],
                "records": records}

    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(rig.runner, "run_scenario", lambda *args, **kw: dict(finished))
    monkeypatch.setattr(rig.plan_check, "check_plan", interrupted)
    path = _scenario_file(tmp_path, None, plan_check=True)
    out = tmp_path / "out"
    assert main(["run", path, "--out", str(out), "--no-plots"]) == 130
    report = json.loads((out / "report.json").read_text())
    assert report["interrupted"] is True and report["records"] == records and "plan_check" not in report
    assert f"partial report (the 1 requests of the runs that finished): {out / 'report.json'}" in \
        capsys.readouterr().err


@pytest.mark.slow  # a real run (~90 s on two busy cores), then its plan check
def test_sigterm_during_the_plan_check_writes_the_finished_runs(tiny_glm4_fp32_bundle, tiny_whole, tmp_path):
    import signal
    import subprocess
    import sys

    path = _scenario_file(tmp_path, tiny_glm4_fp32_bundle, whole=str(tiny_whole), modes=["split", "all-edge"],
                          plan_check=True)
    out = tmp_path / "out"
    rig = subprocess.Popen([sys.executable, "-m", "rig.cli", "run", path, "--out", str(out), "--no-plots"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        err = []
        while not any("checking the planner's predictions" in line for line in err):
            err.append(rig.stderr.readline())
            assert err[-1], err
        rig.send_signal(signal.SIGTERM)
        assert rig.wait(60) == 130
        err = "".join(err) + rig.stderr.read()
        report = json.loads((out / "report.json").read_text())
        assert report["interrupted"] is True, err
        assert {(r["profile"], r["mode"]) for r in report["records"]} == \
            {("loopback", "split"), ("wifi", "split"), ("loopback", "all-edge"), ("wifi", "all-edge")}
    finally:
        if rig.poll() is None:
            rig.kill()
            rig.wait()


_FAKE_PHONE = """
import json, sys, time
sys.stdin.readline()  # the job
print(json.dumps({"event": "ready"}), flush=True)
sys.stdin.readline()  # go
for gap in GAPS:
    time.sleep(gap)
    print(json.dumps({"event": "request", "ttft_s": 0.1, "tokens_per_s": 9.0, "completion_tokens": 3}), flush=True)
"""


@pytest.mark.parametrize("gaps, hung", [([0.4] * 6, False), ([0.2, 2.5], True)])
def test_a_run_lasts_as_long_as_its_phones_report_and_a_silent_one_is_hung(tmp_path, monkeypatch, gaps, hung):
    """run_phones stopped every run 1,800 s after it began, phones reporting or not (a long agent scenario on a
    slow profile failed 'did not finish'); the limit is now on silence: a run whose phones keep finishing requests
    goes on past it (here 2.4 s against 1 s), one whose phones have said nothing for it is a RigError."""
    import subprocess
    import types

    import rig.runner

    script = tmp_path / "phone.py"
    script.write_text(_FAKE_PHONE.replace("GAPS", repr(gaps)))
    real = subprocess.Popen
    monkeypatch.setattr(rig.runner.subprocess, "Popen",
                        lambda cmd, **kw: real([cmd[0], str(script)], **{**kw, "cwd": str(tmp_path)}))
    sc = types.SimpleNamespace(phones=1, edge_threads=1, phone_cores=None, speculate=False)
    workload = types.SimpleNamespace(kind="chat", requests=len(gaps), max_tokens=3)
    run = lambda: rig.runner.run_phones(sc, rig.runner.Targets(tmp_path, None), "all-edge", workload, [None],  # noqa: E731
                                        tmp_path, "t", Progress(), stall_s=1.0)
    if hung:
        with pytest.raises(rig.runner.RigError, match=r"said nothing for 1 s \(1/2 requests done"):
            run()
    else:
        assert len(run()) == len(gaps)


def test_a_cloud_server_that_dies_mid_run_fails_the_run_at_once_naming_its_log(tiny_glm4_fp32_bundle, tmp_path,
                                                                              monkeypatch):
    """A split server killed mid-run (the OOM killer, a crash) went unnoticed: its phones retried for their reconnect
    window (90 s), then the run failed naming a phone's log ("cannot reach the cloud"), never the server's."""
    import time

    import rig.runner
    from rig.runner import RigError

    launched = []
    real_launch = rig.runner.CloudProcess.launch
    monkeypatch.setattr(rig.runner.CloudProcess, "launch", lambda self: launched.append(self) or real_launch(self))
    sc = Scenario.from_dict({
        "name": "dies", "model": "tiny-glm4", "split_layer": 2, "edge_quant": "fp32", "modes": ["split"],
        "profiles": [{"name": "slow", "rtt_ms": 200, "down_mbps": 1, "up_mbps": 1}],
        "workloads": [{"kind": "chat", "requests": 4, "max_tokens": 8}],
    })
    killed = []

    def kill_the_server(text):  # the first answer is streaming: the run is under way
        if not killed:
            killed.append(time.monotonic())
            launched[0].proc.kill()

    with pytest.raises(RigError, match=r"\[slow-chat-split\] the split cloud server exited with code -9 mid-run "
                                       r"\(\d/4 requests done; log: .*cloud-split-slow\.log\)"):
        run_scenario(sc, tmp_path, Progress(), on_delta=kill_the_server, bundle=tiny_glm4_fp32_bundle)
    assert killed and time.monotonic() - killed[0] < 10


def test_a_one_token_answer_has_no_decode_rate_and_does_not_pull_the_mean_down():
    """summarize's tokens/s averaged every record's, and a one-token answer (no inter-token gap) counted 0: a
    group of two answers decoding at 10 tok/s and one stop at once read 6.7 tok/s."""
    from rig.report import summarize

    def rec(gaps):
        return {"profile": "wifi", "workload": "chat", "mode": "split", "ttft_s": 0.1, "itl_s": gaps,
                "tokens_per_s": len(gaps) / sum(gaps) if gaps else 0.0, "prompt_tokens": 4,
                "completion_tokens": len(gaps) + 1, "bytes_up": 10, "bytes_down": 10, "total_s": 1.0,
                "edge_compute_s": 0.0, "edge_cached_tokens": 0, "cloud_cached_tokens": 0}

    [row] = summarize([rec([0.1, 0.1]), rec([0.1] * 4), rec([])])
    assert row["tokens_per_s"] == pytest.approx(10.0)
    [row] = summarize([rec([])])
    assert row["tokens_per_s"] is None
    assert " - " in format_table([row]).splitlines()[2]
