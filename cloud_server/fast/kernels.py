"""Fused element-wise kernels of the GLM layer: RMSNorm, residual-add + two norms (optionally summing tensor-
parallel partial sums first), SiLU-mul, RoPE + KV store.

Eager PyTorch runs GLM-4's RMSNorm as six kernels and each layer has four of them; at decode batch 1 the
launch gaps of those tiny kernels cost more than the matrix products. Each function here is one Triton
kernel on CUDA and the plain-torch formula elsewhere (the CPU tests, and the reference the GPU run checks the
kernels against). The torch versions reproduce the library's rounding step by step (fp32 statistics, cast
to the activation dtype, then the weight product); the Triton versions keep fp32 between those steps, so in
bf16 they differ from the library by rounding only.

``backend``: ``"triton"`` or ``"torch"``; :func:`default_backend` picks Triton on CUDA when it imports.
``TRITON_INTERPRET=1`` runs the Triton kernels on CPU tensors (the tests use it when Triton is installed).

Reference: ``Glm4RMSNorm``, ``Glm4MLP``, ``apply_rotary_pos_emb`` in ``transformers.models.glm4``.
"""

from __future__ import annotations

import os

import torch

from cloud_server import kv_quant

try:  # Triton ships with CUDA builds of torch; the CPU-only CI has none.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None
    HAVE_TRITON = False

BACKENDS = ("triton", "torch")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def default_backend(device: torch.device) -> str:
    """Triton on CUDA (or under TRITON_INTERPRET=1), torch otherwise."""
    if HAVE_TRITON and (torch.device(device).type == "cuda" or interpreting()):
        return "triton"
    return "torch"


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and not HAVE_TRITON:
        raise ValueError("kernel backend 'triton' requested but triton is not installed")
    return backend


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# ------------------------------------------------------------------------------------------------
# torch formulas (the library's rounding)


def rmsnorm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return w * (x.float() * torch.rsqrt(var + eps)).to(x.dtype)


def add_norm_norm_torch(y, res, w1, w2, eps):
    h = res + rmsnorm_torch(y, w1, eps)
    return h, rmsnorm_torch(h, w2, eps)


