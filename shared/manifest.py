"""The bundle manifest: what a split bundle holds and the id that ties its two halves together.

A bundle directory looks like::

    manifest.json
    edge/front.onnx            embeddings + layers [0, N), KV cache in/out (see partition_tools.export)
    edge/tail.onnx             u-shape bundles only (``split --tail M``): layers [L - M, L), final norm, lm_head
    edge/draft_head.onnx       optional (``autoglm-partition draft-head``): boundary state -> draft token
    edge/tokenizer.json ...    tokenizer files and chat_template.jinja (when the source has them)
    cloud/back.safetensors     layers [N, L) renumbered from 0, final norm, lm_head (u-shape: [N, L - M) only)
    cloud/config.json          the source's full HF config (the cloud rebuilds its modules from it)
    cloud/generation_config.json  the source's generation config: the eos_token_ids' origin, so the id covers them
    calibration.json           boundary statistics: outlier channels, attention-sink threshold

``bundle_id`` is a hash over the model description and the sha256 of every artifact *except* the edge
graph's quantization variant, so an int8 and an fp32 edge of the same split talk to the same cloud half, and
except the drafters (edge ones, and the cloud drafter's table, role ``cloud-draft``): they change which drafts
are proposed, never an output, so adding one does not make the phones' bundles stale.
The edge and the cloud each present it at connect time; a mismatch is refused.

A *u-shape* bundle (``tail_layers`` M > 0) keeps the last M layers, the final norm and the lm_head on the
phone too: its cloud half runs the middle layers [N, L - M) and returns hidden states, never a token
(docs/protocol.md, "U-shape"). ``tail_layers`` is part of the id (a plain bundle's id is unchanged by it).

Pure Python (the standard library): the phone reads manifests too.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import stat
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# a writer's staging directory inside the bundle it changes (autoglm-partition split into an earlier bundle,
# draft-head): the new files, then the new manifest, the update's journal (:func:`move_in`, :func:`finish_update`)
STAGING = ".autoglm-split.partial"
JOURNAL = "manifest.json.next"  # in STAGING: the manifest of an update whose files are going in (move_in)
# the cloud drafter (partition_tools.cloud_drafter): [V, H] float16, row v approximates token v's boundary state
CLOUD_DRAFT_INPUTS = "cloud/draft_inputs.npy"
ID_EXCLUDED_ROLES = ("edge", "cloud-draft")  # artifacts outside the bundle id (docstring)
# the edge half: what a phone downloads, holds and reads (the graphs, the tokenizer, and the calibration the codecs
# are built from - "shared" with the cloud); "cloud" / "cloud-draft" weights stay on the server. A phone without a
# shared file runs without the codecs it calibrates (shared.codecs.load_calibration); one with another copy than
# the manifest's would encode states the cloud decodes wrongly, so the edge's load refuses it
EDGE_HALF_ROLES = ("edge", "shared")
# the edge graphs whose weights compute the states the prefix keys name (Manifest.states_variant): the front,
# its prompt-phase copy, the encoders whose rows the front reads; not the drafters or the u-shape tail
STATE_GRAPHS = ("edge/front.onnx", "edge/front_prefill.onnx", "edge/vision.onnx", "edge/audio.onnx")


class BundleError(Exception):
    """A bundle is missing, malformed or tampered with; the message is one line."""


@dataclass(slots=True)
class Artifact:
    sha256: str
    bytes: int
    role: str  # "edge" | "cloud" | "shared" | "cloud-draft" (the cloud drafter's table: outside the bundle id)


@dataclass(slots=True)
class Manifest:
    format_version: int
    source: str  # what `split` loaded (LoadedModel.source: a preset's name or an absolute path), verify's default
    source_identity: str  # LoadedModel.identity
    architecture: str  # adapter family: glm4 | glm | glm4v | llama
    model_type: str  # HF model_type of the source
    split_layer: int  # N: layers [0, N) run on the edge
    num_layers: int  # L
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope: dict
    eos_token_ids: list[int]
    edge_quant: str  # fp32 | int8 | int4
    edge_dtype: str  # dtype of the edge graph's I/O tensors
    cloud_dtype: str  # dtype of the stored back-half weights
    artifacts: dict[str, Artifact] = field(default_factory=dict)
    quant_report: dict = field(default_factory=dict)  # which ops stayed in float, and why
    bundle_id: str = ""
    tail_layers: int = 0  # M: u-shape bundles run layers [L - M, L) + norm + lm_head on the edge too

    def __post_init__(self):
        _check_fields(self)
        if not 0 < self.split_layer < self.num_layers:
            raise BundleError(f"split layer {self.split_layer} must be in [1, {self.num_layers - 1}]")
        if isinstance(self.tail_layers, bool) or not isinstance(self.tail_layers, int) or self.tail_layers < 0 \
                or self.split_layer + self.tail_layers >= self.num_layers:
            raise BundleError(f"tail of {self.tail_layers!r} layers: the cloud must keep at least one of layers "
                              f"[{self.split_layer}, {self.num_layers})")
        self.artifacts = {k: v if isinstance(v, Artifact) else Artifact(**v) for k, v in self.artifacts.items()}
        for rel, art in self.artifacts.items():
            _check_artifact(rel, art)

    # -- identity ---------------------------------------------------------------------------
    def compute_bundle_id(self) -> str:
        desc = {
            "format_version": self.format_version,
            "source_identity": self.source_identity,
            "architecture": self.architecture,
            "split_layer": self.split_layer,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "cloud": {k: a.sha256 for k, a in sorted(self.artifacts.items()) if a.role not in ID_EXCLUDED_ROLES},
        }
        if self.tail_layers:
            desc["tail_layers"] = self.tail_layers
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:32]

    @property
    def edge_variant(self) -> str:
        """What produces the edge's prompt states, as the prefix keys name it (``shared.prefix_keys.KeyScope``):
        ``edge_quant``, or e.g. ``int8+fp32-prefill`` when the bundle's prompt runs through an fp32 copy of the
        front (``quant_report["prefill"]``: precision by phase, ``edge_client.front``), ``int4+int8-kv`` when the
        front's KV cache is int8 (``quant_report["kv_cache"]``, ``split --edge-kv int8``)."""
        prefill = self.quant_report.get("prefill")
        if prefill:
            return f"{self.edge_quant}+{prefill['mode']}-prefill"
        if str(self.quant_report.get("kv_cache", "")).startswith("int8"):  # split --edge-kv int8
            return f"{self.edge_quant}+int8-kv"
        return self.edge_quant

    @property
    def states_variant(self) -> str:
        """What the prefix keys and the edge's activation cache name as the edge variant: ``edge_variant`` and a
        digest of the edge graphs that compute the states (``STATE_GRAPHS``), e.g. ``int8#3fa2c1d09b7e5a10`` - two
        int8 fronts of one split quantized by different recipes compute different states, and share the
        cloud half (the bundle id leaves the edge graphs out)."""
        digest = hashlib.sha256("".join(f"{p}={self.artifacts[p].sha256};" for p in STATE_GRAPHS
                                        if p in self.artifacts).encode()).hexdigest()[:16]
        return f"{self.edge_variant}#{digest}"

    @property
    def cloud_layers(self) -> tuple[int, int]:
        """The layers the cloud runs: [N, L) for a split bundle, [N, L - M) for a u-shape one."""
        return self.split_layer, self.num_layers - self.tail_layers

    # -- io ---------------------------------------------------------------------------------
    def to_json(self) -> str:
        d = asdict(self)
        if not d["tail_layers"]:  # a plain bundle's manifest stays readable by clients from before u-shape
            del d["tail_layers"]
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    def save(self, bundle_dir: Path) -> None:
        """Written whole or not at all (a temporary file renamed over it): a write cut short - a full disk under
        draft-head's update of a bundle - left a truncated manifest, and the whole bundle unreadable."""
        self.bundle_id = self.compute_bundle_id()
        path = Path(bundle_dir) / MANIFEST_NAME
        tmp = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}.tmp")
        try:
            tmp.write_text(self.to_json())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, bundle_dir: str | Path) -> Manifest:
        path = Path(bundle_dir) / MANIFEST_NAME
        try:
            is_dir = stat.S_ISDIR(os.stat(bundle_dir).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            raise BundleError(f"{bundle_dir}: no such bundle directory") from None
        except OSError as e:  # a folder above it the process may not enter: Path.exists raised PermissionError
            raise BundleError(unreadable(Path(bundle_dir), e)) from None
        if not is_dir:  # was "no such bundle directory"
            raise BundleError(f"{bundle_dir}: a file, not a bundle directory (give the directory split --out "
                              "wrote, the one holding its manifest.json)")
        try:
            os.stat(path)  # (not a listing: a folder others may enter but not list, mode 0711, serves)
        except FileNotFoundError:
            pass  # (said below)
        except OSError as e:  # a folder it may not enter (another user's 0700): a PermissionError traceback
            raise BundleError(unreadable(Path(bundle_dir), e)) from None
        finish_update(Path(bundle_dir))
        if not path.is_file():
            raise BundleError(f"{path}: missing (not a bundle written by `autoglm-partition split`)")
        try:
            raw = json.loads(path.read_text(), parse_constant=_refuse_constant)
        except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError, _refuse_constant
            raise BundleError(f"{path}: not valid JSON ({e})") from None
        except OSError as e:  # another user's file (mode 0600): a PermissionError traceback in cloud serve, the edge
            raise BundleError(unreadable(path, e)) from None
        if not isinstance(raw, dict):
            raise BundleError(f"{path}: expected a JSON object")
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            newer = _is_int(version) and version > FORMAT_VERSION  # a bundle split by a later release
            raise BundleError(f"{path}: format version {version!r}, expected {FORMAT_VERSION}"
                              + (" (written by a newer autoglm-partition: upgrade autoglm-split to read it)"
                                 if newer else ""))
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        unknown, missing = sorted(set(raw) - names), sorted(required - set(raw))
        if unknown or missing:  # (was Python's 'Manifest.__init__() got an unexpected keyword argument ...')
            raise BundleError(f"{path}: malformed manifest (" + "; ".join(
                ([f"unknown field(s) {', '.join(unknown)}: a manifest of a newer autoglm-partition?"] if unknown
                 else []) + ([f"missing field(s) {', '.join(missing)}"] if missing else [])) + ")")
        try:
            m = cls(**raw)
        except TypeError as e:  # an artifact entry that is no {sha256, bytes, role} object
            raise BundleError(f"{path}: malformed manifest ({e})") from None
        except BundleError as e:
            raise BundleError(f"{path}: {e}") from None
        if m.bundle_id != m.compute_bundle_id():
            raise BundleError(f"{path}: bundle id does not match its contents (manifest edited?)")
        return m

    # -- integrity --------------------------------------------------------------------------
    def add_artifact(self, bundle_dir: Path, rel: str, role: str) -> None:
        p = Path(bundle_dir) / rel
        self.artifacts[rel] = Artifact(sha256=sha256_file(p), bytes=p.stat().st_size, role=role)

    def verify_files(self, bundle_dir: str | Path, roles: tuple[str, ...] = ("edge", "cloud", "shared"),
                     hashes: bool = True, if_present: tuple[str, ...] = ()) -> None:
        """Re-hash every artifact of the given roles; raise BundleError on the first problem. ``hashes=False``:
        presence and sizes only (a quick check before a load that hashes them). ``if_present``: roles whose
        missing files are skipped (a present one must still match)."""
        for rel, art in sorted(self.artifacts.items()):
            if art.role not in roles:
                continue
            p = Path(bundle_dir) / rel
            try:
                if art.role in if_present and not p.exists():
                    continue
                if not p.is_file():
                    raise BundleError(f"{p}: missing artifact")
                size = p.stat().st_size
                if size != art.bytes:
                    raise BundleError(f"{p}: {size} bytes, manifest says {art.bytes} (truncated or replaced)")
                if hashes and sha256_file(p) != art.sha256:
                    raise BundleError(f"{p}: sha256 mismatch (tampered or corrupt)")
            except OSError as e:  # (was a PermissionError traceback in cloud serve and autoglm-edge)
                raise BundleError(unreadable(p, e)) from None


ARTIFACT_ROLES = ("edge", "cloud", "shared", "cloud-draft")
EDGE_QUANTS = ("fp32", "int8", "int4")  # the edge graph's weights (split --edge-quant, auto resolved)
_INT_FIELDS = ("format_version", "split_layer", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
               "vocab_size", "tail_layers")
_POSITIVE_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
_STR_FIELDS = ("source", "source_identity", "architecture", "model_type", "edge_quant", "edge_dtype", "cloud_dtype",
               "bundle_id")
_DICT_FIELDS = ("rope", "quant_report", "artifacts")


def same_source(a: str, b: str) -> bool:
    """Whether two source identities (``LoadedModel.identity``, a manifest's ``source_identity``) name one model.

    A checkpoint directory (``dir:<folder>#<meta>+<content>``) or a GGUF file (``gguf:<file>#<hash>``) is
    compared by its hashes, not by the folder's or file's name: a moved or renamed copy is the same model. Two
    directory identities are the same when their content hashes agree; when one of them comes from a manifest
    written before content hashes (``#<meta>`` alone), their ``meta`` hashes decide (config, file names and sizes).
    Presets (``preset:<name>@seed<n>``) must match exactly."""
    kind_a, _, rest_a = a.partition(":")
    kind_b, _, rest_b = b.partition(":")
    if kind_a != kind_b or kind_a not in ("dir", "gguf") or "#" not in rest_a or "#" not in rest_b:
        return a == b
    hash_a, hash_b = rest_a.rpartition("#")[2], rest_b.rpartition("#")[2]
    meta_a, _, content_a = hash_a.partition("+")
    meta_b, _, content_b = hash_b.partition("+")
    return content_a == content_b if content_a and content_b else meta_a == meta_b


def unreadable(path: Path, e: OSError) -> str:
    """The one line for a bundle file this process cannot read (``e``): another user's file (mode 0600), a folder
    it may not enter, an I/O error of the disk."""
    return f"{path}: cannot be read ({e.strerror or e}); the user running this needs read access to the bundle's files"


_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # disk full, quota, the file size limit (ulimit -f)


def no_room(e: Exception) -> str | None:
    """Why writing a bundle failed for want of room, or None: an OSError's errno, or the system's words inside a
    library's own error (safetensors' SafetensorError 'No space left on device (os error 28)'), which ended the
    split in a traceback after all its work. The one rule of the split, draft-head and the edge's bundle update."""
    if isinstance(e, OSError) and e.errno in _NO_ROOM:
        return e.strerror
    return next((os.strerror(n) for n in _NO_ROOM if os.strerror(n) in str(e)), None)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_fields(m: Manifest) -> None:
    """Every field of the JSON type it must have (a hand-edited manifest fails here, naming the field, rather than
    deep inside a loader): BundleError."""
    for name in _INT_FIELDS:
        if not _is_int(getattr(m, name)):
            raise BundleError(f"{name} {getattr(m, name)!r}: expected an integer")
    for name in _POSITIVE_FIELDS:
        if getattr(m, name) < 1:
            raise BundleError(f"{name} {getattr(m, name)!r}: expected >= 1")
    for name in _STR_FIELDS:
        if not isinstance(getattr(m, name), str):
            raise BundleError(f"{name} {getattr(m, name)!r}: expected a string")
    for name in _DICT_FIELDS:
        if not isinstance(getattr(m, name), dict):
            raise BundleError(f"{name}: expected a JSON object, got {type(getattr(m, name)).__name__}")
    if not isinstance(m.eos_token_ids, list) or not all(_is_int(t) and t >= 0 for t in m.eos_token_ids):
        raise BundleError(f"eos_token_ids {m.eos_token_ids!r}: expected a list of token ids")
    # outside the bundle id (an edit keeps it), read by every loader: edge_variant, verify's thresholds
    if m.edge_quant not in EDGE_QUANTS:
        raise BundleError(f"edge_quant {m.edge_quant!r}: expected one of {', '.join(EDGE_QUANTS)}")
    prefill = m.quant_report.get("prefill")
    if prefill is not None and not (isinstance(prefill, dict) and isinstance(prefill.get("mode"), str)):
        raise BundleError(f"quant_report.prefill {prefill!r}: expected an object with a string mode")


def _check_artifact(rel, art: Artifact) -> None:
    """An artifact entry: a relative path inside the bundle, a sha256, a size, a known role."""
    _check_path(rel)
    if not isinstance(art.sha256, str):
        raise BundleError(f"artifact {rel}: sha256 {art.sha256!r}: expected a string")
    if not _is_int(art.bytes) or art.bytes < 0:
        raise BundleError(f"artifact {rel}: bytes {art.bytes!r}: expected a size >= 0")
    if art.role not in ARTIFACT_ROLES:
        raise BundleError(f"artifact {rel}: role {art.role!r}: expected one of {', '.join(ARTIFACT_ROLES)}")


def _check_path(rel) -> None:
    """An artifact's path: relative, inside the bundle, outside its writer's staging directory (a listed journal there
    - a server's, downloaded into an edge bundle - would be finished into the bundle at its next load)."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel \
            or any(part in ("", ".", "..") for part in rel.split("/")) or rel.split("/")[0] == STAGING:
        raise BundleError(f"artifact path {rel!r}: expected a relative path inside the bundle")


def _refuse_constant(name: str):
    """NaN / Infinity / -Infinity: Python's json reads them, JSON has none - a manifest holding one (outside the
    bundle id, e.g. in quant_report) loaded, and inspect --json printed a report no JSON parser reads."""
    raise ValueError(f"{name} is not a JSON value")


def export_digest(manifest_bytes: bytes) -> str:
    """The identity of one export of a bundle's edge half: the sha256 of its ``manifest.json`` as written. The bundle
    id leaves the edge graphs out (an edge half re-exported - another recipe, a fixed tokenizer - keeps it), so two
    exports of one id and edge variant are told apart by this (``/v1/bundles`` names it, ``bundle_sync`` compares
    it)."""
    return hashlib.sha256(manifest_bytes).hexdigest()


def move_in(bundle: Path, staged: Path) -> None:
    """Put the bundle staged in ``staged`` (``STAGING``: every new file, then its manifest) into ``bundle``: the
    manifest becomes the update's journal (``JOURNAL``), each file it lists that is still in ``staged`` replaces its
    namesake, then the journal replaces the bundle's manifest - the commit, one rename. Once the journal is there the
    update goes through: a move cut short (a killed writer, an error) is finished by :func:`finish_update`. The caller
    holds ``staged`` and makes sure no running client holds ``bundle``."""
    os.replace(staged / MANIFEST_NAME, staged / JOURNAL)
    finish_move(bundle, staged)


def finish_move(bundle: Path, staged: Path) -> None:
    """The rest of :func:`move_in` from its journal, by the holder of ``staged``."""
    listed = json.loads((staged / JOURNAL).read_text())["artifacts"]
    for rel in sorted(listed):
        _check_path(rel)
        if (staged / rel).is_file():
            (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staged / rel, bundle / rel)
    os.replace(staged / JOURNAL, bundle / MANIFEST_NAME)


def finish_update(bundle: Path) -> None:
    """Finish a :func:`move_in` a killed writer (split, draft-head) left half-done in ``bundle`` - its manifest and its
    files out of step: a drafter missing, or another one than the manifest's hash, refused by every loader -, so a
    reader sees the old bundle or the new one, never a mix. Waits for a live writer's commit to end (it holds its
    staging directory); BundleError when the bundle cannot be written (a read-only mount). No journal: nothing."""
    staged = bundle / STAGING
    if not (staged / JOURNAL).is_file():
        return
    try:
        fd = os.open(staged, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # removed by its writer since
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if (staged / JOURNAL).is_file():  # (another reader finished it while this one waited: nothing left)
            finish_move(bundle, staged)
    except (OSError, ValueError, KeyError, TypeError, BundleError) as e:
        raise BundleError(f"{bundle}: an update (autoglm-partition split or draft-head) was interrupted and cannot be "
                          f"finished here ({getattr(e, 'strerror', None) or e}); open the bundle once where it can be "
                          "written") from None
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
