"""uvicorn's WebSocket protocol (``websockets-sansio``), with two changes for lockstep split decoding.

A decoding session has one frame in flight each way per token: the edge's ``DecodeStep`` in, the server's
``Tokens`` out. The stock protocol pays for flow control on every one of them, and every system call on the
event loop's thread lets the engine thread take the GIL (the loop then waits for it to come back):

* **reading**: it stops reading the socket after every message it queues for the app and starts again when
  the app takes it (two ``epoll_ctl`` calls per frame). :class:`SplitWSProtocol` stops only once
  :data:`PAUSE_AT` messages wait for the app, so a lockstep session never pauses while a streamed prompt
  (many frames back to back) still does: at most a couple of frames, plus what one read brought, are held;
* **a peer that reads nothing**: :meth:`SplitWSProtocol.abort_link`, offered under :data:`ABORT`, drops the
  connection at once (the parent's close handshake waits for a send buffer such a peer never drains);
* **a burst of small frames** (a peer's flood of tiny messages, pings or empty continuation fragments): the parent
  parses everything one read brought (256 KiB: some 40,000 tiny frames) in one go, and the app then takes the queued
  messages without yielding, so one connection held the event loop - every other phone's session - for seconds.
  :meth:`SplitWSProtocol.data_received` feeds the parser a slice at a time (:data:`FEED_SLICE`) and stops once
  :data:`FRAMES_PER_TURN` frames were parsed or as many messages wait for the app; the rest waits unparsed (past
  :data:`FEED_SLICE_MAX` bytes of it, the socket is not read) and is parsed on a later turn of the loop, in order.
  A link lost before its waiting bytes were parsed loses them, as it loses what was still in flight;
* **a first message** (the ``Hello``, a few hundred bytes) is held to :data:`FIRST_MESSAGE_MAX` as it arrives: the
  parent held up to the server's message limit (``max_frame_bytes`` + 1 MiB) of one until the handshake timeout,
  so connections that never finished a huge first frame pinned 17 MiB each; beyond it the link fails (1009);
* **writing**: the app's ``send`` goes through Starlette's ``WebSocket.send``, the ASGI middleware wrappers and
  a writer task per connection. :meth:`SplitWSProtocol.send_bytes_now` writes one binary message at once, with
  the same checks the ASGI ``send`` makes; it is offered to the app in ``scope["extensions"]`` under
  :data:`SEND_NOW` (``cloud_server.split_endpoint`` uses it when nothing is queued before the frame). It
  returns False - the caller then takes the ASGI path, which waits - when the transport is paused for
  writing (a slow reader), closing, or the handshake is not done.

Everything else (handshake, close, pings, limits, disconnects) is the parent's. :func:`protocol_class` returns
this class, or None where uvicorn's protocol is not the one it extends (another uvicorn version): the server
then runs uvicorn's own choice.
"""

from __future__ import annotations

import logging

log = logging.getLogger("autoglm.cloud")

SEND_NOW = "autoglm.send_now"  # scope["extensions"] key: a callable bytes -> bool (written now, or not)
ABORT = "autoglm.abort"  # scope["extensions"] key: drop the TCP connection now (no close handshake)
PAUSE_AT = 2  # messages waiting for the app at which the socket stops being read
FEED_SLICE = 4 << 10  # bytes handed to the frame parser at a time: at most ~700 frames (empty ones are 6 bytes)...
FEED_SLICE_MAX = 256 << 10  # ...doubling up to this while each slice holds at most one frame (a prompt's 1 MiB)
FRAMES_PER_TURN = 64  # frames parsed per turn of the event loop before the rest of a read waits for the next
FIRST_MESSAGE_MAX = 1 << 16  # bytes of a connection's first message (its Hello: a few hundred) held before the
# link fails (1009); the server's message limit (max_frame_bytes + slack) applies from the second message on

try:
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
    from websockets.exceptions import InvalidState
except ImportError:  # pragma: no cover - uvicorn or websockets without the sans-I/O protocol
    WebSocketsSansIOProtocol = None
    InvalidState = None

# what the subclass relies on from the parent (uvicorn 0.3x-0.5x); absent: fall back to uvicorn's own protocol
_PARENT_API = ("send_receive_event_to_app", "handle_connect", "queue", "read_paused", "writable", "conn",
               "transport", "close_sent", "handshake_complete", "initial_response", "disconnected", "loop",
               "receive", "handle_cont", "handle_bytes", "handle_text", "handle_ping", "handle_pong")


