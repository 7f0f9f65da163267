"""The all-cloud baseline on the simulated phone: chat requests as text to the server's full-model endpoint.

A minimal HTTP/1.1 client on one keep-alive connection (the phone's app would hold one too, as the split
client holds its WebSocket): ``POST /v1/chat/completions`` with ``stream: true`` and usage, the SSE body read
as it arrives. It counts every byte it writes and reads on the socket (headers included), so the uplink and
downlink figures compare with the split client's WebSocket frame counts.
"""

from __future__ import annotations

import asyncio
import json
import random
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
    reconnects: int = 0  # attempts after the first (a link cut: the request sent again whole)


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
        """One greedy streamed completion; ``on_delta(text)`` is called per content chunk.

        A connection that fails (reset, refused, closed mid-answer: a link cut, a scheduled disconnect) is retried
        as the split phone's client retries (``RetryPolicy()``: its backoff, within its reconnect window): the
        request goes again whole - the server keeps nothing of it - and its greedy answer shows from where the
        failed one stopped. TTFT and the gaps are what the user saw; bytes count every attempt's; ``reconnects``
        the retries. Any such failure failed the phone, and the run, before: a scenario's ``disconnects`` could
        not be given with all-cloud."""
        from edge_client.config import RetryPolicy

        retry = RetryPolicy()
        t0 = time.perf_counter()
        run = CloudRun()
        shown = {"text": "", "last": None}  # what the user saw across attempts, and when its last token came
        while True:
            try:
                await self._attempt(messages, max_tokens, run, t0, shown, on_delta)
                break
            except (ConnectionError, asyncio.IncompleteReadError) as e:  # the link, not the server's answer
                await self.close()
                delay = retry.wait(run.reconnects, t0 + retry.reconnect_window_s - time.perf_counter(),
                                   rand=random.random())
                if delay is None:
                    raise CloudAPIError(f"full-model stream failed ({run.reconnects} retries): {type(e).__name__}: "
                                        f"{e}") from None
                run.reconnects += 1
                await asyncio.sleep(delay)
            except asyncio.TimeoutError:
                await self.close()
                raise CloudAPIError(f"full-model stream failed: no answer within {self.timeout_s:g} s") from None
        run.text = shown["text"]
        run.total_s = time.perf_counter() - t0
        return run

    async def _attempt(self, messages: list[dict], max_tokens: int, run: CloudRun, t0: float, shown: dict,
                       on_delta) -> None:
        await self._connect()
        body = json.dumps({"model": "full", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: keep-alive\r\n"
                + (f"Authorization: Bearer {self.api_key}\r\n" if self.api_key else "") + "\r\n").encode()
        run.bytes_up += len(head) + len(body)
        run.text = ""  # this attempt's answer; what goes past shown["text"] is new to the user
        self._writer.write(head + body)
        await self._writer.drain()
        await asyncio.wait_for(self._read_response(run, t0, shown, on_delta), self.timeout_s)

    async def _readline(self, run: CloudRun) -> bytes:
        line = await self._reader.readuntil(b"\r\n")
        run.bytes_down += len(line)
        return line[:-2]

    async def _read_response(self, run: CloudRun, t0: float, shown: dict, on_delta) -> None:
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
                self._event(run, event, t0, shown, on_delta)
        if code != 200:
            raise CloudAPIError(f"HTTP {code}")
        if headers.get("connection", "").lower() == "close":
            await self.close()

    @staticmethod
    def _event(run: CloudRun, event: bytes, t0: float, shown: dict, on_delta) -> None:
        data = event.decode("utf-8").removeprefix("data:").strip()
        if not data or data == "[DONE]":
            return
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
                run.text += delta
                new = run.text[len(shown["text"]):] if run.text.startswith(shown["text"]) else ""
                if new:  # (a retry's answer, until it passes what the failed attempt showed, is not new)
                    shown["last"] = mark_token(run, t0, shown["last"])
                    shown["text"] += new
                    if on_delta is not None:
                        on_delta(new)
