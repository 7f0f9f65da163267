"""Sampling: greedy, truncation, seeds independent of the batch, logprobs, parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from cloud_server.engine.sampler import Sampler, _filtered
from cloud_server.engine.sampling_params import SamplingParams, SamplingParamsError


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    out = Sampler(0)(logits, [SamplingParams(0.0)] * 2, [None, None])
    assert [o.token_id for o in out] == [1, 0]


def test_top_k_and_top_p_truncate():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0])
    p = _filtered(logits, SamplingParams(1.0, top_k=2))
    assert (p[2:] == 0).all() and math.isclose(float(p.sum()), 1.0, rel_tol=1e-6)
    probs = torch.softmax(logits, -1)
    p = _filtered(logits, SamplingParams(1.0, top_p=float(probs[0]) + 1e-3))  # needs the top two
    assert (p[:2] > 0).all() and (p[2:] == 0).all()
    p = _filtered(logits, SamplingParams(1.0, top_p=0.01))
    assert p.nonzero().flatten().tolist() == [0]


def test_seeded_requests_do_not_depend_on_their_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    sampler = Sampler()
    params = SamplingParams(1.0, seed=42)

    def tokens(rows, n=20):
        gens = [torch.Generator().manual_seed(42)]
        out = []
        for _ in range(n):
            others = [SamplingParams(1.0)] * (len(rows) - 1)
            out.append(sampler(logits[rows], [params, *others], gens + [None] * len(others))[0].token_id)
        return out

    assert tokens([0]) == tokens([0, 1, 2])
    assert len(set(tokens([0]))) > 1  # really sampling


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    s = Sampler(0)
    counts = torch.zeros(3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2000):
        counts[s(logits, [SamplingParams(1.0)], [gen])[0].token_id] += 1
    assert torch.allclose(counts / 2000, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_logprobs_are_the_raw_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    [o] = Sampler(0)(logits, [SamplingParams(0.0, logprobs=2)], [None])
    lp = torch.log_softmax(logits[0], -1)
    assert o.token_id == 0 and math.isclose(o.logprob, float(lp[0]), rel_tol=1e-6)
    assert [t for t, _ in o.top_logprobs] == [0, 1]


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1},
                                {"max_tokens": 0}, {"logprobs": 21}])
def test_bad_parameters_are_refused(kw):
    with pytest.raises(SamplingParamsError):
        SamplingParams(**kw)


def test_all_greedy_batch_takes_the_device_argmax_path_with_the_same_tokens():
    # The all-greedy fast path (one argmax where the logits live) must pick what the per-row path picks,
    # ties included: mixing in one logprobs request forces the per-row path for the same rows.
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 3.0, 3.0, 0.0], [-1.0, -2.0, -0.5, -0.5]])
    greedy = [SamplingParams(temperature=0.0) for _ in range(3)]
    fast = Sampler(0)(logits, greedy, [None] * 3)
    slow = Sampler(0)(logits, greedy[:2] + [SamplingParams(temperature=0.0, logprobs=0)], [None] * 3)
    assert [t.token_id for t in fast] == [t.token_id for t in slow] == [1, 0, 2]
