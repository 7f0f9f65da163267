"""rig.link: the delay model (queueing, propagation, jitter, loss, in-order delivery, seeding) and the proxy
measured end to end: RTT and throughput of every built-in profile within a tolerance, scheduled disconnects,
the same seed giving the same delays."""

from __future__ import annotations

import logging
import random
import socket
import statistics
import struct
import threading
import time
from dataclasses import replace

import pytest

from rig.link import Disconnect, LinkEmulator, LinkModel
from rig.profiles import MSS, PROFILES, LinkProfile, get_profile

FLAT = LinkProfile("flat", rtt_ms=40.0, jitter_ms=0.0, down_mbps=8.0, up_mbps=1.0, loss=0.0)


# -- the model ------------------------------------------------------------------------------------


def test_bytes_queue_behind_each_other():
    m = LinkModel(FLAT, "up", random.Random(0))  # 1 Mbps: 1448 B take 11.584 ms
    first = m.send(0.0, MSS)
    second = m.send(0.0, MSS)  # handed over at the same instant: waits for the first to serialize
    assert first == [(pytest.approx(0.011584 + 0.020), MSS)]
    assert second == [(pytest.approx(2 * 0.011584 + 0.020), MSS)]
    later = m.send(1.0, 100)  # an idle link: no queue left
    assert later[0][0] == pytest.approx(1.0 + 100 * 8 / 1e6 + 0.020)


def test_down_direction_uses_the_downlink_rate():
    m = LinkModel(FLAT, "down", random.Random(0))
    (arrival, n), = m.send(0.0, 1000)
    assert n == 1000 and arrival == pytest.approx(1000 * 8 / 8e6 + 0.020)


def test_a_lost_segment_holds_back_the_bytes_behind_it():
    lossy = replace(FLAT, loss=0.5, rto_ms=200.0)
    m = LinkModel(lossy, "up", random.Random(3))
    pieces = m.send(0.0, 40 * MSS)
    arrivals = [a for a, _ in pieces]
    assert arrivals == sorted(arrivals)  # in order, always
    lost = [k for k, d in enumerate(m.draws) if d > 0.1]
    assert 10 <= len(lost) <= 30 and m.stats.retransmitted == len(lost)
    k = lost[0]
    assert arrivals[k] >= (k + 1) * MSS * 8 / 1e6 + 0.020 + 0.200 - 1e-9
    if k + 1 < len(arrivals):
        assert arrivals[k + 1] >= arrivals[k]  # head-of-line blocking


