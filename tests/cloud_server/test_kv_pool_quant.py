"""The 8-bit KV pool (``kv_cache_dtype`` int8 / fp8): quantization error, storage and capacity, and the engine's
numbers on it beside the 32-bit pool (tiny-glm4, random weights)."""

from __future__ import annotations

import pytest
import torch
from cloud_support import Phone, boundary, drive, edge_front

from cloud_server.config import EngineConfig
from cloud_server.engine.kv_cache import KVCachePool
from cloud_server.engine.llm_engine import LLMEngine
from cloud_server.engine.model_runner import ModelRunner, build_batch
from cloud_server.engine.sequence import InputChunk
from cloud_server.kv_quant import as_bytes, dequantize, quantize, rotation
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


@pytest.mark.parametrize("kv, element, scales", [("auto", 4, False), ("int8", 1, True), ("fp8", 1, True)])
def test_pool_storage_and_bytes_per_block(kv, element, scales):
    pool = KVCachePool(num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8,
                       dtype=torch.float32, kv_cache_dtype=kv)
    assert pool.k.shape == (3, 40, 2, 8) and pool.k.element_size() == element
    assert (pool.k_scale is not None) == scales
    per_token_head = 2 * (8 * element + (4 if scales else 0))  # K and V, each D elements + a float32 scale
    assert pool.bytes_per_block == 3 * 4 * 2 * per_token_head
    assert pool.nbytes == 10 * pool.bytes_per_block


def test_bf16_vs_int8_capacity_at_head_dim_128():
    """The figure docs/performance.md uses: int8 + float32 scales take 132 / 256 of bf16's bytes."""
    args = dict(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    bf16, int8 = KVCachePool(**args), KVCachePool(**args, kv_cache_dtype="int8")
    assert int8.bytes_per_block / bf16.bytes_per_block == pytest.approx(132 / 256)


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


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_runner_logits_on_an_8bit_pool_stay_close_to_the_fp32_pool(tiny_bundle, kv):
    model = load_split_model(tiny_bundle, "fp32")
    runners = {d: ModelRunner(model, KVCachePool(model.num_layers, 16, 4, model.num_kv_heads, model.head_dim,
                                                 model.dtype, kv_cache_dtype=d)) for d in ("auto", kv)}
    prompt, follow = list(range(5, 30)), [7, 99, 3, 250, 41, 8, 17, 300]
    ref, got = (_logits(r, edge_front(tiny_bundle), prompt, follow) for r in runners.values())
    assert runners[kv].pool.k.dtype != torch.float32  # really stored in 8 bits
    err = (got - ref).abs().max().item()
    spread = (ref.max(-1).values - ref.min(-1).values).min().item()
    # measured: int8 6e-4, fp8 2.7e-3 of logits spanning at least 0.9 per row (random weights)
    assert 0 < err < {"int8": 0.02, "fp8": 0.1}[kv] * spread


def test_engine_greedy_tokens_on_an_int8_pool(tiny_bundle):
    """Greedy answers of 8 staggered sessions on the int8 pool beside the fp32 pool, batched as served."""
    prompts = [list(range(4 + i, 20 + 3 * i)) for i in range(8)]
    answers, block_bytes = {}, {}
    for kv in ("auto", "int8"):
        cfg = EngineConfig(num_blocks=128, block_size=4, kv_cache_dtype=kv)
        eng = LLMEngine.from_models(cfg, {"fp32": load_split_model(tiny_bundle, "fp32")})
        phones = [Phone(f"p{i}", p, edge_front(tiny_bundle), max_tokens=12, arrive=i) for i, p in enumerate(prompts)]
        drive(eng, phones)
        answers[kv] = [p.tokens for p in phones]
        assert eng.num_used_blocks() == 0
        pool = eng.runners["fp32"].pool
        block_bytes[kv], head_dim = pool.bytes_per_block, pool.k.shape[-1]
    assert block_bytes["int8"] * 4 * head_dim == block_bytes["auto"] * (head_dim + 4)  # fp32 D x 4 B -> D + 4
    # measured: 8 of 8 identical (7 before the rotation: random weights have near-tied logits, so one may flip)
    same = sum(a == b for a, b in zip(answers["auto"], answers["int8"]))
    assert same >= 7, (answers["auto"], answers["int8"])


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
