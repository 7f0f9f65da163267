"""Held-out abuse cases for the edge side: bad URLs and config values, misuse of the EdgeClient API, damaged
bundles and media at the edge's boundary. Each must fail at once with a typed, one-line error (never a hang, a
traceback or a silently wrong result)."""

from __future__ import annotations

import io
import json
import shutil
import struct
import threading
import time
import wave
import zlib

import numpy as np
import pytest

from edge_client.cli import main as edge_main
from edge_client.config import ConfigError, EdgeConfig, split_url
from shared.manifest import BundleError

DEAD_URL = "ws://127.0.0.1:9"  # nothing listens: a request that got past validation would fail to connect


# -- URLs and config ------------------------------------------------------------------------------------


@pytest.mark.parametrize("url, match", [
    ("ws://127.0.0.1:99999", "Port out of range"),
    ("ws://[::1", "Invalid IPv6"),
    ("ws://:8000", "expected ws://, wss://, http:// or https:// and a host"),
    ("http://:8000/v1", "expected ws://, wss://, http:// or https:// and a host"),
    ("localhost:8000", "expected ws://, wss://, http:// or https://"),
    ("ftp://x", "expected ws://, wss://, http:// or https://"),
])
def test_bad_urls_are_config_errors(url, match):
    with pytest.raises(ConfigError, match=match):
        split_url(url)


@pytest.mark.parametrize("url", ["ws://h:8000", "ws://h:8000/", "ws://h:8000/v1/", "ws://h:8000/v1/split/"])
def test_base_url_forms_reach_the_split_endpoint(url):
    assert split_url(url) == "ws://h:8000/v1/split"


@pytest.mark.parametrize("url", ["wss://gw/autoglm/v1", "wss://gw/autoglm/v1/", "wss://gw/autoglm/v1/split"])
def test_a_base_url_behind_a_proxys_prefix_reaches_the_split_endpoint(url):
    """OpenAI's base_url convention: a path ending in /v1 is the server's API root wherever a proxy mounts it
    (it was kept as given, and the proxy answered no_split_endpoint)."""
    assert split_url(url) == "wss://gw/autoglm/v1/split"


def test_bad_config_values_are_refused_at_construction(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("not a certificate")
    with pytest.raises(ConfigError, match="codec 'bogus'"):
        EdgeConfig(bundle=tmp_path, codec="bogus")
    with pytest.raises(ConfigError, match="cache_dir .* not a directory"):
        EdgeConfig(bundle=tmp_path, cache_dir=a_file)
    with pytest.raises(ConfigError, match="no such file"):
        EdgeConfig(bundle=tmp_path, url="wss://h:1", ca_file=tmp_path / "missing.pem")
    with pytest.raises(ConfigError, match="no PEM CA certificate"):
        EdgeConfig(bundle=tmp_path, url="wss://h:1", ca_file=a_file)


# -- the CLI ----------------------------------------------------------------------------------------------


def _usage_error(argv, capsys, match):
    capsys.readouterr()
    try:
        rc = edge_main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and match in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, match", [
    (["serve", "--port", "99999"], "not a TCP port"),
    (["serve", "--log-level", "bogus"], "invalid choice"),
    (["demo", "--port", "-1"], "not a TCP port"),
    (["demo", "--threads", "0"], "must be >= 1"),  # before minutes of building the demo bundle
    (["chat", "--max-tokens", "0"], "max_tokens"),  # before the bundle loads (none is given here)
    (["chat", "--temperature", "-1"], "temperature"),
    (["chat", "--precision", "bogus"], "precision 'bogus'"),
    (["chat", "--url", "ws://127.0.0.1:99999"], "Port out of range"),
    (["serve", "--media-dir", "/no/such/folder"], "--media-dir /no/such/folder: not a directory"),  # it served on
    (["serve", "--local-api-key", ""], "--local-api-key is empty"),  # it served with no key, silently
    (["preload", "--cache-dir", "", "p.txt"], "cache_dir is empty"),  # it cached into the current directory
])
def test_cli_bad_flags_exit_2_in_one_line(argv, match, tiny_bundle, capsys, monkeypatch):
    monkeypatch.setenv("AUTOGLM_BUNDLE", str(tiny_bundle))
    if argv[0] == "chat" and "--url" not in argv:
        monkeypatch.setenv("AUTOGLM_BUNDLE", str(tiny_bundle / "missing"))  # the flag is checked first
    _usage_error(argv, capsys, match)


