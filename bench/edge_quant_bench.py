"""Edge quantization benchmark: quality and decode speed of every edge-graph quantization variant, side by side.

For one model split at layer N (default: SmolLM2-135M at layer 8) this

1. exports the fp32 edge front once (``split(..., edge_quant="fp32", edge_graph=--edge-graph)`` into
   ``--work``; the fused graph by default, ``--edge-graph plain`` for the traced one);
2. builds every variant in ``VARIANTS`` from that fp32 graph (``quantize_front`` kwargs, or onnxruntime's
   ``quantize_dynamic`` for the per-tensor dynamic-int8 baseline);
3. scores each with :class:`partition_tools.evaluate.SplitEvaluator` over ``--tokens`` tokens of the built-in
   English text, boundary through a lossless fp16 round trip (top-1 agreement, mean KL(ref || split),
   perplexity of split vs unsplit, boundary error);
4. times a single-token decode step through ``edge_client.front.FrontRuntime`` (``--past`` cached
   tokens, ``--threads`` intra-op threads) of each variant side by side with the fp32 graph (alternating blocks of 10 steps, so machine load hits both
   alike): the speedup is median(fp32) / median(variant) of that pairing; plus a 128-token prefill the same
   way, and fp32 vs ``default`` once more with one thread (insensitive to other jobs on a shared machine);
5. writes the JSON report (``--json``) and prints a markdown table; ``--gate`` exits 1 when the ``default``
   variant misses the goal (top-1 >= 0.98, mean KL <= 0.003, perplexity within +1 %, >= 1.5x fp32 decode).

Usage::

    python bench/edge_quant_bench.py --json docs/results/edge_quant.json
    python bench/edge_quant_bench.py --variants fp32,default --runs 100 --gate
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from edge_client.front import FrontRuntime
from partition_tools.evaluate import SplitEvaluator, fp16_round_trip
from partition_tools.quantize import calibration_tokens, quantize_front, recipe_for

GATE = {"top1_agreement": 0.98, "mean_kl": 0.003, "ppl_delta_pct": 1.0, "decode_speedup": 1.5}
DYNAMIC = "dynamic"  # marker: onnxruntime.quantization.quantize_dynamic, not quantize_front

# name -> quantize_front kwargs (mode included); "fp32" is the exported graph, "default" the shipped recipe.
# Specs with "smooth_alpha" get the recipe's calibration tokens (the last 512 of the built-in text).
I8 = {"mode": "int8", "block_size": 32, "accuracy_level": 4}
I4 = {"mode": "int4", "block_size": 32, "accuracy_level": 4}
# v_proj in the plain graph; the fused graph packs q|k|v into one MatMul, so there it is all three
V_PROJ = ["layers.*.self_attn.v_proj", "layers.*.self_attn.qkv_proj"]
VARIANTS: dict[str, dict | str | None] = {
    "fp32": None,
    "dynamic-int8": DYNAMIC,
    "int8-b32-acc1": {**I8, "accuracy_level": 1},
    "int8-b32": I8,
    "int8-b64": {**I8, "block_size": 64},
    "int8-b128": {**I8, "block_size": 128},
    "int8-b32-v_proj-fp32": {**I8, "keep_float": V_PROJ},
    "int8-b32-v_proj-acc1": {**I8, "precise": V_PROJ},
    "int8-b32-sq0.3": {**I8, "smooth_alpha": 0.3},
    "int8-b32-sq0.5": {**I8, "smooth_alpha": 0.5},
    "int8-b32-sq0.7": {**I8, "smooth_alpha": 0.7},
    "int8-b32-sq0.5-v_proj-fp32": {**I8, "smooth_alpha": 0.5, "keep_float": V_PROJ},
    "int8-b32-emb8": {**I8, "embedding": "int8"},
    "int8-b32-emb8-b64": {**I8, "embedding": "int8", "embedding_block_size": 64},
    "int8-b32-emb4": {**I8, "embedding": "int4"},
    "default": "recipe",  # recipe_for(adapter, N, "int8")
    "int4-b32": I4,
    "int4-b32-asym": {**I4, "symmetric": False},
    "int4-b32-sq0.5": {**I4, "smooth_alpha": 0.5},
    "int4-b32-emb4": {**I4, "embedding": "int4"},
    "int4-default": "recipe-int4",  # recipe_for(adapter, N, "int4")
}
# --sensitivity: which MatMuls does int8 (b32, accuracy level 4) hurt? Keep one kind / one layer in fp32.
OPS = {"plain": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
       "fused": ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}


def sensitivity_variants(n_layers: int, graph: str = "fused") -> dict[str, dict]:
    out = {f"int8-b32-{op.split('.')[-1]}-fp32": {**I8, "keep_float": [f"layers.*.{op}"]} for op in OPS[graph]}
    out.update({f"int8-b32-layer{i}-fp32": {**I8, "keep_float": [f"layers.{i}.*"]} for i in range(n_layers)})
    return out


def build_variant(name: str, spec, fp32: Path, out_dir: Path, adapter, layer: int, tokenizer) -> tuple[Path, dict]:
    if spec is None:
        return fp32, {"mode": "fp32"}
    dst = out_dir / f"{name}.onnx"
    if spec == DYNAMIC:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        root = logging.getLogger()
        level, root.level = root.level, logging.ERROR  # its INFO/WARNING chatter is not progress
        try:
            quantize_dynamic(str(fp32), str(dst), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])
        finally:
            root.setLevel(level)
        return dst, {"mode": "int8", "method": "quantize_dynamic (per-tensor activations, per-tensor weights)"}
    if spec in ("recipe", "recipe-int4"):
        mode = "int8" if spec == "recipe" else "int4"
        return dst, quantize_front(fp32, dst, mode, **recipe_for(adapter, layer, mode, tokenizer))
    kwargs = dict(spec)
    if "smooth_alpha" in kwargs:
        kwargs["calibration_ids"] = calibration_tokens(tokenizer, adapter.vocab_size)
    return dst, quantize_front(fp32, dst, kwargs.pop("mode"), **kwargs)


def front(path: Path, bundle: Path, threads: int, past: int) -> FrontRuntime:
    """The phone's runtime over edge graph ``path`` of ``bundle`` with ``past`` stored (random) cache rows."""
    rt = FrontRuntime(bundle, threads=threads, chunk=512, verify=False, graph=path, capacity=past + 64)
    rng = np.random.default_rng(0)
    if past:  # [KVH, past, D] per layer and tensor
        rt.extend_kv([[rng.standard_normal((rt.kv_heads, past, rt.head_dim)).astype(np.float32)
                       for _ in range(2 * rt.n_layers)]])
    return rt


