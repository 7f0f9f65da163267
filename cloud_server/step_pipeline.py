"""Decode steps' states decoded off the event loop, every other action of the translator kept in arrival order.

At 64 sessions a step's 64 coded ``[1, H]`` states cost the event loop most of its time per token in numpy
(codec decode). :class:`StepPipeline` holds the ``DecodeStep``\\ s that arrive in one turn of the loop, decodes
them in one pass on a worker thread (numpy releases the GIL, so the loop goes on parsing frames meanwhile) and
hands them over on the loop. Small batches (fewer than ``pool_min_rows``, e.g. one session) are decoded on the
loop at once: the thread hop would add latency where the loop has time to spare.

Order: while a batch is decoding, the translator's other actions (a ``Prefill``, ``Cancel``, ``Resume``, a
failure) wait behind it (:meth:`defer`) and run, in the order they came, after it is handed over; steps that
arrive meanwhile form the next batch, after those actions. So a request's messages reach the engine in the
order the edge sent them, as when everything ran on the loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from cloud_server.engine.async_engine import EngineDeadError

log = logging.getLogger("autoglm.cloud.split")
POOL_MIN_ROWS = 16  # batches of at least this many steps are decoded on the worker thread


class StepPipeline:
    """``decode(steps) -> rows`` (one result per step; runs on the worker thread for large batches and must not
    raise), ``hand_over(steps, rows)`` on the loop; ``on_dead(first_arg, error)`` when a deferred action finds
    the engine stopped (the translator closes that session's link)."""

    def __init__(self, decode: Callable[[list], list], hand_over: Callable[[list, list], None],
                 on_dead: Callable[[object, EngineDeadError], None], pool_min_rows: int = POOL_MIN_ROWS):
        self._decode, self._hand_over, self._on_dead = decode, hand_over, on_dead
        self.pool_min_rows = pool_min_rows
        self._held: list = []  # this turn's steps, not yet started
        self._waiting: collections.deque = collections.deque()  # ("steps", list) | ("call", fn, args), in order
        self._busy = False  # a batch is decoding on the worker thread
        self._in_order = False  # running a handed-over batch or a deferred action: nested calls run at once
        self._flush_scheduled = False
        self._pool: ThreadPoolExecutor | None = None

    def hold(self, step) -> None:
        """A DecodeStep: started at the loop's next turn together with the others arriving in this one."""
        self._held.append(step)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Start the held steps now (behind a batch still decoding, and the actions waiting for it)."""
        self._flush_scheduled = False
        steps, self._held = self._held, []
        if not steps:
            return
        if self._busy or self._waiting:
            self._waiting.append(("steps", steps))
        else:
            self._start(steps)

    def defer(self, fn: Callable, *args) -> bool:
        """Called first by every other action: True if ``fn(*args)`` was queued behind held or decoding steps
        (it runs later, in order); False if the caller should go on now."""
        if self._in_order:
            return False
        self.flush()
        if self._busy or self._waiting:
            self._waiting.append(("call", fn, args))
            return True
        return False

    def _start(self, steps: list) -> None:
        if len(steps) < self.pool_min_rows:
            self._finish(steps, self._decode(steps))
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="autoglm-step-decode")
        self._busy = True
        loop = asyncio.get_running_loop()
        fut = self._pool.submit(self._decode, steps)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._decoded, steps, f))

    def _decoded(self, steps: list, fut: Future) -> None:
        self._busy = False
        try:
            self._finish(steps, fut.result())
        finally:
            self._pump()

    def _finish(self, steps: list, rows: list) -> None:
        self._in_order = True
        try:
            self._hand_over(steps, rows)
        finally:
            self._in_order = False

    def _pump(self) -> None:
        while self._waiting and not self._busy:
            item = self._waiting.popleft()
            if item[0] == "steps":
                self._start(item[1])
                continue
            _, fn, args = item
            self._in_order = True
            try:
                fn(*args)
            except EngineDeadError as e:
                self._on_dead(args[0], e)
            except Exception:  # as the loop would for a failed callback: log it, go on with the next
                log.exception("deferred %s failed", getattr(fn, "__name__", fn))
            finally:
                self._in_order = False
