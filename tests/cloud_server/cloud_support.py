"""Test support for the cloud server: the edge's own front runtime, the unsplit greedy reference, and a driver
that plays several phones against an engine (staggered arrivals, slow decode replies)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cloud_server.engine.sampling_params import SamplingParams
from cloud_server.engine.sequence import InputChunk
from edge_client.front import FrontRuntime
from partition_tools.adapters import cache_kwarg_of


def edge_front(bundle: Path) -> FrontRuntime:
    """The phone's own front runtime (``edge_client.front``) over the bundle's edge graph, one thread.

    ``front.fork()`` gives another sequence over the same loaded graph (a test plays many phones)."""
    return FrontRuntime(bundle, threads=1, verify=False)


def boundary(front: FrontRuntime, ids: list[int]) -> torch.Tensor:
    """Tokens at positions [len, len + S) through the front -> boundary hidden states [S, H] (float32)."""
    return torch.from_numpy(front.prefill(ids))


@torch.no_grad()
def greedy_reference(model, prompt: list[int], max_new: int, eos: list[int]) -> list[int]:
    """The unsplit model's greedy continuation (full recompute each step, fp32), stopping after an eos."""
    ids = list(prompt)
    out = []
    for _ in range(max_new):
        logits = model(torch.tensor([ids])).logits[0, -1]
        tok = int(torch.argmax(logits))
        out.append(tok)
        ids.append(tok)
        if tok in eos:
            break
    return out


@torch.no_grad()
def greedy_reference_batch(model, prompts: list[list[int]], max_new: int, eos: list[int]) -> list[list[int]]:
    """``greedy_reference`` for several prompts at once, the way ``generate`` batches: left padding, an
    attention mask, and the library's KV cache (on CPU the cost is reading the weights, once per step)."""
    from transformers import DynamicCache

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])  # [B, W] left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, W]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    cache_kw = cache_kwarg_of(model.forward)
    outs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(max_new):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                       **{cache_kw: cache}).logits[:, -1]  # [B, V]
        nxt = torch.argmax(logits, dim=-1)  # [B]
        for i, tok in enumerate(nxt.tolist()):
            if not done[i]:
                outs[i].append(tok)
                done[i] = tok in eos
        if all(done):
            break
        ids = nxt[:, None]  # [B, 1]
        pos = pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
    return outs


@dataclass
class Phone:
    """One simulated device: arrives at engine step ``arrive``, answers each token after ``delay`` steps."""

    name: str
    prompt: list[int]
    front: FrontRuntime
    max_tokens: int
    arrive: int = 0
    delay: int = 0
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    due: list[tuple[int, int]] = field(default_factory=list)  # (step, token) replies not yet sent


def drive(engine, phones: list[Phone], max_steps: int = 10_000, prefix_keys=None, params=None) -> int:
    """Run ``engine`` until every phone finished; returns the number of steps."""
    step = 0
    live = {p.name: p for p in phones}
    while any(p.finish is None for p in phones):
        for p in phones:
            if p.arrive == step:
                first = InputChunk(0, hidden=boundary(p.front, p.prompt))
                sp = params(p) if params else SamplingParams(temperature=0.0, max_tokens=p.max_tokens)
                outs = engine.add_request(p.name, first, sp, prefix_keys=(prefix_keys or {}).get(p.name))
                for o in outs:
                    p.finish, p.error = o.finish_reason, o.error_code
            for due, tok in [d for d in p.due if d[0] <= step]:
                p.due.remove((due, tok))
                pos = len(p.prompt) + len(p.tokens) - 1
                engine.add_input(p.name, InputChunk(pos, hidden=boundary(p.front, [tok])))
        for o in engine.step():
            p = live[o.request_id]
            if o.token_id is not None:
                p.tokens.append(o.token_id)
            if o.finished:
                p.finish, p.error = o.finish_reason, o.error_code
            elif o.token_id is not None:
                p.due.append((step + 1 + p.delay, o.token_id))
        step += 1
        if step > max_steps:
            raise RuntimeError(f"engine did not finish in {max_steps} steps: {engine.seqs}")
    return step


