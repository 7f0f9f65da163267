"""The committed golden frames (tests/shared/golden/): our encoder produces exactly those bytes, our decoder
turns them back into the same messages, and frames.json describes them; every message type has one. codecs.json's
codec payloads are our encoder's and decoder's."""

from __future__ import annotations

import json

import pytest

from shared import protocol as P

from golden_frames import CODEC_NAMES, CODEC_ROWS, GOLDEN, GOLDEN_DIR, codec_vector, describe

RECORDS = {r["file"].removesuffix(".bin"): r for r in json.loads((GOLDEN_DIR / "frames.json").read_text())["frames"]}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_encoder_produces_the_committed_bytes(name):
    assert P.encode_message(GOLDEN[name]) == (GOLDEN_DIR / f"{name}.bin").read_bytes()


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_decoder_accepts_the_committed_bytes(name):
    msg = P.decode_message((GOLDEN_DIR / f"{name}.bin").read_bytes())
    assert msg == GOLDEN[name]


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_the_json_description_matches(name):
    assert RECORDS[name] == describe(name, GOLDEN[name])


def test_every_message_type_has_a_golden_frame():
    assert {m.TYPE for m in GOLDEN.values()} == set(P.MESSAGE_TYPES)
    assert set(RECORDS) == set(GOLDEN)
    assert json.loads((GOLDEN_DIR / "frames.json").read_text())["protocol_version"] == P.PROTOCOL_VERSION


def test_the_documented_example_is_a_golden_frame():
    assert GOLDEN["cancel"] == P.Cancel(request_id="r1")
    assert (GOLDEN_DIR / "cancel.bin").read_bytes() == bytes.fromhex("9206a27231")  # docs/protocol.md, Framing


CODEC_VECTORS = {v["codec"]: v for v in json.loads((GOLDEN_DIR / "codecs.json").read_text())["vectors"]}


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_the_codec_vectors_are_our_encoders_and_decoders(codec):
    """codecs.json: the payload our encoder writes for CODEC_ROWS and what it decodes to (docs/protocol.md)."""
    v = CODEC_VECTORS[codec]
    assert bytes.fromhex(v["input_f32le"]) == CODEC_ROWS.astype("<f4").tobytes()
    assert v == codec_vector(codec)
    assert set(CODEC_VECTORS) == set(CODEC_NAMES)
