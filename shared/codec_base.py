"""The boundary-codec contract and the bit-level helpers every codec shares.

A :class:`BoundaryCodec` turns float32 hidden states ``[S, H]`` into an :class:`EncodedTensor` and back.
``encode`` refuses non-finite input and values a float16 field cannot hold; ``decode`` refuses anything that
is not exactly the codec's documented layout (size, code ranges, padding bits, NaN/Inf in scales or
float16 fields). Both raise ``ProtocolError`` only. Payload layouts are normative in docs/protocol.md
("Codec payloads"); all multi-byte values are little-endian.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from .compression import DEFAULT_LEVEL, compress, decompress
from .errors import BAD_CODEC, BAD_TENSOR, ProtocolError
from .tensors import EncodedTensor
from .wire import DEFAULT_LIMITS, Limits

F16_MAX = 65504.0


class BoundaryCodec(ABC):
    """Codes hidden states ``[S, H]`` for the wire. Subclasses define the payload layout."""

    name: str

    # -- public API ---------------------------------------------------------------------------------------
    def encode(self, x: np.ndarray, zstd: bool = False, level: int = DEFAULT_LEVEL) -> EncodedTensor:
        """Code ``x`` [S, H]. ``zstd=True`` compresses the payload when that makes it smaller."""
        x = self._check_input(x)  # [S, H] float32
        payload = self.encode_payload(x)
        if zstd:
            packed = compress(payload, level)
            if len(packed) < len(payload):
                return EncodedTensor(codec=self.name, shape=x.shape, data=packed, zstd=True)
        return EncodedTensor(codec=self.name, shape=x.shape, data=payload, zstd=False)

    def decode(self, t: EncodedTensor, limits: Limits | None = None) -> np.ndarray:
        """The float32 hidden states ``[S, H]`` of ``t`` (a fresh writable array); its shape is checked first
        (:meth:`check_shape`)."""
        limits = limits or DEFAULT_LIMITS
        if t.codec != self.name:
            raise ProtocolError(BAD_CODEC, f"tensor coded with {t.codec!r}, this codec is {self.name!r}")
        s, h = t.shape
        self.check_shape(s, h, limits)
        cap = min(self.max_payload_bytes(s, h), limits.max_decoded_tensor_bytes)
        if t.zstd:
            payload = decompress(t.data, cap, limits.max_zstd_ratio, limits.zstd_window_log_max)
        else:
            payload = t.data
            if len(payload) > cap:
                raise ProtocolError(BAD_TENSOR, f"{self.name}: payload of {len(payload)} bytes, at most {cap}")
        try:
            return self.decode_payload(payload, s, h)
        except ProtocolError:
            raise
        except Exception as e:  # noqa: BLE001 - defense in depth: a layout bug must not crash a server
            raise ProtocolError(BAD_TENSOR, f"{self.name}: undecodable payload ({type(e).__name__}: {e})") from None

    def check_hidden_size(self, h: int) -> None:
        """Raise ``ProtocolError("bad_codec")`` if this codec instance cannot code width ``h``."""

    def check_shape(self, s: int, h: int, limits: Limits) -> None:
        """Raise ``ProtocolError`` unless a tensor ``[s, h]`` may be decoded: a width this codec codes, and float32
        states of at most ``limits.max_decoded_tensor_bytes`` (``bad_tensor``; a few payload bytes, or a small
        zstd frame, can declare rows of any width, so this is checked before anything is allocated)."""
        self.check_hidden_size(h)
        if 4 * s * h > limits.max_decoded_tensor_bytes:
            raise ProtocolError(BAD_TENSOR, f"{self.name}: [{s}, {h}] decodes to more than "
                                            f"{limits.max_decoded_tensor_bytes} bytes")

    def decode_rows(self, tensors: list[EncodedTensor], limits: Limits | None = None) -> np.ndarray:
        """The float32 states ``[N, H]`` of ``N`` one-row tensors ``[1, H]`` (a decode step's rows, one per
        session), each validated as :meth:`decode` would. Raises ``ProtocolError`` if any one is bad; the
        caller then decodes them one by one to tell which. Codecs whose rows can be decoded in one pass
        override this; the default decodes them in turn."""
        if not tensors:
            raise ValueError("decode_rows needs at least one tensor")
        rows = [self.decode(t, limits) for t in tensors]
        if any(r.shape[0] != 1 for r in rows) or len({r.shape[1] for r in rows}) != 1:
            raise ProtocolError(BAD_TENSOR, f"{self.name}: decode_rows takes [1, H] tensors of one width")
        return np.concatenate(rows)

    # -- layout, per codec --------------------------------------------------------------------------------
    @abstractmethod
    def encode_payload(self, x: np.ndarray) -> bytes:
        """Payload bytes for finite float32 ``x`` [S, H]."""

    @abstractmethod
    def decode_payload(self, payload: bytes, s: int, h: int) -> np.ndarray:
        """float32 [s, h] from a payload; validates it exactly."""

    @abstractmethod
    def max_payload_bytes(self, s: int, h: int) -> int:
        """The largest payload a valid ``[s, h]`` tensor can have (the zstd cap)."""

    def payload_bytes(self, s: int, h: int) -> int:
        """Payload size in the common case (no sink rows); equals the max for fixed-size codecs."""
        return self.max_payload_bytes(s, h)

    def _check_input(self, x: np.ndarray) -> np.ndarray:
        if not isinstance(x, np.ndarray) or x.ndim != 2 or x.shape[1] == 0:
            raise ProtocolError(BAD_TENSOR, f"{self.name}: expected an array [S, H], got "
                                            f"{getattr(x, 'shape', type(x).__name__)}")
        if x.dtype.kind != "f":
            raise ProtocolError(BAD_TENSOR, f"{self.name}: expected floating point input, got {x.dtype}")
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.size and not np.isfinite(x).all():
            raise ProtocolError(BAD_TENSOR, f"{self.name}: NaN or Inf in the hidden states")
        self.check_hidden_size(x.shape[1])
        return x

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


# -- helpers --------------------------------------------------------------------------------------------------

def to_f16(a: np.ndarray, what: str) -> np.ndarray:
    """float16 copy of finite ``a``; values beyond the float16 range are refused (use bf16 for those)."""
    with np.errstate(over="ignore"):
        out = a.astype("<f2")
    if out.size and not np.isfinite(out).all():
        raise ProtocolError(BAD_TENSOR, f"{what}: values beyond the float16 range ({F16_MAX}); use bf16")
    return out


def f16_round_up(a: np.ndarray) -> np.ndarray:
    """float16 of non-negative ``a``, rounded up so the result is >= ``a`` (scales must not clip)."""
    with np.errstate(over="ignore"):
        out = a.astype("<f2")
        low = out.astype(np.float32) < a
        if low.any():
            out[low] = np.nextafter(out[low], np.float16(np.inf))
    return out


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of finite float32 ``x``, rounded to nearest even."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype("<u2")


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def pack_rows_bitmap(mask: np.ndarray) -> bytes:
    """Row flags [S] -> ceil(S/8) bytes, bit i of byte i // 8 (LSB first) = row i."""
    return np.packbits(mask.astype(np.uint8), bitorder="little").tobytes()


