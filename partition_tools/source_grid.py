"""Keep an already-quantized checkpoint's weights on their own grid instead of rounding them again.

A GGUF checkpoint such as SmolLM2's Q4_1 stores each block of 32 input rows of one output column as
``w = m + d * q`` with ``q`` in 0..15 (``d``, ``m`` per block). Rounding those values once more onto a
symmetric int8 grid (``scale = max |w| / 127``) adds an error of up to half an int8 step to every weight -
small against the 4-bit step, but enough to flip greedy answers. The 16 levels of a block are evenly spaced,
so an 8-bit ``MatMulNBits`` block with a zero point holds them *exactly spaced*: ``scale = d / k``, codes
``c = k * q + a``, zero point ``zp`` with ``scale * (c - zp) = w``. Only the block's offset has to be rounded
(``zp`` is an integer); picking, per block, the ``k`` in 1..17 (codes up to 255) whose ``-k * m / d`` is
closest to an integer leaves an offset error ``e`` per block, ~3x smaller than round-to-nearest int8's
per-weight error, and the same for every weight of the block.

With 4-bit codes (``grid_codes(..., bits=4)``) the source's own codes are kept (scale ``d``), but the 4-bit
zero point is an integer in 0..15, so each block's offset misses by up to half a step and must be added back.

``fit_grid`` recognises the grid (every block's values on ``min + d * j``, ``j`` integer in 0..levels-1,
to float32 precision; anything else returns None and the caller rounds as usual), ``grid_codes`` picks the
codes, ``write_codes`` puts them into the quantizer's node (onnxruntime's layout: codes ``[N, nb, block]``
- two per byte at 4 bits -, scales ``[N * nb]``, uint8 zero points), and ``add_offset_correction`` adds the
remaining offsets exactly, as ``(x @ E) @ R`` (``E [K, nb]`` sums each block of the input, ``R [nb, N]``
the residuals) - sharing the outlier channels' side path when the MatMul has one
(``partition_tools.outlier_channels``), else two small fp32 MatMuls and an Add of its own.

Measured on SmolLM2 (docs/quality.md, "Edge answers"): with the grid kept and fp32 activations the int8 front
gives the unsplit model's answers (40/40 tuning prompts); with int8 activations the activations are what
flips answers, which the outlier channels address.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def fit_grid(w: np.ndarray, block: int = 32, levels: int = 16,
             rtol: float = 1e-5) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``w [K, N]`` on a per-block affine grid of ``levels`` levels (blocks of ``block`` rows, K a multiple)
    -> (lo [nb, N], d [nb, N], q [K, N] int in 0..levels-1), else None."""
    k0, n = w.shape
    if k0 % block:
        return None
    wb = w.astype(np.float64).reshape(k0 // block, block, n)  # [nb, block, N]
    lo, hi = wb.min(1), wb.max(1)  # [nb, N]
    d = (hi - lo) / (levels - 1)
    safe = np.where(d > 0, d, 1.0)
    q = np.rint((wb - lo[:, None]) / safe[:, None])  # [nb, block, N]
    err = np.abs(lo[:, None] + q * d[:, None] - wb).max(1)  # [nb, N]
    if (err > rtol * np.maximum(hi - lo, 1e-30)).any():
        return None
    return lo, d, q.reshape(k0, n).astype(np.int16)


def grid_codes(lo: np.ndarray, d: np.ndarray, q: np.ndarray, block: int = 32, bits: int = 8
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Codes for grid weights ``lo + d * q`` (``lo``, ``d`` [nb, N] per block of ``block`` rows): (codes uint8
    [K, N], scales float32 [nb, N], zero points uint8 [nb, N], offset residual float32 [nb, N] = true weight -
    dequantized weight, the same for every row of a block).

    bits 8: scale ``d / k`` with the ``k`` (codes ``k * q`` up to 255) that leaves the smallest offset residual.
    bits 4: the source codes themselves (scale ``d``, zero point ``rint(-lo / d)`` clipped to 0..15), whose
    residual is up to half a 4-bit step: it must be added back (:func:`add_offset_correction`)."""
    nb, n = lo.shape

    def rep(t: np.ndarray) -> np.ndarray:  # [nb, N] -> [K, N]
        return np.repeat(t, block, axis=0)

    safe = np.where(d > 0, d, 1.0)
    flat = d <= 0  # a constant block
    if bits == 4:
        scales = np.where(flat, 1.0, d).astype(np.float32)
        zp = np.where(flat, 0, np.clip(np.rint(-lo / safe), 0, 15)).astype(np.int64)
        codes = np.where(rep(flat), 0, q).astype(np.int64)
    elif bits == 8:
        qmax = int(q.max()) if q.size else 0
        best_e = np.full((nb, n), np.inf)
        best_k = np.ones((nb, n))
        best_a = np.zeros((nb, n))
        for k in range(1, 255 // max(qmax, 1) + 1):
            z = -k * lo / safe  # the exact (real) zero point for codes k * q
            a = np.maximum(0.0, -np.rint(z))  # codes shifted up when the zero point would be negative
            ok = (a + k * qmax <= 255) & (np.rint(z) + a <= 255)
            e = np.where(ok, np.abs(z - np.rint(z)) * safe / k, np.inf)
            better = e < best_e
            best_e, best_k, best_a = (np.where(better, e, best_e), np.where(better, k, best_k),
                                      np.where(better, a, best_a))
        # a constant block: scale |lo|, zero point 128, codes 128 + sign(lo)
        scales = np.where(flat, np.where(lo != 0, np.abs(lo), 1.0), d / best_k).astype(np.float32)
        zp = np.where(flat, 128, np.rint(-best_k * lo / safe) + best_a).astype(np.int64)
        codes = np.where(rep(flat), 128 + np.sign(rep(lo)), rep(best_k) * q + rep(best_a)).astype(np.int64)
    else:
        raise ValueError(f"grid codes: 4 or 8 bits, not {bits}")
    top = (1 << bits) - 1
    if codes.min() < 0 or codes.max() > top or zp.min() < 0 or zp.max() > top:
        raise ValueError(f"grid codes out of the {bits}-bit range")  # cannot happen for levels <= 16
    deq = rep(scales).astype(np.float64) * (codes - rep(zp))
    resid = (rep(lo) + rep(d) * q - deq).reshape(nb, block, n).mean(1)  # [nb, N]
    return codes.astype(np.uint8), scales, zp.astype(np.uint8), resid.astype(np.float32)


def _pack4(codes: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 [..., 2m] -> [..., m], two per byte, the first in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def write_codes(model: onnx.ModelProto, node: onnx.NodeProto, codes: np.ndarray, scales: np.ndarray,
                zp: np.ndarray) -> None:
    """Make the 4- or 8-bit ``MatMulNBits`` ``node`` read ``codes [K, N]``, ``scales [nb, N]`` and zero points
    ``zp [nb, N]`` (uint8 values; packed two per byte at 4 bits), replacing its codes and scales and adding or
    replacing its zero-point input."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    bits = attrs.get("bits")
    if bits not in (4, 8):
        raise ValueError(f"{node.name}: grid codes are written into 4- or 8-bit MatMulNBits nodes only")
    k, n = codes.shape
    block = int(attrs["block_size"])
    nb = scales.shape[0]
    if nb * block != k or (int(attrs["K"]), int(attrs["N"])) != (k, n):
        raise ValueError(f"{node.name}: codes [{k}, {n}] / {nb} blocks do not match the node")
    inits = {i.name: i for i in model.graph.initializer}
    blob = np.ascontiguousarray(codes.T).reshape(n, nb, block)  # [N, nb, block]
    zcols = np.ascontiguousarray(zp.T)  # [N, nb]
    if bits == 4:
        blob = _pack4(blob)  # [N, nb, block / 2]
        zcols = _pack4(np.pad(zcols, ((0, 0), (0, nb % 2))))  # [N, ceil(nb / 2)]
    inits[node.input[1]].CopyFrom(numpy_helper.from_array(blob, node.input[1]))
    inits[node.input[2]].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(scales.T).reshape(-1), node.input[2]))
    zname = node.name + ".zero_points"
    zarr = numpy_helper.from_array(zcols.reshape(-1), zname)
    if len(node.input) > 3 and node.input[3]:
        inits[node.input[3]].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(zarr), node.input[3]))
    else:
        model.graph.initializer.append(zarr)
        while len(node.input) < 3:
            node.input.append("")
        node.input.append(zname)


