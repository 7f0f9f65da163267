"""``autoglm-edge``: chat with a split model, serve it as a local OpenAI endpoint, or run the demo.

    autoglm-edge chat  --bundle B --url ws://HOST:PORT/v1/split [--api-key K] [--thinking] [--speculate]
    autoglm-edge serve --bundle B --url ws://... [--port 8001] [--preload prompts.txt] [--speculate]
    autoglm-edge preload --bundle B --cache-dir D prompts.txt
    autoglm-edge preload --bundle B --url ws://... --update      (download the server's bundle if it moved)
    autoglm-edge demo

Flags mirror :class:`~edge_client.config.EdgeConfig` fields and have environment twins
(``AUTOGLM_BUNDLE``, ``AUTOGLM_URL``, ``AUTOGLM_API_KEY``, ``AUTOGLM_EDGE_<FIELD>``). Errors print one line
and exit with status 2 (bad input) or 1 (failure at run time).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

from shared.cli_exit import not_utf8, shown


def port_number(text: str) -> int:
    """argparse type of a TCP port to listen on: 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535)")
    return port


def _config_flags(p: argparse.ArgumentParser, need_url: bool = True) -> None:
    g = p.add_argument_group("edge runtime (env: AUTOGLM_EDGE_<FIELD>)")
    g.add_argument("--bundle", type=Path, help="bundle directory (env AUTOGLM_BUNDLE)")
    if need_url:
        g.add_argument("--url", help="the cloud's base URL ws://host:port (an OpenAI base_url's http(s):// is "
                                     "ws(s)://), or its split endpoint ws://host:port/v1/split (default "
                                     "ws://127.0.0.1:8000; env AUTOGLM_URL)")
        g.add_argument("--api-key", help="cloud API key (env AUTOGLM_API_KEY)")
        g.add_argument("--ca-file", type=Path, help="wss://: trust the CAs in this PEM file (default: the system "
                                                    "store or SSL_CERT_FILE; env AUTOGLM_EDGE_CA_FILE)")
        g.add_argument("--auto-update", action=argparse.BooleanOptionalAction, default=None,
                       help="when the cloud serves another bundle of this model, download it and switch "
                            "(default off; env AUTOGLM_EDGE_AUTO_UPDATE)")
        g.add_argument("--reconnect-window-s", type=float,
                       help="keep retrying an unreachable cloud (a dropped link, a server restarting) this many "
                            "seconds before a request fails (default 90; env AUTOGLM_EDGE_RECONNECT_WINDOW_S). A "
                            "client that never reached the cloud gives up after 10 s (env "
                            "AUTOGLM_EDGE_FIRST_CONNECT_WINDOW_S)")
    g.add_argument("--threads", type=int, help="onnxruntime threads for the front layers (1 to 256, default 2)")
    g.add_argument("--prefill-chunk", type=int, help="prompt tokens per front forward (default 128)")
    g.add_argument("--codec", help="wire codec for hidden states (default: the server's precision plan)")
    g.add_argument("--cache-dir", help="persist the activation cache here (default: memory only)")
    g.add_argument("--cache-max-bytes", type=int, help="activation cache bound in bytes (default 512 MiB)")
    g.add_argument("--cache-reserve-bytes", type=int,
                   help="free space the --cache-dir's disk keeps: the cache evicts its oldest blocks, else keeps new "
                        "ones in memory, rather than take it (default 256 MiB; the larger of this and "
                        "--cache-reserve-fraction is kept)")
    g.add_argument("--cache-reserve-fraction", type=float,
                   help="free space the --cache-dir's disk keeps, as a fraction of its size (default 0.05)")
    g.add_argument("--cache-memory-bytes", type=int,
                   help="activation cache blocks held in memory, in bytes: past it the oldest are read again from "
                        "--cache-dir on their next use, or evicted where they are in memory only (default 32 MiB)")
    g.add_argument("--preload", type=Path, action="append", default=[],
                   help="common prompts to cache first (.txt: one system prompt; .jsonl/.json: several)")