def unpack_rows_bitmap(bits: np.ndarray, s: int, what: str) -> np.ndarray:
    """Inverse of :func:`pack_rows_bitmap`; padding bits must be zero."""
    mask = np.unpackbits(bits, bitorder="little").astype(bool)
    if mask[s:].any():
        raise ProtocolError(BAD_TENSOR, f"{what}: nonzero padding bits in the row bitmap")
    return mask[:s]


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [S, n] in 0..15 -> [S, ceil(n/2)]: element 2j in the low nibble, 2j+1 in the high one."""
    s, n = codes.shape
    if n % 2:
        codes = np.concatenate([codes, np.zeros((s, 1), np.uint8)], axis=1)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray, n: int, what: str) -> np.ndarray:
    """Inverse of :func:`pack_nibbles`: uint8 codes [S, n]; an odd n's padding nibble must be zero."""
    out = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    if n % 2 and out[:, n:].any():
        raise ProtocolError(BAD_TENSOR, f"{what}: nonzero padding nibble")
    return out[:, :n]


def check_scales(scales: np.ndarray, what: str) -> None:
    """Scales are finite and non-negative (NaN/Inf/negative scales never reach the model)."""
    if scales.size and (not np.isfinite(scales).all() or (scales < 0).any()):
        raise ProtocolError(BAD_TENSOR, f"{what}: scales must be finite and >= 0")
