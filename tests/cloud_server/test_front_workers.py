"""``autoglm-cloud serve --workers 2``: two WebSocket front-end processes feeding one engine process, as a real
subprocess (one for the module), against ``--workers 1`` for the reference tokens.

Which worker a connection reaches is the kernel's choice (one listening socket shared by both); a session's id
says which holds it (``w0-...`` / ``w1-...``), so the tests that need one session on each worker connect until
they have that. The drain test runs last: it stops the module's server."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
import threading
import time

import httpx
import pytest
import websockets
from cloud_support import EdgeSim, edge_generate, refused_hello

from cloud_server import auth
from cloud_server.engine_host import RENDER_TIMEOUT_S
from edge_client.config import RetryPolicy
from edge_client.demo import LocalCloud
from rig.link import IDEAL, LinkEmulator
from shared import protocol as P
from shared.manifest import Manifest

ARGS = ["--num-blocks", "256", "--block-size", "4", "--variants", "fp32", "--device", "cpu",
        "--max-sessions", "6", "--session-grace-s", "2"]
PROMPTS = [[17, 200, 31, 5, 99, 140, 7], [9, 88, 140, 3, 61], [250, 11, 42, 77, 1, 2, 3, 4], [5, 6, 7]]
N_NEW = 16
RETRY = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=30.0, max_retries=60, backoff_initial_s=0.05,
                    backoff_max_s=0.3)
SLOW_LINK = dataclasses.replace(IDEAL, rtt_ms=20.0, name="rtt-20ms")  # a fault at token k lands mid-generation


@pytest.fixture(scope="module")
def servers(tiny_bundle, tmp_path_factory):
    logs = tmp_path_factory.mktemp("front-workers")
    two = LocalCloud(tiny_bundle, extra_args=ARGS + ["--workers", "2"], log_path=logs / "w2.log").start()
    try:
        with LocalCloud(tiny_bundle, extra_args=ARGS + ["--workers", "1"], log_path=logs / "w1.log") as one:
            reference = {tuple(p): _generate(tiny_bundle, one.ws_url.rsplit("/v1", 1)[0], p) for p in PROMPTS}
        yield two, reference
    finally:
        two.stop()


def _generate(bundle, url: str, prompt: list[int], fault=None, at: tuple[int, ...] = ()):
    """Greedy tokens of ``prompt`` (and the client's stats when a ``fault`` is injected at the tokens ``at``)."""
    tokens, stats = edge_generate(bundle, url, prompt, N_NEW, RETRY, lambda n: fault() if n in at else None,
                                  temperature=0.0)
    return tokens if fault is None else (tokens, stats)


def _metric(cloud: LocalCloud, name: str) -> float:
    text = httpx.get(cloud.http_url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.eE+-]+)$", text, re.M))


def _wait_no_sessions(cloud: LocalCloud, within_s: float) -> float:
    """Poll until no session is open (a closed link's session lingers for its resume grace); the count left."""
    deadline = time.monotonic() + within_s
    while (n := _metric(cloud, "autoglm:sessions_open")) and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def _wait_both_ready(cloud: LocalCloud, within_s: float = 90.0) -> None:
    """Poll ``/ready`` until both workers have answered (the server is ready once one is)."""
    seen, deadline = set(), time.monotonic() + within_s
    while seen != {0, 1}:
        assert time.monotonic() < deadline, f"only workers {sorted(seen)} answered"
        seen.add(httpx.get(cloud.http_url + "/ready", timeout=5).json()["worker"])


async def _one_per_worker(cloud: LocalCloud, bundle, tries: int = 40) -> dict[str, EdgeSim]:
    """Open sessions until one is held by each worker (``w0``, ``w1``); the others are closed."""
    bundle_id = Manifest.load(bundle).bundle_id
    got: dict[str, EdgeSim] = {}
    for _ in range(tries):
        edge = EdgeSim(cloud.ws_url, bundle, bundle_id)
        welcome = await edge.connect()
        worker = welcome.session_id.split("-", 1)[0]
        if worker in got:
            await edge.close()
        else:
            got[worker] = edge
        if len(got) == 2:
            return got
    raise AssertionError(f"{tries} connections all reached {sorted(got)}")


