"""Held-out abuse cases against a real server, written apart from the catalogues of test_bad_inputs*.py: malformed
frames and messages over the WebSocket, sampling values at the edges of their documented ranges, a session left
mid-generation, bad clients beside a good one, and bad HTTP bodies on the OpenAI routes. Every bad input gets
its documented answer (an ``Error`` with its code and close code; HTTP 4xx with an OpenAI error body); the
engine keeps running and other sessions keep their tokens. Two servers for the module: split mode over
tiny-glm4, and full-model mode over tiny-glm4 with a byte-level tokenizer built here (no weights to load).

    python -m pytest -s tests/cloud_server/test_abuse_heldout.py
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import time

import httpx
import msgpack
import numpy as np
import pytest
import websockets
import zstandard
from cloud_support import EdgeSim, ServerThread, edge_front, serving
from websockets.exceptions import ConnectionClosed

from cloud_server.app import create_app
from cloud_server.config import EngineConfig, ServerConfig
from cloud_server.full_api import MIN_BODY_BYTES
from cloud_server.runtime import CloudRuntime
from shared import codecs as C
from shared import protocol as P
from shared.manifest import Manifest

H, VOCAB = 64, 512  # tiny-glm4
PROMPT = [17, 200, 31, 5, 99, 140, 7, 63, 250]
STATES = np.random.default_rng(7).standard_normal((6, H)).astype(np.float32)  # hidden states with a clear argmax


@pytest.fixture(scope="module")
def server(tiny_bundle):
    engine = EngineConfig(num_blocks=128, block_size=4, max_model_len=64, max_num_batched_tokens=256)
    with serving(ServerConfig(bundle=tiny_bundle, engine=engine, handshake_timeout_s=2.0,
                              session_grace_s=0.5)) as srv:
        srv.bundle_id = Manifest.load(tiny_bundle).bundle_id
        yield srv


@pytest.fixture(scope="module")
def front(tiny_bundle):
    return edge_front(tiny_bundle)


def _fp16(a: np.ndarray) -> P.EncodedTensor:
    return C.get_codec("fp16").encode(np.asarray(a, np.float32))


def _raw(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


class Probe:
    """A raw WebSocket: send anything, read what comes back."""

    def __init__(self, server):
        self.server = server
        self.ws = None

    async def open(self, hello: bool = True):
        self.ws = await websockets.connect(self.server.ws_url, max_size=None)
        if hello:
            await self.send(P.Hello(bundle_id=self.server.bundle_id, codecs=["fp16"]))
            welcome = await self.recv()
            assert isinstance(welcome, P.Welcome), welcome
        return self

    async def send(self, msg) -> None:
        await self.ws.send(msg if isinstance(msg, (bytes, str)) else P.encode_message(msg))

    async def recv(self, timeout: float = 20.0):
        return P.decode_message(await asyncio.wait_for(self.ws.recv(), timeout))

    async def answer(self) -> tuple:
        """(code of the next Error, whether it is fatal, its request id, the close code or None if still open)."""
        msg = await self.recv()
        assert isinstance(msg, P.Error), msg
        try:
            await asyncio.wait_for(self.ws.recv(), 0.3)
        except ConnectionClosed as e:
            return msg.code, msg.fatal, msg.request_id, e.rcvd.code if e.rcvd else None
        except asyncio.TimeoutError:
            pass
        return msg.code, msg.fatal, msg.request_id, None

    async def close(self) -> None:
        try:
            await self.send(P.Close())
        except ConnectionClosed:
            pass
        await self.ws.close()


async def _first_token(server, params: P.SamplingParams, rows: int = 4) -> tuple[Probe, P.Tokens]:
    p = await Probe(server).open()
    await p.send(P.Prefill(request_id="r", start=0, hidden=_fp16(STATES[:rows]), params=params))
    tok = await p.recv()
    assert isinstance(tok, P.Tokens), tok
    return p, tok


def _tensor(shape, data: bytes, zstd: bool = False) -> list:
    return ["fp16", list(shape), data, zstd]


GOOD = _fp16(STATES[:4]).data
PARAMS = [4, 0.0]  # SamplingParams as a wire array: max_tokens, temperature

# name -> (frames after Hello (None: the frame is the connection's first), (code, fatal, request id, close code))
FATAL = {
    "msgpack nil": (None, _raw(None), ("bad_type", True, None, 1002)),
    "msgpack int": (None, _raw(7), ("bad_type", True, None, 1002)),
    "msgpack map": (None, _raw({"type": 1}), ("bad_type", True, None, 1002)),
    "empty binary frame": (None, b"", ("bad_frame", True, None, 1002)),
    "a str value in a binary frame": (None, _raw("hello"), ("bad_type", True, None, 1002)),
    "Hello of version -1": (None, _raw([1, -1, "b", ["fp16"]]), ("version", True, None, 1008)),
    "nesting 5000 deep": (None, b"\x91" * 5000 + b"\xc0", ("bad_frame", True, None, 1002)),
    "invalid UTF-8 string": (None, b"\x92\x01\xa2\xff\xfe", ("bad_frame", True, None, 1002)),
    "unknown message type 99": ("hello", _raw([99, "x"]), ("bad_type", True, None, 1002)),
    "message type 2^64-1": ("hello", _raw([2**64 - 1]), ("bad_type", True, None, 1002)),
    "Welcome from the client": ("hello", _raw([2]), ("bad_type", True, None, 1002)),
    "Tokens from the client": ("hello", P.Tokens(request_id="r", index=0, token_ids=[1]), ("bad_state", True, None, 1002)),
    "Prefill start 2^64-1": ("hello", _raw([3, "r", 2**64 - 1, _tensor((4, H), GOOD), True, PARAMS]),
                             ("bad_value", True, None, 1002)),
    "Prefill start a float": ("hello", _raw([3, "r", 0.0, _tensor((4, H), GOOD), True, PARAMS]),
                              ("bad_type", True, None, 1002)),
    "shape of 3 dimensions": ("hello", _raw([3, "r", 0, _tensor((1, 4, H), GOOD), True, PARAMS]),
                              ("bad_tensor", True, None, 1002)),
    "shape of 0 rows": ("hello", _raw([3, "r", 0, _tensor((0, H), b""), True, PARAMS]), ("bad_value", True, None, 1002)),
    "shape over 2^28 elements": ("hello", _raw([3, "r", 0, _tensor((2**31, 2**31), b""), True, PARAMS]),
                                 ("too_large", True, None, 1009)),
    "temperature NaN": ("hello", _raw([3, "r", 0, _tensor((4, H), GOOD), True, [4, float("nan")]]),
                        ("bad_value", True, None, 1002)),
    "ask_drafts 33": ("hello", _raw([3, "r", 0, _tensor((4, H), GOOD), True, PARAMS, [], None, None, False, 33]),
                      ("bad_value", True, None, 1002)),
    "not a zstd frame": ("hello", _raw([3, "r", 0, _tensor((4, H), GOOD, zstd=True), True, PARAMS]),
                         ("decompress", True, None, 1002)),
}
zc = zstandard.ZstdCompressor()
# request-level faults: that request fails, the session stays open
PER_REQUEST = {
    "payload shorter than its shape": (_raw([3, "r", 0, _tensor((8, H), GOOD), True, PARAMS]),
                                       ("bad_tensor", False, "r", None)),
    "truncated zstd": (_raw([3, "r", 0, _tensor((4, H), zc.compress(GOOD)[:-5], zstd=True), True, PARAMS]),
                       ("decompress", False, "r", None)),
    "two zstd frames": (_raw([3, "r", 0, _tensor((4, H), zc.compress(GOOD[:256]) + zc.compress(GOOD[256:]), True),
                              True, PARAMS]), ("decompress", False, "r", None)),
    "zstd without a size, 64 MiB of zeros": (
        _raw([3, "r", 0, _tensor((4, H), zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (64 << 20)),
                                 True), True, PARAMS]), ("decompress", False, "r", None)),
    "a cached prefix without keys": (P.Prefill(request_id="r", start=4, hidden=_fp16(STATES[:4]),
                                               params=P.SamplingParams()), ("bad_position", False, "r", None)),
    "DecodeStep before its prompt": (P.DecodeStep(request_id="r", position=0, hidden=_fp16(STATES[:1])),
                                     ("unknown_request", False, "r", None)),
    "Resume of a request never opened": (P.Resume(request_id="r", have_tokens=3), ("resume_failed", False, "r", None)),
}


def test_malformed_frames_and_messages_get_their_documented_answer(server):
    async def fatal(first_or_hello, frame):
        p = await Probe(server).open(hello=first_or_hello is not None)
        await p.send(frame)
        return await p.answer()

    async def per_request(frame):
        p = await Probe(server).open()
        await p.send(frame)
        out = await p.answer()
        await p.send(P.Cancel(request_id="other"))  # the session still reads: a Cancel of nothing is no error
        await p.close()
        return out

    async def main():
        seen = {name: await fatal(first, frame) for name, (first, frame, _) in FATAL.items()}
        seen.update({name: await per_request(frame) for name, (frame, _) in PER_REQUEST.items()})
        return seen

    seen = asyncio.run(main())
    want = {n: w for n, (_, _, w) in FATAL.items()} | {n: w for n, (_, w) in PER_REQUEST.items()}
    assert seen == want
    assert server.runtime.engine.alive


def test_a_frame_of_many_tiny_arrays_is_too_large_before_its_objects_are_built(server, front, tiny_bundle):
    """Each msgpack element is a Python object of up to ~70 bytes from one byte of frame: a 16 MiB Prefill of empty
    arrays (within max_frame_bytes) cost a real server 1.2 GB and 11 s of its event loop (/health unanswered for
    5 s) before its bad_type. The server now counts the elements as the arrays are built (CLIENT_MESSAGE_ITEMS,
    16x what a client's message holds): a fatal too_large, the next session served."""
    n, m = 127, 131071  # 127 arrays of 131,071 empty arrays: 15.9 MiB
    frame = b"\x92\x03\xdc" + n.to_bytes(2, "big") + (b"\xdd" + m.to_bytes(4, "big") + b"\x90" * m) * n
    assert len(frame) <= P.SessionLimits().max_frame_bytes

    async def main():
        p = await Probe(server).open()
        await p.send(frame)
        answer = await p.answer()
        return answer, await _good_client(server, front, tiny_bundle)

    (code, fatal, rid, close), tokens = asyncio.run(main())
    assert (code, fatal, rid, close) == ("too_large", True, None, 1009)
    assert tokens and server.runtime.engine.alive


@pytest.mark.parametrize("link_kbps", [0.0, 1e-300, 1e9])
def test_a_hello_with_a_link_hint_at_the_ends_of_its_range_is_welcomed(server, link_kbps):
    """ClientHints.link_kbps may be 0 on the wire ([0, 1e9]); the precision policy took it as a rate and raised:
    the handshake died with a traceback and the socket closed without a close frame."""
    async def main():
        ws = await websockets.connect(server.ws_url, max_size=None)
        await ws.send(P.encode_message(P.Hello(bundle_id=server.bundle_id, codecs=["fp16"],
                                               hints=P.ClientHints(link_kbps=link_kbps, rtt_ms=0.0))))
        welcome = P.decode_message(await asyncio.wait_for(ws.recv(), 20))
        await ws.send(P.encode_message(P.Prefill(request_id="r", start=0, hidden=_fp16(STATES[:4]),
                                                 params=P.SamplingParams(max_tokens=1, temperature=0.0))))
        tok = P.decode_message(await asyncio.wait_for(ws.recv(), 20))
        await ws.close()
        return welcome, tok

    welcome, tok = asyncio.run(main())
    assert isinstance(welcome, P.Welcome) and isinstance(tok, P.Tokens), (welcome, tok)


def test_permessage_deflate_is_not_negotiated(server):
    """A client offering permessage-deflate got it (uvicorn's default), against the protocol's Transport rule: a
    16 MiB frame of zeros then travelled as ~16 KB for the server to inflate. The session is served without it."""
    async def main():
        ws = await websockets.connect(server.ws_url, max_size=None, compression="deflate")
        extensions = list(ws.protocol.extensions)
        await ws.send(P.encode_message(P.Hello(bundle_id=server.bundle_id, codecs=["fp16"])))
        welcome = P.decode_message(await asyncio.wait_for(ws.recv(), 20))
        await ws.close()
        return extensions, welcome

    extensions, welcome = asyncio.run(main())
    assert extensions == [] and isinstance(welcome, P.Welcome)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("draft", [VOCAB, 2**31 - 1])
def test_a_draft_outside_the_vocabulary_fails_its_request_not_the_engine(server, temperature, draft):
    """A SpecStep's draft ids are in the protocol's range [0, 2^31) but beyond the model's vocabulary: the request
    fails with bad_input. (A sampled request's verification indexed the probabilities with it: the engine thread
    died, and every session with it.)"""
    async def main():
        p, tok = await _first_token(server, P.SamplingParams(max_tokens=8, temperature=temperature, seed=5))
        await p.send(P.SpecStep(request_id="r", position=4, hidden=_fp16(STATES[:2]), draft_ids=[draft]))
        refused = await p.answer()
        # the session goes on: a new request on it is served
        await p.send(P.Prefill(request_id="s", start=0, hidden=_fp16(STATES[:4]),
                               params=P.SamplingParams(max_tokens=1, temperature=temperature, seed=5)))
        again = await p.recv()
        await p.close()
        return refused, again

    refused, again = asyncio.run(main())
    assert refused == ("bad_input", False, "r", None)
    assert isinstance(again, P.Tokens) and again.finish_reason == "length"
    assert server.runtime.engine.alive


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-6])
@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.5, 0), (1.0, 5)])
def test_a_tiny_positive_temperature_samples_the_greedy_token(server, temperature, top_p, top_k):
    """Temperatures in the protocol's range [0, 100] near 0 (1 / T overflows float32): the greedy token. (They
    gave NaN logits: the last vocabulary id with top_p = 1, and with top_p < 1 an index of -1 that killed the
    engine.)"""
    async def token(t):
        p, tok = await _first_token(server, P.SamplingParams(max_tokens=1, temperature=t, top_p=top_p, top_k=top_k,
                                                             seed=3))
        await p.close()
        return tok.token_ids

    async def main():
        return await token(0.0), await token(temperature)

    greedy, tiny = asyncio.run(main())
    assert tiny == greedy and greedy != [VOCAB - 1]
    assert server.runtime.engine.alive


