"""Quality of the 8-bit KV pool (``--kv-cache-dtype int8 / fp8 / int8v``) on real weights beside the fp32 pool (CPU).

SmolLM2 split at ``--layer`` (fp32 edge, the phone's ``FrontRuntime``), its cloud half in fp32 on one KV pool
per arm (``auto`` = fp32, the reference, always run; ``--arms`` from ``bf16``, ``int8``, ``fp8``, ``int8v``,
``int8v-bf16``). ``bf16`` is the 16-bit reference: the same fp32 compute on a pool stored in bfloat16, what the
GPU's default pool stores (``auto`` with bf16 compute), so that the 8-bit arms' disagreement with the fp32 pool is
read beside what any 16-bit pool costs. ``int8v`` keeps its keys in the compute dtype (fp32 here); ``int8v-bf16``
is the int8v pool as the GPU stores it (bfloat16 keys, int8 values) under the same fp32 compute:

* teacher-forced: held-out text (``inversion_corpus``'s test prose and code) prefilled through the cloud
  half's ``ModelRunner`` with every position's logits kept; per arm vs the fp32 pool, the top-1 agreement and
  the KL divergence ``KL(p_fp32 || p_arm)`` of the next-token distribution (mean, p99, max), and the largest
  logit difference. The 8-bit pool is read back for the chunk's own keys too (written, then gathered), so a
  prefill sees exactly what a later decode step would;
* served: ``--prompts`` held-out chat questions (``edge_answers_bench``'s set), greedy ``--new`` tokens each,
  all sessions batched through ``LLMEngine`` as the split endpoint drives it (the prompt's boundary states,
  then one state per returned token from the session's own edge front); answers identical to the fp32 pool's,
  and the first divergence where not.

``--emulate`` adds storage schemes the pool does not have, as arms on the fp32 pool whose writes are rounded
through the scheme first (fake quantization: same answers, no byte savings; the quality question only). A
scheme is ``BITS:GROUP:SINKS:WHICH``: symmetric ``BITS``-bit codes in the int8 pool's Hadamard-rotated basis,
one scale per ``GROUP`` channels of each token's head (64: the int8 pool's one scale per head), the first
``SINKS`` tokens of each sequence kept exact (attention sinks), applied to keys ``k``, values ``v`` or both
``kv``. ``8:64:0:kv`` is the int8 pool's own rule, so its row checks the emulation against the ``int8`` arm.

Run: ``python bench/kv_quant_pool_bench.py`` (writes docs/results/kv_pool_quality.json; ~3 minutes, 1 thread).
The int8v run: ``python bench/kv_quant_pool_bench.py --arms bf16,int8,int8v,int8v-bf16 --emulate 8:64:0:v
--out docs/results/kv_pool_quality_int8v.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
from edge_answers_bench import HELD_OUT, chat_ids, through_eos
from inversion_corpus import TEST_CODE, TEST_PROSE
from results_io import emit
from split_bundles import cached_split, common_args

ROOT = Path(__file__).resolve().parents[1]
# arm -> (the dtype the pool stores its unquantized tensors in, None: the model's; kv_cache_dtype)
ARM_POOLS = {"auto": (None, "auto"), "bf16": (torch.bfloat16, "auto"), "int8": (None, "int8"), "fp8": (None, "fp8"),
             "int8v": (None, "int8v"), "int8v-bf16": (torch.bfloat16, "int8v")}
ARMS = ("auto", "bf16", "int8", "fp8", "int8v", "int8v-bf16")


def _pool(model, arm: str, num_blocks: int, block_size: int):
    """The arm's pool (:data:`ARM_POOLS`): ``bf16`` stores bfloat16 under fp32 compute (``auto`` of a bfloat16
    dtype), ``int8v-bf16`` bfloat16 keys beside int8 values; the others are ``kv_cache_dtype`` values."""
    from cloud_server.engine.kv_cache import KVCachePool

    dtype, kv = ARM_POOLS[arm]
    return KVCachePool(model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim,
                       dtype or model.dtype, kv_cache_dtype=kv)


@torch.inference_mode()
def teacher_logits(model, kv: str, front, texts: list[list[int]]) -> list[torch.Tensor]:
    """Per text, logits [T, V] of every position through the cloud half on a fresh ``kv`` pool."""
    from cloud_server.engine.model_runner import ModelRunner, build_batch
    from cloud_server.engine.sequence import InputChunk

    bs = 16
    runner = ModelRunner(model, _pool(model, kv, -(-max(map(len, texts)) // bs), bs))
    out = []
    for ids in texts:
        f = front.fork()
        table = list(range(runner.pool.num_blocks))
        chunk = InputChunk(0, hidden=torch.from_numpy(f.prefill(ids)))  # [T, H]
        out.append(runner.run(build_batch([chunk], [table], bs, [True], all_rows=True)))
    return out


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    """Top-1 agreement, KL(ref || got) per position and the largest logit difference over all texts."""
    r, g = torch.cat(ref), torch.cat(got)  # [N, V]
    lr, lg = r.log_softmax(-1), g.log_softmax(-1)
    kl = (lr.exp() * (lr - lg)).sum(-1).clamp_min(0)  # [N]
    top1 = float((r.argmax(-1) == g.argmax(-1)).float().mean())
    return {"positions": int(r.shape[0]), "top1_agreement": round(top1, 5),
            "kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)), "kl_max": float(kl.max()),
            "max_abs_logit_diff": round(float((r - g).abs().max()), 5)}


def served_answers(model, kv: str, front, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Greedy answers of all ``prompts`` at once through ``LLMEngine`` on the arm ``kv``'s pool."""
    from cloud_server.config import EngineConfig
    from cloud_server.engine.llm_engine import LLMEngine
    from cloud_server.engine.model_runner import ModelRunner
    from cloud_server.engine.sampling_params import SamplingParams
    from cloud_server.engine.sequence import InputChunk

    blocks = len(prompts) * (-(-(max(map(len, prompts)) + new) // 16)) + 8
    config = EngineConfig(num_blocks=blocks, block_size=16, max_num_seqs=len(prompts),
                          kv_cache_dtype=ARM_POOLS[kv][1])
    make_runner = None if ARM_POOLS[kv][0] is None else (
        lambda _i, m, _pool_unused: ModelRunner(m, _pool(m, kv, blocks, 16), batch_invariant=config.batch_invariant))
    eng = LLMEngine.from_models(config, {"fp32": model}, make_runner=make_runner)
    fronts = {f"q{i}": front.fork() for i in range(len(prompts))}
    answers: dict[str, list[int]] = {rid: [] for rid in fronts}
    pos = {}
    for (rid, f), ids in zip(fronts.items(), prompts):
        eng.add_request(rid, InputChunk(0, hidden=torch.from_numpy(f.prefill(ids))),
                        SamplingParams(temperature=0.0, max_tokens=new))
        pos[rid] = len(ids)
    while eng.has_work():
        for o in eng.step():
            if o.error_code is not None:
                raise RuntimeError(f"{o.request_id}: {o.error_code}: {o.error_message}")
            if o.token_id is not None:
                answers[o.request_id].append(o.token_id)
            if not o.finished and o.token_id is not None:
                f = fronts[o.request_id]
                state = torch.from_numpy(f.prefill([o.token_id]))  # [1, H]
                eng.add_input(o.request_id, InputChunk(pos[o.request_id], hidden=state))
                pos[o.request_id] += 1
    if eng.num_used_blocks():
        raise RuntimeError("KV blocks leaked")
    return list(answers.values())


def parse_scheme(spec: str) -> tuple[int, int, int, str]:
    """``BITS:GROUP:SINKS:WHICH`` (module docstring) -> its fields, or ValueError naming the bad one."""
    try:
        bits, group, sinks, which = spec.split(":")
        bits, group, sinks = int(bits), int(group), int(sinks)
    except ValueError:
        raise ValueError(f"--emulate {spec!r}: expected BITS:GROUP:SINKS:WHICH, e.g. 8:32:0:kv") from None
    if not 2 <= bits <= 8 or group < 1 or sinks < 0 or which not in ("k", "v", "kv"):
        raise ValueError(f"--emulate {spec!r}: BITS in 2..8, GROUP >= 1, SINKS >= 0, WHICH k / v / kv")
    return bits, group, sinks, which


@contextlib.contextmanager
def emulated(spec: str, head_dim: int):
    """Within the block, the paged attention's pool writes are rounded through the scheme ``spec`` first."""
    import cloud_server.attention as attention
    from cloud_server.kv_quant import SCALE_MIN, rotation

    bits, group, sinks, which = parse_scheme(spec)
    if head_dim % group:
        raise ValueError(f"--emulate {spec!r}: GROUP must divide the head size {head_dim}")
    qmax = 2 ** (bits - 1) - 1
    rot = rotation(head_dim, torch.device("cpu"), torch.float32)  # [D, D] or None
    write = attention.write

    def rounded(x: torch.Tensor) -> torch.Tensor:  # [T, KVH, D]
        y = x.float() @ rot if rot is not None else x.float()
        g = y.reshape(*y.shape[:-1], head_dim // group, group)  # [T, KVH, D / G, G]
        scale = g.abs().amax(-1, keepdim=True).clamp_min(SCALE_MIN) / qmax
        y = ((g / scale).round().clamp(-qmax, qmax) * scale).reshape(y.shape)
        return (y @ rot.T if rot is not None else y).to(x.dtype)

    def fake_write(cache, scale, slots, x):
        ctx = attention.current()
        is_key = cache.untyped_storage().data_ptr() == ctx.k_cache.untyped_storage().data_ptr()
        if ("k" if is_key else "v") in which:
            y = rounded(x)
            if sinks:  # this step's tokens among their sequence's first `sinks` stay exact
                first = torch.cat([ss[:sinks] for ss in ctx.seq_slots])
                y = torch.where(torch.isin(slots, first)[:, None, None], x, y)
            x = y
        write(cache, scale, slots, x)

    attention.write = fake_write
    try:
        yield
    finally:
        attention.write = write


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where answers ``a`` and ``b`` differ (None: identical)."""
    tail = None if len(a) == len(b) else min(len(a), len(b))
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), tail)


def main(argv: list[str] | None = None) -> int:
    p = common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), "/tmp/autoglm-kvpool-bench")
    p.add_argument("--prompts", type=int, default=24, help="held-out chat questions answered greedily")
    p.add_argument("--new", type=int, default=48, help="greedy tokens per answer")
    p.add_argument("--text-tokens", type=int, default=256, help="tokens kept of each held-out text")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--arms", default="bf16,int8,fp8,int8v,int8v-bf16",
                   help=f"pool arms beside the fp32 pool (auto, always run), comma-separated: {', '.join(ARMS[1:])}")
    p.add_argument("--emulate", default="", help="comma-separated BITS:GROUP:SINKS:WHICH schemes emulated on the "
                                                  "fp32 pool (module docstring), e.g. 8:64:0:kv,4:32:0:kv")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "kv_pool_quality.json")
    args = p.parse_args(argv)
    schemes = [x for x in args.emulate.split(",") if x]
    pools = ["auto", *(a for a in args.arms.split(",") if a and a != "auto")]
    if bad := [a for a in pools if a not in ARM_POOLS]:
        p.error(f"--arms: unknown {', '.join(bad)} (choose from {', '.join(ARMS[1:])})")
    try:
        for x in schemes:
            parse_scheme(x)
    except ValueError as e:
        p.error(str(e))
    torch.set_num_threads(args.threads)
    from cloud_server.model import load_split_model
    from edge_client.front import FrontRuntime
    from partition_tools.adapters import ModelAdapter
    from partition_tools.models import load_model

    started = time.perf_counter()
    lm = load_model(args.model)
    eos = set(ModelAdapter(lm.model).eos_token_ids())
    bundle = cached_split(lm, args.layer, args.work / "bundle-fp32")
    model = load_split_model(bundle, "fp32")
    front = FrontRuntime(bundle, threads=args.threads, verify=False)
    texts = [lm.tokenizer(t).input_ids[: args.text_tokens] for t in TEST_PROSE + TEST_CODE]
    prompts = [chat_ids(lm.tokenizer, q) for q in HELD_OUT[: args.prompts]]

    logits = {kv: teacher_logits(model, kv, front, texts) for kv in pools}
    answers = {kv: [through_eos(a, eos) for a in served_answers(model, kv, front, prompts, args.new)]
               for kv in pools}
    pool_bytes = {kv: _pool(model, kv, 1, 16).bytes_per_block for kv in pools}
    for spec in schemes:
        with emulated(spec, model.head_dim):
            logits[spec] = teacher_logits(model, "auto", front, texts)
            answers[spec] = [through_eos(a, eos) for a in served_answers(model, "auto", front, prompts, args.new)]
        pool_bytes[spec] = pool_bytes["auto"]  # emulated: stored in fp32
    arms = {}
    for kv in [*pools[1:], *schemes]:
        div = [first_divergence(a, b) for a, b in zip(answers["auto"], answers[kv])]
        arms[kv] = {"teacher_forced": compare(logits["auto"], logits[kv]),
                    "greedy_identical": sum(d is None for d in div), "greedy_prompts": len(div),
                    "first_divergence": [d for d in div if d is not None],
                    "bytes_per_block": pool_bytes[kv],
                    "bytes_vs_fp32_pool": round(pool_bytes[kv] / pool_bytes["auto"], 4)}
        if kv in schemes:
            arms[kv]["emulated"] = True  # fake quantization on the fp32 pool: quality only, bytes not saved
        same = arms[kv]["greedy_identical"]
        print(f"{kv}: {arms[kv]['teacher_forced']}, greedy identical {same}/{len(div)}", flush=True)
    result = {"benchmark": "kv_pool_quality", "model": args.model, "split_layer": args.layer,
              "cloud_layers": model.num_layers, "kv_heads": model.num_kv_heads, "head_dim": model.head_dim,
              "reference": "the fp32 pool (kv_cache_dtype auto on CPU), same cloud half, same edge front",
              "emulated_schemes": "BITS:GROUP:SINKS:WHICH, fake-quantized writes on the fp32 pool (module docstring)",
              "arm_pools": {a: {"keys": str(_pool(model, a, 1, 16).k.dtype), "values": str(_pool(model, a, 1, 16).v.dtype)}
                            for a in pools},
              "texts": len(texts), "new_tokens": args.new, "fp32_pool_bytes_per_block": pool_bytes["auto"],
              "arms": arms, "threads": args.threads, "wall_s": round(time.perf_counter() - started, 1)}
    emit(result, args.out, "kv_quant_pool_bench.py", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
