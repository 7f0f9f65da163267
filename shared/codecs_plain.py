"""Calibration-free boundary codecs: fp32, fp16, bf16, and Petals-style blockwise int8 / int4.

* ``fp32``  - the states as the front computed them (4 bytes): the only lossless codec, for answers that must be
  the unsplit model's bit for bit (fp16 rounds, and a near-tie between two tokens can flip: docs/quality.md).
* ``fp16``  - IEEE half per element (2 bytes): rounds each value (near-lossless: 59 of 60 held-out answers
  identical on SmolLM2); refuses values beyond +-65504 (use ``bf16``).
* ``bf16``  - bfloat16 (2 bytes), round-to-nearest-even: float32's range, 8 bits of mantissa.
* ``int8-b<B>`` - per token, blocks of B channels, one float16 absmax scale per block, symmetric codes
  -127..127 (1 + 2/B bytes). Blockwise absmax quantization as in Petals' activation compression
  (Borzunov et al., 2023) and bitsandbytes' blockwise quantization (Dettmers et al., 2022).
* ``int4-b<B>`` - the same with codes -7..7 packed two per byte (0.5 + 2/B bytes).

A massive-activation channel (~700-20,000 in SmolLM2) inflates its block's scale, so the other channels
of that block lose most of their resolution; the outlier-aware codecs (:mod:`shared.codecs_outlier`) exist
for that reason. Payload layouts: docs/protocol.md, "Codec payloads".
"""

from __future__ import annotations

import numpy as np

from .codec_base import (
    BoundaryCodec,
    bf16_bits_to_f32,
    check_scales,
    f16_round_up,
    f32_to_bf16_bits,
    pack_nibbles,
    to_f16,
    unpack_nibbles,
)
from .errors import BAD_TENSOR, ProtocolError
from .tensors import PayloadReader, check_finite
from .wire import DEFAULT_LIMITS


class Fp32Codec(BoundaryCodec):
    name = "fp32"

    def encode_payload(self, x):
        check_finite(x, self.name)
        return np.ascontiguousarray(x, "<f4").tobytes()

    def decode_payload(self, payload, s, h):
        r = PayloadReader(payload, self.name)
        out = r.take("float32", (s, h)).copy()  # [S, H] float32, writable
        r.finish()
        check_finite(out, self.name)
        return out

    def max_payload_bytes(self, s, h):
        return 4 * s * h


class Fp16Codec(BoundaryCodec):
    name = "fp16"

    def encode_payload(self, x):
        return to_f16(x, self.name).tobytes()

    def decode_payload(self, payload, s, h):
        r = PayloadReader(payload, self.name)
        out = r.take("float16", (s, h)).astype(np.float32)
        r.finish()
        check_finite(out, self.name)  # on the float32 copy: a few times cheaper than on float16
        return out

    def half_rows(self, tensors, limits=None) -> np.ndarray | None:
        """The rows of N uncompressed one-row tensors ``[1, H]`` of one width as one writable float16 array
        ``[N, H]``, checked as :meth:`decode` checks them (``ProtocolError`` for a NaN or Inf, or a width over the
        limits), or None where
        one is not such a tensor (zstd, another shape or length: :meth:`decode_rows` decodes those one by
        one). The cloud widens it to float32 itself (torch does that several times faster than numpy)."""
        h = tensors[0].shape[1] if tensors else 0
        if not h or any(t.codec != self.name or t.zstd or t.shape != (1, h) or len(t.data) != 2 * h
                        for t in tensors):
            return None
        self.check_shape(1, h, limits or DEFAULT_LIMITS)
        half = np.frombuffer(bytearray().join([t.data for t in tensors]), "<f2").reshape(len(tensors), h)
        if (half.view("<u2") & 0x7FFF).max() >= 0x7C00:  # exponent all ones: Inf or NaN
            raise ProtocolError(BAD_TENSOR, f"{self.name}: NaN or Inf values")
        return half

    def decode_rows(self, tensors, limits=None):
        half = self.half_rows(tensors, limits)
        return super().decode_rows(tensors, limits) if half is None else half.astype(np.float32)

    def max_payload_bytes(self, s, h):
        return 2 * s * h


class Bf16Codec(BoundaryCodec):
    name = "bf16"

    def encode_payload(self, x):
        bits = f32_to_bf16_bits(x)
        if not np.isfinite(bf16_bits_to_f32(bits)).all():  # rounding up past float32's max
            raise ProtocolError(BAD_TENSOR, "bf16: values beyond the bfloat16 range")
        return bits.tobytes()

    def decode_payload(self, payload, s, h):
        r = PayloadReader(payload, self.name)
        out = bf16_bits_to_f32(r.take("bfloat16", (s, h)))
        r.finish()
        check_finite(out, self.name)
        return out

    def max_payload_bytes(self, s, h):
        return 2 * s * h


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    """[S, H] -> [S, nb, block], zero-padding the last (ragged) block."""
    s, h = x.shape
    nb = -(-h // block)
    if nb * block != h:
        x = np.concatenate([x, np.zeros((s, nb * block - h), x.dtype)], axis=1)
    return x.reshape(s, nb, block)


class BlockwiseIntCodec(BoundaryCodec):
    """Symmetric absmax quantization in blocks of ``block`` channels per token; float16 scales."""

    def __init__(self, bits: int, block: int):
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        if block not in (16, 32, 64, 128):
            raise ValueError(f"block must be 16, 32, 64 or 128, got {block}")
        self.bits, self.block = bits, block
        self.qmax = 127 if bits == 8 else 7
        self.name = f"int{bits}-b{block}"

    def _nb(self, h: int) -> int:
        return -(-h // self.block)

    def encode_payload(self, x):
        s, h = x.shape
        xb = _blocks(x, self.block)  # [S, nb, B]
        scale = f16_round_up(np.abs(xb).max(axis=-1) / self.qmax)  # [S, nb] float16
        if not np.isfinite(scale).all():
            raise ProtocolError(BAD_TENSOR, f"{self.name}: block scale beyond the float16 range")
        sf = scale.astype(np.float32)[..., None]
        q = np.where(sf > 0, np.rint(xb / np.where(sf > 0, sf, 1)), 0)
        q = np.clip(q, -self.qmax, self.qmax).reshape(s, xb.shape[1] * self.block)[:, :h]  # [S, H]
        if self.bits == 8:
            codes = q.astype(np.int8).tobytes()
        else:
            codes = pack_nibbles((q + 8).astype(np.uint8)).tobytes()
        return scale.tobytes() + codes

    def decode_payload(self, payload, s, h):
        r = PayloadReader(payload, self.name)
        nb = self._nb(h)
        scale = r.take("float16", (s, nb)).astype(np.float32)  # [S, nb]
        check_scales(scale, self.name)
        if self.bits == 8:
            q = r.take("int8", (s, h)).astype(np.float32)
            if (q < -127).any():
                raise ProtocolError(BAD_TENSOR, f"{self.name}: code -128 is not used")
        else:
            c = unpack_nibbles(r.take("uint8", (s, (h + 1) // 2)), h, self.name)
            if (c == 0).any():
                raise ProtocolError(BAD_TENSOR, f"{self.name}: code 0 (-8) is not used")
            q = c.astype(np.float32) - 8
        r.finish()
        out = _blocks(q, self.block) * scale[..., None]  # [S, nb, B]
        return out.reshape(s, nb * self.block)[:, :h].copy()

    def max_payload_bytes(self, s, h):
        codes = s * h if self.bits == 8 else s * ((h + 1) // 2)
        return 2 * s * self._nb(h) + codes
