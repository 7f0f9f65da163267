"""The GLM fast path (cloud_server.fast) on CPU: equal to the library's layers, decode == prefill, kernels,
tensor parallel, and the engine runner adapter. The GPU-only parts (CUDA graphs, Triton compiled for the
GPU, NCCL) run in ``bench/cloud_gpu_bench.py``, which checks them against these same torch paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cloud_server.fast import FastGLM, FastGLMConfig, UnsupportedFastPath
from cloud_server.fast.glm import DecodeMeta, PrefillMeta
from cloud_server.fast.graphs import DecodeGraphs
from cloud_server.fast.kv import KVPool
from partition_tools.adapters import ModelAdapter, call_layer
from partition_tools.models import load_model

SPLIT = 1  # the fast model runs layers [SPLIT, L) of the tiny presets
BLOCK = 4  # small blocks so that sequences span several, non-contiguous ones


@pytest.fixture(scope="module", params=["tiny-glm4", "tiny-glm4v"])
def tiny(request):
    lm = load_model(request.param)
    ad = ModelAdapter(lm.model)
    layers = list(ad.layers)[SPLIT:]
    fast = FastGLM.from_modules(layers, ad.norm, ad.lm_head, ad.config, backend="torch")
    return ad, layers, fast


def reference_logits(ad, layers, hidden: torch.Tensor) -> torch.Tensor:
    """The library's layers over a whole sequence: hidden [S, H] -> logits [S, V]."""
    pos = torch.arange(hidden.shape[0])[None]
    with torch.no_grad():
        h = hidden[None]
        cos_sin = ad.position_embeddings(h, pos)
        for layer in layers:
            h = call_layer(layer, h, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
        return ad.lm_head(ad.norm(h))[0]


def new_pool(fast: FastGLM, num_blocks: int = 40) -> KVPool:
    c = fast.cfg
    return KVPool.zeros(c.num_layers, num_blocks, BLOCK, fast.local_kv_heads, c.head_dim, fast.dtype, "cpu")


def slots_of(blocks: list[int], positions) -> torch.Tensor:
    return torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in positions])


