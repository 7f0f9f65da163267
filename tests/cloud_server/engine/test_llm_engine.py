"""The engine end to end on CPU: split greedy output equals the unsplit model's, batched or alone."""

from __future__ import annotations

import pytest
import torch
from cloud_support import Phone, boundary, drive, edge_front, greedy_reference, greedy_reference_batch

from cloud_server.config import EngineConfig
from cloud_server.engine.llm_engine import LLMEngine
from cloud_server.engine.sampling_params import SamplingParams
from cloud_server.engine.sequence import InputChunk
from cloud_server.model import load_full_model, load_split_model


def _engine(bundle, **kw) -> LLMEngine:
    cfg = EngineConfig(**{"num_blocks": 128, "block_size": 4, **kw})
    return LLMEngine.from_models(cfg, {"fp32": load_split_model(bundle, "fp32")})


def _prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(4, vocab, (k,), generator=g).tolist() for k in lens]


def test_tiny_single_session_matches_unsplit(tiny_bundle, tiny_lm):
    eng = _engine(tiny_bundle)
    [prompt] = _prompts(1, 512, seed=1)
    phone = Phone("a", prompt, edge_front(tiny_bundle), max_tokens=16)
    drive(eng, [phone])
    assert phone.tokens == greedy_reference(tiny_lm.model, prompt, 16, [2, 3])
    assert eng.num_used_blocks() == 0


def test_tiny_eight_staggered_sessions_match_unsplit(tiny_bundle, tiny_lm):
    eng = _engine(tiny_bundle)
    prompts = _prompts(8, 512, seed=2)
    # Phones arrive at different steps and answer their tokens after different delays (slow links).
    phones = [Phone(f"p{i}", pr, edge_front(tiny_bundle), max_tokens=12, arrive=3 * i, delay=i % 3)
              for i, pr in enumerate(prompts)]
    steps = drive(eng, phones)
    for p in phones:
        assert p.tokens == greedy_reference(tiny_lm.model, p.prompt, 12, [2, 3]), p.name
    # Batching really happened: far fewer steps than running the phones one after another.
    assert steps < sum(len(p.tokens) * (1 + p.delay) for p in phones)
    assert eng.num_used_blocks() == 0


@pytest.mark.slow  # the default suite keeps its tiny-model twin
def test_smollm2_one_and_eight_sessions_match_unsplit(smol_bundle, smol_lm):
    eng = _engine(smol_bundle, num_blocks=256, block_size=16)
    tok = smol_lm.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at",
             "The quick brown fox", "import numpy as np", "My favourite colour is", "1, 2, 3, 4,"]
    prompts = [tok(t).input_ids for t in texts]
    eos = eng.eos_token_ids
    refs = greedy_reference_batch(smol_lm.model, prompts, 8, eos)
    front = edge_front(smol_bundle)  # one loaded graph, forked per phone
    alone = Phone("solo", prompts[0], front.fork(), max_tokens=8)
    drive(eng, [alone])
    assert alone.tokens == refs[0]
    phones = [Phone(f"p{i}", p, front.fork(), max_tokens=8, arrive=2 * i, delay=i % 2)
              for i, p in enumerate(prompts)]
    drive(eng, phones)
    assert [p.tokens for p in phones] == refs
    assert eng.num_used_blocks() == 0


def test_full_model_mode_matches_unsplit(tiny_lm):
    cfg = EngineConfig(num_blocks=64, block_size=4)
    eng = LLMEngine.from_models(cfg, {"fp32": load_full_model(tiny_lm, "fp32")})
    prompts = _prompts(3, 512, seed=3)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", InputChunk(0, token_ids=torch.tensor(p)), SamplingParams(0.0, max_tokens=10))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    while eng.seqs:
        for o in eng.step():
            if o.token_id is not None:
                got[o.request_id].append(o.token_id)
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == greedy_reference(tiny_lm.model, p, 10, [2, 3])
    assert eng.num_used_blocks() == 0


