"""The partition CLI end to end: split -> verify -> inspect, and every bad input as one line + non-zero exit."""

import json
import shutil
import subprocess
import sys

import pytest
from cli_support import undocumented

from partition_tools.cli import main


def test_split_verify_inspect_tiny_glm4v(tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["split", "--preset", "tiny-glm4v", "--layer", "2", "--out", str(out)]) == 0
    # a random-weight model sits on no grid: the rounded recipe, said in one line
    assert "  recipe: 8-bit weights, block 32, int8 activations, SmoothQuant alpha 0.5" in capsys.readouterr().out
    assert main(["verify", str(out), "--json", "--max-tokens", "256"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"top1_agreement", "mean_kl", "ppl_reference", "ppl_split", "tokens"} <= set(report)
    assert report["tokens"] == 256 and report["passed"]
    assert main(["inspect", str(out)]) == 0
    said = capsys.readouterr().out
    assert "integrity  ok" in said and "edge quant int8 (8-bit weights, block 32, int8 activations" in said


def test_verify_checkpoint_dir_bundle(llama_dir, tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["split", str(llama_dir), "--layer", "1", "--out", str(out)]) == 0
    assert main(["verify", str(out), "--max-tokens", "128"]) == 0
    assert "PASSED" in capsys.readouterr().out


def test_verify_passes_on_default_bundle(tiny_glm4_bundle, capsys):
    assert main(["verify", str(tiny_glm4_bundle), "--json", "--max-tokens", "256"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["edge_quant"] == "int8" and r["incremental_rel_err"] < 1e-3


def test_verify_and_plan_show_their_steps(tiny_glm4_bundle, capsys, monkeypatch):
    """verify (minutes on a real model: the reload, 1,024 tokens scored twice) and plan (a probe split, timings) ran
    without a word until their report; each step is a line on stderr, as split's are."""
    monkeypatch.setenv("AUTOGLM_PROGRESS", "1")
    assert main(["verify", str(tiny_glm4_bundle), "--max-tokens", "64", "--json"]) == 0
    err = capsys.readouterr().err
    assert "[verify 1/4] re-hash the bundle's files" in err and "[verify 4/4] decode steps" in err, err
    assert "[verify] done in " in err
    assert main(["plan", "tiny-glm4", "--bundle", str(tiny_glm4_bundle), "--candidates", "1", "--json"]) == 0
    err = capsys.readouterr().err
    assert "[plan 1/3] time the edge front" in err and "[plan 3/3] boundary bytes" in err and "[plan] done" in err, err


def test_a_bundle_of_a_seeded_preset_is_verified_against_that_seed(split_bundle, capsys, monkeypatch):
    """``split --preset tiny-glm4 --seed 3``: verify, draft-head and plan --bundle reloaded the preset with seed 0
    and refused the bundle as another model's; they reload it with the seed the manifest's source identity
    records."""
    import partition_tools.codec_calibration
    import partition_tools.plan
    from partition_tools.models import load_model

    monkeypatch.setattr(partition_tools.codec_calibration, "write_codec_calibration", lambda *a: None)  # fast: no PCA
    out = split_bundle("seeded", load_model("tiny-glm4", seed=3), 2, "fp32")
    assert main(["verify", str(out), "--max-tokens", "64"]) == 0
    assert "PASSED" in capsys.readouterr().out
    planned = []  # plan --bundle times that bundle's front: of the model it was split from (not timed here)
    monkeypatch.setattr(partition_tools.plan, "plan", lambda lm, cfg, bundle: planned.append(lm.identity) or {})
    assert main(["plan", "tiny-glm4", "--bundle", str(out), "--json"]) == 0
    assert planned == ["preset:tiny-glm4@seed3"]


def _fails_in_one_line(argv, capsys, match):
    capsys.readouterr()  # drop what the test's own setup printed
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and match in err, err


@pytest.mark.parametrize("layer", ["0", "4", "-1"])
def test_bad_split_layer(layer, tmp_path, capsys):
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", layer, "--out", str(tmp_path / "b")],
                       capsys, "--layer")


def test_unknown_source(tmp_path, capsys):
    _fails_in_one_line(["split", "no-such-model", "--layer", "1", "--out", str(tmp_path / "b")], capsys,
                       "no such preset")


def test_unknown_architecture(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(d)
    _fails_in_one_line(["split", str(d), "--layer", "1", "--out", str(tmp_path / "b")], capsys,
                       "unsupported architecture: model_type='gpt2'")


@pytest.mark.parametrize("damage", ["missing", "truncated", "tampered", "no-manifest"])
def test_damaged_bundle(damage, tiny_glm4_bundle, tmp_path, capsys):
    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)
    target = d / "cloud" / "back.safetensors"
    if damage == "missing":
        target.unlink()
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[:100])
    elif damage == "tampered":
        data = bytearray(target.read_bytes())
        data[-10] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        (d / "manifest.json").unlink()
    _fails_in_one_line(["verify", str(d)], capsys, str(d))
    if damage != "no-manifest":
        assert main(["inspect", str(d)]) == 1
        assert "integrity  FAILED" in capsys.readouterr().out


def test_console_script_prints_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "partition_tools.cli", "verify", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "no such bundle directory" in r.stderr


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_file_given_for_a_bundle_is_said_to_be_a_file(command, tmp_path, capsys):
    """An existing regular file (a bundle's manifest.json, a tarball) was 'no such bundle directory'."""
    f = tmp_path / "manifest.json"
    f.write_text("{}")
    assert main([command, str(f)]) == 2
    assert capsys.readouterr().err == f"autoglm-partition {command}: error: {f}: a file, not a bundle directory " \
        "(give the directory split --out wrote, the one holding its manifest.json)\n"


def test_split_with_an_int8_edge_kv_cache(tmp_path, capsys):
    """``--edge-kv int8``: the front's cache is int8 (a quarter of the bytes), said by split and inspect, named in
    the edge variant (so prefix keys never mix its states with an fp32 cache's), and the bundle verifies."""
    from edge_client.front import FrontRuntime
    from shared.manifest import Manifest

    out = tmp_path / "b"
    assert main(["split", "--preset", "tiny-glm4", "--layer", "2", "--out", str(out), "--edge-quant", "fp32",
                 "--edge-kv", "int8"]) == 0
    assert "  recipe: KV cache int8 PER_CHANNEL" in capsys.readouterr().out
    m = Manifest.load(out)
    assert m.edge_variant == "fp32+int8-kv" and m.states_variant.startswith("fp32+int8-kv#")
    front = FrontRuntime(out, threads=1)
    assert front.kv_scales is not None and front._cache.buffers[0].dtype.name == "int8"
    assert main(["verify", str(out), "--json", "--max-tokens", "128"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["passed"]
    assert main(["inspect", str(out)]) == 0
    assert "edge quant fp32 (KV cache int8 PER_CHANNEL)" in capsys.readouterr().out


def test_edge_kv_with_fp32_prefill_is_refused(tmp_path, capsys):
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1", "--out", str(tmp_path / "b"),
                        "--edge-kv", "int8", "--fp32-prefill"], capsys, "--edge-kv int8 and --fp32-prefill")


def test_unknown_edge_kv_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["split", "--preset", "tiny-glm4", "--layer", "1", "--out", str(tmp_path / "b"), "--edge-kv", "int4"])
    assert e.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err