@pytest.mark.parametrize("argv, env, match", [
    (["--api-key", ""], {}, "api_key is empty"),
    ([], {"AUTOGLM_API_KEY": ""}, "AUTOGLM_API_KEY is empty"),
    ([], {"AUTOGLM_EDGE_API_KEY": "", "AUTOGLM_API_KEY": "k"}, "AUTOGLM_EDGE_API_KEY is empty"),
    ([], {"AUTOGLM_API_KEY": "k\n"}, "AUTOGLM_API_KEY has whitespace at an end"),
])
def test_an_empty_cloud_key_is_refused_as_the_clouds_serve_refuses_its_own(argv, env, match, tiny_bundle, capsys,
                                                                            monkeypatch):
    """serve --api-key "" (a KEY unset in ``--api-key "$KEY"``) or AUTOGLM_API_KEY="" (a secret made from an unset
    variable) started and connected without any key, silently: every request a 502 'API key refused' from a
    protected cloud. Refused at start as the cloud's serve refuses its own empty key (one rule,
    shared.prefix_keys.bearer_key_problem), the variable named; a flag given still wins over the variables."""
    from edge_client.local_api import ClosingServer

    monkeypatch.setattr(ClosingServer, "run", lambda self: None)  # it served (forever): here it returns, exit 0
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _usage_error(["serve", "--bundle", str(tiny_bundle), "--url", DEAD_URL, *argv], capsys, match)
    from edge_client.config import EdgeConfig

    assert EdgeConfig.from_env(bundle=tiny_bundle, api_key="given").api_key == "given"


@pytest.mark.parametrize("given", [["--media-dir=~/shots"], []])
def test_a_media_dir_under_home_is_the_homes(given, tiny_bundle, tmp_path, monkeypatch):
    """AUTOGLM_EDGE_MEDIA_DIR=~/shots (a variable no shell expands), or --media-dir=~/shots, was refused as 'not a
    directory'; the '~' is the home directory (shared.user_paths, the one rule), as for the other edge paths."""
    from edge_client.local_api import ClosingServer

    (tmp_path / "shots").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AUTOGLM_EDGE_MEDIA_DIR", "~/shots")
    served = []
    monkeypatch.setattr(ClosingServer, "run", lambda self: served.append(self.client.media_policy.local_dir))
    assert edge_main(["serve", "--bundle", str(tiny_bundle), "--url", DEAD_URL, *given]) == 0
    assert served == [tmp_path / "shots"]


# -- the client API ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tiny_bundle):
    from edge_client import EdgeClient

    c = EdgeClient(tiny_bundle, DEAD_URL)
    yield c
    c.close()


