"""Cloud engine on a GPU: the GLM fast path's decode throughput, its HBM roofline, batching gain, the
plain-transformers baseline and tensor parallel, measured side by side in one run.

Workload (the issue "Cloud engine on real GPUs"): the GLM-4.1V-9B text decoder split at N = 12, so the
cloud runs 28 layers + final norm + lm_head in bf16 with random weights (speed does not depend on values).
S simulated sessions each bring a 512-token prompt (boundary hidden states, prefilled in chunks before the
timed phase) and then 128 decode steps, each fed one hidden state per session, as a phone would: the step's
[S, H] input is copied from pinned host memory, the step is one CUDA-graph replay, and the sampled ids are
copied back (the only host sync per step). All sessions decode in lockstep: this is the engine's
steady-state decode batch; arrivals and departures are the scheduler's business, not this measurement's.

Measured, in one process:
* ``bandwidth``: device-to-device copy of a large buffer (bytes read + written / time);
* ``fast``: per S, decode tokens/s and per-step latency, prefill tokens/s;
* ``sequential``: the same decode served one session at a time (the articles' "before batching");
* ``transformers``: plain transformers (``Glm4ForCausalLM`` with the same 28-layer shapes), eager forward
  with its own ``DynamicCache`` (per-step latency) and ``generate``;
* ``roofline``: bytes a decode step must move (weights once + every session's KV) / measured bandwidth,
  and the fraction of it reached;
* ``checks``: the Triton kernels and the fast model against the torch formulas and the library's layers on
  this GPU (bf16 relative errors), CUDA-graph replay against the eager step;
* ``memory``: weights, the KV pool for 128 sessions x 4,096 tokens, peak allocation, and what fits on
  two 24 GiB RTX 4090s at TP = 2;
* ``linear_tuning`` / ``attention_tuning``: before the graphs are captured, cuBLAS vs the Triton GEMV/GEMM
  per projection shape and batch bucket, and the decode kernel's split/tile per bucket, timed and the
  fastest kept by ``cloud_server.fast.tuning`` (the code ``FastGlmRunner`` runs at construction on CUDA;
  ``--no-tune-linear`` keeps cuBLAS and the heuristic);
* ``breakdown``: each op class over all layers in its own CUDA graph: where a step's time goes.

``--tp`` (under ``torchrun --nproc-per-node 2``): TP = 1 on rank 0, then TP = 2 on both ranks: step latency
at S = 1 and throughput at S = 64, with NCCL and with the symmetric-memory one-shot all-reduce (the latter
only here: the served runner all-reduces through NCCL). The model is sharded by the served code
(``cloud_server.tp.shard_model``, then fused into a FastGLM); the sessions are driven directly.

``--through-engine --tp`` (under ``torchrun --nproc-per-node 2``): the *served* tensor-parallel path, as
``autoglm-cloud serve --tp 1`` and ``--tp 2`` build it (``LLMEngine`` + ``FastGlmRunner`` over the
``cloud_server.tp`` shard; rank 0 schedules, samples and broadcasts each batch, rank 1 runs them), TP = 1 and
TP = 2 in one run: ``tp2_served_step_speedup_s1``, ``tp2_served_tokens_per_s_s64`` (``engine_tp`` key).

``--through-engine``: the direct decode above for each S, then the serving stack as ``cloud_server.runtime``
builds it (``LLMEngine.from_models`` + ``fast_runner_factory``; a random-weight back half made on the GPU by
``cloud_server.model.random_split_model``) fed S sessions through the engine's public API: ``add_request``
with the prompt's hidden states, then per decode step one ``add_input`` per session and one ``step()``.
Per S, with overlap scheduling (``engine.sessions``) and without it (``engine.sessions_sync``), side by side:
tokens/s, step latency split into add_input / the step() calls / the host time inside the runner's ``run``,
the runner's graph replay alone, and the roofline fraction, beside the direct figures; written under the
``engine`` key of the ``--merge`` JSON (other keys kept). With ``--sampling``: max(S) sessions sampled
(temperature 0.7, top-p 0.9) vs greedy (``engine.summary_sampling``); with ``--prefill-stall``: a
``--stall-prompt``-position prompt arriving while max(S) - 1 sessions decode, per prefill chunk cap
(``engine.summary_prefill_stall``). The workloads are ``bench/engine_workloads.py``.

Runs on CPU too with a tiny preset (``--preset tiny-glm4v``): the same code without graphs or Triton.
Reproducing commands: docs/performance.md, "Cloud engine on GPU".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cloud_server.config import KV_CACHE_DTYPES
from cloud_server.fast import kernels
from cloud_server.fast.attention import decode_attention_torch, decode_attention_triton
from cloud_server.fast.config import FastGLMConfig
from cloud_server.fast.glm import FastGLM, PrefillMeta
from cloud_server.fast.graphs import DecodeGraphs
from cloud_server.fast.kv import NULL_BLOCK, KVPool
from cloud_server.fast.tuning import attention_inputs, rel, time_graph, tune_attention, tune_linears
from partition_tools.adapters import cache_kwarg_of

GIB = 1 << 30


@dataclass(slots=True)
class BenchConfig:
    preset: str = "glm4v-9b-random"  # or tiny-glm4 / tiny-glm4v for a CPU smoke run
    split: int = 12  # N: layers [0, N) are the phone's; the cloud runs [N, L)
    sessions: tuple[int, ...] = (1, 8, 32, 64, 128)
    prompt: int = 512
    gen: int = 128
    max_context: int = 4096  # tokens of KV each of pool_sessions sessions can hold
    pool_sessions: int = 128
    block_size: int = 16
    prefill_chunk_tokens: int = 8192  # tokens per prefill forward (whole prompts)
    sequential_sessions: int = 2  # sessions served one at a time for the "before batching" baseline
    hf_sessions: tuple[int, ...] = (1, 64)  # plain-transformers batch sizes
    hf_steps: int = 12  # timed eager decode steps per batch size
    hf_generate_tokens: int = 24  # new tokens per generate() call
    tp_sessions: tuple[int, ...] = (1, 64)
    tp: bool = False
    allreduce: tuple[str, ...] = ("nccl", "symm_mem")
    seed: int = 0
    skip_hf: bool = False
    skip_checks: bool = False
    tune_linear: bool = True  # time cuBLAS vs the Triton skinny GEMM per shape and use the faster
    out: Path | None = None
    merge: Path | None = None  # an earlier result JSON to extend (the TP run adds to the single-GPU one)
    through_engine: bool = False  # drive LLMEngine with S sessions (and the direct path): the "engine" key
    sampling: bool = False  # with through_engine: S = max(sessions) sampled (T 0.7, top-p 0.9) vs greedy
    sampling_rounds: int = 4  # greedy / sampled runs, alternated
    prefill_stall: bool = False  # with through_engine: a long prompt arriving while max(sessions) - 1 decode
    stall_prompt: int = 4096  # positions of the arriving prompt
    stall_chunks: tuple[int, ...] = (0, 2048, 512, 256)  # prefill_chunk_while_decoding values (0 = no cap)
    stall_steps: int = 64  # decode steps per phase (steady, then with the arrival at step 8)
    kv_cache_dtype: str = "auto"  # with through_engine: the engine's KV pool (auto = the compute dtype, int8, fp8, int8v)
    generic_runner: bool = False  # with through_engine: the engine on the library's layers, not the fast path
    idle_gap_ms: float = 0.0  # > 0: also the direct step's device time with the GPU idle this long between steps

    def __post_init__(self):
        for name in ("split", "prompt", "gen", "max_context", "pool_sessions", "block_size",
                     "prefill_chunk_tokens", "hf_steps", "hf_generate_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if any(s <= 0 for s in self.sessions) or max(self.sessions) > self.pool_sessions:
            raise ValueError(f"sessions must be in [1, pool_sessions={self.pool_sessions}]")
        if self.prompt + self.gen > self.max_context:
            raise ValueError("prompt + gen exceeds max_context")
        if self.prompt > self.prefill_chunk_tokens:
            raise ValueError("prefill_chunk_tokens must hold at least one prompt")
        if self.prefill_stall and (self.stall_prompt + 1 > self.max_context or self.stall_steps <= 8
                                   or max(self.sessions) < 2 or min(self.stall_chunks) < 0):
            raise ValueError("--prefill-stall needs stall_prompt < max_context, stall_steps > 8, S >= 2 and "
                             "chunk caps >= 0")


# ------------------------------------------------------------------------------------------------
# plumbing


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def attempt(errors: dict, key: str, fn):
    """``fn()``, or None with its traceback recorded under ``errors[key]``: one run must yield all it can."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded and logged
        errors[key] = traceback.format_exc()
        log(f"{key} FAILED: {e}")
        return None


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def model_config(preset: str, split: int) -> tuple[FastGLMConfig, object]:
    from partition_tools import models

    full = {"glm4v-9b-random": models.glm4v_9b_text_config, "tiny-glm4": models.tiny_glm4_config,
            "tiny-glm4v": models.tiny_glm4v_config}.get(preset)
    if full is None:
        raise ValueError(f"--preset must be glm4v-9b-random, tiny-glm4 or tiny-glm4v, got {preset!r}")
    hf = full()
    total = hf.get_text_config().num_hidden_layers
    if not 0 < split < total:
        raise ValueError(f"--split must be in [1, {total - 1}]")
    return FastGLMConfig.from_hf(hf, num_layers=total - split, max_position=8192), hf


