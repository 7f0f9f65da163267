"""rig.scenario / rig.profiles / rig.workloads: parsing, validation with clear errors, the workloads' shape."""

from __future__ import annotations

import pytest

from rig.link import Disconnect
from rig.profiles import LinkProfileError, resolve_profile
from rig.scenario import Scenario, ScenarioError, load_scenario
from rig.workloads import agent_requests, chat_requests, system_prompt


def test_yaml_scenario_round_trip(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("""
name: t
profiles: [wifi, {base: 4g, loss: 0.0}, {name: sat, rtt_ms: 600, down_mbps: 50, up_mbps: 5}]
modes: [split, all-cloud]
phones: 3
disconnects: [{at_s: 2.0, down_s: 0.5}]
workloads:
  - {kind: agent, requests: 5, max_tokens: 16}
""")
    sc = load_scenario(path)
    assert [p.name for p in sc.profiles] == ["wifi", "4g*", "sat"]
    assert sc.profiles[1].loss == 0.0 and sc.profiles[1].rtt_ms == 60.0 and sc.profiles[2].jitter_ms == 0.0
    assert sc.disconnects == [Disconnect(2.0, 0.5)] and sc.workloads[0].kind == "agent"
    assert Scenario.from_dict(sc.to_dict() | {"profiles": [p["name"] for p in sc.to_dict()["profiles"][:1]]})


@pytest.mark.parametrize("data, match", [
    ({"modes": ["split", "edge"]}, "modes"),
    ({"colour": "red"}, "unknown scenario key"),
    ({"profiles": ["6g"]}, "unknown link profile"),
    ({"profiles": [{"name": "x", "rtt_ms": 10}]}, "missing field"),
    ({"profiles": [{"base": "4g", "loss": 1.5}]}, "loss"),
    ({"workloads": [{"kind": "poetry"}]}, "workload kind"),
    ({"workloads": [{"kind": "chat", "requests": 0}]}, "requests"),
    ({"phone_cores": []}, "phone_cores"),
    ({"profiles": "4g"}, "expected a list"),
    # wrong types and absurd sizes: each names its key (they used to pass, or fail as "'<' not supported")
    ({"phones": "3"}, "phones '3'"),
    ({"phones": True}, "phones True"),
    ({"phones": 2.5}, "phones 2.5"),
    ({"phones": 100_000}, r"phones 100000: expected an integer in \[1, 256\]"),
    ({"edge_threads": 10 ** 6}, "edge_threads"),
    ({"split_layer": "8"}, "split_layer '8'"),
    ({"seed": "x"}, "seed 'x'"),
    ({"name": None}, "name None"),
    ({"name": 123}, "name 123"),
    ({"name": "../../etc"}, "one path component"),
    ({"model": None}, "model None"),
    ({"edge_quant": "int3"}, "edge_quant 'int3'"),
    ({"plan_check": "yes"}, "plan_check 'yes'"),
    ({"speculate": "yes"}, "speculate 'yes'"),
    ({"whole": "/etc/passwd"}, "not a whole-model export"),
    ({"cloud_cores": [4096]}, "not usable here"),
    ({"phone_cores": [True]}, "phone_cores"),
    ({"disconnects": [{"at_s": "1"}]}, "at_s '1'"),
    ({"disconnects": [{"at_s": float("nan")}]}, "at_s nan"),
    ({"disconnects": [{"at_s": 1.0, "down_s": -5}]}, "down_s -5"),
    ({"disconnects": [{"at_s": 1.0, "every": 2}]}, "disconnects: unknown key.*every"),
    ({"workloads": [{"kind": "chat", "requests": "5"}]}, "requests '5'"),
    ({"workloads": [{"kind": "chat", "requests": 10 ** 9}]}, "requests 1000000000"),
    ({"workloads": [{"kind": "chat", "max_tokens": 2.5}]}, "max_tokens 2.5"),
    ({"workloads": [{"kind": "chat", "turns": 3}]}, "workloads: unknown key.*turns"),
    ({"workloads": [{"requests": 3}]}, "workloads: missing key.*kind"),
    # tracebacks (TypeError, ValueError) and silent merges before
    ({1: 2, "colour": "red"}, "unknown scenario key.*1, colour"),
    ({"profiles": [{"base": ["4g"]}]}, r"unknown link profile \['4g'\]"),
    ({"name": "a\0b"}, "name 'a.x00b': a NUL character"),
    ({"model": "a\0b"}, "model 'a.x00b': a NUL character"),
    ({"profiles": [{"base": "wifi", "name": "a\0b"}]}, "profiles: name 'a.x00b': a NUL character"),  # (a traceback)
    # a lone surrogate (JSON's or YAML's "\ud800"): UnicodeEncodeError tracebacks, before the run or as it started
    ({"name": "a\ud800"}, "name 'a.ud800': not text"),
    ({"model": "a\ud800"}, "model 'a.ud800': not text"),
    ({"cloud_args": ["--num-blocks", "\ud800"]}, "cloud_args '.ud800': not text"),
    ({"cloud_args": ["--num-blocks", "6\0"]}, "cloud_args '6.x00': a NUL character"),  # (a traceback at its start)
    ({"profiles": [{"base": "4g", "name": "\ud800"}]}, "profiles: name '.ud800': not text"),
    ({"cloud_args": [{"a": 1}]}, "cloud_args: each item"),
    # the rig's own address, or what locks its phones out: a --port there left it waiting 300 s for /ready
    ({"cloud_args": ["--port", 9000]}, "cloud_args: --port: the rig sets it"),
    ({"cloud_args": ["--po=9000"]}, r"cloud_args: --po=9000 \(--port\)"),
    ({"cloud_args": ["--api-key", "k"]}, "cloud_args: --api-key"),
    ({"cloud_args": ["--no-open-probes"]}, "cloud_args: --no-open-probes"),
    ({"profiles": [{"name": "../x", "rtt_ms": 10, "down_mbps": 1, "up_mbps": 1}]}, "profiles: name '../x'"),
    ({"plan_check": True, "profiles": [{"name": "loopback", "rtt_ms": 10, "down_mbps": 1, "up_mbps": 1}]},
     "names must be unique"),
    ({"workloads": [{"kind": "chat"}, {"kind": "chat", "max_tokens": 200}]}, "one workload per kind"),
    # a profile name too long for its log files' names was an OSError traceback as the run opened them; a number
    # key in a profile was "sequence item 0: expected str instance, int found"
    ({"profiles": [{"name": "p" * 201, "rtt_ms": 10, "down_mbps": 1, "up_mbps": 1}]}, "profiles: name 'p+'...: at "
     "most 200 bytes"),
    ({"name": "\u00e9" * 101}, "name .*: at most 200 bytes"),
    ({"profiles": [{"base": "4g", 1: 2}]}, r"unknown field\(s\) 1$"),
    ({"profiles": [{"base": "4g", 1: 2, "x": 3}]}, r"unknown field\(s\) 1, x"),
])
def test_bad_scenarios_name_the_problem(data, match):
    with pytest.raises(ScenarioError, match=match):
        Scenario.from_dict(data)


def test_bad_files(tmp_path):
    with pytest.raises(ScenarioError, match="no such"):
        load_scenario(tmp_path / "missing.yaml")
    with pytest.raises(ScenarioError, match="a directory, not a scenario file"):  # it said 'no such scenario file'
        load_scenario(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("profiles: [wifi\n")
    with pytest.raises(ScenarioError, match="YAML"):
        load_scenario(bad)
    bad.write_text("# phones: 2\n")  # an empty (or emptied) file ran every default, minutes of it
    with pytest.raises(ScenarioError, match="empty"):
        load_scenario(bad)
    bad.write_text("{}\n")
    assert load_scenario(bad) == Scenario()


def test_paths_under_home_are_expanded_as_a_shell_would(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "manifest.json").write_text("{}")
    (tmp_path / "w").mkdir()
    from shared.whole_model import WHOLE_GRAPH

    (tmp_path / "w" / WHOLE_GRAPH).write_text("")
    path = tmp_path / "s.yaml"
    path.write_text("bundle: ~/b\nwhole: ~/w\nmodel: ~/m.gguf\n")  # "not a bundle (no manifest.json)" before
    sc = load_scenario(path)
    assert (sc.bundle, sc.whole, sc.model) == (str(tmp_path / "b"), str(tmp_path / "w"), str(tmp_path / "m.gguf"))
    assert Scenario(model="smollm2").model == "smollm2"

def test_yaml_reads_exponent_numbers_and_refuses_a_key_given_twice(tmp_path):
    """PyYAML read `1e3` as a string (YAML 1.1), refused as "must be a finite number, got '1e3'", and kept the
    last of two equal keys without a word."""
    path = tmp_path / "s.yaml"
    path.write_text("profiles: [{base: 4g, down_mbps: 1e3, up_mbps: 2.5e1, rtt_ms: 1.2e+2}]\n"
                    "disconnects: [{at_s: 5e-1}]\ncloud_args: [--num-blocks, 64]\n")
    sc = load_scenario(path)
    p = sc.profiles[0]
    assert (p.down_mbps, p.up_mbps, p.rtt_ms) == (1000.0, 25.0, 120.0) and sc.disconnects[0].at_s == 0.5
    assert sc.cloud_args == ["--num-blocks", "64"]
    for text, match in (("phones: 1\nseed: 3\nphones: 2\n", r"key 'phones' given twice \(line 3\)"),
                        ("phones: 1\nprofiles: [{base: 4g, loss: 0.1, loss: 0.2}]\n", "key 'loss' given twice")):
        path.write_text(text)
        with pytest.raises(ScenarioError, match=match):
            load_scenario(path)


def test_a_json_scenario_refuses_a_key_given_twice_and_an_upper_case_yaml_suffix_is_yaml(tmp_path):
    """A JSON scenario kept the last of two equal keys without a word (YAML's and the cloud's --config refuse it), and
    Scenario.YAML was read as JSON: "not valid JSON"."""
    path = tmp_path / "s.json"
    path.write_text('{"phones": 1, "workloads": [{"kind": "chat", "requests": 2, "requests": 3}]}')
    with pytest.raises(ScenarioError, match="not valid JSON .*key 'requests' given twice"):
        load_scenario(path)
    path.write_text('{"phones": 2, "phones": 1}')
    with pytest.raises(ScenarioError, match="key 'phones' given twice"):
        load_scenario(path)
    upper = tmp_path / "Phone.YAML"
    upper.write_text("phones: 2\nprofiles: [wifi]\n")
    sc = load_scenario(upper)
    assert sc.phones == 2 and [p.name for p in sc.profiles] == ["wifi"]


def test_profile_validation():
    with pytest.raises(LinkProfileError, match="jitter"):
        resolve_profile({"name": "j", "rtt_ms": 10, "jitter_ms": 6, "down_mbps": 1, "up_mbps": 1})
    with pytest.raises(LinkProfileError, match="up_mbps"):
        resolve_profile({"base": "wifi", "up_mbps": 0})


@pytest.mark.parametrize("fields, match", [
    ({"rtt_ms": float("nan")}, "rtt_ms must be a finite number, got nan"),  # NaN passed every range check
    ({"rtt_ms": float("inf")}, "rtt_ms must be a finite number"),  # the handshake slept forever
    ({"rtt_ms": 1e12}, r"rtt_ms must be in \[0, 60000\]"),
    ({"rtt_ms": "60"}, "rtt_ms must be a finite number, got '60'"),
    ({"rtt_ms": True}, "rtt_ms must be a finite number, got True"),
    ({"down_mbps": float("nan")}, "down_mbps"),
    ({"up_mbps": float("inf")}, "up_mbps"),
    ({"down_mbps": 1e-12}, "down_mbps must be in"),
    # past what a split phone's link hint can say (EdgeConfig.link_kbps, at most 1e9 kbit/s), which the rig gives it
    ({"up_mbps": 2e6}, r"up_mbps must be in \[0.001, 1e\+06\]"),
    ({"jitter_ms": float("nan")}, "jitter_ms"),
    ({"rto_ms": float("inf")}, "rto_ms"),  # a lost segment never arrived
    ({"loss": 1.0}, "loss must be in"),
    ({"name": 5}, "name"),
    ({"source": 5}, "source"),
])
def test_absurd_link_parameters_are_refused(fields, match):
    with pytest.raises(LinkProfileError, match=match):
        resolve_profile({"base": "4g", **fields})
    with pytest.raises(ScenarioError, match=match):
        Scenario.from_dict({"profiles": [{"base": "4g", **fields}]})


def test_workloads():
    chat = chat_requests(14, 32, offset=3)
    assert len(chat) == 14 and chat[0].label == "chat/3" and chat[-1].label == "chat/4"  # wraps around
    steps = agent_requests(8, 24)
    sp = system_prompt()
    assert 2400 <= len(sp.encode()) <= 3000
    assert all(s.messages[0] == {"role": "system", "content": sp} for s in steps)
    assert steps[0].label == "agent/0/0" and steps[6].label == "agent/1/0"
    assert "Previous actions: none" in steps[0].messages[1]["content"]
    assert "step 1:" in steps[1].messages[1]["content"]
    assert steps[3].to_dict()["max_tokens"] == 24
