"""A split into an earlier bundle or a draft-head killed (SIGKILL) as its files go in leaves the old bundle or the new
one, never a mix: the update's journal (``shared.manifest.move_in``) is finished by whoever opens the bundle next."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from edge_client.draft_head import open_draft_head
from edge_client.front import FrontRuntime
from shared.manifest import MANIFEST_NAME, Manifest


def _killed_at(dest: Path, fn, *args) -> None:
    """``fn(*args)`` in a forked child, SIGKILLed as it renames a file onto ``dest``."""
    pid = os.fork()
    if pid == 0:
        try:
            def hooked(real):
                def rename(src, dst, *a, **k):
                    if os.path.abspath(dst) == str(dest):
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(src, dst, *a, **k)
                return rename

            os.replace, os.rename = hooked(os.replace), hooked(os.rename)
            fn(*args)
        finally:
            os._exit(1)  # never reached past the kill; the child runs nothing of pytest's
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


@pytest.mark.parametrize("killed_at", [MANIFEST_NAME, "edge/draft_head.onnx"])
def test_a_draft_head_killed_as_its_files_go_in_leaves_the_new_bundle(killed_at, tiny_glm4_bundle, tiny_glm4_lm,
                                                                      tmp_path, monkeypatch):
    """draft-head over an earlier drafter, killed between its file's rename and its manifest's: the new drafter under
    the earlier one's hash, or no drafter where the manifest listed one (FrontRuntime: 'truncated or replaced',
    'missing artifact'), and the next writer deleted the earlier one from its staging directory."""
    import partition_tools.draft_head as draft_head
    from partition_tools.draft_head import DraftHeadConfig, add_draft_head

    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)
    add_draft_head(tiny_glm4_lm, d, DraftHeadConfig(tokens=64))  # the earlier drafter: int8
    real = draft_head.add_files
    monkeypatch.setattr(draft_head, "add_files", lambda *a: _killed_at(d / killed_at, real, *a))
    add_draft_head(tiny_glm4_lm, d, DraftHeadConfig(tokens=64, quant="fp32"))
    m = Manifest.load(d)
    assert m.quant_report["draft_head"]["quant"] == "fp32"
    m.verify_files(d)
    FrontRuntime(d)  # the edge's load: every edge file against the manifest
    assert open_draft_head(d, m) is not None


def test_a_split_killed_as_it_replaces_an_earlier_bundle_leaves_the_new_one(tiny_glm4_bundle, tiny_glm4_fp32_bundle,
                                                                           tmp_path):
    """A split into an earlier bundle killed as it moved the new one in left a folder without a manifest: refused by
    every loader, and by a rerun of the split ('exists and is not a bundle')."""
    from partition_tools.split import _staging, _swap_in, check_out_dir

    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)  # the earlier bundle: int8; the new one fp32
    with _staging(d.absolute(), f"--out {d}") as staged:
        shutil.copytree(tiny_glm4_fp32_bundle, staged, dirs_exist_ok=True)
        _killed_at(d.absolute() / MANIFEST_NAME, _swap_in, staged, d.absolute())
    m = Manifest.load(d)
    assert m.edge_quant == "fp32"
    m.verify_files(d)
    check_out_dir(d)  # a rerun takes it


def test_a_manifest_listing_a_file_in_the_staging_directory_is_refused(tiny_glm4_bundle, tmp_path):
    """A journal listed as an artifact (a server's manifest, downloaded into an edge bundle by bundle_sync) would be
    finished into the bundle at its next load: no artifact lives in the staging directory."""
    import json

    from shared.manifest import JOURNAL, STAGING, BundleError

    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)
    raw = json.loads((d / MANIFEST_NAME).read_text())
    raw["artifacts"][f"{STAGING}/{JOURNAL}"] = {"sha256": "0" * 64, "bytes": 1, "role": "edge"}
    (d / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(BundleError, match="expected a relative path inside the bundle"):
        Manifest.load(d)
