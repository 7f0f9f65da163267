"""The inversion attacks of partition_tools/privacy.py on tiny-glm4 (random weights), and the figures reader."""

from __future__ import annotations

import json

import pytest
import torch

from partition_tools import privacy as P
from partition_tools.adapters import ModelAdapter
from partition_tools.split import boundary_hidden
from shared.codecs import get_codec


def _random_windows(seed: int, lengths: list[int], vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g) for n in lengths]


@pytest.fixture(scope="module")
def tiny(tiny_glm4_lm):
    adapter = ModelAdapter(tiny_glm4_lm.model)
    train = P.boundary_states(adapter, _random_windows(0, [96] * 40, adapter.vocab_size), [0, 1, 2])
    test = P.boundary_states(adapter, _random_windows(1, [64, 33, 80, 17], adapter.vocab_size), [0, 1, 2])
    return adapter, train, test


def test_windows_cut_documents_and_drop_empty_ones():
    got = P.windows([[1, 2, 3, 4, 5], [], [6]], max_len=2)
    assert [w.tolist() for w in got] == [[1, 2], [3, 4], [5], [6]]
    with pytest.raises(ValueError):
        P.windows([[1]], max_len=0)


def test_batched_states_equal_each_window_run_alone(tiny_glm4_lm):
    """Right-padded batches of uneven windows give every window the states it has alone (the split's reference)."""
    adapter = ModelAdapter(tiny_glm4_lm.model)
    wins = _random_windows(2, [7, 19, 3, 19, 12], adapter.vocab_size)
    got = P.boundary_states(adapter, wins, [2, 0], batch_tokens=40)
    assert sorted(got.states) == [0, 2]
    offset = 0
    for w in wins:
        ref = boundary_hidden(adapter, w[None], 2)[0]  # [S, H]
        torch.testing.assert_close(got.states[2][offset:offset + w.numel()], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.states[0][offset:offset + w.numel()], adapter.embed_tokens(w))
        assert got.position[offset:offset + w.numel()].tolist() == list(range(w.numel()))
        offset += w.numel()
    assert torch.equal(got.ids, torch.cat(wins))


def test_boundary_states_refuses_bad_layers(tiny):
    adapter = tiny[0]
    with pytest.raises(ValueError, match="layers"):
        P.boundary_states(adapter, [torch.tensor([5, 6])], [adapter.num_layers + 1])
    with pytest.raises(ValueError, match="non-empty"):
        P.boundary_states(adapter, [torch.tensor([], dtype=torch.long)], [1])


def test_embedding_match_is_exact_on_the_embeddings(tiny):
    adapter, _, test = tiny
    embedding = adapter.embed_tokens.weight.detach()
    assert P.recovered(P.embedding_match(test.states[0], embedding), test.ids) == 1.0


def test_nearest_neighbour_names_the_training_tokens(tiny):
    adapter, train, test = tiny
    # a state's nearest neighbour among the training states is itself
    assert P.recovered(P.nearest_neighbour(train.states[1], train.ids, train.states[1]), train.ids) == 1.0
    # on held-out text it can only name tokens it has seen
    guess = P.nearest_neighbour(train.states[1], train.ids, test.states[1])
    assert torch.isin(guess, train.ids).all()


def test_linear_inverter_names_held_out_tokens_it_never_saw(tiny):
    """On the embeddings (N = 0) the map is exactly linear: the inverter recovers every held-out token,
    including ids absent from its training text (it scores the whole embedding table)."""
    adapter, train, test = tiny
    embedding = adapter.embed_tokens.weight.detach()
    few = 1000  # ~85 % of the vocabulary, so the test has unseen tokens
    unseen = ~torch.isin(test.ids, train.ids[:few])
    assert unseen.sum() >= 10
    for context in (0, 1):
        inv = P.train_inverter(train.states[0][:few], train.ids[:few], train.position[:few], embedding,
                               P.InverterConfig(context=context))
        guess = inv.predict(test.states[0], test.position)
        assert P.recovered(guess, test.ids) == 1.0
    # trained on pairs that do not belong together (ids shifted by one) it learns nothing
    wrong = P.train_inverter(train.states[0][:few], train.ids[:few].roll(1), train.position[:few], embedding,
                             P.InverterConfig())
    assert P.recovered(wrong.predict(test.states[0], test.position), test.ids) < 0.1


