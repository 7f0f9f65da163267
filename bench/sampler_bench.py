"""Time of one sampling step (temperature 0.7, top-p 0.9) over S rows of a GLM-sized vocabulary: the
whole-vocabulary sort (``filtered_logits`` + ``sample_rows``: the sampler before, now its rare fallback) vs
the rejection sampler (``sample_top_p``: ``tries_for(0.9)`` draws over vocabulary chunks, the first inside the
nucleus), and
the engine's whole ``Sampler.launch`` + ``result`` for S seeded requests (uniforms, parameter table, sampling,
the ids' copy back), on this machine's CPU (or ``--device cuda``). Two logit spreads: a peaked, LM-like one and
the flat one of a random-weight model.

Usage::

    python bench/sampler_bench.py                       # S = 64, V = 151,552, prints one JSON line
    python bench/sampler_bench.py --rows 64 --device cuda --out /tmp/sampler.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cloud_server.engine.sampler import Sampler, filtered_logits, sample_rows, sample_top_p, tries_for
from cloud_server.engine.sampling_params import SamplingParams


def _time_ms(fn, device: str, repeats: int) -> float:
    fn()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151552)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="also write the record here (JSON)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    s, dev = args.rows, args.device
    temperature, top_p = torch.full((s,), 0.7, device=dev), torch.full((s,), 0.9, device=dev)
    top_k = torch.zeros(s, dtype=torch.long, device=dev)
    tries = tries_for(0.9)  # the draws a top-p 0.9 row takes
    u = torch.rand(s, tries, generator=g).to(dev)
    rec = {"rows": s, "vocab": args.vocab, "device": dev, "tries": tries, "torch_threads": torch.get_num_threads(),
           "host": platform.machine(),
           "command": f"python bench/sampler_bench.py --rows {s} --vocab {args.vocab} --device {dev}"}
    sampler = Sampler(0)
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=i) for i in range(s)]
    inv_t = 1 / temperature
    for name, spread in (("peaked", 4.0), ("flat", 1.3)):
        raw = (spread * torch.randn(s, args.vocab, generator=g)).to(dev)  # [S, V] raw logits, std spread
        sort = _time_ms(lambda x=raw: sample_rows(filtered_logits(x, temperature, top_k, top_p, 0, True), u[:, 0]),
                        dev, args.repeats)
        rej = _time_ms(lambda x=raw: sample_top_p(x, top_p, u, inv_t), dev, args.repeats)
        full = _time_ms(lambda x=raw: sampler.launch(x, params, list(range(s))).result(), dev, args.repeats)
        rec[name] = {"logit_std": spread, "sort_ms": round(sort, 3), "rejection_ms": round(rej, 3),
                     "sampler_step_ms": round(full, 3), "speedup": round(sort / rej, 2),
                     "rows_missed": int(sample_top_p(raw, top_p, u, inv_t)[1].sum())}
    print(json.dumps(rec))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
