"""Web pages in the user's browser against ``autoglm-cloud serve`` on loopback without a key (shared.http_browsers):
a cross-site "simple" POST and a page whose name was rebound to 127.0.0.1 (DNS rebinding), sent with the headers a
browser sends. Real uvicorn servers, real HTTP and WebSocket handshakes."""

from __future__ import annotations

import asyncio
import contextlib
import copy

import httpx
import pytest
import websockets
from cloud_support import ServerThread

from cloud_server.app import create_app
from cloud_server.config import ConfigError, EngineConfig, ServerConfig
from cloud_server.runtime import CloudRuntime

COMPLETION = b'{"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}'  # a random preset takes token ids
# what a page on evil.example sends with fetch(url, {method: "POST", mode: "no-cors", body}): no preflight
CROSS_SITE = {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}


@contextlib.contextmanager
def _full_server(tiny_lm, **options):
    cfg = ServerConfig(full="tiny-glm4", model_name="tiny", **options,
                       engine=EngineConfig(num_blocks=32, block_size=4, max_model_len=64))
    rt = CloudRuntime(cfg, loaded=copy.copy(tiny_lm)).start()
    try:
        with ServerThread(create_app(rt)) as srv:
            yield srv
    finally:
        rt.stop()


@pytest.fixture(scope="module")
def server(tiny_lm):
    with _full_server(tiny_lm) as srv:
        yield srv


def _refused(r: httpx.Response, code: str) -> bool:
    return r.status_code == 403 and r.json()["error"]["code"] == code


def test_a_web_page_cannot_drive_a_loopback_server_nor_read_it_rebound(server):
    """`serve --full` on 127.0.0.1 without a key answered every page the user's browser opened: a cross-site POST of
    text/plain, a form or no type (no CORS preflight) was parsed as JSON and generated (200: the compute spent, the
    answer unread), and a page whose name was rebound to 127.0.0.1 read /v1/models and the answers same-origin
    (Host: evil.example). Now 403s before anything runs; an app (no Origin, JSON) is served as before."""
    url, port = f"{server.url}/v1/completions", server.port
    for content_type in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None):
        headers = {**CROSS_SITE, **({"Content-Type": content_type} if content_type else {})}
        assert _refused(httpx.post(url, content=COMPLETION, headers=headers), "forbidden_origin"), content_type
    rebound = {"Host": f"evil.example:{port}", "Sec-Fetch-Site": "same-origin"}
    assert _refused(httpx.get(f"{server.url}/v1/models", headers=rebound), "forbidden_host")
    assert _refused(httpx.post(url, content=COMPLETION, headers={**rebound, "Origin": f"http://evil.example:{port}",
                                                                 "Content-Type": "text/plain"}), "forbidden_host")
    # a body that is not application/json is never read as JSON, whoever sends it
    r = httpx.post(url, content=COMPLETION, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
    assert httpx.post(url, content=COMPLETION).status_code == 415
    # apps, and the server's own origin under a loopback name
    assert httpx.post(url, content=COMPLETION, headers={"Content-Type": "application/json; charset=utf-8"}) \
        .status_code == 200
    own = {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}", "Content-Type": "application/json"}
    assert httpx.post(url, content=COMPLETION, headers=own).status_code == 200
    import openai

    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)
    done = oa.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2)  # (random weights: may end on EOS)
    assert done.choices[0].finish_reason in ("length", "stop") and 1 <= done.usage.completion_tokens <= 2


def test_allowed_origins_get_cors_and_allowed_hosts_are_served(tiny_lm):
    """--allowed-origins: a listed page's preflight is answered (204, its headers echoed) and its requests carry
    Access-Control-Allow-Origin; another page's preflight is the same 403 as its request. --allowed-hosts: a name
    a proxy passes on (Host) is served beside loopback."""
    with _full_server(tiny_lm, allowed_origins="https://app.example", allowed_hosts=("api.example",)) as srv:
        url = f"{srv.url}/v1/completions"
        ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
        pre = httpx.options(url, headers={"Origin": "https://app.example", **ask})
        assert pre.status_code == 204, pre.text
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        assert pre.headers["access-control-allow-headers"] == "authorization,content-type"
        assert "POST" in pre.headers["access-control-allow-methods"] and pre.headers["vary"] == "Origin"
        assert _refused(httpx.options(url, headers={"Origin": "https://evil.example", **ask}), "forbidden_origin")
        r = httpx.post(url, content=COMPLETION, headers={"Origin": "https://app.example",
                                                         "Content-Type": "application/json"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert httpx.get(f"{srv.url}/v1/models", headers={"Host": "api.example"}).status_code == 200
        assert _refused(httpx.get(f"{srv.url}/v1/models", headers={"Host": "evil.example"}), "forbidden_host")


def test_a_web_pages_websocket_is_refused_before_the_upgrade_and_an_edge_is_not(tiny_bundle):
    """A WebSocket is no CORS request: any page could open ws://127.0.0.1:PORT/v1/split (101) and speak the split
    protocol. A handshake with another site's Origin or a rebound Host is a 403; the edge sends no Origin."""
    rt = CloudRuntime(ServerConfig(bundle=tiny_bundle, model_name="tiny")).start()
    try:
        with ServerThread(create_app(rt)) as srv:
            async def handshake(headers: dict) -> int:
                try:
                    async with websockets.connect(srv.ws_url, additional_headers=headers, open_timeout=10):
                        return 101
                except websockets.InvalidStatus as e:
                    return e.response.status_code

            assert asyncio.run(handshake({"Origin": "https://evil.example"})) == 403
            assert asyncio.run(handshake({})) == 101
            assert asyncio.run(handshake({"Origin": f"http://127.0.0.1:{srv.port}"})) == 101  # its own origin
    finally:
        rt.stop()


@pytest.mark.parametrize("options, said", [
    ({"allowed_hosts": "api.example:443"}, "allowed_hosts: 'api.example:443' is no host name"),
    ({"allowed_hosts": "https://api.example"}, "is no host name"),
    ({"allowed_origins": "https://app.example/"}, "allowed_origins: 'https://app.example/' is no origin"),
    ({"allowed_origins": "app.example"}, "is no origin"),
    ({"allowed_origins": "null"}, "is no origin"),
])
def test_a_list_entry_that_is_no_host_or_origin_is_refused(options, said):
    with pytest.raises(ConfigError) as e:
        ServerConfig(full="tiny-glm4", **options)
    assert said in str(e.value)