def add_offset_correction(model: onnx.ModelProto, node: onnx.NodeProto, resid: np.ndarray, block: int,
                          side: dict | None = None) -> None:
    """Add the grid weights' remaining offsets exactly, in fp32: ``y += S(x) @ resid`` with ``S(x) [.., nb]`` the
    sums of each block of ``block`` input channels of ``node``'s input.

    Without ``side``: ``(x @ E) @ resid`` (``E [K, nb]`` 0/1) and an Add after ``node``. With ``side`` (the
    ``partition_tools.smoothing.split_outlier_channels`` entry of this MatMul: its Gather, side MatMul and
    whether the main input is masked) the two share one path: the Gather becomes ``z @ [E | P]`` (``P`` the
    one-hot columns of the split channels) and the side weight gains ``resid`` as its first rows, so the
    step runs no more kernels than the outlier split alone. With a masked main input (``masked_by == "mask"``:
    the Gather reads the unmasked x, the split channels are 0 on the main path) the block sums must leave the
    split channels out, so their side rows lose their blocks' residual."""
    nb, n = resid.shape
    e = np.repeat(np.eye(nb, dtype=np.float32), block, axis=0)  # [K, nb]
    base = node.name
    inits = {i.name: i for i in model.graph.initializer}
    if side is not None:
        nodes = {x.name: x for x in model.graph.node}
        gather, mm = nodes[side["gather"]], nodes[side["side"]]
        idx = numpy_helper.to_array(inits[gather.input[1]]).astype(np.int64)  # [k]
        sel = np.concatenate([e, np.eye(e.shape[0], dtype=np.float32)[:, idx]], axis=1)  # [K, nb + k]
        w_side = numpy_helper.to_array(inits[mm.input[1]]).astype(np.float32)  # [k, N]
        if side["masked_by"] == "mask":
            w_side = w_side - resid[idx // block]
        inits[mm.input[1]].CopyFrom(numpy_helper.from_array(np.concatenate([resid, w_side]).astype(np.float32),
                                                            mm.input[1]))
        model.graph.initializer.remove(inits[gather.input[1]])
        model.graph.initializer.append(numpy_helper.from_array(sel, base + ".side_select"))
        at = list(model.graph.node).index(gather)
        model.graph.node.remove(gather)
        model.graph.node.insert(at, helper.make_node("MatMul", [gather.input[0], base + ".side_select"],
                                                     list(gather.output), name=gather.name))
        return
    out = node.output[0]
    raw = base + ".uncorrected"
    node.output[0] = raw
    model.graph.initializer.extend([numpy_helper.from_array(e, base + ".block_sum"),
                                    numpy_helper.from_array(resid.astype(np.float32), base + ".offset_resid")])
    nodes = [helper.make_node("MatMul", [node.input[0], base + ".block_sum"], [base + ".sums"], name=base + ".sums"),
             helper.make_node("MatMul", [base + ".sums", base + ".offset_resid"], [base + ".corr"],
                              name=base + ".corr"),
             helper.make_node("Add", [raw, base + ".corr"], [out], name=base + ".corrected")]
    at = list(model.graph.node).index(node) + 1
    for i, extra in enumerate(nodes):
        model.graph.node.insert(at + i, extra)