def test_prefill_in_chunks_then_continue_equals_one_shot(tiny_bundle, tiny_lm):
    """A long history replayed as several prefill chunks (Resume after the server lost a session)."""
    eng = _engine(tiny_bundle, max_num_batched_tokens=64)
    prompt = _prompts(1, 512, seed=4, lo=40, hi=41)[0]
    front = edge_front(tiny_bundle)
    hidden = boundary(front, prompt)  # [S, H]
    eng.add_request("r", InputChunk(0, hidden=hidden[:16], last=False), SamplingParams(0.0, max_tokens=6))
    eng.add_input("r", InputChunk(16, hidden=hidden[16:30], last=False))
    eng.add_input("r", InputChunk(30, hidden=hidden[30:], last=True))
    tokens = []
    while eng.seqs:
        for o in eng.step():
            if o.token_id is not None:
                tokens.append(o.token_id)
                if not o.finished:
                    eng.add_input("r", InputChunk(len(prompt) + len(tokens) - 1, hidden=boundary(front, [o.token_id])))
    assert tokens == greedy_reference(tiny_lm.model, prompt, 6, [2, 3])


def test_token_budget_splits_a_long_prompt_into_chunks(tiny_bundle, tiny_lm):
    eng = _engine(tiny_bundle, max_num_batched_tokens=8, max_num_seqs=4)
    prompt = _prompts(1, 512, seed=5, lo=30, hi=31)[0]
    phone = Phone("a", prompt, edge_front(tiny_bundle), max_tokens=5)
    steps = drive(eng, [phone])
    assert steps >= 30 // 8 + 5
    assert phone.tokens == greedy_reference(tiny_lm.model, prompt, 5, [2, 3])


def test_bad_inputs_are_fatal_for_that_request_only(tiny_bundle):
    eng = _engine(tiny_bundle)
    h = torch.randn(5, 64)
    assert eng.add_request("ok", InputChunk(0, hidden=h), SamplingParams(0.0, max_tokens=50)) == []
    [err] = eng.add_request("wide", InputChunk(0, hidden=torch.randn(5, 65)), SamplingParams())
    assert err.error_code == "bad_input"
    [err] = eng.add_request("ids", InputChunk(0, token_ids=torch.tensor([1, 2])), SamplingParams())
    assert err.error_code == "bad_input" and "hidden states" in err.error_message
    [err] = eng.add_request("ok", InputChunk(0, hidden=h), SamplingParams())
    assert err.error_code == "duplicate_request"
    eng.step()
    [err] = eng.add_input("ok", InputChunk(9, hidden=torch.randn(1, 64)))  # position 5 expected
    assert err.error_code == "bad_input" and "expected is 5" in err.error_message
    assert eng.seqs == {} and eng.num_used_blocks() == 0


def test_too_long_and_pool_exhaustion(tiny_bundle):
    eng = _engine(tiny_bundle, num_blocks=8, block_size=4, max_model_len=64)
    [err] = eng.add_request("huge", InputChunk(0, hidden=torch.randn(40, 64)), SamplingParams())
    assert err.error_code == "too_long"
    # Two requests whose decode steps outgrow the 8-block pool together (4 blocks each after the prompt,
    # 7 for the old one's 27 positions): the younger is aborted, the older finishes.
    params = SamplingParams(0.0, max_tokens=12, ignore_eos=True)
    eng.add_request("old", InputChunk(0, hidden=torch.randn(15, 64)), params)
    eng.add_request("young", InputChunk(0, hidden=torch.randn(15, 64)), params)
    finished = {}
    for _ in range(100):
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
            elif o.token_id is not None:
                pos = eng.seqs[o.request_id].num_received
                eng.add_input(o.request_id, InputChunk(pos, hidden=torch.randn(1, 64)))
        if not eng.seqs:
            break
    assert finished["young"].error_code == "kv_cache_full"
    assert finished["old"].finish_reason == "length" and finished["old"].num_output_tokens == 12
    assert eng.num_used_blocks() == 0


