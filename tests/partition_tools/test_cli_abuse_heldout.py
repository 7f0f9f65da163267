"""Held-out abuse cases for ``autoglm-partition`` (and ``autoglm-rig``'s inputs): every bad flag, environment
value, output path or hand-edited manifest ends in one line on stderr and exit status 2, never a traceback,
and before any slow work (loading a model, measuring)."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest

from partition_tools.cli import main


def _fails_in_one_line(argv, capsys, match):
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors (a bad int in a flag or its environment twin)
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and match in err.splitlines()[-1] and "Traceback" not in err, err
    return err


def test_split_out_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1", "--out", str(f)], capsys,
                       "exists and is not a directory")
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1", "--out", str(f / "sub")], capsys,
                       "is not a directory")


def _empty_folder_that_takes_no_files() -> Path | None:
    """An empty folder no process, root included, can make a file in: sysfs's (a read-only mount's stand-in)."""
    import os

    for d in sorted(Path("/sys/class").iterdir()) if Path("/sys/class").is_dir() else []:
        try:
            if d.is_dir() and not any(d.iterdir()):
                os.mkdir(d / "probe")
                os.rmdir(d / "probe")
        except OSError:
            return d
    return None


def test_split_into_a_folder_that_takes_no_files_is_refused_before_loading(capsys, monkeypatch):
    """An existing --out on a read-only mount (or another user's folder) passed the checks: the model loaded and the
    bundle was written beside it, then moving it in ended in an OSError traceback (Read-only file system)."""
    import partition_tools.models as models

    folder = _empty_folder_that_takes_no_files()
    if folder is None:
        pytest.skip("no empty sysfs folder here")
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1", "--out", str(folder)], capsys,
                       f"--out {folder}: cannot write in ")
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1", "--out", str(folder / "sub" / "b")],
                       capsys, f"--out {folder / 'sub' / 'b'}: cannot write in {folder} (")


def test_split_refuses_a_foreign_directory_before_loading(tmp_path, capsys, monkeypatch):
    import partition_tools.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    (tmp_path / "mine.txt").write_text("keep me")
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1", "--out", str(tmp_path)], capsys,
                       "refusing to overwrite")
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_split_keeps_files_that_are_not_the_earlier_bundles(tiny_glm4_bundle, tmp_path, capsys, monkeypatch):
    """An earlier bundle at --out is replaced whole: a file kept beside its artifacts (notes, the source .gguf
    itself) was deleted with it."""
    import partition_tools.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)
    (d / "edge" / "notes.txt").write_text("keep me")
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1", "--out", str(d)], capsys,
                       "holds 1 file(s) not of its bundle (e.g. edge/notes.txt); refusing to overwrite")
    (d / "manifest.json").write_text("{}")
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1", "--out", str(d)], capsys,
                       "its manifest.json does not list a bundle's files")
    assert (d / "edge" / "notes.txt").read_text() == "keep me"


def test_split_over_a_bundle_a_running_edge_client_holds_is_refused(tiny_glm4_bundle, tmp_path, capsys, monkeypatch):
    """split --out an earlier bundle replaced its files in place under a running edge client (which holds its version,
    bundle_sync.HeldVersion, and reads its encoders and drafter from it on demand), though an update never touches
    a held version; now refused before the model loads, and the swap itself takes the version's lock."""
    import partition_tools.models as models
    from edge_client.bundle_sync import HeldVersion

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)
    before = (d / "manifest.json").read_bytes()
    held = HeldVersion(d)
    try:
        _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "2", "--out", str(d)], capsys,
                           f"--out {d}: a running edge client holds this bundle")
    finally:
        held.close()
    assert (d / "manifest.json").read_bytes() == before


