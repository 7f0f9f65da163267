"""edge_client.drafting: prompt lookup finds the continuation of the latest earlier occurrence of the
context's suffix, in the context or in remembered outputs; the sizer's k follows acceptance and costs."""

from __future__ import annotations

import pytest

from edge_client.drafting import DraftConfig, DraftSizer, PromptLookupDrafter


def test_lookup_prefers_the_longest_suffix_and_the_latest_occurrence():
    d = PromptLookupDrafter(DraftConfig(max_ngram=3, min_ngram=1))
    #          0  1  2  3  4  5  6  7  8  9 10 11
    context = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    assert d.propose(context, 3) == [2, 3, 6]  # "6 7" last seen at 6..7, followed by 2 3 6
    assert d.propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # "1 2 3" beats "3"
    assert d.propose([1, 2, 3], 4) == []  # nothing repeats
    assert d.propose(context, 0) == [] and d.propose([], 3) == []


def test_remembered_outputs_are_a_source_and_never_spliced():
    d = PromptLookupDrafter(DraftConfig(max_ngram=2, min_ngram=2))
    d.remember([40, 41, 42, 43])
    d.remember([50, 51])
    assert d.propose([9, 40, 41], 5) == [42, 43]  # stops at the end of that output
    assert d.propose([7, 43, 50], 3) == []  # "43 50" only exists across two outputs
    d.forget()
    assert d.propose([9, 40, 41], 5) == []


def test_max_drafts_caps_a_proposal():
    d = PromptLookupDrafter(DraftConfig(max_drafts=2))
    assert d.propose([1, 2, 3, 4, 5, 1], 8) == [2, 3]


def test_bad_configs_are_refused():
    with pytest.raises(ValueError):
        DraftConfig(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError):
        DraftConfig(max_drafts=-1)


def test_sizer_grows_k_with_acceptance_and_rtt_and_shrinks_it_when_drafts_fail():
    s = DraftSizer(8)
    for _ in range(30):
        s.observe(0, 0, 0.15)  # plain steps: a 150 ms round trip
        s.observe(4, 4, 0.17)  # every draft accepted, 5 ms each
    assert s.alpha > 0.9 and s.choose() == 8
    assert s.choose(limit=3) == 3
    for _ in range(30):
        s.observe(4, 0, 0.17)  # nothing accepted
    assert s.alpha < 0.2 and s.choose() <= 1
    fast = DraftSizer(8)
    for _ in range(30):
        fast.observe(0, 0, 0.01)  # a 10 ms link
        fast.observe(2, 1, 0.03)  # drafts cost as much as the round trip, half accepted
    assert fast.choose() < 2


def test_sizer_tries_again_after_a_phase_without_drafts():
    s = DraftSizer(8)
    for _ in range(30):
        s.observe(0, 0, 0.15)
        s.observe(3, 0, 0.30)  # rejected drafts at 50 ms each: not worth sending
    assert s.choose() == 0
    for _ in range(20):  # plain steps only: no verdicts; the estimate drifts back to the prior
        s.observe(0, 0, 0.15)
    assert s.choose() > 0


def test_a_new_request_restarts_acceptance_but_keeps_the_link_costs():
    s = DraftSizer(8)
    for _ in range(30):
        s.observe(0, 0, 0.15)
        s.observe(3, 0, 0.30)
    round_s, row_s = s.round_s, s.row_s
    s.new_request()
    assert s.alpha == pytest.approx(s.config.prior_alpha) and (s.round_s, s.row_s) == (round_s, row_s)


def test_fixed_k_pins_the_choice_within_the_limits():
    from edge_client.drafting import DRAFTER_SIZERS, SizerConfig

    s = DraftSizer(8, SizerConfig(fixed_k=3))
    for _ in range(30):
        s.observe(0, 0, 0.01)
        s.observe(3, 0, 0.5)  # drafts that fail and cost a lot would drive an adaptive sizer to k = 0
    assert s.choose() == 3 and s.choose(limit=1) == 1
    assert DraftSizer(2, DRAFTER_SIZERS["layers"].with_fixed_k(5)).choose() == 2
    with pytest.raises(ValueError):
        SizerConfig(fixed_k=-1)


def test_a_shadow_proposal_is_scored_against_the_verdict():
    s = DraftSizer(8)
    for _ in range(30):
        s.observe_shadow([5, 6, 7], [5, 9])  # one agreed, the second judged wrong, the third not judged
    assert s.alpha == pytest.approx(0.5, abs=0.02)
    for _ in range(30):
        s.observe_shadow([5, 6, 7], [5, 6])  # censored: both judged positions agree, no rejection seen
    assert s.alpha > 0.9
    before = (s._accepted, s._tried)
    s.observe_shadow([], [1, 2])  # nothing proposed: nothing learnt
    assert (s._accepted, s._tried) == before


def test_drafts_the_server_made_already_cost_only_their_rows():
    s = DraftSizer(4)
    s.observe(0, 0, 0.08)
    s.price_server_rows(0.06, 1)  # a 60 ms engine step per cloud draft (a CPU cloud)
    s.price_server_rows(0.06, 1)
    assert s.rate(1) < s.rate(1, server_paid=True)
    assert s.rate(0) == s.rate(0, server_paid=True) == pytest.approx(1 / s.round_s)
    assert s.choose() == max(range(5), key=s.rate)
