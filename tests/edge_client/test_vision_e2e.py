"""Images through the real server: a tiny GLM-4.1V bundle served by `autoglm-cloud serve`, the edge client
encoding screenshots on the device (vision ONNX, 3-D rope positions on the wire).

* greedy tokens equal the unsplit ``Glm4vForConditionalGeneration`` fed the same pixel values;
* the same screenshot again hits both prefix caches past the image; another screenshot with the same token
  ids does not (content digests in the keys), and still gets the unsplit model's answer;
* a corrupt image is a clear EdgeClientError and the next request is served.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from edge_client.client import EdgeClient
from edge_client.config import RetryPolicy
from edge_client.demo import LocalCloud
from edge_client.errors import EdgeClientError
from edge_client.vision import VisionSpec, decode_image, preprocess

IMG, BOI, EOI = 10, 12, 13
N_NEW = 16
RETRY = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=60.0, max_retries=5, backoff_initial_s=0.1,
                    backoff_max_s=0.5)
PROMPT = [int(t) for t in np.random.RandomState(3).randint(20, 500, 20)] + [BOI, IMG, EOI] + [30, 31, 32, 33]


@pytest.fixture(scope="module")
def lm():
    from partition_tools.models import load_model

    return load_model("tiny-glm4v")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, lm):
    from partition_tools.split import SplitConfig, split

    out = tmp_path_factory.mktemp("glm4v-e2e") / "b"
    split(lm, SplitConfig(layer=2, out=out, edge_quant="fp32"))
    return out


@pytest.fixture(scope="module")
def cloud(bundle, tmp_path_factory):
    with LocalCloud(bundle, log_path=tmp_path_factory.mktemp("log") / "cloud.log") as c:
        yield c


def _png(seed: int, h: int = 112, w: int = 168) -> bytes:
    rng = np.random.default_rng(seed)
    arr = np.full((h, w, 3), 240, np.uint8)
    for _ in range(8):
        y, x = rng.integers(0, h - 8), rng.integers(0, w - 8)
        arr[y:y + rng.integers(4, h // 2), x:x + rng.integers(4, w // 2)] = rng.integers(0, 255, 3)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@torch.no_grad()
def _reference(model, bundle, data: bytes) -> list[int]:
    img = preprocess(decode_image(data), VisionSpec.load(bundle))
    i = PROMPT.index(IMG)
    seq = PROMPT[:i] + [IMG] * img.n_tokens + PROMPT[i + 1:]
    pixels, grid = torch.from_numpy(img.pixel_values), torch.tensor([img.grid_thw])
    out = []
    for _ in range(N_NEW):
        x = torch.tensor([seq])
        t = int(model(input_ids=x, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(x == IMG).int(),
                      use_cache=False).logits[0, -1].argmax())
        out.append(t)
        seq.append(t)
    return out


def test_screenshots_through_the_real_server(lm, bundle, cloud):
    a, b = _png(1), _png(2)
    with EdgeClient(bundle, cloud.ws_url, codec="fp16", retry=RETRY, cache_block_tokens=16) as c:
        assert not c.media._vision  # nothing loaded yet: a text-only app never pays for the tower
        first = c.complete(prompt_ids=PROMPT, images=[a], max_tokens=N_NEW)
        assert first.token_ids == _reference(lm.model, bundle, a)
        st = first.stats
        assert st.image_tokens == 24 and st.prompt_tokens == len(PROMPT) - 1 + 24 and st.media_encode_s > 0
        again = c.complete(prompt_ids=PROMPT, images=[a], max_tokens=N_NEW)
        assert again.token_ids == first.token_ids
        assert again.stats.cached_tokens == 48 and again.stats.cloud_cached_tokens == 48  # past the image
        other = c.complete(prompt_ids=PROMPT, images=[b], max_tokens=N_NEW)
        assert other.stats.cached_tokens == 16 and other.stats.cloud_cached_tokens == 16  # text before it only
        assert other.token_ids == _reference(lm.model, bundle, b)
        with pytest.raises(EdgeClientError) as e:
            c.complete(prompt_ids=PROMPT, images=[a[: len(a) // 2]], max_tokens=4)
        assert e.value.code == "bad_image"
        with pytest.raises(EdgeClientError) as e:
            c.complete(prompt_ids=PROMPT, images=[a, b], max_tokens=4)
        assert e.value.code == "bad_media"
        assert c.complete(prompt_ids=PROMPT, images=[a], max_tokens=N_NEW).token_ids == first.token_ids


def test_local_openai_endpoint_takes_image_parts(bundle, cloud, tmp_path):
    """image_url parts (data URL, allow-listed local path) through the local OpenAI endpoint; usage counts
    the image tokens; bad input is a 400 with the reason, and the next request is served."""
    import base64

    from fastapi.testclient import TestClient

    from edge_client.local_api import create_app

    a = _png(1)
    (tmp_path / "shot.png").write_bytes(a)
    data_url = "data:image/png;base64," + base64.b64encode(a).decode()

    def body(url: str) -> dict:
        return {"model": "m", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "tap the button "},
                                                          {"type": "image_url", "image_url": {"url": url}}]}]}

    with EdgeClient(bundle, cloud.ws_url, codec="fp16", retry=RETRY) as c:
        http = TestClient(create_app(c, media_dir=tmp_path))
        ok = http.post("/v1/chat/completions", json=body(data_url))
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens_details"]["image_tokens"] == 24
        bad = http.post("/v1/chat/completions", json=body("data:image/png;base64," + base64.b64encode(a[:300]).decode()))
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_image"
        outside = http.post("/v1/chat/completions", json=body("/etc/hostname"))
        assert outside.status_code == 400 and outside.json()["error"]["code"] == "path_refused"
        local = http.post("/v1/chat/completions", json=body("shot.png"))
        assert local.status_code == 200 and local.json()["choices"][0]["message"]["content"] is not None
        u, first = local.json()["usage"], ok.json()["usage"]
        assert u["prompt_tokens"] == first["prompt_tokens"] and u["prompt_tokens_details"]["image_tokens"] == 24
        assert u["prompt_tokens_details"]["cached_tokens"] > 0  # the same picture, by path this time: a cache hit
