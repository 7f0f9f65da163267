"""The edge client's public error type (kept apart so light modules can import it without the session)."""

from __future__ import annotations


class EdgeClientError(Exception):
    """A request failed for good (after retries); ``code`` is the wire error code or a local one
    (``unreachable``, ``bad_server``, ``internal``, ...). ``retry_after_s``: for a refusal for now (``overloaded``,
    ``draining``), the wait the server asked for before another try, in seconds (None: it named none)."""

    def __init__(self, message: str, code: str = "error", retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


class PromptTooLongError(ValueError):
    """A prompt longer than the context leaves room for (the edge graph's positions, or the cloud's context or
    prompt limit, less one for the answer): a bad argument, refused before any network traffic. ``code`` is the
    wire's for it, as a cloud's refusal would carry (the local API's 400 answers it as OpenAI's
    ``context_length_exceeded``)."""

    code = "context_full"
