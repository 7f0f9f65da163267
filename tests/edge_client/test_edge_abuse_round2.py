"""Held-out abuse, round 2: ``autoglm-edge serve``'s local API with media parts, on one real uvicorn server over
a real EdgeClient (a tiny GLM-4.1V bundle; no cloud is needed: every request here is refused, or fails, before
any network traffic). Local paths outside ``--media-dir`` (``../``, absolute, a symlink inside pointing out),
paths no file system takes (NUL, too long), malformed data: URLs and input_audio parts, and an http image_url
naming this very server, which must not freeze the endpoint while it is fetched."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import httpx
import pytest

from local_server import local_server

from edge_client.client import EdgeClient
from edge_client.local_api import create_app


@pytest.fixture(scope="module")
def api(tiny_glm4v_fp32_bundle, tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    media = root / "media"
    media.mkdir()
    (root / "secret.png").write_bytes(b"\x89PNG not for the app")
    os.symlink(root / "secret.png", media / "link.png")
    os.symlink(root, media / "up")
    client = EdgeClient(tiny_glm4v_fp32_bundle, "ws://127.0.0.1:9/v1/split")  # never reached
    with local_server(create_app(client, media_dir=media)) as url:
        yield url, root, client
    client.close()


def _chat(base: str, part: dict, timeout: float = 30) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", timeout=timeout, json={
        "model": "m", "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "tap "}, part]}]})


def _image(url) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _code(r: httpx.Response) -> str:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    return r.json()["error"]["code"]


def test_local_paths_outside_the_media_dir_are_refused(api):
    base, root, _ = api
    for url in ("../secret.png", str(root / "secret.png"), f"file://{root / 'secret.png'}", "link.png",
                "up/secret.png", "up/media/../secret.png", "/etc/hostname", "/proc/self/environ"):
        assert _code(_chat(base, _image(url))) == "path_refused", url


def test_paths_no_file_system_takes_are_bad_media_not_500(api):
    base, _, _ = api
    for url in ("a\x00b.png", "x" * 5000 + ".png", "d/" * 3000 + "x.png", "missing.png", "%2e%2e/secret.png"):
        r = _chat(base, _image(url))
        assert _code(r) == "bad_media", (url[:30], r.text[:200])
        assert "x" * 300 not in r.json()["error"]["message"]  # a 5000-character name is not echoed whole


def test_malformed_data_urls_and_audio_parts_are_400s(api):
    base, _, _ = api
    cases = [
        (_image("data:image/png;base64,@@@"), "bad_media"),
        (_image("data:image/png,abc"), "bad_media"),
        (_image("data:image/png;base64,"), "bad_image"),
        (_image("data:image/png;base64," + "A" * 4_000_000), "bad_image"),  # 3 MB of zeros: no image
        (_image(None), "bad_media"),
        (_image(12), "bad_media"),
        ({"type": "input_audio", "input_audio": "UklGRg=="}, "bad_audio"),  # not an object
        ({"type": "input_audio", "input_audio": ["UklGRg=="]}, "bad_audio"),
        ({"type": "input_audio", "input_audio": {"data": "!!!"}}, "bad_audio"),
        ({"type": "input_audio", "input_audio": {"data": 12}}, "bad_audio"),
        ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "mp3"}}, "unsupported_format"),
    ]
    for part, code in cases:
        assert _code(_chat(base, part)) == code, part if len(str(part)) < 200 else str(part)[:80]


def test_an_image_url_naming_this_server_does_not_freeze_it(api):
    base, _, client = api
    assert client.media_policy.fetch_timeout_s >= 5  # the default 10 s: the endpoint used to wait all of it out
    t0 = time.monotonic()
    r = _chat(base, _image(base + "/health"))  # this endpoint answers its own fetch: JSON, not an image
    assert _code(r) == "bad_image" and "application/json" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 3
    # and while a fetch waits on a server that does not answer, the endpoint still does
    with _a_fetch_that_waits(base) as done:
        t1 = time.monotonic()
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        assert time.monotonic() - t1 < 1.5 and not done  # answered during the fetch


@contextlib.contextmanager
def _a_fetch_that_waits(base):
    """A chat request whose image_url names a server that accepts and never answers, sent on a thread; inside the
    block its fetch waits (``done`` stays empty); on leaving, the server closes and the request fails its fetch."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/shot.png"
        done: list[httpx.Response] = []
        th = threading.Thread(target=lambda: done.append(_chat(base, _image(url))))
        th.start()
        time.sleep(0.3)
        yield done
        silent.close()  # the fetch fails now (or times out)
        th.join(timeout=20)
    assert done and _code(done[0]) in ("fetch_failed", "fetch_timeout")