def test_max_tokens_stop_ids_and_seeded_sampling(tiny_bundle):
    eng = _engine(tiny_bundle)
    h = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))

    def run(params):
        eng.add_request("r", InputChunk(0, hidden=h), params)
        out = []
        while eng.seqs:
            for o in eng.step():
                if o.token_id is not None:
                    out.append(o)
                    if not o.finished:  # feed a fixed pseudo-hidden state for the next position
                        eng.add_input("r", InputChunk(6 + len(out) - 1, hidden=h[len(out) % 6][None]))
        return out

    outs = run(SamplingParams(0.0, max_tokens=5, ignore_eos=True))
    assert len(outs) == 5 and outs[-1].finish_reason == "length"
    stop_at = outs[2].token_id
    outs2 = run(SamplingParams(0.0, max_tokens=5, stop_token_ids=[stop_at], ignore_eos=True))
    assert [o.token_id for o in outs2] == [o.token_id for o in outs][: [o.token_id for o in outs].index(stop_at) + 1]
    assert outs2[-1].finish_reason == "stop"
    a = run(SamplingParams(1.0, max_tokens=6, seed=7, ignore_eos=True, logprobs=2))
    b = run(SamplingParams(1.0, max_tokens=6, seed=7, ignore_eos=True, logprobs=2))
    assert [o.token_id for o in a] == [o.token_id for o in b]
    assert all(o.logprob <= 0 and len(o.top_logprobs) == 2 for o in a)


def test_int8_variant_batches_with_its_own_kind(tiny_bundle):
    cfg = EngineConfig(num_blocks=64, block_size=4, variants=("fp32", "int8"), async_scheduling=False)
    models = {v: load_split_model(tiny_bundle, v) for v in cfg.resolved_variants()}
    eng = LLMEngine.from_models(cfg, models)
    assert eng.resolve_variant("int8") == "int8" and eng.resolve_variant("bf16") == "fp32"
    h = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    logits = {}
    for v in ("fp32", "int8"):
        eng.add_request(v, InputChunk(0, hidden=h), SamplingParams(0.0, max_tokens=1, logprobs=5), variant=v)
    for o in eng.step():
        logits[o.request_id] = dict(o.top_logprobs)
    assert logits["fp32"] != logits["int8"]  # different weights really ran
    common = set(logits["fp32"]) & set(logits["int8"])
    assert len(common) >= 4  # ... and int8 stays close to fp32
    assert max(abs(logits["fp32"][t] - logits["int8"][t]) for t in common) < 0.1
    assert eng.num_used_blocks() == 0


@pytest.mark.parametrize("n", [1, 3])
def test_same_tokens_whatever_the_batch(tiny_bundle, n):
    """Batch invariance: a sequence's logits are bitwise the same alone or batched (CPU attention path)."""
    eng = _engine(tiny_bundle, async_scheduling=False)  # one step() call, one step's outputs
    g = torch.Generator().manual_seed(5)
    target = torch.randn(9, 64, generator=g)
    others = [torch.randn(int(k), 64, generator=g) for k in torch.randint(2, 12, (n,), generator=g)]
    eng.add_request("t", InputChunk(0, hidden=target), SamplingParams(0.0, max_tokens=1, logprobs=3))
    [alone] = eng.step()
    for i, o in enumerate(others):
        eng.add_request(f"o{i}", InputChunk(0, hidden=o), SamplingParams(0.0, max_tokens=1))
    eng.add_request("t", InputChunk(0, hidden=target), SamplingParams(0.0, max_tokens=1, logprobs=3))
    batched = next(o for o in eng.step() if o.request_id == "t")
    assert batched.token_id == alone.token_id
    assert abs(batched.logprob - alone.logprob) < 1e-5


