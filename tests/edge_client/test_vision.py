"""edge_client.vision: the phone's preprocessing against transformers' own GLM-4.1V image processor, the
tower's data-dependent inputs against the library's, and bad input refused with a clear MediaError."""

from __future__ import annotations

import io
from dataclasses import asdict

import numpy as np
import pytest
import torch
from PIL import Image

from edge_client.vision import (MediaError, VisionSpec, decode_image, position_grid, preprocess, smart_resize,
                                vision_rotary, visual_tokens)

PIXEL_TOLERANCE = 1e-6  # max abs difference of normalised pixel values (observed: 0, the same PIL resize)


@pytest.fixture(scope="module")
def spec() -> VisionSpec:
    from partition_tools.export_vision import vision_spec
    from partition_tools.models import tiny_glm4v_config

    raw = asdict(vision_spec(tiny_glm4v_config(), "fp32"))
    return VisionSpec(**{**raw, "image_mean": tuple(raw["image_mean"]), "image_std": tuple(raw["image_std"])})


@pytest.fixture(scope="module")
def processor():
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    return Glm4vImageProcessorPil()


def _screenshot(h: int, w: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    arr = np.full((h, w, 3), 245, np.uint8)
    for _ in range(12):
        y, x = rng.integers(0, h - 4), rng.integers(0, w - 4)
        arr[y:y + rng.integers(2, max(3, h // 4)), x:x + rng.integers(2, max(3, w // 3))] = rng.integers(0, 255, 3)
    arr[::7, ::3] = rng.integers(0, 255, 3)  # text-like high-frequency detail
    img = Image.fromarray(arr)
    return img.convert(mode) if mode != "RGB" else img


def _encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("h,w,budget", [
    (200, 300, None),  # small: rounded to multiples of 28
    (2400, 1080, None),  # a phone screenshot at the model's default budget
    (2400, 1080, 1_000_000),  # ... at a smaller budget: downscaled
    (1600, 720, 200_000),
    (20, 50, None),  # below the patch grid: upscaled
])
def test_pixels_and_grid_match_the_model_processor(spec, processor, h, w, budget):
    img = _screenshot(h, w)
    kw = {} if budget is None else {"size": {"shortest_edge": spec.min_pixels, "longest_edge": budget}}
    ref = processor(images=img, return_tensors="np", **kw)
    got = preprocess(img, spec, budget)
    assert list(got.grid_thw) == ref["image_grid_thw"][0].tolist()
    assert got.pixel_values.shape == ref["pixel_values"].shape
    assert np.abs(got.pixel_values - ref["pixel_values"]).max() <= PIXEL_TOLERANCE
    assert got.n_tokens == visual_tokens(h, w, spec, budget) == ref["pixel_values"].shape[0] // 4


def test_decoded_formats_match_the_processor_on_the_same_file(spec, processor):
    """PNG with transparency (composited on white) and JPEG: decode + preprocess as the processor does."""
    for img, fmt in [(_screenshot(300, 200, 1, "RGBA"), "PNG"), (_screenshot(310, 190, 2), "JPEG")]:
        data = _encoded(img, fmt)
        ref = processor(images=Image.open(io.BytesIO(data)), return_tensors="np")
        got = preprocess(decode_image(data), spec)
        assert np.abs(got.pixel_values - ref["pixel_values"]).max() <= PIXEL_TOLERANCE


def test_the_lookup_gives_the_processors_floats_with_one_full_size_float_array(spec):
    """preprocess normalizes through a per-channel table of the 256 levels: bit-identical to the processor's
    float64 rescale + float32 normalize, and its peak (numpy) memory is the tower input plus a little - the
    full-size float64 / float32 intermediates (a 40 MP upload peaked at ~800 MB RSS) are gone."""
    import tracemalloc

    from edge_client.vision import patchify

    rng = np.random.default_rng(7)
    for h, w, budget in [(200, 300, None), (901, 433, None), (1200, 700, 300_000)]:
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        got = preprocess(img, spec, budget)
        rh, rw = got.grid_thw[1] * spec.patch_size, got.grid_thw[2] * spec.patch_size
        x = np.asarray(img.resize((rw, rh), resample=Image.Resampling.BICUBIC), np.uint8).astype(np.float64) / 255
        x = x.astype(np.float32).transpose(2, 0, 1)
        x = (x - np.asarray(spec.image_mean, np.float32)[:, None, None]) / np.asarray(spec.image_std,
                                                                                     np.float32)[:, None, None]
        ref = patchify(x, spec.patch_size, spec.merge_size, spec.temporal_patch_size)
        assert got.pixel_values.dtype == np.float32 and np.array_equal(got.pixel_values, ref)
    img = Image.fromarray(rng.integers(0, 256, (2400, 1080, 3), dtype=np.uint8))
    tracemalloc.start()
    try:
        out = preprocess(img, spec).pixel_values
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * out.nbytes  # the float64 path peaked at ~2.6x


def test_smart_resize_equals_the_library(spec):
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize as ref

    rng = np.random.default_rng(0)
    for _ in range(300):
        h, w = int(rng.integers(28, 4000)), int(rng.integers(28, 4000))
        if max(h, w) / min(h, w) > 200:
            continue
        budget = int(rng.integers(spec.min_pixels, 12_000_000))
        assert smart_resize(h, w, 28, spec.min_pixels, budget) == ref(2, h, w, 2, 28, spec.min_pixels, budget)


def test_the_digest_names_the_content(spec):
    a, b = _screenshot(280, 140, 1), _screenshot(280, 140, 2)
    assert preprocess(a, spec).digest == preprocess(a.copy(), spec).digest
    assert preprocess(a, spec).digest != preprocess(b, spec).digest
    assert preprocess(a, spec).digest != preprocess(a, spec, spec.min_pixels).digest  # another budget


def test_tower_inputs_equal_the_library(spec):
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionRotaryEmbedding
    from transformers.vision_utils import get_vision_position_ids

    from partition_tools.models import tiny_glm4v_config

    vc = tiny_glm4v_config().vision_config
    grid = torch.tensor([[1, 6, 10]])
    pos = get_vision_position_ids(grid, 2)  # [N, 2]
    cos, sin = Glm4vVisionRotaryEmbedding(vc)(torch.zeros(1), pos)
    got_cos, got_sin = vision_rotary(6, 10, 2, spec.head_dim, spec.rope_theta)
    np.testing.assert_allclose(got_cos, cos.numpy(), atol=1e-6)
    np.testing.assert_allclose(got_sin, sin.numpy(), atol=1e-6)
    g = position_grid(6, 10, 2)[0, :, 0]  # [N, 2] (w, h)
    np.testing.assert_allclose(g[:, 0], (pos[:, 1].numpy() + 0.5) / 10 * 2 - 1, atol=1e-6)
    np.testing.assert_allclose(g[:, 1], (pos[:, 0].numpy() + 0.5) / 6 * 2 - 1, atol=1e-6)


@pytest.mark.parametrize("data,code", [
    (b"", "bad_image"),  # empty
    (b"\x89PNG\r\n\x1a\n" + b"garbage" * 20, "bad_image"),  # corrupt
    (b"not an image at all", "bad_image"),
])
def test_bad_bytes_are_refused(data, code):
    with pytest.raises(MediaError) as e:
        decode_image(data)
    assert e.value.code == code


def test_truncated_unsupported_and_oversized_are_refused(spec):
    png = _encoded(_screenshot(200, 200), "PNG")
    with pytest.raises(MediaError, match="decode") as e:
        decode_image(png[: len(png) // 2])
    assert e.value.code == "bad_image"
    with pytest.raises(MediaError, match="unsupported image format") as e:
        decode_image(_encoded(_screenshot(64, 64), "TIFF"))
    assert e.value.code == "unsupported_format"
    with pytest.raises(MediaError, match="pixel limit") as e:
        decode_image(png, max_pixels=100 * 100)
    assert e.value.code == "image_too_large"
    with pytest.raises(MediaError, match="byte limit"):
        decode_image(png, max_bytes=100)
    with pytest.raises(MediaError, match="aspect ratio"):
        preprocess(Image.new("RGB", (28 * 250, 28)), spec)
    with pytest.raises(MediaError, match="below the model's minimum"):
        preprocess(_screenshot(100, 100), spec, 100)
