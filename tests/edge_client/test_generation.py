"""edge_client.generation/client against a reference cloud (fake_cloud.FakeCloud): the request flow, prefix
cache on the wire, resume after a drop, replay after a lost session, bad servers. Greedy output is compared
with the unsplit model token for token."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import numpy as np
import pytest
from model_support import hf_greedy
from edge_fake_cloud import FakeCloud

from edge_client.activation_cache import FILE_SUFFIX
from edge_client.client import EdgeClient
from edge_client.config import RetryPolicy
from edge_client.errors import EdgeClientError
from rig.link import LinkEmulator

PROMPT = [int(t) for t in np.random.RandomState(0).randint(4, 512, 40)]
N_NEW = 12
FAST_RETRY = RetryPolicy(connect_timeout_s=2.0, reply_timeout_s=10.0, max_retries=3, backoff_initial_s=0.05,
                         backoff_max_s=0.2)


@pytest.fixture(scope="module")
def reference(tiny_reference):
    return hf_greedy(tiny_reference, PROMPT, N_NEW)


@pytest.fixture(scope="module")
def cloud(tiny_bundle):
    with FakeCloud(tiny_bundle) as fc:
        yield fc


@pytest.fixture
def client(tiny_bundle, cloud):
    cloud.drop_after_tokens, cloud.forget_sessions = None, False
    with EdgeClient(tiny_bundle, cloud.url, codec="fp16", retry=FAST_RETRY) as c:
        yield c


def test_split_equals_unsplit_and_stats(client, reference):
    gen = client.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
    assert gen.token_ids == reference and gen.finish_reason == "length"
    st = gen.stats
    assert st.prompt_tokens == 40 and st.completion_tokens == N_NEW and st.codec == "fp16"
    assert st.ttft_s > 0 and len(st.itl_s) == N_NEW - 1 and st.tokens_per_s > 0
    # fp16 on the wire: 40 prompt + 11 decode positions of 64 halves, plus framing
    assert (40 + 11) * 64 * 2 < st.bytes_up < (40 + 11) * 64 * 2 * 1.5 and st.bytes_down > 0
    assert st.edge_compute_s > 0


def test_the_policy_sends_a_bulk_prompt_in_its_codec_and_decode_steps_in_fp16(tiny_bundle, cloud):
    """No codec pinned: prompt chunks in the plan's codec, decode steps in the policy's step codec (fp16); a small
    prompt (fp16 states within the policy's lossless_prompt_kib, 64 KiB) travels in fp16 as well."""
    cloud.drop_after_tokens, cloud.forget_sessions = None, False
    bulk = [int(t) for t in np.random.RandomState(1).randint(4, 512, 600)]  # 600 x 64 x 2 B = 75 KiB
    with EdgeClient(tiny_bundle, cloud.url, retry=FAST_RETRY) as c:
        small = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW).stats
        st = c.complete(prompt_ids=bulk, max_tokens=N_NEW).stats
    assert small.codec == small.step_codec == "fp16"
    assert st.codec == "int8-outlier" and st.step_codec == "fp16"
    # 11 decode steps of 64 halves, plus a prompt of 600 rows at about one byte per element, plus framing
    assert 11 * 64 * 2 + 600 * 64 < st.bytes_up < (600 + 11) * 64 * 2


def test_second_request_hits_both_caches(client, cloud, reference):
    client.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
    gen = client.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
    assert gen.token_ids == reference
    assert gen.stats.cached_tokens == 32 and gen.stats.uploaded_prompt_tokens == 8
    assert gen.stats.prefix_misses == 0


def test_the_keys_a_session_knows_the_cloud_holds_are_bounded(client, monkeypatch):
    """The session notes the keys of every prompt the cloud completed (it skips uploading those blocks next time);
    a long-lived session (autoglm-edge serve) would keep every key of every prompt it ever sent. The most recently
    learned CLOUD_KEYS_KEPT stay."""
    from edge_client import generation

    monkeypatch.setattr(generation, "CLOUD_KEYS_KEPT", 4)
    prompts = [[int(t) for t in np.random.RandomState(40 + i).randint(4, 512, 40)] for i in range(3)]
    for p in prompts:  # 2 full blocks each
        client.complete(prompt_ids=p, max_tokens=1)
    from shared.prefix_keys import block_keys

    s = client.session
    last = block_keys(prompts[-1], s._cloud_scope("fp16"), s.block_size)
    held = s.cloud_keys[s.welcome.plan.compute]
    assert len(held) == 4 and list(held)[-2:] == last  # the last prompt's, the newest
    assert client.complete(prompt_ids=prompts[-1], max_tokens=1).stats.uploaded_prompt_tokens == 40 - 32


