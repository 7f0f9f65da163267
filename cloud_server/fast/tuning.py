"""Startup tuning of the fast path on the GPU at hand: the projection kernels and the decode-attention config.

Contract. :func:`tune` times, before the decode graphs are captured, every decode-relevant projection shape
(cuBLAS vs the Triton GEMV / skinny GEMM candidates of :mod:`.linear`, over all layers' weights as a decode
step reads them, at batch 1, 16, 64, 128 up to the largest graph bucket) and the split/tile configs of the
paged decode kernel per graph bucket, and records the winners in the model's ``LinearChooser`` and the
graphs' ``DecodeWorkspace``. A Triton config is kept only if its result matches cuBLAS (relative error
< 1e-2) and it is more than 3 % faster. It runs only on CUDA with Triton; elsewhere it returns ``None`` and
changes nothing (the CPU path stays cuBLAS/torch and the heuristic split). It reads weights and pool
blocks and writes nothing the model computes with except the two choice tables.

Called once by :class:`~cloud_server.fast.runner.FastGlmRunner` at construction and by
``bench/cloud_gpu_bench.py``. Reference: the measure-then-choose approach of Triton's ``autotune`` and
cuBLASLt heuristics, done here per graph bucket because a decode step's shapes are fixed per bucket.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable

import torch

from . import kernels

log = logging.getLogger("autoglm.cloud.fast")

LINEAR_BATCHES = (1, 16, 64, 128)  # batch sizes the projections are timed at (one per chooser bucket used)
ATTENTION_CONFIGS = ((64, 4, 2), (32, 4, 3), (64, 8, 3))  # (block_n, num_warps, num_stages) per split
ATTENTION_SPLITS = (64, 128, 256, 512)  # tokens per split
DEFAULT_CONTEXT = 576  # context the attention configs are timed at: a 512-token prompt + half of 128 steps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against ``b`` (float64)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def time_graph(fn: Callable[[], object], reps: int = 10) -> float:
    """Median ms of one replay of a CUDA graph of ``fn`` (captured after two warm-up calls)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return statistics.median(times[2:])


def _say(report: Callable[[str], None] | None, msg: str) -> None:
    (report or log.info)(msg)


def tune_linears(model, batches: tuple[int, ...] = LINEAR_BATCHES,
                 report: Callable[[str], None] | None = None) -> dict:
    """Time cuBLAS and the Triton candidates on every projection shape of ``model`` (a FastGLM) at each batch
    size in ``batches``; record the winners in ``model.linear``. Returns the table (``"<proj>@m<batch>"``)."""
    import torch.nn.functional as F

    from .linear import candidates, m_bucket, run_config

    dev, dtype = model.device, model.dtype
    layers = model.layers
    groups = {"qkv": [(l_.qkv_weight, l_.qkv_bias) for l_ in layers], "o": [(l_.o_weight, None) for l_ in layers],
              "gate_up": [(l_.gate_up_weight, None) for l_ in layers], "down": [(l_.down_weight, None) for l_ in layers],
              "lm_head": [(model.lm_head_weight, None)]}
    table = {}
    for m in batches:
        for name, ws in groups.items():
            w0, b0 = ws[0]
            n, k = w0.shape
            x = torch.randn(m, k, device=dev, dtype=dtype)  # [m, K]
            nbytes = sum(w.numel() * w.element_size() for w, _ in ws)
            t_cu = time_graph(lambda x=x, ws=ws: [F.linear(x, w, b) for w, b in ws])
            row = {"n": n, "k": k, "m": m, "cublas_ms": t_cu, "cublas_gbs": nbytes / t_cu / 1e6, "chosen": "cublas"}
            best, best_t = None, 0.97 * t_cu
            if kernels.HAVE_TRITON:
                ref = F.linear(x, w0, b0).float()  # [m, N]
                for cfg in candidates(m, n, k):
                    try:
                        if rel(run_config(cfg, x, w0, b0).float(), ref) > 1e-2:
                            continue
                        t = time_graph(lambda cfg=cfg, x=x, ws=ws: [run_config(cfg, x, w, b) for w, b in ws])
                    except Exception as e:  # noqa: BLE001 - a config that does not compile is just not chosen
                        row.setdefault("errors", []).append(f"{cfg}: {e!r}"[:200])
                        continue
                    if t < best_t:
                        best, best_t = cfg, t
            if best is not None:
                model.linear.set(n, k, m_bucket(m), best)
                row.update(chosen=f"triton {best.kernel} n{best.block_n} k{best.block_k} w{best.num_warps} "
                                  f"s{best.num_stages}", triton_ms=best_t, triton_gbs=nbytes / best_t / 1e6)
            table[f"{name}@m{m}"] = row
            _say(report, f"  linear {name:8s} m={m:3d}: cuBLAS {row['cublas_gbs']:.0f} GB/s"
                 + (f", {row['chosen']} {row['triton_gbs']:.0f} GB/s" if best is not None else " (kept)"))
    return table


