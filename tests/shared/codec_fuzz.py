"""A seeded mutation fuzzer for the boundary codecs' decoders (``BoundaryCodec.decode`` / ``decode_rows``) and the
frame decoder in front of them.

Each iteration encodes valid hidden states with one codec, damages the result with one strategy and decodes it
as a server does (the frame through ``decode_message``, the tensor through the codec). Every outcome must be a
float32 array of the declared shape with finite values, or ``ProtocolError`` with a documented code - never
another exception, a decode slower than :data:`MAX_DECODE_S`, or an allocation beyond :func:`memory_bound`
(measured with ``tracemalloc``, which numpy reports its buffers to).

Strategies: ``bit_flips``, ``truncation``, ``extension``, ``byte_runs`` (runs of 0x00/0xFF/random bytes),
``length_fields`` (int16/int32 fields set huge, negative or zero at any offset: the Rice unary length, the rANS
word counts), ``shape`` (the declared [S, H] inconsistent with the payload), ``nonfinite`` (NaN/Inf float16 and
float32 values at any aligned offset: scales, refs, sink rows), ``huge_scales`` (the largest finite float16 /
float32 scales), ``rans_words`` (the rANS state and renormalisation words), ``zstd_wrap`` (a damaged payload in
a valid zstd frame, its size declared or not), ``zstd_bomb`` (frames declaring, or expanding to, gigabytes) and
``rows`` (``decode_rows`` over one-row tensors, one of them damaged).

    fuzz(codecs, iterations, seed) -> report  (failures listed in report["failures"]; empty when all is well)
"""

from __future__ import annotations

import contextlib
import functools
import random
import struct
import time
import tracemalloc
from collections import Counter

import numpy as np
import zstandard

from shared import protocol as P

MAX_DECODE_S = 1.0
VARIANTS = 16  # valid tensors per codec, shape and zstd flag (encoding is most of a case's cost otherwise)
LIMITS = P.Limits()  # the defaults a server decodes with
STRATEGIES = ("bit_flips", "truncation", "extension", "byte_runs", "length_fields", "shape", "nonfinite",
              "huge_scales", "rans_words", "zstd_wrap", "zstd_bomb", "rows")
_RANS = ("pca-ans-compact", "pca-tcq-compact")


def memory_bound(shape: tuple[int, int], wire_bytes: int) -> int:
    """Bytes a decode may allocate: a few float64 working copies of the output, plus the payload a few times."""
    s, h = shape
    return 24 * s * h + 16 * wire_bytes + (1 << 20)


def _rows(rng: random.Random, h: int, s: int) -> np.ndarray:
    """Activation-like rows [s, h]: a massive channel, sometimes an attention sink first, sometimes far rows."""
    g = np.random.default_rng(rng.getrandbits(32))
    x = g.standard_normal((s, h)) * rng.choice([0.01, 1.0, 3.0])
    x[:, 5 % h] += 200.0 * (rng.random() < 0.7)
    if s and rng.random() < 0.4:
        x[0] *= 40
    if s > 1 and rng.random() < 0.1:
        x[-1] = rng.choice([1e4, -3e4, 0.0])
    return x.astype(np.float32)


def _put(b: bytearray, rng: random.Random, pattern: bytes, align: int = 1) -> None:
    if len(b) >= len(pattern):
        i = rng.randrange(0, len(b) - len(pattern) + 1, align) if len(b) - len(pattern) + 1 > align else 0
        b[i:i + len(pattern)] = pattern


