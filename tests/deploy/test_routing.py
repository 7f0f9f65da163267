"""Two tiny replicas behind a real nginx (deploy/nginx/autoglm-split.conf), on localhost.

* Failover: edges whose sessions nginx spread over both replicas (no routing header: round-robin); one
  replica is killed mid-generation; every session reconnects through nginx, lands on the survivor, replays its
  request from the inputs it kept, and ends with exactly the unsplit model's greedy tokens (0 lost, 0 repeated).
* Routing: requests that share a system prompt, each from a new session, hashed on
  ``X-Autoglm-Prefix-Key`` (the prompt's first prefix key) land on the replica that caches it; without the
  header they alternate. The prefix-cache hit rate (the replicas' own ``vllm:prefix_cache_*`` counters) is
  measured both ways.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from model_support import hf_greedy
from deploy_support import DEPLOY, Router, hit_rate, http_get, metric_sum, self_signed

from edge_client.client import EdgeClient
from edge_client.config import RetryPolicy
from edge_client.transport import route_key
from rig.link import LinkEmulator
from shared.link_profiles import LinkProfile
from shared.manifest import Manifest
from shared.prefix_keys import KeyScope

RETRY = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=30.0, max_retries=20, backoff_initial_s=0.1,
                    backoff_max_s=0.5)
N_NEW = 120
# Phones 20 ms from the router: a token's round trip takes >= 20 ms, so 120 tokens take >= 2.4 s and the kill
# lands mid-generation for every session however loaded the test machine is.
PHONE_LINK = LinkProfile("test-20ms", rtt_ms=20.0, jitter_ms=0.0, down_mbps=1000.0, up_mbps=1000.0, loss=0.0)


@pytest.fixture
def replicas(replica_pool):
    """Two live, idle replicas of the tiny fp32 bundle, shared by the module (tests/deploy/conftest.py): the
    failover test kills one, and the next test gets a fresh one in its place. Counters are read as deltas."""
    return replica_pool.get(2)


def test_replica_killed_mid_generation_every_session_completes_on_the_other(
        tiny_glm4_fp32_bundle, tiny_glm4_lm, replicas, nginx_bin, tmp_path):
    rng = np.random.RandomState(3)
    prompts = [[int(t) for t in rng.randint(4, 512, 20 + 3 * i)] for i in range(4)]
    want = [hf_greedy(tiny_glm4_lm.model, p, N_NEW) for p in prompts]
    survivor0 = metric_sum(replicas[1].metrics(), "vllm:generation_tokens_total")
    with Router(nginx_bin, tmp_path / "nginx", [f"127.0.0.1:{r.port}" for r in replicas]) as router, \
            LinkEmulator(router.port, PHONE_LINK) as phones:
        url = f"ws://127.0.0.1:{phones.port}/v1/split"
        clients = [EdgeClient(tiny_glm4_fp32_bundle, url, codec="fp16", retry=RETRY) for _ in prompts]
        try:
            gens = [c.generate(prompt_ids=p, max_tokens=N_NEW) for c, p in zip(clients, prompts)]
            streams = [g.iter_tokens() for g in gens]
            for s in streams:  # every session is generating...
                for _ in range(3):
                    next(s)
            open_on = [metric_sum(r.metrics(), "autoglm:sessions_open") for r in replicas]
            assert open_on == [2, 2], open_on  # no header: nginx's hash falls back to round-robin
            assert metric_sum(replicas[0].metrics(), "vllm:num_requests_running") == 2  # both mid-generation
            replicas[0].kill()  # ...when one replica dies with its sessions and their KV
            for s in streams:
                for _ in s:
                    pass
            got = [g.token_ids for g in gens]
            replays = [g.stats.replays for g in gens]
        finally:
            for c in clients:
                c.close()
    for g, w in zip(got, want):
        assert g == w  # every token, in order, none lost or repeated
    assert sum(replays) == 2 and sorted(replays) == [0, 0, 1, 1]  # the killed replica's two sessions replayed
    # the replays continued where the edges were (prompt + tokens held as the new prompt), not from token 0
    survivor = metric_sum(replicas[1].metrics(), "vllm:generation_tokens_total") - survivor0
    assert 2 * N_NEW + 2 <= survivor <= 4 * N_NEW - 2 * 3  # each replayed session held >= 3 tokens


# -- prefix-aware routing -------------------------------------------------------------------------------------

def test_prefix_hash_routing_beats_round_robin(tiny_glm4_fp32_bundle, replicas, nginx_bin, tmp_path):
    manifest = Manifest.load(tiny_glm4_fp32_bundle)
    rng = np.random.RandomState(9)
    # 3 prompts: an odd count, so round-robin does not pin a prompt to one replica by coincidence
    prompts_hash = [[int(t) for t in rng.randint(4, 512, 64)] for _ in range(3)]  # 4 blocks each
    prompts_rr = [[int(t) for t in rng.randint(4, 512, 64)] for _ in range(3)]  # fresh keys: no carry-over
    per_prompt = 6
    with Router(nginx_bin, tmp_path / "nginx", [f"127.0.0.1:{r.port}" for r in replicas]) as router:
        hashed = hit_rate(replicas, router.ws_url, manifest, prompts_hash, True, per_prompt)
        rr = hit_rate(replicas, router.ws_url, manifest, prompts_rr, False, per_prompt)
        log = router.access_log()
    print(f"\nprefix-cache hit rate over 2 replicas, {len(prompts_hash)} system prompts x {per_prompt} sessions: "
          f"hash on X-Autoglm-Prefix-Key {hashed:.3f}, round-robin {rr:.3f}")
    # hashed: only each prompt's first session misses; its 64 of 72 prompt tokens hit afterwards
    assert hashed == pytest.approx((per_prompt - 1) / per_prompt * 64 / 72, abs=1e-6)
    # round-robin: each prompt's first session on each replica misses
    assert rr < hashed
    # the access log shows each hashed prompt pinned to one upstream
    pinned: dict[str, set[str]] = {}
    for line in log:
        m = re.search(r"upstream=(\S+) prefix=(\S+)", line)
        if m and m.group(2) != "-":
            pinned.setdefault(m.group(2), set()).add(m.group(1))
    assert len(pinned) == len(prompts_hash) and all(len(v) == 1 for v in pinned.values()), pinned


def test_the_real_edge_sends_its_preloaded_prompts_route_key_and_lands_where_it_is_cached(
        tiny_glm4_fp32_bundle, replicas, nginx_bin, tmp_path):
    """EdgeClient end to end: a phone that preloaded a system prompt sends its route key on the upgrade
    (edge_client.transport.route_key), nginx pins that key to one replica, and every phone after the first
    with that prompt reuses the blocks the first one left there."""
    manifest = Manifest.load(tiny_glm4_fp32_bundle)
    rng = np.random.RandomState(11)
    systems = [[int(t) for t in rng.randint(4, 512, 32)] for _ in range(3)]  # 2 blocks of 16 each
    per_prompt = 3

    def counters() -> tuple[float, float]:
        texts = [r.metrics() for r in replicas]
        return (sum(metric_sum(t, "vllm:prefix_cache_hits_total") for t in texts),
                sum(metric_sum(t, "vllm:prefix_cache_queries_total") for t in texts))

    with Router(nginx_bin, tmp_path / "nginx", [f"127.0.0.1:{r.port}" for r in replicas]) as router:
        h0, q0 = counters()
        for _ in range(per_prompt):
            for sp in systems:  # interleaved, as phones arrive; each a new phone with a new session
                client = EdgeClient(tiny_glm4_fp32_bundle, router.ws_url, codec="fp16", retry=RETRY)
                try:
                    client._call(client.session.preload(sp))  # what preload_prompts does after tokenizing
                    gen = client.generate(prompt_ids=sp + [int(t) for t in rng.randint(4, 512, 5)], max_tokens=2)
                    list(gen.iter_tokens())
                    codec0 = next(iter(client.session.codecs))
                finally:
                    client.close()
        log = router.access_log()
    h1, q1 = counters()
    want = {route_key(sp, KeyScope(manifest.bundle_id, manifest.states_variant, codec0), 16, None) for sp in systems}
    pinned: dict[str, set[str]] = {}
    for line in log:
        m = re.search(r"upstream=(\S+) prefix=(\S+)", line)
        if m and "/v1/split" in line:
            pinned.setdefault(m.group(2), set()).add(m.group(1))
    assert set(pinned) == want, (sorted(pinned), sorted(want))  # every upgrade carried its prompt's key
    assert all(len(v) == 1 for v in pinned.values()), pinned  # ...and each key stayed on one replica
    # the first phone per prompt misses; every later one finds its 32 system-prompt tokens cached
    assert h1 - h0 == (per_prompt - 1) * len(systems) * 32 and q1 > q0


def test_the_public_router_passes_the_api_and_not_the_probes_or_metrics(replicas, nginx_bin, tmp_path):
    """The router is the LoadBalancer Service; it proxied every path, so anyone outside could read /metrics (which
    names tenants) and the probes that security.md says to keep internal. Only /v1/ goes through now."""
    with Router(nginx_bin, tmp_path / "nginx", [f"127.0.0.1:{r.port}" for r in replicas]) as router:
        base = f"http://127.0.0.1:{router.port}"
        assert http_get(base + "/v1/models")[0] == 200
        assert http_get(base + "/v1/bundles")[0] == 200
        for path in ("/metrics", "/ready", "/health", "/docs"):
            code, body = http_get(base + path)
            assert code == 404 and json.loads(body)["error"]["code"] == "not_found", (path, code, body[:200])
        assert http_get(f"http://127.0.0.1:{replicas[0].port}/metrics")[0] == 200  # the pods still serve it


def test_a_phone_whose_hashed_replica_is_full_lands_on_another(tiny_glm4_fp32_bundle, replicas, nginx_bin, tmp_path):
    """The route key pins every phone of a system prompt to one replica. When that replica refused the session for
    now (full at --max-sessions; or draining), every retry carried the key and nginx hashed it there again: the phone
    failed 'unreachable' beside a replica with room. After such a refusal the edge's upgrade goes without the key,
    and nginx balances it onto another replica."""
    import contextlib

    from websockets.sync.client import connect

    from shared import protocol as P

    manifest = Manifest.load(tiny_glm4_fp32_bundle)
    system = [int(t) for t in np.random.RandomState(13).randint(4, 512, 32)]
    retry = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=30.0, first_connect_window_s=8.0,
                        backoff_initial_s=0.1, backoff_max_s=0.5)
    with Router(nginx_bin, tmp_path / "nginx", [f"127.0.0.1:{r.port}" for r in replicas]) as router, \
            contextlib.ExitStack() as held:
        phones = [EdgeClient(tiny_glm4_fp32_bundle, router.ws_url, codec="fp16", retry=retry) for _ in range(2)]
        try:
            for phone in phones:
                phone._call(phone.session.preload(system))  # both send the prompt's route key
            phones[0].connect()
            [pinned] = [r for r in replicas if metric_sum(r.metrics(), "autoglm:sessions_open") == 1]
            while True:  # fill the pinned replica's sessions, directly, up to its refusal
                ws = held.enter_context(connect(f"ws://127.0.0.1:{pinned.port}/v1/split", compression=None))
                ws.send(P.encode_message(P.Hello(bundle_id=manifest.bundle_id, codecs=["fp16"])))
                if isinstance(P.decode_message(ws.recv(10)), P.Error):
                    break
                held.callback(ws.send, P.encode_message(P.Close()))  # freed at once, not after the resume grace
            phones[1].connect()  # refused there once (overloaded), then balanced onto the other replica
            other = next(r for r in replicas if r is not pinned)
            assert metric_sum(other.metrics(), "autoglm:sessions_open") == 1
        finally:
            for phone in phones:
                phone.close()
    attempts = [line for line in router.access_log() if "/v1/split" in line]
    assert any("prefix=-" in line and str(other.port) in line for line in attempts), attempts


def test_the_router_leaves_the_body_limit_to_the_replica(replicas, nginx_bin, tmp_path):
    """nginx's default client_max_body_size (1 MiB) refused a larger /v1 body with its own HTML 413, though a
    full-model replica reads more (cloud_server.full_api.max_body_bytes, by its prompt positions and its
    tokenizer's longest token: a 128k-token CJK prompt is 1-2 MB of JSON) and refuses beyond it in OpenAI's shape.
    The router passes such a body on (up to 16 MiB), and the replica's own answer comes back."""
    import urllib.error
    import urllib.request

    body = json.dumps({"model": "m", "prompt": "\u4e00" * (1 << 19)}).encode()  # ~3 MB, JSON-escaped
    with Router(nginx_bin, tmp_path / "nginx", [f"127.0.0.1:{r.port}" for r in replicas]) as router:
        request = urllib.request.Request(f"http://127.0.0.1:{router.port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:  # a split-mode replica serves no completions
            urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 404 and json.loads(e.value.read())["error"]["code"] == "not_found"


def test_the_clusters_router_speaks_tls_only(tiny_glm4_fp32_bundle, replicas, nginx_bin, tmp_path):
    """The router is the public LoadBalancer; it listened on plain HTTP (port 80), so a phone's API key, its prompt's
    hidden states and the tokens crossed the internet in the clear (docs/security.md: never beyond a private
    network). Its listen lines in the cluster (deploy/nginx/k8s/autoglm-listen.conf) are TLS only, on 443."""
    cert, key = self_signed(tmp_path)
    with Router(nginx_bin, tmp_path / "nginx", [f"127.0.0.1:{r.port}" for r in replicas], tls=(cert, key)) as router:
        assert router.ws_url.startswith("wss://")
        with EdgeClient(tiny_glm4_fp32_bundle, router.ws_url, codec="fp16", retry=RETRY, ca_file=cert) as phone:
            assert len(phone.complete(prompt_ids=[5, 17, 99, 4, 250], max_tokens=3).token_ids) == 3
        code, _ = http_get(f"http://127.0.0.1:{router.port}/v1/models")
        assert code == 400  # nginx: a plain HTTP request sent to the HTTPS port
    service = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "router.yaml").read_text()) if d["kind"] == "Service"]
    assert [(p["port"], p["targetPort"]) for p in service[0]["spec"]["ports"]] == [(443, "https")]


