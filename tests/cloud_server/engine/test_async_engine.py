"""The engine thread: commands in, outputs to sinks; idle timeouts; a runner failure is fatal for the engine."""

from __future__ import annotations

import queue
import time

import pytest
import torch

from cloud_server.config import EngineConfig
from cloud_server.engine.async_engine import AsyncEngine, EngineDeadError
from cloud_server.engine.llm_engine import LLMEngine
from cloud_server.engine.sampling_params import SamplingParams
from cloud_server.engine.sequence import InputChunk
from cloud_server.model import load_split_model


@pytest.fixture
def engine(tiny_bundle):
    eng = LLMEngine.from_models(EngineConfig(num_blocks=32, block_size=4), {"fp32": load_split_model(tiny_bundle, "fp32")})
    return eng


def _collect(q: queue.Queue, until, timeout=20.0):
    got = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got.append(q.get(timeout=0.1))
        except queue.Empty:
            continue
        if until(got):
            return got
    raise AssertionError(f"timed out; got {got}")


@pytest.mark.parametrize("as_one_command", [False, True])  # add_input per step, or add_inputs for all
def test_outputs_reach_their_sinks_and_decode_steps_come_back(engine, as_one_command):
    ae = AsyncEngine(engine).start()
    try:
        q: queue.Queue = queue.Queue()
        ae.add_request("a", q.put, InputChunk(0, hidden=torch.randn(5, 64)), SamplingParams(0.0, max_tokens=3,
                                                                                           ignore_eos=True))
        [first] = _collect(q, lambda g: len(g) == 1)
        assert first.token_id is not None and not first.finished
        steps = [("a", InputChunk(5, hidden=torch.randn(1, 64))),
                 ("a", InputChunk(6, hidden=torch.randn(1, 64))),  # arrives before it is due: still fine
                 ("nobody", InputChunk(0, hidden=torch.randn(1, 64)))]  # unknown: refused, the others go on
        if as_one_command:
            ae.add_inputs(steps)
        else:
            for rid, chunk in steps:
                ae.add_input(rid, chunk)
        rest = _collect(q, lambda g: g[-1].finished)
        assert [o.finish_reason for o in rest] == [None, "length"]
        assert ae.call(lambda e: e.num_used_blocks()).result(5) == 0
    finally:
        ae.shutdown()


def test_requests_waiting_too_long_for_input_are_aborted(engine):
    ae = AsyncEngine(engine, idle_timeout_s=0.3).start()
    try:
        q: queue.Queue = queue.Queue()
        ae.add_request("slow", q.put, InputChunk(0, hidden=torch.randn(3, 64)), SamplingParams(0.0, max_tokens=9))
        got = _collect(q, lambda g: g[-1].finished)
        assert got[-1].finish_reason == "timeout" and got[-1].error_code == "timeout"
        assert ae.call(lambda e: (len(e.seqs), e.num_used_blocks())).result(5) == (0, 0)
    finally:
        ae.shutdown()


def test_a_runner_failure_is_fatal_for_the_engine_and_fails_every_request(engine):
    fatal = []
    ae = AsyncEngine(engine, on_fatal=fatal.append)
    runner = engine.runners["fp32"]

    def broken(batch):
        raise RuntimeError("CUDA error: device-side assert triggered")

    runner.run = broken
    ae.start()
    q: queue.Queue = queue.Queue()
    ae.add_request("x", q.put, InputChunk(0, hidden=torch.randn(3, 64)), SamplingParams())
    [out] = _collect(q, lambda g: g[-1].finished)
    assert out.error_code == "engine_error" and "device-side assert" in out.error_message
    deadline = time.monotonic() + 5
    while ae.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not ae.alive and fatal and "device-side assert" in ae.dead
    with pytest.raises(EngineDeadError):
        ae.add_request("y", q.put, InputChunk(0, hidden=torch.randn(3, 64)), SamplingParams())


def test_a_request_whose_admission_kills_the_engine_hears_why(engine):
    """The request whose own ``add_request`` raised is failed like every other open one, not left waiting."""
    ae = AsyncEngine(engine)

    def broken(*args, **kwargs):
        raise ValueError("Overflow when unpacking long long")

    engine.add_request = broken
    ae.start()
    q: queue.Queue = queue.Queue()
    ae.add_request("x", q.put, InputChunk(0, hidden=torch.randn(3, 64)), SamplingParams())
    [out] = _collect(q, lambda g: g[-1].finished, timeout=5.0)
    assert out.request_id == "x" and out.error_code == "engine_error" and "Overflow" in out.error_message
    ae.shutdown()