def test_with_context_never_crosses_a_window():
    states = torch.arange(1, 6, dtype=torch.float32)[:, None]  # [5, 1]: windows [1, 2, 3] and [4, 5]
    position = torch.tensor([0, 1, 2, 0, 1])
    got = P.with_context(states, position, 1)  # [5, 3]: previous, own, next
    assert got.tolist() == [[0, 1, 2], [1, 2, 3], [2, 3, 0], [0, 4, 5], [4, 5, 0]]


def test_inverter_config_refuses_bad_values():
    with pytest.raises(ValueError):
        P.InverterConfig(context=-1)
    with pytest.raises(ValueError):
        P.InverterConfig(ridge=0)


def test_through_codec_codes_each_window(tiny):
    _, _, test = tiny
    states = test.states[2]
    fp16 = P.through_codec(states, test.position, get_codec("fp16"))
    torch.testing.assert_close(fp16, states.half().float())
    int4 = P.through_codec(states, test.position, get_codec("int4-b32"))
    assert int4.shape == states.shape and not torch.equal(int4, states)


def test_recovered_checks_shapes():
    assert P.recovered(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 0, 4])) == 0.75
    with pytest.raises(ValueError):
        P.recovered(torch.tensor([1, 2]), torch.tensor([1, 2, 3]))


def test_recovered_fraction_reads_and_interpolates(tmp_path):
    path = tmp_path / "privacy.json"
    path.write_text(json.dumps({"model": "gguf:x", "best": {"none": {"1": 0.9, "2": 0.8, "4": 0.6}, "int4-outlier": {"2": 0.7}}}))
    assert P.recovered_fraction(2, path=path) == 0.8
    assert P.recovered_fraction(3, path=path) == pytest.approx(0.7)
    assert P.recovered_fraction(4, path=path) == 0.6
    assert P.recovered_fraction(5, path=path) is None  # beyond the measured layers
    assert P.recovered_fraction(2, codec="int4-outlier", path=path) == 0.7
    assert P.recovered_fraction(2, codec="fp16", path=path) is None  # not measured
    assert P.recovered_fraction(2, model="gguf:x", path=path) == 0.8
    assert P.recovered_fraction(2, model="preset:tiny-glm4@seed0", path=path) is None  # another model's figures
    assert P.recovered_fraction(2, path=tmp_path / "missing.json") is None


def test_committed_figures_cover_the_planner_layers():
    if not P.RESULTS.is_file():
        pytest.skip("docs/results/privacy_inversion.json not generated yet (bench/inversion_bench.py)")
    for n in (1, 2, 4, 8, 16):
        value = P.recovered_fraction(n)
        assert value is not None and 0.0 <= value <= 1.0


@pytest.mark.slow
def test_smollm2_boundary_gives_up_most_held_out_tokens(smollm2_lm):
    """Real weights: fitted on the first 3,000 tokens of the built-in text, the linear inverter names most of
    the last 500 at a 2-layer split, and the trivial attack does not (the figures of docs/security.md)."""
    from partition_tools.split import sample_text

    adapter = ModelAdapter(smollm2_lm.model)
    ids = smollm2_lm.tokenizer(sample_text()).input_ids
    train = P.boundary_states(adapter, P.windows([ids[:3000]], 250), [2])
    test = P.boundary_states(adapter, P.windows([ids[-500:]], 250), [2])
    embedding = adapter.embed_tokens.weight.detach()
    inv = P.train_inverter(train.states[2], train.ids, train.position, embedding, P.InverterConfig(context=1))
    assert P.recovered(inv.predict(test.states[2], test.position), test.ids) > 0.8
    assert P.recovered(P.embedding_match(test.states[2], embedding), test.ids) < 0.05
