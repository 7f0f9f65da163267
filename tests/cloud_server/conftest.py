"""Models and bundles built once per test session for the cloud-server tests.

Aliases of the shared fixtures in tests/conftest.py: tiny-glm4 (split at layer 2, fp32 edge) serves most
tests; SmolLM2 (split at layer 4, fp32 edge) is built only when a test asks for it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# cloud_support.py (the test helpers) imports as a top-level module under any pytest import mode.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_lm(tiny_glm4_lm):
    return tiny_glm4_lm


@pytest.fixture(scope="session")
def tiny_bundle(tiny_glm4_fp32_bundle) -> Path:
    return tiny_glm4_fp32_bundle


@pytest.fixture(scope="session")
def smol_lm(smollm2_lm):
    return smollm2_lm


@pytest.fixture(scope="session")
def smol_bundle(smollm2_fp32_bundle) -> Path:
    return smollm2_fp32_bundle
