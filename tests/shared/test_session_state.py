"""shared.session_state: the rulebook both ends run accepts a correct session, refuses misbehaviour, and ignores
what crosses in flight."""

from __future__ import annotations

import numpy as np
import pytest

from shared import codecs as C
from shared import protocol as P
from shared.session_state import CLOSED, DRAINING, READY, SessionError, SessionState

FP16 = C.get_codec("fp16")


def hidden(n):
    return FP16.encode(np.ones((n, 8), np.float32))


def ready(**limits) -> SessionState:
    s = SessionState()
    s.on_client(P.Hello(bundle_id="b", codecs=["fp16"]))
    s.on_server(P.Welcome(session_id="s", resume_token="t", codecs=["fp16"], limits=P.SessionLimits(**limits)))
    assert s.phase == READY
    return s


def refused(s, msg, code, frame_bytes=None):
    with pytest.raises(SessionError) as e:
        s.on_client(msg, frame_bytes)
    assert e.value.code == code
    err = e.value.to_error()
    assert isinstance(err, P.Error) and err.code == code
    return e.value


def prefill(rid="r1", start=0, n=4, last=True, params=True, keys=()):
    return P.Prefill(request_id=rid, start=start, hidden=hidden(n), last=last,
                     params=P.SamplingParams() if params else None, prefix_keys=list(keys))


def test_a_whole_request():
    s = ready()
    s.on_client(prefill(n=3, last=False))
    s.on_client(prefill(start=3, n=2, params=False))
    for i in range(3):
        s.on_server(P.Tokens(request_id="r1", index=i, token_ids=[5]))
        s.on_client(P.DecodeStep(request_id="r1", position=5 + i, hidden=hidden(1)))
    s.on_server(P.Tokens(request_id="r1", index=3, token_ids=[2], finish_reason="stop"))
    assert s.open_requests == 0
    assert s.on_client(P.Cancel(request_id="r1")) is None  # late cancel: ignored
    refused(s, prefill(), "duplicate_request")
    s.on_client(P.Close())
    assert s.phase == CLOSED
    assert refused(s, P.Cancel(request_id="r1"), "bad_state").fatal


def test_order_violations():
    s = SessionState()
    assert refused(s, prefill(), "bad_state").fatal  # before Hello
    s = ready()
    assert refused(s, P.Hello(bundle_id="b", codecs=[]), "bad_state").fatal
    refused(s, P.DecodeStep(request_id="r1", position=0, hidden=hidden(1)), "unknown_request")
    refused(s, prefill(params=False), "unknown_request")  # a continuation of nothing (opening needs params)
    s.on_client(prefill(rid="r0", n=4, last=False))
    refused(s, P.DecodeStep(request_id="r0", position=4, hidden=hidden(1)), "bad_state")  # prompt not complete
    s.on_client(prefill(n=4))
    refused(s, prefill(start=4, params=False), "bad_state")  # prompt already complete
    refused(s, prefill(start=4), "duplicate_request")  # params again on an open request
    refused(s, P.DecodeStep(request_id="r1", position=4, hidden=hidden(1)), "bad_state")  # no token yet
    s.on_server(P.Tokens(request_id="r1", index=0, token_ids=[7]))
    refused(s, P.DecodeStep(request_id="r1", position=5, hidden=hidden(1)), "bad_position")
    s.on_client(P.DecodeStep(request_id="r1", position=4, hidden=hidden(1)))
    refused(s, P.DecodeStep(request_id="r1", position=5, hidden=hidden(1)), "bad_state")  # one step per token


def test_a_later_chunk_that_changes_what_the_first_decided_is_bad_state():
    """return_states and prefix_keys are the first Prefill's (as params): a later chunk carrying them was accepted
    and silently ignored. Refused like other request-level violations: that request closes, the session serves on.
    prompt_len too."""
    s = ready()
    for rid, change in (("u", {"return_states": True}), ("k", {"prefix_keys": ["k0"]}), ("n", {"prompt_len": 6})):
        s.on_client(prefill(rid=rid, n=4, last=False))
        later = P.Prefill(request_id=rid, start=4, hidden=hidden(2), **change)
        e = refused(s, later, "bad_state")
        assert not e.fatal and e.request_id == rid and next(iter(change)) in e.message
        s.on_server(e.to_error())  # the server fails the request with this Error: it closes on both sides
        assert s.track(rid).finish == "error" and s.open_requests == 0
        assert s.on_client(P.Prefill(request_id=rid, start=4, hidden=hidden(2))) is None  # its late chunks: ignored
    s.on_client(prefill(rid="fine", n=4, last=False))
    s.on_client(P.Prefill(request_id="fine", start=4, hidden=hidden(2)))  # the defaults: accepted
    assert s.phase == READY and s.track("fine").prompt_len == 6


