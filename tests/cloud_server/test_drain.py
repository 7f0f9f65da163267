"""Graceful drain of a real ``autoglm-cloud serve`` process on SIGTERM: ``/ready`` turns 503, a new session is
refused (``draining``, close 1013, ``retry_after_ms``), the request in flight runs to its end with its full
output, and the process exits by itself; with a drain timeout shorter than the request, the process exits at
the timeout and the edge finishes the request on the replacement server (told by ``Drain``, then replayed):
no token lost either way. Slow-marked (server processes); the in-process twin is in test_split_endpoint.py."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import threading
import time

import httpx
import pytest
from cloud_support import edge_generate, refused_hello

from edge_client.config import RetryPolicy
from edge_client.demo import LocalCloud, free_port
from rig.link import IDEAL, LinkEmulator
from shared.manifest import Manifest

pytestmark = pytest.mark.slow

PROMPT = [9, 88, 140, 3, 61, 250, 17, 5]
N_NEW = 24
LINK = dataclasses.replace(IDEAL, rtt_ms=60.0, name="rtt-60ms")  # ~1.5 s for the request: the drain overlaps it
RETRY = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=30.0, max_retries=80, backoff_initial_s=0.1,
                    backoff_max_s=0.5)
ARGS = ["--num-blocks", "128", "--block-size", "4", "--variants", "fp32", "--device", "cpu"]


def _generate(bundle, port, on_token, sampling) -> tuple[list[int], object]:
    return edge_generate(bundle, f"ws://127.0.0.1:{port}", PROMPT, N_NEW, RETRY, on_token, **sampling)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 5}], ids=["greedy", "sampled"])
def test_sigterm_lets_the_request_in_flight_finish_then_exits(tiny_bundle, tmp_path, sampling):
    port = free_port()
    bundle_id = Manifest.load(tiny_bundle).bundle_id
    with LocalCloud(tiny_bundle, port=port, extra_args=ARGS + ["--drain-timeout-s", "30"],
                    log_path=tmp_path / "a.log") as cloud, LinkEmulator(port, LINK) as link:
        reference, _ = _generate(tiny_bundle, link.port, lambda n: None, sampling)
        seen = {}

        def on_token(n):
            if n == 4:
                cloud.proc.send_signal(signal.SIGTERM)
                time.sleep(0.3)
                seen["ready"] = httpx.get(cloud.http_url + "/ready", timeout=5).status_code
                seen["late"] = asyncio.run(refused_hello(f"ws://127.0.0.1:{port}/v1/split", bundle_id))

        t0 = time.monotonic()
        tokens, _ = _generate(tiny_bundle, link.port, on_token, sampling)
        code = cloud.proc.wait(30)
        took = time.monotonic() - t0
    assert tokens == reference  # the request in flight ran to its end
    assert seen["ready"] == 503
    err, close = seen["late"]
    assert err.code == "draining" and err.retry_after_ms and close == 1013
    assert code == 0 and took < 30  # exited by itself, well before the drain timeout


def test_a_drain_timeout_shorter_than_the_request_hands_it_to_the_replacement(tiny_bundle, tmp_path):
    port = free_port()
    sampling = {"temperature": 0.9, "seed": 11}
    with LocalCloud(tiny_bundle, port=port, extra_args=ARGS, log_path=tmp_path / "ref.log"), \
            LinkEmulator(port, LINK) as link:
        reference, _ = _generate(tiny_bundle, link.port, lambda n: None, sampling)
    first = LocalCloud(tiny_bundle, port=port, extra_args=ARGS + ["--drain-timeout-s", "0.5"],
                       log_path=tmp_path / "b.log").start()
    replacement = LocalCloud(tiny_bundle, port=port, extra_args=ARGS, log_path=tmp_path / "c.log")
    exited = {}

    def drain_then_replace():
        t = time.monotonic()
        first.proc.send_signal(signal.SIGTERM)
        exited["code"], exited["s"] = first.proc.wait(30), time.monotonic() - t
        replacement.start()  # the same address: the phone's retries find it

    worker = threading.Thread(target=drain_then_replace, daemon=True)

    def on_token(n):
        if n == 4:
            worker.start()

    with LinkEmulator(port, LINK) as link:
        try:
            tokens, stats = _generate(tiny_bundle, link.port, on_token, sampling)
            worker.join(60)
        finally:
            replacement.stop()
    assert exited["code"] == 0 and exited["s"] < 10  # the drain timeout bounds the exit
    assert tokens == reference and stats.replays >= 1  # finished on the replacement, same seeded tokens
