"""Hypothesis strategies for every protocol message (valid values across their whole legal ranges)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from shared import protocol as P
from shared.messages import MAX_POSITION, MAX_TOKEN_ID
from shared.plan import COMPUTE_VARIANTS

IDENT_CHARS = "abcXYZ019._:-"
ident = st.text(IDENT_CHARS, min_size=1, max_size=64)
long_ident = st.text(IDENT_CHARS, min_size=1, max_size=128)
pos = st.integers(0, MAX_POSITION)
token = st.integers(0, MAX_TOKEN_ID)
small_text = st.text(max_size=64)
codec_name = st.sampled_from(["fp16", "bf16", "int8-b32", "int8-b64", "int4-b32", "int8-outlier", "int4-outlier"])


def finite(lo, hi):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


hints = st.builds(P.ClientHints, link_kbps=st.none() | finite(0, 1e9), rtt_ms=st.none() | finite(0, 1e7),
                  device_class=st.text(IDENT_CHARS, min_size=1, max_size=32),
                  edge_quant=st.none() | st.sampled_from(["fp32", "int8", "int4"]),
                  threads=st.none() | st.integers(1, 4096), client=small_text)
limits = st.builds(P.SessionLimits, max_frame_bytes=st.integers(1024, 1 << 30), max_context=st.integers(1, 1 << 20),
                   max_prefill_chunk_tokens=st.integers(1, 4096), max_concurrent_requests=st.integers(1, 64),
                   prefix_block_tokens=st.integers(1, 256), idle_timeout_ms=st.integers(0, 10**9),
                   resume_window_ms=st.integers(0, 10**9), max_prompt_tokens=st.integers(0, 1 << 20))
plan = st.builds(P.PrecisionPlan, codec=codec_name, compute=st.sampled_from(COMPUTE_VARIANTS),
                 reason=st.text(max_size=40))
server = st.builds(P.ServerInfo, name=small_text, version=small_text,
                   compute_variants=st.lists(st.sampled_from(COMPUTE_VARIANTS), max_size=4, unique=True),
                   load=finite(0, 1), max_draft_tokens=st.integers(0, 32), cloud_drafts=st.integers(0, 32))
sampling = st.builds(P.SamplingParams, max_tokens=st.integers(1, 1 << 20), temperature=finite(0, 100),
                     top_p=finite(1e-9, 1), top_k=st.integers(0, 1 << 20), seed=st.none() | st.integers(0, 2**63 - 1),
                     stop_token_ids=st.lists(token, max_size=8), ignore_eos=st.booleans(), logprobs=st.booleans(),
                     top_logprobs=st.integers(0, 20), presence_penalty=finite(-2, 2), frequency_penalty=finite(-2, 2),
                     repetition_penalty=finite(1e-3, 10))


@st.composite
def encoded(draw, rows=None):
    s = draw(st.integers(1, 6)) if rows is None else rows
    h = draw(st.integers(1, 40))
    data = draw(st.binary(max_size=64))
    return P.EncodedTensor(codec=draw(codec_name), shape=(s, h), data=data, zstd=False)


@st.composite
def rope(draw, n):
    if not draw(st.booleans()):
        return None
    return P.WireArray.from_numpy(np.asarray(draw(st.lists(st.integers(0, 2**31 - 1), min_size=3 * n,
                                                            max_size=3 * n)), np.int32).reshape(3, n))


@st.composite
def prefill(draw):
    hidden = draw(encoded())
    return P.Prefill(request_id=draw(ident), start=draw(st.integers(0, 1 << 30)), hidden=hidden,
                     last=draw(st.booleans()), params=draw(st.none() | sampling),
                     prefix_keys=draw(st.lists(long_ident, max_size=4)),
                     compute=draw(st.none() | st.sampled_from(COMPUTE_VARIANTS)),
                     rope_positions=draw(rope(hidden.shape[0])), return_states=draw(st.booleans()))


@st.composite
def states_step(draw):
    hidden = draw(encoded(rows=draw(st.integers(1, 9))))
    return P.StatesStep(request_id=draw(ident), position=draw(st.integers(0, 1 << 30)), hidden=hidden,
                        rope_positions=draw(rope(hidden.shape[0])))


@st.composite
def states(draw):
    return P.States(request_id=draw(ident), start=draw(st.integers(0, 1 << 30)), hidden=draw(encoded()),
                    timings=draw(st.none() | st.builds(P.ServerTimings, total_ms=finite(0, 1e9))),
                    plan=draw(st.none() | plan))


@st.composite
def decode_step(draw):
    return P.DecodeStep(request_id=draw(ident), position=draw(pos), hidden=draw(encoded(rows=1)),
                        rope_positions=draw(rope(1)), ask_drafts=draw(st.integers(0, 32)))


@st.composite
def spec_step(draw):
    drafts = draw(st.lists(token, min_size=1, max_size=8))
    return P.SpecStep(request_id=draw(ident), position=draw(st.integers(0, 1 << 30)),
                      hidden=draw(encoded(rows=len(drafts) + 1)), draft_ids=drafts,
                      rope_positions=draw(rope(len(drafts) + 1)), ask_drafts=draw(st.integers(0, 32)))


@st.composite
def tokens(draw):
    ids = draw(st.lists(token, min_size=0, max_size=6))
    lps = draw(st.none() | st.lists(finite(-1e4, 0), min_size=len(ids), max_size=len(ids)))
    tops = draw(st.none() | st.lists(st.lists(st.builds(P.TopLogprob, token_id=token, logprob=finite(-1e4, 0)),
                                              max_size=3), min_size=len(ids), max_size=len(ids)))
    return P.Tokens(request_id=draw(ident), index=draw(pos), token_ids=ids, logprobs=lps, top_logprobs=tops,
                    finish_reason=draw(st.none() | st.sampled_from(P.FINISH_REASONS)),
                    usage=draw(st.none() | st.builds(P.Usage, prompt_tokens=pos, completion_tokens=pos,
                                                     cached_tokens=pos)),
                    timings=draw(st.none() | st.builds(P.ServerTimings, queue_ms=finite(0, 1e9),
                                                       compute_ms=finite(0, 1e9), total_ms=finite(0, 1e9))),
                    plan=draw(st.none() | plan), draft_ids=draw(st.none() | st.lists(token, max_size=32)))


messages = st.one_of(
    st.builds(P.Hello, bundle_id=long_ident, codecs=st.lists(codec_name, max_size=7), hints=hints,
              resume_token=st.none() | long_ident),
    st.builds(P.Welcome, session_id=ident, resume_token=long_ident, resumed=st.booleans(), limits=limits, plan=plan,
              codecs=st.lists(codec_name, max_size=7), server=server, cached_prefixes=st.lists(long_ident, max_size=3),
              requests=st.lists(st.builds(P.RequestState, request_id=ident, received=pos, tokens=pos), max_size=3)),
    prefill(),
    decode_step(),
    spec_step(),
    states_step(),
    states(),
    tokens(),
    st.builds(P.Cancel, request_id=ident),
    st.builds(P.Resume, request_id=ident, have_tokens=pos),
    st.builds(P.Resumed, request_id=ident, received=pos, index=pos, token_ids=st.lists(token, max_size=5),
              finish_reason=st.none() | st.sampled_from(P.FINISH_REASONS)),
    st.builds(P.Error, code=st.sampled_from(P.PROTOCOL_ERROR_CODES + P.SESSION_ERROR_CODES),
              message=st.text(max_size=80), request_id=st.none() | ident, fatal=st.booleans(),
              retry_after_ms=st.none() | pos),
    st.builds(P.Drain, grace_ms=pos, reason=small_text),
    st.builds(P.Close, reason=small_text),
)
