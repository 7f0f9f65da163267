"""shared.precision: the default policy's tiers, overrides, availability fallbacks; a pure function."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import codecs as C
from shared.precision import (
    CALIBRATION_FREE_CODECS,
    COMPUTE_VARIANTS,
    PrecisionError,
    PrecisionOverride,
    PrecisionPlan,
    PrecisionPolicy,
    RequestFeatures,
    choose_precision,
    step_codec,
)

ALL = C.CODEC_NAMES


def plan(tokens, **kw):
    codecs = kw.pop("codecs", ALL)
    compute = kw.pop("compute", COMPUTE_VARIANTS)
    override = kw.pop("override", None)
    return choose_precision(RequestFeatures(prompt_tokens=tokens, **kw), override, codecs, compute)


def test_text_tiers():
    assert (plan(50).codec, plan(50).compute) == ("int8-outlier", "fp16")  # short, idle server
    assert plan(50, server_load=0.9).compute == "int8"  # short, busy server
    assert plan(300, server_load=0.9).compute == "fp16"
    assert plan(50, server_load=0.5).compute == "fp16"  # int8 only when busy
    assert plan(1024).compute == "fp16" and plan(1025).compute == "bf16"
    assert plan(5000, server_load=0.9).compute == "bf16"


def test_the_load_never_moves_a_request_that_pinned_its_precision_to_int8():
    """A busy server's int8 compute is for requests that left their precision to the policy: a client pinning the
    lossless fp32 codec for the unsplit model's answers (docs/edge.md: precision={"codec": "fp32"} or
    EdgeConfig.codec; the edge's bare "fp16" on a CPU server names the codec only) got int8 weights under load."""
    for override in ("fp32", {"codec": "fp32"}, PrecisionOverride(codec="fp16"), "int8-b32"):
        p = plan(50, override=override, server_load=1.0, compute=("fp32", "int8"))
        assert p.compute == "fp32" and "load" not in p.reason
    for nothing in (None, {}, PrecisionOverride()):  # nothing pinned: the policy's
        assert plan(50, override=nothing, server_load=1.0, compute=("fp32", "int8")).compute == "int8"
    assert plan(50, override="int8", compute=("fp32", "int8")).compute == "int8"  # pinned int8 stays int8


def test_multimodal_uses_calibration_free_codec_and_bf16():
    p = plan(50, images=1, server_load=1.0)
    assert (p.codec, p.compute) == ("int8-b32", "bf16")
    assert plan(10, audio=1).compute == "bf16"


def test_slow_link_uses_the_compact_codec():
    # 2000 tokens x 4096 x 1.02 B x 8 bit = 67 Mbit: 6.7 s at 10 Mbit/s, 0.07 s at 1 Gbit/s
    assert plan(2000, link_kbps=10_000).codec == "int4-outlier"
    assert plan(2000, link_kbps=1_000_000).codec == "int8-outlier"
    assert plan(2000).codec == "int8-outlier"  # no hint: near-lossless
    assert "slow link" in plan(2000, link_kbps=10_000).reason


def test_without_calibration_defaults_are_calibration_free():
    p = choose_precision(RequestFeatures(prompt_tokens=100))
    assert p.codec in CALIBRATION_FREE_CODECS and p.codec == "int8-b32"
    assert plan(2000, link_kbps=1, codecs=CALIBRATION_FREE_CODECS).codec == "int8-b32"  # no compact codec


def test_availability_fallbacks():
    assert plan(50, compute=("bf16",), server_load=1.0).compute == "bf16"
    assert plan(50, compute=("fp32", "int8")).compute == "fp32"
    assert plan(50, codecs=("bf16",)).codec == "bf16"
    with pytest.raises(PrecisionError):
        plan(50, codecs=())


@pytest.mark.parametrize("override, codec, compute", [
    ("int4-outlier", "int4-outlier", "fp16"),
    ("int8", "int8-outlier", "int8"),
    ("bf16", "bf16", "bf16"),  # a name that is both a codec and a compute variant sets both
    ({"compute": "fp32"}, "int8-outlier", "fp32"),
    (PrecisionOverride(codec="fp16"), "fp16", "fp16"),
    (PrecisionPlan(codec="int8-b64", compute="bf16"), "int8-b64", "bf16"),
])
def test_overrides(override, codec, compute):
    p = plan(50, override=override)
    assert (p.codec, p.compute) == (codec, compute) and "override" in p.reason


@pytest.mark.parametrize("override", ["fp8", {"codec": "x"}, {"colour": "red"}, 3])
def test_bad_overrides(override):
    with pytest.raises(PrecisionError):
        plan(50, override=override)


