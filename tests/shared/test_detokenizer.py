"""shared.detokenizer: streamed text equals a full decode (multi-byte UTF-8, real SmolLM2 tokenizer), and the
work per token is bounded (linear in the output, not quadratic)."""

from __future__ import annotations

from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.detokenizer import MAX_CONTEXT, MAX_HELD, StreamDecoder

MULTIBYTE = [
    "你好世界！今天天气很好，我们去公园散步吧。人工智能正在改变手机的使用方式。",
    "Emoji 😀🎉👍🏽, a family 👨‍👩‍👧‍👦, flags 🇨🇳🇺🇸, sparkles ✨🔥 and 中文 mixed in.",
    "Ελληνικά, русский, العربية, हिन्दी, 日本語のテキスト, 한국어 텍스트 — accents: déjà vu, naïve, Zoë.",
]
NO_TEXT = 1000  # an id the byte decoder below gives no text (a hidden special token)


def _stream(decode, ids: list[int]) -> tuple[list[str], str]:
    d = StreamDecoder(decode)
    deltas = [d.push(i) for i in ids]
    return deltas, "".join(deltas) + d.flush()


class CountingDecode:
    """A decode callable that records how many ids each call was given."""

    def __init__(self, decode):
        self.decode, self.sizes = decode, []

    def __call__(self, ids):
        self.sizes.append(len(ids))
        return self.decode(ids)


def byte_decode(ids) -> str:
    """A byte-level tokenizer: id = byte; :data:`NO_TEXT` decodes to nothing."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def smol_decode(smollm2_lm):
    tok = smollm2_lm.tokenizer
    return tok, partial(tok.decode, skip_special_tokens=True)  # what cloud_server.full_api streams with


@pytest.mark.parametrize("text", MULTIBYTE, ids=["chinese", "emoji", "scripts"])
def test_smollm2_stream_equals_full_decode(smol_decode, text):
    tok, decode = smol_decode
    ids = tok(text, add_special_tokens=False).input_ids
    assert any(decode([i]).endswith("\ufffd") for i in ids)  # the text really splits characters
    deltas, out = _stream(decode, ids)
    assert out == decode(ids) == text
    assert all("\ufffd" not in x for x in deltas)  # never half a character mid-stream
    # special tokens decode to nothing here: the text around them still comes out whole
    eos = tok.eos_token_id
    mixed = [t for i in ids for t in ((i, eos) if i % 3 == 0 else (i,))]
    assert _stream(decode, mixed)[1] == decode(mixed) == text


@pytest.mark.parametrize("text", MULTIBYTE, ids=["chinese", "emoji", "scripts"])
def test_a_character_the_stream_ends_inside_is_dropped_not_written_as_ufffd(smol_decode, text):
    """max_tokens reached inside a character (its first byte-level tokens sampled, the rest never): the answer ended
    in U+FFFD, in its text and in a stream's last delta (`autoglm-cloud serve --full`, `autoglm-edge serve`, the
    EdgeClient: '😏😐😑😒\ufffd'). The complete characters come out, the cut one does not."""
    tok, decode = smol_decode
    ids = tok(text, add_special_tokens=False).input_ids
    cuts = [n for n in range(1, len(ids)) if decode(ids[:n]).endswith("\ufffd")]
    assert cuts  # the text really splits characters across tokens
    for n in cuts:
        deltas, out = _stream(decode, ids[:n])
        assert "\ufffd" not in out and all("\ufffd" not in d for d in deltas)
        assert out == decode(ids[:n]).rstrip("\ufffd") and text.startswith(out)


def test_smollm2_work_per_token_is_bounded(smol_decode):
    tok, decode = smol_decode
    ids = tok(" ".join(MULTIBYTE) * 40, add_special_tokens=False).input_ids
    n = len(ids)
    assert n > 2000
    counting = CountingDecode(decode)
    _, out = _stream(counting, ids)
    assert out == decode(ids)
    # two windows per token plus the flush, none longer than the bounds: O(n) ids decoded in all,
    # where re-decoding the whole output each token would be n * (n + 1) / 2
    assert len(counting.sizes) == 2 * n + 2
    assert max(counting.sizes) <= MAX_CONTEXT + MAX_HELD
    assert sum(counting.sizes) <= 2 * n * (MAX_CONTEXT + MAX_HELD)


def test_runs_without_text_and_invalid_bytes_keep_the_window_bounded():
    text = "héllo 世界 🎉"
    padded = [t for c in text for t in (*c.encode(), *[NO_TEXT] * 30)]  # long runs of hidden tokens
    counting = CountingDecode(byte_decode)
    deltas, out = _stream(counting, padded)
    assert out == text and max(counting.sizes) <= MAX_CONTEXT + MAX_HELD
    # a run of invalid bytes (continuation bytes with no start) is not held for ever
    junk = [0x80] * 50 + list(b"ok")
    deltas, out = _stream(byte_decode, junk)
    assert out == byte_decode(junk) and "".join(deltas[:MAX_HELD]) != ""
    # a character cut short at the end of the stream is dropped by flush(), not written as U+FFFD
    deltas, out = _stream(byte_decode, [*b"ok", 0xF0, 0x9F])
    assert deltas == ["o", "k", "", ""] and out == "ok"


PIECES = [*(c.encode() for c in "aé世🎉 "), b"\x80"]  # characters, and a byte no character starts with


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(PIECES), st.integers(0, 3 * MAX_HELD)), max_size=40))
def test_random_byte_streams_equal_a_full_decode(pieces):
    # one byte per token, each piece followed by a run of tokens without text; an invalid byte is held
    # until text follows it or the hold runs out, and never swallows the character after it (one still held at
    # the end is dropped: only U+FFFDs at the end may be missing)
    ids = [t for piece, gap in pieces for t in (*piece, *[NO_TEXT] * gap)]
    out, full = _stream(byte_decode, ids)[1], byte_decode(ids)
    assert full.startswith(out) and set(full[len(out):]) <= {"\ufffd"}


def test_decode_must_be_callable():
    with pytest.raises(TypeError, match="callable"):
        StreamDecoder(object())