def test_positions_limits_and_codecs():
    s = ready(max_context=10, max_prefill_chunk_tokens=6, max_concurrent_requests=1, prefix_block_tokens=4)
    refused(s, prefill(rid="big", n=7), "too_large")
    refused(s, prefill(rid="nokeys", start=4, n=2), "bad_position")  # a prefix without keys
    refused(s, prefill(rid="big", n=1), "duplicate_request")  # a refused request's id stays used
    s.on_client(prefill(start=4, n=2, last=False, keys=["k1"]))  # prefix of one block
    refused(s, prefill(start=7, n=1, params=False), "bad_position")  # gap
    refused(s, prefill(start=6, n=5, params=False), "context_full")
    refused(s, prefill(rid="r2"), "overloaded")
    t = C.get_codec("bf16").encode(np.ones((1, 8), np.float32))
    refused(s, P.Prefill(request_id="r1", start=6, hidden=t), "codec_not_negotiated")


def test_a_prompt_over_max_prompt_tokens_is_prompt_too_long_and_generation_may_go_beyond():
    s = ready(max_context=20, max_prompt_tokens=8, max_prefill_chunk_tokens=10)
    refused(s, prefill(rid="one", n=9), "prompt_too_long")  # in its first Prefill
    s.on_client(prefill(rid="two", n=6, last=False))
    refused(s, prefill(rid="two", start=6, n=3, params=False), "prompt_too_long")  # the chunk that crosses it
    s.on_client(prefill(rid="ok", n=6, last=False))
    s.on_client(prefill(rid="ok", start=6, n=2, params=False))  # exactly max_prompt_tokens
    for i in range(4):  # the answer may run on past it, up to max_context
        s.on_server(P.Tokens(request_id="ok", index=i, token_ids=[5]))
        s.on_client(P.DecodeStep(request_id="ok", position=8 + i, hidden=hidden(1)))
    assert P.SessionLimits(max_context=20).prompt_limit == 20  # 0: max_context bounds the prompt
    assert P.SessionLimits(max_context=20, max_prompt_tokens=8).prompt_limit == 8


def test_a_prompt_ends_where_its_first_prefill_said_and_a_said_length_meets_the_limits_before_its_upload():
    """Prefill.prompt_len (the first Prefill's): the prompt's chunks reach no further, the last one reaches it; a
    length over max_context or max_prompt_tokens is refused at the first chunk, not when its chunk comes."""
    s = ready(max_context=20, max_prompt_tokens=12, max_prefill_chunk_tokens=10)

    def said(rid, n, length, last=False):
        return P.Prefill(request_id=rid, start=0, hidden=hidden(n), last=last, params=P.SamplingParams(),
                         prompt_len=length)

    refused(s, said("short", 4, 3), "bad_position")  # its first chunk already reaches past it
    refused(s, said("early", 4, 6, last=True), "bad_position")  # the prompt ends before it
    refused(s, said("ctx", 4, 21), "context_full")
    refused(s, said("long", 4, 13), "prompt_too_long")
    s.on_client(said("over", 4, 6))
    refused(s, prefill(rid="over", start=4, n=3, params=False), "bad_position")  # past it
    s.on_client(said("under", 4, 10))
    refused(s, prefill(rid="under", start=4, n=2, params=False), "bad_position")  # last, short of it
    refused(s, said("whole", 6, 6), "bad_position")  # reaches it without last: no chunk could follow
    s.on_client(said("open", 4, 10))
    refused(s, prefill(rid="open", start=4, n=6, last=False, params=False), "bad_position")  # likewise, later
    s.on_client(said("ok", 4, 10))
    s.on_client(prefill(rid="ok", start=4, n=2, last=False, params=False))
    s.on_client(prefill(rid="ok", start=6, n=4, params=False))
    assert s.track("ok").prompt_len == 10
    s.on_client(said("one", 5, 5, last=True))  # one chunk: it says what last says
    assert s.track("one").prompt_len == 5


def test_resume_and_reconnect():
    s = ready()
    s.on_client(prefill())
    s.on_server(P.Tokens(request_id="r1", index=0, token_ids=[1, 2]))
    s.reconnect()
    refused(s, P.Resume(request_id="r1", have_tokens=1), "bad_state")  # Hello first
    s.on_client(P.Hello(bundle_id="b", codecs=["fp16"], resume_token="t"))
    s.on_server(P.Welcome(session_id="s", resume_token="t", resumed=True, codecs=["fp16"]))
    assert s.on_client(P.Resume(request_id="r1", have_tokens=1)).tokens == 2
    refused(s, P.Resume(request_id="r1", have_tokens=3), "bad_position")
    refused(s, P.Resume(request_id="gone", have_tokens=0), "resume_failed")
    s.on_server(P.Resumed(request_id="r1", received=4, index=1, token_ids=[2]))
    s.on_client(P.DecodeStep(request_id="r1", position=4, hidden=hidden(1)))


