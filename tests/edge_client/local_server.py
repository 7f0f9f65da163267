"""``autoglm-edge serve``'s app on a real uvicorn server in a background thread, for the local API's tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


@contextmanager
def local_server(app, start_timeout_s: float = 30.0) -> Iterator[str]:
    """Serve ``app`` on a free loopback port; yields its base URL (``http://127.0.0.1:PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.monotonic() + start_timeout_s
    while not srv.started:
        if time.monotonic() > deadline or not th.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        th.join(timeout=10)