def _step(rt: FrontRuntime, past: int, prefill: int) -> None:
    """One timed unit: a decode step over ``past`` cached positions (rolled back after), or a prefill of
    ``prefill`` tokens from an empty cache."""
    if prefill:
        rt.reset()
        rt.prefill(np.arange(4, 4 + prefill))
    else:
        rt.decode(42)
        rt.truncate(past)


def time_paired(base: FrontRuntime, other: FrontRuntime, past: int, runs: int, block: int = 10,
                prefill: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Milliseconds of ``runs`` steps of each of two runtimes, alternating in blocks of ``block`` steps.

    Returns two [runs // block, block] arrays (row i: block i of each runtime, run within a fraction of a
    second of each other). The first step of each block is an untimed warm-up: it pays for the other
    runtime's still-spinning worker threads and the caches the other graph evicted (a decoding edge runs
    one graph step after step).
    """
    blocks = max(1, runs // block)
    times = np.zeros((2, blocks, block))
    for rt in (base, other):
        _step(rt, past, prefill)
    for b in range(blocks):
        for k, rt in enumerate((base, other)):
            _step(rt, past, prefill)
            for i in range(block):
                start = time.perf_counter()
                _step(rt, past, prefill)
                times[k, b, i] = 1000 * (time.perf_counter() - start)
    return times[0], times[1]


def speed_one_thread(paths: dict[str, Path], bundle: Path, past: int, runs: int) -> dict[str, float]:
    """fp32 vs ``default`` with one intra-op thread: no cross-thread barriers, so other jobs on a shared
    machine slow each step by their share of the core instead of by whole scheduler slices."""
    base, other = front(paths["fp32"], bundle, 1, past), front(paths["default"], bundle, 1, past)
    b, d = time_paired(base, other, past, runs)
    return {"fp32_decode_ms_median": float(np.median(b)), "default_decode_ms_median": float(np.median(d)),
            "decode_speedup": float(np.median(b) / np.median(d)),
            "decode_speedup_blockwise": float(np.median(np.median(b, 1) / np.median(d, 1)))}


def speed(paths: dict[str, Path], bundle: Path, past: int, runs: int, threads: int) -> dict[str, dict]:
    """Decode (one token over ``past`` cached ones) and 128-token prefill times, each variant paired with fp32.

    ``decode_speedup`` = median(fp32) / median(variant) over all paired runs; ``decode_speedup_blockwise`` =
    the median over blocks of the same ratio within one block pair (robust to load that changes over the
    run: another job starting on a shared machine slows both sides of a block alike).
    """
    out, base_decode = {}, []
    for name, path in paths.items():
        if name == "fp32":
            continue
        base = front(paths["fp32"], bundle, threads, past)  # afresh: the prefill pairing below empties its cache
        rt = front(path, bundle, threads, past)
        b, d = time_paired(base, rt, past, runs)
        bp, p = time_paired(base, rt, past, max(4, runs // 10), block=2, prefill=128)
        base_decode.append(b.ravel())
        out[name] = {
            "decode_ms_median": float(np.median(d)), "decode_ms_p10": float(np.percentile(d, 10)),
            "decode_ms_p90": float(np.percentile(d, 90)), "prefill128_ms_median": float(np.median(p)),
            "fp32_decode_ms_median": float(np.median(b)), "fp32_decode_ms_p10": float(np.percentile(b, 10)),
            "fp32_prefill128_ms_median": float(np.median(bp)),
            "decode_speedup": float(np.median(b) / np.median(d)),
            "decode_speedup_blockwise": float(np.median(np.median(b, 1) / np.median(d, 1))),
            "decode_speedup_p10": float(np.percentile(b, 10) / np.percentile(d, 10)),
            "prefill128_speedup": float(np.median(bp) / np.median(p)),
        }
        del rt
    if not base_decode:  # fp32 alone: time it against itself
        base_decode = [time_paired(base, base, past, runs)[0].ravel()]
    fp32 = np.concatenate(base_decode)
    out["fp32"] = {"decode_ms_median": float(np.median(fp32)), "decode_ms_p10": float(np.percentile(fp32, 10)),
                   "decode_ms_p90": float(np.percentile(fp32, 90)),
                   "prefill128_ms_median": float(np.median([o["fp32_prefill128_ms_median"] for o in out.values()]))
                   if out else None, "decode_speedup": 1.0, "decode_speedup_blockwise": 1.0, "decode_speedup_p10": 1.0}
    return out


def markdown(rows: list[dict]) -> str:
    head = ("| variant | top-1 | mean KL | ppl Δ % | decode ms median | decode ms p10 | × fp32 median | × fp32 p10 "
            "| prefill-128 ms | size MB | boundary max err |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['name']} | {r['top1_agreement']:.4f} | {r['mean_kl']:.5f} | {r['ppl_delta_pct']:+.3f} | "
                     f"{r['decode_ms_median']:.1f} | {r['decode_ms_p10']:.1f} | {r['decode_speedup']:.2f} | "
                     f"{r['decode_speedup_p10']:.2f} | {r['prefill128_ms_median'] or 0:.0f} | {r['size_mb']:.1f} | "
                     f"{r['boundary_max_abs_err']:.2f} |")
    return "\n".join(lines)


def gate_failures(row: dict) -> list[str]:
    fails = []
    if row["top1_agreement"] < GATE["top1_agreement"]:
        fails.append(f"top-1 {row['top1_agreement']:.4f} < {GATE['top1_agreement']}")
    if row["mean_kl"] > GATE["mean_kl"]:
        fails.append(f"mean KL {row['mean_kl']:.5f} > {GATE['mean_kl']}")
    if row["ppl_delta_pct"] > GATE["ppl_delta_pct"]:
        fails.append(f"perplexity {row['ppl_delta_pct']:+.3f} % > +{GATE['ppl_delta_pct']} %")
    if row["decode_speedup"] < GATE["decode_speedup"]:
        fails.append(f"decode speedup {row['decode_speedup']:.2f}x < {GATE['decode_speedup']}x")
    return fails


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model source (preset, checkpoint dir, .gguf)")
    p.add_argument("--layer", type=int, default=8, help="split layer N")
    p.add_argument("--work", type=Path, default=Path("/tmp/edge_quant_bench"), help="scratch directory")
    p.add_argument("--variants", default="all", help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of text to score")
    p.add_argument("--window", type=int, default=512, help="edge prefill window")
    p.add_argument("--past", type=int, default=256, help="KV length of the timed decode step")
    p.add_argument("--runs", type=int, default=100, help="timed decode steps per variant (and as many fp32)")
    p.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--sensitivity", action="store_true",
                   help="also run int8 with one MatMul kind / one layer kept in fp32 (per-op sensitivity)")
    p.add_argument("--edge-graph", choices=("fused", "plain"), default="fused",
                   help="edge graph every variant is built from (partition_tools.export.build_front)")
    p.add_argument("--gate", action="store_true", help="exit 1 if the 'default' variant misses the goal")
    args = p.parse_args(argv)
    known = {**VARIANTS, **sensitivity_variants(args.layer, args.edge_graph)}
    names = list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.sensitivity:
        names += [n for n in sensitivity_variants(args.layer, args.edge_graph) if n not in names]
    unknown = [v for v in names if v not in known]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    if "fp32" not in names:
        names.insert(0, "fp32")  # the speed baseline is always measured in the same run
    args.names = names
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from partition_tools.adapters import ModelAdapter
    from partition_tools.models import load_model
    from partition_tools.split import SplitConfig, split
    from shared.manifest import BundleError, Manifest

    started = time.perf_counter()
    load_before = os.getloadavg()
    lm = load_model(args.model)
    adapter = ModelAdapter(lm.model)
    bundle = args.work / f"bundle-fp32-{args.edge_graph}"
    try:
        m = Manifest.load(bundle)
        reuse = (m.source_identity == lm.identity and m.split_layer == args.layer
                 and m.quant_report.get("edge_graph") == args.edge_graph)
    except BundleError:
        reuse = False
    if not reuse:
        split(lm, SplitConfig(layer=args.layer, out=bundle, edge_quant="fp32", edge_graph=args.edge_graph))
    Manifest.load(bundle)  # the split is complete
    fp32 = bundle / "edge" / "front.onnx"
    vdir = args.work / "variants"
    vdir.mkdir(parents=True, exist_ok=True)

    variants = {**VARIANTS, **sensitivity_variants(args.layer, args.edge_graph)}
    evaluator = SplitEvaluator(bundle, lm=lm, max_tokens=args.tokens, window=args.window, threads=args.threads)
    rows, paths = [], {}
    for name in args.names:
        t = time.perf_counter()
        path, report = build_variant(name, variants[name], fp32, vdir, adapter, args.layer, lm.tokenizer)
        quant_s = time.perf_counter() - t
        quality = evaluator.evaluate(path, fp16_round_trip)
        paths[name] = path
        rows.append({"name": name, "report": report, "quantize_s": quant_s,
                     "size_mb": path.stat().st_size / 1e6, **quality})
        print(f"{name}: top-1 {quality['top1_agreement']:.4f} KL {quality['mean_kl']:.5f} "
              f"ppl {quality['ppl_delta_pct']:+.3f} %", file=sys.stderr, flush=True)
    load_timing = os.getloadavg()
    timing = speed(paths, bundle, args.past, args.runs, args.threads)
    for r in rows:
        r.update(timing[r["name"]])
    one_thread = speed_one_thread(paths, bundle, args.past, args.runs) if "default" in paths else None

    result = {
        "command": "python bench/edge_quant_bench.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "model": lm.source, "identity": lm.identity, "split_layer": args.layer, "tokens": rows[0]["tokens"],
        "window": args.window, "boundary_codec": "fp16 round trip", "decode_past": args.past,
        "decode_runs": args.runs, "threads": args.threads, "gate": GATE,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "loadavg_before": load_before, "loadavg_timing_start": load_timing,
                    "loadavg_after": os.getloadavg()},
        "default_vs_fp32_one_thread": one_thread,
        "onnxruntime": __import__("onnxruntime").__version__,
        "seconds": time.perf_counter() - started,
        "variants": rows,
    }
    default = next((r for r in rows if r["name"] == "default"), None)
    if default is not None:
        result["default_gate_failures"] = gate_failures(default)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(rows))
    if default is not None:
        fails = result["default_gate_failures"]
        print("default recipe: " + ("PASS" if not fails else "FAIL: " + "; ".join(fails)))
        if args.gate and fails:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
