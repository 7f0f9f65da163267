"""Boundary codecs by name: the registry both ends use after the handshake negotiated a name.

===================  ==========================================  ==========================
name                 what                                        bytes/element (H=576, k=8)
===================  ==========================================  ==========================
``fp32``             float32, as computed (lossless)             4
``fp16``             IEEE half                                   2
``bf16``             bfloat16                                    2
``int8-b32``         int8, float16 scale per 32 channels         1.0625
``int8-b64``         int8, float16 scale per 64 channels         1.031
``int4-b32``         int4, float16 scale per 32 channels         0.5625
``int8-outlier``     outliers + sinks fp16, int8 per-row scale   ~1.02
``int4-outlier``     outliers + sinks fp16, rotated 4-bit        ~0.59
``pca-fine``         bundle PCA basis, uniform step, Rice code   ~0.7 (data-dependent)
``pca-compact``      the same, coarser step                      ~0.3 (data-dependent)
``pca-ans-compact``  the basis, row-scale-context rANS code      ~0.3 (data-dependent)
``pca-tcq-compact``  the same code, trellis-coded quantization   ~0.3 (data-dependent)
===================  ==========================================  ==========================

``get_codec(name, **params)`` builds one; the outlier codecs need the bundle's calibration
(``outlier_channels``, optionally ``sink_threshold``), e.g. ``get_codec("int8-outlier",
outlier_channels=[...])``; the PCA codecs need the bundle's codec artifact (``get_codec("pca-fine",
basis=PcaBasis)``, :mod:`shared.codecs_pca`). ``load_calibration(bundle_dir)`` reads a bundle's calibration
(and its artifact, hash-checked); ``available_codecs(calibration)`` builds every codec a bundle supports.
Measured quality on SmolLM2: docs/quality.md ("Boundary codecs").
"""

from __future__ import annotations

from collections.abc import Callable

from .codec_base import BoundaryCodec
from .codecs_outlier import OutlierInt4Codec, OutlierInt8Codec, find_outlier_channels, find_sink_threshold
from .codecs_pca import CodecArtifactError, PcaBasis, PcaCodec
from .codecs_pca_ans import PcaAnsCodec
from .codecs_pca_tcq import PcaTcqCodec
from .codecs_plain import Bf16Codec, BlockwiseIntCodec, Fp16Codec, Fp32Codec
from .errors import BAD_CODEC, ProtocolError

CALIBRATION_FILE = "calibration.json"

CODECS: dict[str, Callable[..., BoundaryCodec]] = {
    "fp32": Fp32Codec,
    "fp16": Fp16Codec,
    "bf16": Bf16Codec,
    "int8-b32": lambda: BlockwiseIntCodec(8, 32),
    "int8-b64": lambda: BlockwiseIntCodec(8, 64),
    "int4-b32": lambda: BlockwiseIntCodec(4, 32),
    "int8-outlier": OutlierInt8Codec,
    "int4-outlier": OutlierInt4Codec,
    "pca-fine": lambda basis: PcaCodec(basis, "pca-fine"),
    "pca-compact": lambda basis: PcaCodec(basis, "pca-compact"),
    "pca-ans-compact": lambda basis: PcaAnsCodec(basis, "pca-ans-compact"),
    "pca-tcq-compact": lambda basis: PcaTcqCodec(basis, "pca-tcq-compact"),
}
CODEC_NAMES: tuple[str, ...] = tuple(CODECS)
OUTLIER_CODECS: tuple[str, ...] = ("int8-outlier", "int4-outlier")  # need outlier_channels from calibration
BASIS_CODECS: tuple[str, ...] = ("pca-fine", "pca-compact", "pca-ans-compact", "pca-tcq-compact")  # need the bundle's codec artifact (PcaBasis)
CALIBRATED_CODECS: tuple[str, ...] = OUTLIER_CODECS + BASIS_CODECS  # need the bundle's calibration

_plain_cache: dict[str, BoundaryCodec] = {}


def get_codec(name: str, **params) -> BoundaryCodec:
    """The codec called ``name``; ``ProtocolError("bad_codec")`` for unknown names or bad parameters."""
    factory = CODECS.get(name)
    if factory is None:
        raise ProtocolError(BAD_CODEC, f"unknown codec {name!r} (known: {', '.join(CODEC_NAMES)})")
    if name in BASIS_CODECS:
        if set(params) != {"basis"}:
            raise ProtocolError(BAD_CODEC, f"{name} takes exactly basis= (the bundle's codec artifact), got "
                                           f"{sorted(params)}")
        return factory(params["basis"])
    if name in OUTLIER_CODECS:
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
    (``outlier_channels``: list[int], optional ``sink_threshold``: float; ``pca_basis``: the loaded
    :class:`PcaBasis`, as :func:`load_calibration` puts it there); without it only the calibration-free
    codecs are available, and each calibrated family only with its part of the calibration."""
    calibration = calibration or {}
    out = {name: get_codec(name) for name in CODEC_NAMES if name not in CALIBRATED_CODECS}
    channels = calibration.get("outlier_channels")
    if channels:
        for name in OUTLIER_CODECS:
            out[name] = get_codec(name, outlier_channels=channels, sink_threshold=calibration.get("sink_threshold"))
    basis = calibration.get("pca_basis")
    if isinstance(basis, PcaBasis):
        for name in BASIS_CODECS:
            if name in basis.levels:
                out[name] = get_codec(name, basis=basis)
    return out


def load_calibration(bundle_dir) -> dict | None:
    """A bundle's ``calibration.json`` as a dict (None if it has none or it is unreadable). When it names a
    codec artifact (``"pca_codec": {"file": ..., "sha256": ...}``, written by ``partition_tools.codec_calibration``)
    the artifact is loaded and hash-checked into ``"pca_basis"``; a missing, altered or malformed artifact leaves the PCA
    codecs out (``"pca_error"`` says why), so the handshake never offers a codec this side cannot decode."""
    import json
    from pathlib import Path

    try:
        calib = json.loads((Path(bundle_dir) / CALIBRATION_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(calib, dict):
        return None
    ref = calib.get("pca_codec")
    if isinstance(ref, dict):
        try:
            calib["pca_basis"] = PcaBasis.load(Path(bundle_dir) / str(ref.get("file")), sha256=ref.get("sha256"))
        except CodecArtifactError as e:
            calib["pca_error"] = str(e)
    return calib


__all__ = [
    "BASIS_CODECS",
    "CALIBRATED_CODECS",
    "CODECS",
    "CODEC_NAMES",
    "Bf16Codec",
    "BlockwiseIntCodec",
    "BoundaryCodec",
    "Fp16Codec",
    "OUTLIER_CODECS",
    "OutlierInt4Codec",
    "OutlierInt8Codec",
    "PcaBasis",
    "PcaCodec",
    "available_codecs",
    "find_outlier_channels",
    "find_sink_threshold",
    "get_codec",
    "load_calibration",
]
