"""Hand items from another thread to an event loop with one wakeup per burst, not one per item.

The engine thread delivers a step's outputs (one per decoding session) one after another. Passing each with
``loop.call_soon_threadsafe`` costs a self-pipe write and a loop callback per token; :class:`LoopInbox` queues
them and schedules one drain for all that arrive before the loop gets to it. Items are handled on the loop's
thread in the order they were put; one that fails is logged and the rest are still handled.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

log = logging.getLogger("autoglm.cloud")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class LoopInbox:
    """``put`` from any thread; ``handle(item)`` runs on ``loop``'s thread, in order, for every item."""

    def __init__(self, loop: asyncio.AbstractEventLoop, handle: Callable[[object], None]):
        self.loop = loop
        self._handle = handle
        self._items: collections.deque = collections.deque()
        self._scheduled = False

    def put(self, item) -> None:
        """Queue ``item`` (any thread); wakes the loop only if no drain is pending. Raises ``RuntimeError`` once
        the loop is closed."""
        self._items.append(item)  # before the check: a drain that resets the flag afterwards still sees it
        if not self._scheduled:
            self._scheduled = True
            if _running_loop() is self.loop:  # put on the loop itself (the engine link's frames): no wakeup
                self.loop.call_soon(self._drain)
            else:
                self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self._scheduled = False  # before emptying: an item put from now on schedules the next drain
        items, handle = self._items, self._handle
        while items:
            try:
                handle(items.popleft())
            except Exception:  # as the loop would for a failed callback: log it, go on with the next
                log.exception("event-loop inbox handler failed")
