"""The bundle's drafter on the phone: boundary states -> a guess at the next token (self-speculative drafts).

Two kinds, both fed the boundary state ``h_N`` the front computes for a token anyway, both costing per draft
one front decode step (the draft's own boundary state, which the SpecStep uploads anyway) and one drafter
evaluation:

* ``edge/draft_layers.onnx`` (``autoglm-partition draft-head --layers``): a few of the cloud's own layers
  and the lm_head, with its own KV (``edge_client.draft_layers.LayerDrafter``; the stronger one);
* ``edge/draft_head.onnx`` (``autoglm-partition draft-head``, ``partition_tools.draft_head``): a calibrated
  linear lens onto the lm_head, int8, stateless (:class:`DraftHead`).

:func:`open_draft_head` opens the bundle's (the layer drafter when the manifest lists both); bundles without
either draft by prompt lookup only (it returns None). Both speak one interface to the speculative loop
(``edge_client.generation``): ``note(start, ids, rows)`` (the front's context from ``start`` on),
``catch_up()``, ``propose()`` (the next token after the last noted row), ``reset()``, ``seconds``, ``kind``.

Only numpy and onnxruntime: this module runs on the phone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shared.manifest import Manifest

from .draft_layers import DRAFT_LAYERS, LayerDrafter

DRAFT_HEAD = "edge/draft_head.onnx"


class DraftHead:
    """One onnxruntime session over a draft head graph: ``hidden`` float32 [S, H] -> ``token_ids`` int64 [S]."""

    kind = "lens"

    def __init__(self, path: str | Path, threads: int = 2):
        from .front import open_session

        self.session = open_session(path, threads)
        self._row: np.ndarray | None = None  # the last noted boundary state [1, H]
        self.seconds = 0.0

    def next_tokens(self, hidden: np.ndarray) -> np.ndarray:
        """The proposed next token after each row of ``hidden`` [S, H]: int64 [S]."""
        if hidden.ndim != 2:
            raise ValueError(f"draft head input must be [S, H], got shape {hidden.shape}")
        t0 = time.perf_counter()
        out = self.session.run(None, {"hidden": np.ascontiguousarray(hidden, dtype=np.float32)})[0]
        self.seconds += time.perf_counter() - t0
        return out

    def next_token(self, row: np.ndarray) -> int:
        """The proposed next token after one boundary state ``row`` [H] (or [1, H])."""
        return int(self.next_tokens(row.reshape(1, -1))[0])

    # the drafting interface (module docstring): the lens needs the last row only
    def note(self, start: int, ids: Sequence[int], rows: np.ndarray) -> None:
        del start, ids
        self._row = np.asarray(rows)[-1:]

    def catch_up(self) -> None:
        pass

    def propose(self) -> int:
        if self._row is None:
            raise ValueError("propose: nothing noted yet")
        return self.next_token(self._row)

    def reset(self) -> None:
        self._row = None


def open_draft_head(bundle: str | Path, manifest: Manifest, threads: int = 2) -> LayerDrafter | DraftHead | None:
    """The bundle's drafter when its manifest lists one (its hash is checked with the edge's other artifacts
    at load), else None."""
    if DRAFT_LAYERS in manifest.artifacts:
        return LayerDrafter.open(bundle, manifest, threads)
    if DRAFT_HEAD not in manifest.artifacts:
        return None
    return DraftHead(Path(bundle) / DRAFT_HEAD, threads)