def tables(block_lists: list[list[int]], width: int = 12) -> torch.Tensor:
    out = torch.zeros(len(block_lists), width, dtype=torch.int32)
    for i, b in enumerate(block_lists):
        out[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
    return out


# ------------------------------------------------------------------------------------------------


def test_config_reads_the_9b_text_decoder():
    from partition_tools.models import glm4v_9b_text_config

    c = FastGLMConfig.from_hf(glm4v_9b_text_config(), num_layers=28)
    assert (c.head_dim, c.rotary_dim, c.num_kv_heads, c.q_size + 2 * c.kv_size) == (128, 64, 2, 4608)
    # 28 layers + norm + lm_head in bf16: the weight stream of one decode step (12.66 GB)
    assert c.weight_bytes() == 12_663_787_520
    assert c.kv_bytes_per_token() == 28 * 2 * 2 * 128 * 2


def test_config_refuses_what_it_cannot_run():
    from transformers import LlamaConfig

    with pytest.raises(UnsupportedFastPath, match="model types"):
        FastGLMConfig.from_hf(LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        FastGLMConfig(64, 4, 3, 16, 128, 2, 512)
    with pytest.raises(ValueError, match="rotary_dim"):
        FastGLMConfig(64, 4, 2, 16, 128, 2, 512, rotary_dim=18)


def test_fast_layers_equal_the_library(tiny):
    ad, layers, fast = tiny
    s = 13
    hidden = torch.randn(s, ad.hidden_size, generator=torch.Generator().manual_seed(1))
    ref = reference_logits(ad, layers, hidden)
    kv = new_pool(fast)
    blocks = [7, 2, 30, 11]  # out of order on purpose
    x = fast.forward(hidden, torch.arange(s), slots_of(blocks, range(s)), kv, PrefillMeta([s], [s], tables([blocks])))
    assert torch.allclose(fast.compute_logits(x), ref, atol=1e-5, rtol=0), float((fast.compute_logits(x) - ref).abs().max())


def test_decode_equals_prefill_with_mixed_lengths(tiny):
    """Three sequences prefilled in one flat batch, then decoded together (lengths differ every step), with a
    mixed step (one sequence's prompt chunk beside the others' decode tokens): every logit row equals the
    full-sequence reference at that position."""
    ad, layers, fast = tiny
    g = torch.Generator().manual_seed(2)
    prompts, total = [5, 9, 3], 16
    seqs = [torch.randn(total, ad.hidden_size, generator=g) for _ in prompts]
    refs = [reference_logits(ad, layers, h) for h in seqs]
    kv = new_pool(fast)
    blocks = [[5, 1, 9, 3], [2, 8, 11, 6], [4, 10, 7, 12]]  # 4 blocks of 4 per sequence, scattered
    bt = tables(blocks)

    # 1. prefill: all three prompts in one forward (sequence 2 gets only its first 2 tokens now)
    first = [5, 9, 2]
    hid = torch.cat([h[:n] for h, n in zip(seqs, first)])
    pos = torch.cat([torch.arange(n) for n in first])
    slots = torch.cat([slots_of(b, range(n)) for b, n in zip(blocks, first)])
    logits = fast.prefill(hid, pos, slots, kv, PrefillMeta(first, first, bt))
    for i, n in enumerate(first):
        assert torch.allclose(logits[i], refs[i][n - 1], atol=1e-5)

    # 2. a mixed step: sequences 0 and 1 decode one token, sequence 2 finishes its prompt (1 more token)
    #    and then one more: query lens [1, 1, 2] after context
    lens = [5, 9, 2]
    q_lens = [1, 1, 2]
    hid = torch.cat([seqs[i][lens[i]: lens[i] + q] for i, q in enumerate(q_lens)])
    pos = torch.cat([torch.arange(lens[i], lens[i] + q) for i, q in enumerate(q_lens)])
    slots = torch.cat([slots_of(blocks[i], range(lens[i], lens[i] + q)) for i, q in enumerate(q_lens)])
    ctx = [n + q for n, q in zip(lens, q_lens)]
    for block_size in (0, kv.block_size):  # context slots found by each layer, then once for the step
        meta = PrefillMeta.build(q_lens, ctx, bt, split_decode=True, block_size=block_size)
        assert meta.decode_seqs == {0, 1} and (meta.context_slots is None) == (block_size == 0)
        x = fast.forward(hid, pos, slots, kv, meta)  # the same keys to the same slots both times
        rows = torch.tensor(q_lens).cumsum(0) - 1
        logits = fast.compute_logits(x[rows])
        for i in range(3):
            assert torch.allclose(logits[i], refs[i][ctx[i] - 1], atol=1e-5)
    lens = ctx  # [6, 10, 4]

    # 3. decode steps through the graph runner's code path (eager on CPU), all three at once
    runner = DecodeGraphs(fast, kv, max_batch=4, max_blocks_per_seq=bt.shape[1])
    for _ in range(4):
        hid = torch.stack([seqs[i][lens[i]] for i in range(3)])
        logits, ids = runner.step(hid, torch.tensor(lens), torch.tensor([n + 1 for n in lens], dtype=torch.int32), bt)
        for i in range(3):
            assert torch.allclose(logits[i], refs[i][lens[i]], atol=1e-5)
            assert int(ids[i]) == int(refs[i][lens[i]].argmax())
        lens = [n + 1 for n in lens]

    # 4. the direct decode metadata path agrees too
    hid = torch.stack([seqs[i][lens[i]] for i in range(3)])
    x = fast.forward(hid, torch.tensor(lens), torch.stack([slots_of(blocks[i], [lens[i]])[0] for i in range(3)]), kv,
                     DecodeMeta(bt, torch.tensor([n + 1 for n in lens], dtype=torch.int32)))
    for i in range(3):
        assert torch.allclose(fast.compute_logits(x)[i], refs[i][lens[i]], atol=1e-5)


def test_glm4v_image_positions_take_the_3d_rope():
    """GLM-4.1V image tokens carry different temporal/height/width positions: the fast path rotates each
    rotary pair by its mrope section's axis, exactly as Glm4vTextRotaryEmbedding does."""
    lm = load_model("tiny-glm4v")
    ad = ModelAdapter(lm.model)
    layers = list(ad.layers)[SPLIT:]
    fast = FastGLM.from_modules(layers, ad.norm, ad.lm_head, ad.config, backend="torch")
    s = 9
    hidden = torch.randn(s, ad.hidden_size, generator=torch.Generator().manual_seed(5))
    rope = torch.stack([torch.arange(s), torch.tensor([0, 1, 2, 2, 2, 3, 4, 5, 6]),
                        torch.tensor([0, 1, 2, 3, 4, 3, 4, 5, 6])])  # [3, S]: a 1x2x3-ish image grid
    pos = torch.arange(s)[None]
    with torch.no_grad():
        h = hidden[None]
        cos_sin = ad.rotary_emb(h, rope[:, None])
        for layer in layers:
            h = call_layer(layer, h, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
        ref = ad.lm_head(ad.norm(h))[0]
    kv = new_pool(fast)
    blocks = [4, 9, 1]
    meta = PrefillMeta([s], [s], tables([blocks]))
    got = fast.compute_logits(fast.forward(hidden, torch.arange(s), slots_of(blocks, range(s)), kv, meta, rope))
    assert torch.allclose(got, ref, atol=1e-5)
    flat = fast.compute_logits(fast.forward(hidden, torch.arange(s), slots_of(blocks, range(s)), kv, meta))
    assert not torch.allclose(flat, ref, atol=1e-5)  # the 3-D positions mattered


def test_kv_pool_views_the_engine_pool_and_refuses_bad_shapes():
    from cloud_server.engine.kv_cache import KVCachePool

    engine_pool = KVCachePool(2, 6, BLOCK, 2, 16, torch.float32)
    kv = KVPool.view_of(engine_pool)
    assert (kv.num_blocks, kv.block_size, tuple(kv.k.shape)) == (6, BLOCK, (2, 6, BLOCK, 2, 16))
    kv.layer(1)[0][3, 2].fill_(7.0)  # block 3, offset 2 of layer 1 is slot 3 * BLOCK + 2 of the engine's pool
    assert bool((engine_pool.k[1, 3 * BLOCK + 2] == 7.0).all()) and kv.nbytes() == engine_pool.nbytes
    with pytest.raises(ValueError, match="block 0 is reserved"):
        KVPool.zeros(2, 1, BLOCK, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"\[L, NB, BS, KVH, D\]"):
        KVPool(torch.zeros(2, 4, 4, 16), torch.zeros(2, 4, 4, 16))


# ------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (runs where triton is installed; CUDA-less CI has none)

_TRITON_SCRIPT = r"""
import json, sys, torch
from cloud_server.fast import kernels as K
from cloud_server.fast.attention import decode_attention_torch, decode_attention_triton
torch.manual_seed(0)
err = {}
x, r = torch.randn(5, 64), torch.randn(5, 64)
w1, w2 = torch.rand(64) + 0.5, torch.rand(64) + 0.5
err["rmsnorm"] = (K.rmsnorm(x, w1, 1e-5, "triton") - K.rmsnorm_torch(x, w1, 1e-5)).abs().max().item()
h_t, o_t = K.add_norm_norm(x, r.clone(), w1, w2, 1e-5, "triton")
h_r, o_r = K.add_norm_norm_torch(x, r, w1, w2, 1e-5)
err["add_norm_norm"] = max((h_t - h_r).abs().max().item(), (o_t - o_r).abs().max().item())
gu = torch.randn(5, 2 * 96)
err["silu_mul"] = (K.silu_mul(gu, "triton") - K.silu_mul_torch(gu)).abs().max().item()
nq, nkv, d, rot = 4, 2, 16, 8
qkv = torch.randn(5, (nq + 2 * nkv) * d)
pos = torch.tensor([0, 3, 7, 8, 2])
freqs = torch.arange(16.)[:, None] * (1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot))[None]
cos, sin = freqs.cos(), freqs.sin()
slots = torch.tensor([9, 1, 4, 12, 6])
kc_t, vc_t, kc_r, vc_r = (torch.zeros(4, 4, nkv, d) for _ in range(4))
a, b = qkv.clone(), qkv.clone()
K.rope_store(a, pos, cos, sin, kc_t, vc_t, slots, nq, nkv, d, rot, "triton")
K.rope_store_torch(b, pos, cos, sin, kc_r, vc_r, slots, nq, nkv, d, rot)
err["rope_store"] = max((a - b).abs().max().item(), (kc_t - kc_r).abs().max().item(), (vc_t - vc_r).abs().max().item())
kc, vc = torch.randn(20, 4, nkv, d), torch.randn(20, 4, nkv, d)
q = torch.randn(3, nq, d)
bt = torch.tensor([[3, 9, 1, 17, 5, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0, 0], [4, 6, 8, 10, 12, 14, 16, 18]], dtype=torch.int32)
lens = torch.tensor([19, 1, 32], dtype=torch.int32)
ref = decode_attention_torch(q, kc, vc, bt, lens, d ** -0.5)
err["decode_attention"] = max((decode_attention_triton(q, kc, vc, bt, lens, d ** -0.5, split=s) - ref).abs().max().item()
                              for s in (64, 128))
from cloud_server.fast.linear import gemv, skinny_linear
w, bias = torch.randn(40, 300), torch.randn(40)
lin = torch.nn.functional.linear
err["skinny_linear"] = max((skinny_linear(x, w, bias, block_k=128) - lin(x, w, bias)).abs().max().item()
                           for x in (torch.randn(5, 300), torch.randn(70, 300)))
x = torch.randn(1, 300)
err["gemv"] = max((gemv(x, w, b, block_n=bn, block_k=256) - lin(x, w, b)).abs().max().item()
                  for bn in (2, 8) for b in (bias, None))
print(json.dumps(err))
"""


def test_triton_kernels_match_the_torch_formulas():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], check=False, capture_output=True, text=True, env=env,
                         timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    err = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(err) == {"rmsnorm", "add_norm_norm", "silu_mul", "rope_store",
                        "decode_attention", "skinny_linear", "gemv"}
    assert all(v < 5e-5 for v in err.values()), err


# ------------------------------------------------------------------------------------------------
# tensor parallel: two gloo ranks on CPU reproduce the unsharded model


def _tp_worker(out_path: str) -> None:
    """One torchrun rank: the unsharded fast model and this rank's shard (``cloud_server.tp.shard_model`` over
    the library's layers, then fused) compute the same prefill and decode logits."""
    from cloud_server import tp
    from cloud_server.model import load_full_model

    torch.set_num_threads(1)
    rank, world = tp.init_from_env("cpu")
    lm = load_model("tiny-glm4")
    whole, part = load_full_model(lm, "fp32"), load_full_model(lm, "fp32")
    tp.shard_model(part, rank, world)
    full = FastGLM.from_modules(whole.layers, whole.norm, whole.lm_head, whole.config, backend="torch")
    fast = FastGLM.from_modules(part.layers, part.norm, part.lm_head, part.config, backend="torch", tp=part.tp)
    s = 7
    hidden = torch.randn(s + 1, whole.hidden_size, generator=torch.Generator().manual_seed(3))
    blocks = [3, 1, 5]
    bt = tables([blocks])
    errs = []
    for model in (full, fast):
        kv = new_pool(model, 8)
        a = model.prefill(hidden[:s], torch.arange(s), slots_of(blocks, range(s)), kv, PrefillMeta([s], [s], bt))
        x = model.forward(hidden[s:], torch.tensor([s]), slots_of(blocks, [s]), kv,
                          DecodeMeta(bt, torch.tensor([s + 1], dtype=torch.int32)))
        errs.append((a, model.compute_logits(x)))
    (a0, b0), (a1, b1) = errs
    result = {"prefill": (a0 - a1).abs().max().item(), "decode": (b0 - b1).abs().max().item(),
              "qkv_rows": fast.layers[0].qkv_weight.shape[0], "vocab_rows": fast.lm_head_weight.shape[0],
              "kv_heads": fast.local_kv_heads}
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    torch.distributed.barrier()  # nobody tears the group down while a peer still talks to it
    tp.exit_rank(0)  # no interpreter teardown: gloo's threads may abort it (SIGABRT after the work is done)


def test_tensor_parallel_two_ranks_equal_one(tmp_path):
    """Two torchrun ranks (gloo). Once flaky (failed in full runs, passed alone): the ranks finished their work
    and wrote the result, then rank 0 died at interpreter teardown with "terminate called without an active
    exception" (SIGABRT from gloo's threads), which torchrun reports as a failure; the ranks now leave through
    ``tp.exit_rank``. ``--standalone`` also lets torchrun's agent bind the rendezvous port itself (port 0)
    rather than a port probed free earlier that another process could take in between."""
    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--tp-worker", str(out)]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2], env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["qkv_rows"] == (2 + 2 * 1) * 16 and r["vocab_rows"] == 256 and r["kv_heads"] == 1  # halves
    assert r["prefill"] < 1e-5 and r["decode"] < 1e-5, r


# ------------------------------------------------------------------------------------------------
# the engine adapter


def test_fast_runner_equals_the_engine_runner(tiny_bundle, monkeypatch):
    import cloud_server.fast.glm as glm_module
    from cloud_server.engine.kv_cache import KVCachePool
    from cloud_server.engine.model_runner import Batch, ModelRunner
    from cloud_server.fast.runner import FastGlmRunner, fast_path_supported
    from cloud_server.model import load_split_model

    model = load_split_model(tiny_bundle, "fp32", "cpu")
    assert not fast_path_supported(model, "cpu") and fast_path_supported(model, "cuda")  # default: CUDA only
    assert fast_path_supported(model, "cpu", True) and not fast_path_supported(model, "cuda", False)

    def pool():
        return KVCachePool(model.num_layers, 16, BLOCK, model.num_kv_heads, model.head_dim, torch.float32)

    ref = ModelRunner(model, pool())
    fast = FastGlmRunner(model, pool(), max_batch=4, max_model_len=48)
    assert fast.reserved_blocks == (0,)
    # no startup tuning on the CPU: cuBLAS/torch everywhere, the heuristic decode split
    assert fast.tuning is None and not fast.fast.linear.choice and not fast.graphs.workspace.configs
    g = torch.Generator().manual_seed(4)
    tabs = [[3, 4, 5], [7, 9, 2]]

    def batch(q_lens, starts):
        pos = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, q_lens)])
        slots = torch.cat([torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for p in range(s, s + q)])
                           for t, s, q in zip(tabs, starts, q_lens)])
        return Batch(positions=pos, slot_mapping=slots, query_lens=q_lens,
                     context_lens=[s + q for s, q in zip(starts, q_lens)], block_tables=tabs,
                     logits_indices=torch.tensor(q_lens).cumsum(0) - 1,
                     hidden=torch.randn(sum(q_lens), model.hidden_size, generator=g))

    widths = []  # block-table widths the decode kernel sees (its compiled specialization depends on them)
    real = glm_module.decode_attention
    monkeypatch.setattr(glm_module, "decode_attention",
                        lambda q, k, v, bt, *a: widths.append(bt.shape[1]) or real(q, k, v, bt, *a))
    for q_lens, starts in (([6, 3], [0, 0]), ([1, 2], [6, 3]), ([1, 1], [7, 5]), ([1, 1], [8, 6])):
        b = batch(q_lens, starts)
        a, f = ref.run(b), fast.run(b)
        assert f.dtype == torch.float32 and f.shape == a.shape
        assert torch.allclose(a, f, atol=1e-5), float((a - f).abs().max())
    # the mixed step's decode row read full-width tables [n, MAXB], as the graphs' steps do
    assert widths and set(widths) == {fast.max_blocks}


