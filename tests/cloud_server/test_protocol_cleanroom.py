"""A clean-room client of the split protocol, written only from docs/protocol.md and its golden files, against
the real server on a tiny-glm4 bundle (split at layer 2, int8 edge: what `autoglm-partition split --preset
tiny-glm4 --layer 2` writes).

The client below (everything above the tests) must NOT import the repository's wire code - no ``shared``,
``edge_client`` or ``cloud_server`` module: only ``msgpack``, ``numpy``, ``onnxruntime``, ``websockets`` and
``zstandard``, as a developer porting the protocol to another language has them. It runs the bundle's edge
ONNX itself (docs/protocol.md, "Boundary states"), codes states with the byte-exact codecs (``fp32``, ``fp16``,
``bf16``, ``int8-b32``), names prefix blocks by the doc's key derivation, speculates (SpecStep), streams and decodes tokens, cancels, resumes after a dropped link and handles Error
frames (the server's, and its own: an edge's Error naming a request closes it); a u-shape client runs the
bundle's tail (edge/tail.onnx) over the States it gets back. Where it fails, the doc (or
the server) is wrong. The repo's ``EdgeClient`` is used only as the
reference its greedy tokens must equal."""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
from pathlib import Path

import msgpack
import numpy as np
import onnxruntime as ort
import pytest
import websockets
import zstandard

# -- the clean-room client: docs/protocol.md only ----------------------------------------------------------
HELLO, WELCOME, PREFILL, DECODE, TOKENS, CANCEL, RESUME, ERROR, DRAIN, CLOSE, RESUMED = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11
GOLDEN = Path(__file__).parents[1] / "shared" / "golden"
KEY = "cleanroom-key-0123456789"
PROMPT = [5, 17, 99, 200, 301, 42, 7, 8, 9, 10, 123, 77]
LONG = [(i * 37 + 11) % 500 + 4 for i in range(40)]  # two full prefix blocks of 16


