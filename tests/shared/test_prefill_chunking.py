"""shared.chunking: Prefill messages never exceed the negotiated frame and chunk limits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import codecs as C
from shared import protocol as P
from shared.chunking import prefill_messages

CODECS = C.available_codecs({"outlier_channels": [0, 7], "sink_threshold": 5.0})


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(CODECS)), s=st.integers(1, 300), h=st.integers(8, 96),
       frame=st.integers(2048, 40_000), chunk=st.integers(1, 200), sinks=st.booleans(), z=st.booleans(),
       start=st.integers(0, 1000))
def test_chunks_cover_the_prompt_within_limits(name, s, h, frame, chunk, sinks, z, start):
    rng = np.random.default_rng(s)
    x = rng.standard_normal((s, h)).astype(np.float32)
    if sinks:
        x[::2] *= 50  # many float16 sink rows: payloads near the worst case
    limits = P.SessionLimits(max_frame_bytes=frame, max_prefill_chunk_tokens=chunk)
    codec = CODECS[name]
    try:
        msgs = prefill_messages("r1", x, codec, limits, start=start, params=P.SamplingParams(),
                                prefix_keys=["k" * 64] * 3, zstd=z)
    except P.ProtocolError as e:  # only when a single token cannot fit
        assert e.code == "too_large"
        assert 2 * h + 200 > frame
        return
    pos = start
    for i, m in enumerate(msgs):
        assert len(P.encode_message(m)) <= frame
        assert m.start == pos and 1 <= m.n_tokens <= chunk
        assert (m.params is not None) == (i == 0) and bool(m.prefix_keys) == (i == 0)
        assert m.last == (i == len(msgs) - 1)
        pos += m.n_tokens
    assert pos == start + s
    back = np.concatenate([codec.decode(m.hidden) for m in msgs])
    assert np.array_equal(back, np.concatenate([codec.decode(codec.encode(x[i:i + 1])) for i in range(s)]))


def test_rope_positions_are_sliced_per_chunk():
    x = np.ones((10, 16), np.float32)
    rope = np.arange(30, dtype=np.int32).reshape(3, 10)
    msgs = prefill_messages("r", x, C.get_codec("fp16"), P.SessionLimits(max_prefill_chunk_tokens=4),
                            params=P.SamplingParams(), rope_positions=rope)
    assert [m.n_tokens for m in msgs] == [4, 4, 2]
    assert np.array_equal(np.concatenate([m.rope_positions.to_numpy() for m in msgs], axis=1), rope)


def test_the_prompts_length_goes_on_the_first_chunk_only():
    msgs = prefill_messages("r", np.ones((10, 16), np.float32), C.get_codec("fp16"),
                            P.SessionLimits(max_prefill_chunk_tokens=4), params=P.SamplingParams(), prompt_len=10)
    assert [m.prompt_len for m in msgs] == [10, None, None]


def test_not_last_leaves_the_request_open():
    msgs = prefill_messages("r", np.ones((5, 8), np.float32), C.get_codec("fp16"), P.SessionLimits(), last=False)
    assert not any(m.last for m in msgs)
    with pytest.raises(ValueError):
        prefill_messages("r", np.ones((0, 8), np.float32), C.get_codec("fp16"), P.SessionLimits())


def test_chunks_stay_within_the_receivers_decoded_tensor_limit(monkeypatch):
    """A receiver refuses a tensor whose float32 states exceed its decoded-tensor limit (64 MiB by default), however
    few bytes it travels in, so chunks stop there too even when the server's chunk limit is larger."""
    import shared.chunking

    monkeypatch.setattr(shared.chunking, "DEFAULT_LIMITS", P.Limits(max_decoded_tensor_bytes=4 * 64 * 100))
    x = np.random.default_rng(0).standard_normal((250, 64)).astype(np.float32)
    codec = CODECS["int4-b32"]
    msgs = prefill_messages("r1", x, codec, P.SessionLimits(max_prefill_chunk_tokens=4096),
                            params=P.SamplingParams())
    assert [m.n_tokens for m in msgs] == [100, 100, 50]
    for m in msgs:
        codec.decode(m.hidden, shared.chunking.DEFAULT_LIMITS)
