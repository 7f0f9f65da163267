"""The GPU benchmark's engine workloads (``bench/engine_workloads.py``) on a tiny random GLM-4.1V half on CPU:
the code ``bench/gpu_session.sh engine`` / ``extras`` runs on the H200, small."""

from __future__ import annotations

import torch
from bench_support import load_bench

from cloud_server.config import EngineConfig
from cloud_server.engine.llm_engine import LLMEngine
from cloud_server.model import random_split_model
from partition_tools.models import tiny_glm4v_config

wl = load_bench("engine_workloads")


def _engine(**kw):
    model = random_split_model(tiny_glm4v_config(), 1, "fp32", "cpu", seed=3)
    cfg = EngineConfig(block_size=4, num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                       enable_prefix_cache=False, **kw)
    return LLMEngine.from_models(cfg, {"fp32": model}), model.hidden_size


def _inputs(h):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(12, h, generator=g) for _ in range(2)], [torch.randn(1, h, generator=g) for _ in range(4)]


def test_lockstep_tokens_are_the_same_with_overlap_on_and_off():
    engine, h = _engine()
    prompts, steps_in = _inputs(h)
    tokens = {}
    for overlap in (True, False):
        engine.config.async_scheduling = overlap
        got: list = []
        r = wl.lockstep(engine, 3, prompts, steps_in, 5, f"o{overlap}", lambda: None, tokens=got)
        tokens[overlap] = got
        assert r["tokens_per_s"] > 0 and r["step_calls_per_token"] == (2 if overlap else 1)
    assert tokens[True] == tokens[False] and all(len(t) == 6 for t in tokens[True])


def test_sampled_vs_greedy_and_the_prefill_stall_run():
    engine, h = _engine()
    prompts, steps_in = _inputs(h)
    r = wl.sampled_vs_greedy(engine, 3, prompts, steps_in, 4, lambda: None, rounds=1)
    assert r["sampled_over_greedy"] > 0
    long_prompt = torch.randn(100, h)
    r = wl.prefill_stall(engine, 3, prompts, steps_in, long_prompt, [0, 8], 16, 2, lambda: None, served=(32, 0))
    assert list(r["chunks"]) == ["default", "0", "8"]
    assert (r["chunks"]["default"]["budget"], r["chunks"]["default"]["cap"]) == (32, 0)
    assert r["chunks"]["default"]["arrival"]["long_ttft_steps"] >= 4  # 100 positions, 32 - 3 per step at most
    assert r["chunks"]["0"]["arrival"]["long_ttft_steps"] <= 2  # 100 positions fit the budget of 64 in two steps
    # while the others decode a step holds max_num_seqs + 8 = 12 positions: 9 for the prompt beside their 3 rows,
    # each chunk riding on their step (none runs between two of them)
    assert r["chunks"]["8"]["arrival"]["long_ttft_steps"] == 12
    assert engine.config.prefill_chunk_while_decoding == EngineConfig().prefill_chunk_while_decoding  # restored
    assert engine.config.max_num_batched_tokens == 64
    assert not engine.seqs and engine.num_used_blocks() == 0


def test_lockstep_model_runs_every_session_to_its_last_token():
    """``bench/lockstep_model.py``: the real AsyncEngine against the simulated device and phones, small."""
    lm = load_bench("lockstep_model")
    r = lm.run_config(sessions=4, tokens=6, rt_median_ms=0.5, rt_p99_ms=1.0, async_scheduling=True, gather_max_s=None,
                      hidden=32, prompt=8)
    assert r["steady_tokens_per_s"] > 0 and r["device_steps"] >= 6  # a prompt step, then >= one step per token
    assert 0 < r["of_limit"] <= 1.05 and r["rows_per_step_median"] <= 4
    assert lm.device_ms(1) == lm.DEVICE_MS[0][1] and abs(lm.device_ms(36) - (4.175 + 4.794) / 2) < 1e-9
