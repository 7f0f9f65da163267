"""One idle deadline per connection: ``on_idle`` runs once no frame has arrived for ``idle_s`` seconds.

Why not ``asyncio.wait_for(ws.receive(), idle_s)`` per frame: that creates a timer (and, before Python 3.12, a
task) for every frame, ~10 us of event-loop work per decode token at 64 sessions. Here a frame costs one
clock read (:meth:`IdleDeadline.touch`); the single timer is re-armed only when it fires early.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class IdleDeadline:
    """Calls ``on_idle()`` (on the event loop) ``idle_s`` seconds after the last :meth:`touch`, at most once.

    Create it on the running loop; :meth:`cancel` when the connection ends."""

    def __init__(self, idle_s: float, on_idle: Callable[[], None]):
        if not idle_s > 0:
            raise ValueError(f"idle_s must be positive, got {idle_s}")
        self._loop = asyncio.get_running_loop()
        self.idle_s = idle_s
        self._on_idle = on_idle
        self.last = self._loop.time()
        self.expired = False
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(self.last + idle_s, self._check)

    def touch(self) -> None:
        """A frame arrived: the deadline moves to ``idle_s`` from now."""
        self.last = self._loop.time()

    def _check(self) -> None:
        due = self.last + self.idle_s
        if self._loop.time() < due:  # touched since the timer was armed: wait for the new deadline
            self._timer = self._loop.call_at(due, self._check)
            return
        self._timer, self.expired = None, True
        self._on_idle()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
