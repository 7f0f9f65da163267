"""The top-p sampler's passes over the vocabulary on the device, as Triton kernels.

:func:`top_p_draws` ``(x [S, V], top_p, u [S, R], inv_t, tries, chunk) -> (ids [S], missed [S])``: the whole of
``sampler.sample_top_p`` in one kernel, one program per row: the row's largest logit, the unnormalised
probabilities ``exp(x * t - max * t)`` summed per chunk of ``chunk`` tokens, their cumulative masses, then per
draw its chunk, its token inside the chunk and that token's logit, one more pass for the mass of the tokens
strictly better than each draw, and the first accepted draw. Three passes over the row (in bf16 where the logits
are), no ``[S, V]`` intermediate in memory: on the H200 the torch formula's ~25 kernels and float32 copies took
~0.3 ms of a 64-row step. Same rule and order of operations as the torch formula, so the same tokens up to
float summation order (a draw within rounding of a boundary may differ).
"""

from __future__ import annotations

import torch

from cloud_server.fast.kernels import HAVE_TRITON, interpreting

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _top_p_kernel(x_ptr, stride_x, inv_t_ptr, top_p_ptr, u_ptr, tries_ptr, mass_ptr, ids_ptr, missed_ptr, n,
                      nchunks, R: tl.constexpr, W: tl.constexpr, TILE: tl.constexpr, CPAD: tl.constexpr):
        row = tl.program_id(0)
        base = x_ptr + row * stride_x
        it = tl.load(inv_t_ptr + row)
        offs = tl.arange(0, TILE)
        # pass 1: the row's largest logit
        mx = tl.full([TILE], float("-inf"), tl.float32)
        for start in range(0, n, TILE):
            v = tl.load(base + start + offs, mask=start + offs < n, other=float("-inf")).to(tl.float32)
            mx = tl.maximum(mx, v)
        m = tl.max(mx, axis=0)
        mt = m * it
        # pass 2: each chunk's mass, TILE / W chunks at a time, into the row's scratch [CPAD]
        cidx = tl.arange(0, CPAD)
        sub = tl.arange(0, TILE // W)
        lane = tl.arange(0, W)
        for start in range(0, n, TILE):
            o2 = start + sub[:, None] * W + lane[None, :]  # [TILE / W, W]
            v = tl.load(base + o2, mask=o2 < n, other=float("-inf")).to(tl.float32)
            chunk = start // W + sub
            tl.store(mass_ptr + row * CPAD + chunk, tl.sum(tl.exp(v * it - mt), axis=1), mask=chunk < nchunks)
        tl.debug_barrier()
        masses = tl.load(mass_ptr + row * CPAD + cidx, mask=cidx < nchunks, other=0.0)
        cum = tl.cumsum(masses, axis=0)  # [CPAD]; padding chunks hold the total
        total = tl.sum(tl.where(cidx == nchunks - 1, cum, 0.0), axis=0)
        # the draws: chunk, token, logit (inverse CDF at u * total, in vocabulary order)
        jr = tl.arange(0, R)
        toks = tl.zeros([R], tl.int64)
        vals = tl.zeros([R], tl.float32)
        for j in tl.static_range(R):
            target = tl.load(u_ptr + row * R + j) * total
            ci = tl.minimum(tl.sum(((cum < target) & (cidx < nchunks)).to(tl.int32), axis=0), nchunks - 1)
            before = tl.sum(tl.where(cidx == ci - 1, cum, 0.0), axis=0)
            cv = tl.load(base + ci * W + lane, mask=ci * W + lane < n, other=float("-inf")).to(tl.float32)
            lc = tl.cumsum(tl.exp(cv * it - mt), axis=0)  # [W]
            rest = tl.minimum(target - before, tl.sum(tl.where(lane == W - 1, lc, 0.0), axis=0))
            li = tl.minimum(tl.sum((lc < rest).to(tl.int32), axis=0), W - 1)
            toks = tl.where(jr == j, ci.to(tl.int64) * W + li, toks)
            vals = tl.where(jr == j, tl.sum(tl.where(lane == li, cv, 0.0), axis=0), vals)
        # pass 3: the mass of the tokens strictly better than each draw, all draws at once, W tokens at a time
        acc = tl.zeros([R, W], tl.float32)
        for start in range(0, n, W):
            v = tl.load(base + start + lane, mask=start + lane < n, other=float("-inf")).to(tl.float32)
            e = tl.exp(v * it - mt)
            acc += tl.where(v[None, :] > vals[:, None], e[None, :], 0.0)  # [R, W]
        better = tl.sum(acc, axis=1)  # [R]
        top_p = tl.load(top_p_ptr + row)
        bound = tl.where(top_p >= 1.0, float("inf"), top_p * total)  # (top_p 1: every draw is in)
        ok = (better < bound) & (jr < tl.load(tries_ptr + row))
        first = tl.min(tl.where(ok, jr, R), axis=0)
        tl.store(ids_ptr + row, tl.sum(tl.where(jr == tl.minimum(first, R - 1), toks, 0), axis=0))
        tl.store(missed_ptr + row, first == R)

TILE = 4096  # tokens per iteration of the fused top-p kernel's passes


def fused_top_p(x: torch.Tensor) -> bool:
    """Whether :func:`top_p_draws` runs for logits ``x``: Triton, on CUDA or under the interpreter."""
    return HAVE_TRITON and (x.is_cuda or interpreting())


def top_p_draws(x: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, inv_t: torch.Tensor, tries: torch.Tensor,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampler.sample_top_p`` as one kernel (module docstring). x ``[S, V]`` logits (float32 or the model's
    16-bit dtype, unit stride along V; -inf = excluded), top_p / inv_t ``[S]`` float32, u ``[S, R]`` (R a power of
    two), tries ``[S]`` int64, ``chunk`` a power of two -> (ids ``[S]`` int64, missed ``[S]`` bool)."""
    s, n = x.shape
    r = u.shape[1]
    if x.stride(1) != 1 or r & (r - 1) or chunk & (chunk - 1) or chunk > TILE:
        raise ValueError("top_p_draws needs unit-stride rows, a power-of-two number of draws and chunk <= TILE")
    nchunks = triton.cdiv(n, chunk)
    cpad = triton.next_power_of_2(nchunks)
    ids = torch.empty(s, dtype=torch.int64, device=x.device)
    missed = torch.empty(s, dtype=torch.bool, device=x.device)
    mass = torch.empty((s, cpad), dtype=torch.float32, device=x.device)  # [S, CPAD] each row's chunk masses
    _top_p_kernel[(s,)](x, x.stride(0), inv_t.float().contiguous(), top_p.float().contiguous(),
                        u.float().contiguous(), tries.long().contiguous(), mass, ids, missed, n, nchunks, R=r,
                        W=chunk, TILE=TILE, CPAD=cpad, num_warps=8)
    return ids, missed