def pack(msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(frame: bytes):
    return msgpack.unpackb(frame, raw=False)


def encode(codec: str, x, zstd: bool = False) -> list:
    """EncodedTensor ``[codec, [S, H], data, zstd]`` ("Codec payloads")."""
    x = np.ascontiguousarray(x, np.float32)
    s, h = x.shape
    if codec == "fp32":
        data = x.astype("<f4").tobytes()
    elif codec == "fp16":
        data = x.astype("<f2").tobytes()
    elif codec == "bf16":  # the upper 16 bits, rounded to nearest even
        u = x.view("<u4").astype(np.uint64)
        data = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()
    elif codec == "int8-b32":
        nb = -(-h // 32)
        scales, codes = np.zeros((s, nb), "<f2"), np.zeros((s, h), np.int8)
        for j in range(nb):
            blk = x[:, 32 * j:32 * (j + 1)]
            want = np.abs(blk).max(axis=1) / np.float32(127)
            sc = want.astype(np.float16)
            low = sc.astype(np.float32) < want  # rounded *up* to float16
            sc[low] = np.nextafter(sc[low], np.float16(np.inf))
            scales[:, j] = sc
            d = sc.astype(np.float32)[:, None]
            codes[:, 32 * j:32 * (j + 1)] = np.clip(np.rint(np.divide(blk, d, out=np.zeros_like(blk), where=d > 0)),
                                                    -127, 127)
        data = scales.tobytes() + codes.tobytes()
    else:
        raise ValueError(codec)
    if zstd:
        data = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(data)
    return [codec, [s, h], data, zstd]


def params(max_tokens: int) -> list:
    """SamplingParams, greedy (temperature 0)."""
    return [max_tokens, 0.0, 1.0, 0, None, [], False, False, 0, 0.0, 0.0, 1.0]


def prefix_keys(manifest: dict, ids: list[int], block: int, encoding: str) -> list[str]:
    """The keys of the full blocks of a text prompt ("Prefix keys", key version 3)."""
    def lp(s: str) -> bytes:
        return struct.pack("<I", len(s.encode())) + s.encode()

    arts = manifest["artifacts"]
    graphs = [g for g in ("edge/front.onnx", "edge/front_prefill.onnx", "edge/vision.onnx", "edge/audio.onnx")
              if g in arts]
    digest = hashlib.sha256("".join(f"{g}={arts[g]['sha256']};" for g in graphs).encode()).hexdigest()[:16]
    variant = manifest["edge_quant"] + ("+fp32-prefill" if "edge/front_prefill.onnx" in arts else "") + "#" + digest
    k = hashlib.sha256(b"autoglm-prefix-key\x00" + struct.pack("<I", 3) + lp(manifest["bundle_id"]) + lp(variant)
                       + lp(encoding)).digest()
    keys = []
    for i in range(len(ids) // block):
        k = hashlib.sha256(k + np.array(ids[i * block:(i + 1) * block], "<i8").tobytes() + bytes(32)).digest()
        keys.append(k.hex())
    return keys


class Front:
    """The bundle's fused front graph, edge/front.onnx ("Boundary states")."""

    def __init__(self, bundle: Path):
        self.manifest = json.loads((bundle / "manifest.json").read_text())
        self.graph = ort.InferenceSession(str(bundle / "edge" / "front.onnx"), providers=["CPUExecutionProvider"])
        meta = self.graph.get_modelmeta().custom_metadata_map
        assert meta["autoglm.edge_graph"] == "fused-gqa", meta
        self.capacity = min(int(meta["autoglm.max_positions"]), 256)
        self.reset()

    def reset(self) -> None:
        m = self.manifest
        self.p = 0
        self.kv = {f"past_{kv}.{i}": np.zeros((1, m["num_kv_heads"], self.capacity, m["head_dim"]), np.float32)
                   for i in range(m["split_layer"]) for kv in ("key", "value")}

    def run(self, ids: list[int]) -> np.ndarray:
        s = len(ids)
        feeds = {"input_ids": np.array([ids], np.int64), "seqlens_k": np.array([self.p + s - 1], np.int32),
                 "total_sequence_length": np.array(self.p + s, np.int32), **self.kv}
        out = self.graph.run(["hidden_states"] + [k.replace("past_", "present_") for k in self.kv], feeds)
        self.kv = dict(zip(self.kv, out[1:]))
        self.p += s
        return out[0][0]


class Tail:
    """A u-shape bundle's tail, edge/tail.onnx ("U-shape"): the middle's States -> logits of the last rows."""

    def __init__(self, bundle: Path, manifest: dict):
        self.graph = ort.InferenceSession(str(bundle / "edge" / "tail.onnx"), providers=["CPUExecutionProvider"])
        assert self.graph.get_modelmeta().custom_metadata_map["autoglm.edge_graph"] == "fused-gqa-tail"
        self.past = [i.name for i in self.graph.get_inputs() if i.name.startswith("past_")]
        self.p, self.kv = 0, {n: np.zeros((1, manifest["num_kv_heads"], 256, manifest["head_dim"]), np.float32)
                              for n in self.past}

    def run(self, states: np.ndarray, rows: int) -> np.ndarray:
        s = states.shape[0]
        feeds = {"boundary_states": states[None], "seqlens_k": np.array([self.p + s - 1], np.int32),
                 "total_sequence_length": np.array(self.p + s, np.int32), "logits_rows": np.array([rows], np.int64),
                 **self.kv}
        out = self.graph.run(["logits"] + [n.replace("past_", "present_") for n in self.past], feeds)
        self.kv = dict(zip(self.past, out[1:]))
        self.p += s
        return out[0][0]


def decode_fp32(t: list) -> np.ndarray:
    assert t[0] == "fp32" and not t[3]
    return np.frombuffer(t[2], "<f4").reshape(t[1])


class Session:
    def __init__(self, url: str, bundle_id: str, codecs: list[str], key: str | None = KEY):
        self.url, self.bundle_id, self.codecs, self.key = url, bundle_id, codecs, key

    async def connect(self, resume_token: str | None = None, version: int = 1, bundle_id: str | None = None):
        """Hello; returns the Welcome as a dict, or the refusing Error frame and the close code."""
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        self.ws = await websockets.connect(self.url, additional_headers=headers, compression=None)
        await self.send([HELLO, version, bundle_id or self.bundle_id, self.codecs,
                         [None, None, "unknown", None, None, "cleanroom/1"], resume_token])
        first = await self.recv()
        if first[0] == ERROR:
            return first, await self.closed()
        names = ["type", "protocol_version", "session_id", "resume_token", "resumed", "limits", "plan", "codecs",
                 "server", "cached_prefixes", "requests"]
        self.welcome = dict(zip(names, first))
        return self.welcome

    async def send(self, msg) -> None:
        await self.ws.send(pack(msg))

    async def recv(self, timeout: float = 30.0):
        frame = await asyncio.wait_for(self.ws.recv(), timeout)
        assert isinstance(frame, bytes)
        return unpack(frame)

    async def closed(self) -> int | None:
        try:
            while True:
                await asyncio.wait_for(self.ws.recv(), 10)
        except websockets.ConnectionClosed as e:
            return e.rcvd.code if e.rcvd else None

    async def quiet(self, seconds: float = 0.3) -> list:
        """Everything the server sends within ``seconds``."""
        got = []
        try:
            while True:
                got.append(await self.recv(seconds))
        except (asyncio.TimeoutError, TimeoutError):
            return got

    async def answer(self, rid: str):
        """The next Tokens (progress skipped) or Error for ``rid``."""
        while True:
            m = await self.recv()
            if m[0] == TOKENS and m[1] == rid and (m[3] or m[6] is not None):
                return m
            if m[0] == ERROR and m[3] in (rid, None):
                return m


async def generate(sess: Session, front: Front, rid: str, max_tokens: int, codec: str, stop_after: int = 0,
                   chunk: int = 0, zstd: bool = False, prompt: list[int] = PROMPT, cached: int = 0,
                   keys: list[str] = ()) -> list[int]:
    """A greedy request: Prefill (in chunks of ``chunk``; from ``cached``, the server's prefix cache holding the
    positions before, named by ``keys``), then a DecodeStep per token; returns early (no step sent for the last
    token) once ``stop_after`` tokens came. ``sess.usage``: the final Tokens' usage."""
    front.reset()
    h = front.run(prompt)
    cut = chunk or len(prompt)
    for start in range(cached, len(prompt), cut):
        first, last = start == cached, start + cut >= len(prompt)
        await sess.send([PREFILL, rid, start, encode(codec, h[start:start + cut], zstd), last,
                         params(max_tokens) if first else None, list(keys) if first else []])
    out: list[int] = []
    while True:
        m = await sess.answer(rid)
        assert m[0] == TOKENS and m[2] == len(out), m
        sess.usage = m[7]
        out += m[3]
        if m[6] is not None or len(out) == stop_after:
            return out
        pos = front.p
        await sess.send([DECODE, rid, pos, encode(codec, front.run([out[-1]]), zstd), None, 0])


async def speculate(sess: Session, front: Front, rid: str, guide: list[int]) -> list[int]:
    """Greedy SpecSteps whose 3 drafts come from ``guide``, the last one wrong: each answer accepts a prefix."""
    assert sess.welcome["server"][4] >= 3  # max_draft_tokens
    out = (await generate(sess, front, rid, len(guide), "fp32", stop_after=1))
    while True:
        drafts = guide[len(out):len(out) + 3] or [1]
        drafts[-1] = (drafts[-1] + 1) % 512
        pos = front.p
        await sess.send([12, rid, pos, encode("fp32", front.run([out[-1]] + drafts)), drafts, None, 0])
        m = await sess.answer(rid)
        assert m[0] == TOKENS and m[2] == len(out) and 1 <= len(m[3]) <= len(drafts) + 1, m
        out += m[3]
        front.p = pos + len(m[3])  # keep the fed token and the accepted drafts; the KV rows past P are unused
        if m[6] is not None:
            return out


async def finish(sess: Session, front: Front, rid: str, out: list[int], codec: str) -> list[int]:
    while True:
        pos = front.p
        await sess.send([DECODE, rid, pos, encode(codec, front.run([out[-1]])), None, 0])
        m = await sess.answer(rid)
        assert m[0] == TOKENS and m[2] == len(out), m
        out += m[3]
        if m[6] is not None:
            return out


# -- the tests -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_glm4_int8_bundle):
    from cloud_support import serving

    from cloud_server.config import ServerConfig

    with serving(ServerConfig(bundle=tiny_glm4_int8_bundle, api_key=KEY, session_grace_s=30.0)) as srv:
        yield srv


@pytest.fixture(scope="module")
def front(tiny_glm4_int8_bundle):
    return Front(tiny_glm4_int8_bundle)


def test_the_doc_only_encoders_write_the_golden_bytes():
    """The frames of frames.json and the payloads of codecs.json, from the doc's rules alone."""
    def fields(v):
        if isinstance(v, dict):
            return bytes.fromhex(v["hex"]) if set(v) == {"hex"} else [fields(x) for x in v.values()]
        return [fields(x) for x in v] if isinstance(v, list) else v

    for f in json.loads((GOLDEN / "frames.json").read_text())["frames"]:
        msg = [f["type"]] + [fields(v) for v in f["fields"].values()]
        assert pack(msg) == (GOLDEN / f["file"]).read_bytes(), f["file"]
        assert unpack((GOLDEN / f["file"]).read_bytes()) == msg
    for v in json.loads((GOLDEN / "codecs.json").read_text())["vectors"]:
        if v["codec"] in ("fp32", "fp16", "bf16", "int8-b32"):
            x = np.frombuffer(bytes.fromhex(v["input_f32le"]), "<f4").reshape(v["shape"])
            assert encode(v["codec"], x)[2].hex() == v["payload"], v["codec"]


def test_a_doc_only_client_gets_the_edge_clients_greedy_tokens(server, front, tiny_glm4_int8_bundle):
    from edge_client.client import EdgeClient  # the reference only

    async def ours():
        sess = Session(server.ws_url, front.manifest["bundle_id"], ["fp32", "fp16", "bf16", "int8-b32"])
        w = await sess.connect()
        assert w["protocol_version"] == 1 and not w["resumed"] and set(w["codecs"]) == {"fp32", "fp16", "bf16",
                                                                                        "int8-b32"}
        got = {c: await generate(sess, front, f"r-{c}", 10, c) for c in ("fp32", "fp16", "bf16", "int8-b32")}
        got["fp32 chunked zstd"] = await generate(sess, front, "r-chunks", 10, "fp32", chunk=5, zstd=True)
        got["fp32 speculative"] = await speculate(sess, front, "r-spec", got["fp32"])
        await sess.send([CLOSE, "done"])
        assert await sess.closed() == 1000
        return got

    async def from_the_edge_clients_blocks():
        """The EdgeClient's request published LONG's two full blocks: keys derived from the doc name them."""
        sess = Session(server.ws_url, front.manifest["bundle_id"], ["fp32"])
        w = await sess.connect()
        keys = prefix_keys(front.manifest, LONG, w["limits"][4], "fp32")
        assert len(keys) == 2 and set(keys) <= set(w["cached_prefixes"])
        tokens = await generate(sess, front, "r-cached", 6, "fp32", prompt=LONG, cached=32, keys=keys)
        assert sess.usage == [len(LONG), 6, 32]
        return tokens

    got = asyncio.run(ours())
    with EdgeClient(tiny_glm4_int8_bundle, server.url.replace("http", "ws"), api_key=KEY) as client:
        for codec in ("fp32", "fp16", "bf16", "int8-b32"):
            gen = client.generate(prompt_ids=PROMPT, max_tokens=10, precision=codec)
            want = [tok for tok, _ in gen.iter_tokens()]
            assert gen.stats.codec == gen.stats.step_codec == codec
            assert got[codec] == want, codec
        gen = client.generate(prompt_ids=LONG, max_tokens=6, precision="fp32")
        want = [tok for tok, _ in gen.iter_tokens()]
    assert got["fp32 chunked zstd"] == got["fp32 speculative"] == got["fp32"]
    assert asyncio.run(from_the_edge_clients_blocks()) == want


def test_the_timings_a_doc_only_client_reads_are_the_ones_the_doc_describes(server, front):
    """Tokens.timings: the doc called queue_ms and compute_ms "durations for this message's work", and the
    reference server sends 0 for both on every message (only total_ms and draft_ms are measured): a client
    that showed its users the queue wait read 0 under any load. The doc's row must say which are sent."""
    async def run():
        sess = Session(server.ws_url, front.manifest["bundle_id"], ["fp32"])
        await sess.connect()
        front.reset()
        await sess.send([PREFILL, "t1", 0, encode("fp32", front.run(PROMPT)), True, params(3)])
        seen = []
        while True:
            m = await sess.answer("t1")
            seen.append(m[8])
            if m[6] is not None:
                break
            await sess.send([DECODE, "t1", front.p, encode("fp32", front.run(m[3][-1:])), None, 0])
        await sess.send([CLOSE, ""])
        return seen

    seen = asyncio.run(run())
    assert len(seen) == 3 and all(t[2] > 0 for t in seen)  # total_ms: the server's time for each answer
    row = next(line for line in (Path(__file__).parents[2] / "docs" / "protocol.md").read_text().splitlines()
               if line.startswith("| 7 | timings |"))
    if all(t[0] == 0 and t[1] == 0 for t in seen):
        assert "sends 0 for both" in row, row


def test_a_doc_only_client_cancels_resumes_and_handles_errors(server, front):
    bid = front.manifest["bundle_id"]

    async def run():
        sess = Session(server.ws_url, bid, ["fp32", "fp16"])
        await sess.connect()
        whole = await generate(sess, front, "whole", 12, "fp32")
        # Cancel: the final Tokens has no tokens and counts those sent; a second Cancel gets nothing
        assert len(await generate(sess, front, "c1", 50, "fp32", stop_after=3)) == 3
        await sess.send([CANCEL, "c1"])
        m = await sess.answer("c1")
        assert (m[2], m[3], m[6]) == (3, [], "cancelled")
        await sess.send([CANCEL, "c1"])
        assert await sess.quiet() == []
        # a request-level Error: that request is closed, the session goes on
        out = await generate(sess, front, "e1", 50, "fp32", stop_after=2)
        await sess.send([DECODE, "e1", front.p + 3, encode("fp32", front.run([out[-1]])), None, 0])
        m = await sess.answer("e1")
        assert m[0] == ERROR and (m[1], m[3], m[4]) == ("bad_position", "e1", False)
        assert await generate(sess, front, "after", 12, "fp16") == whole
        # the client's own non-fatal Error naming its request: that request is closed (as by a Cancel)
        assert len(await generate(sess, front, "edge-failed", 50, "fp32", stop_after=2)) == 2
        await sess.send([ERROR, "internal", "the front failed", "edge-failed", False])
        m = await sess.recv(5.0)
        assert m[0] == TOKENS and (m[1], m[2], m[3], m[6]) == ("edge-failed", 2, [], "cancelled"), m
        await sess.send([DECODE, "edge-failed", front.p, encode("fp32", front.run([5])), None, 0])
        assert await sess.quiet() == []  # a late step of a closed request: ignored
        # resume after a dropped link: a TCP reset, then a WebSocket close without a Close message
        for how in ("reset", "websocket close"):
            rid = f"res-{how.split()[0]}"
            out = await generate(sess, front, rid, 12, "fp32", stop_after=4)
            token = sess.welcome["resume_token"]
            if how == "reset":
                sess.ws.transport.abort()
            else:
                await sess.ws.close()
            sess = Session(server.ws_url, bid, ["fp32", "fp16"])
            w = await sess.connect(resume_token=token)
            assert w["resumed"] and w["requests"] == [[rid, len(PROMPT) + 3, 4]], w
            await sess.send([RESUME, rid, len(out)])
            m = await sess.recv()
            assert m[0] == RESUMED and m[1:5] == [rid, front.p, 4, []], m
            assert await finish(sess, front, rid, out, "fp32") == whole
        await sess.send([RESUME, "never-opened", 0])
        m = await sess.recv()
        assert m[0] == ERROR and (m[1], m[3], m[4]) == ("resume_failed", "never-opened", False)
        # a fatal Error: a text frame, then close 1002
        await sess.ws.send("text")
        m = await sess.recv()
        assert m[0] == ERROR and (m[1], m[4]) == ("bad_frame", True)
        assert await sess.closed() == 1002
        # refusals at the handshake
        with pytest.raises(websockets.InvalidStatus) as refused:
            await Session(server.ws_url, bid, ["fp32"], key="wrong-key-0123456789").connect()
        assert refused.value.response.status_code == 401
        err, code = await Session(server.ws_url, bid, ["fp32"]).connect(version=2)
        assert (err[1], err[4], code) == ("version", True, 1008)
        err, code = await Session(server.ws_url, bid, ["fp32"]).connect(bundle_id="0" * 32)
        assert (err[1], err[4], err[6], code) == ("bundle_mismatch", True, [bid], 1008)

    asyncio.run(run())


def test_a_doc_only_u_shape_client_samples_the_edge_clients_greedy_tokens(tiny_glm4_ushape_bundle):
    """Prefill(return_states) -> States -> the phone's tail -> its own token -> StatesStep; one speculative
    StatesStep with a wrong draft, rolled back by the next one; Cancel ends it."""
    from cloud_support import serving

    from cloud_server.config import ServerConfig
    from edge_client.client import EdgeClient  # the reference only

    bundle = tiny_glm4_ushape_bundle
    front = Front(bundle)
    tail = Tail(bundle, front.manifest)

    async def ours(url):
        sess = Session(url, front.manifest["bundle_id"], ["fp32"], key=None)
        await sess.connect()
        h = front.run(PROMPT)
        await sess.send([PREFILL, "u1", 0, encode("fp32", h), True, params(10), [], None, None, True])
        out: list[int] = []
        rows, kept, draft = 1, len(PROMPT), None  # logits rows wanted; positions kept after the answer; the draft
        while True:
            m = await sess.recv()
            assert m[0] == 14 and m[1] == "u1" and m[2] == tail.p, m  # States of the positions after the tail's
            token = int(np.argmax(tail.run(decode_fp32(m[3]), rows)[0]))
            assert rows == 1 or token != draft  # the draft is wrong on purpose: rejected
            out.append(token)
            front.p = tail.p = kept  # a rejected draft's position is dropped on both ends of the phone
            if len(out) == 10:
                break
            rows, draft = (2 if len(out) == 3 else 1), (token + 1) % 512
            kept = front.p + 1
            await sess.send([13, "u1", front.p, encode("fp32", front.run([token, draft][:rows])), None])
        await sess.send([CANCEL, "u1"])
        m = await sess.answer("u1")
        assert (m[3], m[6]) == ([], "cancelled"), m
        return out

    with serving(ServerConfig(bundle=bundle)) as srv:
        got = asyncio.run(ours(srv.ws_url))
        with EdgeClient(bundle, srv.url.replace("http", "ws")) as client:
            gen = client.generate(prompt_ids=PROMPT, max_tokens=10, mode="u-shape", precision="fp32")
            assert got == [tok for tok, _ in gen.iter_tokens()]
            assert gen.stats.exec_mode == "u-shape"
