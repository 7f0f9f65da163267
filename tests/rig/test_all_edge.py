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


def test_the_cached_bundle_and_export_are_the_models_own(tiny_glm4_lm, tiny_glm4_fp32_bundle, tiny_whole, tmp_path,
                                                         monkeypatch):
    """The rig's cache named a bundle and an export by the ``model`` string: ``model: ckpt`` run from another folder
    (another checkpoint there) took the first folder's cached bundle, so the split rows measured another model than
    the all-edge ones; its export was exported again on every run (its whole.json holds the absolute path, never
    equal to ``ckpt``); and an absolute ``model`` put both beside the model, outside the cache. The builders are
    faked (copies of the session's artifacts, stamped with the identity of the model they were given)."""
    import copy
    import shutil

    import torch

    from partition_tools.models import source_identity
    from rig import runner
    from rig.scenario import Scenario
    from shared.manifest import Manifest, same_source
    from shared.whole_model import read_meta

    for folder, bump in (("a", 0.0), ("b", 1.0)):  # one config, other weights
        model = copy.deepcopy(tiny_glm4_lm.model)
        with torch.no_grad():
            model.lm_head.weight.add_(bump)
        model.save_pretrained(tmp_path / folder / "ckpt")
    built = {"bundle": 0, "whole": 0}

    def split(lm, cfg):
        built["bundle"] += 1
        shutil.copytree(tiny_glm4_fp32_bundle, cfg.out)
        manifest = Manifest.load(cfg.out)
        manifest.source, manifest.source_identity = lm.source, lm.identity
        manifest.save(cfg.out)

    def export_whole(lm, out, quant):
        built["whole"] += 1
        shutil.copytree(tiny_whole, out)
        meta = json.loads((out / "whole.json").read_text())
        (out / "whole.json").write_text(json.dumps(dict(meta, source=lm.source, source_identity=lm.identity,
                                                        quant=quant)))

    monkeypatch.setattr("partition_tools.split.split", split)
    monkeypatch.setattr("partition_tools.export_whole.export_whole", export_whole)
    cache = tmp_path / "cache"
    monkeypatch.setenv("AUTOGLM_CACHE", str(cache))
    used = []

    def run_phones(sc, targets, *args, **kwargs):  # the artifacts the run would measure; no phone starts
        used.append(targets)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_phones", run_phones)

    def run(model: str):
        sc = Scenario.from_dict({"name": "c", "model": model, "split_layer": 2, "edge_quant": "fp32",
                                 "modes": ["all-edge"], "workloads": [{"kind": "chat", "requests": 1}]})
        with pytest.raises(runner.RunInterrupted):
            runner.run_scenario(sc, tmp_path / "out")
        targets = used[-1]
        identity = source_identity(model)
        assert same_source(Manifest.load(targets.bundle).source_identity, identity), targets.bundle
        assert same_source(read_meta(targets.whole)["source_identity"], identity), targets.whole
        assert cache in targets.bundle.parents and cache in targets.whole.parents
        return targets

    monkeypatch.chdir(tmp_path / "a")
    first = run("ckpt")
    monkeypatch.chdir(tmp_path / "b")
    second = run("ckpt")  # another model by the same name: its own bundle and export
    assert run("ckpt") == second and built == {"bundle": 2, "whole": 2}  # cached: not built again
    assert first.bundle != second.bundle
    # an absolute path: in the cache too, the entry of the relative name that named the same folder
    assert run(str(tmp_path / "a" / "ckpt")) == first and built == {"bundle": 2, "whole": 2}