def silu_mul_torch(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return up * torch.nn.functional.silu(gate)


def _rotate_interleaved(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rope_store_torch(qkv, positions, cos, sin, k_cache, v_cache, slots, nq, nkv, head_dim, rotary_dim, scales=None):
    t = qkv.shape[0]
    q = qkv[:, : nq * head_dim].view(t, nq, head_dim)  # [T, Hq, D] views into qkv
    k = qkv[:, nq * head_dim: (nq + nkv) * head_dim].view(t, nkv, head_dim)
    v = qkv[:, (nq + nkv) * head_dim:].view(t, nkv, head_dim)
    c = cos[positions].to(qkv.dtype).repeat_interleave(2, dim=-1)[:, None, :]  # [T, 1, R]
    s = sin[positions].to(qkv.dtype).repeat_interleave(2, dim=-1)[:, None, :]
    for x in (q, k):
        xr = x[..., :rotary_dim]
        x[..., :rotary_dim] = xr * c + _rotate_interleaved(xr) * s
    if scales is None:
        k_cache.view(-1, nkv, head_dim)[slots] = k
        v_cache.view(-1, nkv, head_dim)[slots] = v
        return
    # an 8-bit tensor is stored rotated and quantized, one in the compute dtype as it is (kv_quant's basis rule)
    for cache, scale, rot, x in ((k_cache, scales.k, scales.k_rotation, k), (v_cache, scales.v, scales.v_rotation, v)):
        kv_quant.write(cache.view(-1, nkv, head_dim), None if scale is None else scale.view(-1, nkv), slots,
                       x if rot is None else x @ rot)


# ------------------------------------------------------------------------------------------------
# Triton kernels

if HAVE_TRITON:

    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, o_ptr, stride_x, stride_o, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        y = (x * r).to(o_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(o_ptr + row * stride_o + offs, y.to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_norm_norm_kernel(y_ptr, res_ptr, w1_ptr, w2_ptr, h_ptr, o_ptr, stride_y, stride_r, stride_h, stride_o,
                              n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        dt = o_ptr.dtype.element_ty
        y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        res = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        w1 = tl.load(w1_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r1 = tl.rsqrt(tl.sum(y * y, axis=0) / n + eps)
        yn = ((y * r1).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        h = (res + yn).to(dt).to(tl.float32)
        r2 = tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
        o = (h * r2).to(dt).to(tl.float32) * w2
        tl.store(h_ptr + row * stride_h + offs, h.to(dt), mask=mask)
        tl.store(o_ptr + row * stride_o + offs, o.to(dt), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, o_ptr, stride_gu, stride_o, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        dt = o_ptr.dtype.element_ty
        g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + inter + offs, mask=mask, other=0.0).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        tl.store(o_ptr + row * stride_o + offs, (u * act).to(dt), mask=mask)

    @triton.jit
    def _rope_head(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, t, h, stride_qkv, stride_tab, NQ: tl.constexpr,
                   NKV: tl.constexpr, D: tl.constexpr, HALF_R: tl.constexpr, HALF_D_PAD: tl.constexpr):
        """Head ``h`` of token ``t``: rotate it in place if it is a q or k head; returns its (even, odd) channels."""
        dt = qkv_ptr.dtype.element_ty
        i = tl.arange(0, HALF_D_PAD)  # pair index: channels (2i, 2i + 1)
        pmask = i < D // 2
        base = qkv_ptr + t * stride_qkv + h * D
        xe = tl.load(base + 2 * i, mask=pmask, other=0.0).to(tl.float32)
        xo = tl.load(base + 2 * i + 1, mask=pmask, other=0.0).to(tl.float32)
        if h < NQ + NKV:  # rotate q and k
            pos = tl.load(pos_ptr + t)
            rmask = i < HALF_R
            c = tl.load(cos_ptr + pos * stride_tab + i, mask=rmask, other=1.0).to(dt).to(tl.float32)
            s = tl.load(sin_ptr + pos * stride_tab + i, mask=rmask, other=0.0).to(dt).to(tl.float32)
            ye = xe * c - xo * s
            yo = xo * c + xe * s
            tl.store(base + 2 * i, ye.to(dt), mask=pmask)
            tl.store(base + 2 * i + 1, yo.to(dt), mask=pmask)
        else:
            ye = xe
            yo = xo
        return ye, yo

    @triton.jit
    def _to_storage(y, scale, QMAX: tl.constexpr, INT8: tl.constexpr):
        """kv_quant.quantize's rule on fp32 rows y [R, C] with their scales [R]: int8 rounds half to even (the
        1.5 * 2**23 trick, exact for |x| < 2**22) and clamps; fp8 is rounded by the store's conversion."""
        q = y / scale[:, None]
        if INT8:
            q = (q + 12582912.0) - 12582912.0
            q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
        return q

    @triton.jit
    def _rope_quant_kv(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slot_ptr, ks_ptr, vs_ptr, rot_ptr, t, j,
                       stride_qkv, stride_tab, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
                       HALF_R: tl.constexpr, HALF_D_PAD: tl.constexpr, D_PAD: tl.constexpr, ROTATE: tl.constexpr,
                       INT8: tl.constexpr, QMAX: tl.constexpr, SCALE_MIN: tl.constexpr, IEEE: tl.constexpr,
                       QK: tl.constexpr, QV: tl.constexpr):
        """KV head ``j`` of token ``t`` into an 8-bit pool: rope the key (in place in qkv too); each of key (QK)
        and value (QV) that the pool holds in 8 bits is rotated into the pool's basis, quantized with its own
        scale and stored with it; the other is stored in the compute dtype as it is (int8v's keys)."""
        dt = qkv_ptr.dtype.element_ty
        r = tl.arange(0, 16)  # tile rows: 0 the key head, 1 the value head (a tensor-core-sized tile)
        i = tl.arange(0, HALF_D_PAD)
        pmask = i < D // 2
        m2 = (r < 2)[:, None] & pmask[None, :]
        base = qkv_ptr + t * stride_qkv + (NQ + j + r * NKV)[:, None] * D + 2 * i[None, :]  # [16, HALF]
        xe = tl.load(base, mask=m2, other=0.0).to(tl.float32)
        xo = tl.load(base + 1, mask=m2, other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + t)
        rmask = i < HALF_R
        c = tl.load(cos_ptr + pos * stride_tab + i, mask=rmask, other=1.0).to(dt).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + pos * stride_tab + i, mask=rmask, other=0.0).to(dt).to(tl.float32)[None, :]
        is_k = (r == 0)[:, None]
        is_v = (r == 1)[:, None]
        ye = tl.where(is_k, xe * c - xo * s, xe).to(dt)  # [16, HALF] as the 16-bit pool would store them
        yo = tl.where(is_k, xo * c + xe * s, xo).to(dt)
        kmask = is_k & pmask[None, :]
        vmask = is_v & pmask[None, :]
        tl.store(base, ye, mask=kmask)
        tl.store(base + 1, yo, mask=kmask)
        slot = tl.load(slot_ptr + t)
        zero = 0 * r[:, None]  # [16, 1]: every tile row addresses the same head row; masks pick the row
        k_dst = k_ptr + (slot * NKV + j) * D + zero
        v_dst = v_ptr + (slot * NKV + j) * D + zero
        if not QK:  # keys in the compute dtype, plain basis: as the 16-bit pool stores them
            tl.store(k_dst + 2 * i[None, :], ye, mask=kmask)
            tl.store(k_dst + 2 * i[None, :] + 1, yo, mask=kmask)
        if not QV:
            tl.store(v_dst + 2 * i[None, :], ye, mask=vmask)
            tl.store(v_dst + 2 * i[None, :] + 1, yo, mask=vmask)
        if ROTATE:  # y = x H over the pairs: even channels meet H's even rows, odd channels its odd rows
            cols = tl.arange(0, D_PAD)
            cmask = cols < D
            hmask = pmask[:, None] & cmask[None, :]
            he = tl.load(rot_ptr + (2 * i)[:, None] * D + cols[None, :], mask=hmask, other=0.0)  # [HALF, D]
            ho = tl.load(rot_ptr + (2 * i + 1)[:, None] * D + cols[None, :], mask=hmask, other=0.0)
            if IEEE:
                y = tl.dot(ye, he, input_precision="ieee") + tl.dot(yo, ho, input_precision="ieee")
            else:
                y = tl.dot(ye, he) + tl.dot(yo, ho)  # [16, D_PAD] fp32
            y = y.to(dt).to(tl.float32)  # the rotated head in the activation dtype, as the generic runner's x @ H
            scale = tl.maximum(tl.max(tl.abs(y), axis=1), SCALE_MIN) / QMAX  # [16]
            q = _to_storage(y, scale, QMAX, INT8)
            if QK:
                tl.store(k_dst + cols[None, :], q.to(k_ptr.dtype.element_ty), mask=is_k & cmask[None, :])
            if QV:
                tl.store(v_dst + cols[None, :], q.to(v_ptr.dtype.element_ty), mask=is_v & cmask[None, :])
        else:  # the plain basis, pair by pair
            yef = ye.to(tl.float32)
            yof = yo.to(tl.float32)
            scale = tl.maximum(tl.maximum(tl.max(tl.abs(yef), axis=1), tl.max(tl.abs(yof), axis=1)),
                               SCALE_MIN) / QMAX
            qe = _to_storage(yef, scale, QMAX, INT8)
            qo = _to_storage(yof, scale, QMAX, INT8)
            if QK:
                tl.store(k_dst + 2 * i[None, :], qe.to(k_ptr.dtype.element_ty), mask=kmask)
                tl.store(k_dst + 2 * i[None, :] + 1, qo.to(k_ptr.dtype.element_ty), mask=kmask)
            if QV:
                tl.store(v_dst + 2 * i[None, :], qe.to(v_ptr.dtype.element_ty), mask=vmask)
                tl.store(v_dst + 2 * i[None, :] + 1, qo.to(v_ptr.dtype.element_ty), mask=vmask)
        if QK:
            tl.store(ks_ptr + slot * NKV + j, tl.sum(tl.where(r == 0, scale, 0.0), axis=0))  # [slots, KVH] layout
        if QV:
            tl.store(vs_ptr + slot * NKV + j, tl.sum(tl.where(r == 1, scale, 0.0), axis=0))

    @triton.jit
    def _rope_store_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slot_ptr, ks_ptr, vs_ptr, rot_ptr,
                           stride_qkv, stride_tab, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
                           HALF_R: tl.constexpr, HALF_D_PAD: tl.constexpr, QUANT: tl.constexpr,
                           D_PAD: tl.constexpr, ROTATE: tl.constexpr, INT8: tl.constexpr, QMAX: tl.constexpr,
                           SCALE_MIN: tl.constexpr, IEEE: tl.constexpr, QK: tl.constexpr, QV: tl.constexpr):
        # 16/32-bit pool: one program per (token, head); heads [0, NQ) are q, [NQ, NQ+NKV) k, the rest v.
        # 8-bit pool (QUANT: keys QK and / or values QV in 8 bits): heads [0, NQ) are q; program NQ + j takes KV
        # head j's key and value together.
        t = tl.program_id(0)
        h = tl.program_id(1)
        if QUANT:
            if h < NQ:
                _rope_head(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, t, h, stride_qkv, stride_tab, NQ, NKV, D, HALF_R,
                           HALF_D_PAD)
            else:
                _rope_quant_kv(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slot_ptr, ks_ptr, vs_ptr, rot_ptr,
                               t, h - NQ, stride_qkv, stride_tab, NQ, NKV, D, HALF_R, HALF_D_PAD, D_PAD, ROTATE,
                               INT8, QMAX, SCALE_MIN, IEEE, QK, QV)
        else:
            ye, yo = _rope_head(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, t, h, stride_qkv, stride_tab, NQ, NKV, D,
                                HALF_R, HALF_D_PAD)
            if h >= NQ:  # k and v also go to the paged cache slot of this token
                dt = qkv_ptr.dtype.element_ty
                i = tl.arange(0, HALF_D_PAD)
                pmask = i < D // 2
                slot = tl.load(slot_ptr + t)
                if h < NQ + NKV:
                    dst = k_ptr + (slot * NKV + (h - NQ)) * D
                else:
                    dst = v_ptr + (slot * NKV + (h - NQ - NKV)) * D
                tl.store(dst + 2 * i, ye.to(dt), mask=pmask)
                tl.store(dst + 2 * i + 1, yo.to(dt), mask=pmask)


# ------------------------------------------------------------------------------------------------
# dispatch


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, backend: str) -> torch.Tensor:
    """RMSNorm of each row of ``x`` [T, H]."""
    if backend == "torch":
        return rmsnorm_torch(x, w, eps)
    out = torch.empty_like(x)
    n = x.shape[-1]
    _rmsnorm_kernel[(x.shape[0],)](x, w, out, x.stride(0), out.stride(0), n, eps, BLOCK=_pow2(n), num_warps=8)
    return out


def add_norm_norm(y, res, w1, w2, eps: float, backend: str):
    """``h = res + rmsnorm(y, w1)``; returns ``(h, rmsnorm(h, w2))``, rows of [T, H]. ``h`` reuses ``res``."""
    if backend == "torch":
        return add_norm_norm_torch(y, res, w1, w2, eps)
    out = torch.empty_like(y)
    n = y.shape[-1]
    _add_norm_norm_kernel[(y.shape[0],)](y, res, w1, w2, res, out, y.stride(0), res.stride(0), res.stride(0),
                                         out.stride(0), n, eps, BLOCK=_pow2(n), num_warps=8)
    return res, out


def silu_mul(gu: torch.Tensor, backend: str) -> torch.Tensor:
    """``up * silu(gate)`` for ``gu`` = [gate | up] of shape [T, 2I] -> [T, I]."""
    if backend == "torch":
        return silu_mul_torch(gu)
    t, two_i = gu.shape
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=gu.dtype, device=gu.device)
    block = min(1024, _pow2(inter))
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](gu, out, gu.stride(0), out.stride(0), inter, BLOCK=block,
                                                   num_warps=4)
    return out


def rope_store(qkv, positions, cos, sin, k_cache, v_cache, slots, nq: int, nkv: int, head_dim: int,
               rotary_dim: int, backend: str, scales=None) -> None:
    """Rotate q and k inside ``qkv`` [T, (nq + 2 nkv) D] in place and store k, v at ``slots`` [T].

    ``cos``/``sin``: fp32 tables [max_position, rotary_dim / 2]; ``k_cache``/``v_cache``: one layer's pool,
    any shape whose flat view is [slots, nkv, D]. ``scales`` (:class:`~cloud_server.fast.kv.LayerScales`, an
    8-bit pool's layer): k and v are stored as :func:`cloud_server.kv_quant.write` stores them, each that the pool
    holds in 8 bits rotated by ``scales.rotation`` and quantized with one scale per token and KV head (into
    ``scales.k`` / ``scales.v``), the other (int8v's keys) in the compute dtype as it is.
    """
    if backend == "torch":
        return rope_store_torch(qkv, positions, cos, sin, k_cache, v_cache, slots, nq, nkv, head_dim, rotary_dim,
                                scales)
    t = qkv.shape[0]
    if t == 0:
        return None
    quant = scales is not None
    qk, qv = quant and scales.k is not None, quant and scales.v is not None
    rot = None if not quant else scales.rotation
    if rot is not None and rot.dtype != qkv.dtype:
        raise ValueError(f"rope_store: the rotation must be in the activation dtype {qkv.dtype}, got {rot.dtype}")
    stored = {c.dtype for c, q in ((k_cache, qk), (v_cache, qv)) if q}  # the 8-bit dtype(s)
    if len(stored) > 1:
        raise ValueError(f"rope_store: keys and values in two 8-bit dtypes {sorted(map(str, stored))}")
    for c in (k_cache, v_cache) if quant else ():
        if not kv_quant.is_quantized(c.dtype) and c.dtype != qkv.dtype:
            raise ValueError(f"rope_store: an unquantized half of an 8-bit pool must be in {qkv.dtype}, got {c.dtype}")
    q_dtype = stored.pop() if stored else None
    qmax = kv_quant.qmax(q_dtype) if quant else 1.0
    dummy = qkv  # pointer arguments a specialization does not read
    _rope_store_kernel[(t, nq + (nkv if quant else 2 * nkv))](
        qkv, positions, cos, sin, k_cache, v_cache, slots, scales.k if qk else dummy,
        scales.v if qv else dummy, dummy if rot is None else rot, qkv.stride(0), cos.stride(0), NQ=nq, NKV=nkv,
        D=head_dim, HALF_R=rotary_dim // 2, HALF_D_PAD=_pow2(head_dim // 2) if not quant else max(16, _pow2(head_dim // 2)),
        QUANT=quant, D_PAD=max(16, _pow2(head_dim)), ROTATE=rot is not None, INT8=q_dtype == torch.int8,
        QMAX=qmax, SCALE_MIN=kv_quant.SCALE_MIN, IEEE=qkv.dtype == torch.float32, QK=qk, QV=qv,
        num_warps=4 if quant else 1)
    return None
