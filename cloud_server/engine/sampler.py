"""Token sampling from a step's logits: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

All rows of a step are sampled together where the logits are (the device on a GPU), in a fixed number of
tensor ops over ``[S, V]`` whatever the batch, with no sort of the vocabulary and no full-vocabulary scan
(:func:`sample_top_p`): top-k (only when a row sets it) masks the logits below each row's k-th largest; each row
draws a few tokens (:func:`tries_for` its top_p: 4 at 0.9) from ``softmax(logits / temperature)`` by inverting its
cumulative distribution at uniform numbers ``u`` and keeps the first inside its top-p nucleus (rejection
sampling: exactly a draw from the top-p distribution; a row whose draws all miss, probability <= :data:`MISS`,
is redrawn from the sorted cut). The vocabulary is cut into chunks of :data:`CHUNK` tokens: a draw first finds its chunk
from the chunks' masses, then its token inside that chunk; whether a try is in the nucleus (the mass of the
strictly better tokens is below top_p) is one masked sum per draw. A seeded request's ``u`` are
counter-based hashes of ``(seed, position, try)`` (:func:`uniforms`), so it draws the same tokens batched or
alone and when it is replayed from its context (a resume, another replica). The engine gives an unseeded sampled
request a random key of its own as its seed (:meth:`Sampler.fresh_key`), so every sampled row's uniforms are such
hashes (rows without a seed, from other callers, take fresh uniforms from the sampler's generator). No per-row
Python loop, no per-row sync: one copy of the S ids (and the logprobs asked for) to the host, and
:meth:`Sampler.launch` only queues it, so the engine can overlap it with the next step (:meth:`PendingSample.result`
waits).

In the steady decode step the same rule runs inside the fast runner's CUDA graph (:class:`GraphSampling`: the
uniforms from the keys and positions on the device, :func:`device_uniforms`) for a composition without penalties,
top-k or logprobs (:meth:`Sampler.graph_columns`); :meth:`Sampler.launch` then only takes the graph's ids
(``drawn``) and redraws a row whose draws all missed.

Greedy picks the argmax (lowest id on ties). Logprobs are those of the model's raw distribution (temperature
1, no truncation, no penalties), as vLLM reports them. Presence / frequency / repetition penalties apply to the
generated tokens only (the one per-row step: only penalized rows take it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from cloud_server.engine.sampler_kernels import fused_top_p, top_p_draws
from cloud_server.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the sampled token, when asked for
    top_logprobs: list[tuple[int, float]] | None = None  # (token, logprob), best first


_M64 = (1 << 64) - 1


def uniform_of(seed: int, position: int, draw: int = 0) -> float:
    """The uniform number in (0, 1) of try ``draw`` that samples the token at ``position`` of a request seeded
    ``seed``: a splitmix64 hash of the three, so it depends on nothing else (not the batch, not any generator's
    state). :func:`uniforms` computes the same numbers for a whole batch."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + draw * 0xD6E8FEB86659FD93
         + 0x94D049BB133111EB) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (((z ^ (z >> 31)) >> 40) + 0.5) / (1 << 24)


def uniforms(seeds: list[int], positions: list[int], tries: int) -> np.ndarray:
    """``[len(seeds), tries]`` float64: ``uniform_of(seeds[i], positions[i], r)`` for every row and try, computed
    in one vectorized pass (uint64 arithmetic wraps modulo 2**64 as the masks in :func:`uniform_of` do)."""
    u64 = np.uint64
    seed = np.array([s & _M64 for s in seeds], dtype=u64)[:, None]  # [S, 1]
    pos = np.array([p & _M64 for p in positions], dtype=u64)[:, None]
    draw = np.arange(tries, dtype=u64)[None, :]  # [1, R]
    with np.errstate(over="ignore"):
        z = (seed * u64(0x9E3779B97F4A7C15) + pos * u64(0xBF58476D1CE4E5B9) + draw * u64(0xD6E8FEB86659FD93)
             + u64(0x94D049BB133111EB))  # [S, R]
        z = (z ^ (z >> u64(30))) * u64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> u64(27))) * u64(0x94D049BB133111EB)
    return (((z ^ (z >> u64(31))) >> u64(40)).astype(np.float64) + 0.5) / (1 << 24)


