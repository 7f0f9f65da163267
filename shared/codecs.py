"""Boundary codecs by name: the registry both ends use after the handshake negotiated a name.

=================  ==========================================  ==========================
name               what                                        bytes/element (H=576, k=8)
=================  ==========================================  ==========================
``fp16``           IEEE half                                   2
``bf16``           bfloat16                                    2
``int8-b32``       int8, float16 scale per 32 channels         1.0625
``int8-b64``       int8, float16 scale per 64 channels         1.031
``int4-b32``       int4, float16 scale per 32 channels         0.5625
``int8-outlier``   outliers + sinks fp16, int8 per-row scale   ~1.02
``int4-outlier``   outliers + sinks fp16, rotated 4-bit        ~0.59
=================  ==========================================  ==========================

``get_codec(name, **params)`` builds one; the outlier codecs need the bundle's calibration
(``outlier_channels``, optionally ``sink_threshold``), e.g. ``get_codec("int8-outlier",
outlier_channels=[...])``. ``available_codecs(calibration)`` builds every codec a bundle supports.
Measured quality on SmolLM2: docs/quality.md ("Boundary codecs").
"""

from __future__ import annotations

from collections.abc import Callable

from .codec_base import BoundaryCodec
from .codecs_outlier import OutlierInt4Codec, OutlierInt8Codec, find_outlier_channels, find_sink_threshold
from .codecs_plain import Bf16Codec, BlockwiseIntCodec, Fp16Codec
from .errors import BAD_CODEC, ProtocolError

CODECS: dict[str, Callable[..., BoundaryCodec]] = {
    "fp16": Fp16Codec,
    "bf16": Bf16Codec,
    "int8-b32": lambda: BlockwiseIntCodec(8, 32),
    "int8-b64": lambda: BlockwiseIntCodec(8, 64),
    "int4-b32": lambda: BlockwiseIntCodec(4, 32),
    "int8-outlier": OutlierInt8Codec,
    "int4-outlier": OutlierInt4Codec,
}
CODEC_NAMES: tuple[str, ...] = tuple(CODECS)
CALIBRATED_CODECS: tuple[str, ...] = ("int8-outlier", "int4-outlier")  # need the bundle's calibration

_plain_cache: dict[str, BoundaryCodec] = {}


def get_codec(name: str, **params) -> BoundaryCodec:
    """The codec called ``name``; ``ProtocolError("bad_codec")`` for unknown names or bad parameters."""
    factory = CODECS.get(name)
    if factory is None:
        raise ProtocolError(BAD_CODEC, f"unknown codec {name!r} (known: {', '.join(CODEC_NAMES)})")
    if name in CALIBRATED_CODECS:
        if params.get("outlier_channels") is None:
            raise ProtocolError(BAD_CODEC, f"{name} needs outlier_channels from the bundle's calibration")
        allowed = {"outlier_channels", "sink_threshold"}
        if set(params) - allowed:
            raise ProtocolError(BAD_CODEC, f"{name}: unknown parameters {sorted(set(params) - allowed)}")
        return factory(**params)
    if params:
        raise ProtocolError(BAD_CODEC, f"{name} takes no parameters, got {sorted(params)}")
    if name not in _plain_cache:
        _plain_cache[name] = factory()
    return _plain_cache[name]


def available_codecs(calibration: dict | None = None) -> dict[str, BoundaryCodec]:
    """Every codec this bundle supports. ``calibration``: the bundle's calibration.json as a dict
    (``outlier_channels``: list[int], optional ``sink_threshold``: float); without it only the
    calibration-free codecs are available."""
    out = {name: get_codec(name) for name in CODEC_NAMES if name not in CALIBRATED_CODECS}
    channels = (calibration or {}).get("outlier_channels")
    if channels:
        for name in CALIBRATED_CODECS:
            out[name] = get_codec(name, outlier_channels=channels,
                                  sink_threshold=(calibration or {}).get("sink_threshold"))
    return out


__all__ = [
    "CALIBRATED_CODECS",
    "CODECS",
    "CODEC_NAMES",
    "Bf16Codec",
    "BlockwiseIntCodec",
    "BoundaryCodec",
    "Fp16Codec",
    "OutlierInt4Codec",
    "OutlierInt8Codec",
    "available_codecs",
    "find_outlier_channels",
    "find_sink_threshold",
    "get_codec",
]