def test_a_bundle_that_does_not_fit_is_one_line_and_leaves_nothing(tmp_path):
    """A disk that fills up mid-split (here the file size limit, ulimit -f: the same refusal of a write) ended in an
    OSError or SafetensorError traceback after all the work; the fp32 front went to /tmp, not --out's disk."""
    import subprocess
    import sys

    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, resource.RLIM_INFINITY)); "
            "from partition_tools.cli import main; sys.exit(main(sys.argv[1:]))")
    out = tmp_path / "b"
    r = subprocess.run([sys.executable, "-c", code, "split", "--preset", "tiny-glm4", "--layer", "1", "--edge-quant",
                        "fp32", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f"autoglm-partition split: error: --out {out}: the bundle does not fit "
                                                 "(File too large); make room and split again")
    assert list(tmp_path.iterdir()) == []  # neither the bundle nor its staging directory


@contextlib.contextmanager
def _tmpfs(path: Path, kib: int):
    """A tmpfs of ``kib`` KiB mounted at ``path`` (made) until the block ends: a mount point of its own file system;
    skipped where this process may not mount one (not root)."""
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_split_into_a_mount_point_writes_on_its_file_system(tiny_glm4_bundle, tmp_path, capsys):
    """--out a mount point holding an earlier bundle: the bundle was staged beside it (another file system) and copied
    in after the earlier one was removed; a copy that ran out of room left --out partial, the earlier bundle gone, and
    the 'split again' the error advised refused the folder ('exists and is not a bundle'). It is staged inside --out:
    the earlier bundle stays whole, nothing is left, and a parent that takes no files (/mnt of a mounted disk, here
    read-only: it was refused 'cannot write in') no longer matters."""
    import subprocess

    from shared.manifest import Manifest

    with _tmpfs(tmp_path / "ro", 64) as parent:
        with _tmpfs(parent / "disk", sum(f.stat().st_size for f in tiny_glm4_bundle.rglob("*") if f.is_file()) // 1024
                    + 96) as disk:
            subprocess.run(["mount", "-o", "remount,ro", str(parent)], check=True)  # under the mounted disk
            shutil.copytree(tiny_glm4_bundle, disk, dirs_exist_ok=True)
            before = Manifest.load(disk).bundle_id
            _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "2", "--edge-quant", "fp32", "--out",
                                str(disk)], capsys, "the bundle does not fit (No space left on device); make room (the earlier bundle at --out is kept until the new one is written)")
            assert Manifest.load(disk).bundle_id == before  # the earlier bundle, whole
            Manifest.load(disk).verify_files(disk)
            assert sorted(p.name for p in disk.iterdir()) == sorted(p.name for p in tiny_glm4_bundle.iterdir())


def test_a_draft_head_while_another_writes_the_bundle_is_refused(tiny_glm4_bundle, tmp_path, capsys, monkeypatch):
    """Two draft-heads at once on one bundle (the head and the cloud table, run side by side) both said they added
    theirs: each saved the manifest it had read, and the later dropped the other's drafter from it (its file left
    unlisted, which a later split --out refuses). One command writes a bundle at a time (split.writing)."""
    import partition_tools.models as models
    from partition_tools.split import writing

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)
    with writing(d):  # another draft-head's, or a split's into it
        for kind in ([], ["--cloud"]):
            _fails_in_one_line(["draft-head", str(d), *kind], capsys,
                               f"{d}: another autoglm-partition split or draft-head is writing this bundle")
        _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1", "--out", str(d)], capsys,
                           f"--out {d}: another autoglm-partition split or draft-head is writing this bundle")
    assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in tiny_glm4_bundle.iterdir())


def test_a_draft_head_on_a_bundle_a_running_edge_client_holds_is_refused(tiny_glm4_bundle, tmp_path, capsys,
                                                                        monkeypatch):
    """draft-head changed a bundle's files in place under a running edge client (bundle_sync.HeldVersion), which
    split --out refuses: refused before the model loads, and again as its files go in (a client opened meanwhile),
    the bundle as it was."""
    import partition_tools.models as models
    from edge_client.bundle_sync import HeldVersion
    from partition_tools.split import add_files, writing
    from shared.manifest import CLOUD_DRAFT_INPUTS, BundleError, Manifest

    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)
    load = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    held = HeldVersion(d)
    try:
        for kind in ([], ["--cloud"], ["--layers", "2"]):
            _fails_in_one_line(["draft-head", str(d), *kind], capsys,
                               f"{d}: a running edge client holds this bundle (its files must not change under it); "
                               "close it first")
        monkeypatch.setattr(models, "load_model", load)
        with writing(d) as staged:
            (staged / "cloud").mkdir()
            (staged / CLOUD_DRAFT_INPUTS).write_bytes(b"x")
            with pytest.raises(BundleError, match="a running edge client holds this bundle"):
                add_files(d, staged, Manifest.load(d))
    finally:
        held.close()
    assert sorted(p.relative_to(d) for p in d.rglob("*")) == sorted(p.relative_to(tiny_glm4_bundle)
                                                                    for p in tiny_glm4_bundle.rglob("*"))


