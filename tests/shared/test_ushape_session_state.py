"""shared.session_state on u-shape requests (``Prefill.return_states``): States answer every span, a StatesStep
stands only once every position was returned, may roll the server's positions back to the prompt's end at the
earliest, carries at most ``max_draft_tokens + 1`` rows; DecodeStep and SpecStep are refused, and a Resume
claims no more positions than were returned (the rest: test_ushape_resume_rules.py)."""

from __future__ import annotations

import numpy as np
import pytest

from shared import codecs as C
from shared import protocol as P
from shared.session_state import SessionError, SessionState

FP16 = C.get_codec("fp16")


def _hidden(n):
    return FP16.encode(np.ones((n, 8), np.float32))


def _open(max_draft_tokens=4, prompt=5) -> tuple[SessionState, object]:
    s = SessionState()
    s.on_client(P.Hello(bundle_id="b", codecs=["fp16"]))
    s.on_server(P.Welcome(session_id="s", resume_token="t", codecs=["fp16"],
                          server=P.ServerInfo(max_draft_tokens=max_draft_tokens)))
    track = s.on_client(P.Prefill(request_id="r", start=0, hidden=_hidden(prompt), params=P.SamplingParams(),
                                  return_states=True))
    return s, track


def _step(position, n=1):
    return P.StatesStep(request_id="r", position=position, hidden=_hidden(n))


def _refused(s, msg, code):
    with pytest.raises(SessionError) as e:
        s.on_client(msg)
    assert e.value.code == code and not e.value.fatal


def test_states_answer_spans_and_steps_follow_them():
    s, track = _open()
    assert track.states and track.answered == 0
    _refused(s, _step(5), "bad_state")  # nothing returned yet
    s.on_server(P.States(request_id="r", start=0, hidden=_hidden(3)))
    _refused(s, _step(5), "bad_state")  # positions 3, 4 not returned yet
    s.on_server(P.States(request_id="r", start=3, hidden=_hidden(2)))
    assert s.on_client(_step(5, 3)) is track and track.received == 8  # a speculative step: 3 rows
    _refused(s, _step(8), "bad_state")  # one step in flight
    s.on_server(P.States(request_id="r", start=5, hidden=_hidden(3)))
    s.on_client(_step(6, 2))  # one draft kept: the server drops [6, 8) and takes two new rows
    assert track.received == 8 and track.answered == 6


def test_rollback_stays_within_the_generated_positions_and_rows_within_the_cap():
    s, track = _open(max_draft_tokens=2)
    s.on_server(P.States(request_id="r", start=0, hidden=_hidden(5)))
    _refused(s, _step(4), "bad_position")  # into the prompt
    s, track = _open(max_draft_tokens=2)
    s.on_server(P.States(request_id="r", start=0, hidden=_hidden(5)))
    _refused(s, _step(6), "bad_position")  # skips a position
    s, track = _open(max_draft_tokens=2)
    s.on_server(P.States(request_id="r", start=0, hidden=_hidden(5)))
    _refused(s, _step(5, 4), "too_large")


def test_sampling_messages_and_resume_are_refused_and_cancel_ends_it():
    s, track = _open()
    s.on_server(P.States(request_id="r", start=0, hidden=_hidden(5)))
    _refused(s, P.DecodeStep(request_id="r", position=5, hidden=_hidden(1)), "bad_state")
    s, track = _open()
    s.on_server(P.States(request_id="r", start=0, hidden=_hidden(5)))
    _refused(s, P.SpecStep(request_id="r", position=5, hidden=_hidden(2), draft_ids=[3]), "bad_state")
    s, track = _open()
    _refused(s, P.Resume(request_id="r", have_tokens=1), "bad_position")  # no States returned yet
    s, track = _open()
    assert s.on_client(P.Cancel(request_id="r")) is track
    s.on_server(P.Tokens(request_id="r", index=0, token_ids=[], finish_reason="cancelled"))
    assert track.finish == "cancelled" and not s.requests
    assert s.on_client(_step(5)) is None  # crossed the end in flight: ignored


def test_a_plain_request_takes_no_states_step_and_a_u_shape_one_starts_at_zero():
    s = SessionState()
    s.on_client(P.Hello(bundle_id="b", codecs=["fp16"]))
    s.on_server(P.Welcome(session_id="s", resume_token="t", codecs=["fp16"]))
    s.on_client(P.Prefill(request_id="r", start=0, hidden=_hidden(5), params=P.SamplingParams()))
    s.on_server(P.Tokens(request_id="r", index=0, token_ids=[9]))
    _refused(s, _step(5), "bad_state")
    _refused(s, P.Prefill(request_id="q", start=16, hidden=_hidden(2), params=P.SamplingParams(),
                          prefix_keys=["k0"], return_states=True), "bad_position")
