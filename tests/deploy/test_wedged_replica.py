"""A replica that hangs without dying: its engine thread never comes back from a step (a wedged GPU, a deadlock),
while its event loop answers ``/health`` and ``/ready`` 200 and sends every queued request its progress frames.
No probe replaced it and no phone gave up: every session on it waited for ever. An engine step running for over
``--engine-stall-s`` is a dead engine (``cloud_server.engine.async_engine.AsyncEngine.dead``): ``/ready`` turns
503 naming it, the server stops with exit status 1 to be restarted, and its phones replay on another replica.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from deploy_support import ROOT, Router, http_get, metric_sum, routing_bench
from model_support import hf_greedy

from cloud_server.config import EngineConfig
from cloud_server.engine.async_engine import AsyncEngine, EngineDeadError
from cloud_server.engine.llm_engine import LLMEngine
from cloud_server.engine.sampling_params import SamplingParams
from cloud_server.engine.sequence import InputChunk
from cloud_server.model import load_split_model
from edge_client.client import EdgeClient
from edge_client.config import RetryPolicy
from rig.link import LinkEmulator
from shared.link_profiles import LinkProfile

N_NEW = 60
PHONE_LINK = LinkProfile("test-20ms", rtt_ms=20.0, jitter_ms=0.0, down_mbps=1000.0, up_mbps=1000.0, loss=0.0)
RETRY = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=30.0, backoff_initial_s=0.1, backoff_max_s=0.5)


def test_an_engine_step_that_never_returns_is_a_dead_engine(tiny_glm4_fp32_bundle):
    llm = LLMEngine.from_models(EngineConfig(num_blocks=32, block_size=4),
                                {"fp32": load_split_model(tiny_glm4_fp32_bundle, "fp32")})
    release, real_step = threading.Event(), llm.step
    llm.step = lambda: (release.wait(), real_step())[1]  # wedged until released
    ae = AsyncEngine(llm, stall_s=0.5).start()
    try:
        ae.add_request("x", lambda out: None, InputChunk(0, hidden=torch.randn(3, 64)), SamplingParams())
        assert ae.alive  # a step under way is no stall
        deadline = time.monotonic() + 10
        while ae.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not ae.alive and "an engine step has run for over 0.5 s" in ae.dead
        with pytest.raises(EngineDeadError):  # the server's watch stops it; nothing new is taken meanwhile
            ae.add_request("y", lambda out: None, InputChunk(0, hidden=torch.randn(3, 64)), SamplingParams())
    finally:
        release.set()
        ae.shutdown()


WEDGEABLE = """
import os, sys, time
import cloud_server.engine.llm_engine as m
step = m.LLMEngine.step
def wedged(self):
    while os.path.exists(sys.argv[1]):  # the injected fault: a step that does not come back
        time.sleep(0.05)
    return step(self)
m.LLMEngine.step = wedged
from cloud_server.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_replica_whose_engine_wedges_stops_and_its_phones_finish_on_another(
        tiny_glm4_fp32_bundle, tiny_glm4_lm, replica_pool, nginx_bin, tmp_path, workers):
    """With ``--workers 2`` the engine process told its workers 'dead' through the engine thread, the one stuck in
    the step: they never heard it, their phones' requests ended 'internal' at the drain timeout, not replayed."""
    [healthy] = replica_pool.get(1)
    wedge = tmp_path / "wedge"
    port = routing_bench.free_port()
    with open(tmp_path / "wedged.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", WEDGEABLE, str(wedge), "serve", str(tiny_glm4_fp32_bundle),
                                 "--port", str(port), "--engine-stall-s", "2", "--log-level", "warning",
                                 "--workers", str(workers)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    rng = np.random.RandomState(5)
    prompts = [[int(t) for t in rng.randint(4, 512, 20 + 3 * i)] for i in range(2)]
    want = [hf_greedy(tiny_glm4_lm.model, p, N_NEW) for p in prompts]
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "wedged.log").read_text()[-2000:]
            try:
                if http_get(url + "/ready")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        with Router(nginx_bin, tmp_path / "nginx", [f"127.0.0.1:{port}", f"127.0.0.1:{healthy.port}"]) as router, \
                LinkEmulator(router.port, PHONE_LINK) as phones:
            clients = [EdgeClient(tiny_glm4_fp32_bundle, f"ws://127.0.0.1:{phones.port}/v1/split", codec="fp16",
                                  retry=RETRY) for _ in prompts]
            try:
                gens = [c.generate(prompt_ids=p, max_tokens=N_NEW) for c, p in zip(clients, prompts)]
                streams = [g.iter_tokens() for g in gens]
                for s in streams:
                    next(s)
                assert metric_sum(http_get(url + "/metrics")[1], "autoglm:sessions_open") == 1  # round-robin
                wedge.touch()  # the wedged replica's engine never finishes its next step
                ready = http_get(url + "/ready")
                while ready[0] == 200:  # until the stall is seen (then the server stops listening)
                    time.sleep(0.05)
                    try:
                        ready = http_get(url + "/ready")
                    except OSError:  # it stopped listening between two polls (a loaded host): its log says why
                        ready = (None, (tmp_path / "wedged.log").read_text())
                for s in streams:
                    for _ in s:
                        pass
            finally:
                for c in clients:
                    c.close()
        assert ready[0] in (503, None) and "an engine step has run for over 2 s" in ready[1], ready
        assert proc.wait(timeout=60) == 1  # stopped to be restarted, not serving probes with no engine
        assert [g.token_ids for g in gens] == want  # every token, the wedged replica's session replayed elsewhere
        assert sorted(g.stats.replays for g in gens) == [0, 1]
    finally:
        wedge.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
