"""shared.exec_mode: privacy levels filter the modes (an override too), the estimates pick among the rest, a
link that is down keeps the request on the phone, and the private levels key prefixes with a secret."""

from __future__ import annotations

import pytest

from shared.exec_mode import Deployment, ExecModeError, LinkState, RequestShape, choose_mode, estimate_s
from shared.link_profiles import PROFILES
from shared.prefix_keys import KeyScope, block_keys

CHAT = RequestShape(prompt_tokens=60, max_tokens=128)
AGENT = RequestShape(prompt_tokens=900, max_tokens=40, images=1)
EVERYTHING = Deployment(all_cloud=True, edge_only=True)


def _link(name: str) -> LinkState:
    p = PROFILES[name]
    return LinkState(rtt_ms=p.rtt_ms, up_kbps=p.up_mbps * 1000, down_kbps=p.down_mbps * 1000)


def test_standard_picks_the_fastest_estimate_and_says_why():
    d = choose_mode(CHAT, "standard", _link("4g"), EVERYTHING)
    assert d.mode == "all-cloud"  # streamed, no round trip per token: raw text may leave
    assert d.mode in d.reason and set(d.estimates_s) == {"split", "all-cloud", "edge-only"}
    assert d.estimates_s["all-cloud"] == min(d.estimates_s.values())
    assert not d.drafts_from_outputs_only and not d.secret_prefix_keys
    # without a full-model endpoint the split serves it; speculation makes the split cheaper
    d = choose_mode(CHAT, "standard", _link("4g"), Deployment(edge_only=True))
    assert d.mode == "split"
    spec = Deployment(split_tokens_per_round_trip=2.8)
    assert estimate_s("split", CHAT, _link("4g"), spec) < estimate_s("split", CHAT, _link("4g"), Deployment())
    # u-shape takes the split's gain unless its own is given (it drafts by lookup alone)
    both = Deployment(u_shape=True, split_tokens_per_round_trip=2.8)
    own = Deployment(u_shape=True, split_tokens_per_round_trip=2.8, ushape_tokens_per_round_trip=1.1)
    assert estimate_s("u-shape", CHAT, _link("4g"), both) < estimate_s("u-shape", CHAT, _link("4g"), own)
    assert estimate_s("split", CHAT, _link("4g"), both) == estimate_s("split", CHAT, _link("4g"), own)


def test_private_never_sends_raw_input_and_restricts_drafts_and_keys():
    for name in PROFILES:
        d = choose_mode(AGENT, "private", _link(name), EVERYTHING)
        assert d.mode in ("split", "edge-only") and "all-cloud" not in d.estimates_s
        assert d.secret_prefix_keys and d.drafts_from_outputs_only == (d.mode == "split")
    with pytest.raises(ExecModeError, match="privacy level private"):
        choose_mode(AGENT, "private", _link("wifi"), EVERYTHING, override="all-cloud")


def test_output_private_needs_the_whole_model_or_u_shape():
    d = choose_mode(CHAT, "output-private", _link("wifi"), EVERYTHING)
    assert d.mode == "edge-only"
    with pytest.raises(ExecModeError, match="output-private allows edge-only, u-shape"):
        choose_mode(CHAT, "output-private", _link("wifi"), Deployment(all_cloud=True))
    with pytest.raises(ExecModeError):
        choose_mode(CHAT, "output-private", _link("wifi"), EVERYTHING, override="split")


def test_output_private_runs_u_shape_on_a_bundle_with_a_tail():
    tail = Deployment(split=False, u_shape=True, boundary_bytes_per_token=2 * 576)
    for name in PROFILES:
        d = choose_mode(CHAT, "output-private", _link(name), tail)
        assert d.mode == "u-shape" and "output-private: u-shape" in d.reason and set(d.estimates_s) == {"u-shape"}
        assert not d.drafts_from_outputs_only  # u-shape sends no draft id at all
    # with the whole model on the phone too, the estimates decide; the reason names both
    d = choose_mode(CHAT, "output-private", _link("5g"), Deployment(split=False, u_shape=True, edge_only=True))
    assert d.mode == "u-shape" and "edge-only" in d.reason
    # a tail bundle's cloud never samples: no split, even when the level would allow it
    assert choose_mode(CHAT, "standard", _link("4g"), tail).mode == "u-shape"
    with pytest.raises(ExecModeError, match="not available"):
        choose_mode(CHAT, "standard", _link("4g"), tail, override="split")


def test_u_shape_costs_the_downlink_and_the_tail():
    split, u = Deployment(u_shape=True), Deployment(u_shape=True, edge_tail_token_s=0.0, edge_tail_prefill_token_s=0.0)
    slow_down = LinkState(rtt_ms=60.0, up_kbps=6300.0, down_kbps=500.0)
    assert estimate_s("u-shape", CHAT, _link("4g"), split) > estimate_s("split", CHAT, _link("4g"), split)
    assert estimate_s("u-shape", CHAT, slow_down, u) > estimate_s("u-shape", CHAT, _link("4g"), u)
    # no cloud prefix cache in u-shape: cached prompt tokens still cost their rows up and down
    cached = RequestShape(prompt_tokens=900, max_tokens=40, cached_tokens=640)
    assert (estimate_s("u-shape", AGENT, _link("4g"), u) - estimate_s("u-shape", cached, _link("4g"), u)
            < estimate_s("split", AGENT, _link("4g"), u) - estimate_s("split", cached, _link("4g"), u))


def test_link_down_keeps_the_request_on_the_phone():
    down = LinkState(connected=False)
    assert choose_mode(CHAT, "standard", down, EVERYTHING).mode == "edge-only"
    with pytest.raises(ExecModeError, match="link is down"):
        choose_mode(CHAT, "standard", down, Deployment(all_cloud=True))
    with pytest.raises(ExecModeError, match="not available"):
        choose_mode(CHAT, "standard", down, EVERYTHING, override="split")


def test_slow_uplink_moves_a_long_prompt_off_the_split():
    # 3G: 900 hidden rows of 8 KB up take minutes; raw text is a few KB
    assert choose_mode(AGENT, "standard", _link("3g-poor"), EVERYTHING).mode != "split"
    assert choose_mode(CHAT, "standard", _link("wifi"), Deployment()).mode == "split"


def test_bad_names_are_refused():
    with pytest.raises(ExecModeError, match="privacy"):
        choose_mode(CHAT, "secret")
    with pytest.raises(ExecModeError, match="mode"):
        choose_mode(CHAT, "standard", override="cloud")


def test_secret_prefix_keys_cannot_be_recomputed_without_the_secret():
    ids = list(range(100, 164))
    scope = KeyScope("b", "int8", "fp16")
    plain = block_keys(ids, scope, 16)
    keyed = block_keys(ids, KeyScope("b", "int8", "fp16", secret=b"s" * 32), 16)
    other = block_keys(ids, KeyScope("b", "int8", "fp16", secret=b"t" * 32), 16)
    assert len(keyed) == 4 and not set(keyed) & set(plain) and not set(keyed) & set(other)
    assert keyed == block_keys(ids, KeyScope("b", "int8", "fp16", secret=b"s" * 32), 16)  # same tenant: shared
    with pytest.raises(ValueError, match="16 bytes"):
        KeyScope("b", "int8", "fp16", secret=b"short").seed()
