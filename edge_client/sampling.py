"""Sampling on the phone (u-shape: the phone holds the lm_head, so it picks the tokens): greedy, temperature,
top-k, top-p, per-request seeds, and the speculative-sampling draws, in numpy.

The distribution is the cloud sampler's (``cloud_server.engine.sampler``): logits / temperature, the tokens
outside the top-k and the top-p mass removed, softmax; greedy is the argmax (lowest id on ties). A seeded
request draws each token from a generator keyed by (seed, position), so a replay of the request from its
context (after a reconnect) draws the same tokens; an unseeded one draws from fresh entropy. Speculative
verification (``shared.speculative_sampling``) takes each row's token from :meth:`EdgeSampler.sample` at that
row's position, so it emits plain sampling's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.messages import MIN_TEMPERATURE


@dataclass(frozen=True, slots=True)
class EdgeSampler:
    temperature: float = 0.0  # 0 (or below MIN_TEMPERATURE): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """logits [V] -> the sampling distribution [V] float64 (temperature, then top-k, then top-p)."""
        x = np.asarray(logits, np.float64) / self.temperature
        if 0 < self.top_k < x.size:
            kth = np.partition(x, -self.top_k)[-self.top_k]
            x = np.where(x < kth, -np.inf, x)
        p = np.exp(x - x.max())
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            before = np.cumsum(p[order]) - p[order]  # mass of the better tokens
            p[order[before >= self.top_p]] = 0.0  # keep the smallest prefix whose mass reaches top_p
            p /= p.sum()
        return p

    def generator(self, position: int) -> np.random.Generator:
        """The draws for the token at ``position`` (keyed by the seed, so a replay draws the same)."""
        if self.seed is None:
            return np.random.default_rng()
        return np.random.default_rng([self.seed, position])

    def sample(self, logits: np.ndarray, position: int) -> int:
        """The token at ``position`` from its logits [V]."""
        if self.greedy:
            return int(np.argmax(logits))
        p = self.probs(logits)
        return int(self.generator(position).choice(p.size, p=p))