def _int64(v: int) -> int:
    """The 64 bits of ``v`` (mod 2**64) as a signed int64 value (torch has no uint64 arithmetic)."""
    v &= _M64
    return v - (1 << 64) if v >> 63 else v


_GOLD, _MIX1, _MIX2, _DRAW = (_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB,
                                                 0xD6E8FEB86659FD93))


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` holding uint64 bits (``>>`` on int64 is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def device_uniforms(keys: torch.Tensor, positions: torch.Tensor, tries: int) -> torch.Tensor:
    """:func:`uniforms` where ``keys`` and ``positions`` (``[S]`` int64; a key is its seed's 64 bits as int64) are:
    ``[S, tries]`` float32, the same numbers (int64 arithmetic wraps as uint64 does; the float64 value rounded to
    float32 as the host path rounds it). No host sync: a CUDA graph can compute them from static buffers."""
    draw = torch.arange(tries, dtype=torch.int64, device=keys.device)  # [R]
    z = keys[:, None] * _GOLD + positions[:, None] * _MIX1 + draw[None, :] * _DRAW + _MIX2  # [S, R]
    z = (z ^ _lsr(z, 30)) * _MIX1
    z = (z ^ _lsr(z, 27)) * _MIX2
    return ((_lsr(z ^ _lsr(z, 31), 40).double() + 0.5) / (1 << 24)).float()


def sample_rows(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of truncated logits ``x`` ``[S, V]`` (-inf = excluded): the first token whose
    cumulative probability reaches ``u * total`` (``u`` ``[S]`` in (0, 1)), i.e. inverse-CDF sampling of
    ``softmax(x)``. An excluded token adds nothing to the sum, so it is never picked."""
    cum = torch.cumsum(torch.softmax(x, dim=-1), dim=-1)  # [S, V]
    target = (u[:, None] * cum[:, -1:]).contiguous()  # [S, 1] <= the row's total: an index always exists
    return torch.searchsorted(cum, target)[:, 0].clamp_(max=x.shape[-1] - 1)


def filtered_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    kmax: int, any_top_p: bool) -> torch.Tensor:
    """logits ``[S, V]`` float32 -> ``logits / temperature`` with the tokens outside each row's top-k and top-p set
    to -inf. temperature ``[S]`` (> 0), top_k ``[S]`` int64 (0 = off), top_p ``[S]`` in (0, 1]; ties at a
    cut-off are kept. ``kmax`` (the largest top_k in use, 0 = none) and ``any_top_p`` (a row has top_p < 1) are
    known on the host, so nothing here waits for the device."""
    x = logits / temperature[:, None]  # [S, V]
    if kmax > 0:
        x = top_k_masked(x, top_k, kmax)
    if any_top_p:
        ordered = torch.sort(x, dim=-1, descending=True).values  # [S, V]
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the better tokens
        kept = (before < top_p[:, None]).sum(dim=-1, keepdim=True)  # [S, 1] >= 1: the smallest prefix reaching top_p
        cut = ordered.gather(1, kept - 1)  # [S, 1]
        x = x.masked_fill((top_p[:, None] < 1.0) & (x < cut), float("-inf"))
    return x


TRIES = 16  # most draws per row of the top-p rejection sampler (a row takes tries_for(top_p) of them)
MISS = 1e-4  # a row's draws all fall outside its nucleus with probability <= MISS (it is then redrawn exactly)
CHUNK = 512  # tokens per vocabulary chunk of :func:`sample_top_p` (151,552 = 296 x 512: no padding for GLM)


def tries_for(top_p: float) -> int:
    """Draws a row with this ``top_p`` takes: each lands in the nucleus with probability >= top_p, so ``n`` draws
    all miss with probability <= (1 - top_p) ** n; the smallest n with that <= :data:`MISS` (4 at top-p 0.9, 14
    at 0.5), at most :data:`TRIES`. It depends on the row's own parameter only, so the batch never changes which
    of its draws a row keeps."""
    if top_p >= 1.0:
        return 1
    return max(1, min(TRIES, math.ceil(math.log(MISS) / math.log1p(-top_p) - 1e-9)))  # (1e-9: 2.0000000000000004)


def top_k_masked(x: torch.Tensor, top_k: torch.Tensor, kmax: int) -> torch.Tensor:
    """logits ``[S, V]`` with the tokens below each row's ``top_k``-th largest set to -inf (ties at the cut are
    kept; ``top_k`` ``[S]`` int64, 0 = off). ``kmax`` is the largest ``top_k`` in use (> 0). The cut does not move
    under a positive temperature, so the raw logits are cut."""
    vocab = x.shape[-1]
    kmax = min(kmax, vocab)
    use_k = (top_k > 0) & (top_k < vocab)  # [S]
    top = torch.topk(x, kmax, dim=-1).values  # [S, kmax], best first
    kth = top.gather(1, (top_k.clamp(1, kmax) - 1)[:, None])  # [S, 1]
    return x.masked_fill(use_k[:, None] & (x < kth), float("-inf"))


def sample_top_p(x: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, inv_temperature: torch.Tensor | None = None,
                 tries: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p sampling without sorting the vocabulary: rejection sampling.

    ``x`` ``[S, V]`` logits (-inf = excluded, e.g. by top-k), ``top_p`` ``[S]``, ``u`` ``[S, R]`` uniforms in (0, 1),
    ``inv_temperature`` ``[S]`` (None: 1), ``tries`` ``[S]`` int64 (None: R): the draws each row takes. Each row
    draws its tokens from ``p = softmax(x * inv_temperature)`` (inverse CDF: the first token whose cumulative
    probability, in vocabulary order, reaches ``u * total``) and keeps the first whose strictly better tokens
    (larger logit) hold less than ``top_p`` of the mass: exactly the tokens the sorted cut of
    :func:`filtered_logits` keeps, so the kept draw is exactly a draw from the top-p distribution. A draw is
    accepted with probability >= top_p; a row where none is (``missed`` ``[S]`` bool) must be redrawn.
    Returns (ids ``[S]``, missed ``[S]``).

    On CUDA (and under ``TRITON_INTERPRET=1``) all of it is five Triton kernels reading ``x`` as it is (float32 or
    16-bit): :func:`~cloud_server.engine.sampler_kernels.top_p_draws`, the same rule and order of operations
    (below: the torch formula, which runs elsewhere, in float32).

    The formula (:func:`_top_p_formula`), a fixed number of tensor ops whatever the batch: the unnormalised
    probabilities ``exp((x - max) * inv_temperature)`` once; the vocabulary cut into chunks of :data:`CHUNK` tokens
    (the last padded with -inf), a draw finds its chunk from the chunks' cumulative masses and its token from that
    one chunk's cumulative probabilities (no scan along the whole vocabulary); then the mass of each draw's better
    tokens, one masked sum per draw.
    """
    s, v = x.shape
    r = u.shape[1]
    w = _chunk(v)
    if fused_top_p(x):
        # the kernel's draws: TRIES (a power of two; padding draws are never kept), so that one compiled variant per
        # logits dtype serves every batch (the engine's warm_up compiles them at startup: no JIT stall while serving)
        p2 = max(TRIES, 1 << max(r - 1, 0).bit_length())
        if tries is None:
            tries = torch.full((s,), r, dtype=torch.int64, device=x.device)
        if inv_temperature is None:
            inv_temperature = torch.ones(s, dtype=torch.float32, device=x.device)
        if p2 != r:
            u = F.pad(u, (0, p2 - r), value=0.5)
        return top_p_draws(x, top_p, u, inv_temperature, tries, w)
    return _top_p_formula(x.float(), top_p, u, inv_temperature, tries, w)  # (16-bit logits: in float32)


def _chunk(vocab: int) -> int:
    """Tokens per vocabulary chunk of :func:`sample_top_p` for a vocabulary of ``vocab`` tokens."""
    return min(CHUNK, 1 << max(vocab - 1, 0).bit_length())


def warm_up(vocab: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    """Run :func:`sample_top_p` once per logits dtype on ``device``, so that its kernel is compiled before serving
    (a first sampled request would otherwise wait for Triton's JIT, and every session with it)."""
    one = torch.ones(1, device=device)
    sampling = GraphSampling(1, device)
    for dtype in dtypes:
        x = torch.zeros(1, vocab, dtype=dtype, device=device)
        sample_top_p(x, one * 0.9, torch.full((1, TRIES), 0.5, device=device), one,
                     torch.ones(1, dtype=torch.int64, device=device))
        sampling(x, torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int64,
                                                                                   device=device))
    # and the redraw of a row that missed (the sort's kernels: CUDA loads a module at its first launch, ~0.2 s
    # measured on the H200 in the middle of a sampled run)
    x = torch.zeros(1, vocab, device=device)
    sample_rows(filtered_logits(x, one, torch.zeros(1, dtype=torch.int64, device=device), one * 0.9, 0, True),
                one * 0.5)


def _top_p_formula(x: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, inv_temperature: torch.Tensor | None,
                   tries: torch.Tensor | None, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_top_p` in torch ops, float32 ``x`` ``[S, V]``, chunks of ``w`` tokens."""
    s, v = x.shape
    r = u.shape[1]
    c = -(-v // w)
    xp = x if c * w == v else F.pad(x, (0, c * w - v), value=float("-inf"))  # [S, C * W]
    m = x.amax(dim=-1, keepdim=True)  # [S, 1] the row's largest logit (finite: a row keeps its best token)
    if inv_temperature is None:
        e = (xp - m).exp_()  # [S, C * W]
    else:
        it = inv_temperature.to(x.dtype)[:, None]  # [S, 1]
        e = torch.addcmul(-m * it, xp, it).exp_()  # [S, C * W] unnormalised probabilities
    e3 = e.view(s, c, w)
    cum = torch.cumsum(e3.sum(dim=-1), dim=-1)  # [S, C] cumulative chunk masses
    total = cum[:, -1:]  # [S, 1] the row's mass
    # the draws, in vocabulary order: the chunk holding u * total, then the token inside it
    target = u.to(x.dtype) * total  # [S, R]
    ci = torch.searchsorted(cum, target.contiguous()).clamp_(max=c - 1)  # [S, R]
    before = torch.where(ci > 0, cum.gather(1, (ci - 1).clamp(min=0)), 0.0)  # [S, R] < target
    local = torch.cumsum(e3.gather(1, ci[:, :, None].expand(s, r, w)), dim=-1)  # [S, R, W] the chosen chunks
    rest = torch.minimum(target - before, local[:, :, -1])  # [S, R] in (0, the chunk's mass]
    li = torch.searchsorted(local, rest[:, :, None].contiguous())[:, :, 0].clamp_(max=w - 1)  # [S, R]
    drawn = ci * w + li  # [S, R] token ids; the first token to reach a positive target has positive probability
    val = xp.gather(1, drawn)  # [S, R] their logits
    bound = top_p.to(x.dtype)[:, None] * total  # [S, 1]
    order = torch.arange(r, device=x.device)
    better = torch.stack([torch.where(xp > val[:, j:j + 1], e, 0.0).sum(dim=-1) for j in range(r)], dim=1)  # [S, R]
    ok = better < bound  # [S, R] the strictly better tokens' mass, under top_p of the total
    ok |= top_p[:, None] >= 1.0  # [S, R] the draw is in the nucleus
    if tries is not None:
        ok &= order[None, :] < tries[:, None]
    first = torch.where(ok, order, r).amin(dim=1)  # [S] the first accepted draw (r: none)
    ids = drawn.gather(1, first.clamp(max=r - 1)[:, None])[:, 0]
    return ids, first == r


def _device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A small host tensor on ``dev``, copied asynchronously (through page-locked memory on CUDA)."""
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


