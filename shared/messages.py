"""The message set of the edge-cloud split protocol: one dataclass per message, validated on construction.

Every message travels as one binary WebSocket frame holding one msgpack array ``[type, field, field, ...]``:
``type`` is the one-byte code in :data:`MESSAGE_TYPES`, the fields follow in the order declared below, and
nested structs (``SamplingParams``, ``EncodedTensor``, ...) are arrays of their fields in order. Encoding and
decoding live in :mod:`shared.wire`; this module says what each message means and which values are legal.
A decoded message has passed ``__post_init__``, so a handler never sees an out-of-range field.

Direction: C->S client (edge) to server (cloud), S->C the reverse. Durations travel (``*_ms``); timestamps
never do: the two clocks are not comparable.

References: docs/protocol.md (the normative description, session state machine, versioning rules);
vLLM v1 ``EngineCoreRequest`` (compact positional structs, one-byte request kinds); Petals (the client keeps
what it sent so that a replacement server can rebuild the KV cache: ``Resume``/``Resumed``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import ClassVar

from .errors import BAD_TYPE, BAD_VALUE, ProtocolError
from .plan import COMPUTE_VARIANTS, PrecisionPlan
from .tensors import EncodedTensor, WireArray

PROTOCOL_VERSION = 1  # major version; bumped only for incompatible changes (docs/protocol.md, "Versioning")

FINISH_REASONS = ("stop", "length", "cancelled", "error")
# while a request owes the client output (a long prefill, a queue) the server sends a progress Tokens - no token,
# ``index`` = tokens sent so far - at least this often, so a client's reply timeout above it never mistakes
# compute for a dead link (docs/protocol.md, "Progress")
PROGRESS_INTERVAL_S = 15.0
MAX_POSITION = (1 << 31) - 1
MAX_TOKEN_ID = (1 << 31) - 1
MAX_DRAFT_TOKENS = 32  # drafts per SpecStep the protocol allows at all (a server announces its own cap)
MAX_PREFIX_KEYS = 4096  # keys a Prefill names (its prompt's first blocks) and Welcome.cached_prefixes lists, at most
_IDENT = re.compile(r"[A-Za-z0-9._:\-]+")  # ids and tokens: no spaces or control characters (log-safe)


# -- field checks (all raise ProtocolError, so a bad decoded value and a bad constructor call look alike) --

def _ident(v: str, what: str, max_len: int = 64) -> None:
    if not isinstance(v, str) or not 1 <= len(v) <= max_len or not _IDENT.fullmatch(v):
        raise ProtocolError(BAD_VALUE, f"{what}: expected 1..{max_len} characters of [A-Za-z0-9._:-], got {v!r:.80}")


def _int(v: int, what: str, lo: int = 0, hi: int = MAX_POSITION) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(BAD_TYPE, f"{what}: expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ProtocolError(BAD_VALUE, f"{what}: {v} not in [{lo}, {hi}]")


def _float(v: float, what: str, lo: float, hi: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProtocolError(BAD_TYPE, f"{what}: expected a number, got {type(v).__name__}")
    if not math.isfinite(v) or not lo <= v <= hi:
        raise ProtocolError(BAD_VALUE, f"{what}: {v} not in [{lo}, {hi}]")


def _text(v: str, what: str, max_len: int) -> None:
    if not isinstance(v, str):
        raise ProtocolError(BAD_TYPE, f"{what}: expected a string, got {type(v).__name__}")
    if len(v) > max_len:
        raise ProtocolError(BAD_VALUE, f"{what}: {len(v)} characters (at most {max_len})")


def _list(v: list, what: str, max_len: int) -> None:
    if not isinstance(v, list):
        raise ProtocolError(BAD_TYPE, f"{what}: expected a list, got {type(v).__name__}")
    if len(v) > max_len:
        raise ProtocolError(BAD_VALUE, f"{what}: {len(v)} entries (at most {max_len})")


# -- nested structs ----------------------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class ClientHints:
    """What the client knows about itself; the server's precision policy reads these (all optional)."""

    link_kbps: float | None = None  # measured or configured uplink bandwidth, kbit/s
    rtt_ms: float | None = None  # measured round-trip time
    device_class: str = "unknown"  # e.g. phone-low | phone-mid | phone-high | desktop | sim
    edge_quant: str | None = None  # the edge graph's weights: fp32 | int8 | int4
    threads: int | None = None  # CPU threads the edge runtime uses
    client: str = ""  # client name/version, for logs

    def __post_init__(self):
        if self.link_kbps is not None:
            _float(self.link_kbps, "hints.link_kbps", 0.0, 1e9)
        if self.rtt_ms is not None:
            _float(self.rtt_ms, "hints.rtt_ms", 0.0, 1e7)
        _ident(self.device_class, "hints.device_class", 32)
        if self.edge_quant is not None:
            _ident(self.edge_quant, "hints.edge_quant", 16)
        if self.threads is not None:
            _int(self.threads, "hints.threads", 1, 4096)
        _text(self.client, "hints.client", 128)