def test_the_idle_hook_runs_on_the_engine_thread_when_nothing_happens(engine):
    import threading

    calls = []
    ae = AsyncEngine(engine, idle_hook=lambda: calls.append(threading.current_thread().name),
                     idle_hook_every_s=0.1).start()
    try:
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        ae.shutdown()
    assert len(calls) >= 2 and set(calls) == {"autoglm-engine"}  # e.g. the tensor-parallel heartbeat


def _slow_steps(engine, step_s: float) -> list[int]:
    """Make every forward pass take ``step_s`` (a slow device) and record its batch sizes (sequences)."""
    runner = engine.runners["fp32"]
    run, sizes = runner.run, []

    def slow(batch):
        sizes.append(len(batch.query_lens))
        time.sleep(step_s)
        return run(batch)

    runner.run = slow
    return sizes


def _two_decoding(ae, q) -> None:
    """Requests a and b, each with its first token delivered (both now await their next input)."""
    params = SamplingParams(0.0, max_tokens=2, ignore_eos=True)
    for rid in ("a", "b"):
        ae.add_request(rid, q.put, InputChunk(0, hidden=torch.randn(3, 64)), params)
    _collect(q, lambda g: {o.request_id for o in g if o.token_id is not None} == {"a", "b"})


@pytest.mark.parametrize("gather_max_s, steps_after", [(2.0, [2]), (0.0, [1, 1])])
def test_a_step_waits_for_the_awaited_inputs_of_its_decode_cohort_unless_the_window_is_off(engine, gather_max_s,
                                                                                            steps_after):
    sizes = _slow_steps(engine, 0.2)
    ae = AsyncEngine(engine, gather_max_s=gather_max_s).start()  # the window: the recent step time (~0.2 s)
    try:
        q: queue.Queue = queue.Queue()
        _two_decoding(ae, q)
        before = len(sizes)
        ae.add_inputs([("a", InputChunk(3, hidden=torch.randn(1, 64)))])
        time.sleep(0.05)  # b's input is on its way: the step waits for it instead of running a alone
        ae.add_input("b", InputChunk(3, hidden=torch.randn(1, 64)))
        _collect(q, lambda g: sum(o.finished for o in g) == 2)
        assert sizes[before:] == steps_after
    finally:
        ae.shutdown()


def test_an_input_that_does_not_come_holds_one_step_for_at_most_the_window(engine):
    sizes = _slow_steps(engine, 0.1)
    ae = AsyncEngine(engine, gather_max_s=0.05).start()
    try:
        q: queue.Queue = queue.Queue()
        _two_decoding(ae, q)
        before = len(sizes)
        t0 = time.monotonic()
        ae.add_input("a", InputChunk(3, hidden=torch.randn(1, 64)))  # b never sends
        [done] = _collect(q, lambda g: any(o.finished for o in g))
        assert done.request_id == "a" and sizes[before:] == [1]
        assert time.monotonic() - t0 < 0.05 + 0.1 + 1.0  # the window, one step, slack for a busy host
    finally:
        ae.shutdown()


def test_a_negative_gather_window_is_refused(engine):
    with pytest.raises(ValueError, match="gather_max_s"):
        AsyncEngine(engine, gather_max_s=-1.0)


def _three_tokens_answering_after(ae: AsyncEngine, delay_s: float) -> None:
    """A 4-position prompt, then each of its two decode inputs ``delay_s`` after the token before it (the phone's
    link and front step); returns once the engine thread has applied both and the request finished."""
    q: queue.Queue = queue.Queue()
    ae.add_request("a", q.put, InputChunk(0, hidden=torch.randn(4, 64)), SamplingParams(0.0, max_tokens=3,
                                                                                        ignore_eos=True))
    for position in (4, 5):
        _collect(q, lambda g: len(g) == 1)
        time.sleep(delay_s)
        ae.add_input("a", InputChunk(position, hidden=torch.randn(1, 64)))
    _collect(q, lambda g: g[-1].finished)
    assert ae.call(lambda e: 0).result(5) == 0


def test_each_decode_input_reports_its_edge_round_trip(engine):
    """A token leaves the engine; its edge answers 30 ms later: the hook sees that wait, once per decode input
    (not for the prompt, nor for an input that was never awaited)."""
    trips: list[float] = []
    ae = AsyncEngine(engine, on_round_trip=trips.append).start()
    try:
        _three_tokens_answering_after(ae, 0.03)
        assert len(trips) == 2 and all(0.03 <= t < 5.0 for t in trips), trips
    finally:
        ae.shutdown()


