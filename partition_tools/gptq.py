"""GPTQ rounding for the MatMulNBits weights: small *output* error on calibration inputs, not small weight error.

onnxruntime's quantizer rounds every weight to the nearest point of its block's grid, independently. GPTQ
(Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers", ICLR
2023) rounds the K input rows of ``W [K, N]`` one at a time and moves each row's rounding error onto the rows
not rounded yet, weighted by the inverse of ``H = X^T X`` (the MatMul's calibration inputs ``X [T, K]``):
the greedy second-order solution of ``min ||X W - X W_q||^2``. The rows of one weight block are rounded on
one grid, so the result is a valid blockwise code.

The grid is exactly onnxruntime's symmetric ``MatMulNBits`` grid, per block of ``block`` input rows and
output column: ``scale = m / -2^(b-1)`` with ``m`` the block's signed value of largest magnitude (fixed when
GPTQ enters the block, from the error-updated weights), ``q = clip(rint(w / scale), -2^(b-1), 2^(b-1) - 1)``
and the stored code ``q + 2^(b-1)`` (uint8, layout ``[N, K / block, block]``; scales ``[N, K / block]``). The
codes are written into the nodes the quantizer made (:func:`write_codes`), so the kernel reads GPTQ's codes.
A partial last block (K not a multiple of ``block``) is padded with unused zero rows, as onnxruntime pads it.

Applied to the graph the quantizer is about to rewrite (after smoothing: ``X`` is the smoothed input), with
``X`` from a prefill of the calibration tokens through the fp32 graph (one pass for every MatMul, not layer by
layer). 8-bit weights only here (4-bit codes are packed two to a byte; not implemented).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

DAMP = 0.01  # of the mean diagonal of H, added to it: X^T X of a few hundred tokens is singular for K > T


def gptq_round(w: np.ndarray, gram: np.ndarray, bits: int = 8, block: int = 32,
               damp: float = DAMP) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ codes of ``w [K, N]`` given ``gram = X^T X [K, K]``: (q int8 [K, N] in [-2^(b-1), 2^(b-1) - 1],
    scales float32 [K / block, N]); the dequantized weights are ``q * repeat(scales, block)``."""
    k0, n = w.shape
    if gram.shape != (k0, k0):
        raise ValueError(f"GPTQ: gram must be [{k0}, {k0}] for w [{k0}, {n}], got {list(gram.shape)}")
    k = -(-k0 // block) * block  # a partial last block: zero rows (unused channels) pad it, as onnxruntime does
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    w = np.pad(w.astype(np.float64), ((0, k - k0), (0, 0)))
    h = np.pad(gram.astype(np.float64), ((0, k - k0), (0, k - k0)))
    dead = np.diag(h) <= 0  # channels no calibration token used: their rows get plain rounding
    h[dead, dead] = 1.0
    h += damp * np.mean(np.diag(h)) * np.eye(k)
    # upper Cholesky factor of H^-1: row i holds the error-propagation weights onto rows > i
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # [K, K]
    q = np.zeros((k, n), np.int8)
    scales = np.zeros((k // block, n), np.float32)
    for b0 in range(0, k, block):
        b1 = b0 + block
        blk = w[b0:b1]  # [block, N], updated in place
        m = blk[np.abs(blk).argmax(0), np.arange(n)].astype(np.float32)  # [N] signed max-magnitude value
        scale = m / np.float32(lo)  # onnxruntime's symmetric scale (exact: a power-of-two division)
        scales[b0 // block] = scale
        safe = np.where(scale != 0, scale, 1.0).astype(np.float64)
        err = np.zeros((block, n))
        for i in range(block):
            row = blk[i]
            qi = np.clip(np.rint(row / safe), lo, hi)
            q[b0 + i] = qi
            e = (row - qi * np.where(scale != 0, scale, 0.0)) / u[b0 + i, b0 + i]  # [N]
            blk[i + 1:] -= np.outer(u[b0 + i, b0 + i + 1:b1], e)
            err[i] = e
        w[b1:] -= u[b0:b1, b1:].T @ err  # the block's errors onto every later row
    return q[:k0], scales


def dequantize(q: np.ndarray, scales: np.ndarray, block: int = 32) -> np.ndarray:
    """``q [K, N]`` and ``scales [ceil(K / block), N]`` -> float32 weights [K, N]."""
    return (q.astype(np.float32) * np.repeat(scales, block, axis=0)[:q.shape[0]]).astype(np.float32)


def write_codes(model: onnx.ModelProto, node: onnx.NodeProto, q: np.ndarray, scales: np.ndarray, bits: int) -> None:
    """Replace the codes and scales of the ``MatMulNBits`` ``node`` (8-bit, symmetric: no zero points) by
    ``q [K, N]`` / ``scales [K / block, N]``, in onnxruntime's layout."""
    if bits != 8:
        raise ValueError("GPTQ codes: 8-bit weights only")
    if len(node.input) > 3 and node.input[3]:
        raise ValueError(f"{node.name}: has zero points; GPTQ writes symmetric codes only")
    inits = {i.name: i for i in model.graph.initializer}
    k, n = q.shape
    nb = scales.shape[0]
    old_codes, old_scales = inits[node.input[1]], inits[node.input[2]]
    block = int(old_codes.dims[-1]) if len(old_codes.dims) == 3 else 0
    if tuple(old_codes.dims) != (n, nb, block) or nb != -(-k // max(block, 1)) or int(np.prod(old_scales.dims)) != n * nb:
        raise ValueError(f"{node.name}: codes {list(old_codes.dims)} / scales {list(old_scales.dims)} do not "
                         f"match K = {k}, N = {n}, {nb} blocks")
    padded = np.pad(q.astype(np.int16), ((0, nb * block - k), (0, 0)))  # [nb * block, N]; padding codes 0
    codes = (padded + (1 << (bits - 1))).astype(np.uint8).T.reshape(n, nb, block)  # [N, nb, block]
    old_codes.CopyFrom(numpy_helper.from_array(codes, old_codes.name))
    old_scales.CopyFrom(numpy_helper.from_array(
        np.ascontiguousarray(scales.T).reshape(tuple(old_scales.dims)).astype(np.float32), old_scales.name))
