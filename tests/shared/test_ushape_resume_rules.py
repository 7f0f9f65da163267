"""shared.session_state on the Resume of a u-shape request: ``have_tokens`` counts the positions whose States the
client holds (at most ``answered``), ``Resumed(received=have)`` rolls both records back to it, no input stands
between the Resume and its Resumed, and a finished u-shape request is not resumed (the edge replays it)."""

from __future__ import annotations

import pytest
from test_ushape_session_state import _hidden, _step

from shared import protocol as P
from shared.session_state import SessionError, SessionState


def _ready(max_draft_tokens=4) -> SessionState:
    s = SessionState()
    s.on_client(P.Hello(bundle_id="b", codecs=["fp16"]))
    s.on_server(P.Welcome(session_id="s", resume_token="t", codecs=["fp16"],
                          server=P.ServerInfo(max_draft_tokens=max_draft_tokens)))
    return s


def _prefill(start, n, last=False, first=False):
    return P.Prefill(request_id="r", start=start, hidden=_hidden(n), last=last,
                     params=P.SamplingParams() if first else None, return_states=first)


def _states(start, n):
    return P.States(request_id="r", start=start, hidden=_hidden(n))


def _relink(s: SessionState) -> None:
    s.reconnect()
    s.on_client(P.Hello(bundle_id="b", codecs=["fp16"], resume_token="t"))
    s.on_server(P.Welcome(session_id="s", resume_token="t", resumed=True, codecs=["fp16"],
                          server=P.ServerInfo(max_draft_tokens=s.max_draft_tokens)))


def _refused(s, msg, code):
    with pytest.raises(SessionError) as e:
        s.on_client(msg)
    assert e.value.code == code and not e.value.fatal and e.value.request_id == msg.request_id


def _decoding() -> tuple[SessionState, object]:
    """A u-shape request with a prompt of 8 and two plain steps answered: received = answered = 10."""
    s = _ready()
    track = s.on_client(_prefill(0, 8, last=True, first=True))
    s.on_server(_states(0, 8))
    for pos in (8, 9):
        s.on_client(_step(pos))
        s.on_server(_states(pos, 1))
    assert track.received == track.answered == 10
    return s, track


def test_resume_claims_at_most_the_returned_positions():
    s, track = _decoding()
    s.on_client(_step(10))  # in flight when the link drops: received 11, answered 10
    _relink(s)
    _refused(s, P.Resume(request_id="r", have_tokens=11), "bad_position")  # its States never went out
    s, track = _decoding()
    _relink(s)
    assert s.on_client(P.Resume(request_id="r", have_tokens=10)) is track and track.resume_at == 10


def test_resumed_rolls_back_to_have_and_the_lost_step_stands_again():
    s, track = _decoding()
    s.on_client(_step(10))
    s.on_server(_states(10, 1))  # sent by the server, lost on the way down: the client holds 10 positions
    _relink(s)
    s.on_client(P.Resume(request_id="r", have_tokens=10))
    _refused(s, _step(10), "bad_state")  # no input before the Resumed (the server fails the request)
    _relink(s)
    s.on_client(P.Resume(request_id="r", have_tokens=10))  # again, as after another drop: allowed
    s.on_server(P.Resumed(request_id="r", received=10, index=0))
    assert (track.received, track.answered, track.resume_at, track.prompt_len, track.tokens) == (10, 10, None, 8, 0)
    assert s.on_client(_step(10)) is track and track.received == 11  # resent as first sent


def test_a_speculative_step_in_flight_is_resent_after_the_rollback():
    s, track = _decoding()
    s.on_client(_step(10, 4))  # the last token and 3 drafts
    s.on_server(_states(10, 4))  # lost on the way down
    _relink(s)
    s.on_client(P.Resume(request_id="r", have_tokens=10))
    s.on_server(P.Resumed(request_id="r", received=10, index=0))
    assert s.on_client(_step(10, 4)) is track and (track.received, track.answered) == (14, 10)
    s.on_server(_states(10, 4))
    s.on_client(_step(12))  # verdict: one draft kept; the next step rolls the rejected ones back as usual
    assert (track.received, track.answered) == (13, 12)


def test_mid_prompt_resume_reopens_the_prompt():
    s = _ready()
    track = s.on_client(_prefill(0, 4, first=True))
    s.on_client(_prefill(4, 4))
    s.on_client(_prefill(8, 4))
    s.on_server(_states(0, 4))
    s.on_server(_states(4, 4))  # lost on the way down; [8, 12) never arrived
    _relink(s)
    s.on_client(P.Resume(request_id="r", have_tokens=4))
    _refused(s, _prefill(12, 4), "bad_state")  # the upload goes on only after the Resumed
    s.on_server(P.Resumed(request_id="r", received=4, index=0))
    assert (track.received, track.answered, track.prompt_len) == (4, 4, None)
    _refused(s, _prefill(8, 4), "bad_position")  # resent from 4, not from where it was
    s = _ready()
    track = s.on_client(_prefill(0, 4, first=True))
    s.on_client(_prefill(4, 4, last=True))  # the prompt's last chunk went out: its States did not come back
    s.on_server(_states(0, 4))
    _relink(s)
    s.on_client(P.Resume(request_id="r", have_tokens=4))
    s.on_server(P.Resumed(request_id="r", received=4, index=0))
    assert track.prompt_len is None  # the last chunk is resent (and ends the prompt again)
    s.on_client(_prefill(4, 4, last=True))
    assert (track.received, track.prompt_len) == (8, 8)
    s.on_server(_states(4, 4))
    s.on_client(_step(8))


def test_finished_or_unknown_u_shape_requests_are_replayed():
    s, track = _decoding()
    s.on_server(P.Error(code="timeout", request_id="r"))
    _relink(s)
    _refused(s, P.Resume(request_id="r", have_tokens=10), "resume_failed")  # finished: its KV is gone
    _refused(s, P.Resume(request_id="other", have_tokens=0), "resume_failed")


def test_split_requests_keep_their_rules():
    s = _ready()
    s.on_client(P.Prefill(request_id="q", start=0, hidden=_hidden(4), last=True, params=P.SamplingParams()))
    s.on_server(P.Tokens(request_id="q", index=0, token_ids=[5]))
    _relink(s)
    track = s.on_client(P.Resume(request_id="q", have_tokens=1))
    assert track.resume_at is None and not track.states
    s.on_server(P.Resumed(request_id="q", received=4, index=1))
    assert (track.received, track.answered, track.tokens) == (4, 0, 1)
    s.on_client(P.DecodeStep(request_id="q", position=4, hidden=_hidden(1)))