def _config(args):
    from .config import EdgeConfig

    return EdgeConfig.from_env(bundle=args.bundle, url=getattr(args, "url", None),
                               api_key=getattr(args, "api_key", None), ca_file=getattr(args, "ca_file", None),
                               auto_update=getattr(args, "auto_update", None),
                               reconnect_window_s=getattr(args, "reconnect_window_s", None),
                               speculate=getattr(args, "speculate", None),
                               threads=args.threads,
                               prefill_chunk=args.prefill_chunk, codec=args.codec, cache_dir=args.cache_dir,
                               cache_max_bytes=args.cache_max_bytes, cache_reserve_bytes=args.cache_reserve_bytes,
                               cache_reserve_fraction=args.cache_reserve_fraction,
                               cache_memory_bytes=args.cache_memory_bytes)


def _client(args):
    from .client import EdgeClient

    client = EdgeClient(_config(args))
    try:
        _preload(client, args.preload, lambda path, n: print(f"preloaded {path}: {n} tokens cached", file=sys.stderr))
    except BaseException:
        client.close()
        raise
    return client


def _preload(client, paths: list, report, saved: bool = False) -> None:
    """Cache ``paths``' prompts, then ``report(path, tokens)`` what the cache holds of each once all are in (not what
    went in: a ``cache_max_bytes`` too small for them all evicts earlier files' blocks as later ones go in, as does a
    ``cache_memory_bytes`` where the blocks are held in memory only); EdgeClientError ``cache_too_small``, naming the
    bound, when it holds less than went in. ``saved``: a cache directory must have kept
    each file (``cache_unwritable``)."""
    from .errors import EdgeClientError

    cached = []
    for path in paths:
        cached.append(client.preload_prompts(path))
        if saved and client.cache.write_error is not None:  # cached in this process's memory only: nothing was kept
            raise EdgeClientError(f"{path}: the activation cache was not saved: {client.cache.write_error}",
                                  "cache_unwritable")
    held = [client.preloaded_tokens(path) for path in paths]  # what the bound kept, not what went in
    for path, n in zip(paths, held):
        report(path, n)
    if sum(held) < sum(cached):
        bounds = [("--cache-max-bytes", client.config.cache_max_bytes)]
        if client.cache.dir is None or client.cache.write_error is not None:  # blocks in memory only: its bound too
            bounds.append(("--cache-memory-bytes", client.config.cache_memory_bytes))
        flag, bound = min(bounds, key=lambda b: b[1])
        raise EdgeClientError(f"{flag} {bound} holds {sum(held)} of the "
                              f"{sum(cached)} tokens preloaded: later prompts' blocks evicted earlier ones (raise the "
                              "bound)", "cache_too_small")


def _speculate_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculate", action=argparse.BooleanOptionalAction, default=None,
                   help="speculative decoding on every answer: drafts (prompt lookup, the server's cloud drafts, the "
                        "bundle's draft head) verified several per round trip, the same answer in fewer round trips "
                        "(default off; env AUTOGLM_EDGE_SPECULATE)")


def cmd_chat(args) -> int:
    from .request import RequestSpec

    if args.system is not None and (problem := not_utf8(args.system)) is not None:  # argv: surrogateescape
        raise ValueError(f"--system is {problem}")
    # the per-answer flags, checked before the bundle loads (the rules of every request: RequestSpec)
    RequestSpec(prompt_ids=[0], max_tokens=args.max_tokens, temperature=args.temperature, precision=args.precision)
    with _cache_said_by_command(args.verbose):
        return _chat(args)