if WebSocketsSansIOProtocol is not None:
    class SplitWSProtocol(WebSocketsSansIOProtocol):
        """See the module docstring."""

        def handle_connect(self, event) -> None:
            super().handle_connect(event)
            scope = getattr(self, "scope", None)  # set by the parent unless the handshake was refused
            if scope is not None:
                self.first_message_due = True  # its size is held to FIRST_MESSAGE_MAX (data_received)
                extensions = scope.setdefault("extensions", {})
                extensions[SEND_NOW], extensions[ABORT] = self.send_bytes_now, self.abort_link

        # bytes read but not yet parsed (a burst cut at FRAMES_PER_TURN), frames parsed this turn, and whether a
        # turn that parses the waiting bytes is scheduled
        unfed: memoryview | None = None
        turn_frames = 0
        feed_due = False

        def data_received(self, data: bytes) -> None:
            if self.unfed:  # bytes read earlier still wait: these go behind them
                self.unfed = memoryview(b"".join((self.unfed, data)))
                if len(self.unfed) > FEED_SLICE_MAX:  # enough waits: the socket is not read meanwhile
                    self._pause()
                return
            self._feed(memoryview(data))

        def _feed(self, data: memoryview) -> None:
            """Parse ``data`` a slice at a time until :data:`FRAMES_PER_TURN` frames were parsed this turn or as
            many messages wait for the app; keep the rest for a later turn."""
            self.turn_frames, start, size = 0, 0, FEED_SLICE
            while start < len(data):
                if self.disconnected or self.transport.is_closing():
                    return  # the link failed or closed on a frame: what follows it is not read
                if self.turn_frames >= FRAMES_PER_TURN or self.queue.qsize() >= FRAMES_PER_TURN:
                    self.unfed = data[start:]
                    if self.queue.qsize() < FRAMES_PER_TURN:  # else receive() schedules it as the app takes them
                        self._feed_later()
                    return
                before = self.turn_frames
                super().data_received(data[start:start + size])
                self._check_first_message()
                start += size
                # a slice that held at most one frame: large frames (a prompt's), take more at once
                size = min(size * 2, FEED_SLICE_MAX) if self.turn_frames - before <= 1 else FEED_SLICE

        def _pause(self) -> None:
            if not self.read_paused:
                self.read_paused = True
                self.transport.pause_reading()

        def _feed_later(self) -> None:
            if not self.feed_due:
                self.feed_due = True
                self.loop.call_soon(self._feed_unfed)

        def _feed_unfed(self) -> None:
            self.feed_due = False
            if not self.unfed or self.disconnected:
                return
            data, self.unfed = self.unfed, None
            self._feed(data)
            if not self.unfed and self.read_paused and self.queue.qsize() < PAUSE_AT:
                self.read_paused = False  # all parsed and room for more: read the socket again
                self.transport.resume_reading()

        async def receive(self):
            message = await super().receive()
            if self.unfed and self.queue.qsize() < FRAMES_PER_TURN:
                self._feed_later()
            return message

        def handle_cont(self, event) -> None:
            self.turn_frames += 1
            super().handle_cont(event)

        def handle_bytes(self, event) -> None:
            self.turn_frames += 1
            super().handle_bytes(event)

        def handle_text(self, event) -> None:
            self.turn_frames += 1
            super().handle_text(event)

        def handle_ping(self) -> None:
            self.turn_frames += 1
            super().handle_ping()

        def handle_pong(self, event) -> None:
            self.turn_frames += 1
            super().handle_pong(event)

        def _check_first_message(self) -> None:
            if getattr(self, "first_message_due", False) and not self.close_sent:
                reader = getattr(self.conn, "reader", None)
                held = len(getattr(reader, "buffer", b"")) + sum(map(len, getattr(self, "frames", ())))
                if held > FIRST_MESSAGE_MAX:  # a Hello is a few hundred bytes: no need to hold 17 MiB of one
                    self.conn.fail(1009, f"first message over {FIRST_MESSAGE_MAX} bytes (a Hello is far smaller)")
                    if self.conn.close_sent is not None:
                        self.handle_parser_exception()  # the close (1009) to the peer, the disconnect to the app
                    else:  # before the app accepted: no close to send
                        self.transport.close()

        def send_receive_event_to_app(self) -> None:
            self.first_message_due = False
            if self.read_paused or self.queue.qsize() + 1 >= PAUSE_AT:
                super().send_receive_event_to_app()  # pauses reading, as uvicorn does
                return
            # the parent pauses reading unless it believes it is paused already: below PAUSE_AT, keep reading
            self.read_paused = True
            try:
                super().send_receive_event_to_app()
            finally:
                self.read_paused = False

        def abort_link(self) -> None:
            """Drop the connection without a close handshake, which would wait behind what a peer that does not
            read never takes (the parent's close does); ``connection_lost`` then wakes the app's pending send and
            receive as for any lost link."""
            if not self.disconnected:
                self.transport.abort()

        def send_bytes_now(self, data: bytes) -> bool:
            """Write ``data`` as one binary message now; False if it must wait (or cannot go): use ``send``."""
            if (self.disconnected or self.close_sent or not self.handshake_complete
                    or self.initial_response is not None or not self.writable.is_set()
                    or self.transport.is_closing()):
                return False
            try:
                self.conn.send_binary(data)
            except InvalidState:
                return False
            self.transport.write(b"".join(self.conn.data_to_send()))
            return True
else:  # pragma: no cover
    SplitWSProtocol = None


def protocol_class():
    """:class:`SplitWSProtocol`, or None (uvicorn's default then) if this uvicorn's protocol lacks what it
    builds on."""
    if SplitWSProtocol is None:
        return None
    probe = WebSocketsSansIOProtocol.__dict__
    init_attrs = WebSocketsSansIOProtocol.__init__.__code__.co_names
    missing = [a for a in _PARENT_API if a not in probe and a not in init_attrs]
    if missing:
        log.warning("uvicorn's websockets-sansio protocol lacks %s: serving with uvicorn's default", missing)
        return None
    return SplitWSProtocol
