"""shared.http_browsers' rules on their own: which Host and Origin headers a policy serves."""

from __future__ import annotations

import pytest

from shared.http_browsers import BrowserPolicy, is_loopback, json_content_type_problem


@pytest.mark.parametrize("host, loopback", [
    ("localhost", True), ("LOCALHOST.", True), ("app.localhost", True), ("127.0.0.1", True), ("127.8.9.10", True),
    ("::1", True), ("0.0.0.0", False), ("192.168.1.2", False), ("localhost.evil.example", False),
    ("evil.example", False), ("127.0.0.1.nip.io", False),
])
def test_loopback_names_and_addresses(host, loopback):
    assert is_loopback(host) is loopback


def test_host_headers_a_loopback_server_serves():
    """The Host header, port and IPv6 brackets aside: loopback, the listen address and the listed names; a
    rebound name is not served. Beyond loopback, without a list, any Host is."""
    policy = BrowserPolicy.serving("127.0.0.1", "api.example")
    for host in ("127.0.0.1:8001", "localhost:8001", "[::1]:8001", "localhost", "API.example", "api.example:443"):
        assert policy.host_allowed(host), host
    for host in ("evil.example:8001", "evil.example", "[::2]:8001", "api.example.evil.example", ""):
        assert not policy.host_allowed(host), host
    assert BrowserPolicy.serving("0.0.0.0").host_allowed("evil.example:8001")
    assert not BrowserPolicy.serving("0.0.0.0", "api.example").host_allowed("evil.example:8001")
    assert BrowserPolicy.serving("10.0.0.5", "api.example").host_allowed("10.0.0.5:8000")  # autoglm-cloud health


def test_origins_a_server_serves():
    """Its own origin (scheme, host, port; a default port written or not) and the listed ones, nothing else: not
    another port of the same host, not null, not a malformed one."""
    policy = BrowserPolicy.serving("127.0.0.1", (), "https://app.example, http://localhost:3000")
    assert policy.origin_allowed("http://127.0.0.1:8001", "http", "127.0.0.1:8001")
    assert policy.origin_allowed("http://localhost", "ws", "localhost:80")  # a WebSocket's own page
    assert policy.origin_allowed("https://APP.example:443", "http", "127.0.0.1:8001")
    assert policy.origin_allowed("http://localhost:3000", "http", "127.0.0.1:8001")
    for origin in ("http://localhost:3001", "https://127.0.0.1:8001", "null", "http://[x", "https://app.example.evil"):
        assert not policy.origin_allowed(origin, "http", "127.0.0.1:8001"), origin
    assert not policy.origin_allowed("http://127.0.0.1:8001", "http", None)
    assert BrowserPolicy.serving("127.0.0.1", (), "*").origin_allowed("null", "http", "127.0.0.1:8001")


@pytest.mark.parametrize("content_type, json", [
    ("application/json", True), ("Application/JSON; charset=utf-8", True), (" application/json ;x=y", True),
    ("text/plain", False), ("application/x-www-form-urlencoded", False), ("multipart/form-data", False),
    (None, False), ("", False), ("application/jsonp", False),
])
def test_only_application_json_is_read_as_json(content_type, json):
    assert (json_content_type_problem(content_type) is None) is json