def _chat(args) -> int:
    from shared.cli_exit import sigterm_unwinds

    from .errors import EdgeClientError

    client = _client(args)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("autoglm-edge chat: empty line or Ctrl-D quits; Ctrl-C stops an answer.", file=sys.stderr)
    status = 0  # the last turn's: 1 when it failed
    if hasattr(sys.stdin, "reconfigure"):  # a byte that is no UTF-8 is the message's problem, not the chat's end
        sys.stdin.reconfigure(errors="surrogateescape")
    sigterm_unwinds()  # a SIGTERM killed it with readline's terminal left without echo, the answer's request open
    _terminal_editing()
    cache_said = False
    try:
        while True:
            # the cache's refusal (a full or unwritable --cache-dir) on a line of its own, between answers: its
            # logged warning came in the middle of the streamed answer that cached the prompt
            if not cache_said and client.cache.write_error is not None:
                print(f"autoglm-edge chat: activation cache: {client.cache.write_error}; new blocks are kept in memory "
                      "only", file=sys.stderr)
                cache_said = True
            try:
                line = input("you> ")
            except EOFError:
                break
            if not line.strip():
                break
            if (problem := not_utf8(line)) is not None:
                print(f"autoglm-edge chat: the message is {problem}: not sent", file=sys.stderr)
                status = 1
                continue
            history.append({"role": "user", "content": line})
            # a turn that fails (too long for the context, the cloud unreachable through every retry) is said in
            # one line and dropped; the chat and its conversation go on (they ended with the process)
            try:
                gen = _answer(client, history, args)
            except (ValueError, EdgeClientError) as e:
                print(f"autoglm-edge chat: {e}", file=sys.stderr)
                history.pop()
                status = 1
                continue
            status = 0
            print()
            history.append({"role": "assistant", "content": gen.text})
            st = gen.stats
            if args.stats:
                print(f"  [{gen.finish_reason}] TTFT {1000 * (st.ttft_s or 0):.0f} ms, {st.tokens_per_s:.1f} tok/s, "
                      f"up {st.bytes_up} B, down {st.bytes_down} B, cached {st.cached_tokens} prompt tokens"
                      + (f", {st.accepted_draft_tokens} of {st.draft_tokens} drafts accepted" if st.draft_tokens else ""),
                      file=sys.stderr)
    finally:
        client.close()
    return status