def _garbage_frames(r: random.Random) -> list[bytes]:
    frames = []
    for _ in range(r.randint(1, 6)):
        kind = r.random()
        if kind < 0.3:
            frames.append(bytes(r.getrandbits(8) for _ in range(r.randint(0, 48))))
        elif kind < 0.6:
            frames.append(_raw([r.choice([1, 3, 4, 6, 7, 10, 12, 13, 99]),
                                *[r.choice([None, 1, -1, "x", b"y", [], [1], 2**40, 1.5]) for _ in range(r.randint(0, 8))]]))
        else:
            frames.append(P.encode_message(P.Prefill(
                request_id=f"f{r.randint(0, 2)}", start=r.choice([0, 0, 4]), hidden=_fp16(STATES[:r.randint(1, 6)]),
                params=r.choice([None, P.SamplingParams(max_tokens=r.randint(1, 9), temperature=r.choice([0.0, 0.7]))]))))
    return frames


async def _bad_client(server, seed: int) -> None:
    """Garbage, then a disconnect: an orderly close, or a dropped link (mid-generation when a Prefill got in)."""
    r = random.Random(seed)
    p = await Probe(server).open(hello=r.random() < 0.7)
    for frame in _garbage_frames(r):
        try:
            await p.send(frame)
        except ConnectionClosed:
            break
    await asyncio.sleep(r.random() * 0.2)
    if r.random() < 0.5:
        p.ws.transport.abort()
    else:
        await p.ws.close()


