"""Bundles built once per test session. tiny-glm4 (fp32 and int8 edges) serves most tests; the SmolLM2
bundle is built only when a test asks for it (one end-to-end run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the test helpers (edge_fake_cloud.py, edge_tcp_proxy.py) import as top-level modules under any import mode
sys.path.insert(0, str(Path(__file__).parent))


def _split(out: Path, source: str, layer: int, quant: str) -> Path:
    from partition_tools.models import load_model
    from partition_tools.split import SplitConfig, split

    split(load_model(source), SplitConfig(layer=layer, out=out, edge_quant=quant))
    return out


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory) -> Path:
    """tiny-glm4 split at layer 2, fp32 edge (split output equals the unsplit model)."""
    return _split(tmp_path_factory.mktemp("tiny-fp32") / "b", "tiny-glm4", 2, "fp32")


@pytest.fixture(scope="session")
def tiny_int8_bundle(tmp_path_factory) -> Path:
    return _split(tmp_path_factory.mktemp("tiny-int8") / "b", "tiny-glm4", 2, "int8")


@pytest.fixture(scope="session")
def smollm2_lm():
    """The unsplit SmolLM2-135M-Instruct (loaded once: the bundle is split from it and it is the reference)."""
    from partition_tools.models import ModelLoadError, load_model, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    return load_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_bundle(tmp_path_factory, smollm2_lm) -> Path:
    """SmolLM2 split at layer 2 with an fp32 edge, real tokenizer and chat template. Layer 2 keeps the export
    short in the default suite; the demo's layer-8 int8 split is exercised by the benchmark and the demo."""
    from partition_tools.split import SplitConfig, split

    out = tmp_path_factory.mktemp("smollm2-fp32") / "b"
    split(smollm2_lm, SplitConfig(layer=2, out=out, edge_quant="fp32"))
    return out


@pytest.fixture(scope="session")
def tiny_reference(tiny_bundle):
    """The unsplit tiny-glm4 model (same seed as the bundle) for token-for-token comparisons."""
    from partition_tools.models import load_model

    return load_model("tiny-glm4").model
