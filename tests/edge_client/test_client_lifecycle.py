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


def _sessions_open(cloud) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{cloud.http_url}/metrics", timeout=10) as r:
        line = next(x for x in r.read().decode().splitlines() if x.startswith("autoglm:sessions_open"))
    return float(line.rsplit(" ", 1)[1])


def test_a_client_dropped_unclosed_ends_its_thread_and_its_cloud_session(tiny_bundle, tiny_cloud):
    """An app that drops its client without close() (one per request, a closure that lost it) kept its loop thread,
    WebSocket and the server's session (with its flock on the bundle) until the process ended: four dropped
    clients, four threads and four sessions open on the cloud. A collected client now stops them, one dropped
    mid-stream (the last reference leaves on its own loop thread) and an auto-updating one too."""
    import gc
    import threading

    from edge_client import EdgeClient

    def loops() -> int:
        return sum(t.name == "autoglm-edge-loop" for t in threading.enumerate())

    before_threads, before_sessions = loops(), _sessions_open(tiny_cloud)
    for auto_update in (False, True):
        EdgeClient(tiny_bundle, tiny_cloud.ws_url, auto_update=auto_update).complete(prompt_ids=PROMPT, max_tokens=4)
    gen = EdgeClient(tiny_bundle, tiny_cloud.ws_url).generate(prompt_ids=PROMPT, max_tokens=3000)
    next(gen)
    del gen
    deadline = time.monotonic() + 10.0
    while (loops(), _sessions_open(tiny_cloud)) != (before_threads, before_sessions) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    assert (loops(), _sessions_open(tiny_cloud)) == (before_threads, before_sessions)


def test_closing_a_generation_from_another_task_or_thread_ends_the_loop_reading_it():
    """A UI's stop button calling ``gen.close()`` / ``await agen.aclose()`` while another thread or task reads the
    deltas: both wait on the stream, and when the closing side took its end the reader waited for ever (1 in 10 on a
    real autoglm-cloud serve). The end now stays queued for every reader. The interleaving is made exact here: the
    reader takes a token, then waits behind the closer, which takes the end."""
    import asyncio
    import queue
    import threading

    from edge_client.client import AsyncGeneration, Generation
    from edge_client.request import RequestSpec

    async def async_case() -> str | None:
        agen = AsyncGeneration(object(), RequestSpec(prompt_ids=PROMPT), asyncio.Queue())
        reader = asyncio.create_task(agen.__anext__())
        await asyncio.sleep(0.05)  # the reader waits on the stream first
        closer = asyncio.create_task(agen.aclose())
        await asyncio.sleep(0.05)  # and the closer behind it
        agen._q.put_nowait(("token", 7, ""))  # the reader's: no text yet, it waits again - behind the closer
        await asyncio.sleep(0.05)
        agen._q.put_nowait(("end", "cancelled"))  # the closer's
        await asyncio.wait_for(closer, 5.0)
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(reader, 5.0)
        return agen.finish_reason

    assert asyncio.run(async_case()) == "cancelled"

    gen = Generation(object(), RequestSpec(prompt_ids=PROMPT), queue.Queue())
    reader = threading.Thread(target=lambda: list(gen), daemon=True)
    reader.start()
    time.sleep(0.05)
    closer = threading.Thread(target=gen.close, daemon=True)
    closer.start()
    time.sleep(0.05)
    gen._q.put(("token", 7, ""))
    time.sleep(0.05)
    gen._q.put(("end", "cancelled"))
    closer.join(5.0)
    reader.join(5.0)
    assert not reader.is_alive() and gen.finish_reason == "cancelled"
