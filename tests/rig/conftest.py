"""Artifacts for the rig tests: the whole tiny-glm4 model as ONNX (fp32), next to the shared tiny-glm4 fp32
bundle, so that split and all-edge must give the same greedy tokens (both built once per session, in
tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_whole(tiny_glm4_whole) -> Path:
    return tiny_glm4_whole
