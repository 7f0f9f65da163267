"""GLM-4.1V split with its vision tower on the edge: export, and parity with the unsplit model.

The split pipeline (edge: numpy preprocessing, ``edge/vision.onnx``, 3-D rope positions, the front graph
with the visual embeddings at the image tokens; cloud: the back half's reference forward) against the
unsplit ``Glm4vForConditionalGeneration`` fed the same ``pixel_values``: the same greedy tokens over the
prefill and 16 decode steps, logits within 1e-4 (fp32 on both sides; the error is printed).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from PIL import Image

from edge_client.front import FRONT, FrontRuntime
from edge_client.mrope import ImageSpan, rope_index, text_positions
from edge_client.vision import VISION, VISION_CONFIG, VisionEncoder, VisionSpec, preprocess
from partition_tools.cloud_half import CloudModel
from partition_tools.export_vision import INT8_MAX_REL_ERROR

IMG, BOI, EOI = 10, 12, 13
DECODE_STEPS = 16


def _image(seed: int, h: int, w: int) -> Image.Image:
    """A screenshot-like picture: flat blocks and a few sharp bars (not noise)."""
    rng = np.random.default_rng(seed)
    arr = np.full((h, w, 3), rng.integers(180, 255, 3), np.uint8)
    for _ in range(6):
        y, x = rng.integers(0, h - 8), rng.integers(0, w - 8)
        arr[y:y + rng.integers(4, h // 2), x:x + rng.integers(4, w // 2)] = rng.integers(0, 255, 3)
    return Image.fromarray(arr)


def test_split_writes_the_tower_and_its_spec(tiny_glm4v_fp32_bundle):
    m = json.loads((tiny_glm4v_fp32_bundle / "manifest.json").read_text())
    assert m["artifacts"][VISION]["role"] == "edge" and m["artifacts"][VISION_CONFIG]["role"] == "edge"
    spec = json.loads((tiny_glm4v_fp32_bundle / VISION_CONFIG).read_text())
    assert spec["quant"] == "fp32" and spec["image_token_id"] == IMG and spec["merge_size"] == 2
    front = onnx.load(str(tiny_glm4v_fp32_bundle / FRONT), load_external_data=False)
    assert {"inputs_embeds", "embeds_mask"} <= {i.name for i in front.graph.input}


@pytest.mark.parametrize("hw", [(84, 112), (140, 56)])
def test_fp32_tower_equals_the_library_tower(tiny_glm4v_lm, tiny_glm4v_fp32_bundle, hw):
    enc = VisionEncoder(tiny_glm4v_fp32_bundle)
    assert not enc.loaded  # opened on first use
    p = preprocess(_image(1, *hw), enc.spec)
    got = enc.encode(p)
    with torch.no_grad():
        ref = tiny_glm4v_lm.model.model.get_image_features(torch.from_numpy(p.pixel_values),
                                                torch.tensor([p.grid_thw])).pooler_output[0].numpy()
    assert got.shape == ref.shape == (p.n_tokens, 64)
    assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


def test_int8_tower_stays_close(tiny_glm4v_lm, tiny_glm4v_int8_bundle):
    """The default split's tower (``export_vision(model, bundle, "int8")``, tests/conftest.py)."""
    spec = VisionSpec.load(tiny_glm4v_int8_bundle)
    assert spec.quant == "int8", spec.quant_report
    assert 0 < spec.quant_report["probe_max_rel_error"] <= INT8_MAX_REL_ERROR
    enc = VisionEncoder(tiny_glm4v_int8_bundle)
    p = preprocess(_image(2, 112, 112), enc.spec)
    with torch.no_grad():
        ref = tiny_glm4v_lm.model.model.get_image_features(torch.from_numpy(p.pixel_values),
                                                torch.tensor([p.grid_thw])).pooler_output[0].numpy()
    rel = np.abs(enc.encode(p) - ref).max() / np.abs(ref).max()
    print(f"int8 vision tower: max abs error / absmax = {rel:.4f}")
    assert rel <= INT8_MAX_REL_ERROR


def _prompt(parts, images, spec) -> tuple[list[int], list]:
    """parts: ints (text run lengths) or image indices -> ids with BOI, the image's tokens, EOI; prepared."""
    ids, prepared = [], []
    for k, p in enumerate(parts):
        if isinstance(p, str):
            img = preprocess(images[int(p)], spec)
            prepared.append(img)
            ids += [BOI] + [IMG] * img.n_tokens + [EOI]
        else:
            ids += [int(t) for t in np.random.default_rng(k).integers(20, 500, p)]
    return ids, prepared