@pytest.mark.parametrize("sampled", [False, True])
def test_overlap_scheduling_gives_the_synchronous_outputs(tiny_bundle, sampled):
    """async_scheduling on and off: the same tokens (greedy, and seeded sampling), with staggered phones,
    prompts split into chunks by a small token budget, and the pool released at the end."""
    prompts = _prompts(6, 512, seed=7, lo=10, hi=30)

    def params(p):
        i = int(p.name[1:])
        if not sampled:
            return SamplingParams(temperature=0.0, max_tokens=p.max_tokens)
        return SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=i, max_tokens=p.max_tokens)

    runs = {}
    for overlap in (False, True):
        eng = _engine(tiny_bundle, max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=overlap)
        phones = [Phone(f"p{i}", pr, edge_front(tiny_bundle), max_tokens=9, arrive=2 * i, delay=i % 3)
                  for i, pr in enumerate(prompts)]
        drive(eng, phones, params=params)
        runs[overlap] = [(p.tokens, p.finish) for p in phones]
        assert eng.num_used_blocks() == 0 and not eng.has_work()
        for bm in eng.block_managers.values():
            bm.check()
    assert runs[True] == runs[False]
    assert all(len(t) == 9 for t, _ in runs[True])


def test_a_request_aborted_while_its_step_is_in_flight_gets_no_token(tiny_bundle):
    eng = _engine(tiny_bundle)
    assert eng.config.async_scheduling
    eng.add_request("a", InputChunk(0, hidden=torch.randn(6, 64)), SamplingParams(0.0, max_tokens=4))
    eng.add_request("b", InputChunk(0, hidden=torch.randn(5, 64)), SamplingParams(0.0, max_tokens=4))
    assert eng.step() == [] and eng.has_in_flight()  # launched, not postprocessed
    [aborted] = eng.abort("a")
    assert aborted.finish_reason == "abort" and aborted.token_id is None
    outs = eng.step()  # nothing new to launch: the in-flight step is postprocessed now
    assert [(o.request_id, o.token_id is not None) for o in outs] == [("b", True)]
    assert not eng.has_in_flight() and "a" not in eng.seqs
    eng.abort("b")
    assert eng.num_used_blocks() == 0


def test_overlap_never_queues_a_prompt_only_step_behind_decodes(tiny_bundle):
    """Lockstep decoders (their next input waits for their token) and a long prompt arriving, overlap on: every
    step launched while decode rows are in flight carries decode rows, so each prompt chunk rides on the
    decoders' step instead of running between two of them (which would delay their token by a chunk)."""
    eng = _engine(tiny_bundle, max_num_batched_tokens=64, max_num_seqs=4, prefill_chunk_while_decoding=5)
    g = torch.Generator().manual_seed(0)
    ids = ["d0", "d1"]
    for rid in ids:
        eng.add_request(rid, InputChunk(0, hidden=torch.randn(4, 64, generator=g)), SamplingParams(0.0, max_tokens=20))
    while sum(1 for rid in ids if eng.seqs[rid].output_ids) < 2:
        eng.step()
    eng.add_request("long", InputChunk(0, hidden=torch.randn(23, 64, generator=g)), SamplingParams(0.0, max_tokens=1))
    launched = []
    real_launch = eng._launch

    def launch(batch):
        launched.append(sorted((it.seq.request_id, it.chunk.n) for it in batch.items))
        return real_launch(batch)

    eng._launch = launch
    for _ in range(6):  # each decoder's next input, then step() until its token is back
        for rid in ids:
            seq = eng.seqs[rid]
            eng.add_input(rid, InputChunk(seq.num_received, hidden=torch.randn(1, 64, generator=g)))
        want = {rid: len(eng.seqs[rid].output_ids) + 1 for rid in ids}
        while any(len(eng.seqs[rid].output_ids) < want[rid] for rid in ids):
            eng.step()
    # the step holds max_num_seqs + 5 = 9 positions: 7 for the prompt beside the 2 decode rows
    assert launched[:4] == [[("d0", 1), ("d1", 1), ("long", 7)]] * 3 + [[("d0", 1), ("d1", 1), ("long", 2)]]
    assert all(("d0", 1) in b for b in launched)  # no prompt-only step


