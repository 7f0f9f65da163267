"""A TCP proxy for tests that can cut every connection through it at will (a mobile link dropping)."""

from __future__ import annotations

import asyncio
import socket
import threading


class CuttableProxy:
    """Forward 127.0.0.1:<port> to ``target_port``; :meth:`cut` aborts every live connection (both sides)."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.connections = 0
        self.cuts = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server = None

    def __enter__(self) -> CuttableProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("proxy did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._writers += [writer, up_writer]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def cut(self) -> None:
        """Abort every connection now (RST, no close handshake): both ends see the link die."""
        def _cut():
            for w in self._writers:
                w.transport.abort()
            self._writers.clear()
            self.cuts += 1
        self._loop.call_soon_threadsafe(_cut)