@functools.cache
def _rle_bomb(total: int, declare: bool) -> bytes:
    """A hand-built zstd frame of RLE blocks (4 bytes per 128 KiB) expanding to ``total`` zero bytes; with
    ``declare`` its header says so (8-byte content size), else no size and a 128 KiB window."""
    block = 1 << 17
    n = -(-total // block)
    head = b"\x28\xb5\x2f\xfd" + (b"\xe0" + struct.pack("<Q", total) if declare else b"\x00" + bytes([(17 - 10) << 3]))
    blocks = []
    for i in range(n):
        size = min(block, total - i * block)
        blocks.append(struct.pack("<I", (size << 3) | (1 << 1) | (i == n - 1))[:3] + b"\0")
    return head + b"".join(blocks)


def _scale_field(codec, data: bytes, s: int, h: int) -> tuple[int, np.dtype, int] | None:
    """(offset, dtype, count) of the scales in a valid payload of ``codec`` (the codecs that send scales)."""
    if hasattr(codec, "block"):  # int8-b<B>, int4-b<B>: float16 scales [S, nb] first
        return 0, np.dtype("<f2"), s * -(-h // codec.block)
    if hasattr(codec, "outlier_channels"):  # bitmap | sink rows | outliers [Sq, k] | scales/refs [Sq] | ...
        nb = (s + 7) // 8
        sinks = int(np.unpackbits(np.frombuffer(data[:nb], np.uint8)).sum())
        sq, k = s - sinks, len(codec.outlier_channels)
        dtype = np.dtype("<f4" if codec.name == "int4-outlier" else "<f2")
        return nb + 2 * sinks * h + 2 * sq * k, dtype, sq
    return None


def _damage(rng: random.Random, strategy: str, codec, data: bytes, shape, zstd: bool):
    """(data, shape, zstd) after one damage of ``strategy``."""
    b = bytearray(zstandard.ZstdDecompressor().decompress(data) if zstd else data)
    zstd, name = False, codec.name
    s, h = shape
    if strategy == "bit_flips" and b:
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif strategy == "truncation":
        del b[rng.randrange(len(b) + 1) if rng.random() < 0.7 else max(0, len(b) - rng.randint(1, 4)):]
    elif strategy == "extension":
        tail = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))
        if rng.random() < 0.5:
            b += tail
        else:
            i = rng.randrange(len(b) + 1)
            b[i:i] = tail[:rng.randint(1, 4)]
    elif strategy == "byte_runs" and b:
        i = rng.randrange(len(b))
        n = min(len(b) - i, rng.randint(1, 32))
        fill = rng.choice([b"\0", b"\xff", None])
        b[i:i + n] = fill * n if fill else bytes(rng.getrandbits(8) for _ in range(n))
    elif strategy == "length_fields":
        wide = [struct.pack("<i", v) for v in (-1, -(1 << 31), (1 << 31) - 1, 1 << 24, 0, len(b))]
        if name in ("pca-fine", "pca-compact") and rng.random() < 0.5:  # the int32 unary length itself
            nb = (s + 7) // 8
            at = 4 + nb + 2 * h * int(np.unpackbits(np.frombuffer(bytes(b[4:4 + nb]), np.uint8)).sum())
            b[at:at + 4] = rng.choice(wide)[:len(b[at:at + 4])]
        else:  # anywhere: the rANS word counts are uint16 fields
            _put(b, rng, rng.choice(wide + [struct.pack("<H", v) for v in (0, 1, 0xFFFF, 0x7FFF)]))
    elif strategy == "shape":
        s, h = rng.choice([(s + 1, h), (max(s - 1, 0), h), (s, h + 1), (s, max(h - 1, 1)), (0, h), (s, 1),
                           (1 << 20, h), (s, 1 << 20), (1 << 14, 1 << 14), (1, 1 << 28), (2 * s + 1, h)])
    elif strategy == "nonfinite":
        half = rng.choice([b"\x00\x7c", b"\x00\xfc", b"\x00\x7e", b"\xff\x7f"])
        single = rng.choice([struct.pack("<f", v) for v in (float("nan"), float("inf"), -float("inf"))])
        _put(b, rng, half if rng.random() < 0.6 else single, rng.choice([1, 2, 4]))
    elif strategy == "huge_scales":
        field = _scale_field(codec, bytes(b), s, h)
        if field is not None and rng.random() < 0.7:  # every scale of the field at the largest finite value
            at, dtype, n = field
            big = np.full(n, rng.choice([np.finfo(dtype).max, np.finfo(dtype).max / 2]), dtype)
            b[at:at + big.nbytes] = big.tobytes()
        else:
            _put(b, rng, rng.choice([b"\xff\x7b", struct.pack("<f", 3.4e38), struct.pack("<f", 1e30),
                                     struct.pack("<f", -1.0), b"\x00\x80"]), rng.choice([1, 2, 4]))
    elif strategy == "rans_words" and b:
        if name in _RANS:  # the words are the payload's tail: its state words and renormalisations
            tail = max(1, min(len(b), rng.randint(2, 16)))
            i = len(b) - rng.randint(1, tail)
            b[i] = rng.choice([0, 0xFF, b[i] ^ (1 << rng.randrange(8))])
            if rng.random() < 0.3:
                b[-4:] = rng.choice([b"\0\0\0\0", b"\xff\xff\xff\xff", b"\0\0\x01\0"])
        else:
            b[rng.randrange(len(b))] ^= 0xFF
    elif strategy == "zstd_wrap":
        if b and rng.random() < 0.8:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        cctx = zstandard.ZstdCompressor(level=1, write_content_size=rng.random() < 0.5)
        return cctx.compress(bytes(b)), (s, h), True
    elif strategy == "zstd_bomb":
        total = rng.choice([len(b) + 1, 1 << 20, 64 << 20, 1 << 30])
        bomb = _rle_bomb(total, declare=rng.random() < 0.5)
        return (bomb if rng.random() < 0.8 else bomb[:rng.randrange(4, len(bomb))]), (s, h), True
    return bytes(b), (s, h), zstd


