"""StepPipeline: decode steps decoded off the loop in batches, every other action kept in arrival order."""

from __future__ import annotations

import asyncio
import threading

from cloud_server.engine.async_engine import EngineDeadError
from cloud_server.step_pipeline import StepPipeline


class Recorder:
    """decode / hand_over / actions that log what ran, in which order and on which thread."""

    def __init__(self, gate: threading.Event | None = None):
        self.log: list = []
        self.decode_threads: set[str] = set()
        self.dead: list = []
        self.gate = gate  # the worker's decode waits for it: a batch stays in flight while the test acts

    def decode(self, steps):
        self.decode_threads.add(threading.current_thread().name)
        if self.gate is not None:
            self.gate.wait(5)
        return [f"row-{s}" for s in steps]

    def hand_over(self, steps, rows):
        self.log.append(("steps", list(steps), list(rows)))

    def action(self, name):
        self.log.append(("action", name))

    def pipeline(self, pool_min_rows: int) -> StepPipeline:
        return StepPipeline(self.decode, self.hand_over, lambda first, e: self.dead.append((first, str(e))),
                            pool_min_rows)


async def _settle():
    for _ in range(50):
        await asyncio.sleep(0.01)


def test_a_turns_steps_are_decoded_together_on_the_loop_when_few():
    async def main():
        r = Recorder()
        p = r.pipeline(pool_min_rows=16)
        for i in range(3):
            p.hold(i)
        await _settle()
        return r

    r = asyncio.run(main())
    assert r.log == [("steps", [0, 1, 2], ["row-0", "row-1", "row-2"])]
    assert r.decode_threads == {"MainThread"}


def test_actions_wait_behind_a_batch_decoding_on_the_worker_and_later_steps_behind_them():
    gate = threading.Event()

    async def main():
        r = Recorder(gate)
        p = r.pipeline(pool_min_rows=2)
        p.hold("a1")
        p.hold("b1")
        await asyncio.sleep(0.01)  # the batch [a1, b1] is on the worker thread, held at the gate
        assert p.defer(r.action, "cancel-a") is True  # waits behind it
        p.hold("b2")  # after the cancel
        assert p.defer(r.action, "prefill-c") is True
        assert r.log == []
        gate.set()
        await _settle()
        assert p.defer(r.action, "later") is False  # nothing in flight: the caller goes on at once
        return r

    r = asyncio.run(main())
    assert r.log == [("steps", ["a1", "b1"], ["row-a1", "row-b1"]), ("action", "cancel-a"),
                     ("steps", ["b2"], ["row-b2"]), ("action", "prefill-c")]
    assert any(t.startswith("autoglm-step-decode") for t in r.decode_threads)


def test_a_deferred_action_that_finds_the_engine_stopped_is_reported_and_the_rest_still_run():
    gate = threading.Event()

    async def main():
        r = Recorder(gate)
        p = r.pipeline(pool_min_rows=1)

        def opening(session):
            raise EngineDeadError("engine stopped: boom")

        p.hold("s1")
        await asyncio.sleep(0.01)
        p.defer(opening, "session-1")
        p.defer(r.action, "after")
        gate.set()
        await _settle()
        return r

    r = asyncio.run(main())
    assert r.dead == [("session-1", "engine stopped: boom")]
    assert r.log[-1] == ("action", "after")


def test_a_nested_action_inside_a_handed_over_batch_runs_at_once():
    async def main():
        r = Recorder()
        p = None

        def hand_over(steps, rows):
            r.log.append(("steps", list(steps)))
            assert p.defer(r.action, "fail-inside") is False  # part of the batch's own handling
            r.action("fail-inside")

        p = StepPipeline(r.decode, hand_over, lambda *a: None, pool_min_rows=1)
        p.hold("x")
        await asyncio.sleep(0.01)
        p.hold("y")  # a later batch waits while nothing else does
        await _settle()
        return r

    r = asyncio.run(main())
    assert r.log == [("steps", ["x"]), ("action", "fail-inside"), ("steps", ["y"]), ("action", "fail-inside")]