@dataclass(slots=True, kw_only=True)
class SessionLimits:
    """What the server accepts on this session (sent in Welcome; the client must stay within it).

    The defaults are what the reference server (``cloud_server``) sends with its default configuration
    (``cloud_server.split_endpoint.session_limits``; a test holds the two and docs/protocol.md together)."""

    max_frame_bytes: int = 16 << 20  # largest binary frame either side may send
    max_context: int = 8192  # prompt + generated tokens per request
    max_prefill_chunk_tokens: int = 2048  # tokens per Prefill message
    max_concurrent_requests: int = 16  # requests open at once on this session
    prefix_block_tokens: int = 16  # granularity of prefix_keys (one key per full block of the prompt)
    idle_timeout_ms: int = 300_000  # the server closes a session silent for this long
    resume_window_ms: int = 30_000  # a dropped session stays resumable this long
    # positions a request's prompt may fill (its Prefills), beside max_context for prompt + generated; 0: no limit
    # of its own (servers from before the field omit it, so it decodes as 0)
    max_prompt_tokens: int = 0

    def __post_init__(self):
        _int(self.max_frame_bytes, "limits.max_frame_bytes", 1024, 1 << 30)
        _int(self.max_context, "limits.max_context", 1, MAX_POSITION)
        _int(self.max_prefill_chunk_tokens, "limits.max_prefill_chunk_tokens", 1, MAX_POSITION)
        _int(self.max_concurrent_requests, "limits.max_concurrent_requests", 1, 1 << 16)
        _int(self.prefix_block_tokens, "limits.prefix_block_tokens", 1, 1 << 16)
        _int(self.idle_timeout_ms, "limits.idle_timeout_ms", 0, MAX_POSITION)
        _int(self.resume_window_ms, "limits.resume_window_ms", 0, MAX_POSITION)
        _int(self.max_prompt_tokens, "limits.max_prompt_tokens", 0, MAX_POSITION)

    @property
    def prompt_limit(self) -> int:
        """Positions a prompt may fill: ``max_prompt_tokens``, or ``max_context`` when it is 0."""
        return self.max_prompt_tokens or self.max_context


@dataclass(slots=True, kw_only=True)
class ServerInfo:
    name: str = "autoglm-cloud"
    version: str = ""
    compute_variants: list[str] = field(default_factory=lambda: ["bf16"])  # what this deployment can run
    load: float = 0.0  # busy fraction in [0, 1] at the time of the Welcome (the policy's load input; Tokens.load since)
    # drafts one SpecStep may carry (its hidden states: max_draft_tokens + 1 rows); 0: this server takes no
    # SpecStep (servers from before the message omit the field, so it decodes as 0)
    max_draft_tokens: int = 0
    # drafts the server itself proposes with a Tokens (the cloud drafter, docs/protocol.md "Cloud drafts"),
    # at most; 0: it proposes none (a bundle without cloud/draft_inputs.npy, or switched off)
    cloud_drafts: int = 0
    # False: this server keeps no prefix cache (``serve --no-enable-prefix-cache``): it neither takes a Prefill's
    # start > 0 from cached blocks (prefix_miss) nor publishes any; servers from before the field omit it, so it
    # decodes as True (their blocks may be cached)
    prefix_cache: bool = True

    def __post_init__(self):
        _text(self.name, "server.name", 64)
        _text(self.version, "server.version", 64)
        _list(self.compute_variants, "server.compute_variants", len(COMPUTE_VARIANTS))
        for c in self.compute_variants:
            if c not in COMPUTE_VARIANTS:
                raise ProtocolError(BAD_VALUE, f"server.compute_variants: {c!r} not in {COMPUTE_VARIANTS}")
        _float(self.load, "server.load", 0.0, 1.0)
        _int(self.max_draft_tokens, "server.max_draft_tokens", 0, MAX_DRAFT_TOKENS)
        _int(self.cloud_drafts, "server.cloud_drafts", 0, MAX_DRAFT_TOKENS)


