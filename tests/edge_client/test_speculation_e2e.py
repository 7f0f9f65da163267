"""Speculative decoding across the split, end to end: a real `autoglm-cloud serve`, the edge client, the rig's
link emulator.

* greedy output with speculation equals plain split decoding (tiny GLM-4 and SmolLM2, fp32 edge, fp16 wire),
  with fewer round trips than tokens, and so does seeded sampled output;
* a cut of the link while a SpecStep is in flight - the step lost on the way up, or its verdict lost on the
  way down - still gives the same tokens (resume, no replay);
* a restart of the cloud while a SpecStep is in flight replays and still gives the same tokens;
* so does a seeded sampled request, cut (resume) or restarted (replay) with drafts in flight: the undisturbed
  plain run's tokens;
* a cut inside a prompt span the session's limits cut into several Prefills resends the rest of the span;
* drafts from the bundle's draft head (where prompt lookup has none) keep greedy parity too, and so do the
  layer-skipping drafter's (tiny GLM-4, SmolLM2), whose KV mirror never keeps a rejected draft.

Speculative runs pin k (``EdgeConfig.draft_k``): the timing-driven DraftSizer would make the steps, and so
what a cut hits, depend on the machine's load.
"""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest

from edge_client.client import EdgeClient
from edge_client.config import RetryPolicy
from edge_client.demo import LocalCloud
from rig.link import LinkEmulator
from shared import protocol as P
from shared.link_profiles import LinkProfile

RETRY = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=60.0, max_retries=40, backoff_initial_s=0.1,
                    backoff_max_s=0.5)
# a prompt that repeats itself, as agent prompts do: drafts from prompt lookup get accepted
_rng = np.random.RandomState(3)
_PHRASE = [int(t) for t in _rng.randint(4, 512, 12)]
PROMPT = [int(t) for t in _rng.randint(4, 512, 10)] + _PHRASE + [7, 9] + _PHRASE + [11] + _PHRASE[:5]
N_NEW = 24
K = 4  # drafts per step, pinned
# slow enough that a frame is still inside the emulated link when the test cuts it
SLOW = LinkProfile("slow-test", rtt_ms=400.0, jitter_ms=0.0, down_mbps=100.0, up_mbps=100.0, loss=0.0)


@pytest.fixture(scope="module")
def plain_tokens(tiny_bundle, tiny_cloud):
    with EdgeClient(tiny_bundle, tiny_cloud.ws_url, codec="fp16", retry=RETRY) as c:
        return c.complete(prompt_ids=PROMPT, max_tokens=N_NEW).token_ids


def test_tiny_speculative_greedy_equals_plain(tiny_bundle, tiny_cloud, plain_tokens):
    with EdgeClient(tiny_bundle, tiny_cloud.ws_url, codec="fp16", retry=RETRY, draft_k=K) as c:
        gen = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW, speculate=True)
    st = gen.stats
    assert gen.token_ids == plain_tokens
    assert st.draft_tokens > 0 and st.accepted_draft_tokens > 0
    assert st.decode_round_trips < len(gen.token_ids) - 1  # more than one token per round trip
    assert st.decode_round_trips + st.accepted_draft_tokens == len(gen.token_ids) - 1


def test_seeded_sampled_speculation_emits_the_plain_runs_tokens(tiny_bundle, tiny_cloud):
    """Each verified row's token is the sampler's draw at its position: a seeded speculative run (its drafts from
    the plain run's answer, remembered) is the seeded plain run, token for token - it used to draw from a
    generator of its own, so it differed, and a replay (which restarts that generator) differed from both."""
    kw = dict(prompt_ids=PROMPT, max_tokens=N_NEW, temperature=0.7, seed=1234)
    with EdgeClient(tiny_bundle, tiny_cloud.ws_url, codec="fp16", retry=RETRY, draft_k=K) as c:
        plain = c.complete(**kw)
        spec = c.complete(**kw, speculate=True)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted_draft_tokens > 0 and spec.stats.decode_round_trips < N_NEW - 1