def _terminal_editing() -> None:
    """On a terminal, read messages with readline and bracketed paste: a paste of several lines is one message that
    Enter sends (it was a message per line, each answered, and its first blank line ended the chat - the lines after
    it went to the user's shell, which ran them); arrow keys edit the line. A terminal that does not bracket pastes
    gets a message per line, as before; piped input is read line by line without readline."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):  # input() uses readline on a terminal only
        return
    try:
        import readline
    except ImportError:  # no readline on this platform: line by line
        return
    readline.parse_and_bind("set enable-bracketed-paste on")  # Python's readline module turns it off


def _answer(client, history: list[dict], args):
    """The finished generation answering the conversation's last message, streamed to stdout. A conversation the
    context cannot hold forgets its oldest exchanges (the system prompt stays) until it fits - once full, it failed
    every later turn; with nothing left to forget the refusal is raised, the conversation kept whole."""
    from shared.cli_exit import Terminated

    from .errors import EdgeClientError

    turns = list(history)
    while True:
        gen = None
        try:
            gen = client.generate(messages=turns, max_tokens=args.max_tokens, temperature=args.temperature,
                                  enable_thinking=args.thinking, precision=args.precision)
            print("assistant> ", end="", flush=True)
            try:
                for delta in gen:
                    print(shown(delta), end="", flush=True)  # its control characters as escapes
            except KeyboardInterrupt as e:
                gen.close()
                if isinstance(e, Terminated):  # a SIGTERM ends the chat; Ctrl-C only this answer
                    raise
            history[:] = turns
            return gen
        except (ValueError, EdgeClientError) as e:
            if gen is not None:  # after "assistant> "
                print()
            if getattr(e, "code", None) != "context_full" or not _forget_oldest_exchange(turns):
                raise
            print("autoglm-edge chat: the conversation is over the context: its oldest exchange is forgotten",
                  file=sys.stderr)


def _forget_oldest_exchange(turns: list[dict]) -> bool:
    """Drop the first user message and the answers up to the next one, never the system prompt or the message being
    asked (the last); False when there is none before it."""
    first = 1 if turns and turns[0]["role"] == "system" else 0
    end = first + 1
    while end < len(turns) - 1 and turns[end]["role"] != "user":
        end += 1
    if end >= len(turns):
        return False
    del turns[first:end]
    return True


def cmd_serve(args) -> int:
    from shared.http_limits import limit_problem
    from shared.cli_exit import duration_problem
    from shared.prefix_keys import bearer_key_problem

    from .local_api import HANDSHAKE_TIMEOUT_S, MAX_HTTP_REQUESTS, ClosingServer, create_app

    from shared.user_paths import user_path

    if args.model_name is not None and (problem := not_utf8(args.model_name)) is not None:  # every answer a 500
        raise ValueError(f"--model-name is {problem}")
    if args.media_dir == "":  # Path('') is '.': every local app could read the working directory's files
        raise ValueError("--media-dir is empty (an unset variable?): give the folder, or leave it unset to refuse "
                         "local paths")
    if args.media_dir is not None:  # AUTOGLM_EDGE_MEDIA_DIR=~/shots, --media-dir=~/shots: no shell expanded the '~'
        args.media_dir = user_path(args.media_dir)
        if not args.media_dir.is_dir():  # else every local image path is refused
            raise ValueError(f"--media-dir {args.media_dir}: not a directory")
    if args.local_api_key is not None and (problem := bearer_key_problem(args.local_api_key)) is not None:
        # empty: `--local-api-key "$KEY"` with KEY unset served every local app without a key; a secret file's
        # newline: every local request was a 401
        raise ValueError(f"--local-api-key {problem}")
    if args.handshake_timeout_s is None:
        args.handshake_timeout_s = HANDSHAKE_TIMEOUT_S
    if (problem := duration_problem(args.handshake_timeout_s)) is not None:  # before the bundle loads
        raise ValueError(f"--handshake-timeout-s {problem}")
    if args.max_http_requests is None:
        args.max_http_requests = MAX_HTTP_REQUESTS
    if (problem := limit_problem(args.max_http_requests)) is not None:
        raise ValueError(f"--max-http-requests {problem}")
    from shared.http_browsers import BrowserPolicy, hosts_problem, names, origins_problem

    hosts, origins = names(args.allowed_hosts), names(args.allowed_origins)
    for flag, problem in (("--allowed-hosts", hosts_problem(hosts)), ("--allowed-origins", origins_problem(origins))):
        if problem is not None:
            raise ValueError(f"{flag}: {problem}")
    from shared.cli_exit import listen_problem

    if (problem := listen_problem(args.host, args.port)) is not None:  # was uvicorn's bind error, exit 3
        raise ValueError(problem)
    client = _client(args)
    app = create_app(client, model_name=args.model_name, api_key=args.local_api_key, media_dir=args.media_dir,
                     fetch_urls=args.fetch_urls, handshake_timeout_s=args.handshake_timeout_s,
                     max_http_requests=args.max_http_requests,
                     browsers=BrowserPolicy.serving(args.host, hosts, origins))
    try:
        ClosingServer(app, client, host=args.host, port=args.port, log_level=args.log_level).run()
    finally:
        client.close()
    return 0


def cmd_preload(args) -> int:
    from .client import EdgeClient

    if not [*args.preload, *args.files] and not args.update:
        raise ValueError("nothing to do: give prompt files to cache (FILE ... or --preload FILE), or --update")
    cfg = _config(args)
    if args.update:
        _update(cfg)
    if not [*args.preload, *args.files]:
        return 0
    if cfg.cache_dir is None:
        raise ValueError("preload needs --cache-dir (or AUTOGLM_EDGE_CACHE_DIR): a memory cache dies with the process")
    # a directory that refuses the blocks is this command's one-line error (cache_unwritable)
    with _cache_said_by_command(args.verbose):
        client = EdgeClient(cfg)
        try:
            _preload(client, [*args.preload, *args.files], lambda path, n: print(f"{path}: {n} tokens cached in "
                                                                                 f"{cfg.cache_dir}"), saved=True)
        finally:
            client.close()
    return 0


@contextlib.contextmanager
def _cache_said_by_command(verbose: bool):
    """The activation cache's warning (a directory that refused its blocks: ``cache.write_error``) left to the
    command, which says it in its own line - preload's error, chat's line between answers - unless ``-v``: logged, for
    apps that carry on, it said the same twice, or in the middle of a streamed answer."""
    from . import activation_cache

    level = activation_cache.log.level
    if not verbose:
        activation_cache.log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        activation_cache.log.setLevel(level)  # (main() run in-process, as the tests do, leaves it as it was)


def _update(cfg) -> None:
    """Bring the bundle to the one the server serves (edge_client.bundle_sync), with a progress bar."""
    from shared.manifest import Manifest

    from . import bundle_sync
    from .errors import EdgeClientError

    bundle_sync.recover(cfg.bundle)  # a switch a crash interrupted (as EdgeClient does at its start)
    current = Manifest.load(cfg.bundle)
    bar = _Bar()
    try:
        new = bundle_sync.update(cfg, current, progress=bar)
    except bundle_sync.BundleSyncError as e:
        raise EdgeClientError(f"update: {e}", e.code) from None
    finally:
        bar.close()
    if new is None:
        print(f"{cfg.bundle}: up to date (bundle {current.bundle_id})", file=sys.stderr)
    elif new == current:  # the copy held had lost files: the server's same export came down again
        print(f"{cfg.bundle}: bundle {new.bundle_id} downloaded again (the copy held was damaged)", file=sys.stderr)
    else:
        bundle_sync.retire_cache(cfg, current, new)
        what = "another export of bundle" if new.bundle_id == current.bundle_id else "bundle"
        print(f"{cfg.bundle}: updated to {what} {new.bundle_id} (split layer {new.split_layer}, "
              f"{new.edge_quant} edge); the previous one is kept beside it", file=sys.stderr)


class _Bar:
    """tqdm over a download's (done, total) callbacks on a terminal; quiet otherwise."""

    def __init__(self):
        try:
            from tqdm import tqdm
        except ImportError:  # not an edge dependency
            tqdm = None
        self._tqdm = tqdm if tqdm is not None and sys.stderr.isatty() else None
        self._bar = None

    def __call__(self, done: int, total: int) -> None:
        if self._tqdm is None:
            return
        if self._bar is None:
            self._bar = self._tqdm(total=total, unit="B", unit_scale=True, desc="bundle", file=sys.stderr)
        self._bar.n = done
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def cmd_demo(args) -> int:
    from .demo import DEMO_PROMPT, run_demo

    from shared.cli_exit import listen_problem, sigterm_unwinds
    from shared.threads import threads_problem

    if args.prompt is not None and (problem := not_utf8(args.prompt)) is not None:
        raise ValueError(f"--prompt is {problem}")
    if args.max_tokens < 1:  # checked before minutes of building the bundle
        raise ValueError(f"--max-tokens ({args.max_tokens}) must be >= 1")
    if (problem := threads_problem(args.threads)) is not None:
        raise ValueError(f"--threads {problem}")
    if args.port is not None and (problem := listen_problem("127.0.0.1", args.port, f"--port {args.port}")):
        # taken: a traceback once its server failed to bind, or the demo ran against the server holding the port
        raise ValueError(problem)
    sigterm_unwinds()  # its LocalCloud runs in a session of its own: a SIGTERM'd demo left it running, orphaned
    run_demo(prompt=args.prompt or DEMO_PROMPT, max_tokens=args.max_tokens, bundle=args.bundle,
             rebuild=args.rebuild, threads=args.threads, port=args.port)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autoglm-edge", description="Edge side of the autoglm-split runtime.")
    p.add_argument("-v", "--verbose", action="store_true", help="log reconnects and cache decisions")
    sub = p.add_subparsers(dest="command", required=True)

    chat = sub.add_parser("chat", help="interactive streaming chat through the split model",
                          description="Interactive streaming chat through the split model.")
    _config_flags(chat)
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--max-tokens", type=int, default=512, help="most tokens per answer (default 512)")
    chat.add_argument("--temperature", type=float, default=0.7,
                      help="sampling temperature of every answer (default 0.7; 0: greedy, EdgeClient's default)")
    chat.add_argument("--precision", help="wire codec override for every request (fp16, int8-b32, ...)")
    chat.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                      help="enable_thinking for the chat template (default: the template's)")
    _speculate_flag(chat)
    chat.add_argument("--stats", action=argparse.BooleanOptionalAction, default=True,
                      help="print TTFT, tokens/s and bytes after each answer (default on)")
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="local OpenAI-compatible endpoint (/v1/chat/completions)",
                           description="Local OpenAI-compatible endpoint (/v1/chat/completions).")
    _config_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1: this device only)")
    serve.add_argument("--media-dir", default=os.environ.get("AUTOGLM_EDGE_MEDIA_DIR") or None,  # empty: unset
                       help="the one folder whose images image_url parts may name by local path (default: none; "
                            "env AUTOGLM_EDGE_MEDIA_DIR)")
    serve.add_argument("--port", type=port_number, default=8001, help="listen port (default 8001; 0: a free one, which the banner names)")
    serve.add_argument("--fetch-urls", action=argparse.BooleanOptionalAction, default=True,
                       help="fetch http(s) image_url parts on the phone (--no-fetch-urls: refuse them, url_refused; "
                            "a fetch may reach whatever the phone reaches, localhost included)")
    _speculate_flag(serve)
    serve.add_argument("--model-name", help="model id reported by /v1/models (default: from the bundle id)")
    serve.add_argument("--local-api-key", help="require this Bearer key from local apps (default: none)")
    serve.add_argument("--handshake-timeout-s", type=float,
                       help="close a connection without a whole request head within this many seconds, and answer "
                            "408 to a request body that stops arriving this long or, after this long, arrives "
                            "slower than 500 bytes/s (default 30, as the cloud's flag)")
    serve.add_argument("--max-http-requests", type=int,
                       help="/v1/ requests in flight, the one answered and those waiting their turn, before 429 + "
                            "Retry-After (default 8)")
    serve.add_argument("--allowed-hosts", default="",
                       help="Host names a request may name besides loopback ones and --host, comma-separated; * any "
                            "(default: none, any when --host is beyond loopback): a page whose name was rebound to "
                            "this address (DNS rebinding) is refused")
    serve.add_argument("--allowed-origins", default="",
                       help="web pages whose requests are served, with CORS: origins (scheme://host[:port]), "
                            "comma-separated; * any (default: none: apps, which send no Origin, only)")
    serve.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug",
                                                                  "trace"),
                       help="uvicorn's log level: info logs every request (default warning)")
    serve.set_defaults(func=cmd_serve)

    pre = sub.add_parser("preload", help="fill the persistent activation cache with common prompts",
                         description="Cache the front's work on prompt files (FILE ... or --preload FILE; needs "
                                     "--cache-dir) and/or --update the bundle first. With neither there is nothing "
                                     "to do: a usage error (exit 2).")
    _config_flags(pre)
    pre.add_argument("files", nargs="*", type=Path, help="prompt files (.txt, .jsonl, .json)")
    pre.add_argument("--update", action="store_true",
                     help="first bring the bundle to the one the server at --url serves (same model; resumable "
                          "download, verified, switched atomically, the previous version kept)")
    pre.set_defaults(func=cmd_preload)

    demo = sub.add_parser("demo", help="build the SmolLM2 bundle once, start a local cloud, stream an answer",
                          description="Build the SmolLM2 bundle once, start a local cloud, stream an answer.")
    demo.add_argument("--prompt", help="the question to ask (default: why splitting a model helps)")
    demo.add_argument("--max-tokens", type=int, default=96, help="most tokens of the answer (default 96)")
    demo.add_argument("--bundle", type=Path, help="use this bundle; absent, the SmolLM2 one is built there "
                                                        "(default: $AUTOGLM_CACHE/bundles/smollm2-l8)")
    demo.add_argument("--rebuild", action="store_true", help="rebuild the cached bundle")
    demo.add_argument("--threads", type=int, default=2, help="onnxruntime threads of the edge front (1 to 256, default 2)")
    demo.add_argument("--port", type=port_number, help="cloud server port (default: a free one)")
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from shared.cli_exit import run_command
    from shared.manifest import BundleError

    from .config import ConfigError

    from .errors import EdgeClientError

    return run_command("autoglm-edge", args.command, args.func, args,
                       (ConfigError, BundleError, ValueError, FileNotFoundError), (EdgeClientError,))


if __name__ == "__main__":
    sys.exit(main())