def env_info(dev: torch.device) -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "device": str(dev), "triton": None}
    if kernels.HAVE_TRITON:
        import triton

        info["triton"] = triton.__version__
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(gpu=p.name, sm_count=p.multi_processor_count, gpu_mem_gib=round(p.total_memory / GIB, 1),
                    cuda=torch.version.cuda)
    else:
        info["gpu"] = None
    return info


def measure_bandwidth(dev: torch.device, nbytes: int, reps: int = 20) -> dict:
    """Device-to-device copy: (bytes read + bytes written) / median time."""
    n = nbytes // 2
    src = torch.randn(n, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 3):
        sync(dev)
        t0 = time.perf_counter()
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            dt = a.elapsed_time(b) / 1e3
        else:
            dst.copy_(src)
            dt = time.perf_counter() - t0
        if i >= 3:
            times.append(dt)
    med = statistics.median(times)
    del src, dst
    return {"bytes_per_copy": 2 * n * 2, "median_s": med, "gb_per_s": 2 * n * 2 / med / 1e9}


# ------------------------------------------------------------------------------------------------
# sessions: the minimal serving loop (stand-ins for the engine's block manager, and the all-reduce variant
# the served runner does not use)


class OutOfBlocks(Exception):
    """The pool has no free block left for a session."""


class BlockAllocator:
    """Free list of the pool's blocks (the null block excluded): the direct path's stand-in for the engine's
    block manager (sessions reserve prompt + generation up front and release at the end)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError("a pool needs at least 2 blocks (block 0 is reserved)")
        self.block_size = block_size
        self._free = [b for b in range(num_blocks - 1, -1, -1) if b != NULL_BLOCK]

    def allocate(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.block_size)
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks for {num_tokens} tokens, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class SymmMemAllReduce:
    """One-shot all-reduce through PyTorch symmetric memory for small (decode) inputs, NCCL above ``max_rows``.

    At decode sizes (a few KB per rank) an NCCL all-reduce costs ~9 us inside a CUDA graph, two calls a layer;
    the one-shot kernel copies the local input into a symmetric staging buffer, meets its peers at a barrier
    and reads their buffers over NVLink directly (no multicast needed, so it runs with
    ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``), all in one kernel. Swapped in for ``FastGLM.all_reduce``.
    """

    name = "symm_mem"

    def __init__(self, group, max_rows: int, hidden: int, dtype: torch.dtype, device):
        import torch.distributed as dist
        from torch.distributed import _symmetric_memory as symm_mem

        self.group = group or dist.group.WORLD
        self.group_name = self.group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # required by older releases, deprecated (a no-op) in newer ones
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group_name)
        self.max_rows = max_rows
        self.buf = symm_mem.empty(max_rows, hidden, dtype=dtype, device=device)  # [R, H]
        symm_mem.rendezvous(self.buf, self.group)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = x.shape[0]
        if t > self.max_rows:
            dist.all_reduce(x, group=self.group)
            return x
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(self.buf[:t], x, "sum", self.group_name, out)
        return out


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's weights."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def rope_tables(cfg: FastGLMConfig, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 cos/sin tables [max_position, rotary_dim / 2] FastGLM builds (the library's formula)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float) / cfg.rotary_dim))
    freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


class Sessions:
    """S sessions' KV blocks (reserved for prompt + gen at admission) and device-side decode state."""

    def __init__(self, n: int, tokens: int, alloc: BlockAllocator, max_blocks: int, dev: torch.device):
        self.n, self.alloc = n, alloc
        self.blocks = [alloc.allocate(tokens) for _ in range(n)]
        tab = torch.zeros(n, max_blocks, dtype=torch.int32)
        for i, b in enumerate(self.blocks):
            tab[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
        self.tables = tab.to(dev)  # [S, MAXB]
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)  # next position to decode
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)  # context incl. that token

    def release(self) -> None:
        for b in self.blocks:
            self.alloc.free(b)
        self.blocks = []


