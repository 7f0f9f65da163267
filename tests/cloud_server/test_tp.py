"""Tensor parallel over two ranks (gloo on CPU): the same tokens as one rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cloud_support import OnnxFront, Phone, drive

from cloud_server import tp
from cloud_server.config import ConfigError, EngineConfig
from cloud_server.engine.llm_engine import LLMEngine
from cloud_server.model import load_split_model
from cloud_server.runtime import free_port


def _phones(bundle, n=4):
    g = torch.Generator().manual_seed(11)
    return [Phone(f"p{i}", torch.randint(4, 512, (5 + 3 * i,), generator=g).tolist(), OnnxFront(bundle),
                  max_tokens=10, arrive=i) for i in range(n)]


def test_tp2_over_gloo_gives_the_same_tokens_as_tp1(tiny_bundle):
    cfg = EngineConfig(num_blocks=64, block_size=4)
    single = LLMEngine.from_models(cfg, {"fp32": load_split_model(tiny_bundle, "fp32")})
    ref = _phones(tiny_bundle)
    drive(single, ref)

    port = free_port()
    workers = tp.launch_workers(2, "127.0.0.1", port, "bundle", str(tiny_bundle), ["fp32"], "cpu",
                                cfg.num_blocks, cfg.block_size)
    try:
        tp.init_group(0, 2, "127.0.0.1", port, "cpu")
        [model] = tp.load_models("bundle", str(tiny_bundle), ["fp32"], "cpu", 0, 2)
        assert model.num_kv_heads == 1 and model.layers[0].self_attn.k_proj.out_features == 16  # half of 2 x 16
        dist.barrier()
        runner = None

        def make_runner(i, m, pool):
            nonlocal runner
            runner = tp.TPModelRunner(m, pool, variant_idx=i)
            return runner

        sharded = LLMEngine.from_models(cfg, {"fp32": model}, make_runner=make_runner)
        got = _phones(tiny_bundle)
        drive(sharded, got)
        runner.stop_workers()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for w in workers:
            try:
                assert w.wait(timeout=60) == 0
            finally:
                if w.poll() is None:
                    w.kill()
    assert [p.tokens for p in got] == [p.tokens for p in ref]
    assert all(len(p.tokens) > 0 for p in got)


def test_shapes_that_do_not_divide_are_refused(tiny_bundle):
    model = load_split_model(tiny_bundle, "fp32")
    with pytest.raises(ConfigError, match="not divisible by 3"):
        tp.shard_model(model, 0, 3)


def test_server_with_tp2_serves_the_split_endpoint(tiny_bundle, tiny_lm):
    """``autoglm-cloud serve --tp 2``: rank 0 owns the network and the scheduler, rank 1 runs its shard."""
    import asyncio

    from cloud_support import EdgeSim, ServerThread, greedy_reference

    from cloud_server.app import create_app
    from cloud_server.config import ServerConfig
    from cloud_server.runtime import CloudRuntime
    from shared.manifest import Manifest

    rt = CloudRuntime(ServerConfig(bundle=tiny_bundle, engine=EngineConfig(tp=2, num_blocks=32, block_size=4)))
    rt.start()
    try:
        assert len(rt._workers) == 1 and rt._workers[0].poll() is None
        prompt = [7, 99, 300, 12, 5, 41]
        with ServerThread(create_app(rt)) as srv:
            async def main():
                edge = EdgeSim(srv.ws_url, tiny_bundle, Manifest.load(tiny_bundle).bundle_id)
                await edge.connect()
                out = await edge.generate("r", prompt, 8)
                await edge.close()
                return out

            tokens, _, _ = asyncio.run(main())
        assert tokens == greedy_reference(tiny_lm.model, prompt, 8, [2, 3])
    finally:
        workers = list(rt._workers)
        rt.stop()
    assert all(w.poll() == 0 for w in workers)  # stopped cleanly