def test_the_clusters_router_presents_a_renewed_certificate_without_a_restart(nginx_bin, tmp_path):
    """The router's certificate is the Secret autoglm-router-tls, which a renewal (cert-manager, kubectl apply) updates
    in place. nginx read it once, at start, and went on presenting the old one until it expired: every phone then
    failed tls_verify_failed. The cluster's listen lines read it at each handshake."""
    import shutil
    import socket
    import ssl

    live, first, renewed = (tmp_path / d for d in ("live", "first", "renewed"))
    for d in (live, first, renewed):
        d.mkdir()
    old, new = self_signed(first), self_signed(renewed)
    for src, name in zip(old, ("tls.pem", "tls.key")):
        shutil.copy(src, live / name)

    def presented(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s, \
                ssl._create_unverified_context().wrap_socket(s) as tls:  # noqa: S323 - the test's own certificates
            return tls.getpeercert(binary_form=True)

    def der(pem: Path) -> bytes:
        return ssl.PEM_cert_to_DER_cert(pem.read_text())

    with Router(nginx_bin, tmp_path / "nginx", ["127.0.0.1:1"], tls=(live / "tls.pem", live / "tls.key")) as router:
        assert presented(router.port) == der(old[0])
        for src, name in zip(new, ("tls.pem", "tls.key")):  # the Secret renewed
            shutil.copy(src, live / name)
        assert presented(router.port) == der(new[0])  # no reload, no restart


def test_a_post_that_a_draining_replica_refuses_is_passed_to_another(nginx_bin, tmp_path):
    """A draining (or not yet ready) full-model replica answers every new request 503 ``draining``. nginx's
    proxy_next_upstream passes a request on after a 503 only when it is idempotent unless told ``non_idempotent``,
    so every POST /v1/chat/completions and /v1/completions that the router sent to a draining replica during a rolling
    update came back as that 503 (every other one, with two replicas) while a replica with room stood beside it.
    Here the draining replica is a stub answering exactly what cloud_server answers while draining. Each request is
    one write, head and body: nginx passes on only a body it read whole with the head (the router streams a body on
    unbuffered, and one still arriving cannot be sent twice; its client gets the 503 and retries after Retry-After)."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    def replica(status: int, body: dict) -> ThreadingHTTPServer:
        class Answer(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers["Content-Length"]))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == 503:
                    self.send_header("Retry-After", "1")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    draining = replica(503, {"error": {"message": "the server is draining", "type": "server_error", "param": None,
                                       "code": "draining"}})
    serving = replica(200, {"object": "text_completion", "choices": [{"index": 0, "text": "ok"}]})
    try:
        upstreams = [f"127.0.0.1:{s.server_address[1]}" for s in (draining, serving)]
        with Router(nginx_bin, tmp_path / "nginx", upstreams) as router:
            got = []
            for path in ("/v1/completions", "/v1/chat/completions") * 3:
                body = b'{"model": "m"}'
                with socket.create_connection(("127.0.0.1", router.port), timeout=10) as c:
                    c.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                              f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
                    got.append(int(c.makefile("rb").readline().split()[1]))  # "HTTP/1.1 200 OK"
    finally:
        for s in (draining, serving):
            s.shutdown()
            s.server_close()
    assert got == [200] * 6, got