def edge_generate(bundle: Path, url: str, prompt: list[int], max_tokens: int, retry, on_token=None,
                  **sampling) -> tuple[list[int], object]:
    """One request through a real ``EdgeClient`` (fp16 codec, ``retry`` policy) to the server at ``url``
    (``ws://host:port``); ``on_token(n)`` runs when the n-th token arrives (a test injects its fault there).
    Asserts the request ran to its length; returns its tokens and the client's stats."""
    from edge_client.client import EdgeClient

    with EdgeClient(bundle, url, codec="fp16", retry=retry) as c:
        gen = c.generate(prompt_ids=prompt, max_tokens=max_tokens, **sampling)
        tokens = []
        for tok, _ in gen.iter_tokens():
            tokens.append(tok)
            if on_token is not None:
                on_token(len(tokens))
        assert gen.finish_reason == "length", gen.finish_reason
        return tokens, gen.stats


async def refused_hello(ws_url: str, bundle_id: str):
    """A Hello on a new connection that the server refuses: its ``Error`` and the close code after it."""
    import websockets

    from shared import protocol as P

    async with websockets.connect(ws_url) as ws:
        await ws.send(P.encode_message(P.Hello(bundle_id=bundle_id, codecs=["fp16"])))
        err = P.decode_message(await ws.recv())
        try:
            await ws.recv()
        except websockets.ConnectionClosed as e:
            return err, e.rcvd.code
        raise AssertionError(f"the server answered {err} and kept the connection open")


class ServerThread:
    """A real uvicorn server for ``app`` on a free port, in a background thread (``with`` block).
    ``uvicorn_kw`` go to ``uvicorn.Config`` (``ssl_certfile``/``ssl_keyfile``: https:// and wss://)."""

    def __init__(self, app, host: str = "127.0.0.1", **uvicorn_kw):
        import socket

        import uvicorn

        from cloud_server.app import DrainingServer

        with socket.socket() as s:
            s.bind((host, 0))
            self.port = s.getsockname()[1]
        self.host = host
        self.tls = "ssl_certfile" in uvicorn_kw
        self.server = DrainingServer(uvicorn.Config(app, host=host, port=self.port, log_level="warning",
                                                    **{"ws_ping_interval": None, **uvicorn_kw}), app)
        self.thread = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"{'wss' if self.tls else 'ws'}://{self.host}:{self.port}/v1/split"

    def __enter__(self):
        import threading
        import time

        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextmanager
def serving(config, **uvicorn_kw) -> Iterator[ServerThread]:
    """``autoglm-cloud serve`` in-process for ``config`` (a ``ServerConfig``): the runtime started, its app on a
    real uvicorn server; ``srv.runtime`` and ``srv.app`` are set. Stops both on exit."""
    from cloud_server.app import create_app
    from cloud_server.runtime import CloudRuntime

    rt = CloudRuntime(config).start()
    try:
        app = create_app(rt)
        with ServerThread(app, **uvicorn_kw) as srv:
            srv.runtime, srv.app = rt, app
            yield srv
    finally:
        rt.stop()


