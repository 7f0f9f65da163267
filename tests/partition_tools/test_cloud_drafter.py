"""partition_tools.cloud_drafter: the one-forward agreement probe equals running each position on its own, the
ridge fit picks its strength on a calibration fold and tabulates [e, 1] @ W, and a bundle gets the table with its manifest entry (bundle id unchanged; the
server's loader checks it; a u-shape bundle and bad CLI combinations are refused)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from cloud_server.model import load_draft_inputs
from partition_tools.adapters import ModelAdapter, call_layer
from partition_tools.cli import main
from partition_tools.cloud_drafter import (CloudDrafterConfig, _front, _mixed_argmax, add_cloud_drafter, fit,
                                           table_of)
from partition_tools.draft_layers import Sequences
from shared.manifest import CLOUD_DRAFT_INPUTS, BundleError, Manifest

SPLIT = 2  # tiny_glm4_fp32_bundle: layers [0, 2) on the edge, [2, 4) in the cloud


@torch.no_grad()
def test_mixed_forward_equals_each_position_alone(tiny_glm4_lm):
    adapter = ModelAdapter(tiny_glm4_lm.model)
    ids = torch.randint(4, 512, (9,), generator=torch.Generator().manual_seed(1))
    _, h = _front(adapter, ids, SPLIT)
    approx = h + torch.randn(h.shape, generator=torch.Generator().manual_seed(2), dtype=h.dtype) * h.std()
    got = _mixed_argmax(adapter, h, approx, SPLIT)
    for t in range(ids.numel()):  # the true states before t, the approximate one at t, nothing after
        x = torch.cat([h[:t], approx[t:t + 1]]).float()[None]
        pos = torch.arange(t + 1)[None]
        cos_sin = adapter.position_embeddings(x, pos)
        for blk in adapter.layers[SPLIT:]:
            x = call_layer(blk, x, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
        assert int(got[t]) == int(adapter.lm_head(adapter.norm(x[0, -1])).argmax())


def test_fit_picks_its_strength_on_a_fold_and_tabulates_the_vocabulary(tiny_glm4_lm):
    adapter = ModelAdapter(tiny_glm4_lm.model)
    seqs = Sequences()
    g = torch.Generator().manual_seed(4)
    for _ in range(8):
        seqs.add_prose(torch.randint(4, 512, (48,), generator=g))
    w, report = fit(adapter, seqs, SPLIT)
    assert w.shape == (adapter.hidden_size + 1, adapter.hidden_size)
    assert report["positions"] == 8 * 48 and report["ridge_lambda"] in map(float, report["validation_mse"])
    table = table_of(adapter, w)
    assert table.shape == (adapter.vocab_size, adapter.hidden_size) and table.dtype == np.float16
    e = adapter.embed_tokens.weight[17].detach().double()
    np.testing.assert_allclose(table[17], (e @ w[:-1] + w[-1]).numpy(), rtol=2e-3, atol=2e-3)


def test_bundle_gets_the_table_and_the_server_loads_it(tiny_bundle_copy, tiny_glm4_lm, capsys):
    before = Manifest.load(tiny_bundle_copy).bundle_id
    r = add_cloud_drafter(tiny_glm4_lm, tiny_bundle_copy, CloudDrafterConfig(answer_tokens=0))
    m = Manifest.load(tiny_bundle_copy)
    assert m.bundle_id == before and m.artifacts[CLOUD_DRAFT_INPUTS].role == "cloud-draft"
    assert m.quant_report["cloud_drafter"] == r and 0.0 <= r["held_out_top1_agreement"] <= 1.0
    table = load_draft_inputs(tiny_bundle_copy, m)
    assert tuple(table.shape) == (m.vocab_size, m.hidden_size) and table.dtype == torch.float16
    path = tiny_bundle_copy / CLOUD_DRAFT_INPUTS
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="draft_inputs"):
        load_draft_inputs(tiny_bundle_copy, m)


def test_cli_refuses_cloud_with_layers_or_vocab(tiny_bundle_copy, capsys):
    assert main(["draft-head", str(tiny_bundle_copy), "--cloud", "--layers", "2"]) == 2
    assert "--cloud" in capsys.readouterr().err
    assert main(["draft-head", str(tiny_bundle_copy), "--cloud", "--vocab", "100"]) == 2


def test_a_ushape_bundle_cannot_have_a_cloud_drafter(split_bundle, tiny_glm4_lm):
    bundle = split_bundle("ushape-cd", tiny_glm4_lm, 1, "fp32", tail=1)
    with pytest.raises(BundleError, match="u-shape"):
        add_cloud_drafter(tiny_glm4_lm, bundle, CloudDrafterConfig(answer_tokens=0))


@pytest.fixture
def tiny_bundle_copy(tiny_glm4_fp32_bundle, tmp_path):
    out = tmp_path / "b"
    shutil.copytree(tiny_glm4_fp32_bundle, out)
    return out
