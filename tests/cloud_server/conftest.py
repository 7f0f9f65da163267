"""Models and bundles built once per test session for the cloud-server tests.

tiny-glm4 (split at layer 2, fp32 edge) serves most tests; SmolLM2 (split at layer 8) is built only when a
test asks for it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# cloud_support.py (the test helpers) imports as a top-level module under any pytest import mode.
sys.path.insert(0, str(Path(__file__).parent))


def _split(out: Path, source: str, layer: int) -> Path:
    from partition_tools.models import load_model
    from partition_tools.split import SplitConfig, split

    split(load_model(source), SplitConfig(layer=layer, out=out, edge_quant="fp32"))
    return out


@pytest.fixture(scope="session")
def tiny_lm():
    from partition_tools.models import load_model

    return load_model("tiny-glm4")


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory) -> Path:
    return _split(tmp_path_factory.mktemp("cloud-tiny") / "b", "tiny-glm4", 2)


@pytest.fixture(scope="session")
def smol_lm():
    from partition_tools.models import ModelLoadError, load_model

    try:
        return load_model("smollm2")
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smol_bundle(tmp_path_factory, smol_lm) -> Path:
    from partition_tools.split import SplitConfig, split

    out = tmp_path_factory.mktemp("cloud-smol") / "b"
    split(smol_lm, SplitConfig(layer=8, out=out, edge_quant="fp32"))
    return out