def _filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row: logits [V] -> probabilities [V] after temperature, top-k and top-p (speculative verification)."""
    one = torch.ones(1, device=logits.device)
    x = filtered_logits(logits[None].float(), one * p.temperature, torch.tensor([p.top_k], device=logits.device),
                        one * p.top_p, p.top_k, p.top_p < 1.0)
    return torch.softmax(x[0], dim=-1)


def _penalized(logits: torch.Tensor, p: SamplingParams, history: list[int]) -> torch.Tensor:
    """logits [V] with presence / frequency / repetition penalties over the generated ``history``."""
    if not history:
        return logits
    ids = torch.tensor(history, dtype=torch.long, device=logits.device)
    counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones(len(history), device=logits.device))  # [V]
    seen = counts > 0
    if p.repetition_penalty != 1.0:
        pen = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seen, pen, logits)
    return logits - p.presence_penalty * seen.float() - p.frequency_penalty * counts


class PendingSample:
    """The sampled ids (and logprobs) of one step on their way to the host; :meth:`token_ids` and :meth:`result`
    wait for them."""

    def __init__(self, ids: torch.Tensor, logprob: torch.Tensor | None, top: tuple | None,
                 params: list[SamplingParams], short: torch.Tensor | None = None, redraw=None):
        """``short`` [S] bool (optional): rows whose ``ids`` are not valid; ``redraw(rows)`` (their indices) then
        returns the exact (ids, logprob, top) on the device, which the results take instead (rare: see
        sample_top_p)."""
        self.params = params
        self.logprobs = logprob is not None  # some row asked for logprobs: :meth:`result` carries them
        pin = ids.device.type == "cuda"
        self._host = [self._to_host(t, pin) for t in (ids, logprob, *(top or (None, None)))]
        self._short = self._to_host(short, pin)
        self._redraw = redraw
        self._event = None
        if pin:
            self._event = torch.cuda.Event()
            self._event.record()
        self._ids: list[int] | None = None

    @staticmethod
    def _to_host(t: torch.Tensor | None, pin: bool) -> torch.Tensor | None:
        if t is None or not pin:
            return None if t is None else t.cpu()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    def token_ids(self) -> list[int]:
        """The sampled token of each row, in order (the one host sync of a step's sampling)."""
        if self._ids is None:
            if self._event is not None:
                self._event.synchronize()
            if self._short is not None and bool(self._short.any()):
                ids, logprob, top = self._redraw(self._short.nonzero()[:, 0].tolist())
                self._host = [None if t is None else t.cpu() for t in (ids, logprob, *(top or (None, None)))]
            self._ids = self._host[0].tolist()
        return self._ids

    def result(self) -> list[SampledToken]:
        """One SampledToken per row, in order, with the logprobs its request asked for."""
        out = [SampledToken(t) for t in self.token_ids()]
        _, logprob, top_v, top_i = self._host
        if logprob is not None:
            lps, tv, ti = logprob.tolist(), top_v.tolist(), top_i.tolist()
            for r, (s, p) in enumerate(zip(out, self.params, strict=True)):
                if p.logprobs is not None:
                    s.logprob = lps[r]
                    if p.logprobs > 0:
                        s.top_logprobs = list(zip(ti[r][: p.logprobs], tv[r][: p.logprobs], strict=True))
        return out


class _BatchParams:
    """What a batch's sampling parameters decide, derived once per batch composition: the engine hands the sampler
    the same list while the same sequences step on, and an equal list (the same parameters in the same order) is
    the same composition. The fast-path flags, each row's draws and seed, and (built at the first step that samples
    with a temperature) the rows' columns on the device, read by every step of that composition."""

    def __init__(self, params: list[SamplingParams], dev: torch.device):
        self.params, self.device = params, dev
        self.plain_greedy = all(p.plain_greedy for p in params)
        self.want_lp = any(p.logprobs is not None for p in params)
        self.penalized = any(p.penalized for p in params)
        self.greedy = all(p.greedy for p in params)
        self.any_greedy = any(p.greedy for p in params)
        self.tries = [1 if p.greedy else tries_for(p.top_p) for p in params]
        self.draws = max(self.tries, default=1)
        self.seeded = [i for i, p in enumerate(params) if p.seed is not None]
        self.seeds = [params[i].seed for i in self.seeded]
        self.kmax = max((p.top_k for p in params if not p.greedy), default=0)
        self._columns: tuple[torch.Tensor, ...] | None = None
        # a composition a decode graph can sample (GraphSampling): no penalties, top-k nor logprobs, every
        # sampled row keyed by its seed (the engine gives unseeded requests a key), not plain greedy
        self.in_graph = (not self.plain_greedy and not self.penalized and not self.want_lp and self.kmax == 0
                         and all(p.greedy or p.seed is not None for p in params))
        self.keys = [0 if p.seed is None else _int64(p.seed) for p in params]
        self._graph_columns: GraphColumns | None = None

    def matches(self, params: list[SamplingParams], dev: torch.device) -> bool:
        return dev == self.device and (params is self.params or params == self.params)

    def columns(self) -> tuple[torch.Tensor, ...]:
        """Per row on the device: 1 / temperature ``[S]`` float32 (1 for greedy rows, whose argmax is kept), top_p
        ``[S]`` float32, top_k ``[S]`` int64, greedy ``[S]`` bool, its draws ``[S]`` int64 (one upload, once)."""
        if self._columns is None:
            params = self.params
            table = np.empty((len(params), 5), dtype=np.float32)
            table[:, 0] = [1.0 / p.temperature if p.temperature > 0 else 1.0 for p in params]
            table[:, 1] = [p.top_p for p in params]
            table[:, 2] = [p.top_k for p in params]
            table[:, 3] = [p.greedy for p in params]
            table[:, 4] = self.tries
            cols = _device(torch.from_numpy(table), self.device)  # [S, 5]
            self._columns = (cols[:, 0], cols[:, 1], cols[:, 2].long(), cols[:, 3] > 0, cols[:, 4].long())
        return self._columns

    def graph_columns(self) -> GraphColumns | None:
        """What :class:`GraphSampling` loads for this composition (uploaded once), or None where it is not
        :attr:`in_graph`."""
        if not self.in_graph:
            return None
        if self._graph_columns is None:
            inv_t, top_p, _, greedy, tries = self.columns()
            keys = _device(torch.tensor(self.keys, dtype=torch.int64), self.device)  # [S]
            self._graph_columns = GraphColumns(inv_t, top_p, tries, greedy, keys)
        return self._graph_columns


@dataclass(frozen=True, eq=False)
class GraphColumns:
    """One composition's sampling columns on the device, ``[S]`` each: 1 / temperature, top_p, draws, greedy,
    keys (the rows' seeds as int64)."""

    inv_t: torch.Tensor
    top_p: torch.Tensor
    tries: torch.Tensor
    greedy: torch.Tensor
    keys: torch.Tensor


class GraphSampling:
    """The sampler's rule as a function of static buffers, for a runner's CUDA graphs to capture after the logits
    (``cloud_server.fast.graphs``): no host work, no host sync, no upload per step.

    The buffers (``[max_batch]`` on ``device``) hold the columns of the composition :meth:`load` was last given;
    a graph replays with them. Each row draws :data:`TRIES` uniforms from its key and the position of the token it
    samples (:func:`device_uniforms`: a seeded row's numbers are the host path's), and :func:`sample_top_p` keeps
    the first of its own ``tries`` draws in its nucleus: the tokens :meth:`Sampler.launch` draws from the same
    logits. Greedy rows take the argmax. A row whose draws all missed is flagged; :meth:`Sampler.launch` (given
    these ids with ``drawn``) redraws it from the sorted cut, as it does its own. On CUDA the kernels hash the
    uniforms and take the greedy rows' argmax themselves (``sampler_kernels.top_p_draws`` with keys); elsewhere
    the same in torch ops."""

    def __init__(self, max_batch: int, device: torch.device):
        self.inv_t = torch.ones(max_batch, dtype=torch.float32, device=device)  # [B]
        self.top_p = torch.ones(max_batch, dtype=torch.float32, device=device)  # [B]
        self.tries = torch.ones(max_batch, dtype=torch.int64, device=device)  # [B]
        self.greedy = torch.ones(max_batch, dtype=torch.bool, device=device)  # [B]
        self.keys = torch.zeros(max_batch, dtype=torch.int64, device=device)  # [B]
        self.loaded: GraphColumns | None = None

    def load(self, cols: GraphColumns) -> None:
        """Copy a composition's columns into the buffers (nothing when they hold them already)."""
        if cols is self.loaded:
            return
        n = cols.keys.shape[0]
        for dst, src in ((self.inv_t, cols.inv_t), (self.top_p, cols.top_p), (self.tries, cols.tries),
                         (self.greedy, cols.greedy), (self.keys, cols.keys)):
            dst[:n].copy_(src, non_blocking=True)
        self.loaded = cols

    def __call__(self, logits: torch.Tensor, argmax: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits ``[b, V]``, their argmax ``[b]``, the rows' input positions ``[b]`` (each samples the token at the
        next one) -> (ids ``[b]``, missed ``[b]`` bool)."""
        b = logits.shape[0]
        if fused_top_p(logits):  # the uniforms hashed and the greedy rows' argmax taken in the kernels
            return top_p_draws(logits, self.top_p[:b], None, self.inv_t[:b], self.tries[:b], _chunk(logits.shape[1]),
                               draws=TRIES, keys=self.keys[:b], positions=positions + 1, greedy=self.greedy[:b],
                               argmax=argmax)
        u = device_uniforms(self.keys[:b], positions + 1, TRIES)  # [b, R]
        ids, missed = sample_top_p(logits, self.top_p[:b], u, self.inv_t[:b], self.tries[:b])
        greedy = self.greedy[:b]
        return torch.where(greedy, argmax, ids), missed & ~greedy


class Sampler:
    def __init__(self, seed: int | None = None):
        self.generator = torch.Generator()  # keys of unseeded rows; speculative draws of unseeded requests
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        self._batch: _BatchParams | None = None  # the last batch composition's derived parameters

    def fresh_key(self) -> int:
        """A random key for an unseeded request (the engine makes it the request's seed: its draws are then a
        function of the key and the position, as a seeded request's are, which a decode graph can compute)."""
        return int(torch.randint(0, (1 << 63) - 1, (), generator=self.generator))

    def _plan(self, params: list[SamplingParams], dev: torch.device) -> _BatchParams:
        b = self._batch
        if b is None or not b.matches(params, dev):
            b = self._batch = _BatchParams(params, dev)
        return b

    def graph_columns(self, params: list[SamplingParams], dev: torch.device) -> GraphColumns | None:
        """The composition's columns for a decode graph's :class:`GraphSampling`, or None: the graph's argmax (plain
        greedy) or this sampler's own launch (penalties, top-k, logprobs, an unkeyed row)."""
        return self._plan(params, dev).graph_columns()

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                 histories: list[list[int]] | None = None) -> list[SampledToken]:
        """:meth:`launch` and wait."""
        return self.launch(logits, params, positions, histories).result()

    def launch(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
               histories: list[list[int]] | None = None, argmax: torch.Tensor | None = None,
               drawn: tuple[torch.Tensor, torch.Tensor] | None = None) -> PendingSample:
        """logits [S, V] (CPU or device; float32, or a float the sampled rows are computed from in float32), one
        row per request; ``positions[i]`` is the position of row i's token (with the request's seed, it fixes the
        row's uniform); ``histories`` each request's generated tokens (for the penalties); ``argmax`` [S] the
        logits' argmax (lowest id on ties) where the caller has it already (the fast runner's graph computes it):
        greedy rows take it instead of a pass of their own. Queues the sampling where the logits are and the copy
        of the ids to the host. ``drawn`` = (ids ``[S]``, missed ``[S]``): what a decode graph's
        :class:`GraphSampling` drew from these logits for a composition :meth:`graph_columns` gave it; only the
        copy to the host is queued (and the logits kept for the rare redraw)."""
        if len(params) != logits.shape[0] or len(positions) != len(params):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(params)} params, {len(positions)} positions")
        b = self._plan(params, logits.device)
        if drawn is not None:
            return self._drawn(b, logits, params, positions, *drawn)
        if b.plain_greedy:
            # plain greedy rows: argmax where the logits are (first maximum = lowest id on ties)
            return PendingSample(logits.argmax(dim=-1) if argmax is None else argmax, None, None, params)
        return self._launch(b, logits, params, positions, histories, argmax)

    @torch.inference_mode()
    def _launch(self, b: _BatchParams, logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                histories: list[list[int]] | None, argmax: torch.Tensor | None) -> PendingSample:
        """:meth:`launch` of a batch that is not plain greedy (``b``: its derived parameters)."""
        dev = logits.device
        raw = logits.float()  # [S, V]
        x = raw
        if b.penalized:
            histories = histories or [[] for _ in params]
            x = torch.stack([_penalized(raw[r], p, h) if p.penalized else raw[r]
                             for r, (p, h) in enumerate(zip(params, histories, strict=True))])
        if argmax is None or b.penalized:  # (a penalty moves the argmax)
            argmax = x.argmax(dim=-1) if b.any_greedy else None
        if b.greedy:
            return self._pending(raw, argmax, params, b.want_lp)
        n, r, seeded = len(params), b.draws, b.seeded
        u = np.empty((n, r), dtype=np.float32)  # [S, R]
        if len(seeded) < n:  # unseeded rows: fresh keys from the sampler's generator
            u[:] = torch.rand(n, r, generator=self.generator, dtype=torch.float64).clamp_(1e-7, 1 - 1e-7).numpy()
        if seeded:
            u[seeded] = uniforms(b.seeds, positions if len(seeded) == n else [positions[i] for i in seeded], r)
        u = _device(torch.from_numpy(u), dev)  # [S, R] (float64 draws rounded to float32)
        inv_t, top_p, top_k, greedy, tries = b.columns()
        kmax = b.kmax
        # [S, V]; neither top-k nor penalties: the logits as they came (a 16-bit model's: the kernel the graphs use)
        y = top_k_masked(x, top_k, kmax) if kmax > 0 else x if b.penalized else logits
        ids, missed = sample_top_p(y, top_p, u, inv_t, tries)
        if b.any_greedy:
            ids = torch.where(greedy, argmax, ids)
            missed &= ~greedy

        def exact(rows: list[int]) -> torch.Tensor:  # the rows that missed: the sorted cut, inverse CDF at their u
            r = torch.tensor(rows, dtype=torch.long, device=dev)  # [k]
            z = filtered_logits(x[r], 1.0 / inv_t[r], top_k[r], top_p[r], kmax, True)  # [k, V]
            return ids.index_put((r,), sample_rows(z, u[r, 0].contiguous()))

        # a row that rejected every draw (probability <= MISS) is redrawn once the host sees its flag
        # (PendingSample.result): no sync here
        return self._pending(raw, ids, params, b.want_lp, missed, exact)

    @staticmethod
    def _drawn(b: _BatchParams, logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
               ids: torch.Tensor, missed: torch.Tensor) -> PendingSample:
        """The ids a decode graph drew (:class:`GraphSampling`) on their way to the host; a row that missed is
        redrawn as :meth:`_launch` redraws it (the sorted cut, inverse CDF at its first uniform)."""
        if not b.in_graph:
            raise ValueError("drawn ids for a composition the graph does not sample (see graph_columns)")

        def exact(rows: list[int]) -> tuple:
            inv_t, top_p, top_k, _, _ = b.columns()
            u0 = uniforms([b.keys[i] for i in rows], [positions[i] for i in rows], 1)[:, 0].astype(np.float32)
            r = torch.tensor(rows, dtype=torch.long, device=kept.device)  # [k]
            z = filtered_logits(kept[r].float(), 1.0 / inv_t[r], top_k[r], top_p[r], 0, True)  # [k, V]
            return ids.index_put((r,), sample_rows(z, _device(torch.from_numpy(u0), kept.device))), None, None

        pending = PendingSample(ids, None, None, params, missed, exact)  # (the ids' copy to the host queued first)
        kept = logits if logits.dtype == torch.float32 else logits.clone()  # [S, V] for exact (the graph's buffer is
        return pending  # reused; a float32 model's logits are the runner's copy already)

    @staticmethod
    def _pending(raw: torch.Tensor, ids: torch.Tensor, params: list[SamplingParams], want_lp: bool,
                 short: torch.Tensor | None = None, redraw=None) -> PendingSample:
        """The step's ids [S] (and the logprobs asked for, of the raw logits [S, V]) on their way to the host;
        ``redraw()`` gives the exact ids when a row of ``short`` [S] bool is set."""

        def finish(ids: torch.Tensor) -> tuple:
            if not want_lp:
                return ids, None, None
            lp = torch.log_softmax(raw, dim=-1)  # [S, V]
            k = max(p.logprobs or 0 for p in params)
            t = torch.topk(lp, k, dim=-1) if k else None
            top = (t.values, t.indices) if t is not None else (lp[:, :0], ids[:, None][:, :0])
            return ids, lp.gather(1, ids[:, None])[:, 0], top

        return PendingSample(*finish(ids), params, short,
                             None if redraw is None else lambda rows: finish(redraw(rows)))
