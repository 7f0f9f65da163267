"""Token sampling from a step's logits: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

All rows of a step are sampled together where the logits are (the device on a GPU): temperature and top-k
truncate the logits of the whole batch in a few tensor ops; each row draws :data:`TRIES` tokens by inverting the
cumulative distribution of that softmax at uniform numbers ``u`` (``searchsorted``) and keeps the first inside
its top-p nucleus (:func:`sample_top_p`, rejection sampling: exactly a draw from the top-p distribution, with
no sort of the vocabulary). A seeded request's ``u`` are counter-based hashes of ``(seed, position, try)``
(:func:`uniform_of`), so it draws the
same tokens batched or alone and when it is replayed from its context (a resume, another replica); rows without
a seed take fresh uniforms from the sampler's generator. No per-row Python loop, no per-row sync: one copy of
the S ids (and the logprobs asked for) to the host, and :meth:`Sampler.launch` only queues it, so the engine
can overlap it with the next step (:meth:`PendingSample.result` waits).

Greedy picks the argmax (lowest id on ties). Logprobs are those of the model's raw distribution (temperature
1, no truncation, no penalties), as vLLM reports them. Presence / frequency / repetition penalties apply to the
generated tokens only (the one per-row step: only penalized rows take it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cloud_server.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the sampled token, when asked for
    top_logprobs: list[tuple[int, float]] | None = None  # (token, logprob), best first


def uniform_of(seed: int, position: int, draw: int = 0) -> float:
    """The uniform number in (0, 1) of try ``draw`` that samples the token at ``position`` of a request seeded
    ``seed``: a splitmix64 hash of the three, so it depends on nothing else (not the batch, not any generator's
    state)."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + draw * 0xD6E8FEB86659FD93
         + 0x94D049BB133111EB) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (((z ^ (z >> 31)) >> 40) + 0.5) / (1 << 24)


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
    vocab = x.shape[-1]
    kmax = min(kmax, vocab)
    if kmax > 0:
        use_k = (top_k > 0) & (top_k < vocab)  # [S]
        top = torch.topk(x, kmax, dim=-1).values  # [S, kmax], best first
        kth = top.gather(1, (top_k.clamp(1, kmax) - 1)[:, None])  # [S, 1]
        x = x.masked_fill(use_k[:, None] & (x < kth), float("-inf"))
    if any_top_p:
        ordered = torch.sort(x, dim=-1, descending=True).values  # [S, V]
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the better tokens
        kept = (before < top_p[:, None]).sum(dim=-1, keepdim=True)  # [S, 1] >= 1: the smallest prefix reaching top_p
        cut = ordered.gather(1, kept - 1)  # [S, 1]
        x = x.masked_fill((top_p[:, None] < 1.0) & (x < cut), float("-inf"))
    return x


TRIES = 8  # draws per row of the top-p rejection sampler; all rejected with probability <= (1 - top_p) ** TRIES


