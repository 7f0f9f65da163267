"""The bundle's draft head on the phone: boundary state -> a guess at the next token (self-speculative drafts).

``edge/draft_head.onnx`` (written by ``autoglm-partition draft-head``, ``partition_tools.draft_head``) maps the
boundary state ``h_N`` the front computes for a token anyway to the model's likely next token: a calibrated
linear lens onto the lm_head (int8). Drafting with it costs, per draft, one front decode step (the draft's own
boundary state, which the SpecStep uploads anyway) and one head evaluation. Bundles without the file draft by
prompt lookup only (:func:`open_draft_head` returns None).

Only numpy and onnxruntime: this module runs on the phone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shared.manifest import Manifest

DRAFT_HEAD = "edge/draft_head.onnx"


class DraftHead:
    """One onnxruntime session over a draft head graph: ``hidden`` float32 [S, H] -> ``token_ids`` int64 [S]."""

    def __init__(self, path: str | Path, threads: int = 2):
        from .front import open_session

        self.session = open_session(path, threads)

    def next_tokens(self, hidden: np.ndarray) -> np.ndarray:
        """The proposed next token after each row of ``hidden`` [S, H]: int64 [S]."""
        if hidden.ndim != 2:
            raise ValueError(f"draft head input must be [S, H], got shape {hidden.shape}")
        return self.session.run(None, {"hidden": np.ascontiguousarray(hidden, dtype=np.float32)})[0]

    def next_token(self, row: np.ndarray) -> int:
        """The proposed next token after one boundary state ``row`` [H] (or [1, H])."""
        return int(self.next_tokens(row.reshape(1, -1))[0])


def open_draft_head(bundle: str | Path, manifest: Manifest, threads: int = 2) -> DraftHead | None:
    """The bundle's draft head when its manifest lists one (its hash is checked with the edge's other
    artifacts at load), else None."""
    if DRAFT_HEAD not in manifest.artifacts:
        return None
    return DraftHead(Path(bundle) / DRAFT_HEAD, threads)
