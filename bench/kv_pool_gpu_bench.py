"""The fast path's KV pool, 16-bit vs 8-bit (``--kv-cache-dtype``), side by side in one process: decode tokens/s
through ``LLMEngine`` at each S, and the capacity (sessions x ``--context`` tokens) of the pool a memory budget holds.

One random-weight back half (``--preset``, split at ``--split``) is built once; per arm (``--kv``: ``auto`` = the
compute dtype, then ``int8`` / ``fp8`` / ``int8v``) an engine with the fast runner (tuned, CUDA graphs: as ``serve`` builds
it) gets a pool sized to the budget, ``--memory-fraction`` of the GPU's memory less what is allocated once the
weights are (and ``--headroom-gib`` for activations, graphs and logits), and runs ``engine_workloads.lockstep``
(prompt of ``--prompt`` states, ``--gen`` greedy decode steps) at every S of ``--sessions``. Recorded per arm:
tokens/s and step ms per S, the pool's bytes, bytes per block and blocks, the sessions x context it holds
(``capacity_sessions``: its blocks, the null block excepted, over ``--context``), the peak memory of the run, and
the capacity at the measured overhead (``capacity_sessions_at_peak``: the budget less weights and the measured
non-pool peak, over the bytes per block); beside them each later arm's ratios to the first arm.

``autoglm-cloud serve`` sizes its pool by ``--num-blocks`` and has no memory fraction; 0.9 is vLLM's default
``gpu_memory_utilization`` and the figure docs/performance.md's capacity arithmetic uses. On the CPU (a smoke run
at a tiny preset) the pool is ``--cpu-blocks`` blocks and no capacity is measured.

Run (GPU): ``python bench/kv_pool_gpu_bench.py --out $OUT/cloud_gpu_kvpool.json`` (bench/gpu_session.sh kvpool)
CPU smoke: ``python bench/kv_pool_gpu_bench.py --preset tiny-glm4v --split 1 --sessions 2,4 --prompt 16 --gen 8``
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cloud_gpu_bench import GIB, BenchConfig, build_engine, env_info, log, model_config, weight_bytes  # noqa: E402
from engine_workloads import lockstep  # noqa: E402
from results_io import emit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def pool_blocks(bc: BenchConfig, model, kv: str, dev, fraction: float, headroom: float, cpu_blocks: int) -> int:
    """Blocks of a ``kv`` pool for ``model`` that fit the budget: ``fraction`` of the GPU less what is allocated
    now (the weights) less ``headroom`` bytes; ``cpu_blocks`` on the CPU."""
    from cloud_server.engine.kv_cache import KVCachePool

    if dev.type != "cuda":
        return cpu_blocks
    probe = KVCachePool(model.num_layers, 2, bc.block_size, model.num_kv_heads, model.head_dim, model.dtype, dev, kv)
    per_block = probe.bytes_per_block
    del probe
    budget = fraction * torch.cuda.get_device_properties(dev).total_memory - torch.cuda.memory_allocated(dev) - headroom
    if budget < 2 * per_block:
        raise RuntimeError(f"no KV budget left: {budget / GIB:.1f} GiB")
    return int(budget // per_block)


def run_arm(bc: BenchConfig, model, hf_full, dev, variant: str, kv: str, args) -> dict:
    """One engine over ``model`` with a ``kv`` pool sized to the budget: the S sweep and the capacity."""
    cfg = replace(bc, kv_cache_dtype=kv)
    blocks = pool_blocks(cfg, model, kv, dev, args.memory_fraction, args.headroom_gib * GIB, args.cpu_blocks)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    engine, runner, info = build_engine(cfg, hf_full, dev, variant, num_blocks=blocks, model=model)
    log(f"[{kv}] engine ready: {blocks} blocks, {runner.pool.nbytes / 1e9:.2f} GB pool, runner {info['runner']}, "
        f"build {info['runner_build_s']:.1f} s")
    out = {"build": info, "pool_dtype": str(runner.pool.k.dtype), "pool_v_dtype": str(runner.pool.v.dtype),
           "pool_bytes": runner.pool.nbytes,
           "pool_bytes_per_block": runner.pool.bytes_per_block, "pool_blocks": blocks, "sessions": {},
           "capacity_sessions": ((blocks - len(runner.reserved_blocks)) * bc.block_size // args.context
                                 if dev.type == "cuda" else None)}
    h = model.hidden_size
    gen = torch.Generator().manual_seed(bc.seed + 3)
    prompts = [torch.randn(bc.prompt, h, generator=gen) for _ in range(4)]  # [P, H] float32, as decoded
    steps_in = [torch.randn(1, h, generator=gen) for _ in range(16)]  # [1, H] per decode step

    def sync():
        return torch.cuda.synchronize(dev) if dev.type == "cuda" else None

    lockstep(engine, 1, prompts, steps_in, 4, f"warm-{kv}", sync)  # first-call costs out of the way
    for s in bc.sessions:
        r = lockstep(engine, s, prompts, steps_in, bc.gen, f"{kv}-s{s}", sync)
        out["sessions"][str(s)] = r
        log(f"[{kv}] S={s:3d}: {r['tokens_per_s']:.0f} tok/s, step {r['step_ms_mean']:.3f} ms, prefill "
            f"{r['prefill_tokens_per_s']:.0f} tok/s")
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        weights = weight_bytes(model)
        peak = torch.cuda.max_memory_allocated(dev)
        out.update(gpu_total_bytes=total, weights_bytes=weights, peak_allocated_bytes=peak,
                   overhead_bytes=peak - weights - runner.pool.nbytes, fits=peak <= args.memory_fraction * total)
        at_peak = (args.memory_fraction * total - weights - out["overhead_bytes"]) // runner.pool.bytes_per_block
        out["capacity_sessions_at_peak"] = int((at_peak - 1) * bc.block_size // args.context)
    del engine, runner
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="glm4v-9b-random")
    p.add_argument("--split", type=int, default=12)
    p.add_argument("--sessions", default="64,256", help="S values, comma-separated")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--kv", default="auto,int8,int8v",
                   help="pool arms in order (ratios against the first): auto (the compute dtype), int8, fp8, int8v")
    p.add_argument("--context", type=int, default=4096, help="tokens per session of the capacity figure")
    p.add_argument("--memory-fraction", type=float, default=0.9, help="the GPU memory share weights + pool + rest get")
    p.add_argument("--headroom-gib", type=float, default=6.0, help="GiB kept off the pool for activations etc.")
    p.add_argument("--cpu-blocks", type=int, default=64, help="the pool's blocks on the CPU (no capacity there)")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    sessions = tuple(int(s) for s in args.sessions.split(",") if s)
    arms = [k.strip() for k in args.kv.split(",") if k.strip()]
    from cloud_server.config import KV_CACHE_DTYPES

    if bad := [k for k in arms if k not in KV_CACHE_DTYPES]:
        raise SystemExit(f"--kv: unknown {', '.join(bad)} (choose from {', '.join(KV_CACHE_DTYPES)})")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    variant = "bf16" if dev.type == "cuda" else "fp32"
    bc = BenchConfig(preset=args.preset, split=args.split, sessions=sessions, prompt=args.prompt, gen=args.gen,
                     max_context=max(args.context, args.prompt + args.gen), pool_sessions=max(sessions))
    from cloud_server.model import random_split_model

    _, hf_full = model_config(bc.preset, bc.split)
    t0 = time.perf_counter()
    model = random_split_model(hf_full, bc.split, variant, str(dev), seed=bc.seed)
    res = {"env": env_info(dev), "config": {**vars(args), "out": str(args.out) if args.out else None},
           "model_build_s": time.perf_counter() - t0, "arms": {}, "errors": {}}
    for kv in arms:
        try:
            res["arms"][kv] = run_arm(bc, model, hf_full, dev, variant, kv, args)
        except Exception as e:  # noqa: BLE001 - record and go on: the other arm still measures
            res["errors"][kv] = traceback.format_exc()
            log(f"[{kv}] FAILED: {e!r}")
            gc.collect()
    base = res["arms"].get(arms[0])
    for kv in arms[1:]:
        arm = res["arms"].get(kv)
        if not (base and arm):
            continue
        arm["vs_" + arms[0]] = {
            "pool_bytes_per_block": arm["pool_bytes_per_block"] / base["pool_bytes_per_block"],
            "capacity_sessions": (arm["capacity_sessions"] / base["capacity_sessions"]
                                  if base["capacity_sessions"] else None),
            "tokens_per_s": {s: arm["sessions"][s]["tokens_per_s"] / base["sessions"][s]["tokens_per_s"]
                             for s in arm["sessions"] if s in base["sessions"]}}
        log(f"[{kv}] vs {arms[0]}: {arm['vs_' + arms[0]]}")
    emit(res, args.out, "kv_pool_gpu_bench.py", argv)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
