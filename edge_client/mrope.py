"""GLM-4.1V's 3-D multimodal RoPE positions, computed on the phone (numpy port of ``get_rope_index``).

Every prompt token gets a (t, h, w) position. Text runs count up on all three axes together. An image of
``grid_thw = (t, h, w)`` patches becomes ``t * h/m * w/m`` tokens (``m``: the spatial merge size) whose
positions start at the running position ``p``: ``(p + i_t, p + i_h, p + i_w)``; after it the running
position advances by ``max(h, w) / m`` (not by its token count), so text after a large image sits at much
smaller positions than its index. The *rope delta* ``max(position) + 1 - S`` then gives every later token
(decoding, a follow-up turn without images) its position: index + delta on all three axes.

Positions travel with the hidden states (``Prefill.rope_positions`` / ``DecodeStep.rope_positions``);
the edge front feeds their rotary angles to its graph (``edge_client.rope``).

Reference: transformers ``Glm4vModel.get_rope_index`` / ``get_vision_position_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """One image in the prompt: its first placeholder token's index and its patch grid."""

    start: int  # index of the first image token in the prompt
    grid_thw: tuple[int, int, int]  # (t, h, w) in patches, as the processor returns it

    def n_tokens(self, merge: int) -> int:
        t, h, w = self.grid_thw
        return t * (h // merge) * (w // merge)


def vision_positions(start: int, grid_thw: tuple[int, int, int], merge: int) -> np.ndarray:
    """Positions int64 [3, n] of one image's tokens starting at running position ``start``."""
    t, h, w = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt, hh, ww]).reshape(3, -1).astype(np.int64) + start


def rope_index(n_tokens: int, images: list[ImageSpan], merge: int) -> tuple[np.ndarray, int]:
    """Positions int64 [3, S] of a prompt of ``n_tokens`` with ``images`` (in order, not overlapping), and
    its rope delta (``max + 1 - S``: add it to a later token's index to get its position)."""
    parts: list[np.ndarray] = []
    pos = 0  # the running position
    idx = 0  # prompt index
    for img in sorted(images, key=lambda s: s.start):
        n = img.n_tokens(merge)
        if img.start < idx or img.start + n > n_tokens:
            raise ValueError(f"image at tokens [{img.start}, {img.start + n}) overlaps another or the prompt end "
                             f"({n_tokens} tokens)")
        text = img.start - idx
        parts.append(np.broadcast_to(np.arange(text, dtype=np.int64) + pos, (3, text)))
        pos += text
        parts.append(vision_positions(pos, img.grid_thw, merge))
        pos += max(img.grid_thw[1], img.grid_thw[2]) // merge
        idx = img.start + n
    tail = n_tokens - idx
    parts.append(np.broadcast_to(np.arange(tail, dtype=np.int64) + pos, (3, tail)))
    positions = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), np.int64)  # [3, S]
    delta = int(positions.max()) + 1 - n_tokens if n_tokens else 0
    return np.ascontiguousarray(positions), delta


def text_positions(start: int, n: int, delta: int) -> np.ndarray:
    """Positions int64 [3, n] of tokens at indices [start, start + n) after the prompt's images."""
    return np.broadcast_to(np.arange(start, start + n, dtype=np.int64) + delta, (3, n)).copy()
