"""shared.session_state on SpecStep: where it may stand, the server's cap on drafts, and how the verdict sets
the positions back (the rejected drafts' KV is gone on both sides)."""

from __future__ import annotations

import numpy as np
import pytest

from shared import codecs as C
from shared import protocol as P
from shared.session_state import SessionError, SessionState

FP16 = C.get_codec("fp16")


def _hidden(n):
    return FP16.encode(np.ones((n, 8), np.float32))


def _ready(max_draft_tokens=4) -> SessionState:
    s = SessionState()
    s.on_client(P.Hello(bundle_id="b", codecs=["fp16"]))
    s.on_server(P.Welcome(session_id="s", resume_token="t", codecs=["fp16"],
                          server=P.ServerInfo(max_draft_tokens=max_draft_tokens)))
    s.on_client(P.Prefill(request_id="r", start=0, hidden=_hidden(5), params=P.SamplingParams()))
    s.on_server(P.Tokens(request_id="r", index=0, token_ids=[9]))
    return s


def _spec(position, k):
    return P.SpecStep(request_id="r", position=position, hidden=_hidden(k + 1), draft_ids=[3] * k)


def _refused(s, msg, code):
    with pytest.raises(SessionError) as e:
        s.on_client(msg)
    assert e.value.code == code and not e.value.fatal


def test_verdict_sets_received_to_the_kept_positions():
    s = _ready()
    track = s.on_client(_spec(5, 3))
    assert track.received == 9 and track.spec_position == 5
    _refused(s, P.DecodeStep(request_id="r", position=9, hidden=_hidden(1)), "bad_state")  # one step in flight
    s.on_server(P.Tokens(request_id="r", index=1, token_ids=[3, 4]))  # one draft accepted, then the model's 4
    assert track.received == 7 and track.tokens == 3 and track.spec_position is None
    _refused(s, _spec(9, 1), "bad_position")  # the rejected drafts' positions are gone
    s.on_client(_spec(7, 2))
    s.on_server(P.Tokens(request_id="r", index=3, token_ids=[3, 3, 8]))  # all accepted
    assert track.received == 10 and track.tokens == 6
    s.on_client(P.DecodeStep(request_id="r", position=10, hidden=_hidden(1)))  # plain steps mix freely


def test_drafts_beyond_the_servers_cap_and_servers_without_speculation_are_refused():
    _refused(_ready(max_draft_tokens=2), _spec(5, 3), "too_large")
    _refused(_ready(max_draft_tokens=0), _spec(5, 1), "too_large")


def test_spec_step_rows_must_match_the_drafts():
    with pytest.raises(P.ProtocolError):
        P.SpecStep(request_id="r", position=5, hidden=_hidden(2), draft_ids=[1, 2])
    with pytest.raises(P.ProtocolError):
        P.SpecStep(request_id="r", position=5, hidden=_hidden(1), draft_ids=[])


def test_resumed_clears_the_step_in_flight():
    s = _ready()
    track = s.on_client(_spec(5, 3))
    s.reconnect()
    s.on_client(P.Hello(bundle_id="b", codecs=["fp16"], resume_token="t"))
    s.on_server(P.Welcome(session_id="s", resume_token="t", resumed=True, codecs=["fp16"],
                          server=P.ServerInfo(max_draft_tokens=4)))
    s.on_server(P.Resumed(request_id="r", received=5, index=1))  # the SpecStep never arrived
    assert track.received == 5 and track.spec_position is None
    s.on_client(_spec(5, 3))  # sent again