async def _good_client(server, front, tiny_bundle, pause: float = 0.0) -> list[int]:
    edge = EdgeSim(server.ws_url, tiny_bundle, server.bundle_id, front=front)
    await edge.connect()
    tokens, finish, msg = await edge.generate("g", PROMPT, 20, ignore_eos=True, pause=pause)
    assert finish == "length", msg
    await edge.close()
    return tokens


def test_a_session_keeps_its_tokens_while_bad_clients_come_and_go(server, front, tiny_bundle):
    """40 clients send garbage and drop their links (some mid-generation) while one session decodes: its tokens
    are what it gets alone; every dropped session is freed after the resume grace."""
    async def main():
        alone = await _good_client(server, front, tiny_bundle)
        good = asyncio.create_task(_good_client(server, front, tiny_bundle, pause=0.02))
        await asyncio.gather(*(_bad_client(server, seed) for seed in range(40)))
        beside = await good
        deadline = time.monotonic() + 10
        while len(server.app.state.split.registry) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return alone, beside

    alone, beside = asyncio.run(main())
    assert beside == alone and len(alone) == 20
    assert len(server.app.state.split.registry) == 0  # every session detached, expired and freed
    assert server.runtime.engine.alive
    assert httpx.get(server.url + "/ready", timeout=5).status_code == 200


