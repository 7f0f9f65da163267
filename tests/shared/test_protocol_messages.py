"""shared.messages / shared.wire: every message round-trips; validation refuses out-of-range fields."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from protocol_strategies import messages

from shared import protocol as P


@settings(max_examples=400, deadline=None)
@given(messages)
def test_every_message_round_trips(msg):
    frame = P.encode_message(msg)
    back = P.decode_message(frame)
    assert type(back) is type(msg)
    assert back == msg
    assert P.encode_message(back) == frame  # canonical: decode . encode is the identity on frames


def test_every_message_type_is_covered():
    assert {cls.__name__ for cls in P.MESSAGE_TYPES.values()} == {
        "Hello", "Welcome", "Prefill", "DecodeStep", "SpecStep", "StatesStep", "States", "Tokens", "Cancel", "Resume", "Resumed", "Error",
        "Drain", "Close"}
    assert len(set(P.MESSAGE_TYPES)) == len(P.MESSAGE_TYPES)


def test_frame_layout_is_type_then_fields():
    assert msgpack.unpackb(P.encode_message(P.Cancel(request_id="r1"))) == [6, "r1"]
    assert msgpack.unpackb(P.encode_message(P.Resume(request_id="r1", have_tokens=3))) == [7, "r1", 3]


def test_trailing_optional_fields_may_be_omitted_and_extra_fields_are_ignored():
    # an older peer omits trailing optional fields; a newer one appends fields we do not know
    assert P.decode_message(msgpack.packb([8, "overloaded"])) == P.Error(code="overloaded")
    msg = P.decode_message(msgpack.packb([6, "r1", "from-the-future", 42]))
    assert msg == P.Cancel(request_id="r1")


def test_a_welcome_from_a_server_before_server_prefix_cache_says_its_prefix_cache_is_on():
    """``ServerInfo.prefix_cache`` is a trailing field: an older server's Welcome (its ServerInfo ending at
    ``cloud_drafts``) decodes as a server that keeps a prefix cache, the edge's behaviour before the field."""
    fields = msgpack.unpackb(P.encode_message(P.Welcome(session_id="s", resume_token="t",
                                                        server=P.ServerInfo(prefix_cache=False))))
    assert fields[8][-1] is False  # [type, protocol_version, ..., server (field 7), ...]
    fields[8] = fields[8][:-1]
    assert P.decode_message(msgpack.packb(fields)).server.prefix_cache is True


def test_missing_required_field_is_bad_type():
    with pytest.raises(P.ProtocolError) as e:
        P.decode_message(msgpack.packb([7, "r1"]))  # Resume without have_tokens
    assert e.value.code == "bad_type"


def test_hello_hints_accept_a_dict_and_check_its_keys():
    h = P.Hello(bundle_id="b", codecs=["fp16"], hints={"edge_quant": "int8", "threads": 4})
    assert h.hints == P.ClientHints(edge_quant="int8", threads=4)
    with pytest.raises(P.ProtocolError):
        P.Hello(bundle_id="b", codecs=["fp16"], hints={"api_key": "secret"})  # auth is never a field


def test_other_major_version_is_refused_with_version_code():
    frame = msgpack.packb([1, P.PROTOCOL_VERSION + 1, "bundle", ["fp16"]])
    with pytest.raises(P.ProtocolError) as e:
        P.decode_message(frame)
    assert e.value.code == "version"


def test_welcome_convenience_properties():
    w = P.Welcome(session_id="s", resume_token="t", limits=P.SessionLimits(max_frame_bytes=4096, prefix_block_tokens=32))
    assert (w.max_frame_bytes, w.block_size) == (4096, 32)


