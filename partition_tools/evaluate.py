"""Split-vs-unsplit quality: does a bundle (edge front in onnxruntime + cloud half in torch) reproduce the model?

Contract of :func:`evaluate_split` (``autoglm-partition verify`` builds on it):

1. tokenize real text (the built-in ``data/sample.txt`` unless given; random ids for presets without a
   tokenizer) and keep the first ``max_tokens`` tokens -> ``ids [T]``;
2. reference: the *unsplit* source model (``lm.model``, fp32 torch) over all T tokens at once -> logits
   ``[T, V]`` and the fp32 boundary activations after layer N ``[T, H]``;
3. split: the edge graph in the phone's own runtime (``edge_client.front.FrontRuntime``), prefilled in
   chunks of ``window`` tokens over its KV cache (P = 0, then the past of the previous chunks), each chunk's
   boundary passed through ``codec`` (what the wire does to it; identity = lossless fp32), then the cloud
   half (``CloudModel.forward``, fp32 torch) over the whole sequence -> logits ``[T, V]``; a u-shape bundle's
   middle returns hidden states instead, which pass through ``codec`` again (the downlink) and the phone's
   tail (``edge_client.tail.TailRuntime``, in chunks of ``window`` over its KV cache) -> logits ``[T, V]``;
4. compare: top-1 next-token agreement, mean and max KL(ref || split) per position, perplexity of both on
   the text itself, and the boundary error the cloud receives (after the codec) against the fp32 boundary.

The reference is computed once per :class:`SplitEvaluator`, so a sweep over many edge graphs of one bundle
pays for it once. The reference model is ``load_bundle_source(bundle)`` unless one is passed; its identity
must match the bundle's ``source_identity``.

References: SmoothQuant (Xiao et al., 2023) and LLM.int8() (Dettmers et al., 2022) measure quantization
quality the same way (next-token agreement, KL, perplexity against the fp model).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edge_client.front import FRONT, FrontRuntime
from shared.manifest import BundleError, Manifest, same_source

from .adapters import ModelAdapter
from .cloud_half import CloudModel
from .models import LoadedModel, load_bundle_source

Codec = Callable[[np.ndarray], np.ndarray]  # boundary [S, H] float32 -> what the cloud receives [S, H]


def fp16_round_trip(x: np.ndarray) -> np.ndarray:
    """The lossless-fp16 boundary (what the ``fp16`` wire codec delivers)."""
    return x.astype(np.float16).astype(np.float32)


def evaluation_ids(lm: LoadedModel, text: str | None, max_tokens: int) -> np.ndarray:
    """Token ids of ``text`` (default: the built-in sample), at most ``max_tokens``: int64 [T]."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens {max_tokens}: need at least 2 tokens to score next-token predictions")
    if lm.tokenizer is None:
        if text is not None:
            raise ValueError(f"{lm.source}: has no tokenizer, cannot evaluate on given text")
        vocab = ModelAdapter(lm.model).vocab_size
        return np.random.default_rng(0).integers(4, vocab, max_tokens).astype(np.int64)
    if text is None:
        from .split import sample_text

        text = sample_text()
    ids = np.asarray(lm.tokenizer(text).input_ids, dtype=np.int64)[:max_tokens]
    if ids.size < 2:  # (verify --text of an empty file: a ValueError traceback after the model loaded)
        raise BundleError(f"the text tokenizes to {ids.size} token(s); scoring needs at least 2")
    return ids


@dataclass(slots=True)
class Reference:
    ids: np.ndarray  # int64 [T]
    logits: torch.Tensor  # float32 [T, V] of the unsplit model
    boundary: np.ndarray  # float32 [T, H]: hidden state after layer N (input of the cloud half)


@torch.no_grad()
def reference_run(lm: LoadedModel, split_layer: int, ids: np.ndarray) -> Reference:
    out = lm.model(torch.from_numpy(ids)[None], output_hidden_states=True)
    boundary = out.hidden_states[split_layer][0].float().numpy()  # [T, H]: hidden_states[0] is the embedding
    return Reference(ids=ids, logits=out.logits[0].float(), boundary=boundary)


