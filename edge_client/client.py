"""EdgeClient: the phone-side API. Front layers here, back layers in the cloud, text deltas out.

    client = EdgeClient("bundle/", "ws://cloud:8000/v1/split", api_key="...")
    gen = client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=64)
    for delta in gen:            # sync iterator of text deltas
        print(delta, end="")
    print(gen.stats.ttft_s, gen.stats.bytes_up)

    async for delta in client.agenerate(prompt="..."):   # the async twin (any event loop)
        ...

    async with EdgeClient(...) as client:   # an asyncio app: closed by ``await client.aclose()``, off its loop
        ...

One request runs at a time (the edge holds one sequence's KV); concurrent calls queue. Everything network-
side runs on a private event loop thread that owns the WebSocket, so the sync and async APIs share one
session; the front layers run in a worker thread so keepalive pings go out during a long prefill. That thread stays
in the process that built the client: a forked child's copy refuses every call (``forked``), and so does a
generation it inherited (its stream is fed by that thread).

A request (see :mod:`edge_client.generation` for the wire flow): tokenize -> activation-cache lookup ->
front prefill of the rest in chunks, each chunk coded and sent as soon as it is computed -> for every token
the cloud returns, one front decode step and one DecodeStep up -> until a finish reason, a stop string,
``max_tokens`` or :meth:`Generation.cancel`. Dropped links reconnect and resume (or replay) without losing or
repeating a token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from shared.chat_tokens import Placeholder
from shared.detokenizer import StreamDecoder
from shared.exec_mode import Deployment, ExecModeError, LinkState, ModeDecision, RequestShape, choose_mode
from shared.messages import MIN_TEMPERATURE
from shared.openai_compat import StopMatcher, template_kwargs_problem
from shared.manifest import Manifest

from . import bundle_sync
from .activation_cache import ActivationCache
from .config import EdgeConfig
from .errors import EdgeClientError, PromptTooLongError
from .request import RequestSpec, RequestStats, answer_end
from .front import FrontError, FrontRuntime
from .generation import Session
from .media import MediaEncoders, MediaPart, MediaPolicy, assemble, extract_parts
from .tokenizer import EdgeTokenizer
from .vision import MediaError

log = logging.getLogger("edge_client.client")

STOP_WAIT_S = 5.0  # closing waits this long for the session's goodbye, then as long for the loop thread to end

__all__ = ["AsyncGeneration", "EdgeClient", "EdgeClientError", "Generation", "RequestStats"]


class EdgeClient:
    """The edge runtime, tokenizer, activation cache and cloud session of one bundle."""

    def __init__(self, bundle: str | Path | EdgeConfig, url: str | None = None, api_key: str | None = None,
                 media_policy: MediaPolicy | None = None, *, whole_model: Any = None, all_cloud: Any = None,
                 prefix_secret: bytes | None = None, **overrides: Any):
        """``media_policy``: limits on fetching images/audio (default: http(s) allowed, no local paths).

        Execution modes besides ``split`` (``shared.exec_mode``): ``whole_model`` runs the whole model on the
        phone (``edge-only``; e.g. ``rig.all_edge.WholeModelRunner``), ``all_cloud`` calls a full-model
        endpoint (``all-cloud``); each is an object whose ``generate(prompt_ids, max_tokens)`` returns a
        result with ``token_ids`` (greedy) and optionally ``ttft_s`` / ``itl_s`` (its timings: the stats'). ``prefix_secret``: the tenant secret that keys prefix keys in the
        private levels (>= 16 bytes; share it among a tenant's devices to share their cloud prefix blocks);
        None: a random one per client (private requests then share blocks only within this client)."""
        if isinstance(bundle, EdgeConfig):
            cfg = replace(bundle, **({"url": url} if url else {}), **({"api_key": api_key} if api_key else {}),
                          **overrides)
        else:
            kw = {"url": url} if url else {}
            cfg = EdgeConfig(bundle=Path(bundle), api_key=api_key, **kw, **overrides)
        self.config = cfg
        self._pid = os.getpid()  # the process whose loop thread and WebSocket this is (a forked child has neither)
        bundle_sync.recover(cfg.bundle)  # a bundle switch that a crash interrupted
        self.manifest, self.runtime, self.tokenizer, self.cache, self._version = self._open_bundle()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=_run_loop, args=(self._loop,), name="autoglm-edge-loop", daemon=True)
        self._thread.start()
        self.session = Session(cfg, self.manifest, self.runtime, self.cache, self.tokenizer)
        if cfg.auto_update:  # on bundle_mismatch, or another export of this id: download it and carry on with it
            self.session.on_bundle_mismatch = _weak(self._update_bundle)  # (the session never keeps the client)
            self.session.on_new_session = _weak(self._follow_export)
        self.media = MediaEncoders(self._version, cfg.threads)  # opened on the first image / audio clip
        self.media_policy = media_policy or MediaPolicy()
        self.whole_model, self.all_cloud = whole_model, all_cloud
        self.prefix_secret = prefix_secret if prefix_secret is not None else os.urandom(32)
        self.link_up = True  # False: the caller knows the link is down (the policy then keeps the request here)
        self._closed = False
        self._close_lock = threading.Lock()  # one close() closes; every other waits for it (_wait_closed)
        self._close_done = threading.Event()
        self._inflight: dict[concurrent.futures.Future, Any] = {}  # unfinished requests -> their sinks
        self._inflight_lock = threading.Lock()
        # close(), or the app dropping the client unclosed: the loop thread, its WebSocket and the server's session
        # ended only with the process (nothing else refers to the client: it is collected)
        self._stop = weakref.finalize(self, _stop_loop, self._pid, self._loop, self._thread, self.session,
                                      self._inflight, self._inflight_lock)

    def _open_bundle(self) -> tuple[Manifest, FrontRuntime, EdgeTokenizer, ActivationCache, bundle_sync.HeldVersion]:
        """The configured bundle's manifest, front runtime, tokenizer and activation cache, and its version
        (``bundle_sync.HeldVersion``): the bundle path is resolved once, so everything read from it (the
        encoders, opened later, included) is of one version, whatever another process switches the path to, and
        no update removes that version while this client holds it."""
        cfg = self.config
        version = bundle_sync.HeldVersion(cfg.bundle)
        directory = Path(version)
        try:
            manifest = Manifest.load(directory)
            runtime = FrontRuntime(directory, threads=cfg.threads, chunk=cfg.prefill_chunk, verify=cfg.verify_bundle)
            tokenizer = EdgeTokenizer.from_bundle(directory, manifest)
            cache = ActivationCache(
                manifest.bundle_id, runtime.n_layers, runtime.kv_heads, runtime.head_dim,
                runtime.hidden_size, block_tokens=cfg.cache_block_tokens, max_bytes=cfg.cache_max_bytes,
                cache_dir=cfg.cache_dir, dtype=cfg.cache_dtype, edge_variant=manifest.states_variant,
                reserve_bytes=cfg.cache_reserve_bytes, reserve_fraction=cfg.cache_reserve_fraction,
                memory_bytes=cfg.cache_memory_bytes)
        except BaseException:
            version.close()
            raise
        return manifest, runtime, tokenizer, cache, version

    async def _update_bundle(self, bundle_ids: list[str]) -> bool:
        """The cloud refused this bundle (``bundle_ids``: what it serves): download its bundle of the same model,
        switch to it (``edge_client.bundle_sync``) and reopen everything over it. True when switched."""
        try:
            new = await asyncio.to_thread(bundle_sync.update, self.config, self.manifest, bundle_ids,
                                          bundle_sync.LogProgress())
            if new is None:
                return False
            opened = await asyncio.to_thread(self._open_bundle)
        except bundle_sync.BundleSyncError as e:
            raise EdgeClientError(f"the cloud serves another bundle and updating to it failed: {e}", e.code) from None
        self.cache.close()  # the bundle it left: its cache files go, unless another client has them open
        self._version.close()  # and a later update may remove its version
        await asyncio.to_thread(bundle_sync.retire_cache, self.config, self.manifest, opened[0])
        self.manifest, self.runtime, self.tokenizer, self.cache, self._version = opened
        self.media = MediaEncoders(self._version, self.config.threads)
        self.session.use_bundle(self.manifest, self.runtime, self.cache, self.tokenizer)
        return True

    async def _follow_export(self) -> None:
        """A new cloud session (the first, or after a restart: how a re-export is deployed): the server may serve
        another export of this bundle id's edge half (another recipe, a fixed tokenizer: the id covers the cloud
        half, so the Hello was not refused); switch to it as :meth:`_update_bundle` does. A failure is logged, not
        raised: the bundle held works with this cloud."""
        try:
            await self._update_bundle([])
        except EdgeClientError as e:
            log.warning("checking the cloud for another export of bundle %s: %s; carrying on with the one held",
                        self.manifest.bundle_id, e)

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self.session.connected

    def connect(self) -> dict:
        """Open the session now (otherwise the first request does), retrying as a request does; returns the
        server's Welcome as a dict."""
        return self._call(self.session.connect())

    def close(self) -> None:
        """End the session (the server frees it at once) and every request still running (``closed``); a client
        dropped unclosed gets the same when collected. It returns once the client is closed, whichever thread
        closes it and however many at once: a second close() returned while the first still ended the session, its
        loop thread alive. Called on the client's own loop thread (a callback there), it cannot wait for that
        thread to end: it returns at once and the loop stops once its turn ends. In a forked child, whose copy has
        no loop thread, only the child's descriptors close: the parent's client runs on."""
        with self._close_lock:
            first, self._closed = not self._closed, True
        if first:
            try:
                self._stop()  # (in a forked child, nothing)
                self.cache.close()  # its scope is free to retire (edge_client.bundle_sync.retire_cache)
                self._version.close()  # and its bundle version free to remove (bundle_sync.switch)
            finally:
                self._close_done.set()
        self._wait_closed()

    def _wait_closed(self) -> None:
        """Wait until the close() that closes the client has finished and the loop thread has ended (after that
        close() returned, when it ran on the loop thread itself). Not on the loop thread, which cannot wait for
        itself, nor in a forked child: its copy has no such thread, and a close() of the parent's half done at the
        fork is finished by nobody there."""
        if threading.current_thread() is self._thread or os.getpid() != self._pid:
            return
        self._close_done.wait()
        self._thread.join(STOP_WAIT_S)

    async def aclose(self) -> None:
        """:meth:`close` for an asyncio app: it runs on a worker thread, so the caller's event loop serves its other
        tasks meanwhile (closing waits for the server's goodbye, up to seconds on a slow link); it returns, as
        close() does, once the client is closed."""
        await asyncio.to_thread(self.close)

    def __enter__(self) -> EdgeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> EdgeClient:  # ``async with EdgeClient(...) as client:``
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def _call(self, coro, timeout: float | None = None):
        try:
            self._check_open()
        except EdgeClientError:
            coro.close()  # never scheduled: no "never awaited" warning
            raise
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)
        except concurrent.futures.CancelledError:
            self._check_open()  # closed meanwhile (another thread): 'closed', as a request's
            raise

    def _check_open(self) -> None:
        """A closed client's loop has stopped, and a forked child's copy never had one (threads do not survive a
        fork; its loop thread and WebSocket stayed with the parent): a request would wait forever, so it is refused
        at once."""
        _refuse_forked(self._pid, "EdgeClient")
        if self._closed:
            raise EdgeClientError("the client is closed", "closed")

    def warmup_encoders(self, kinds: tuple[str, ...] = ("image", "audio")) -> dict[str, float]:
        """Load the bundle's encoders of ``kinds`` now and run each once; kind -> seconds taken."""
        return self.media.warmup(kinds)

    # -- requests -----------------------------------------------------------------------------
    def _spec(self, prompt: str | None, messages: list[dict] | None, prompt_ids: list[int] | None,
              enable_thinking: bool | None, chat_template_kwargs: dict | None, images: list | None = None,
              audio: list | None = None, **sampling: Any) -> RequestSpec:
        """The request; media (message parts, ``images=`` / ``audio=`` for placeholders in ``prompt`` /
        ``prompt_ids``) are loaded, checked and encoded here: a bad one raises EdgeClientError before any
        network traffic."""
        self._check_open()
        if sampling.get("speculate") is None:  # the request does not say: the client's setting
            sampling["speculate"] = self.config.speculate
        try:
            return self._media_spec(prompt, messages, prompt_ids, enable_thinking, chat_template_kwargs,
                                    images, audio, **sampling)
        except MediaError as e:
            raise EdgeClientError(str(e), e.code) from None

    def _placeholder(self, kind: str) -> Placeholder:
        # decode() hides special tokens; a Placeholder keeps them tokens where a message's text would not
        return Placeholder(self.tokenizer.token_text(self.media.placeholder_ids(kind)))

    def _media_spec(self, prompt, messages, prompt_ids, enable_thinking, chat_template_kwargs, images, audio,
                    **sampling: Any) -> RequestSpec:
        given = sum(x is not None for x in (prompt, messages, prompt_ids))
        if given != 1:
            raise ValueError("pass exactly one of prompt=, messages= or prompt_ids=")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__} (token ids go in prompt_ids=)")
        if messages is not None:
            check_messages(messages)
        elif enable_thinking is not None or chat_template_kwargs is not None:  # a raw prompt is not rendered
            raise ValueError("enable_thinking and chat_template_kwargs apply to messages= (the chat template renders "
                             "them); a prompt= or prompt_ids= request is sent as given")
        parts: list[MediaPart] = []
        if messages is not None:
            messages, parts = extract_parts(messages, self._placeholder)
            kw = _template_kwargs(chat_template_kwargs, enable_thinking)
            prompt = self.tokenizer.render_chat(messages, add_generation_prompt=True, **kw)
        if prompt_ids is None and len(prompt) > self.tokenizer.max_token_chars * self.runtime.max_positions:
            # no tokenizing a text that cannot fit (a 48 MB prompt held the local API's event loop for seconds)
            raise PromptTooLongError(f"prompt of {len(prompt)} characters exceeds the edge graph's "
                                     f"{self.runtime.max_positions} positions")
        # a chat's messages are text (a special token's string in one is no token); a raw prompt is the caller's own,
        # with the tokenizer's own special tokens (a BOS) added as the cloud's full-model /v1/completions adds them
        ids = (list(prompt_ids) if prompt_ids is not None
               else self.tokenizer.encode_chat(prompt) if messages is not None
               else self.tokenizer.encode_prompt(prompt))
        if not ids:
            raise ValueError("empty prompt")
        try:
            self.runtime.check_ids(ids)
        except FrontError as e:
            raise ValueError(f"prompt_ids: {e}") from None
        room, whose = self.session.prompt_room()
        if len(ids) > room:  # the answer needs one position at least (as in full mode)
            raise PromptTooLongError(f"prompt of {len(ids)} tokens exceeds {whose}")
        parts += _sources("image", images) + _sources("audio", audio)
        placeholders = self.media.placeholders()
        if not parts and placeholders.isdisjoint(ids):
            return RequestSpec(prompt_ids=[int(t) for t in ids], **sampling)
        # every placeholder becomes its rows: they must fit too, counted before any is decoded or encoded; the
        # media are read and fetched side by side with other requests', decoded and encoded one request at a time
        checked = self.media.check(parts, self.media_policy, room=(room - len(ids), whose))
        with self.media.turn:
            items = self.media.items(checked, self.media_policy)
            media = assemble([int(t) for t in ids], items, self.runtime.hidden_size, self.media.merge_size,
                             placeholders)
            media.encode(self.session.cached_prefix(media))  # an item inside the cached prefix is not encoded again
        return RequestSpec(prompt_ids=media.ids, media=media, **sampling)

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 prompt_ids: list[int] | None = None, max_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: list[str] | None = None,
                 precision: str | None = None, enable_thinking: bool | None = None,
                 chat_template_kwargs: dict | None = None, images: list | None = None,
                 audio: list | None = None, speculate: bool | None = None, privacy: str = "standard",
                 mode: str | None = None) -> Generation:
        """Start a request; iterate the result for text deltas. Exactly one of ``prompt`` (raw text),
        ``messages`` (rendered by the bundle's chat template, with ``enable_thinking`` and ``chat_template_kwargs``:
        with the other two, sent as given, either is a ValueError) or ``prompt_ids`` (token ids).

        Media: ``messages`` may hold OpenAI ``image_url`` / ``input_audio`` parts (and ``{"type": "image",
        "image": bytes or a PIL image}``); ``images`` / ``audio`` (a list of bytes or URLs - images also PIL
        images -, or one) fill the image / audio placeholder tokens of ``prompt`` / ``prompt_ids`` in order.
        They are encoded on the phone; only hidden states leave it.

        ``temperature=0`` is greedy. ``precision`` overrides the precision policy's choice for this request: a
        wire codec (``"int8-b32"``), a compute variant (``"int8"``), a name that is both (``"fp16"``) or a dict
        (docs/edge.md, "Precision per request"). ``stop`` strings end the text (not included).

        ``speculate``: drafts come from prompt lookup on the phone (the prompt, this answer, earlier answers) or
        from the server's own layers when it offers cloud drafts (whichever is expected to yield more tokens per
        second), else from the bundle's drafter if it has one (``edge_client.draft_head``); the cloud verifies
        several per round trip (``edge_client.drafting``); the output is plain decoding's, greedy or sampled with
        the same ``seed``. None: ``EdgeConfig.speculate`` (off unless set).

        ``privacy`` (``standard`` | ``private`` | ``output-private``) and ``mode`` (an override: ``split``,
        ``u-shape`` (a bundle split with ``--tail``), ``all-cloud``, ``edge-only``) pick where the request runs (``shared.exec_mode``); the choice and why are
        in ``stats.exec_mode`` / ``stats.exec_reason``. An impossible combination raises EdgeClientError."""
        spec = self._spec(prompt, messages, prompt_ids, enable_thinking, chat_template_kwargs, images, audio,
                          max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          stop=_stops(stop), precision=precision, speculate=speculate)
        decision = self._decide(spec, privacy, mode)
        q: queue.Queue = queue.Queue()
        gen = Generation(self, spec, q)
        gen._media_stats()
        gen.stats.exec_mode, gen.stats.exec_reason = decision.mode, decision.reason
        self._submit(gen, self._execute(decision, spec, q.put, gen.stats), q.put)
        return gen

    def _submit(self, gen: _GenerationBase, coro, sink) -> None:
        """Run a request's coroutine on the client's loop, known to :meth:`close` until it ends; EdgeClientError
        ``closed`` when another thread closed the client while this one prepared the request (encoded its media):
        submitted to the stopped loop, it never ran and its stream was read for ever."""
        with self._inflight_lock:  # close() sets _closed, then takes the requests in flight under this lock
            if self._closed:
                coro.close()  # never scheduled: no "never awaited" warning
                raise EdgeClientError("the client was closed before the request started", "closed")
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._inflight[future] = sink
        future.add_done_callback(self._finished)
        gen._future = future

    def _finished(self, future: concurrent.futures.Future) -> None:
        with self._inflight_lock:
            sink = self._inflight.pop(future, None)
        if sink is not None and not future.cancelled() and (e := future.exception()) is not None:
            # a failure no runner path handled (an edge-only / all-cloud runner's malformed result): its consumer
            # waited on the stream for ever; it ends with the error
            log.error("edge request failed", exc_info=e)
            sink(("error", e if isinstance(e, EdgeClientError) else
                  EdgeClientError(f"internal error: {type(e).__name__}: {e}", "internal")))

    # -- execution mode ---------------------------------------------------------------------------
    def _decide(self, spec: RequestSpec, privacy: str, mode: str | None, session_only: bool = False) -> ModeDecision:
        """The request's mode (``shared.exec_mode``) from what this client can run and what it measured; a
        private level also restricts drafts to the cloud's own outputs and keys prefixes with the secret.
        ``session_only``: among the cloud session's modes only (split or u-shape, whichever the bundle has)."""
        sizer = self.session.sizer
        tail = self.session.ushape is not None  # a bundle split with --tail: its cloud returns states, never samples
        # speculation's gain: the better of prompt lookup and, where the server offers them, the cloud's drafts (a
        # u-shape cloud never sees a token and offers none)
        w = self.session.welcome
        sizers = [sizer, self.session.cloud_sizer] if (not tail and self.config.cloud_drafts and w is not None
                                                       and w.server.cloud_drafts > 0) else [sizer]
        gain = max(s.expected_tokens(s.choose()) for s in sizers) if spec.speculate else 1.0
        # the edge-only and all-cloud runners take token ids alone (generate(prompt_ids, max_tokens)): images and
        # audio reach the model only as the front's rows, so a request with them runs split or u-shape (it used
        # to run edge-only on the placeholder ids, the same answer for every screenshot); and they decode
        # greedily, so a sampled request runs split or u-shape too (its temperature and seed were ignored)
        media, sampled = spec.media is not None, spec.temperature >= MIN_TEMPERATURE
        runners = not (media or sampled or session_only)
        dep = Deployment(split=not tail, u_shape=tail, all_cloud=self.all_cloud is not None and runners,
                         edge_only=self.whole_model is not None and runners,
                         boundary_bytes_per_token=2.0 * self.runtime.hidden_size, split_tokens_per_round_trip=gain)
        link = LinkState(connected=self.link_up, rtt_ms=sizer.round_s * 1000)
        shape = RequestShape(len(spec.prompt_ids), spec.max_tokens,
                             images=spec.media.count("image") if spec.media is not None else 0)
        try:
            decision = choose_mode(shape, privacy, link, dep, mode)
        except ExecModeError as e:
            dropped = not (runners or session_only) and (self.all_cloud is not None or self.whole_model is not None)
            why = ("" if not dropped else "; a request with images or audio runs split or u-shape only" if media else
                   "; a sampled request (temperature > 0) runs split or u-shape only: the edge-only and all-cloud "
                   "runners decode greedily")
            raise EdgeClientError(f"{e}{why}", "exec_mode") from None
        spec.drafts_from_outputs_only = decision.drafts_from_outputs_only
        spec.prefix_secret = self.prefix_secret if decision.secret_prefix_keys else None
        spec.ushape = decision.mode == "u-shape"
        return decision

    def _redecide(self, spec: RequestSpec, decision: ModeDecision, stats: RequestStats) -> None:
        """The request's connect updated the bundle to one of the other kind (a tail gained or lost: auto_update),
        so the mode chosen for the old one no longer runs: the request takes the new bundle's session mode where
        its privacy level and override allow it (EdgeClientError ``exec_mode`` otherwise, before any traffic)."""
        try:
            again = self._decide(spec, decision.privacy, decision.override, session_only=True)
        except EdgeClientError as e:
            raise EdgeClientError(f"the cloud moved to another bundle, on which {e}", e.code) from None
        stats.exec_mode, stats.exec_reason = again.mode, f"{again.reason}; the bundle was updated"

    async def _execute(self, decision: ModeDecision, spec: RequestSpec, sink, stats: RequestStats) -> None:
        if decision.mode in ("split", "u-shape"):
            await self.session.run(spec, sink, stats, redecide=lambda: self._redecide(spec, decision, stats))
            return
        runner = self.whole_model if decision.mode == "edge-only" else self.all_cloud
        self.session.fit(spec)  # the split's context bound: a max_tokens past it is cut (and ends "length")
        t0 = time.perf_counter()
        try:
            result = await asyncio.to_thread(runner.generate, list(spec.prompt_ids), spec.max_tokens)
        except Exception as e:  # noqa: BLE001 - the runner's failure is this request's
            sink(("error", EdgeClientError(f"{decision.mode}: {type(e).__name__}: {e}", "internal")))
            return
        stats.total_s = time.perf_counter() - t0
        decoder, stop = StreamDecoder(self.tokenizer.decode), StopMatcher(spec.stop)
        tokens: list[int] = []
        # the answer ends as the split's does (request.answer_end): its end-of-sequence token counted, "length" at
        # max_tokens; a runner's answer that ended before both (it left its end-of-sequence token out) is "stop"
        ids, finish = answer_end(0, [int(t) for t in result.token_ids], spec.max_tokens,
                                 set(self.session.manifest.eos_token_ids))
        for t in ids:  # the stop strings end the text as in split mode (the stop itself not included)
            tokens.append(t)
            text, stopped = stop.feed(decoder.push(t))
            if not stopped and len(tokens) == len(ids):  # the last token carries what the decoder and stops held
                text += stop.finish(decoder.flush())
            sink(("token", t, text))
            if stopped:
                break
        stats.completion_tokens = len(tokens)
        _runner_timings(stats, result, len(tokens))
        if decision.mode == "all-cloud":  # the cloud produced it: a draft source; an edge-only answer never is
            self.session.drafter.remember(tokens)
        sink(("end", "stop" if stop.stopped else finish or "stop"))

    def agenerate(self, prompt: str | None = None, *, loop: asyncio.AbstractEventLoop | None = None,
                  privacy: str = "standard", mode: str | None = None, abandoned: threading.Event | None = None,
                  **kwargs: Any) -> AsyncGeneration:
        """The async twin of :meth:`generate` (same arguments); call it inside a running event loop, or on a
        worker thread with ``loop``, the event loop that consumes the generation (its media are loaded, fetched
        and encoded by the calling thread: ``edge_client.local_api`` keeps them off its event loop). ``abandoned``
        set by then (the caller's own client went away meanwhile): EdgeClientError ``cancelled``, nothing sent."""
        caller = loop or asyncio.get_running_loop()
        spec = self._spec(prompt, kwargs.pop("messages", None), kwargs.pop("prompt_ids", None),
                          kwargs.pop("enable_thinking", None), kwargs.pop("chat_template_kwargs", None),
                          kwargs.pop("images", None), kwargs.pop("audio", None), **_sampling_defaults(kwargs))
        decision = self._decide(spec, privacy, mode)
        if abandoned is not None and abandoned.is_set():
            raise EdgeClientError("the request was abandoned before it started", "cancelled")
        aq: asyncio.Queue = asyncio.Queue()
        gen = AsyncGeneration(self, spec, aq)
        gen._media_stats()
        gen.stats.exec_mode, gen.stats.exec_reason = decision.mode, decision.reason
        def sink(item):
            try:
                caller.call_soon_threadsafe(aq.put_nowait, item)
            except RuntimeError:  # the consumer's event loop is closed (its asyncio.run ended): no one reads this
                pass
        self._submit(gen, self._execute(decision, spec, sink, gen.stats), sink)
        return gen

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Generation:
        """Run a request to the end; returns the finished :class:`Generation` (``.text``, ``.stats``)."""
        gen = self.generate(prompt, **kwargs)
        for _ in gen:
            pass
        return gen

    # -- common prompts ---------------------------------------------------------------------
    def preload_prompts(self, path: str | Path, as_system: bool = True) -> int:
        """Fill the activation cache with the prompts in ``path``; returns the number of tokens cached.

        ``.txt``: the whole file is one prompt. ``.jsonl``: one JSON value per line, a string or
        ``{"messages": [...]}``. ``.json``: a list of those. Strings become a system message rendered by the
        chat template (``as_system``), so their blocks match the start of real requests; set
        ``as_system=False`` to cache raw text. Only the front runs; the cloud learns the prefix from the
        first request that uses it (its hidden states come from this cache, not the front layers). Messages with
        image / audio parts: the blocks before the first one are cached (no encoder runs)."""
        self._check_open()
        return sum(self._call(self.session.preload(ids)) for ids in self._preload_ids(path, as_system))

    def preloaded_tokens(self, path: str | Path, as_system: bool = True) -> int:
        """Tokens of ``path``'s prompts (as :meth:`preload_prompts` reads them) the activation cache holds now: a
        ``cache_max_bytes`` too small for them all evicts earlier prompts' blocks as later ones are cached (as does a
        ``cache_memory_bytes`` where they are held in memory only)."""
        self._check_open()
        return sum(self.cache.contains(ids) for ids in self._preload_ids(path, as_system))

    def _preload_ids(self, path: str | Path, as_system: bool) -> list[list[int]]:
        out = []
        for p in _read_prompts(Path(path)):
            if isinstance(p, str):
                ids = (self.tokenizer.chat_ids([{"role": "system", "content": p}], add_generation_prompt=False)
                       if as_system else self.tokenizer.encode_prompt(p))
            else:  # image / audio parts as their placeholders, as a request renders them (they were repr()'d)
                messages, parts = extract_parts(p, self._placeholder)
                ids = self.tokenizer.chat_ids(messages, add_generation_prompt=False)
                if parts:  # no encoder runs here: the text before the first placeholder is what gets cached
                    first = {self.media.placeholder_ids(part.kind)[0] for part in parts}
                    ids = ids[:next((i for i, t in enumerate(ids) if t in first), len(ids))]
            out.append(ids)
        return out