def attention_inputs(model, kv, m: int, ctx: int):
    """q [m, Hq, D], block tables [m, blocks] over distinct pool blocks (never the null block 0), lengths [m]."""
    dev, dtype = model.device, model.dtype
    nblk = -(-ctx // kv.block_size)
    tables = (torch.arange(m * nblk, device=dev, dtype=torch.int32).view(m, nblk) % (kv.num_blocks - 1)) + 1
    lens = torch.full((m,), ctx, dtype=torch.int32, device=dev)  # [m]
    q = torch.randn(m, model.local_heads, model.cfg.head_dim, device=dev, dtype=dtype)  # [m, Hq, D]
    return q, tables, lens


def heuristic_split(b: int, model, max_tokens: int) -> int:
    from .attention import decode_split_tokens

    return decode_split_tokens(b, model.local_kv_heads, max_tokens)


def tune_attention(model, kv, graphs, ctx: int = DEFAULT_CONTEXT,
                   report: Callable[[str], None] | None = None) -> dict:
    """Per decode bucket of ``graphs``, time the decode kernel's split/tile configs (all layers, ``ctx`` tokens
    of context) and record the fastest in ``graphs.workspace.configs``. Returns the table (bucket -> config)."""
    from .attention import MAX_SPLITS, DecodeConfig, decode_attention_triton

    dev = model.device
    ws = graphs.workspace
    width = graphs.block_tables.shape[1]
    max_tokens = width * kv.block_size
    ctx = max(1, min(ctx, max_tokens))
    table: dict = {}
    for b in graphs.buckets:
        q, tables, lens = attention_inputs(model, kv, b, ctx)
        full = torch.zeros(b, width, dtype=torch.int32, device=dev)  # [b, MAXB]: the graphs' full-width tables
        full[:, : tables.shape[1]] = tables
        results = {}
        for split in ATTENTION_SPLITS:
            if math.ceil(max_tokens / split) > MAX_SPLITS:
                continue
            for bn, warps, stages in ATTENTION_CONFIGS:
                cfg = DecodeConfig(split, bn, warps, stages)
                try:
                    t = time_graph(lambda cfg=cfg, q=q, full=full, lens=lens: [
                        decode_attention_triton(q, *kv.layer(i), full, lens, 0.088, ws, config=cfg,
                                                scales=kv.scales(i))
                        for i in range(model.cfg.num_layers)])
                except Exception as e:  # noqa: BLE001 - a config that does not compile is just not chosen
                    table.setdefault("errors", []).append(f"{cfg}: {e!r}"[:200])
                    continue
                results[cfg] = t
        if not results:
            continue  # nothing ran: the heuristic stays
        best = min(results, key=results.get)
        ws.configs[b] = best
        table[str(b)] = {"config": [best.split, best.block_n, best.num_warps, best.num_stages],
                         "ms_all_layers": results[best],
                         "heuristic_ms": results.get(DecodeConfig(heuristic_split(b, model, max_tokens)))}
        _say(report, f"  attention b={b:3d}: split {best.split} block {best.block_n} warps {best.num_warps} "
             f"stages {best.num_stages}: {results[best]:.3f} ms / step (ctx {ctx})")
    return table


def linear_batches_for(max_batch: int) -> tuple[int, ...]:
    """The timed batch sizes whose chooser bucket a decode graph of at most ``max_batch`` rows can use."""
    from .linear import m_bucket

    top = m_bucket(max_batch) or max(LINEAR_BATCHES)
    return tuple(m for m in LINEAR_BATCHES if m_bucket(m) <= top)


def can_tune(model) -> bool:
    """Tuning needs a CUDA device and the Triton kernels (the CPU path has nothing to choose)."""
    return model.device.type == "cuda" and kernels.HAVE_TRITON


def tune(model, kv, graphs, ctx: int = DEFAULT_CONTEXT, report: Callable[[str], None] | None = None) -> dict | None:
    """Tune projections and decode attention for ``graphs`` (call before ``graphs.capture()``).

    Returns ``{"linear": table, "attention": table, "seconds": s}``, or ``None`` where :func:`can_tune` is
    false (nothing changed)."""
    if not can_tune(model):
        return None
    t0 = time.perf_counter()
    out = {"linear": tune_linears(model, linear_batches_for(graphs.max_batch), report)}
    if model.backend == "triton":
        out["attention"] = tune_attention(model, kv, graphs, ctx, report)
    torch.cuda.synchronize(model.device)
    out["seconds"] = time.perf_counter() - t0
    return out
