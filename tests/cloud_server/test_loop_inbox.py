"""LoopInbox: items from another thread reach the loop in order, with one wakeup per burst."""

from __future__ import annotations

import asyncio
import threading

from cloud_server.loop_inbox import LoopInbox


def test_a_burst_from_another_thread_is_handled_in_order_with_one_wakeup():
    async def main():
        loop = asyncio.get_running_loop()
        got, threads, wakeups = [], set(), []
        inbox = LoopInbox(loop, lambda x: (got.append(x), threads.add(threading.current_thread())))
        original = loop.call_soon_threadsafe

        def counting(*args):
            wakeups.append(args)
            return original(*args)

        loop.call_soon_threadsafe = counting
        worker = threading.Thread(target=lambda: [inbox.put(i) for i in range(100)])
        worker.start()
        worker.join()  # the whole burst is queued before the loop runs again
        await asyncio.sleep(0.01)
        later = threading.Thread(target=inbox.put, args=(100,))  # a later item wakes the loop again
        later.start()
        later.join()
        await asyncio.sleep(0.01)
        inbox.put(101)  # one put on the loop itself: handled without a wakeup (no self-pipe write)
        await asyncio.sleep(0.01)
        return got, threads, len(wakeups)

    got, threads, wakeups = asyncio.run(main())
    assert got == list(range(102))
    assert threads == {threading.main_thread()}
    assert wakeups == 2


def test_a_failing_handler_is_logged_and_the_rest_are_still_handled(caplog):
    async def main():
        got = []

        def handle(x):
            if x == 1:
                raise RuntimeError("boom")
            got.append(x)

        inbox = LoopInbox(asyncio.get_running_loop(), handle)
        for i in range(3):
            inbox.put(i)
        await asyncio.sleep(0.01)
        return got

    assert asyncio.run(main()) == [0, 2]
    assert "inbox handler failed" in caplog.text
