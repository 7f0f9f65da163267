"""Configuration of the cloud server: the engine's knobs and the server's, as validated dataclasses.

``EngineConfig`` sizes the KV pool and the per-step token budget (nano-vLLM's ``Config``); ``ServerConfig``
adds what the network side needs (listen address, API key, session limits, timeouts). The CLI
(``cloud_server.cli``) mirrors every field as a flag with an ``AUTOGLM_CLOUD_*`` environment twin.
Invalid values raise :class:`ConfigError` with a one-line message naming the field.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from shared.cli_exit import MIN_DURATION_S, duration_problem, host_problem, not_utf8
from shared.http_browsers import BrowserPolicy, hosts_problem, names, origins_problem
from shared.messages import MAX_POSITION
from shared.prefix_keys import bearer_key_problem
from shared.user_paths import user_path

COMPUTE_VARIANTS = ("fp32", "bf16", "fp16", "int8")
LOOPS = ("auto", "asyncio", "uvloop")  # uvicorn's --loop names
MAX_WORKERS = 256  # front-end processes: each a Python process with its own socket (more bound sockets than the
# open-file limit was a traceback); past the host's cores they only contend
EMPTY_REFUSED = ("bundle", "full", "model_name", "keys_file", "ssl_certfile", "ssl_keyfile")  # paths and names: '' is
# no value (an unset shell variable), never "the default" nor '.'
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "int8v")  # cloud_server.kv_quant.POOL_LAYOUTS: the same names (no torch here)
# The shortest --engine-stall-s: a real step takes milliseconds to seconds (a long prompt's chunk on a CPU, a first
# step's kernels compiled), and a watchdog shorter than that takes a healthy engine for a wedged one (1e-9 stopped a
# real server, exit 1, at its first request)
ENGINE_STALL_MIN_S = 1.0


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0 (got {value!r})")


@dataclass(slots=True)
class EngineConfig:
    device: str = "cpu"  # "cpu" or "cuda[:i]"; tensor parallel ranks use cuda:rank
    # Compute variants to load. "auto" = fp32 on CPU, bf16 on CUDA. int8 = weight-only int8 layers
    # (dequantized in the matmul) with the device's default compute dtype.
    variants: tuple[str, ...] = ("auto",)
    block_size: int = 16  # tokens per KV block; also the prefix-cache granularity (one key per full block)
    num_blocks: int = 1024  # blocks per variant pool, preallocated at start (fixed memory, no growth)
    max_num_seqs: int = 64  # sequences in one forward pass
    # Token budget of one step: every ready decode step first, then prefill chunks fill the rest.
    # Large enough for a phone's typical prompt in one chunk, small enough to bound a step's latency.
    max_num_batched_tokens: int = 2048
    # While any sequence is decoding, a step holds at most max_num_seqs + this many positions (0 = no cap: the
    # budget): prompts get what the decode rows leave, at least this many, so a long prompt is prefilled in chunks
    # riding on the decode steps. 128: such a step replays a CUDA graph on the fast path (a flat step,
    # cloud_server.fast.graphs); on the H200 a 256-position flat step beside 63 decode rows cost 1.9-2.4 decode
    # steps, so 128 keeps it under 2 (docs/performance.md, prefill without stalls).
    prefill_chunk_while_decoding: int = 128
    max_model_len: int = 8192  # positions per sequence (prompt + generated)
    tp: int = 1  # tensor-parallel ranks (1 or 2; GLM-4.1V's 2 KV heads split exactly over 2)
    enable_prefix_cache: bool = True
    # CPU: compute attention one sequence at a time so batching never changes a sequence's numbers.
    # GPU: decode steps share one padded attention call (faster, equal up to float rounding).
    batch_invariant: bool | None = None  # None = True on CPU, False on CUDA
    # The hand-written GLM fast path (cloud_server.fast) for GLM-4 / GLM-4.1V float variants, at any tp.
    # None: on CUDA (Triton kernels, CUDA graphs); True: on the CPU too (the same layers in plain torch: the
    # tests' check of the served GPU path); False: never. Elsewhere the library's layers run (paged attention).
    fast_path: bool | None = None
    # Overlap scheduling: step() launches step t + 1 on the device before it postprocesses step t, so the
    # host's work for one step runs while the device computes the other (vLLM's async scheduling).
    async_scheduling: bool = True
    # KV pool storage (vLLM's --kv-cache-dtype, cloud_server.kv_quant): "auto" = the compute dtype; "int8" / "fp8"
    # = 8-bit keys and values with a float32 scale per token and KV head (-48 % KV bytes at head_dim 128 vs bf16);
    # "int8v" = keys in the compute dtype, values int8 with their scales (-24 % vs bf16, the 16-bit pool's quality);
    # read by the fast path's Triton kernels and by the library's layers (paged attention) alike.
    kv_cache_dtype: str = "auto"
    # Cloud drafts (LLMEngine, "cloud drafts"): the most drafts the server proposes per Tokens when the bundle has a
    # cloud drafter (cloud/draft_inputs.npy) and the edge asks; each costs one decode row of the back layers. 0 = off.
    cloud_drafts: int = 4

    @property
    def max_context(self) -> int:
        """Positions one request may fill (prompt + answer): ``max_model_len``, and no more than the whole KV pool -
        a request longer than the pool could never finish (the engine drops it for load on every try)."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

    def __post_init__(self):
        if isinstance(self.variants, str):
            self.variants = tuple(v.strip() for v in self.variants.split(",") if v.strip())
        self.variants = tuple(self.variants)
        if not self.variants:
            raise ConfigError("variants: at least one compute variant is needed")
        for v in self.variants:
            if v != "auto" and v not in COMPUTE_VARIANTS:
                raise ConfigError(f"variants: unknown compute variant {v!r} (choose from auto, "
                                  f"{', '.join(COMPUTE_VARIANTS)})")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device: expected 'cpu' or 'cuda[:i]' (got {self.device!r})")
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            _positive(name, getattr(self, name))
        for name, most in (("max_model_len", MAX_POSITION), ("max_num_batched_tokens", MAX_POSITION),
                           ("block_size", 1 << 16)):  # what Welcome.limits carries (shared.messages.SessionLimits)
            if getattr(self, name) > most:
                raise ConfigError(f"{name} must be <= {most} (got {getattr(self, name)})")
        if not 0 <= self.cloud_drafts <= 16:
            raise ConfigError(f"cloud_drafts must be in [0, 16] (got {self.cloud_drafts})")
        if self.prefill_chunk_while_decoding < 0:
            raise ConfigError(f"prefill_chunk_while_decoding must be >= 0 (got {self.prefill_chunk_while_decoding})")
        if self.tp not in (1, 2):
            raise ConfigError(f"tp: tensor parallel size must be 1 or 2 (got {self.tp})")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError("max_num_batched_tokens must be >= max_num_seqs (every ready decode step "
                              "must fit in one step)")
        if self.batch_invariant is None:
            self.batch_invariant = self.device == "cpu"
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype: unknown {self.kv_cache_dtype!r} (choose from "
                              f"{', '.join(KV_CACHE_DTYPES)})")

    def resolved_variants(self) -> tuple[str, ...]:
        """``auto`` expanded for this device; order kept, duplicates dropped; the first is the default."""
        out: list[str] = []
        for v in self.variants:
            v = ("fp32" if self.device == "cpu" else "bf16") if v == "auto" else v
            if self.device == "cpu" and v in ("bf16", "fp16"):
                raise ConfigError(f"variants: {v} compute needs a CUDA device (CPU computes in fp32)")
            if v not in out:
                out.append(v)
        return tuple(out)


