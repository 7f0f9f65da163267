"""The project's one link emulator: a TCP proxy that makes a loopback connection behave like a mobile link.

    with LinkEmulator(server_port, get_profile("4g"), seed=1) as link:
        client connects to 127.0.0.1:<link.port> ...
        link.cut()                       # every connection through it dies now (RST both ways)

Faults for a chaos soak (``bench/chaos_soak.py``), each on every connection or on one (``connection=i``, an index
of :meth:`LinkEmulator.connection_info`): :meth:`~LinkEmulator.cut` one connection; :meth:`~LinkEmulator.cut_after`
a connection (the next one to open, or a given one) once one direction has carried a number of bytes - exactly that
many are delivered, then both ways are reset (mid-handshake, mid-frame); :meth:`~LinkEmulator.stall` holds every
byte of a connection for a while (a delay spike: nothing lost, everything late); :meth:`~LinkEmulator.half_close`
ends one direction with a FIN while the other keeps flowing.

Each direction of each connection is a :class:`LinkModel`: a FIFO bottleneck of the profile's bandwidth (a
byte leaves only after the bytes before it: serialization delay = size / bandwidth, so a burst queues),
then one-way propagation delay with uniform jitter, then a retransmission delay (one RTO) on a seeded
fraction of TCP segments. TCP delivers in order, so a late segment holds back every byte behind it
(head-of-line blocking): what a loss looks like to an application. A new connection waits one RTT before its
first byte moves (the TCP handshake); an end's FIN or reset reaches the other end behind its bytes, one way later. ``disconnects`` cut every connection at given times and refuse new ones
for a while (a tunnel, a handover).

Reproducible: the random draws (jitter, loss) of connection ``i`` in direction ``up``/``down`` come from a
generator seeded by ``(seed, i, direction)``, one per TCP segment in stream order. Segments are cut as TCP
cuts them: full MSS-sized segments while the link is busy, and a new segment for a write that finds the link
idle. So the same seed gives the same delay for the same byte whatever the read boundaries of the run
(a message that waits for an answer always starts a segment).

Not modelled: TCP congestion control (slow start, cwnd), bufferbloat beyond ``max_queue_bytes``, reordering.
The kernel's ``tc qdisc ... netem`` does the same job in a real lab (docs/rig.md says how).

References: Linux netem (delay/jitter/loss/rate semantics); RFC 6298 (RTO); Neurosurgeon (Kang et al.,
ASPLOS 2017) for why the link, not the GPU, decides where to split.
"""

from __future__ import annotations

import asyncio
import collections
import random
import socket
import struct
import threading
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.link_profiles import MSS, LinkProfile

# The event loop's timers wake up to one millisecond late (epoll waits whole milliseconds, rounded up), so a
# delivery aimed at its due time came 0.5-1 ms late in each direction: an RTT of 5 ms measured 6.7 ms. Aimed half
# a millisecond early, with everything due within half a millisecond delivered at once, the error is centred on
# the due time: within +-0.5 ms (plus the host's wake-up latency).
TIMER_SLACK_S = 0.0005

# a link that adds nothing: the pass-through proxy the reliability tests cut
IDEAL = LinkProfile("loopback", rtt_ms=0.0, jitter_ms=0.0, down_mbps=1e6, up_mbps=1e6, loss=0.0,
                    source="no emulation: loopback speed")


@dataclass(frozen=True, slots=True)
class Disconnect:
    at_s: float  # seconds after the link starts (or after LinkEmulator.schedule)
    down_s: float = 0.0  # new connections are refused for this long after the cut


@dataclass(slots=True)
class DirectionStats:
    bytes: int = 0
    segments: int = 0
    retransmitted: int = 0  # segments that drew a loss (each delayed by one RTO)