@pytest.mark.parametrize("kwargs, match", [
    ({"prompt_ids": [10 ** 9]}, "out of range"),
    ({"prompt_ids": [-1]}, "out of range"),
    ({"prompt": b"hi"}, "prompt must be a string"),
    ({"messages": "hello"}, "messages must be a non-empty list"),
    ({"messages": []}, "messages must be a non-empty list"),  # rendered as the template's default system prompt
    ({"messages": [{"content": "hi"}]}, "messages must be a non-empty list"),  # rendered as some other turn
    ({"messages": [{"role": None, "content": "hi"}]}, "messages must be a non-empty list"),
    # a null or missing content: the chat template's 'can only concatenate str (not NoneType)' before
    ({"messages": [{"role": "user", "content": None}]}, r"messages\[0\]\.content: missing or null"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user"}]}, r"messages\[1\]\.content: missing"),
    ({"messages": [{"role": "user", "content": 5}]}, r"messages\[0\]\.content must be a string"),
    # a text part's null or missing text beside an image (or alone) was rendered 'None' (or nothing) and answered
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}, {"type": "image", "image": b"png"}]}]},
     r"messages\[0\]\.content\[0\]\.text: expected a string"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, r"messages\[0\]\.content\[0\]\.text"),
    # the template's variables: a bare TypeError ('multiple values for argument') or dict()'s ValueError before
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}}, "may not be set"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"add_generation_prompt": False}},
     "add_generation_prompt may not be set"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": "x"}, "must be a dict, got str"),
    # every variable is copied into each render: 900,000 keys cost the phone 7 s and 570 MB (the local API's rule)
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {f"k{i}": 1 for i in range(129)}},
     "more than 256 keys and values"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"k": [[]] * 256}},
     "more than 256 keys and values"),
    ({"messages": [{"role": "user", "content": "hi"}], "enable_thinking": "no"}, "enable_thinking must be"),
    # they shape the chat template's rendering of messages=; a raw prompt is not rendered: they were ignored, silently
    ({"prompt": "hi", "enable_thinking": False}, "apply to messages="),
    ({"prompt": "hi", "enable_thinking": "no"}, "apply to messages="),
    ({"prompt_ids": [5, 6], "chat_template_kwargs": {"enable_thinking": False}}, "apply to messages="),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "hi", "temperature": float("nan")}, "temperature"),
    ({"prompt": "hi", "stop": [1]}, "stop"),
    ({"prompt": "hi", "stop": 3}, "stop must be a string or a list"),  # TypeError: 'int' object is not iterable
    ({"prompt": "hi", "stop": {"a": 1}}, "stop must be a string or a list"),  # its keys were taken as the stops
    # the local API's rule (a 400 there): an empty stop was dropped without a word, and any number taken
    ({"prompt": "hi", "stop": ""}, "stop: at most 16 non-empty strings"),
    ({"prompt": "hi", "stop": ["a", ""]}, "stop: at most 16 non-empty strings"),
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop: at most 16 non-empty strings"),
    # no text (the local API's 400 for the body): no answer's text holds one, so it never matched - the answer ran on
    ({"prompt": "hi", "stop": "\ud800"}, "stop: a string with a lone UTF-16 surrogate"),
    ({"prompt": "hi", "stop": ["ok", "a\udfff"]}, "stop: a string with a lone UTF-16 surrogate"),
    ({"prompt": "hi", "stop": "\ud83d\ude00"}, "stop: a string with a lone UTF-16 surrogate"),  # a pair's halves
    # the wire's types too: these passed the range checks and failed after the prompt ran ('internal' + traceback)
    ({"prompt": "hi", "top_k": 1.5}, "top_k must be an integer"),
    ({"prompt": "hi", "top_p": True}, "top_p must be a number"),
    ({"prompt": "hi", "temperature": "0.5"}, "temperature must be a number"),
    ({"prompt": "hi", "speculate": "no"}, "speculate must be True or False"),  # it speculated
])
def test_bad_request_arguments_raise_value_error_before_any_traffic(client, kwargs, match):
    with pytest.raises(ValueError, match=match):
        client.generate(**kwargs)


def test_prompt_longer_than_the_edge_context_is_refused(client):
    n = client.runtime.max_positions + 1
    with pytest.raises(ValueError, match=f"prompt of {n} tokens exceeds"):
        client.generate(prompt_ids=[5] * n)


def test_a_text_too_long_for_the_context_is_refused_before_tokenizing(client, monkeypatch):
    def no_tokenizing(text):
        raise AssertionError("tokenized")

    monkeypatch.setattr(client.tokenizer, "encode", no_tokenizing)
    n = client.tokenizer.max_token_chars * client.runtime.max_positions + 1
    with pytest.raises(ValueError, match=f"prompt of {n} characters exceeds"):
        client.generate(prompt="a" * n)
    with pytest.raises(ValueError, match="characters exceeds"):
        client.generate(messages=[{"role": "user", "content": "a" * n}])


