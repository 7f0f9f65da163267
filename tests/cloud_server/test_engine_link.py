"""``cloud_server.engine_link``: what crosses the pipe between a front-end worker and the engine process."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import random
import socket
import time

import numpy as np
import torch

from cloud_server.engine.llm_engine import RequestOutput
from cloud_server.engine.sequence import InputChunk
from cloud_server.engine_facts import EngineFacts
from cloud_server.engine_link import (
    FrameReader,
    facts_from_wire,
    frame,
    facts_to_wire,
    pack_chunks,
    pack_output,
    unpack_chunks,
    unpack_output,
)


def test_a_turns_chunks_cross_as_one_array_and_come_back_equal():
    g = torch.Generator().manual_seed(0)
    chunks = [InputChunk(7, hidden=torch.randn(1, 8, generator=g)),  # a decode step
              InputChunk(0, hidden=torch.randn(3, 8, generator=g), last=False,
                         rope_positions=torch.arange(9).reshape(3, 3)),  # a prompt chunk with 3-D RoPE
              InputChunk(4, hidden=torch.randn(2, 8, generator=g), draft_ids=[5])]  # a speculative step
    packed = pack_chunks(chunks)
    assert packed[3].shape == (6, 8) and packed[3].dtype == np.float32  # one [sum n, H] array
    back = unpack_chunks(packed)
    for a, b in zip(chunks, back, strict=True):
        assert (a.start, a.last, a.n, a.draft_ids) == (b.start, b.last, b.n, b.draft_ids)
        assert torch.equal(a.hidden, b.hidden)
        assert (a.rope_positions is None) == (b.rope_positions is None)
        if a.rope_positions is not None:
            assert torch.equal(a.rope_positions, b.rope_positions)


def _send(conn, messages: list[tuple]) -> None:  # a Connection end (the tests' engine / worker stand-in)
    conn.send_bytes(pickle.dumps(messages, protocol=5))


def _recv(conn) -> list[tuple]:
    return pickle.loads(conn.recv_bytes())


def test_frames_are_read_back_whole_from_any_split_of_the_stream_and_in_a_connections_format():
    frames = [[("outputs", [(i, "x" * i)], i)] for i in range(5)] + [[("inputs", ["r"], np.ones((300, 64)))]]
    stream = b"".join(b"".join(frame(m)) for m in frames)
    rng = random.Random(0)
    for _ in range(20):  # the stream arrives in random pieces, as a socket delivers it
        reader, got, at = FrameReader(), [], 0
        while at < len(stream):
            n = rng.randint(1, 9000)
            got += reader.feed(stream[at:at + n])
            at += n
        assert len(got) == len(frames) and got[:5] == frames[:5]
        assert np.array_equal(got[5][0][2], frames[5][0][2])
    ours, theirs = mp.Pipe()  # a Connection reads what frame() wrote
    sock = socket.socket(fileno=ours.fileno())
    sock.sendall(b"".join(frame(frames[1])))
    assert _recv(theirs) == frames[1]
    sock.detach()
    ours.close()
    theirs.close()
    bad = FrameReader()
    try:
        list(bad.feed(b"\xff\xff\xff\xfe"))  # a negative length other than -1
    except ValueError:
        pass
    else:
        raise AssertionError("a corrupt frame length must be refused")


def test_outputs_and_facts_round_trip_through_a_real_pipe():
    a, b = mp.Pipe()
    outs = [RequestOutput("s/r", token_id=5, logprob=-0.5, top_logprobs=[(5, -0.5)], num_prompt_tokens=3),
            RequestOutput("s/q", finish_reason="error", error_code="engine_error", error_message="boom"),
            RequestOutput("s/u", states=torch.ones(2, 4), states_start=3)]
    facts = EngineFacts(variants=("fp32",), variant_for={None: "fp32", "int8": "fp32"}, hidden_size=4,
                        vocab_size=10, mrope=False, eos_token_ids=(2,), block_size=4, max_context=64,
                        max_num_seqs=8, max_num_batched_tokens=64)
    _send(a, [("outputs", [pack_output(o) for o in outs], 3), ("hello", facts_to_wire(facts), "m")])
    (kind, packed, n), (_, wire_facts, name) = _recv(b)
    back = [unpack_output(t) for t in packed]
    assert kind == "outputs" and n == 3 and name == "m"
    for o, r in zip(outs, back, strict=True):
        assert (o.request_id, o.token_ids, o.finished, o.error_code, o.top_logprobs) == \
            (r.request_id, r.token_ids, r.finished, r.error_code, r.top_logprobs)
    assert torch.equal(back[2].states, outs[2].states) and back[2].states_start == 3
    got = facts_from_wire(wire_facts)
    assert got == facts and got.resolve_variant("int8") == "fp32"
    a.close()
    b.close()


def test_the_workers_event_loop_never_waits_on_the_link_and_messages_keep_their_order():
    """A worker's loop writes frames through its transport: 8 MB of prompt states, which the engine process has
    not started reading, cost the loop nothing; what follows arrives after them, in order; the engine's frames
    reach the sinks on the loop."""
    import asyncio
    import threading

    from cloud_server.remote_engine import RemoteEngine

    ours, engine_end = mp.Pipe()
    facts = EngineFacts(variants=("fp32",), variant_for={None: "fp32"}, hidden_size=1024, vocab_size=10,
                        mrope=False, eos_token_ids=(2,), block_size=4, max_context=64, max_num_seqs=8,
                        max_num_batched_tokens=64)
    _send(engine_end, [("hello", facts_to_wire(facts), "m")])
    got: list[tuple] = []
    turn_done = threading.Event()  # the loop's turn returned; until then nobody reads (not a timing: a load-free
    released: list[bool] = []      # check - a write that waited for a reader would wait the full 10 s here)

    def engine() -> None:  # the engine process: reads the worker's frames, then answers with one step
        released.append(turn_done.wait(10))  # not reading until the loop's turn is over
        while len(got) < 2:
            got.extend(_recv(engine_end))
        _send(engine_end, [("outputs", [pack_output(RequestOutput("r1", token_id=4))], 1)])

    async def turn() -> tuple[float, list, threading.Thread]:
        loop = asyncio.get_running_loop()
        remote = RemoteEngine(ours, 0)
        await loop.run_in_executor(None, remote.start, loop, 5)
        outs: list = []
        seen = asyncio.Event()
        remote.add_request("r1", lambda o: (outs.append((o, threading.current_thread())), seen.set()),
                           InputChunk(0, hidden=torch.randn(1, 1024)), None)
        reader = threading.Thread(target=engine)
        reader.start()
        inputs = [(f"r{i}", InputChunk(0, hidden=torch.randn(512, 1024))) for i in range(4)]  # 8 MB
        remote.add_inputs(inputs)
        remote.abort("r0", "abort")
        await asyncio.sleep(0)  # the turn's end flushes the abort
        turn_done.set()
        await asyncio.wait_for(seen.wait(), 20)
        remote.close()
        return outs, reader

    outs, reader = asyncio.run(turn())
    reader.join(5)
    assert released == [True]  # nobody read the other end during the turn: the loop went on at once
    assert got[0][0] == "add" and got[1][0] == "inputs" and got[1][1] == ["r0", "r1", "r2", "r3"]
    assert got[1][2][3].shape == (2048, 1024)
    more = _recv(engine_end)
    assert more == [("abort", "r0", "abort")]
    assert outs[0][0].token_id == 4 and outs[0][1] is threading.main_thread()  # on the loop, no thread between
    engine_end.close()


def test_a_killed_engine_process_sends_its_workers_edges_elsewhere():
    """The engine process killed (its end of the pipe gone): the worker's open request ends ``engine_gone``, which
    the wire calls ``draining`` - its edge replays it on the restarted server or another replica, as after a whole
    server's crash; it was ``internal``, which the edge does not retry. The engine's own fatal errors stay
    ``internal`` (not retried: the same input might fail again)."""
    import asyncio

    from cloud_server.remote_engine import RemoteEngine
    from cloud_server.split_translate import WIRE_CODES

    ours, engine_end = mp.Pipe()
    facts = EngineFacts(variants=("fp32",), variant_for={None: "fp32"}, hidden_size=8, vocab_size=10,
                        mrope=False, eos_token_ids=(2,), block_size=4, max_context=64, max_num_seqs=8,
                        max_num_batched_tokens=64)
    _send(engine_end, [("hello", facts_to_wire(facts), "m")])

    async def kill() -> tuple[list, str | None]:
        loop = asyncio.get_running_loop()
        remote = RemoteEngine(ours, 0)
        await loop.run_in_executor(None, remote.start, loop, 5)
        outs: list = []
        ended = asyncio.Event()
        remote.add_request("r1", lambda o: (outs.append(o), ended.set()), InputChunk(0, hidden=torch.randn(1, 8)), None)
        engine_end.close()  # SIGKILL's effect on the pipe
        await asyncio.wait_for(ended.wait(), 10)
        return outs, remote.dead

    outs, dead = asyncio.run(kill())
    assert outs[-1].finish_reason == "error" and outs[-1].error_code == "engine_gone" and "gone" in dead
    assert WIRE_CODES["engine_gone"] == "draining" and WIRE_CODES["engine_error"] == "internal"


class _StubEngine:
    """What the engine host uses of ``AsyncEngine``: commands recorded, and ``drive`` polling the pump on a thread of
    its own (the engine thread's waits)."""

    dead = None

    def __init__(self):
        import threading

        self.calls: list[tuple] = []
        self.seen = threading.Event()
        self.stop = threading.Event()

    def add_request(self, rid, sink, first, params, variant, keys):
        self.calls.append(("add", rid))

    def abort(self, rid, reason):
        self.calls.append(("abort", rid, reason))
        self.seen.set()

    def drive(self, pump):
        import threading

        self.thread = threading.Thread(target=lambda: [pump.poll(0.05) for _ in iter(self.stop.is_set, True)],
                                       daemon=True)
        self.thread.start()


def _host(engine):
    import types

    from cloud_server.engine_host import EngineHost

    facts = EngineFacts(variants=("fp32",), variant_for={None: "fp32"}, hidden_size=8, vocab_size=10,
                        mrope=False, eos_token_ids=(2,), block_size=4, max_context=64, max_num_seqs=8,
                        max_num_batched_tokens=64)
    rt = types.SimpleNamespace(engine=engine, config=types.SimpleNamespace(max_sessions=8), facts=facts,
                               model_name="m")
    return EngineHost(rt)


def test_a_corrupt_frame_from_one_worker_drops_that_worker_only():
    """The engine process's links (polled by the engine thread): garbage on one worker's pipe ends that worker's
    link (its requests aborted, as when a worker dies); the other worker's link goes on (its hello came, its
    commands apply)."""
    engine = _StubEngine()
    host = _host(engine)
    try:
        (a_ours, a_worker), (b_ours, b_worker) = mp.Pipe(), mp.Pipe()
        port_a, port_b = host.attach(0, a_ours), host.attach(1, b_ours)
        assert _recv(a_worker)[0][0] == "hello" and _recv(b_worker)[0][0] == "hello"
        _send(a_worker, [("add", "a1", pack_chunks([InputChunk(0, hidden=torch.randn(2, 8))]), None, None, None)])
        a_worker.send_bytes(b"not a pickle")  # a broken worker
        assert engine.seen.wait(5)  # its open request is aborted
        assert engine.calls == [("add", "a1"), ("abort", "a1", "abort")]
        assert port_a.serial not in host.ports and port_b.serial in host.ports
        engine.seen.clear()
        _send(b_worker, [("abort", "b1", "cancel")])  # the other worker's link still applies commands
        assert engine.seen.wait(5) and engine.calls[-1] == ("abort", "b1", "cancel")
    finally:
        host.stop()
        engine.stop.set()


def test_a_worker_that_does_not_read_never_blocks_the_engine_thread_and_gets_every_frame_in_order():
    """Outputs for a worker that stops reading are buffered on the engine's side (its pipe full): the engine thread
    goes on serving the other worker at once, and when the slow one reads again its frames come whole, in order."""
    import threading

    engine = _StubEngine()
    host = _host(engine)
    try:
        (a_ours, a_worker), (b_ours, b_worker) = mp.Pipe(), mp.Pipe()
        port_a, _ = host.attach(0, a_ours), host.attach(1, b_ours)
        assert _recv(a_worker)[0][0] == "hello" and _recv(b_worker)[0][0] == "hello"
        big = np.arange(1 << 18, dtype=np.float32)  # 1 MiB a message: 24 of them are far more than a pipe holds
        sent = threading.Event()

        def send_on_engine_thread():
            for i in range(24):
                port_a.send(("outputs", [(i, big)], i))
            sent.set()

        host.on_engine_thread(send_on_engine_thread)
        assert sent.wait(5)  # the writes returned with the pipe full
        assert port_a._unsent  # the rest waits on the engine's side
        _send(b_worker, [("abort", "b1", "cancel")])  # the engine thread still applies the other worker's commands
        assert engine.seen.wait(5) and engine.calls[-1] == ("abort", "b1", "cancel")
        got = [_recv(a_worker)[0] for _ in range(24)]  # the slow worker reads at last
        assert [m[2] for m in got] == list(range(24)) and all(np.array_equal(m[1][0][1], big) for m in got)
        deadline = time.monotonic() + 5
        while port_a._unsent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not port_a._unsent
    finally:
        host.stop()
        engine.stop.set()


def test_after_a_fatal_engine_error_the_links_are_still_served_and_every_add_hears_it(tiny_bundle):
    """A real engine driven by the host: its runner fails, the open request's worker gets ``engine_error``; the
    engine thread goes on polling the links, so a request sent afterwards is answered ``engine_error`` at once."""
    import types

    from cloud_server.config import EngineConfig
    from cloud_server.engine.async_engine import AsyncEngine
    from cloud_server.engine.llm_engine import LLMEngine
    from cloud_server.engine.sampling_params import SamplingParams
    from cloud_server.engine_host import EngineHost
    from cloud_server.engine_link import unpack_output
    from cloud_server.model import load_split_model

    llm = LLMEngine.from_models(EngineConfig(num_blocks=32, block_size=4), {"fp32": load_split_model(tiny_bundle, "fp32")})

    def broken(batch):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    llm.runners["fp32"].run = broken
    engine = AsyncEngine(llm).start()
    facts = EngineFacts(variants=("fp32",), variant_for={None: "fp32"}, hidden_size=64, vocab_size=10,
                        mrope=False, eos_token_ids=(2,), block_size=4, max_context=64, max_num_seqs=8,
                        max_num_batched_tokens=64)
    rt = types.SimpleNamespace(engine=engine, config=types.SimpleNamespace(max_sessions=8), facts=facts,
                               model_name="m")
    host = EngineHost(rt)
    try:
        ours, worker = mp.Pipe()
        host.attach(0, ours)
        assert _recv(worker)[0][0] == "hello"

        def add(rid):
            _send(worker, [("add", rid, pack_chunks([InputChunk(0, hidden=torch.randn(3, 64))]), SamplingParams(),
                            None, None)])
            assert worker.poll(10)
            [(kind, outs, _)] = _recv(worker)
            return kind, [unpack_output(o) for o in outs]

        kind, outs = add("r1")
        assert kind == "outputs" and outs[-1].error_code == "engine_error" and "illegal memory" in outs[-1].error_message
        kind, outs = add("r2")  # the engine is dead: the link still answers
        assert kind == "outputs" and outs[-1].request_id == "r2" and outs[-1].error_code == "engine_error"
    finally:
        host.stop()
        engine.shutdown()