def sample_top_p(x: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p sampling without sorting the vocabulary: rejection sampling.

    ``x`` ``[S, V]`` tempered (top-k-truncated) logits, ``top_p`` ``[S]``, ``u`` ``[S, TRIES]`` uniforms. Each row
    draws TRIES tokens from ``softmax(x)`` (inverse CDF) and keeps the first whose better tokens (strictly
    larger logit) hold less than ``top_p`` of the mass: exactly the tokens the sorted cut of
    :func:`filtered_logits` keeps, so the kept draw is exactly a draw from the top-p distribution. A try is
    accepted with probability >= top_p; a row where none is (``missed`` ``[S]`` bool) must be redrawn.
    Returns (ids ``[S]``, missed ``[S]``). A few passes over ``[S, V]``, no sort, no host sync.
    """
    probs = torch.softmax(x, dim=-1)  # [S, V]
    cum = torch.cumsum(probs, dim=-1)
    tries = torch.searchsorted(cum, (u * cum[:, -1:]).contiguous()).clamp_(max=x.shape[-1] - 1)  # [S, R]
    ids, missed = tries[:, 0], torch.ones_like(top_p, dtype=torch.bool)
    for r in reversed(range(tries.shape[1])):  # the first accepted try wins
        v = x.gather(1, tries[:, r:r + 1])  # [S, 1]
        better = torch.where(x > v, probs, 0.0).sum(dim=-1)  # [S] mass of the strictly better tokens
        ok = (top_p >= 1.0) | (better < top_p)
        ids = torch.where(ok, tries[:, r], ids)
        missed &= ~ok
    return ids, missed


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
    """The sampled ids (and logprobs) of one step on their way to the host; :meth:`result` waits for them."""

    def __init__(self, ids: torch.Tensor, logprob: torch.Tensor | None, top: tuple | None,
                 params: list[SamplingParams], short: torch.Tensor | None = None, redraw=None):
        """``short`` [S] bool (optional): rows whose ``ids`` are not valid; ``redraw()`` then returns the exact
        (ids, logprob, top) on the device, which :meth:`result` takes instead (rare: see sample_truncated)."""
        self.params = params
        pin = ids.device.type == "cuda"
        self._host = [self._to_host(t, pin) for t in (ids, logprob, *(top or (None, None)))]
        self._short = self._to_host(short, pin)
        self._redraw = redraw
        self._event = None
        if pin:
            self._event = torch.cuda.Event()
            self._event.record()

    @staticmethod
    def _to_host(t: torch.Tensor | None, pin: bool) -> torch.Tensor | None:
        if t is None or not pin:
            return None if t is None else t.cpu()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    def result(self) -> list[SampledToken]:
        """One SampledToken per row, in order (the one host sync of a step's sampling)."""
        if self._event is not None:
            self._event.synchronize()
        if self._short is not None and bool(self._short.any()):
            ids, logprob, top = self._redraw()
            self._host = [None if t is None else t.cpu() for t in (ids, logprob, *(top or (None, None)))]
        ids, logprob, top_v, top_i = self._host
        out = [SampledToken(t) for t in ids.tolist()]
        if logprob is not None:
            lps, tv, ti = logprob.tolist(), top_v.tolist(), top_i.tolist()
            for r, (s, p) in enumerate(zip(out, self.params, strict=True)):
                if p.logprobs is not None:
                    s.logprob = lps[r]
                    if p.logprobs > 0:
                        s.top_logprobs = list(zip(ti[r][: p.logprobs], tv[r][: p.logprobs], strict=True))
        return out


class Sampler:
    def __init__(self, seed: int | None = None):
        self.generator = torch.Generator()  # keys of unseeded rows; speculative draws of unseeded requests
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                 histories: list[list[int]] | None = None) -> list[SampledToken]:
        """:meth:`launch` and wait."""
        return self.launch(logits, params, positions, histories).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
               histories: list[list[int]] | None = None) -> PendingSample:
        """logits [S, V] float32 (CPU or device), one row per request; ``positions[i]`` is the position of row i's
        token (with the request's seed, it fixes the row's uniform); ``histories`` each request's generated tokens (for the
        penalties). Queues the sampling where the logits are and the copy of the ids to the host."""
        if len(params) != logits.shape[0] or len(positions) != len(params):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(params)} params, {len(positions)} positions")
        want_lp = any(p.logprobs is not None for p in params)
        if all(p.greedy and not p.penalized for p in params) and not want_lp:
            # plain greedy rows: argmax where the logits are (first maximum = lowest id on ties)
            return PendingSample(logits.argmax(dim=-1), None, None, params)
        dev = logits.device
        raw = logits.float()  # [S, V]
        x = raw
        if any(p.penalized for p in params):
            histories = histories or [[] for _ in params]
            x = torch.stack([_penalized(raw[r], p, h) if p.penalized else raw[r]
                             for r, (p, h) in enumerate(zip(params, histories, strict=True))])
        ids = x.argmax(dim=-1)  # [S] the greedy rows' tokens
        if not all(p.greedy for p in params):
            fresh = torch.rand(len(params), TRIES, generator=self.generator, dtype=torch.float64)
            fresh = fresh.clamp(1e-7, 1 - 1e-7).tolist()
            u = [[uniform_of(p.seed, pos, r) for r in range(TRIES)] if p.seed is not None else f
                 for p, pos, f in zip(params, positions, fresh, strict=True)]
            # per row: temperature (1 for greedy rows, whose argmax is kept), top_p, top_k, greedy, u x TRIES
            table = _device(torch.tensor([[p.temperature or 1.0, p.top_p, p.top_k, p.greedy, *r]
                                          for p, r in zip(params, u, strict=True)]), dev)  # [S, 4 + TRIES]
            sampled = [p for p in params if not p.greedy]
            kmax = max((p.top_k for p in sampled), default=0)
            temperature, top_p, top_k, greedy, u = table[:, 0], table[:, 1], table[:, 2].long(), table[:, 3] > 0, \
                table[:, 4:]
            y = filtered_logits(x, temperature, top_k, top_p, kmax, False)  # [S, V] temperature and top-k
            picked, missed = sample_top_p(y, top_p, u)
            missed &= ~greedy
            ids = torch.where(greedy, ids, picked)

            def exact() -> torch.Tensor:  # the rows that missed: the sorted cut, inverse CDF at their first u
                z = filtered_logits(x, temperature, top_k, top_p, kmax, True)  # [S, V]
                return torch.where(missed, sample_rows(z, u[:, 0].contiguous()), ids)

            # a row that rejected every try (probability <= 0.1 ** TRIES at top-p 0.9) is redrawn once the host
            # sees its flag (PendingSample.result): no sync here
            return self._pending(raw, ids, params, want_lp, missed, exact)
        return self._pending(raw, ids, params, want_lp)

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

        return PendingSample(*finish(ids), params, short, None if redraw is None else lambda: finish(redraw()))
