"""The paged KV pool as the fast path reads it: per layer, blocks of keys and values.

One tensor each for keys and values, allocated once (by the engine's ``KVCachePool``, which the fast path views
block-wise): ``[layers, num_blocks, block_size, kv_heads, head_dim]``
(per tensor-parallel rank, ``kv_heads`` is the rank's share). A token's *slot* is
``block * block_size + offset``; a sequence's block table lists its blocks in order, so its blocks may lie
anywhere in the pool (vLLM's PagedAttention layout, which the engine's block manager also uses).

An 8-bit pool (``kv_cache_dtype`` int8 / fp8, :mod:`cloud_server.kv_quant`) also holds one float32 scale per
token and KV head, ``[L, NB, BS, KVH]``, and stores heads in the Hadamard-rotated basis of
:func:`~cloud_server.kv_quant.rotation`: :meth:`KVPool.scales` hands a layer's scales and that rotation (in the
compute dtype) to the kernels. Scales and rotation are allocated once, so the CUDA graphs capture them as they do
the blocks.

Block 0 is reserved as the *null block*: rows that pad a decode batch up to its CUDA-graph bucket write
their throw-away keys there and read it back, so padding never touches a live sequence.

Reference: Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention"
(SOSP 2023).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cloud_server.kv_quant import SCALE_DTYPE, is_quantized, rotation, storage_dtype

NULL_BLOCK = 0


@dataclass(frozen=True, slots=True)
class LayerScales:
    """What an 8-bit pool's layer adds to its blocks: the float32 scales of its keys and values, each
    ``[NB, BS, KVH]`` (one per token and KV head, ``x ~= q * scale``), and the rotation ``[D, D]`` (compute dtype)
    its heads are stored in, or None where the pool keeps the plain basis (``head_dim`` not a power of two)."""

    k: torch.Tensor
    v: torch.Tensor
    rotation: torch.Tensor | None


class KVPool:
    """Keys and values of every layer of this half (this rank's KV heads), each ``[L, NB, BS, KVH, D]``; for an
    8-bit pool also their scales ``[L, NB, BS, KVH]`` and the rotation of the stored heads."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, rotation_matrix: torch.Tensor | None = None):
        if k.dim() != 5 or k.shape != v.shape:
            raise ValueError(f"KV pool tensors must both be [L, NB, BS, KVH, D], got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        if k.shape[1] < 2:
            raise ValueError(f"a KV pool needs >= 2 blocks (block 0 is reserved), got {k.shape[1]}")
        if is_quantized(k.dtype) != (k_scale is not None) or (k_scale is None) != (v_scale is None):
            raise ValueError(f"a {k.dtype} pool needs scales exactly when it is 8-bit (int8 / fp8)")
        if k_scale is not None and (k_scale.shape != k.shape[:4] or v_scale.shape != k.shape[:4]
                                    or k_scale.dtype != SCALE_DTYPE or v_scale.dtype != SCALE_DTYPE):
            raise ValueError(f"KV pool scales must both be float32 {tuple(k.shape[:4])}, got "
                             f"{tuple(k_scale.shape)} {k_scale.dtype} and {tuple(v_scale.shape)} {v_scale.dtype}")
        self.k, self.v = k, v
        self.k_scale, self.v_scale = k_scale, v_scale
        self._scales = None if k_scale is None else [LayerScales(k_scale[i], v_scale[i], rotation_matrix)
                                                     for i in range(k.shape[0])]

    @classmethod
    def zeros(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: str | torch.device, kv_cache_dtype: str = "auto") -> KVPool:
        """A pool of its own (``num_blocks`` including the null block); ``dtype`` is the compute dtype, stored as
        it is for ``kv_cache_dtype`` ``auto`` and as 8 bits with scales for ``int8`` / ``fp8``."""
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        store = storage_dtype(kv_cache_dtype, dtype)
        k, v = torch.zeros(shape, dtype=store, device=device), torch.zeros(shape, dtype=store, device=device)
        if not is_quantized(store):
            return cls(k, v)
        ks, vs = (torch.zeros(shape[:4], dtype=SCALE_DTYPE, device=device) for _ in range(2))
        return cls(k, v, ks, vs, rotation(head_dim, torch.device(device), dtype))

    @classmethod
    def view_of(cls, pool, compute_dtype: torch.dtype | None = None) -> KVPool:
        """The engine's ``KVCachePool`` (k, v [L, NB * BS, KVH, D], scales [L, NB * BS, KVH] or None) seen
        block-wise: same memory, no copy. ``compute_dtype`` (the model's) is needed for an 8-bit pool: the
        dtype its rotation is applied in, as the generic runner applies it (``cloud_server.attention``)."""
        layers, _, kvh, d = pool.k.shape
        shape = (layers, pool.num_blocks, pool.block_size, kvh, d)
        if pool.k_scale is None:
            return cls(pool.k.view(shape), pool.v.view(shape))
        if compute_dtype is None:
            raise ValueError("an 8-bit KV pool's view needs the compute dtype its rotation is applied in")
        return cls(pool.k.view(shape), pool.v.view(shape), pool.k_scale.view(shape[:4]), pool.v_scale.view(shape[:4]),
                   rotation(d, pool.k.device, compute_dtype))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def quantized(self) -> bool:
        return self._scales is not None

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]  # each [NB, BS, KVH, D], contiguous

    def scales(self, i: int) -> LayerScales | None:
        """Layer ``i``'s scales and rotation for an 8-bit pool; None for a 16/32-bit one."""
        return None if self._scales is None else self._scales[i]

    def nbytes(self) -> int:
        """Bytes of keys, values and (8-bit pool) their scales."""
        scales = 0 if self.k_scale is None else 2 * self.k_scale.numel() * self.k_scale.element_size()
        return self.k.numel() * self.k.element_size() * 2 + scales