def test_unavailable_override_is_refused_not_ignored():
    with pytest.raises(PrecisionError):
        plan(50, override="int4-outlier", codecs=CALIBRATION_FREE_CODECS)
    with pytest.raises(PrecisionError):
        plan(50, override="int8", compute=("bf16",))


def test_bad_features_and_policies():
    for kw in ({"prompt_tokens": -1}, {"prompt_tokens": 1, "server_load": 2.0}, {"prompt_tokens": 1, "link_kbps": 0}):
        with pytest.raises(ValueError):
            RequestFeatures(**kw)
    with pytest.raises(ValueError):
        PrecisionPolicy(short_prompt_tokens=600, long_prompt_tokens=512)
    assert plan(600, compute=COMPUTE_VARIANTS).compute == "fp16"
    with pytest.raises(ValueError):
        PrecisionPolicy(compact_codec="int2")


def steps(tokens, **kw):
    codecs = kw.get("codecs", ALL)
    policy = kw.pop("policy", DEFAULT)
    p = choose_precision(RequestFeatures(prompt_tokens=tokens, link_kbps=kw.get("link_kbps")), kw.get("override"),
                         codecs, COMPUTE_VARIANTS, policy)
    return p, step_codec(p, kw.get("override"), codecs, policy)


DEFAULT = PrecisionPolicy()


def test_decode_steps_travel_lossless_while_the_prompt_keeps_the_plan_codec():
    p, s = steps(50)
    assert (p.codec, s) == ("int8-outlier", "fp16") and "steps fp16" in p.reason
    p, s = steps(50, codecs=("int8-outlier", "int8-b32"))  # no fp16 negotiated: the prompt's codec
    assert s == p.codec == "int8-outlier" and "steps" not in p.reason
    p, s = steps(50, policy=PrecisionPolicy(step_codecs=()))
    assert s == p.codec == "int8-outlier"


def test_a_pinned_codec_or_a_slow_link_keeps_one_codec_for_every_message():
    assert steps(50, override="int8-b32")[1] == "int8-b32"
    assert steps(50, override={"compute": "fp32"})[1] == "fp16"  # a compute override leaves the codec to the policy
    p, s = steps(2000, link_kbps=10_000)
    assert p.codec == s == "int4-outlier"
    with pytest.raises(ValueError):
        PrecisionPolicy(step_codecs=("fp8",))


@settings(max_examples=300, deadline=None)
@given(tokens=st.integers(0, 1 << 20), images=st.integers(0, 3), audio=st.integers(0, 2),
       link=st.none() | st.floats(1, 1e7), load=st.floats(0, 1),
       codecs=st.lists(st.sampled_from(ALL), min_size=1, unique=True),
       compute=st.lists(st.sampled_from(COMPUTE_VARIANTS), min_size=1, unique=True))
def test_always_a_valid_available_plan(tokens, images, audio, link, load, codecs, compute):
    f = RequestFeatures(prompt_tokens=tokens, images=images, audio=audio, link_kbps=link, server_load=load)
    p = choose_precision(f, None, codecs, compute)
    assert p.codec in codecs and p.compute in compute
    assert p == choose_precision(f, None, codecs, compute)  # pure
    assert step_codec(p, None, codecs) in codecs


def test_small_text_prompts_travel_lossless():
    # 56 tokens x 576 x 2 B = 63 KiB <= 64 KiB; 57 tokens do not fit; at H = 4096 only 8 tokens do
    assert plan(56, hidden_size=576).codec == "fp16" and "lossless" in plan(56, hidden_size=576).reason
    assert plan(57, hidden_size=576).codec == "int8-outlier"
    assert plan(8).codec == "fp16" and plan(9).codec == "int8-outlier"
    assert plan(0).codec == "int8-outlier"  # a session's default plan (no prompt yet) stays near-lossless
    assert plan(10, hidden_size=576, images=1).codec == "int8-b32"  # multimodal keeps its calibration-free codec
    assert plan(10, hidden_size=576, override="int8-outlier").codec == "int8-outlier"  # a pinned codec wins
    assert plan(10, hidden_size=576, codecs=("int8-outlier", "int8-b32")).codec == "int8-outlier"  # no fp16 here
    off = PrecisionPolicy(lossless_codecs=())
    got = choose_precision(RequestFeatures(prompt_tokens=10, hidden_size=576), None, ALL, COMPUTE_VARIANTS, off)
    assert got.codec == "int8-outlier"
    p, s = steps(4)  # 32 KiB at H = 4096: the prompt and its decode steps both in fp16
    assert p.codec == s == "fp16"
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            PrecisionPolicy(lossless_prompt_kib=bad)


def test_every_codec_has_a_nominal_size_for_upload_estimates():
    from shared.precision import NOMINAL_BYTES_PER_ELEMENT

    assert set(ALL) <= set(NOMINAL_BYTES_PER_ELEMENT)
