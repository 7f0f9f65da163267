"""The layer-skipping drafter on the phone: a few of the cloud's layers continue from the boundary state.

``edge/draft_layers.onnx`` (written by ``autoglm-partition draft-head --layers``, ``partition_tools.draft_layers``)
holds M of the cloud's decoder layers (the model's own weights, int8; the skipped ones absent), the final norm
and the lm_head, with the u-shape tail's interface (hidden states in, logits out, its own in-place KV:
``edge_client.tail.StatesRuntime``). Fed the boundary state ``h_N`` the front computes for every token anyway,
it guesses the model's next token (self-speculative drafting by layer skipping: Draft & Verify, LayerSkip).

The drafter mirrors the front's context: its KV holds its M layers' keys and values of the same positions.
The caller *notes* the front's boundary rows as they become part of the context (:meth:`LayerDrafter.note`:
"positions [start, start + n) hold these tokens and rows, nothing after"; a rejection is a note that ends
earlier); the drafter runs what it lacks only when a draft is wanted (:meth:`LayerDrafter.propose`) or when
told to catch up (:meth:`LayerDrafter.catch_up`: after the prompt is sent, while the first token is on its
way). Positions it already holds with the same tokens are kept (an agent step re-sends the previous step's
system prompt and task: only the new tail of the prompt runs). Drafting chain, one draft per front step::

    note(p, [t], front(t)) -> propose() = d1 -> note(p + 1, [d1], front(d1)) -> propose() = d2 -> ...

Only numpy and onnxruntime: this module runs on the phone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shared.manifest import BundleError, Manifest

from .tail import StatesRuntime

DRAFT_LAYERS = "edge/draft_layers.onnx"
VOCAB_KEY = "autoglm.draft_vocab"  # graph metadata: JSON token ids of the logits' columns (a --vocab drafter)


class LayerDrafter:
    """The drafter graph and its mirror of the front's context (module docstring)."""

    kind = "layers"

    def __init__(self, path: str | Path, manifest: Manifest, n_layers: int, threads: int = 2, chunk: int = 128):
        path = Path(path)
        if not path.is_file():
            raise BundleError(f"{path}: missing (the manifest lists a layer drafter)")
        self.graph = StatesRuntime(path, manifest, n_layers, threads, chunk)
        vocab = self.graph.meta.get(VOCAB_KEY)
        self.vocab = None if vocab is None else np.asarray(json.loads(vocab), np.int64)  # [K] or all
        self._ids: list[int] = []  # the token at each position of the mirrored context
        self._pending: list[np.ndarray] = []  # rows [1, H] of positions [graph.length, len(_ids)), not run yet
        self._last: int | None = None  # the proposal after position graph.length - 1, once computed

    @classmethod
    def open(cls, bundle: str | Path, manifest: Manifest, threads: int = 2) -> LayerDrafter:
        report = manifest.quant_report.get("draft_layers")
        if not isinstance(report, dict) or not report.get("layers"):
            raise BundleError(f"{bundle}: the manifest lists {DRAFT_LAYERS} but records no draft layers")
        return cls(Path(bundle) / DRAFT_LAYERS, manifest, len(report["layers"]), threads)

    @property
    def length(self) -> int:
        """Positions of the mirrored context (run or pending)."""
        return len(self._ids)

    @property
    def seconds(self) -> float:
        """The drafter graph's compute so far."""
        return self.graph.stats.seconds

    def reset(self) -> None:
        self.graph.reset()
        self._ids, self._pending, self._last = [], [], None

    def note(self, start: int, ids: Sequence[int], rows: np.ndarray) -> None:
        """The front's context from position ``start`` on is exactly ``ids`` [n] with boundary rows ``rows``
        [n, H] (nothing after them). Positions already held with the same tokens are kept."""
        rows = np.asarray(rows, np.float32)
        if rows.ndim != 2 or rows.shape[0] != len(ids):
            raise ValueError(f"note: {len(ids)} ids and rows of shape {rows.shape}")
        if not 0 <= start <= self.length:
            raise ValueError(f"note at position {start}: the drafter mirrors {self.length} positions")
        keep = start
        while keep - start < len(ids) and keep < self.length and self._ids[keep] == int(ids[keep - start]):
            keep += 1
        if ids and keep == start + len(ids) and (keep < self.graph.length or
                                                 (keep == self.graph.length and self._last is None)):
            keep -= 1  # all held, but the proposal after the last row is gone (or never was): run it again
        self._truncate(keep)
        self._ids += [int(t) for t in ids[keep - start:]]
        self._pending += [rows[j:j + 1] for j in range(keep - start, len(ids))]

    def _truncate(self, n: int) -> None:
        run = self.graph.length
        if n < run:
            self.graph.truncate(n)
            self._last = None
            self._pending = []
        else:
            self._pending = self._pending[:n - run]
        del self._ids[n:]

    def catch_up(self) -> None:
        """Run the pending rows (in chunks); afterwards :meth:`propose` costs nothing more."""
        if not self._pending:
            return
        rows = np.concatenate(self._pending, axis=0)  # [n, H]
        self._pending = []
        self._last = int(self._argmax(self.graph.prefill(rows))[0])

    def propose(self) -> int:
        """The drafter's next token after the last noted position."""
        if not self._ids:
            raise ValueError("propose: nothing noted yet")
        self.catch_up()
        return self._last

    def next_tokens(self, rows: np.ndarray) -> np.ndarray:
        """Evaluation: append ``rows`` [S, H] as new positions and return the proposal after each: int64 [S]
        (one call; the mirrored context is not tracked, :meth:`reset` before drafting again)."""
        rows = np.asarray(rows, np.float32)
        return self._argmax(self.graph.run(rows, rows.shape[0]))

    def _argmax(self, logits: np.ndarray) -> np.ndarray:
        slot = logits.argmax(-1)  # [rows]
        return slot.astype(np.int64) if self.vocab is None else self.vocab[slot]
