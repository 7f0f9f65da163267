"""The precision plan of one request: wire codec + cloud compute variant (a wire struct; policy in precision.py)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import BAD_VALUE, ProtocolError

COMPUTE_VARIANTS = ("bf16", "fp16", "fp32", "int8")  # int8 = weight-only int8, activations in bf16/fp16


@dataclass(slots=True)
class PrecisionPlan:
    codec: str  # wire codec of the boundary hidden states (a name in shared.codecs.CODEC_NAMES)
    compute: str  # cloud compute variant of the back half: bf16 | fp16 | fp32 | int8 (weight-only)
    reason: str = ""  # one short line: why (for logs and metrics, not for machines)

    def __post_init__(self):
        if not isinstance(self.codec, str) or not 1 <= len(self.codec) <= 32:
            raise ProtocolError(BAD_VALUE, f"plan codec {self.codec!r}: 1..32 characters")
        if self.compute not in COMPUTE_VARIANTS:
            raise ProtocolError(BAD_VALUE, f"plan compute {self.compute!r}: expected one of {COMPUTE_VARIANTS}")
        if not isinstance(self.reason, str) or len(self.reason) > 200:
            raise ProtocolError(BAD_VALUE, "plan reason: a string of at most 200 characters")
