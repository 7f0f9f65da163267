"""``autoglm-cloud``: the cloud server's command line.

``autoglm-cloud serve BUNDLE [BUNDLE ...]`` serves bundles' cloud halves (split mode; several: one engine per
bundle id); ``autoglm-cloud serve --full SOURCE`` serves a whole model OpenAI-compatibly (preset, checkpoint
directory or .gguf).

Every option has an environment twin ``AUTOGLM_CLOUD_<NAME>`` (``--max-sessions`` ->
``AUTOGLM_CLOUD_MAX_SESSIONS``; the bundle is ``AUTOGLM_CLOUD_BUNDLE``) and may also come from a config
file (``--config FILE``, JSON or TOML, keys as the option names with ``_``). Precedence: command line >
environment > config file > built-in default.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from cloud_server.config import ConfigError, EngineConfig, ServerConfig
from shared.json_keys import unique_keys
from shared.user_paths import user_path

ENV_PREFIX = "AUTOGLM_CLOUD_"
# what full-model mode has none of (phones' split sessions, their resume grace, the bundle's cloud drafter): given
# with --full, each was accepted and ignored
SPLIT_ONLY = ("max_sessions", "session_grace_s", "cloud_drafts")
LOG_LEVELS = ("debug", "info", "warning", "error")


def _bool(text: str) -> bool:
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {text!r}")


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # flag without dashes, with "_"; also the config-file key and the env suffix (upper-cased)
    kind: type  # str | int | float | bool
    target: str  # "server" or "engine": which dataclass field it sets
    help: str


# the helps too long for a table row (one row per option: the table stays a plain list)
_VARIANTS_HELP = ("compute variants, comma-separated: auto, fp32, bf16, fp16, int8; the first is the default "
                  "(default auto = fp32 on CPU, bf16 on CUDA)")
_CHUNK_WHILE_DECODING_HELP = ("while sequences decode, a step holds at most max-num-seqs + this many positions (prompt "
                               "chunks get what the decode rows leave, at least this many); 0: the whole budget")
_FAST_PATH_HELP = ("the hand-written GLM layers for GLM float variants, tp 1 or 2 (default: on CUDA; --fast-path: "
                   "on the CPU too; --no-fast-path: never)")
_KV_CACHE_DTYPE_HELP = ("KV pool storage: auto (the compute dtype), int8 or fp8 (8-bit keys and values, a scale per "
                        "token and head: -48 %% bytes vs bf16), int8v (keys in the compute dtype, int8 values: -24 %%, "
                        "the 16-bit pool's quality); the fast path and the generic runner")
_ALLOWED_HOSTS_HELP = ("Host names a request may name besides loopback ones and --host, comma-separated; * any "
                       "(default: none, any when --host is beyond loopback): a page whose name was rebound to this "
                       "address (DNS rebinding) is refused")
_ALLOWED_ORIGINS_HELP = ("web pages whose requests are served, with CORS: origins (scheme://host[:port]), "
                         "comma-separated; * any (default: none: apps, which send no Origin, only)")
_WORKERS_HELP = ("WebSocket front-end processes feeding the one engine process (split mode; 1: one process "
                 "serves both; at most 256)")

OPTIONS = (  # help without "(default ...)" gets the dataclass default appended (build_parser)
    Option("full", str, "server", "full-model mode: serve this model whole (preset, checkpoint dir or .gguf)"),
    Option("host", str, "server", "listen address"),
    Option("port", int, "server", "listen port"),
    Option("api_key", str, "server", "require 'Authorization: Bearer KEY' on the API and the WebSocket"),
    Option("max_sessions", int, "server", "open split sessions before new ones are refused with 1013"),
    Option("session_grace_s", float, "server", "seconds a disconnected session keeps its KV for Resume"),
    Option("step_timeout_s", float, "server", "abort a request whose edge sends nothing for this long"),
    Option("drain_timeout_s", float, "server", "on shutdown, seconds open requests may finish"),
    Option("engine_stall_s", float, "server", "an engine step running this long (at least 1 s) is a wedged engine: "
                                              "the server stops (exit 1), to be restarted"),
    Option("model_name", str, "server", "model id reported by /v1/models (default: bundle or source name)"),
    Option("keys_file", str, "server", "API keys file (`autoglm-cloud keys add`): hashes, reloaded on change"),
    Option("open_probes", bool, "server", "serve /health, /ready and /metrics without a key"),
    Option("ssl_certfile", str, "server", "TLS certificate chain (PEM): serve https:// and wss://"),
    Option("ssl_keyfile", str, "server", "TLS private key (PEM), with --ssl-certfile"),
    Option("handshake_timeout_s", float, "server", "close a socket without a whole request head, a WebSocket "
           "without Hello, or a request whose body stops arriving (408) within this"),
    Option("max_connections", int, "server", "open WebSockets and HTTP requests before 503 (probes aside)"),
    Option("max_http_requests", int, "server", "HTTP /v1 requests in flight before 429 + Retry-After"),
    Option("allowed_hosts", str, "server", _ALLOWED_HOSTS_HELP),
    Option("allowed_origins", str, "server", _ALLOWED_ORIGINS_HELP),
    Option("max_prompt_tokens", int, "server", "prompt positions per request (default: --max-model-len)"),
    Option("workers", int, "server", _WORKERS_HELP),
    Option("loop", str, "server", "event loop of every front end, as uvicorn's --loop: auto (uvloop when "
                                  "installed), asyncio or uvloop"),
    Option("tp", int, "engine", "tensor-parallel ranks: 1 or 2"),
    Option("device", str, "engine", "cpu or cuda (default: cuda if available)"),
    Option("variants", str, "engine", _VARIANTS_HELP),
    Option("num_blocks", int, "engine", "KV blocks per variant, preallocated"),
    Option("block_size", int, "engine", "tokens per KV block and prefix-cache granularity"),
    Option("max_num_seqs", int, "engine", "sequences per forward pass"),
    Option("max_num_batched_tokens", int, "engine", "token budget of one engine step"),
    Option("prefill_chunk_while_decoding", int, "engine", _CHUNK_WHILE_DECODING_HELP),
    Option("max_model_len", int, "engine", "positions per sequence: prompt + generated"),
    Option("enable_prefix_cache", bool, "engine", "share KV of common prefixes across sessions"),
    Option("async_scheduling", bool, "engine", "launch each engine step before postprocessing the last one"),
    Option("batch_invariant", bool, "engine", "compute each sequence's attention on its own, so a token's result "
           "does not depend on who shares its step (default: on for cpu, off for cuda)"),
    Option("fast_path", bool, "engine", _FAST_PATH_HELP),
    Option("kv_cache_dtype", str, "engine", _KV_CACHE_DTYPE_HELP),
    Option("cloud_drafts", int, "engine", "most drafts proposed per token when the bundle has a cloud drafter "
                                          "(`autoglm-partition draft-head --cloud`) and the edge asks; 0: off"),
)


def _load_file(path: str, label: str) -> dict:
    """The options of the config file ``path``; its errors start with ``label``, the file as it was given (``--config
    FILE`` or ``AUTOGLM_CLOUD_CONFIG=FILE``)."""
    p = user_path(path)
    if not p.is_file():
        raise ConfigError(f"{label}: {'not a file' if p.exists() else 'no such file'}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{label}: cannot read ({e})") from None
    if p.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ConfigError(f"{label}: TOML needs Python 3.11+; use JSON") from None
        parse = tomllib.loads  # a key given twice is TOML's own error
    else:
        parse = functools.partial(json.loads, object_pairs_hook=unique_keys)
    try:
        data = parse(text)
    except Exception as e:  # noqa: BLE001 - json / toml errors
        raise ConfigError(f"{label}: cannot parse ({type(e).__name__}: {e})".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: expected a table/object of options")
    known = {o.name for o in OPTIONS} | {"bundle"}
    unknown = sorted(set(data) - known)
    if unknown:
        hint = [f"{k} -> {k.replace('-', '_')}" for k in unknown if k.replace("-", "_") in known]
        raise ConfigError(f"{label}: unknown option(s) {', '.join(unknown)}"
                          + (f" (keys are spelt with _: {', '.join(hint)})" if hint else ""))
    return data


def _help(o: Option) -> str:
    """``o.help`` with its dataclass field's default appended, unless the help states its own or there is none."""
    field = {f.name: f for f in dataclasses.fields(ServerConfig if o.target == "server" else EngineConfig)}[o.name]
    if "(default" in o.help or field.default in (None, dataclasses.MISSING):
        return o.help
    value = field.default
    text = str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else value
    return f"{o.help} (default {text})"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="autoglm-cloud", description="The autoglm-split cloud server.")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("keys", help="manage the API keys file: `autoglm-cloud keys add FILE --tenant NAME`")
    h = sub.add_parser("health", help="exit 0 if the server process answers /health where its own options put it",
                       description="Is the `autoglm-cloud serve` process PID answering /health where its command line, "
                                   "environment and --config file put it (port, host, TLS, --api-key)? Exit 0 if so, "
                                   "else 1 with one line saying why. The image's HEALTHCHECK (deploy/Dockerfile).")
    h.add_argument("--pid", type=int, default=1, help="the server process (default 1: a container's main process)")
    s = sub.add_parser("serve", help="serve a bundle's cloud half (split mode) or a whole model (--full)",
                       description=__doc__.replace("``", "`"), formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("bundle", nargs="*", help="bundle directory written by `autoglm-partition split`; several: "
                                             "each bundle id gets its own engine (the first is the default), a "
                                             "repeated id is an edge variant offered for download at /v1/bundles "
                                             f"[env {ENV_PREFIX}BUNDLE: one directory]")
    s.add_argument("--config", help=f"JSON or TOML file of options [env {ENV_PREFIX}CONFIG]")
    for o in OPTIONS:
        flag = "--" + o.name.replace("_", "-")
        env = ENV_PREFIX + o.name.upper()
        if o.kind is bool:
            s.add_argument(flag, dest=o.name, action=argparse.BooleanOptionalAction, default=None,
                           help=f"{_help(o)} [env {env}]")
        else:
            s.add_argument(flag, dest=o.name, type=o.kind, default=None, help=f"{_help(o)} [env {env}]")
    s.add_argument("--log-level", choices=LOG_LEVELS,
                   help="server log level (default info; env or command line only, not --config) "
                        f"[env {ENV_PREFIX}LOG_LEVEL]")
    return ap


def resolve(args: argparse.Namespace, environ: dict[str, str] | None = None,
            overridden: list[str] | None = None) -> ServerConfig:
    """Merge command line, environment and config file into a validated :class:`ServerConfig`. ``overridden``
    collects, for a warning, each config-file value that a variable set otherwise: the image's
    ``AUTOGLM_CLOUD_PORT`` (deploy/Dockerfile) beat a ``--config`` file's port without a word."""
    env = os.environ if environ is None else environ
    if args.config == "":  # `--config "$CFG"` with CFG unset served without the file's options (its keys file: none)
        raise ConfigError("--config is empty (an unset variable?): give the file, or leave the option out")
    cfg_path = args.config or env.get(ENV_PREFIX + "CONFIG")
    cfg_label = f"--config {cfg_path}" if args.config else f"{ENV_PREFIX}CONFIG={cfg_path}"
    file = _load_file(cfg_path, cfg_label) if cfg_path else {}
    server: dict = {}
    engine: dict = {}
    origin: dict[str, str] = {}  # option -> the variable or file it came from (not the command line)

    def pick(name: str, kind: type, cli_value):
        if cli_value is not None:
            return cli_value
        raw = env.get(ENV_PREFIX + name.upper())
        # an empty variable is unset, except the API key: an empty one (a Kubernetes secret made from an unset
        # shell variable) served without any key, silently; ServerConfig refuses it
        if raw is not None and (raw != "" or name == "api_key"):
            origin[name] = ENV_PREFIX + name.upper()
            try:
                value = _bool(raw) if kind is bool else kind(raw)
            except ValueError as e:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r}: {e}") from None
            if name in file and file[name] != value and overridden is not None:
                overridden.append(f"{ENV_PREFIX}{name.upper()}={raw} overrides {name} = {json.dumps(file[name])} of "
                                  f"{cfg_label} (command line > environment > config file)")
            return value
        if name in file:
            origin[name] = cfg_label
            value = file[name]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ConfigError(f"config file: {name} must be {kind.__name__}, got {type(value).__name__}")
            return value
        return None

    bundles = list(args.bundle or [])
    if not bundles:
        first = pick("bundle", str, None)
        bundles = [first] if first is not None else []
    if bundles:
        server["bundle"], server["more_bundles"] = bundles[0], tuple(bundles[1:])
    for o in OPTIONS:
        value = pick(o.name, o.kind, getattr(args, o.name))
        if value is not None:
            (server if o.target == "server" else engine)[o.name] = value
    if "device" not in engine:
        engine["device"] = _default_device()
    try:
        if "full" in server and (given := [name for name in SPLIT_ONLY if name in server or name in engine]):
            raise ConfigError(f"{', '.join(given)}: split mode's, given with full (full-model mode has no split "
                              "sessions nor cloud drafts); leave it unset")
        return ServerConfig(engine=EngineConfig(**engine), **server)
    except ConfigError as e:  # "keys_file and api_key: give one" left the operator hunting for an api_key never typed
        named = [f"{name} from {where}" for name, where in origin.items() if re.search(rf"\b{name}\b", str(e))]
        if not named:
            raise
        raise ConfigError(f"{e} [{'; '.join(named)}]") from None


