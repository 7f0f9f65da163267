"""Tensors on the wire: typed arrays from an allow-list of dtypes, and codec-encoded hidden states.

Two wire types:

* :class:`WireArray` - a plain little-endian array (``dtype`` name, ``shape``, raw ``data``). Only the
  dtypes in :data:`WIRE_DTYPES` exist; ``prod(shape) * itemsize == len(data)`` is checked on construction,
  so a decoded message never holds an array whose bytes disagree with its declaration. Used for small side
  tensors such as multimodal RoPE positions.
* :class:`EncodedTensor` - a hidden-state block ``[S, H]`` in one of the codecs of :mod:`shared.codecs`.
  Its ``data`` layout belongs to the codec (docs/protocol.md, "Codec payloads"); the exact size check
  happens when the negotiated codec decodes it (:meth:`shared.codecs.BoundaryCodec.decode`), because the
  size depends on codec parameters from the bundle (e.g. the number of outlier channels).

:class:`PayloadReader` is how codecs cut a payload into typed arrays with bounds checks; every failure is a
``ProtocolError("bad_tensor")``. Nothing here allocates more than ``len(data)`` bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import BAD_TENSOR, BAD_VALUE, TOO_LARGE, ProtocolError

# dtype name on the wire -> numpy dtype (always little-endian). bfloat16 travels as its raw 16-bit pattern.
WIRE_DTYPES: dict[str, np.dtype] = {
    "int8": np.dtype("<i1"),
    "uint8": np.dtype("<u1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
}
FLOAT_DTYPES = frozenset({"float16", "float32"})

MAX_DIMS = 4  # hidden states are [S, H]; side tensors at most [3, S]; 4 leaves room, not abuse
MAX_ELEMENTS = 1 << 28  # 256 Mi elements: far above any frame limit, so shape products stay small ints


def check_shape(shape: tuple[int, ...], what: str = "tensor") -> int:
    """Validate a declared shape; return its element count."""
    if not 1 <= len(shape) <= MAX_DIMS:
        raise ProtocolError(BAD_TENSOR, f"{what}: {len(shape)} dimensions (1..{MAX_DIMS} allowed)")
    n = 1
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ProtocolError(BAD_TENSOR, f"{what}: bad dimension {d!r} in shape {list(shape)}")
        n *= d
        if n > MAX_ELEMENTS:
            raise ProtocolError(TOO_LARGE, f"{what}: shape {list(shape)} declares over {MAX_ELEMENTS} elements")
    return n


def check_finite(a: np.ndarray, what: str) -> None:
    """Reject NaN/Inf (a float16/32 array); a corrupted scale must never reach the model."""
    if a.size and not np.isfinite(a).all():
        raise ProtocolError(BAD_TENSOR, f"{what}: NaN or Inf values")


@dataclass(slots=True)
class WireArray:
    """A plain little-endian array. ``data`` holds exactly ``prod(shape) * itemsize`` bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self):
        if self.dtype not in WIRE_DTYPES:
            raise ProtocolError(BAD_TENSOR, f"dtype {self.dtype!r} not allowed (allowed: {', '.join(WIRE_DTYPES)})")
        self.shape = tuple(self.shape)
        n = check_shape(self.shape, "array")
        if n * WIRE_DTYPES[self.dtype].itemsize != len(self.data):
            raise ProtocolError(BAD_TENSOR, f"array {self.dtype}{list(self.shape)} needs "
                                            f"{n * WIRE_DTYPES[self.dtype].itemsize} bytes, got {len(self.data)}")

    @classmethod
    def from_numpy(cls, a: np.ndarray) -> WireArray:
        name = {v: k for k, v in WIRE_DTYPES.items() if k != "bfloat16"}.get(a.dtype.newbyteorder("<"))
        if name is None:
            raise ProtocolError(BAD_TENSOR, f"numpy dtype {a.dtype} has no wire dtype")
        return cls(name, tuple(int(d) for d in a.shape), np.ascontiguousarray(a, WIRE_DTYPES[name]).tobytes())

    def to_numpy(self) -> np.ndarray:
        """A read-only view of ``data``; float arrays are checked for NaN/Inf."""
        a = np.frombuffer(self.data, WIRE_DTYPES[self.dtype]).reshape(self.shape)
        if self.dtype in FLOAT_DTYPES:
            check_finite(a, f"{self.dtype} array")
        return a


@dataclass(slots=True)
class EncodedTensor:
    """A hidden-state block ``[S, H]`` coded by ``codec``; ``data`` optionally one zstd frame.

    ``shape`` is the decoded shape. ``zstd`` says ``data`` is a single zstd frame whose content is the
    codec payload; the decoder caps its size at the codec's largest payload for ``shape``.
    """

    codec: str
    shape: tuple[int, ...]
    data: bytes
    zstd: bool = False

    def __post_init__(self):
        if not self.codec or len(self.codec) > 32:
            raise ProtocolError(BAD_VALUE, f"codec name {self.codec!r}: 1..32 characters")
        self.shape = tuple(self.shape)
        if len(self.shape) != 2:
            raise ProtocolError(BAD_TENSOR, f"hidden states are [S, H], got shape {list(self.shape)}")
        check_shape(self.shape, "hidden")
        if self.shape[1] == 0:
            raise ProtocolError(BAD_TENSOR, "hidden size 0")

    @property
    def n_tokens(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return len(self.data)


class PayloadReader:
    """Cut a codec payload into typed arrays, front to back, with bounds checks.

    ``take`` never reads past the end; ``finish`` insists that nothing is left over, so a payload is
    accepted only when its length is exactly what the codec's layout declares.
    """

    __slots__ = ("_buf", "_pos", "_what")

    def __init__(self, data: bytes, what: str):
        self._buf = memoryview(data)
        self._pos = 0
        self._what = what

    def take(self, dtype: str, shape: tuple[int, ...], finite: bool = False) -> np.ndarray:
        dt = WIRE_DTYPES[dtype]
        n = math.prod(shape)
        end = self._pos + n * dt.itemsize
        if end > len(self._buf):
            raise ProtocolError(BAD_TENSOR, f"{self._what}: payload too short ({len(self._buf)} bytes) for "
                                            f"{dtype}{list(shape)} at offset {self._pos}")
        a = np.frombuffer(self._buf[self._pos:end], dt).reshape(shape)
        self._pos = end
        if finite:
            check_finite(a, f"{self._what} {dtype}{list(shape)}")
        return a

    def finish(self) -> None:
        if self._pos != len(self._buf):
            raise ProtocolError(BAD_TENSOR, f"{self._what}: payload is {len(self._buf)} bytes, layout uses {self._pos}")
