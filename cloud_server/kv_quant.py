"""Compact KV storage: 8-bit keys and/or values with one scale per token and KV head.

``kv_cache_dtype`` (vLLM's ``--kv-cache-dtype``) picks how the KV pool stores keys and values
(:data:`POOL_LAYOUTS`: each of K and V has its own storage dtype, :func:`storage_dtypes`):

* ``auto``: the compute dtype (fp32 on CPU, bf16 on CUDA), no scales;
* ``int8``: keys and values symmetric int8, ``x ~= q * scale`` with ``scale = amax / 127`` over the head dimension;
* ``fp8``: keys and values ``torch.float8_e4m3fn`` with ``scale = amax / 448`` (e4m3's largest finite value), so
  every token's head vector uses the whole e4m3 range;
* ``int8v``: keys in the compute dtype (as ``auto`` stores them: plain basis, no scales), values int8 as ``int8``
  stores them (rotated, a scale each). The keys carry the 8-bit pool's loss (docs/performance.md, "What would
  close the gap": values-only int8 keeps the 16-bit pool's answers), so this pool keeps 16-bit quality for
  ``2 * D + D + 4`` bytes per token and KV head instead of ``4 * D`` at bf16 (-24 % at ``head_dim`` 128).

Scales are float32, one per (token, KV head) of every 8-bit tensor: ``head_dim + 4`` bytes per token, head and
tensor instead of ``2 * head_dim`` at bf16 (-48 % at ``head_dim`` 128 when both are 8-bit). The pool stores the
scales beside its blocks (:class:`~cloud_server.engine.kv_cache.KVCachePool`; None for a tensor stored in the
compute dtype); writers call :func:`quantize` (or :func:`write`), readers :func:`dequantize` (or :func:`read`).

**The basis rule** (one for every layout): a tensor is stored Hadamard-rotated (:func:`rotation`) exactly when it
is stored in 8 bits (:func:`stored_rotation`), so that a channel outlier does not set a whole head's scale.
Attention then runs with the queries turned into the *keys'* basis and the output turned back from the
*values'* basis: ``(q H) . (k H) = q . k`` and ``sum p (v H) = (sum p v) H``. For ``int8`` / ``fp8`` that is
both (queries in, outputs back); for ``int8v`` the keys are plain, so the queries are not rotated and only the
output is rotated back. Only this step's queries, keys, values and outputs are rotated, never the cached context.

This module is the one implementation of the rule: the generic runner (``cloud_server.attention``) and the fast
path's Triton kernels (``cloud_server.fast.kernels.rope_store``, ``cloud_server.fast.attention``) take
:func:`storage_dtypes`, :func:`qmax`, :data:`SCALE_MIN`, the scales' layout and the :func:`rotation` matrix from
here and are tested against it. Reference: vLLM's fp8 KV cache (per-tensor scales there; per-token scales here,
which need no calibration), KIVI / KVQuant (Liu et al., Hooper et al., 2024), QuaRot (Ashkboos et al., 2024).
"""

from __future__ import annotations

import functools

import torch

from cloud_server.config import KV_CACHE_DTYPES
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32
SCALE_MIN = 1e-8  # an all-zero head vector still gets a nonzero scale


