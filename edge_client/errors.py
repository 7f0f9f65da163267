"""The edge client's public error type (kept apart so light modules can import it without the session)."""

from __future__ import annotations


class EdgeClientError(Exception):
    """A request failed for good (after retries); ``code`` is the wire error code or a local one
    (``unreachable``, ``bad_server``, ``internal``, ...)."""

    def __init__(self, message: str, code: str = "error"):
        super().__init__(message)
        self.code = code
