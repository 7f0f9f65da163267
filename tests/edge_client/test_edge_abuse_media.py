"""Held-out abuse, round 3: the media boundary of ``autoglm-edge serve``, as an outside tester throws at it, through
real HTTP (httpx and the official ``openai`` client) on real uvicorn servers: one over a tiny GLM-4.1V bundle (a
vision tower), one over the same model with only an audio encoder, both in front of one real ``autoglm-cloud
serve`` (the two bundles share their cloud half), so that after every refusal a normal request is answered. Each
test's docstring says what used to go wrong, if anything did."""

from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import time
import zlib
from dataclasses import replace

import httpx
import numpy as np
import openai
import pytest
from local_server import local_server
from media_support import tone, wav
from PIL import Image

from edge_client.audio import AudioEncoder, decode_wav
from edge_client.client import EdgeClient
from edge_client.config import RetryPolicy
from edge_client.errors import EdgeClientError
from edge_client.local_api import create_app
from edge_client.vision import VisionEncoder, decode_image, load_image, open_image

RETRY = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=60.0, max_retries=3, backoff_initial_s=0.1,
                    backoff_max_s=0.5)


@pytest.fixture(scope="module")
def served(tiny_glm4v_fp32_bundle, tiny_glm4v_audio_bundle, tmp_path_factory):
    """(vision endpoint URL, audio endpoint URL, vision EdgeClient, audio EdgeClient)."""
    from edge_client.demo import LocalCloud

    with LocalCloud(tiny_glm4v_fp32_bundle, log_path=tmp_path_factory.mktemp("log") / "cloud.log") as cloud, \
            EdgeClient(tiny_glm4v_fp32_bundle, cloud.ws_url, codec="fp16", retry=RETRY) as vc, \
            EdgeClient(tiny_glm4v_audio_bundle, cloud.ws_url, codec="fp16", retry=RETRY) as ac:
        assert vc.manifest.bundle_id == ac.manifest.bundle_id  # one cloud half: one cloud serves both
        with local_server(create_app(vc)) as v, local_server(create_app(ac)) as a:
            yield v, a, vc, ac


# -- helpers ----------------------------------------------------------------------------------------------------


def _chat(base: str, *parts: dict, max_tokens: int = 3) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": "m", "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "look "}, *parts]}]})


def _code(r: httpx.Response) -> str:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err  # OpenAI's error shape
    return err["code"]


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text[:300]
    return r.json()


def _encoded(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _audio(data: bytes | str, fmt: str | None = "wav") -> dict:
    part = {"data": base64.b64encode(data).decode() if isinstance(data, bytes) else data}
    if fmt is not None:
        part["format"] = fmt
    return {"type": "input_audio", "input_audio": part}


NORMAL_IMAGE = _image(_data_url(_encoded(Image.new("RGB", (64, 64), (200, 30, 30)))))
NORMAL_AUDIO = _audio(wav(tone(0.5)))


def _png_bomb(w: int, h: int, rows: int | None = None) -> bytes:
    """A grayscale PNG of ``w x h`` zero pixels, of which ``rows`` (default all) are in its data: a few KB."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z = zlib.compressobj(9)
    row = bytes(w + 1)
    idat = b"".join(z.compress(row) for _ in range(h if rows is None else rows)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def _riff(samples: bytes, rate: int = 16000, width: int = 2, channels: int = 1, frames: int | None = None,
          tag: int = 1, extensible: bool = False) -> bytes:
    """A WAV file written by hand: any sample width, format tag (1 PCM, 3 float) and declared frame count;
    ``extensible``: the tag as WAVE_FORMAT_EXTENSIBLE's sub-format (as ffmpeg writes 24-bit or multichannel)."""
    n = len(samples) // (width * channels) if frames is None else frames
    fmt = struct.pack("<HHIIHH", 0xFFFE if extensible else tag, channels, rate, rate * width * channels,
                      width * channels, width * 8)
    if extensible:  # cbSize, valid bits, channel mask, SubFormat GUID (the tag, then KSDATAFORMAT's fixed tail)
        fmt += struct.pack("<HHIH", 22, width * 8, 4, tag) + bytes.fromhex("000000001000800000aa00389b71")
    body = (b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", n * width * channels)
            + samples)
    return b"RIFF" + struct.pack("<I", len(body)) + body


@pytest.fixture
def no_tower(monkeypatch):
    """Every encoder run fails the request loudly (a 500): a refusal must come before any."""
    runs: list[str] = []

    def refuse(kind):
        def encode(self, *args, **kwargs):
            runs.append(kind)
            raise AssertionError(f"the {kind} encoder ran")
        return encode

    monkeypatch.setattr(VisionEncoder, "encode", refuse("image"))
    monkeypatch.setattr(AudioEncoder, "encode", refuse("audio"))
    return runs


# -- images -----------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # PIL warns past 89 Mpx
def test_decompression_bombs_are_refused_from_their_header_before_any_decode_or_tower(served, no_tower):
    """30000 x 30000 (past PIL's own guard) and 10000 x 10000 (past the 40 Mpx limit): image_too_large. A 38 KB PNG
    of 6300 x 6300 is within the pixel limit, but its 7396 visual tokens can never fit the edge graph's 2048
    positions: context_full at once, from its header (it used to be decoded and run through the tower - 36 s and
    14 GB of RSS on this bundle - before the cloud refused it). Through the official openai client."""
    v, _, _, _ = served
    client = openai.OpenAI(base_url=v + "/v1", api_key="none", max_retries=0, timeout=60)

    def ask(png: bytes):
        return client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is it?"}, _image(_data_url(png))]}])

    for png, code in ((_png_bomb(30000, 30000, rows=2), "image_too_large"),
                      (_png_bomb(10000, 10000, rows=2), "image_too_large"),
                      (_png_bomb(6300, 6300), "context_length_exceeded")):  # OpenAI's code for context_full
        assert len(png) < 64_000
        t0 = time.monotonic()
        with pytest.raises(openai.BadRequestError) as e:
            ask(png)
        assert e.value.code == code and time.monotonic() - t0 < 5, e.value
    assert "7396 tokens" in str(e.value)
    assert no_tower == []


def test_too_many_images_are_refused_before_any_is_encoded(served, no_tower, monkeypatch):
    """300 one-pixel images (9 visual tokens each: 2700 > 2048 positions; no documented count limit, the
    positions are the limit): context_full without one tower run (the first 139 used to be encoded first). 50 of
    them fit and are answered."""
    v, _, _, _ = served
    one = _image(_data_url(_encoded(Image.new("RGB", (1, 1)))))
    r = _chat(v, *[one] * 300)
    assert _code(r) == "context_length_exceeded" and "image 140 of 300" in r.json()["error"]["message"]
    assert no_tower == []
    monkeypatch.undo()  # the tower back
    assert _ok(_chat(v, *[one] * 50))["usage"]["prompt_tokens_details"]["image_tokens"] == 50 * 9


def test_exif_orientation_is_applied(served):
    """A photo stored sideways with EXIF Orientation 6 (rotate 90 degrees clockwise to view: what phone cameras
    write) is seen upright, as a viewer and transformers' load_image show it; it used to reach the tower sideways."""
    v, _, _, _ = served
    rng = np.random.default_rng(0)
    sideways = Image.fromarray(rng.integers(0, 256, (60, 150, 3), dtype=np.uint8))  # 150 wide, 60 high
    upright = sideways.transpose(Image.Transpose.ROTATE_270)  # 90 degrees clockwise: 60 wide, 150 high
    exif = Image.Exif()
    exif[0x0112] = 6
    tagged = _encoded(sideways, exif=exif.tobytes())
    plain = _encoded(upright)
    assert decode_image(tagged).size == (60, 150)
    assert np.array_equal(np.asarray(decode_image(tagged)), np.asarray(decode_image(plain)))
    a = _ok(_chat(v, _image(_data_url(tagged)), max_tokens=6))
    b = _ok(_chat(v, _image(_data_url(plain)), max_tokens=6))
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]


