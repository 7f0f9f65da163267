"""What every codec over the bundle's PCA basis shares: the float64 transform, the width check, the fingerprint.

:class:`BasisCodec` is the base of ``shared.codecs_pca.PcaCodec`` (Rice levels) and
``shared.codecs_pca_ans.PcaAnsCodec`` (rANS levels). Every payload starts with the first
:data:`FINGERPRINT_BYTES` bytes of the artifact's content digest, so a tensor coded with another basis is
refused (``bad_codec``) instead of decoding to garbage.
"""

from __future__ import annotations

import numpy as np

from .codec_base import BoundaryCodec
from .errors import BAD_CODEC, ProtocolError
from .tensors import PayloadReader

FINGERPRINT_BYTES = 4


class BasisCodec(BoundaryCodec):
    """Level ``name`` of a PCA artifact ``basis`` (a ``PcaBasis``: ``mean`` [H], ``basis`` [H, H], ``digest``)
    that sends the leading ``r`` components at quantization ``step``."""

    def __init__(self, basis, name: str, step: float, r: int):
        self.name, self.pca, self.step, self.r = name, basis, step, r
        self.fingerprint = bytes.fromhex(basis.digest[:2 * FINGERPRINT_BYTES])
        # float64 arithmetic: BLAS sums a one-row product in another order than a chunk's, and in float32 that
        # moves codes across rounding boundaries; in float64 a chunk and its rows code and decode identically
        self.analysis = basis.basis[:, :r].astype(np.float64)  # [H, r]
        self.synthesis = np.ascontiguousarray(self.analysis.T)  # [r, H]
        self.mean = basis.mean.astype(np.float64)  # [H]

    def check_hidden_size(self, h):
        if h != self.pca.hidden_size:
            raise ProtocolError(BAD_CODEC, f"{self.name}: the codec artifact is for hidden size "
                                           f"{self.pca.hidden_size}, not {h} (another model's bundle?)")

    def read_fingerprint(self, rd: PayloadReader) -> None:
        """Take the payload's fingerprint; ``bad_codec`` if it names another artifact."""
        got = bytes(rd.take("uint8", (FINGERPRINT_BYTES,)))
        if got != self.fingerprint:
            raise ProtocolError(BAD_CODEC, f"{self.name}: tensor coded with codec artifact {got.hex()}..., this "
                                           f"side has {self.fingerprint.hex()}... (bundles differ)")

    def synthesize(self, coef: np.ndarray, whole: np.ndarray, whole_rows: np.ndarray) -> np.ndarray:
        """Decoded rows [S, H]: the rows not flagged in ``whole`` [S] from their coefficients ``coef`` [Sq, r]
        (float64, in units of the hidden state), the flagged ones from ``whole_rows`` [S - Sq, H] (float16)."""
        rows = (coef @ self.synthesis + self.mean).astype(np.float32)  # [Sq, H]
        if not whole.any():
            return rows
        out = np.empty((whole.size, rows.shape[1]), np.float32)
        out[whole] = whole_rows
        out[~whole] = rows
        return out
