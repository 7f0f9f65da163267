"""Sampling: greedy, truncation, seeds independent of the batch and replayable, logprobs, parameter validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import cloud_server.engine.sampler as sampler_module
from cloud_server.engine.sampler import (
    MISS,
    TRIES,
    Sampler,
    _filtered,
    filtered_logits,
    sample_rows,
    sample_top_p,
    tries_for,
    uniform_of,
    uniforms,
)
from cloud_server.engine.sampling_params import SamplingParams, SamplingParamsError


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    out = Sampler(0)(logits, [SamplingParams(0.0)] * 2, [0, 0])
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
        others = [SamplingParams(0.7, top_p=0.9)] * (len(rows) - 1)
        return [sampler(logits[rows], [params, *others], [pos] * len(rows))[0].token_id for pos in range(n)]

    assert tokens([0]) == tokens([0, 1, 2])
    assert len(set(tokens([0]))) > 1  # really sampling


def test_a_seeded_request_replays_the_same_tokens_from_any_point():
    """The noise of a position depends on (seed, position) only: a resume that replays positions 5.. draws
    what the original run drew there, whichever sampler (a fresh one: another replica) does it."""
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(0.8, top_k=50, top_p=0.95, seed=11)
    first = [Sampler(1)(logits, [p], [pos])[0].token_id for pos in range(20)]
    again = [Sampler(2)(logits, [p], [pos])[0].token_id for pos in range(5, 20)]
    assert again == first[5:] and len(set(first)) > 3
    other = [Sampler(1)(logits, [SamplingParams(0.8, top_k=50, top_p=0.95, seed=12)], [pos])[0].token_id
             for pos in range(20)]
    assert other != first


def test_seeded_uniforms_are_uniform_and_independent_of_each_other():
    u = torch.tensor([[uniform_of(seed, pos) for pos in range(4000)] for seed in (1, 2)])  # [2, 4000]
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.02 and abs(float(u.var()) - 1 / 12) < 0.005
    assert abs(float(torch.corrcoef(u)[0, 1])) < 0.05  # two seeds
    assert abs(float(torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1])) < 0.05  # neighbouring positions


def test_batched_uniforms_are_the_scalar_hash():
    seeds, positions = [0, 1, 42, -3, 2**63 + 5], [0, 7, 4095, 1, 2**40]
    u = uniforms(seeds, positions, TRIES)  # [5, TRIES]
    want = [[uniform_of(s, p, r) for r in range(TRIES)] for s, p in zip(seeds, positions, strict=True)]
    assert u.shape == (5, TRIES) and u.tolist() == want


@pytest.mark.parametrize("vocab", [5, 40, 512, 1000, 1537])  # inside one chunk, exactly chunks, padded chunks
def test_chunked_draws_follow_the_tempered_distribution_and_skip_excluded_tokens(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(2, vocab, generator=g) * 2  # [S, V]
    x[:, ::3] = float("-inf")  # excluded tokens (e.g. by top-k)
    inv_t = torch.tensor([1.0, 1 / 0.7])
    n = 6000
    u = torch.rand(2, n, generator=g).clamp(1e-7, 1 - 1e-7)
    counts = torch.zeros(2, vocab)
    for i in range(0, n, 2):
        ids, missed = sample_top_p(x, torch.ones(2), u[:, i:i + 2], inv_t)  # top-p 1: the first draw is kept
        assert not missed.any()
        counts[torch.arange(2), ids] += 1
    assert counts[:, ::3].sum() == 0
    want = torch.softmax(x * inv_t[:, None], -1)
    assert (counts / counts.sum(-1, keepdim=True) - want).abs().max() < 0.05


def test_draws_per_row_follow_its_top_p_only():
    assert [tries_for(p) for p in (1.0, 0.99, 0.95, 0.9, 0.5, 0.01)] == [1, 2, 4, 4, 14, TRIES]
    assert all((1 - p) ** tries_for(p) <= MISS * (1 + 1e-9) for p in (0.99, 0.9, 0.7, 0.5))
    # a row's draws beyond its own count are never kept: its result does not depend on its neighbours' top_p
    x = torch.zeros(1, 100)
    x[0, 3] = math.log(99.0)  # half the mass on token 3: top-p 0.5 keeps token 3 only
    u = torch.tensor([[0.9, 0.9, 0.1]])  # the first two draws land in the flat half, the third on token 3
    assert sample_top_p(x, torch.tensor([0.5]), u)[0].item() == 3
    ids, missed = sample_top_p(x, torch.tensor([0.5]), u, tries=torch.tensor([2]))
    assert missed.item()


def test_top_k_cuts_before_the_temperature_and_keeps_ties():
    logits = torch.tensor([[4.0, 3.0, 3.0, 1.0, 0.5]] * 2)
    params = [SamplingParams(0.7, top_k=2, seed=1), SamplingParams(1.3, top_k=2, top_p=0.95, seed=2)]
    seen = set()
    for pos in range(300):
        seen |= {o.token_id for o in Sampler(0)(logits, params, [pos, pos])}
    assert seen == {0, 1, 2}  # the tie at the 2nd largest stays, the rest never comes


def test_inverse_cdf_sampling_never_picks_an_excluded_token():
    x = torch.tensor([[float("-inf"), 1.0, float("-inf"), 1.0, float("-inf")]] * 3)
    ids = sample_rows(x, torch.tensor([1e-7, 0.6, 1.0]))
    assert ids.tolist() == [1, 3, 3]


def test_batched_truncation_applies_each_rows_own_parameters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 3)
    x = filtered_logits(logits, torch.tensor([1.0, 1.0, 2.0]), torch.tensor([2, 0, 0]),
                        torch.tensor([1.0, 0.5, 1.0]), 2, True)
    assert torch.isinf(x[0, 2:]).all() and torch.isfinite(x[0, :2]).all()  # top-k 2
    assert torch.isfinite(x[1]).tolist() == [True, False, False, False]  # top-p 0.5: the first token has 0.64
    assert torch.equal(x[2], logits[2] / 2)  # temperature only


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    s = Sampler(0)
    counts = torch.zeros(3)
    for pos in range(2000):
        counts[s(logits, [SamplingParams(1.0, seed=1)], [pos])[0].token_id] += 1
    assert torch.allclose(counts / 2000, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)
    counts.zero_()
    for _ in range(2000):  # unseeded: fresh keys every draw
        counts[s(logits, [SamplingParams(1.0)], [0])[0].token_id] += 1
    assert torch.allclose(counts / 2000, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_a_mixed_batch_samples_greedy_rows_by_argmax():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(0.0), SamplingParams(1.5), SamplingParams(0.0, logprobs=1), SamplingParams(1.0, seed=3)]
    out = Sampler(0)(logits, params, [9] * 4)
    assert out[0].token_id == int(logits[0].argmax()) and out[2].token_id == int(logits[2].argmax())
    assert out[2].logprob is not None and out[0].logprob is None and len(out[2].top_logprobs) == 1


def test_logprobs_are_the_raw_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    [o] = Sampler(0)(logits, [SamplingParams(0.0, logprobs=2)], [0])
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
    fast = Sampler(0)(logits, greedy, [0] * 3)
    slow = Sampler(0)(logits, greedy[:2] + [SamplingParams(temperature=0.0, logprobs=0)], [0] * 3)
    assert [t.token_id for t in fast] == [t.token_id for t in slow] == [1, 0, 2]


@pytest.mark.parametrize("vocab", [40, 1300])  # one padded chunk; three chunks, the last padded
def test_top_p_rejection_sampling_keeps_exactly_the_sorted_cut(vocab):
    """A try is accepted iff the sorted cut of filtered_logits keeps its token; the kept draws follow the
    top-p distribution."""
    x = torch.randn(2, vocab, generator=torch.Generator().manual_seed(7)) * (2 if vocab < 100 else 5)  # [S, V]
    top_p = torch.tensor([0.6, 1.0])
    kept = torch.isfinite(filtered_logits(x, torch.ones(2), torch.zeros(2, dtype=torch.long), top_p, 0, True))
    u = torch.rand(2, 4000, generator=torch.Generator().manual_seed(1)).double().clamp(1e-7, 1 - 1e-7)
    counts = torch.zeros(2, vocab)
    for i in range(0, 4000, TRIES):
        ids, missed = sample_top_p(x, top_p, u[:, i:i + TRIES].float())
        assert kept.gather(1, ids[:, None]).all() and not missed[1]
        counts[torch.arange(2)[~missed], ids[~missed]] += 1
    want = torch.softmax(x.masked_fill(~kept, float("-inf")), -1)
    assert torch.allclose(counts / counts.sum(-1, keepdim=True), want, atol=0.04)


def test_a_row_that_rejects_every_try_is_redrawn_from_the_sorted_cut(monkeypatch):
    v = 1000
    logits = torch.zeros(2, v)  # row 0: 0.5 of the mass on token 3, the rest flat; top-p 0.5: only token 3
    logits[0, 3] = math.log(v - 1)
    logits[1, 7] = 30.0
    params = [SamplingParams(1.0, top_p=0.5, seed=5), SamplingParams(1.0, top_p=0.9, seed=6)]
    u = torch.tensor([[0.99] * TRIES, [0.5] * TRIES])  # row 0: every try lands in the flat tail
    ids, missed = sample_top_p(logits, torch.tensor([0.5, 0.9]), u)
    assert missed.tolist() == [True, False] and int(ids[1]) == 7
    for pos in range(30):  # whatever the tries, the answer is token 3 (redrawn when all of them missed)
        out = Sampler(0)(logits, params, [pos, pos])
        assert [o.token_id for o in out] == [3, 7]
    monkeypatch.setattr(sampler_module, "uniforms", lambda seeds, pos, tries: np.full((len(seeds), tries), 0.99))
    pending = Sampler(0).launch(logits, params, [0, 0])
    assert pending._short.tolist() == [True, False]
    assert [o.token_id for o in pending.result()] == [3, 7]


def test_device_uniforms_are_the_host_hash():
    """The uniforms a decode graph computes from int64 keys on the device are the host path's, bit for bit
    (keys past 2**63 included: int64 arithmetic wraps as the uint64 hash does)."""
    from cloud_server.engine.sampler import _int64, device_uniforms

    seeds = [0, 1, 3, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 123456789012345, -5]
    positions = [0, 1, 5, 100_000, 7, 1 << 31, 9, 2]
    want = uniforms(seeds, positions, TRIES).astype(np.float32)  # [8, TRIES]
    got = device_uniforms(torch.tensor([_int64(s) for s in seeds]), torch.tensor(positions), TRIES)
    assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want)


def test_warm_up_runs_the_sampled_and_redraw_paths():
    """What the fast runner calls at startup on CUDA runs on any device and dtype (here: the torch formula)."""
    from cloud_server.engine.sampler import warm_up

    warm_up(300, (torch.float32, torch.bfloat16), torch.device("cpu"))
    warm_up(300, (), torch.device("cpu"))
