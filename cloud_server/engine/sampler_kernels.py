"""The top-p sampler's one pass over the vocabulary per step: the mass of the tokens strictly better than each draw.

:func:`better_mass` ``(x [S, V], e [S, V], val [S, R]) -> [S, R]``: for every row and draw ``j``, the sum of
``e`` over the tokens whose logit ``x`` is strictly above ``val[:, j]`` (``e`` the row's unnormalised
probabilities). On CUDA (and under ``TRITON_INTERPRET=1``) one Triton kernel reads ``x`` and ``e`` once for all
R draws: each program sums one slice of a row for every draw, and the slices' partial sums are added in a fixed
order, so a row's result depends on that row only. Elsewhere, one masked sum per draw in torch (R passes). The
two agree up to float summation order.
"""

from __future__ import annotations

import torch

from cloud_server.fast.kernels import HAVE_TRITON, interpreting

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _better_mass_kernel(x_ptr, e_ptr, val_ptr, out_ptr, n, stride_x, stride_e, R: tl.constexpr,
                            BLOCK: tl.constexpr):
        row = tl.program_id(0)
        blk = tl.program_id(1)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=float("-inf"))
        e = tl.load(e_ptr + row * stride_e + offs, mask=mask, other=0.0)
        base = (row * tl.num_programs(1) + blk) * R
        for j in tl.static_range(R):
            v = tl.load(val_ptr + row * R + j)
            tl.store(out_ptr + base + j, tl.sum(tl.where(x > v, e, 0.0), axis=0))

BLOCK = 4096  # tokens per program of the Triton kernel


def better_mass(x: torch.Tensor, e: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """x, e ``[S, V]`` float32 (last dim contiguous), val ``[S, R]`` float32 -> ``[S, R]``: per row and draw, the
    sum of ``e`` where ``x > val``."""
    s, n = x.shape
    r = val.shape[1]
    if HAVE_TRITON and (x.is_cuda or interpreting()):
        if x.stride(1) != 1 or e.stride(1) != 1:
            raise ValueError("better_mass needs rows with a unit stride")
        nblk = triton.cdiv(n, BLOCK)
        part = torch.empty((s, nblk, r), dtype=torch.float32, device=x.device)  # [S, blocks, R]
        _better_mass_kernel[(s, nblk)](x, e, val.float().contiguous(), part, n, x.stride(0), e.stride(0), R=r,
                                       BLOCK=BLOCK, num_warps=8)
        return part.sum(dim=1)
    return torch.stack([torch.where(x > val[:, j:j + 1], e, 0.0).sum(dim=-1) for j in range(r)], dim=1)
