"""edge_client.mrope against transformers' own Glm4vModel.get_rope_index."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_client.mrope import ImageSpan, rope_index, text_positions

IMG, BOI, EOI = 10, 12, 13


@pytest.fixture(scope="module")
def glm4v():
    from partition_tools.models import load_model

    return load_model("tiny-glm4v").model


def _prompt(parts: list) -> tuple[list[int], list[tuple[int, int, int]]]:
    """parts: ints (text tokens) or (t, h, w) grids -> ids with BOI, n image tokens, EOI; the grids."""
    ids, grids = [], []
    for p in parts:
        if isinstance(p, tuple):
            grids.append(p)
            ids += [BOI] + [IMG] * (p[0] * (p[1] // 2) * (p[2] // 2)) + [EOI]
        else:
            ids += list(range(20, 20 + p))
    return ids, grids


def _spans(ids: list[int], grids: list[tuple[int, int, int]]) -> list[ImageSpan]:
    """Each image's span: its tokens start after its BOI (as media.assemble places them)."""
    return [ImageSpan(i + 1, g) for i, g in zip([i for i, t in enumerate(ids) if t == BOI], grids, strict=True)]


@pytest.mark.parametrize("parts", [
    [5, (1, 4, 6), 7],
    [3, (1, 14, 22), 2, (1, 6, 4), 9],  # two images, one wide and one tall
    [(1, 8, 8), 4],  # image first
    [6],  # text only
])
def test_positions_and_delta_match_transformers(glm4v, parts):
    ids, grids = _prompt(parts)
    types = [1 if t == IMG else 0 for t in ids]
    ref_pos, ref_delta = glm4v.model.get_rope_index(
        torch.tensor([ids]), torch.tensor([types]),
        image_grid_thw=torch.tensor(grids) if grids else None)
    pos, delta = rope_index(len(ids), _spans(ids, grids), 2)
    np.testing.assert_array_equal(pos, ref_pos[:, 0].numpy())
    assert delta == int(ref_delta[0, 0])
    if grids:  # an image shrinks later positions: delta < 0 for any image wider than one token
        assert delta < 0


def test_decode_positions_continue_with_the_delta(glm4v):
    """A prompt + generated tokens, all positions at once (the HF model's view of decoding), equals the
    prompt's positions followed by index + delta."""
    ids, grids = _prompt([3, (1, 6, 8), 4])
    full = ids + [30, 31, 32]
    types = [1 if t == IMG else 0 for t in full]
    ref, _ = glm4v.model.get_rope_index(torch.tensor([full]), torch.tensor([types]),
                                        image_grid_thw=torch.tensor(grids))
    pos, delta = rope_index(len(ids), _spans(ids, grids), 2)
    np.testing.assert_array_equal(np.concatenate([pos, text_positions(len(ids), 3, delta)], axis=1),
                                  ref[:, 0].numpy())


def test_spans_must_not_overlap():
    with pytest.raises(ValueError, match="overlaps"):
        rope_index(6, [ImageSpan(4, (1, 4, 4))], 2)
