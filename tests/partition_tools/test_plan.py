"""partition_tools.plan: the latency model behaves as the physics says, and ``autoglm-partition plan`` runs
on a real bundle with measured costs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from partition_tools.cli import main
from partition_tools.plan import Costs, PlanConfig, Shape, predict
from shared.link_profiles import get_profile

COSTS = Costs(num_layers=30, edge={"prefill_per_token": 1e-4, "decode": {100: 5e-4}},
              cloud={"prefill_per_token": 2e-4, "decode": {100: 3e-4}, "head": 2e-3},
              codec_bytes={8: {"int8-outlier": 600.0, "fp16": 1152.0}}, layer_weight_bytes=4e6,
              embed_weight_bytes=3e7, head_edge_s=4e-3, kv_bytes_per_token_layer=1536, hidden_size=576)
CHAT = Shape(prompt_tokens=60, cached_tokens=0, output_tokens=40, text_bytes=240)


def _cfg(link: str, **kw) -> PlanConfig:
    return PlanConfig(link=get_profile(link), overhead_ms=0.0, **kw)


def test_split_pays_a_round_trip_per_token_all_cloud_does_not():
    fast, slow = _cfg("wifi"), _cfg("3g-poor")
    split_fast, split_slow = predict(COSTS, fast, 8, CHAT), predict(COSTS, slow, 8, CHAT)
    rtt_gap = (slow.link.rtt_ms - fast.link.rtt_ms) / 1000
    assert split_slow["per_token_s"] - split_fast["per_token_s"] > rtt_gap  # + the slower uplink
    cloud_fast, cloud_slow = predict(COSTS, fast, "all-cloud", CHAT), predict(COSTS, slow, "all-cloud", CHAT)
    assert cloud_slow["per_token_s"] - cloud_fast["per_token_s"] < 0.01  # streaming: no round trip per token
    edge = predict(COSTS, fast, "all-edge", CHAT)
    assert edge["per_token_s"] == pytest.approx(30 * 5e-4 + 4e-3) and edge["up_bytes"] == 0


def test_upload_bytes_follow_the_codec_and_the_cache():
    cfg = _cfg("4g")
    int8 = predict(COSTS, cfg, 8, CHAT)
    fp16 = predict(COSTS, replace(cfg, codec="fp16"), 8, CHAT)
    assert fp16["up_bytes"] > 1.8 * int8["up_bytes"] and fp16["ttft_s"] > int8["ttft_s"]
    cached = predict(COSTS, cfg, 8, replace(CHAT, cached_tokens=50))
    assert cached["ttft_s"] < int8["ttft_s"] and cached["up_bytes"] < int8["up_bytes"]


def test_calibrated_overheads_add_per_mode():
    base = predict(COSTS, _cfg("4g"), 8, CHAT)
    over = predict(COSTS, _cfg("4g", overheads={"split": (0.05, 0.01)}), 8, CHAT)
    assert over["ttft_s"] - base["ttft_s"] == pytest.approx(0.05)
    assert over["per_token_s"] - base["per_token_s"] == pytest.approx(0.01)


def test_plan_cli_on_a_bundle(tiny_glm4_int8_bundle, capsys):
    assert main(["plan", "tiny-glm4", "--bundle", str(tiny_glm4_int8_bundle), "--link", "4g",
                 "--edge-threads", "1", "--candidates", "1,2,3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [row["n"] for row in r["rows"]] == [1, 2, 3, "all-cloud", "all-edge"] and r["pick"] in (1, 2, 3)
    assert r["costs"]["edge_decode_ms_per_layer"] and r["costs"]["codec_bytes_per_token"]["2"]["fp16"] == 128.0
    mem = [row["edge_memory_mb"] for row in r["rows"][:3]]
    assert mem == sorted(mem)  # more layers on the phone, more memory
    assert main(["plan", "tiny-glm4", "--link", "6g"]) == 2
    assert "unknown link profile" in capsys.readouterr().err


def test_a_budget_no_split_fits_is_said_and_each_candidate_is_one_row(tiny_glm4_int8_bundle, capsys):
    """With no split within --edge-memory-mb the plan ended 'pick: N = None (fastest agent step within the edge
    memory budget)'; --candidates 2,1,2 gave three rows, 2 twice, out of order."""
    assert main(["plan", "tiny-glm4", "--bundle", str(tiny_glm4_int8_bundle), "--edge-threads", "1",
                 "--candidates", "2,1,2", "--edge-memory-mb", "0.001"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines if line.split()[:1] in (["1"], ["2"])] == ["1", "2"]
    assert lines[-2].startswith("pick: none - no split fits the edge memory budget of 0.001 MB (N = 1 needs "), lines


def test_plan_rows_show_what_the_cloud_can_read():
    from types import SimpleNamespace

    from partition_tools.plan import _exposure

    smollm2 = SimpleNamespace(identity=json.loads((Path(__file__).parents[2] / "docs/results/privacy_inversion.json").read_text())["model"])
    other = SimpleNamespace(identity="preset:tiny-glm4@seed0")
    cfg = _cfg("4g")
    assert _exposure(smollm2, cfg, "all-cloud") == 1.0 and _exposure(smollm2, cfg, "all-edge") == 0.0
    deep, shallow = _exposure(smollm2, cfg, 16), _exposure(smollm2, cfg, 2)
    assert deep is not None and shallow is not None and 0 < deep < shallow < 1  # deeper splits leak less
    assert _exposure(other, cfg, 2) is None  # the figures are SmolLM2's only