def _split_run(bundle, ids, prepared, steps):
    """The split pipeline: greedy tokens and the logits of each step [steps + 1, V]."""
    enc, front = VisionEncoder(bundle), FrontRuntime(bundle, threads=1, chunk=16)
    cloud = CloudModel.from_bundle(bundle)
    spans = [ImageSpan(i + 1, p.grid_thw) for i, p in zip([i for i, t in enumerate(ids) if t == BOI], prepared,
                                                        strict=True)]  # tokens after each BOI
    positions, delta = rope_index(len(ids), spans, enc.spec.merge_size)  # [3, S]
    rows = np.zeros((len(ids), front.hidden_size), np.float32)
    mask = np.zeros(len(ids), np.bool_)
    for span, img in zip(spans, prepared):
        rows[span.start:span.start + img.n_tokens] = enc.encode(img)
        mask[span.start:span.start + img.n_tokens] = True
    hidden = [front.prefill_media(ids, positions, rows, mask)]  # [S, H]
    front.rope_delta = delta
    tokens, logits = [], []
    for step in range(steps + 1):
        h = torch.from_numpy(np.concatenate(hidden))[None]  # [1, T, H]
        t = h.shape[1]
        pos3 = np.concatenate([positions, text_positions(len(ids), t - len(ids), delta)], axis=1)  # [3, T]
        out = cloud(h, torch.arange(t)[None], torch.from_numpy(pos3)[:, None])[0, -1]  # [V]
        logits.append(out.numpy())
        tokens.append(int(out.argmax()))
        if step < steps:
            hidden.append(front.decode(tokens[-1]))
    return tokens, np.stack(logits)


@torch.no_grad()
def _reference_run(model, ids, prepared, steps):
    """The unsplit model, whole sequence per step, fed the same pixel_values."""
    pixels = torch.from_numpy(np.concatenate([p.pixel_values for p in prepared]))
    grids = torch.tensor([p.grid_thw for p in prepared])
    seq, tokens, logits = list(ids), [], []
    for _ in range(steps + 1):
        x = torch.tensor([seq])
        out = model(input_ids=x, pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=(x == IMG).int(),
                    use_cache=False).logits[0, -1]
        logits.append(out.numpy())
        tokens.append(int(out.argmax()))
        seq.append(tokens[-1])
    return tokens, np.stack(logits)


@pytest.mark.parametrize("parts", [[7, "0", 5], [4, "0", 6, "1", 3]], ids=["one-image", "two-images"])
def test_split_matches_unsplit_greedy(tiny_glm4v_lm, tiny_glm4v_fp32_bundle, parts):
    images = [_image(3, 84, 140), _image(4, 112, 56)]
    spec = VisionEncoder(tiny_glm4v_fp32_bundle).spec
    ids, prepared = _prompt(parts, images, spec)
    ref_tokens, ref_logits = _reference_run(tiny_glm4v_lm.model, ids, prepared, DECODE_STEPS)
    tokens, logits = _split_run(tiny_glm4v_fp32_bundle, ids, prepared, DECODE_STEPS)
    err = float(np.abs(logits - ref_logits).max())
    print(f"{len(prepared)} image(s), {len(ids)} prompt tokens: max abs logit error {err:.2e} over "
          f"{DECODE_STEPS + 1} steps")
    assert tokens == ref_tokens
    assert err <= 1e-4


def test_int8_front_takes_media_rows(tiny_glm4v_int8_bundle):
    """The default int8 split: the embeddings input survives quantization; without media rows the front
    computes exactly its text output, with them the rows change it."""
    out = tiny_glm4v_int8_bundle
    assert json.loads((out / VISION_CONFIG).read_text())["quant"] == "int8"
    ids = [int(t) for t in np.random.default_rng(5).integers(20, 500, 12)]
    text = FrontRuntime(out, threads=1).prefill(ids)
    rows = np.random.default_rng(6).standard_normal((12, 64)).astype(np.float32)
    none = FrontRuntime(out, threads=1).prefill_media(ids, None, rows, np.zeros(12, np.bool_))
    np.testing.assert_array_equal(none, text)
    mask = np.zeros(12, np.bool_)
    mask[4:8] = True
    some = FrontRuntime(out, threads=1).prefill_media(ids, None, rows, mask)
    np.testing.assert_array_equal(some[:4], text[:4])  # causal: rows before the media are untouched
    assert np.abs(some[4:] - text[4:]).max() > 1e-3


def test_exports_do_not_warn_about_torchvision(capfd):
    """Every torch.onnx export (the vision tower, the audio encoder, the whole model) printed four 'W... torchvision
    is not installed. Skipping torchvision::nms' lines from torch's op registry: no graph here uses those ops,
    and a user took them for a missing dependency."""
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    from partition_tools.export import quiet_exporter_logs

    quiet_exporter_logs()  # what every export does first
    ONNXRegistry.from_torchlib()  # what torch.onnx.export(dynamo=True) builds, warning as it goes
    assert "torchvision" not in capfd.readouterr().err
