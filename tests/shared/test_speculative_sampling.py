"""shared.speculative_sampling: the verification rule both sides run. Greedy keeps the drafts while they are
the argmax; with sampling, the first emitted token is distributed exactly as a plain draw (chi-square)."""

from __future__ import annotations

import numpy as np

from edge_client.sampling import EdgeSampler
from shared.speculative_sampling import accept_drafts


def test_greedy_accepts_the_argmax_prefix_then_the_models_token():
    rows = np.eye(6)[[2, 3, 1, 4]]  # argmax after each position: 2, 3, 1, 4
    def argmax(i, _):
        return int(np.argmax(rows[i]))

    assert accept_drafts([2, 3, 5], argmax) == [2, 3, 1]  # d3 rejected
    assert accept_drafts([2, 3, 1], argmax) == [2, 3, 1, 4]  # all + bonus
    assert accept_drafts([0], argmax) == [2]


def test_speculative_sampling_keeps_the_models_distribution():
    sampler = EdgeSampler(temperature=1.3, top_k=6)
    logits = np.random.default_rng(1).normal(size=(2, 10)) * 2  # [k + 1, V]
    p = sampler.probs(logits[0])
    draft = int(np.argsort(p)[-2])  # a likely but not the likeliest token
    n = 20000
    first = []
    for seed in range(n):
        s = EdgeSampler(temperature=1.3, top_k=6, seed=seed)
        first.append(accept_drafts([draft], lambda i, _, s=s: s.sample(logits[i], 5 + i))[0])
    counts = np.bincount(first, minlength=10)
    kept = p > 0
    assert counts[~kept].sum() == 0  # nothing outside top-k
    expected = p[kept] * n
    stat, dof = float(((counts[kept] - expected) ** 2 / expected).sum()), int(kept.sum()) - 1
    # the chi-square test at p = 0.001: Wilson-Hilferty's 99.9th percentile (scipy is not a dependency)
    assert stat < dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3, (stat, dof)


def test_seeded_edge_sampling_is_keyed_by_position():
    s = EdgeSampler(temperature=1.0, seed=5)
    logits = np.zeros(50)
    draws = [s.sample(logits, pos) for pos in range(40)]
    assert draws == [s.sample(logits, pos) for pos in range(40)] and len(set(draws)) > 5
    assert EdgeSampler().sample(np.arange(5.0), 0) == 4  # greedy
