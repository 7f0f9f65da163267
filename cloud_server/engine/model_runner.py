"""One forward pass of the cloud's layers over a flat, varlen batch: ``ModelRunner.run(batch) -> logits``.

A :class:`Batch` is the step's sequences flattened to ``T`` tokens (sequence ``i`` owns rows
``[cu[i], cu[i+1])``): boundary hidden states ``[T, H]`` (split mode) or token ids ``[T]`` (full-model mode),
absolute positions ``[T]``, the pool slot of every token ``[T]``, per-sequence query and context lengths and
block tables, and the rows whose logits are wanted. It is plain tensors and lists so it can be broadcast to
tensor-parallel ranks (``cloud_server.tp``) and so a hand-written fast path (e.g. a fused GLM kernel) can
take the same input.

The runner drives the library's decoder layers on ``[1, T, H]`` with the paged attention context installed
(``cloud_server.attention``); logits are computed only for the sampled rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cloud_server.attention import AttentionContext, attention_context
from cloud_server.engine.kv_cache import KVCachePool
from cloud_server.model import CloudModel
from partition_tools.adapters import call_layer


@dataclass(slots=True)
class Batch:
    positions: torch.Tensor  # [T] int64 absolute positions
    slot_mapping: torch.Tensor  # [T] int64 pool slot each token's K/V is written to
    query_lens: list[int]  # [B] tokens per sequence this step
    context_lens: list[int]  # [B] cached tokens per sequence after this step
    block_tables: list[list[int]]  # [B] block ids in position order
    logits_indices: torch.Tensor  # [S] int64 rows (of T) whose logits are wanted (all of a speculative chunk's)
    hidden: torch.Tensor | None = None  # [T, H] float32 boundary hidden states (split mode)
    input_ids: torch.Tensor | None = None  # [T] int64 token ids (full-model mode)
    rope_positions: torch.Tensor | None = None  # [3, T] int64 multimodal RoPE positions (GLM-4.1V)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


# Chunks up to this many positions are flattened as Python ints (decode steps, short chunks: one
# ``torch.tensor`` per field for the whole batch); longer prefill chunks as tensor ops (cheaper per position).
_LIST_MAX = 64


class _Int64Column:
    """A flat int64 column appended to in order, as runs of Python ints or whole tensors; one tensor at the end."""

    __slots__ = ("parts", "run")

    def __init__(self):
        self.parts: list[torch.Tensor] = []
        self.run: list[int] = []

    def _flush(self) -> None:
        self.parts.append(torch.tensor(self.run, dtype=torch.long))  # copies: the run list is reused
        self.run.clear()

    def add_tensor(self, t: torch.Tensor) -> None:
        if self.run:
            self._flush()
        self.parts.append(t)

    def tensor(self) -> torch.Tensor:
        if self.run or not self.parts:
            self._flush()
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)


def build_batch(chunks, block_tables: list[list[int]], block_size: int, sample: list[bool],
                all_rows: bool = False, host_buffer=None) -> Batch:
    """Flatten scheduled input chunks (``InputChunk`` list, same order as ``block_tables``) into a Batch.
    ``all_rows``: every position's row is wanted (u-shape: the hidden states of all of them go back).
    ``host_buffer(shape, dtype)`` (a runner's, optional): the tensor the batch's hidden states are concatenated
    into (e.g. page-locked memory the runner uploads from without another copy).

    Position ``p`` of a chunk goes to pool slot ``table[p // block_size] * block_size + p % block_size``."""
    if not chunks:
        raise ValueError("an empty batch")
    positions, slots = _Int64Column(), _Int64Column()
    pos_run, slot_run = positions.run, slots.run
    q_lens, c_lens, rows, hiddens, ids, ropes = [], [], [], [], [], []
    any_rope = any(c.rope_positions is not None for c in chunks)
    bs = block_size
    t = 0
    for chunk, table, want in zip(chunks, block_tables, sample, strict=True):
        start, end, n = chunk.start, chunk.end, chunk.n
        if n == 1:  # a decode step
            pos_run.append(start)
            slot_run.append(table[start // bs] * bs + start % bs)
        elif n <= _LIST_MAX:
            pos_run.extend(range(start, end))
            slot_run.extend([table[p // bs] * bs + p % bs for p in range(start, end)])
        else:
            pos = torch.arange(start, end)  # [n]
            tab = torch.tensor(table, dtype=torch.long)
            positions.add_tensor(pos)
            slots.add_tensor(tab[pos // bs] * bs + pos % bs)
        q_lens.append(n)
        c_lens.append(end)
        t += n
        if all_rows:
            rows.extend(range(t - n, t))
        elif want:
            if chunk.draft_ids is not None:  # a speculative step: every position is verified
                rows.extend(range(t - n, t))
            else:
                rows.append(t - 1)
        if any_rope:  # text positions ride on all three axes
            r = chunk.rope_positions
            ropes.append(r if r is not None else torch.arange(start, end).expand(3, -1))
        if chunk.hidden is not None:
            hiddens.append(chunk.hidden)
        else:
            ids.append(chunk.token_ids)
    if hiddens and ids:
        raise ValueError("a batch mixes hidden-state and token-id inputs")
    hidden = None
    if hiddens:
        if host_buffer is not None and all(h.dtype == torch.float32 for h in hiddens):
            hidden = torch.cat(hiddens, out=host_buffer((t, hiddens[0].shape[1]), torch.float32))  # [T, H]
        else:
            hidden = torch.cat(hiddens).float()  # [T, H]
    return Batch(
        positions=positions.tensor(), slot_mapping=slots.tensor(), query_lens=q_lens, context_lens=c_lens,
        block_tables=[list(tb) for tb in block_tables], logits_indices=torch.tensor(rows, dtype=torch.long),
        hidden=hidden, input_ids=torch.cat(ids) if ids else None,
        rope_positions=torch.cat(ropes, dim=1).long() if ropes else None,
    )


class ModelRunner:
    """Runs one :class:`CloudModel` (one compute variant) against its :class:`KVCachePool`."""

    def __init__(self, model: CloudModel, pool: KVCachePool, batch_invariant: bool = True):
        self.model = model
        self.pool = pool
        self.batch_invariant = batch_invariant
        self.device = pool.k.device

    def _seq_slots(self, batch: Batch) -> list[torch.Tensor]:
        bs = self.pool.block_size
        offs = torch.arange(bs)
        out = []
        for table, ctx in zip(batch.block_tables, batch.context_lens, strict=True):
            slots = (torch.tensor(table, dtype=torch.long)[:, None] * bs + offs).flatten()[:ctx]  # [ctx]
            out.append(slots.to(self.device))
        return out

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """Forward ``batch``; returns float32 logits ``[S, V]`` for ``batch.logits_indices`` (on every
        tensor-parallel rank: a sharded lm_head gathers the vocabulary); a u-shape middle (no lm_head) returns
        those rows' hidden states ``[S, H]`` instead."""
        m, dev = self.model, self.device
        if batch.hidden is not None:
            hidden = batch.hidden.to(device=dev, dtype=m.dtype)[None]  # [1, T, H]
        else:
            if m.embed_tokens is None:
                raise ValueError("this model has no token embeddings (split mode expects hidden states)")
            hidden = m.embed_tokens(batch.input_ids.to(dev))[None]  # [1, T, H]
        position_ids = batch.positions.to(dev)[None]  # [1, T]
        rope = None if batch.rope_positions is None else batch.rope_positions.to(dev)[:, None]  # [3, 1, T]
        cos_sin = m.position_embeddings(hidden, position_ids, rope)
        ctx = AttentionContext(k_cache=self.pool.k, v_cache=self.pool.v, slot_mapping=batch.slot_mapping.to(dev),
                               query_lens=batch.query_lens, context_lens=batch.context_lens,
                               seq_slots=self._seq_slots(batch), batch_invariant=self.batch_invariant,
                               k_scale=self.pool.k_scale, v_scale=self.pool.v_scale)
        with attention_context(ctx):
            for layer in m.layers:
                hidden = call_layer(layer, hidden, attention_mask=None, position_ids=position_ids,
                                    position_embeddings=cos_sin)
        last = hidden[0, batch.logits_indices.to(dev)]  # [S, H]
        if m.returns_states:
            return last.float()  # [S, H]
        return m.lm_head(m.norm(last)).float()  # [S, V]
