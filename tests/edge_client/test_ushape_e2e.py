"""U-shape end to end: a real `autoglm-cloud serve` of a bundle split with ``--tail``, the edge client, the rig's
link emulator.

* greedy u-shape output equals the unsplit model's (tiny GLM-4: front layer 0, cloud layer 1, tail layers 2-3;
  SmolLM2: equal to plain split of the same model), plain and speculative (fp32 edge, fp16 wire both ways);
* what comes down is hidden states, never a token: no Tokens message carries an id;
* (link cuts: test_ushape_resume.py - resumed mid-decode, mid-prompt and mid speculative step, replayed after
  a server restart, each with the uncut run's tokens);
* seeded sampling on the phone is reproducible, with speculation too (the plain run's tokens).
"""

from __future__ import annotations


import numpy as np
import pytest
from test_speculation_e2e import N_NEW, PROMPT, RETRY

from edge_client.client import EdgeClient
from edge_client.demo import LocalCloud
from shared import protocol as P


@pytest.fixture(scope="module")
def cloud(ushape_cloud):
    return ushape_cloud  # one server for the u-shape modules (conftest)


@pytest.fixture(scope="module")
def reference(tiny_glm4_lm, greedy_continuation) -> list[int]:
    return greedy_continuation(tiny_glm4_lm, PROMPT, N_NEW)


def _recording(client: EdgeClient) -> tuple[list, list]:
    """Every message the client sends and receives, from now on."""
    s = client.session
    sent, got = [], []
    real_send, real_recv = s._send, s._recv

    async def send(msg):
        sent.append(msg)
        return await real_send(msg)

    async def recv(timeout):
        msg = await real_recv(timeout)
        got.append(msg)
        return msg

    s._send, s._recv = send, recv
    return sent, got


@pytest.mark.parametrize("speculate", [False, True])
def test_tiny_ushape_greedy_equals_unsplit(tiny_glm4_ushape_bundle, cloud, reference, speculate):
    with EdgeClient(tiny_glm4_ushape_bundle, cloud.ws_url, codec="fp16", retry=RETRY) as c:
        sent, got = _recording(c)
        gen = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW, speculate=speculate)
    st = gen.stats
    assert gen.token_ids == reference and gen.finish_reason == "length"
    assert st.exec_mode == "u-shape" and "u-shape" in st.exec_reason
    assert not any(isinstance(m, P.Tokens) and m.token_ids for m in got)  # no token id came down
    states = [m for m in got if isinstance(m, P.States)]
    assert sum(m.n_tokens for m in states) >= len(PROMPT) + N_NEW - 1  # a middle row per position
    assert {type(m).__name__ for m in sent} <= {"Prefill", "StatesStep", "Cancel", "Close"}
    assert st.bytes_down > (len(PROMPT) + N_NEW - 1) * 64 * 2 and st.edge_tail_s > 0
    if speculate:
        assert st.accepted_draft_tokens > 0
        assert st.decode_round_trips + st.accepted_draft_tokens == N_NEW - 1
        assert st.decode_round_trips < N_NEW - 1
        assert any(m.n_tokens > 1 for m in sent if isinstance(m, P.StatesStep))


@pytest.fixture(scope="module")
def phased_bundle(tiny_glm4_lm, split_bundle):
    """The u-shape bundle's twin with an int8 front and an fp32 copy for the prompt (the same cloud half and id)."""
    return split_bundle("glm4-ushape-phased", tiny_glm4_lm, 1, "int8", fp32_prefill=True, tail=2)


def test_speculation_on_a_bundle_with_an_fp32_prompt_graph_keeps_plain_decodings_tokens(phased_bundle, cloud):
    """Precision by phase (``split --fp32-prefill``: an int8 front for steps, an fp32 copy for the prompt): a
    speculative StatesStep ran its token and drafts through the prompt's graph, where plain steps run the decode
    graph, so its rows - and the front KV kept - were another graph's and the greedy answer differed from the plain
    one (the split's SpecStep runs the decode graph: FrontRuntime.step)."""
    with EdgeClient(phased_bundle, cloud.ws_url, codec="fp16", retry=RETRY, draft_k=4) as c:
        assert c.runtime.phased
        plain = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
        spec = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW, speculate=True)
    assert spec.stats.exec_mode == "u-shape" and spec.stats.accepted_draft_tokens > 0
    assert spec.token_ids == plain.token_ids


def test_the_stats_name_the_codec_the_steps_travel_in(tiny_glm4_ushape_bundle, cloud):
    """A u-shape request's steps travel in its prompt's codec (as its States do); a prompt long enough for the
    policy's int8-outlier used to report the split's fp16 step codec for them."""
    prompt = [int(t) for t in np.random.RandomState(1).randint(4, 512, 600)]  # fp16 rows over 64 KiB at H = 64
    with EdgeClient(tiny_glm4_ushape_bundle, cloud.ws_url, retry=RETRY) as c:
        sent, _ = _recording(c)
        st = c.complete(prompt_ids=prompt, max_tokens=3).stats
    steps = {m.hidden.codec for m in sent if isinstance(m, P.StatesStep)}
    assert st.codec == "int8-outlier" and steps == {st.step_codec} == {st.codec}