def test_an_answer_a_stop_string_ended_is_drafted_from_later(tiny_bundle, tiny_cloud):
    """Prompt lookup drafts from earlier answers (the next agent step repeats them): one that a stop string ended
    (agents stop at their action's end) was never remembered, so the next request found nothing to draft from.
    Seeded sampling: the answers are the same but the context alone proposes nothing the cloud accepts."""
    kw = dict(prompt_ids=PROMPT, max_tokens=N_NEW, temperature=0.7, seed=1234)
    with EdgeClient(tiny_bundle, tiny_cloud.ws_url, codec="fp16", retry=RETRY, draft_k=K) as c:
        text = c.complete(**kw).text
    i = len(text) // 2
    stop = text[i:i + 2]
    assert text.find(stop) == i  # the answer ends there, after several tokens
    with EdgeClient(tiny_bundle, tiny_cloud.ws_url, codec="fp16", retry=RETRY, draft_k=K) as c:
        cut = c.complete(**kw, stop=[stop])
        assert cut.finish_reason == "stop" and cut.text == text[:i] and len(cut.token_ids) > 2
        spec = c.complete(**kw, speculate=True)
    assert spec.text == text
    assert spec.stats.accepted_draft_tokens >= len(cut.token_ids) // 2


def _cut_after_spec(client: EdgeClient, proxy: LinkEmulator, which: int, delay_s: float) -> list[int]:
    """Cut ``proxy`` ``delay_s`` after the ``which``-th SpecStep leaves the edge; returns a list that gets the
    positions of the SpecSteps sent."""
    session = client.session
    sent_positions: list[int] = []
    real_send = session._send

    async def send(msg):
        n = await real_send(msg)
        if isinstance(msg, P.SpecStep):
            sent_positions.append(msg.position)
            if len(sent_positions) == which:
                asyncio.get_running_loop().call_later(delay_s, proxy.cut)
        return n

    session._send = send
    return sent_positions


@pytest.mark.parametrize("delay_s,lost", [pytest.param(0.0, "the SpecStep", marks=pytest.mark.slow),
                                          (0.3, "the verdict")])
def test_cut_mid_speculative_step_keeps_parity(tiny_bundle, tiny_cloud, plain_tokens, delay_s, lost):
    with LinkEmulator(tiny_cloud.port, SLOW) as proxy, \
            EdgeClient(tiny_bundle, f"ws://127.0.0.1:{proxy.port}/v1/split", codec="fp16", retry=RETRY,
                       draft_k=K) as c:
        positions = _cut_after_spec(c, proxy, 2, delay_s)
        gen = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW, speculate=True)
    assert gen.token_ids == plain_tokens, lost
    assert proxy.cuts == 1 and gen.stats.reconnects >= 1 and gen.stats.resumes >= 1 and gen.stats.replays == 0
    if lost == "the SpecStep":  # it was sent again at the same position after the resume
        assert len(positions) != len(set(positions))


# a restart costs a server start (~10 s on two busy cores): slow, as the greedy twin below
@pytest.mark.parametrize("fault", ["cut", pytest.param("restart", marks=pytest.mark.slow)])
def test_seeded_sampled_speculation_interrupted_emits_the_undisturbed_runs_tokens(tiny_bundle, tiny_cloud, fault):
    """A seeded sampled request with drafts in flight, interrupted - the link cut while the verdict is on its way
    (resume), or the server SIGKILLed and restarted as the SpecStep goes out (replay, the drafts dropped) - emits
    the tokens of an undisturbed plain run with that seed (the cloud draws by seed and position)."""
    kw = dict(prompt_ids=PROMPT, max_tokens=N_NEW, temperature=0.7, seed=1234)
    with EdgeClient(tiny_bundle, tiny_cloud.ws_url, codec="fp16", retry=RETRY) as c:
        plain = c.complete(**kw).token_ids
    with LinkEmulator(tiny_cloud.port, SLOW if fault == "cut" else None) as proxy, \
            EdgeClient(tiny_bundle, f"ws://127.0.0.1:{proxy.port}/v1/split", codec="fp16", retry=RETRY,
                       draft_k=K) as c:
        c.session.drafter.remember(plain)  # an earlier answer to draft from (sampled text repeats nothing)
        if fault == "cut":
            _cut_after_spec(c, proxy, 2, 0.3)
        else:
            real_send, seen = c.session._send, []

            async def send(msg):
                if isinstance(msg, P.SpecStep):
                    seen.append(msg.position)
                    if len(seen) == 2:  # the server dies as the second SpecStep goes out, and comes back on its port
                        await asyncio.to_thread(tiny_cloud.kill)
                        await asyncio.to_thread(tiny_cloud.start)
                return await real_send(msg)

            c.session._send = send
        gen = c.complete(**kw, speculate=True)
    st = gen.stats
    assert gen.token_ids == plain
    assert st.accepted_draft_tokens > 0 and st.reconnects >= 1
    assert (st.resumes, st.replays) == ((1, 0) if fault == "cut" else (0, 1))