def test_each_step_reports_its_time_and_the_wait_for_its_inputs(engine):
    """Per step that delivers: the time in the step, and the time the engine waited for inputs before it while the
    request was open - 40 ms of a phone's round trip before each decode step, none before the prompt's step; the
    idle time before the request came is nobody's wait."""
    times: list[tuple[float, float]] = []
    ae = AsyncEngine(engine, on_step=lambda step_s, wait_s: times.append((step_s, wait_s))).start()
    try:
        time.sleep(0.1)  # idle, no request: not a wait for inputs
        _three_tokens_answering_after(ae, 0.04)
        assert len(times) == 3, times
        assert all(step > 0 for step, _ in times)
        assert times[0][1] < 0.04  # the prompt's step: no earlier token, nothing awaited
        assert all(0.04 <= wait < 5.0 for _, wait in times[1:]), times
    finally:
        ae.shutdown()


def test_decode_rows_as_one_array_give_the_tokens_of_one_input_each(tiny_bundle):
    """``add_rows`` (a turn's decode steps as one [S, H] tensor, what the engine process gets from a worker)
    and ``add_inputs`` (one chunk per row) feed the same steps: the same tokens."""
    g = torch.Generator().manual_seed(3)
    prompts = {rid: torch.randn(n, 64, generator=g) for rid, n in (("a", 5), ("b", 3))}
    steps = [torch.randn(2, 64, generator=g) for _ in range(3)]  # [S, H]: row 0 is a's, row 1 b's

    def run(as_rows: bool) -> dict[str, list[int]]:
        eng = LLMEngine.from_models(EngineConfig(num_blocks=32, block_size=4),
                                    {"fp32": load_split_model(tiny_bundle, "fp32")})
        ae = AsyncEngine(eng).start()
        try:
            q: queue.Queue = queue.Queue()
            for rid, x in prompts.items():
                ae.add_request(rid, q.put, InputChunk(0, hidden=x), SamplingParams(0.0, max_tokens=4, ignore_eos=True))
            got = _collect(q, lambda o: len(o) == 2)
            for k, h in enumerate(steps):
                starts = [5 + k, 3 + k]
                if as_rows:
                    ae.add_rows(["a", "b"], starts, h.clone())
                else:
                    ae.add_inputs([(rid, InputChunk(s, hidden=h[i:i + 1].clone()))
                                   for i, (rid, s) in enumerate(zip(["a", "b"], starts))])
                got += _collect(q, lambda o: len(o) == 2)
        finally:
            ae.shutdown()
        return {rid: [o.token_id for o in got if o.request_id == rid] for rid in prompts}

    rows, inputs = run(True), run(False)
    assert rows == inputs and all(len(t) == 4 for t in rows.values())


def test_a_pump_is_polled_on_the_engine_thread_and_other_threads_wake_it(engine):
    """``drive``: the engine thread polls the pump where it would sleep (the engine process's worker links); a
    command the pump reads is applied as any other, and a command from another thread ends the poll."""
    import select
    import socket
    import threading

    q: queue.Queue = queue.Queue()

    class LinkPump:  # one request id per line on a socket, as a worker's pipe carries its commands
        def __init__(self):
            self.rx, self.tx = socket.socketpair()
            self.wake_r, self.wake_w = socket.socketpair()
            self.threads: set[str] = set()
            self.woken = 0

        def poll(self, timeout):
            self.threads.add(threading.current_thread().name)
            ready, _, _ = select.select([self.rx, self.wake_r], [], [], timeout)
            if self.wake_r in ready:
                self.wake_r.recv(64)
                self.woken += 1
            if self.rx in ready:
                for rid in self.rx.recv(4096).decode().split():
                    ae.add_request(rid, q.put, InputChunk(0, hidden=torch.randn(3, 64)),
                                   SamplingParams(0.0, max_tokens=1, ignore_eos=True))

        def wake(self):
            self.wake_w.send(b"w")

    ae = AsyncEngine(engine).start()
    pump = LinkPump()
    try:
        ae.drive(pump)
        pump.tx.send(b"a b\n")
        got = _collect(q, lambda g: sum(o.finished for o in g) == 2)
        assert {o.request_id for o in got if o.finished} == {"a", "b"}
        assert pump.woken == 0  # commands read on the engine thread need no wakeup
        assert ae.call(lambda e: len(e.seqs)).result(5) == 0  # from this thread: it wakes the poll
        deadline = time.monotonic() + 5  # an engine thread between two polls ran the call first, then reads the wake
        while pump.woken == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pump.woken >= 1 and pump.threads == {"autoglm-engine"}
    finally:
        ae.shutdown()
