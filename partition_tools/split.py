"""``autoglm-partition split``: cut a model at layer N into an edge/cloud bundle (layout: shared.manifest)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from edge_client.bundle_sync import unheld
from edge_client.front import FRONT, PREFILL_GRAPH
from shared.manifest import (FORMAT_VERSION, JOURNAL, MANIFEST_NAME, STAGING, BundleError, Manifest, finish_move,
                             finish_update, move_in, no_room)

from .adapters import ModelAdapter, call_layer
from .cloud_half import BACK_CONFIG, BACK_WEIGHTS, GENERATION_CONFIG, back_state_dict
from .export import build_front
from .models import LoadedModel
from .progress import Steps
from .quantize import EDGE_QUANT_CHOICES, KV_MODES, quantize_front, resolve_edge_quant

CALIBRATION = "calibration.json"
# the bundle being written (split's staging directory, ``shared.manifest.STAGING``): inside --out when that is a
# directory - on its file system, a mount point's included, where the finished bundle then moves in by renames
# (``shared.manifest.move_in``) -, else beside it as ``.<name>.autoglm-split.partial``; a split holds it (flock) from
# start to end and removes it
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass(slots=True)
class SplitConfig:
    layer: int  # N: layers [0, N) go to the edge
    out: Path
    edge_quant: str = "auto"  # auto | int8 | int4 | fp32; auto: int4 on a 4-bit grid source, else int8
    edge_graph: str = "auto"  # fused | plain | auto (fused where it fits): partition_tools.export.build_front
    calib_tokens: int = 512  # tokens of built-in text used to find the boundary's outlier channels
    outlier_channels: int = 8  # channels kept in fp16 by the outlier-aware codec
    vision_quant: str | None = None  # GLM-4.1V's edge vision tower: int8 | fp32 | none (None: as the front)
    audio_encoder: str | None = None  # a Whisper + projector directory (or "tiny-whisper"): partition_tools.export_audio
    tail: int = 0  # M > 0: a u-shape bundle, layers [L - M, L) + norm + lm_head also on the edge (export_tail)
    # precision by phase (--fp32-prefill): the prompt through an fp32 copy of the front (edge/front_prefill.onnx),
    # decode steps through the quantized one; off by default (no gain on held-out answers, 3x the memory:
    # docs/quality.md, "Edge answers")
    fp32_prefill: bool = False
    # MatMuls the int8 recipe keeps in fp32 (the most outlier-heavy down_proj); None: the recipe's own (2 for
    # int8). A one-layer bench passes 0 to time the layer every other layer of a deep front is.
    float_outliers: int | None = None
    # the front's KV cache on the phone (--edge-kv): fp32, or int8 with calibrated per-channel scales
    # (partition_tools.kv_quant: a quarter of the bytes; the fused graph only, no fp32 prompt copy)
    edge_kv: str = "fp32"

    def __post_init__(self):
        if self.edge_quant not in EDGE_QUANT_CHOICES:
            raise BundleError(f"--edge-quant {self.edge_quant!r}: expected one of {', '.join(EDGE_QUANT_CHOICES)}")
        if self.vision_quant not in (None, "int8", "fp32", "none"):
            raise BundleError(f"--vision-quant {self.vision_quant!r}: expected int8, fp32 or none")
        if self.tail < 0:
            raise BundleError(f"--tail {self.tail}: expected M >= 0 layers")
        if self.fp32_prefill and self.edge_quant == "fp32":
            raise BundleError("--fp32-prefill is for a quantized edge (--edge-quant auto|int8|int4)")
        if self.edge_kv not in KV_MODES:
            raise BundleError(f"--edge-kv {self.edge_kv!r}: expected one of {', '.join(KV_MODES)}")
        if self.edge_kv != "fp32" and self.edge_graph == "plain":
            raise BundleError(f"--edge-kv {self.edge_kv} needs the fused edge graph (its attention op holds the "
                              "int8 cache); the plain graph keeps an fp32 cache")
        if self.edge_kv != "fp32" and self.fp32_prefill:
            raise BundleError(f"--edge-kv {self.edge_kv} and --fp32-prefill: the prompt-phase copy shares the decode "
                              "graph's fp32 cache; pick one")
        if self.float_outliers is not None and self.float_outliers < 0:
            raise BundleError(f"float_outliers {self.float_outliers}: expected >= 0")
        self.out = Path(self.out)
        check_out_dir(self.out)


def check_layers(cfg: SplitConfig, num_layers: int) -> None:
    """``--layer`` and ``--tail`` fit a model of ``num_layers`` layers: BundleError otherwise (the CLI checks them
    from the config before the weights load, split again on the loaded model)."""
    L = num_layers
    if not 0 < cfg.layer < L:
        raise BundleError(f"--layer {cfg.layer}: must be between 1 and {L - 1} (the model has {L} layers)")
    if cfg.tail and cfg.layer + cfg.tail >= L:
        raise BundleError(f"--tail {cfg.tail} with --layer {cfg.layer}: the cloud must keep at least one of the "
                          f"{L} layers (layer + tail < {L})")


def check_vision(cfg: SplitConfig, source: str, has_vision_tower: bool) -> None:
    """``--vision-quant`` asks for a tower ``source`` has: BundleError otherwise (the CLI checks it from the config
    before the weights load, split again on the loaded model)."""
    if cfg.vision_quant not in (None, "none") and not has_vision_tower:
        raise BundleError(f"--vision-quant {cfg.vision_quant}: {source} has no vision tower (GLM-4.1V's); leave "
                          "it out")


def check_out_dir(out: Path) -> None:
    """``out`` can take a bundle: absent, an empty directory or an earlier bundle (replaced); BundleError otherwise,
    checked before the model loads."""
    if out.is_symlink():
        raise BundleError(f"--out {out}: a symbolic link (an updated edge bundle?); give its target or a new directory")
    if out.exists() and not out.is_dir():
        raise BundleError(f"--out {out}: exists and is not a directory")
    if _split_running(_staging_path(out)):
        raise _busy(f"--out {out}")
    if out.is_dir():  # a killed split or draft-head's move in, finished: its new files are no foreign ones
        finish_update(out)
    if out.is_dir() and any(p.name != STAGING for p in out.iterdir()) and not (out / MANIFEST_NAME).is_file():
        raise BundleError(f"--out {out}: exists and is not a bundle; refusing to overwrite")
    if (out / MANIFEST_NAME).is_file():  # an earlier bundle: replaced whole, so it must hold nothing else
        refuse_if_held(out, f"--out {out}", _SPLIT_ADVICE)
        try:
            listed = set(json.loads((out / MANIFEST_NAME).read_text())["artifacts"])
        except (OSError, ValueError, KeyError, TypeError):
            raise BundleError(f"--out {out}: its {MANIFEST_NAME} does not list a bundle's files; refusing to "
                              "overwrite") from None
        files = (p.relative_to(out).as_posix() for p in out.rglob("*") if not p.is_dir())
        foreign = sorted(rel for rel in files if rel != MANIFEST_NAME and rel not in listed
                         and not rel.startswith(STAGING + "/"))  # a killed split's, cleared by the next
        if foreign:
            raise BundleError(f"--out {out}: holds {len(foreign)} file(s) not of its bundle (e.g. {foreign[0]}); "
                              "refusing to overwrite")
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise BundleError(f"--out {out}: {parent} is not a directory")
    # the bundle is staged in --out when it exists, else beside it (STAGING): that folder must take new files (a
    # read-only mount, a folder of another user), found before the model loads rather than after the export
    folder = out if out.is_dir() else parent
    problem = folder is not None and _cannot_write_in(folder)
    if problem:
        raise BundleError(f"--out {out}: cannot write in {folder} ({problem})")


def refuse_if_held(bundle: Path, shown: str | None = None, advice: str = "close it first") -> None:
    """BundleError while a running edge client holds ``bundle`` (split --out, draft-head: its files must not change
    under it); ``shown``: how the message names it (the bundle's path)."""
    with unheld(bundle) as free:
        if not free:
            raise _held(shown or str(bundle), advice)


_SPLIT_ADVICE = "close it first, or split into another directory"


def _held(shown: str, advice: str = "close it first") -> BundleError:
    return BundleError(f"{shown}: a running edge client holds this bundle (its files must not change under it); "
                       f"{advice}")


def _busy(shown: str) -> BundleError:
    return BundleError(f"{shown}: another autoglm-partition split or draft-head is writing this bundle; wait for it "
                       "to end")


def _staging_path(out: Path) -> Path:
    """Where a split into ``out`` writes its bundle (``STAGING``)."""
    return out / STAGING if out.is_dir() else out.parent / f".{out.name}{STAGING}"


def _split_running(staged: Path) -> bool:
    """Whether a split (or draft-head: ``writing``) holds the staging directory ``staged`` now (one a killed split
    left is not held)."""
    try:
        fd = os.open(staged, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@contextlib.contextmanager
def writing(bundle: Path):
    """``bundle`` held against every other split into it or draft-head on it until the block ends (draft-head: two at
    once on one bundle each saved the manifest it had read, and the later dropped the other's drafter from it);
    BundleError naming ``bundle`` when one holds it. Yields its staging directory (``STAGING``), where new files are
    written before :func:`add_files` puts them in."""
    with _staging(Path(os.path.abspath(bundle)), str(bundle)) as staged:
        yield staged


def writing_unless(bundle: Path, staged: Path | None):
    """:func:`writing` ``bundle``, or the caller's ``staged`` where it holds it already (the CLI, from before the
    model loads)."""
    return contextlib.nullcontext(staged) if staged is not None else writing(bundle)


def add_files(bundle: Path, staged: Path, manifest: Manifest) -> None:
    """Move the new files written in ``staged`` (:func:`writing`'s, at their paths in the bundle) into ``bundle`` with
    ``manifest``, which lists them (``shared.manifest.move_in``): all or nothing - no room for the manifest leaves the
    bundle as it was, and a move cut short (a kill, an error) is finished by whoever opens the bundle next
    (``Manifest.load``, the next writer: the new bundle; a drafter file left unlisted, or the new one over an earlier
    one whose hash the manifest still gave, failed verify, inspect and loading, and the next writer deleted the
    earlier one). Refused while a running edge client holds the bundle."""
    manifest.save(staged)
    with unheld(bundle) as free:
        if not free:
            raise _held(str(bundle))
        move_in(bundle, staged)


@contextlib.contextmanager
def _staging(out: Path, shown: str):
    """The empty staging directory of a split into ``out`` (``STAGING``), held until the block ends, then removed: a
    second split into the same ``out`` is refused (``_busy``) rather than replacing the first's bundle as it ends,
    and a killed split's leftovers are cleared. ``shown``: what errors name (``--out DIR``)."""
    staged = _staging_path(out)
    for _ in range(3):  # (the held directory renamed or removed between its open and its lock: another round)
        try:
            staged.mkdir(parents=True, exist_ok=True)
            fd = os.open(staged, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise BundleError(f"{shown}: cannot write there ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _busy(shown) from None
        if staged.is_dir() and os.path.samestat(os.stat(staged), os.fstat(fd)):
            break
        os.close(fd)
    else:
        raise _busy(shown)
    try:
        if staged.parent == out and (staged / JOURNAL).is_file():  # a killed writer's move in: finished
            finish_move(out, staged)
        for p in list(staged.iterdir()):  # a killed split's
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        yield staged
    finally:
        with contextlib.suppress(OSError):  # unless renamed to --out (then the path may be another split's), or an
            # update's move in was cut short by an error (its journal: finished by the bundle's next opener)
            if os.path.samestat(os.stat(staged), os.fstat(fd)) and not (staged / JOURNAL).is_file():
                shutil.rmtree(staged, ignore_errors=True)
        os.close(fd)


def _cannot_write_in(folder: Path) -> str | None:
    """Why no file can be made in ``folder`` (read-only file system, no permission), or None: a probe directory made
    and removed (``os.access`` passes root on a read-only mount and in sysfs)."""
    try:
        tempfile.TemporaryDirectory(dir=folder, prefix=".autoglm-probe-").cleanup()
    except OSError as e:
        return e.strerror or str(e)
    return None


def sample_text() -> str:
    return (Path(__file__).parent / "data" / "sample.txt").read_text()


def calibration_ids(lm: LoadedModel, adapter: ModelAdapter, n_tokens: int) -> torch.Tensor:
    """Calibration tokens: the *last* ``n_tokens`` of the built-in text, so they never overlap the first
    1,024 tokens that ``verify`` and the benchmarks evaluate on."""
    if lm.tokenizer is not None:
        ids = lm.tokenizer(sample_text(), return_tensors="pt").input_ids[:, -n_tokens:]
    else:  # random-weight presets: no vocabulary to speak of, any ids will do
        ids = torch.randint(4, adapter.vocab_size, (1, n_tokens), generator=torch.Generator().manual_seed(0))
    return ids  # [1, T]


@torch.no_grad()
def boundary_hidden(adapter: ModelAdapter, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """fp32 reference boundary activations after layers [0, layer): [1, T, H]."""
    hidden = adapter.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    cos_sin = adapter.position_embeddings(hidden, pos)
    for blk in list(adapter.layers)[:layer]:
        hidden = call_layer(blk, hidden, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
    return hidden


def calibrate(adapter: ModelAdapter, ids: torch.Tensor, layer: int, k: int) -> dict:
    """Boundary statistics for the outlier-aware codecs (``shared.codecs``): which channels carry the
    massive activations, and above which row magnitude a token (an attention sink) travels whole in fp16."""
    from shared.codecs import find_outlier_channels, find_sink_threshold

    h = boundary_hidden(adapter, ids, layer)[0].float().numpy()  # [T, H]
    outliers = find_outlier_channels(h, k)
    return {
        "layer": layer,
        "tokens": int(h.shape[0]),
        "outlier_channels": outliers,
        "sink_threshold": find_sink_threshold(h, outliers),
        "channel_absmax": [round(float(x), 4) for x in np.abs(h).max(axis=0)],
        "boundary_absmax": float(np.abs(h).max()),
    }


def _has_vision_tower(lm: LoadedModel) -> bool:
    return hasattr(getattr(lm.model, "model", None), "visual")


def _export_vision(lm: LoadedModel, cfg: SplitConfig) -> dict:
    """GLM-4.1V: the vision tower as ``edge/vision.onnx`` (``partition_tools.export_vision``); returns the
    tower's quant report."""
    from .export_vision import export_vision

    quant = cfg.vision_quant or ("fp32" if cfg.edge_quant == "fp32" else "int8")
    spec = export_vision(lm.model, cfg.out, quant)
    return {"mode": spec.quant, **{k: v for k, v in spec.quant_report.items() if k != "mode"}}


def split(lm: LoadedModel, cfg: SplitConfig) -> Manifest:
    adapter = ModelAdapter(lm.model)
    L = adapter.num_layers
    check_layers(cfg, L)
    check_vision(cfg, lm.source, _has_vision_tower(lm))
    started = time.perf_counter()
    cfg = replace(cfg, edge_quant=resolve_edge_quant(cfg.edge_quant, adapter, cfg.layer))
    check_out_dir(cfg.out)
    # written aside (STAGING), then swapped in whole: an interrupted or failed split leaves neither half a bundle at
    # --out (it blocked a rerun there: "not a bundle") nor an earlier bundle there removed
    out = Path(os.path.abspath(cfg.out))
    with _staging(out, f"--out {cfg.out}") as staged:
        try:
            manifest = _write_bundle(lm, replace(cfg, out=staged), adapter, started)
            _swap_in(staged, out)
        except Exception as e:
            reason = no_room(e)
            if reason is None:
                raise
            kept = " (the earlier bundle at --out is kept until the new one is written)" \
                if (out / MANIFEST_NAME).is_file() else ""
            raise BundleError(f"--out {cfg.out}: the bundle does not fit ({reason}); make room{kept} and split again") \
                from None
    return manifest


def _swap_in(staged: Path, out: Path) -> None:
    """Put the finished bundle ``staged`` at ``out``: renamed there when ``out`` is absent; else ``out`` (an empty
    directory or an earlier bundle: perhaps a mount point, or someone's working directory) keeps its inode and has
    its contents replaced by renames on its own file system (``staged`` is inside it: a copy across file systems
    that failed half-way destroyed the earlier bundle and left a partial one a rerun refused): the earlier bundle's
    files go, then ``shared.manifest.move_in`` puts the new ones in, the manifest last; a kill mid-way is finished by
    whoever opens ``out`` next (``Manifest.load``, the next split: it left a folder without a manifest, which loaders
    and a rerun refused)."""
    if not out.exists():
        staged.rename(out)
        return
    with unheld(out) as free:  # a running edge client (bundle_sync.HeldVersion) reads its version's files on
        if not free:  # demand (the encoders): another bundle's under it would pair them with its front
            raise _held(f"--out {out}", _SPLIT_ADVICE)
        for p in list(out.iterdir()):
            if p not in (staged, out / MANIFEST_NAME):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        move_in(out, staged)


def _write_bundle(lm: LoadedModel, cfg: SplitConfig, adapter: ModelAdapter, started: float) -> Manifest:
    """Every file of the bundle into the empty directory ``cfg.out``."""
    L = adapter.num_layers
    out = cfg.out
    (out / "edge").mkdir(parents=True, exist_ok=True)
    (out / "cloud").mkdir(parents=True, exist_ok=True)
    rewrite = cfg.edge_quant != "fp32" or cfg.edge_kv != "fp32"  # the fp32 graph is quantized / gets an int8 KV
    steps = Steps((5 if rewrite else 4) + (1 if cfg.tail else 0), "split")

    # 1. edge front -> ONNX (fp32), then quantize
    steps.next(f"export layers [0, {cfg.layer}) to ONNX")
    quant_report: dict = {"mode": "fp32"}
    with tempfile.TemporaryDirectory(dir=out) as tmp:  # on --out's file system, not /tmp (often a small tmpfs)
        fp32, graph_kind = build_front(adapter, cfg.layer, Path(tmp) / "front.onnx", cfg.edge_graph)
        if cfg.edge_kv != "fp32" and graph_kind != "fused":
            raise BundleError(f"--edge-kv {cfg.edge_kv} needs the fused edge graph, and this model's front fell back "
                              f"to the plain one ({graph_kind}); split without --edge-kv")
        if not rewrite:
            shutil.move(str(fp32), out / FRONT)
        else:
            steps.next(f"quantize edge weights to {cfg.edge_quant}" if cfg.edge_quant != "fp32" else
                       f"store the edge KV cache as {cfg.edge_kv}")
            from .quantize import kv_calibration_tokens, recipe_for

            recipe = {} if cfg.edge_quant == "fp32" else recipe_for(adapter, cfg.layer, cfg.edge_quant, lm.tokenizer)
            if cfg.float_outliers is not None and cfg.edge_quant != "fp32":
                recipe["float_outliers"] = cfg.float_outliers
            if cfg.edge_kv != "fp32":
                recipe.update(kv_cache=cfg.edge_kv,
                              kv_calibration_ids=kv_calibration_tokens(lm.tokenizer, adapter.vocab_size))
            quant_report = quantize_front(fp32, out / FRONT, cfg.edge_quant, **recipe,
                                          prefill="fp32" if cfg.fp32_prefill else None)
    quant_report["edge_graph"] = graph_kind
    has_vision = _has_vision_tower(lm) and cfg.vision_quant != "none"
    if has_vision or cfg.audio_encoder:  # encoder rows enter the front in place of token embeddings
        from .front_embeds import add_embeds_input_file

        for graph in (FRONT, PREFILL_GRAPH):
            if (out / graph).is_file():
                add_embeds_input_file(out / graph, adapter.hidden_size)
    if has_vision:
        quant_report["vision"] = _export_vision(lm, cfg)
    if cfg.audio_encoder:
        from dataclasses import asdict

        from .export_audio import export_audio

        quant_report["audio"] = {"mode": "fp32", "encoder": str(cfg.audio_encoder),
                                 **asdict(export_audio(cfg.audio_encoder, adapter.hidden_size, adapter.vocab_size, out))}

    if cfg.tail:  # u-shape: the tail on the edge as well
        from .export_tail import TAIL, export_tail

        steps.next(f"export the tail: layers [{L - cfg.tail}, {L}) + norm + lm_head to ONNX ({cfg.edge_quant})")
        quant_report["tail"] = export_tail(adapter, cfg.tail, out / TAIL, cfg.edge_quant)

    # 2. cloud half -> safetensors + config
    steps.next(f"write layers [{cfg.layer}, {L - cfg.tail})" + ("" if cfg.tail else " + norm + lm_head"))
    from safetensors.torch import save_file

    (out / BACK_CONFIG).write_text(lm.model.config.to_json_string())
    save_file(back_state_dict(adapter, cfg.layer, cfg.tail), str(out / BACK_WEIGHTS))
    # safetensors writes through a private temporary file (0600): the mode open() gives a new file (0666 less the
    # umask), as the bundle's other files have, so a server running as another user can read it
    shutil.copymode(out / BACK_CONFIG, out / BACK_WEIGHTS)
    if getattr(lm.model, "generation_config", None) is not None:
        (out / GENERATION_CONFIG).write_text(lm.model.generation_config.to_json_string())

    # 3. tokenizer + chat template
    steps.next("tokenizer, chat template, calibration")
    if lm.tokenizer is not None:
        tmp_tok = out / "edge" / "_tok"
        lm.tokenizer.save_pretrained(str(tmp_tok))
        for name in TOKENIZER_FILES:
            if (tmp_tok / name).is_file():
                shutil.move(str(tmp_tok / name), out / "edge" / name)
        if lm.tokenizer.chat_template and not (out / "edge" / "chat_template.jinja").is_file():
            (out / "edge" / "chat_template.jinja").write_text(lm.tokenizer.chat_template)
        shutil.rmtree(tmp_tok)
    ids = calibration_ids(lm, adapter, cfg.calib_tokens)
    (out / CALIBRATION).write_text(json.dumps(calibrate(adapter, ids, cfg.layer, cfg.outlier_channels)) + "\n")
    from .codec_calibration import write_codec_calibration

    write_codec_calibration(lm, adapter, out, cfg.layer)  # codec_pca.npz, recorded in calibration.json

    # 4. manifest with hashes
    steps.next("hash artifacts, write manifest")
    manifest = Manifest(
        format_version=FORMAT_VERSION, source=lm.source, source_identity=lm.identity,
        architecture=adapter.family.name, model_type=lm.model.config.model_type, split_layer=cfg.layer,
        num_layers=L, hidden_size=adapter.hidden_size, num_heads=adapter.num_heads,
        num_kv_heads=adapter.num_kv_heads, head_dim=adapter.head_dim, vocab_size=adapter.vocab_size,
        rope=adapter.rope_settings(), eos_token_ids=adapter.eos_token_ids(), edge_quant=cfg.edge_quant,
        edge_dtype="float32", cloud_dtype=str(adapter.lm_head.weight.dtype).removeprefix("torch."),
        quant_report=quant_report, tail_layers=cfg.tail,
    )
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.name != "manifest.json":
            rel = p.relative_to(out).as_posix()
            role = "edge" if rel.startswith("edge/") else "cloud" if rel.startswith("cloud/") else "shared"
            manifest.add_artifact(out, rel, role)
    manifest.save(out)
    steps.done(time.perf_counter() - started)
    return manifest
