"""Images through the real server: a tiny GLM-4.1V bundle served by `autoglm-cloud serve`, the edge client
encoding screenshots on the device (vision ONNX, 3-D rope positions on the wire).

* greedy tokens equal the unsplit ``Glm4vForConditionalGeneration`` fed the same pixel values;
* the same screenshot again hits both prefix caches past the image; another screenshot with the same token
  ids does not (content digests in the keys), and still gets the unsplit model's answer;
* a corrupt image is a clear EdgeClientError and the next request is served;
* ``http`` image URLs are fetched by the phone within its size and time limits (a local HTTP server).
"""

from __future__ import annotations

import io
import re

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
def bundle(tiny_glm4v_fp32_bundle):
    return tiny_glm4v_fp32_bundle


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


def test_screenshots_through_the_real_server(tiny_glm4v_lm, bundle, cloud):
    a, b = _png(1), _png(2)
    with EdgeClient(bundle, cloud.ws_url, codec="fp16", retry=RETRY, cache_block_tokens=16) as c:
        assert not c.media._vision  # nothing loaded yet: a text-only app never pays for the tower
        first = c.complete(prompt_ids=PROMPT, images=[a], max_tokens=N_NEW)
        assert first.token_ids == _reference(tiny_glm4v_lm.model, bundle, a)
        st = first.stats
        assert st.image_tokens == 24 and st.prompt_tokens == len(PROMPT) - 1 + 24 and st.media_encode_s > 0
        again = c.complete(prompt_ids=PROMPT, images=[a], max_tokens=N_NEW)
        assert again.token_ids == first.token_ids
        assert again.stats.cached_tokens == 48 and again.stats.cloud_cached_tokens == 48  # past the image
        other = c.complete(prompt_ids=PROMPT, images=[b], max_tokens=N_NEW)
        assert other.stats.cached_tokens == 16 and other.stats.cloud_cached_tokens == 16  # text before it only
        assert other.token_ids == _reference(tiny_glm4v_lm.model, bundle, b)
        with pytest.raises(EdgeClientError) as e:
            c.complete(prompt_ids=PROMPT, images=[a[: len(a) // 2]], max_tokens=4)
        assert e.value.code == "bad_image"
        with pytest.raises(EdgeClientError) as e:
            c.complete(prompt_ids=PROMPT, images=[a, b], max_tokens=4)
        assert e.value.code == "bad_media"
        assert c.complete(prompt_ids=PROMPT, images=[a], max_tokens=N_NEW).token_ids == first.token_ids


def test_a_chats_earlier_screenshots_are_not_encoded_again(bundle, cloud):
    """A 3-turn chat, one new screenshot per turn, each turn's prompt the whole history: the images inside the
    prefix the activation cache covers are not run through the tower again (turn 3 encodes only its own: each
    image's rows end before the last full block of the turn that brought it), and the answers equal those of a client without the cache (which encodes every image each turn)."""
    def chat(c) -> tuple[list[list[int]], list[int]]:
        ids, images, answers, runs = [], [], [], []
        for turn in range(3):
            ids += [int(t) for t in np.arange(20) + 40 * turn + 20] + [BOI, IMG, EOI] + list(range(30, 50))
            images.append(_png(10 + turn))
            before = c.media.vision.graph.runs if c.media._vision is not None else 0
            g = c.complete(prompt_ids=ids, images=images, max_tokens=6)
            runs.append(c.media.vision.graph.runs - before)
            answers.append(g.token_ids)
            ids += g.token_ids
        return answers, runs

    with EdgeClient(bundle, cloud.ws_url, codec="fp16", retry=RETRY, cache_block_tokens=16) as c:
        cached, runs = chat(c)
    assert runs == [1, 1, 1]
    with EdgeClient(bundle, cloud.ws_url, codec="fp16", retry=RETRY, cache_block_tokens=16,
                    cache_prompts=False) as c:
        plain, plain_runs = chat(c)
    assert plain_runs == [1, 2, 3] and cached == plain


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
        http = TestClient(create_app(c, media_dir=tmp_path), base_url="http://127.0.0.1")  # a loopback Host (not testserver: 403)
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


class _ImageServer:
    """A local HTTP server (stdlib, in a thread) with one path per fetch outcome; ``url(name)``."""

    def __init__(self, png: bytes, limit: int):
        import http.server
        import threading
        import time

        big = png + b"\0" * (2 * limit)

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, body: bytes, ctype: str, length: bool = True, pause: float = 0.0) -> None:
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                if length:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                step = max(1, len(body) // 8) if pause else len(body)
                try:
                    for i in range(0, len(body), step):
                        self.wfile.write(body[i:i + step])
                        self.wfile.flush()
                        time.sleep(pause)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the phone gave up on it (over the size or time limit)

            def do_GET(self):  # noqa: N802 - http.server's name
                routes = {"/shot.png": lambda: self._reply(png, "image/png"),
                          "/big.png": lambda: self._reply(big, "image/png"),  # refused by its Content-Length
                          "/big-stream.png": lambda: self._reply(big, "image/png", length=False),  # while reading
                          "/slow.png": lambda: self._reply(png, "image/png", pause=0.3),  # 8 x 0.3 s > 1 s
                          "/page.html": lambda: self._reply(b"<html>not a picture</html>", "text/html"),
                          "/s3-object": lambda: self._reply(png, "binary/octet-stream")}  # S3's untyped object
                route = routes.get(self.path)
                if route is None:
                    self.send_error(404)
                else:
                    route()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{name}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_http_image_urls_are_fetched_by_the_phone_within_limits(tiny_glm4v_lm, bundle, cloud):
    """image_url http URLs, fetched on the phone: success (the same tokens as the bytes themselves); over the
    size limit (by Content-Length and while streaming), a server slower than the time limit, a non-image
    content type, a 404: each a clear EdgeClientError (a 400 on the local endpoint), the next request served."""
    from fastapi.testclient import TestClient

    from edge_client.local_api import create_app
    from edge_client.media import MediaPolicy

    a = _png(1)
    policy = MediaPolicy(max_bytes=len(a) + 512, fetch_timeout_s=1.0)

    def msgs(url: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": "tap it "},
                                             {"type": "image_url", "image_url": {"url": url}}]}]

    with _ImageServer(a, policy.max_bytes) as srv, \
            EdgeClient(bundle, cloud.ws_url, media_policy=policy, codec="fp16", retry=RETRY) as c:
        ok = c.complete(prompt_ids=PROMPT, images=[srv.url("shot.png")], max_tokens=N_NEW)
        assert ok.token_ids == _reference(tiny_glm4v_lm.model, bundle, a)
        for name, code in (("big.png", "image_too_large"), ("big-stream.png", "image_too_large"),
                           ("slow.png", "fetch_timeout"), ("page.html", "bad_image"), ("missing.png", "fetch_failed")):
            with pytest.raises(EdgeClientError) as e:
                c.complete(messages=msgs(srv.url(name)), max_tokens=4)
            assert e.value.code == code, (name, e.value)
            assert name in str(e.value)  # the message names the URL
        assert "HTTP 404" in str(e.value)
        again = c.complete(prompt_ids=PROMPT, images=[srv.url("shot.png")], max_tokens=N_NEW)
        assert again.token_ids == ok.token_ids  # the next request is served
        # an object uploaded to S3 without a type is served as binary/octet-stream: it was bad_image 'not an image'
        assert c.complete(prompt_ids=PROMPT, images=[srv.url("s3-object")], max_tokens=N_NEW).token_ids == ok.token_ids
        http = TestClient(create_app(c), base_url="http://127.0.0.1")  # a loopback Host (not testserver: 403)
        body = {"model": "m", "max_tokens": 4, "temperature": 0}
        for name, code in (("slow.png", "fetch_timeout"), ("page.html", "bad_image")):
            r = http.post("/v1/chat/completions", json={**body, "messages": msgs(srv.url(name))})
            assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
        r = http.post("/v1/chat/completions", json={**body, "messages": msgs(srv.url("shot.png"))})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["image_tokens"] == 24


def test_a_prompt_over_the_clouds_limit_is_refused_before_encoding_or_upload(bundle, tmp_path, monkeypatch):
    """Once a session is open the phone knows the cloud's limits (Welcome): a screenshot whose rows would take
    the prompt past the cloud's prompt limit is refused before the vision tower runs, and a text prompt over it
    before any state is uploaded - the cloud used to refuse them after the phone's work."""
    with LocalCloud(bundle, extra_args=["--max-prompt-tokens", "40"], log_path=tmp_path / "cloud.log") as cloud, \
            EdgeClient(bundle, cloud.ws_url, codec="fp16", retry=RETRY) as c:
        assert c.complete(prompt_ids=PROMPT[:10], max_tokens=2).stats.completion_tokens == 2  # the session is open
        monkeypatch.setattr(type(c.media.vision), "encode", lambda *a: pytest.fail("the tower ran"))
        with pytest.raises(EdgeClientError, match="the cloud's prompt limit of 40") as e:
            c.complete(prompt_ids=PROMPT, images=[_png(1)], max_tokens=2)  # 26 tokens + 24 rows
        assert e.value.code == "context_full"
        up = c.session.link.bytes_up
        with pytest.raises(ValueError, match="prompt of 41 tokens exceeds the cloud's prompt limit of 40"):
            c.complete(prompt_ids=[int(t) for t in np.arange(41) + 20], max_tokens=2)
        assert c.session.link.bytes_up == up
        monkeypatch.undo()
        assert c.complete(prompt_ids=[BOI, IMG, EOI, 30], images=[_png(1)], max_tokens=2).stats.image_tokens == 24


def _counter(cloud, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"{cloud.http_url}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.eE+-]+)$", text, re.M))