@pytest.mark.slow  # a restart's replay stays in the default suite (test_end_to_end, test_ushape_resume)
def test_cloud_restart_mid_speculative_step_replays_with_parity(tiny_bundle, tmp_path, plain_tokens):
    with LocalCloud(tiny_bundle, log_path=tmp_path / "cloud.log") as cloud, \
            EdgeClient(tiny_bundle, cloud.ws_url, codec="fp16", retry=RETRY, draft_k=K) as c:
        session = c.session
        real_send = session._send
        seen = []

        async def send(msg):
            if isinstance(msg, P.SpecStep) and not seen:
                seen.append(msg.position)
                await asyncio.to_thread(cloud.kill)  # the server dies as the SpecStep goes out...
                await asyncio.to_thread(cloud.start)  # ...and a fresh one comes up on the same port
                return await real_send(msg)  # on the dead connection: lost
            return await real_send(msg)

        session._send = send
        gen = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW, speculate=True)
    assert seen and gen.token_ids == plain_tokens
    assert gen.stats.replays == 1


@pytest.fixture(scope="module")
def head_bundle(tiny_bundle, tiny_glm4_lm, tmp_path_factory):
    """The tiny bundle with a draft head (same cloud half, same bundle id)."""
    from partition_tools.draft_head import DraftHeadConfig, add_draft_head

    bundle = tmp_path_factory.mktemp("tiny-head") / "b"
    shutil.copytree(tiny_bundle, bundle)
    add_draft_head(tiny_glm4_lm, bundle, DraftHeadConfig(tokens=1024))
    return bundle


def test_draft_head_drafts_keep_greedy_parity(head_bundle, tiny_cloud):
    prompt = [int(t) for t in np.random.RandomState(5).randint(4, 512, 20)]  # repeats nothing: no lookup drafts
    with EdgeClient(head_bundle, tiny_cloud.ws_url, codec="fp16", retry=RETRY) as c:
        plain = c.complete(prompt_ids=prompt, max_tokens=N_NEW).token_ids
    with EdgeClient(head_bundle, tiny_cloud.ws_url, codec="fp16", retry=RETRY, draft_k=2) as c:
        gen = c.complete(prompt_ids=prompt, max_tokens=N_NEW, speculate=True)
    st = gen.stats
    assert gen.token_ids == plain
    assert st.head_draft_tokens > 0 and st.head_draft_tokens <= st.draft_tokens
    assert st.decode_round_trips + st.accepted_draft_tokens == len(gen.token_ids) - 1


# -- SmolLM2: real weights ------------------------------------------------------------------------------------


@pytest.mark.slow  # SmolLM2 (real weights); the tiny GLM-4 parity tests stay in the default suite
def test_smollm2_speculative_greedy_equals_plain(smollm2_bundle, tmp_path):
    chat = [{"role": "system", "content": "You copy the user's list exactly."},
            {"role": "user", "content": "Repeat this list twice: apples, pears, plums, cherries, grapes."}]
    with LocalCloud(smollm2_bundle, log_path=tmp_path / "cloud.log") as cloud, \
            EdgeClient(smollm2_bundle, cloud.ws_url, codec="fp16", retry=RETRY, draft_k=K) as c:
        plain = c.complete(messages=chat, max_tokens=32)
        spec = c.complete(messages=chat, max_tokens=32, speculate=True)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert spec.stats.accepted_draft_tokens > 0
    assert spec.stats.decode_round_trips < plain.stats.decode_round_trips


# -- the layer-skipping drafter (edge_client.draft_layers) ------------------------------------------------------


def _layers_bundle(src, lm, out, **cfg):
    from partition_tools.draft_layers import DraftLayersConfig, add_draft_layers

    shutil.copytree(src, out)
    add_draft_layers(lm, out, DraftLayersConfig(prose_tokens=512, answer_tokens=0, **cfg))
    return out


def _mirrors_the_context(client: EdgeClient, prompt: list[int], tokens: list[int]) -> bool:
    """The drafter's mirror is a prefix of the context it drafted for (its KV never holds a rejected draft)."""
    head = client.session.head
    context = [*prompt, *tokens]
    return 0 < head.length <= len(context) and head._ids == context[:head.length]