@dataclass(slots=True, kw_only=True)
class RequestState:
    """Where an open request stands on the server (Welcome.requests after a resumed session)."""

    request_id: str
    received: int  # positions [0, received) are in the server's KV cache
    tokens: int  # tokens generated so far

    def __post_init__(self):
        _ident(self.request_id, "request_id")
        _int(self.received, "received")
        _int(self.tokens, "tokens")


MAX_SEED = (1 << 63) - 1  # a request's seed, on every path (wire, HTTP, the edge's own sampler)
MAX_TOP_K = 1 << 24  # SamplingParams.top_k; any larger is the same as off (no vocabulary is that large)
MIN_TOP_P = 1e-9  # SamplingParams.top_p's floor on the wire
MAX_TEMPERATURE = 100.0
# a temperature below this samples greedily, on both ends (vLLM's rule): 1 / T overflows near 0 and the
# scaled logits turn to inf, then NaN
MIN_TEMPERATURE = 1e-5


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """Sampling on the server. Stop *strings* are matched on the edge (it owns the detokenizer)."""

    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request generator seed; None = nondeterministic
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's EOS ids
    ignore_eos: bool = False
    logprobs: bool = False  # return the sampled tokens' logprobs
    top_logprobs: int = 0  # and the top-n alternatives (0..20)
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over generated tokens (the server never sees prompt ids)

    def __post_init__(self):
        _int(self.max_tokens, "params.max_tokens", 1, MAX_POSITION)
        _float(self.temperature, "params.temperature", 0.0, MAX_TEMPERATURE)
        _float(self.top_p, "params.top_p", MIN_TOP_P, 1.0)
        _int(self.top_k, "params.top_k", 0, MAX_TOP_K)
        if self.seed is not None:
            _int(self.seed, "params.seed", 0, MAX_SEED)
        _list(self.stop_token_ids, "params.stop_token_ids", 64)
        for t in self.stop_token_ids:
            _int(t, "params.stop_token_ids[]", 0, MAX_TOKEN_ID)
        _int(self.top_logprobs, "params.top_logprobs", 0, 20)
        _float(self.presence_penalty, "params.presence_penalty", -2.0, 2.0)
        _float(self.frequency_penalty, "params.frequency_penalty", -2.0, 2.0)
        _float(self.repetition_penalty, "params.repetition_penalty", 1e-3, 10.0)


@dataclass(slots=True, kw_only=True)
class TopLogprob:
    token_id: int
    logprob: float  # finite; the server clamps -inf to -9999.0 (as OpenAI does)

    def __post_init__(self):
        _int(self.token_id, "token_id", 0, MAX_TOKEN_ID)
        _float(self.logprob, "logprob", -1e4, 0.0)


