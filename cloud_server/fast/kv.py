"""The paged KV pool as the fast path reads it: per layer, blocks of keys and values.

One tensor each for keys and values, allocated once (by the engine's ``KVCachePool``, which the fast path views
block-wise): ``[layers, num_blocks, block_size, kv_heads, head_dim]``
(per tensor-parallel rank, ``kv_heads`` is the rank's share). A token's *slot* is
``block * block_size + offset``; a sequence's block table lists its blocks in order, so its blocks may lie
anywhere in the pool (vLLM's PagedAttention layout, which the engine's block manager also uses).

Block 0 is reserved as the *null block*: rows that pad a decode batch up to its CUDA-graph bucket write
their throw-away keys there and read it back, so padding never touches a live sequence.

Reference: Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention"
(SOSP 2023).
"""

from __future__ import annotations

import torch

NULL_BLOCK = 0


class KVPool:
    """Keys and values of every layer of this half (this rank's KV heads), each ``[L, NB, BS, KVH, D]``."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        if k.dim() != 5 or k.shape != v.shape:
            raise ValueError(f"KV pool tensors must both be [L, NB, BS, KVH, D], got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        if k.shape[1] < 2:
            raise ValueError(f"a KV pool needs >= 2 blocks (block 0 is reserved), got {k.shape[1]}")
        self.k, self.v = k, v

    @classmethod
    def zeros(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: str | torch.device) -> KVPool:
        """A pool of its own (``num_blocks`` including the null block)."""
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @classmethod
    def view_of(cls, pool) -> KVPool:
        """The engine's ``KVCachePool`` (k, v [L, NB * BS, KVH, D]) seen block-wise: same memory, no copy."""
        layers, _, kvh, d = pool.k.shape
        shape = (layers, pool.num_blocks, pool.block_size, kvh, d)
        return cls(pool.k.view(shape), pool.v.view(shape))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]  # each [NB, BS, KVH, D], contiguous

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
