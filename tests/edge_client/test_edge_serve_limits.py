"""``autoglm-edge serve``'s limits, against a real ``autoglm-edge serve`` process, as the cloud's front has them.
Deadlines on a request's head and body (``--handshake-timeout-s``): anything reaching the local port (a local app, a
page's fetch, a stray client) that opened a connection and sent nothing, half a request line, or a request body that
stopped or came a byte at a time held its socket and request for ever (shared.http_protocol,
shared.openai_routes.read_body). A cap on requests in flight (``--max-http-requests``): each request waiting its
turn held its body, and an app sending many at once grew the endpoint's memory without bound
(shared.http_limits)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import pytest

from edge_client.cli import main as edge_main

DEAD_URL = "ws://127.0.0.1:9"  # nothing listens: none of these requests reaches a cloud
DEADLINE_S = 1.5
POST_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\n\r\n{")


def _serve(bundle, *flags: str) -> tuple[subprocess.Popen, int]:
    """A real ``autoglm-edge serve`` on a free port, and the port its banner names."""
    proc = subprocess.Popen([sys.executable, "-m", "edge_client.cli", "serve", "--bundle", str(bundle), "--url",
                             DEAD_URL, "--port", "0", *flags], stderr=subprocess.PIPE, text=True)
    banner = proc.stderr.readline()  # the first line: the banner, or the error it exited with
    found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", banner)
    if found is None:
        proc.kill()
        proc.wait()
        pytest.fail(f"autoglm-edge serve did not start: {banner}{proc.stderr.read()}")
    return proc, int(found.group(1))


def _answer(sock: socket.socket, within_s: float) -> bytes:
    """What the server sends ``sock`` until it closes it; fails if it is still open after ``within_s``."""
    sock.settimeout(within_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pytest.fail(f"still open after {within_s} s (sent {data[:80]!r})")
    return data


def _assert_408(reply: bytes, why: str) -> None:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), reply[:200]
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and why in error["message"], error


def test_serve_closes_silent_and_half_sent_heads_and_answers_stalled_bodies_408(tiny_bundle):
    proc, port = _serve(tiny_bundle, "--handshake-timeout-s", str(DEADLINE_S))
    try:
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        silent, half_head, stalled, dribbled = conns
        half_head.sendall(b"POST /v1/chat/comp")
        stalled.sendall(POST_HEAD % 100)
        dribbled.sendall(POST_HEAD % 100_000)
        opened = time.monotonic()
        dribbled.settimeout(0.2)
        dribbled_reply = b""
        while time.monotonic() - opened < DEADLINE_S + 3:  # 5 bytes/s: never silent for the deadline, far under
            try:  # the 500 bytes/s a body keeps up once the deadline has passed
                if not (chunk := dribbled.recv(65536)):
                    break
                dribbled_reply += chunk
            except TimeoutError:
                dribbled.send(b" ")
        _assert_408(dribbled_reply, "arrives slower than 500 bytes/s")
        _assert_408(_answer(stalled, 3), "the request body")  # (1 byte, then silence: either of read_body's whys)
        for sock in (silent, half_head):
            assert _answer(sock, 3) == b""  # closed, nothing said: there is no request to answer
        assert time.monotonic() - opened < DEADLINE_S + 3
        with socket.create_connection(("127.0.0.1", port)) as ok:  # the endpoint still answers
            ok.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert _answer(ok, 10).startswith(b"HTTP/1.1 200 ")
        for sock in conns:
            sock.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_answers_requests_past_its_cap_429_at_once(tiny_bundle):
    """Two requests hold both slots (the cloud unreachable: each waits out the first connect's 10 s); the third is
    refused at once, with Retry-After, before its body is read, and the probe still answers."""
    proc, port = _serve(tiny_bundle, "--max-http-requests", "2")
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        for sock in held:
            sock.sendall(request)
        time.sleep(1)  # both in flight
        with socket.create_connection(("127.0.0.1", port)) as third:
            sent = time.monotonic()
            third.sendall(request.replace(b"Host: 127.0.0.1\r\n", b"Host: 127.0.0.1\r\nConnection: close\r\n"))
            head, _, reply = _answer(third, 5).partition(b"\r\n\r\n")
            assert time.monotonic() - sent < 2
        assert head.startswith(b"HTTP/1.1 429 ") and b"retry-after: 1" in head.lower(), head
        assert json.loads(reply)["error"]["code"] == "overloaded"
        with socket.create_connection(("127.0.0.1", port)) as probe:
            probe.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert _answer(probe, 5).startswith(b"HTTP/1.1 200 ")
        for sock in held:
            sock.settimeout(0)
            with pytest.raises(BlockingIOError):  # still waiting for the cloud: the slots were theirs
                sock.recv(1)
            sock.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("flag, value, problem", [
    *[("--handshake-timeout-s", v, f"must be a number of seconds from 0.001 to 2147483 (got {float(v)!r})")
      for v in ("0", "-1", "1e-9", "nan", "inf", "1e300")],  # 0, a negative or under 1 ms: every request timed out;
    # NaN, infinity or longer than the wire's int32 of milliseconds: none (the cloud's rule, one helper)
    ("--max-http-requests", "0", "must be >= 1 (got 0)"),  # every request refused
])
def test_a_limit_that_limits_nothing_or_everything_is_refused_in_one_line(flag, value, problem, tiny_bundle, capsys):
    assert edge_main(["serve", "--bundle", str(tiny_bundle), "--url", DEAD_URL, "--port", "0", flag, value]) == 2
    assert capsys.readouterr().err == f"autoglm-edge serve: error: {flag} {problem}\n"
