"""The top-p sampler's passes over the vocabulary on the device, as Triton kernels.

:func:`top_p_draws` ``(x [S, V], top_p, u [S, R], inv_t, tries, chunk) -> (ids [S], missed [S])`` is the whole of
``sampler.sample_top_p``: the row's largest logit, the unnormalised probabilities ``exp(x * t - max * t)`` summed
per chunk of ``chunk`` tokens, their cumulative masses, then per draw its chunk, its token inside the chunk and
that token's logit, the mass of the tokens strictly better than each draw, and the first accepted draw. The
passes over the vocabulary are split over ``[S, P]`` programs (``P`` spans of :data:`SPAN` tokens per row), so a
64-row step of a 151,552-token vocabulary runs ~2,400 programs instead of 64 (one program per row streamed its
row alone: ~0.2-0.3 ms on the H200); the per-row work between the passes is one program per row:

1. ``_span_max``   ``[S, P]``: each span's largest logit;
2. ``_chunk_mass`` ``[S, P]``: the row's largest logit (the spans' maxima), each chunk's mass;
3. ``_draws``      ``[S]``:    the cumulative masses, each of the row's ``tries`` draws: chunk, token, logit
   (its uniform loaded, or hashed here from the row's key and position: ``sampler.device_uniforms``'s numbers);
4. ``_better``     ``[S, P]``: per span, the mass of its tokens strictly better than each draw;
5. ``_accept``     ``[S]``:    the spans' sums, the first draw in the nucleus (greedy rows: their argmax).

Every pass reads the logits as they are (bf16 for a 16-bit model), no ``[S, V]`` intermediate in memory. Same rule
and order of operations per value as the torch formula, so the same tokens up to float summation order (a draw
within rounding of a boundary may differ).
"""

from __future__ import annotations

import torch

from cloud_server.fast.kernels import HAVE_TRITON, interpreting