class EdgeSim:
    """A minimal edge over the real protocol: Hello, Prefill, DecodeStep per token, Cancel, Resume.

    Runs the edge's front runtime for every token it sends (one fork of ``front`` per request), codes hidden
    states with ``codec`` (``shared.codecs``) and records every message it receives."""

    def __init__(self, url: str, bundle: Path, bundle_id: str, codec: str = "fp16", api_key: str | None = None,
                 front: FrontRuntime | None = None):
        self.url, self.bundle, self.bundle_id, self.codec = url, bundle, bundle_id, codec
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.front = front or edge_front(bundle)  # loaded once; requests fork it
        self.ws = None
        self.welcome = None

    async def connect(self, resume_token: str | None = None, codecs: list[str] | None = None):
        import websockets

        from shared import protocol as P

        self.ws = await websockets.connect(self.url, additional_headers=self.headers, max_size=None)
        await self.send(P.Hello(bundle_id=self.bundle_id, codecs=codecs or [self.codec],
                                resume_token=resume_token))
        self.welcome = await self.recv()
        return self.welcome

    async def send(self, msg) -> None:
        from shared import protocol as P

        await self.ws.send(P.encode_message(msg))

    async def recv(self, timeout: float = 60.0):
        import asyncio

        from shared import protocol as P

        return P.decode_message(await asyncio.wait_for(self.ws.recv(), timeout))

    def encode(self, hidden: torch.Tensor):
        from shared.codecs import get_codec

        return get_codec(self.codec).encode(hidden.numpy())

    async def prefill(self, rid: str, front: FrontRuntime, prompt: list[int], params, start: int = 0,
                      keys: list[str] | None = None, chunk: int = 0) -> None:
        """Run the front over ``prompt`` and send positions [start, len) (in chunks of ``chunk`` if > 0)."""
        from shared import protocol as P

        hidden = boundary(front, prompt)  # [S, H]
        n = len(prompt)
        step = chunk or n
        first = True
        for a in range(start, n, step):
            b = min(n, a + step)
            await self.send(P.Prefill(request_id=rid, start=a, hidden=self.encode(hidden[a:b]), last=b == n,
                                      params=params if first else None, prefix_keys=(keys or []) if first else []))
            first = False

    async def generate(self, rid: str, prompt: list[int], max_tokens: int, start: int = 0, keys=None,
                       stop_after: int | None = None, temperature: float = 0.0, ignore_eos: bool = False,
                       pause: float = 0.0):
        """Greedy generation; returns (tokens, finish_reason, last Tokens message). ``stop_after``: return
        after that many tokens without sending the next DecodeStep (the caller then cancels or drops);
        ``pause``: seconds a slow phone waits before each DecodeStep."""
        import asyncio

        from shared import protocol as P

        front = self.front.fork()
        params = P.SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos)
        await self.prefill(rid, front, prompt, params, start, keys)
        tokens: list[int] = []
        while True:
            msg = await self.recv()
            if isinstance(msg, P.Error):
                return tokens, f"error:{msg.code}", msg
            if not isinstance(msg, P.Tokens) or msg.request_id != rid:
                continue
            tokens.extend(msg.token_ids)
            if msg.finish_reason is not None:
                return tokens, msg.finish_reason, msg
            if stop_after is not None and len(tokens) >= stop_after:
                return tokens, None, msg
            if pause:
                await asyncio.sleep(pause)
            pos = len(prompt) + len(tokens) - 1
            await self.send(P.DecodeStep(request_id=rid, position=pos, hidden=self.encode(boundary(front, [tokens[-1]]))))

    def kill(self) -> None:
        """Drop the TCP connection without a close handshake (a phone losing its link)."""
        self.ws.transport.abort()

    async def close(self) -> None:
        from shared import protocol as P

        await self.send(P.Close())
        await self.ws.close()


def signal_twice(bundle: Path, log: Path, extra_args: list[str], first: int, wait_for: str, second: int,
                 delay_s: float = 0.0, group: bool = False) -> tuple[int, str]:
    """Serve ``bundle`` (``autoglm-cloud serve`` as a subprocess, CPU), send it ``first``, wait until its log shows
    ``wait_for`` (then ``delay_s``), send ``second`` if it is still running (``group``: both to its whole process
    group, as a terminal's Ctrl-C); its exit status and its log."""
    import os
    import time

    from edge_client.demo import LocalCloud

    kill = os.killpg if group else os.kill
    with LocalCloud(bundle, extra_args=extra_args, log_path=log) as cloud:
        proc = cloud.proc
        kill(proc.pid, first)
        deadline = time.monotonic() + 30
        while wait_for not in log.read_text(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(delay_s)
        if proc.poll() is None:
            kill(proc.pid, second)
        code = proc.wait(60)
    return code, log.read_text(errors="replace")
