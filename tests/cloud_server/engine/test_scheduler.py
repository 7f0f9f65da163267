"""Scheduling policy: decode steps first, prefill chunks under the token budget, FCFS admission,
prefix-cache admission, and the abort of the youngest when the pool is exhausted."""

from __future__ import annotations

import pytest
import torch

from cloud_server.config import EngineConfig
from cloud_server.engine.kv_cache import BlockManager
from cloud_server.engine.sampling_params import SamplingParams
from cloud_server.engine.scheduler import PrefixMiss, RequestError, Scheduler
from cloud_server.engine.sequence import InputChunk, Sequence, SequenceStatus


def _sched(num_blocks=64, block_size=4, **kw):
    cfg = EngineConfig(num_blocks=num_blocks, block_size=block_size, **kw)
    return Scheduler(cfg, {"fp32": BlockManager(num_blocks, block_size)})


def _seq(name, keys=None):
    return Sequence(name, SamplingParams(0.0), "fp32", keys)


def _h(n):
    return torch.zeros(n, 8)


def _run(sched, batches):
    """Pretend the forward ran: mark the scheduled positions computed."""
    for b in batches:
        for it in b.items:
            it.seq.update_from_output(it.chunk.end)
            sched.publish_prefix(it.seq)


def test_decode_steps_go_first_then_prefill_fills_the_budget():
    s = _sched(max_num_batched_tokens=10, max_num_seqs=8)
    a, b = _seq("a"), _seq("b")
    s.add(a, InputChunk(0, hidden=_h(3)))
    batches, _ = s.schedule()
    _run(s, batches)
    s.add(b, InputChunk(0, hidden=_h(30)))
    a.push(InputChunk(3, hidden=_h(1)))  # a's decode step
    [batch], victims = s.schedule()
    assert not victims
    assert [(it.seq.request_id, it.chunk.n, it.sample) for it in batch.items] == [("a", 1, True), ("b", 9, False)]
    _run(s, [batch])
    [batch], _ = s.schedule()  # b continues with the next 10-token chunk
    assert [(it.seq.request_id, it.chunk.start, it.chunk.n) for it in batch.items] == [("b", 9, 10)]


def test_only_ready_sequences_run_and_nobody_waits_for_a_slow_one():
    s = _sched()
    a, b = _seq("a"), _seq("b")
    s.add(a, InputChunk(0, hidden=_h(2)))
    s.add(b, InputChunk(0, hidden=_h(2)))
    _run(s, s.schedule()[0])
    b.push(InputChunk(2, hidden=_h(1)))  # a's phone is slow: only b is ready
    [batch], _ = s.schedule()
    assert [it.seq.request_id for it in batch.items] == ["b"]
    _run(s, [batch])
    assert s.schedule() == ([], [])


