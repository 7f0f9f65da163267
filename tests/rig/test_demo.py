"""``autoglm-rig demo`` end to end on the embedded default (SmolLM2; builds and caches the bundle and the
whole-model export on first use): a real streamed answer, then the three-way summary."""

from __future__ import annotations

import io

import pytest


@pytest.mark.slow
def test_demo_prints_an_answer_and_the_three_way_summary(tmp_path):
    pytest.importorskip("matplotlib")
    from partition_tools.models import ModelLoadError, smollm2_gguf_path
    from rig.demo import DEMO_REQUESTS, run_demo

    try:
        smollm2_gguf_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    out = io.StringIO()
    report = run_demo(out=tmp_path, stream=out)
    text = out.getvalue()
    assert "assistant (split, over 4g)>" in text and "all-cloud" in text and "all-edge" in text
    answer = text.split("assistant (split, over 4g)>", 1)[1].split("\n\n", 1)[0]
    assert len(answer.split()) >= 5  # real words, streamed
    modes = {(r["workload"], r["mode"]) for r in report["summary"]}
    assert modes == {(w, m) for w in ("chat", "agent") for m in ("split", "all-cloud", "all-edge")}
    assert all(r["requests"] == DEMO_REQUESTS[r["workload"]] for r in report["summary"])
    assert (tmp_path / "report.json").is_file() and (tmp_path / "rig_agent.png").is_file()


def test_quiet_build_logs_silences_the_gguf_loaders_progress_bar():
    """rig.md: the demo's terminal shows the answer, the progress lines and the table. Building SmolLM2 (a GGUF)
    printed transformers' "Converting and de-quantizing GGUF tensors" bar there: a plain tqdm, which
    ``disable_progress_bar()`` does not reach. A subprocess: the helper changes process-wide logging."""
    import subprocess
    import sys

    pytest.importorskip("transformers")
    code = ("from rig.artifacts import quiet_build_logs; quiet_build_logs(); "
            "from transformers import modeling_gguf_pytorch_utils as g; "
            "[None for _ in g.tqdm(range(3), desc='the GGUF bar')]; print('done')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr
    assert "the GGUF bar" not in run.stderr, run.stderr