def test_prefix_miss_falls_back_to_cached_hidden_states(client, cloud, reference):
    client.complete(prompt_ids=PROMPT, max_tokens=2)
    cloud.prefix.clear()  # the cloud evicted the prefix
    front_before = client.runtime.stats.tokens
    gen = client.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
    assert gen.token_ids == reference and gen.stats.prefix_misses == 1
    assert gen.stats.uploaded_prompt_tokens == 40
    # the front layers still ran only over the uncached suffix (8) and the decode steps (11)
    assert client.runtime.stats.tokens - front_before == 8 + N_NEW - 1


def test_a_prompt_of_more_blocks_than_a_prefill_names_keys_its_first_blocks(client):
    """A prompt of more than MAX_PREFIX_KEYS (4096) cloud blocks - 65,552 tokens at the default 16, 4,097 on a
    server run with --block-size 1 - failed every time before any upload: 'internal error: ProtocolError:
    prefix_keys: 4200 entries (at most 4096)' (SmolLM2, a real server). The first Prefill names the first 4096
    blocks; later ones are computed, not shared (and a cache hit past them is uploaded)."""
    from edge_client.generation import _Request
    from edge_client.request import RequestSpec
    from shared import protocol as P
    from shared.messages import MAX_PREFIX_KEYS

    client.connect()
    block = client.session.block_size
    ids = [int(t) for t in np.random.RandomState(5).randint(4, 512, (MAX_PREFIX_KEYS + 3) * block)]
    fields = client.session._open_fields(_Request(RequestSpec(prompt_ids=ids), "fp16"))
    assert len(fields["prefix_keys"]) == MAX_PREFIX_KEYS
    assert fields["prefix_keys"][-1] == client.session._open_fields(  # the same chain as a shorter prompt's
        _Request(RequestSpec(prompt_ids=ids[: MAX_PREFIX_KEYS * block]), "fp16"))["prefix_keys"][-1]
    hidden = client.session.codecs["fp16"].encode(np.zeros((1, client.runtime.hidden_size), np.float32))
    P.Prefill(request_id="r", start=0, hidden=hidden, **fields)  # a valid message


def test_drop_mid_generation_resumes_without_loss(client, cloud, reference):
    cloud.drop_after_tokens = 5
    gen = client.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
    assert gen.token_ids == reference
    assert gen.stats.reconnects == 1 and gen.stats.resumes == 1 and gen.stats.replays == 0


def test_lost_session_is_replayed(client, cloud, reference):
    cloud.drop_after_tokens, cloud.forget_sessions = 5, True
    front_before = client.runtime.stats.tokens
    gen = client.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
    assert gen.token_ids == reference
    assert gen.stats.replays == 1 and gen.stats.resumes == 0
    # replay re-sent stored hidden states: the front ran once per position, never again
    assert client.runtime.stats.tokens - front_before <= len(PROMPT) + N_NEW - 1


def test_a_replay_on_a_session_without_the_requests_compute_fails_instead_of_running_on_another(tiny_bundle, cloud):
    """A pinned precision="int8" replayed after a restart onto a server that no longer loads int8 was served in
    fp32 from the replay on without a word (the server falls back to a loaded variant), its stats still saying
    int8 (reproduced with autoglm-cloud serve --variants fp32,int8 killed mid-answer, restarted with fp32)."""
    cloud.drop_after_tokens, cloud.forget_sessions, cloud.compute_variants = 3, True, ["fp32", "int8"]
    try:
        with EdgeClient(tiny_bundle, cloud.url, retry=FAST_RETRY) as c:
            c.connect()  # a Welcome offering int8
            cloud.compute_variants = ["fp32"]  # what the session the request is replayed on offers
            with pytest.raises(EdgeClientError, match="does not offer its compute 'int8'") as e:
                c.complete(prompt_ids=PROMPT, max_tokens=N_NEW, precision="int8")
            assert e.value.code == "codec_not_negotiated"
            assert c.complete(prompt_ids=PROMPT[:8], max_tokens=2).stats.compute == "fp32"  # the client serves on
    finally:
        cloud.drop_after_tokens, cloud.forget_sessions, cloud.compute_variants = None, False, ["fp32"]