def unknown_variables(environ: dict[str, str] | None = None) -> list[str]:
    """``AUTOGLM_CLOUD_*`` variables that name no option, each with the nearest one's name when there is one: a
    typo (``AUTOGLM_CLOUD_API_KEYS``) was ignored without a word - there, a server without a key."""
    import difflib

    env = os.environ if environ is None else environ
    known = [name.upper() for name in [o.name for o in OPTIONS] + ["bundle", "config", "log_level"]]
    out = []
    for name in sorted(k for k in env if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX):] not in known):
        near = difflib.get_close_matches(name[len(ENV_PREFIX):], known, n=1)
        out.append(f"{name} (did you mean {ENV_PREFIX}{near[0]}?)" if near else name)
    return out


def log_level(args: argparse.Namespace, environ: dict[str, str] | None = None) -> str:
    """``--log-level``, else ``AUTOGLM_CLOUD_LOG_LEVEL`` (any case; empty is unset, as for every twin), else info.
    The variable was taken unchecked: ``verbose`` or an empty value was a ValueError traceback from logging."""
    if args.log_level is not None:
        return args.log_level
    raw = (os.environ if environ is None else environ).get(ENV_PREFIX + "LOG_LEVEL", "")
    if not raw:
        return "info"
    if raw.strip().lower() not in LOG_LEVELS:
        raise ConfigError(f"{ENV_PREFIX}LOG_LEVEL={raw!r}: expected one of {', '.join(LOG_LEVELS)}")
    return raw.strip().lower()


