"""An EdgeClient's lifecycle as an app uses it beyond one thread: a client or a generation inherited by a forked
process (a multiprocessing worker) must fail at once with a clear error, never wait forever, and leave the parent's
serving; an asyncio app closes its client (``async with``) without holding its event loop; an OpenAI client's
``base_url`` reaches the split endpoint."""

from __future__ import annotations

import multiprocessing
import time

import pytest

PROMPT = [1, 2, 3, 4, 5]


def _outcomes(*calls) -> list[str]:
    """Each call's outcome: its error's code (or type), or 'ok'."""
    outcomes = []
    for call in calls:
        try:
            call()
            outcomes.append("ok")
        except Exception as e:  # noqa: BLE001 - the outcome is the test's
            outcomes.append(getattr(e, "code", type(e).__name__))
    return outcomes


def _use_in_child(client, conn) -> None:
    """In the forked child: each call's outcome (its error code, or 'ok'), and how long close() took."""
    outcomes = _outcomes(lambda: list(client.generate(prompt_ids=PROMPT, max_tokens=4)), client.connect,
                         lambda: client.agenerate(prompt_ids=PROMPT, max_tokens=4, loop=object()))
    t0 = time.monotonic()
    client.close()
    conn.send((outcomes, time.monotonic() - t0))


def _in_forked_child(target, *args):
    """What ``target(*args, conn)`` sent over ``conn`` from a forked child; a child still running after 20 s (its
    calls waited for ever) fails the test."""
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=target, args=(*args, child_end))
    child.start()
    child.join(20.0)
    hung = child.is_alive()
    if hung:
        child.kill()
        child.join()
    assert not hung and parent_end.poll(), "the forked child's calls waited for ever"
    return parent_end.recv()


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork on this platform")
def test_a_client_inherited_by_a_forked_process_fails_forked_at_once_and_the_parents_serves_on(tiny_bundle,
                                                                                              tiny_cloud):
    """A forked child inherits the client but not its event loop thread (threads do not survive a fork): its
    requests were handed to a loop nobody runs and waited for ever, its close() for 5 s. They now fail as
    ``forked`` at once, the child's close() touches nothing of the parent's, whose client answers as before."""
    from edge_client import EdgeClient

    with EdgeClient(tiny_bundle, tiny_cloud.ws_url) as client:
        before = client.complete(prompt_ids=PROMPT, max_tokens=8).token_ids
        outcomes, close_s = _in_forked_child(_use_in_child, client)
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


def _read_in_child(gen, agen, conn) -> None:
    """In the forked child: the outcome of reading, iterating by token and cancelling each inherited generation
    (its error code, or 'ok'), and how long their close() took."""
    import asyncio

    outcomes = _outcomes(lambda: next(gen), lambda: next(gen.iter_tokens()), gen.cancel,
                         lambda: asyncio.run(agen.__anext__()), agen.cancel)
    t0 = time.monotonic()
    gen.close()
    asyncio.run(agen.aclose())
    conn.send((outcomes, time.monotonic() - t0))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork on this platform")
def test_a_generation_read_in_a_forked_process_fails_forked_at_once_and_the_parent_reads_it_whole(tiny_bundle,
                                                                                                 tiny_cloud):
    """A generation started before a fork and read in the child (a multiprocessing worker handed it) waited for ever:
    its stream is fed by the parent's loop thread, which the child has not (its close() waited 10 s). Reading it,
    by text or by token, sync or async, and cancelling it now fail ``forked`` at once, its close() does nothing,
    and the parent reads both generations to their end, the tokens of a run without a fork."""
    import asyncio

    from edge_client import EdgeClient

    with EdgeClient(tiny_bundle, tiny_cloud.ws_url) as client:
        reference = client.complete(prompt_ids=PROMPT, max_tokens=12).token_ids
        loop = asyncio.new_event_loop()
        gen = client.generate(prompt_ids=PROMPT, max_tokens=12)
        next(gen)
        agen = client.agenerate(prompt_ids=PROMPT, max_tokens=12, loop=loop)
        outcomes, close_s = _in_forked_child(_read_in_child, gen, agen)
        assert outcomes == ["forked"] * 5 and close_s < 1.0
        list(gen)

        async def read_all() -> None:
            async for _ in agen:
                pass
        loop.run_until_complete(read_all())
        loop.close()
        assert gen.token_ids == agen.token_ids == reference


