"""The rig's all-edge phone (rig.phone over rig.all_edge.WholeModelRunner) fits a request to the context as the
split does (edge_client.request.fit_answer, answer_end)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edge_client.errors import EdgeClientError
from edge_client.tokenizer import EdgeTokenizer
from rig.all_edge import WholeModelRunner


def _messages(tokenizer: EdgeTokenizer, n: int) -> list[dict]:
    """A chat whose prompt is ``n`` tokens (tiny-glm4 has no tokenizer: one byte, one token)."""
    messages = [{"role": "user", "content": "x"}]
    messages[0]["content"] = "x" * (1 + n - len(tokenizer.chat_ids(messages)))
    assert len(tokenizer.chat_ids(messages)) == n
    return messages


def test_the_all_edge_phone_cuts_max_tokens_to_the_context_as_the_split_does(tiny_glm4_fp32_bundle, tiny_whole):
    """The all-edge phone decoded max_tokens whatever the context: a 2,045-token prompt with max_tokens 10 answered
    10 tokens past tiny-glm4's 2,048 positions (the split answers 3, "length"; a max_tokens of 3,000 after a
    104-token chat: 3,000 tokens where the split stopped at 1,944)."""
    tok = EdgeTokenizer.from_bundle(tiny_glm4_fp32_bundle)
    job = {"phone": 0, "mode": "all-edge", "bundle": str(tiny_glm4_fp32_bundle), "whole": str(tiny_whole),
           "threads": 1, "cores": None,
           "requests": [{"messages": _messages(tok, 2045), "max_tokens": 10, "label": "long"}]}
    out = subprocess.run([sys.executable, "-m", "rig.phone"], input=json.dumps(job) + "\ngo\n", text=True,
                         capture_output=True, timeout=120)
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert out.returncode == 0, (out.stderr, events)
    (rec,) = [e for e in events if e["event"] == "request"]
    assert (rec["prompt_tokens"], rec["completion_tokens"], rec["finish_reason"]) == (2045, 3, "length")
    assert len(rec["token_ids"]) == 3
    assert WholeModelRunner(tiny_whole, threads=1).max_positions == 2048  # tiny-glm4's, as its split front graph's


def test_the_whole_model_runner_refuses_a_prompt_that_leaves_no_room(tiny_whole):
    runner = WholeModelRunner(tiny_whole, threads=1)
    runner.eos = set()  # random weights: only the context ends these answers
    run = runner.generate([5 + i % 50 for i in range(2047)], 10)
    assert len(run.token_ids) == 1 and run.finish_reason == "length"
    with pytest.raises(EdgeClientError, match="prompt of 2048 tokens exceeds the whole graph's 2048 positions") as ei:
        runner.generate([5 + i % 50 for i in range(2048)], 10)
    assert ei.value.code == "context_full"
    assert runner.generate([5, 6, 7], 4).finish_reason == "length"


def _old_export(tiny_whole, to):
    """``tiny_whole`` as exported before ``whole.json`` held ``max_positions``."""
    to.mkdir()
    (to / "model.onnx").symlink_to(tiny_whole / "model.onnx")
    meta = json.loads((tiny_whole / "whole.json").read_text())
    del meta["max_positions"]
    (to / "whole.json").write_text(json.dumps(meta))
    return to


def test_an_export_older_than_max_positions_is_a_scenario_error_and_rebuilt_in_the_cache(tiny_whole, tmp_path,
                                                                                          monkeypatch, capsys):
    from rig import artifacts
    from rig.cli import main

    old = _old_export(tiny_whole, tmp_path / "old")
    monkeypatch.setenv("AUTOGLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"name": "old", "model": "tiny-glm4", "split_layer": 2, "whole": str(old),
                                "profiles": ["wifi"], "modes": ["all-edge"],
                                "workloads": [{"kind": "chat", "requests": 1, "max_tokens": 2}]}))
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoglm-rig run: error: whole ") and "no max_positions" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "cache").exists()

    exported = []
    monkeypatch.setattr("partition_tools.models.load_model", lambda source: source)
    monkeypatch.setattr("partition_tools.export_whole.export_whole",
                        lambda lm, out, quant: exported.append(out) or out.mkdir())
    cached = _old_export(tiny_whole, tmp_path / "cached")
    meta = json.loads((cached / "whole.json").read_text())
    assert (meta["source"], meta["quant"]) == ("tiny-glm4", "fp32")  # the cache's match, but for the missing key
    assert artifacts.ensure_whole("tiny-glm4", "fp32", out=cached, quiet=True) == cached and len(exported) == 1
