"""The bundle download routes (cloud_server/bundle_files.py): listing, manifest, files with ETag and Range,
nothing but the edge half, behind the API key."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time

import pytest
from cloud_support import ServerThread
from fastapi.testclient import TestClient

from cloud_server import bundle_files
from cloud_server.app import create_app
from cloud_server.bundle_files import BundleCatalog, RangeNotSatisfiable, parse_range
from cloud_server.config import EngineConfig, ServerConfig
from cloud_server.runtime import CloudRuntime
from shared.manifest import BundleError, Manifest

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FRONT = "edge/front.onnx"


def _client(bundle, *more) -> TestClient:
    cfg = ServerConfig(bundle=bundle, more_bundles=more, api_key=KEY, engine=EngineConfig(device="cpu"))
    # the routes read files only: no engine needed; a loopback Host (TestClient's "testserver" is refused 403)
    return TestClient(create_app(CloudRuntime(cfg)), base_url="http://127.0.0.1")


@pytest.fixture(scope="module")
def http(tiny_glm4_fp32_bundle, tiny_glm4_int8_bundle):
    with _client(tiny_glm4_fp32_bundle, tiny_glm4_int8_bundle) as c:
        yield c


def test_listing_names_the_bundle_and_its_edge_variants(http, tiny_glm4_fp32_bundle):
    m = Manifest.load(tiny_glm4_fp32_bundle)
    body = http.get("/v1/bundles", headers=AUTH).json()
    [entry] = body["data"]
    assert entry["id"] == m.bundle_id and entry["split_layer"] == 2 and entry["model"] == tiny_glm4_fp32_bundle.name
    assert [v["edge_quant"] for v in entry["edge_variants"]] == ["fp32", "int8"]
    edge_bytes = sum(a.bytes for a in m.artifacts.values() if a.role != "cloud")
    assert entry["edge_variants"][0]["bytes"] == edge_bytes


def test_manifest_is_served_byte_for_byte_per_variant(http, tiny_glm4_fp32_bundle, tiny_glm4_int8_bundle):
    bid = Manifest.load(tiny_glm4_fp32_bundle).bundle_id
    r = http.get(f"/v1/bundles/{bid}/manifest", headers=AUTH)
    assert r.status_code == 200 and r.content == (tiny_glm4_fp32_bundle / "manifest.json").read_bytes()
    r8 = http.get(f"/v1/bundles/{bid}/manifest", params={"edge": "int8"}, headers=AUTH)
    assert json.loads(r8.content)["edge_quant"] == "int8"
    assert http.get(f"/v1/bundles/{bid}/manifest", params={"edge": "int4"}, headers=AUTH).status_code == 404
    assert http.get("/v1/bundles/" + "0" * 32 + "/manifest", headers=AUTH).status_code == 404


def test_a_file_whole_and_by_range(http, tiny_glm4_fp32_bundle):
    m = Manifest.load(tiny_glm4_fp32_bundle)
    data = (tiny_glm4_fp32_bundle / FRONT).read_bytes()
    url = f"/v1/bundles/{m.bundle_id}/files/{FRONT}"
    whole = http.get(url, headers=AUTH)
    assert whole.status_code == 200 and whole.content == data
    assert whole.headers["etag"] == f'"{m.artifacts[FRONT].sha256}"' == f'"{hashlib.sha256(data).hexdigest()}"'
    assert whole.headers["accept-ranges"] == "bytes"
    part = http.get(url, headers={**AUTH, "Range": "bytes=100-1099"})
    assert part.status_code == 206 and part.content == data[100:1100]
    assert part.headers["content-range"] == f"bytes 100-1099/{len(data)}"
    tail = http.get(url, headers={**AUTH, "Range": f"bytes={len(data) - 10}-"})
    assert tail.status_code == 206 and tail.content == data[-10:]
    suffix = http.get(url, headers={**AUTH, "Range": "bytes=-7"})
    assert suffix.status_code == 206 and suffix.content == data[-7:]
    past = http.get(url, headers={**AUTH, "Range": f"bytes={len(data)}-"})
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{len(data)}"
    # If-Range with another ETag: the file changed since the partial copy, so all of it comes back
    stale = http.get(url, headers={**AUTH, "Range": "bytes=100-", "If-Range": '"0000"'})
    assert stale.status_code == 200 and stale.content == data
    fresh = http.get(url, headers={**AUTH, "Range": "bytes=100-", "If-Range": whole.headers["etag"]})
    assert fresh.status_code == 206 and fresh.content == data[100:]
    assert http.get(url, headers={**AUTH, "If-None-Match": whole.headers["etag"]}).status_code == 304
    head = http.head(url, headers=AUTH)
    assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) == len(data)


def test_shared_files_are_served(http, tiny_glm4_fp32_bundle):
    m = Manifest.load(tiny_glm4_fp32_bundle)
    r = http.get(f"/v1/bundles/{m.bundle_id}/files/calibration.json", headers=AUTH)
    assert r.status_code == 200 and r.content == (tiny_glm4_fp32_bundle / "calibration.json").read_bytes()


def test_cloud_weights_and_unlisted_paths_are_not_served(http, tiny_glm4_fp32_bundle):
    m = Manifest.load(tiny_glm4_fp32_bundle)
    cloud = [rel for rel, a in m.artifacts.items() if a.role == "cloud"]
    assert "cloud/back.safetensors" in cloud
    base = f"/v1/bundles/{m.bundle_id}/files/"
    for rel in [*cloud, "manifest.json", "edge", "edge/", "nonexistent.bin", "../manifest.json",
                "edge/../cloud/back.safetensors", "%2e%2e/%2e%2e/etc/passwd", "..%2F..%2Fetc%2Fpasswd",
                "/etc/passwd", "edge/%2e%2e/cloud/config.json"]:
        r = http.get(base + rel, headers=AUTH)
        assert r.status_code == 404, (rel, r.status_code)
        assert len(r.content) < 1024  # an error body, never the file


def test_a_symlink_out_of_the_bundle_is_not_served(tmp_path, tiny_glm4_fp32_bundle):
    b = tmp_path / "b"
    shutil.copytree(tiny_glm4_fp32_bundle, b)
    m = Manifest.load(b)
    outside = tmp_path / "secret.bin"
    outside.write_bytes((b / FRONT).read_bytes())  # same bytes, same size: only the location is wrong
    (b / FRONT).unlink()
    (b / FRONT).symlink_to(outside)
    with _client(b) as c:
        assert c.get(f"/v1/bundles/{m.bundle_id}/files/{FRONT}", headers=AUTH).status_code == 404


def test_a_file_changed_on_disk_is_refused(tmp_path, tiny_glm4_fp32_bundle):
    b = tmp_path / "b"
    shutil.copytree(tiny_glm4_fp32_bundle, b)
    m = Manifest.load(b)
    url = f"/v1/bundles/{m.bundle_id}/files/{FRONT}"
    good = (b / FRONT).read_bytes()
    with _client(b) as c:
        assert c.get(url, headers=AUTH).content == good  # hashed and found right
        with open(b / FRONT, "ab") as f:  # longer
            f.write(b"x")
        r = c.get(url, headers=AUTH)
        assert r.status_code == 500 and "differs from its manifest" in r.text
        tampered = bytearray(good)  # same size, one byte flipped, after it was served once
        tampered[len(good) // 2] ^= 0xFF
        (b / FRONT).write_bytes(bytes(tampered))
        for headers in (AUTH, {**AUTH, "Range": "bytes=0-99"}):
            r = c.get(url, headers=headers)
            assert r.status_code == 500 and "differs from its manifest" in r.text, headers
        (b / FRONT).write_bytes(good)  # put back: served again
        assert c.get(url, headers=AUTH).content == good


def test_a_listed_edge_file_missing_on_the_server_is_a_logged_500(tmp_path, tiny_glm4_fp32_bundle, caplog):
    """A server deployed with its bundle's cloud half only (the edge folder left out) offered the edge for download
    and answered its front 404 "'edge/front.onnx' is not an edge file of bundle ...", logging nothing: the phone
    was told the manifest's own file is none of it, the operator never heard; it is the server's fault (500) and
    logged, as a changed file is."""
    b = tmp_path / "b"
    shutil.copytree(tiny_glm4_fp32_bundle, b, ignore=shutil.ignore_patterns("edge"))
    m = Manifest.load(b)
    with _client(b) as c, caplog.at_level("ERROR", logger="autoglm.cloud.bundles"):
        r = c.get(f"/v1/bundles/{m.bundle_id}/files/{FRONT}", headers=AUTH)
    assert r.status_code == 500 and "tell the operator" in r.text, (r.status_code, r.text)  # (404 before)
    assert str(b / FRONT) in caplog.text


def test_the_routes_need_the_api_key(http, tiny_glm4_fp32_bundle):
    bid = Manifest.load(tiny_glm4_fp32_bundle).bundle_id
    for url in ("/v1/bundles", f"/v1/bundles/{bid}/manifest", f"/v1/bundles/{bid}/files/{FRONT}"):
        assert http.get(url).status_code == 401
        assert http.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_two_edges_of_one_variant_are_refused(tiny_glm4_fp32_bundle):
    with pytest.raises(BundleError, match="a second fp32 edge"):
        BundleCatalog([tiny_glm4_fp32_bundle, tiny_glm4_fp32_bundle])


@pytest.mark.parametrize("header,size,want", [
    (None, 10, None), ("bytes=0-", 10, (0, 9)), ("bytes=2-4", 10, (2, 4)), ("bytes=5-100", 10, (5, 9)),
    ("bytes=-3", 10, (7, 9)), ("bytes=-30", 10, (0, 9)), ("bytes=0-1,4-5", 10, None), ("items=0-1", 10, None),
])
def test_parse_range(header, size, want):
    assert parse_range(header, size) == want


@pytest.mark.parametrize("header,size", [("bytes=10-", 10), ("bytes=5-2", 10), ("bytes=-0", 10), ("bytes=0-", 0)])
def test_parse_range_unsatisfiable(header, size):
    with pytest.raises(RangeNotSatisfiable):
        parse_range(header, size)


def test_a_download_nobody_reads_gives_its_request_slot_back(monkeypatch, tmp_path, tiny_glm4_fp32_bundle):
    """A client that asks for a big file and stops reading must not hold a --max-http-requests slot forever."""
    b = tmp_path / "b"
    shutil.copytree(tiny_glm4_fp32_bundle, b)
    m = Manifest.load(b)
    (b / "edge" / "pad.bin").write_bytes(os.urandom(24 << 20))  # more than the sockets' buffers hold
    m.add_artifact(b, "edge/pad.bin", "edge")
    m.save(b)
    monkeypatch.setattr(bundle_files, "SEND_STALL_S", 1.0, raising=False)
    cfg = ServerConfig(bundle=b, api_key=KEY, max_http_requests=1, engine=EngineConfig(device="cpu"))
    with ServerThread(create_app(CloudRuntime(cfg))) as srv, socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", srv.port))
        s.sendall(f"GET /v1/bundles/{m.bundle_id}/files/edge/pad.bin HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  f"Authorization: Bearer {KEY}\r\n\r\n".encode())
        s.recv(1024)  # it started; now nothing more is read
        import httpx

        codes = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            codes.append(httpx.get(srv.url + "/v1/bundles", headers=AUTH, timeout=5).status_code)
            if codes[-1] == 200:
                break
            time.sleep(0.2)
        assert codes[0] == 429 and codes[-1] == 200, codes  # the stalled download let go of its slot


def test_the_connection_cap_holds_websockets_and_lets_the_probes_through(tiny_glm4_fp32_bundle):
    """--max-connections was uvicorn's limit_concurrency, which an upgrade skips: it refused no WebSocket (8 sessions
    opened under a cap of 3) but counted them, and once the phones' sessions reached it every probe and /metrics
    got 503 - the liveness probe restarted a busy pod, the autoscaler lost its metrics. Now the cap refuses the
    excess WebSocket before its upgrade (503, a proxy's next replica), counts HTTP requests too, and never the
    probes. The refused session is counted (autoglm:sessions_refused_total{reason="max_connections"}: it was not,
    so phones turned away for load showed nowhere)."""
    import httpx
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    from cloud_server.app import uvicorn_config
    from cloud_server.metrics import ServerMetrics

    cfg = ServerConfig(bundle=tiny_glm4_fp32_bundle, api_key=KEY, max_connections=2, engine=EngineConfig(device="cpu"))
    runtime = CloudRuntime(cfg)
    runtime.metrics = ServerMetrics("tiny")  # what a started runtime has; the routes and the upgrade need no engine
    app = create_app(runtime)
    served = uvicorn_config(app, cfg)  # what `autoglm-cloud serve` gives uvicorn
    with ServerThread(app, limit_concurrency=served.limit_concurrency) as srv:
        url = srv.ws_url
        with connect(url, additional_headers=AUTH), connect(url, additional_headers=AUTH):  # the cap, open
            with pytest.raises(InvalidStatus) as refused:
                with connect(url, additional_headers=AUTH):
                    pass
            assert refused.value.response.status_code == 503
            assert httpx.get(srv.url + "/v1/bundles", headers=AUTH).status_code == 503
            for probe in ("/health", "/metrics"):
                assert httpx.get(srv.url + probe).status_code == 200, probe
            assert 'autoglm:sessions_refused_total{model_name="tiny",reason="max_connections"} 1.0' in \
                httpx.get(srv.url + "/metrics").text
        assert httpx.get(srv.url + "/v1/bundles", headers=AUTH).status_code == 200
