"""A sequence's state transitions, one method each, and no other engine module writing its fields."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from cloud_server.engine.sampling_params import SamplingParams
from cloud_server.engine.sequence import InputChunk, Sequence, SequenceStatus

ENGINE = Path(__file__).resolve().parents[3] / "cloud_server" / "engine"


def _seq() -> Sequence:
    return Sequence("r", SamplingParams(0.0), "fp32", ["k0", "k1"])


def test_admit_with_cached_blocks_skips_their_inputs_and_runs_at_once():
    seq = _seq()
    seq.admit(InputChunk(0, hidden=torch.zeros(10, 8)), cached_blocks=[5, 9], block_size=4)
    assert seq.status is SequenceStatus.RUNNING and seq.block_table == [5, 9]
    assert (seq.num_cached_tokens, seq.num_computed, seq.num_received, seq.num_prompt_tokens) == (8, 8, 10, 10)
    assert seq.num_registered_blocks == 2 and seq.num_ready_tokens == 2  # positions [8, 10) remain
    cold = _seq()
    cold.admit(InputChunk(0, hidden=torch.zeros(3, 8)), cached_blocks=[], block_size=4)
    assert cold.status is SequenceStatus.WAITING and cold.num_ready_tokens == 3


def test_inputs_then_output_then_finish():
    seq = _seq()
    seq.admit(InputChunk(0, hidden=torch.zeros(6, 8)), [], 4)
    with pytest.raises(ValueError, match="next position expected is 6"):
        seq.push(InputChunk(7, hidden=torch.zeros(1, 8)))
    seq.start_running()
    head, sample = seq.take(4)  # a prefill chunk: the rest stays pending
    assert (head.start, head.n, sample, seq.num_ready_tokens) == (0, 4, False, 0)
    seq.update_from_output(head.end)
    assert seq.num_computed == 4 and seq.ready
    tail, sample = seq.take(10)
    assert (tail.start, tail.n, sample) == (4, 2, True)
    seq.update_from_output(tail.end, token=42, now=123.0)
    assert seq.output_ids == [42] and seq.last_token_time == 123.0 and seq.waiting_since == 123.0
    seq.push(InputChunk(6, hidden=torch.zeros(1, 8)))  # the decode step
    assert seq.num_prompt_tokens == 6 and seq.ready  # output exists: later input is not prompt
    seq.mark_published(1)
    seq.mark_published(0)
    assert seq.num_registered_blocks == 1  # never goes back


def test_a_replayed_sequence_starts_with_its_output_so_far_and_its_whole_prompt_is_prompt():
    """A replay (``LLMEngine.add_request``'s ``output_ids``): its earlier tokens are its output (a copy), and every
    chunk up to the one ending its first input turn counts as prompt, its carried tokens' positions included."""
    carried = [7, 8]
    seq = Sequence("r", SamplingParams(0.0), "fp32", output_ids=carried)
    carried.append(9)
    seq.admit(InputChunk(0, token_ids=torch.arange(4), last=False), [], 4)
    seq.push(InputChunk(4, token_ids=torch.tensor([7, 8])))
    assert seq.output_ids == [7, 8] and seq.num_prompt_tokens == 6 and seq.prompt_complete
    assert seq.last_token_time is None  # no token sampled here yet
    seq.update_from_output(6, token=3)
    assert seq.output_ids == [7, 8, 3]
    seq.finish("stop")
    seq.finish("abort")
    assert seq.finish_reason == "stop" and seq.status is SequenceStatus.FINISHED and not seq.pending
    assert not seq.ready


def test_a_long_prefill_is_not_idle_time(monkeypatch):
    """The step timeout counts from when the engine took the last input, not from when it arrived: an 8,100-token
    prompt whose chunked prefill took longer than the timeout on a CPU cloud was aborted 'no input for 120 s'
    the moment its last chunk was scheduled."""
    clock = [100.0]
    monkeypatch.setattr("cloud_server.engine.sequence.time.monotonic", lambda: clock[0])
    seq = _seq()
    seq.admit(InputChunk(0, hidden=torch.zeros(8, 8), last=True), [], 4)
    seq.start_running()
    assert seq.waiting_since == 100.0  # the prompt arrived
    clock[0] = 250.0
    seq.take(4)  # the engine works through the prompt...
    assert seq.waiting_since == 100.0  # (inputs still pending: never idle)
    clock[0] = 400.0
    _, sample = seq.take(4)  # ...and takes its last chunk 300 s after it arrived
    assert sample and seq.waiting_since == 400.0


def _fields() -> set[str]:
    seq = _seq()
    return set(vars(seq))


def test_no_other_engine_module_writes_a_sequence_field():
    """Assignments ``x.<field> = ...`` / ``x.<field> += ...`` to a Sequence field live in sequence.py only."""
    fields = _fields() - {"params", "variant", "request_id", "prefix_keys", "generator"}
    offenders = []
    for path in sorted(ENGINE.glob("*.py")):
        if path.name == "sequence.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in fields and not (
                        isinstance(t.value, ast.Name) and t.value.id == "self"):
                    offenders.append(f"{path.name}:{node.lineno} .{t.attr}")
    assert not offenders, offenders
    assert {"num_computed", "block_table", "output_ids", "status"} <= fields  # the check looks at real names