class LinkModel:
    """Delay model of one direction of one connection (no I/O: tests drive it with explicit times).

    ``send(now, n)`` hands ``n`` bytes to the link at time ``now`` and returns ``[(arrival_time, nbytes)]``
    pieces in stream order; arrival times never decrease."""

    def __init__(self, profile: LinkProfile, direction: str, rng: random.Random, mss: int = MSS):
        if direction not in ("up", "down"):
            raise ValueError(f"direction {direction!r}: expected 'up' or 'down'")
        self.bits_per_s = (profile.up_mbps if direction == "up" else profile.down_mbps) * 1e6
        self.one_way_s = profile.one_way_s
        self.jitter_s = profile.jitter_ms / 1000.0
        self.loss = profile.loss
        self.rto_s = profile.rto_ms / 1000.0
        self.mss = mss
        self.rng = rng
        self.segment = 0  # index of the TCP segment being filled
        self.segment_left = mss  # its room left: a busy link packs back-to-back writes into full segments
        self.free_at = 0.0  # when the bottleneck finishes serializing what it holds
        self.last_arrival = 0.0
        # extra delay (propagation + jitter + loss) of segment k of the stream, kept for segment_delays(): 8 bytes a
        # segment (a list of floats held ~70, 5 % of the bytes carried: a soak moving 10 GB kept ~500 MB)
        self.draws = array("d")
        self.stats = DirectionStats()

    def _segment_delay(self, k: int) -> float:
        while len(self.draws) <= k:
            jitter = self.rng.uniform(-self.jitter_s, self.jitter_s)  # always drawn: the stream stays aligned
            lost = self.rng.random() < self.loss
            self.draws.append(self.one_way_s + jitter + (self.rto_s if lost else 0.0))
            self.stats.segments += 1
            self.stats.retransmitted += int(lost)
        return self.draws[k]

    def send(self, now: float, nbytes: int) -> list[tuple[float, int]]:
        out: list[tuple[float, int]] = []
        if now >= self.free_at and self.segment_left < self.mss:
            # an idle link: the sender's next write starts a new TCP segment (a 1-byte ping is its own segment)
            self.segment += 1
            self.segment_left = self.mss
        left = nbytes
        while left > 0:
            piece = min(left, self.segment_left)
            start = max(self.free_at, now)
            self.free_at = start + piece * 8.0 / self.bits_per_s  # serialization: queued behind earlier bytes
            arrival = max(self.free_at + self._segment_delay(self.segment), self.last_arrival)  # in order
            self.last_arrival = arrival
            out.append((arrival, piece))
            self.segment_left -= piece
            if self.segment_left == 0:
                self.segment += 1
                self.segment_left = self.mss
            left -= piece
        self.stats.bytes += nbytes
        return out

    def end(self, now: float) -> float:
        """When the FIN or RST the sender hands over at ``now`` arrives: behind every byte before it, one-way delay
        after it leaves the bottleneck (it carries no payload: no serialization, no draw)."""
        return max(max(self.free_at, now) + self.one_way_s, self.last_arrival)


@dataclass(slots=True)
class _Connection:
    index: int
    transports: list = field(default_factory=list)
    tasks: list = field(default_factory=list)
    models: dict = field(default_factory=dict)
    peer_port: int = 0  # the client's source port (which client a connection is)
    opened_at: float = 0.0  # loop time of the accept
    trip: dict = field(default_factory=dict)  # direction -> bytes after which the connection is reset
    hold_until: float = 0.0  # loop time before which nothing is delivered either way (a stall)
    pumps: dict = field(default_factory=dict)  # direction -> its pump task


@dataclass(frozen=True, slots=True)
class ConnectionInfo:
    index: int
    peer_port: int  # the client's source port
    age_s: float
    bytes_up: int  # read from the client so far
    bytes_down: int  # read from the server so far