def test_admission_is_first_come_first_served_when_blocks_are_short():
    s = _sched(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    big, small = _seq("big"), _seq("small")
    hog = _seq("hog")
    s.add(hog, InputChunk(0, hidden=_h(8)))
    _run(s, s.schedule()[0])  # hog holds 2 of 4 blocks
    s.add(big, InputChunk(0, hidden=_h(12)))  # needs 3 blocks: must wait
    s.add(small, InputChunk(0, hidden=_h(2)))  # would fit, but may not overtake
    batches, victims = s.schedule()
    # big waits for its 3 blocks (2 are free); small waits behind it.
    assert batches == [] and not victims
    assert big.status is SequenceStatus.WAITING and small.status is SequenceStatus.WAITING
    s.remove(hog, "finished")
    [batch], victims = s.schedule()
    assert [(it.seq.request_id, it.chunk.n) for it in batch.items] == [("big", 12), ("small", 2)] and not victims


def test_a_prompt_the_free_blocks_cannot_hold_waits_instead_of_being_dropped_for_load():
    """docs/cloud.md, KV admission: a request waits until its prompt's blocks fit. It was admitted with the blocks
    free (8 of its 12 positions), ran out of pool at its next chunk and, the youngest running, was the victim of the
    next step in which the sequence holding the pool waited for its phone - at once in split mode (over the wire:
    ``overloaded`` 0.0 s after its Prefill, ``vllm:num_requests_waiting`` never counting it)."""
    s = _sched(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    hog, big = _seq("hog"), _seq("big")
    s.add(hog, InputChunk(0, hidden=_h(8)))
    _run(s, s.schedule()[0])  # hog holds 2 of 4 blocks; its phone is computing its next step
    s.add(big, InputChunk(0, hidden=_h(12)))
    for _ in range(3):
        batches, victims = s.schedule()
        assert not victims, "the request that arrived was dropped for load"
        _run(s, batches)
    assert big.status is SequenceStatus.WAITING and s.num_waiting == 1
    hog.push(InputChunk(8, hidden=_h(1)))  # hog decodes on, within its blocks
    [batch], _ = s.schedule()
    assert [it.seq.request_id for it in batch.items] == ["hog"]


def test_a_prefix_hit_whose_rest_the_free_blocks_cannot_hold_waits_holding_its_hits():
    """As above for a request whose prompt starts with cached blocks (a shared system prompt): it ran at once with
    what was free and was dropped for load the next step (a real server: ``overloaded`` 0.0 s after its Prefill while
    the request holding the pool decoded). It waits holding its hits; should nobody run to free blocks while the
    waiting head needs those it holds, the youngest holder goes, as a running one would."""
    s = _sched(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    bm = s.block_managers["fp32"]
    pub = _seq("pub", keys=["k0"])
    s.add(pub, InputChunk(0, hidden=_h(5)))
    _run(s, s.schedule()[0])
    s.remove(pub, "finished")  # block k0 cached, evictable
    hog = _seq("hog")
    s.add(hog, InputChunk(0, hidden=_h(8)))
    _run(s, s.schedule()[0])  # 2 of 4 blocks; its phone is away
    hit = _seq("hit", keys=["k0", "k1", "k2"])
    s.add(hit, InputChunk(0, hidden=_h(12)))  # k0 cached: 2 more blocks wanted, 1 free
    for _ in range(3):
        batches, victims = s.schedule()
        assert not victims, "the prefix hit was dropped for load"
        _run(s, batches)
    assert hit.status is SequenceStatus.WAITING and hit.num_cached_tokens == 4
    s.remove(hog, "finished")
    [batch], victims = s.schedule()
    assert [(it.seq.request_id, it.chunk.start, it.chunk.n) for it in batch.items] == [("hit", 4, 8)] and not victims
    bm.check()
    # the head needs the whole pool; a waiting hit behind it holds a block, and nobody runs
    s = _sched(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    pub = _seq("pub", keys=["k0"])
    s.add(pub, InputChunk(0, hidden=_h(5)))
    _run(s, s.schedule()[0])
    s.remove(pub, "finished")
    hog2, whole, hit2 = _seq("hog2"), _seq("whole"), _seq("hit2", keys=["k0"])
    s.add(hog2, InputChunk(0, hidden=_h(8)))
    _run(s, s.schedule()[0])
    s.add(whole, InputChunk(0, hidden=_h(16)))
    s.add(hit2, InputChunk(0, hidden=_h(12)))
    assert hit2.status is SequenceStatus.WAITING and len(hit2.block_table) == 1
    s.remove(hog2, "finished")
    batches, victims = s.schedule()
    assert batches == [] and victims == [hit2]
    s.remove(hit2, "abort")
    [batch], _ = s.schedule()
    assert [(it.seq.request_id, it.chunk.n) for it in batch.items] == [("whole", 16)]
    s.block_managers["fp32"].check()


def test_youngest_running_sequence_is_the_victim_when_the_pool_is_exhausted():
    s = _sched(num_blocks=2, block_size=2)
    old, young = _seq("old"), _seq("young")
    s.add(old, InputChunk(0, hidden=_h(2)))
    s.add(young, InputChunk(0, hidden=_h(2)))
    _run(s, s.schedule()[0])
    old.push(InputChunk(2, hidden=_h(1)))
    young.push(InputChunk(2, hidden=_h(1)))
    batches, victims = s.schedule()
    assert batches == [] and victims == [young]
    s.remove(young, "abort")
    [batch], victims = s.schedule()
    assert [it.seq.request_id for it in batch.items] == ["old"] and not victims


def test_prefix_hits_skip_computation_and_omitted_positions_need_the_cache():
    s = _sched(block_size=4)
    first = _seq("first", keys=["k0", "k1", "k2"])
    s.add(first, InputChunk(0, hidden=_h(10)))
    _run(s, s.schedule()[0])  # blocks 0 and 1 are full -> published; block 2 is not full
    bm = s.block_managers["fp32"]
    assert bm.num_cached_blocks == 2
    # Full hidden states sent: the cached 8 positions are skipped, 2 computed.
    again = _seq("again", keys=["k0", "k1", "k2"])
    s.add(again, InputChunk(0, hidden=_h(10)))
    assert again.num_cached_tokens == 8 and again.num_computed == 8
    [batch], _ = s.schedule()
    assert [(it.chunk.start, it.chunk.n) for it in batch.items] == [(8, 2)]
    # Positions [0, 8) omitted by the edge: fine when cached...
    short = _seq("short", keys=["k0", "k1"])
    s.add(short, InputChunk(8, hidden=_h(3)))
    assert short.num_computed == 8 and short.block_table[:2] == first.block_table[:2]
    # ... a prefix miss otherwise.
    with pytest.raises(PrefixMiss):
        s.add(_seq("miss", keys=["k0", "zz"]), InputChunk(8, hidden=_h(3)))
    # A whole-prompt hit still computes the last position (its logits are needed).
    exact = _seq("exact", keys=["k0", "k1"])
    s.add(exact, InputChunk(0, hidden=_h(8)))
    assert exact.num_cached_tokens == 4 and exact.num_computed == 4


def test_only_prompt_blocks_are_published_not_blocks_that_decode_steps_fill():
    """A key names prompt block i (docs/protocol.md, "Prefix cache"): a key beyond the prompt's full blocks (a
    client's mistake: block 1 of a 6-token prompt) is never published, even once decode steps fill that block
    with generated positions' KV. It was: the block went into the cache under the client's key."""
    s = _sched(block_size=4)
    seq = _seq("a", keys=["k0", "k1"])
    s.add(seq, InputChunk(0, hidden=_h(6)))
    _run(s, s.schedule()[0])
    bm = s.block_managers["fp32"]
    assert bm.num_cached_blocks == 1  # block 0 is the prompt's one full block
    for pos in (6, 7, 8):  # decode steps fill block 1 (positions 4..7) and go past it
        seq.push(InputChunk(pos, hidden=_h(1)))
        _run(s, s.schedule()[0])
    assert seq.num_computed == 9
    assert bm.num_cached_blocks == 1 and seq.num_registered_blocks == 1
    assert len(bm.lookup(["k0", "k1"])) == 1  # k1 names nothing


def test_too_long_prompts_are_refused():
    s = _sched(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(RequestError, match="max_model_len"):
        s.add(_seq("a"), InputChunk(0, hidden=_h(101)))
    with pytest.raises(RequestError, match="more KV blocks than the pool holds"):
        s.add(_seq("b"), InputChunk(0, hidden=_h(17)))


@pytest.mark.parametrize("cap", [0, 6])
def test_prompt_chunks_are_capped_while_a_sequence_decodes(cap):
    """A long prompt arriving while another sequence decodes: the step holds at most max_num_seqs +
    ``prefill_chunk_while_decoding`` positions, the decode rows' included (0: the whole budget); with nobody
    decoding the prompt takes the whole budget - a replayed request's too (the tokens it carries are prompt positions
    to it)."""
    s = _sched(max_num_batched_tokens=32, max_num_seqs=8, prefill_chunk_while_decoding=cap)
    for alone in (_seq("alone"), Sequence("replayed", SamplingParams(0.0), "fp32", output_ids=[5, 6])):
        s.add(alone, InputChunk(0, hidden=_h(80)))
        for _ in range(2):
            [b], _ = s.schedule()
            assert [it.chunk.n for it in b.items] == [32]  # no decoder: the budget
            _run(s, [b])
        s.remove(alone, "abort")
    d, long = _seq("d"), _seq("long")
    s.add(d, InputChunk(0, hidden=_h(3)))
    [b], _ = s.schedule()
    _run(s, [b])
    d.update_from_output(3, token=5)  # d is decoding now
    d.push(InputChunk(3, hidden=_h(1)))
    s.add(long, InputChunk(0, hidden=_h(40)))
    [b], _ = s.schedule()
    assert [(it.seq.request_id, it.chunk.n) for it in b.items] == [("d", 1), ("long", 6 + 8 - 1 if cap else 31)]
    _run(s, [b])
    [b], _ = s.schedule()  # d awaits its next input; the prompt still gets only its share
    assert [(it.seq.request_id, it.chunk.n) for it in b.items] == [("long", 6 + 8 if cap else 9)]


def test_prompts_wait_for_a_decode_step_when_told_to():
    """``prefill_alone=False`` (a step with decode rows is in flight): a batch of prompt chunks alone is not
    formed, waiting admissions included; beside a decode step the prompt runs as usual."""
    s = _sched(max_num_batched_tokens=32, max_num_seqs=8, prefill_chunk_while_decoding=6)
    d, long, new = _seq("d"), _seq("long"), _seq("new")
    s.add(d, InputChunk(0, hidden=_h(3)))
    _run(s, s.schedule()[0])
    d.update_from_output(3, token=5)
    s.add(long, InputChunk(0, hidden=_h(40)))
    _run(s, s.schedule()[0])  # long is running now (6 + 8 positions), d awaits its input
    s.add(new, InputChunk(0, hidden=_h(4)))
    assert s.schedule(prefill_alone=False) == ([], [])
    assert long.num_computed == 14 and new.status is SequenceStatus.WAITING  # nothing was taken
    d.push(InputChunk(3, hidden=_h(1)))
    [b], _ = s.schedule(prefill_alone=False)
    assert [(it.seq.request_id, it.chunk.n) for it in b.items] == [("d", 1), ("long", 13)]