# -- HTTP: full-model mode -------------------------------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if bonus %}{{ bonus + 1 }}{% endif %}{% if add_generation_prompt %}assistant:{% endif %}")


def _byte_tokenizer():
    """One token per byte (ids 4..259) and tiny-glm4's special ids, with a chat template that reads a variable."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<eot>": 3,
             **{c: 4 + i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def http(tiny_lm):
    lm = copy.copy(tiny_lm)
    lm.tokenizer = _byte_tokenizer()
    cfg = ServerConfig(full="tiny-glm4", model_name="tiny",
                       engine=EngineConfig(num_blocks=64, block_size=4, max_model_len=128))
    rt = CloudRuntime(cfg, loaded=lm).start()
    with ServerThread(create_app(rt)) as srv:
        srv.runtime = rt
        yield srv
    rt.stop()


COMPLETION = {"model": "tiny", "prompt": "a b c", "max_tokens": 3, "temperature": 0.0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0.0}


def _post(srv, path: str, body=None, content: bytes | None = None, headers=None) -> httpx.Response:
    return httpx.post(srv.url + path, json=body if content is None else None, content=content,
                      headers={"content-type": "application/json", **(headers or {})}, timeout=20)


HTTP_CASES = {  # name -> (request, status, OpenAI error code, param)
    "seed 2^70": (lambda s: _post(s, "/v1/completions", {**COMPLETION, "seed": 2**70, "temperature": 0.5}),
                  400, "invalid_request_error", "seed"),
    "seed -1": (lambda s: _post(s, "/v1/completions", {**COMPLETION, "seed": -1, "temperature": 0.5}),
                400, "invalid_request_error", "seed"),
    "seed of 400 digits": (lambda s: _post(s, "/v1/completions", content=json.dumps(COMPLETION).replace(
        "}", ', "seed": ' + "9" * 400 + "}").encode()), 400, "invalid_request_error", "seed"),
    "chat_template_kwargs.chat_template": (
        lambda s: _post(s, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"chat_template": "{{ 7 }}"}}),
        400, "invalid_request_error", "chat_template_kwargs"),
    "chat_template_kwargs.tokenize": (
        lambda s: _post(s, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"tokenize": True}}),
        400, "invalid_request_error", "chat_template_kwargs"),
    "chat_template_kwargs.messages": (
        lambda s: _post(s, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"messages": 5}}),
        400, "invalid_request_error", "chat_template_kwargs"),
    "a template variable of the wrong type": (
        lambda s: _post(s, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"bonus": "x"}}),
        400, "invalid_request_error", "messages"),
    "JSON nested 100000 deep": (lambda s: _post(s, "/v1/completions", content=b"[" * 100000 + b"]" * 100000),
                                400, "invalid_request_error", None),
    "body over the limit": (lambda s: _post(s, "/v1/completions", content=b'{"prompt": "' + b"a" * MIN_BODY_BYTES
                                            + b'"}'), 413, "request_too_large", None),
    "NaN temperature": (lambda s: _post(s, "/v1/completions", content=b'{"prompt": "a", "temperature": NaN}'),
                        400, "invalid_request_error", "temperature"),
    "top_p 1.5": (lambda s: _post(s, "/v1/completions", {**COMPLETION, "top_p": 1.5}), 400, "invalid_request_error",
                  "top_p"),
    "n 2": (lambda s: _post(s, "/v1/completions", {**COMPLETION, "n": 2}), 400, "invalid_request_error", "n"),
    "stop a number": (lambda s: _post(s, "/v1/completions", {**COMPLETION, "stop": 5}), 400, "invalid_request_error",
                      "stop"),
    "messages not a list": (lambda s: _post(s, "/v1/chat/completions", {**CHAT, "messages": "hi"}), 400,
                            "invalid_request_error", "messages"),
    "max_tokens a string": (lambda s: _post(s, "/v1/completions", {**COMPLETION, "max_tokens": "3"}), 400,
                            "invalid_request_error", "max_tokens"),
    "presence_penalty 3": (lambda s: _post(s, "/v1/completions", {**COMPLETION, "presence_penalty": 3}), 400,
                           "invalid_request_error", "presence_penalty"),
    "repetition_penalty 0": (lambda s: _post(s, "/v1/completions", {**COMPLETION, "repetition_penalty": 0}), 400,
                             "invalid_request_error", "repetition_penalty"),
    "logprobs true": (lambda s: _post(s, "/v1/chat/completions", {**CHAT, "logprobs": True}), 400,
                      "invalid_request_error", "logprobs"),
    "unknown route": (lambda s: httpx.get(s.url + "/v1/nope", timeout=10), 404, "not_found", None),
    # FastAPI's own pages were served (Swagger UI, the route list), past auth and outside the documented routes
    **{f"FastAPI's {p}": (lambda s, p=p: httpx.get(s.url + p, timeout=10), 404, "not_found", None)
       for p in ("/docs", "/redoc", "/openapi.json")},
    "GET on a POST route": (lambda s: httpx.get(s.url + "/v1/completions", timeout=10), 405, "method_not_allowed",
                            None),
}


def test_bad_http_inputs_get_an_openai_error_and_the_engine_serves_on(http):
    before = _post(http, "/v1/completions", COMPLETION).json()["choices"][0]["text"]
    seen, errors = {}, {}
    for name, (make, *_) in HTTP_CASES.items():
        r = make(http)
        seen[name] = r.status_code
        errors[name] = (r.json()["error"]["code"], r.json()["error"]["param"])
    assert seen == {n: status for n, (_, status, _, _) in HTTP_CASES.items()}
    assert errors == {n: (code, param) for n, (_, _, code, param) in HTTP_CASES.items()}
    assert httpx.get(http.url + "/v1/completions", timeout=10).headers["allow"] == "POST"
    assert http.runtime.engine.alive
    assert _post(http, "/v1/completions", COMPLETION).json()["choices"][0]["text"] == before


def test_a_tiny_positive_temperature_over_http_is_greedy(http):
    greedy = _post(http, "/v1/completions", {**COMPLETION, "max_tokens": 6}).json()["choices"][0]["text"]
    for top_p in (1.0, 0.5):
        r = _post(http, "/v1/completions", {**COMPLETION, "max_tokens": 6, "temperature": 1e-300, "top_p": top_p})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy
    assert http.runtime.engine.alive


def _aborted(srv) -> float:
    """``vllm:request_success{finished_reason="abort"}``: requests the server cut short."""
    for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_stream_left_by_its_client_is_aborted(http):
    body = {**COMPLETION, "max_tokens": 120, "stream": True}
    aborted = _aborted(http)
    with httpx.stream("POST", http.url + "/v1/completions", json=body, timeout=20) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first event: the generation runs; then the client goes
    deadline = time.monotonic() + 10
    while http.runtime.engine.call(lambda e: len(e.seqs)).result(5) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http.runtime.engine.call(lambda e: len(e.seqs)).result(5) == 0
    assert _aborted(http) == aborted + 1  # cut short, not run to its length
    assert _post(http, "/v1/completions", COMPLETION).status_code == 200


def test_penalties_over_http_reach_the_engine(http):
    """presence / frequency / repetition penalties were dropped on the way to the engine: a greedy answer that
    repeats a token changes under a strong repetition penalty."""
    body = {**COMPLETION, "max_tokens": 24}
    plain = _post(http, "/v1/completions", body).json()["choices"][0]["text"]
    assert len(set(plain)) < len(plain)  # the random tiny model repeats itself (bytes: one token each)
    penalized = _post(http, "/v1/completions", {**body, "repetition_penalty": 10.0, "frequency_penalty": 2.0})
    assert penalized.status_code == 200
    assert penalized.json()["choices"][0]["text"] != plain


def test_a_long_prompt_is_tokenized_off_the_event_loop(http, monkeypatch):
    """A tokenization that takes 0.6 s (a long prompt's; a text that cannot fit is refused before it, so here one
    made slow) leaves the same server answering /health at once (on the event loop it would wait the whole
    tokenization). The prompt is then refused as over the context."""
    import threading

    from cloud_server import full_api

    encode = full_api._EngineBackend._encode
    monkeypatch.setattr(full_api._EngineBackend, "_encode", lambda self, *a: time.sleep(0.6) or encode(self, *a))
    body = {**COMPLETION, "prompt": "ab c" * 100}  # 400 characters: no more than 127 positions of 5 hold
    result = {}

    def big():
        t0 = time.perf_counter()
        result["r"] = _post(http, "/v1/completions", body)
        result["s"] = time.perf_counter() - t0

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.15)  # the body is read (loopback) and its tokenization under way
    waits = []
    while t.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(http.url + "/health", timeout=10).status_code == 200
        waits.append(time.perf_counter() - t0)
        time.sleep(0.02)
    t.join()
    assert result["r"].status_code == 400 and result["r"].json()["error"]["param"] == "prompt"
    assert result["s"] > 0.4 and waits  # the tokenization took long enough to be seen
    assert max(waits) < 0.5 * result["s"], (waits, result["s"])


def test_a_connection_still_sending_the_body_of_an_answered_request_is_closed_at_the_handshake_timeout(tiny_lm):
    """A request refused before its body was read (413: a declared length over the limit; 415: a compressed body) is
    answered at once; uvicorn then reads the body's rest to throw it away, and its first bytes cancelled the
    keep-alive timeout: a client that sent a few more and went silent held its connection (a descriptor) for ever,
    as a silent socket did before its first head (test_bad_inputs.py). Closed at --handshake-timeout-s after the
    answer now, like a keep-alive connection whose next head never comes."""
    import socket

    lm = copy.copy(tiny_lm)
    lm.tokenizer = _byte_tokenizer()
    cfg = ServerConfig(full="tiny-glm4", model_name="tiny", handshake_timeout_s=2,
                       engine=EngineConfig(num_blocks=64, block_size=4, max_model_len=128))
    rt = CloudRuntime(cfg, loaded=lm).start()
    try:
        with ServerThread(create_app(rt)) as srv:
            heads = {413: f"Content-Length: {MIN_BODY_BYTES + 1}", 415: "Content-Length: 5000\r\nContent-Encoding: gzip"}
            socks = {}
            for status, head in heads.items():
                s = socks[status] = socket.create_connection(("127.0.0.1", srv.port))
                s.settimeout(15)
                s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{head}\r\n\r\n"
                          .encode())
                assert s.recv(4096).startswith(f"HTTP/1.1 {status} ".encode())
                s.sendall(b"a" * 1000)  # more of a body the server will not read; then silence
            t0, ended = time.monotonic(), {}
            for status, s in socks.items():
                try:
                    while s.recv(4096):
                        pass
                    ended[status] = time.monotonic() - t0
                except TimeoutError:
                    ended[status] = None  # still open
                s.close()
    finally:
        rt.stop()
    assert all(t is not None and t < 2 + 3 for t in ended.values()), ended