def test_jitter_stays_within_its_bounds_and_the_stream_is_seeded():
    jittery = replace(FLAT, jitter_ms=10.0)
    a = LinkModel(jittery, "down", random.Random("s"))
    b = LinkModel(jittery, "down", random.Random("s"))
    a.send(0.0, 50 * MSS)
    for _ in range(50):  # the same bytes in other read sizes: the same draw per segment of the stream
        b.send(0.0, MSS // 2)
        b.send(0.0, MSS - MSS // 2)
    assert a.draws == b.draws
    assert all(0.010 - 1e-12 <= d <= 0.030 + 1e-12 for d in a.draws)
    assert len(set(a.draws)) > 40
    n = len(a.draws)
    a.send(10.0, 1)  # the link went idle: a new write is a new segment with its own draw
    a.send(20.0, 1)
    assert len(a.draws) == n + 2
    c = LinkModel(jittery, "down", random.Random("other"))
    c.send(0.0, 50 * MSS)
    assert c.draws != a.draws


def test_the_kept_draws_cost_8_bytes_a_segment():
    """A long soak's links kept every segment's draw as a Python float in a list (~70 bytes a segment of 1,448 B: 5 %
    of the bytes carried, ~500 MB for a soak moving 10 GB); they are an array of doubles now."""
    import tracemalloc

    m = LinkModel(replace(FLAT, jitter_ms=5.0, loss=0.01, down_mbps=1e6), "down", random.Random(0))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    m.send(0.0, 20_000 * MSS)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(m.draws) == 20_000 and grown < 12 * 20_000 + 65_536  # the pieces returned are gone by now


# -- the proxy, measured --------------------------------------------------------------------------


class _Peer:
    """A loopback server: ``e`` echoes one byte; ``s<N>\\n`` sends N bytes; ``r<N>\\n`` reads N, answers 1;
    ``w`` reads to the client's half-close (EOF), then answers how many bytes came."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    @staticmethod
    def _serve(c: socket.socket):
        f = c.makefile("rb")
        try:
            while cmd := f.read(1):
                if cmd == b"e":
                    c.sendall(b"e")
                elif cmd in (b"s", b"r"):
                    n = int(f.readline())
                    if cmd == b"s":
                        c.sendall(b"x" * n)
                    else:
                        f.read(n)
                        c.sendall(b"k")
                elif cmd == b"w":
                    c.sendall(str(len(f.read())).encode())
                    break
        except OSError:
            pass
        finally:
            c.close()

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def peer():
    p = _Peer()
    yield p
    p.close()


def _recv_exact(s: socket.socket, n: int) -> float:
    """Read n bytes; return the time the first one arrived."""
    first = None
    got = 0
    while got < n:
        chunk = s.recv(min(1 << 20, n - got))
        if not chunk:
            raise ConnectionError("closed")
        first = first or time.perf_counter()
        got += len(chunk)
    return first


def _ping_ms(s: socket.socket) -> float:
    t0 = time.perf_counter()
    s.sendall(b"e")
    _recv_exact(s, 1)
    return 1000 * (time.perf_counter() - t0)


def _best_of(rounds: int, measure, target: float, rel: float, floor: float = 0.0):
    """The round closest to ``target`` (a loaded host only ever adds delay, so the best round is the
    emulator's own accuracy); returns (value, every round)."""
    seen = []
    for _ in range(rounds):
        seen.append(measure())
        if abs(seen[-1] - target) <= max(floor, rel * target):
            break
    return min(seen, key=lambda v: abs(v - target)), seen


@pytest.mark.alone  # RTT and throughput within 10 %: no other test worker competing for the cores meanwhile
@pytest.mark.parametrize("name", list(PROFILES))
def test_profile_rtt_and_throughput_match(peer, name):
    prof = replace(get_profile(name), loss=0.0)  # loss is measured apart: an RTO would swamp the tolerance
    with LinkEmulator(peer.port, prof, seed=1) as link, socket.create_connection(("127.0.0.1", link.port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        every: list[float] = []

        def median_ping():
            pings = [_ping_ms(s) for _ in range(5 if prof.rtt_ms > 100 else 9)]
            every.extend(pings)
            return statistics.median(pings)

        rtt, rounds = _best_of(3, median_ping, prof.rtt_ms, 0.10, floor=4.0)
    assert abs(rtt - prof.rtt_ms) <= max(4.0, 0.10 * prof.rtt_ms), (name, rounds)
    assert min(every) >= prof.rtt_ms - 2 * prof.jitter_ms - 0.5  # never early, however loaded the host

    steady = replace(prof, jitter_ms=0.0)  # bandwidth alone: jitter on the first and last byte is noise here
    with LinkEmulator(peer.port, steady, seed=1) as link, socket.create_connection(("127.0.0.1", link.port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        n = int(prof.down_mbps * 1e6 / 8 * 0.4)  # ~0.4 s of serialization
        n_up = int(prof.up_mbps * 1e6 / 8 * 0.4)

        def down():  # the first byte to the last takes (n - 1 segment) / bandwidth
            s.sendall(f"s{n}\n".encode())
            first = _recv_exact(s, n)
            return (n - MSS) * 8 / (time.perf_counter() - first) / 1e6

        def up():  # n bytes up, a 1-byte answer down: n / bandwidth + one RTT
            t0 = time.perf_counter()
            s.sendall(f"r{n_up}\n".encode() + b"x" * n_up)
            _recv_exact(s, 1)
            return n_up * 8 / (time.perf_counter() - t0 - prof.rtt_ms / 1000) / 1e6

        down_mbps, _ = _best_of(3, down, prof.down_mbps, 0.15)
        up_mbps, _ = _best_of(3, up, prof.up_mbps, 0.15)
    print(f"\n{name}: rtt {rtt:.1f} ms (profile {prof.rtt_ms}), down {down_mbps:.2f} Mbps "
          f"({prof.down_mbps}), up {up_mbps:.2f} Mbps ({prof.up_mbps})")
    assert down_mbps == pytest.approx(prof.down_mbps, rel=0.15)
    assert up_mbps == pytest.approx(prof.up_mbps, rel=0.15)
    assert link.bytes_up >= n_up and link.bytes_down >= n


@pytest.mark.alone  # timing within a millisecond: no other test worker competing for the cores meanwhile
@pytest.mark.alone  # a 1 ms bound: another worker's test on the other core moved it 1.2 ms (clean-clone CI)
def test_a_short_rtt_is_not_rounded_up_by_the_event_loops_timers(peer):
    """The event loop wakes a timer up to 1 ms late (epoll waits whole milliseconds), so every delivery came 0.5-1 ms
    late each way: a 6 ms RTT measured 7.6 ms (+27 %), any RTT ~1.5 ms high. Aimed half a tick early, the error is
    centred: what is left is the host's wake-up latency."""
    prof = LinkProfile("near", rtt_ms=6.0, jitter_ms=2.0, down_mbps=1000.0, up_mbps=1000.0, loss=0.0)  # jitter: the
    with LinkEmulator(peer.port, prof, seed=1) as link, \
            socket.create_connection(("127.0.0.1", link.port)) as s:  # due times fall at every phase of a tick
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _ping_ms(s)
        every: list[float] = []

        def median_ping():
            pings = [_ping_ms(s) for _ in range(41)]
            every.extend(pings)
            return statistics.median(pings)

        rtt, rounds = _best_of(3, median_ping, prof.rtt_ms, 0.0, floor=1.0)
    assert abs(rtt - prof.rtt_ms) <= 1.0, rounds
    assert min(every) >= prof.rtt_ms - 2 * prof.jitter_ms - 1.0  # at most half a tick early each way


@pytest.mark.alone
def test_loss_shows_as_rto_delay_spikes(peer):
    lossy = LinkProfile("lossy", rtt_ms=10.0, jitter_ms=0.0, down_mbps=100.0, up_mbps=100.0, loss=0.3,
                        rto_ms=100.0)
    with LinkEmulator(peer.port, lossy, seed=5) as link, socket.create_connection(("127.0.0.1", link.port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pings = [_ping_ms(s) for _ in range(20)]
        up, down = link.segment_delays(0, "up"), link.segment_delays(0, "down")
    # each ping is its own segment each way (the link is idle between pings): draw k is ping k's
    assert len(up) == len(down) == 20
    lost = [int(up[k] > 0.05) + int(down[k] > 0.05) for k in range(20)]
    assert 2 <= sum(x > 0 for x in lost) <= 16 and link.retransmitted == sum(d > 0.05 for d in up + down)
    for p, n in zip(pings, lost):
        assert p >= 10 + 100 * n - 0.5  # each lost segment costs at least one RTO, never less
    clean = [p for p, n in zip(pings, lost) if n == 0]
    spiked = [p for p, n in zip(pings, lost) if n > 0]
    assert statistics.median(spiked) - statistics.median(clean) >= 60


def test_same_seed_same_delays(peer):
    prof = get_profile("3g-poor")
    draws = []
    for seed in (7, 7, 8):
        with LinkEmulator(peer.port, replace(prof, rtt_ms=10.0, jitter_ms=5.0, down_mbps=50.0, up_mbps=50.0),
                          seed=seed) as link, socket.create_connection(("127.0.0.1", link.port)) as s:
            s.sendall(b"s200000\n")
            _recv_exact(s, 200000)
            draws.append(link.segment_delays(0, "down"))
    assert len(draws[0]) >= 200000 // MSS
    assert draws[0] == draws[1] and draws[0] != draws[2]


def test_scheduled_disconnect_cuts_and_refuses(peer):
    with LinkEmulator(peer.port, seed=0, disconnects=[Disconnect(at_s=0.3, down_s=0.3)]) as link:
        s = socket.create_connection(("127.0.0.1", link.port))
        assert _ping_ms(s) < 50
        time.sleep(0.4)  # the cut happened at 0.3 s
        with pytest.raises(OSError):
            s.sendall(b"e")
            if not s.recv(1):
                raise ConnectionResetError("closed")
        s.close()
        with socket.create_connection(("127.0.0.1", link.port)) as s2:  # still down: accepted, then reset
            with pytest.raises(OSError):
                s2.sendall(b"e")
                if not s2.recv(1):
                    raise ConnectionResetError("closed")
        time.sleep(0.35)
        with socket.create_connection(("127.0.0.1", link.port)) as s3:  # back up
            assert _ping_ms(s3) < 50
        assert link.cuts == 1 and link.refused == 1 and link.connections == 2


def test_a_refused_connection_reads_as_a_reset():
    """A connection refused while the link is down, or to a server that is not there, ended with a clean FIN: the
    client read an empty answer (a server that closed), where a refused connect fails with an error."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        nothing = free.getsockname()[1]
    with LinkEmulator(nothing) as dead, socket.create_connection(("127.0.0.1", dead.port)) as s:
        s.settimeout(5)
        with pytest.raises(ConnectionResetError):
            s.recv(1)
    with socket.create_server(("127.0.0.1", 0)) as srv, LinkEmulator(srv.getsockname()[1]) as link:
        link.cut(down_s=5)
        with socket.create_connection(("127.0.0.1", link.port)) as s:
            s.settimeout(5)
            with pytest.raises(ConnectionResetError):
                s.recv(1)
        assert link.refused == 1


def test_disconnects_scheduled_later_count_from_then(peer):
    """The rig starts its phones' disconnect clock at the burst: counted from the link's start, a cut landed in the
    phones' setup (a first connect refused: the run failed) or at a time unrelated to the measured requests."""
    with LinkEmulator(peer.port, seed=0) as link:
        s = socket.create_connection(("127.0.0.1", link.port))
        time.sleep(0.3)
        link.schedule([Disconnect(at_s=0.2, down_s=0.3)])
        assert _ping_ms(s) < 50 and link.cuts == 0  # 0.3 s after the start: nothing cut yet
        time.sleep(0.3)
        assert link.cuts == 1
        with pytest.raises(OSError):
            _ping_ms(s)
        with pytest.raises(OSError):  # refused while down
            _ping_ms(socket.create_connection(("127.0.0.1", link.port)))


def test_manual_cut_aborts_live_connections(peer):
    with LinkEmulator(peer.port) as link:
        s = socket.create_connection(("127.0.0.1", link.port))
        _ping_ms(s)
        link.cut()
        with pytest.raises(OSError):
            s.sendall(b"e")
            if not s.recv(1):
                raise ConnectionResetError("closed")
        s.close()
        assert link.cuts == 1 and link.connections == 1


def test_stopping_with_bytes_in_flight_logs_no_asyncio_error(peer, caplog):
    """The rig stops its links on Ctrl-C/SIGTERM mid-run: that printed 'Exception in callback ...
    CancelledError' tracebacks from each cancelled connection handler onto the rig's terminal."""
    slow = LinkProfile("slow", rtt_ms=400.0, jitter_ms=0.0, down_mbps=1.0, up_mbps=1.0, loss=0.0)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for _ in range(3):
            link = LinkEmulator(peer.port, slow, seed=1).start()
            s = socket.create_connection(("127.0.0.1", link.port))
            s.sendall(b"s100000\n")
            time.sleep(0.7)  # connected upstream, the answer queued behind the 1 Mbps bottleneck
            link.stop()
            s.close()
    assert not [r for r in caplog.records if r.name == "asyncio"], [r.getMessage() for r in caplog.records]


def test_a_half_close_passes_through_and_the_answer_still_arrives(peer):
    """A client that shuts down its sending side (FIN) still reads the server's answer, as over real TCP; the
    emulator used to close the whole upstream connection at the client's EOF, losing the answer."""
    with LinkEmulator(peer.port) as link, socket.create_connection(("127.0.0.1", link.port)) as s:
        s.sendall(b"w" + b"x" * 5000)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(10)
        answer = b""
        while chunk := s.recv(100):
            answer += chunk
        assert answer == b"5000"


# -- faults for a chaos soak (bench/chaos_soak.py) --------------------------------------------------


def _dead(s: socket.socket) -> bool:
    """True when the connection was reset or closed (what a cut leaves)."""
    s.settimeout(5)
    try:
        s.sendall(b"e")
        return not s.recv(1)
    except OSError:
        return True


def test_a_cut_resets_both_ends():
    """A cut closed both sockets with a FIN (asyncio's abort): each end read a clean end-of-stream, not the reset
    the docs promise, and the server could go on writing into a half-closed connection."""
    with socket.create_server(("127.0.0.1", 0)) as srv, LinkEmulator(srv.getsockname()[1]) as link:
        client = socket.create_connection(("127.0.0.1", link.port))
        server, _ = srv.accept()
        client.sendall(b"e")
        assert server.recv(1) == b"e"
        link.cut()
        for end in (client, server):
            end.settimeout(5)
            with pytest.raises(ConnectionResetError):
                end.recv(1)
            end.close()
        # a reset from one end reaches the other as a reset, not as an end-of-stream
        client = socket.create_connection(("127.0.0.1", link.port))
        server, _ = srv.accept()
        client.sendall(b"e")
        assert server.recv(1) == b"e"
        server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        server.close()
        client.settimeout(5)
        with pytest.raises(ConnectionResetError):
            client.recv(1)
        client.close()


def _read_to_end(s: socket.socket) -> tuple[bytes, str]:
    got, s_end = b"", "FIN"
    s.settimeout(5)
    try:
        while chunk := s.recv(4096):
            got += chunk
    except ConnectionResetError:
        s_end = "RST"
    return got, s_end


@pytest.mark.parametrize("closer", ["server", "client"])
@pytest.mark.parametrize("how", ["RST", "FIN"])
def test_an_end_closing_reaches_the_other_after_its_bytes_one_way_later(closer, how):
    """A reset from one end overtook what that end had sent before it: the other end read the reset at once (0 ms on a
    200 ms link), none of the 1,000 bytes already on the wire; a FIN with nothing queued came at once too."""
    slow = LinkProfile("slow", rtt_ms=200.0, jitter_ms=0.0, down_mbps=100.0, up_mbps=100.0, loss=0.0)
    with socket.create_server(("127.0.0.1", 0)) as srv, LinkEmulator(srv.getsockname()[1], slow) as link:
        client = socket.create_connection(("127.0.0.1", link.port))
        client.sendall(b"e")
        server, _ = srv.accept()
        assert server.recv(1) == b"e"
        sender, receiver = (server, client) if closer == "server" else (client, server)
        t0 = time.perf_counter()
        if how == "RST":
            sender.sendall(b"A" * 1000)
            sender.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sender.close()
        got, end = _read_to_end(receiver)
        took = time.perf_counter() - t0
        receiver.close()
    assert (len(got), end) == ((1000 if how == "RST" else 0), how)
    assert 0.095 <= took < 0.5  # one way (100 ms), not at once


def test_cutting_one_connection_leaves_the_others(peer):
    cut = []
    with LinkEmulator(peer.port) as link, socket.create_connection(("127.0.0.1", link.port)) as a, \
            socket.create_connection(("127.0.0.1", link.port)) as b:
        link.on_cut = cut.append
        _ping_ms(a), _ping_ms(b)
        info = link.connection_info()
        assert [c.index for c in info] == [0, 1] and info[0].peer_port == a.getsockname()[1]
        assert info[0].bytes_up == info[0].bytes_down == 1
        assert link.cut(connection=0) and not link.cut(connection=0)  # the second finds nothing open
        assert _dead(a) and _ping_ms(b) < 50
        assert link.cuts == 1 and [c.index for c in cut] == [0] and [c.index for c in link.connection_info()] == [1]


def test_cut_after_delivers_exactly_that_many_bytes_then_resets(peer):
    with LinkEmulator(peer.port) as link:
        link.cut_after("up", 5 + 3000)  # the next connection: "r4000\n" and 3,000 of its 4,000 bytes get through
        with socket.create_connection(("127.0.0.1", link.port)) as s:
            s.sendall(b"r4000\n" + b"x" * 4000)
            assert _dead(s)
        assert link.bytes_up == 5 + 3000 and link.cuts == 1
        with socket.create_connection(("127.0.0.1", link.port)) as s:  # one trip per call: this one lives
            _ping_ms(s)
            assert link.cut_after("down", 1 + 700, connection=link.connection_info()[0].index)
            s.sendall(b"s1000\n")
            got = b""
            s.settimeout(5)
            try:
                while chunk := s.recv(4096):
                    got += chunk
            except OSError:
                pass
            assert len(got) == 700 and link.cuts == 2  # the ping's byte counted: 700 of the 1,000 came down


def test_a_closed_connection_leaves_only_its_draws_behind(peer):
    """Each closed connection stayed whole in the link (its sockets, tasks and random generators: ~12 KB) until the
    link stopped - a soak's link, thousands of reconnects long, grew by that much each."""
    import gc
    import tracemalloc

    lossy = replace(FLAT, rtt_ms=0.0, loss=0.5, rto_ms=1.0, down_mbps=1000.0, up_mbps=1000.0)
    with LinkEmulator(peer.port, lossy, seed=3) as link:
        for _ in range(20):  # warm: the allocator's pools, the loop's structures
            with socket.create_connection(("127.0.0.1", link.port)) as s:
                _ping_ms(s)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(200):
                with socket.create_connection(("127.0.0.1", link.port)) as s:
                    _ping_ms(s)
            deadline = time.monotonic() + 5
            while link.connection_info() and time.monotonic() < deadline:
                time.sleep(0.01)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grown < 200 * 3000, f"{grown / 200:.0f} bytes kept a connection"
        assert len(link.segment_delays(5, "up")) == 1 and link.retransmitted == sum(
            d > 0.0005 for i in range(220) for way in ("up", "down") for d in link.segment_delays(i, way))
        with pytest.raises(KeyError):
            link.segment_delays(999, "up")


def test_a_stall_delays_every_byte_and_loses_none(peer):
    with LinkEmulator(peer.port) as link, socket.create_connection(("127.0.0.1", link.port)) as s:
        assert _ping_ms(s) < 50
        assert link.stall(0.4, connection=0)
        assert 380 <= _ping_ms(s) < 1000
        assert _ping_ms(s) < 50  # over
        link.stall(0.3)  # every connection
        assert 280 <= _ping_ms(s) < 1000
        assert not link.stall(0.3, connection=7) and link.cuts == 0


def test_a_half_close_ends_one_direction_only(peer):
    with LinkEmulator(peer.port) as link, socket.create_connection(("127.0.0.1", link.port)) as s:
        s.sendall(b"w" + b"x" * 100)  # the peer counts what comes until the FIN, then answers
        time.sleep(0.2)
        assert link.half_close(0, "up")  # the server reads end-of-stream; its answer still comes down
        s.settimeout(5)
        answer = b""
        while chunk := s.recv(100):
            answer += chunk
        assert answer == b"100" and link.cuts == 0
    with LinkEmulator(peer.port) as link, socket.create_connection(("127.0.0.1", link.port)) as s:
        _ping_ms(s)
        assert link.half_close(0, "down")  # the client reads end-of-stream
        s.settimeout(5)
        assert s.recv(1) == b""
        assert not link.half_close(5, "down")
