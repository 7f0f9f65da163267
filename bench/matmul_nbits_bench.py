"""One decode row through onnxruntime's ``MatMulNBits`` kernels against the fp32 ``MatMul``, side by side.

The edge's recipe rests on which kernels this CPU runs fast: 8 or 4 bits of weight, int8 activations
(``accuracy_level=4``) or fp32 ones (``accuracy_level=1``), and what the exact offset correction of a Q4
source (``partition_tools.source_grid.add_offset_correction``: two small fp32 MatMuls and an Add) adds. For
each shape (SmolLM2's packed q|k|v, gate|up and down_proj by default) a graph of ``--mats`` independent
MatMuls of random weights is timed per arm, the arms interleaved run by run; the table gives the p10 time per
MatMul and its ratio to fp32.

Usage::

    python bench/matmul_nbits_bench.py --json docs/results/matmul_nbits.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

BLOCK = 32
ARMS = {  # name -> (bits or None for fp32, accuracy level, exact offset correction)
    "fp32": (None, 0, False),
    "int8-a8": (8, 4, False),
    "int8-a32": (8, 1, False),
    "int4-a8": (4, 4, False),
    "int4-a32": (4, 1, False),
    "int4-a32-exact": (4, 1, True),
}


def build(k: int, n: int, arm: str, mats: int, threads: int, rng: np.random.Generator) -> ort.InferenceSession:
    """``mats`` MatMuls of one ``[1, k]`` input, each ``[k, n]``, as the arm computes them."""
    bits, level, exact = ARMS[arm]
    nb = k // BLOCK
    nodes, inits, outs = [], [], []
    for i in range(mats):
        y = f"y{i}"
        if bits is None:
            inits.append(numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32) * 0.02, f"w{i}"))
            nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [y]))
        else:
            q = rng.integers(0, 1 << bits, (n, nb, BLOCK), dtype=np.uint8)
            codes = q[..., 0::2] | (q[..., 1::2] << 4) if bits == 4 else q  # two 4-bit codes per byte
            zp = np.full(n * ((nb * bits + 7) // 8), 0x88 if bits == 4 else 128, np.uint8)
            inits += [numpy_helper.from_array(codes.astype(np.uint8), f"w{i}"),
                      numpy_helper.from_array(rng.random(n * nb, dtype=np.float32) * 0.01, f"s{i}"),
                      numpy_helper.from_array(zp, f"z{i}")]
            raw = f"r{i}" if exact else y
            nodes.append(helper.make_node("MatMulNBits", ["x", f"w{i}", f"s{i}", f"z{i}"], [raw],
                                          domain="com.microsoft", K=k, N=n, bits=bits, block_size=BLOCK,
                                          accuracy_level=level))
            if exact:  # (x @ E) @ R + raw, as add_offset_correction writes it
                inits += [numpy_helper.from_array(np.repeat(np.eye(nb, dtype=np.float32), BLOCK, axis=0), f"e{i}"),
                          numpy_helper.from_array(rng.standard_normal((nb, n), dtype=np.float32) * 1e-3, f"o{i}")]
                nodes += [helper.make_node("MatMul", ["x", f"e{i}"], [f"b{i}"]),
                          helper.make_node("MatMul", [f"b{i}", f"o{i}"], [f"c{i}"]),
                          helper.make_node("Add", [raw, f"c{i}"], [y])]
        outs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, [1, n]))
    graph = helper.make_graph(nodes, "mats", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])], outs,
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def shape(text: str) -> tuple[int, int]:
    k, n = (int(v) for v in text.lower().split("x"))
    if k % BLOCK or k <= 0 or n <= 0:
        raise argparse.ArgumentTypeError(f"shape {text!r}: K x N with K a positive multiple of {BLOCK}")
    return k, n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=lambda s: [shape(x) for x in s.split(",")], default="576x960,576x3072,1536x576",
                   help="K x N per MatMul (default: SmolLM2's qkv, gate_up, down)")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--mats", type=int, default=8, help="MatMuls per graph (one run times them all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown or "fp32" not in arms or args.mats < 1 or args.runs < 1 or args.threads < 1:
        p.error(f"--arms from {', '.join(ARMS)} including fp32; --mats, --runs, --threads >= 1 (unknown: {unknown})")
    rng = np.random.default_rng(0)
    load = {"before": os.getloadavg()}
    records = []
    for k, n in args.shapes:
        x = rng.standard_normal((1, k), dtype=np.float32)
        sessions = {a: build(k, n, a, args.mats, args.threads, rng) for a in arms}
        times = {a: [] for a in arms}
        for s in sessions.values():
            s.run(None, {"x": x})
        for _ in range(args.runs):
            for a, s in sessions.items():
                t0 = time.perf_counter()
                s.run(None, {"x": x})
                times[a].append((time.perf_counter() - t0) / args.mats)
        p10 = {a: float(np.percentile(t, 10)) * 1e3 for a, t in times.items()}
        med = {a: float(np.median(t)) * 1e3 for a, t in times.items()}
        records.append({"k": k, "n": n, "p10_ms": p10, "median_ms": med,
                        "fp32_over": {a: p10["fp32"] / p10[a] for a in arms}})
        print(f"K {k} x N {n}, ms per MatMul (p10), fp32 / arm:")
        for a in arms:
            print(f"  {a:16s} {p10[a]:8.4f}  {p10['fp32'] / p10[a]:6.2f}x")
    load["after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "onnxruntime": ort.__version__,
                                         "threads": args.threads, "mats": args.mats, "runs": args.runs,
                                         "cores": os.cpu_count(), "loadavg": load, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