def test_a_replayed_request_whose_compute_the_policy_chose_runs_on_the_new_sessions(tiny_bundle, cloud, reference):
    """A request that pinned no compute - the policy chose fp16 where the server offered it - failed its replay
    onto a server (a restart, another replica) that offers fp32 only (codec_not_negotiated: the pinned case's rule
    taken for every request), where a new request there just runs in fp32: the policy chooses it again."""
    cloud.drop_after_tokens, cloud.forget_sessions, cloud.compute_variants = 3, True, ["fp16", "fp32"]
    try:
        with EdgeClient(tiny_bundle, cloud.url, codec="fp16", retry=FAST_RETRY) as c:
            c.connect()  # a Welcome offering fp16: a short prompt's compute
            cloud.compute_variants = ["fp32"]  # what the session the request is replayed on offers
            gen = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
        assert gen.token_ids == reference and gen.stats.replays >= 1
        assert gen.stats.compute == "fp32"
    finally:
        cloud.drop_after_tokens, cloud.forget_sessions, cloud.compute_variants = None, False, ["fp32"]


def test_a_configured_slow_uplink_sends_a_bulk_prompt_in_the_compact_codec(tiny_bundle, cloud):
    """The policy's slow-link tier (int4-outlier when the near-lossless upload would take over 1.5 s: quality.md,
    protocol.md's hints.link_kbps) was out of the reference edge's reach: it had no link rate to give the policy
    or the Hello. EdgeConfig.link_kbps (env AUTOGLM_EDGE_LINK_KBPS) is both."""
    cloud.drop_after_tokens, cloud.forget_sessions = None, False
    bulk = [4 + (i * 7) % 500 for i in range(600)]  # 600 x 64 x 1.02 B: 3.1 s at 100 kbit/s, 31 ms at 10 Mbit/s
    for kbps, codec in ((100, "int4-outlier"), (10_000, "int8-outlier")):
        with EdgeClient(tiny_bundle, cloud.url, link_kbps=kbps, retry=FAST_RETRY) as c:
            assert c.session._hello(False).hints.link_kbps == kbps
            st = c.complete(prompt_ids=bulk, max_tokens=2).stats
            assert st.codec == codec, kbps


def test_cut_tcp_connection_repeatedly(tiny_bundle, cloud, reference):
    cloud.drop_after_tokens, cloud.forget_sessions = None, False
    with LinkEmulator(cloud.port) as proxy, \
            EdgeClient(tiny_bundle, f"ws://127.0.0.1:{proxy.port}/v1/split", codec="fp16", retry=FAST_RETRY) as c:
        gen = c.generate(prompt_ids=PROMPT, max_tokens=N_NEW)
        for i, (_token, _) in enumerate(gen.iter_tokens()):
            if i in (2, 6):  # cut the link twice while tokens flow
                proxy.cut()
                time.sleep(0.05)
        assert gen.token_ids == reference
        assert proxy.cuts == 2 and gen.stats.reconnects == 2 and proxy.connections == 3


def test_cancel_stops_the_request(client, reference):
    gen = client.generate(prompt_ids=PROMPT, max_tokens=200)
    for i, _ in enumerate(gen.iter_tokens()):
        if i == 2:
            gen.cancel()
    assert gen.finish_reason == "cancelled" and 3 <= len(gen.token_ids) < 200
    assert client.complete(prompt_ids=PROMPT, max_tokens=N_NEW).token_ids == reference  # the session lives on


def test_iter_tokens_deltas_join_to_the_text(client, reference):
    """Text held back to the end (a tail that may begin a stop string, an incomplete character) came as a delta
    of no token, which iter_tokens() dropped: an app streaming with it lost the answer's last characters."""
    whole = client.complete(prompt_ids=PROMPT, max_tokens=N_NEW).text
    stop = whole[-1] + "\x00never"  # the answer's last character may begin it: held until the end
    gen = client.generate(prompt_ids=PROMPT, max_tokens=N_NEW, stop=[stop])
    pairs = list(gen.iter_tokens())
    assert [t for t, _ in pairs] == gen.token_ids == reference
    assert "".join(d for _, d in pairs) == gen.text == whole