def prefill(model: FastGLM, kv: KVPool, sess: Sessions, prompt: int, chunk_tokens: int, gen: torch.Generator,
            dev: torch.device) -> float:
    """Prefill every session's prompt (random boundary states), whole prompts per chunk; returns seconds."""
    per_chunk = max(1, chunk_tokens // prompt)
    bs = kv.block_size
    sync(dev)
    t0 = time.perf_counter()
    for start in range(0, sess.n, per_chunk):
        idx = list(range(start, min(sess.n, start + per_chunk)))
        k = len(idx)
        hidden = torch.randn(k * prompt, model.cfg.hidden_size, generator=gen, device=dev, dtype=model.dtype)
        pos = torch.arange(prompt, device=dev).repeat(k)  # [k * prompt]
        tables = sess.tables[idx]  # [k, MAXB]
        rows = torch.arange(k, device=dev).repeat_interleave(prompt)
        slots = tables[rows, pos // bs].long() * bs + pos % bs
        model.prefill(hidden, pos, slots, kv, PrefillMeta([prompt] * k, [prompt] * k, tables))
    sync(dev)
    sess.positions.fill_(prompt)
    sess.seq_lens.fill_(prompt + 1)
    return time.perf_counter() - t0


def decode(graphs: DecodeGraphs, sess: Sessions, steps: int, inputs: list[torch.Tensor],
           full_metadata: bool = False, gap_s: float | None = None) -> dict:
    """``steps`` decode steps of all sessions; per-step wall time includes input copy, replay and id readback.

    The first step uploads the batch's metadata; later ones only the hidden states (``step_next``), unless
    ``full_metadata`` (positions, lengths and block tables uploaded every step, as the engine adapter does).
    ``gap_s`` (CUDA): each step's device time from CUDA events too (``device_ms_median``), and the host sleeps
    ``gap_s`` after each step (0: back to back)."""
    dev = graphs.model.device
    ids_host = torch.empty(sess.n, dtype=torch.long, pin_memory=dev.type == "cuda")
    done = torch.cuda.Event() if dev.type == "cuda" else None
    timed = gap_s is not None and done is not None
    begin = torch.cuda.Event(enable_timing=True) if timed else None
    end = torch.cuda.Event(enable_timing=True) if timed else None
    times, device = [], []
    sync(dev)
    t_start = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        hid = inputs[step % len(inputs)][: sess.n]  # [S, H] pinned host: the phones' boundary states
        if timed:
            begin.record()
        if step == 0 or full_metadata:
            _, ids = graphs.step(hid, sess.positions, sess.seq_lens, sess.tables)
        else:
            _, ids = graphs.step_next(hid)
        ids_host.copy_(ids, non_blocking=True)
        if full_metadata:
            sess.positions += 1
            sess.seq_lens += 1
        if done is not None:
            ev = end if timed else done
            ev.record()
            ev.synchronize()  # the sampled ids go back to the phones
        times.append(time.perf_counter() - t0)
        if timed:
            device.append(begin.elapsed_time(end))
            if gap_s:
                time.sleep(gap_s)
    total = time.perf_counter() - t_start
    if not full_metadata:
        sess.positions += steps
        sess.seq_lens += steps
    return {"steps": steps, "total_s": total, "step_ms_mean": 1e3 * total / steps,
            "step_ms_median": 1e3 * statistics.median(times), "step_ms_p90": 1e3 * sorted(times)[int(0.9 * steps)],
            "tokens_per_s": sess.n * steps / total,
            **({"device_ms_median": statistics.median(device)} if device else {})}


def host_inputs(n: int, hidden: int, dtype, dev: torch.device, count: int = 4) -> list[torch.Tensor]:
    pin = dev.type == "cuda"
    return [torch.randn(n, hidden).to(dtype).pin_memory() if pin else torch.randn(n, hidden).to(dtype)
            for _ in range(count)]


# ------------------------------------------------------------------------------------------------
# roofline and memory


def roofline(cfg: FastGLMConfig, s: int, prompt: int, gen: int, step_ms: float, bw_gbs: float,
             tp: int = 1) -> dict:
    avg_ctx = prompt + (gen + 1) / 2  # context grows from prompt + 1 to prompt + gen over the decode
    w = cfg.weight_bytes() / tp
    kv = s * avg_ctx * cfg.kv_bytes_per_token() / tp
    t_w = w / (bw_gbs * 1e9) * 1e3
    t_all = (w + kv) / (bw_gbs * 1e9) * 1e3
    return {"weight_bytes": w, "kv_read_bytes": kv, "roofline_ms_weights": t_w, "roofline_ms": t_all,
            "fraction": t_all / step_ms, "fraction_weights_only": t_w / step_ms}


def memory_plan(cfg: FastGLMConfig, overhead_bytes: float, gpu_gib: float = 24.0, tp: int = 2,
                context: int = 4096) -> dict:
    """What fits per GPU on ``tp`` GPUs of ``gpu_gib`` GiB: weights / tp + overhead + KV / tp."""
    w = cfg.weight_bytes() / tp
    per_tok = cfg.kv_bytes_per_token() / tp
    free = gpu_gib * GIB - w - overhead_bytes
    tokens = max(0, int(free // per_tok))
    return {"gpu_gib": gpu_gib, "tp": tp, "weights_gib_per_gpu": w / GIB, "overhead_gib_per_gpu": overhead_bytes / GIB,
            "kv_bytes_per_token_per_gpu": per_tok, "kv_tokens_fit": tokens,
            "sessions_fit_at_4096": tokens // context, "sessions_fit_at_640": tokens // 640,
            "kv_gib_for_128x4096_per_gpu": 128 * context * per_tok / GIB}


# ------------------------------------------------------------------------------------------------
# checks: kernels and model on this device


def check_kernels(cfg: FastGLMConfig, dev: torch.device, dtype) -> dict:
    if not kernels.HAVE_TRITON or dev.type != "cuda":
        return {"skipped": "no triton on this device"}
    g = torch.Generator(device=dev).manual_seed(1)
    h, out = cfg.hidden_size, {}
    x, r = (torch.randn(37, h, device=dev, generator=g, dtype=dtype) for _ in range(2))
    w1, w2 = (torch.rand(h, device=dev, generator=g).to(dtype) + 0.5 for _ in range(2))
    out["rmsnorm"] = rel(kernels.rmsnorm(x, w1, 1e-5, "triton"), kernels.rmsnorm_torch(x, w1, 1e-5))
    ht, ot = kernels.add_norm_norm(x, r.clone(), w1, w2, 1e-5, "triton")
    hr, orf = kernels.add_norm_norm_torch(x, r, w1, w2, 1e-5)
    out["add_norm_norm"] = max(rel(ht, hr), rel(ot, orf))
    gu = torch.randn(37, 2 * cfg.intermediate_size, device=dev, generator=g, dtype=dtype)
    out["silu_mul"] = rel(kernels.silu_mul(gu, "triton"), kernels.silu_mul_torch(gu))
    nq, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = torch.randn(37, (nq + 2 * nkv) * d, device=dev, generator=g, dtype=dtype)
    cos, sin = (t.to(dev) for t in rope_tables(cfg, 8192))
    pos = torch.randint(0, 4000, (37,), device=dev, generator=g)
    slots = torch.randperm(64 * 16, device=dev, generator=g)[:37]
    caches = [torch.zeros(64, 16, nkv, d, device=dev, dtype=dtype) for _ in range(4)]
    a, b = qkv.clone(), qkv.clone()
    kernels.rope_store(a, pos, cos, sin, caches[0], caches[1], slots, nq, nkv, d, cfg.rotary_dim, "triton")
    kernels.rope_store_torch(b, pos, cos, sin, caches[2], caches[3], slots, nq, nkv, d, cfg.rotary_dim)
    out["rope_store"] = max(rel(a, b), rel(caches[0], caches[2]), rel(caches[1], caches[3]))
    kc, vc = (torch.randn(300, 16, nkv, d, device=dev, generator=g, dtype=dtype) for _ in range(2))
    q = torch.randn(5, nq, d, device=dev, generator=g, dtype=dtype)
    bt = torch.randperm(299, device=dev, generator=g)[:5 * 40].view(5, 40).int() + 1
    lens = torch.tensor([1, 17, 333, 640, 640], dtype=torch.int32, device=dev)
    ref = decode_attention_torch(q.float(), kc.float(), vc.float(), bt, lens, d ** -0.5)
    out["decode_attention"] = max(rel(decode_attention_triton(q, kc, vc, bt, lens, d ** -0.5, split=s), ref)
                                  for s in (64, 256, 640))
    return out


def check_model(hf_full, cfg: FastGLMConfig, dev: torch.device, dtype) -> dict:
    """Two library layers (a random ``CloudModel``, the text decoder's own classes) vs FastGLM built from them,
    prefill and decode; the reference is ``CloudModel.forward``."""
    from partition_tools.cloud_half import CloudModel

    total = hf_full.get_text_config().num_hidden_layers
    ref_model = CloudModel.random(hf_full, total - 2, dtype, dev, seed=2)  # the last two layers
    torch.manual_seed(2)
    with torch.no_grad():
        for layer in ref_model.layers:  # the library initialises norms to ones and biases to zero: perturb
            for p in layer.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.05)
    fast = FastGLM.from_modules(ref_model.layers, ref_model.norm, ref_model.lm_head, ref_model.config)
    s = 45
    hidden = torch.randn(s, cfg.hidden_size, device=dev, dtype=dtype)
    pos = torch.arange(s, device=dev)[None]
    ref = ref_model(hidden[None], pos)[0].float()  # [S, V]
    kv = KVPool.zeros(2, 8, 16, cfg.num_kv_heads, cfg.head_dim, dtype, dev)
    blocks = [5, 2, 7, 1]
    bt = torch.tensor([blocks + [0] * 4], dtype=torch.int32, device=dev)
    slots = torch.tensor([blocks[t // 16] * 16 + t % 16 for t in range(s)], device=dev)
    p = s - 4
    out = {}
    logits = fast.prefill(hidden[:p], pos[0, :p], slots[:p], kv, PrefillMeta([p], [p], bt))
    out["prefill_logits_rel"] = rel(logits[0].float(), ref[p - 1])
    graphs = DecodeGraphs(fast, kv, max_batch=2, max_blocks_per_seq=8)
    graphs.capture()
    errs = []
    for t in range(p, s):
        lg, _ = graphs.step(hidden[t:t + 1], torch.tensor([t], device=dev), torch.tensor([t + 1], dtype=torch.int32,
                                                                                      device=dev), bt)
        errs.append(rel(lg[0].float(), ref[t]))
    out["decode_logits_rel_max"] = max(errs)
    if graphs.use_graphs:
        one = (hidden[s - 1:s], torch.tensor([s - 1], device=dev), torch.tensor([s], dtype=torch.int32, device=dev))
        # graph replay == eager step on the same state (the last step again: same inputs, same slot)
        graphs.use_graphs = False
        lg_e = graphs.step(*one, bt)[0].float()
        graphs.use_graphs = True
        lg_g = graphs.step(*one, bt)[0].float()
        out["graph_vs_eager_rel"] = rel(lg_g, lg_e)
        # bucket 2 replayed for batch 1: its padding row must not touch the live sequence's blocks
        before = kv.k[:, blocks].clone()
        graphs.step(*one, bt)
        out["padding_touched_live_kv"] = bool((kv.k[:, blocks] != before).any())
    del ref_model, fast, graphs, kv
    return out


# ------------------------------------------------------------------------------------------------
# where a decode step's time goes: each op over all layers, in a CUDA graph (no launch gaps between calls)


def breakdown(model: FastGLM, kv: KVPool, graphs: DecodeGraphs, m: int, ctx: int, dev, dtype, bw_gbs: float) -> dict:
    """ms per decode step spent in each op class (all layers), at batch ``m`` with ``ctx`` tokens of context."""
    from cloud_server.fast.attention import decode_attention

    cfg, be, eps = model.cfg, model.backend, model.cfg.rms_norm_eps
    nq, nkv, d = model.local_heads, model.local_kv_heads, cfg.head_dim
    h, layers = cfg.hidden_size, model.layers
    x = torch.randn(m, h, device=dev, dtype=dtype)
    res = torch.randn(m, h, device=dev, dtype=dtype)
    qkv = torch.randn(m, (nq + 2 * nkv) * d, device=dev, dtype=dtype)
    attn_in = torch.randn(m, nq * d, device=dev, dtype=dtype)
    gu = torch.randn(m, 2 * layers[0].down_weight.shape[1], device=dev, dtype=dtype)
    act = torch.randn(m, layers[0].down_weight.shape[1], device=dev, dtype=dtype)
    bs = kv.block_size
    q, tables, lens = attention_inputs(model, kv, m, ctx)
    full = torch.zeros(m, graphs.block_tables.shape[1], dtype=torch.int32, device=dev)
    full[:, : tables.shape[1]] = tables
    pos = torch.full((m,), ctx - 1, dtype=torch.long, device=dev)
    slots = tables[:, -1].long() * bs + (ctx - 1) % bs
    ws = graphs.workspace
    ops = {
        "qkv": lambda: [model.linear(x, l_.qkv_weight, l_.qkv_bias) for l_ in layers],
        "rope_store": lambda: [kernels.rope_store(qkv, pos, model.rope_cos, model.rope_sin, *kv.layer(i), slots, nq, nkv,
                                                  d, cfg.rotary_dim, be) for i in range(len(layers))],
        "attention": lambda: [decode_attention(q, *kv.layer(i), full, lens, d ** -0.5, be, ws)
                              for i in range(len(layers))],
        "o": lambda: [model.linear(attn_in, l_.o_weight) for l_ in layers],
        "norms": lambda: [kernels.add_norm_norm(x, res, l_.post_self_attn_ln, l_.post_attention_ln, eps, be)
                          for l_ in layers for _ in range(2)],
        "gate_up": lambda: [model.linear(x, l_.gate_up_weight) for l_ in layers],
        "silu_mul": lambda: [kernels.silu_mul(gu, be) for _ in layers],
        "down": lambda: [model.linear(act, l_.down_weight) for l_ in layers],
        "lm_head": lambda: model.linear(x, model.lm_head_weight),
    }
    out = {}
    for name, fn in ops.items():
        out[name] = {"ms": time_graph(fn)}
    gemm_bytes = {"qkv": sum(l_.qkv_weight.numel() for l_ in layers), "o": sum(l_.o_weight.numel() for l_ in layers),
                  "gate_up": sum(l_.gate_up_weight.numel() for l_ in layers),
                  "down": sum(l_.down_weight.numel() for l_ in layers), "lm_head": model.lm_head_weight.numel()}
    for name, n in gemm_bytes.items():
        out[name]["gb_per_s"] = n * 2 / out[name]["ms"] / 1e6
        out[name]["fraction_of_copy_bw"] = out[name]["gb_per_s"] / bw_gbs
    kv_bytes = len(layers) * m * ctx * 2 * nkv * d * 2
    out["attention"]["gb_per_s"] = kv_bytes / out["attention"]["ms"] / 1e6
    out["sum_ms"] = sum(v["ms"] for v in out.values() if isinstance(v, dict))
    log(f"  breakdown m={m} ctx={ctx}: " + ", ".join(f"{k} {v['ms']:.3f}" for k, v in out.items() if isinstance(v, dict))
        + f"; sum {out['sum_ms']:.3f} ms")
    return out


# ------------------------------------------------------------------------------------------------
# the fast path: decode sweep


def build_fast(cfg: FastGLMConfig, hf_full, bc: BenchConfig, dev, dtype, tp_rank: int = 0, tp_size: int = 1,
                allreduce: str = "nccl", tune: dict | None = None):
    """The served model's construction: a random-weight back half made on ``dev``
    (``cloud_server.model.random_split_model``), sharded by ``cloud_server.tp.shard_model`` under TP and fused
    into a FastGLM as ``FastGlmRunner`` does; a KV pool for pool_sessions x max_context; captured graphs.

    ``tune`` (a dict): time cuBLAS vs the Triton skinny GEMM per shape first and record the table there."""
    from cloud_server import tp
    from cloud_server.model import random_split_model

    half = random_split_model(hf_full, bc.split, "bf16" if dtype == torch.bfloat16 else "fp32", str(dev),
                              seed=bc.seed)
    if tp_size > 1:
        tp.shard_model(half, tp_rank, tp_size)
    model = FastGLM.from_modules(half.layers, half.norm, half.lm_head, half.config, tp=getattr(half, "tp", None))
    del half  # FastGLM holds every weight it needs (the fused q/k/v is its own copy)
    if tp_size > 1 and allreduce == "symm_mem":
        model.all_reduce = SymmMemAllReduce(None, max(bc.sessions + bc.tp_sessions), cfg.hidden_size, dtype, dev)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    max_blocks = -(-bc.max_context // bc.block_size)
    num_blocks = -(-(bc.pool_sessions * bc.max_context) // bc.block_size) + 1  # + the null block
    kv = KVPool.zeros(cfg.num_layers, num_blocks, bc.block_size, model.local_kv_heads, cfg.head_dim, dtype, dev)
    alloc = BlockAllocator(num_blocks, bc.block_size)
    graphs = DecodeGraphs(model, kv, max_batch=max(bc.sessions + bc.tp_sessions), max_blocks_per_seq=max_blocks)
    if tune is not None and "chosen" in tune:  # same shapes as an earlier build of this process: reuse
        model.linear.choice.update(tune["chosen"][0])
        graphs.workspace.configs.update(tune["chosen"][1])
    elif tune is not None and dev.type == "cuda":
        tune["linear"] = tune_linears(model, report=log)  # cloud_server.fast.tuning, as FastGlmRunner does
        if model.backend == "triton":
            tune["attention"] = tune_attention(model, kv, graphs, bc.prompt + bc.gen // 2, report=log)
        tune["chosen"] = (dict(model.linear.choice), dict(graphs.workspace.configs))
    t0 = time.perf_counter()
    graphs.capture()
    return model, kv, alloc, graphs, time.perf_counter() - t0


EXTRA_STEPS = 160  # KV room per session beyond prompt + gen for the side measurements


def gpu_step_ms(graphs: DecodeGraphs, n: int, reps: int = 20, sampled: bool = False) -> float:
    """GPU time of one step replayed back to back (no host sync between steps): the step without the host;
    ``sampled``: the bucket's sampled graph (the sampling columns its buffers hold)."""
    if not graphs.use_graphs:
        return float("nan")
    hid = graphs.hidden[:n].clone()
    step = graphs.step_next_sampled if sampled else graphs.step_next
    step(hid)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        step(hid)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def probe_logits(model: FastGLM, kv: KVPool, alloc: BlockAllocator, graphs: DecodeGraphs, dev, dtype,
                 tokens: int = 64) -> torch.Tensor:
    """Logits of one fixed 64-token prefill (same inputs on every rank): compares TP = 2 with TP = 1."""
    gen = torch.Generator().manual_seed(1234)
    hidden = torch.randn(tokens, model.cfg.hidden_size, generator=gen).to(device=dev, dtype=dtype)
    sess = Sessions(1, tokens, alloc, graphs.block_tables.shape[1], dev)
    pos = torch.arange(tokens, device=dev)
    bs = kv.block_size
    slots = sess.tables[0, pos // bs].long() * bs + pos % bs
    logits = model.prefill(hidden, pos, slots, kv, PrefillMeta([tokens], [tokens], sess.tables))
    sess.release()
    return logits.float().cpu()


def sweep(model, kv, alloc, graphs, bc: BenchConfig, sessions: tuple[int, ...], dev, dtype, bw: float,
          tp: int = 1, side: tuple[int, ...] = (1, 64)) -> dict:
    """Per S: prefill, ``gen`` lockstep decode steps; for S in ``side`` also metadata-every-step and GPU-only."""
    gen = torch.Generator(device=dev).manual_seed(bc.seed + 1)
    max_blocks = graphs.block_tables.shape[1]
    inputs = host_inputs(max(sessions), model.cfg.hidden_size, dtype, dev)
    warm = Sessions(1, bc.prompt + bc.gen + EXTRA_STEPS, alloc, max_blocks, dev)  # first-call costs out of the way
    prefill(model, kv, warm, bc.prompt, bc.prefill_chunk_tokens, gen, dev)
    decode(graphs, warm, 4, inputs)
    warm.release()
    out = {}
    for s in sessions:
        sess = Sessions(s, bc.prompt + bc.gen + EXTRA_STEPS, alloc, max_blocks, dev)
        t_pre = prefill(model, kv, sess, bc.prompt, bc.prefill_chunk_tokens, gen, dev)
        res = decode(graphs, sess, bc.gen, inputs)
        res["prefill_s"] = t_pre
        res["prefill_tokens_per_s"] = s * bc.prompt / t_pre
        res["roofline"] = roofline(model.cfg, s, bc.prompt, bc.gen, res["step_ms_mean"], bw, tp)
        if s in side:  # the engine adapter's way (metadata every step), and the GPU time alone
            full = decode(graphs, sess, 32, inputs, full_metadata=True)
            res["full_metadata_step_ms_mean"] = full["step_ms_mean"]
            res["gpu_step_ms"] = gpu_step_ms(graphs, s)
            if bc.idle_gap_ms > 0 and dev.type == "cuda":  # does an idle GPU between steps step slower?
                runs = [decode(graphs, sess, 24, inputs, gap_s=g) for g in (0.0, bc.idle_gap_ms / 1e3) * 2]
                res["idle_gap"] = {"gap_ms": bc.idle_gap_ms,
                                   "device_ms_back_to_back": [r["device_ms_median"] for r in runs[0::2]],
                                   "device_ms_after_gap": [r["device_ms_median"] for r in runs[1::2]]}
        sess.release()
        out[str(s)] = res
        log(f"  S={s:4d}: step {res['step_ms_mean']:.3f} ms (median {res['step_ms_median']:.3f}"
            + (f", metadata every step {res['full_metadata_step_ms_mean']:.3f}, GPU only {res['gpu_step_ms']:.3f}"
               if "gpu_step_ms" in res else "")
            + (f", device back to back {res['idle_gap']['device_ms_back_to_back']} vs after a "
               f"{bc.idle_gap_ms:g} ms idle gap {res['idle_gap']['device_ms_after_gap']}" if "idle_gap" in res else "")
            + f"), {res['tokens_per_s']:.0f} tok/s, roofline {res['roofline']['roofline_ms']:.3f} ms -> "
            f"{100 * res['roofline']['fraction']:.1f} %, prefill {res['prefill_tokens_per_s']:.0f} tok/s")
    return out


def sequential(model, kv, alloc, graphs, bc: BenchConfig, dev, dtype) -> dict:
    """Sessions served one at a time (batch 1 each): the 'before batching' baseline."""
    gen = torch.Generator(device=dev).manual_seed(bc.seed + 2)
    inputs = host_inputs(1, model.cfg.hidden_size, dtype, dev)
    total_t, tokens = 0.0, 0
    for _ in range(bc.sequential_sessions):
        sess = Sessions(1, bc.prompt + bc.gen, alloc, graphs.block_tables.shape[1], dev)
        prefill(model, kv, sess, bc.prompt, bc.prefill_chunk_tokens, gen, dev)
        r = decode(graphs, sess, bc.gen, inputs)
        total_t += r["total_s"]
        tokens += bc.gen
        sess.release()
    return {"sessions": bc.sequential_sessions, "tokens_per_s": tokens / total_t,
            "step_ms_mean": 1e3 * total_t / (bc.sequential_sessions * bc.gen)}


# ------------------------------------------------------------------------------------------------
# plain transformers


def hf_baseline(cfg: FastGLMConfig, bc: BenchConfig, dev, dtype) -> dict:

    from transformers import DynamicCache, GenerationConfig, Glm4Config, Glm4ForCausalLM

    hcfg = Glm4Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                      num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, attention_bias=True,
                      rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=8192, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                       "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim})
    t0 = time.perf_counter()
    with torch.device(dev):
        model = Glm4ForCausalLM._from_config(hcfg, dtype=dtype).eval()
    log(f"  transformers model built in {time.perf_counter() - t0:.1f} s "
        f"({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, attn={model.config._attn_implementation})")
    cache_kw = cache_kwarg_of(model.forward)
    out = {"model": "Glm4ForCausalLM", "layers": cfg.num_layers, "attn_implementation": model.config._attn_implementation,
           "eager": {}, "generate": {}}
    h = cfg.hidden_size
    with torch.no_grad():
        for s in bc.hf_sessions:
            cache = DynamicCache(config=hcfg)
            emb = torch.randn(s, bc.prompt, h, device=dev, dtype=dtype)
            o = model(inputs_embeds=emb, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
            o.logits[:, -1].argmax(-1).tolist()
            times = []
            for _ in range(bc.hf_steps + 2):
                x = torch.randn(s, 1, h, device=dev, dtype=dtype)
                sync(dev)
                t0 = time.perf_counter()
                o = model(inputs_embeds=x, use_cache=True, **{cache_kw: cache})
                o.logits[:, -1].argmax(-1).tolist()  # the sampled ids to the host, as a server must
                times.append(time.perf_counter() - t0)
            times = times[2:]
            step = statistics.median(times)
            out["eager"][str(s)] = {"step_ms_median": 1e3 * step, "tokens_per_s": s / step, "steps": len(times)}
            log(f"  transformers eager S={s}: step {1e3 * step:.1f} ms, {s / step:.0f} tok/s")
            del cache, o
            torch.cuda.empty_cache() if dev.type == "cuda" else None
        gcfg = GenerationConfig(max_new_tokens=bc.hf_generate_tokens, min_new_tokens=bc.hf_generate_tokens,
                                do_sample=False, pad_token_id=0, eos_token_id=2)
        for s in bc.hf_sessions:
            emb = torch.randn(s, bc.prompt, h, device=dev, dtype=dtype)
            mask = torch.ones(s, bc.prompt, dtype=torch.long, device=dev)
            sync(dev)
            t0 = time.perf_counter()
            res = model.generate(inputs_embeds=emb, attention_mask=mask, generation_config=gcfg)
            sync(dev)
            dt = time.perf_counter() - t0
            new = res.shape[1] if res.shape[1] <= bc.hf_generate_tokens else res.shape[1] - bc.prompt
            out["generate"][str(s)] = {"new_tokens": int(new), "seconds": dt, "tokens_per_s": s * new / dt,
                                       "note": "includes the 512-token prefill, as generate() does"}
            log(f"  transformers generate S={s}: {s * new / dt:.1f} tok/s ({new} new tokens in {dt:.2f} s)")
    del model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------------
# through the engine: S simulated sessions fed to LLMEngine as the split endpoint feeds it


def build_engine(bc: BenchConfig, hf_full, dev, variant: str, sessions: tuple[int, ...] | None = None,
                 tp_rank: int = 0, tp_size: int = 1, num_blocks: int | None = None, model=None):
    """An ``LLMEngine`` over a random-weight back half built on ``dev``, the way ``cloud_server.runtime`` builds
    one (``LLMEngine.from_models`` + ``fast_runner_factory``); the fast runner tunes itself at construction.
    On the CPU the fast path is switched on (``fast_path=True``; by default it runs on CUDA only) so the smoke
    run covers its code. Under TP (``tp_size`` 2, inside the group) the half is sharded by
    ``cloud_server.tp.shard_model`` and rank 0's runner broadcasts every batch, as ``serve --tp 2`` does; the
    other rank's engine is only the holder of its runner and pool (``cloud_server.tp.serve_batches`` drives it).
    ``num_blocks``: the pool's size (default: what the sessions need); ``model``: a back half already built."""
    from cloud_server import tp
    from cloud_server.config import EngineConfig
    from cloud_server.engine.llm_engine import LLMEngine
    from cloud_server.fast.runner import FastGlmRunner, fast_runner_factory
    from cloud_server.model import random_split_model

    smax = max(sessions or bc.sessions)
    per_seq = -(-(bc.prompt + max(bc.gen, 2 * bc.stall_steps + 16) + 1) // bc.block_size)
    num_blocks = num_blocks or (smax + 1) * per_seq + 2 + (-(-(bc.stall_prompt + 1) // bc.block_size)
                                                          if bc.prefill_stall else 0)
    ecfg = EngineConfig(device=str(dev), variants=(variant,), block_size=bc.block_size,
                        num_blocks=num_blocks, max_num_seqs=smax,
                        max_num_batched_tokens=max(bc.prefill_chunk_tokens, smax), max_model_len=bc.max_context,
                        tp=tp_size, enable_prefix_cache=False, kv_cache_dtype=bc.kv_cache_dtype,
                        fast_path=False if bc.generic_runner
                        else True if dev.type == "cpu" else None)
    t0 = time.perf_counter()
    if model is None:
        model = random_split_model(hf_full, bc.split, variant, str(dev), seed=bc.seed)
    if tp_size > 1:
        tp.shard_model(model, tp_rank, tp_size)
    sync(dev)
    t_model = time.perf_counter() - t0
    make_runner = fast_runner_factory(ecfg)
    if tp_size > 1 and tp_rank == 0:
        comm, inner = tp.comm_device(ecfg.device, 0), make_runner

        def make_runner(i, m, pool):
            return tp.BroadcastingRunner(inner(i, m, pool), i, comm)
    engine = LLMEngine.from_models(ecfg, {variant: model}, make_runner=make_runner)
    sync(dev)
    runner = engine.runners[variant]
    runner = getattr(runner, "runner", runner)  # rank 0 under TP: the runner inside the broadcasting one
    info = {"engine_config": {k: getattr(ecfg, k) for k in ("block_size", "num_blocks", "max_num_seqs",
                                                           "max_num_batched_tokens", "max_model_len",
                                                           "kv_cache_dtype")},
            "kv_pool_bytes": runner.pool.nbytes, "kv_pool_bytes_per_block": runner.pool.bytes_per_block,
            "model_build_s": t_model, "runner_build_s": time.perf_counter() - t0 - t_model,
            "runner": type(runner).__name__}
    if isinstance(runner, FastGlmRunner):
        info.update(graphs=runner.graphs.use_graphs, backend=runner.fast.backend, buckets=runner.graphs.buckets,
                    tuning_s=(runner.tuning or {}).get("seconds"),
                    linear_choices=len(runner.fast.linear.choice),
                    attention_configs={str(b): [c.split, c.block_n, c.num_warps, c.num_stages]
                                       for b, c in runner.graphs.workspace.configs.items()})
    return engine, runner, info


def run_engine(bc: BenchConfig) -> dict:
    """Direct fast path and the engine, same GPU, same process, same S: recorded under the ``engine`` key."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    variant = "bf16" if dev.type == "cuda" else "fp32"
    cfg, hf_full = model_config(bc.preset, bc.split)
    res = load_json(bc.merge)
    out: dict = {"config": {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                            for k, v in asdict(bc).items()}, "env": env_info(dev), "errors": {}}
    res["engine"] = out
    log(f"env: {out['env']}")
    bw = measure_bandwidth(dev, 4 * GIB if dev.type == "cuda" else 64 << 20)
    out["bandwidth"] = bw
    log(f"copy bandwidth: {bw['gb_per_s']:.0f} GB/s")
    # 1. the fast path driven directly (tuned by the same cloud_server.fast.tuning code)
    def direct() -> dict:
        t0 = time.perf_counter()
        tune: dict = {}
        model, kv, alloc, graphs, _ = build_fast(cfg, hf_full, bc, dev, dtype, tune=tune if bc.tune_linear else None)
        out["direct_build_s"] = time.perf_counter() - t0
        return sweep(model, kv, alloc, graphs, bc, bc.sessions, dev, dtype, bw["gb_per_s"], side=bc.sessions)

    out["direct"] = attempt(out["errors"], "direct", direct) or {}
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    save(bc, res)
    # 2. the engine: LLMEngine + FastGlmRunner (self-tuned), S sessions through the public API
    attempt(out["errors"], "engine", lambda: measure_engine(bc, res, cfg, hf_full, dev, variant))
    summarize_engine(out)
    save(bc, res)
    return res


def measure_engine(bc: BenchConfig, res: dict, cfg, hf_full, dev, variant: str) -> None:
    """The engine at each S (overlap scheduling on, then off, side by side), then the ``--sampling`` and
    ``--prefill-stall`` workloads on the same engine (``bench/engine_workloads.py``)."""
    from engine_workloads import lockstep, prefill_stall, sampled_vs_greedy

    out, bw = res["engine"], res["engine"]["bandwidth"]["gb_per_s"]
    engine, runner, info = build_engine(bc, hf_full, dev, variant)
    out["build"] = info
    log(f"engine ready: {info}")
    h = cfg.hidden_size
    gen = torch.Generator().manual_seed(bc.seed + 3)
    prompts = [torch.randn(bc.prompt, h, generator=gen) for _ in range(4)]  # [P, H] float32, as decoded
    steps_in = [torch.randn(1, h, generator=gen) for _ in range(16)]  # [1, H] float32 per decode step

    def sync():
        return torch.cuda.synchronize(dev) if dev.type == "cuda" else None

    lockstep(engine, 1, prompts, steps_in, 4, "warm", sync)  # first-call costs out of the way
    out["sessions"], out["sessions_sync"] = {}, {}
    for s in bc.sessions:
        engine.config.async_scheduling = False  # the synchronous engine, same S, same engine, just before
        out["sessions_sync"][str(s)] = r0 = lockstep(engine, s, prompts, steps_in, bc.gen, f"sync{s}", sync)
        engine.config.async_scheduling = True
        r = lockstep(engine, s, prompts, steps_in, bc.gen, f"s{s}", sync)
        r["roofline"] = roofline(cfg, s, bc.prompt, bc.gen, r["step_ms_mean"], bw)
        if dev.type == "cuda" and getattr(runner, "graphs", None) is not None and runner.graphs.use_graphs:
            r["graph_replay_ms"] = gpu_step_ms(runner.graphs, s)  # the runner's own graph, back to back
            r["overhead_ms_vs_replay"] = r["step_ms_mean"] - r["graph_replay_ms"]
        d = out["direct"].get(str(s))
        if d:
            r["direct_step_ms_mean"] = d["step_ms_mean"]
            r["overhead_ms_vs_direct"] = r["step_ms_mean"] - d["step_ms_mean"]
            r["throughput_vs_direct"] = r["tokens_per_s"] / d["tokens_per_s"]
            r0["throughput_vs_direct"] = r0["tokens_per_s"] / d["tokens_per_s"]
        out["sessions"][str(s)] = r
        log(f"  engine S={s:3d}: step {r['step_ms_mean']:.3f} ms (sync engine {r0['step_ms_mean']:.3f}; add_input "
            f"{r['add_input_ms_mean']:.3f}, engine.step {r['engine_step_ms_mean']:.3f}, runner host "
            f"{r['runner_host_ms_mean']:.3f}), {r['tokens_per_s']:.0f} tok/s, roofline "
            f"{100 * r['roofline']['fraction']:.1f} %" + (f", direct {d['step_ms_mean']:.3f} ms" if d else "")
            + (f", replay {r['graph_replay_ms']:.3f} ms" if "graph_replay_ms" in r else ""))
        save(bc, res)
    smax = max(bc.sessions)
    if bc.sampling:
        out["sampling"] = attempt(out["errors"], "sampling", lambda: sampled_vs_greedy(
            engine, smax, prompts, steps_in, bc.gen, sync, rounds=bc.sampling_rounds))
        if out["sampling"] and getattr(runner, "graphs", None) is not None and runner.graphs.sampling is not None:
            # the sampler's device cost alone: the sampled graph (the last sampled composition loaded) beside the
            # greedy one, each replayed back to back
            out["sampling"]["replay_ms"] = {"greedy": gpu_step_ms(runner.graphs, smax),
                                            "sampled": gpu_step_ms(runner.graphs, smax, sampled=True)}
            log(f"  replay alone S={smax}: {out['sampling']['replay_ms']}")
        if out["sampling"]:
            log(f"  sampled vs greedy S={smax}: {out['sampling']['sampled_over_greedy']:.3f} "
                f"({out['sampling']['sampled_tokens_per_s']:.0f} / {out['sampling']['greedy_tokens_per_s']:.0f} tok/s)")
        save(bc, res)
    if bc.prefill_stall:
        long_prompt = torch.randn(bc.stall_prompt, h, generator=gen)  # [P, H]
        from cloud_server.config import EngineConfig

        served = EngineConfig()  # what `autoglm-cloud serve` runs with unless told otherwise
        out["prefill_stall"] = attempt(out["errors"], "prefill_stall", lambda: prefill_stall(
            engine, smax - 1, prompts, steps_in, long_prompt, list(bc.stall_chunks), bc.stall_steps, 8, sync,
            served=(served.max_num_batched_tokens, served.prefill_chunk_while_decoding)))
        for b, r in ((out["prefill_stall"] or {}).get("chunks") or {}).items():
            log(f"  prefill stall, {b} (budget {r['budget']}, cap {r['cap']}): ITL p99 "
                f"{r['arrival']['itl_p99_ms']:.2f} ms vs steady {r['steady']['itl_p99_ms']:.2f} "
                f"({r['p99_over_steady_p99']:.2f}x), long prompt TTFT "
                f"{r['arrival']['long_ttft_ms']} ms in {r['arrival']['long_ttft_steps']} steps")
        save(bc, res)


def run_engine_tp(bc: BenchConfig) -> dict:
    """``--through-engine --tp`` under torchrun: the served tensor-parallel path measured beside TP = 1, one run.

    TP = 1: rank 0 alone runs the engine as ``serve --tp 1`` does. TP = 2: both ranks build the engine over their
    shard (``build_engine``); rank 0 feeds S sessions through it and its runner broadcasts every step, rank 1
    runs the broadcast batches as a ``serve --tp 2`` worker does (``cloud_server.tp.serve_batches``). Per S in
    ``--tp-sessions``: the ``engine_workloads.lockstep`` figures; recorded under ``engine_tp`` with
    ``tp2_served_step_speedup_s1`` and ``tp2_served_tokens_per_s_s64`` (and TP = 1's) at the top level."""
    import torch.distributed as dist
    from engine_workloads import lockstep

    from cloud_server import tp

    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    rank, world = tp.init_from_env(dev_type)
    dev = torch.device(tp.rank_device(dev_type, rank))
    variant = "bf16" if dev.type == "cuda" else "fp32"
    cfg, hf_full = model_config(bc.preset, bc.split)
    res = load_json(bc.merge) if (bc.merge and rank == 0) else {}
    out: dict = {"world_size": world, "env": env_info(dev), "tp1": {}, "tp2": {}, "errors": {}}
    h = cfg.hidden_size
    gen = torch.Generator().manual_seed(bc.seed + 3)
    prompts = [torch.randn(bc.prompt, h, generator=gen) for _ in range(4)]  # [P, H] float32, as decoded
    steps_in = [torch.randn(1, h, generator=gen) for _ in range(16)]  # [1, H] float32 per decode step

    tokens: dict[str, dict[int, list[list[int]]]] = {"tp1": {}, "tp2": {}}  # greedy ids per S, per session

    def measure(engine, key: str) -> None:
        lockstep(engine, 1, prompts, steps_in, 4, f"{key}-warm", lambda: sync(dev))
        for s in bc.tp_sessions:
            tokens[key][s] = []
            r = lockstep(engine, s, prompts, steps_in, bc.gen, f"{key}-s{s}", lambda: sync(dev), tokens=tokens[key][s])
            out[key][str(s)] = r
            log(f"[served {key}] S={s:3d}: step {r['step_ms_mean']:.3f} ms, {r['tokens_per_s']:.0f} tok/s "
                f"(runner host {r['runner_host_ms_mean']:.3f} ms)")

    if rank == 0:
        try:
            engine, _, out["tp1_build"] = build_engine(bc, hf_full, dev, variant, bc.tp_sessions)
            measure(engine, "tp1")
            del engine
        except Exception as e:  # noqa: BLE001 - record and go on: one run must yield all it can
            out["errors"]["tp1"] = traceback.format_exc()
            log(f"[served tp1] FAILED: {e}")
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    engine, _, info = build_engine(bc, hf_full, dev, variant, bc.tp_sessions, rank, world)
    comm = tp.comm_device(dev_type, rank)
    if rank == 0:
        out["tp2_build"] = info
        try:
            measure(engine, "tp2")
        except Exception as e:  # noqa: BLE001
            out["errors"]["tp2"] = traceback.format_exc()
            log(f"[served tp2] FAILED: {e}")
        tp.stop_workers(comm)
    else:
        tp.serve_batches([engine.runners[engine.default_variant]], comm)
    dist.barrier()
    if rank == 0:
        t1, t2 = out["tp1"], out["tp2"]
        if "1" in t1 and "1" in t2:
            res["tp2_served_step_speedup_s1"] = t1["1"]["step_ms_mean"] / t2["1"]["step_ms_mean"]
            res["tp1_served_step_ms_s1"], res["tp2_served_step_ms_s1"] = t1["1"]["step_ms_mean"], t2["1"]["step_ms_mean"]
        if "64" in t1 and "64" in t2:
            res["tp2_served_tokens_per_s_s64"] = t2["64"]["tokens_per_s"]
            res["tp1_served_tokens_per_s_s64"] = t1["64"]["tokens_per_s"]
        # the same inputs at every position (the sessions' states do not depend on the sampled ids): the
        # fraction of greedy ids TP = 2 samples as TP = 1 does (1.0 in fp32; bf16 rounding may flip near-ties)
        pairs = [(a, b) for s in tokens["tp2"] if s in tokens["tp1"]
                 for sa, sb in zip(tokens["tp1"][s], tokens["tp2"][s], strict=True) for a, b in zip(sa, sb, strict=True)]
        if pairs:
            res["tp2_served_greedy_agreement"] = out["greedy_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
        res["engine_tp"] = out
        save(bc, res)
        for k in ("tp2_served_step_speedup_s1", "tp1_served_step_ms_s1", "tp2_served_step_ms_s1",
                  "tp1_served_tokens_per_s_s64", "tp2_served_tokens_per_s_s64", "tp2_served_greedy_agreement"):
            if k in res:
                print(f"{k:40s} {res[k]:.3f}")
        if out["errors"]:
            print("errors in:", ", ".join(out["errors"]))
    return res


def summarize_engine(out: dict) -> None:
    """Headline figures of the engine section: per S, engine vs direct step, tokens/s and roofline fraction."""
    rows = {}
    for s, r in out.get("sessions", {}).items():
        d = out.get("direct", {}).get(s, {})
        rows[s] = {"engine_step_ms": r["step_ms_mean"], "engine_tokens_per_s": r["tokens_per_s"],
                   "engine_roofline_fraction": r["roofline"]["fraction"],
                   "direct_step_ms": d.get("step_ms_mean"), "direct_tokens_per_s": d.get("tokens_per_s"),
                   "direct_roofline_fraction": d.get("roofline", {}).get("fraction"),
                   "graph_replay_ms": r.get("graph_replay_ms"),
                   "engine_overhead_ms_vs_replay": r.get("overhead_ms_vs_replay"),
                   "engine_overhead_ms_vs_direct": r.get("overhead_ms_vs_direct"),
                   "engine_over_direct": r.get("throughput_vs_direct"),
                   "sync_engine_over_direct": out.get("sessions_sync", {}).get(s, {}).get("throughput_vs_direct")}
    out["summary"] = rows
    if out.get("sampling"):
        out["summary_sampling"] = {k: out["sampling"][k] for k in (
            "sessions", "rounds", "greedy_tokens_per_s", "sampled_tokens_per_s", "sampled_over_greedy",
            "sampled_over_greedy_median_step", "per_round_ratio", "replay_ms") if k in out["sampling"]}
    if (out.get("prefill_stall") or {}).get("chunks"):
        out["summary_prefill_stall"] = {b: {"steady_itl_p99_ms": r["steady"]["itl_p99_ms"],
                                            "itl_p99_ms": r["arrival"]["itl_p99_ms"],
                                            "p99_over_steady_p99": r["p99_over_steady_p99"],
                                            "long_ttft_ms": r["arrival"]["long_ttft_ms"],
                                            "budget": r.get("budget"), "cap": r.get("cap")}
                                        for b, r in out["prefill_stall"]["chunks"].items()}
    if rows:
        print("\n== engine vs direct ==")
        print(f"{'S':>4} {'engine ms':>10} {'direct ms':>10} {'replay ms':>10} {'eng tok/s':>10} {'dir tok/s':>10} "
              f"{'eng roof':>9} {'dir roof':>9}")
        for s, r in rows.items():
            def f(v, fmt):
                return format(v, fmt) if isinstance(v, (int, float)) else "-"
            print(f"{s:>4} {f(r['engine_step_ms'], '10.3f')} {f(r['direct_step_ms'], '10.3f')} "
                  f"{f(r['graph_replay_ms'], '10.3f')} {f(r['engine_tokens_per_s'], '10.0f')} "
                  f"{f(r['direct_tokens_per_s'], '10.0f')} {f(r['engine_roofline_fraction'], '9.3f')} "
                  f"{f(r['direct_roofline_fraction'], '9.3f')}")
    for key in ("summary_sampling", "summary_prefill_stall"):
        if key in out:
            print(f"{key}: {json.dumps(out[key])}")


# ------------------------------------------------------------------------------------------------
# runs


def run_single(bc: BenchConfig) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg, hf_full = model_config(bc.preset, bc.split)
    res: dict = {"config": {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                            for k, v in asdict(bc).items()},
                 "env": env_info(dev), "model": asdict(cfg), "errors": {}}
    res["gpu"] = res["env"]["gpu"]
    save(bc, res)
    log(f"env: {res['env']}")
    bw = measure_bandwidth(dev, 4 * GIB if dev.type == "cuda" else 64 << 20)
    res["bandwidth"] = bw
    log(f"copy bandwidth: {bw['gb_per_s']:.0f} GB/s")
    if not bc.skip_checks:
        for name, fn in (("kernels", lambda: check_kernels(cfg, dev, dtype)),
                         ("model", lambda: check_model(hf_full, cfg, dev, dtype))):
            try:
                res.setdefault("checks", {})[name] = fn()
                log(f"check {name}: {res['checks'][name]}")
            except Exception as e:  # noqa: BLE001 - record and go on: one run must yield all it can
                res["errors"][f"check_{name}"] = traceback.format_exc()
                log(f"check {name} FAILED: {e}")
        save(bc, res)
    log(f"building the fast model: {cfg.num_layers} layers, {cfg.weight_bytes() / 1e9:.2f} GB of weights")
    t0 = time.perf_counter()
    tune: dict = {}
    model, kv, alloc, graphs, t_cap = build_fast(cfg, hf_full, bc, dev, dtype, tune=tune if bc.tune_linear else None)
    res["linear_tuning"] = tune.get("linear")
    res["attention_tuning"] = tune.get("attention")
    tune.pop("chosen", None)
    res["fast_build"] = {"seconds": time.perf_counter() - t0, "graph_capture_s": t_cap, "buckets": graphs.buckets,
                         "backend": model.backend, "graphs": graphs.use_graphs}
    mem = {"weights_bytes": weight_bytes(model), "kv_pool_bytes": kv.nbytes(),
           "kv_pool_tokens": (kv.num_blocks - 1) * kv.block_size}
    log(f"fast model ready: {res['fast_build']}")
    if dev.type == "cuda":
        try:
            res["breakdown"] = {str(m): breakdown(model, kv, graphs, m, bc.prompt + bc.gen // 2, dev, dtype,
                                                  bw["gb_per_s"])
                                for m in (1, 64) if m <= graphs.max_batch}
        except Exception as e:  # noqa: BLE001
            res["errors"]["breakdown"] = traceback.format_exc()
            log(f"breakdown FAILED: {e}")
        save(bc, res)
    res["fast"] = sweep(model, kv, alloc, graphs, bc, bc.sessions, dev, dtype, bw["gb_per_s"])
    save(bc, res)
    res["sequential"] = sequential(model, kv, alloc, graphs, bc, dev, dtype)
    log(f"sequential (one session at a time): {res['sequential']}")
    if dev.type == "cuda":
        mem["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
        mem["overhead_bytes"] = mem["peak_allocated_bytes"] - mem["weights_bytes"] - mem["kv_pool_bytes"]
        mem["fits_128x4096_on_one_gpu"] = mem["peak_allocated_bytes"] < torch.cuda.get_device_properties(dev).total_memory
        mem["rtx4090_tp2"] = memory_plan(cfg, mem["overhead_bytes"] / 2)
    res["memory"] = mem
    save(bc, res)
    del model, kv, graphs
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if not bc.skip_hf:
        res["transformers"] = attempt(res["errors"], "transformers", lambda: hf_baseline(cfg, bc, dev, dtype))
    summarize(res)
    save(bc, res)
    return res


def run_tp(bc: BenchConfig) -> dict:
    import datetime

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(minutes=20)  # rank 1 waits while rank 0 measures TP = 1
    if torch.cuda.is_available():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dev = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=dev, timeout=timeout)
        dtype = torch.bfloat16
    else:  # CPU smoke run of this code path (gloo; no symmetric memory)
        dev, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group("gloo", timeout=timeout)
        bc.allreduce = tuple(a for a in bc.allreduce if a == "nccl")
    cfg, hf_full = model_config(bc.preset, bc.split)
    res = load_json(bc.merge) if (bc.merge and rank == 0) else {}
    res.setdefault("errors", {})
    tp_res = {"world_size": world, "env": env_info(dev), "tp1": {}, "tp2": {}}
    bw = measure_bandwidth(dev, 4 * GIB if dev.type == "cuda" else 64 << 20)
    tp_res["bandwidth"] = bw
    if rank == 0:
        log(f"[tp] rank 0: TP=1 reference on one GPU ({bw['gb_per_s']:.0f} GB/s)")
        tune1: dict = {}
        model, kv, alloc, graphs, _ = build_fast(cfg, hf_full, bc, dev, dtype, tune=tune1 if bc.tune_linear else None)
        tp_res["tp1"] = sweep(model, kv, alloc, graphs, bc, bc.tp_sessions, dev, dtype, bw["gb_per_s"])
        ref_logits = probe_logits(model, kv, alloc, graphs, dev, dtype)
        del model, kv, alloc, graphs
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    tune2: dict = {}
    for ar in bc.allreduce:
        try:
            log(f"[tp] rank {rank}: TP={world} with {ar} all-reduce")
            model, kv, alloc, graphs, t_cap = build_fast(cfg, hf_full, bc, dev, dtype, rank, world, ar,
                                                         tune=tune2 if bc.tune_linear else None)
            r = sweep(model, kv, alloc, graphs, bc, bc.tp_sessions, dev, dtype, bw["gb_per_s"], tp=world)
            if dev.type == "cuda":  # where the time goes: this rank's ops alone, and the all-reduces alone
                r["breakdown_m1"] = breakdown(model, kv, graphs, 1, bc.prompt + bc.gen // 2, dev, dtype,
                                              bw["gb_per_s"])
                r["allreduce_ms_per_step"] = {}
                for m in (1, 64):
                    xs = torch.randn(m, cfg.hidden_size, device=dev, dtype=dtype)
                    r["allreduce_ms_per_step"][str(m)] = time_graph(
                        lambda xs=xs, fn=model.all_reduce: [fn(xs) for _ in range(2 * cfg.num_layers)])
                log(f"[tp] {ar}: {2 * cfg.num_layers} all-reduces per step: "
                    + ", ".join(f"m={m} {t:.3f} ms" for m, t in r["allreduce_ms_per_step"].items()))
            r["graph_capture_s"] = t_cap
            logits = probe_logits(model, kv, alloc, graphs, dev, dtype)
            if rank == 0:
                r["logits_rel_err_vs_tp1"] = rel(logits, ref_logits)
                log(f"[tp] {ar}: logits vs TP=1 rel err {r['logits_rel_err_vs_tp1']:.2e}")
            r["weights_bytes_per_gpu"] = weight_bytes(model)
            r["kv_pool_bytes_per_gpu"] = kv.nbytes()
            tp_res["tp2"][ar] = r
            del model, kv, alloc, graphs
        except Exception as e:  # noqa: BLE001
            res["errors"][f"tp_{ar}"] = traceback.format_exc()
            log(f"[tp] {ar} FAILED on rank {rank}: {e}")
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        dist.barrier()
    tp_res["tuning_rank0"] = {"linear": tune2.get("linear"), "attention": tune2.get("attention")}
    if rank == 0:
        res["tp"] = tp_res
        summarize(res)
        save(bc, res)
    dist.barrier()
    return res


def summarize(res: dict) -> None:
    """The headline figures (the issue's required keys) from whatever sections this run has."""
    fast = res.get("fast", {})
    if "1" in fast:
        res["roofline_fraction_s1"] = fast["1"]["roofline"]["fraction"]
        res["roofline_fraction_weights_only_s1"] = fast["1"]["roofline"]["fraction_weights_only"]
        res["step_ms_s1"] = fast["1"]["step_ms_mean"]
    if "64" in fast:
        res["roofline_fraction_s64"] = fast["64"]["roofline"]["fraction"]
        res["tokens_per_s_s64"] = fast["64"]["tokens_per_s"]
        res["step_ms_s64"] = fast["64"]["step_ms_mean"]
        seq = res.get("sequential")
        if seq:
            res["batching_gain_s64"] = fast["64"]["tokens_per_s"] / seq["tokens_per_s"]
        hf = res.get("transformers", {}).get("eager", {}).get("64")
        if hf:
            res["speedup_vs_transformers_s64"] = fast["64"]["tokens_per_s"] / hf["tokens_per_s"]
        gen = res.get("transformers", {}).get("generate", {}).get("64")
        if gen:
            res["speedup_vs_transformers_generate_s64"] = fast["64"]["tokens_per_s"] / gen["tokens_per_s"]
    if "1" in fast and res.get("transformers", {}).get("eager", {}).get("1"):
        res["speedup_vs_transformers_s1"] = res["transformers"]["eager"]["1"]["step_ms_median"] / fast["1"]["step_ms_mean"]
    tp = res.get("tp")
    if tp and "1" in tp.get("tp1", {}):
        best = None
        for ar, r in tp.get("tp2", {}).items():
            if "1" in r and (best is None or r["1"]["step_ms_mean"] < tp["tp2"][best]["1"]["step_ms_mean"]):
                best = ar
        if best:
            t1, t2 = tp["tp1"], tp["tp2"][best]
            res["tp2_allreduce"] = best
            res["tp2_step_speedup_s1"] = t1["1"]["step_ms_mean"] / t2["1"]["step_ms_mean"]
            if "64" in t1 and "64" in t2:
                res["tp2_throughput_speedup_s64"] = t2["64"]["tokens_per_s"] / t1["64"]["tokens_per_s"]


def load_json(path: Path | None) -> dict:
    return json.loads(Path(path).read_text()) if path and Path(path).is_file() else {}


def save(bc: BenchConfig, res: dict) -> None:
    if bc.out is not None:
        bc.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = bc.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1, default=str))
        tmp.replace(bc.out)


def parse_args(argv=None) -> BenchConfig:
    d = BenchConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default=d.preset, help="glm4v-9b-random (GPU) | tiny-glm4 | tiny-glm4v (CPU smoke)")
    p.add_argument("--split", type=int, default=d.split, help="N: the phone runs layers [0, N)")
    p.add_argument("--sessions", default=",".join(map(str, d.sessions)), help="decode batch sizes S to sweep")
    p.add_argument("--prompt", type=int, default=d.prompt, help="prompt tokens per session")
    p.add_argument("--gen", type=int, default=d.gen, help="decode steps per session")
    p.add_argument("--max-context", type=int, default=d.max_context, help="KV tokens per session in the pool")
    p.add_argument("--pool-sessions", type=int, default=d.pool_sessions, help="sessions the KV pool holds")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--prefill-chunk-tokens", type=int, default=d.prefill_chunk_tokens)
    p.add_argument("--sequential-sessions", type=int, default=d.sequential_sessions)
    p.add_argument("--hf-sessions", default=",".join(map(str, d.hf_sessions)))
    p.add_argument("--hf-steps", type=int, default=d.hf_steps)
    p.add_argument("--hf-generate-tokens", type=int, default=d.hf_generate_tokens)
    p.add_argument("--tp-sessions", default=",".join(map(str, d.tp_sessions)))
    p.add_argument("--tp", action="store_true", help="tensor-parallel run (launch with torchrun)")
    p.add_argument("--allreduce", default=",".join(d.allreduce), help="TP all-reduce variants: nccl,symm_mem")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--skip-hf", action="store_true", help="skip the plain-transformers baseline")
    p.add_argument("--skip-checks", action="store_true", help="skip the on-device correctness checks")
    p.add_argument("--no-tune-linear", action="store_true", help="cuBLAS for every projection (no Triton GEMM)")
    p.add_argument("--out", type=Path, default=None, help="result JSON (rewritten after every section)")
    p.add_argument("--merge", type=Path, default=None, help="earlier result JSON to extend (TP / engine run)")
    p.add_argument("--through-engine", action="store_true",
                   help="S sessions through LLMEngine + FastGlmRunner beside the direct path ('engine' key)")
    p.add_argument("--sampling", action="store_true",
                   help="with --through-engine: max(S) sessions sampled (T 0.7, top-p 0.9) vs greedy")
    p.add_argument("--sampling-rounds", type=int, default=d.sampling_rounds,
                   help="greedy and sampled runs of --sampling, alternated (each gen steps)")
    p.add_argument("--prefill-stall", action="store_true",
                   help="with --through-engine: a long prompt arriving while max(S) - 1 sessions decode")
    p.add_argument("--stall-prompt", type=int, default=d.stall_prompt, help="positions of the arriving prompt")
    p.add_argument("--stall-chunks", default=",".join(map(str, d.stall_chunks)),
                   help="prefill_chunk_while_decoding values the stall is measured at (0 = no cap)")
    p.add_argument("--stall-steps", type=int, default=d.stall_steps, help="decode steps per stall phase")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="with --through-engine: the engine's KV pool (auto: the compute dtype; int8 / fp8: 8-bit; "
                        "int8v: compute-dtype keys, int8 values)")
    p.add_argument("--generic-runner", action="store_true",
                   help="with --through-engine: the engine on the library's layers (the 16-bit pool beside int8)")
    p.add_argument("--idle-gap-ms", type=float, default=d.idle_gap_ms,
                   help="also time each side S's direct step on the device (CUDA events) back to back and with the "
                        "GPU idle this long between steps, as a served lockstep leaves it while the phones answer")
    a = p.parse_args(argv)
    if a.idle_gap_ms < 0:
        p.error("--idle-gap-ms must be >= 0")

    def ints(s):
        return tuple(int(x) for x in s.split(",") if x)

    return BenchConfig(preset=a.preset, split=a.split, sessions=ints(a.sessions), prompt=a.prompt, gen=a.gen,
                       max_context=a.max_context, pool_sessions=a.pool_sessions, block_size=a.block_size,
                       prefill_chunk_tokens=a.prefill_chunk_tokens, sequential_sessions=a.sequential_sessions,
                       hf_sessions=ints(a.hf_sessions), hf_steps=a.hf_steps, hf_generate_tokens=a.hf_generate_tokens,
                       tp_sessions=ints(a.tp_sessions), tp=a.tp,
                       allreduce=tuple(x for x in a.allreduce.split(",") if x), seed=a.seed, skip_hf=a.skip_hf,
                       skip_checks=a.skip_checks, tune_linear=not a.no_tune_linear, out=a.out, merge=a.merge,
                       through_engine=a.through_engine, sampling=a.sampling,
                       sampling_rounds=a.sampling_rounds, prefill_stall=a.prefill_stall,
                       stall_prompt=a.stall_prompt, stall_chunks=ints(a.stall_chunks), stall_steps=a.stall_steps,
                       kv_cache_dtype=a.kv_cache_dtype, generic_runner=a.generic_runner, idle_gap_ms=a.idle_gap_ms)


def print_table(res: dict) -> None:
    keys = ["gpu", "roofline_fraction_s1", "roofline_fraction_weights_only_s1", "roofline_fraction_s64",
            "tokens_per_s_s64", "batching_gain_s64", "speedup_vs_transformers_s64", "speedup_vs_transformers_s1",
            "tp2_step_speedup_s1", "tp2_throughput_speedup_s64", "tp2_allreduce"]
    print("\n== summary ==")
    for k in keys:
        if k in res:
            v = res[k]
            print(f"{k:40s} {v:.3f}" if isinstance(v, float) else f"{k:40s} {v}")
    if res.get("errors"):
        print("errors in:", ", ".join(res["errors"]))


def main(argv=None) -> int:
    bc = parse_args(argv)
    if bc.tp:  # under torchrun; each rank leaves its group through tp.exit_rank (no gloo teardown abort)
        from cloud_server import tp

        if bc.through_engine:
            run_engine_tp(bc)
        else:
            res = run_tp(bc)
            if int(os.environ.get("RANK", "0")) == 0:
                print_table(res)
        tp.exit_rank(0)
    if bc.through_engine:
        res = run_engine(bc)
        if res["engine"].get("errors"):
            print("errors in:", ", ".join(res["engine"]["errors"]))
        return 0
    print_table(run_single(bc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