@dataclass(slots=True, kw_only=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt positions served from the server's prefix cache

    def __post_init__(self):
        _int(self.prompt_tokens, "usage.prompt_tokens")
        _int(self.completion_tokens, "usage.completion_tokens")
        _int(self.cached_tokens, "usage.cached_tokens")


@dataclass(slots=True, kw_only=True)
class ServerTimings:
    """Server-side durations for the work behind one Tokens message, in milliseconds."""

    queue_ms: float = 0.0  # waiting for a batch slot
    compute_ms: float = 0.0  # back-half forward + sampling
    total_ms: float = 0.0  # message in -> message out on the server
    draft_ms: float = 0.0  # of total_ms, the time the token was held while the server drafted (cloud drafts)

    def __post_init__(self):
        for name in ("queue_ms", "compute_ms", "total_ms", "draft_ms"):
            _float(getattr(self, name), f"timings.{name}", 0.0, 1e9)


# -- messages ----------------------------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class Hello:
    """C->S, first frame of every connection. Auth is the HTTP ``Authorization`` header, never a field."""

    TYPE: ClassVar[int] = 1
    protocol_version: int = PROTOCOL_VERSION
    bundle_id: str  # Manifest.bundle_id of the client's bundle; a mismatch is refused
    codecs: list[str]  # codecs the client can encode, in preference order
    hints: ClientHints = field(default_factory=ClientHints)
    resume_token: str | None = None  # from an earlier Welcome: reattach that session

    def __post_init__(self):
        if isinstance(self.hints, dict):  # convenience for callers; the wire always carries the struct
            try:
                self.hints = ClientHints(**self.hints)
            except TypeError as e:
                raise ProtocolError(BAD_TYPE, f"hints: {e}") from None
        _int(self.protocol_version, "protocol_version", 0, 1 << 16)
        _ident(self.bundle_id, "bundle_id", 128)
        _list(self.codecs, "codecs", 32)
        for c in self.codecs:
            _ident(c, "codecs[]", 32)
        if self.resume_token is not None:
            _ident(self.resume_token, "resume_token", 256)


@dataclass(slots=True, kw_only=True)
class Welcome:
    """S->C answer to Hello: the session, its limits, and the default precision plan."""

    TYPE: ClassVar[int] = 2
    protocol_version: int = PROTOCOL_VERSION
    session_id: str
    resume_token: str  # present it in a later Hello to reattach this session
    resumed: bool = False  # True: the Hello's resume_token matched a live session (see ``requests``)
    limits: SessionLimits = field(default_factory=SessionLimits)
    plan: PrecisionPlan = field(default_factory=lambda: PrecisionPlan(codec="fp16", compute="bf16"))
    codecs: list[str] = field(default_factory=lambda: ["fp16"])  # accepted codecs (subset of Hello.codecs)
    server: ServerInfo = field(default_factory=ServerInfo)
    cached_prefixes: list[str] = field(default_factory=list)  # prefix keys the server holds (advisory)
    requests: list[RequestState] = field(default_factory=list)  # open requests of a resumed session

    def __post_init__(self):
        _int(self.protocol_version, "protocol_version", 0, 1 << 16)
        _ident(self.session_id, "session_id")
        _ident(self.resume_token, "resume_token", 256)
        _list(self.codecs, "codecs", 32)
        for c in self.codecs:
            _ident(c, "codecs[]", 32)
        _list(self.cached_prefixes, "cached_prefixes", MAX_PREFIX_KEYS)
        for k in self.cached_prefixes:
            _ident(k, "cached_prefixes[]", 128)
        _list(self.requests, "requests", 1 << 16)

    @property
    def max_frame_bytes(self) -> int:
        return self.limits.max_frame_bytes

    @property
    def block_size(self) -> int:
        return self.limits.prefix_block_tokens


@dataclass(slots=True, kw_only=True)
class Prefill:
    """C->S: boundary hidden states of prompt positions ``[start, start + hidden.shape[0])``.

    The first Prefill of a request opens it and carries ``params`` (and ``prefix_keys``, ``return_states``,
    ``prompt_len``); later chunks carry ``params=None``, an empty ``prefix_keys``, ``return_states=False`` and
    ``prompt_len=None`` (the session rulebook refuses others: ``duplicate_request`` for params, ``bad_state`` for
    the rest). ``start > 0`` on the first chunk asks the server to
    take positions ``[0, start)`` from its prefix cache under ``prefix_keys`` (``Error(prefix_miss)`` if it
    cannot). ``last`` marks the chunk that completes the context: the server samples after it.
    """

    TYPE: ClassVar[int] = 3
    request_id: str
    start: int
    hidden: EncodedTensor  # [n, H]
    last: bool = True
    params: SamplingParams | None = None
    prefix_keys: list[str] = field(default_factory=list)  # one hash-chain key per full prompt block
    compute: str | None = None  # requested compute variant (None: the server's plan)
    rope_positions: WireArray | None = None  # int32 [3, n] multimodal RoPE positions (GLM-4V); None: 1-D
    # first Prefill only: a u-shape request (a bundle split with --tail): the server runs the middle layers and
    # answers every span with States (its hidden states) instead of sampling; steps are StatesSteps
    return_states: bool = False
    # the chunk with ``last``: ask the server to propose up to this many drafts with the first token
    # (ServerInfo.cloud_drafts caps it; 0: none)
    ask_drafts: int = 0
    # first Prefill only: the positions the whole prompt fills (the chunk with ``last`` ends there), so that a
    # server choosing the compute variant plans for the real length; None: not said
    prompt_len: int | None = None

    def __post_init__(self):
        _ident(self.request_id, "request_id")
        _int(self.start, "start")
        _int(self.ask_drafts, "ask_drafts", 0, MAX_DRAFT_TOKENS)
        if self.prompt_len is not None:
            _int(self.prompt_len, "prompt_len", 1)
        _rows(self.start, self.hidden.shape[0], "Prefill")
        _list(self.prefix_keys, "prefix_keys", MAX_PREFIX_KEYS)
        for k in self.prefix_keys:
            _ident(k, "prefix_keys[]", 128)
        if self.compute is not None and self.compute not in COMPUTE_VARIANTS:
            raise ProtocolError(BAD_VALUE, f"compute {self.compute!r} not in {COMPUTE_VARIANTS}")
        _check_rope(self.rope_positions, self.hidden.shape[0])

    @property
    def n_tokens(self) -> int:
        return self.hidden.shape[0]


@dataclass(slots=True, kw_only=True)
class DecodeStep:
    """C->S: the boundary hidden state of the token the server sent last, at ``position``."""

    TYPE: ClassVar[int] = 4
    request_id: str
    position: int
    hidden: EncodedTensor  # [1, H]
    rope_positions: WireArray | None = None  # int32 [3, 1] (GLM-4V); None: 1-D positions
    ask_drafts: int = 0  # propose up to this many drafts with the next token (docs/protocol.md "Cloud drafts")

    def __post_init__(self):
        _ident(self.request_id, "request_id")
        _int(self.position, "position")
        _int(self.ask_drafts, "ask_drafts", 0, MAX_DRAFT_TOKENS)
        if self.hidden.shape[0] != 1:
            raise ProtocolError(BAD_VALUE, f"DecodeStep carries one token, got {self.hidden.shape[0]}")
        _check_rope(self.rope_positions, 1)


@dataclass(slots=True, kw_only=True)
class SpecStep:
    """C->S: a speculative decode step. Row 0 of ``hidden`` is the boundary state of the token the server sent
    last (at ``position``, as a DecodeStep's), rows 1..k those of the edge's draft tokens ``draft_ids`` at the
    positions after it. The server verifies all k+1 positions in one engine step, keeps the longest prefix of
    drafts its own sampling accepts, and answers one ``Tokens`` with the accepted drafts plus its own next
    token; both sides then roll their KV back past the first rejected draft (docs/protocol.md, "SpecStep")."""

    TYPE: ClassVar[int] = 12
    request_id: str
    position: int
    hidden: EncodedTensor  # [k + 1, H]
    draft_ids: list[int]  # [k], k >= 1
    rope_positions: WireArray | None = None  # int32 [3, k + 1] (GLM-4V); None: 1-D positions
    ask_drafts: int = 0  # propose up to this many drafts after the verdict's last token (as DecodeStep's)

    def __post_init__(self):
        _ident(self.request_id, "request_id")
        _int(self.position, "position")
        _int(self.ask_drafts, "ask_drafts", 0, MAX_DRAFT_TOKENS)
        _list(self.draft_ids, "draft_ids", MAX_DRAFT_TOKENS)
        if not self.draft_ids:
            raise ProtocolError(BAD_VALUE, "SpecStep with no drafts (send a DecodeStep)")
        for t in self.draft_ids:
            _int(t, "draft_ids[]", 0, MAX_TOKEN_ID)
        if self.hidden.shape[0] != len(self.draft_ids) + 1:
            raise ProtocolError(BAD_VALUE, f"SpecStep with {len(self.draft_ids)} drafts carries "
                                           f"{len(self.draft_ids) + 1} rows, got {self.hidden.shape[0]}")
        if self.position + len(self.draft_ids) + 1 > MAX_POSITION:
            raise ProtocolError(BAD_VALUE, "SpecStep positions overflow")
        _check_rope(self.rope_positions, len(self.draft_ids) + 1)

    @property
    def n_tokens(self) -> int:
        return len(self.draft_ids) + 1


@dataclass(slots=True, kw_only=True)
class StatesStep:
    """C->S, u-shape: the boundary states of positions ``[position, position + n)`` after the server returned
    every position it holds. ``position`` may lie before the server's ``received`` (never before the prompt's
    end): the server first drops its KV from ``position`` on, so the edge rolls back the rejected drafts of a
    speculative step in the same message. One row: a plain decode step; k + 1 rows: the last sampled token and
    k drafts (the drafts' ids stay on the phone: the edge verifies them against its own tail's logits)."""

    TYPE: ClassVar[int] = 13
    request_id: str
    position: int
    hidden: EncodedTensor  # [n, H], 1 <= n <= Welcome.server.max_draft_tokens + 1
    rope_positions: WireArray | None = None  # int32 [3, n] (GLM-4V); None: 1-D positions

    def __post_init__(self):
        _ident(self.request_id, "request_id")
        _int(self.position, "position")
        _rows(self.position, self.hidden.shape[0], "StatesStep", MAX_DRAFT_TOKENS + 1)
        _check_rope(self.rope_positions, self.hidden.shape[0])

    @property
    def n_tokens(self) -> int:
        return self.hidden.shape[0]


@dataclass(slots=True, kw_only=True)
class States:
    """S->C, u-shape: the hidden states after the cloud's middle layers for positions ``[start, start + n)``, one
    message per span the server computed (a prompt chunk, a StatesStep). Coded with the codec of the request's
    first Prefill. The edge's tail turns them into logits; the server never samples, so no token id exists on
    this side of the link."""

    TYPE: ClassVar[int] = 14
    request_id: str
    start: int
    hidden: EncodedTensor  # [n, H]
    timings: ServerTimings | None = None
    plan: PrecisionPlan | None = None  # on a request's first States: the plan actually used

    def __post_init__(self):
        _ident(self.request_id, "request_id")
        _int(self.start, "start")
        _rows(self.start, self.hidden.shape[0], "States")

    @property
    def n_tokens(self) -> int:
        return self.hidden.shape[0]


@dataclass(slots=True, kw_only=True)
class Tokens:
    """S->C: generated tokens ``index, index + 1, ...`` of a request (index counts from 0). With no
    ``token_ids`` and no ``finish_reason`` it is a progress message: the request is still being computed
    (:data:`PROGRESS_INTERVAL_S`)."""

    TYPE: ClassVar[int] = 5
    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float] | None = None  # one per token when params.logprobs
    top_logprobs: list[list[TopLogprob]] | None = None  # one list per token when params.top_logprobs
    finish_reason: str | None = None  # None while running; stop | length | cancelled | error
    usage: Usage | None = None  # on the message with finish_reason
    timings: ServerTimings | None = None
    plan: PrecisionPlan | None = None  # on a request's first Tokens: the plan actually used
    # the cloud drafter's proposal for the tokens after the last of ``token_ids`` (asked with ask_drafts): the
    # edge may send them back as a SpecStep's drafts; None: no proposal
    draft_ids: list[int] | None = None
    # the server's busy fraction in [0, 1] as it sent this message (ServerInfo.load's meaning), on a request's final
    # Tokens: what the session's next request is planned with (a Welcome's is as old as the session); None: not said
    load: float | None = None

    def __post_init__(self):
        _ident(self.request_id, "request_id")
        _int(self.index, "index")
        _list(self.token_ids, "token_ids", 1 << 16)
        if self.load is not None:
            _float(self.load, "load", 0.0, 1.0)
        if self.draft_ids is not None:
            _list(self.draft_ids, "draft_ids", MAX_DRAFT_TOKENS)
            for t in self.draft_ids:
                _int(t, "draft_ids[]", 0, MAX_TOKEN_ID)
        for t in self.token_ids:
            _int(t, "token_ids[]", 0, MAX_TOKEN_ID)
        if self.logprobs is not None:
            _list(self.logprobs, "logprobs", len(self.token_ids))
            if len(self.logprobs) != len(self.token_ids):
                raise ProtocolError(BAD_VALUE, "logprobs: one per token")
            for lp in self.logprobs:
                _float(lp, "logprobs[]", -1e4, 0.0)
        if self.top_logprobs is not None:
            _list(self.top_logprobs, "top_logprobs", len(self.token_ids))
            if len(self.top_logprobs) != len(self.token_ids):
                raise ProtocolError(BAD_VALUE, "top_logprobs: one list per token")
            for alts in self.top_logprobs:
                _list(alts, "top_logprobs[]", 20)
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ProtocolError(BAD_VALUE, f"finish_reason {self.finish_reason!r} not in {FINISH_REASONS}")


