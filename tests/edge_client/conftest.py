"""Bundles built once per test session. tiny-glm4 (fp32 and int8 edges) serves most tests; the SmolLM2
bundle is built only when a test asks for it (one end-to-end run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the test helper edge_fake_cloud.py imports as a top-level module under any import mode
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_bundle(tiny_glm4_fp32_bundle) -> Path:
    """tiny-glm4 split at layer 2, fp32 edge (split output equals the unsplit model)."""
    return tiny_glm4_fp32_bundle


@pytest.fixture(scope="session")
def tiny_int8_bundle(tiny_glm4_int8_bundle) -> Path:
    return tiny_glm4_int8_bundle


@pytest.fixture(scope="session")
def smollm2_bundle(smollm2_fp32_bundle) -> Path:
    """SmolLM2 split at layer 4 with an fp32 edge, real tokenizer and chat template (shared fixture)."""
    return smollm2_fp32_bundle


@pytest.fixture(scope="session")
def tiny_reference(tiny_bundle, tiny_glm4_lm):
    """The unsplit tiny-glm4 model (same seed as the bundle) for token-for-token comparisons."""
    return tiny_glm4_lm.model


@pytest.fixture(scope="session")
def tiny_cloud(tiny_bundle, tmp_path_factory):
    """A real `autoglm-cloud serve` of the tiny fp32 bundle (default options), shared by the end-to-end modules
    (one server start instead of one per module; a test that restarts it leaves it running on its port)."""
    from edge_client.demo import LocalCloud

    with LocalCloud(tiny_bundle, log_path=tmp_path_factory.mktemp("cloud-log") / "tiny.log") as cloud:
        yield cloud


@pytest.fixture(scope="session")
def ushape_cloud(tiny_glm4_ushape_bundle, tmp_path_factory):
    """A real `autoglm-cloud serve` of the tiny u-shape bundle, shared by the u-shape end-to-end modules."""
    from edge_client.demo import LocalCloud

    with LocalCloud(tiny_glm4_ushape_bundle, log_path=tmp_path_factory.mktemp("cloud-log") / "ushape.log") as cloud:
        yield cloud


@pytest.fixture(scope="session")
def greedy_continuation():
    """``fn(lm, prompt, n)``: the unsplit model's ``n`` greedy tokens after ``prompt`` (no stop token)."""
    return _greedy_continuation


def _greedy_continuation(lm, prompt: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = lm.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    return out[0, len(prompt):].tolist()