@dataclass(slots=True)
class ServerConfig:
    bundle: Path | None = None  # split mode: the bundle whose cloud half we serve
    # split mode: further bundle directories (cloud_server.bundle_set). Another bundle id: another bundle,
    # served by its own engine; the id of one before: an edge variant of it, offered for download only
    more_bundles: tuple[Path, ...] = ()
    full: str | None = None  # full-model mode: a load_model source (preset, checkpoint dir, .gguf)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, required as "Authorization: Bearer <key>" (HTTP and WebSocket)
    max_sessions: int = 64  # open split sessions (connected or within their resume grace period)
    # A disconnected session keeps its KV this long so the edge can Resume; then everything is freed.
    session_grace_s: float = 30.0
    # A request waiting this long for the edge's next decode step is aborted and its KV freed.
    step_timeout_s: float = 120.0
    # On shutdown: stop admitting, then let open requests finish for up to this long.
    drain_timeout_s: float = 30.0
    # An engine step running this long is a wedged engine (a hung device, a deadlock): the server stops, exit 1, to
    # be restarted; it answered its probes while no request moved. A real step takes milliseconds to seconds.
    engine_stall_s: float = 120.0
    model_name: str | None = None  # served model id (/v1/models); default: the bundle's or source's name
    # API keys file of hashes, one entry per key naming its tenant (cloud_server.auth); excludes api_key.
    keys_file: Path | None = None
    open_probes: bool = True  # /health, /ready and /metrics without a key (probes on an internal network)
    ssl_certfile: Path | None = None  # TLS: serve https:// and wss:// with this certificate chain (PEM)
    ssl_keyfile: Path | None = None  # TLS: its private key (PEM)
    # A WebSocket that sends no Hello within this is closed: a flood of idle sockets frees itself quickly.
    handshake_timeout_s: float = 30.0  # docs/protocol.md hello_timeout_ms
    max_connections: int = 2048  # open connections of any kind; beyond, uvicorn answers 503 (limit_concurrency)
    max_http_requests: int = 256  # HTTP /v1 requests in flight; beyond, 429 with Retry-After (never queued)
    # What a web browser may ask (shared.http_browsers; a comma-separated string is split): Host names or addresses a
    # request may name beside loopback ones and `host` ("*": any; none given: any when `host` is beyond loopback),
    # and origins of web pages served (with CORS) beside the server's own ("*": any page)
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    # Prompt positions per request (TGI's max_input_tokens), beside engine.max_model_len for prompt + generated;
    # a longer prompt fails at its Prefill (prompt_too_long) or HTTP request (400). None: engine.max_model_len.
    max_prompt_tokens: int | None = None
    # WebSocket front-end processes (cloud_server.front_workers): with N > 1 the main process runs the engine and
    # N spawned workers the split endpoint, each on its own socket of one port (SO_REUSEPORT; one shared socket
    # where that is missing); 1: one process does both.
    workers: int = 1
    # The event loop under every front end (uvicorn's --loop): "auto" (uvloop when installed, else asyncio),
    # "asyncio" or "uvloop" (measured side by side: bench/served_load.py --loops asyncio,uvloop).
    loop: str = "auto"
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        # `--keys-file "$KEYS"` with KEYS unset: the path '' was '.' ("--keys-file .: not a file"), a model name ''
        # was served as the default one, without a word
        for name, value in [(f, getattr(self, f)) for f in EMPTY_REFUSED] + [("more_bundles", b) for b in self.more_bundles]:
            if value == "":
                raise ConfigError(f"{name} is empty (an unset variable?): give it, or leave the option out")
        if (self.bundle is None) == (self.full is None):
            raise ConfigError("serve exactly one of: a BUNDLE (split mode) or --full SOURCE (full-model mode)")
        # "~/..." is the user's home in a --config file or an environment twin too, as a shell expands it
        if self.bundle is not None:
            self.bundle = user_path(self.bundle)
        self.more_bundles = tuple(user_path(b) for b in self.more_bundles)
        if self.full is not None and self.full.startswith("~"):  # a checkpoint dir or .gguf; a preset is a name
            self.full = str(user_path(self.full))
        if self.more_bundles and self.bundle is None:
            raise ConfigError("more_bundles: further bundles are served beside a BUNDLE (split mode)")
        if (problem := host_problem(self.host, "host")) is not None:
            raise ConfigError(problem)
        if self.model_name is not None and (problem := not_utf8(self.model_name)) is not None:
            raise ConfigError(f"model_name is {problem}")  # else /v1/models and /metrics answered 500
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port: {self.port} is not a TCP port")
        if self.api_key is not None and (problem := bearer_key_problem(self.api_key)) is not None:
            # empty: an unset secret, `--api-key "$KEY"` with KEY unset (served without any key); a Kubernetes
            # secret from `kubectl create secret --from-file` (its newline): every request was a 401
            raise ConfigError(f"api_key {problem}")
        _positive("max_sessions", self.max_sessions)
        # durations, one rule (shared.cli_exit.duration_problem): a number of seconds up to what the wire's int32 of
        # milliseconds carries (Welcome.limits, Drain.grace_ms: nan / inf / larger failed the drain itself, a SIGTERM
        # then left the server draining for ever; an infinite handshake deadline or stall watchdog never fired), from
        # a millisecond - a drain from 0 (open requests end at once), the stall watchdog from ENGINE_STALL_MIN_S
        for name, least in (("session_grace_s", MIN_DURATION_S), ("step_timeout_s", MIN_DURATION_S),
                            ("drain_timeout_s", 0.0), ("engine_stall_s", ENGINE_STALL_MIN_S),
                            ("handshake_timeout_s", MIN_DURATION_S)):
            if (problem := duration_problem(getattr(self, name), least)) is not None:
                raise ConfigError(f"{name} {problem}")
        if self.keys_file is not None:
            self.keys_file = user_path(self.keys_file)
            if self.api_key is not None:
                raise ConfigError("keys_file and api_key: give one (the keys file holds every tenant's key)")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ConfigError("ssl_certfile and ssl_keyfile go together (TLS needs the certificate and its key)")
        for name in ("ssl_certfile", "ssl_keyfile"):
            if getattr(self, name) is not None:
                setattr(self, name, user_path(getattr(self, name)))
        for name in ("max_connections", "max_http_requests"):
            _positive(name, getattr(self, name))
        self.allowed_hosts, self.allowed_origins = names(self.allowed_hosts), names(self.allowed_origins)
        for name, problem in (("allowed_hosts", hosts_problem(self.allowed_hosts)),
                              ("allowed_origins", origins_problem(self.allowed_origins))):
            if problem is not None:
                raise ConfigError(f"{name}: {problem}")
        if self.max_prompt_tokens is not None:
            _positive("max_prompt_tokens", self.max_prompt_tokens)
            ecfg = self.engine
            if self.max_prompt_tokens > ecfg.max_context:  # the pool bounds a request too (EngineConfig.max_context)
                # over the pool (--num-blocks 4 --block-size 16 --max-prompt-tokens 200) it was served and sent in
                # Welcome.limits beside a max_context of 64: a limit no prompt could reach, every prompt over 63
                # refused as over the context the operator had not set
                bound = (f"max_model_len ({ecfg.max_model_len})" if ecfg.max_context == ecfg.max_model_len else
                         f"the KV pool's {ecfg.max_context} positions (num_blocks {ecfg.num_blocks} x block_size "
                         f"{ecfg.block_size}, below max_model_len {ecfg.max_model_len})")
                raise ConfigError(f"max_prompt_tokens ({self.max_prompt_tokens}) must be <= {bound}: a prompt also "
                                  "has to fit the context")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"workers must be >= 1 and <= {MAX_WORKERS} (got {self.workers})")
        if self.loop not in LOOPS:
            raise ConfigError(f"loop must be one of {', '.join(LOOPS)} (got {self.loop!r})")
        if self.loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
            raise ConfigError("loop: uvloop is not installed (pip install uvloop, or --loop asyncio)")
        if self.workers > 1:
            if self.bundle is None:
                raise ConfigError("workers > 1 serves split mode (a BUNDLE); full-model mode runs in one process")
            if self.more_bundles:
                raise ConfigError("workers > 1 serves one bundle; run one server per bundle (or --workers 1)")
            if self.engine.tp > 1:
                raise ConfigError("workers > 1 runs with tp 1 (front-end workers beside tensor parallelism are "
                                  "not built)")
            for name in ("max_connections", "max_http_requests"):  # divided between the workers, each at least 1:
                if getattr(self, name) < self.workers:  # --max-connections 2 --workers 8 let 8 in
                    raise ConfigError(f"{name} ({getattr(self, name)}) must be >= workers ({self.workers}): it is "
                                      "divided between them, each worker taking at least one")

    @property
    def browsers(self) -> BrowserPolicy:
        """The hosts and web pages served (``allowed_hosts``, ``allowed_origins`` where it listens)."""
        return BrowserPolicy.serving(self.host, self.allowed_hosts, self.allowed_origins)

    @property
    def prompt_limit(self) -> int:
        """Prompt positions a request may fill: ``max_prompt_tokens``, else the engine's ``max_model_len``."""
        return self.engine.max_model_len if self.max_prompt_tokens is None else self.max_prompt_tokens

    @property
    def mode(self) -> str:
        return "split" if self.bundle is not None else "full"
