"""Speculative steps in the engine: verification rules, greedy parity with plain decoding, KV rollback, and
the sampling rule's distribution (chi-square against plain sampling; a seeded verdict is plain sampling's draw)."""

from __future__ import annotations

import pytest
import torch
from cloud_support import boundary, edge_front, greedy_reference

from cloud_server.config import EngineConfig
from cloud_server.engine.llm_engine import LLMEngine
from cloud_server.engine.sampler import Sampler, _filtered
from cloud_server.engine.sampling_params import SamplingParams
from cloud_server.engine.sequence import InputChunk
from cloud_server.engine.speculation import verify
from cloud_server.model import load_split_model


def _engine(bundle, **kw) -> LLMEngine:
    cfg = EngineConfig(**{"num_blocks": 128, "block_size": 4, **kw})
    return LLMEngine.from_models(cfg, {"fp32": load_split_model(bundle, "fp32")})


# -- the rule on synthetic logits ---------------------------------------------------------------------

def test_greedy_verify_accepts_the_longest_matching_prefix():
    logits = torch.full((4, 10), -5.0)
    for i, best in enumerate([3, 7, 1, 9]):
        logits[i, best] = 5.0
    greedy = SamplingParams(temperature=0.0)
    assert [t.token_id for t in verify(logits, [3, 7, 1], greedy, Sampler(0), 5, [])] == [3, 7, 1, 9]
    assert [t.token_id for t in verify(logits, [3, 2, 1], greedy, Sampler(0), 5, [])] == [3, 7]
    assert [t.token_id for t in verify(logits, [4, 7, 1], greedy, Sampler(0), 5, [])] == [3]
    with pytest.raises(ValueError, match="logits"):
        verify(logits, [3, 7], greedy, Sampler(0), 5, [])


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells with expected count >= 5 (the rest pooled) and its dof."""
    n = float(counts.sum())
    exp = probs * n
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    e = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = e > 0
    return float(((obs[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1


# 99.9th percentile of chi-square for the degrees of freedom used here (scipy is not a dependency)
def _chi2_999(dof: int) -> float:
    # Wilson-Hilferty approximation, z = 3.09 (p = 0.999)
    return dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3


def test_sampling_rule_emits_the_models_distribution_on_synthetic_logits():
    """First emitted token of a speculative step vs p_0, for a likely, an unlikely and an impossible draft."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 12, generator=g) * 1.5
    p0 = _filtered(logits[0], SamplingParams(temperature=0.8, top_k=8))
    sampler = Sampler(0)
    for draft in (int(torch.argmax(p0)), int(torch.argsort(p0)[-5]), int(torch.argmin(p0))):
        counts = torch.zeros(12)
        for seed in range(6000):
            params = SamplingParams(temperature=0.8, top_k=8, seed=seed)
            counts[verify(logits, [draft, 0], params, sampler, 5, [])[0].token_id] += 1
        stat, dof = _chi_square(counts, p0)
        assert stat < _chi2_999(dof), (draft, stat, dof)


def test_a_seeded_verdict_is_plain_samplings_draw_whatever_was_drafted():
    """Each row's token is the sampler's draw at its position (seed, position): any drafts, any k, and a replay
    of the step emit the tokens plain sampling emits there."""
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=7)
    sampler = Sampler(0)
    plain = [sampler(logits[i:i + 1], [params], [10 + i], [[]])[0].token_id for i in range(4)]
    for drafts in ([], plain[:1], plain[:3], [plain[0], (plain[1] + 1) % 12, 0], [(plain[0] + 1) % 12]):
        out = [t.token_id for t in verify(logits[:len(drafts) + 1], drafts, params, sampler, 9, [])]
        agreed = next((i for i, (d, t) in enumerate(zip(drafts, plain)) if d != t), len(drafts))
        assert out == plain[:agreed + 1], drafts


# -- on the tiny model: the engine's speculative step -----------------------------------------------------

def _spec_generate(eng, front, name: str, prompt: list[int], n: int, drafts_for, params) -> tuple[list[int], int]:
    """Drive one request by speculative steps: ``drafts_for(emitted)`` proposes drafts (possibly none);
    returns the emitted tokens and the number of engine round trips."""
    out = eng.add_request(name, InputChunk(0, hidden=boundary(front, prompt)), params)
    assert not out
    tokens: list[int] = []
    trips = 0
    while True:
        outs = eng.step()
        if not outs:
            continue
        [o] = outs
        trips += 1
        tokens += o.token_ids
        front.truncate(len(prompt) + len(tokens) - 1)  # keep the fed token and the accepted drafts only
        if o.finished:
            assert len(tokens) <= n
            return tokens, trips
        drafts = drafts_for(tokens)[: max(0, n - len(tokens) - 1)]
        pos = len(prompt) + len(tokens) - 1
        hidden = boundary(front, [tokens[-1], *drafts])  # [k + 1, H]
        eng.add_input(name, InputChunk(pos, hidden=hidden, draft_ids=list(drafts) if drafts else None))


