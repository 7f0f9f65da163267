"""Models and bundles built once per test session for the cloud-server tests.

Aliases of the shared fixtures in tests/conftest.py: tiny-glm4 (split at layer 2, fp32 edge) serves most
tests; SmolLM2 (split at layer 4, fp32 edge) is built only when a test asks for it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# cloud_support.py (the test helpers) imports as a top-level module under any pytest import mode.
sys.path.insert(0, str(Path(__file__).parent))


def _alias(shared_fixture: str):
    """A session fixture that is ``shared_fixture`` of tests/conftest.py under this folder's name."""

    @pytest.fixture(scope="session")
    def fixture(request):
        return request.getfixturevalue(shared_fixture)

    return fixture


tiny_lm = _alias("tiny_glm4_lm")
tiny_bundle = _alias("tiny_glm4_fp32_bundle")
smol_lm = _alias("smollm2_lm")
smol_bundle = _alias("smollm2_fp32_bundle")