@dataclass(slots=True, kw_only=True)
class Cancel:
    """C->S: stop a request; the server answers with a final Tokens(finish_reason="cancelled")."""

    TYPE: ClassVar[int] = 6
    request_id: str

    def __post_init__(self):
        _ident(self.request_id, "request_id")


@dataclass(slots=True, kw_only=True)
class Resume:
    """C->S after a resumed Welcome: where does ``request_id`` stand? The client holds ``have_tokens``."""

    TYPE: ClassVar[int] = 7
    request_id: str
    have_tokens: int

    def __post_init__(self):
        _ident(self.request_id, "request_id")
        _int(self.have_tokens, "have_tokens")


@dataclass(slots=True, kw_only=True)
class Resumed:
    """S->C answer to Resume: the KV cache holds ``[0, received)``; tokens from ``index`` the client lacks."""

    TYPE: ClassVar[int] = 11
    request_id: str
    received: int  # the client resends its inputs from this position
    index: int  # = Resume.have_tokens
    token_ids: list[int] = field(default_factory=list)  # generated tokens index, index + 1, ...
    finish_reason: str | None = None

    def __post_init__(self):
        _ident(self.request_id, "request_id")
        _int(self.received, "received")
        _int(self.index, "index")
        _list(self.token_ids, "token_ids", 1 << 16)
        for t in self.token_ids:
            _int(t, "token_ids[]", 0, MAX_TOKEN_ID)
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ProtocolError(BAD_VALUE, f"finish_reason {self.finish_reason!r} not in {FINISH_REASONS}")


