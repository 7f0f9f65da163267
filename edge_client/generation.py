"""One edge session with the cloud: the request flow, the prefix cache on the wire, reconnect and resume.

The flow of one request (message names from :mod:`shared.protocol`)::

    Hello(bundle_id, codecs, resume_token?) -> Welcome(session_id, resume_token, limits)   [once per link]
    Prefill(start=p, hidden[p:p+n], params, prefix_keys, last=False) ... Prefill(..., last=True)
                                              <- Tokens(index 0, [t0])
    DecodeStep(position=L, hidden(t0))        <- Tokens(index 1, [t1])       ... until finish_reason

Prefix cache: the edge names every full block of the prompt by its hash-chain key
(:func:`shared.prefix_keys.block_keys`, at the server's block size, scoped to this bundle, this front's
weights and the request's codec - plus the activation cache's float16 rounding when it stores float16,
:meth:`Session._cloud_scope` -: the cloud reuses only states produced the same way). When its activation cache
covers ``[0, h)`` it skips the front layers there, and it skips uploading ``[0, c)``: the leading blocks of
``[0, h)`` whose keys the cloud is known to hold (:attr:`Session.cloud_keys`: the keys ``Welcome.cached_prefixes``
listed, and those of the prompts this session completed since - the cloud publishes a prompt's blocks when it
has computed them); the rest goes up. A prefix the edge cached alone (``preload``; a restarted or another
cloud) is therefore uploaded with the first request, without a round trip lost. The list is advisory: if
the cloud lost a block since (evicted), it answers ``Error(prefix_miss)`` and the edge resends the whole
prompt, the prefix's hidden states coming from its cache (the front layers still do not run). A cloud whose
Welcome says it keeps no prefix cache (``ServerInfo.prefix_cache`` false: ``serve --no-enable-prefix-cache``)
gets no keys at all, so every prompt goes up whole in its first Prefill; one whose Welcome omits the field (an
older server) is taken to keep one.

Resume: the edge keeps, for the whole context, every hidden state it sent (coded, as sent) and every token
it received. When the link drops it reconnects with backoff and presents its resume token:

* the session survived (``Welcome.resumed``): ``Resume(request_id, have)``; the cloud resends the tokens
  after ``have`` and says which position it expects next; the edge resends its inputs from there;
* the session is gone (server restart, another replica): the edge *replays* - a fresh request whose prompt
  is the whole context so far (prompt + tokens received), all hidden states from its record, so the new
  server rebuilds its KV without the front layers running again; token indices continue where they were.

Either way no token is lost or repeated (greedy output equals an undisturbed run's).

Drain (the server is going away: a rolling update, a scale-down): requests open on it run to their end there; the
next request goes to a new connection - the balancer's next replica, or the replacement on the same address -
whether the ``Drain`` was read during an earlier request or was still unread when the server refused the new one
(``Error(draining)``: the request is replayed there).

The protocol's rules are the server's own: every message the edge sends first passes the shared state machine
(``shared.session_state``, the one the cloud enforces) and every message it receives is recorded there, and
prompt states are cut into Prefill messages by the shared chunking (``shared.chunking``), so a message the
cloud would refuse is caught here, as a bug, before it leaves.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shared import codecs as C
from shared import protocol as P
from shared.chunking import prefill_messages
from shared.detokenizer import StreamDecoder
from shared.manifest import Manifest
from shared.messages import MAX_PREFIX_KEYS
from shared.openai_compat import StopMatcher
from shared.precision import PrecisionError, PrecisionOverride, RequestFeatures, choose_precision, step_codec
from shared.prefix_keys import KeyScope, block_keys
from shared.session_state import DRAINING, RequestTrack, SessionError, SessionState
from shared.tensors import WireArray

from .activation_cache import ActivationCache
from .config import EdgeConfig
from .draft_head import open_draft_head
from .drafting import DRAFTER_SIZERS, DraftSizer, PromptLookupDrafter, SizerConfig
from .errors import EdgeClientError
from .request import RequestSpec, RequestStats, fit_answer, mark_token
from .front import FrontRuntime
from .tail import TailRuntime
from .tokenizer import EdgeTokenizer
from .transport import GarbageFromServer, HandshakeRefused, Link, LinkDown, ServerBusy, retry_after_s, route_key
from .ushape import UShape

from shared.version import __version__ as CLIENT_VERSION

log = logging.getLogger("edge_client.generation")

# prefix keys a session remembers the cloud holding (Session.cloud_keys), the most recently learned: a long-lived
# session publishing prompt after prompt would otherwise grow the set for good (the cloud evicts its side anyway)
CLOUD_KEYS_KEPT = 4 * MAX_PREFIX_KEYS


@dataclass(slots=True)
class _Sent:
    """One coded span of hidden states sent for a request: positions [start, start + n)."""

    start: int
    n: int
    tensor: object  # shared.codecs EncodedTensor, as sent
    rope: object = None  # WireArray int32 [3, n]: 3-D rope positions sent with it (prompts with images)


@dataclass(slots=True)
class _Spec:
    """A SpecStep in flight: the fed token and ``drafts`` at positions [position, position + k + 1)."""

    position: int
    drafts: list[int]
    hidden: np.ndarray  # [k + 1, H] raw boundary states (the accepted rows are coded again for the record)
    msg: object  # the SpecStep as sent (a resume resends it as is)
    started: float  # perf_counter when its front work began (the step's cost runs from here to the verdict)
    from_head: bool = False  # drafted by the bundle's draft head (its own sizer), not by prompt lookup
    from_cloud: bool = False  # the cloud's proposal (Tokens.draft_ids, its own sizer)
    shadow: list[int] = field(default_factory=list)  # the other source's proposal, not sent: scored on the verdict


class _Request:
    """Everything needed to resend or replay a request: its spec, coded inputs, received tokens."""

    def __init__(self, spec: RequestSpec, codec: str, compute: str | None = None, step_codec: str | None = None):
        self.spec = spec
        self.rid = uuid.uuid4().hex[:16]
        # The trace id in both ends' logs (the cloud logs request ids as trace=<id>); a replay's new request
        # id starts with it, so one grep finds every attempt.
        self.trace_id = self.rid
        self.codec = codec  # prompt chunks (and the prefix keys)
        self.step_codec = step_codec or codec  # decode steps and SpecSteps (shared.precision.step_codec)
        self.compute = compute
        self.prompt_len = len(spec.prompt_ids)
        self.prefix_raw: np.ndarray | None = None  # [c, H] hidden of the prefix not uploaded (from the cache)
        self.prefix_keys: list[str] | None = None  # the keys its Prefill names (Session._prefix_keys), once computed
        self.sent: list[_Sent] = []  # coded inputs, in position order
        self.tokens: list[int] = []  # received, in order
        self.index_base = 0  # the cloud's token index 0 is our token `index_base` (after a replay)
        self.opened = False  # the current request id's first Prefill (params, keys) has been sent
        self.pending: list = []  # token messages received during recovery, to process in order
        self.finish: str | None = None
        # (since, replays, tokens held then): the cloud dropping it for load with no token since (the wait's window)
        self.overload: tuple[float, int, int] | None = None
        self.spec_step: _Spec | None = None  # the speculative step awaiting its verdict
        self.plain_started: float | None = None  # when the DecodeStep in flight began (the sizer's timing)
        self.cloud_drafts: list[int] = []  # the cloud's proposal after the last token received (Tokens.draft_ids)
        # drafting over image placeholders would need their 3-D rope rows: media prompts decode plainly
        self.speculate = spec.speculate and spec.media is None
        self.bundle_gen = 0  # Session.bundle_gen its inputs were computed under
        # the bundle's drafter mirrors the front's context: (start, ids, rows) notes not yet handed to it, and
        # its catch-up over the prompt, running while the first token is on its way (Session._sync_head)
        self.head_notes: list[tuple[int, list[int], np.ndarray]] = []
        self.head_ready: asyncio.Future | None = None

    @property
    def context_len(self) -> int:
        return self.prompt_len + len(self.tokens)

    def context_ids(self, start: int, n: int) -> list[int]:
        """The tokens at positions [start, start + n) of the context (prompt, then the tokens received)."""
        p = self.prompt_len
        return [*self.spec.prompt_ids[start:p], *self.tokens[max(0, start - p):start + n - p]][:n]


async def _compute(fn, *args):
    """Run front-layer work in a worker thread (the event loop keeps pinging). If the caller is cancelled
    meanwhile, the work still finishes before the cancellation propagates: the runtime's KV cache must never
    be touched by two requests at once."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait({fut})
        raise


