"""build_batch: the flat batch's positions, pool slots, lengths and sampled rows, checked per position."""

from __future__ import annotations

import random

import pytest
import torch

from cloud_server.engine.model_runner import build_batch
from cloud_server.engine.sequence import InputChunk


def _reference_slots(start: int, n: int, table: list[int], bs: int) -> list[int]:
    return [table[p // bs] * bs + p % bs for p in range(start, start + n)]


@pytest.mark.parametrize("seed", range(6))
def test_flat_batch_matches_the_per_position_definition(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    chunks, tables, sample = [], [], []
    for _ in range(rng.randint(1, 10)):
        start, n = rng.randint(0, 300), rng.choice([1, 1, 3, 64, 65, 150])  # decode, short and long chunks
        tables.append(rng.sample(range(2000), -(-(start + n) // bs) + rng.randint(0, 2)))
        chunks.append(InputChunk(start, hidden=torch.randn(n, 8)))
        sample.append(rng.random() < 0.7)
    b = build_batch(chunks, tables, bs, sample)
    pos = [p for c in chunks for p in range(c.start, c.end)]
    slots = [s for c, t in zip(chunks, tables) for s in _reference_slots(c.start, c.n, t, bs)]
    ends = torch.tensor([c.n for c in chunks]).cumsum(0) - 1
    assert b.positions.dtype == b.slot_mapping.dtype == b.logits_indices.dtype == torch.long
    assert b.positions.tolist() == pos and b.slot_mapping.tolist() == slots
    assert b.query_lens == [c.n for c in chunks] and b.context_lens == [c.end for c in chunks]
    assert b.logits_indices.tolist() == [int(e) for e, w in zip(ends, sample) if w]
    assert torch.equal(b.hidden, torch.cat([c.hidden for c in chunks]))
    assert b.block_tables == tables and all(x is not y for x, y in zip(b.block_tables, tables))
    assert b.input_ids is None and b.rope_positions is None


def test_token_ids_and_rope_positions():
    rope = torch.tensor([[5, 6], [7, 8], [9, 9]])
    chunks = [InputChunk(3, token_ids=torch.tensor([4])), InputChunk(0, token_ids=torch.tensor([1, 2]),
                                                                     rope_positions=rope)]
    b = build_batch(chunks, [[2], [0]], 4, [True, False])
    assert b.input_ids.tolist() == [4, 1, 2] and b.hidden is None
    assert b.slot_mapping.tolist() == [11, 0, 1] and b.logits_indices.tolist() == [0]
    assert b.rope_positions.tolist() == [[3, 5, 6], [3, 7, 8], [3, 9, 9]]  # text positions on all 3 axes


def test_bad_batches_are_refused():
    h = InputChunk(0, hidden=torch.zeros(1, 4))
    t = InputChunk(0, token_ids=torch.tensor([1]))
    with pytest.raises(ValueError, match="mixes"):
        build_batch([h, t], [[0], [1]], 4, [True, True])
    with pytest.raises(ValueError, match="empty"):
        build_batch([], [], 4, [])
    with pytest.raises(IndexError):  # the table does not cover the chunk's positions
        build_batch([InputChunk(4, hidden=torch.zeros(1, 4))], [[0]], 4, [True])
