"""The PCA codecs' calibration artifact: boundary states of calibration text -> ``codec_pca.npz`` in the bundle.

``split`` calls :func:`write_codec_calibration` after ``calibration.json`` is written: it runs the fp32 front
over the calibration windows, fits :func:`shared.codecs_pca.calibrate_pca` (basis, mean, per level one step
and its Rice parameters or rANS tables), writes the artifact and records it in ``calibration.json``
(``"pca_codec"``: file, sha256, content digest, levels). The manifest then hashes it like every other shared artifact, so it is part of
the bundle id: an edge and a cloud with the same bundle id hold the same basis.

Calibration text: the built-in sample text *after* its first :data:`EVAL_TOKENS` tokens (``verify``,
``bench/codec_bench.py`` and the other quality benches evaluate on those), cut into fresh sequences of
:data:`WINDOW` tokens (each with its attention sink at position 0), plus the same text as one chat exchange
so the template's special tokens are seen. Models without a tokenizer get seeded random ids.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from shared.codecs import CALIBRATION_FILE
from shared.codecs_pca import PcaBasis, calibrate_pca

from .adapters import ModelAdapter
from .models import LoadedModel, ModelLoadError

ARTIFACT = "codec_pca.npz"
EVAL_TOKENS = 1024  # the sample text's first tokens are the evaluation text of every quality bench
WINDOW = 512
CHAT_TOKENS = 800  # calibration text wrapped in the chat template (two turns of CHAT_TOKENS // 2)
TARGETS = {"pca-fine": 0.62, "pca-compact": 0.25,  # bytes per element of the coefficients on the calibration
           "pca-ans-compact": 0.27,  # (held-out text costs ~10-15 % more: docs/quality.md, "PCA codecs")
           "pca-tcq-compact": 0.26}


def codec_calibration_windows(lm: LoadedModel, vocab_size: int) -> list[torch.Tensor]:
    """Token windows [1, T] for the codec calibration (see the module docstring); disjoint from the first
    :data:`EVAL_TOKENS` tokens of the sample text."""
    if lm.tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(4, vocab_size, (1, WINDOW), generator=g) for _ in range(4)]
    from .split import sample_text

    text_ids = lm.tokenizer(sample_text(), return_tensors="pt").input_ids[0]
    ids = text_ids[EVAL_TOKENS:]  # [N]
    if ids.numel() < 16:
        raise ModelLoadError(f"{lm.source}: its tokenizer turns the built-in sample text into {text_ids.numel()} "
                             f"token(s); the codec calibration needs at least {EVAL_TOKENS + 16} (a tokenizer of another "
                             "model?)")
    windows = [ids[i:i + WINDOW][None] for i in range(0, ids.numel(), WINDOW)]
    if getattr(lm.tokenizer, "chat_template", None):
        half = CHAT_TOKENS // 2
        chat = [{"role": "user", "content": lm.tokenizer.decode(ids[:half])},
                {"role": "assistant", "content": lm.tokenizer.decode(ids[-half:])}]
        windows.append(torch.tensor(lm.tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False),
                                    dtype=torch.long).reshape(1, -1))
    return windows


def codec_calibration_states(adapter: ModelAdapter, windows: list[torch.Tensor], layer: int) -> np.ndarray:
    """fp32 boundary states [T, H] after layers [0, layer) of every window, concatenated."""
    from .split import boundary_hidden

    return np.concatenate([boundary_hidden(adapter, w, layer)[0].float().numpy() for w in windows])


def write_codec_calibration(lm: LoadedModel, adapter: ModelAdapter, bundle: Path, layer: int,
                            targets: dict[str, float] | None = None) -> PcaBasis:
    """Fit the PCA codecs at split ``layer``, write ``bundle/codec_pca.npz`` and record it in
    ``bundle/calibration.json`` (which must exist). Returns the basis."""
    states = codec_calibration_states(adapter, codec_calibration_windows(lm, adapter.vocab_size), layer)
    basis = calibrate_pca(states, targets or TARGETS)
    data = basis.to_bytes()
    (bundle / ARTIFACT).write_bytes(data)
    path = bundle / CALIBRATION_FILE
    calib = json.loads(path.read_text())
    calib["pca_codec"] = {
        "file": ARTIFACT, "sha256": hashlib.sha256(data).hexdigest(), "digest": basis.digest,
        "tokens": int(states.shape[0]), "eval_tokens_skipped": EVAL_TOKENS,
        "levels": {name: {"step": lv.step, "components": lv.r} for name, lv in basis.levels.items()},
    }
    path.write_text(json.dumps(calib) + "\n")
    return basis