def test_async_twin(client, reference):
    async def main():
        gen = client.agenerate(prompt_ids=PROMPT, max_tokens=N_NEW)
        deltas = [d async for d in gen]
        return gen, deltas

    gen, _ = asyncio.run(main())
    assert gen.token_ids == reference and gen.finish_reason == "length"


def test_bundle_mismatch_is_refused(client, cloud):
    real = cloud.bundle_id
    cloud.bundle_id = "another-bundle"
    try:
        with pytest.raises(EdgeClientError, match="bundle_mismatch") as ei:
            client.complete(prompt_ids=PROMPT, max_tokens=2)
        assert ei.value.code == "bundle_mismatch"
    finally:
        cloud.bundle_id = real


def test_api_key_goes_in_the_upgrade_header(tiny_bundle, cloud):
    cloud.api_key = "sekrit"
    try:
        with EdgeClient(tiny_bundle, cloud.url, api_key="wrong", retry=FAST_RETRY) as c, \
                pytest.raises(EdgeClientError, match="HTTP 401") as ei:
            c.complete(prompt_ids=PROMPT, max_tokens=2)
        assert ei.value.code == "unauthorized"
        with EdgeClient(tiny_bundle, cloud.url, api_key="sekrit", retry=FAST_RETRY) as c:
            assert len(c.complete(prompt_ids=PROMPT, max_tokens=2).token_ids) == 2
        assert cloud.auth_headers[-1] == "Bearer sekrit"
    finally:
        cloud.api_key = None


def test_garbage_server_is_a_clear_error(client, cloud):
    cloud.garbage = True
    try:
        t0 = time.monotonic()
        with pytest.raises(EdgeClientError, match="undecodable|not a WebSocket|expected Welcome") as ei:
            client.complete(prompt_ids=PROMPT, max_tokens=2)
        assert ei.value.code == "bad_server" and time.monotonic() - t0 < 5
    finally:
        cloud.garbage = False


def _serve_once(payload: bytes) -> int:
    """A TCP server that answers every connection with ``payload`` (not a WebSocket)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def run():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.recv(4096)
            conn.sendall(payload)
            conn.close()

    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()[1]


def test_http_server_instead_of_cloud(tiny_bundle):
    port = _serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
    with EdgeClient(tiny_bundle, f"ws://127.0.0.1:{port}/v1/split", retry=FAST_RETRY) as c, \
            pytest.raises(EdgeClientError, match="HTTP 200 instead of a WebSocket upgrade"):
        c.complete(prompt_ids=PROMPT, max_tokens=2)


def test_unreachable_cloud_fails_after_retries(tiny_bundle, caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="edge_client.generation"), \
            EdgeClient(tiny_bundle, f"ws://127.0.0.1:{port}/v1/split", retry=FAST_RETRY) as c, \
            pytest.raises(EdgeClientError, match="cannot reach") as ei:
        c.complete(prompt_ids=PROMPT, max_tokens=2)
    assert ei.value.code == "unreachable" and time.monotonic() - t0 < 10
    # each retry of a new request's connect is logged, as a dropped request's reconnects are
    retries = [r.message for r in caplog.records if r.message.startswith("cannot connect")]
    assert len(retries) == FAST_RETRY.max_retries and f"retry {FAST_RETRY.max_retries} in" in retries[-1]


def test_a_dead_cloud_is_retried_for_the_reconnect_window_then_fails(tiny_bundle):
    """Without a count, the retries last the policy's reconnect window - a server's restart fits in it (its
    default, 90 s; test_faults.py) - and no longer: a dead cloud fails the request, it does not hang the app."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens
    retry = RetryPolicy(connect_timeout_s=2.0, reconnect_window_s=1.5, backoff_initial_s=0.05, backoff_max_s=0.2)
    t0 = time.monotonic()
    with EdgeClient(tiny_bundle, f"ws://127.0.0.1:{port}/v1/split", retry=retry) as c, \
            pytest.raises(EdgeClientError, match=r"cannot reach .* \(retried \d+ times in \d+\.\d s\)") as ei:
        c.complete(prompt_ids=PROMPT, max_tokens=2)
    assert ei.value.code == "unreachable" and 1.5 <= time.monotonic() - t0 < 5