@pytest.mark.parametrize("make", [
    lambda: P.SamplingParams(top_p=0.0),
    lambda: P.SamplingParams(temperature=-1.0),
    lambda: P.SamplingParams(temperature=float("nan")),
    lambda: P.SamplingParams(max_tokens=0),
    lambda: P.SamplingParams(top_logprobs=21),
    lambda: P.SamplingParams(stop_token_ids=[-1]),
    lambda: P.Cancel(request_id=""),
    lambda: P.Cancel(request_id="has space"),
    lambda: P.Cancel(request_id="x" * 65),
    lambda: P.Resume(request_id="r", have_tokens=-1),
    lambda: P.Tokens(request_id="r", index=0, token_ids=[1], logprobs=[0.0, 0.0]),
    lambda: P.Tokens(request_id="r", index=0, token_ids=[1], finish_reason="done"),
    lambda: P.Tokens(request_id="r", index=0, token_ids=[1], logprobs=[float("-inf")]),
    lambda: P.DecodeStep(request_id="r", position=0, hidden=P.EncodedTensor(codec="fp16", shape=(2, 4), data=b"")),
    lambda: P.Prefill(request_id="r", start=0, hidden=P.EncodedTensor(codec="fp16", shape=(0, 4), data=b"")),
    lambda: P.Prefill(request_id="r", start=0, hidden=P.EncodedTensor(codec="fp16", shape=(1, 4), data=b""),
                      compute="fp8"),
    lambda: P.EncodedTensor(codec="fp16", shape=(4,), data=b""),
    lambda: P.EncodedTensor(codec="fp16", shape=(1 << 20, 1 << 20), data=b""),
    lambda: P.WireArray("float64", (1,), b"\x00" * 8),
    lambda: P.WireArray("int32", (2, 3), b"\x00" * 23),
    lambda: P.PrecisionPlan(codec="fp16", compute="int4"),
    lambda: P.ServerInfo(load=1.5),
    lambda: P.ServerInfo(cloud_drafts=33),
    lambda: P.DecodeStep(request_id="r", position=0, hidden=P.EncodedTensor(codec="fp16", shape=(1, 4), data=b""),
                         ask_drafts=-1),
    lambda: P.DecodeStep(request_id="r", position=0, hidden=P.EncodedTensor(codec="fp16", shape=(1, 4), data=b""),
                         ask_drafts=33),
    lambda: P.Tokens(request_id="r", index=0, token_ids=[1], draft_ids=[1] * 33),
    lambda: P.Tokens(request_id="r", index=0, token_ids=[1], draft_ids=[-4]),
    lambda: P.SessionLimits(max_frame_bytes=10),
])
def test_out_of_range_values_are_refused(make):
    with pytest.raises(P.ProtocolError) as e:
        make()
    assert e.value.code in P.PROTOCOL_ERROR_CODES


def test_error_message_is_cut_not_refused():
    assert len(P.Error(code="internal", message="x" * 5000).message) == 1024


def test_encode_checks_the_frame_limit():
    t = P.EncodedTensor(codec="fp16", shape=(1000, 8), data=bytes(16000))
    msg = P.Prefill(request_id="r", start=0, hidden=t)
    with pytest.raises(P.ProtocolError) as e:
        P.encode_message(msg, max_frame_bytes=8000)
    assert e.value.code == "too_large"
    with pytest.raises(TypeError):
        P.encode_message({"not": "a message"})


def test_to_dict_is_json_friendly():
    import json

    t = P.EncodedTensor(codec="fp16", shape=(1, 2), data=b"\x00" * 4)
    d = P.to_dict(P.DecodeStep(request_id="r", position=3, hidden=t))
    assert d["type"] == "DecodeStep" and d["hidden"]["data"] == "<4 bytes>"
    json.dumps(d)


def test_the_documented_sampling_ranges_are_the_ones_the_wire_checks():
    """docs/protocol.md's SamplingParams gave top_p (0, 1], top_k >= 0 and max_tokens >= 1 where the decoder takes
    [1e-9, 1], [0, 2^24] and [1, 2^31 - 1]: a doc-only client's top_p 1e-12 or top_k 2^30 was a fatal bad_value
    that ended its session. Each documented bound is accepted and the next value past it refused."""
    import re
    from pathlib import Path

    doc = " ".join((Path(__file__).parents[2] / "docs" / "protocol.md").read_text().split())

    def bounds(field: str, kind: str) -> tuple[float, float]:
        m = re.search(rf"{field}: {kind}\[([^,\]]+), ([^\]]+)\]", doc)
        assert m, f"{field}: no documented range {kind}[lo, hi]"
        return tuple(eval(v.replace("^", "**"), {}) for v in m.groups())  # numbers like 1e-9, 2^31 - 1

    lo, hi = bounds("top_p", "float")
    P.SamplingParams(top_p=lo), P.SamplingParams(top_p=hi)
    for bad in (lo / 2, 1.0000001):
        with pytest.raises(P.ProtocolError):
            P.SamplingParams(top_p=bad)
    for field in ("top_k", "max_tokens"):
        lo, hi = bounds(field, "int")
        P.SamplingParams(**{field: lo}), P.SamplingParams(**{field: hi})
        for bad in (lo - 1, hi + 1):
            with pytest.raises(P.ProtocolError):
                P.SamplingParams(**{field: bad})


def test_the_documented_hint_ranges_are_the_ones_the_wire_checks():
    """docs/protocol.md's ClientHints gave link_kbps and rtt_ms as any float; the decoder takes [0, 1e9] and
    [0, 1e7], and a Hello outside them is a fatal bad_value (no session at all)."""
    import re
    from pathlib import Path

    doc = " ".join((Path(__file__).parents[2] / "docs" / "protocol.md").read_text().split())
    for field in ("link_kbps", "rtt_ms"):
        m = re.search(rf"{field}: float\[([^,\]]+), ([^\]]+)\]\|nil", doc)
        assert m, f"{field}: no documented range float[lo, hi]|nil"
        lo, hi = (float(v) for v in m.groups())
        P.ClientHints(**{field: lo}), P.ClientHints(**{field: hi})
        for bad in (-1.0, hi * 1.5):
            with pytest.raises(P.ProtocolError):
                P.ClientHints(**{field: bad})
