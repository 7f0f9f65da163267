"""uvicorn's HTTP/1.1 protocol (h11), with a deadline for every request head: both servers' (``autoglm-cloud
serve``'s ``--handshake-timeout-s``, ``autoglm-edge serve``'s own).

uvicorn closes a keep-alive connection that stays idle after a response (``timeout_keep_alive``), but gives a
connection's first request head no deadline, nor a later one once a byte of it came: a socket that sends nothing,
or half a request line and stops - a phone losing coverage during its WebSocket upgrade, with no FIN or RST to
tell, or a local app on the phone that opens connections to the edge's endpoint and leaves them - was kept for
ever, and over a long run the server's file descriptors only grew (at its limit, no more accepts).
:func:`protocol_class` returns the h11 protocol with that deadline: a connection that has not sent a whole
request head within ``head_timeout_s`` of opening, or of its previous response, is closed. So is one still sending
the body of a request answered before its body was read (a 413, 415 or 401) that long after the answer: uvicorn
reads such a body's rest to throw it away, and the first bytes of it cancelled its keep-alive timeout, so a client
that sent a few and went silent was kept for ever too. A request under way (its body, its answer) and a WebSocket
after its upgrade are not timed here (``shared.openai_routes.read_body``'s ``stall_s``, the split endpoint's Hello
deadline).
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadDeadlineProtocol(H11Protocol):
    """See the module docstring; :func:`protocol_class` sets ``head_timeout_s``."""

    head_timeout_s = 30.0
    _head_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()  # the next request's head (uvicorn's keep-alive timer stops at its first byte)

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.transport.get_protocol() is not self:  # gone, or a WebSocket now
            return
        no_head = self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE  # and no answer due
        answered_mid_body = self.conn.their_state is h11.SEND_BODY and self.conn.our_state is h11.DONE
        if no_head or answered_mid_body:
            self.conn.send(h11.ConnectionClosed())
            self.transport.close()


def protocol_class(head_timeout_s: float) -> type[HeadDeadlineProtocol]:
    """:class:`HeadDeadlineProtocol` closing a connection without a whole request head after ``head_timeout_s``."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout_s": head_timeout_s})