def test_requests_queued_behind_one_retrying_share_its_reconnect_window(tiny_bundle):
    """Four threads' requests on one client while the cloud is down: each retried a whole window of its own once
    the one before it had failed, the fourth failing after four windows (six minutes at the default 90 s). The
    window counts from the first failure since the cloud last answered; each request still tries once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    retry = RetryPolicy(connect_timeout_s=2.0, first_connect_window_s=1.5, backoff_initial_s=0.05, backoff_max_s=0.2)
    codes, t0 = [], time.monotonic()

    def request(c):
        try:
            c.complete(prompt_ids=PROMPT, max_tokens=2)
        except EdgeClientError as e:
            codes.append(e.code)

    with EdgeClient(tiny_bundle, f"ws://127.0.0.1:{port}", retry=retry) as c:
        threads = [threading.Thread(target=request, args=(c,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
    assert codes == ["unreachable"] * 4 and time.monotonic() - t0 < 4.5  # four windows: 6 s and more


def test_a_client_that_never_reached_the_cloud_gives_up_after_the_first_connect_window(tiny_bundle):
    """A wrong URL or a server not started shows in seconds (``first_connect_window_s``), not after the long
    window a reached cloud's restart gets."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    retry = RetryPolicy(connect_timeout_s=2.0, reconnect_window_s=60.0, first_connect_window_s=0.5,
                        backoff_initial_s=0.05, backoff_max_s=0.1)
    t0 = time.monotonic()
    with EdgeClient(tiny_bundle, f"ws://127.0.0.1:{port}", retry=retry) as c, \
            pytest.raises(EdgeClientError, match="cannot reach") as ei:
        c.complete(prompt_ids=PROMPT, max_tokens=2)
    assert ei.value.code == "unreachable" and time.monotonic() - t0 < 5


def test_connect_to_a_dead_cloud_is_retried_and_fails_unreachable(tiny_bundle):
    """``EdgeClient.connect()`` retries as a request does and fails with an EdgeClientError (it raised the
    transport's internal LinkDown at the first refusal)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    retry = RetryPolicy(connect_timeout_s=2.0, reconnect_window_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.1)
    with EdgeClient(tiny_bundle, f"ws://127.0.0.1:{port}", retry=retry) as c, \
            pytest.raises(EdgeClientError, match=r"cannot reach .* \(retried [1-9]\d* times") as ei:
        c.connect()
    assert ei.value.code == "unreachable"


def test_persistent_cache_survives_restart_and_corruption(tiny_bundle, cloud, reference, tmp_path):
    cloud.drop_after_tokens, cloud.forget_sessions = None, False
    kw = dict(codec="fp16", retry=FAST_RETRY, cache_dir=tmp_path)
    with EdgeClient(tiny_bundle, cloud.url, **kw) as c:
        assert c.complete(prompt_ids=PROMPT, max_tokens=N_NEW).token_ids == reference
    files = sorted((tmp_path / c.manifest.bundle_id).glob(f"*{FILE_SUFFIX}"))
    assert len(files) == 2  # 40 prompt tokens: two full blocks of 16
    with EdgeClient(tiny_bundle, cloud.url, **kw) as c:  # a new process would see the same files
        gen = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
        assert gen.token_ids == reference and gen.stats.cached_tokens == 32
    files[0].write_bytes(files[0].read_bytes()[:-10])  # truncated by a crash
    with EdgeClient(tiny_bundle, cloud.url, **kw) as c:
        gen = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
        assert gen.token_ids == reference and c.cache.stats.rejected_files == 1


def test_the_server_base_url_works_like_the_endpoint_url(tiny_bundle, cloud, reference):
    cloud.drop_after_tokens, cloud.forget_sessions = None, False
    for url in (cloud.base_url, cloud.base_url + "/", cloud.base_url + "/v1"):
        with EdgeClient(tiny_bundle, url, codec="fp16", retry=FAST_RETRY) as c:
            assert c.config.url == cloud.url
            assert c.complete(prompt_ids=PROMPT, max_tokens=N_NEW).token_ids == reference


def test_a_url_without_a_split_endpoint_says_so(tiny_bundle, cloud):
    url = cloud.base_url + "/v2/nothing"
    t0 = time.monotonic()
    with EdgeClient(tiny_bundle, url, retry=FAST_RETRY) as c, \
            pytest.raises(EdgeClientError, match=f"no split endpoint at {url}") as ei:
        c.complete(prompt_ids=PROMPT, max_tokens=2)
    assert ei.value.code == "no_split_endpoint" and "API key" not in str(ei.value)
    assert time.monotonic() - t0 < 5  # refused, not retried
