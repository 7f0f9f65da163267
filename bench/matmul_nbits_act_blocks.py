"""How onnxruntime's ``MatMulNBits`` at ``accuracy_level=4`` quantizes its activations: per block of K, or per row?

The int8 edge recipe keeps each MatMul's largest calibration input channels in fp32 beside the kernel
(``partition_tools.outlier_channels``): ~3 extra kernels per MatMul, ~1.3 ms of a SmolLM2 front step (docs/
performance.md, "Session 9"). Whether those outliers could instead be confined by *where they sit* depends on the
activation quantization's granularity: if the kernel scales each block of ``block`` input channels on its own, an
outlier only coarsens its own block, and channels permuted so that the outliers share blocks (a permutation the
front's weights can absorb) would cost nothing per step.

The probe: one 8-bit ``MatMulNBits`` (K = 576, N = 1,536, SmolLM2's gate|up input width, random weights on the
kernel's grid, so the weights are exact and all error is the activations'), a ``[1, K]`` N(0, 1) row, and the
mean absolute output error against float64 when outlier channels of value ``--outlier`` are placed: none, one, 8
in one block, 8 in 8 blocks, and a block made of outliers only. Per-block scaling shows as: one block's worth of
extra error however many outliers share it; per-row scaling as every channel's error growing.

Usage::

    python bench/matmul_nbits_act_blocks.py --json docs/results/matmul_nbits_act_blocks.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def session(w_codes: np.ndarray, scales: np.ndarray, k: int, n: int, block: int) -> ort.InferenceSession:
    """An 8-bit ``MatMulNBits`` (accuracy level 4: int8 activations) of codes ``[N, K / block, block]``, zero point
    128, one thread."""
    nb = k // block
    inits = [numpy_helper.from_array(w_codes, "B"), numpy_helper.from_array(scales.reshape(-1), "S"),
             numpy_helper.from_array(np.full(n * nb, 128, np.uint8), "Z")]
    node = helper.make_node("MatMulNBits", ["A", "B", "S", "Z"], ["Y"], domain="com.microsoft", K=k, N=n, bits=8,
                            block_size=block, accuracy_level=4)
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=576)
    p.add_argument("--n", type=int, default=1536)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--outlier", type=float, default=200.0, help="value of an outlier channel (the rest ~N(0, 1))")
    p.add_argument("--rows", type=int, default=20, help="random rows averaged per placement")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if a.k % a.block or a.k < 16 * a.block:
        raise SystemExit("--k must be a multiple of --block and hold at least 16 blocks")
    rng = np.random.default_rng(0)
    nb = a.k // a.block
    codes = rng.integers(0, 256, size=(a.n, nb, a.block)).astype(np.uint8)  # [N, nb, block]
    scales = (rng.random((a.n, nb)) * 0.01 + 0.001).astype(np.float32)  # [N, nb]
    w = ((codes.astype(np.float64) - 128) * scales[:, :, None]).reshape(a.n, a.k).T  # [K, N] exactly the kernel's
    sess = session(codes, scales, a.k, a.n, a.block)
    b = a.block
    placements = {"none": [], "one": [0], "8 in one block": list(range(8)),
                  "8 in 8 blocks": [i * 2 * b for i in range(8)], "one block of outliers only": list(range(b))}
    out = {}
    for name, chans in placements.items():
        errs = []
        for _ in range(a.rows):
            x = rng.standard_normal((1, a.k)).astype(np.float32)
            x[0, chans] = a.outlier
            y = sess.run(None, {"A": x})[0].astype(np.float64)
            errs.append(float(np.abs(y - x.astype(np.float64) @ w).mean()))
        out[name] = {"outlier_channels": len(chans), "mean_abs_error": float(np.mean(errs))}
    base = out["none"]["mean_abs_error"]
    print(f"MatMulNBits 8-bit, accuracy_level 4, K {a.k} N {a.n} block {a.block}, outliers {a.outlier:g}, "
          f"onnxruntime {ort.__version__}")
    for name, r in out.items():
        r["over_none"] = r["mean_abs_error"] / base
        print(f"  {name:28s} mean |error| {r['mean_abs_error']:.4f}  ({r['over_none']:.1f}x none)")
    if a.json is not None:
        a.json.write_text(json.dumps({"command": " ".join(["python", "bench/matmul_nbits_act_blocks.py", *sys.argv[1:]]),
                                      "onnxruntime": ort.__version__, "k": a.k, "n": a.n, "block": a.block,
                                      "outlier": a.outlier, "rows": a.rows, "placements": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
