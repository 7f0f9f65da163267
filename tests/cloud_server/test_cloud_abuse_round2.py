"""Held-out abuse, round 2, on one real server with an API-keys file (two tenants): the bundle download
routes (Range headers, paths that are no edge file, HEAD, auth) and WebSocket resume (another tenant's token,
two resumes of one token at once, a token past its grace period, limits on requests per session)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import websockets
from cloud_support import EdgeSim, ServerThread

from cloud_server import auth
from cloud_server.app import create_app
from cloud_server.bundle_files import parse_range
from cloud_server.config import EngineConfig, ServerConfig
from cloud_server.runtime import CloudRuntime
from shared import protocol as P
from shared.manifest import Manifest

FRONT = "edge/front.onnx"
HUGE = "9" * 5000  # more digits than int() takes from a string (4300)


@pytest.fixture(scope="module")
def srv(tiny_bundle, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    _, alice = auth.add_key(path, "alice")
    _, bob = auth.add_key(path, "bob")
    rt = CloudRuntime(ServerConfig(bundle=tiny_bundle, keys_file=path, open_probes=False, model_name="tiny",
                                   session_grace_s=0.5, engine=EngineConfig(num_blocks=64, block_size=4))).start()
    app = create_app(rt)
    with ServerThread(app) as s:
        s.runtime, s.app, s.alice, s.bob = rt, app, alice, bob
        s.manifest = Manifest.load(tiny_bundle)
        yield s
    rt.stop()


def _get(srv, path: str, key: str | None = "alice", method: str = "GET", **headers) -> httpx.Response:
    if key is not None:
        headers["Authorization"] = f"Bearer {getattr(srv, key)}"
    return httpx.request(method, srv.url + path, headers=headers, timeout=30)


# -- bundle downloads ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_range_headers_get_exact_206_416_or_the_whole_file(srv, tiny_bundle, method):
    data = (tiny_bundle / FRONT).read_bytes()
    n = len(data)
    url = f"/v1/bundles/{srv.manifest.bundle_id}/files/{FRONT}"
    cases = {  # Range -> (status, Content-Range, body)
        f"bytes=0-{HUGE}": (206, f"bytes 0-{n - 1}/{n}", data),  # a last position past the end is clamped
        f"bytes={HUGE}-": (416, f"bytes */{n}", b""),
        f"bytes={HUGE}-{HUGE}": (416, f"bytes */{n}", b""),
        f"bytes=-{HUGE}": (206, f"bytes 0-{n - 1}/{n}", data),  # a suffix longer than the file: all of it
        f"bytes=-{n + 5}": (206, f"bytes 0-{n - 1}/{n}", data),
        f"bytes={'0' * 40}5-{'0' * 40}9": (206, f"bytes 5-9/{n}", data[5:10]),  # leading zeros are no size
        "bytes=-0": (416, f"bytes */{n}", b""),
        "bytes=5-2": (416, f"bytes */{n}", b""),
        "bytes=999999999-": (416, f"bytes */{n}", b""),
        "bytes=0-1,5-6": (200, None, data),  # several ranges: served whole (RFC 9110 lets a server ignore them)
        "garbage": (200, None, data),
        "bytes=-": (200, None, data),
        "items=0-5": (200, None, data),
    }
    for rng, (status, content_range, body) in cases.items():
        r = _get(srv, url, method=method, Range=rng)
        assert r.status_code == status, (rng[:40], r.status_code, r.text[:200])
        assert r.headers.get("content-range") == content_range, rng[:40]
        assert int(r.headers["content-length"]) == len(body), rng[:40]
        assert r.content == (body if method == "GET" else b""), rng[:40]
    assert parse_range(f"bytes=1-{HUGE}", 10) == (1, 9)


def test_only_edge_files_are_served_and_only_with_a_key(srv):
    bid = srv.manifest.bundle_id
    cloud = [k for k, a in srv.manifest.artifacts.items() if a.role == "cloud"]
    assert cloud
    for rel in [*cloud, "manifest.json", "edge/../manifest.json", "%2e%2e/%2e%2e/etc/passwd", "..%2fmanifest.json",
                "%2fetc%2fpasswd", "edge%5cfront.onnx", f"{FRONT}%00", "a" * 5000,
                "edge/front.onnx/", "EDGE/front.onnx"]:
        for method in ("GET", "HEAD"):
            r = _get(srv, f"/v1/bundles/{bid}/files/{rel}", method=method)
            assert r.status_code == 404, (rel[:40], method, r.status_code)
    assert _get(srv, f"/v1/bundles/{'0' * 32}/files/{FRONT}").status_code == 404
    assert _get(srv, f"/v1/bundles/{bid}/files/{FRONT}?edge=int4").status_code == 404
    for path in ("/v1/bundles", f"/v1/bundles/{bid}/manifest", f"/v1/bundles/{bid}/files/{FRONT}"):
        assert _get(srv, path, key=None).status_code == 401
        assert _get(srv, path, key="bob").status_code == 200  # a tenant's key: the edge half is not secret per tenant
    assert _get(srv, f"/v1/bundles/{bid}/files/{FRONT}", key=None, method="HEAD").status_code == 401


def test_every_get_route_answers_head_with_the_gets_status_and_headers(srv):
    """HEAD on the GET routes (/health, /ready, /v1/models, the bundle listing and manifest) was a 405 (FastAPI's
    ``get`` takes GET alone), though RFC 9110 asks a server to answer HEAD wherever it answers GET: ``curl -I`` and
    uptime monitors that probe with HEAD read a healthy server as failing. Only the bundle files took it."""
    bid = srv.manifest.bundle_id
    for path in ("/health", "/ready", "/metrics", "/v1/models", "/v1/models/tiny", "/v1/models/nope", "/v1/bundles",
                 f"/v1/bundles/{bid}/manifest"):
        got, head = _get(srv, path), _get(srv, path, method="HEAD")
        assert (head.status_code, head.content) == (got.status_code, b""), (path, head.status_code)
        assert head.headers["content-length"] == str(len(got.content)), path
        assert _get(srv, path, key=None, method="HEAD").status_code == 401, path  # the key still guards it
    assert _get(srv, "/v1/completions", method="HEAD").status_code == 405  # a POST route takes no HEAD


def test_a_plain_http_request_to_the_split_endpoint_is_told_it_lacks_the_upgrade(srv):
    """/v1/split without 'Upgrade: websocket' (curl, or a proxy that does not pass Upgrade and Connection on) was a
    404 'Not Found' on the route the docs name, and the edge said 'no split endpoint at .../v1/split ... the cloud
    serves it at <base URL>/v1/split, unless it runs in full-model mode': the operator checked a right URL and
    mode. It is 426 Upgrade Required saying what the request lacked (with a key; without one, 401 as the upgrade)."""
    for method in ("GET", "HEAD"):
        r = _get(srv, "/v1/split", method=method)
        assert r.status_code == 426 and r.headers["upgrade"] == "websocket", (method, r.status_code)
    r = _get(srv, "/v1/split")
    assert r.json()["error"]["code"] == "upgrade_required" and "Upgrade: websocket" in r.json()["error"]["message"]
    assert _get(srv, "/v1/split", key=None).status_code == 401


# -- WebSocket resume ---------------------------------------------------------------------------------------
def _edge(srv, tiny_bundle, key: str, front=None) -> EdgeSim:
    return EdgeSim(srv.ws_url, tiny_bundle, srv.manifest.bundle_id, api_key=getattr(srv, key), front=front)


async def _state(edge: EdgeSim, wait: float = 1.0):
    """"open" if the server keeps the link open for ``wait`` s (frames read meanwhile are dropped), else the close
    code."""
    try:
        while True:
            await asyncio.wait_for(edge.ws.recv(), wait)
    except asyncio.TimeoutError:
        return "open"
    except websockets.ConnectionClosed as e:
        return e.rcvd.code if e.rcvd else None


def test_two_resumes_of_one_token_at_once_leave_one_link(srv, tiny_bundle):
    registry = srv.app.state.split.registry

    async def main():
        first = _edge(srv, tiny_bundle, "alice")
        welcome = await first.connect()
        first.kill()  # no close: the session is detached, resumable
        await asyncio.sleep(0.1)
        for _ in range(3):
            a, b = _edge(srv, tiny_bundle, "alice", first.front), _edge(srv, tiny_bundle, "alice", first.front)
            wa, wb = await asyncio.gather(a.connect(welcome.resume_token), b.connect(welcome.resume_token))
            assert wa.session_id == wb.session_id == welcome.session_id and wa.resumed and wb.resumed
            states = await asyncio.gather(_state(a), _state(b))
            # the later attach took the session over: exactly one link serves it, the other is closed (1000)
            assert sorted(states, key=str) == [1000, "open"], states
            live = a if states[0] == "open" else b
            session = registry.by_id[welcome.session_id]
            assert session.attached and session.ws is not None
            tokens, finish, _ = await live.generate(f"r{_}", [5, 6, 7, 8], 3)
            assert len(tokens) == 3 and finish == "length"
            live.kill()
            await asyncio.sleep(0.1)
        await _edge(srv, tiny_bundle, "alice").connect(welcome.resume_token)  # tidy: replaced below by grace

    asyncio.run(main())


def test_resume_tokens_do_not_cross_tenants_or_outlive_their_grace(srv, tiny_bundle):
    registry = srv.app.state.split.registry

    async def main():
        a = _edge(srv, tiny_bundle, "alice")
        wa = await a.connect()
        tokens, finish, _ = await a.generate("mine", [9, 8, 7, 6], 2)
        assert finish == "length"
        b = _edge(srv, tiny_bundle, "bob", a.front)
        wb = await b.connect(wa.resume_token)  # alice's token on bob's key: a new session of bob's
        assert not wb.resumed and wb.session_id != wa.session_id and wb.requests == []
        assert registry.by_id[wa.session_id].attached  # alice's session untouched
        assert await _state(a, 0.3) == "open"
        await b.send(P.Cancel(request_id="mine"))  # alice's request id, on bob's session: unknown here
        await b.send(P.Resume(request_id="mine", have_tokens=0))
        err = await b.recv(5)  # never alice's tokens (a Resumed)
        assert isinstance(err, P.Error) and err.code == "resume_failed" and not err.fatal, err
        assert registry.by_id[wa.session_id].record("mine") is not None
        a.kill()
        await asyncio.sleep(1.2)  # past session_grace_s = 0.5
        assert wa.session_id not in registry.by_id
        late = _edge(srv, tiny_bundle, "alice", a.front)
        wl = await late.connect(wa.resume_token)
        assert not wl.resumed and wl.session_id != wa.session_id
        # more requests at once than the session's limit: the extra ones fail, the session goes on
        limit = wl.limits.max_concurrent_requests
        params = P.SamplingParams(max_tokens=50, ignore_eos=True)  # none may finish (and free a slot) early
        for i in range(limit + 2):
            await late.prefill(f"q{i}", late.front.fork(), [5, 6, 7], params)
        got = [await late.recv(30) for _ in range(limit + 2)]
        refused = sorted(m.request_id for m in got if isinstance(m, P.Error))
        assert refused == sorted(f"q{i}" for i in range(limit, limit + 2)), got
        assert all(not m.fatal for m in got if isinstance(m, P.Error))
        assert sum(isinstance(m, P.Tokens) for m in got) == limit
        for i in range(limit):
            await late.send(P.Cancel(request_id=f"q{i}"))
        await late.close()
        b.kill()

    asyncio.run(main())