def test_a_text_whose_tokens_are_long_is_not_refused_by_its_characters(client, monkeypatch, tmp_path):
    """The bound assumed at most 64 characters a token, but SmolLM2's vocabulary has an 81-character one (a newline
    and 80 spaces): a prompt that fits was refused 'prompt of N characters exceeds the edge graph's positions'. The
    bound is the tokenizer's longest token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from edge_client.tokenizer import EdgeTokenizer

    word = "x" * 100
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, word: 5}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(word, "isolated")
    tok.save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setattr(client, "tokenizer", EdgeTokenizer(tmp_path / "tokenizer.json", {}, None, [2]))
    assert client.tokenizer.max_token_chars == 100
    n = client.runtime.max_positions - 1  # fills the edge graph, one position left for the answer
    gen = client.generate(prompt=word * n, max_tokens=1)
    assert gen.spec.prompt_ids == [5] * n
    gen.cancel()
    gen.close()
    with pytest.raises(ValueError, match="characters exceeds"):
        client.generate(prompt=word * client.runtime.max_positions + "x")


def test_a_stop_string_is_one_stop_not_its_characters(client):
    gen = client.generate(prompt="hi", stop="abc", max_tokens=2)
    assert gen.spec.stop == ["abc"]
    gen.cancel()
    gen.close()


def _outcomes_on_a_thread(calls, timeout_s: float = 10.0) -> list[str]:
    """Each call's outcome, run in order on another thread: "returned", or its EdgeClientError's code (a hang
    fails the test after ``timeout_s``)."""
    from edge_client import EdgeClientError

    outcome = []

    def run():
        for call in calls:
            try:
                call()
                outcome.append("returned")
            except EdgeClientError as e:
                outcome.append(e.code)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"hung after {outcome}"
    return outcome


def test_a_closed_client_refuses_requests_instead_of_hanging(tiny_bundle):
    from edge_client import EdgeClient

    c = EdgeClient(tiny_bundle, DEAD_URL)
    c.close()
    calls = (lambda: c.generate(prompt="hi"), c.connect, lambda: c.preload_prompts(tiny_bundle / "x.txt"))
    assert _outcomes_on_a_thread(calls) == ["closed"] * 3


def test_closing_the_client_ends_its_unfinished_requests(tiny_bundle):
    """``with EdgeClient(...) as c: gen = c.generate(...)`` and iterating after the block (or close() from another
    thread mid-stream) waited forever: the client's loop stopped under the request. Now it fails as ``closed``."""
    import asyncio

    from edge_client import EdgeClient

    async def drain(agen):
        return [d async for d in agen]

    loop = asyncio.new_event_loop()
    with EdgeClient(tiny_bundle, DEAD_URL) as c:  # its requests wait on connect retries: unfinished at close
        gen = c.generate(prompt="hi", max_tokens=2)
        agen = c.agenerate(prompt="hi", max_tokens=2, loop=loop)
    outcome = _outcomes_on_a_thread((lambda: list(gen), lambda: loop.run_until_complete(drain(agen))))
    loop.close()
    assert outcome == ["closed"] * 2 and gen.finish_reason == "error"
    # a stream whose consumer's event loop has closed (its asyncio.run ended) is dropped without a word
    gone = asyncio.new_event_loop()
    with EdgeClient(tiny_bundle, DEAD_URL) as c:
        orphan = c.agenerate(prompt="hi", max_tokens=2, loop=gone)
        gone.close()
    assert not orphan._done  # close() ran past it: 'RuntimeError: Event loop is closed' raised out of it


def test_a_request_being_prepared_when_another_thread_closes_the_client_fails_closed(tiny_bundle):
    """generate() prepares a request on its caller's thread (tokenizes it, encodes its images: a second or more)
    before handing it to the client's loop. Closed by another thread meanwhile, the request went to the stopped
    loop, never ran, and its stream was read for ever; it now fails as ``closed``."""
    from edge_client import EdgeClient

    c = EdgeClient(tiny_bundle, DEAD_URL)
    decide = c._decide

    def closed_meanwhile(*args, **kwargs):  # the last step before the hand-over: the other thread's close() lands
        decision = decide(*args, **kwargs)
        c.close()
        return decision

    c._decide = closed_meanwhile
    assert _outcomes_on_a_thread((lambda: list(c.generate(prompt="hi", max_tokens=2)),), timeout_s=5.0) == ["closed"]