@pytest.mark.parametrize("fails_at", ["the agreement", "the manifest"])
def test_a_draft_head_that_fails_leaves_the_bundle_as_it_was(fails_at, tiny_glm4_bundle, tmp_path, capsys,
                                                             monkeypatch):
    """A draft-head that failed mid-way (an error, no room for the manifest) left its new drafter file in the
    bundle: unlisted, or over the earlier drafter whose hash the manifest still gave (verify, inspect and loading
    failed). Its files are written aside and put in with the manifest, all or nothing."""
    import hashlib

    import partition_tools.cloud_drafter as cloud_drafter
    from shared.manifest import Manifest

    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)

    def state():
        return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(d.rglob("*")) if p.is_file()}

    for earlier in (False, True):  # a bundle without a drafter, then one with an earlier one
        if earlier:
            assert main(["draft-head", str(d), "--cloud"]) == 0
            capsys.readouterr()
        before = state()
        with monkeypatch.context() as m:
            if fails_at == "the agreement":
                m.setattr(cloud_drafter, "agreement", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
            else:
                m.setattr(Manifest, "save", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
            with contextlib.suppress(RuntimeError):  # (an internal error: its traceback)
                assert main(["draft-head", str(d), "--cloud"]) != 0
        capsys.readouterr()
        assert state() == before and not (d / ".autoglm-split.partial").exists()
        Manifest.load(d).verify_files(d)


def test_draft_head_on_a_full_disk_is_one_line_and_keeps_the_bundle(tiny_glm4_bundle, tmp_path, capsys):
    """draft-head writing into a bundle on a disk that filled up ended in an OSError traceback ('No space left on
    device'); and a manifest rewrite cut short by it left the bundle's manifest truncated (shared.manifest: saved
    whole or not at all)."""
    from shared.manifest import Manifest

    with _tmpfs(tmp_path / "disk", 2048) as disk:
        shutil.copytree(tiny_glm4_bundle, disk / "b")
        import os

        st = os.statvfs(disk)
        with open(disk / "filler", "wb") as f:  # room for 16 pages: not the 65,664-byte drafter table
            os.posix_fallocate(f.fileno(), 0, (st.f_bavail - 16) * st.f_frsize)
        _fails_in_one_line(["draft-head", str(disk / "b"), "--cloud"], capsys,
                           f"{disk / 'b'}: the drafter does not fit (No space left on device); make room and run "
                           "draft-head again")
        Manifest.load(disk / "b").verify_files(disk / "b")


def test_a_second_split_into_the_same_out_is_refused_naming_it(tiny_glm4_bundle, tmp_path, capsys):
    """Two splits into one --out: the later to finish replaced the other's bundle (both said 'bundle ... -> out'), and
    one checking the folder while the other moved its bundle in was told a running edge client held it. A split holds
    its staging directory until it ends; another split into the folder is refused, naming what runs."""
    from partition_tools.split import _staging, _staging_path

    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)
    for out in (d, tmp_path / "new"):  # an earlier bundle (staged inside it), a folder to make (staged beside)
        with _staging(out.absolute(), f"--out {out}") as staged:
            assert staged == _staging_path(out.absolute())
            _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1", "--out", str(out)], capsys,
                               f"--out {out}: another autoglm-partition split or draft-head is writing this bundle")
        assert not staged.exists()
    (d / ".autoglm-split.partial" / "edge").mkdir(parents=True)  # a killed split's leftovers: cleared
    (d / ".autoglm-split.partial" / "edge" / "front.onnx").write_bytes(b"x")
    assert main(["split", "--preset", "tiny-glm4", "--layer", "1", "--out", str(d)]) == 0
    assert not (d / ".autoglm-split.partial").exists()


def test_split_layers_the_model_lacks_are_refused_before_it_loads(llama_dir, tmp_path, capsys, monkeypatch):
    """--layer / --tail were checked against the loaded model: glm4v-9b-random --layer 40 built a 9B model (minutes,
    ~18 GB) to say 'must be between 1 and 39'; a checkpoint directory's config tells it without the weights, a GGUF
    file's metadata too (a .gguf, the smollm2 preset's: checked only after the load, a minute for SmolLM2)."""
    import partition_tools.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    out = str(tmp_path / "b")
    _fails_in_one_line(["split", "--preset", "glm4v-9b-random", "--layer", "40", "--out", out], capsys,
                       "--layer 40: must be between 1 and 39 (the model has 40 layers)")
    _fails_in_one_line(["split", str(llama_dir), "--layer", "1", "--tail", "2", "--out", out], capsys,
                       "--tail 2 with --layer 1: the cloud must keep at least one of the 3 layers")
    gguf = _tiny_gguf(tmp_path / "m.gguf")
    _fails_in_one_line(["split", str(gguf), "--layer", "2", "--out", out], capsys,
                       "--layer 2: must be between 1 and 1 (the model has 2 layers)")
    _fails_in_one_line(["split", str(gguf), "--layer", "1", "--tail", "1", "--out", out], capsys,
                       "--tail 1 with --layer 1: the cloud must keep at least one of the 2 layers")


def test_split_vision_quant_for_a_model_without_a_vision_tower(llama_dir, tmp_path, capsys, monkeypatch):
    """--vision-quant int8/fp32 on a text-only model was ignored without a word (the bundle had no vision tower); it
    is refused, and from the config, before the weights load (a 9B GLM-4 checkpoint: minutes)."""
    import partition_tools.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1", "--vision-quant", "fp32", "--out",
                        str(tmp_path / "b")], capsys, "--vision-quant fp32: tiny-glm4 has no vision tower")
    _fails_in_one_line(["split", str(llama_dir), "--layer", "1", "--vision-quant", "int8", "--out",
                        str(tmp_path / "b")], capsys, f"--vision-quant int8: {llama_dir} has no vision tower")
    _fails_in_one_line(["split", str(_tiny_gguf(tmp_path / "m.gguf")), "--layer", "1", "--vision-quant", "int8",
                        "--out", str(tmp_path / "b")], capsys, "has no vision tower")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("seed", ["-1", str(1 << 64)])
