"""``autoglm-cloud serve --workers N``: N WebSocket front-end processes feeding one engine process.

One Python event loop spends ~230-280 us per decode token on the H200's host (WebSocket frame, msgpack, codec
decode, asyncio); split decoding is lockstep per session, so at 64 sessions one loop needs ~15 ms per ~6.6 ms
engine step. With N workers the loop work of a round is spread over N processes (docs/performance.md).

    main process (this module's :func:`serve_workers`)
        CloudRuntime: model, AsyncEngine, KV pool, prefix cache, engine metrics
        EngineHost: every worker's pipe, read and written by the engine thread (its I/O pump), a sink per worker
            (cloud_server.engine_host)
        one listening socket per worker on the same port (SO_REUSEPORT: the kernel spreads connections by
        their hash), bound here and inherited by the workers
    worker process i (:func:`worker_main`, multiprocessing spawn)
        the FastAPI app on the inherited socket: /v1/split (handshake, state machine, codecs, translator),
        /health, /ready, /metrics, /v1/models, /v1/bundles
        WorkerRuntime + RemoteEngine over one pipe to the engine, on the worker's event loop  (cloud_server.worker_runtime, remote_engine)

The kernel hands each new connection to whichever worker accepts first, so a reconnect may reach another
worker than before: that worker has not the session and the edge replays (``cloud_server.session_ledger``).

Signals: SIGTERM / SIGINT to the main process is passed to every worker (each drains as a single server does:
``/ready`` 503, ``Drain`` to its edges, open requests finish up to ``drain_timeout_s``); when they have all
exited the engine stops. A second signal is passed on too (each worker cuts its drain short and shuts down,
and the command ends 'interrupted', exit 130, as a single server does); SIGHUP (reload the keys
file) is passed on as it is. Workers run in their own process group, so a terminal's Ctrl-C reaches the main
process only and is passed on once. A worker that dies while serving has its requests aborted and is
replaced; one that exits with an error within a minute of its start (a broken setup) stops the server
(status 1), and so does an engine that stops (a fatal error; its open requests got ``internal``), so that
whatever supervises the server restarts it. ``max_connections`` and ``max_http_requests`` are divided between
the workers (each process enforces its share).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import time

from cloud_server.config import ServerConfig

log = logging.getLogger("autoglm.cloud")
POLL_S = 0.2  # how often the main process looks at its workers and the engine
EARLY_EXIT_S = 60.0  # a worker erring out this soon after its start is not replaced: the server stops (status 1)
STOP_SLACK_S = 15.0  # beyond drain_timeout_s, how long the main process waits for draining workers


def worker_config(config: ServerConfig) -> ServerConfig:
    """A worker's configuration, one front end's (``workers`` 1): the connection and HTTP limits divided between the
    workers, rounded down so that together they hold no more than the limit (rounded up, 10 over 3 workers let 12
    in; ``ServerConfig`` refuses a limit below the workers' count, so each worker takes at least one)."""
    n = config.workers
    return dataclasses.replace(config, workers=1, max_connections=config.max_connections // n,
                               max_http_requests=config.max_http_requests // n)


def listening_sockets(host: str, port: int, n: int) -> list[socket.socket]:
    """One bound (not yet listening: its worker listens once it serves) TCP socket per worker, all on one port with
    SO_REUSEPORT, so the kernel spreads new connections over the workers by each connection's hash (nginx's
    ``reuseport``) instead of letting whichever worker wakes first take them all. Port 0 picks one free port for
    all. Without SO_REUSEPORT (not Linux/BSD) the workers share one socket (uvicorn's own multi-worker way)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    shared = not hasattr(socket, "SO_REUSEPORT")
    socks: list[socket.socket] = []
    try:
        for _ in range(1 if shared else n):
            socks.append(_port_socket(family, kind, proto, addr, not shared))
            addr = (addr[0], socks[-1].getsockname()[1], *addr[2:])  # port 0: the others join the port the first got
    except OSError:
        for s in socks:
            s.close()
        raise
    return socks * n if shared else socks


def _port_socket(family, kind, proto, addr, reuse_port: bool) -> socket.socket:
    s = socket.socket(family, kind, proto)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(addr)
        s.set_inheritable(True)
    except OSError:
        s.close()
        raise
    return s


def fresh_socket(socks: list[socket.socket], index: int) -> None:
    """A dead worker's listening socket replaced by a new, bound one on the port for its replacement: kept listening
    (by this process's copy), it stayed in the port's group, so the kernel went on handing it its share of new
    connections - probes, scrapes, phones - which waited unanswered until the replacement started (~10 s: a
    spawn imports torch). The few connections its queue held when it closes are reset (a client retries
    them at once, on a live worker). A shared socket (no SO_REUSEPORT) is served by the other workers: kept."""
    old = socks[index]
    if socks.count(old) > 1:
        return
    sock = _port_socket(old.family, old.type, old.proto, old.getsockname(), True)
    old.close()
    socks[index] = sock


def serve_workers(config: ServerConfig, log_level: str = "info") -> int:
    """Run the engine here and ``config.workers`` front ends; returns when all have drained (exit status)."""
    from cloud_server.engine_host import EngineHost
    from cloud_server.runtime import CloudRuntime

    socks = listening_sockets(config.host, config.port, config.workers)  # one per worker, one port
    runtime = CloudRuntime(config).start()
    host = EngineHost(runtime)
    ctx = mp.get_context("spawn")
    wcfg = worker_config(config)

    def spawn(index: int):
        ours, theirs = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=worker_main, args=(wcfg, index, socks[index], theirs, log_level),
                           name=f"autoglm-front-{index}", daemon=False)
        # the worker starts with SIGHUP ignored (an exec keeps that) until it installs its reload: a SIGHUP passed on
        # while it imported and started ended it by the default action (a worker killed, replaced)
        hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
        try:
            proc.start()
        finally:
            signal.signal(signal.SIGHUP, hup)
        theirs.close()
        host.attach(index, ours)
        return proc

    procs = {i: spawn(i) for i in range(config.workers)}
    started = {i: time.monotonic() for i in procs}
    signals: list[int] = []
    status = 0

    def on_signal(sig, frame) -> None:
        signals.append(sig)
        # draining replaces no worker: let each socket live in its worker only, so that one that has drained
        # and exits takes its socket out of the port's group and new connections (a probe, a late Hello) reach
        # the workers still draining, which answer 503 / `draining`
        for s in set(socks):
            s.close()
        for p in procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    def pass_on(sig, frame) -> None:  # SIGHUP: every worker reloads its keys file (cloud_server.auth)
        for p in procs.values():
            if p.is_alive():
                os.kill(p.pid, sig)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, pass_on)
    # the port bound (--port 0 picks one: it logged ':0', the one place an operator could have learned it)
    log.info("serving with %d front-end workers on %s:%d", config.workers, config.host, socks[0].getsockname()[1])
    deadline = None
    try:
        # until signalled, dead workers are replaced (all of them at once too: the loop ran while any lived, so
        # workers killed together ended the server, exit 0 without a word); then until the last has drained
        while not signals or any(p.is_alive() for p in procs.values()):
            if host.check_engine() and not signals:  # a fatal engine error: stop, to be restarted (status 1)
                log.error("the engine stopped (%s): stopping the workers", runtime.engine.dead)
                status = 1
                on_signal(signal.SIGTERM, None)
            if signals and deadline is None:
                deadline = time.monotonic() + config.drain_timeout_s + STOP_SLACK_S
            if deadline is not None and time.monotonic() > deadline:
                log.warning("workers still draining past the drain timeout: killed")
                for p in procs.values():
                    p.kill()
            for i, p in list(procs.items()):
                if signals or p.is_alive():
                    continue
                if p.exitcode > 0 and time.monotonic() - started[i] < EARLY_EXIT_S:  # an error, not a kill
                    log.error("front-end worker %d failed at start (exit %s): stopping", i, p.exitcode)
                    status = 1
                    on_signal(signal.SIGTERM, None)
                    break
                log.error("front-end worker %d exited with %s: replaced", i, p.exitcode)
                fresh_socket(socks, i)
                procs[i], started[i] = spawn(i), time.monotonic()
            time.sleep(POLL_S)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for p in procs.values():
            p.join(5)
        host.stop()
        runtime.stop()
        for s in set(socks):
            s.close()
    if not status and len(signals) > 1:  # a second Ctrl-C / SIGTERM cut the drain short (cloud_server.cli.serve)
        print("interrupted", file=sys.stderr)
        return 130
    return status


def worker_main(config: ServerConfig, index: int, sock: socket.socket, conn, log_level: str) -> None:
    """A front-end worker process: the app over a :class:`~cloud_server.worker_runtime.WorkerRuntime`, served
    by uvicorn on its inherited listening socket until it drains (SIGTERM) or the engine stops or its process
    goes away (``cloud_server.app.DrainingServer`` stops then)."""
    os.setpgrp()  # a terminal's Ctrl-C reaches the main process only; it passes the drain on
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[w{index}]: %(message)s")
    from cloud_server.app import loop_factory

    with asyncio.Runner(loop_factory=loop_factory(config.loop)) as runner:
        runner.run(_serve(config, index, sock, conn, log_level))


async def _serve(config: ServerConfig, index: int, sock: socket.socket, conn, log_level: str) -> None:
    from cloud_server.app import DrainingServer, create_app, uvicorn_config
    from cloud_server.auth import install_sighup
    from cloud_server.worker_runtime import WorkerRuntime

    loop = asyncio.get_running_loop()
    rt = WorkerRuntime(config, conn, index)
    await loop.run_in_executor(None, rt.start, loop)
    app = create_app(rt)
    install_sighup(app.state.auth.store)
    server = DrainingServer(uvicorn_config(app, config, log_level), app)  # its address: the inherited socket
    try:
        await server.serve(sockets=[sock])
    finally:
        rt.stop()