def _refuse_forked(pid: int, what: str) -> None:
    """EdgeClientError ``forked`` in a process forked from ``pid``, where ``what`` (the client, or a generation's
    stream, which its event loop thread feeds) was made: threads do not survive a fork, so a call would wait for
    ever."""
    if os.getpid() != pid:
        raise EdgeClientError(f"this {what} was created in process {pid}, and a forked process cannot use it (its "
                              "event loop thread and WebSocket stay in that process): create the client in the child "
                              "(a multiprocessing worker's initializer)", "forked")


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The client's loop thread: the loop runs until stopped, then closes (its executor's threads - front work,
    ``to_thread`` - end with it)."""
    try:
        loop.run_forever()
    finally:
        loop.close()


def _weak(method):
    """A session callback that calls ``method`` while its client lives (None after): the session keeps no client
    alive, so an unclosed client is still collected and stopped (:func:`_stop_loop`)."""
    ref = weakref.WeakMethod(method)

    async def call(*args):
        bound = ref()
        return None if bound is None else await bound(*args)
    return call


def _stop_loop(pid: int, loop: asyncio.AbstractEventLoop, thread: threading.Thread, session: Session,
               inflight: dict, lock: threading.Lock) -> None:
    """End a client's loop thread: its unfinished requests fail ``closed`` (the loop stops under them: they would
    never end their streams), the session closes (orderly: the server frees it at once) and the loop stops.
    ``EdgeClient.close()``, or the client's collection (an app that dropped it unclosed). Nothing in a process forked
    from ``pid``: the thread and its WebSocket are the parent's."""
    if os.getpid() != pid:
        return
    with lock:
        unfinished = list(inflight.items())
        inflight.clear()
    for future, sink in unfinished:
        sink(("error", EdgeClientError("the client was closed before the request finished", "closed")))
        future.cancel()
    if threading.current_thread() is thread:  # collected on the loop itself (a request's last frame held the client)
        loop.create_task(_shutdown(session)).add_done_callback(lambda _: loop.stop())
        return
    try:
        asyncio.run_coroutine_threadsafe(_shutdown(session), loop).result(STOP_WAIT_S)
    except Exception:  # noqa: BLE001 - closing is best effort
        pass
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=STOP_WAIT_S)