def test_a_closed_client_leaves_no_thread_behind(tiny_bundle, tmp_path):
    """close() stopped the client's loop but never closed it: the threads its executor ran the front on stayed, one
    or two a client, for as long as the app kept the closed client (ten kept: eleven threads)."""
    from edge_client import EdgeClient

    before = set(threading.enumerate())
    (tmp_path / "system.txt").write_text("You are a phone agent.")
    c = EdgeClient(tiny_bundle, DEAD_URL)
    assert c.preload_prompts(tmp_path / "system.txt", as_system=False) > 0  # the front runs on the executor
    c.close()
    deadline = time.monotonic() + 3.0
    while (left := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, sorted(t.name for t in left)
    assert c._closed  # kept by the test all along


def test_closing_the_client_ends_a_call_waiting_on_another_thread(tiny_bundle):
    """close() stopped the client's loop under a connect() or preload_prompts() another thread was waiting on: that
    thread waited forever, and the stopped task was logged 'destroyed but pending' (Ctrl-C in `autoglm-edge
    preload`). The loop's tasks are now cancelled and awaited first: the call fails as ``closed``."""
    import socket

    from edge_client import EdgeClient, EdgeClientError

    with socket.socket() as silent:  # takes the TCP connection, never answers the WebSocket handshake
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        c = EdgeClient(tiny_bundle, f"ws://127.0.0.1:{silent.getsockname()[1]}")
        outcome = []

        def connect():
            try:
                c.connect()
                outcome.append("returned")
            except EdgeClientError as e:
                outcome.append(e.code)

        waiting = threading.Thread(target=connect, daemon=True)
        waiting.start()
        time.sleep(0.5)  # connect() waits on the handshake (connect_timeout_s 10)
        c.close()
        waiting.join(5)
    assert not waiting.is_alive() and outcome == ["closed"]


# -- bundles --------------------------------------------------------------------------------------------------


def test_manifest_dims_that_disagree_with_the_graph_are_refused(tiny_bundle, tmp_path):
    """num_kv_heads / head_dim are outside the bundle id: an edited value must still not load."""
    from edge_client.front import FrontRuntime

    d = tmp_path / "b"
    shutil.copytree(tiny_bundle, d)
    m = json.loads((d / "manifest.json").read_text())
    m["head_dim"] *= 2
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="head_dim"):
        FrontRuntime(d)


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.__setitem__("artifacts", []), "artifacts: expected a JSON object"),
    (lambda m: m.__setitem__("num_kv_heads", "2"), "num_kv_heads '2': expected an integer"),
    (lambda m: m.__setitem__("quant_report", []), "quant_report: expected a JSON object"),
    (lambda m: m["artifacts"]["edge/front.onnx"].__setitem__("bytes", "many"), "bytes 'many'"),
    # outside the bundle id, so the edit loaded: a TypeError traceback in Manifest.edge_variant
    (lambda m: m.__setitem__("quant_report", {"prefill": "fp32"}), "quant_report.prefill 'fp32'"),
])
def test_edited_manifest_fields_fail_naming_the_manifest(edit, match, tiny_bundle, tmp_path):
    from edge_client import EdgeClient

    d = tmp_path / "b"
    shutil.copytree(tiny_bundle, d)
    m = json.loads((d / "manifest.json").read_text())
    edit(m)
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match=match) as e:
        EdgeClient(d, DEAD_URL, verify_bundle=False)
    assert str(d / "manifest.json") in str(e.value)


# -- media ------------------------------------------------------------------------------------------------------


def _png_header(w: int, h: int) -> bytes:
    """A PNG whose header declares w x h RGB pixels and whose data is a small zlib stream (a decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * (1 << 16))) + chunk(b"IEND", b""))


@pytest.mark.parametrize("side", [7000, 20000])  # ours fires below PIL's guard (179 M pixels), PIL's above it
def test_huge_declared_images_are_image_too_large(side):
    from edge_client.vision import MediaError, decode_image

    with pytest.raises(MediaError) as e:
        decode_image(_png_header(side, side))
    assert e.value.code == "image_too_large"


def test_16_bit_grayscale_keeps_its_levels():
    from PIL import Image

    from edge_client.vision import decode_image

    levels = (np.arange(16).reshape(4, 4) * 4000).astype(np.uint16)  # 0 .. 60000 of 65535
    buf = io.BytesIO()
    Image.fromarray(levels).save(buf, format="PNG")
    rgb = np.asarray(decode_image(buf.getvalue()))
    assert rgb.shape == (4, 4, 3) and (rgb[..., 0] == (levels >> 8)).all()  # not clipped to white above 255


def test_a_32_bit_integer_image_is_read_as_pil_reads_it_and_only_16_bit_samples_are_scaled():
    """A PIL mode 'I' image (32-bit integers) was taken for 16-bit grayscale and scaled by 1/256: an app's
    ``convert("I")`` of an 8-bit picture (levels 0..255) came out black. Only 16-bit samples are scaled (the 'I;16'
    modes, a 16-bit PNG, EXIF-turned or not); any other 'I' image converts as PIL and the model's processor do."""
    from PIL import Image

    from edge_client.vision import decode_image, load_image, open_image

    gray = Image.fromarray((np.arange(48).reshape(6, 8) * 5).astype(np.uint8))  # levels 0 .. 235
    as_int32 = np.asarray(load_image(open_image(gray.convert("I"))))
    assert (as_int32 == np.asarray(gray.convert("RGB"))).all()  # was all 0
    wide = Image.fromarray(np.array([[-5, 0, 200, 70000, 2**31 - 1]], np.int32))
    assert np.asarray(load_image(open_image(wide)))[0, :, 0].tolist() == [0, 0, 200, 255, 255]  # PIL's clip
    levels = (np.arange(48).reshape(6, 8) * 1300).astype(np.uint16)
    exif = Image.Exif()
    exif[0x0112] = 6  # a sideways photo: the turned image has no format to tell its depth by
    buf = io.BytesIO()
    Image.fromarray(levels).save(buf, format="PNG", exif=exif)
    turned = np.asarray(decode_image(buf.getvalue()))[..., 0]
    assert (turned == np.rot90(levels >> 8, -1)).all()