@dataclass(slots=True, kw_only=True)
class Error:
    """Either direction. ``fatal``: the session ends (else only ``request_id``, if any, failed)."""

    TYPE: ClassVar[int] = 8
    code: str  # shared.errors: a ProtocolError code or a session code
    message: str = ""  # human-readable, at most 1024 characters (longer ones are cut)
    request_id: str | None = None
    fatal: bool = False
    retry_after_ms: int | None = None  # for overloaded / draining: when trying again makes sense
    # for bundle_mismatch: the bundle ids the server serves, its default first (their edge halves download
    # from GET /v1/bundles/{id}/...); empty otherwise, and from servers before the field
    bundle_ids: list[str] = field(default_factory=list)

    def __post_init__(self):
        _ident(self.code, "code", 64)
        _text(self.message, "message", 1 << 20)
        self.message = self.message[:1024]
        if self.request_id is not None:
            _ident(self.request_id, "request_id")
        if self.retry_after_ms is not None:
            _int(self.retry_after_ms, "retry_after_ms")
        _list(self.bundle_ids, "bundle_ids", 64)
        for b in self.bundle_ids:
            _ident(b, "bundle_ids[]", 128)


@dataclass(slots=True, kw_only=True)
class Drain:
    """S->C: the server is going away. Open requests may finish within ``grace_ms``; open no new ones."""

    TYPE: ClassVar[int] = 9
    grace_ms: int = 30_000
    reason: str = ""

    def __post_init__(self):
        _int(self.grace_ms, "grace_ms")
        _text(self.reason, "reason", 256)