async def _shutdown(session: Session) -> None:
    """The loop's last work: the session closed, then every other task still on the loop (a preload or a connect
    another thread waits on) cancelled and awaited - the stopped loop left them pending, their callers waiting
    forever and the tasks logged 'destroyed but pending' (Ctrl-C in ``autoglm-edge preload``)."""
    await session.close()
    others = asyncio.all_tasks() - {asyncio.current_task()}
    for task in others:
        task.cancel()
    if others:
        await asyncio.wait(others, timeout=3.0)  # front work in a thread finishes first (_compute)


def _runner_timings(stats: RequestStats, result: Any, n: int) -> None:
    """``ttft_s`` / ``itl_s`` of an edge-only or all-cloud answer of ``n`` tokens (those the stop strings left):
    the runner's own (``result.ttft_s`` / ``result.itl_s``, as the rig's report them: it returns the answer whole,
    so they tell when it produced each token); a runner without them: the first token came with the whole answer
    (``ttft_s = total_s``), no decode rate."""
    if n == 0:
        return
    ttft, itl = getattr(result, "ttft_s", None), getattr(result, "itl_s", None)
    if isinstance(ttft, (int, float)) and 0 <= ttft <= stats.total_s:
        stats.ttft_s = float(ttft)
        stats.itl_s = [float(g) for g in (itl or [])][: n - 1]
    else:
        stats.ttft_s = stats.total_s


