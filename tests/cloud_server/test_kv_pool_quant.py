"""The 8-bit KV pool (``kv_cache_dtype`` int8 / fp8 / int8v): quantization error, storage and capacity, the paged
attention on it against its formula, and the engine's numbers on it beside the 32-bit pool (tiny-glm4, random
weights)."""

from __future__ import annotations

import pytest
import torch
from cloud_support import Phone, boundary, drive, edge_front

from cloud_server.attention import AttentionContext, attention_context, paged_attention_forward
from cloud_server.config import KV_CACHE_DTYPES, ConfigError, EngineConfig
from cloud_server.engine.kv_cache import KVCachePool
from cloud_server.engine.llm_engine import LLMEngine
from cloud_server.engine.model_runner import ModelRunner, build_batch
from cloud_server.engine.sequence import InputChunk
from cloud_server.kv_quant import POOL_LAYOUTS, as_bytes, dequantize, quantize, rotation, storage_dtypes
from cloud_server.model import load_split_model


@pytest.mark.parametrize("dtype, rel", [(torch.int8, 1 / 254), (torch.float8_e4m3fn, 1 / 16)])
def test_quantize_round_trip_error_is_bounded_by_the_format(dtype, rel):
    x = torch.randn(64, 2, 32) * torch.logspace(-3, 2, 64)[:, None, None]  # [N, KVH, D], rows of every size
    x[3] = 0.0  # an all-zero row needs a nonzero scale
    q, scale = quantize(x, dtype)
    assert q.dtype == dtype and scale.shape == (64, 2) and scale.dtype == torch.float32
    y = dequantize(as_bytes(q), scale, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)  # [N, KVH, 1]
    # int8: half a step of amax / 127; e4m3: 3 mantissa bits, relative to the value (amax bounds it)
    assert ((y - x).abs() <= rel * amax * (1 + 1e-5) + 1e-12).all()
    assert torch.equal(y[3], torch.zeros_like(y[3]))


def test_rotation_is_orthonormal_and_spreads_a_channel_outlier():
    h = rotation(64, "cpu", torch.float32)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-6) and rotation(96, "cpu", torch.float32) is None
    x = torch.randn(256, 1, 64)
    x[..., 5] *= 50  # one outlier channel sets every token's scale
    plain = quantize(x, torch.int8)
    turned = quantize(x @ h, torch.int8)
    err_plain = (dequantize(*plain, torch.float32) - x).norm()
    err_turned = (dequantize(*turned, torch.float32) @ h - x).norm()
    assert err_turned < 0.5 * err_plain


@pytest.mark.parametrize("kv, k_element, v_element", [("auto", 4, 4), ("int8", 1, 1), ("fp8", 1, 1), ("int8v", 4, 1)])
def test_pool_storage_and_bytes_per_block(kv, k_element, v_element):
    pool = KVCachePool(num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8,
                       dtype=torch.float32, kv_cache_dtype=kv)
    assert pool.k.shape == pool.v.shape == (3, 40, 2, 8)
    assert (pool.k.element_size(), pool.v.element_size()) == (k_element, v_element)
    # an 8-bit tensor has its float32 scales [L, slots, KVH]; one in the compute dtype none
    assert (pool.k_scale is not None, pool.v_scale is not None) == (k_element == 1, v_element == 1)
    assert all(sc is None or sc.shape == (3, 40, 2) for sc in (pool.k_scale, pool.v_scale))
    per_token_head = sum(8 * e + (4 if e == 1 else 0) for e in (k_element, v_element))  # D elements (+ a scale)
    assert pool.bytes_per_block == 3 * 4 * 2 * per_token_head
    assert pool.nbytes == 10 * pool.bytes_per_block


