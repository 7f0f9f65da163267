"""Edge client configuration: one dataclass for the runtime and session, one for timeouts and retries.

CLI flags mirror the common fields (``--threads`` <-> ``EdgeConfig.threads``, ``--reconnect-window-s`` <->
``RetryPolicy.reconnect_window_s``), and each field of both has an environment twin (``AUTOGLM_EDGE_THREADS``,
``AUTOGLM_EDGE_RECONNECT_WINDOW_S``), parsed by the field's type; see :func:`EdgeConfig.from_env`.

Reference: Petals' ``ClientConfig`` (one dataclass of client timeouts, each field saying why).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from shared.prefix_keys import bearer_key_problem
from shared.threads import threads_problem
from shared.user_paths import user_path

from .activation_cache import MEMORY_BYTES, RESERVE_BYTES, RESERVE_FRACTION, memory_problem, reserve_problem

DEFAULT_SPLIT_PATH = "/v1/split"  # the cloud server's WebSocket route for split sessions
# a URL's scheme -> the split endpoint's: an OpenAI base_url's http(s) is the same server's WebSocket, TLS kept
_WS_SCHEMES = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field."""


def split_url(url: str) -> str:
    """The split endpoint's WebSocket URL for ``url``: a server's base URL (``ws://host:port``, or a path ending in
    ``/v1`` - ``wss://gw/autoglm/v1`` behind a proxy's prefix - as an OpenAI client takes ``base_url``) gets the
    endpoint's path (``/v1/split``, ``/autoglm/v1/split``); any other path is kept as given. An OpenAI client's own
    ``base_url`` works too: ``http://`` is the same server's ``ws://``, ``https://`` its ``wss://`` (host, port and
    path as above; the TLS options apply to it), so one base URL serves the cloud's OpenAI routes and this client;
    another scheme is ``ConfigError``. Whitespace around it
    (an environment twin read from a file) is dropped, as a browser's URL parser drops it; whitespace inside, port 0
    (the WebSocket library would dial the scheme's default port) and credentials in it (``user:pass@``: they would go
    out as HTTP Basic auth in place of the API key's Bearer, and into every error message and log line naming the
    URL) are ``ConfigError``, shown without the credentials."""
    if not isinstance(url, str):
        raise ConfigError(f"url: expected a string, got {type(url).__name__}")
    url = url.strip()
    netloc = url.partition("://")[2].split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    if "@" in netloc:  # named without its credentials
        shown = url.replace(netloc, netloc.rpartition("@")[2], 1)
        raise ConfigError(f"url {shown!r}: credentials in the URL (user:password@) are refused; pass the key as "
                          "api_key (AUTOGLM_API_KEY), sent as 'Authorization: Bearer <key>'")
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port  # parsing the port raises ValueError when it is not one
    except ValueError as e:  # a bracket left open, a port out of range
        raise ConfigError(f"url {url!r}: {e}") from None
    scheme = _WS_SCHEMES.get(parts.scheme)
    if scheme is None or not host:
        raise ConfigError(f"url {url!r}: expected ws://, wss://, http:// or https:// and a host (the server's base "
                          f"URL, or its {DEFAULT_SPLIT_PATH} endpoint)")
    if port == 0 or any(c.isspace() for c in url):
        raise ConfigError(f"url {url!r}: " + ("port 0 is no server's port" if port == 0 else "whitespace inside"))
    path = parts.path.rstrip("/")
    if path == "":
        path = DEFAULT_SPLIT_PATH
    elif path.endswith("/v1"):
        path += DEFAULT_SPLIT_PATH.removeprefix("/v1")
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


