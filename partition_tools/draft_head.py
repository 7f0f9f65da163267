"""The edge's draft head: a calibrated linear "tuned lens" from the boundary state to the next token.

Speculation across the split needs drafts where prompt lookup has none (a chat answer copies little of its
prompt). The phone computes the boundary state ``h_N`` of every token it runs anyway; the draft head maps it
to an estimate of the model's final normed hidden state and scores that against the lm_head::

    y = h_N @ W + b            # [S, H]: ridge regression on calibration text, closed form
    token = vocab[argmax(y @ E)]   # E [H, K]: the lm_head's rows of the K most frequent calibration tokens

(FR-Spec's frequency-ranked vocabulary bounds the head's cost on a phone for GLM's 151 k vocabulary; for a
small vocabulary K is the whole of it). The final norm needs no place in the head: its per-channel weight is
linear and absorbed in ``W``, and its scale does not change an argmax. ``fit`` solves ``W`` on calibration
text (by default the tail of the built-in sample text, never a benchmark prompt or transcript), ``export``
writes ``edge/draft_head.onnx`` (int8 weights by default) with input ``hidden`` float32 ``[S, H]`` and
output ``token_ids`` int64 ``[S]``; :func:`add_draft_head` does both for a bundle and records the head in
its manifest (artifact + ``quant_report["draft_head"]``: calibration size, held-out top-1 agreement).
``edge_client.draft_head`` runs it on the phone.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edge_client.draft_head import DRAFT_HEAD, DraftHead
from shared.manifest import BundleError, Manifest, same_source

from .adapters import ModelAdapter, call_layer
from .models import LoadedModel
from .progress import Steps
from .split import add_files, writing_unless

HELD_OUT = 1024  # the first tokens of the calibration text are held out to measure agreement
WINDOW = 512  # calibration tokens per forward pass


@dataclass(slots=True)
class DraftHeadConfig:
    text: Path | None = None  # calibration text (UTF-8); None: the built-in sample text (partition_tools/data)
    tokens: int = 8192  # calibration tokens at most (after the held-out ones)
    vocab: int | None = None  # K: the head's vocabulary, the most frequent calibration tokens; None: all
    ridge: float = 100.0  # L2 weight of the regression (calibration text is small next to H^2 parameters)
    quant: str = "int8"  # int8 | fp32 weights in the ONNX

    def __post_init__(self):
        if self.quant not in ("int8", "fp32"):
            raise BundleError(f"draft head quant {self.quant!r}: expected int8 or fp32")
        if self.vocab is not None and self.vocab < 1:
            raise BundleError(f"draft head vocabulary {self.vocab}: must be >= 1")
        if self.tokens < 1 or self.ridge < 0:
            raise BundleError("draft head: tokens must be >= 1 and ridge >= 0")


@dataclass(slots=True)
class LensFit:
    weight: np.ndarray  # [H, H]
    bias: np.ndarray  # [H]
    vocab: np.ndarray  # int64 [K]: token ids the head can propose
    head: np.ndarray  # [H, K]: the lm_head's rows of those ids, transposed


def _ids(lm: LoadedModel, adapter: ModelAdapter, cfg: DraftHeadConfig) -> torch.Tensor:
    """Calibration + held-out token ids [T] (held-out first)."""
    if lm.tokenizer is None:  # random-weight presets: random ids, as for the boundary calibration
        gen = torch.Generator().manual_seed(1)
        return torch.randint(4, adapter.vocab_size, (HELD_OUT + cfg.tokens,), generator=gen)
    from .split import sample_text

    text = cfg.text.read_text(encoding="utf-8") if cfg.text is not None else sample_text()
    ids = lm.tokenizer(text, return_tensors="pt").input_ids[0][:HELD_OUT + cfg.tokens]
    if ids.numel() < 2 * HELD_OUT:
        raise BundleError(f"draft head calibration text has {ids.numel()} tokens: need at least {2 * HELD_OUT}")
    return ids


@torch.no_grad()
def boundary_and_final(adapter: ModelAdapter, ids: torch.Tensor, layer: int) -> tuple[np.ndarray, np.ndarray,
                                                                                        np.ndarray]:
    """For ids [T] (in windows of ``WINDOW``): boundary states h_N [T, H], final normed states [T, H] and the
    model's greedy next token per position [T]."""
    hs, ys, nxt = [], [], []
    for s in range(0, ids.numel(), WINDOW):
        w = ids[s:s + WINDOW][None]  # [1, S]
        hidden = adapter.embed_tokens(w)
        pos = torch.arange(w.shape[1])[None]
        cos_sin = adapter.position_embeddings(hidden, pos)
        for i, blk in enumerate(adapter.layers):
            if i == layer:
                hs.append(hidden[0].float().numpy())
            hidden = call_layer(blk, hidden, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
        final = adapter.norm(hidden)[0]  # [S, H]
        ys.append(final.float().numpy())
        nxt.append(adapter.lm_head(final).argmax(-1).numpy())
    return np.concatenate(hs), np.concatenate(ys), np.concatenate(nxt)


def fit(h: np.ndarray, y: np.ndarray, next_ids: np.ndarray, lm_head: np.ndarray, cfg: DraftHeadConfig) -> LensFit:
    """Ridge regression h [T, H] -> y [T, H] with a bias; the head's vocabulary from the calibration's next
    tokens ``next_ids`` [T] (the K most frequent), scored by ``lm_head`` [V, H]."""
    if h.shape != y.shape or h.shape[0] != next_ids.shape[0]:
        raise ValueError(f"calibration shapes differ: h {h.shape}, y {y.shape}, next ids {next_ids.shape}")
    x = np.concatenate([h, np.ones((h.shape[0], 1), h.dtype)], axis=1).astype(np.float64)  # [T, H + 1]
    gram = x.T @ x + cfg.ridge * np.eye(x.shape[1])
    sol = np.linalg.solve(gram, x.T @ y.astype(np.float64))  # [H + 1, H]
    vocab_size = lm_head.shape[0]
    if cfg.vocab is None or cfg.vocab >= vocab_size:
        vocab = np.arange(vocab_size, dtype=np.int64)
    else:
        counts = np.bincount(next_ids, minlength=vocab_size)
        vocab = np.sort(np.argsort(-counts, kind="stable")[:cfg.vocab]).astype(np.int64)
    return LensFit(sol[:-1].astype(np.float32), sol[-1].astype(np.float32), vocab,
                   np.ascontiguousarray(lm_head[vocab].T.astype(np.float32)))


def export(lens: LensFit, path: Path, quant: str) -> None:
    """``lens`` as an ONNX graph: hidden float32 [S, H] -> token_ids int64 [S] (module docstring)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    H = lens.weight.shape[0]
    nodes = [helper.make_node("MatMul", ["hidden", "W"], ["xw"]),
             helper.make_node("Add", ["xw", "b"], ["y"]),
             helper.make_node("MatMul", ["y", "E"], ["logits"]),
             helper.make_node("ArgMax", ["logits"], ["slot"], axis=-1, keepdims=0),
             helper.make_node("Gather", ["vocab", "slot"], ["token_ids"], axis=0)]
    inits = [numpy_helper.from_array(lens.weight, "W"), numpy_helper.from_array(lens.bias, "b"),
             numpy_helper.from_array(lens.head, "E"), numpy_helper.from_array(lens.vocab, "vocab")]
    graph = helper.make_graph(nodes, "draft_head",
                              [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["S", H])],
                              [helper.make_tensor_value_info("token_ids", TensorProto.INT64, ["S"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    if quant == "fp32":
        onnx.save(model, str(path))
        return
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    root.addFilter(_no_preprocess_advice)  # a WARNING on every draft-head run that asked nothing of the user
    try:
        with tempfile.TemporaryDirectory() as tmp:
            fp32 = Path(tmp) / "head.onnx"
            onnx.save(model, str(fp32))
            quantize_dynamic(str(fp32), str(Path(tmp) / "q.onnx"), weight_type=QuantType.QInt8)
            shutil.move(str(Path(tmp) / "q.onnx"), path)
    finally:
        root.removeFilter(_no_preprocess_advice)


def _no_preprocess_advice(record) -> bool:
    """Drop onnxruntime's "Please consider to run pre-processing before quantization" (logged on the root logger
    for any model without its pre-processing metadata): this two-MatMul graph has nothing to pre-process."""
    return "run pre-processing before quantization" not in record.getMessage()


def check_takes_a_drafter(bundle: Path, manifest: Manifest) -> None:
    """BundleError for a bundle that takes no drafter, from its manifest alone (the CLI checks it before the model
    loads: minutes for a 9B source)."""
    if manifest.tail_layers:  # the lens was written, hashed in and opened by every client, never run
        raise BundleError(f"{bundle}: a u-shape bundle (split with --tail) drafts by prompt lookup only; it takes "
                          "no drafter")


def bundle_of(lm: LoadedModel, bundle: Path) -> tuple[Manifest, ModelAdapter]:
    """The manifest of ``bundle`` and the adapter of ``lm``, the model it must have been split from: the same
    identity (``LoadedModel.identity``, the manifest's ``source_identity``, as ``verify`` checks it) - a model of
    the same shape with other weights would give a drafter that proposes the wrong tokens - and the same shape.
    A u-shape bundle takes no drafter: its requests draft by prompt lookup only (the phone's drafters are not run
    on them, and its cloud never sees a token)."""
    manifest = Manifest.load(bundle)
    check_takes_a_drafter(bundle, manifest)
    if not same_source(lm.identity, manifest.source_identity):
        raise BundleError(f"{bundle}: the bundle was not split from {lm.source} (model {lm.identity}, the "
                          f"bundle's source is {manifest.source} {manifest.source_identity}); give --source the "
                          "model it was split from")
    adapter = ModelAdapter(lm.model)
    if adapter.hidden_size != manifest.hidden_size or adapter.num_layers != manifest.num_layers:
        raise BundleError(f"{bundle}: the bundle was not split from this model (hidden size / layers differ)")
    return manifest, adapter


STEPS = 3  # the progress lines add_draft_head prints (partition_tools.progress)


def add_draft_head(lm: LoadedModel, bundle: Path, cfg: DraftHeadConfig | None = None,
                   progress: Steps | None = None,
                   staged: Path | None = None) -> dict:
    """Fit, export and register the draft head of ``bundle`` (split from ``lm``); returns its report. ``steps``: the
    progress it goes on (its ``STEPS`` lines). ``staged``: the bundle's staging directory where the caller holds it
    (``split.writing``; else held here). Every drafter's files go in with its manifest, all or nothing
    (``split.add_files``)."""
    cfg = cfg or DraftHeadConfig()
    progress = progress or Steps(STEPS, "draft-head")
    bundle = Path(bundle)
    with writing_unless(bundle, staged) as staged:  # the new file written there, then put in
        manifest, adapter = bundle_of(lm, bundle)
        ids = _ids(lm, adapter, cfg)
        progress.next(f"boundary and final states of {ids.numel()} calibration tokens")
        h, y, nxt = boundary_and_final(adapter, ids, manifest.split_layer)
        lm_head = adapter.lm_head.weight.detach().float().numpy()  # [V, H]
        progress.next(f"fit the lens, export {DRAFT_HEAD} ({cfg.quant})")
        lens = fit(h[HELD_OUT:], y[HELD_OUT:], nxt[HELD_OUT:], lm_head, cfg)
        export(lens, staged / DRAFT_HEAD, cfg.quant)
        progress.next("held-out agreement of the exported head, manifest")
        proposed = DraftHead(staged / DRAFT_HEAD).next_tokens(h[:HELD_OUT])  # the exported graph, as the phone runs it
        report = {"quant": cfg.quant, "vocab": int(lens.vocab.size), "ridge": cfg.ridge,
                  "calibration_tokens": int(ids.numel() - HELD_OUT),
                  "calibration": str(cfg.text) if cfg.text is not None else "built-in sample text (tail)",
                  "held_out_tokens": HELD_OUT,
                  "held_out_top1_agreement": round(float((proposed == nxt[:HELD_OUT]).mean()), 4)}
        manifest.quant_report["draft_head"] = report
        manifest.add_artifact(staged, DRAFT_HEAD, "edge")
        add_files(bundle, staged, manifest)  # all or nothing, as no client holds the bundle
    return report