def _sampling_defaults(kw: dict) -> dict:
    out = dict(max_tokens=256, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=None, precision=None,
               speculate=None)
    unknown = set(kw) - set(out)
    if unknown:
        raise TypeError(f"unexpected arguments: {', '.join(sorted(unknown))}")
    out.update(kw)
    out["stop"] = _stops(out["stop"])
    return out


def _stops(stop) -> list:
    """``stop=`` as OpenAI takes it: one string or a list of them (a string is one stop, not its characters);
    anything else is left for :class:`RequestSpec` to refuse."""
    if stop is None or isinstance(stop, str):
        return [] if stop is None else [stop]
    return list(stop) if isinstance(stop, (list, tuple)) else stop


def _sources(kind: str, given) -> list[MediaPart]:
    """``images=`` / ``audio=``: sources (a list, or any iterable), or one source as itself - a string is one
    source, not its characters (a data: URL read as 'd', 'a', ... was refused as local paths), and so is what is
    not iterable (a PIL image); never tested for truth (a numpy array's is an error)."""
    if given is None:
        return []
    one = isinstance(given, (str, bytes, bytearray, memoryview, dict)) or not isinstance(given, Iterable)
    return [MediaPart(kind, x) for x in ([given] if one else given)]


def check_messages(messages: Any) -> None:
    """The shape of a chat's ``messages`` (``generate``, preload files), or ``ValueError``: a message without a
    string role was rendered by the chat template as some other turn."""
    if not (isinstance(messages, list) and messages
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        raise ValueError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} dicts")
    for i, m in enumerate(messages):  # the template failed on a null content ('can only concatenate str ...')
        content = m.get("content")
        if content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise ValueError(f"messages[{i}].content: missing or null (a string or a list of content parts)")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}].content must be a string or a list of content parts, "
                             f"got {type(content).__name__}")
        for j, part in enumerate(content if isinstance(content, list) else ()):  # a null text was rendered 'None'
            if isinstance(part, dict) and part.get("type") == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}].content[{j}].text: expected a string")


