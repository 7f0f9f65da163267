"""The all-cloud baseline on the simulated phone: chat requests as text to the server's full-model endpoint.

A minimal HTTP/1.1 client on one keep-alive connection (the phone's app would hold one too, as the split
client holds its WebSocket): ``POST /v1/chat/completions`` with ``stream: true`` and usage, the SSE body read
as it arrives. It counts every byte it writes and reads on the socket (headers included), so the uplink and
downlink figures compare with the split client's WebSocket frame counts.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from edge_client.request import mark_token


class CloudAPIError(Exception):
    """The full-model endpoint answered with an error status or a malformed stream."""


@dataclass(slots=True)
class CloudRun:
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # the server's prefix-cache hits (usage.prompt_tokens_details.cached_tokens)
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks (one per token)
    total_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    finish_reason: str | None = None


class FullModelClient:
    """Streams chat completions from ``base_url`` (``http://host:port``) over one keep-alive connection."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 120.0):
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"{base_url!r}: expected http://host:port")
        self.host, self.port = u.hostname, u.port or 80
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> None:
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def chat(self, messages: list[dict], max_tokens: int, on_delta=None) -> CloudRun:
        """One greedy streamed completion; ``on_delta(text)`` is called per content chunk."""
        t0 = time.perf_counter()
        await self._connect()
        body = json.dumps({"model": "full", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: keep-alive\r\n"
                + (f"Authorization: Bearer {self.api_key}\r\n" if self.api_key else "") + "\r\n").encode()
        run = CloudRun(bytes_up=len(head) + len(body))
        self._writer.write(head + body)
        await self._writer.drain()
        try:
            await asyncio.wait_for(self._read_response(run, t0, on_delta), self.timeout_s)
        except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError) as e:
            await self.close()
            raise CloudAPIError(f"full-model stream failed: {type(e).__name__}: {e}") from None
        run.total_s = time.perf_counter() - t0
        return run

    async def _readline(self, run: CloudRun) -> bytes:
        line = await self._reader.readuntil(b"\r\n")
        run.bytes_down += len(line)
        return line[:-2]

    async def _read_response(self, run: CloudRun, t0: float, on_delta) -> None:
        status = await self._readline(run)
        headers: dict[str, str] = {}
        while line := await self._readline(run):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        code = int(status.split()[1])
        if headers.get("transfer-encoding", "").lower() != "chunked":
            n = int(headers.get("content-length", "0"))
            data = await self._reader.readexactly(n)
            run.bytes_down += n
            raise CloudAPIError(f"HTTP {code}: {data[:300].decode('utf-8', 'replace')}")
        buf = b""
        last = None
        while True:
            size = int((await self._readline(run)).split(b";")[0], 16)
            if size == 0:
                await self._readline(run)  # the empty trailer line
                break
            chunk = await self._reader.readexactly(size + 2)
            run.bytes_down += size + 2
            buf += chunk[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                last = self._event(run, event, t0, last, on_delta)
        if code != 200:
            raise CloudAPIError(f"HTTP {code}")
        if headers.get("connection", "").lower() == "close":
            await self.close()

    @staticmethod
    def _event(run: CloudRun, event: bytes, t0: float, last: float | None, on_delta) -> float | None:
        data = event.decode("utf-8").removeprefix("data:").strip()
        if not data or data == "[DONE]":
            return last
        obj = json.loads(data)
        if "error" in obj:
            raise CloudAPIError(f"server error: {obj['error']}")
        if obj.get("usage"):
            u = obj["usage"]
            run.completion_tokens = int(u.get("completion_tokens", 0))
            run.prompt_tokens = int(u.get("prompt_tokens", 0))
            run.cached_tokens = int((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        for choice in obj.get("choices") or []:
            delta = (choice.get("delta") or {}).get("content")
            if choice.get("finish_reason"):
                run.finish_reason = choice["finish_reason"]
            if delta:
                last = mark_token(run, t0, last)
                run.text += delta
                if on_delta is not None:
                    on_delta(delta)
        return last
