"""Cloud drafts end to end: a real `autoglm-cloud serve` of a bundle with a cloud drafter
(`partition_tools.cloud_drafter`), the edge client asking for drafts with its steps (docs/protocol.md, "Cloud
drafts").

* greedy output equals plain split decoding (tiny GLM-4, SmolLM2), the drafts counted in the stats;
* a cut of the link while a cloud-drafted SpecStep is in flight keeps parity (resume);
* the Welcome announces the drafter; a client with ``cloud_drafts=False`` never asks and gets none.
"""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest

from edge_client.client import EdgeClient
from edge_client.config import RetryPolicy
from edge_client.demo import LocalCloud
from partition_tools.cloud_drafter import CloudDrafterConfig, add_cloud_drafter
from rig.link import LinkEmulator
from shared import protocol as P
from shared.link_profiles import LinkProfile

RETRY = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=60.0, max_retries=40, backoff_initial_s=0.1,
                    backoff_max_s=0.5)
PROMPT = [int(t) for t in np.random.RandomState(7).randint(4, 512, 18)]  # repeats nothing: no lookup drafts
N_NEW = 20
SLOW = LinkProfile("slow-test", rtt_ms=400.0, jitter_ms=0.0, down_mbps=100.0, up_mbps=100.0, loss=0.0)


def _with_cloud_drafter(src, lm, out, **cfg):
    shutil.copytree(src, out)
    add_cloud_drafter(lm, out, CloudDrafterConfig(**cfg))
    return out


@pytest.fixture(scope="module")
def drafter_bundle(tiny_bundle, tiny_glm4_lm, tmp_path_factory):
    return _with_cloud_drafter(tiny_bundle, tiny_glm4_lm, tmp_path_factory.mktemp("tiny-cloud-drafter") / "b")


@pytest.fixture(scope="module")
def drafter_cloud(drafter_bundle, tmp_path_factory):
    with LocalCloud(drafter_bundle, log_path=tmp_path_factory.mktemp("cloud-log") / "drafter.log") as cloud:
        yield cloud


@pytest.fixture(scope="module")
def plain_tokens(drafter_bundle, drafter_cloud):
    with EdgeClient(drafter_bundle, drafter_cloud.ws_url, codec="fp16", retry=RETRY) as c:
        gen = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
    assert gen.stats.draft_tokens == 0
    return gen.token_ids


def test_cloud_drafts_keep_greedy_parity(drafter_bundle, drafter_cloud, plain_tokens):
    with EdgeClient(drafter_bundle, drafter_cloud.ws_url, codec="fp16", retry=RETRY, draft_k=3) as c:
        gen = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW, speculate=True)
        assert c.session.welcome.server.cloud_drafts == 4
    st = gen.stats
    assert gen.token_ids == plain_tokens
    assert 0 < st.cloud_draft_tokens <= st.draft_tokens  # the answer repeats itself: lookup drafts too
    assert st.decode_round_trips + st.accepted_draft_tokens == len(gen.token_ids) - 1


def test_a_client_can_decline_cloud_drafts(drafter_bundle, drafter_cloud, plain_tokens):
    asked = []
    with EdgeClient(drafter_bundle, drafter_cloud.ws_url, codec="fp16", retry=RETRY, draft_k=3,
                    cloud_drafts=False) as c:
        real_send = c.session._send

        async def send(msg):
            asked.append(getattr(msg, "ask_drafts", 0))
            return await real_send(msg)

        c.session._send = send
        gen = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW, speculate=True)
    assert gen.token_ids == plain_tokens and gen.stats.cloud_draft_tokens == 0 and not any(asked)


def test_cut_mid_cloud_drafted_step_keeps_parity(drafter_bundle, drafter_cloud, plain_tokens):
    with LinkEmulator(drafter_cloud.port, SLOW) as proxy, \
            EdgeClient(drafter_bundle, f"ws://127.0.0.1:{proxy.port}/v1/split", codec="fp16", retry=RETRY,
                       draft_k=3) as c:
        session = c.session
        real_send = session._send
        specs = []

        async def send(msg):
            n = await real_send(msg)
            if isinstance(msg, P.SpecStep):
                specs.append(msg.position)
                if len(specs) == 2:
                    asyncio.get_running_loop().call_later(0.0, proxy.cut)
            return n

        session._send = send
        gen = c.complete(prompt_ids=PROMPT, max_tokens=12, speculate=True)
    assert gen.token_ids == plain_tokens[:12]
    assert proxy.cuts == 1 and gen.stats.resumes >= 1 and gen.stats.replays == 0


@pytest.mark.slow  # fits the table on SmolLM2 (~1-2 min on two cores); the tiny tests above cover the protocol
def test_smollm2_cloud_drafts_keep_parity_and_get_accepted(smollm2_bundle, smollm2_lm, tmp_path):
    # calibrated on prose only (fast); the chat below is not in it
    bundle = _with_cloud_drafter(smollm2_bundle, smollm2_lm, tmp_path / "b", answer_tokens=0)
    chat = [{"role": "user", "content": "Tell me about the history of tea in a few sentences."}]
    with LocalCloud(bundle, log_path=tmp_path / "cloud.log") as cloud, \
            EdgeClient(bundle, cloud.ws_url, codec="fp16", retry=RETRY) as plain_c, \
            EdgeClient(bundle, cloud.ws_url, codec="fp16", retry=RETRY, draft_k=3) as spec_c:
        plain = plain_c.complete(messages=chat, max_tokens=24)
        spec = spec_c.complete(messages=chat, max_tokens=24, speculate=True)
    st = spec.stats
    assert spec.token_ids == plain.token_ids
    assert st.accepted_cloud_draft_tokens >= 0.3 * st.cloud_draft_tokens > 0
    assert st.decode_round_trips < plain.stats.decode_round_trips
