"""A fatal ``Error`` from a real cloud ends the edge client's session: it closes its WebSocket and refuses further
use with a clear error; a request-level (non-fatal) Error fails that request only and the session serves on."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.client import EdgeClient
from edge_client.config import RetryPolicy
from edge_client.errors import EdgeClientError
from shared import protocol as P

PROMPT = [int(t) for t in np.random.RandomState(7).randint(4, 512, 20)]
RETRY = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=60.0, max_retries=3, backoff_initial_s=0.1,
                    backoff_max_s=0.5)


def _break_first_step(client: EdgeClient, frame_for) -> None:
    """The request's first decode step goes up as ``frame_for(step)`` instead (past the edge's own rule check)."""
    session, send = client.session, client.session._send
    armed = [True]

    async def patched(msg):
        if isinstance(msg, P.DecodeStep) and armed[0]:
            armed[0] = False
            return await session.link.send_frame(frame_for(msg))
        return await send(msg)

    session._send = patched


def _generate(client: EdgeClient) -> list[int]:
    return [t for t, _ in client.generate(prompt_ids=PROMPT, max_tokens=8, temperature=0.0).iter_tokens()]


def test_a_fatal_error_closes_the_session_and_a_request_level_one_does_not(tiny_bundle, tiny_cloud):
    """The client got the fatal Error, failed the request, and left its WebSocket open and its session in use: the
    next request went on over a session the cloud had ended. Now the link closes at once and the next request opens
    a new session (a long-running `autoglm-edge serve` must recover without a restart)."""
    with EdgeClient(tiny_bundle, tiny_cloud.ws_url, codec="fp16", retry=RETRY, draft_k=0) as c:
        c.connect()
        session_id = c.session.welcome.session_id
        # request-level: a decode step at a position the cloud does not hold fails that request only
        _break_first_step(c, lambda m: P.encode_message(P.DecodeStep(request_id=m.request_id,
                                                                     position=m.position + 5, hidden=m.hidden)))
        with pytest.raises(EdgeClientError) as e:
            _generate(c)
        assert e.value.code == "bad_position"
        assert c.connected and c.session.welcome.session_id == session_id
        assert len(_generate(c)) >= 1  # the same session serves on
        assert c.session.welcome.session_id == session_id
        # fatal: a frame that is no message; the cloud answers Error(bad_frame, fatal) and ends the session
        _break_first_step(c, lambda m: b"\xc1")
        with pytest.raises(EdgeClientError) as e:
            _generate(c)
        assert e.value.code == "bad_frame"
        assert not c.connected and c.session.link.ws is None  # the client closed its side at once
        # the next request opens a new session (the ended one is not resumed)
        assert len(_generate(c)) >= 1
        assert c.connected and c.session.welcome.session_id != session_id and not c.session.welcome.resumed
