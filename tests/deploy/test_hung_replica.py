"""A replica that hangs - it takes connections and answers nothing (its event loop blocked; here SIGSTOP) - behind
the router. nginx sees no error on it (the phone gives up first: a 499, no upstream failure), so it never skips it,
and every reconnect of a phone whose route key hashes there went to it again: the phone failed 'unreachable' beside
a healthy replica. An upgrade left unanswered is now :class:`edge_client.transport.NoAnswer`, and the next upgrade
goes without the route key, which nginx balances onto another replica.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import numpy as np
import pytest
from deploy_support import Router, metric_sum
from model_support import hf_greedy

from edge_client.client import EdgeClient
from edge_client.config import RetryPolicy
from edge_client.transport import Link, NoAnswer, ServerBusy
from shared import protocol as P

# a hung link is seen within ~2 s (a missed pong), an unanswered upgrade within 2 s
RETRY = RetryPolicy(connect_timeout_s=2.0, reply_timeout_s=30.0, reconnect_window_s=20.0, backoff_initial_s=0.1,
                    backoff_max_s=0.5, keepalive_interval_s=1.0, keepalive_timeout_s=1.0)


def test_an_upgrade_left_unanswered_is_no_answer():
    """A server that accepts the connection and sends nothing: the upgrade times out as NoAnswer, a ServerBusy (the
    next upgrade goes without the route key), where a refused connection stays a plain LinkDown."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        link = Link(f"ws://127.0.0.1:{port}/v1/split", None, RetryPolicy(connect_timeout_s=0.5, max_retries=0))
        t0 = time.monotonic()
        with pytest.raises(NoAnswer) as e:
            asyncio.run(link.connect(P.Hello(bundle_id="b", codecs=["fp16"])))
    assert isinstance(e.value, ServerBusy) and time.monotonic() - t0 < 5
    with pytest.raises(Exception) as refused:  # nothing listens there now
        asyncio.run(link.connect(P.Hello(bundle_id="b", codecs=["fp16"])))
    assert not isinstance(refused.value, NoAnswer)


@pytest.fixture
def replicas(replica_pool):
    """Two live, idle replicas of the deploy tests' pool (tests/deploy/conftest.py); the test kills the one it hangs."""
    return replica_pool.get(2)


def test_a_phone_pinned_to_a_hung_replica_moves_to_the_other(tiny_glm4_fp32_bundle, tiny_glm4_lm, replicas, nginx_bin,
                                                              tmp_path):
    system = [int(t) for t in np.random.RandomState(21).randint(4, 512, 32)]
    prompt = system + [9, 8, 7]
    want = hf_greedy(tiny_glm4_lm.model, prompt, 4)
    hung = None
    with Router(nginx_bin, tmp_path / "nginx", [f"127.0.0.1:{r.port}" for r in replicas]) as router:
        phone = EdgeClient(tiny_glm4_fp32_bundle, router.ws_url, codec="fp16", retry=RETRY)
        try:
            phone._call(phone.session.preload(system))  # its upgrades carry the prompt's route key
            assert phone.complete(prompt_ids=prompt, max_tokens=4).token_ids == want
            [hung] = [r for r in replicas if metric_sum(r.metrics(), "autoglm:sessions_open") == 1]
            os.kill(hung.proc.pid, signal.SIGSTOP)  # takes connections (the kernel's backlog), answers nothing
            gen = phone.complete(prompt_ids=prompt, max_tokens=4)  # its link to the hung replica is lost first
        finally:
            phone.close()
            if hung is not None:
                os.kill(hung.proc.pid, signal.SIGCONT)
                hung.kill()  # the pool starts a fresh one for the next test
        log = router.access_log()
    assert gen.token_ids == want and gen.stats.replays == 1
    other = next(r for r in replicas if r is not hung)
    landed = [line for line in log if f"upstream=127.0.0.1:{other.port}" in line and "/v1/split" in line]
    assert landed and all("prefix=-" in line for line in landed), log  # balanced there without the key