def test_flat_steps_equal_the_engine_runner(tiny_bundle):
    """Prompt chunks (with and without cached context, sampled or not) beside decode rows, run as flat steps (one
    row per position through the decode path, the sampled rows first) up to max_batch + flat_rows rows, and
    eagerly beyond: the library runner's logits either way."""
    from cloud_server.engine.kv_cache import KVCachePool
    from cloud_server.engine.model_runner import Batch, ModelRunner
    from cloud_server.fast.runner import FastGlmRunner
    from cloud_server.model import load_split_model

    model = load_split_model(tiny_bundle, "fp32", "cpu")

    def pool():
        return KVCachePool(model.num_layers, 24, BLOCK, model.num_kv_heads, model.head_dim, torch.float32)

    ref = ModelRunner(model, pool())
    fast = FastGlmRunner(model, pool(), max_batch=2, max_model_len=48, flat_rows=8, flat_steps=True)
    assert fast.graphs.max_rows == 10 and fast.graphs.flat_buckets == [10]
    g = torch.Generator().manual_seed(5)
    tabs = [[3, 4, 5, 6], [7, 9, 2, 8]]

    def batch(q_lens, starts, sample):
        pos = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, q_lens)])
        slots = torch.cat([torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for p in range(s, s + q)])
                           for t, s, q in zip(tabs, starts, q_lens)])
        ends = (torch.tensor(q_lens).cumsum(0) - 1).tolist()
        return Batch(positions=pos, slot_mapping=slots, query_lens=q_lens,
                     context_lens=[s + q for s, q in zip(starts, q_lens)], block_tables=tabs,
                     logits_indices=torch.tensor([e for e, w in zip(ends, sample) if w], dtype=torch.long),
                     hidden=torch.randn(sum(q_lens), model.hidden_size, generator=g))

    steps = [([5, 3], [0, 0], [False, True], True),  # prompts, one chunk not sampled: flat (8 rows)
             ([6, 1], [5, 3], [True, True], True),  # a chunk after cached context beside a decode row: flat
             ([1, 1], [11, 4], [True, True], False),  # decode: the decode graph path
             ([1, 11], [12, 5], [True, False], False)]  # 12 rows > max_rows: eager
    for q_lens, starts, sample, flat in steps:
        b = batch(q_lens, starts, sample)
        before = fast.graphs.steps
        a, f = ref.run(b), fast.run(b)
        assert f.shape == a.shape and torch.allclose(a, f, atol=1e-5), float((a - f).abs().max())
        assert (fast.graphs.steps > before) == (flat or sum(q_lens) == len(q_lens))