def test_a_request_that_failed_while_the_link_was_down_is_resume_failed():
    """Its Error (a step timeout while the edge was away) went nowhere: Resume is resume_failed, so the edge
    replays it - the server answered Resumed(finish_reason='error') and the edge ended the answer there, silently
    cut short. One that finished normally meanwhile still resumes (its last tokens are resent)."""
    s = ready()
    s.on_client(prefill(rid="failed"))
    s.on_client(prefill(rid="done"))
    s.on_server(P.Tokens(request_id="failed", index=0, token_ids=[1]))
    s.on_server(P.Tokens(request_id="done", index=0, token_ids=[1], finish_reason="length"))
    s.on_server(P.Error(code="timeout", request_id="failed"))
    s.reconnect()
    s.on_client(P.Hello(bundle_id="b", codecs=["fp16"], resume_token="t"))
    s.on_server(P.Welcome(session_id="s", resume_token="t", resumed=True, codecs=["fp16"]))
    refused(s, P.Resume(request_id="failed", have_tokens=1), "resume_failed")
    assert s.on_client(P.Resume(request_id="done", have_tokens=0)).finish == "length"


def test_a_resume_of_a_request_dropped_for_load_asks_the_wait_its_error_asked():
    """Dropped for load while the link was down (``overloaded``, ``retry_after_ms``): its Resume's refusal said
    resume_failed alone, and the edge replayed at once into the same full pool; it carries the wait now."""
    s = ready()
    s.on_client(prefill(rid="dropped"))
    s.on_server(P.Error(code="overloaded", message="the KV pool is exhausted", request_id="dropped",
                        retry_after_ms=1000))
    s.reconnect()
    s.on_client(P.Hello(bundle_id="b", codecs=["fp16"], resume_token="t"))
    s.on_server(P.Welcome(session_id="s", resume_token="t", resumed=True, codecs=["fp16"]))
    with pytest.raises(SessionError) as ei:
        s.on_client(P.Resume(request_id="dropped", have_tokens=0))
    error = ei.value.to_error()
    assert (error.code, error.retry_after_ms, error.request_id) == ("resume_failed", 1000, "dropped")
    assert "overloaded" in error.message


def test_drain_errors_and_cancel():
    s = ready()
    s.on_client(prefill())
    assert s.on_client(P.Cancel(request_id="r1")).cancelled
    s.on_server(P.Drain(grace_ms=100))
    assert s.phase == DRAINING
    refused(s, prefill(rid="r2"), "draining")
    s.on_server(P.Error(code="internal", request_id="r1"))
    assert s.open_requests == 0
    s.on_server(P.Error(code="internal", fatal=True))
    assert s.phase == CLOSED


def test_frames_over_the_limit_fail_their_request_only():
    s = ready(max_frame_bytes=2048)
    e = refused(s, prefill(), "too_large", frame_bytes=4096)
    assert not e.fatal and e.request_id == "r1"
    s.on_client(prefill(rid="r2"))  # the session goes on
    assert s.on_client(prefill(rid="r1", start=4, params=False)) is None  # late chunk of the refused one
    assert refused(s, P.Close(), "too_large", frame_bytes=4096).fatal  # no request to blame


def test_late_messages_of_a_finished_request_are_ignored():
    s = ready()
    s.on_client(prefill(n=2, last=False))
    s.on_server(P.Error(code="prefix_miss", request_id="r1"))  # the server closed it; the client still sends
    assert s.on_client(prefill(start=2, n=2, params=False)) is None
    assert s.on_client(P.DecodeStep(request_id="r1", position=4, hidden=hidden(1))) is None
    assert s.on_client(P.Cancel(request_id="r1")) is None
    refused(s, prefill(), "duplicate_request")  # but the id stays used


def test_resumed_resyncs_positions_after_a_lost_link():
    s = ready(max_prefill_chunk_tokens=4)
    s.on_client(prefill(n=4, last=False))
    s.on_client(prefill(start=4, n=2, params=False))  # the last chunk: sent, but lost with the link
    s.reconnect()
    s.on_client(P.Hello(bundle_id="b", codecs=["fp16"], resume_token="t"))
    s.on_server(P.Welcome(session_id="s", resume_token="t", resumed=True, codecs=["fp16"]))
    s.on_client(P.Resume(request_id="r1", have_tokens=0))
    s.on_server(P.Resumed(request_id="r1", received=4, index=0))
    s.on_client(prefill(start=4, n=2, params=False))  # resent: allowed again
    s.on_server(P.Tokens(request_id="r1", index=0, token_ids=[3], finish_reason="stop"))
    track = s.on_client(P.Resume(request_id="r1", have_tokens=0))  # finished, still resumable (kept track)
    assert track.finish == "stop" and track.tokens == 1


def test_close_finishes_open_requests():
    s = ready()
    s.on_client(prefill())
    track = s.requests["r1"]
    s.close()
    assert track.finish == "cancelled" and s.open_requests == 0 and s.phase == CLOSED