@pytest.mark.parametrize("layers", [(2, 3), (3,)], ids=["every-cloud-layer", "layer-2-skipped"])
def test_layer_drafter_keeps_greedy_parity(tiny_bundle, tiny_glm4_lm, tiny_cloud, tmp_path, layers):
    bundle = _layers_bundle(tiny_bundle, tiny_glm4_lm, tmp_path / "b", layers=layers, quant="fp32")
    prompt = [int(t) for t in np.random.RandomState(5).randint(4, 512, 20)]  # repeats nothing: no lookup drafts
    with EdgeClient(bundle, tiny_cloud.ws_url, codec="fp16", retry=RETRY) as c:
        plain = c.complete(prompt_ids=prompt, max_tokens=N_NEW).token_ids
    with EdgeClient(bundle, tiny_cloud.ws_url, codec="fp16", retry=RETRY, draft_k=3) as c:
        gen = c.complete(prompt_ids=prompt, max_tokens=N_NEW, speculate=True)
        assert _mirrors_the_context(c, prompt, gen.token_ids)
        again = c.complete(prompt_ids=prompt, max_tokens=N_NEW, speculate=True)  # the mirror reused, then cut
        assert _mirrors_the_context(c, prompt, again.token_ids)
    st = gen.stats
    assert gen.token_ids == plain and again.token_ids == plain
    assert st.head_draft_tokens > 0 and st.edge_draft_s > 0
    assert st.decode_round_trips + st.accepted_draft_tokens == len(gen.token_ids) - 1
    if layers == (2, 3):  # the drafter is the model's own cloud half: its drafts are the model's tokens
        assert st.accepted_head_draft_tokens >= 0.9 * st.head_draft_tokens


@pytest.mark.slow  # the default suite keeps its tiny-model twin
def test_smollm2_layer_drafter_keeps_greedy_parity(smollm2_bundle, smollm2_lm, tmp_path):
    bundle = _layers_bundle(smollm2_bundle, smollm2_lm, tmp_path / "b", layers=(4, 5, 27, 28, 29))
    chat = [{"role": "user", "content": "Tell me about the history of tea in a few sentences."}]
    with LocalCloud(bundle, log_path=tmp_path / "cloud.log") as cloud, \
            EdgeClient(bundle, cloud.ws_url, codec="fp16", retry=RETRY) as plain_c, \
            EdgeClient(bundle, cloud.ws_url, codec="fp16", retry=RETRY, draft_k=3) as spec_c:
        plain = plain_c.complete(messages=chat, max_tokens=24)
        spec = spec_c.complete(messages=chat, max_tokens=24, speculate=True)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.head_draft_tokens > 0 and spec.stats.accepted_head_draft_tokens > 0


def test_cut_inside_a_prompt_span_of_several_prefills_keeps_parity(tiny_bundle, tiny_cloud, plain_tokens,
                                                                   monkeypatch):
    """The session's limits cut one front chunk into several Prefill messages; the link drops after the second
    goes out. Every message of the span was recorded before the first was sent, so the recovery sends the rest
    (a span recorded only as far as it was sent would leave a gap the cloud never fills)."""
    import dataclasses

    from edge_client import generation

    real = generation.prefill_messages

    def small(request_id, hidden, codec, limits, **kw):
        return real(request_id, hidden, codec, dataclasses.replace(limits, max_prefill_chunk_tokens=4), **kw)

    monkeypatch.setattr(generation, "prefill_messages", small)
    with LinkEmulator(tiny_cloud.port, SLOW) as proxy, \
            EdgeClient(tiny_bundle, f"ws://127.0.0.1:{proxy.port}/v1/split", codec="fp16", retry=RETRY,
                       cache_prompts=False) as c:
        s = c.session
        real_send, prefills = s._send, []

        async def send(msg):
            n = await real_send(msg)
            if isinstance(msg, P.Prefill):
                prefills.append(msg.start)
                if len(prefills) == 2:
                    proxy.cut()
            return n

        s._send = send
        gen = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
    assert gen.token_ids == plain_tokens
    assert proxy.cuts == 1 and gen.stats.reconnects >= 1
    first = prefills[0]  # 0, or past the blocks an earlier test left on the shared server (they do not go up)
    assert first % 16 == 0 and prefills[1] == first + 4 and max(prefills) == 4 * ((len(PROMPT) - 1) // 4)  # whole