def test_a_photo_whose_exif_pil_cannot_write_back_is_turned_upright(served):
    """A sideways photo (Orientation 6) whose EXIF holds a tag PIL reads but cannot write back (MaxSampleValue,
    SHORT by the standard, stored as text: a quirky camera's writer) failed inside ImageOps.exif_transpose, which
    rewrites the metadata - struct.error out of generate(), a 500 on the local API; it is turned upright (the
    same transpose) and answered as the upright picture."""
    v, _, _, _ = served
    rng = np.random.default_rng(3)
    sideways = Image.fromarray(rng.integers(0, 256, (60, 150, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112], exif[0x010F] = 6, "Cam"
    raw = exif.tobytes()
    quirky = raw.replace(b"\x01\x0f\x00\x02", b"\x01\x19\x00\x02")  # Make (0x010F, ASCII) as tag 0x0119
    assert quirky != raw
    photo = _encoded(sideways, "JPEG", quality=95, exif=quirky)
    plain = _encoded(Image.open(io.BytesIO(_encoded(sideways, "JPEG", quality=95))).transpose(
        Image.Transpose.ROTATE_270))
    a = _ok(_chat(v, _image(_data_url(photo, "image/jpeg")), max_tokens=6))
    b = _ok(_chat(v, _image(_data_url(plain)), max_tokens=6))
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]


def test_odd_but_valid_images_are_served_and_broken_ones_are_400s(served):
    """Already handled before this round, kept: a 1x1, CMYK JPEG, 16-bit gray and 16-bit RGBA PNG, palette with
    transparency, LA, 1-bit, animated GIF and WebP (the first frame), BMP: 200; truncated PNG / JPEG: bad_image;
    TIFF: unsupported_format; an aspect ratio over 200:1: bad_image. Round 4: a JPEG with more pictures after
    the photo (a phone camera's depth map or preview, which PIL names MPO) was unsupported_format 'MPO'; served
    (the first picture)."""
    v, _, _, _ = served
    rng = np.random.default_rng(1)
    base = Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8))
    frames = [Image.new("RGB", (50, 40), c) for c in ((255, 0, 0), (0, 255, 0))]
    gray16 = Image.fromarray(rng.integers(0, 65536, (40, 50)).astype(np.uint16))
    good = {
        "1x1": _encoded(Image.new("RGB", (1, 1))),
        "cmyk": _encoded(base.convert("CMYK"), "JPEG"),
        "gray16": _encoded(gray16),
        "palette+transparency": _encoded(base.convert("P"), transparency=0),
        "LA": _encoded(base.convert("LA")),
        "1-bit": _encoded(base.convert("1")),
        "gif": _encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50),
        "webp": _encoded(frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=50),
        "bmp": _encoded(base, "BMP"),
        "mpo": _encoded(base, "MPO", save_all=True, append_images=[frames[0]]),  # round 4: was unsupported_format
    }
    for name, data in good.items():
        assert _ok(_chat(v, _image(_data_url(data)), max_tokens=1))["usage"]["prompt_tokens_details"][
            "image_tokens"] > 0, name
    png, jpeg = _encoded(base), _encoded(base, "JPEG")
    for data, code in ((png[: len(png) // 2], "bad_image"), (jpeg[:300], "bad_image"),
                       (_encoded(base, "TIFF"), "unsupported_format"),
                       (_encoded(Image.new("RGB", (201, 1))), "bad_image")):
        assert _code(_chat(v, _image(_data_url(data)))) == code
    _ok(_chat(v, NORMAL_IMAGE))


def test_a_pil_image_is_an_image_and_other_objects_are_refused_by_name(served):
    """Round 4, the Python API: a PIL image (an app's screenshot as it captured it) in an ``image`` part or as
    ``images=`` was 'a media source is bytes or a URL string', and ``images=pil_image`` a TypeError "'Image'
    object is not iterable"; it is encoded as the same picture's PNG bytes (the same answer, the same content
    digest: the second hits the cache past the image), an image opened from a TIFF file included. A numpy array
    as ``images=`` was a ValueError 'The truth value of an array ... is ambiguous'; any other object is refused
    before traffic, bad_media naming its type."""
    _, _, vc, _ = served
    picture = Image.fromarray(np.random.default_rng(5).integers(0, 256, (60, 90, 3), dtype=np.uint8))

    def ask(image, **kw):
        return vc.complete(messages=[{"role": "user", "content": [{"type": "text", "text": "what is here?"},
                                                                 {"type": "image", "image": image}]}],
                           max_tokens=4, **kw)

    as_bytes = ask(_encoded(picture))
    as_pil = ask(picture)
    assert as_pil.token_ids == as_bytes.token_ids and as_pil.stats.image_tokens == as_bytes.stats.image_tokens
    assert as_pil.stats.cached_tokens > as_pil.stats.prompt_tokens - 16  # every full block but the last
    from_tiff = Image.open(io.BytesIO(_encoded(picture, "TIFF")))  # not decoded yet: the client does
    assert ask(from_tiff).token_ids == as_bytes.token_ids
    prompt = "what is here? " + vc._placeholder("image")
    for given in (picture, (x for x in [picture])):  # one, or any iterable of them
        assert vc.complete(prompt=prompt, images=given, max_tokens=4).stats.image_tokens == as_bytes.stats.image_tokens
    for bad, name in ((np.asarray(picture), "ndarray"), (7, "int"), ("", "an empty string")):
        with pytest.raises(EdgeClientError) as e:
            vc.complete(prompt=prompt, images=bad, max_tokens=4)
        assert e.value.code == "bad_media" and f"not {name}" in str(e.value), e.value
    with pytest.raises(EdgeClientError) as e:
        ask(Image.new("1", (7000, 7000)))  # 49 Mpx
    assert e.value.code == "image_too_large"


def test_a_pil_image_in_any_mode_pil_makes_is_served(served):
    """An app's own PIL image in an unusual mode: premultiplied alpha 'La' raised a raw ValueError ('conversion
    from La to L not supported') out of generate(); it is converted (to straight alpha, then on white, as 'LA':
    the same picture is the same answer), as are 'I;16', 'F' and 'PA'."""
    _, _, vc, _ = served
    prompt = "what is here? " + vc._placeholder("image")

    def ask(image):
        return vc.complete(prompt=prompt, images=image, max_tokens=3)

    straight = ask(Image.new("LA", (40, 30), (200, 255)))
    assert ask(Image.new("La", (40, 30), (200, 255))).token_ids == straight.token_ids
    half = decode_image(_encoded(Image.new("LA", (4, 3), (199, 128))))  # La (100, 128): 100 / (128 / 255) = 199
    assert np.array_equal(np.asarray(load_image(open_image(Image.new("La", (4, 3), (100, 128))))), np.asarray(half))
    for mode in ("I;16", "F", "PA"):
        assert ask(Image.new(mode, (40, 30))).stats.image_tokens == straight.stats.image_tokens, mode


def test_a_request_with_media_never_runs_where_its_rows_cannot_go(served):
    """Round 4: the edge-only and all-cloud runners take token ids alone; a request with a screenshot was run
    edge-only (privacy output-private, a mode override, a link down) on its placeholder ids - the same answer for
    every screenshot, image_tokens reported. Now such a request is refused before traffic (exec_mode, saying why)
    or, where split may run, runs split; text-only requests still run edge-only."""
    _, _, vc, _ = served
    calls = []

    class Whole:  # the documented runner interface (rig.all_edge.WholeModelRunner's), recording its calls
        def generate(self, prompt_ids, max_tokens):
            calls.append(prompt_ids)
            return type("Run", (), {"token_ids": [7] * max_tokens})()

    picture = {"type": "image", "image": _encoded(Image.new("RGB", (64, 64), (9, 90, 200)))}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is here?"}, picture]}]
    vc.whole_model, vc.all_cloud = Whole(), Whole()
    try:
        for kw in ({"privacy": "output-private"}, {"mode": "edge-only"}, {"mode": "all-cloud"}):
            with pytest.raises(EdgeClientError) as e:
                vc.complete(messages=messages, max_tokens=2, **kw)
            assert e.value.code == "exec_mode" and "images or audio" in str(e.value), (kw, e.value)
        assert vc.complete(messages=messages, max_tokens=2, privacy="private").stats.exec_mode == "split"
        assert calls == []
        assert vc.complete(prompt="hello", max_tokens=2, mode="edge-only").token_ids == [7, 7]
    finally:
        vc.whole_model = vc.all_cloud = None


def test_a_file_url_is_percent_decoded(served, tmp_path):
    """Round 4: a file:// URL's path is percent-encoded (what an Android app's Uri.toString() or pathlib's
    as_uri() gives for 'Screenshot 1.png'); it was looked up as written, 'no such file in the media folder'. Its
    encoded '../' is still refused as outside the folder. The same file as RFC 8089's other forms, 'file:/path'
    (Java's File.toURI()) and 'file://localhost/path', was looked up as 'file:/...' or 'localhost/...' inside the
    media folder: 'no such file'; served."""
    v, _, vc, _ = served
    (tmp_path / "Screenshot 1 #2.png").write_bytes(_encoded(Image.new("RGB", (64, 64), (3, 60, 9))))
    (tmp_path / "media").mkdir()
    before = vc.media_policy
    vc.media_policy = replace(before, local_dir=tmp_path)
    try:
        url = (tmp_path / "Screenshot 1 #2.png").as_uri()
        assert "%20" in url
        _ok(_chat(v, _image(url)))
        for other in ("file:" + url.removeprefix("file://"), "file://localhost" + url.removeprefix("file://")):
            _ok(_chat(v, _image(other)))
        vc.media_policy = replace(before, local_dir=tmp_path / "media")
        assert _code(_chat(v, _image("file://%2E%2E/Screenshot%201%20%232.png"))) == "path_refused"
    finally:
        vc.media_policy = before


def test_preloading_messages_with_an_image_caches_the_text_before_it(served, tmp_path):
    """Round 4: ``preload_prompts`` rendered a message's list of parts through the chat template as a Python
    repr (the image's whole base64 as text): blocks no request ever matches. Its parts become placeholders now, as
    in a request, and the text before the first image is cached: a request with that text and any screenshot
    finds it in the cache."""
    import json

    _, _, vc, _ = served
    system = {"role": "system", "content": "You operate a phone for the user, one action per screenshot. " * 3}
    task = [{"type": "text", "text": "Open the settings. Screen:"}]
    path = tmp_path / "agent.jsonl"
    path.write_text(json.dumps({"messages": [system, {"role": "user", "content": [*task, NORMAL_IMAGE]}]}) + "\n")
    cached = vc.preload_prompts(path)
    shot = {"type": "image", "image": _encoded(Image.new("RGB", (64, 64), (250, 250, 5)))}
    gen = vc.complete(messages=[system, {"role": "user", "content": [*task, shot]}], max_tokens=2)
    assert gen.stats.cached_tokens == cached > 0


def test_data_url_forms(served):
    """A data: URL's base64 may carry ASCII whitespace (``base64``'s 76-column lines, a trailing newline) and its
    scheme and ``;base64`` any case, as RFC 2397 / the URL standard read them (all used to be refused); its media
    type is not checked (the bytes tell). Its base64 percent-encoded (``%2B``, ``%2F``, ``%3D``: a URL's
    escapes), or the URL with spaces / a newline around it, is the same image (both were refused). Not base64 (URL-safe alphabet, non-ASCII): bad_media; a scheme other
    than data / http(s) / file: bad_media naming it (it used to be looked up as a file of the media folder)."""
    v, _, _, _ = served
    png = _encoded(Image.fromarray(np.random.default_rng(2).integers(0, 256, (50, 60, 3), dtype=np.uint8)))
    b64 = base64.b64encode(png).decode()
    escaped = b64.replace("+", "%2B").replace("/", "%2f").replace("=", "%3D")
    assert "%2B" in escaped and escaped.endswith("%3D")  # the escapes are there to decode
    for url in ("data:image/png;base64," + base64.encodebytes(png).decode(),
                "data:image/png;base64," + b64 + "\n",
                "data:image/png;base64, " + b64,
                "DATA:image/png;BASE64," + b64,
                "data:text/plain;base64," + b64,
                "data:image/png;base64," + escaped,
                "  data:image/png;base64," + b64 + " \n",
                "data:image/png;base64," + b64.rstrip("=")):  # unpadded, as the URL standard takes it (was refused)
        _ok(_chat(v, _image(url), max_tokens=1))
    urlsafe = base64.urlsafe_b64encode(png).decode()
    assert urlsafe != b64
    for url in ("data:image/png;base64," + urlsafe, "data:image/png;base64,é" + b64):
        r = _chat(v, _image(url))
        assert _code(r) == "bad_media" and "invalid base64" in r.json()["error"]["message"]
    r = _chat(v, _image("ftp://127.0.0.1/x.png"))
    assert _code(r) == "bad_media" and "unsupported URL scheme" in r.json()["error"]["message"]
    _ok(_chat(v, NORMAL_IMAGE))


class _Misbehaving:
    """A local HTTP server that misbehaves slowly: headers trickled, a chain of slow redirects, a redirect to
    ftp://; and one good image."""

    def __init__(self, png: bytes):
        self.served: list[str] = []  # the paths answered whole
        served = self.served

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _redirect(self, to: str, pause: float = 0.0) -> None:
                time.sleep(pause)
                self.send_response(302)
                self.send_header("Location", to)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self):  # noqa: N802 - http.server's name
                try:
                    if self.path in ("/ok.png", "/slow.png"):
                        time.sleep(1.5 if self.path == "/slow.png" else 0.0)
                        self.send_response(200)
                        self.send_header("Content-Type", "image/png")
                        self.send_header("Content-Length", str(len(png)))
                        self.end_headers()
                        self.wfile.write(png)
                        served.append(self.path)
                    elif self.path == "/trickle.png":  # a header line every 0.25 s for 10 s
                        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n")
                        for i in range(40):
                            self.wfile.flush()
                            time.sleep(0.25)
                            self.wfile.write(b"X-Wait: %d\r\n" % i)
                    elif self.path.startswith("/hop/"):  # 0.5 s per redirect, always to a new URL
                        self._redirect(f"/hop/{int(self.path[5:]) + 1}", pause=0.5)
                    elif self.path == "/to-ftp.png":
                        self._redirect("ftp://127.0.0.1:1/x.png")
                    else:
                        self.send_error(404)
                except OSError:
                    pass  # the phone hung up

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, path: str, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_the_fetch_deadline_covers_headers_and_redirects(served):
    """fetch_timeout_s bounds the whole fetch: a server trickling its headers (it used to hold the request for as
    long as it trickled, then answer bad_image 'empty image') and a chain of slow redirects (ten of them, 5 s)
    are fetch_timeout at the deadline. A redirect to ftp:// is not followed. An upper-case HTTP:// is fetched."""
    v, _, vc, _ = served
    srv = _Misbehaving(_encoded(Image.new("RGB", (64, 64), (1, 2, 3))))
    before = vc.media_policy
    vc.media_policy = replace(before, fetch_timeout_s=1.0)
    try:
        for path in ("/trickle.png", "/hop/0"):
            t0 = time.monotonic()
            r = _chat(v, _image(srv.url(path)))
            assert _code(r) == "fetch_timeout" and time.monotonic() - t0 < 3, (path, r.text)
        r = _chat(v, _image(srv.url("/to-ftp.png")))
        assert _code(r) == "fetch_failed" and "only http(s)" in r.json()["error"]["message"], r.text
        _ok(_chat(v, _image(srv.url("/ok.png", scheme="HTTP"))))
    finally:
        vc.media_policy = before
        srv.close()
    _ok(_chat(v, NORMAL_IMAGE))


def test_an_app_gone_while_its_image_is_fetched_starts_nothing(served, monkeypatch):
    """An app that hung up while its request's media were prepared (an image_url still being fetched) still had
    its generation started once they were - its prompt sent up the link, its answer run to the end for no one -
    and cancelled only when garbage-collected; the request is dropped as it goes, and nothing reaches the cloud."""
    v, _, vc, _ = served
    srv = _Misbehaving(_encoded(Image.new("RGB", (64, 64), (1, 2, 3))))
    submitted = []
    submit = vc._submit
    monkeypatch.setattr(vc, "_submit", lambda gen, *rest: (submitted.append(gen), submit(gen, *rest))[1])
    try:
        with pytest.raises(httpx.ReadTimeout):  # the app gives up after 0.5 s, the fetch takes 1.5 s
            httpx.post(v + "/v1/chat/completions", timeout=0.5, json={
                "model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "look "}, _image(srv.url("/slow.png"))]}]})
        deadline = time.monotonic() + 10
        while not srv.served and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the image decoded and encoded: where the generation started
        assert srv.served == ["/slow.png"] and submitted == []
    finally:
        srv.close()
    _ok(_chat(v, NORMAL_IMAGE))
    assert len(submitted) == 1


# -- audio and a bundle without a vision tower ------------------------------------------------------------------


def test_wav_variants(served):
    """8-, 16- (stereo), 24- (used to be refused) and 32-bit PCM, a missing ``format`` (wav), ``"WAV"`` (used to be
    unsupported_format: the format is read in any case), base64 with a trailing newline, 8 kHz and 192 kHz (were
    bad_sample_rate: resampled to 16 kHz now): served. Refused with a 400 each: 0 samples, a header declaring 2 hours
    over half a second of data (truncated), mp3 bytes labelled wav, 3 kHz and 400 kHz (outside 4..384 kHz), longer
    than the encoder's window (at 16 and at 48 kHz), a format other than wav."""
    _, a, _, _ = served
    x = tone(0.5)
    i24 = np.round(x * (2 ** 23 - 1)).astype("<i4")
    pcm24 = np.stack([i24 & 0xFF, (i24 >> 8) & 0xFF, (i24 >> 16) & 0xFF], axis=1).astype(np.uint8).tobytes()
    samples16, _ = decode_wav(wav(x))
    samples24, rate = decode_wav(_riff(pcm24, width=3))
    assert rate == 16000 and np.abs(samples24 - samples16).max() < 1e-4
    served_ok = {
        "8-bit": _audio(_riff(np.round(x * 127 + 128).astype(np.uint8).tobytes(), width=1)),
        "stereo": _audio(_riff((np.repeat(x, 2) * 32767).astype("<i2").tobytes(), channels=2)),
        "24-bit": _audio(_riff(pcm24, width=3)),
        "32-bit": _audio(_riff(np.round(x * (2 ** 31 - 256)).astype("<i4").tobytes(), width=4)),
        "no format": _audio(wav(x), fmt=None),
        "WAV": _audio(wav(x), fmt="WAV"),
        "newline": _audio(base64.b64encode(wav(x)).decode() + "\n"),
        "8 kHz": _audio(wav(tone(0.5, 8000), 8000)),  # resampled to the encoder's 16 kHz (was bad_sample_rate)
        "192 kHz": _audio(wav(tone(0.5, 192000), 192000)),
    }
    for name, part in served_ok.items():
        assert _ok(_chat(a, part, max_tokens=1))["usage"]["prompt_tokens_details"]["audio_tokens"] == 13, name
    refused = [
        (_audio(_riff(b"")), "bad_audio"),
        (_audio(_riff((x * 32767).astype("<i2").tobytes(), frames=16000 * 7200)), "bad_audio"),
        (_audio(b"ID3\x03\x00\x00\x00\x00\x00\x00\xff\xfb\x90\x64" + bytes(400)), "bad_audio"),
        (_audio(wav(tone(0.5, 3000), 3000)), "bad_sample_rate"),  # outside 4..384 kHz
        (_audio(wav(tone(0.5, 400000), 400000)), "bad_sample_rate"),
        (_audio(wav(tone(2.5, 48000), 48000)), "audio_too_long"),  # the window in seconds, at any rate
        (_audio(wav(tone(2.5))), "audio_too_long"),
        (_audio(wav(x), fmt="mp3"), "unsupported_format"),
    ]
    for part, code in refused:
        assert _code(_chat(a, part)) == code
    _ok(_chat(a, NORMAL_AUDIO))


def test_extensible_and_float_wavs_are_read_and_broken_headers_are_400s(served):
    """Round 4. WAVE_FORMAT_EXTENSIBLE (what ffmpeg writes for 24-bit or multichannel audio) was refused as 'not a
    PCM WAV file (unknown format: 65534)' - Python 3.11's wave reads plain PCM only - and a float WAV (what
    scipy.io.wavfile writes from a float32 array) as bad_audio: both are read now, the same samples as 16-bit PCM
    of the same clip (the same answer). A float WAV with a NaN: bad_audio 'not finite'; compressed samples (ADPCM):
    unsupported_format. A fmt chunk whose size runs past the file was a 500 'internal error: RuntimeError' (wave's
    seek past the end); bad_audio now, as is a header cut inside it ('()' was its whole reason). A WAV that ffmpeg
    wrote to a pipe (sizes left at 0xFFFFFFFF) was 'truncated'; it is read to its end."""
    _, a, _, _ = served
    x = tone(0.5)
    i16, i24 = np.round(x * 32767).astype("<i2"), np.round(x * (2 ** 23 - 1)).astype("<i4")
    pcm24 = np.stack([i24 & 0xFF, (i24 >> 8) & 0xFF, (i24 >> 16) & 0xFF], axis=1).astype(np.uint8).tobytes()
    stereo = np.repeat(x, 2).astype("<f4").tobytes()
    reference, _ = decode_wav(wav(x))
    for data in (_riff(pcm24, width=3, extensible=True), _riff(i16.tobytes(), extensible=True),
                 _riff(x.astype("<f4").tobytes(), width=4, tag=3), _riff(x.astype("<f8").tobytes(), width=8, tag=3),
                 _riff(stereo, width=4, tag=3, channels=2, extensible=True)):
        samples, rate = decode_wav(data)
        assert rate == 16000 and np.abs(samples - reference).max() < 1e-4
    # ffmpeg writing to a pipe (-f wav -) cannot seek back: RIFF and data sizes stay 0xFFFFFFFF, the samples run to
    # the end of the file (an odd byte after the last frame is dropped); it was 'truncated WAV: 8000 of 2147483647'
    piped = bytearray(_riff(i16.tobytes()) + b"\x01")
    piped[4:8] = piped[40:44] = struct.pack("<I", 0xFFFFFFFF)
    samples, _ = decode_wav(bytes(piped))
    assert samples.size == reference.size and np.abs(samples - reference).max() < 1e-4
    plain = _ok(_chat(a, _audio(wav(x)), max_tokens=4))["choices"][0]["message"]["content"]
    for data in (_riff(pcm24, width=3, extensible=True), _riff(x.astype("<f4").tobytes(), width=4, tag=3),
                 bytes(piped)):
        assert _ok(_chat(a, _audio(data), max_tokens=4))["choices"][0]["message"]["content"] == plain
    nan = x.copy()
    nan[100] = np.nan
    header_past_end = bytearray(wav(x))
    header_past_end[16:20] = struct.pack("<I", 0x6C0010)  # the fmt chunk's size
    for data, code, says in ((_riff(nan.astype("<f4").tobytes(), width=4, tag=3), "bad_audio", "not finite"),
                             (_riff(i16.tobytes(), tag=2), "unsupported_format", "0x0002"),
                             (_riff(x.astype("<f2").tobytes(), tag=3), "unsupported_format", "16 bits (float)"),
                             (bytes(header_past_end), "bad_audio", "cut short"),
                             (wav(x)[:4], "bad_audio", "cut short")):
        r = _chat(a, _audio(data))
        assert _code(r) == code and says in r.json()["error"]["message"], r.text
    _ok(_chat(a, NORMAL_AUDIO))


def test_a_wav_whose_riff_size_is_wrong_is_read_by_its_data_chunk(served):
    """A WAV whose RIFF size is wrong - 0 (a recorder's placeholder never filled in), the data's size alone (a
    hand-written header's slip) or smaller than its chunks with a streamed data chunk - was refused: bad_audio 'not
    a WAVE file', 'truncated WAV: 7982 of the 8000 frames' or 'empty audio', its samples all there (stdlib wave
    reads no chunk past the RIFF size). The RIFF size is not read, as ffmpeg does: the same samples and answer as
    the right header's; a data chunk cut short is still truncated."""
    _, a, _, _ = served
    x = tone(0.5)
    good = _riff((x * 32767).astype("<i2").tobytes())
    reference, _ = decode_wav(good)
    plain = _ok(_chat(a, _audio(good), max_tokens=4))["choices"][0]["message"]["content"]
    for riff_size, data_size in ((0, None), (len(good) - 44, None), (36, 0xFFFFFFFF)):
        data = bytearray(good)
        data[4:8] = struct.pack("<I", riff_size)
        if data_size is not None:
            data[40:44] = struct.pack("<I", data_size)
        samples, _ = decode_wav(bytes(data))
        assert np.array_equal(samples, reference), (riff_size, data_size)
        assert _ok(_chat(a, _audio(bytes(data)), max_tokens=4))["choices"][0]["message"]["content"] == plain
    r = _chat(a, _audio(good[:-1000]))
    assert _code(r) == "bad_audio" and "truncated" in r.json()["error"]["message"]


def test_a_wav_whose_data_size_was_never_filled_in_is_read_to_its_end(served):
    """A WAV whose data chunk's size is 0 with its samples after it (a recorder writes the header first, sizes 0, and
    fills them in when it stops: an app stopped mid-recording leaves them 0) was 'empty audio (no samples)'; its
    samples run to the end of the file, as ffmpeg reads it (and as a size of 0xFFFFFFFF): the right header's
    answer. A header alone is still empty audio."""
    _, a, _, _ = served
    x = tone(0.5)
    good = _riff((x * 32767).astype("<i2").tobytes())
    plain = _ok(_chat(a, _audio(good), max_tokens=4))["choices"][0]["message"]["content"]
    unfilled = bytearray(good)
    unfilled[4:8] = unfilled[40:44] = struct.pack("<I", 0)
    assert np.array_equal(decode_wav(bytes(unfilled))[0], decode_wav(good)[0])
    assert _ok(_chat(a, _audio(bytes(unfilled)), max_tokens=4))["choices"][0]["message"]["content"] == plain
    r = _chat(a, _audio(_riff(b"")))
    assert _code(r) == "bad_audio" and "empty" in r.json()["error"]["message"]


def test_an_audio_source_over_the_limit_is_audio_too_large(served):
    """Round 4: audio over ``MediaPolicy.max_bytes`` (a data: URL or a file given to ``audio=``) was refused as
    image_too_large 'media of ... bytes'; audio_too_large now, as a WAV over 16 MB already was."""
    _, _, _, ac = served
    prompt = "what does it say? " + ac._placeholder("audio")
    big = "data:audio/wav;base64," + base64.b64encode(bytes(ac.media_policy.max_bytes + 1)).decode()
    for clip, says in ((big, "audio of"), (bytes(17 << 20), "audio of")):
        with pytest.raises(EdgeClientError) as e:
            ac.complete(prompt=prompt, audio=clip, max_tokens=2)
        assert e.value.code == "audio_too_large" and says in str(e.value), e.value


def test_too_many_clips_are_refused_before_any_is_encoded(served, no_tower, monkeypatch):
    """45 two-second clips (50 audio tokens each: 2250 > 2048 positions): context_full, no encoder run."""
    _, a, _, _ = served
    clip = _audio(wav(tone(2.0)))
    assert _code(_chat(a, *[clip] * 45)) == "context_length_exceeded"
    assert no_tower == []
    monkeypatch.undo()
    _ok(_chat(a, NORMAL_AUDIO))


def test_an_image_for_a_bundle_without_a_vision_tower(served, tiny_glm4v_audio_bundle):
    """no_encoder, a 400; the message no longer names the bundle's path on the device."""
    _, a, _, _ = served
    r = _chat(a, NORMAL_IMAGE)
    assert _code(r) == "no_encoder" and str(tiny_glm4v_audio_bundle) not in r.json()["error"]["message"]
    _ok(_chat(a, NORMAL_AUDIO))


def _with_a_trained_tokenizer(bundle, out):
    """A copy of ``bundle`` with a tokenizer.json whose media placeholder tokens are special added tokens, as a
    trained vision model's are (GLM-4.1V: ``<|begin_of_image|>``, ``<|image|>``, ``<|end_of_image|>``); the tiny
    preset itself has none (ByteTokenizer), so nothing showed what a real one does."""
    import json
    import shutil

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    shutil.copytree(bundle, out)
    specials = {10: "<|image|>", 12: "<|begin_of_image|>", 13: "<|end_of_image|>", 2: "<|endoftext|>", 3: "<|user|>",
                4: "<|assistant|>"}
    vocab = {f"w{i}": i for i in range(512) if i not in specials} | {t: i for i, t in specials.items()}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w20"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials.values()])
    tok.save(str(out / "edge" / "tokenizer.json"))
    (out / "edge" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": (
        "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")}))
    return out