@dataclass(slots=True, kw_only=True)
class Close:
    """Either direction: orderly end of the session (then the WebSocket closes with 1000)."""

    TYPE: ClassVar[int] = 10
    reason: str = ""

    def __post_init__(self):
        _text(self.reason, "reason", 256)


def _rows(start: int, n: int, what: str, most: int = MAX_POSITION) -> None:
    """A span of ``n`` rows at positions [start, start + n): 1 <= n <= ``most``, no position past the limit."""
    if not 1 <= n <= most:
        raise ProtocolError(BAD_VALUE, f"{what} carries 1..{most} rows, got {n}")
    if start + n > MAX_POSITION:
        raise ProtocolError(BAD_VALUE, f"{what} positions overflow")


def _check_rope(rope: WireArray | None, n: int) -> None:
    if rope is None:
        return
    if rope.dtype != "int32" or rope.shape != (3, n):
        raise ProtocolError(BAD_VALUE, f"rope_positions: expected int32 [3, {n}], got {rope.dtype}{list(rope.shape)}")


Message = (Hello | Welcome | Prefill | DecodeStep | SpecStep | StatesStep | States | Tokens | Cancel | Resume
           | Resumed | Error | Drain | Close)
MESSAGE_TYPES: dict[int, type] = {cls.TYPE: cls for cls in
                                  (Hello, Welcome, Prefill, DecodeStep, SpecStep, StatesStep, States, Tokens, Cancel,
                                   Resume, Resumed, Error, Drain, Close)}