def _default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover
        return "cpu"


def serve(config: ServerConfig, log_level: str = "info") -> int:
    """Serve until drained; returns the exit status."""
    from cloud_server.limits import raise_open_files

    if (short := raise_open_files(config.max_connections)) is not None:  # (the workers inherit the raised limit)
        logging.getLogger("autoglm.cloud").warning("%s", short)
    if config.workers > 1:  # the engine here, the WebSocket front ends in worker processes
        from cloud_server.front_workers import serve_workers

        return serve_workers(config, log_level)
    from cloud_server.app import DrainingServer, create_app, uvicorn_config
    from cloud_server.auth import install_sighup
    from cloud_server.runtime import CloudRuntime

    loaded = None
    if config.full is not None:  # loaded here, not in the app's startup: uvicorn logs a failure there as a
        from partition_tools.models import ModelLoadError, load_model  # traceback and exits 3

        try:
            loaded = load_model(config.full)
        except ModelLoadError as e:
            print(f"autoglm-cloud: error: --full {e}", file=sys.stderr)
            return 2
    app = create_app(CloudRuntime(config, loaded), owns_runtime=True)
    install_sighup(app.state.auth.store)  # `kill -HUP` reloads the keys file
    server = DrainingServer(uvicorn_config(app, config, log_level), app)
    # a signal outside uvicorn's handling (after its shutdown, before the process ends) is noted, not a
    # KeyboardInterrupt through asyncio's runner and the app's lifespan (a traceback in the log)
    late: list[int] = []
    previous = {s: signal.signal(s, lambda sig, _frame: late.append(sig)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if server.interrupted or late:  # a second Ctrl-C / SIGTERM cut the drain short, or came after it
        print("interrupted", file=sys.stderr)
        return 130
    if server.engine_failed:  # stopped to be restarted (cloud_server.app.DrainingServer logged why)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``autoglm-cloud``; Ctrl-C where the server does not take it as a drain (while the command starts, before
    it serves) ends as every console script's does (``shared.cli_exit``): ``interrupted``, exit 130. So does a
    SIGTERM then: as a container's PID 1 the process ignored it (the default disposition), so a pod stopped while
    its server loaded and hashed its bundle waited out its whole grace period for the SIGKILL. Run as the
    console script (``argv`` None) it ends the process itself once the command is done (:func:`_exit_now`)."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # serving, uvicorn's handler drains instead
        from shared.cli_exit import sigterm_unwinds

        sigterm_unwinds()
    from cloud_server.auth import hold_sighup

    hold_sighup()  # until serve() installs its reload (cloud_server.auth.install_sighup)
    try:
        code = _main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if argv is None:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process with ``code`` after the exit handlers, without the interpreter's teardown. That teardown
    (torch's and onnxruntime's native finalizers: about a second on two cores) ran with the default signal
    dispositions back, so a second SIGTERM shortly after a drain with nothing open ended the process by the signal
    (status 143, no message) where the docs say a second signal ends it ``interrupted``, exit 130; until the end
    a Ctrl-C / SIGTERM now does that (one this process ignores, a background job's SIGINT, stays ignored). As
    ``cloud_server.tp.exit_rank`` ends a rank; with a thread still running, the usual exit joins it instead."""
    import atexit
    import threading

    def end(_sig, _frame):
        with contextlib.suppress(Exception):  # os._exit flushes nothing
            sys.stdout.flush()
        print("interrupted", file=sys.stderr, flush=True)
        os._exit(130)

    for s in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, end)
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()  # logging's flush among them
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keys"]:  # `autoglm-cloud keys add FILE --tenant T`: the keys file's own small CLI
        from cloud_server.auth import keys_main

        return keys_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "health":  # the image's HEALTHCHECK
        from cloud_server.health_check import main as health_main

        return health_main(args.pid)
    try:
        args.log_level = log_level(args)
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if unknown := unknown_variables():  # warned, not refused: the environment is shared with other programs
            logging.getLogger("autoglm.cloud").warning("ignoring unknown variable(s): %s", ", ".join(unknown))
        overridden: list[str] = []
        config = resolve(args, overridden=overridden)
        for line in overridden:  # the operator's file says otherwise: it may be the one they meant
            logging.getLogger("autoglm.cloud").warning("%s", line)
    except ConfigError as e:
        print(f"autoglm-cloud: error: {e}", file=sys.stderr)
        return 2
    for bundle in [config.bundle, *config.more_bundles] if config.bundle is not None else []:
        try:
            missing = not (Path(bundle) / "manifest.json").is_file()
        except OSError:  # a folder it may not enter (a PermissionError traceback): the manifest's load names it
            missing = False
        if missing:
            print(f"autoglm-cloud: error: {bundle}: not a bundle (no manifest.json)", file=sys.stderr)
            return 2
    for name in ("ssl_certfile", "ssl_keyfile", "keys_file"):
        path = getattr(config, name)
        if path is not None and not Path(path).is_file():
            print(f"autoglm-cloud: error: --{name.replace('_', '-')} {path}: "
                  f"{'not a file' if Path(path).exists() else 'no such file'}", file=sys.stderr)
            return 2
    problem = _startup_problem(config)
    if problem:
        print(f"autoglm-cloud: error: {problem}", file=sys.stderr)
        return 2
    if config.ssl_certfile is not None and (dates := _certificate_dates_problem(config)) is not None:
        # served all the same (a clock a minute behind a fresh certificate's start is no reason to refuse), but
        # every verifying client will fail its handshake until the certificate is renewed or its time comes
        logging.getLogger("autoglm.cloud").warning("--ssl-certfile %s: %s: clients that verify it will refuse "
                                                   "every connection", config.ssl_certfile, dates)
    return serve(config, args.log_level)


def _device_problem(device: str, tp: int = 1) -> str | None:
    """``--device cuda`` (device 0) or ``cuda:N`` that this host does not have, or with ``--tp`` above 1 a device
    a rank runs on (rank r on ``cuda:r``: ``cloud_server.tp.rank_device``) that it does not have; else None."""
    if not device.startswith("cuda"):
        return None
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0

    def missing(name: str) -> bool:
        suffix = name.partition(":")[2]
        index = 0 if not suffix else int(suffix) if suffix.isdigit() else -1
        return not 0 <= index < count

    if missing(device):
        return f"--device {device}: no such CUDA device ({count} visible)"
    if tp > 1:
        from cloud_server.tp import rank_device

        for rank in range(tp):
            if missing(rank_device(device, rank)):
                return (f"--tp {tp}: rank {rank} runs on {rank_device(device, rank)}: no such CUDA device "
                        f"({count} visible)")
    return None


def _startup_problem(config) -> str | None:
    """What would stop the server while it starts, found before it does: a certificate and key that do not load
    as a pair (a passphrase-protected key is refused, not prompted for), a --full source that names nothing or a
    .gguf cut short, a
    bundle whose manifest does not load or whose cloud files are missing, truncated or not the manifest's (their
    sha256: found by the runtime's load, which re-hashes them, each was a traceback), one bundle directory given
    twice (or two of one bundle id and edge variant), several bundles with --tp 2, a KV pool larger than the device
    (a bundle's, a --full model's whose config is known without its weights), and a --host/--port it cannot listen
    on."""
    from cloud_server.auth import KeyStore, KeysFileError
    from shared.manifest import BundleError, Manifest

    ecfg = config.engine
    try:
        ecfg.resolved_variants()  # bf16 / fp16 on a CPU
    except ConfigError as e:
        return str(e)
    if (problem := _device_problem(ecfg.device, ecfg.tp)) is not None:
        return problem
    if config.keys_file is not None:
        try:
            KeyStore(config.keys_file)
        except KeysFileError as e:
            return f"--keys-file {e}"
    for bundle in [config.bundle, *config.more_bundles] if config.bundle is not None else []:
        try:
            manifest = Manifest.load(bundle)
            manifest.verify_files(bundle, roles=("cloud", "shared"))  # hashed: a same-size swap or bit rot too
        except BundleError as e:
            return str(e)
        layers = manifest.num_layers - manifest.split_layer - manifest.tail_layers
        if (problem := _kv_pool_problem(ecfg, layers, manifest.num_kv_heads, manifest.head_dim)) is not None:
            return problem
    if config.bundle is not None:  # the download catalog refused a repeated (bundle, edge variant) after the load
        from cloud_server.bundle_files import BundleCatalog

        try:
            catalog = BundleCatalog([config.bundle, *config.more_bundles], config.model_name)
        except BundleError as e:
            return str(e)
        if len(catalog.ids) > 1 and ecfg.tp > 1:  # BundleSet's rule: a ConfigError traceback after the load
            return ("several bundles in one process run without tensor parallelism (tp 1); run one replica per "
                    "bundle for tp 2")
    if config.ssl_certfile is not None:
        import ssl

        class Encrypted(Exception):
            """The key asked for a passphrase (a server that prompted for one would never start unattended)."""

        def no_passphrase():
            raise Encrypted

        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                config.ssl_certfile, config.ssl_keyfile, password=no_passphrase)
        except Encrypted:  # (raised as ssl.SSLError, its message read "(('the key is ...',))")
            return f"--ssl-keyfile {config.ssl_keyfile}: the key is passphrase-protected (give an unencrypted key)"
        except OSError as e:  # ssl.SSLError too
            if getattr(e, "reason", None) == "KEY_VALUES_MISMATCH":  # both load: the key of another certificate
                return (f"--ssl-keyfile {config.ssl_keyfile} is not the key of the certificate in --ssl-certfile "
                        f"{config.ssl_certfile} ({e})")
            return (f"--ssl-certfile {config.ssl_certfile} / --ssl-keyfile {config.ssl_keyfile}: not a PEM "
                    f"certificate and its key ({e})")
    if config.full is not None:
        from partition_tools.adapters import head_dim_of, kv_heads_of, text_config
        from partition_tools.models import ModelLoadError, check_source, source_config

        try:
            check_source(config.full)
            model_config = source_config(config.full)
        except ModelLoadError as e:
            return f"--full {e}"
        if model_config is not None:  # a GGUF's comes with its load
            text = text_config(model_config)
            if (problem := _kv_pool_problem(ecfg, text.num_hidden_layers, kv_heads_of(text), head_dim_of(text))):
                return problem
    from shared.cli_exit import listen_problem

    return listen_problem(config.host, config.port)  # last: the checks above name their own flags



def _certificate_dates_problem(config) -> str | None:
    """OpenSSL's "certificate has expired" / "certificate is not yet valid" when now is outside the served
    certificate's dates, else None. The standard library reads no certificate file's dates (only a private
    helper does), so this runs a TLS handshake in memory between the certificate and a client trusting exactly it
    (``VERIFY_X509_PARTIAL_CHAIN``: the leaf as its own anchor), whose verification checks the dates."""
    import ssl

    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)  # loaded once already (_startup_problem)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.load_verify_locations(config.ssl_certfile)
    client.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    ends = ((client.wrap_bio(c_in, c_out), c_out, s_in), (server.wrap_bio(s_in, s_out, server_side=True), s_out, c_in))
    for _ in range(8):  # TLS 1.3 needs two round trips
        done = 0
        for conn, out, peer in ends:
            try:
                conn.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLCertVerificationError as e:  # X509_V_ERR_CERT_NOT_YET_VALID, X509_V_ERR_CERT_HAS_EXPIRED
                return e.verify_message if e.verify_code in (9, 10) else None
            except ssl.SSLError:  # any other failure is not about the dates (the pair loaded)
                return None
            peer.write(out.read())
        if done == 2:
            return None
    return None


def _kv_pool_problem(ecfg, layers: int, kv_heads: int, head_dim: int) -> str | None:
    """A KV pool of ``layers`` (the served ones: a bundle's back half, a --full model's all) that cannot fit the
    device's whole memory at its least (one byte an element: int8 / fp8 keys and values; every other storage is
    larger): ``2 * layers * num_blocks * block_size * kv_heads * head_dim`` bytes per variant; else None. Its
    allocation failed in the app's startup, a traceback and exit 3 after the load."""
    pool = 2 * max(layers, 0) * ecfg.num_blocks * ecfg.block_size * kv_heads * head_dim
    memory = _device_memory_bytes(ecfg.device)
    if memory and pool > memory:
        return (f"--num-blocks {ecfg.num_blocks} x --block-size {ecfg.block_size}: the KV pool needs at least "
                f"{pool / 2**30:.1f} GiB per variant, more than this {ecfg.device}'s {memory / 2**30:.1f} GiB")
    return None


def _device_memory_bytes(device: str) -> int | None:
    """The device's whole memory (host RAM for the CPU); None where unknown."""
    try:
        if device.startswith("cuda"):
            import torch

            return torch.cuda.get_device_properties(torch.device(device)).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None


if __name__ == "__main__":
    sys.exit(main())
