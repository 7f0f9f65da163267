"""An EdgeClient's lifecycle as an app uses it beyond one thread: a client inherited by a forked process (a
multiprocessing worker) must fail at once with a clear error, never wait forever, and leave the parent's client
serving."""

from __future__ import annotations

import multiprocessing
import time

import pytest

PROMPT = [1, 2, 3, 4, 5]


def _use_in_child(client, conn) -> None:
    """In the forked child: each call's outcome (its error code, or 'ok'), and how long close() took."""
    outcomes = []
    for call in (lambda: list(client.generate(prompt_ids=PROMPT, max_tokens=4)), client.connect,
                 lambda: client.agenerate(prompt_ids=PROMPT, max_tokens=4, loop=object())):
        try:
            call()
            outcomes.append("ok")
        except Exception as e:  # noqa: BLE001 - the outcome is the test's
            outcomes.append(getattr(e, "code", type(e).__name__))
    t0 = time.monotonic()
    client.close()
    conn.send((outcomes, time.monotonic() - t0))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork on this platform")
def test_a_client_inherited_by_a_forked_process_fails_forked_at_once_and_the_parents_serves_on(tiny_bundle,
                                                                                              tiny_cloud):
    """A forked child inherits the client but not its event loop thread (threads do not survive a fork): its
    requests were handed to a loop nobody runs and waited for ever, its close() for 5 s. They now fail as
    ``forked`` at once, the child's close() touches nothing of the parent's, whose client answers as before."""
    from edge_client import EdgeClient

    with EdgeClient(tiny_bundle, tiny_cloud.ws_url) as client:
        before = client.complete(prompt_ids=PROMPT, max_tokens=8).token_ids
        ctx = multiprocessing.get_context("fork")
        parent_end, child_end = ctx.Pipe()
        child = ctx.Process(target=_use_in_child, args=(client, child_end))
        child.start()
        child.join(20.0)
        hung = child.is_alive()
        if hung:
            child.kill()
            child.join()
        assert not hung and parent_end.poll(), "the forked child's calls waited for ever"
        outcomes, close_s = parent_end.recv()
        assert outcomes == ["forked"] * 3 and close_s < 1.0
        assert client.complete(prompt_ids=PROMPT, max_tokens=8).token_ids == before
