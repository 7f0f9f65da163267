"""partition_tools.evaluate: split-vs-unsplit scoring (agreement, KL, perplexity, boundary error)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from partition_tools.evaluate import SplitEvaluator, compare_logits, evaluate_split, fp16_round_trip
from partition_tools.models import load_model
from shared.manifest import BundleError


@pytest.fixture(scope="module")
def glm4_fp32_front(tiny_glm4_plain_bundle):
    """The fp32 edge graph of the same split as conftest's (int8) tiny-glm4 bundle: ``export_front`` of
    tiny-glm4's layers [0, 2), as the session's plain fp32 bundle holds it (tests/conftest.py)."""
    return tiny_glm4_plain_bundle / "edge" / "front.onnx"


def test_compare_logits_on_known_values():
    ids = np.array([0, 1, 1, 0])
    ref = torch.tensor([[2.0, 0.0], [0.0, 2.0], [1.0, 0.0], [0.0, 0.0]])
    same = compare_logits(ref, ref.clone(), ids)
    assert same["top1_agreement"] == 1.0 and same["mean_kl"] == 0.0 and same["ppl_delta_pct"] == 0.0
    # rows 0-2 predict tokens 1, 1, 0: p(target) = sigmoid(-2), sigmoid(2), sigmoid(1)
    nll = -(math.log(1 / (1 + math.e ** 2)) + math.log(1 / (1 + math.e ** -2)) + math.log(1 / (1 + math.e ** -1)))
    assert same["ppl_reference"] == pytest.approx(math.exp(nll / 3))
    flipped = ref.clone()
    flipped[1] = torch.tensor([2.0, 0.0])  # row 1 now prefers token 0
    r = compare_logits(ref, flipped, ids, rows=3)  # row blocks must not change the result
    assert r["top1_agreement"] == 0.75
    p = torch.softmax(ref[1].double(), -1)
    kl_row1 = float((p * (p.log() - torch.log_softmax(flipped[1].double(), -1))).sum())
    assert r["mean_kl"] == pytest.approx(kl_row1 / 4) and r["max_kl"] == pytest.approx(kl_row1)


def test_fp32_front_reproduces_the_unsplit_model(tiny_glm4_bundle, glm4_fp32_front):
    shapes = []

    def recording(x):
        shapes.append(x.shape)
        return x

    r = evaluate_split(tiny_glm4_bundle, front_onnx_path=glm4_fp32_front, max_tokens=100, window=40, codec=recording)
    assert shapes == [(40, 64), (40, 64), (20, 64)]  # the codec sees each prefill window, with past after the first
    assert r["tokens"] == 100 and r["top1_agreement"] == 1.0
    assert r["mean_kl"] < 1e-8 and r["boundary_max_abs_err"] < 1e-4
    assert r["ppl_split"] == pytest.approx(r["ppl_reference"], rel=1e-5)


def test_quantized_and_lossy_boundaries_show_up_in_the_numbers(tiny_glm4_bundle, glm4_fp32_front):
    ev = SplitEvaluator(tiny_glm4_bundle, max_tokens=100, window=64)
    int8 = ev.evaluate(codec=fp16_round_trip)  # the bundle's own int8 front (default recipe)
    assert int8["boundary_max_abs_err"] > 1e-4  # really quantized ...
    assert int8["top1_agreement"] >= 0.9 and int8["mean_kl"] < 1e-3  # ... and still close on random weights
    noisy = ev.evaluate(glm4_fp32_front, codec=lambda x: x + np.random.default_rng(0).normal(0, 3, x.shape))
    assert noisy["mean_kl"] > 10 * int8["mean_kl"] and noisy["top1_agreement"] < int8["top1_agreement"]
    assert noisy["boundary_mean_abs_err"] == pytest.approx(3 * math.sqrt(2 / math.pi), rel=0.05)


def test_reference_must_be_the_bundle_source(tiny_glm4_bundle):
    with pytest.raises(BundleError, match="not the bundle's source"):
        SplitEvaluator(tiny_glm4_bundle, lm=load_model("tiny-glm4", seed=1))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"max_tokens": 1}, ValueError, "at least 2"),
    ({"window": 0}, ValueError, "window 0"),
    ({"text": "hello"}, ValueError, "no tokenizer"),
])
def test_bad_arguments(tiny_glm4_bundle, kwargs, error, match):
    with pytest.raises(error, match=match):
        SplitEvaluator(tiny_glm4_bundle, **kwargs)


def test_missing_edge_graph_is_a_bundle_error(tiny_glm4_bundle, tmp_path):
    ev = SplitEvaluator(tiny_glm4_bundle, max_tokens=8)
    with pytest.raises(BundleError, match="no such edge graph"):
        ev.evaluate(tmp_path / "nope.onnx")