def test_several_edges_get_the_tokens_of_one_process(servers, tiny_bundle):
    cloud, reference = servers
    out: dict[tuple, list[int]] = {}
    url = cloud.ws_url.rsplit("/v1", 1)[0]
    threads = [threading.Thread(target=lambda p=p: out.__setitem__(tuple(p), _generate(tiny_bundle, url, p)))
               for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out == reference


def test_metrics_sum_the_workers_counters(servers, tiny_bundle):
    cloud, reference = servers

    async def one_each():
        edges = await _one_per_worker(cloud, tiny_bundle)
        got = [await e.generate("m", PROMPTS[0], N_NEW) for e in edges.values()]
        open_now = _metric(cloud, "autoglm:sessions_open")
        for e in edges.values():
            await e.close()
        return got, open_now

    before = _metric(cloud, "vllm:generation_tokens_total")
    tenant_before = _metric(cloud, "autoglm:tenant_generation_tokens_total")
    got, open_now = asyncio.run(one_each())
    assert [g[0] for g in got] == [reference[tuple(PROMPTS[0])]] * 2  # both workers, the same tokens
    assert open_now == 2  # one session per worker, summed
    # the engine counts tokens in the engine process; each worker counts what it sent: the sums agree
    assert _metric(cloud, "vllm:generation_tokens_total") - before == 2 * N_NEW
    assert _metric(cloud, "autoglm:tenant_generation_tokens_total") - tenant_before == 2 * N_NEW
    # each worker counts the HTTP requests it refused (here the 404 of chat in split mode): the sum is every one
    refused_before = _metric(cloud, "autoglm:http_requests_refused_total")
    for _ in range(4):  # new connections: the kernel spreads them over the workers
        assert httpx.post(cloud.http_url + "/v1/chat/completions", json={}, timeout=10).status_code == 404
    assert _metric(cloud, "autoglm:http_requests_refused_total") - refused_before == 4
    # the refusals alerts rate exist from the start in the engine and every worker: one series each on the page
    text = httpx.get(cloud.http_url + "/metrics", timeout=10).text
    for series in ('autoglm:http_requests_refused_total{model_name="b",reason="draining",status="503"}',
                   'autoglm:sessions_refused_total{model_name="b",reason="overloaded"}'):
        assert len(re.findall(rf"^{re.escape(series)} ", text, re.M)) == 1, series


def test_a_bad_frame_on_one_worker_leaves_the_other_workers_session_alone(servers, tiny_bundle):
    cloud, reference = servers

    async def scenario():
        edges = await _one_per_worker(cloud, tiny_bundle)
        bad, good = edges["w0"], edges["w1"]
        task = asyncio.create_task(good.generate("g", PROMPTS[1], N_NEW))
        await bad.ws.send(b"\xc1 not msgpack")
        err = await bad.recv()
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await bad.recv()
        tokens, finish, _ = await task
        await good.close()
        return err, closed.value.rcvd.code, tokens, finish

    err, code, tokens, finish = asyncio.run(scenario())
    assert isinstance(err, P.Error) and err.fatal and code == 1002
    assert finish == "length" and tokens == reference[tuple(PROMPTS[1])]


def test_max_sessions_counts_every_worker(servers, tiny_bundle):
    cloud, _ = servers
    bundle_id = Manifest.load(tiny_bundle).bundle_id
    assert _wait_no_sessions(cloud, 10) == 0  # the earlier tests' sessions are gone (grace 2 s)

    async def scenario():
        held = list((await _one_per_worker(cloud, tiny_bundle)).values())
        while len(held) < 6:  # --max-sessions 6, however the kernel spreads them
            edge = EdgeSim(cloud.ws_url, tiny_bundle, bundle_id)
            assert isinstance(await edge.connect(), P.Welcome)
            held.append(edge)
        workers = {e.welcome.session_id.split("-", 1)[0] for e in held}
        late = EdgeSim(cloud.ws_url, tiny_bundle, bundle_id)
        refused = await late.connect()
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await late.recv()
        for e in held:
            await e.close()
        await asyncio.sleep(0.3)  # the releases reach the engine process
        again = EdgeSim(cloud.ws_url, tiny_bundle, bundle_id)
        admitted = await again.connect()
        await again.close()
        return workers, refused, closed.value.rcvd.code, admitted

    workers, refused, code, admitted = asyncio.run(scenario())
    assert workers == {"w0", "w1"}
    assert isinstance(refused, P.Error) and refused.code == "overloaded" and refused.retry_after_ms and code == 1013
    assert isinstance(admitted, P.Welcome)


def test_a_reconnect_to_the_other_worker_replays_without_losing_a_token(servers, tiny_bundle):
    """Connection cuts mid-generation; a reconnect that reaches the other worker finds no session there and the
    edge replays its context (one on the same worker resumes). Repeated until a replay happened."""
    cloud, reference = servers
    want = reference[tuple(PROMPTS[2])]
    replays = 0
    with LinkEmulator(cloud.port, SLOW_LINK, seed=5) as link:
        for _ in range(4):
            tokens, stats = _generate(tiny_bundle, f"ws://127.0.0.1:{link.port}", PROMPTS[2], fault=link.cut,
                                      at=(3, 6, 9, 12))
            assert tokens == want and stats.reconnects >= 4
            replays += stats.replays
            if replays:
                break
    assert replays >= 1
    # nothing left behind: the edge closed its session, the stale copy on the other worker was reclaimed at the
    # replay (a copy the edge abandoned mid-handshake, if a cut hit it, expires after its 2 s grace)
    assert _wait_no_sessions(cloud, 5) == 0 and _metric(cloud, "vllm:num_requests_running") == 0


@pytest.mark.slow  # a keyed --workers 2 server of its own (~25 s on a busy 2-core box); the rule alone:
# test_session_ledger.py::test_a_token_presented_by_a_key_not_acting_as_its_opener_reclaims_nothing
def test_a_resume_token_on_the_other_worker_closes_its_session_only_for_a_key_acting_as_its_opener(tiny_bundle,
                                                                                                   tmp_path):
    """A resume token presented on the worker that does not hold its session reclaims (closes) that session only
    for a key acting as the one that opened it (``Principal.acts_as``: same tenant and role), as on the worker
    holding it (``SessionRegistry.for_resume``): a tenant key presenting its tenant's operator's token closed the
    operator's live session on the other worker ('resumed on another worker'), the ledger compared tenants only.
    Another operator key of the tenant takes it over wherever it lands: reclaimed from the other worker, or
    resumed on the holder (the old link 'replaced by a new connection')."""
    keys = tmp_path / "keys.json"
    _, op = auth.add_key(keys, "acme", role="operator")
    _, op2 = auth.add_key(keys, "acme", role="operator")
    _, member = auth.add_key(keys, "acme")
    bundle_id = Manifest.load(tiny_bundle).bundle_id
    args = ARGS + ["--workers", "2", "--keys-file", str(keys)]

    async def on_the_other_worker(cloud, key, holder, token, front):
        """Connect with ``key`` presenting ``token`` until the session opened lands off ``holder``."""
        for _ in range(40):
            edge = EdgeSim(cloud.ws_url, tiny_bundle, bundle_id, api_key=key, front=front)
            welcome = await edge.connect(resume_token=token)
            if not welcome.session_id.startswith(holder + "-"):
                return edge, welcome
            await edge.close()
        raise AssertionError(f"40 connections all reached {holder}")

    async def scenario(cloud):
        opened = EdgeSim(cloud.ws_url, tiny_bundle, bundle_id, api_key=op)
        welcome = await opened.connect()
        holder = welcome.session_id.split("-", 1)[0]
        intruder, theirs = await on_the_other_worker(cloud, member, holder, welcome.resume_token, opened.front)
        tokens, finish, _ = await opened.generate("still-open", PROMPTS[0], 4)  # after the ledger's answer
        await intruder.close()
        heir = EdgeSim(cloud.ws_url, tiny_bundle, bundle_id, api_key=op2, front=opened.front)
        took_over = await heir.connect(resume_token=welcome.resume_token)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await opened.recv(timeout=10)
        await heir.close()
        on_holder = took_over.session_id.startswith(holder + "-")
        return (theirs.resumed, (len(tokens), finish)), (on_holder, took_over.resumed, closed.value.rcvd.reason)

    with LocalCloud(tiny_bundle, extra_args=args, log_path=tmp_path / "keyed.log") as cloud:
        _wait_both_ready(cloud)
        intruder, heir = asyncio.run(scenario(cloud))
    assert intruder == (False, (4, "length"))  # a session of its own; the operator's generated on
    assert heir in {(False, False, "resumed on another worker"), (True, True, "replaced by a new connection")}


def _front_pids(main: int) -> set[int]:
    """The main process's front-end workers: its children started by multiprocessing's spawn."""
    out = set()
    for task in os.listdir(f"/proc/{main}/task"):
        for kid in open(f"/proc/{main}/task/{task}/children").read().split():
            try:
                if b"spawn_main" in open(f"/proc/{kid}/cmdline", "rb").read():
                    out.add(int(kid))
            except FileNotFoundError:  # gone meanwhile
                pass
    return out


def test_a_killed_worker_is_replaced_and_the_server_keeps_serving(servers, tiny_bundle):
    """Its replacement serves, and /metrics goes on as one server's: a scrape while the replacement started waited
    2 s for it (the scrapes one after another), and the killed worker's counts left the sums, so a summed counter
    went down - a reset to Prometheus, which counts the whole sum again as new."""
    cloud, reference = servers

    async def both():
        edges = await _one_per_worker(cloud, tiny_bundle)
        got = [(await e.generate("k", PROMPTS[1], N_NEW))[0] for e in edges.values()]
        for e in edges.values():
            await e.close()
        return got

    assert asyncio.run(both()) == [reference[tuple(PROMPTS[1])]] * 2  # each worker has sent tokens
    sent = _metric(cloud, "autoglm:downlink_bytes_total")
    before = _front_pids(cloud.proc.pid)
    assert len(before) == 2
    os.kill(min(before), signal.SIGKILL)
    seen, scrapes, deadline = set(), [], time.monotonic() + 60
    while seen != {0, 1} and time.monotonic() < deadline:  # the replacement answers once it listens
        try:
            seen.add(httpx.get(cloud.http_url + "/ready", timeout=5).json()["worker"])
            start = time.monotonic()
            scrapes.append((_metric(cloud, "autoglm:downlink_bytes_total"), time.monotonic() - start))
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    assert seen == {0, 1} and len(_front_pids(cloud.proc.pid) - before) == 1
    assert min(n for n, _ in scrapes) >= sent > 0  # the dead worker's bytes still counted
    assert max(s for _, s in scrapes) < RENDER_TIMEOUT_S, scrapes  # no scrape waited for the worker starting
    assert asyncio.run(both()) == [reference[tuple(PROMPTS[1])]] * 2


def test_a_sighup_while_a_worker_starts_does_not_kill_it(servers, tiny_bundle):
    """The main process passes SIGHUP on to every worker (each reloads its keys file); one still starting (importing,
    its runtime's start: a killed worker's replacement, every worker at the server's start) had no handler yet and
    was ended by it - one more worker killed and replaced per SIGHUP. It starts with the signal ignored."""
    cloud, reference = servers
    before = _front_pids(cloud.proc.pid)
    assert len(before) == 2
    os.kill(min(before), signal.SIGKILL)
    seen, started, deadline = set(), set(), time.monotonic() + 90
    while seen != {0, 1} and time.monotonic() < deadline:
        started |= _front_pids(cloud.proc.pid) - before
        os.kill(cloud.proc.pid, signal.SIGHUP)  # while the replacement starts
        try:
            seen.add(httpx.get(cloud.http_url + "/ready", timeout=5).json()["worker"])
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    started |= _front_pids(cloud.proc.pid) - before
    assert seen == {0, 1} and len(started) == 1, started  # one replacement, never killed in turn
    assert _generate(tiny_bundle, cloud.ws_url.rsplit("/v1", 1)[0], PROMPTS[0]) == reference[tuple(PROMPTS[0])]


def test_workers_killed_all_at_once_are_all_replaced(servers, tiny_bundle):
    """Every worker dead at once (the OOM killer taking both, a SIGKILL to each): the main process's loop ran while
    any worker lived, so it ended there and the server exited 0 without a word, where a supervisor restarts only a
    failure. They are replaced as one dead worker is."""
    cloud, reference = servers
    before = _front_pids(cloud.proc.pid)
    assert len(before) == 2
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    seen, deadline = set(), time.monotonic() + 90
    while seen != {0, 1} and time.monotonic() < deadline and cloud.proc.poll() is None:
        try:
            seen.add(httpx.get(cloud.http_url + "/ready", timeout=5).json()["worker"])
        except httpx.HTTPError:
            time.sleep(0.1)
    assert cloud.proc.poll() is None, f"the server exited with {cloud.proc.returncode}"
    assert seen == {0, 1} and not _front_pids(cloud.proc.pid) & before
    assert _generate(tiny_bundle, cloud.ws_url.rsplit("/v1", 1)[0], PROMPTS[0]) == reference[tuple(PROMPTS[0])]


def test_sigterm_drains_every_worker_then_exits(servers, tiny_bundle):
    """Last: stops the module's server. The request in flight finishes, ``/ready`` says 503 on whichever worker
    answers, a new session is refused (``draining``, 1013, or the connection itself once every listener has
    closed), and the process exits 0 by itself."""
    cloud, reference = servers
    bundle_id = Manifest.load(tiny_bundle).bundle_id
    seen = {}

    def probe():
        try:
            return httpx.get(cloud.http_url + "/ready", timeout=5).status_code
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
            # a worker with nothing to finish has drained and left the port's group: refused, or (a connection it
            # had accepted into its backlog when its listener closed) dropped without a response
            return "refused"

    def on_token():
        cloud.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        seen["ready"] = {probe() for _ in range(8)}
        seen["late"] = "refused"  # every listener closed: uvicorn stops accepting once it starts draining
        for _ in range(8):  # the same race as probe(): a refused connection is retried
            try:
                seen["late"] = asyncio.run(refused_hello(cloud.ws_url, bundle_id))
                break
            except (OSError, websockets.ConnectionClosed):  # (or closed 1012 by a listener shutting down)
                continue

    with LinkEmulator(cloud.port, dataclasses.replace(IDEAL, rtt_ms=60.0, name="rtt-60ms")) as link:
        tokens, _ = _generate(tiny_bundle, f"ws://127.0.0.1:{link.port}", PROMPTS[3], fault=on_token, at=(3,))
    code = cloud.proc.wait(30)
    assert tokens == reference[tuple(PROMPTS[3])]
    assert 503 in seen["ready"] and seen["ready"] <= {503, "refused"}  # never ready once draining
    if seen["late"] != "refused":  # a listener still open answers a new session with draining / 1013
        err, close = seen["late"]
        assert err.code == "draining" and close == 1013
    assert code == 0


def test_port_0_logs_the_port_the_workers_listen_on(tiny_bundle, tmp_path):
    """--workers 2 --port 0 logged 'on 127.0.0.1:0': the port the kernel picked was nowhere to be read."""
    import subprocess
    import sys

    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-c", "import sys; from cloud_server.cli import main; sys.exit(main())", "serve",
           str(tiny_bundle), "--port", "0", "--workers", "2", *ARGS]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (said := re.search(r"front-end workers on 127\.0\.0\.1:(\d+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        assert int(said.group(1)) != 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


@pytest.mark.parametrize("workers, limit", [(3, 10), (4, 4), (6, 2048), (7, 255)])
def test_the_workers_shares_of_a_limit_hold_no_more_than_it(tmp_path, workers, limit):
    """Shares rounded up let 12 connections in under --max-connections 10 over 3 workers (and 8 under 2 over 8,
    now refused: ServerConfig)."""
    from cloud_server.config import ServerConfig
    from cloud_server.front_workers import worker_config

    share = worker_config(ServerConfig(bundle=tmp_path, workers=workers, max_connections=limit,
                                       max_http_requests=limit))
    assert 1 <= share.max_connections and share.max_connections * workers <= limit
    assert 1 <= share.max_http_requests and share.max_http_requests * workers <= limit