@dataclass(slots=True)
class RetryPolicy:
    # Opening the WebSocket (TCP + HTTP upgrade + Hello/Welcome). A phone on a bad link needs seconds,
    # but a dead server must not hang the app.
    connect_timeout_s: float = 10.0
    # Longest wait for the server's next message while a request is in flight. A server computing a long
    # prefill or queueing the request sends a progress Tokens at least every 15 s (shared.protocol
    # PROGRESS_INTERVAL_S), so this need only exceed that; liveness is detected sooner by the keepalive below.
    reply_timeout_s: float = 60.0
    # How long the edge keeps trying to reach the cloud - after the link drops mid-request, or when a request's
    # first connect fails - before the request fails (`unreachable`; the server's refusal, `overloaded` or
    # `draining`, when it refused the last attempt for now); the last attempt starts within it. It rides
    # out mobile drops (handover, tunnel: seconds) and a server's crash-restart (process start + model load:
    # ~5-15 s for a tiny model on a busy CPU box, about a minute for a 9B GPU server), after which the request
    # resumes or is replayed; a server that stays dead fails the request after this long, not never.
    reconnect_window_s: float = 90.0
    # The same for a client that has not reached the cloud yet (a wrong URL, a server not started): a
    # misconfiguration shows in seconds, as an HTTP client's connect error does; from its first Welcome or refusal
    # for now on (the server answered: a busy server is no misconfiguration), reconnect_window_s applies.
    first_connect_window_s: float = 10.0
    # At most this many retries within the window (None: as many as the backoff fits in it); 0 never retries.
    max_retries: int | None = None
    # Backoff before reconnect attempt k: min(max, initial * multiplier**k) * (1 +- jitter). Jitter keeps a
    # fleet of phones from reconnecting in lockstep after a server restart.
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    backoff_multiplier: float = 2.0
    backoff_jitter: float = 0.2
    # WebSocket ping interval and the pong deadline: NAT boxes drop idle TCP flows after ~30-60 s, and a
    # half-open connection (the phone changed networks) is only noticed by a missed pong.
    keepalive_interval_s: float | None = 15.0
    keepalive_timeout_s: float | None = 20.0

    def __post_init__(self):
        for name in ("connect_timeout_s", "reply_timeout_s", "reconnect_window_s", "first_connect_window_s",
                     "backoff_initial_s",
                     "backoff_max_s"):
            if not getattr(self, name) > 0:  # (nan too)
                raise ConfigError(f"RetryPolicy.{name} must be > 0, got {getattr(self, name)}")
        if self.max_retries is not None and self.max_retries < 0:
            raise ConfigError(f"RetryPolicy.max_retries must be >= 0, got {self.max_retries}")
        if self.backoff_multiplier < 1.0:
            raise ConfigError(f"RetryPolicy.backoff_multiplier must be >= 1, got {self.backoff_multiplier}")
        if not 0.0 <= self.backoff_jitter < 1.0:
            raise ConfigError(f"RetryPolicy.backoff_jitter must be in [0, 1), got {self.backoff_jitter}")
        for name in ("keepalive_interval_s", "keepalive_timeout_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"RetryPolicy.{name} must be > 0 or None, got {v}")

    def backoff(self, attempt: int, rand: float = 0.5) -> float:
        """Delay before reconnect attempt ``attempt`` (0-based); ``rand`` in [0, 1) draws the jitter."""
        try:
            base = min(self.backoff_max_s, self.backoff_initial_s * self.backoff_multiplier ** attempt)
        except OverflowError:  # the thousandth retry of a long window of short ones: long at the cap
            base = self.backoff_max_s
        return base * (1.0 + self.backoff_jitter * (2.0 * rand - 1.0))

    def wait(self, attempt: int, left: float, at_least: float | None = None, rand: float = 0.5) -> float | None:
        """Delay before retry ``attempt`` (0-based) with ``left`` seconds of the window to go: the backoff, never
        shorter than ``at_least`` (the server's ``retry_after_ms``), the last one ending at the window's end.
        None: give up - the window or ``max_retries`` is spent, or the server asks for longer than is left."""
        if left <= 0 or (self.max_retries is not None and attempt >= self.max_retries):
            return None
        if at_least is not None and at_least > left:
            return None
        return min(max(self.backoff(attempt, rand), at_least or 0.0), left)


@dataclass(slots=True)
class EdgeConfig:
    bundle: Path  # a bundle directory written by `autoglm-partition split` (only edge/ files are read)
    url: str = "ws://127.0.0.1:8000"  # the cloud's base URL, or its split endpoint (split_url)
    api_key: str | None = None  # sent as "Authorization: Bearer <key>"
    # wss://: trust only the CAs in this PEM file (a private CA); None: the system store or SSL_CERT_FILE
    ca_file: Path | None = None
    # onnxruntime intra-op threads. Phones have 2-4 big cores; using all of them starves the UI thread.
    threads: int = 2
    # Prompt tokens per front-layer forward. Bounds peak edge memory (attention is S x P) and lets the first
    # chunk's upload overlap the next chunk's compute.
    prefill_chunk: int = 128
    # Wire codec for boundary activations; None lets the server's precision plan decide per request.
    codec: str | None = None
    # The phone's uplink in kbit/s (Hello.hints.link_kbps): the precision policy sends a bulk prompt whose upload
    # would take over 1.5 s in the compact codec (int4-outlier). None: unknown, the near-lossless codec.
    link_kbps: float | None = None
    wire_zstd: bool = False  # zstd over coded payloads: ~1.1x on activations, not worth a phone core by default
    # Activation cache for common prompts (see activation_cache.py). None: in memory only.
    cache_dir: Path | None = None
    cache_max_bytes: int = 512 << 20  # 512 MiB: a few long system prompts' front KV of a 9B split at N=4
    # Free space cache_dir's disk keeps: the larger of the two (256 MiB, 5 % of the disk). A block that would eat into
    # it evicts the oldest blocks first, else stays in memory: the cache never takes a phone's last free space.
    cache_reserve_bytes: int = RESERVE_BYTES
    cache_reserve_fraction: float = RESERVE_FRACTION
    # Block arrays the cache holds in memory (32 MiB: a phone app's budget): past it the oldest blocks on disk are read
    # again on their next use, those in memory only (no cache_dir, or one that refused them) are evicted.
    cache_memory_bytes: int = MEMORY_BYTES
    cache_block_tokens: int = 16  # hash-chain block: finer blocks reuse more, coarser ones cost fewer files
    cache_dtype: str = "float32"  # float32 keeps cached == recomputed bit for bit; float16 halves the bytes
    cache_prompts: bool = True  # also cache the full blocks of every request's prompt (not only preloads)
    verify_bundle: bool = True  # re-hash edge/ artifacts at load: a tampered graph is refused
    # On bundle_mismatch, download the server's bundle of the same model and switch to it
    # (edge_client.bundle_sync). Off by default: a new edge half is tens of MB to GBs, which an app may
    # want to fetch on Wi-Fi only (`autoglm-edge preload --update` does it on demand).
    auto_update: bool = False
    # Drafts per speculative step: None lets edge_client.drafting.DraftSizer choose k from the measured
    # acceptance and link; an int pins it (deterministic tests and benchmarks).
    draft_k: int | None = None
    # Ask a server that offers cloud drafts (Welcome.server.cloud_drafts: it drafts with its own layers from an
    # approximate boundary state, docs/protocol.md "Cloud drafts") for them when a request speculates.
    cloud_drafts: bool = True
    # Speculate on every request that does not say (generate(speculate=None); autoglm-edge chat / serve
    # --speculate): drafts verified k + 1 per round trip, the answer plain decoding's (docs/edge.md, "Speculation").
    speculate: bool = False
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self):
        # "~/..." is the user's home, as a shell would expand it (an app's setting or an environment twin is not)
        self.bundle = user_path(self.bundle)
        if self.cache_dir is not None:
            if isinstance(self.cache_dir, str) and not self.cache_dir.strip():
                # `--cache-dir "$DIR"` with DIR unset: Path("") is ".", so the cache (and its directory-wide bound's
                # scan) went into the current directory, where an empty environment twin means no cache_dir
                raise ConfigError("cache_dir is empty (an unset variable?): give a directory, or leave it unset "
                                  "for a memory-only cache")
            self.cache_dir = user_path(self.cache_dir)
        if self.ca_file is not None:
            self.ca_file = user_path(self.ca_file)
        self.url = split_url(self.url)
        if self.api_key is not None and (problem := bearer_key_problem(self.api_key)) is not None:
            # empty: connected without the key, silently (every request a 401 from a protected cloud); a newline
            # failed every connect as 'not a WebSocket server (InvalidHeaderValue ...)'
            raise ConfigError(f"api_key {problem}")
        if (problem := threads_problem(self.threads)) is not None:  # 100,000: onnxruntime hung starting them
            raise ConfigError(f"threads {problem}")
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.cache_max_bytes < 0:
            raise ConfigError(f"cache_max_bytes must be >= 0, got {self.cache_max_bytes}")
        if self.cache_block_tokens < 1:
            raise ConfigError(f"cache_block_tokens must be >= 1, got {self.cache_block_tokens}")
        if (problem := reserve_problem(self.cache_reserve_bytes, self.cache_reserve_fraction)
                or memory_problem(self.cache_memory_bytes)) is not None:
            raise ConfigError(problem)
        if self.draft_k is not None and (type(self.draft_k) is not int or self.draft_k < 0):
            # (2.5 failed the first speculative step as an internal error, "3" raised a TypeError here)
            raise ConfigError(f"draft_k must be an integer >= 0 or None, got {self.draft_k!r}")
        for name in ("cloud_drafts", "speculate"):  # "no" is a true value
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.cache_dtype not in ("float32", "float16"):
            raise ConfigError(f"cache_dtype {self.cache_dtype!r}: expected float32 or float16")
        if self.link_kbps is not None and (isinstance(self.link_kbps, bool) or not isinstance(self.link_kbps, (int, float))
                                           or not 0 < self.link_kbps <= 1e9):  # the wire's range (ClientHints)
            raise ConfigError(f"link_kbps must be a number of kbit/s in (0, 1e9] or None, got {self.link_kbps!r}")
        if self.codec is not None:
            from shared.precision import PrecisionError, PrecisionOverride

            try:
                PrecisionOverride(codec=self.codec)
            except PrecisionError as e:
                raise ConfigError(str(e)) from None
        # (os.path's checks: a path the app may not even look at - a parent it cannot enter - was a PermissionError
        # traceback here; it is the cache's to refuse, which keeps its blocks in memory then, as for a read-only one)
        if self.cache_dir is not None and os.path.exists(self.cache_dir) and not os.path.isdir(self.cache_dir):
            raise ConfigError(f"cache_dir {self.cache_dir}: exists and is not a directory")
        if self.ca_file is not None:
            from .tls import trust_context

            try:
                trust_context(self.ca_file)
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(str(e)) from None

    @classmethod
    def from_env(cls, **overrides) -> EdgeConfig:
        """Fields from ``AUTOGLM_EDGE_<FIELD>`` (``AUTOGLM_BUNDLE``/``AUTOGLM_URL``/``AUTOGLM_API_KEY`` too), the
        retry policy's the same way (``AUTOGLM_EDGE_RECONNECT_WINDOW_S``), then ``overrides`` (the CLI's explicit
        flags, of either) on top."""
        values: dict = {}
        retry: dict = {}
        aliases = {"bundle": "AUTOGLM_BUNDLE", "url": "AUTOGLM_URL", "api_key": "AUTOGLM_API_KEY"}
        for into, owner in ((values, cls), (retry, RetryPolicy)):
            for f in fields(owner):
                if f.name == "retry":
                    continue
                names = (f"AUTOGLM_EDGE_{f.name.upper()}", aliases.get(f.name, "-"))
                if f.name == "api_key" and overrides.get("api_key") is None:
                    # an empty variable is unset, except the key's (the cloud's rule): an empty one, a secret made
                    # from an unset variable, connected without the key, silently; named with its problem here
                    for name in names:
                        if (key := os.environ.get(name)) is not None and (problem := bearer_key_problem(key)):
                            raise ConfigError(f"{name} {problem}")
                raw = os.environ.get(names[0]) or os.environ.get(names[1])
                if raw is not None:
                    into[f.name] = _coerce(f.name, f.type, raw)
        retry_names = {f.name for f in fields(RetryPolicy)}
        for k, v in overrides.items():
            if v is not None:
                (retry if k in retry_names else values)[k] = v
        if "bundle" not in values:
            raise ConfigError("no bundle: pass --bundle or set AUTOGLM_BUNDLE")
        if retry:
            values["retry"] = RetryPolicy(**retry)
        return cls(**values)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _coerce(name: str, annotation: str, raw: str):
    """An environment twin's text as its field's type (the dataclass annotation: ``int``, ``float``, ``bool``, with
    or without ``| None``, where ``none`` is None - for every field that may be None, as docs/edge.md says: the
    codec's ``none`` is the precision policy's choice, not a codec named 'none'); other fields keep the text
    (``__post_init__`` converts paths)."""
    kind = annotation.split("|")[0].strip()
    if "None" in annotation and raw.strip().lower() == "none":
        return None
    if kind in ("int", "float"):
        try:
            return int(raw) if kind == "int" else float(raw)
        except ValueError:
            raise ConfigError(f"AUTOGLM_EDGE_{name.upper()}={raw!r}: expected "
                              f"{'an integer' if kind == 'int' else 'a number'}") from None
    if kind == "bool":
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ConfigError(f"AUTOGLM_EDGE_{name.upper()}={raw!r}: expected one of {', '.join(_TRUE + _FALSE)}")
        return word in _TRUE
    return raw