def test_every_configured_kv_cache_dtype_has_a_layout():
    assert tuple(POOL_LAYOUTS) == KV_CACHE_DTYPES
    assert storage_dtypes("int8v", torch.bfloat16) == (torch.bfloat16, torch.int8)
    assert storage_dtypes("int8", torch.bfloat16) == (torch.int8, torch.int8)
    assert EngineConfig(kv_cache_dtype="int8v").kv_cache_dtype == "int8v"
    with pytest.raises(ConfigError, match="int8v"):  # the message lists the choices
        EngineConfig(kv_cache_dtype="int8k")


def test_serve_takes_int8v_from_the_flag_and_the_environment(tmp_path):
    from cloud_server.cli import build_parser, resolve

    args = build_parser().parse_args(["serve", str(tmp_path), "--device", "cpu", "--kv-cache-dtype", "int8v"])
    assert resolve(args, environ={}).engine.kv_cache_dtype == "int8v"
    args = build_parser().parse_args(["serve", str(tmp_path), "--device", "cpu"])
    assert resolve(args, environ={"AUTOGLM_CLOUD_KV_CACHE_DTYPE": "int8v"}).engine.kv_cache_dtype == "int8v"


def test_bf16_vs_int8_capacity_at_head_dim_128():
    """The figures docs/performance.md uses: int8 + float32 scales take 132 / 256 of bf16's bytes; int8v (bf16
    keys, int8 values + scales) (256 + 132) / 512."""
    args = dict(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    bf16, int8 = KVCachePool(**args), KVCachePool(**args, kv_cache_dtype="int8")
    int8v = KVCachePool(**args, kv_cache_dtype="int8v")
    assert int8.bytes_per_block / bf16.bytes_per_block == pytest.approx(132 / 256)
    assert int8v.bytes_per_block / bf16.bytes_per_block == pytest.approx(388 / 512)
    assert int8v.bytes_per_block == 2 * 16 * 2 * (2 * 128 + 128 + 4)  # layers x tokens x KV heads x bytes


class _Layer:  # what paged_attention_forward reads of the library's attention module
    layer_idx = 1


@pytest.mark.parametrize("batch_invariant", [True, False])
@pytest.mark.parametrize("kv", ["int8", "int8v"])
def test_paged_attention_on_an_8bit_pool_is_attention_over_the_rounded_pool(kv, batch_invariant):
    """The generic runner's attention on a ``kv`` pool: a prefill chunk then a decode step of two sequences (per
    sequence, or one padded batch: ``batch_invariant`` False) equal SDPA over the keys and values the pool's rule
    gives back (int8v: the exact keys, the values rounded in the rotated basis and turned back), to fp32 rounding;
    int8v's stored keys are the keys themselves."""
    torch.manual_seed(0)
    kvh, rep, d, bs = 2, 3, 16, 4
    pool = KVCachePool(2, 8, bs, kvh, d, torch.float32, kv_cache_dtype=kv)
    h = rotation(d, "cpu", torch.float32)
    seq_slots = [torch.arange(0, 6), torch.arange(8, 12)]  # prompts of 5 and 3 tokens, then one decode step each
    keys = {i: torch.randn(6 if i == 0 else 4, kvh, d) * 3 for i in range(2)}
    vals = {i: torch.randn(6 if i == 0 else 4, kvh, d) * 3 for i in range(2)}
    keys[0][:, :, 2] *= 20  # an outlier channel

    def rounded(x, quantized):  # what the pool gives back for x [N, KVH, D]
        return dequantize(*quantize(x @ h, torch.int8), torch.float32) @ h if quantized else x

    def step(qlen: list[int], starts: list[int]):
        t = sum(qlen)
        q = torch.randn(1, kvh * rep, t, d)
        k = torch.cat([keys[i][s:s + n] for i, (s, n) in enumerate(zip(starts, qlen))]).transpose(0, 1)[None]
        v = torch.cat([vals[i][s:s + n] for i, (s, n) in enumerate(zip(starts, qlen))]).transpose(0, 1)[None]
        slots = torch.cat([seq_slots[i][s:s + n] for i, (s, n) in enumerate(zip(starts, qlen))])
        ctx_lens = [s + n for s, n in zip(starts, qlen)]
        ctx = AttentionContext(pool.k, pool.v, slots, qlen, ctx_lens, [seq_slots[i][:c] for i, c in enumerate(ctx_lens)],
                               batch_invariant=batch_invariant, k_scale=pool.k_scale, v_scale=pool.v_scale)
        with attention_context(ctx):
            out, _ = paged_attention_forward(_Layer(), q, k, v, None, scaling=d ** -0.5)
        a = 0
        for i, (n, c) in enumerate(zip(qlen, ctx_lens)):
            kr = rounded(keys[i][:c], kv == "int8").transpose(0, 1).repeat_interleave(rep, 0)  # [Hq, c, D]
            vr = rounded(vals[i][:c], True).transpose(0, 1).repeat_interleave(rep, 0)
            mask = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
            ref = torch.nn.functional.scaled_dot_product_attention(q[0, :, a:a + n], kr, vr, attn_mask=mask,
                                                                  scale=d ** -0.5)  # [Hq, n, D]
            assert (out[0, a:a + n] - ref.transpose(0, 1)).abs().max() < 1e-5
            a += n

    step([5, 3], [0, 0])  # prefill
    step([1, 1], [5, 3])  # decode
    written = torch.cat(seq_slots)
    assert pool.v.dtype == torch.int8 and pool.v_scale[1, written].min() > 0
    if kv == "int8v":  # the keys as they came, in the plain basis; no key scales
        assert pool.k.dtype == torch.float32 and pool.k_scale is None
        assert torch.equal(pool.k[1, seq_slots[0]], keys[0]) and torch.equal(pool.k[1, seq_slots[1]], keys[1])


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVCachePool(1, 2, 4, 1, 8, torch.float32, kv_cache_dtype="int4")


def _logits(runner: ModelRunner, front, prompt: list[int], follow: list[int]) -> torch.Tensor:
    """Logits [1 + len(follow), V]: after the prompt's prefill, then after each teacher-forced decode step."""
    table = list(range(runner.pool.num_blocks))
    bs = runner.pool.block_size
    out = [runner.run(build_batch([InputChunk(0, hidden=boundary(front, prompt))], [table], bs, [True]))]
    for i, tok in enumerate(follow):
        chunk = InputChunk(len(prompt) + i, hidden=boundary(front, [tok]))
        out.append(runner.run(build_batch([chunk], [table], bs, [True])))
    return torch.cat(out)


@pytest.mark.parametrize("kv", ["int8", "fp8", "int8v"])
def test_runner_logits_on_an_8bit_pool_stay_close_to_the_fp32_pool(tiny_bundle, kv):
    model = load_split_model(tiny_bundle, "fp32")
    runners = {d: ModelRunner(model, KVCachePool(model.num_layers, 16, 4, model.num_kv_heads, model.head_dim,
                                                 model.dtype, kv_cache_dtype=d)) for d in ("auto", kv)}
    prompt, follow = list(range(5, 30)), [7, 99, 3, 250, 41, 8, 17, 300]
    ref, got = (_logits(r, edge_front(tiny_bundle), prompt, follow) for r in runners.values())
    assert runners[kv].pool.v.dtype != torch.float32  # really stored in 8 bits
    err = (got - ref).abs().max().item()
    spread = (ref.max(-1).values - ref.min(-1).values).min().item()
    # measured: int8 6.8e-4, fp8 3.0e-3, int8v 6.8e-4 of logits spanning at least 0.9 per row (random weights)
    assert 0 < err < {"int8": 0.02, "fp8": 0.1, "int8v": 0.02}[kv] * spread
    if kv == "int8v":  # the first layer's keys come from the boundary states alone: exactly the fp32 pool's
        assert torch.equal(runners["int8v"].pool.k[0], runners["auto"].pool.k[0])


@pytest.mark.parametrize("arm", ["int8", "int8v"])
def test_engine_greedy_tokens_on_an_8bit_pool(tiny_bundle, arm):
    """Greedy answers of 8 staggered sessions on an 8-bit pool beside the fp32 pool, batched as served."""
    prompts = [list(range(4 + i, 20 + 3 * i)) for i in range(8)]
    answers, block_bytes = {}, {}
    for kv in ("auto", arm):
        cfg = EngineConfig(num_blocks=128, block_size=4, kv_cache_dtype=kv)
        eng = LLMEngine.from_models(cfg, {"fp32": load_split_model(tiny_bundle, "fp32")})
        phones = [Phone(f"p{i}", p, edge_front(tiny_bundle), max_tokens=12, arrive=i) for i, p in enumerate(prompts)]
        drive(eng, phones)
        answers[kv] = [p.tokens for p in phones]
        assert eng.num_used_blocks() == 0
        pool = eng.runners["fp32"].pool
        block_bytes[kv], head_dim = pool.bytes_per_block, pool.k.shape[-1]
    # fp32 D x 4 B -> D + 4 per 8-bit tensor
    per_head = {"int8": 2 * (head_dim + 4), "int8v": 4 * head_dim + head_dim + 4}[arm]
    assert block_bytes[arm] * 2 * 4 * head_dim == block_bytes["auto"] * per_head
    # measured: 8 of 8 identical (int8: 7 before the rotation: random weights have near-tied logits, so one may flip)
    same = sum(a == b for a, b in zip(answers["auto"], answers[arm]))
    assert same >= 7, (answers["auto"], answers[arm])


def test_the_quality_bench_emulates_the_int8_pool_and_only_what_its_scheme_names(tiny_bundle):
    """``kv_quant_pool_bench.py --emulate``: ``8:D:0:kv`` (the int8 pool's rule, one scale per head of D, as fake
    quantization on the fp32 pool) gives the int8 pool's logits up to float rounding; ``v`` alone leaves the keys
    exact; bad specs are refused."""
    from bench_support import load_bench

    bench = load_bench("kv_quant_pool_bench")
    model = load_split_model(tiny_bundle, "fp32")
    d = model.head_dim

    def run(kv: str, scheme: str | None = None) -> torch.Tensor:
        pool = KVCachePool(model.num_layers, 16, 4, model.num_kv_heads, model.head_dim, model.dtype, kv_cache_dtype=kv)
        runner = ModelRunner(model, pool)
        prompt, follow = list(range(5, 30)), [7, 99, 3, 250, 41]
        if scheme is None:
            return _logits(runner, edge_front(tiny_bundle), prompt, follow), pool
        with bench.emulated(scheme, model.head_dim):
            return _logits(runner, edge_front(tiny_bundle), prompt, follow), pool

    ref, _ = run("auto")
    int8, _ = run("int8")
    emu, pool = run("auto", f"8:{d}:0:kv")
    assert pool.k.dtype == torch.float32  # emulated: stored in fp32
    spread = (ref.max(-1).values - ref.min(-1).values).min().item()
    assert (emu - ref).abs().max() > 1e-5  # the writes were rounded
    assert (emu - int8).abs().max() < 0.05 * (int8 - ref).abs().max() + 1e-4 * spread
    values_only, pool = run("auto", f"8:{d}:0:v")
    keys = pool.k.clone()
    _, exact = run("auto")
    # the first layer's keys come from the boundary states alone (later layers' see the rounded values upstream)
    assert torch.equal(keys[0], exact.k[0]) and not torch.equal(pool.v[0], exact.v[0])
    assert (values_only - ref).abs().max() > 0
    for bad in ("8:64", "9:64:0:kv", "8:0:0:kv", "8:64:0:q", "x:64:0:kv"):
        with pytest.raises(ValueError, match="--emulate"):
            bench.parse_scheme(bad)
    with pytest.raises(ValueError, match="divide"):
        with bench.emulated(f"8:{d - 1}:0:kv", d):
            pass