def test_tiny_speculative_greedy_equals_plain_and_frees_rejected_blocks(tiny_bundle, tiny_lm):
    prompt = torch.randint(4, 512, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    n = 24
    ref = greedy_reference(tiny_lm.model, prompt, n, [])
    eng = _engine(tiny_bundle)
    front = edge_front(tiny_bundle)
    step = {"i": 0}

    def drafts_for(emitted: list[int]) -> list[int]:
        # an oracle that is right for a while, then wrong: every acceptance length occurs
        step["i"] += 1
        good = ref[len(emitted):len(emitted) + 4]
        cut = step["i"] % 5
        return good[:cut] + [(t + 1) % 512 for t in good[cut:]]

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    tokens, trips = _spec_generate(eng, front, "s", prompt, n, drafts_for, params)
    assert tokens == ref
    assert trips < n  # more than one token per round trip on average
    assert eng.num_used_blocks() == 0
    for bm in eng.block_managers.values():
        bm.check()


def test_speculative_step_batches_with_a_plain_request(tiny_bundle, tiny_lm):
    """A verification step of one session runs in the same engine step as another session's decode."""
    g = torch.Generator().manual_seed(5)
    pa, pb = (torch.randint(4, 512, (9,), generator=g).tolist() for _ in range(2))
    ref_a, ref_b = (greedy_reference(tiny_lm.model, p, 6, []) for p in (pa, pb))
    eng = _engine(tiny_bundle, async_scheduling=False)  # one step() call, one step's outputs
    fa, fb = edge_front(tiny_bundle), edge_front(tiny_bundle)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eng.add_request("a", InputChunk(0, hidden=boundary(fa, pa)), params)
    eng.add_request("b", InputChunk(0, hidden=boundary(fb, pb)), params)
    first = {o.request_id: o.token_id for o in eng.step()}
    assert first == {"a": ref_a[0], "b": ref_b[0]}
    # a: speculative with 3 correct drafts and one wrong; b: a plain decode step
    drafts = ref_a[1:4] + [(ref_a[4] + 7) % 512]
    eng.add_input("a", InputChunk(len(pa), hidden=boundary(fa, [ref_a[0], *drafts]), draft_ids=drafts))
    eng.add_input("b", InputChunk(len(pb), hidden=boundary(fb, [ref_b[0]])))
    batches, _ = eng.scheduler.schedule()  # one step by hand: both sessions in one batch
    assert len(batches) == 1 and {it.seq.request_id for it in batches[0].items} == {"a", "b"}
    outs = {o.request_id: o for o in eng._postprocess(eng._launch(batches[0]))}
    assert outs["a"].token_ids == ref_a[1:5] and not outs["a"].finished  # 3 accepted drafts + the model's token
    assert outs["b"].token_ids == [ref_b[1]]
    assert eng.seqs["b"].num_computed == len(pb) + 1
    assert eng.seqs["a"].num_computed == len(pa) + 4 and len(eng.seqs["a"].block_table) == (len(pa) + 4 + 3) // 4


def test_speculative_sampling_matches_plain_sampling_on_the_tiny_model(tiny_bundle):
    """Chi-square: the first token after a speculative step's fed token, drafted by a fixed token, is
    distributed as plain sampling's (the same logits row, computed by the engine)."""
    eng = _engine(tiny_bundle, num_blocks=64, async_scheduling=False)
    front = edge_front(tiny_bundle)
    prompt = torch.randint(4, 512, (7,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(temperature=1.3, top_k=12, max_tokens=3, ignore_eos=True, seed=1)
    eng.add_request("r", InputChunk(0, hidden=boundary(front, prompt)), params)
    [o] = eng.step()
    fed = o.token_id
    base = front.length
    # the model's distribution after `fed`, and its most likely token as the draft
    hidden = boundary(front, [fed, 0])
    front.truncate(base)
    seq = eng.seqs["r"]
    eng.add_input("r", InputChunk(len(prompt), hidden=hidden, draft_ids=[0]))
    batches, _ = eng.scheduler.schedule()
    logits = eng._run(batches[0])[0]  # [2, V]
    p0 = _filtered(logits[0].float(), params)
    draft = int(torch.argsort(p0)[-2])  # the second most likely: accepted often, rejected often
    g, sampler = torch.Generator().manual_seed(2), Sampler(0)
    plain, spec = torch.zeros(p0.numel()), torch.zeros(p0.numel())
    for seed in range(4000):
        plain[int(torch.multinomial(p0, 1, generator=g))] += 1
        keyed = SamplingParams(temperature=1.3, top_k=12, max_tokens=3, ignore_eos=True, seed=seed)
        spec[verify(logits, [draft], keyed, sampler, len(prompt), list(seq.output_ids))[0].token_id] += 1
    for counts in (plain, spec):
        stat, dof = _chi_square(counts, p0)
        assert stat < _chi2_999(dof), stat
    assert 0.05 < spec[draft] / 4000 < 0.95  # both branches of the rule ran
