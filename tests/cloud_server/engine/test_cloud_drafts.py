"""Cloud drafts in the engine: the server drafts with its own layers from the draft table, the edge sends the
drafts back as a speculative step; greedy output equals plain decoding, the drafts never reach the sampler,
their KV is dropped, and other sessions in the same steps are unaffected."""

from __future__ import annotations

import pytest
import torch
from cloud_support import boundary, edge_front, greedy_reference

from cloud_server.config import EngineConfig
from cloud_server.engine.llm_engine import LLMEngine
from cloud_server.engine.sampling_params import SamplingParams
from cloud_server.engine.sequence import InputChunk
from cloud_server.model import load_split_model
from partition_tools.adapters import ModelAdapter
from partition_tools.cloud_drafter import fit, table_of
from partition_tools.draft_layers import Sequences


@pytest.fixture(scope="module")
def table(tiny_lm):
    """The cloud drafter's table for the tiny model, fitted on random sequences (the real fit, small data)."""
    seqs = Sequences()
    g = torch.Generator().manual_seed(11)
    for _ in range(6):
        seqs.add_prose(torch.randint(4, 512, (64,), generator=g))
    w, _ = fit(ModelAdapter(tiny_lm.model), seqs, 2)
    return torch.from_numpy(table_of(ModelAdapter(tiny_lm.model), w))


def _engine(bundle, table, **kw) -> LLMEngine:
    cfg = EngineConfig(**{"num_blocks": 128, "block_size": 4, **kw})
    eng = LLMEngine.from_models(cfg, {"fp32": load_split_model(bundle, "fp32")})
    eng.set_draft_inputs(table)
    return eng


def _run(eng, front, name, prompt, params, ask: int, steps: list | None = None) -> tuple[list[int], int, int, int]:
    """Drive one request as the edge does: each output's ``draft_ids`` go back as the next step's drafts.
    Returns (tokens, round trips, drafts proposed, drafts accepted)."""
    assert not eng.add_request(name, InputChunk(0, hidden=boundary(front, prompt), ask_drafts=ask), params)
    tokens: list[int] = []
    trips = proposed = accepted = 0
    pending: list[int] = []
    while True:
        outs = [o for o in eng.step() if o.request_id == name]
        if not outs:
            continue
        [o] = outs
        trips += 1
        accepted += len(o.accepted_ids)
        tokens += o.token_ids
        front.truncate(len(prompt) + len(tokens) - 1)
        if o.finished:
            return tokens, trips, proposed, accepted
        pending = list(o.draft_ids or [])
        proposed += len(pending)
        if steps is not None:
            steps.append(len(pending))
        pos = len(prompt) + len(tokens) - 1
        eng.add_input(name, InputChunk(pos, hidden=boundary(front, [tokens[-1], *pending]),
                                       draft_ids=pending or None, ask_drafts=ask))


def test_cloud_drafted_greedy_equals_plain_and_frees_the_draft_kv(tiny_bundle, tiny_lm, table):
    prompt = torch.randint(4, 512, (11,), generator=torch.Generator().manual_seed(4)).tolist()
    n = 20
    ref = greedy_reference(tiny_lm.model, prompt, n, [])
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    # the fitted table (a random model: its drafts are mostly rejected), and one whose rows for the answer's
    # tokens are their true boundary states in this context (mostly accepted; a repeated token's row is right
    # at one position only): both verdicts occur
    oracle = table.clone()
    rows = boundary(edge_front(tiny_bundle), prompt + ref)  # [P + n, H]
    for i, t in enumerate(ref):
        oracle[t] = rows[len(prompt) + i].to(oracle.dtype)
    for tab, asynchronous in ((table, True), (oracle, True), (oracle, False)):
        eng = _engine(tiny_bundle, tab, async_scheduling=asynchronous)
        steps: list[int] = []
        tokens, trips, proposed, accepted = _run(eng, edge_front(tiny_bundle), "r", prompt, params, 3, steps)
        assert tokens == ref
        assert proposed > 0 and max(steps) == 3  # drafts were proposed, the asked count at most
        assert trips == n - accepted  # every accepted draft saved one round trip
        if tab is oracle:
            assert accepted >= n // 3 and proposed > accepted
        assert eng.num_used_blocks() == 0
        for bm in eng.block_managers.values():
            bm.check()