def test_a_16_bit_png_with_a_transparent_level_is_on_white():
    """A 16-bit grayscale PNG's tRNS (one transparent level) was dropped when it was scaled to 8 bits: its transparent
    pixels came out as their gray, where every other transparent image is composited on white."""
    from PIL import Image

    from edge_client.vision import decode_image

    levels = np.full((3, 5), 1000, np.uint16)
    levels[0, 0] = levels[2, 4] = 5000
    buf = io.BytesIO()
    Image.fromarray(levels).save(buf, format="PNG", transparency=5000)
    rgb = np.asarray(decode_image(buf.getvalue()))
    assert (rgb[0, 0] == 255).all() and (rgb[2, 4] == 255).all()  # was 19: 5000 >> 8
    assert (rgb[1, 1] == 1000 >> 8).all()


def _wav(frames: int, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((3000 * np.sin(np.arange(frames) * 0.05)).astype("<i2").tobytes())
    return buf.getvalue()


def test_truncated_wav_is_refused_not_encoded_in_part():
    from edge_client.audio import decode_wav
    from edge_client.vision import MediaError

    samples, rate = decode_wav(_wav(16000))
    assert samples.size == 16000 and rate == 16000
    with pytest.raises(MediaError, match="truncated WAV: 478 of the 16000 frames") as e:
        decode_wav(_wav(16000)[:1000])
    assert e.value.code == "bad_audio"


def test_the_phone_sampler_treats_a_vanishing_temperature_as_greedy():
    """u-shape sampling on the phone: 1 / 1e-300 would scale the logits to inf and NaN; below MIN_TEMPERATURE the
    phone takes the argmax, as the cloud does."""
    from edge_client.sampling import EdgeSampler

    logits = np.array([0.5, 3.0, -1.0, 2.9])
    for t in (1e-300, 1e-40, 1e-6):
        s = EdgeSampler(temperature=t, top_p=0.9, seed=7)
        assert s.greedy and s.sample(logits, position=3) == 1
    assert not EdgeSampler(temperature=0.7).greedy


@pytest.mark.parametrize("seed", [-1, 1 << 63, 1.5, True])
def test_a_seed_outside_the_wire_range_is_refused_before_sampling(seed):
    from edge_client.request import RequestSpec

    with pytest.raises(ValueError, match="seed"):
        RequestSpec(prompt_ids=[1, 2], seed=seed)


def test_chat_template_kwargs_past_their_bound_are_a_400_before_any_render(tiny_bundle, tiny_cloud):
    """A real local API over a real cloud: chat_template_kwargs of 900,000 keys (12 MB, within the body limit) took
    the phone 7 s of CPU and 570 MB, rendered twice (each variable copied into the template's context); now more
    than MAX_TEMPLATE_KWARGS_ITEMS keys and values, however nested, are refused by name before the template runs,
    and as many as that are served."""
    import urllib.error
    import urllib.request

    from edge_client import EdgeClient
    from edge_client.local_api import create_app
    from local_server import local_server

    def post(url, kwargs):
        body = json.dumps({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                           "chat_template_kwargs": kwargs}).encode()
        try:
            with urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}),
                                        timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    bound = 256  # shared.openai_compat.MAX_TEMPLATE_KWARGS_ITEMS
    rendered = []
    with EdgeClient(tiny_bundle, tiny_cloud.ws_url) as c:
        render = c.tokenizer.template.render
        c.tokenizer.template.render = lambda *a, **kw: rendered.append(len(kw)) or render(*a, **kw)
        with local_server(create_app(c)) as base:
            url = base + "/v1/chat/completions"
            at_bound = {f"k{i}": 1 for i in range(bound // 2)}
            assert post(url, at_bound)[0] == 200
            rendered.clear()
            for too_many in ({f"k{i}": 1 for i in range(200_000)}, {"k": [1] * 200_000},
                             {"k": [{"a": [1] * 100}] * 3}):
                status, body = post(url, too_many)
                assert status == 400 and body["error"]["param"] == "chat_template_kwargs", body
                assert f"more than {bound} keys and values" in body["error"]["message"]
            assert rendered == []  # refused before the template ran