def test_an_agents_steps_count_their_whole_prompts_on_the_servers_counters(bundle, cloud):
    """Two agent steps (a long instruction and a screenshot, then the history and a new one): the server's prompt
    and prefix-cache counters grow by each step's whole prompt and its cached part, as the client's stats say. They
    counted the first Prefill chunk only - 128 of the first step's 325 positions - so the prefix hit rate of an
    agent's dashboard read 0 / 128, then hits over whole prompts."""
    names = ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    ids = [int(t) for t in np.random.RandomState(5).randint(20, 500, 300)] + [BOI, IMG, EOI]
    with EdgeClient(bundle, cloud.ws_url, codec="fp16", retry=RETRY, prefill_chunk=128) as c:
        for step in range(2):
            before = [_counter(cloud, n) for n in names]
            g = c.complete(prompt_ids=ids, images=[_png(20 + k) for k in range(step + 1)], max_tokens=4)
            grew = [_counter(cloud, n) - b for n, b in zip(names, before)]
            st = g.stats
            assert st.prompt_tokens > 300 and (step == 0) == (st.cloud_cached_tokens == 0)
            assert grew == [st.prompt_tokens, st.prompt_tokens, st.cloud_cached_tokens], (step, grew, st.to_dict())
            ids += g.token_ids + [int(t) for t in np.arange(20) + 40] + [BOI, IMG, EOI]