def test_a_request_ends_length_where_a_pool_smaller_than_max_model_len_ends_its_context(tiny_bundle):
    """The context is ``EngineConfig.max_context``, the pool's 32 positions here (Welcome.limits.max_context): a
    request asking for more ends ``length`` there (prompt + answer = 32), as it does at ``max_model_len``. It ran on
    to a 33rd position - a token the pool could not hold once fed back - and was dropped for load (over the wire:
    that token, then ``context_full`` at its DecodeStep), while the same request ended ``length`` where
    ``max_model_len`` was the smaller."""
    for kw in ({"num_blocks": 8, "block_size": 4}, {"num_blocks": 64, "block_size": 4, "max_model_len": 32}):
        eng = _engine(tiny_bundle, **kw)
        assert eng.config.max_context == 32
        eng.add_request("r", InputChunk(0, hidden=torch.randn(29, 64)), SamplingParams(0.0, max_tokens=12,
                                                                                      ignore_eos=True))
        outs = []
        while eng.seqs:
            for o in eng.step():
                outs.append(o)
                if not o.finished:
                    eng.add_input("r", InputChunk(29 + len(outs) - 1, hidden=torch.randn(1, 64)))
        assert [o.finish_reason for o in outs] == [None, None, "length"], (kw, outs[-1])
        assert eng.num_used_blocks() == 0


_PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.4}


@pytest.mark.parametrize("params", [SamplingParams(0.0, max_tokens=12, logprobs=2, ignore_eos=True, **_PENALTIES),
                                    SamplingParams(0.9, max_tokens=12, seed=5, logprobs=2, ignore_eos=True,
                                                   **_PENALTIES)], ids=["greedy", "seeded"])
def test_a_request_replayed_with_its_output_so_far_continues_as_the_one_run_whole(tiny_lm, params):
    """Full-model mode's replay of a request dropped for load (``cloud_server.full_api``): its prompt and first k
    tokens, those k as ``output_ids``, give the rest of the tokens the request gives run whole - penalized over all
    its tokens - with their logprobs, ``num_output_tokens`` and its ``length`` finish at ``max_tokens``. Without the
    k as its output the replay penalizes (and counts) otherwise; a replay with nothing left to generate or a token
    outside the vocabulary is refused."""
    eng = LLMEngine.from_models(EngineConfig(num_blocks=64, block_size=4), {"fp32": load_full_model(tiny_lm, "fp32")})
    prompt, k = [5, 6, 7, 8], 5

    def run(rid: str, ids: list[int], output_ids: list[int] | None = None) -> list:
        assert eng.add_request(rid, InputChunk(0, token_ids=torch.tensor(ids)), params, output_ids=output_ids) == []
        outs = []
        while eng.seqs:
            outs += eng.step()
        return outs

    def seen(outs) -> list[tuple]:
        return [(o.token_id, [t for t, _ in o.top_logprobs], o.num_output_tokens, o.finish_reason) for o in outs]

    whole = run("whole", prompt)
    tokens = [o.token_id for o in whole]
    assert len(tokens) == 12 and len(set(tokens)) > 6  # (the penalties at work: tiny-glm4 repeats itself without)
    replay = run("replay", prompt + tokens[:k], tokens[:k])
    assert seen(replay) == seen(whole[k:])
    assert [o.logprob for o in replay] == pytest.approx([o.logprob for o in whole[k:]], abs=1e-4)
    assert [o.token_id for o in run("forgetful", prompt + tokens[:k])][:12 - k] != tokens[k:]
    for rid, out in (("done", tokens[:12]), ("bad id", [eng.vocab_size])):
        [err] = eng.add_request(rid, InputChunk(0, token_ids=torch.tensor(prompt + out)), params, output_ids=out)
        assert err.error_code == "bad_input" and not eng.seqs
    assert eng.num_used_blocks() == 0