def _template_kwargs(given: Any, enable_thinking: Any) -> dict:
    """The chat template's variables of a request, or ``ValueError``: a dict within the local API's rule
    (``shared.openai_compat.template_kwargs_problem``: none of the template call's own arguments - ``messages`` or
    ``add_generation_prompt`` there was a bare TypeError -, bounded nesting and size), a string or a list was a
    puzzling ValueError - and a boolean ``enable_thinking`` (or None)."""
    if given is not None and not isinstance(given, dict):
        raise ValueError(f"chat_template_kwargs must be a dict, got {type(given).__name__}")
    if (problem := template_kwargs_problem(given or {})) is not None:
        raise ValueError(problem)
    if enable_thinking is not None and not isinstance(enable_thinking, bool):
        raise ValueError(f"enable_thinking must be True, False or None, got {enable_thinking!r}")
    return {**(given or {}), **({} if enable_thinking is None else {"enable_thinking": enable_thinking})}


def _read_prompts(path: Path) -> list[str | list[dict]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such prompts file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    if path.suffix == ".txt":
        return [text.strip("\n")] if text.strip() else []
    try:
        items = ([json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl"
                 else json.loads(text))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a list of prompts")
    out: list[str | list[dict]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict) and "messages" in item:  # its messages were passed on unchecked (a traceback)
            try:
                check_messages(item["messages"])
            except ValueError as e:
                raise ValueError(f"{path}: item {i}: {e}") from None
            out.append(item["messages"])
        else:
            raise ValueError(f"{path}: item {i} is neither a string nor {{\"messages\": [...]}}")
    return out


class _GenerationBase:
    def __init__(self, client: EdgeClient, spec: RequestSpec):
        self.client = client
        self.spec = spec
        self.stats = RequestStats(prompt_tokens=len(spec.prompt_ids))
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self._future: concurrent.futures.Future | None = None
        self._done = False
        self._pid = os.getpid()  # the process whose client's loop thread feeds the stream (a forked child's has none)

    def _media_stats(self) -> None:
        media = self.spec.media
        if media is not None:
            self.stats.image_tokens = media.tokens_by_kind.get("image", 0)
            self.stats.audio_tokens = media.tokens_by_kind.get("audio", 0)
            self.stats.media_encode_s = media.encode_s  # this request's: others' encoding meanwhile is theirs

    def cancel(self) -> None:
        """Stop generating: the cloud is told to drop the request; iteration ends with finish_reason
        ``"cancelled"``. Safe from any thread; ``forked`` in a forked child, as reading it there is."""
        self._check_process()
        if self._future is not None:
            self._future.cancel()

    def _check_process(self) -> None:
        """``forked`` in a child forked after the request started: its copy of the stream is fed by no one (the
        parent's loop thread feeds the parent's), so a read waited for ever."""
        _refuse_forked(self._pid, type(self).__name__)

    def _unfinished_here(self) -> bool:
        """Not finished, in the process that started it: what close() and collection cancel. A forked child's copy
        is left alone, as a forked client's close() leaves the parent's client (the parent's request runs on)."""
        return not self._done and os.getpid() == self._pid

    def __del__(self):  # abandoned mid-way (a loop left, a consuming task cancelled): free the session for the next
        if self._unfinished_here():
            self.cancel()

    def _consume(self, item) -> str | None:
        kind = item[0]
        if kind == "token":
            _, token, delta = item
            if token >= 0:  # -1: text flushed at the end (held-back bytes), no token of its own
                self.token_ids.append(token)
            self.text += delta
            return delta
        if kind in ("end", "error"):  # the stream's end stays queued for whoever else reads it: a close() from another
            self._q.put_nowait(item)   # thread or task took it while the loop reading the deltas waited for ever
        if kind == "end":
            self.finish_reason = item[1]
            self._done = True
            return None
        if kind == "error":
            self._done = True
            self.finish_reason = "error"
            raise item[1]
        raise AssertionError(f"unknown item {kind!r}")


class Generation(_GenerationBase):
    """Sync iterator of text deltas; ``token_ids``, ``text``, ``finish_reason`` and ``stats`` fill as it runs."""

    def __init__(self, client: EdgeClient, spec: RequestSpec, q: queue.Queue):
        super().__init__(client, spec)
        self._q = q

    def __iter__(self) -> Generation:
        return self

    def __enter__(self) -> Generation:  # ``with client.generate(...) as gen:`` closes it on the way out
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __next__(self) -> str:
        while not self._done:
            self._check_process()
            delta = self._consume(self._q.get())
            if delta:
                return delta
        raise StopIteration

    def iter_tokens(self):
        """Iterate ``(token_id, text_delta)`` per generated token (the delta may be empty while a character
        is incomplete). Use this or plain iteration, not both."""
        while not self._done:
            self._check_process()
            n = len(self.token_ids)
            delta = self._consume(self._q.get())
            if len(self.token_ids) > n:
                yield self.token_ids[-1], delta

    def close(self) -> None:
        """Cancel an unfinished request and wait for its end (nothing in a forked child: ``_unfinished_here``)."""
        if self._unfinished_here():
            self.cancel()
            while not self._done:
                try:
                    self._consume(self._q.get(timeout=10.0))
                except queue.Empty:
                    break
                except Exception:  # noqa: BLE001 - closing: the error is not the caller's concern now
                    break


class AsyncGeneration(_GenerationBase):
    """Async iterator of text deltas (``async for``); ``aclose()`` cancels an unfinished request."""

    def __init__(self, client: EdgeClient, spec: RequestSpec, q: asyncio.Queue):
        super().__init__(client, spec)
        self._q = q

    def __aiter__(self) -> AsyncGeneration:
        return self

    async def __aenter__(self) -> AsyncGeneration:  # ``async with client.agenerate(...) as gen:``
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def __anext__(self) -> str:
        while not self._done:
            self._check_process()
            delta = self._consume(await self._q.get())
            if delta:
                return delta
        raise StopAsyncIteration

    async def iter_tokens(self):
        """Async ``(token_id, text_delta)`` per generated token (see :meth:`Generation.iter_tokens`)."""
        while not self._done:
            self._check_process()
            n = len(self.token_ids)
            delta = self._consume(await self._q.get())
            if len(self.token_ids) > n:
                yield self.token_ids[-1], delta

    async def aclose(self) -> None:
        """Cancel an unfinished request and wait for its end (nothing in a forked child, as :meth:`Generation.close`)."""
        if self._unfinished_here():
            self.cancel()
            while not self._done:
                try:
                    self._consume(await asyncio.wait_for(self._q.get(), 10.0))
                except Exception:  # noqa: BLE001
                    break
