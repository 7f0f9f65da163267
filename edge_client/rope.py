"""Rotary angles for the fused edge graph of 3-D (multimodal) rope families, in numpy.

GLM-4.1V gives each token a (t, h, w) position; the R/2 frequencies of a head are split into
``mrope_section = [a, b, c]`` (a + b + c = R/2) and section j takes its angle from axis j. The fused
graph (``partition_tools.graph_builder``) receives the resulting per-token cos/sin ``[S, R/2]`` as inputs,
so images only change the positions computed here. Text tokens have t = h = w = their index, which is
plain 1-D rope.
"""

from __future__ import annotations

import numpy as np


def rope_inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
    """theta^(-2i / R) for i in [0, R/2): float64 [R/2]."""
    return 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


def mrope_cos_sin(positions: np.ndarray, theta: float, rotary_dim: int,
                  mrope_section: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin float32 [S, R/2] of ``positions`` int [3, S] (or [S]: a text run, all axes equal)."""
    pos = np.asarray(positions, dtype=np.float64)
    if pos.ndim == 1:
        pos = np.broadcast_to(pos, (3, pos.size))
    if pos.ndim != 2 or pos.shape[0] != 3:
        raise ValueError(f"positions: expected [3, S] or [S], got shape {pos.shape}")
    if sum(mrope_section) != rotary_dim // 2 or len(mrope_section) != 3:
        raise ValueError(f"mrope_section {mrope_section}: must be 3 sections summing to R/2 = {rotary_dim // 2}")
    freqs = pos[:, :, None] * rope_inv_freq(theta, rotary_dim)  # [3, S, R/2]
    axis = np.repeat(np.arange(3), mrope_section)  # [R/2]: which position axis each frequency reads
    angles = freqs[axis, :, np.arange(axis.size)].T  # [S, R/2]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_feeds(positions: np.ndarray, params: dict) -> dict[str, np.ndarray]:
    """The fused graph's ``rope_cos`` / ``rope_sin`` inputs for ``positions`` ([3, S] or [S]); ``params``:
    the graph's ``autoglm.mrope`` metadata (theta, rotary_dim, mrope_section)."""
    cos, sin = mrope_cos_sin(positions, float(params["theta"]), int(params["rotary_dim"]),
                             list(params["mrope_section"]))
    return {"rope_cos": cos, "rope_sin": sin}