def test_an_asyncio_app_closes_its_client_with_async_with_and_its_loop_runs_meanwhile(tiny_bundle, tiny_cloud):
    """``async with EdgeClient(...)`` was a TypeError: an asyncio app called the blocking close() on its own event
    loop, which then served nothing else until the server's goodbye came. ``__aexit__`` / ``aclose()`` close on a
    worker thread: here the close waits for a flag that only another task of the app's loop sets, so a close on
    the loop would never end. The client is closed as close() closes it: its generation still open ends
    ``closed``, its loop thread and its cloud session end; a second aclose() is a no-op."""
    import asyncio
    import threading

    from edge_client import EdgeClient, EdgeClientError

    before = _sessions_open(tiny_cloud)

    async def app() -> tuple[EdgeClient, object]:
        loop_ran = threading.Event()
        async with EdgeClient(tiny_bundle, tiny_cloud.ws_url) as client:
            real_close = client.close

            def close_after_the_loop_ran() -> None:
                assert loop_ran.wait(30.0), "close() held the app's event loop"
                real_close()
            client.close = close_after_the_loop_ran
            agen = client.agenerate(prompt_ids=PROMPT, max_tokens=3000)
            await agen.__anext__()
            asyncio.get_running_loop().call_later(0.05, loop_ran.set)
        with pytest.raises(EdgeClientError) as e:
            async for _ in agen:
                pass
        assert e.value.code == "closed"
        await client.aclose()
        return client

    client = asyncio.run(app())
    assert client._closed and not client._thread.is_alive()
    deadline = time.monotonic() + 10.0
    while _sessions_open(tiny_cloud) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _sessions_open(tiny_cloud) == before


def test_every_close_returns_once_the_client_is_closed_and_one_on_its_loop_thread_at_once(tiny_bundle, tiny_cloud):
    """Two threads closing one client at once: the second close() returned while the first still ended the cloud
    session, the loop thread alive - a caller that closes, then checks (or exits, or forks) met a client still
    open. The interleaving is made exact: the first close() is held in the session's goodbye while a thread's
    close(), an asyncio app's aclose() and a callback on the client's own loop thread close too. The thread and the
    app return only once the client is closed (loop thread ended, session closed, the cloud's too); the callback, which
    that thread's end waits for, at once (no deadlock), and so does a callback's close() that is the first."""
    import asyncio
    import threading

    from edge_client import EdgeClient

    before = _sessions_open(tiny_cloud)
    client = EdgeClient(tiny_bundle, tiny_cloud.ws_url)
    client.connect()
    entered, gate = threading.Event(), threading.Event()
    goodbye = client.session.close

    async def held_goodbye() -> None:
        entered.set()
        await asyncio.to_thread(gate.wait, 10.0)
        await goodbye()
    client.session.close = held_goodbye
    seen: dict[str, object] = {}

    def closed_then_seen(name: str, close) -> None:
        close()
        seen[name] = (client._thread.is_alive(), client.connected)

    first = threading.Thread(target=client.close)
    first.start()
    assert entered.wait(10.0)
    closers = [threading.Thread(target=closed_then_seen, args=("thread", client.close)),
               threading.Thread(target=closed_then_seen, args=("aclose", lambda: asyncio.run(client.aclose())))]
    for t in closers:
        t.start()
    on_loop = threading.Event()
    client._loop.call_soon_threadsafe(lambda: (client.close(), on_loop.set()))
    assert on_loop.wait(5.0), "close() on the client's loop thread waited for that thread"
    time.sleep(0.3)
    held = {name: name in seen for name in ("thread", "aclose")}
    gate.set()
    for t in (first, *closers):
        t.join(30.0)
    assert held == {"thread": False, "aclose": False}, f"returned while the first close() was running: {seen}"
    assert seen == {"thread": (False, False), "aclose": (False, False)}
    # the first close() on the loop thread returns at once (the loop stops after its turn); a close() elsewhere
    # then returns once it has
    client = EdgeClient(tiny_bundle, tiny_cloud.ws_url)
    client.connect()
    on_loop.clear()
    client._loop.call_soon_threadsafe(lambda: (client.close(), on_loop.set()))
    assert on_loop.wait(5.0)
    closed_then_seen("after the loop's", client.close)
    assert seen["after the loop's"] == (False, False)
    deadline = time.monotonic() + 10.0  # the server frees a session at the client's Close (the client waits 1 s)
    while _sessions_open(tiny_cloud) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _sessions_open(tiny_cloud) == before


def test_an_openai_base_url_is_the_split_endpoints(tiny_bundle, tiny_cloud):
    """An OpenAI user's ``base_url`` (``http://host:port/v1``) was a ConfigError; it is the same server's WebSocket
    (``ws://host:port/v1/split``), and the answer is the one the ws:// URL gets."""
    from edge_client import EdgeClient

    with EdgeClient(tiny_bundle, tiny_cloud.ws_url) as client:
        reference = client.complete(prompt_ids=PROMPT, max_tokens=8).token_ids
    with EdgeClient(tiny_bundle, f"{tiny_cloud.http_url}/v1") as client:
        assert client.config.url == tiny_cloud.ws_url
        assert client.complete(prompt_ids=PROMPT, max_tokens=8).token_ids == reference