SPAN = 4096  # tokens per program of the passes over the vocabulary (a multiple of every chunk size used)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _span_max(x_ptr, stride_x, pmax_ptr, n, P, SPAN_: tl.constexpr):
        row, p = tl.program_id(0), tl.program_id(1)
        offs = p * SPAN_ + tl.arange(0, SPAN_)
        v = tl.load(x_ptr + row * stride_x + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
        tl.store(pmax_ptr + row * P + p, tl.max(v, axis=0))

    @triton.jit
    def _row_max_t(pmax_ptr, inv_t_ptr, row, P, PPAD: tl.constexpr):
        """(1 / temperature, the row's largest logit times it) from the spans' maxima."""
        pi = tl.arange(0, PPAD)
        m = tl.max(tl.load(pmax_ptr + row * P + pi, mask=pi < P, other=float("-inf")), axis=0)
        it = tl.load(inv_t_ptr + row)
        return it, m * it

    @triton.jit
    def _chunk_mass(x_ptr, stride_x, pmax_ptr, inv_t_ptr, mass_ptr, n, P, nchunks, CPAD: tl.constexpr,
                    PPAD: tl.constexpr, SPAN_: tl.constexpr, W: tl.constexpr):
        row, p = tl.program_id(0), tl.program_id(1)
        it, mt = _row_max_t(pmax_ptr, inv_t_ptr, row, P, PPAD)
        sub = tl.arange(0, SPAN_ // W)
        o2 = p * SPAN_ + sub[:, None] * W + tl.arange(0, W)[None, :]  # [SPAN / W, W]
        v = tl.load(x_ptr + row * stride_x + o2, mask=o2 < n, other=float("-inf")).to(tl.float32)
        chunk = p * (SPAN_ // W) + sub
        tl.store(mass_ptr + row * CPAD + chunk, tl.sum(tl.exp(v * it - mt), axis=1), mask=chunk < nchunks)

    @triton.jit
    def _draws(x_ptr, stride_x, pmax_ptr, inv_t_ptr, mass_ptr, u_ptr, keys_ptr, pos_ptr, tries_ptr, toks_ptr,
               vals_ptr, total_ptr, n, P, nchunks, R: tl.constexpr, W: tl.constexpr, CPAD: tl.constexpr,
               PPAD: tl.constexpr, KEYED: tl.constexpr):
        row = tl.program_id(0)
        base = x_ptr + row * stride_x
        it, mt = _row_max_t(pmax_ptr, inv_t_ptr, row, P, PPAD)
        cidx = tl.arange(0, CPAD)
        masses = tl.load(mass_ptr + row * CPAD + cidx, mask=cidx < nchunks, other=0.0)
        cum = tl.cumsum(masses, axis=0)  # [CPAD]; padding chunks hold the total
        total = tl.sum(tl.where(cidx == nchunks - 1, cum, 0.0), axis=0)
        tl.store(total_ptr + row, total)
        jr = tl.arange(0, R)
        if KEYED:  # the uniforms of (key, position, draw): sampler.uniform_of's splitmix64, in uint64
            key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
            pos = tl.load(pos_ptr + row).to(tl.uint64, bitcast=True)
            z = key * 0x9E3779B97F4A7C15 + pos * 0xBF58476D1CE4E5B9 + jr.to(tl.uint64) * 0xD6E8FEB86659FD93
            z = z + 0x94D049BB133111EB
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
            z = (z ^ (z >> 27)) * 0x94D049BB133111EB
            us = ((((z ^ (z >> 31)) >> 40).to(tl.float64) + 0.5) / 16777216.0).to(tl.float32)  # [R]
        else:
            us = tl.load(u_ptr + row * R + jr)  # [R]
        lane = tl.arange(0, W)
        ntries = tl.load(tries_ptr + row)
        toks = tl.zeros([R], tl.int64)
        vals = tl.full([R], float("inf"), tl.float32)  # (a draw not taken: nothing is better than it)
        for j in tl.static_range(R):
            if j < ntries:  # (the rest are never kept)
                target = tl.sum(tl.where(jr == j, us, 0.0), axis=0) * total
                ci = tl.minimum(tl.sum(((cum < target) & (cidx < nchunks)).to(tl.int32), axis=0), nchunks - 1)
                before = tl.sum(tl.where(cidx == ci - 1, cum, 0.0), axis=0)
                cv = tl.load(base + ci * W + lane, mask=ci * W + lane < n, other=float("-inf")).to(tl.float32)
                lc = tl.cumsum(tl.exp(cv * it - mt), axis=0)  # [W]
                rest = tl.minimum(target - before, tl.sum(tl.where(lane == W - 1, lc, 0.0), axis=0))
                li = tl.minimum(tl.sum((lc < rest).to(tl.int32), axis=0), W - 1)
                toks = tl.where(jr == j, ci.to(tl.int64) * W + li, toks)
                vals = tl.where(jr == j, tl.sum(tl.where(lane == li, cv, 0.0), axis=0), vals)
        tl.store(toks_ptr + row * R + jr, toks)
        tl.store(vals_ptr + row * R + jr, vals)

    @triton.jit
    def _better(x_ptr, stride_x, pmax_ptr, inv_t_ptr, vals_ptr, part_ptr, n, P, R: tl.constexpr,
                PPAD: tl.constexpr, SPAN_: tl.constexpr, W: tl.constexpr):
        row, p = tl.program_id(0), tl.program_id(1)
        it, mt = _row_max_t(pmax_ptr, inv_t_ptr, row, P, PPAD)
        jr = tl.arange(0, R)
        vals = tl.load(vals_ptr + row * R + jr)  # [R]
        lane = tl.arange(0, W)
        acc = tl.zeros([R, W], tl.float32)
        for start in range(p * SPAN_, p * SPAN_ + SPAN_, W):
            v = tl.load(x_ptr + row * stride_x + start + lane, mask=start + lane < n,
                        other=float("-inf")).to(tl.float32)
            e = tl.exp(v * it - mt)
            acc += tl.where(v[None, :] > vals[:, None], e[None, :], 0.0)  # [R, W]
        tl.store(part_ptr + (row * P + p) * R + jr, tl.sum(acc, axis=1))

    @triton.jit
    def _accept(part_ptr, total_ptr, top_p_ptr, tries_ptr, toks_ptr, greedy_ptr, argmax_ptr, ids_ptr, missed_ptr,
                P, R: tl.constexpr, PPAD: tl.constexpr, GREEDY: tl.constexpr):
        row = tl.program_id(0)
        jr = tl.arange(0, R)
        pi = tl.arange(0, PPAD)
        part = tl.load(part_ptr + (row * P + pi[:, None]) * R + jr[None, :], mask=pi[:, None] < P, other=0.0)
        better = tl.sum(part, axis=0)  # [R]
        top_p = tl.load(top_p_ptr + row)
        bound = tl.where(top_p >= 1.0, float("inf"), top_p * tl.load(total_ptr + row))  # (top_p 1: all are in)
        ok = (better < bound) & (jr < tl.load(tries_ptr + row))
        first = tl.min(tl.where(ok, jr, R), axis=0)
        toks = tl.load(toks_ptr + row * R + jr)
        tok = tl.sum(tl.where(jr == tl.minimum(first, R - 1), toks, 0), axis=0)
        miss = first == R
        if GREEDY:  # greedy rows take their argmax and are never redrawn
            g = tl.load(greedy_ptr + row).to(tl.int1)
            tok = tl.where(g, tl.load(argmax_ptr + row), tok)
            miss = miss & (g == 0)
        tl.store(ids_ptr + row, tok)
        tl.store(missed_ptr + row, miss)


def fused_top_p(x: torch.Tensor) -> bool:
    """Whether :func:`top_p_draws` runs for logits ``x``: Triton, on CUDA or under the interpreter."""
    return HAVE_TRITON and (x.is_cuda or interpreting())


def top_p_draws(x: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor | None, inv_t: torch.Tensor,
                tries: torch.Tensor, chunk: int, draws: int | None = None, keys: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, greedy: torch.Tensor | None = None,
                argmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampler.sample_top_p`` on the device (module docstring). x ``[S, V]`` logits (float32 or the model's
    16-bit dtype, unit stride along V; -inf = excluded), top_p / inv_t ``[S]`` float32, tries ``[S]`` int64 (the
    draws each row takes), ``chunk`` a power of two dividing :data:`SPAN`; the uniforms either ``u`` ``[S, R]`` (R a
    power of two) or, with ``u`` None, hashed from ``keys`` / ``positions`` ``[S]`` int64 (``draws`` = R of them:
    ``sampler.device_uniforms(keys, positions, R)``). ``greedy`` ``[S]`` bool with ``argmax`` ``[S]``: those rows
    take their argmax, never missed. -> (ids ``[S]`` int64, missed ``[S]`` bool)."""
    s, n = x.shape
    r = u.shape[1] if u is not None else draws
    if x.stride(1) != 1 or not r or r & (r - 1) or chunk & (chunk - 1) or SPAN % chunk:
        raise ValueError("top_p_draws needs unit-stride rows, a power-of-two number of draws and a chunk "
                         f"dividing {SPAN}")
    if u is None and (keys is None or positions is None):
        raise ValueError("top_p_draws needs the uniforms u or the rows' keys and positions")
    dev, f32 = x.device, torch.float32
    p = triton.cdiv(n, SPAN)
    nchunks = triton.cdiv(n, chunk)
    cpad, ppad = triton.next_power_of_2(nchunks), triton.next_power_of_2(p)
    inv_t, top_p, tries = inv_t.float().contiguous(), top_p.float().contiguous(), tries.long().contiguous()
    pmax = torch.empty((s, p), dtype=f32, device=dev)  # [S, P] each span's largest logit
    mass = torch.empty((s, cpad), dtype=f32, device=dev)  # [S, CPAD] each chunk's mass
    toks = torch.empty((s, r), dtype=torch.int64, device=dev)  # [S, R] each draw's token
    vals = torch.empty((s, r), dtype=f32, device=dev)  # [S, R] and its logit
    total = torch.empty(s, dtype=f32, device=dev)  # [S] the row's mass
    part = torch.empty((s, p, r), dtype=f32, device=dev)  # [S, P, R] each span's mass better than each draw
    ids = torch.empty(s, dtype=torch.int64, device=dev)
    missed = torch.empty(s, dtype=torch.bool, device=dev)
    keyed = u is None
    _span_max[(s, p)](x, x.stride(0), pmax, n, p, SPAN_=SPAN, num_warps=8)
    _chunk_mass[(s, p)](x, x.stride(0), pmax, inv_t, mass, n, p, nchunks, CPAD=cpad, PPAD=ppad, SPAN_=SPAN,
                        W=chunk, num_warps=8)
    _draws[(s,)](x, x.stride(0), pmax, inv_t, mass, keys if keyed else u.float().contiguous(),
                 keys if keyed else tries, positions if keyed else tries, tries, toks, vals, total, n, p, nchunks,
                 R=r, W=chunk, CPAD=cpad, PPAD=ppad, KEYED=keyed, num_warps=4)
    _better[(s, p)](x, x.stride(0), pmax, inv_t, vals, part, n, p, R=r, PPAD=ppad, SPAN_=SPAN, W=chunk,
                    num_warps=8)
    with_greedy = greedy is not None
    _accept[(s,)](part, total, top_p, tries, toks, greedy if with_greedy else tries,
                  argmax if with_greedy else tries, ids, missed, p, R=r, PPAD=ppad, GREEDY=with_greedy,
                  num_warps=1)
    return ids, missed
