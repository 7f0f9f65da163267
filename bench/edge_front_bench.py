"""Edge front speed, side by side: fused graph (int8 / int4 / fp32) vs the plain traced graph vs llama.cpp.

For one model split at layer N (default SmolLM2-135M at 8) this

1. splits the model once per variant into ``--work`` (reused when the source matches): ``fused-{fp32,int8,
   int4}`` (``partition_tools.graph_builder``, the shipped recipes), ``fused-int8-kv8`` / ``fused-int4-kv8`` (the int8 / int4 recipe
   plus an int8 KV cache, ``partition_tools.kv_quant``: ``split --edge-kv int8``) and ``plain-{fp32,int8}`` (the traced graph, the
   old default);
2. times a one-token decode step of every variant through ``edge_client.front.FrontRuntime`` (what the
   phone runs) over a cache of P positions, P in ``--contexts``, with 1 and 2 intra-op threads. The cache
   is filled with stored rows (``extend_kv``, no compute) and each timed step is rolled back with
   ``truncate(P)`` outside the timed region, so every step sees exactly P cached positions. Variants run
   *interleaved* in blocks of ``--block`` steps (round robin), so load from other jobs on a shared machine
   hits all of them alike; ratios are taken within the run;
3. times a ``--prefill``-token prefill from an empty cache (tokens/s) the same way;
4. with ``llama-cpp-python`` importable, the same model through llama.cpp, *in the same interleaved loops*:
   the GGUF re-quantized to Q8_0 (and the shipped Q4_1), whole-model decode step at the same contexts and
   threads; its per-layer time is (step - lm_head share) / layers, the lm_head share estimated by its
   share of the weights;
5. profiles one decode step series per graph with onnxruntime's profiler (per-op-type time and kernel
   count per step) and writes everything to ``--json``.

Usage::

    python bench/edge_front_bench.py --json docs/results/edge_front.json
    python bench/edge_front_bench.py --contexts 16,256 --runs 40 --no-llama   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from split_bundles import cached_split, choices, common_args

ROUNDED = {"smooth_alpha": 0.5, "source_grid": None, "outlier_channels": 0}  # the recipe for a bf16 source
VARIANTS = {  # name -> (edge_graph, edge_quant, quantize_front overrides: then built from the fused fp32 front)
    "fused-int8": ("fused", "int8", None),
    "fused-int8-kv8": ("fused", "int8", {"kv_cache": "int8"}),
    "fused-int8-rounded": ("fused", "int8", ROUNDED),  # a grid source quantized as a bf16 one would be
    "fused-int4": ("fused", "int4", None),
    "fused-int4-kv8": ("fused", "int4", {"kv_cache": "int8"}),  # the default front + `split --edge-kv int8`
    # the previous int4 recipe of a grid source: int8 activations, 16 fp32 outlier channels per MatMul
    "fused-int4-a8": ("fused", "int4", {"accuracy_level": 4, "outlier_channels": 16}),
    "fused-fp32": ("fused", "fp32", None),
    "plain-int8": ("plain", "int8", None),
    "plain-fp32": ("plain", "fp32", None),
}


def build_bundles(lm, layer: int, work: Path, names: list[str]) -> dict[str, tuple[Path, Path]]:
    """name -> (bundle, edge graph): one split per (graph, quant); variants with overrides (the int8 KV cache,
    the rounded recipe) as graphs beside the fp32 bundle."""
    from partition_tools.adapters import ModelAdapter
    from partition_tools.quantize import kv_calibration_tokens, quantize_front, recipe_for

    out = {}
    for name in names:
        graph, quant, extra = VARIANTS[name]
        path = cached_split(lm, layer, work / (f"{graph}-fp32" if extra else name), "fp32" if extra else quant, graph)
        front = path / "edge" / "front.onnx"
        if extra:
            adapter = ModelAdapter(lm.model)
            front = work / f"{name}.onnx"
            recipe = {**recipe_for(adapter, layer, quant, lm.tokenizer), **extra}
            if "kv_cache" in extra:
                recipe["kv_calibration_ids"] = kv_calibration_tokens(lm.tokenizer, adapter.vocab_size)
            quantize_front(path / "edge" / "front.onnx", front, quant, **recipe)
        out[name] = (path, front)
    return out


def filled_runtime(variant: tuple[Path, Path], threads: int, past: int, rng: np.random.Generator):
    """A FrontRuntime whose cache holds ``past`` stored positions (random rows of the right shape)."""
    from edge_client.front import FrontRuntime

    bundle, graph = variant
    own = graph == bundle / "edge" / "front.onnx"  # the bundle's own front: as the phone opens it (both phases)
    rt = FrontRuntime(bundle, threads=threads, chunk=512, verify=False, capacity=past + 64,
                      graph=None if own else graph)
    if past:
        block = [rng.standard_normal((rt.kv_heads, past, rt.head_dim)).astype(np.float32)
                 for _ in range(2 * rt.n_layers)]
        rt.extend_kv([block])
    return rt


# An onnxruntime session's idle intra-op worker spins ~50 ms after each Run (measured on the 2-core dev box: a
# full core of CPU time), so a block timed right after another variant's block shared its cores with that
# spinner: session 10's 2-thread int8 and int4 numbers (second and third in the loop) paid for it, the fp32
# front (first, after llama.cpp) did not. Each block now starts after the previous variant's threads are idle.
QUIET_S = 0.1


def time_decode(runtimes: dict, past: int, runs: int, block: int) -> dict[str, np.ndarray]:
    """ms per decode step of each runtime, interleaved in blocks of ``block`` steps: name -> [runs]."""
    times = {n: [] for n in runtimes}
    for rt in runtimes.values():  # warm-up
        for _ in range(3):
            rt.decode(7)
            rt.truncate(past)
    for _ in range(max(1, runs // block)):
        for name, rt in runtimes.items():
            time.sleep(QUIET_S)  # the previous variant's pool workers stop spinning
            rt.decode(7)  # untimed: wakes this runtime's threads (caches: the other graph's may still be warm)
            rt.truncate(past)
            for _ in range(block):
                t0 = time.perf_counter()
                rt.decode(11)
                times[name].append(1000 * (time.perf_counter() - t0))
                rt.truncate(past)
    return {n: np.asarray(t) for n, t in times.items()}


def time_prefill(runtimes: dict, n_tokens: int, runs: int) -> dict[str, np.ndarray]:
    """ms per ``n_tokens``-token prefill from an empty cache, interleaved: name -> [runs]."""
    ids = np.random.default_rng(1).integers(4, 40000, n_tokens)
    times = {n: [] for n in runtimes}
    for _ in range(runs + 1):
        for name, rt in runtimes.items():
            rt.reset()
            time.sleep(QUIET_S)  # as in time_decode
            rt.prefill(ids[:8])  # untimed: wakes this runtime's threads
            rt.reset()
            t0 = time.perf_counter()
            rt.prefill(ids)
            times[name].append(1000 * (time.perf_counter() - t0))
    return {n: np.asarray(t[1:]) for n, t in times.items()}


def summary(ms: np.ndarray) -> dict:
    return {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)), "n": int(ms.size)}


def profile_ops(variant: tuple[Path, Path], past: int, steps: int, threads: int) -> dict:
    """onnxruntime profiler over ``steps`` decode steps: per op type, mean µs per step and kernels per step."""
    from edge_client.front import FrontRuntime

    bundle, graph = variant
    with tempfile.TemporaryDirectory() as tmp:
        rt = FrontRuntime(bundle, threads=threads, verify=False, capacity=past + 64, graph=graph,
                          profile_prefix=str(Path(tmp) / "prof"))
        rng = np.random.default_rng(0)
        if past:
            rt.extend_kv([[rng.standard_normal((rt.kv_heads, past, rt.head_dim)).astype(np.float32)
                           for _ in range(2 * rt.n_layers)]])
        for _ in range(steps):
            rt.decode(11)
            rt.truncate(past)
        path = rt.session.end_profiling()
        events = json.loads(Path(path).read_text())
    per_op, count = defaultdict(float), defaultdict(int)
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            op = e.get("args", {}).get("op_name", "?")
            per_op[op] += e["dur"]
            count[op] += 1
    n = max(1, len(runs))
    total = sum(per_op.values()) / n
    ops = {op: {"us_per_step": per_op[op] / n, "kernels_per_step": count[op] / n,
                "share": per_op[op] / n / total if total else 0.0}
           for op in sorted(per_op, key=per_op.get, reverse=True)}
    model_run_us = float(np.median([e["dur"] for e in runs])) if runs else None
    return {"past": past, "threads": threads, "steps": n, "kernel_us_per_step": total,
            "model_run_us_median": model_run_us, "kernels_per_step": sum(count.values()) / n, "ops": ops}


# ------------------------------------------------------------------------------------------------
# llama.cpp


def llama_cpp_gguf(src: Path, work: Path) -> dict[str, Path]:
    """The shipped GGUF and a Q8_0 re-quantization of it (llama.cpp's own quantizer)."""
    import llama_cpp

    q8 = work / (src.stem.split(".")[0] + ".Q8_0.gguf")
    if not q8.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
        params.allow_requantize = True
        params.nthread = 2
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(q8).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize returned {rc}")
    return {"Q8_0": q8, src.stem.split(".")[-1]: src}


class LlamaStepper:
    """llama.cpp (whole model, last-token logits) behind the runtime's decode / truncate / reset / prefill,
    so the timing loops interleave it with the fronts."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int, past: int):
        from llama_cpp import Llama

        self.llm = Llama(str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                         verbose=False)
        if past:
            self.llm.eval([int(t) for t in np.random.default_rng(0).integers(4, 40000, past)])

    def decode(self, token: int) -> None:
        self.llm.eval([token])

    def truncate(self, n: int) -> None:
        self.llm.n_tokens = n  # eval drops the cache rows past n before its next batch

    def reset(self) -> None:
        self.llm.reset()

    def prefill(self, ids) -> None:
        self.llm.eval([int(t) for t in ids])

    def close(self) -> None:
        self.llm.close()


def lm_head_share(adapter) -> float:
    """lm_head's share of the decoder's weight bytes (llama.cpp stores them at one type): its step share."""
    layer = sum(p.numel() for p in adapter.layers[0].parameters())
    head = adapter.lm_head.weight.numel()
    return head / (head + layer * adapter.num_layers)


# ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), "/tmp/edge_front_bench")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--contexts", default="16,256,1024,2048")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--runs", type=int, default=100, help="timed decode steps per variant, context and threads")
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--prefill", type=int, default=128, help="tokens of the timed prefill")
    p.add_argument("--prefill-runs", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=50)
    p.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.names = choices(p, args.variants, VARIANTS, "variant")
    args.context_list = [int(c) for c in args.contexts.split(",")]
    args.thread_list = [int(t) for t in args.threads.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from partition_tools.adapters import ModelAdapter
    from partition_tools.models import load_model

    started = time.perf_counter()
    load = {"before": os.getloadavg()}
    lm = load_model(args.model)
    adapter = ModelAdapter(lm.model)
    args.work.mkdir(parents=True, exist_ok=True)
    bundles = build_bundles(lm, args.layer, args.work, args.names)
    rng = np.random.default_rng(0)
    decode: dict = {}
    prefill: dict = {}
    load["timing_start"] = os.getloadavg()
    ggufs: dict[str, Path] = {}
    if not args.no_llama:
        try:
            from partition_tools.models import smollm2_gguf_path

            ggufs = llama_cpp_gguf(smollm2_gguf_path(), args.work)
        except ImportError as e:
            print(f"llama.cpp skipped: {e}", file=sys.stderr)
    n_ctx = max(args.context_list) + 64
    for threads in args.thread_list:
        for past in args.context_list:
            rts = {n: filled_runtime(b, threads, past, rng) for n, b in bundles.items()}
            rts.update({f"llama.cpp-{q}": LlamaStepper(g, threads, n_ctx, past) for q, g in ggufs.items()})
            ms = time_decode(rts, past, args.runs, args.block)
            decode[f"t{threads}/p{past}"] = {n: summary(v) for n, v in ms.items()}
            line = " ".join(f"{n} {np.median(v):.2f}" for n, v in ms.items())
            print(f"threads {threads} past {past}: {line} ms", file=sys.stderr, flush=True)
            del rts
        rts = {n: filled_runtime(b, threads, 0, rng) for n, b in bundles.items()}
        rts.update({f"llama.cpp-{q}": LlamaStepper(g, threads, n_ctx, 0) for q, g in ggufs.items()})
        pm = time_prefill(rts, args.prefill, args.prefill_runs)
        prefill[f"t{threads}"] = {n: {**summary(v), "tok_s": args.prefill / (np.median(v) / 1000)}
                                  for n, v in pm.items()}
        del rts
    load["timing_end"] = os.getloadavg()

    ratios = {}
    for key, row in decode.items():
        r = {}
        for a, b in (("fused-fp32", "fused-int8"), ("fused-fp32", "fused-int4"), ("plain-fp32", "fused-int8"),
                     ("plain-int8", "fused-int8"), ("plain-fp32", "plain-int8"), ("fused-int8", "fused-int8-kv8"),
                     ("llama.cpp-Q8_0", "fused-int8")):
            if a in row and b in row:
                r[f"{b} vs {a}"] = {"median": row[a]["median_ms"] / row[b]["median_ms"],
                                    "p10": row[a]["p10_ms"] / row[b]["p10_ms"]}
        ratios[key] = r
    growth = {}
    for threads in args.thread_list:
        lo, hi = f"t{threads}/p{min(args.context_list)}", f"t{threads}/p{max(args.context_list)}"
        growth[f"t{threads}"] = {n: {"median": decode[hi][n]["median_ms"] / decode[lo][n]["median_ms"],
                                     "p10": decode[hi][n]["p10_ms"] / decode[lo][n]["p10_ms"]} for n in decode[lo]}

    profiles = {}
    for past in sorted({256, max(args.context_list)}):
        for name in bundles:
            profiles[f"{name}/p{past}"] = profile_ops(bundles[name], past, args.profile_steps, 2)

    llama = None
    if ggufs:
        share = lm_head_share(adapter)
        llama = {"lm_head_share": share, "layers": adapter.num_layers, "models": list(ggufs),
                 "version": __import__("llama_cpp").__version__,
                 "per_layer_ms": {k: {n: v["median_ms"] * (1 - share) / adapter.num_layers
                                      for n, v in row.items() if n.startswith("llama.cpp")}
                                  for k, row in decode.items()},
                 "per_layer_p10_ms": {k: {n: v["p10_ms"] * (1 - share) / adapter.num_layers
                                          for n, v in row.items() if n.startswith("llama.cpp")}
                                      for k, row in decode.items()}}
    load["after"] = os.getloadavg()

    per_layer = {k: {n: v["median_ms"] / args.layer for n, v in row.items() if not n.startswith("llama")}
                 for k, row in decode.items()}
    per_layer_p10 = {k: {n: v["p10_ms"] / args.layer for n, v in row.items() if not n.startswith("llama")}
                     for k, row in decode.items()}
    result = {
        "command": "python bench/edge_front_bench.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "model": lm.source, "identity": lm.identity, "split_layer": args.layer, "layers_total": adapter.num_layers,
        "contexts": args.context_list, "threads": args.thread_list, "runs": args.runs, "block": args.block,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "loadavg": load, "cpu_model": _cpu_model(),
                    "note": "loadavg above is the noise from other jobs (vs cores); ratios are within one "
                            "interleaved run, p10/p90 show the spread"},
        "onnxruntime": __import__("onnxruntime").__version__,
        "bundles": {n: {"bundle": str(b), "graph": str(g)} for n, (b, g) in bundles.items()},
        "decode": decode, "decode_ratios": ratios, "decode_growth_max_over_min_context": growth,
        "per_layer_ms": per_layer, "per_layer_p10_ms": per_layer_p10, "prefill": prefill, "prefill_tokens": args.prefill,
        "profiles_decode_t2": profiles, "llama_cpp": llama,
        "seconds": time.perf_counter() - started,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"decode_ratios": ratios, "growth": growth}, indent=1))
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


if __name__ == "__main__":
    sys.exit(main())