def test_decode_config_of_a_mixed_step_is_its_graph_buckets():
    from cloud_server.fast.attention import DecodeConfig, DecodeWorkspace, decode_split_tokens

    ws = DecodeWorkspace(64, 4, 8, 8192, "cpu", buckets=(1, 2, 4, 8, 16, 32, 64))
    ws.configs[64] = DecodeConfig(128, 32, 8, 3)
    assert ws.config_for(63, 2, 8192) == ws.config_for(33, 2, 8192) == DecodeConfig(128, 32, 8, 3)
    assert ws.config_for(3, 2, 8192) == DecodeConfig(decode_split_tokens(4, 2, 8192))  # bucket 4's heuristic
    assert DecodeWorkspace(8, 4, 8, 512, "cpu").config_for(5, 2, 512) == DecodeConfig(decode_split_tokens(5, 2, 512))


@pytest.mark.gpu
def test_fast_runner_on_cuda_matches_the_engine_runner():
    """On a GPU: the fast runner (Triton kernels, CUDA graphs incl. a padded bucket, a mixed step) against the
    library runner, bf16, through the engine's Batch; and the factory selects it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from cloud_server.config import EngineConfig
    from cloud_server.engine.kv_cache import KVCachePool
    from cloud_server.engine.model_runner import Batch, ModelRunner
    from cloud_server.fast.runner import FastGlmRunner, fast_runner_factory
    from cloud_server.model import load_full_model

    model = load_full_model(load_model("tiny-glm4"), "bf16", "cuda")

    def pool():
        return KVCachePool(model.num_layers, 32, BLOCK, model.num_kv_heads, model.head_dim, torch.bfloat16, "cuda")

    ref = ModelRunner(model, pool(), batch_invariant=False)
    fast = fast_runner_factory(EngineConfig(device="cuda", max_num_seqs=4, max_model_len=64))(0, model, pool())
    assert isinstance(fast, FastGlmRunner) and fast.fast.backend == "triton" and fast.graphs.use_graphs
    # the startup tuning ran before capture: every graph bucket has a measured decode-attention config
    assert fast.tuning is not None and set(fast.tuning) >= {"linear", "attention", "seconds"}
    assert set(fast.graphs.workspace.configs) == set(fast.graphs.buckets)
    assert all(f"{name}@m1" in fast.tuning["linear"] for name in ("qkv", "o", "gate_up", "down", "lm_head"))
    g = torch.Generator().manual_seed(6)
    tabs = [[3, 4, 5, 6], [7, 9, 2, 8], [11, 12, 13, 14]]

    def batch(q_lens, starts):
        pos = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, q_lens)])
        slots = torch.cat([torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for p in range(s, s + q)])
                           for t, s, q in zip(tabs, starts, q_lens)])
        return Batch(positions=pos, slot_mapping=slots, query_lens=q_lens,
                     context_lens=[s + q for s, q in zip(starts, q_lens)], block_tables=tabs[: len(q_lens)],
                     logits_indices=torch.tensor(q_lens).cumsum(0) - 1,
                     hidden=torch.randn(sum(q_lens), model.hidden_size, generator=g))

    steps = [([6, 3, 5], [0, 0, 0]), ([1, 2, 1], [6, 3, 5]), ([1, 1, 1], [7, 5, 6]), ([1, 1, 1], [8, 6, 7]),
             ([1, 1], [9, 7])]  # prefill, mixed, decode x2 (bucket 4, one padding row), decode (bucket 2)
    for q_lens, starts in steps:
        b = batch(q_lens, starts)
        a, f = ref.run(b), fast.run(b)
        err = float((a - f).norm() / a.norm())
        assert err < 3e-2, (q_lens, err)



def test_tuning_is_a_no_op_off_cuda(tiny):
    from cloud_server.fast import tuning

    _, _, fast = tiny
    kv = new_pool(fast)
    graphs = DecodeGraphs(fast, kv, max_batch=4, max_blocks_per_seq=8)
    assert not tuning.can_tune(fast)
    assert tuning.tune(fast, kv, graphs) is None
    assert not fast.linear.choice and not graphs.workspace.configs
    # timed batch sizes: only those whose chooser bucket a graph of that many rows can use
    assert tuning.linear_batches_for(1) == (1,) and tuning.linear_batches_for(64) == (1, 16, 64)
    assert tuning.linear_batches_for(128) == tuning.linear_batches_for(4096) == (1, 16, 64, 128)


def test_engine_over_a_random_back_half_matches_the_library_runner():
    """The benchmark's engine mode on CPU: a random-weight back half built from a config, S sessions through
    LLMEngine's public API (prompt chunk, then one hidden state per decode step) with the fast runner and
    with the library's runner give the same greedy tokens."""
    from cloud_server.config import EngineConfig
    from cloud_server.engine.llm_engine import LLMEngine
    from cloud_server.engine.sampling_params import SamplingParams
    from cloud_server.engine.sequence import InputChunk
    from cloud_server.fast.runner import FastGlmRunner
    from cloud_server.model import random_split_model
    from partition_tools.models import tiny_glm4v_config

    cfg = tiny_glm4v_config()
    a = random_split_model(cfg, 1, "fp32", "cpu", seed=3)
    b = random_split_model(cfg, 1, "fp32", "cpu", seed=3)
    assert a.num_layers == 3 and a.mrope and a.embed_tokens is None
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    with pytest.raises(Exception, match="split layer"):
        random_split_model(cfg, 4, "fp32", "cpu")
    ecfg = EngineConfig(device="cpu", variants=("fp32",), block_size=BLOCK, num_blocks=64, max_num_seqs=4,
                        max_num_batched_tokens=32, max_model_len=64, enable_prefix_cache=False,
                        async_scheduling=False)  # lockstep: each step() returns its own step's tokens
    engines = {"fast": LLMEngine.from_models(ecfg, {"fp32": a}, make_runner=lambda i, m, p: FastGlmRunner(
                   m, p, max_batch=4, max_model_len=64)),
               "library": LLMEngine.from_models(ecfg, {"fp32": b})}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randn(n, a.hidden_size, generator=g) for n in (9, 5, 12)]
    steps = [torch.randn(3, 1, a.hidden_size, generator=g) for _ in range(4)]
    tokens = {}
    graphs = engines["fast"].runners["fp32"].graphs
    continued, step_next = [], graphs.step_next
    graphs.step_next = lambda h: continued.append(h.shape[0]) or step_next(h)  # steps that upload only states
    fast_runner = engines["fast"].runners["fp32"]
    shortcut, continue_decode = [], fast_runner.continue_decode
    fast_runner.continue_decode = lambda h, *a: shortcut.append(h.shape[0]) or continue_decode(h, *a)  # no batch
    for name, eng in engines.items():
        params = SamplingParams(temperature=0.0, max_tokens=len(steps) + 1, ignore_eos=True)
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
        for i, p in enumerate(prompts):
            assert eng.add_request(f"r{i}", InputChunk(0, hidden=p), params) == []
        while any(not v for v in got.values()):
            for o in eng.step():
                got[o.request_id].append(o.token_id)
        for k, hid in enumerate(steps):
            for i, p in enumerate(prompts):
                assert eng.add_input(f"r{i}", InputChunk(p.shape[0] + k, hidden=hid[i])) == []
            outs = eng.step()
            assert len(outs) == 3 and all(o.error_code is None for o in outs)
            for o in outs:
                got[o.request_id].append(o.token_id)
        assert not eng.seqs  # max_tokens reached: every session finished
        tokens[name] = got
    assert tokens["fast"] == tokens["library"]
    assert isinstance(engines["fast"].runners["fp32"], FastGlmRunner)
    # decode steps 2-4 continue step 1's batch (step 4 crosses a block: the new blocks go into the graphs' tables)
    assert continued == [3, 3, 3]
    assert shortcut == [3, 3, 3]  # and the engine handed those steps over without building their batch


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--tp-worker":
    _tp_worker(sys.argv[2])