def test_seeded_sampling_on_the_phone_is_reproducible(tiny_glm4_ushape_bundle, cloud):
    with EdgeClient(tiny_glm4_ushape_bundle, cloud.ws_url, codec="fp16", retry=RETRY, draft_k=3) as c:
        a, b, other = (c.complete(prompt_ids=PROMPT, max_tokens=N_NEW, temperature=1.5, seed=seed)
                       for seed in (11, 11, 12))
        # the phone verifies with each row's draw at its position: speculation (drafting a's answer) emits a's tokens
        spec = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW, temperature=1.5, seed=11, speculate=True)
    assert a.token_ids == b.token_ids and a.token_ids != other.token_ids
    assert spec.token_ids == a.token_ids and spec.stats.accepted_draft_tokens > 0


@pytest.mark.slow  # the default suite keeps its tiny-model twin
def test_smollm2_ushape_equals_plain_split(smollm2_bundle, smollm2_ushape_bundle, tmp_path):
    chat = [{"role": "system", "content": "You copy the user's list exactly."},
            {"role": "user", "content": "Repeat this list twice: apples, pears, plums, cherries, grapes."}]
    with LocalCloud(smollm2_bundle, log_path=tmp_path / "split.log") as cloud, \
            EdgeClient(smollm2_bundle, cloud.ws_url, codec="fp16", retry=RETRY) as c:
        plain = c.complete(messages=chat, max_tokens=32)
    with LocalCloud(smollm2_ushape_bundle, log_path=tmp_path / "ushape.log") as cloud, \
            EdgeClient(smollm2_ushape_bundle, cloud.ws_url, codec="fp16", retry=RETRY) as c:
        u = c.complete(messages=chat, max_tokens=32)
        u_spec = c.complete(messages=chat, max_tokens=32, speculate=True)
    assert plain.stats.exec_mode == "split" and u.stats.exec_mode == "u-shape"
    assert u.token_ids == plain.token_ids and u.text == plain.text
    assert u_spec.token_ids == plain.token_ids
    assert u_spec.stats.accepted_draft_tokens > 0 and u_spec.stats.decode_round_trips < u.stats.decode_round_trips


@pytest.mark.slow  # tests/edge_client/test_vision_e2e.py keeps screenshots through the real server by default
def test_screenshot_through_u_shape_equals_unsplit(tiny_glm4v_lm, split_bundle, tmp_path):
    """GLM-4.1V (3-D rope): the image's positions travel with the states and feed the tail's rotary inputs."""
    from test_vision_e2e import N_NEW as V_NEW
    from test_vision_e2e import PROMPT as V_PROMPT
    from test_vision_e2e import _png, _reference

    bundle = split_bundle("glm4v-ushape", tiny_glm4v_lm, 2, "fp32", tail=1)
    image = _png(1)
    with LocalCloud(bundle, log_path=tmp_path / "cloud.log") as cloud, \
            EdgeClient(bundle, cloud.ws_url, codec="fp16", retry=RETRY) as c:
        gen = c.complete(prompt_ids=V_PROMPT, images=[image], max_tokens=V_NEW)
    assert gen.stats.exec_mode == "u-shape" and gen.stats.image_tokens > 0
    assert gen.token_ids == _reference(tiny_glm4v_lm.model, bundle, image)


def test_states_of_another_width_are_refused_before_decoding():
    """States whose declared width is not the tail's are bad_server without being decoded (a few bytes declaring
    2^20 channels were decoded first - up to the 64 MiB decoded-tensor limit - and refused as undecodable)."""
    from types import SimpleNamespace

    from edge_client.errors import EdgeClientError
    from edge_client.ushape import UShape
    from shared import codecs as C

    sent = SimpleNamespace(track=lambda rid: SimpleNamespace(received=2))  # the positions the edge sent
    u = UShape(SimpleNamespace(codecs=C.available_codecs(), state=sent), SimpleNamespace(length=0, hidden_size=64))
    req = SimpleNamespace(codec="fp16", rid="r")
    wide = P.States(request_id="r", start=0, hidden=P.EncodedTensor(codec="fp16", shape=(2, 1 << 20), data=b"\0" * 6))
    with pytest.raises(EdgeClientError) as e:
        u._new_rows(req, wide)
    assert e.value.code == "bad_server" and "width 1048576" in str(e.value)
    good = C.get_codec("fp16").encode(np.ones((2, 64), np.float32))
    assert u._new_rows(req, P.States(request_id="r", start=0, hidden=good)).shape == (2, 64)


def test_states_of_more_positions_than_the_edge_sent_are_refused_before_decoding(tiny_glm4_ushape_bundle):
    """A cloud answering a 6-token prompt with States of 100,000 rows: bad_server naming the positions, at once
    (they were decoded - 21 s for 349,525 rows of a compact PCA codec - and run through the tail, which failed
    as 'internal')."""
    from edge_client.errors import EdgeClientError
    from shared.manifest import Manifest
    from tests.protocol_fake_server import ScriptedRequest, ScriptedServer

    class Hostile(ScriptedServer):
        def _prefill(self, sess, msg):
            sess.requests[msg.request_id] = ScriptedRequest(msg.request_id, msg.params, [])
            rows = self.codecs[msg.hidden.codec].encode(np.zeros((100_000, self.hidden_size), np.float32))
            return [P.States(request_id=msg.request_id, start=0, hidden=rows)]

    m = Manifest.load(tiny_glm4_ushape_bundle)
    with Hostile(m.bundle_id, m.hidden_size) as srv, \
            EdgeClient(tiny_glm4_ushape_bundle, srv.url, codec="fp16", retry=RETRY) as c:
        with pytest.raises(EdgeClientError) as e:
            c.complete(prompt_ids=PROMPT[:6], max_tokens=2)
    assert e.value.code == "bad_server" and "positions [0, 100000), the edge sent [0, 6)" in str(e.value)