def test_a_seed_out_of_range_is_refused(seed, tmp_path, capsys):
    """--seed -1 split a bundle that verify, draft-head and plan could not reload (they read the seed back from the
    identity as 0: 'not the bundle's source'); a seed past 64 bits was a ValueError traceback from torch."""
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1", "--seed", seed, "--out",
                        str(tmp_path / "b")], capsys, f"--seed {seed}: expected 0 to {(1 << 64) - 1}")
    assert not (tmp_path / "b").exists()


def test_bad_environment_twins_are_usage_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AUTOGLM_PARTITION_TAIL", "x")
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1", "--out", str(tmp_path / "b")], capsys,
                       "argument --tail: invalid int value: 'x'")
    monkeypatch.setenv("AUTOGLM_PARTITION_EDGE_MEMORY_MB", "lots")
    _fails_in_one_line(["plan", "tiny-glm4"], capsys, "argument --edge-memory-mb: invalid float value")


def test_a_path_under_home_from_the_environment_is_the_home(tmp_path, capsys, monkeypatch):
    """AUTOGLM_PARTITION_OUT=~/b (a unit file's or Dockerfile's ENV: no shell expands it) split into a folder named
    '~' in the working directory; --cloud-results and the other path twins were looked for there too."""
    import partition_tools.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "b").write_text("a file, not a bundle")
    monkeypatch.setenv("AUTOGLM_PARTITION_OUT", "~/b")
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1"], capsys,
                       f"--out {tmp_path / 'home' / 'b'}: exists and is not a directory")
    (tmp_path / "home" / "gpu.json").write_text("not json")
    monkeypatch.setenv("AUTOGLM_PARTITION_CLOUD_RESULTS", "~/gpu.json")
    _fails_in_one_line(["plan", "tiny-glm4"], capsys, f"--cloud-results {tmp_path / 'home' / 'gpu.json'}: not JSON")
    assert not (tmp_path / "~").exists()


def test_drafters_a_bundle_cannot_take_are_refused_before_the_model_loads(tiny_glm4_bundle, tiny_glm4_ushape_bundle,
                                                                          capsys, monkeypatch):
    """draft-head --layers past the model's, a --budget over the cloud's layers, any drafter for a u-shape bundle:
    each said so only after the source loaded (minutes for a 9B model) - the budget after the calibration too -
    though the manifest tells it."""
    import partition_tools.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    b = str(tiny_glm4_bundle)  # split at 2 of 4 layers
    _fails_in_one_line(["draft-head", b, "--layers", "2,9"], capsys, "draft layers [2, 9]: need distinct cloud layers "
                       "of [2, 4)")
    _fails_in_one_line(["draft-head", b, "--layers", "auto", "--budget", "3"], capsys,
                       "draft layers budget 3: the cloud has 2 layers")
    for kind in ([], ["--cloud"], ["--layers", "auto"]):
        _fails_in_one_line(["draft-head", str(tiny_glm4_ushape_bundle), *kind], capsys,
                           "a u-shape bundle (split with --tail) drafts by prompt lookup only")


def test_draft_head_flags_the_drafter_asked_for_does_not_take_are_refused(tiny_glm4_bundle, capsys, monkeypatch):
    """--cloud --quant int4 wrote the float16 table and --budget without --layers auto (a lens, the cloud drafter,
    given layers) was dropped, each with exit 0 and no word: the user got another drafter than the one asked for."""
    import partition_tools.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    b = str(tiny_glm4_bundle)
    _fails_in_one_line(["draft-head", b, "--cloud", "--quant", "int4"], capsys, "--quant int4 is not for --cloud")
    for kind in ([], ["--cloud"], ["--layers", "3"]):
        _fails_in_one_line(["draft-head", b, *kind, "--budget", "1"], capsys, "--budget is for --layers auto")
    monkeypatch.setenv("AUTOGLM_PARTITION_QUANT", "fp32")  # an environment twin is a flag given too, as --vocab's
    _fails_in_one_line(["draft-head", b, "--cloud"], capsys, "--quant fp32 is not for --cloud")


