"""The paged KV pool as the fast path reads it: per layer, blocks of keys and values.

One tensor each for keys and values, allocated once (by the engine's ``KVCachePool``, which the fast path views
block-wise): ``[layers, num_blocks, block_size, kv_heads, head_dim]``
(per tensor-parallel rank, ``kv_heads`` is the rank's share). A token's *slot* is
``block * block_size + offset``; a sequence's block table lists its blocks in order, so its blocks may lie
anywhere in the pool (vLLM's PagedAttention layout, which the engine's block manager also uses).

An 8-bit pool (``kv_cache_dtype`` int8 / fp8 / int8v, :mod:`cloud_server.kv_quant`) also holds one float32 scale
per token and KV head of each 8-bit tensor, ``[L, NB, BS, KVH]`` (int8v: values only; its keys are stored in the
compute dtype, as a 16-bit pool's), and stores its 8-bit tensors in the Hadamard-rotated basis of
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

from cloud_server.kv_quant import SCALE_DTYPE, is_quantized, rotation, storage_dtypes

NULL_BLOCK = 0


@dataclass(frozen=True, slots=True)
class LayerScales:
    """What an 8-bit pool's layer adds to its blocks: the float32 scales of its keys and values, each
    ``[NB, BS, KVH]`` (one per token and KV head, ``x ~= q * scale``) or None for a tensor stored in the compute
    dtype (int8v's keys), and the rotation ``[D, D]`` (compute dtype) its 8-bit tensors are stored in, or None
    where the pool keeps the plain basis (``head_dim`` not a power of two)."""

    k: torch.Tensor | None
    v: torch.Tensor | None
    rotation: torch.Tensor | None

    @property
    def k_rotation(self) -> torch.Tensor | None:
        """The keys' basis (kv_quant's basis rule): queries are turned into it before they meet the keys."""
        return None if self.k is None else self.rotation

    @property
    def v_rotation(self) -> torch.Tensor | None:
        """The values' basis: attention outputs are turned back from it."""
        return None if self.v is None else self.rotation


class KVPool:
    """Keys and values of every layer of this half (this rank's KV heads), each ``[L, NB, BS, KVH, D]``; for an
    8-bit pool also the scales ``[L, NB, BS, KVH]`` of its 8-bit tensors and the rotation they are stored in."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, rotation_matrix: torch.Tensor | None = None):
        if k.dim() != 5 or k.shape != v.shape:
            raise ValueError(f"KV pool tensors must both be [L, NB, BS, KVH, D], got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        if k.shape[1] < 2:
            raise ValueError(f"a KV pool needs >= 2 blocks (block 0 is reserved), got {k.shape[1]}")
        for name, x, sc in (("key", k, k_scale), ("value", v, v_scale)):
            if is_quantized(x.dtype) != (sc is not None):
                raise ValueError(f"a {x.dtype} {name} pool needs scales exactly when it is 8-bit (int8 / fp8)")
            if sc is not None and (sc.shape != k.shape[:4] or sc.dtype != SCALE_DTYPE):
                raise ValueError(f"KV pool {name} scales must be float32 {tuple(k.shape[:4])}, got "
                                 f"{tuple(sc.shape)} {sc.dtype}")
        self.k, self.v = k, v
        self.k_scale, self.v_scale = k_scale, v_scale
        quantized = k_scale is not None or v_scale is not None
        self._scales = None if not quantized else [
            LayerScales(None if k_scale is None else k_scale[i], None if v_scale is None else v_scale[i],
                        rotation_matrix) for i in range(k.shape[0])]

    @classmethod
    def zeros(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: str | torch.device, kv_cache_dtype: str = "auto") -> KVPool:
        """A pool of its own (``num_blocks`` including the null block); ``dtype`` is the compute dtype: each of
        keys and values is stored in it or in 8 bits with scales, as ``kv_cache_dtype`` says
        (:func:`~cloud_server.kv_quant.storage_dtypes`)."""
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        k_store, v_store = storage_dtypes(kv_cache_dtype, dtype)
        k, v = torch.zeros(shape, dtype=k_store, device=device), torch.zeros(shape, dtype=v_store, device=device)
        ks, vs = (torch.zeros(shape[:4], dtype=SCALE_DTYPE, device=device) if is_quantized(st) else None
                  for st in (k_store, v_store))
        if ks is None and vs is None:
            return cls(k, v)
        return cls(k, v, ks, vs, rotation(head_dim, torch.device(device), dtype))

    @classmethod
    def view_of(cls, pool, compute_dtype: torch.dtype | None = None) -> KVPool:
        """The engine's ``KVCachePool`` (k, v [L, NB * BS, KVH, D], scales [L, NB * BS, KVH] or None) seen
        block-wise: same memory, no copy. ``compute_dtype`` (the model's) is needed for an 8-bit pool: the
        dtype its rotation is applied in, as the generic runner applies it (``cloud_server.attention``)."""
        layers, _, kvh, d = pool.k.shape
        shape = (layers, pool.num_blocks, pool.block_size, kvh, d)
        if pool.k_scale is None and pool.v_scale is None:
            return cls(pool.k.view(shape), pool.v.view(shape))
        if compute_dtype is None:
            raise ValueError("an 8-bit KV pool's view needs the compute dtype its rotation is applied in")
        ks, vs = (None if sc is None else sc.view(shape[:4]) for sc in (pool.k_scale, pool.v_scale))
        return cls(pool.k.view(shape), pool.v.view(shape), ks, vs, rotation(d, pool.k.device, compute_dtype))

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
        """Bytes of keys, values and (8-bit tensors) their scales."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None)