@torch.no_grad()
def compare_logits(ref: torch.Tensor, split: torch.Tensor, ids: np.ndarray, rows: int = 256) -> dict:
    """Agreement, KL(ref || split) and perplexities of two logit tensors [T, V] over the tokens ``ids``."""
    T = ref.shape[0]
    targets = torch.from_numpy(ids[1:])
    agree, kl_sum, kl_max, nll_ref, nll_split = 0, 0.0, 0.0, 0.0, 0.0
    for s in range(0, T, rows):  # row blocks: [rows, V] in float64 stays small
        lp = torch.log_softmax(ref[s:s + rows].double(), -1)
        lq = torch.log_softmax(split[s:s + rows].double(), -1)
        agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
        kl = (lp.exp() * (lp - lq)).sum(-1)  # [rows]
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        t = targets[s:s + rows]  # next tokens of rows [s, s + len(t)); the last row has none
        nll_ref -= float(lp[: len(t)].gather(1, t[:, None]).sum())
        nll_split -= float(lq[: len(t)].gather(1, t[:, None]).sum())
    ppl_ref, ppl_split = math.exp(nll_ref / (T - 1)), math.exp(nll_split / (T - 1))
    return {
        "top1_agreement": agree / T,
        "mean_kl": kl_sum / T,
        "max_kl": kl_max,
        "ppl_reference": ppl_ref,
        "ppl_split": ppl_split,
        "ppl_delta_pct": 100.0 * (ppl_split / ppl_ref - 1.0),
    }


class SplitEvaluator:
    """Holds the reference run and the cloud half of one bundle; scores any edge graph of that split."""

    def __init__(self, bundle_dir: str | Path, lm: LoadedModel | None = None, text: str | None = None,
                 max_tokens: int = 1024, window: int = 512, threads: int = 2):
        if window < 1:
            raise ValueError(f"window {window}: must be >= 1")
        self.bundle_dir = Path(bundle_dir)
        self.manifest = Manifest.load(self.bundle_dir)
        lm = lm if lm is not None else load_bundle_source(self.bundle_dir)
        if not same_source(lm.identity, self.manifest.source_identity):
            raise BundleError(f"reference model {lm.identity} is not the bundle's source "
                              f"{self.manifest.source_identity}")
        self.window, self.threads = window, threads
        self.reference = reference_run(lm, self.manifest.split_layer, evaluation_ids(lm, text, max_tokens))
        self.back = CloudModel.from_bundle(self.bundle_dir)

    @torch.no_grad()
    def evaluate(self, front_onnx_path: str | Path | None = None, codec: Codec | None = None) -> dict:
        started = time.perf_counter()
        ref = self.reference
        path = Path(front_onnx_path) if front_onnx_path is not None else self.bundle_dir / FRONT
        if not path.is_file():
            raise BundleError(f"{path}: no such edge graph")
        front = FrontRuntime(self.bundle_dir, threads=self.threads, chunk=self.window, verify=False, graph=path)
        chunks = [h if codec is None else codec(h) for _, h in front.prefill_chunks(ref.ids)]  # each [S, H]
        boundary = np.concatenate(chunks).astype(np.float32)  # [T, H]: what the cloud receives
        if boundary.shape != ref.boundary.shape:
            raise BundleError(f"{path}: boundary shape {boundary.shape}, expected {ref.boundary.shape}")
        pos = torch.arange(ref.ids.size)[None]  # [1, T]
        logits = self.back(torch.from_numpy(boundary)[None], pos)[0].float()  # [T, V] (u-shape: [T, H])
        if self.back.returns_states:
            logits = torch.from_numpy(self._tail_logits(logits.numpy(), codec))  # [T, V]
        err = np.abs(boundary - ref.boundary)
        return {
            **compare_logits(ref.logits, logits, ref.ids),
            "tokens": int(ref.ids.size),
            "boundary_max_abs_err": float(err.max()),
            "boundary_mean_abs_err": float(err.mean()),
            "boundary_absmax": float(np.abs(ref.boundary).max()),
            "seconds": time.perf_counter() - started,
        }


    def _tail_logits(self, middle: np.ndarray, codec: Codec | None) -> np.ndarray:
        """u-shape: the middle's states [T, H] down the wire (``codec``) and through the tail -> logits [T, V]."""
        from edge_client.tail import TailRuntime

        tail = TailRuntime(self.bundle_dir, threads=self.threads, chunk=self.window, verify=False)
        rows = middle if codec is None else codec(middle)
        return np.concatenate([tail.run(rows[i:i + self.window], len(rows[i:i + self.window]))
                               for i in range(0, len(rows), self.window)])


def evaluate_split(bundle_dir: str | Path, front_onnx_path: str | Path | None = None, text: str | None = None,
                   max_tokens: int = 1024, window: int = 512, codec: Codec | None = None, *,
                   lm: LoadedModel | None = None, threads: int = 2) -> dict:
    """Score a bundle's edge graph (or ``front_onnx_path``) + cloud half against the unsplit model.

    Returns ``top1_agreement, mean_kl, max_kl, ppl_reference, ppl_split, ppl_delta_pct, tokens,
    boundary_max_abs_err, boundary_mean_abs_err, boundary_absmax, seconds``.
    """
    ev = SplitEvaluator(bundle_dir, lm=lm, text=text, max_tokens=max_tokens, window=window, threads=threads)
    return ev.evaluate(front_onnx_path, codec)