class LinkEmulator:
    """Forward ``127.0.0.1:<port>`` to ``target_host:target_port`` through an emulated link.

    Runs on its own thread and event loop, so it works from sync tests and from the rig alike. ``bytes_up``
    / ``bytes_down`` count application bytes that crossed it; ``connections`` the connections accepted;
    ``cuts`` the cuts made (by :meth:`cut` or a scheduled disconnect); ``refused`` the connections refused
    while the link was down."""

    def __init__(self, target_port: int, profile: LinkProfile | None = None, seed: int = 0,
                 disconnects: list[Disconnect] | tuple[Disconnect, ...] = (), target_host: str = "127.0.0.1",
                 port: int = 0, max_queue_bytes: int = 4 << 20):
        self.target = (target_host, target_port)
        self.profile = profile or IDEAL
        self.seed = seed
        self.disconnects = sorted(disconnects, key=lambda d: d.at_s)
        self.max_queue_bytes = max_queue_bytes  # the bottleneck's buffer: reading pauses above it
        self.port = port or _free_port()
        self.connections = 0
        self.cuts = 0
        self.refused = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self._conns: dict[int, _Connection] = {}
        # what is kept of a closed connection: its draws for segment_delays() (not its sockets, tasks and generators:
        # ~12 KB a connection, which a soak's link, thousands of reconnects long, kept to the end)
        self._closed_draws: dict[int, dict[str, array]] = {}
        self._closed_retransmitted = 0
        self._down_until = 0.0
        self._hold_until = 0.0  # a stall of every connection: nothing is delivered before this loop time
        self._armed: list[tuple[str, int]] = []  # (direction, bytes): trips for the next connections to open
        # called on the link's thread with each connection's ConnectionInfo as it is cut (a soak names the moment)
        self.on_cut: Callable[[ConnectionInfo], None] | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"link-{self.profile.name}", daemon=True)
        self._server: asyncio.AbstractServer | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> LinkEmulator:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("link emulator did not start")
        if self._error is not None:
            raise RuntimeError(f"link emulator could not listen on port {self.port}: {self._error}")
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        try:
            fut.result(5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> LinkEmulator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        except OSError as e:
            self._error = e
            self._ready.set()
            return
        self._schedule(self.disconnects)
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [t for c in self._conns.values() for t in c.tasks]
        self._cut_all()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- control ----------------------------------------------------------------------------------
    def cut(self, down_s: float = 0.0, connection: int | None = None) -> bool:
        """Abort every connection now (RST, no close handshake), or only ``connection``; refuse new ones for
        ``down_s`` seconds. Returns once they are gone: False when ``connection`` was not open (nothing cut)."""
        return self._call(self._cut_now, down_s, connection)

    def schedule(self, disconnects: list[Disconnect] | tuple[Disconnect, ...]) -> None:
        """Scheduled disconnects as the constructor's, their ``at_s`` counted from now instead of from the start (the
        rig starts the clock when its phones start their measured requests)."""
        self._call(self._schedule, list(disconnects))

    def _schedule(self, disconnects: list[Disconnect]) -> None:
        for d in disconnects:
            self._loop.call_later(d.at_s, self._cut_now, d.down_s)

    def cut_after(self, direction: str, nbytes: int, connection: int | None = None) -> bool:
        """Reset a connection once its ``direction`` (``up``: client to server) has carried ``nbytes`` bytes in
        all: exactly those are delivered, then both ways are aborted (``cuts`` counts it then). ``connection``
        None: the next connection to open (one each call, in order: a reconnect's handshake), else that one
        (False when it is not open)."""
        _direction(direction)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return self._call(self._arm, direction, nbytes, connection)

    def stall(self, seconds: float, connection: int | None = None) -> bool:
        """A delay spike: nothing reaches either end of every connection (or of ``connection``) for ``seconds``
        from now; what the ends send meanwhile queues and then arrives, in order. False when ``connection`` is
        not open."""
        return self._call(self._stall, seconds, connection)

    def half_close(self, connection: int, direction: str) -> bool:
        """End ``direction`` of ``connection`` as a FIN does (``up``: the server reads end-of-stream, as if the
        client had shut down its sending side); bytes still in that direction's queue are lost, the other
        direction keeps flowing until an end closes it. False when the connection is not open."""
        _direction(direction)
        return self._call(self._half_close, connection, direction)

    def connection_info(self) -> list[ConnectionInfo]:
        """The connections open now, oldest first."""
        return self._call(self._info)

    def _call(self, fn, *args):
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(5)

    def _cut_now(self, down_s: float, connection: int | None = None) -> bool:
        if connection is not None and connection not in self._conns:
            return False
        victims = list(self._conns.values()) if connection is None else [self._conns[connection]]
        if self.on_cut is not None:
            now = self._loop.time()
            for c in victims:
                self.on_cut(self._info_of(c, now))
        for c in victims:
            self._drop(c, reset=True)
        self.cuts += 1
        self._down_until = max(self._down_until, self._loop.time() + down_s)
        return True

    def _arm(self, direction: str, nbytes: int, connection: int | None) -> bool:
        if connection is None:
            self._armed.append((direction, nbytes))
            return True
        conn = self._conns.get(connection)
        if conn is None:
            return False
        conn.trip[direction] = nbytes
        return True

    def _stall(self, seconds: float, connection: int | None) -> bool:
        until = self._loop.time() + seconds
        if connection is None:
            self._hold_until = max(self._hold_until, until)
            return True
        conn = self._conns.get(connection)
        if conn is None:
            return False
        conn.hold_until = max(conn.hold_until, until)
        return True

    def _half_close(self, connection: int, direction: str) -> bool:
        conn = self._conns.get(connection)
        task = conn.pumps.get(direction) if conn is not None else None
        if task is None or task.done():
            return False
        task.cancel()  # the pump sends the FIN as it ends (_pump)
        return True

    def _info(self) -> list[ConnectionInfo]:
        now = self._loop.time()
        return [self._info_of(c, now) for c in self._conns.values()]

    @staticmethod
    def _info_of(c: _Connection, now: float) -> ConnectionInfo:
        return ConnectionInfo(c.index, c.peer_port, now - c.opened_at, c.models["up"].stats.bytes,
                              c.models["down"].stats.bytes)

    def _cut_all(self) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn, reset=True)

    def _drop(self, conn: _Connection, reset: bool = False) -> None:
        """Close both ends now; ``reset``: with an RST, as a cut is documented (a plain abort closed them with a
        FIN: each end read a clean end-of-stream, and the server's writes went on succeeding)."""
        for t in conn.transports:
            if reset:
                _reset(t)
            else:
                t.abort()
        try:
            me = asyncio.current_task()
        except RuntimeError:  # the loop is closing
            me = None
        for task in conn.tasks:
            if task is not me:
                task.cancel()
        if self._conns.pop(conn.index, None) is not None:
            self._closed_draws[conn.index] = {d: m.draws for d, m in conn.models.items()}
            self._closed_retransmitted += sum(m.stats.retransmitted for m in conn.models.values())

    @property
    def retransmitted(self) -> int:
        """Segments that drew a loss so far, over every connection and both directions."""
        return self._closed_retransmitted + sum(m.stats.retransmitted for c in list(self._conns.values())
                                                for m in c.models.values())

    def segment_delays(self, connection: int, direction: str) -> list[float]:
        """The per-segment extra delays drawn so far for one direction of one connection (reproducibility)."""
        conn = self._conns.get(connection)
        kept = {d: m.draws for d, m in conn.models.items()} if conn is not None else self._closed_draws.get(connection)
        draws = (kept or {}).get(direction)
        if draws is None:
            raise KeyError(f"no connection {connection}")
        return list(draws)

    # -- the proxy --------------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._proxy(reader, writer)
        except asyncio.CancelledError:  # stop() / a cut: end quietly (a cancelled client_connected_cb task makes
            pass  # asyncio log "Exception in callback ... CancelledError" on Python 3.11)

    async def _proxy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() < self._down_until:  # the link is down: the connect fails (a reset, as a refused one reads)
            self.refused += 1
            _reset(writer.transport)
            return
        index = self.connections
        self.connections += 1
        conn = _Connection(index)
        conn.models = {d: LinkModel(self.profile, d, random.Random(f"{self.seed}:{index}:{d}"))
                       for d in ("up", "down")}
        conn.opened_at = loop.time()
        peer = writer.get_extra_info("peername")
        conn.peer_port = peer[1] if peer else 0
        if self._armed:
            direction, nbytes = self._armed.pop(0)
            conn.trip[direction] = nbytes
        conn.transports.append(writer.transport)
        self._conns[index] = conn
        conn.tasks.append(asyncio.current_task())
        try:
            if self.profile.rtt_ms > 0:
                await asyncio.sleep(self.profile.rtt_ms / 1000.0)  # SYN / SYN-ACK before the first byte
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except (OSError, asyncio.CancelledError):  # no server there (or cut meanwhile): the client's connect fails
            self._drop(conn, reset=True)
            return
        conn.transports.append(up_writer.transport)
        if index not in self._conns:  # cut while connecting
            up_writer.transport.abort()
            return
        up = asyncio.ensure_future(self._pump(reader, up_writer, conn, "up"))
        down = asyncio.ensure_future(self._pump(up_reader, writer, conn, "down"))
        conn.pumps = {"up": up, "down": down}
        conn.tasks += [up, down]
        try:
            await asyncio.gather(up, down, return_exceptions=True)
        finally:
            for w in (writer, up_writer):  # both directions ended: the connection closes
                w.close()
            self._drop(conn)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, conn: _Connection,
                    direction: str) -> None:
        loop = asyncio.get_running_loop()
        model: LinkModel = conn.models[direction]
        queue: collections.deque[tuple[float, bytes | None]] = collections.deque()  # None: the end (FIN or RST)
        state = {"queued": 0}
        wake = asyncio.Event()
        room = asyncio.Event()
        room.set()

        async def deliver() -> None:
            try:
                await deliver_all()
            finally:  # ended (or failed: the other end is gone): the reader must not wait for room that never comes
                room.set()

        async def deliver_all() -> None:
            end = False
            while not end:
                if not queue:
                    wake.clear()
                    await wake.wait()
                    continue
                wait = max(queue[0][0], self._hold_until, conn.hold_until) - loop.time()  # a stall holds it all
                if wait > TIMER_SLACK_S:
                    await asyncio.sleep(wait - TIMER_SLACK_S)  # aimed half a timer tick early: see TIMER_SLACK_S
                    continue
                horizon = loop.time() + TIMER_SLACK_S  # what is due within half a millisecond goes in one write
                batch = []
                while queue and queue[0][0] <= horizon and not end:
                    piece = queue.popleft()[1]
                    end = piece is None
                    batch.append(piece or b"")
                data = b"".join(batch)
                state["queued"] -= len(data)
                if state["queued"] <= self.max_queue_bytes:
                    room.set()
                dst.write(data)
                await dst.drain()

        sender = asyncio.ensure_future(deliver())
        tripped = reset = False
        try:
            while not tripped:
                await room.wait()
                if sender.done():  # a write failed: its error is raised below
                    break
                try:
                    data = await src.read(65536)
                except (ConnectionError, OSError):  # the sender reset: what it sent before is on the wire already
                    reset = True
                    break
                if not data:
                    break
                trip = conn.trip.get(direction)
                if trip is not None and model.stats.bytes + len(data) >= trip:  # cut_after: this far, then reset
                    data, tripped = data[:max(0, trip - model.stats.bytes)], True
                if direction == "up":
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
                pos = 0
                for arrival, n in model.send(loop.time(), len(data)):
                    queue.append((arrival, data[pos:pos + n]))
                    pos += n
                state["queued"] += len(data)
                if state["queued"] > self.max_queue_bytes:
                    room.clear()
                wake.set()
            queue.append((model.end(loop.time()), None))  # the FIN or RST travels too, behind the bytes in flight
            wake.set()
            await sender
            if tripped:
                self._cut_now(0.0, conn.index)
            elif reset:  # a reset from one end reaches the other as a reset, not as an end-of-stream
                _reset(dst.transport)
            elif dst.can_write_eof():  # a half-close passes on as one: the other direction keeps flowing
                dst.write_eof()
            else:
                dst.close()
        except (ConnectionError, OSError):  # a failed write: the other end is gone
            _reset(dst.transport)
        except asyncio.CancelledError:
            if conn.index in self._conns and direction in conn.pumps and not dst.is_closing() \
                    and dst.can_write_eof():  # half_close(): this direction ends with a FIN
                try:
                    dst.write_eof()
                except (ConnectionError, OSError):
                    pass
            raise
        finally:
            sender.cancel()
            if sender.done() and not sender.cancelled():
                sender.exception()  # retrieved: asyncio would log "Task exception was never retrieved"


def _reset(transport: asyncio.BaseTransport) -> None:
    """Close ``transport``'s socket with an RST (SO_LINGER 0): asyncio's abort alone sends a FIN."""
    sock = transport.get_extra_info("socket")
    if sock is not None and not transport.is_closing():
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


def _direction(direction: str) -> None:
    if direction not in ("up", "down"):
        raise ValueError(f"direction {direction!r}: expected 'up' or 'down'")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