def test_a_request_with_media_never_waits_for_another_requests_media(api):
    """The local API prepared one request's media at a time: a second client's image (here a data: URL that is no
    image, refused at once) waited out the first one's fetch from a server that does not answer - up to
    fetch_timeout_s (10 s) for every request with media behind it. Each request's media are prepared on its own."""
    base, _, client = api
    with _a_fetch_that_waits(base) as done:
        t0 = time.monotonic()
        r = _chat(base, _image("data:image/png;base64,AAAA"))
        assert _code(r) == "bad_image" and time.monotonic() - t0 < 3 and not done  # while the fetch waits


def test_requests_side_by_side_open_one_vision_encoder(tiny_glm4v_fp32_bundle, monkeypatch):
    """Since requests' media are prepared side by side, two first images at once each created the bundle's
    VisionEncoder (a race on MediaEncoders.vision: two graphs loaded, one dropped - twice a phone's tower memory
    for a while). Here its opening takes 50 ms, as a slow disk's read of the spec would."""
    from edge_client import vision
    from edge_client.media import MediaEncoders

    opened = []
    real = vision.VisionEncoder.__init__

    def slow_open(self, *a, **kw):
        real(self, *a, **kw)
        opened.append(self)
        time.sleep(0.05)

    monkeypatch.setattr(vision.VisionEncoder, "__init__", slow_open)
    encoders = MediaEncoders(tiny_glm4v_fp32_bundle)
    got = []
    threads = [threading.Thread(target=lambda: got.append(encoders.vision)) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(opened) == 1 and all(g is opened[0] for g in got)


def test_requests_side_by_side_decode_their_media_one_at_a_time(api, monkeypatch):
    """Fetched side by side (above), but decoded and encoded one request at a time: four 40 MP photos at once
    would hold four times the ~0.5 GB one takes while it is decoded."""
    from PIL import Image

    from edge_client import vision
    from edge_client.client import _sampling_defaults

    _, _, client = api
    inside, most = [], []
    real = vision.VisionEncoder.prepared

    def timed(self, *a, **kw):
        inside.append(1)
        most.append(len(inside))
        time.sleep(0.1)
        try:
            return real(self, *a, **kw)
        finally:
            inside.pop()

    monkeypatch.setattr(vision.VisionEncoder, "prepared", timed)
    prompt = "what is here? " + client._placeholder("image")

    def spec():
        client._spec(prompt, None, None, None, None, [Image.new("RGB", (64, 64), (9, 90, 200))], None,
                     **_sampling_defaults({}))

    threads = [threading.Thread(target=spec) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(most) == 3 and max(most) == 1


def test_no_fetch_urls_refuses_http_image_urls_without_fetching(api):
    """``autoglm-edge serve --no-fetch-urls``: an http(s) image_url is url_refused, nothing is fetched (the URL
    names a port where nothing listens, which a fetch would answer fetch_failed)."""
    from dataclasses import replace

    from fastapi.testclient import TestClient

    from edge_client.cli import build_parser

    _, _, client = api
    before = client.media_policy
    try:
        app = create_app(client, fetch_urls=False)
        with TestClient(app, base_url="http://127.0.0.1") as tc:  # a loopback Host ("testserver" is refused 403)
            r = tc.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "tap "}, _image("http://127.0.0.1:9/x.png")]}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "url_refused"
    finally:
        client.media_policy = replace(before)
    assert build_parser().parse_args(["serve", "--bundle", "b", "--no-fetch-urls"]).fetch_urls is False
    assert build_parser().parse_args(["serve", "--bundle", "b"]).fetch_urls is True