def test_an_empty_path_twin_is_unset(tiny_glm4_bundle, tmp_path, capsys, monkeypatch):
    """AUTOGLM_PARTITION_TEXT="" (a unit file's empty value) is no --text, not the working directory ('.')."""
    monkeypatch.setenv("AUTOGLM_PARTITION_TEXT", "")
    monkeypatch.setenv("AUTOGLM_PARTITION_SOURCE", "")
    _fails_in_one_line(["draft-head", str(tiny_glm4_bundle), "--cloud", "--layers", "1"], capsys,
                       "--cloud takes neither --layers nor --vocab")
    # AUTOGLM_PARTITION_OUT="" (or --out ''): split wrote the bundle into the working directory
    monkeypatch.setenv("AUTOGLM_PARTITION_OUT", "")
    monkeypatch.chdir(tmp_path)
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1"], capsys, "split needs --layer N and --out DIR")
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1", "--out", ""], capsys,
                       "split needs --layer N and --out DIR")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flags, match", [
    (["--edge-threads", "0"], "threads must be >= 1"),
    (["--edge-threads", "100000"], "threads must be >= 1 and <= 256"),  # onnxruntime took minutes to start them
    (["--cloud-threads", "1000000"], "threads must be >= 1 and <= 256"),  # torch crashed the process (SIGSEGV)
    (["--codec", "bogus"], "--codec 'bogus'"),
    (["--codec", "pca-fine"], "--codec 'pca-fine'"),  # the planner sizes no basis codec
    (["--edge-memory-mb", "-1"], "--edge-memory-mb -1: expected > 0"),
    (["--edge-memory-mb", "inf"], "--edge-memory-mb inf: expected > 0 and finite"),  # --json printed Infinity
    (["--edge-memory-mb", "1e400"], "--edge-memory-mb inf: expected > 0 and finite"),
    (["--candidates", "a,b"], "expected split layers, comma-separated"),
    (["--candidates", "0"], "expected split layers >= 1"),
    (["--candidates", "2,99"], "the model has 4 layers"),
])
def test_plan_bad_flags(flags, match, capsys):
    _fails_in_one_line(["plan", "tiny-glm4", *flags], capsys, match)


def test_plan_candidates_the_model_lacks_are_refused_before_it_loads(llama_dir, tmp_path, capsys, monkeypatch):
    """plan --candidates past the model's layers was said after the load (SmolLM2's GGUF: 38 s; minutes for a 9B
    model); the config or the GGUF metadata tells it first, as for split --layer."""
    import partition_tools.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    _fails_in_one_line(["plan", str(llama_dir), "--candidates", "1,3"], capsys,
                       "--candidates 3: the model has 3 layers (split layers 1 to 2)")
    _fails_in_one_line(["plan", str(_tiny_gguf(tmp_path / "m.gguf")), "--candidates", "2"], capsys,
                       "--candidates 2: the model has 2 layers (split layers 1 to 1)")


def test_plan_refuses_a_bundle_of_another_model(tiny_glm4_bundle, capsys, monkeypatch):
    """--bundle split from another model: its front was timed as this model's layers, and the plan built on it."""
    import partition_tools.plan as plan

    monkeypatch.setattr(plan, "edge_layer_times", lambda *a, **k: pytest.fail("timed the other model's front"))
    _fails_in_one_line(["plan", "tiny-glm4v", "--bundle", str(tiny_glm4_bundle)], capsys,
                       "split from another model (preset:tiny-glm4@seed0, not preset:tiny-glm4v@seed0)")


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.__setitem__("artifacts", None), "artifacts: expected a JSON object"),
    (lambda m: m.__setitem__("split_layer", "2"), "split_layer '2': expected an integer"),
    (lambda m: m["artifacts"]["edge/front.onnx"].__setitem__("bytes", "abc"), "bytes 'abc'"),
    (lambda m: m["artifacts"]["edge/front.onnx"].__setitem__("role", "zzz"), "role 'zzz'"),
    (lambda m: m["artifacts"].__setitem__("../../etc/passwd", {"sha256": "0" * 64, "bytes": 1, "role": "edge"}),
     "expected a relative path inside the bundle"),
    # outside the bundle id, so the edit loaded: verify's KeyError traceback (its thresholds), the edge's TypeError
    (lambda m: m.__setitem__("edge_quant", "int3"), "edge_quant 'int3': expected one of fp32, int8, int4"),
    (lambda m: m["quant_report"].__setitem__("prefill", "fp32"), "quant_report.prefill 'fp32'"),
    # Python's json reads NaN, JSON has none: inspect --json printed a report no JSON parser reads
    (lambda m: m["quant_report"].__setitem__("alpha", float("nan")), "not valid JSON (NaN is not a JSON value)"),
    # a bundle of a later release: Python's "Manifest.__init__() got an unexpected keyword argument", or a bare
    # "format version 2, expected 1"
    (lambda m: m.__setitem__("edge_kv_layout", "x"),
     "malformed manifest (unknown field(s) edge_kv_layout: a manifest of a newer autoglm-partition?)"),
    (lambda m: m.pop("rope"), "malformed manifest (missing field(s) rope)"),
    (lambda m: m.__setitem__("format_version", 2),
     "format version 2, expected 1 (written by a newer autoglm-partition: upgrade autoglm-split to read it)"),
])
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_edited_manifest_is_one_line_naming_it(edit, match, command, tiny_glm4_bundle, tmp_path, capsys):
    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)
    m = json.loads((d / "manifest.json").read_text())
    edit(m)
    (d / "manifest.json").write_text(json.dumps(m))
    assert str(d / "manifest.json") in _fails_in_one_line([command, str(d)], capsys, match)