def _calibration(bundle: Path) -> dict | None:
    """The bundle's boundary calibration (outlier channels, the PCA codecs' artifact), if any."""
    return C.load_calibration(bundle)


def _moved_kind(ushape: bool, when: str) -> EdgeClientError:
    """A request's bundle was updated to one of the other kind (a u-shape tail gained or lost)."""
    return EdgeClientError(f"the cloud moved to a bundle {'without' if ushape else 'with'} a u-shape tail{when}; send "
                           "the request again", "bundle_changed")


def _refusal(failure: Exception) -> str | None:
    """The wire code of a server's refusal for now (``overloaded``, ``draining``, ``internal``: the server answered),
    None for a failure nothing answered (a drop, a refused socket, an unanswered upgrade)."""
    return failure.code if isinstance(failure, ServerBusy) else None


class Session:
    """The link, the Welcome it got, and the request loop (see the module docstring)."""

    def __init__(self, config: EdgeConfig, manifest: Manifest, runtime: FrontRuntime, cache: ActivationCache,
                 tokenizer: EdgeTokenizer | None = None):
        self.config = config
        self.manifest = manifest
        self.runtime = runtime
        self.cache = cache
        self.tokenizer = tokenizer
        self.link = Link(config.url, config.api_key, config.retry, ca_file=config.ca_file)
        self.codecs = C.available_codecs(_calibration(runtime.bundle_dir))  # name -> BoundaryCodec
        self.welcome = None
        # the server's busy fraction (the policy's load input): the Welcome's, then each final Tokens' (Tokens.load),
        # so a session held for hours plans its requests at the server's load of late, not of its connect
        self.server_load = 0.0
        self.resume_token: str | None = None
        # the cloud answered once - a Welcome, or a refusal for now (overloaded, draining): the URL, key and bundle
        # are right - so a failed connect is retried for the longer window (a busy server is no misconfiguration)
        self.reached = False
        self.down_since: float | None = None  # monotonic time of the first failure since the cloud last answered
        # prefix keys the cloud holds as far as this session knows, per compute variant (each has its own KV pool:
        # a block held for one is a prefix_miss for another): Welcome.cached_prefixes (of Welcome.plan.compute),
        # and the keys of the prompts it completed since (advisory: a prefix_miss says one was lost)
        self.cloud_keys: dict[str, dict[str, None]] = {}  # compute -> an ordered set: oldest first (CLOUD_KEYS_KEPT)
        self.state = SessionState()  # the protocol's rules, as the cloud enforces them
        self._lock: asyncio.Lock | None = None
        # the request running keys its prefixes with a secret (a private level): its connections carry no route key
        self._private = False
        # prompt lookup over the context and earlier outputs (agent steps repeat actions); remembered across requests
        self.drafter = PromptLookupDrafter()
        self.sizer = DraftSizer(self.drafter.config.max_drafts, SizerConfig(fixed_k=config.draft_k))
        # the bundle's drafter (edge_client.draft_head: its layer drafter or its lens), when it has one: drafts
        # where prompt lookup has none, priced by their own sizer
        self._open_head()
        # async (server's bundle ids) -> bool: the client's bundle update on bundle_mismatch (EdgeConfig.auto_update)
        self.on_bundle_mismatch = None
        # async () -> None: after the Welcome of a new session, the client's check for another export of its bundle
        # id (EdgeConfig.auto_update: a re-exported edge half keeps the id, so no Hello is refused for it)
        self.on_new_session = None
        self.bundle_gen = 0  # bumped by use_bundle: a request opened under an older bundle is rebuilt
        self.ushape: UShape | None = None
        self.ushape = self._open_ushape()  # a bundle split with --tail: its tail and the u-shape loop

    def use_bundle(self, manifest: Manifest, runtime: FrontRuntime, cache: ActivationCache,
                   tokenizer: EdgeTokenizer | None) -> None:
        """Carry on with another bundle of the same model (after an update): its front, cache and codecs."""
        self.manifest, self.runtime, self.cache, self.tokenizer = manifest, runtime, cache, tokenizer
        self.codecs = C.available_codecs(_calibration(runtime.bundle_dir))
        self.bundle_gen += 1
        self.ushape = self._open_ushape()
        self._open_head()

    def _open_head(self) -> None:
        cfg = self.config
        self.head = open_draft_head(self.runtime.bundle_dir, self.manifest, cfg.threads)  # the front's version
        prior = DRAFTER_SIZERS[self.head.kind if self.head is not None else "lens"]
        self.head_sizer = DraftSizer(self.drafter.config.max_drafts, prior.with_fixed_k(cfg.draft_k))
        self.cloud_sizer = DraftSizer(self.drafter.config.max_drafts, DRAFTER_SIZERS["cloud"].with_fixed_k(cfg.draft_k))

    def _open_ushape(self) -> UShape | None:
        """The u-shape loop of a bundle split with --tail (None without one). After a bundle update the loop stays
        and takes the new bundle's tail, empty: a u-shape request open across the update runs it over the new
        middle's States of its whole context (:meth:`_rebuild`), never the old tail over them."""
        if not self.manifest.tail_layers:
            return None
        cfg = self.config
        tail = TailRuntime(self.runtime.bundle_dir, threads=cfg.threads, chunk=cfg.prefill_chunk,
                           verify=cfg.verify_bundle)
        if self.ushape is None:
            return UShape(self, tail)
        self.ushape.tail = tail
        return self.ushape

    # -- connection -----------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self.link.open and self.welcome is not None

    @property
    def limits(self) -> P.SessionLimits:
        return self.welcome.limits if self.welcome is not None else P.SessionLimits()

    @property
    def max_context(self) -> int:
        """Positions one request may fill (prompt + answer): the cloud's context or the edge graph's, the smaller."""
        return min(self.limits.max_context, self.runtime.max_positions)

    def prompt_room(self) -> tuple[int, str]:
        """Positions a prompt may fill as far as the phone knows, and whose limit that is: the edge graph's less
        one for the answer, and while a session is open the cloud's too (its context less one, its prompt limit),
        so a prompt the cloud would refuse is refused before its media are encoded or its states uploaded."""
        room = [(self.runtime.max_positions - 1, f"the edge graph's {self.runtime.max_positions} positions less "
                                                 "one for the answer")]
        if self.welcome is not None:
            lim = self.welcome.limits
            room += [(lim.max_context - 1, f"the cloud's context of {lim.max_context} less one for the answer"),
                     (lim.prompt_limit, f"the cloud's prompt limit of {lim.prompt_limit}")]
        return min(room, key=lambda r: r[0])

    def fit(self, spec: RequestSpec) -> None:
        """Refuse a prompt over :meth:`prompt_room` (EdgeClientError ``context_full``) and cut ``spec.max_tokens``
        to the context left (the answer then ends ``"length"`` there), as in full mode - every mode's rule: the
        front failed at the edge graph's last position before (an internal error after the whole answer's work),
        and the edge-only and all-cloud runners answered past the context."""
        spec.max_tokens = fit_answer(len(spec.prompt_ids), spec.max_tokens, self.prompt_room(), self.max_context)

    @property
    def block_size(self) -> int:
        return self.limits.prefix_block_tokens

    def _hello(self, resume: bool):
        hints = P.ClientHints(link_kbps=self.config.link_kbps, edge_quant=self.manifest.edge_quant,
                              threads=self.config.threads, client=f"autoglm-edge/{CLIENT_VERSION}")
        return P.Hello(bundle_id=self.manifest.bundle_id, codecs=list(self.codecs), hints=hints,
                       resume_token=self.resume_token if resume else None)

    async def ensure_connected(self, resume: bool = False, route: bool = True) -> dict:
        """Connect unless connected (``route``: send the route key, if any, not at a private level, and not for a
        u-shape bundle, whose requests send no prefix keys: the key would only tell the cloud the system prompt)."""
        if not self.connected:
            for attempt in (0, 1):  # a second Hello after a bundle update
                hello = self._hello(resume and attempt == 0)
                try:
                    w = await self.link.connect(hello, route=route and not self._private and self.ushape is None)
                    break
                except HandshakeRefused as e:
                    if attempt == 0 and e.code == "bundle_mismatch" and self.on_bundle_mismatch is not None \
                            and await self.on_bundle_mismatch(e.bundle_ids):
                        continue
                    raise EdgeClientError(str(e), e.code) from None
                except GarbageFromServer as e:
                    raise EdgeClientError(str(e), "bad_server") from None
            if self.config.cache_block_tokens != w.limits.prefix_block_tokens:
                log.warning("the cloud names prefixes per %d tokens, the edge cache per %d: cloud prefix reuse "
                            "is limited to whole cloud blocks", w.limits.prefix_block_tokens,
                            self.config.cache_block_tokens)
            if w.resumed:
                self.state.reconnect()  # same session: its open requests carry on
            else:
                self.state = SessionState()
            self.state.on_client(hello)
            self.state.on_server(w)
            # what the cloud holds: its list, and on the same session what its requests published since
            if not w.resumed:
                self.cloud_keys = {}
            self._learn_keys(w.plan.compute, reversed(w.cached_prefixes))  # listed most recently used first
            self.welcome = w
            self.server_load = w.server.load
            self.resume_token = w.resume_token
            self.reached = True
            if not w.resumed and attempt == 0 and self.on_new_session is not None:  # (1: it has just updated)
                await self.on_new_session()
        return P.to_dict(self.welcome)

    async def _send(self, msg) -> int:
        """Check ``msg`` against the protocol's rules, then send it; returns the frame's size."""
        frame = P.encode_message(msg)
        try:
            self.state.on_client(msg, len(frame))
        except SessionError as e:
            raise EdgeClientError(f"the edge would break the protocol ({e.code}): {e.message}", e.code) from None
        return await self.link.send_frame(frame)

    async def _recv(self, timeout: float):
        """The next message from the cloud, recorded in the protocol state (a Tokens' load in :attr:`server_load`).
        A fatal Error ends the session: the link is closed here and the resume token dropped (the request it ended
        fails with its code; the next request opens a new session, as a long-lived client - ``autoglm-edge serve`` -
        needs)."""
        msg = await self.link.recv(timeout)
        self.state.on_server(msg)
        if isinstance(msg, P.Tokens) and msg.load is not None:
            self.server_load = msg.load
        if isinstance(msg, P.Error) and msg.fatal:
            log.warning("the cloud ended the session: %s: %s", msg.code, msg.message)
            self.welcome, self.resume_token = None, None
            await self.link.close()
        return msg

    async def close(self) -> None:
        """Orderly end: Close, then let the server close the WebSocket (it frees the session at once)."""
        if self.link.open:
            try:
                await self._send(P.Close(reason="client closed"))
                await self.link.wait_closed(1.0)
            except (LinkDown, EdgeClientError):
                pass
        await self.link.close()
        self.welcome = None

    async def _reconnect(self, req: _Request, stats: RequestStats, cause: Exception) -> bool:
        """Reconnect with backoff; True if the cloud session (and the request) survived."""
        await self.connect(cause)
        stats.reconnects += 1
        return bool(getattr(self.welcome, "resumed", False))

    async def connect(self, cause: Exception | None = None) -> dict:
        """Connect (resuming the session after ``cause``, the link's drop), retrying with backoff while the
        retry policy's ``reconnect_window_s`` lasts - ``first_connect_window_s`` until the cloud first answered this
        client (:attr:`reached`) - (and ``max_retries`` allows), then EdgeClientError with the last attempt's
        refusal's code (``overloaded``, ``draining``; its ``retry_after_s``) when the server answered it, else
        ``unreachable``; returns the Welcome as a dict. Requests and :meth:`EdgeClient.connect` both come here."""
        retry = self.config.retry
        start = time.monotonic()
        if cause is not None and self.down_since is None:
            self.down_since = start
        # the window counts from the first failure since the cloud last answered, whichever request met it: the
        # requests queued behind one that retried through it (other threads) each retried a whole window of their
        # own, the 4th of 4 failing after 4 windows (6 minutes); each still tries once
        began = self.down_since if self.down_since is not None else start
        last, attempt = cause, 0
        while True:
            if last is not None:
                window = retry.reconnect_window_s if self.reached else min(retry.first_connect_window_s,
                                                                           retry.reconnect_window_s)
                left = began + window - time.monotonic()
                delay = retry.wait(attempt, left, getattr(last, "retry_after_s", None), random.random())
                if delay is None:
                    raise self._gave_up(last, attempt, time.monotonic() - began)
                attempt += 1
                log.info("%s (%s); retry %d in %.2f s (%.0f s left to reconnect)",
                         "link down" if cause is not None else "cannot connect", last, attempt, delay, left)
                await asyncio.sleep(delay)
                self.welcome = None
            # after a refusal for now (full, draining), or for a new request after a Drain, the proxy's hash would
            # pick the same replica again: without the route key it balances the upgrade onto another one (a dropped
            # link's reconnect keeps it: the draining replica still resumes the session's open request)
            route = not isinstance(last, ServerBusy) and not (cause is None and self.state.phase == DRAINING)
            # a new request resumes the session of a link that dropped while it was idle too (a new session left that
            # one on the server for its grace, with the KV of a request cancelled while the link was down:
            # _cancel_abandoned), not one a Drain ended (the draining server would take no request on it)
            resume = cause is not None or self.state.phase != DRAINING
            try:
                welcome = await self.ensure_connected(resume=resume, route=route)
            except LinkDown as e:
                last = e
                self.reached = self.reached or _refusal(e) is not None
                if self.down_since is None:
                    self.down_since = start
                continue
            self.down_since = None
            return welcome

    def _gave_up(self, last: Exception, attempts: int, spent: float) -> EdgeClientError:
        """The connect's failure after its retries: the server's refusal for now when it answered the last attempt
        so (busy: retry later, after ``retry_after_s``), ``unreachable`` when nothing answered."""
        tried = f"retried {attempts} times in {spent:.1f} s"
        if (code := _refusal(last)) is not None:
            return EdgeClientError(f"the cloud at {self.config.url} refused the session for now ({tried}): {last}",
                                   code, last.retry_after_s)
        return EdgeClientError(f"cannot reach the cloud at {self.config.url} ({tried}): {last}", "unreachable")

    # -- requests -------------------------------------------------------------------------------
    async def run(self, spec: RequestSpec, sink: Callable, stats: RequestStats,
                  redecide: Callable[[], None] | None = None) -> None:
        """Run one request, feeding ``sink`` with ("token", id, text) items, then ("end", reason) or
        ("error", exc). Cancellation (the caller cancels the task) ends it with reason "cancelled".
        ``redecide``: called when the connect updated the bundle to one of the other kind (a tail gained or lost),
        to choose the request's mode (``spec.ushape``) anew (the client's: it raises if none may serve it)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        try:
            async with self._lock:
                reason = await self._run(spec, sink, stats, redecide)
            sink(("end", reason))
        except asyncio.CancelledError:
            sink(("end", "cancelled"))
        except EdgeClientError as e:
            sink(("error", e))
        except Exception as e:
            log.exception("edge request failed")
            sink(("error", EdgeClientError(f"internal error: {type(e).__name__}: {e}", "internal")))

    def _plan_for(self, spec: RequestSpec) -> tuple[P.PrecisionPlan, str]:
        """The request's precision: the shared policy over what this session negotiated, with the request's
        override (or the config's codec) winning, and the codec of its decode steps. Both ends run the same policy
        (shared.precision)."""
        w = self.welcome
        features = RequestFeatures(prompt_tokens=len(spec.prompt_ids), server_load=self.server_load,
                                   images=spec.media.count("image") if spec.media is not None else 0,
                                   audio=spec.media.count("audio") if spec.media is not None else 0,
                                   link_kbps=self.config.link_kbps, hidden_size=self.runtime.hidden_size)
        try:
            override = self._override(spec)
            # the config's codec is every request's that names none - one pinning only its compute too (it was
            # dropped then, the prompt going up in the policy's lossy codec under EdgeConfig.codec="fp32")
            if self.config.codec is not None and (override is None or override.codec is None):
                override = PrecisionOverride(codec=self.config.codec,
                                             compute=override.compute if override is not None else None)
            plan = choose_precision(features, override, available_codecs=w.codecs,
                                    available_compute=w.server.compute_variants)
            return plan, step_codec(plan, override, available_codecs=w.codecs)
        except PrecisionError as e:
            raise EdgeClientError(f"precision: {e}", "codec_not_negotiated") from None

    def _override(self, spec: RequestSpec) -> PrecisionOverride | None:
        """The request's own precision override on this session (raises PrecisionError for a bad one): a bare name
        of both ("fp16") names the codec only where this server computes otherwise; an explicit {"codec": ...,
        "compute": ...} is held to both (its compute was dropped without a word)."""
        return PrecisionOverride.for_server(spec.precision, self.welcome.server.compute_variants)

    async def _run(self, spec: RequestSpec, sink: Callable, stats: RequestStats,
                   redecide: Callable[[], None] | None) -> str:
        t0 = time.perf_counter()
        up0, down0 = self.link.bytes_up, self.link.bytes_down
        compute0 = self.runtime.stats.seconds
        draft0 = self.head.seconds if self.head is not None else 0.0
        req: _Request | None = None
        try:
            if self.state.phase == DRAINING:  # this server takes no new request (module docstring, Drain)
                await self.link.close()
            self._private = spec.prefix_secret is not None
            await self.connect()
            await self._cancel_abandoned()
            if spec.ushape != (self.ushape is not None):  # the connect's update moved to a bundle of the other kind
                if redecide is None:
                    raise _moved_kind(spec.ushape, "")
                redecide()
            self.fit(spec)
            plan, steps = self._plan_for(spec)
            # u-shape steps travel in the request's codec, as its States do (docs/protocol.md, "U-shape"): the
            # stats named the split's step codec (fp16) for them
            req = _Request(spec, plan.codec, plan.compute, plan.codec if spec.ushape else steps)
            self.sizer.new_request()
            self.head_sizer.new_request()
            self.cloud_sizer.new_request()
            req.bundle_gen = self.bundle_gen
            stats.codec, stats.step_codec, stats.compute = plan.codec, req.step_codec, plan.compute
            stats.edge_variant = self.manifest.edge_variant
            stats.trace_id = req.trace_id
            log.info("trace=%s start: %d prompt tokens, codec %s", req.trace_id, len(spec.prompt_ids), plan.codec)
            decoder = StreamDecoder(self.tokenizer.decode) if self.tokenizer is not None else None
            stop = StopMatcher(spec.stop)
            await self._prefill(req, stats)
            stats.edge_prefill_s = self.runtime.stats.seconds - compute0
            if self._head_drafts(req):  # the drafter over the prompt, while the first token is on its way
                await self._sync_head(req)
                req.head_ready = asyncio.ensure_future(_compute(self.head.catch_up))
            last_t = None
            async for token in (self.ushape.tokens(req, stats) if spec.ushape else self._tokens(req, stats)):
                last_t = mark_token(stats, t0, last_t)
                stats.completion_tokens += 1
                text, stopped = stop.feed(decoder.push(token) if decoder is not None else "")
                if not stopped and decoder is not None and req.finish is not None \
                        and stats.completion_tokens == len(req.tokens):  # the last token: it carries what was held
                    text += stop.finish(decoder.flush())  # (iter_tokens' deltas join to the text, as plain ones do)
                sink(("token", token, text))
                if stopped:  # a stop string: the text ends before it, the cloud stops generating
                    await self._cancel(req)
                    break
            else:  # the request's own end
                if decoder is not None:  # bytes held back for an incomplete character, and text held for stops
                    tail = stop.finish(decoder.flush())
                    if tail:
                        sink(("token", -1, tail))
                if req.finish == "error":  # ended by the cloud without an Error saying why: a failure, not an answer
                    raise EdgeClientError(f"the cloud ended the request with an error after {len(req.tokens)} "
                                          "tokens", "internal")
            # later requests (the next agent step) draft from the tokens it answered - up to a stop string too (an
            # answer a stop string ended was never remembered)
            # (a u-shape answer, which the cloud never saw as tokens, only for drafts that stay on the phone)
            self.drafter.remember(req.tokens[:stats.completion_tokens], phone_only=spec.ushape)
            return "stop" if stop.stopped else req.finish or "stop"
        except (asyncio.CancelledError, Exception):  # a failure here too: the cloud would hold the request's KV
            if req is not None and req.opened:      # until its step timeout (a Cancel of one it ended is ignored)
                await asyncio.shield(self._cancel(req))
            raise
        finally:
            if req is not None and req.head_ready is not None:  # the next request must find the drafter idle
                await asyncio.wait({req.head_ready})
            stats.total_s = time.perf_counter() - t0
            stats.bytes_up = self.link.bytes_up - up0
            stats.bytes_down = self.link.bytes_down - down0
            stats.edge_compute_s = self.runtime.stats.seconds - compute0
            stats.edge_draft_s = (self.head.seconds - draft0) if self.head is not None else 0.0

    async def _cancel_abandoned(self) -> None:
        """Cancel the requests the resumed session still holds open for this client: ended here (closed, abandoned,
        a stop string) while the link was down, their Cancel never went out, and the cloud went on generating them
        into its KV. A new request holds the session's lock: no other request of this client runs."""
        for track in list(self.state.requests.values()):
            if not track.cancelled:
                await self._cancel(track)  # best effort: the request's own sends find a link down and recover

    async def _cancel(self, req: _Request | RequestTrack) -> None:
        """Cancel ``req`` (this client's request, or a track the session holds open); a link down drops it."""
        if self.link.open:
            try:
                await self._send(P.Cancel(request_id=req.rid if isinstance(req, _Request) else req.request_id))
            except (LinkDown, EdgeClientError):
                pass

    # -- prefill --------------------------------------------------------------------------------
    def _open_fields(self, req: _Request) -> dict:
        """What a request's first Prefill carries (and no other): sampling params, prefix keys, compute, the
        context's length."""
        spec = req.spec
        req.opened = True
        if spec.ushape:  # the phone samples: only the length goes up; no prefix keys (no cloud prefix reuse)
            return {"params": P.SamplingParams(max_tokens=spec.max_tokens), "compute": req.compute,
                    "return_states": True, "prompt_len": req.context_len}
        params = P.SamplingParams(max_tokens=spec.max_tokens - len(req.tokens), temperature=spec.temperature,
                                  top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed)
        return {"params": params, "prefix_keys": self._prefix_keys(req), "compute": req.compute,
                "prompt_len": req.context_len}

    def _prefix_keys(self, req: _Request) -> list[str]:
        """The keys of the prompt's first full blocks in the cloud's scope, as its first Prefill names them (the
        first 4096 at most), computed once per request and bundle; none for a cloud that keeps no prefix cache
        (``Welcome.server.prefix_cache`` false): nothing is skipped, learned or published, and no key goes up."""
        if self.welcome is not None and not self.welcome.server.prefix_cache:
            return []
        if req.prefix_keys is None:
            spec = req.spec
            scope = self._cloud_scope(req.codec, spec.prefix_secret)  # private levels: the cloud cannot recompute them
            content = spec.media.content(self.block_size) if spec.media is not None else None  # image/audio digests
            named = spec.prompt_ids[: MAX_PREFIX_KEYS * self.block_size]  # a Prefill names 4096 blocks at most
            req.prefix_keys = block_keys(named, scope, self.block_size, content)
        return req.prefix_keys

    def _learn_keys(self, compute: str, keys) -> None:
        """Note ``keys`` as held by the cloud for the ``compute`` variant (most recent last), forgetting its oldest
        past CLOUD_KEYS_KEPT."""
        held = self.cloud_keys.setdefault(compute, {})
        for key in keys:
            held.pop(key, None)
            held[key] = None
        for key in list(held)[: max(0, len(held) - CLOUD_KEYS_KEPT)]:
            del held[key]

    def _held_prefix(self, req: _Request, cached: int) -> int:
        """Positions of the prompt's first ``cached`` not to upload: the whole cloud blocks, from the first, whose
        keys :attr:`cloud_keys` holds for the request's compute variant (none for u-shape: the tail needs every
        position)."""
        if req.spec.ushape:
            return 0
        n, held = 0, self.cloud_keys.get(req.compute, {})
        for key in self._prefix_keys(req)[: cached // self.block_size]:
            if key not in held:
                break
            n += 1
        return n * self.block_size

    def _cloud_scope(self, codec: str, secret: bytes | None = None) -> KeyScope:
        """What this edge's prefix keys for the cloud's blocks are scoped to: the bundle, the front's weights and
        what the states went through: the wire codec and, from a float16 activation cache (its prefixes are sent
        from there, rounded), ``+cache-float16`` - a client whose states are not rounded is never served KV
        computed from rounded ones (docs/protocol.md, "Prefix keys")."""
        encoding = codec if self.cache.dtype.itemsize == 4 else f"{codec}+{self.cache.scope.encoding}"
        return KeyScope(self.manifest.bundle_id, self.manifest.states_variant, encoding, secret=secret)

    async def _send_span(self, req: _Request, start: int, hidden: np.ndarray, stats: RequestStats,
                         record: bool = True) -> None:
        """Code and send hidden states [n, H] of positions [start, start + n) as Prefill messages, cut to
        the session's limits by the shared chunking (tokens per Prefill, frame bytes)."""
        first = {} if req.opened else self._open_fields(req)
        msgs = prefill_messages(req.rid, np.ascontiguousarray(hidden), self.codecs[req.codec], self.limits,
                                start=start, last=start + hidden.shape[0] == req.context_len,
                                zstd=self.config.wire_zstd, rope_positions=self._rope(req, start, hidden.shape[0]),
                                **first)
        if record:  # all of them before the first goes out: a link dropped mid-span resends the rest from here
            req.sent.extend(_Sent(m.start, m.n_tokens, m.hidden, m.rope_positions) for m in msgs)
        for m in msgs:
            stats.prefill_bytes_up += await self._send(m)

    def _prefill_msg(self, req: _Request, span: _Sent):
        """A Prefill resending ``span`` (as coded the first time); the first one of a request id carries the
        request's fields, and the one that completes the context is ``last`` (the cloud samples after it)."""
        first = {} if req.opened else self._open_fields(req)
        last = span.start + span.n == req.context_len
        return P.Prefill(request_id=req.rid, start=span.start, hidden=span.tensor, last=last, rope_positions=span.rope,
                         **first)

    def cached_prefix(self, media) -> int:
        """Positions of a media prompt (``edge_client.media.MediaPrompt``) that the activation cache covers now
        (:meth:`_prefill`'s lookup, without loading or touching a block): the encoder rows there are not needed."""
        if self.cache is None:
            return 0
        n = len(media.ids) - 1  # the lookup leaves the last position to the front (it yields the first token)
        return self.cache.contains(media.ids[:n], media.content(self.cache.block_tokens, n))

    def _rope(self, req: _Request, start: int, n: int) -> np.ndarray | None:
        """3-D rope positions int32 [3, n] of positions [start, start + n) when the prompt has images (the
        cloud's default, index on all axes, is wrong after an image); None otherwise."""
        media = req.spec.media
        if media is None or not self.runtime.mrope or not media.has_images:
            return None
        return media.rope_positions(start, n).astype(np.int32)

    async def _prefill(self, req: _Request, stats: RequestStats) -> None:
        spec, rt = req.spec, self.runtime
        ids = spec.prompt_ids
        # 1. the activation cache: skip the front for [0, h)
        rt.reset()
        media = spec.media
        content = media.content(self.cache.block_tokens) if media is not None and self.cache is not None else None
        hit = self.cache.lookup(ids, content=content) if self.cache is not None else None
        h = hit.tokens if hit is not None else 0
        if hit is not None:
            rt.extend_kv(hit.kv_blocks)
        stats.cached_tokens = h
        if media is not None:  # items cached_prefix() left out whose blocks were evicted since: encoded now
            stats.media_encode_s += await _compute(media.encode, h)
        # 2. the cloud has [0, c) under the same keys (as far as the session knows): those positions are not uploaded,
        # also past h (an app restarted with a memory cache: the front runs over them for its KV, nothing goes up)
        c = self._held_prefix(req, len(ids) - 1)  # (the last position goes up: the cloud samples after it)
        req.prefix_raw = hit.hidden[:c] if hit is not None and c <= h else None  # [c, H]; c > h: once computed
        stats.uploaded_prompt_tokens = len(ids) - c
        parts: list[np.ndarray] = [hit.hidden] if hit is not None else []
        if h > c:
            await self._guarded(req, stats, self._send_span(req, c, hit.hidden[c:h], stats))
            if req.bundle_gen != self.bundle_gen:  # the cloud moved to another bundle: _rebuild sent it all
                return
        # 3. front layers over [h, L), each chunk sent as soon as it is computed
        if media is None:
            chunks = rt.prefill_chunks(ids[h:])
        else:  # encoder rows at their placeholders, 3-D rope positions (edge_client.media)
            chunks = rt.prefill_media_chunks(ids[h:], media.positions[:, h:] if rt.mrope else None,
                                             media.embeds[h:], media.mask[h:])
        while True:
            item = await _compute(next, chunks, None)
            if item is None:
                break
            start, hidden = item  # hidden: [n, H]
            parts.append(hidden)
            end = start + hidden.shape[0]
            if end <= c:  # the cloud holds these positions
                continue
            if req.prefix_raw is None:  # the first chunk past c: the states of [0, c) are complete (for a replay)
                req.prefix_raw = np.concatenate(parts, axis=0)[:c]
            if start < c:
                start, hidden = c, hidden[c - start:]
            await self._guarded(req, stats, self._send_span(req, start, hidden, stats))
            if req.bundle_gen != self.bundle_gen:  # the cloud moved to another bundle: _rebuild sent it all
                return
        # 4. remember the prompt's full blocks for next time (front KV + boundary hidden states)
        all_hidden = np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]  # [L, H]
        self._note(req, 0, list(ids), all_hidden)
        if self.config.cache_prompts and self.cache is not None:
            start_block = h // self.cache.block_tokens
            await _compute(self.cache.insert, ids, rt.kv_slice, all_hidden, start_block, content)
        if media is not None:
            rt.rope_delta = media.rope_delta  # decode steps sit at index + delta

    async def _guarded(self, req: _Request, stats: RequestStats, coro) -> None:
        """Await a send; on a dropped link, recover (the recovery resends what the cloud lacks)."""
        try:
            await coro
        except LinkDown as e:
            await self._recover(req, stats, e)

    def _check_offered(self, req: _Request, stats: RequestStats) -> None:
        """A request carried to a new session (a replay after a restart or onto another replica, a bundle update)
        keeps its plan: its codecs (its spans went up coded in them) and a compute variant it pinned must be offered
        there, or it fails ``codec_not_negotiated`` - the server served a compute it lacks by another variant
        without a word (a pinned ``int8`` answered in fp32 from the replay on, the stats still saying int8). A
        compute the policy chose is chosen again from the new session's variants, as a new request's would be."""
        w = self.welcome
        lacking = [f"codec {c!r}" for c in dict.fromkeys((req.codec, req.step_codec))
                   if c not in w.codecs or c not in self.codecs]
        if req.compute is not None and req.compute not in w.server.compute_variants:
            override = self._override(req.spec)  # parsed when the request started: it cannot raise here
            if override is not None and override.compute is not None:
                lacking.append(f"compute {req.compute!r}")
            elif not lacking:
                req.compute = stats.compute = self._plan_for(req.spec)[0].compute
        if lacking:
            raise EdgeClientError(f"precision: the cloud session that took the request over does not offer its "
                                  f"{' and '.join(lacking)} (codecs: {', '.join(w.codecs)}; compute: "
                                  f"{', '.join(w.server.compute_variants)}); send it again", "codec_not_negotiated")

    async def _resend_all(self, req: _Request, stats: RequestStats) -> None:
        """Open a fresh request with everything recorded: the cached prefix (coded now) and every span."""
        self._check_offered(req, stats)
        req.rid = f"{req.trace_id}.r{uuid.uuid4().hex[:6]}"
        log.info("trace=%s replayed as request %s", req.trace_id, req.rid)
        self._abandon_spec(req)
        req.opened = False
        req.index_base = len(req.tokens)  # the new request's token 0 is the next one we lack
        stats.uploaded_prompt_tokens = req.prompt_len  # the whole prompt goes up again (a replay kept the first count)
        if req.prefix_raw is not None and len(req.prefix_raw):
            await self._send_span(req, 0, req.prefix_raw, stats, record=False)
        for span in req.sent:
            stats.prefill_bytes_up += await self._send(self._prefill_msg(req, span))

    # -- tokens ---------------------------------------------------------------------------------
    async def _next_message(self, req: _Request, stats: RequestStats):
        """The next message for ``req`` (messages held during a recovery first), or None after recovering from a
        dropped link or for a late Error about a request id it abandoned."""
        if req.pending:
            return req.pending.pop(0)
        try:
            msg = await self._recv(self.config.retry.reply_timeout_s)
        except LinkDown as e:
            await self._recover(req, stats, e)
            return None
        except GarbageFromServer as e:
            raise EdgeClientError(str(e), "bad_server") from None
        if isinstance(msg, P.Error) and getattr(msg, "request_id", None) not in (None, req.rid):
            return None
        if isinstance(msg, P.Error) and msg.code == "draining":  # its Drain was unread when the request went up
            await self.link.close()
            await self._recover(req, stats, ServerBusy(f"server draining: {msg.message}", retry_after_s(msg),
                                                       "draining"))
            return None
        if isinstance(msg, P.Error) and msg.code == "overloaded":  # dropped for load (the cloud's KV pool ran out)
            await self._replay_after_overload(req, stats, msg)
            return None
        return msg

    async def _replay_after_overload(self, req: _Request, stats: RequestStats, error: P.Error) -> None:
        """The cloud dropped ``req`` for load: wait (its backoff, never less than the ``retry_after_ms`` asked),
        then replay it on this session, the tokens received kept. A request that gets no further token for the
        reconnect window (or ``max_retries``) fails ``overloaded``."""
        retry, now = self.config.retry, time.monotonic()
        since, attempt, have = req.overload if req.overload is not None and req.overload[2] == len(req.tokens) \
            else (now, 0, len(req.tokens))
        delay = retry.wait(attempt, since + retry.reconnect_window_s - now, retry_after_s(error), random.random())
        if delay is None:
            raise EdgeClientError(f"cloud error overloaded: {error.message} (replayed {attempt} times in "
                                  f"{now - since:.1f} s)", "overloaded", retry_after_s(error))
        req.overload = (since, attempt + 1, have)
        log.info("trace=%s overloaded (%s); replay %d in %.2f s", req.trace_id, error.message, attempt + 1, delay)
        await asyncio.sleep(delay)
        stats.replays += 1
        await self._guarded(req, stats, self._resend_all(req, stats))

    async def _tokens(self, req: _Request, stats: RequestStats):
        """Yield new tokens in order; drives decode steps, prefix misses and recovery."""
        while req.finish is None:
            msg = await self._next_message(req, stats)
            if msg is None:
                continue
            if isinstance(msg, P.Error):
                if msg.code == "prefix_miss":  # the cloud lost a block it held: none skipped until republished
                    stats.prefix_misses += 1
                    for key in self._prefix_keys(req):
                        self.cloud_keys.get(req.compute, {}).pop(key, None)
                    await self._guarded(req, stats, self._resend_all(req, stats))
                    continue
                raise EdgeClientError(f"cloud error {msg.code}: {msg.message}", msg.code)
            if not isinstance(msg, (P.Tokens, P.Resumed)) or msg.request_id != req.rid:
                continue  # nothing for this request
            if isinstance(msg, P.Tokens) and msg.usage is not None:
                stats.cloud_cached_tokens = msg.usage.cached_tokens
            if isinstance(msg, P.Tokens) and msg.index == 0:  # its prompt is computed: the cloud published the
                self._learn_keys(req.compute, self._prefix_keys(req))  # blocks its keys name, in its variant's pool
            new = self._accept(req, msg.index, msg.token_ids, msg.finish_reason)
            held_s = 0.0  # the server held these tokens while it drafted the next ones (not this step's cost)
            if new and isinstance(msg, P.Tokens):  # a proposal follows the message's last token, or none
                req.cloud_drafts = list(msg.draft_ids or []) if msg.index + len(msg.token_ids) + req.index_base \
                    == len(req.tokens) else []
                held_s = msg.timings.draft_ms / 1000 if msg.timings is not None else 0.0
                self.cloud_sizer.price_server_rows(held_s, len(req.cloud_drafts))
            if req.spec_step is not None and (new or req.finish is not None):
                self._settle_spec(req, new, stats, held_s)
            elif new and req.plain_started is not None:  # a plain step answered: the sizers' base cost
                for sizer in (self.sizer, self.head_sizer, self.cloud_sizer):
                    sizer.observe(0, 0, time.perf_counter() - req.plain_started - held_s)
                req.plain_started = None
            for t in new:
                yield t
            if new and req.finish is None:
                await self._guarded(req, stats, self._decode_and_send(req, new, stats))

    def _accept(self, req: _Request, index: int, token_ids: list[int], finish: str | None) -> list[int]:
        """Append the tokens we do not have yet (indices are the cloud's, offset by ``index_base``)."""
        new = []
        for i, t in enumerate(token_ids):
            if req.index_base + index + i == len(req.tokens):
                req.tokens.append(int(t))
                new.append(int(t))
        if finish and req.index_base + index + len(token_ids) >= len(req.tokens):
            req.finish = finish
        return new

    async def _decode_and_send(self, req: _Request, new: list[int], stats: RequestStats | None = None) -> None:
        """Front decode of each new token the front lacks (accepted drafts are in it already); a DecodeStep
        for the last one, or a SpecStep with drafts when the request speculates."""
        codec = self.codecs[req.step_codec]
        todo = [t for j, t in enumerate(req.tokens) if req.prompt_len + j >= self.runtime.length]
        if stats is not None and self._drafts_wanted(req):
            lookup = self._drafts(req)
            cloud = req.cloud_drafts[:max(0, self._room(req))]
            req.cloud_drafts = []
            if lookup or cloud:
                # the proposal with more expected tokens per second goes up; the cloud's are drafted already, so
                # only their rows cost anything now
                use_cloud = bool(cloud) and (not lookup or self.cloud_sizer.rate(len(cloud), server_paid=True)
                                             > self.sizer.rate(len(lookup)))
                drafts, shadow = (cloud, lookup) if use_cloud else (lookup, cloud)
                await self._send_spec(req, todo, drafts, stats, from_cloud=use_cloud, shadow=shadow)
                return
            k = self._head_k(req)
            if k:
                await self._send_head_spec(req, todo, k, stats)
                return
        req.plain_started = time.perf_counter()
        for t in todo:
            hidden = await _compute(self.runtime.decode, t)  # [1, H]
            pos = self.runtime.length - 1
            self._note(req, pos, [t], hidden)
            rope = self._rope(req, pos, 1)
            req.sent.append(_Sent(pos, 1, codec.encode(hidden, zstd=self.config.wire_zstd),
                                  None if rope is None else WireArray.from_numpy(rope)))
        if stats is not None:
            stats.decode_round_trips += 1
        await self._send_decode(req, req.sent[-1])

    # -- speculation ----------------------------------------------------------------------------
    def _drafts_wanted(self, req: _Request) -> bool:
        w = self.welcome
        return req.speculate and req.spec_step is None and w is not None and w.server.max_draft_tokens > 0

    def _drafts(self, req: _Request) -> list[int]:
        """Drafts to follow the context (k from the sizer, capped by what the request and the server allow:
        the step emits at most k + 1 tokens and needs k + 1 positions)."""
        k = self.sizer.choose(self._room(req))
        if k <= 0:
            return []
        # the private levels: only tokens the cloud produced itself may go up as drafts; u-shape's stay on the phone
        context = req.tokens if req.spec.drafts_from_outputs_only else [*req.spec.prompt_ids, *req.tokens]
        return self.drafter.propose(context, k, phone_only=req.spec.ushape)

    def _ask(self, req: _Request) -> int:
        """Cloud drafts to ask for with the next token (0: none; the cloud's sizer picks k, capped by what the
        server offers and the request allows), on decode steps only: drafts delay their token by k engine
        steps, and the first token's latency (TTFT) is kept as it is. They are the cloud's own tokens, so every
        privacy level allows them; a u-shape cloud never sees a token and offers none."""
        w = self.welcome
        if not (self.config.cloud_drafts and req.speculate and not req.spec.ushape and w is not None
                and w.server.cloud_drafts > 0 and w.server.max_draft_tokens > 0):
            return 0
        return self.cloud_sizer.choose(min(self._room(req) - 1, w.server.cloud_drafts))

    def _room(self, req: _Request) -> int:
        """Drafts the request and the server allow: the step emits at most k + 1 tokens, needs k + 1 positions."""
        return min(req.spec.max_tokens - len(req.tokens) - 1, self.welcome.server.max_draft_tokens,
                   self.max_context - req.context_len - 1)

    def _head_k(self, req: _Request) -> int:
        """Drafts the bundle's drafter should propose this step (0: none, or no drafter). It drafts from boundary
        states the cloud receives anyway, so the private levels allow it."""
        return self.head_sizer.choose(self._room(req)) if self._head_drafts(req) else 0

    def _head_drafts(self, req: _Request) -> bool:
        """The bundle's drafter works for this request (the u-shape loop drafts by lookup only)."""
        return self.head is not None and req.speculate and not req.spec.ushape

    def _note(self, req: _Request, start: int, ids: list[int], rows: np.ndarray) -> None:
        """The front's context from ``start`` on is ``ids`` with boundary ``rows`` [n, H]: for the drafter, at
        once, or by :meth:`_sync_head` while its catch-up runs."""
        if not self._head_drafts(req):
            return
        if req.head_ready is None and not req.head_notes:
            self.head.note(start, ids, rows)
        else:
            req.head_notes.append((start, ids, rows))

    async def _sync_head(self, req: _Request) -> None:
        """Wait for the drafter's catch-up, then hand it the notes taken meanwhile."""
        if req.head_ready is not None:
            ready, req.head_ready = req.head_ready, None
            await ready
        for note in req.head_notes:
            self.head.note(*note)
        req.head_notes = []

    async def _front_before_last(self, req: _Request, todo: list[int]) -> None:
        """Front decode of the tokens before the last one the front lacks (never after a verdict; after a
        resume or replay), recorded as sent."""
        codec = self.codecs[req.step_codec]
        for t in todo[:-1]:
            hidden = await _compute(self.runtime.decode, t)
            self._note(req, self.runtime.length - 1, [t], hidden)
            req.sent.append(_Sent(self.runtime.length - 1, 1, codec.encode(hidden, zstd=self.config.wire_zstd)))

    async def _send_spec(self, req: _Request, todo: list[int], drafts: list[int], stats: RequestStats,
                         from_cloud: bool = False, shadow: list[int] | None = None) -> None:
        """Run the tokens the front lacks (the last emitted one) and the drafts as one chunk; one SpecStep up."""
        await self._front_before_last(req, todo)
        pos, t0 = self.runtime.length, time.perf_counter()
        hidden = await _compute(self.runtime.step, [todo[-1], *drafts])  # [k + 1, H]: a decode-phase call
        await self._spec_up(req, _Spec(pos, list(drafts), hidden, None, t0, from_cloud=from_cloud,
                                       shadow=list(shadow or [])), stats)

    async def _send_head_spec(self, req: _Request, todo: list[int], k: int, stats: RequestStats) -> None:
        """Self-speculative drafts: the front runs the last emitted token, the drafter proposes d1 from its
        boundary state, the front runs d1, the drafter proposes d2, ... The k + 1 states are the SpecStep's rows."""
        await self._front_before_last(req, todo)
        pos, t0 = self.runtime.length, time.perf_counter()
        rows = [await _compute(self.runtime.decode, todo[-1])]  # each [1, H]
        await self._sync_head(req)
        drafts: list[int] = []
        for j in range(k):
            self.head.note(pos + j, [drafts[-1] if j else todo[-1]], rows[-1])
            drafts.append(await _compute(self.head.propose))
            rows.append(await _compute(self.runtime.decode, drafts[-1]))
        spec = _Spec(pos, drafts, np.concatenate(rows, axis=0), None, t0, from_head=True)  # hidden [k + 1, H]
        await self._spec_up(req, spec, stats)

    async def _spec_up(self, req: _Request, spec: _Spec, stats: RequestStats) -> None:
        """Send ``spec``'s rows and drafts as one SpecStep and keep it as the step in flight."""
        # prompt-lookup drafts run in streaks (a copied span): while lookup is accepted more often than the
        # cloud's drafts, the next step likely drafts by lookup again and does not pay for the cloud's
        lookup = not (spec.from_head or spec.from_cloud)
        ask = 0 if lookup and self.sizer.alpha >= self.cloud_sizer.alpha else self._ask(req)
        spec.msg = P.SpecStep(request_id=req.rid, position=spec.position, draft_ids=list(spec.drafts),
                              hidden=self.codecs[req.step_codec].encode(spec.hidden, zstd=self.config.wire_zstd),
                              ask_drafts=ask)
        req.spec_step = spec
        stats.draft_tokens += len(spec.drafts)
        if spec.from_head:
            stats.head_draft_tokens += len(spec.drafts)
        if spec.from_cloud:
            stats.cloud_draft_tokens += len(spec.drafts)
        await self._send(spec.msg)

    def _settle_spec(self, req: _Request, new: list[int], stats: RequestStats, held_s: float = 0.0) -> None:
        """The verdict on the SpecStep in flight: ``new`` = the accepted drafts and the cloud's next token
        (fewer if the request stopped). Keep the fed token's and the accepted drafts' front KV, record their
        coded rows for a replay, and feed the sizer."""
        spec, req.spec_step = req.spec_step, None
        if not new:  # finished without a verdict (cancelled): nothing to keep
            return
        accepted = len(new) - 1 if new[-1] != (spec.drafts + [None])[len(new) - 1] else len(new)
        if new[:accepted] != spec.drafts[:accepted]:
            raise EdgeClientError(f"the cloud's verdict {new} does not extend the drafts {spec.drafts}", "bad_server")
        keep = min(len(new), len(spec.drafts) + 1)  # rows kept: the fed token and the accepted drafts
        self.runtime.truncate(spec.position + keep)
        self._note(req, spec.position, req.context_ids(spec.position, keep), spec.hidden[:keep])
        codec = self.codecs[req.step_codec]
        req.sent.append(_Sent(spec.position, keep, codec.encode(np.ascontiguousarray(spec.hidden[:keep]),
                                                                zstd=self.config.wire_zstd)))
        stats.decode_round_trips += 1
        stats.accepted_draft_tokens += min(accepted, len(spec.drafts))
        if spec.from_head:
            stats.accepted_head_draft_tokens += min(accepted, len(spec.drafts))
        if spec.from_cloud:
            stats.accepted_cloud_draft_tokens += min(accepted, len(spec.drafts))
        sizer = self.head_sizer if spec.from_head else self.cloud_sizer if spec.from_cloud else self.sizer
        sizer.observe(len(spec.drafts), min(accepted, len(spec.drafts)), time.perf_counter() - spec.started - held_s)
        if spec.shadow:
            (self.sizer if spec.from_cloud else self.cloud_sizer).observe_shadow(spec.shadow, new)

    def _abandon_spec(self, req: _Request) -> None:
        """A replay while a SpecStep is unanswered: keep only its fed token (the replay's last position)."""
        spec, req.spec_step = req.spec_step, None
        if spec is None:
            return
        self.runtime.truncate(spec.position + 1)
        self._note(req, spec.position, req.context_ids(spec.position, 1), spec.hidden[:1])
        req.sent.append(_Sent(spec.position, 1, self.codecs[req.step_codec].encode(
            np.ascontiguousarray(spec.hidden[:1]), zstd=self.config.wire_zstd)))

    async def _send_decode(self, req: _Request, span: _Sent) -> None:
        await self._send(P.DecodeStep(request_id=req.rid, position=span.start, hidden=span.tensor,
                                      rope_positions=span.rope, ask_drafts=self._ask(req)))

    async def _recover(self, req: _Request, stats: RequestStats, cause: Exception) -> None:
        """After a drop: resume the cloud's request if it survived, else replay the context (docstring)."""
        if req.spec.ushape:
            await self._keep_delivered_states(req)
        while True:
            resumed = await self._reconnect(req, stats, cause)
            try:
                if req.bundle_gen != self.bundle_gen:  # reconnected with another bundle (an update)
                    await self._rebuild(req, stats)
                    return
                if resumed and req.opened and await self._resume(req, stats):
                    return
                if self.state.phase == DRAINING:  # resumed on a draining server, which takes no replay: elsewhere
                    self.resume_token = None
                    await self.link.close()
                    raise ServerBusy("the draining server cannot resume the request", code="draining")
                if req.rid in self.state.requests:  # the cloud holds part of a span: drop its copy, replay ours
                    await self._send(P.Cancel(request_id=req.rid))
                stats.replays += 1
                await self._resend_all(req, stats)
                return
            except LinkDown as e:  # dropped again while recovering: start over
                cause = e

    async def _rebuild(self, req: _Request, stats: RequestStats) -> None:
        """The bundle changed under an open request: the new front computes the whole context so far (prompt +
        tokens received) and a fresh request id carries it to the cloud; token indices continue (as a replay).
        A link drop midway makes the next recovery start this over."""
        if req.spec.media is not None:
            raise EdgeClientError("the cloud changed bundles during a request with images or audio; send it "
                                  "again", "bundle_changed")
        if req.spec.ushape != (self.ushape is not None):  # its answer so far came from the other mode's loop
            raise _moved_kind(req.spec.ushape, " during the request")
        self._check_offered(req, stats)
        req.rid = f"{req.trace_id}.b{uuid.uuid4().hex[:6]}"
        log.info("trace=%s rebuilt on bundle %s as request %s", req.trace_id, self.manifest.bundle_id, req.rid)
        req.spec_step, req.opened, req.sent, req.prefix_raw, req.pending = None, False, [], None, []
        req.prefix_keys = None  # the new bundle's scope names the blocks anew
        req.index_base = len(req.tokens)
        req.head_notes, req.head_ready = [], None  # a new bundle, a new drafter (use_bundle): it starts empty
        stats.replays += 1
        stats.uploaded_prompt_tokens = req.prompt_len  # (as _resend_all's)
        self.runtime.reset()
        chunks = self.runtime.prefill_chunks([*req.spec.prompt_ids, *req.tokens])
        while (item := await _compute(next, chunks, None)) is not None:
            start, hidden = item  # hidden: [n, H]
            self._note(req, start, req.context_ids(start, hidden.shape[0]), hidden)
            await self._send_span(req, start, hidden, stats)
        req.bundle_gen = self.bundle_gen

    async def _keep_delivered_states(self, req: _Request) -> None:
        """u-shape, the link just dropped: the States it delivered that nobody read yet (they come while the
        prompt goes up) are kept for the tail (``req.pending``), so a Resume need not have them computed again."""
        while self.link.ws is not None:
            try:
                msg = await self._recv(1.0)  # a closed connection hands over what it buffered, then raises
            except (LinkDown, GarbageFromServer):
                return
            if isinstance(msg, P.States) and msg.request_id == req.rid:
                req.pending.append(msg)

    async def _resume(self, req: _Request, stats: RequestStats) -> bool:
        """Ask the surviving session where the request stands; resend what it lacks. False: replay instead (True
        too after a refusal that asks for a wait, ``retry_after_ms``: the request is replayed once it is over).
        u-shape: ``have`` counts the positions whose States the edge holds (``UShape.resume_point``); the cloud
        rolls back to it and the inputs from there go up again (the States sent meanwhile are of positions it
        recomputes: dropped)."""
        ushape = req.spec.ushape
        track = self.state.requests.get(req.rid)
        if ushape:
            if track is None:
                return False  # it ended on the cloud (an error came with the last frames)
            have = self.ushape.resume_point(req, track.answered)
            if have == 0:
                return False  # nothing held: a replay costs the same
        else:
            have = len(req.tokens) - req.index_base
        # this request id's prompt: its inputs up to there go up as Prefills, the later ones as steps (after a
        # replay, the context when it was replayed; None: its last prompt chunk was never sent)
        prompt_end = req.prompt_len if track is None else track.prompt_len
        prompt_end = req.context_len + 1 if prompt_end is None else prompt_end
        await self._send(P.Resume(request_id=req.rid, have_tokens=have))
        while True:
            msg = await self._recv(self.config.retry.reply_timeout_s)
            if isinstance(msg, P.Error) and msg.fatal:
                raise EdgeClientError(f"cloud error {msg.code}: {msg.message}", msg.code)
            if isinstance(msg, P.Error) and getattr(msg, "request_id", None) in (None, req.rid):
                if msg.retry_after_ms is not None:  # dropped for load while we were away: replay after the wait
                    await self._replay_after_overload(req, stats, msg)
                    return True
                return False  # unknown request (finished, timed out or aborted while we were away)
            if isinstance(msg, P.Resumed) and msg.request_id == req.rid:
                break
            if isinstance(msg, P.Tokens) and msg.request_id == req.rid and not ushape:
                req.pending.append(msg)  # sent just before the Resumed: still ours, in order
        received = msg.received
        req.plain_started = None  # the outage is no step cost
        if ushape and received > have:
            return False  # the cloud claims positions whose States the edge lacks: replay
        if any(s.start < received < s.start + s.n for s in req.sent):
            return False  # the cloud holds part of a span: cannot resend it exactly, replay instead
        steps = [s for s in req.sent if s.start >= max(received, prompt_end)]
        if not ushape and any(s.n > 1 for s in steps):
            return False  # it lacks a verified speculative span: no message resends one, replay instead
        spec = req.spec_step
        if ushape and len(steps) + (spec is not None and spec.position >= received) > (received >= prompt_end):
            return False  # StatesSteps to resend: one stands at a time, after the prompt; replay instead
        stats.resumes += 1
        for span in req.sent:
            if span.start >= received:
                if span.start >= prompt_end:
                    await (self._send_states_step(req, span) if ushape else self._send_decode(req, span))
                else:
                    stats.prefill_bytes_up += await self._send(self._prefill_msg(req, span))
        if spec is not None and spec.position >= received:  # the SpecStep in flight never arrived: resend it
            await self._send(spec.msg)
        if not ushape:
            req.pending.append(msg)  # its tokens (a verdict on the SpecStep, if the cloud had it) come next
        return True

    async def _send_states_step(self, req: _Request, span: _Sent) -> None:
        """u-shape: a recorded step's rows (a plain step, or the kept rows of a verified one) resent as sent."""
        await self._send(P.StatesStep(request_id=req.rid, position=span.start, hidden=span.tensor,
                                      rope_positions=span.rope))

    # -- preload ----------------------------------------------------------------------------------
    async def preload(self, ids: list[int]) -> int:
        """Run the front over ``ids`` and cache its full blocks (no network); returns tokens cached. The first
        preloaded prompt of at least a block also names the link's routing key (``transport.route_key``: its
        first prefix key, in the edge's block size and first codec, scoped by the API key's tenant). A prompt longer
        than the edge graph's positions is a ValueError before anything runs (no request could start with it)."""
        if len(ids) > self.runtime.max_positions:
            raise ValueError(f"a prompt of {len(ids)} tokens exceeds the edge graph's {self.runtime.max_positions} "
                             f"positions: no request could use it")
        if self.link.route_key is None:
            scope = self._cloud_scope(next(iter(self.codecs)))
            self.link.route_key = route_key(ids, scope, self.config.cache_block_tokens, self.config.api_key)
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            rt = self.runtime
            rt.reset()
            have = self.cache.contains(ids)
            if have >= (len(ids) // self.cache.block_tokens) * self.cache.block_tokens:
                return have
            hidden = await _compute(rt.prefill, ids)
            await _compute(self.cache.insert, ids, rt.kv_slice, hidden)
            return self.cache.contains(ids)