def test_edge_kv_needs_the_fused_graph(tmp_path):
    from partition_tools.split import SplitConfig
    from shared.manifest import BundleError

    with pytest.raises(BundleError, match="needs the fused edge graph"):
        SplitConfig(layer=1, out=tmp_path / "b", edge_graph="plain", edge_kv="int8")
    with pytest.raises(BundleError, match="--edge-kv 'fp16'"):
        SplitConfig(layer=1, out=tmp_path / "b", edge_kv="fp16")




def test_every_subcommand_and_option_has_help_text():
    """No subcommand --help had a description; the bundle argument of draft-head, verify and inspect had no help,
    and the top-level description left draft-head out."""
    from partition_tools.cli import build_parser

    parser = build_parser()
    assert undocumented(parser) == [] and "draft-head" in parser.description


@pytest.mark.parametrize("command", [["verify"], ["draft-head"], ["draft-head", "--layers", "auto"]])
@pytest.mark.parametrize("content, match", [(b"", "the file holds no text"), (b" \n\t\n", "the file holds no text"),
                                            (b"\xff\xfe\x00binary", "'utf-8' codec can't decode")])
def test_text_that_is_no_text_is_a_usage_error_before_the_model_loads(tiny_glm4_bundle, tmp_path, capsys, monkeypatch,
                                                                      command, content, match):
    """verify --text of an empty file loaded the model, then stopped with a ValueError traceback ('text tokenizes to 0
    token(s)'); draft-head read its --text only after the model loaded: a file not UTF-8 was a UnicodeDecodeError
    traceback (SmolLM2: after a minute's load), a missing one said so as late."""
    import partition_tools.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    f = tmp_path / "t.txt"
    f.write_bytes(content)
    assert main([*command[:1], str(tiny_glm4_bundle), *command[1:], "--text", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"autoglm-partition {command[0]}: error: --text {f}: ") and match in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("command", [["verify"], ["draft-head"], ["draft-head", "--cloud"], ["draft-head",
                                                                                               "--layers", "3"]])
def test_text_for_a_source_without_a_tokenizer_is_a_usage_error(tiny_glm4_bundle, tmp_path, capsys, command):
    """verify --text on a random preset's bundle ended in a ValueError traceback; draft-head ignored the file
    and calibrated on random ids as if it had not been given."""
    bundle = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, bundle)  # a broken draft-head must not change the shared bundle
    text = tmp_path / "t.txt"
    text.write_text("some calibration prose " * 50)
    assert main([command[0], str(bundle), *command[1:], "--text", str(text)]) == 2
    err = capsys.readouterr().err
    assert err == (f"autoglm-partition {command[0]}: error: --text {text}: tiny-glm4 has no tokenizer to read it "
                   "with (without one, random token ids are used); leave --text out\n")
    assert sorted(p.name for p in bundle.rglob("*")) == sorted(p.name for p in tiny_glm4_bundle.rglob("*"))


def test_a_split_sent_sigterm_removes_its_staging_directory_and_says_interrupted(tmp_path):
    """SIGTERM (``timeout``, a CI cancel, systemd, ``kill``) ended a split by the signal (status -15, no word), its
    finally never ran: ``.<out>.autoglm-split.partial`` stayed beside --out, as big as the bundle it was writing,
    until a later split into the same place. It unwinds as Ctrl-C does (shared.cli_exit.sigterm_unwinds)."""
    import signal
    import time

    out = tmp_path / "b"
    staging = tmp_path / ".b.autoglm-split.partial"
    proc = subprocess.Popen([sys.executable, "-m", "partition_tools.cli", "split", "tiny-glm4", "--layer", "2",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not staging.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the CLI holds its staging directory from before the model loads
        assert staging.exists(), proc.communicate()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", (proc.returncode, err)
    assert not staging.exists() and not out.exists()