def _check_output(y, shape) -> str | None:
    if not isinstance(y, np.ndarray) or y.dtype != np.float32 or y.shape != tuple(shape):
        return f"decoded to {type(y).__name__} {getattr(y, 'dtype', '')} {getattr(y, 'shape', '')}, declared {shape}"
    if y.size and not np.isfinite(y).all():
        return "decoded to NaN or Inf values"
    return None


def _decode_one(codec, data: bytes, shape, zstd: bool):
    """Through the frame decoder, then the codec, as the server: (outcome, error text or None)."""
    t = P.EncodedTensor(codec.name, shape, data, zstd)
    msg = P.decode_message(P.encode_message(P.Prefill(request_id="f", start=0, hidden=t, params=P.SamplingParams())),
                           LIMITS)
    y = codec.decode(msg.hidden, LIMITS)
    return _check_output(y, shape)


def _decode_rows(codec, rng: random.Random, h: int, strategy: str):
    n = rng.randint(1, 6)
    tensors = [codec.encode(_rows(rng, h, 1)) for _ in range(n)]
    i = rng.randrange(n)
    data, shape, z = _damage(rng, strategy, codec, tensors[i].data, (1, h), False)
    tensors[i] = P.EncodedTensor(codec.name, shape, data, z)
    half = getattr(codec, "half_rows", None)
    y = half(tensors, LIMITS) if half is not None else None
    y = codec.decode_rows(tensors, LIMITS) if y is None else y.astype(np.float32)
    return _check_output(y, (n, h))


def fuzz(codecs: dict, iterations: int, seed: int = 0, h: int = 64, keep: int = 10) -> dict:
    """Fuzz ``codecs`` (name -> codec for width ``h``) for ``iterations`` seeded cases; see the module docstring."""
    rng = random.Random(seed)
    names = sorted(codecs)
    by = {s: Counter() for s in STRATEGIES}
    codes: Counter = Counter()
    valid: dict[tuple, P.EncodedTensor] = {}
    failures: list[dict] = []
    for codec in codecs.values():  # first uses build caches (rANS lookup lists, index runs): not per payload
        with contextlib.suppress(Exception):  # a codec that cannot decode valid input fails in the loop below
            for s in (1, 8):
                codec.decode_rows([codec.encode(_rows(rng, h, 1)) for _ in range(s)], LIMITS)
                codec.decode(codec.encode(_rows(rng, h, s)), LIMITS)
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        for it in range(iterations):
            strategy = STRATEGIES[it % len(STRATEGIES)]
            name = rng.choice(names)
            codec = codecs[name]
            case = {"iteration": it, "strategy": strategy, "codec": name}
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            t0 = time.perf_counter()
            wire = 0
            try:
                if strategy == "rows":
                    bad, shape = _decode_rows(codec, rng, h, rng.choice(STRATEGIES[:5])), (6, h)
                    wire = 6 * codec.max_payload_bytes(1, h)
                else:
                    key = (name, rng.choice([1, 1, 2, 3, 5, 8, 17]), rng.random() < 0.2, rng.randrange(VARIANTS))
                    if key not in valid:  # a few valid tensors per codec and shape, each damaged many ways
                        valid[key] = codec.encode(_rows(rng, h, key[1]), zstd=key[2])
                    good = valid[key]
                    data, shape, z = _damage(rng, strategy, codec, good.data, good.shape, good.zstd)
                    case.update(shape=list(shape), zstd=z, data=data.hex() if len(data) < 256 else len(data))
                    wire = len(data)
                    t0 = time.perf_counter()
                    bad = _decode_one(codec, data, shape, z)
            except P.ProtocolError as e:
                bad = None if e.code in P.PROTOCOL_ERROR_CODES else f"undocumented code {e.code!r}"
                codes[e.code] += 1
                by[strategy]["refused"] += 1
            except Exception as e:  # noqa: BLE001 - what the fuzzer is looking for
                bad = f"{type(e).__name__}: {e}"
            else:
                by[strategy]["accepted" if bad is None else "failed"] += 1
            took = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1] - base
            if bad is None and took > MAX_DECODE_S:
                bad = f"took {took:.2f} s"
            if bad is None and peak > memory_bound(shape, wire):
                bad = f"allocated {peak} bytes for {list(shape)} from {wire} bytes"
            if bad is not None:
                failures.append({**case, "error": bad})
    finally:
        if not tracing:
            tracemalloc.stop()
    return {"iterations": iterations, "by_strategy": {k: dict(v) for k, v in by.items()},
            "refusal_codes": dict(codes), "failures": failures[:keep], "n_failures": len(failures)}