@functools.lru_cache(maxsize=16)  # built once per (size, device, dtype): every layer of every step asks
def rotation(head_dim: int, device, dtype: torch.dtype) -> torch.Tensor | None:
    """The orthonormal Hadamard matrix [D, D] (Sylvester; symmetric, its own inverse) an 8-bit pool is stored in,
    or None when ``head_dim`` is not a power of two (then the pool stores the plain basis).

    A key or value head vector's few large channels (outliers) would set its one scale and flatten the rest to
    a few levels; rotated, every channel carries a share of them (QuaRot, Ashkboos et al. 2024). Attention runs
    in the rotated basis: ``(q H) . (k H) = q . k`` and ``sum p (v H) = (sum p v) H``, so only this step's
    queries, keys, values and outputs are rotated, never the cached context."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        return None
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / head_dim ** 0.5).to(device=device, dtype=dtype)


# kv_cache_dtype -> (keys, values) storage; None: the compute dtype (config.KV_CACHE_DTYPES names the same keys)
POOL_LAYOUTS: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    "auto": (None, None),
    "int8": (torch.int8, torch.int8),
    "fp8": (torch.float8_e4m3fn, torch.float8_e4m3fn),
    "int8v": (None, torch.int8),
}
assert tuple(POOL_LAYOUTS) == KV_CACHE_DTYPES


def storage_dtypes(kv_cache_dtype: str, compute_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """The element dtypes the pool stores keys and values in for ``kv_cache_dtype`` (``compute_dtype`` where a
    tensor is not quantized)."""
    if kv_cache_dtype not in POOL_LAYOUTS:
        raise ValueError(f"kv_cache_dtype: unknown {kv_cache_dtype!r} (choose from {', '.join(KV_CACHE_DTYPES)})")
    k, v = POOL_LAYOUTS[kv_cache_dtype]
    return k or compute_dtype, v or compute_dtype


def stored_rotation(scale: torch.Tensor | None, head_dim: int, device, dtype: torch.dtype) -> torch.Tensor | None:
    """The basis rule (module docstring): the rotation [D, D] (``dtype``) a pool tensor with scales ``scale`` (an
    8-bit one) is stored in; None for one stored in the compute dtype (no scales) or a ``head_dim`` that is not a
    power of two. Queries take the keys' one in, outputs the values' one back."""
    return None if scale is None else rotation(head_dim, device, dtype)


def is_quantized(dtype: torch.dtype) -> bool:
    """Storage of this dtype carries scales (int8, fp8)."""
    return dtype in _QMAX


def qmax(dtype: torch.dtype) -> float:
    """The largest stored magnitude of an 8-bit storage dtype: ``scale = amax / qmax(dtype)``."""
    return _QMAX[dtype]


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, KVH, D] (any float dtype) -> (q [N, KVH, D] of ``dtype``, scale [N, KVH] float32), x ~= q * scale.

    int8 rounds half to even (``torch.round``), then clamps to +-127; fp8 converts with round-to-nearest."""
    qmax = _QMAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(SCALE_MIN) / qmax  # [N, KVH]
    y = xf / scale[..., None]
    if dtype == torch.int8:
        y = y.round_().clamp_(-qmax, qmax)
    return y.to(dtype), scale


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor seen as uint8 (same memory): index_copy_ / gathers are not implemented for float8 on every
    device. Other dtypes are returned as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., D] (int8, fp8 or fp8's bytes) with scale [...] -> ``dtype`` [..., D] (the inverse of :func:`quantize` up to rounding)."""
    if q.dtype == torch.uint8:  # fp8 read through :func:`as_bytes`
        q = q.view(torch.float8_e4m3fn)
    return (q.float() * scale[..., None]).to(dtype)


def write(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Store x [T, KVH, D] into one layer's ``cache`` [slots, KVH, D] at ``slots`` [T] int64: quantized, with its
    scales into ``scale`` [slots, KVH], when ``scale`` is given (an 8-bit pool); cast to the cache's dtype otherwise.
    ``x`` is already in the pool's basis (rotated by the caller where the pool is)."""
    if scale is None:
        cache.index_copy_(0, slots, x.to(cache.dtype))
        return
    q, s = quantize(x, cache.dtype)  # [T, KVH, D], [T, KVH]
    as_bytes(cache).index_copy_(0, slots, as_bytes(q))
    scale.index_copy_(0, slots, s)


def read(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``dtype`` keys or values at ``slots`` (int64, any shape [...]) of one layer's ``cache`` [slots, KVH, D]
    (dequantized with ``scale`` [slots, KVH] when given): [..., KVH, D]."""
    if scale is None:
        return cache[slots].to(dtype)
    return dequantize(as_bytes(cache)[slots], scale[slots], dtype)
