"""Bounded zstd: compress codec payloads, and decompress them without ever trusting the sender.

A hostile (or broken) peer can send a few bytes that expand to gigabytes, or a frame header that *declares*
a huge content size so that a naive decoder allocates it up front. :func:`decompress` refuses, before any
allocation beyond its caps:

1. anything that is not exactly one standard zstd frame (magic ``28 b5 2f fd``; skippable frames, dictionary
   frames and trailing bytes are refused);
2. a window larger than ``2**window_log_max`` (the decoder's memory is bounded by the window);
3. a declared content size over ``max_output`` or over ``max_ratio * len(data)``;
4. a frame without a declared size that would expand past the same cap (decoding stops at the cap).

Every refusal is ``ProtocolError("decompress")``. Our own frames always declare their content size.

References: RFC 8878 (Zstandard format), section 3.1.1 (frame header, window descriptor, content size).
"""

from __future__ import annotations

import zstandard

from .errors import DECOMPRESS, ProtocolError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
DEFAULT_LEVEL = 3  # ~300 MB/s on one phone core; higher levels buy <1 % on activations (docs/quality.md)
DEFAULT_WINDOW_LOG_MAX = 23  # 8 MiB window: more than one 16 MiB frame needs, far below zstd's 2 GiB max
DEFAULT_MAX_RATIO = 256.0  # hidden-state payloads compress ~1.1x; 256x only happens for constant data


def compress(data: bytes, level: int = DEFAULT_LEVEL) -> bytes:
    """One zstd frame with its content size declared (so the receiver can check it before allocating)."""
    if not 1 <= level <= 19:
        raise ValueError(f"zstd level must be in [1, 19], got {level}")
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    return cctx.compress(data)


def decompress(data: bytes, max_output: int, max_ratio: float = DEFAULT_MAX_RATIO,
               window_log_max: int = DEFAULT_WINDOW_LOG_MAX) -> bytes:
    """Decompress one zstd frame whose content may be at most ``max_output`` bytes (see module docstring)."""
    if max_output < 0 or max_ratio <= 0 or not 10 <= window_log_max <= 31:
        raise ValueError("decompress: bad limits")
    if len(data) < 6 or bytes(data[:4]) != ZSTD_MAGIC:
        raise ProtocolError(DECOMPRESS, "not a zstd frame")
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise ProtocolError(DECOMPRESS, f"bad zstd frame header ({e})") from None
    if params.dict_id != 0:
        raise ProtocolError(DECOMPRESS, "zstd dictionaries are not used on this protocol")
    if params.window_size > (1 << window_log_max):
        raise ProtocolError(DECOMPRESS, f"zstd window {params.window_size} over the limit {1 << window_log_max}")
    cap = min(max_output, int(max_ratio * len(data)))
    declared = params.content_size
    if declared == zstandard.CONTENTSIZE_ERROR:
        raise ProtocolError(DECOMPRESS, "bad zstd content size")
    if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > cap:
        raise ProtocolError(DECOMPRESS, f"zstd frame declares {declared} bytes; the cap is {cap} "
                                        f"(max {max_output} bytes, ratio {max_ratio:g})")
    dctx = zstandard.ZstdDecompressor(max_window_size=1 << window_log_max)
    try:
        # With a declared size the output buffer is exactly that size (checked above); without one it is
        # ``cap`` and decoding fails when the frame would exceed it.
        out = dctx.decompress(data, max_output_size=max(cap, 1), allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise ProtocolError(DECOMPRESS, f"zstd: {e}") from None
    if len(out) > cap:  # belt and braces: never hand on more than the caller allowed
        raise ProtocolError(DECOMPRESS, f"zstd output {len(out)} bytes over the cap {cap}")
    return out
