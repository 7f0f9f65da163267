"""onnxruntime's CPU ``GroupQueryAttention`` alone, one decode token over P cached positions: what the edge front's
attention costs at long context, with the cache in float32 (the fused graph's) or float16.

The fused front's step at 2,048 positions is 1.7-2.4x its step at 16 (docs/performance.md, "Edge: the fused front
graph"), and the profiler puts the growth in ``GroupQueryAttention``. This times the op by itself in SmolLM2's shape
(9 query heads over 3 KV heads of 64 channels; ``--layers`` of them in one graph, as the front runs them), each
with its cache bound once through IO binding and written in place (past and present share the buffer, as
``FrontRuntime`` binds them), at each ``--contexts`` P; float16 casts q|k|v in and the output back (the op runs
on float16 caches only with float16 inputs). Variants interleaved step by step, a pause before each (the
runtime's idle spin: ``edge_front_bench.py``), p10 and median per step.

    python bench/gqa_cache_bench.py --contexts 16,256,2048 --threads 1,2 --json docs/results/gqa_cache.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

QH, KVH, D = 9, 3, 64  # SmolLM2-135M: query heads, KV heads, head size
CAPACITY = 4096  # the cache buffer's positions (FrontRuntime's buffer, grown in place)
PAUSE_S = 0.003


def build(dtype: str, layers: int):
    """``layers`` GroupQueryAttention nodes on one packed q|k|v input [1, 1, (QH + 2 KVH) D] (float32)."""
    cache = TensorProto.FLOAT if dtype == "fp32" else TensorProto.FLOAT16
    inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [1, 1, (QH + 2 * KVH) * D]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    nodes, outputs, src = [], [], "qkv"
    if dtype == "fp16":
        nodes.append(helper.make_node("Cast", ["qkv"], ["qkv16"], to=cache))
        src = "qkv16"
    for i in range(layers):
        inputs += [helper.make_tensor_value_info(f"past_key.{i}", cache, [1, KVH, "C", D]),
                   helper.make_tensor_value_info(f"past_value.{i}", cache, [1, KVH, "C", D])]
        attn = f"attn.{i}" + ("_16" if dtype == "fp16" else "")
        nodes.append(helper.make_node("GroupQueryAttention", [src, "", "", f"past_key.{i}", f"past_value.{i}",
                                                              "seqlens_k", "total_sequence_length"],
                                      [attn, f"present_key.{i}", f"present_value.{i}"], domain="com.microsoft",
                                      num_heads=QH, kv_num_heads=KVH))
        if dtype == "fp16":
            nodes.append(helper.make_node("Cast", [attn], [f"attn.{i}"], to=TensorProto.FLOAT))
        outputs += [helper.make_tensor_value_info(f"attn.{i}", TensorProto.FLOAT, [1, 1, QH * D]),
                    helper.make_tensor_value_info(f"present_key.{i}", cache, [1, KVH, "C", D]),
                    helper.make_tensor_value_info(f"present_value.{i}", cache, [1, KVH, "C", D])]
    graph = helper.make_graph(nodes, "gqa", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def session(dtype: str, layers: int, threads: int, past: int, rng: np.random.Generator):
    """A session with every cache bound in place, each step writing position ``past`` and attending to 0..past."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(build(dtype, layers).SerializeToString(), opts, providers=["CPUExecutionProvider"])
    bind = sess.io_binding()
    bind.bind_cpu_input("qkv", rng.standard_normal((1, 1, (QH + 2 * KVH) * D)).astype(np.float32))
    bind.bind_cpu_input("seqlens_k", np.array([past], np.int32))
    bind.bind_cpu_input("total_sequence_length", np.array(past + 1, np.int32))
    np_dtype = np.float32 if dtype == "fp32" else np.float16
    keep = []
    for i in range(layers):
        for name in ("key", "value"):
            buf = ort.OrtValue.ortvalue_from_numpy((rng.standard_normal((1, KVH, CAPACITY, D)) * 0.3).astype(np_dtype))
            keep.append(buf)
            bind.bind_ortvalue_input(f"past_{name}.{i}", buf)
            bind.bind_ortvalue_output(f"present_{name}.{i}", buf)
        bind.bind_output(f"attn.{i}")
    return sess, bind, keep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="16,256,2048", help="cached positions P per step")
    ap.add_argument("--threads", default="1,2", help="intra-op threads")
    ap.add_argument("--layers", type=int, default=8, help="GroupQueryAttention nodes per graph (the front's layers)")
    ap.add_argument("--dtypes", default="fp32,fp16", help="cache dtypes")
    ap.add_argument("--runs", type=int, default=100, help="timed steps per variant")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    dtypes = args.dtypes.split(",")
    if any(not 0 < p < CAPACITY for p in contexts) or not set(dtypes) <= {"fp32", "fp16"} or args.runs < 1:
        ap.error(f"contexts in 1..{CAPACITY - 1}, dtypes fp32 / fp16, runs >= 1")
    rng = np.random.default_rng(0)
    rows = []
    for threads in (int(x) for x in args.threads.split(",")):
        for past in contexts:
            arms = {d: session(d, args.layers, threads, past, rng) for d in dtypes}
            times = {d: [] for d in arms}
            for sess, bind, _ in arms.values():
                for _ in range(10):
                    sess.run_with_iobinding(bind)
            for _ in range(args.runs):
                for d, (sess, bind, _) in arms.items():
                    time.sleep(PAUSE_S)
                    t0 = time.perf_counter()
                    sess.run_with_iobinding(bind)
                    times[d].append(1e3 * (time.perf_counter() - t0))
            for d, ts in times.items():
                row = {"threads": threads, "past": past, "cache": d, "layers": args.layers,
                       "p10_ms": float(np.percentile(ts, 10)), "median_ms": float(np.median(ts))}
                row["per_layer_median_ms"] = row["median_ms"] / args.layers
                rows.append(row)
                print(f"threads {threads}  P {past:5d}  {d}: p10 {row['p10_ms']:.3f} ms, median {row['median_ms']:.3f} ms "
                      f"({row['per_layer_median_ms']:.3f} ms per layer)", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": "python bench/gqa_cache_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
                                         "onnxruntime": ort.__version__, "cpu": platform.processor() or platform.machine(),
                                         "shape": {"query_heads": QH, "kv_heads": KVH, "head_dim": D},
                                         "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
