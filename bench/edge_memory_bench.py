"""Edge front memory: resident set of the phone's runtime per edge variant (fp32, int8, int8 with its fp32
prefill graph), each in a fresh process.

SmolLM2 split at N (default 8); the bundles are the fp32 split and variants of it (``split_bundles``: the same
cloud half) with the default int8 graph, with and without the prompt-phase graph (precision by phase). Per
variant a child process imports onnxruntime, reads its RSS (the baseline), opens ``FrontRuntime`` over the
bundle (``--threads``), prefills ``--prompt`` tokens and decodes ``--steps`` tokens, and reports RSS and peak
RSS (VmHWM) above the baseline, plus the bundle's edge bytes on disk. The KV buffers are in it (256 rows x
8 layers x 2 x 3 heads x 64 x 4 bytes = 3 MB at the default capacity).

Usage::

    python bench/edge_memory_bench.py --json docs/results/edge_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from split_bundles import cached_split, common_args, variant_bundle

CHILD = r"""
import json, sys
import numpy as np

def rss():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}  # MiB

import onnxruntime  # noqa: F401  (the baseline includes the runtime's own pages)
from edge_client.front import FrontRuntime

base = rss()
bundle, threads, prompt, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rt = FrontRuntime(bundle, threads=threads, verify=False)
opened = rss()
rt.prefill(np.arange(4, 4 + prompt))
for t in range(steps):
    rt.decode(42 + t)
done = rss()
print(json.dumps({"phased": rt.phased, "rss_open_mib": opened["VmRSS"] - base["VmRSS"],
                  "rss_mib": done["VmRSS"] - base["VmRSS"], "peak_mib": done["VmHWM"] - base["VmRSS"]}))
"""


def measure(bundle: Path, threads: int, prompt: int, steps: int) -> dict:
    """RSS above an onnxruntime-only baseline of a fresh process that runs the bundle's front (MiB)."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(bundle), str(threads), str(prompt), str(steps)],
                         check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def edge_bytes(bundle: Path) -> int:
    from shared.manifest import Manifest

    return sum(a.bytes for a in Manifest.load(bundle).artifacts.values() if a.role == "edge")


def main(argv=None) -> int:
    p = common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), "/tmp/edge_answers_bench")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens prefilled")
    p.add_argument("--steps", type=int, default=16, help="decode steps after it")
    p.add_argument("--repeats", type=int, default=2, help="fresh processes per variant (the median is reported)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from partition_tools.adapters import ModelAdapter
    from partition_tools.models import load_model
    from partition_tools.quantize import quantize_front, recipe_for

    lm = load_model(args.model)
    adapter = ModelAdapter(lm.model)
    fp32 = cached_split(lm, args.layer, args.work / "bundle-fp32")
    graphs = args.work / "memory"
    graphs.mkdir(parents=True, exist_ok=True)
    bundles = {"fp32": fp32}
    for name, prefill in (("int8-one-graph", None), ("int8-phased", "fp32")):
        dst = graphs / f"{name}.onnx"
        recipe = recipe_for(adapter, args.layer, "int8", lm.tokenizer)
        report = quantize_front(fp32 / "edge" / "front.onnx", dst, "int8", prefill=prefill, **recipe)
        bundles[name] = variant_bundle(fp32, dst, "int8", report, args.work / "bundles" / f"memory-{name}")
    rows = []
    for name, bundle in bundles.items():
        runs = [measure(bundle, args.threads, args.prompt, args.steps) for _ in range(args.repeats)]
        runs.sort(key=lambda r: r["rss_mib"])
        row = {"variant": name, "edge_mb_on_disk": edge_bytes(bundle) / 1e6, **runs[len(runs) // 2],
               "runs": runs}
        rows.append(row)
        print(f"{name}: {row['edge_mb_on_disk']:.1f} MB on disk, RSS +{row['rss_mib']:.1f} MiB "
              f"(peak +{row['peak_mib']:.1f})", file=sys.stderr, flush=True)
    result = {"command": "python bench/edge_memory_bench.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
              "model": lm.source, "split_layer": args.layer, "threads": args.threads, "prompt_tokens": args.prompt,
              "decode_steps": args.steps, "loadavg": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
              "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
