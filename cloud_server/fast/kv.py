"""The static paged KV pool of the fast path, and a minimal block allocator.

One tensor each for keys and values, allocated once: ``[layers, num_blocks, block_size, kv_heads, head_dim]``
(per tensor-parallel rank, ``kv_heads`` is the rank's share). A token's *slot* is
``block * block_size + offset``; a sequence's block table lists its blocks in order, so its blocks may lie
anywhere in the pool (vLLM's PagedAttention layout, which the engine's block manager also uses).

Block 0 is reserved as the *null block*: rows that pad a decode batch up to its CUDA-graph bucket write
their throw-away keys there and read it back, so padding never touches a live sequence.

Reference: Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention"
(SOSP 2023).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NULL_BLOCK = 0


@dataclass(slots=True)
class KVPoolConfig:
    num_layers: int
    num_blocks: int  # including the null block
    block_size: int = 16  # tokens per block: the engine's page size
    num_kv_heads: int = 2  # per rank
    head_dim: int = 128

    def __post_init__(self):
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVPoolConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_blocks < 2:
            raise ValueError(f"KVPoolConfig.num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")

    def bytes_per_block(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def for_tokens(cls, num_layers: int, tokens: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> KVPoolConfig:
        """A pool holding ``tokens`` tokens (rounded up to whole blocks) plus the null block."""
        return cls(num_layers, -(-tokens // block_size) + 1, block_size, num_kv_heads, head_dim)


class KVPool:
    def __init__(self, cfg: KVPoolConfig, dtype: torch.dtype, device: str | torch.device):
        self.cfg = cfg
        shape = (cfg.num_layers, cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, NB, BS, KVH, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]  # each [NB, BS, KVH, D], contiguous

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class OutOfBlocks(Exception):
    """The pool has no free block left for a request."""


class BlockAllocator:
    """Free-list of the pool's blocks (block 0 excluded); the benchmark's stand-in for the engine's manager."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError("a pool needs at least 2 blocks (block 0 is reserved)")
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, num_tokens: int) -> list[int]:
        """Blocks for ``num_tokens`` tokens (a request reserves its prompt + max new tokens up front)."""
        n = -(-num_tokens // self.block_size)
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks for {num_tokens} tokens, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
