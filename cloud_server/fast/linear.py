"""Weight-streaming matrix products for decode batches, chosen per shape by measurement on the GPU at hand.

At decode batch sizes every projection is bound by reading its weight once; the question is only which
kernel streams it closest to the HBM bandwidth, and for the small GLM projections (q/k/v, o: 34-38 MB,
~9 us at full bandwidth) fixed costs decide. Two Triton kernels compete with cuBLAS:

* :func:`gemv` (batch 1): ``BLOCK_N`` weight rows per program, a multiply-reduce on the CUDA cores over
  ``BLOCK_K`` slices (16-byte loads); small ``BLOCK_N`` gives thousands of short programs and no tail;
* :func:`skinny_linear` (batch <= 128): a [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tile product on the tensor
  cores per program, streaming ``BLOCK_N`` weight rows over K.

:class:`LinearChooser` maps (N, K, batch bucket) to the implementation and launch config that won;
:mod:`.tuning` fills it by timing the candidates over every layer's weights (as a decode step reads them) before
the decode graphs are captured, after checking each Triton result against cuBLAS. Empty means cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kernels import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

BUCKETS = (1, 16, 32, 64, 128)  # batch buckets a choice is made for (1 = exactly one row)


def m_bucket(m: int) -> int:
    for b in BUCKETS:
        if m <= b:
            return b
    return 0  # larger batches (prefill) always use cuBLAS


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    kernel: str  # "gemv" | "skinny"
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


if HAVE_TRITON:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, stride_wn, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        nmask = offs_n < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + offs_k) < K
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
            x = tl.load(x_ptr + k0 + offs_k, mask=kmask, other=0.0)  # [BLOCK_K]
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)  # [BLOCK_N]
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=nmask)

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym, K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mmask = offs_m < M
        nmask = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + offs_k) < K
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                        mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            acc += tl.dot(x, tl.trans(w))
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1] or w.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"weight-streaming linear: x {tuple(x.shape)} / w {tuple(w.shape)} not supported")


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, block_n: int = 4,
         block_k: int = 512, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """``x @ w.T + b`` for one row x [1, K] and a row-major weight w [N, K] (Triton, CUDA cores)."""
    _check(x, w)
    if x.shape[0] != 1:
        raise ValueError(f"gemv takes one row, got {x.shape[0]}")
    n, k = w.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, w, b if b is not None else w, y, n, w.stride(0), K=k,
                                             HAS_BIAS=b is not None, BLOCK_N=block_n, BLOCK_K=block_k,
                                             num_warps=num_warps, num_stages=num_stages)
    return y


def skinny_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, block_n: int | None = None,
                  block_k: int = 256, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """``x @ w.T + b`` for x [M, K] and a row-major weight w [N, K] (Triton, tensor cores; M tiles of <= 128)."""
    _check(x, w)
    m, k = x.shape
    n = w.shape[0]
    block_m = max(16, min(128, 1 << max(m - 1, 0).bit_length()))
    if block_n is None:
        block_n = 16 if n <= 8192 else 32 if n <= 32768 else 64
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _skinny_kernel[grid](x, w, b if b is not None else w, y, m, n, x.stride(0), w.stride(0), y.stride(0), K=k,
                         HAS_BIAS=b is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         num_warps=num_warps, num_stages=num_stages)
    return y


def run_config(cfg: LaunchConfig, x, w, b=None) -> torch.Tensor:
    if cfg.kernel == "gemv":
        return gemv(x, w, b, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
    return skinny_linear(x, w, b, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)


def candidates(m: int, n: int, k: int) -> list[LaunchConfig]:
    """Launch configs worth timing for a batch-``m`` product with an [N, K] weight."""
    out = []
    if m == 1:
        for bn in (2, 4, 8):
            for bk in (256, 512, 1024):
                if bk <= max(256, k):
                    out.append(LaunchConfig("gemv", bn, bk, 4 if bn * bk <= 2048 else 8, 3))
    for bn in ((16, 32) if m <= 16 else (32, 64)):
        for bk in (128, 256):
            out.append(LaunchConfig("skinny", bn, bk, 4, 4))
    return out


class LinearChooser:
    """Implementation per (N, K, batch bucket): cuBLAS unless a measurement recorded a faster Triton config."""

    def __init__(self):
        self.choice: dict[tuple[int, int, int], LaunchConfig] = {}

    def set(self, n: int, k: int, bucket: int, cfg: LaunchConfig | None) -> None:
        if cfg is None:
            self.choice.pop((n, k, bucket), None)
        else:
            self.choice[(n, k, bucket)] = cfg

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if self.choice:
            m = x.shape[0]
            cfg = self.choice.get((w.shape[0], w.shape[1], m_bucket(m)))
            if cfg is not None and (cfg.kernel != "gemv" or m == 1):
                return run_config(cfg, x, w, b)
        return F.linear(x, w, b)
