"""Artifacts for the rig tests, built once per session: the whole tiny-glm4 model as ONNX (fp32), next to the
shared tiny-glm4 fp32 bundle, so that split and all-edge must give the same greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_whole(tmp_path_factory, tiny_glm4_lm) -> Path:
    from partition_tools.export_whole import export_whole

    out = tmp_path_factory.mktemp("tiny-whole") / "w"
    export_whole(tiny_glm4_lm, out, "fp32")
    return out