def test_no_drafts_unless_asked_or_loaded(tiny_bundle, tiny_lm, table):
    prompt = [5, 9, 23, 7]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = greedy_reference(tiny_lm.model, prompt, 6, [])
    eng = _engine(tiny_bundle, table)
    tokens, trips, proposed, _ = _run(eng, edge_front(tiny_bundle), "a", prompt, params, 0)
    assert (tokens, trips, proposed) == (ref, 6, 0)
    bare = LLMEngine.from_models(EngineConfig(num_blocks=64, block_size=4), {"fp32": load_split_model(tiny_bundle, "fp32")})
    assert bare.max_cloud_drafts == 0
    tokens, _, proposed, _ = _run(bare, edge_front(tiny_bundle), "b", prompt, params, 3)
    assert (tokens, proposed) == (ref, 0)
    off = _engine(tiny_bundle, table, cloud_drafts=0)
    assert off.max_cloud_drafts == 0


def test_drafting_batches_with_another_session_without_changing_it(tiny_bundle, tiny_lm, table):
    """A session that drafts and one that does not, in the same engine steps: both get the model's greedy
    tokens, and the plain one's sampling is untouched (its seeded sampled tokens equal a run alone)."""
    g = torch.Generator().manual_seed(8)
    pa, pb = (torch.randint(4, 512, (9,), generator=g).tolist() for _ in range(2))
    ref_a = greedy_reference(tiny_lm.model, pa, 10, [])
    sampled = SamplingParams(temperature=1.0, top_k=20, max_tokens=10, ignore_eos=True, seed=3)

    def alone() -> list[int]:
        eng = _engine(tiny_bundle, table)
        return _run(eng, edge_front(tiny_bundle), "b", pb, sampled, 0)[0]

    eng = _engine(tiny_bundle, table)
    fa, fb = edge_front(tiny_bundle), edge_front(tiny_bundle)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    eng.add_request("a", InputChunk(0, hidden=boundary(fa, pa), ask_drafts=2), greedy)
    eng.add_request("b", InputChunk(0, hidden=boundary(fb, pb)), sampled)
    got = {"a": [], "b": []}
    done = set()
    while len(done) < 2:
        for o in eng.step():
            rid = o.request_id
            got[rid] += o.token_ids
            front, prompt = (fa, pa) if rid == "a" else (fb, pb)
            front.truncate(len(prompt) + len(got[rid]) - 1)
            if o.finished:
                done.add(rid)
                continue
            drafts = list(o.draft_ids or [])
            assert rid == "a" or not drafts
            eng.add_input(rid, InputChunk(len(prompt) + len(got[rid]) - 1,
                                          hidden=boundary(front, [got[rid][-1], *drafts]), draft_ids=drafts or None,
                                          ask_drafts=2 if rid == "a" else 0))
    assert got["a"] == ref_a
    assert got["b"] == alone()


def test_sampled_request_with_cloud_drafts_runs_and_stops_at_max_tokens(tiny_bundle, table):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, ignore_eos=True, seed=5)
    eng = _engine(tiny_bundle, table)
    tokens, trips, proposed, _ = _run(eng, edge_front(tiny_bundle), "s", [3, 4, 5, 6, 7], params, 4)
    assert len(tokens) == 12 and proposed > 0 and trips <= 12
    assert eng.num_used_blocks() == 0


def test_draft_table_shape_is_checked(tiny_bundle, table):
    eng = LLMEngine.from_models(EngineConfig(num_blocks=16, block_size=4), {"fp32": load_split_model(tiny_bundle, "fp32")})
    with pytest.raises(ValueError, match="draft inputs of shape"):
        eng.set_draft_inputs(table[:, :-1])
    with pytest.raises(ValueError, match="draft inputs of shape"):
        eng.set_draft_inputs(table[:-1])
