"""onnxruntime's CPU ``GroupQueryAttention`` alone, one decode token over P cached positions: what the edge front's
attention costs at long context, with the cache in float32 (the fused graph's), float16, or int8 (the op's own
quantized cache: ``kv_cache_bit_width`` 8 with per-channel scales, what ``partition_tools/kv_quant.py`` builds).

The fused front's step at 2,048 positions is 1.7-2.4x its step at 16 (docs/performance.md, "Edge: the fused front
graph"), and the profiler puts the growth in ``GroupQueryAttention``. This times the op by itself in SmolLM2's shape
(9 query heads over 3 KV heads of 64 channels; ``--layers`` of them in one graph, as the front runs them), each
with its cache bound once through IO binding and written in place (past and present share the buffer, as
``FrontRuntime`` binds them), at each ``--contexts`` P; float16 casts q|k|v in and the output back (the op runs
on float16 caches only with float16 inputs; int8 takes float32 inputs and the cache's scales). Variants
interleaved step by step, a pause before each (the runtime's idle spin: ``edge_front_bench.py``), p10 and
median per step.

Beside the op, the ``read`` rows are the floor any attention kernel meets: one pass over the same cache bytes
(numpy sums of 64-bit words over the P cached rows of every layer's key and value, split over the same number
of threads), for a float32 cache and for an int8 one (a quarter of the bytes: what ``quantize_front(...,
kv_cache="int8")`` stores). The step at P cannot be faster than the step at 16 plus the growth of these
floors, whatever the kernel.

    python bench/gqa_cache_bench.py --contexts 16,256,2048 --threads 1,2 --json docs/results/gqa_cache.json
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
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


CACHE_TYPES = {"fp32": (TensorProto.FLOAT, np.float32), "fp16": (TensorProto.FLOAT16, np.float16),
               "int8": (TensorProto.INT8, np.int8)}
SCALE_SLOT = 12  # GroupQueryAttention's k_scale / v_scale inputs


def build(dtype: str, layers: int):
    """``layers`` GroupQueryAttention nodes on one packed q|k|v input [1, 1, (QH + 2 KVH) D] (float32)."""
    cache = CACHE_TYPES[dtype][0]
    scales = []
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
        ins = [src, "", "", f"past_key.{i}", f"past_value.{i}", "seqlens_k", "total_sequence_length"]
        quant = {}
        if dtype == "int8":  # per-channel scales [1, KVH, 1, D], as kv_quant.py calibrates them (values: N(0, 0.3))
            ins += [""] * (SCALE_SLOT - len(ins)) + ["kv_scale", "kv_scale"]
            quant = {"kv_cache_bit_width": 8, "k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL"}
        nodes.append(helper.make_node("GroupQueryAttention", ins, [attn, f"present_key.{i}", f"present_value.{i}"],
                                      domain="com.microsoft", num_heads=QH, kv_num_heads=KVH, **quant))
        if dtype == "fp16":
            nodes.append(helper.make_node("Cast", [attn], [f"attn.{i}"], to=TensorProto.FLOAT))
        outputs += [helper.make_tensor_value_info(f"attn.{i}", TensorProto.FLOAT, [1, 1, QH * D]),
                    helper.make_tensor_value_info(f"present_key.{i}", cache, [1, KVH, "C", D]),
                    helper.make_tensor_value_info(f"present_value.{i}", cache, [1, KVH, "C", D])]
    if dtype == "int8":
        scales.append(helper.make_tensor("kv_scale", TensorProto.FLOAT, [1, KVH, 1, D], [1.2 / 127] * (KVH * D)))
    graph = helper.make_graph(nodes, "gqa", inputs, outputs, initializer=scales)
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
    np_dtype = CACHE_TYPES[dtype][1]
    keep = []
    for i in range(layers):
        for name in ("key", "value"):
            x = rng.standard_normal((1, KVH, CAPACITY, D)) * 0.3
            x = np.clip(np.round(x / (1.2 / 127)), -127, 127) if dtype == "int8" else x
            buf = ort.OrtValue.ortvalue_from_numpy(x.astype(np_dtype))
            keep.append(buf)
            bind.bind_ortvalue_input(f"past_{name}.{i}", buf)
            bind.bind_ortvalue_output(f"present_{name}.{i}", buf)
        bind.bind_output(f"attn.{i}")
    return sess, bind, keep


class ReadFloor:
    """One pass over ``layers`` key and value caches of ``past`` rows (numpy's reductions release the GIL, so
    ``threads`` Python threads read disjoint layers at once)."""

    def __init__(self, dtype: str, layers: int, threads: int, past: int, rng: np.random.Generator):
        np_dtype = np.float32 if dtype == "fp32" else np.int8
        bufs = [rng.integers(-100, 100, (KVH, CAPACITY, D)).astype(np_dtype) for _ in range(2 * layers)]
        views = [b[:, :past, :] for b in bufs]  # [KVH, P, D], strided like the op's per-head reads
        self.parts = [views[i::threads] for i in range(threads)]
        self.pool = ThreadPoolExecutor(threads) if threads > 1 else None

    @staticmethod
    def _read(views) -> int:
        # each row's D values reinterpreted as 64-bit words: a pass over the bytes, not the dtype's arithmetic
        return sum(int(v.view(np.uint64).sum()) for v in views)

    def run(self) -> None:
        if self.pool is None:
            self._read(self.parts[0])
        else:
            list(self.pool.map(self._read, self.parts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="16,256,2048", help="cached positions P per step")
    ap.add_argument("--threads", default="1,2", help="intra-op threads")
    ap.add_argument("--layers", type=int, default=8, help="GroupQueryAttention nodes per graph (the front's layers)")
    ap.add_argument("--dtypes", default="fp32,fp16,int8", help="cache dtypes")
    ap.add_argument("--runs", type=int, default=100, help="timed steps per variant")
    ap.add_argument("--no-floor", action="store_true", help="skip the read-floor rows")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    dtypes = args.dtypes.split(",")
    if any(not 0 < p < CAPACITY for p in contexts) or not set(dtypes) <= set(CACHE_TYPES) or args.runs < 1:
        ap.error(f"contexts in 1..{CAPACITY - 1}, dtypes {' / '.join(CACHE_TYPES)}, runs >= 1")
    rng = np.random.default_rng(0)
    rows = []
    for threads in (int(x) for x in args.threads.split(",")):
        for past in contexts:
            arms = {d: session(d, args.layers, threads, past, rng) for d in dtypes}
            steps = {d: (lambda s=sess, b=bind: s.run_with_iobinding(b)) for d, (sess, bind, _) in arms.items()}
            if not args.no_floor:
                for d in ("fp32", "int8"):
                    steps[f"read-{d}"] = ReadFloor(d, args.layers, threads, past, rng).run
            times = {d: [] for d in steps}
            for step in steps.values():
                for _ in range(10):
                    step()
            for _ in range(args.runs):
                for d, step in steps.items():
                    time.sleep(PAUSE_S)
                    t0 = time.perf_counter()
                    step()
                    times[d].append(1e3 * (time.perf_counter() - t0))
            for d, ts in times.items():
                kind = "read" if d.startswith("read-") else "op"
                row = {"threads": threads, "past": past, "kind": kind, "cache": d.removeprefix("read-"),
                       "layers": args.layers, "cache_mb": 2 * args.layers * KVH * past * D
                       * np.dtype(CACHE_TYPES[d.removeprefix("read-")][1]).itemsize / 1e6,
                       "p10_ms": float(np.percentile(ts, 10)), "median_ms": float(np.median(ts))}
                row["per_layer_median_ms"] = row["median_ms"] / args.layers
                rows.append(row)
                print(f"threads {threads}  P {past:5d}  {kind} {row['cache']:4s} ({row['cache_mb']:5.1f} MB): p10 {row['p10_ms']:.3f} ms, median {row['median_ms']:.3f} ms "
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