@pytest.mark.parametrize("edit", [lambda q: q.pop("block_size"), lambda q: q.__setitem__("outlier_channels", 8),
                                  lambda q: q.__setitem__("smoothing", "yes")])
def test_inspect_of_an_edited_recipe_says_so(edit, tiny_glm4_bundle, tmp_path, capsys):
    """quant_report is outside the bundle id, so an edited one loads - and inspect, where such a bundle is looked
    into, stopped on it with a KeyError / TypeError traceback."""
    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)
    m = json.loads((d / "manifest.json").read_text())
    edit(m["quant_report"])
    (d / "manifest.json").write_text(json.dumps(m))
    assert main(["inspect", str(d)]) == 0
    assert "edge quant int8 (quant_report not as split writes it (edited?))" in capsys.readouterr().out


def test_inspect_counts_a_cloud_drafter_table(tiny_glm4_bundle, tmp_path, capsys):
    """The cloud drafter's role ("cloud-draft", outside the bundle id) made inspect raise KeyError."""
    from shared.manifest import Manifest

    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)
    (d / "cloud" / "draft_inputs.npy").write_bytes(b"\0" * 1000)
    m = Manifest.load(d)
    m.add_artifact(d, "cloud/draft_inputs.npy", "cloud-draft")
    m.save(d)
    assert main(["inspect", str(d), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["integrity"] == "ok" and r["bytes"]["cloud"] >= 1000


def test_rig_scenario_that_is_not_utf8(tmp_path, capsys):
    from rig.cli import main as rig_main

    p = tmp_path / "s.yaml"
    p.write_bytes(b"\xff\xfe\x00name: x\n")
    assert rig_main(["run", str(p)]) == 2
    err = capsys.readouterr().err
    assert "not UTF-8 text" in err and "Traceback" not in err


def test_rig_bad_threads_environment_twin(capsys, monkeypatch):
    from rig.cli import main as rig_main

    monkeypatch.setenv("AUTOGLM_RIG_THREADS", "abc")
    with pytest.raises(SystemExit) as e:
        rig_main(["demo"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --threads: expected an integer in [1, 256], got 'abc'" in err


def test_a_fake_gguf_and_a_missing_audio_encoder_are_one_line(tmp_path, capsys):
    """A .gguf that is no GGUF file (transformers' ValueError) and an --audio-encoder directory without its
    files (AudioEncoderError) ended in tracebacks."""
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file")
    _fails_in_one_line(["split", str(fake), "--layer", "1", "--out", str(tmp_path / "o1")], capsys,
                       "not a GGUF file")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00cut")
    _fails_in_one_line(["split", str(truncated), "--layer", "1", "--out", str(tmp_path / "o2")], capsys,
                       "cannot load GGUF")
    _fails_in_one_line(["split", "--preset", "tiny-glm4", "--layer", "1", "--audio-encoder", str(tmp_path / "none"),
                        "--out", str(tmp_path / "o3")], capsys, "no config.json")


def test_rig_scenario_naming_no_bundle(tmp_path, capsys, monkeypatch):
    """A scenario's bundle that is no bundle: the run's cloud server exited at once and the rig stopped with a
    RuntimeError traceback; now refused with the scenario, before anything starts."""
    import rig.runner as runner
    from rig.cli import main as rig_main

    monkeypatch.setattr(runner, "run_scenario", lambda *a, **k: pytest.fail("the run started"))
    p = tmp_path / "s.yaml"
    p.write_text(f"bundle: {tmp_path / 'nope'}\nphones: 1\n")
    assert rig_main(["run", str(p), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "not a bundle (no manifest.json)" in err and "Traceback" not in err


def test_a_checkpoint_lacking_tensors_is_refused(llama_dir, tmp_path, capsys):
    """A config.json of more layers than the weight files hold (or a shard gone from the index): transformers
    filled the missing tensors with random values and only warned, and split wrote a bundle, exit 0."""
    d = tmp_path / "ckpt"
    shutil.copytree(llama_dir, d)
    config = json.loads((d / "config.json").read_text())
    config["num_hidden_layers"] += 2
    (d / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["split", str(d), "--layer", "1", "--out", str(tmp_path / "b")]) == 2
    # the last line, not the whole of stderr: transformers' logger may hold an earlier test's closed capture stream
    assert "its weights lack 18 of the model's tensors (e.g. model.layers.3." in \
        capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "b").exists()


def test_the_manifest_names_a_relative_source_by_its_absolute_path(llama_dir, tmp_path, monkeypatch, capsys):
    """A source given relative to the working directory was recorded as given, so verify and draft-head (which
    reload the manifest's source) run from any other folder failed: 'ckpt: no such preset, directory or file'."""
    from shared.manifest import Manifest

    shutil.copytree(llama_dir, tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    assert main(["split", "ckpt", "--layer", "1", "--edge-quant", "fp32", "--out", "b"]) == 0
    assert Manifest.load(tmp_path / "b").source == str(tmp_path / "ckpt")
    # moved since: the error says it is the model the bundle was split from, and what to pass
    (tmp_path / "ckpt").rename(tmp_path / "moved")
    for command in (["verify", "b"], ["draft-head", "b", "--cloud"]):
        err = _fails_in_one_line(command, capsys, f"the model b was split from: {tmp_path / 'ckpt'}: no such preset")
        assert err.endswith("; give its path with --source")


@pytest.mark.parametrize("edit, match", [
    (None, "not JSON"),
    (lambda d: d["fast"]["1"].__setitem__("prefill_tokens_per_s", 0), "prefill_tokens_per_s 0: expected a number > 0"),
    (lambda d: d.__setitem__("step_ms_s1", float("nan")), "step_ms_s1 nan: expected a number > 0"),
    (lambda d: d.__setitem__("step_ms_s1", -5), "step_ms_s1 -5: expected a number > 0"),
    (lambda d: d["model"].__setitem__("num_layers", 0), "model.num_layers 0: expected a number > 0"),
])
def test_plan_cloud_results_that_are_no_measurements(edit, match, tmp_path, capsys, monkeypatch):
    """--cloud-results that is not JSON, or whose figures are 0, negative or NaN: a JSONDecodeError or
    ZeroDivisionError traceback after the edge was measured, or a plan of 'nan ms' rows picking its first split."""
    from pathlib import Path

    import partition_tools.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    f = tmp_path / "cloud_gpu.json"
    if edit is None:
        f.write_text("not json")
    else:
        data = json.loads((Path(__file__).parents[2] / "docs" / "results" / "cloud_gpu.json").read_text())
        edit(data)
        f.write_text(json.dumps(data))
    _fails_in_one_line(["plan", "tiny-glm4", "--cloud-results", str(f)], capsys, match)


def test_plan_cloud_results_that_is_no_file_names_the_flag(tmp_path, capsys):
    """--cloud-results naming a folder or nothing: "[Errno 21] Is a directory: '...'", no flag named."""
    _fails_in_one_line(["plan", "tiny-glm4", "--cloud-results", str(tmp_path)], capsys,
                       f"--cloud-results {tmp_path}: Is a directory")
    _fails_in_one_line(["plan", "tiny-glm4", "--cloud-results", str(tmp_path / "none.json")], capsys,
                       f"--cloud-results {tmp_path / 'none.json'}: No such file or directory")


def test_verify_more_tokens_than_the_edge_graph_holds(tiny_glm4_bundle, capsys, monkeypatch):
    """--max-tokens past the model's context (2,048 positions): the reference ran, then the edge graph raised
    FrontError as a traceback, exit 1; now one line, before the model loads."""
    import partition_tools.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    _fails_in_one_line(["verify", str(tiny_glm4_bundle), "--max-tokens", "3000"], capsys,
                       "--max-tokens 3000: the bundle's edge graph holds 2048 positions")


def test_verify_of_a_model_of_a_short_context_scores_what_it_holds(tiny_glm4_bundle, tmp_path, capsys):
    """Without --max-tokens, a bundle whose edge graph holds 512 positions (a checkpoint of a 512-token context; here
    tiny-glm4's graph says so): the default 1024 was refused ('--max-tokens 1024: the bundle's edge graph holds 512
    positions', exit 2) - a flag never given; it scores the 512 the graph holds."""
    bundle = _holding_512_positions(tiny_glm4_bundle, tmp_path / "b")
    assert main(["verify", str(bundle), "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["tokens"] == 512


def _holding_512_positions(bundle: Path, out: Path) -> Path:
    """A copy of ``bundle`` at ``out`` whose edge graph says it holds 512 positions, as a checkpoint of a 512-token
    context's does (its manifest re-hashed: the edge graph is outside the bundle id)."""
    import onnx

    from edge_client.front import MAX_POSITIONS_KEY
    from shared.manifest import Manifest

    shutil.copytree(bundle, out)
    graph = onnx.load(str(out / "edge/front.onnx"))
    for prop in graph.metadata_props:
        if prop.key == MAX_POSITIONS_KEY:
            prop.value = "512"
    onnx.save(graph, str(out / "edge/front.onnx"))
    m = Manifest.load(out)
    m.add_artifact(out, "edge/front.onnx", "edge")
    m.save(out)
    return out


def test_plan_of_a_model_of_a_context_shorter_than_its_agent_step_is_one_line(tiny_glm4_bundle, tmp_path, capsys):
    """A front of 512 positions (a checkpoint of a 512-token context): plan timed its decode at the agent step's 792
    tokens of context, a FrontError traceback ('792 positions exceed the edge graph's 512')."""
    bundle = _holding_512_positions(tiny_glm4_bundle, tmp_path / "b")
    _fails_in_one_line(["plan", "tiny-glm4", "--bundle", str(bundle)], capsys,
                       "the model's edge graph holds 512 positions (its context), fewer than the 793 plan times")


def _tiny_gguf(path, blocks_written: int = 2):
    """A 2-layer llama GGUF of random weights and a 64-token vocabulary; layers from ``blocks_written`` on left out."""
    import numpy as np
    from gguf import GGUFWriter

    h, f, v = 32, 64, 64
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(128), w.add_embedding_length(h), w.add_block_count(2), w.add_feed_forward_length(f)
    w.add_head_count(2), w.add_head_count_kv(1), w.add_layer_norm_rms_eps(1e-5), w.add_rope_dimension_count(16)
    w.add_tokenizer_model("llama"), w.add_token_list([f"t{i}" for i in range(v)]), w.add_token_scores([0.0] * v)
    w.add_token_types([1] * v), w.add_bos_token_id(1), w.add_eos_token_id(2)
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,), "output.weight": (v, h)}
    for i in range(blocks_written):
        shapes.update({f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.attn_q.weight": (h, h),
                       f"blk.{i}.attn_k.weight": (16, h), f"blk.{i}.attn_v.weight": (16, h),
                       f"blk.{i}.attn_output.weight": (h, h), f"blk.{i}.ffn_norm.weight": (h,),
                       f"blk.{i}.ffn_gate.weight": (f, h), f"blk.{i}.ffn_up.weight": (f, h),
                       f"blk.{i}.ffn_down.weight": (h, f)})
    for name, shape in shapes.items():
        w.add_tensor(name, np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.mark.parametrize("blocks, match", [
    # transformers filled the missing layer with random values, and split wrote the bundle
    (1, "its weights lack 9 of the model's tensors (e.g. model.layers.1."),
    # a vocabulary that turns the sample text into a few tokens: a ValueError traceback from the codec calibration
    (2, "token(s); the codec calibration needs at least 1040"),
])
def test_a_gguf_split_cannot_use_is_refused(blocks, match, tmp_path, capsys):
    source = _tiny_gguf(tmp_path / "m.gguf", blocks)
    capsys.readouterr()
    assert main(["split", str(source), "--layer", "1", "--out", str(tmp_path / "b")]) == 2
    assert match in capsys.readouterr().err.strip().splitlines()[-1]  # (the last line: see the test above)
    assert not (tmp_path / "b").exists()


def test_no_library_progress_bars_off_a_terminal(llama_dir, tmp_path):
    """split's steps are quiet when stderr is no terminal (a CI log), but transformers' 'Loading weights' bar (and a
    GGUF's 'Converting and de-quantizing') still wrote its carriage-return lines there; AUTOGLM_PROGRESS=1 keeps both."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "AUTOGLM_PROGRESS"}
    r = subprocess.run([sys.executable, "-m", "partition_tools.cli", "split", str(llama_dir), "--layer", "1",
                        "--edge-quant", "fp32", "--out", str(tmp_path / "b")], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_a_checkpoint_with_another_models_tokenizer_is_refused(llama_dir, tmp_path, capsys):
    """A tokenizer of more ids than the model's 300 embedding rows saved beside it: split's calibration text indexed
    past the table, an onnxruntime Gather traceback ('indices element out of data bounds')."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from partition_tools.split import sample_text

    words = sorted(set(sample_text().split()))[:200]
    vocab = {**{f"t{i}": i for i in range(300)}, **{w: 300 + i for i, w in enumerate(words)}, "[UNK]": 500}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    d = tmp_path / "ckpt"
    shutil.copytree(llama_dir, d)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(d)
    capsys.readouterr()
    assert main(["split", str(d), "--layer", "1", "--out", str(tmp_path / "b")]) == 2
    assert f"{d}: its tokenizer has ids up to 500, the model's vocabulary 300" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    # the model's own vocabulary with a [PAD] added past the table (no text becomes it) is the model's tokenizer
    own = Tokenizer(models.WordLevel({f"t{i}": i for i in range(299)} | {"[UNK]": 299}, unk_token="[UNK]"))
    shutil.rmtree(d)
    shutil.copytree(llama_dir, d)
    fast = PreTrainedTokenizerFast(tokenizer_object=own, unk_token="[UNK]")
    fast.add_special_tokens({"pad_token": "[PAD]"})
    fast.save_pretrained(d)
    from partition_tools.models import load_model

    assert len(load_model(str(d)).tokenizer) == 301


def test_a_checkpoint_whose_tokenizer_does_not_load_is_refused(llama_dir, tmp_path, capsys):
    """A tokenizer.json that does not parse was taken for no tokenizer: split wrote a bundle that takes no text,
    exit 0, and verify --text then ended in a ValueError traceback ('has no tokenizer')."""
    d = tmp_path / "ckpt"
    shutil.copytree(llama_dir, d)
    (d / "tokenizer.json").write_text("garbage")
    capsys.readouterr()
    assert main(["split", str(d), "--layer", "1", "--out", str(tmp_path / "b")]) == 2
    assert "its tokenizer files do not load (" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "b").exists()