def test_an_image_part_reaches_the_prompt_when_its_placeholder_tokens_are_special(served, tiny_glm4v_fp32_bundle,
                                                                                  tmp_path):
    """An image part becomes its placeholder's text in the chat, written as decode(placeholder ids); decode hides
    special tokens (an answer must not show them), and a trained tokenizer's image tokens are special: the text was
    empty, so every image sent through messages= or the local API was refused bad_media '1 media input(s) without
    a placeholder in the prompt'. The placeholder is written out (token_text) and the image is seen."""
    _, _, vc, _ = served
    bundle = _with_a_trained_tokenizer(tiny_glm4v_fp32_bundle, tmp_path / "b")
    with EdgeClient(bundle, vc.config.url, codec="fp16", retry=RETRY) as c:
        assert c.tokenizer.decode([12, 10, 13]) == ""  # answers still hide them
        picture = {"type": "image", "image": _encoded(Image.new("RGB", (64, 64)))}
        r = c.complete(messages=[{"role": "user", "content": [{"type": "text", "text": "w5 w6"}, picture]}],
                       max_tokens=2)
    assert r.stats.image_tokens == 9 and r.stats.prompt_tokens == 1 + 2 + 1 + 9 + 1 + 1, r.stats  # <|user|>...


def test_a_placeholder_without_its_input_is_refused_even_when_no_input_is_given(served):
    """One image placeholder with ``images=[]`` (an agent loop whose screen capture failed), the placeholder ids with
    no images, or its text in a text-only chat: the request ran as text, the image token's plain embedding where
    the picture should be - an answer about no picture, without a word - while two placeholders and one image were
    bad_media. Every placeholder of a bundle's encoder needs its input: bad_media before any traffic, a 400. The
    audio bundle has no vision tower: the image token is plain text there."""
    v, a, vc, ac = served
    image_placeholder = vc._placeholder("image")
    for kw in ({"prompt": "look " + image_placeholder, "images": []},
               {"prompt_ids": [30, 31, 12, 10, 13, 32]},
               {"messages": [{"role": "user", "content": "look " + image_placeholder}]}):
        with pytest.raises(EdgeClientError) as e:
            vc.complete(max_tokens=2, **kw)
        assert e.value.code == "bad_media" and "placeholders" in str(e.value), (kw, e.value)
    r = httpx.post(v + "/v1/chat/completions", timeout=60, json={
        "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "look " + image_placeholder}]})
    assert _code(r) == "bad_media" and r.json()["error"]["param"] == "messages"
    r = httpx.post(v + "/v1/completions", timeout=60, json={"model": "m", "max_tokens": 2,
                                                           "prompt": "look " + image_placeholder})
    assert _code(r) == "bad_media" and r.json()["error"]["param"] == "prompt"  # the field it came in
    assert ac.complete(prompt_ids=[30, 31, 12, 10, 13, 32], max_tokens=2).stats.image_tokens == 0
    _ok(_chat(v, NORMAL_IMAGE))


def test_an_image_within_a_raised_byte_limit_is_served(served):
    """``MediaPolicy.max_bytes`` raised for a phone camera's large photos let the bytes be loaded, and the image was
    then refused image_too_large 'exceeds the 20971520-byte limit' - the default, checked again by the image's own
    opening; the policy's limit is the one limit. (A PNG over 20 MB: a small picture with a big private chunk.)"""
    _, _, vc, _ = served
    png = _encoded(Image.new("RGB", (64, 64), (10, 200, 30)))
    chunk = bytes(21 << 20)
    big = png[:33] + struct.pack(">I", len(chunk)) + b"prVt" + chunk + struct.pack(">I", zlib.crc32(b"prVt" + chunk)) \
        + png[33:]  # after IHDR: an ancillary chunk PIL skips
    prompt = "what is here? " + vc._placeholder("image")
    before = vc.media_policy
    try:
        vc.media_policy = replace(before, max_bytes=32 << 20)
        assert vc.complete(prompt=prompt, images=big, max_tokens=2).stats.image_tokens == 9
        vc.media_policy = replace(before, max_bytes=len(big) - 1)
        with pytest.raises(EdgeClientError) as e:
            vc.complete(prompt=prompt, images=big, max_tokens=2)
        assert e.value.code == "image_too_large"
    finally:
        vc.media_policy = before


def test_formats_pil_cannot_open_are_unsupported_formats_by_name(served):
    """A phone camera's HEIC/HEIF photo, an SVG icon or a JPEG XL image was bad_image 'not a recognised image
    (corrupt, or an unsupported format)' - the code for broken bytes, where the table's unsupported_format (TIFF's)
    is what an app acts on (convert, then resend); they are unsupported_format naming the format (from the first
    bytes: PIL cannot open them here). Broken bytes stay bad_image."""
    v, _, _, _ = served
    heic = struct.pack(">I", 24) + b"ftypheic" + bytes(4) + b"mif1heic" + bytes(64)  # an iPhone .heic's start
    for data, name in ((heic, "HEIC"), (b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"/>', "SVG"),
                       (b"\x00\x00\x00\x0cJXL \r\n\x87\n" + bytes(64), "JPEG XL")):
        r = _chat(v, _image(_data_url(data)))
        assert _code(r) == "unsupported_format" and f"'{name}'" in r.json()["error"]["message"], r.text
    assert _code(_chat(v, _image(_data_url(b"<html>not an image</html>")))) == "bad_image"
    _ok(_chat(v, NORMAL_IMAGE))


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _with_chunks(png: bytes, before: list[bytes] = (), after: list[bytes] = ()) -> bytes:
    """``png`` with chunks inserted after its IHDR (``before`` the image data) and before its IEND (``after``)."""
    ihdr_end, iend = 8 + 12 + 13, png.rindex(b"IEND") - 4
    return png[:ihdr_end] + b"".join(before) + png[ihdr_end:iend] + b"".join(after) + png[iend:]


def _itxt(key: bytes, text: bytes, compress: bool = True) -> bytes:
    return _png_chunk(b"iTXt", key + b"\0" + bytes([compress, 0]) + b"\0\0" + (zlib.compress(text) if compress else text))


def _ztxt(key: bytes, text: bytes) -> bytes:
    return _png_chunk(b"zTXt", key + b"\0\0" + zlib.compress(text, 9))


MEGABYTE_OF_TEXT = zlib.compress(bytes(1 << 20), 9)  # 1 KB


def _text_mb(key: bytes) -> bytes:
    """A zTXt chunk of 1 MB of text (PIL's MAX_TEXT_CHUNK exactly: read) in 1 KB."""
    return _png_chunk(b"zTXt", key + b"\0\0" + MEGABYTE_OF_TEXT)


def _xmp(orientation: int, padding: int = 0) -> bytes:
    """An XMP packet naming an orientation, ``padding`` bytes of history in it (Photoshop's can run to megabytes)."""
    return (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
            b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="%d">' % orientation
            + b"<!-- " + b"h" * padding + b" --></rdf:Description></rdf:RDF></x:xmpmeta>")


def _jpeg_rescanned(side: int, copies: int) -> bytes:
    """A progressive JPEG of ``side x side`` with ``copies`` more of its last scan (a 12-byte AC refinement of the
    luma, each a pass over every block of the image) before its end: libjpeg decodes it (warning only)."""
    data = _encoded(Image.new("RGB", (side, side), (120, 30, 200)), "JPEG", progressive=True, quality=90)
    end = data.rindex(b"\xff\xd9")
    last = data[data.rindex(b"\xff\xda"):end]
    return data[:end] + last * copies + b"\xff\xd9"


def test_a_jpeg_of_more_scans_than_an_app_writes_is_refused_before_it_is_decoded(served, no_tower, monkeypatch):
    """A progressive JPEG's decode passes over the whole image once per scan, and a scan can be 12 bytes: 10,000
    copies of one in a 130 KB 1200 x 1200 JPEG took a real ``autoglm-edge serve`` 10 s of CPU (1.2 s for the
    image as written, tower included), 20 MB of them would take half an hour. Now a JPEG of over MAX_JPEG_SCANS
    (64) scans, or MAX_JPEG_SEGMENTS segments, is bad_image from its markers alone; what encoders write (10 scans,
    baseline's 1, an MPO's first frame) is served."""
    from edge_client import vision

    v = served[0]
    decoded = []
    monkeypatch.setattr(vision, "load_image", lambda *a, **kw: decoded.append(1) or load_image(*a, **kw))
    for copies in (60, 2000):  # 70 scans: over the bound at once; 2000: 2 s of decoding before
        r = _chat(v, _image(_data_url(_jpeg_rescanned(1200, copies), "image/jpeg")))
        assert _code(r) == "bad_image" and "over 64 scans" in r.json()["error"]["message"], r.text
    segments = _encoded(Image.new("RGB", (64, 64)), "JPEG")
    segments = segments[:2] + b"\xff\xfe\x00\x03c" * 5000 + segments[2:]  # 5000 one-byte comments
    r = _chat(v, _image(_data_url(segments, "image/jpeg")))
    assert _code(r) == "bad_image" and "over 4096 segments" in r.json()["error"]["message"], r.text
    assert decoded == [] and no_tower == []  # refused before any decode or tower run
    picture = Image.fromarray((np.random.default_rng(0).random((96, 80, 3)) * 255).astype(np.uint8))
    for kw in ({}, {"progressive": True}, {"progressive": True, "optimize": True, "subsampling": 0}):
        assert vision.open_image(_encoded(picture, "JPEG", **kw)).size == (80, 96)
    assert vision.open_image(_jpeg_rescanned(64, 54)).size == (64, 64)  # 64 scans: within the bound
    mpo = _encoded(picture, "MPO", save_all=True, append_images=[picture] * 8)  # 9 frames of 10 scans
    assert vision.open_image(mpo).format == "MPO"


def test_a_png_with_large_or_many_text_chunks(served):
    """A screenshot whose XMP packet decompresses to over 1 MB (PIL's MAX_TEXT_CHUNK) was a 400 bad_image 'cannot
    decode the image: Decompressed data too large for PngImagePlugin.MAX_TEXT_CHUNK', and so were a PNG with 70 MB
    of compressed text ('Too much memory used in text chunks', before or after the image data) and a 64 KB zTXt of
    64 MB of text: text chunks carry no pixels; the phone drops those it does not turn images by (XMP, an EXIF raw
    profile) or that PIL would refuse, and serves the picture: the answer and digest of the plain PNG. An XMP
    orientation PIL can read still turns the image (as the model's processor does). A PNG of over 65536 chunks
    (1.4 M tiny text chunks in 20 MB held PIL for 3 s) is bad_image, refused at once."""
    v, _, vc, _ = served
    rng = np.random.default_rng(3)
    picture = Image.fromarray(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8))
    plain = _encoded(picture)
    served_as_plain = {
        "1.5 MB XMP, compressed": _with_chunks(plain, [_itxt(b"XML:com.adobe.xmp", _xmp(1, 3 << 19))]),
        "1 MB XMP, plain": _with_chunks(plain, [_itxt(b"XML:com.adobe.xmp", _xmp(1, 1 << 20), compress=False)]),
        "70 MB of text": _with_chunks(plain, [_text_mb(b"k%d" % i) for i in range(70)]),
        "70 MB of text after the pixels": _with_chunks(plain, after=[_text_mb(b"k%d" % i) for i in range(70)]),
        "64 MB of text in one zTXt": _with_chunks(plain, [_ztxt(b"Comment", bytes(64 << 20))]),
        "70 1 MB XMP packets": _with_chunks(plain, [_itxt(b"XML:com.adobe.xmp", _xmp(1, 1 << 20)) for _ in range(70)]),
    }
    reference = vc.media.vision.prepare(plain)
    for name, data in served_as_plain.items():
        t0 = time.perf_counter()
        assert vc.media.vision.prepare(data).digest == reference.digest, name
        assert time.perf_counter() - t0 < 10, name  # ~0.1 s; generous for a shared machine
    answer = _ok(_chat(v, _image(_data_url(plain)), max_tokens=6))["choices"][0]["message"]["content"]
    for name in ("1.5 MB XMP, compressed", "70 MB of text"):
        assert _ok(_chat(v, _image(_data_url(served_as_plain[name])), max_tokens=6))["choices"][0]["message"][
            "content"] == answer, name

    upright = picture.transpose(Image.Transpose.ROTATE_270)  # what XMP orientation 6 shows
    turned = _with_chunks(plain, [_itxt(b"XML:com.adobe.xmp", _xmp(6, 1000))] + [_text_mb(b"k%d" % i)
                                                                                   for i in range(70)])
    assert np.array_equal(np.asarray(decode_image(turned)), np.asarray(upright))
    assert np.array_equal(np.asarray(decode_image(turned)), np.asarray(decode_image(_encoded(upright))))

    flood = _with_chunks(plain, [_png_chunk(b"tEXt", b"k\0")] * 1_400_000)  # 19.6 MB
    t0 = time.perf_counter()
    r = _chat(v, _image(_data_url(flood)))
    assert _code(r) == "bad_image" and "over 65536 chunks" in r.json()["error"]["message"]
    assert time.perf_counter() - t0 < 20
    _ok(_chat(v, NORMAL_IMAGE))


def test_a_pathlib_path_is_a_local_path(served, tmp_path):
    """``images=Path(...)`` / ``audio=Path(...)`` (or such a path in an ``image`` part), the Python way to name a
    file, was bad_media 'not PosixPath' where its string was read from the media folder; a path is a local path:
    read from inside ``MediaPolicy.local_dir``, refused without one (path_refused, saying where it is set)."""
    _, _, vc, ac = served
    shot, clip = tmp_path / "shot.png", tmp_path / "clip.wav"
    shot.write_bytes(_encoded(Image.new("RGB", (64, 64), (40, 80, 120))))
    clip.write_bytes(wav(tone(0.5)))
    image_prompt = "what is here? " + vc._placeholder("image")
    audio_prompt = "what does it say? " + ac._placeholder("audio")
    befores = vc.media_policy, ac.media_policy
    try:
        for c in (vc, ac):
            c.media_policy = replace(c.media_policy, local_dir=tmp_path)
        by_path = vc.complete(prompt=image_prompt, images=shot, max_tokens=3)
        assert by_path.token_ids == vc.complete(prompt=image_prompt, images=str(shot), max_tokens=3).token_ids
        assert ac.complete(prompt=audio_prompt, audio=[clip], max_tokens=2).stats.audio_tokens == 13
        vc.media_policy = befores[0]
        with pytest.raises(EdgeClientError) as e:
            vc.complete(prompt=image_prompt, images=shot, max_tokens=2)
        assert e.value.code == "path_refused" and "MediaPolicy.local_dir" in str(e.value)
    finally:
        vc.media_policy, ac.media_policy = befores
