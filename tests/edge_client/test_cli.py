"""edge_client.cli: bad input gets one line and exit status 2; preload fills a persistent cache."""

from __future__ import annotations

from cli_support import undocumented

import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from edge_client.cli import build_parser, main


@pytest.mark.parametrize("argv, needle", [
    (["chat", "--bundle", "/no/such/bundle", "--url", "ws://x"], "no such bundle directory"),
    (["serve", "--bundle", "/no/such/bundle", "--url", "ftp://x"], "expected ws://, wss://, http:// or https://"),
    (["chat", "--bundle", "/b", "--url", "ws://x", "--threads", "0"], "threads must be >= 1"),
    # no upper bound: 100,000 hung the load (onnxruntime starting its threads); plan's and the rig's bound
    # (shared.threads), said before anything loads - demo's before minutes of building its bundle
    (["chat", "--bundle", "/b", "--url", "ws://x", "--threads", "100000"], "threads must be >= 1 and <= 256"),
    (["serve", "--bundle", "/b", "--url", "ws://x", "--threads", "257"], "threads must be >= 1 and <= 256"),
    (["preload", "--bundle", "/b", "--threads", "100000", "p.txt"], "threads must be >= 1 and <= 256"),
    (["chat", "--bundle", "/b", "--url", "ws://x", "--cache-reserve-fraction", "1"],
     "cache_reserve_fraction must be a number from 0 to below 1, got 1.0"),
    (["preload", "--bundle", "/b", "--cache-reserve-bytes", "-1", "p.txt"], "cache_reserve_bytes must be an integer"),
    (["serve", "--bundle", "/b", "--url", "ws://x", "--cache-memory-bytes", "-1"],
     "cache_memory_bytes must be an integer >= 0, got -1"),
    (["demo", "--threads", "100000"], "--threads must be >= 1 and <= 256"),
    # the cloud's serve refuses these (one rule, shared.cli_exit.host_problem / shared.prefix_keys.bearer_key_problem):
    # an empty host listened on every interface, a key with a secret file's newline was a 401 on every local request
    # or failed every connect as "not a WebSocket server (InvalidHeaderValue ...)"
    (["serve", "--bundle", "/b", "--url", "ws://x", "--host", ""], "--host is empty"),
    (["serve", "--bundle", "/b", "--url", "ws://x", "--host", "[::1]"], "give an IPv6 address without brackets (::1)"),
    (["serve", "--bundle", "/b", "--url", "ws://x", "--local-api-key", "k\n"], "--local-api-key has whitespace at an end"),
    # the cloud serve's flags, one rule (shared.http_browsers): an origin as a browser sends it, a host without its port
    (["serve", "--bundle", "/b", "--url", "ws://x", "--allowed-origins", "localhost:3000"],
     "--allowed-origins: 'localhost:3000' is no origin"),
    (["serve", "--bundle", "/b", "--url", "ws://x", "--allowed-hosts", "a.example,b.example:8001"],
     "--allowed-hosts: 'b.example:8001' is no host name"),
    (["chat", "--bundle", "/b", "--url", "ws://x", "--api-key", "k\n"], "api_key has whitespace at an end"),
    (["chat", "--bundle", "/b", "--url", "ws://x", "--api-key", "a\tb"], "or a control character"),
])
def test_bad_input_is_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and err.startswith(f"autoglm-edge {argv[0]}: error:")


def test_serve_on_a_port_in_use_is_one_line_before_the_bundle_loads(tiny_bundle, capsys):
    """It loaded the bundle, printed its endpoint, then uvicorn's bind error ended it with exit status 3."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--bundle", str(tiny_bundle), "--url", "ws://127.0.0.1:1", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"autoglm-edge serve: error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in use)\n"


def test_help_lists_every_command():
    text = build_parser().format_help()
    assert all(c in text for c in ("chat", "serve", "preload", "demo"))


def test_preload_with_nothing_to_do_is_a_usage_error(tiny_bundle, tmp_path, capsys):
    """No prompt files and no --update: it exited 0 having done nothing."""
    argv = ["preload", "--bundle", str(tiny_bundle), "--cache-dir", str(tmp_path / "c")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoglm-edge preload: error: nothing to do") and err.count("\n") == 1, err
    assert not (tmp_path / "c").exists()


def test_preload_needs_a_cache_dir(tiny_bundle, capsys):
    assert main(["preload", "--bundle", str(tiny_bundle), "x.txt"]) == 2
    assert "--cache-dir" in capsys.readouterr().err


def test_preload_persists_common_prompts(tiny_bundle, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"You are a phone agent. Tap, swipe and type to finish the task."\n'
                       '{"messages": [{"role": "system", "content": "Answer briefly and politely."}]}\n')
    assert main(["preload", "--bundle", str(tiny_bundle), "--cache-dir", str(tmp_path / "c"), str(prompts)]) == 0
    assert "tokens cached" in capsys.readouterr().out
    from edge_client.activation_cache import ActivationCache
    from shared.manifest import Manifest

    m = Manifest.load(tiny_bundle)
    cache = ActivationCache(m.bundle_id, m.split_layer, m.num_kv_heads, m.head_dim, m.hidden_size,
                            cache_dir=tmp_path / "c", edge_variant=m.states_variant)
    assert len(cache) >= 4  # both prompts' full blocks survived the process
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    assert main(["preload", "--bundle", str(tiny_bundle), "--cache-dir", str(tmp_path / "c"), str(bad)]) == 2


def test_preload_reports_what_the_cache_bound_kept_and_fails_when_it_could_not_keep_it_all(tiny_bundle, tmp_path,
                                                                                          capsys):
    """With a --cache-max-bytes too small for its prompts, preload printed each file's tokens as they went in and
    exited 0, while the later file's blocks evicted the earlier's: the folder held far less than it said."""
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("You are a phone agent. Tap, swipe and type to finish the task. " * 3)
    second.write_text("Answer briefly and politely, in the user's language, and never guess. " * 3)
    argv = ["preload", "--bundle", str(tiny_bundle), "--cache-dir", str(tmp_path / "c"), str(first), str(second)]
    assert main(argv) == 0  # the default bound holds both
    both = {line.split(":")[0]: int(line.split()[1]) for line in capsys.readouterr().out.splitlines()}
    assert both[str(first)] > 0 and both[str(second)] > 0
    block_bytes = sum(f.stat().st_size for f in (tmp_path / "c").rglob("*") if f.is_file()) // (
        sum(both.values()) // 16)  # tiny bundles' blocks are 16 tokens
    assert main([*argv[:4], str(tmp_path / "d"), "--cache-max-bytes", str(block_bytes * 3), *argv[5:]]) == 1
    out, err = capsys.readouterr()
    held = {line.split(":")[0]: int(line.split()[1]) for line in out.splitlines()}
    assert sum(held.values()) <= 3 * 16 < sum(both.values()), (held, both)
    assert "later prompts' blocks evicted earlier ones (raise the bound)" in err and err.count("\n") == 1, err


def test_preload_into_a_directory_that_refuses_writes_fails_saying_so(tiny_bundle, tmp_path, capsys):
    """A read-only (or full) --cache-dir ended `autoglm-edge preload` in an OSError traceback; the cache now keeps
    such blocks in memory, so preload (whose whole point is the files) says none were saved: one line, exit 1."""
    from shared.manifest import Manifest

    prompt = tmp_path / "p.txt"
    prompt.write_text("You are a phone agent. Tap, swipe and type to finish the task.")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / Manifest.load(tiny_bundle).bundle_id).write_text("")  # where the bundle's folder goes
    assert main(["preload", "--bundle", str(tiny_bundle), "--cache-dir", str(tmp_path / "c"), str(prompt)]) == 1
    captured = capsys.readouterr()
    assert "tokens cached" not in captured.out
    assert captured.err.startswith(f"autoglm-edge preload: {prompt}: the activation cache was not saved: cannot "
                                   f"write in {tmp_path / 'c'}"), captured.err


def test_preload_into_a_directory_that_refuses_writes_prints_its_one_line_alone(tiny_bundle, tmp_path):
    """The command's own process (the test above runs main() under pytest's log capture): preload into a read-only
    or full --cache-dir printed the cache's warning ('WARNING edge_client.activation_cache: ... kept in memory
    only') before its error line, which says the same (real: a read-only mount, a full 2 MB tmpfs)."""
    from shared.manifest import Manifest

    prompt = tmp_path / "p.txt"
    prompt.write_text("You are a phone agent. Tap, swipe and type to finish the task.")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / Manifest.load(tiny_bundle).bundle_id).write_text("")  # where the bundle's folder goes
    proc = subprocess.run([sys.executable, "-m", "edge_client.cli", "preload", "--bundle", str(tiny_bundle),
                           "--cache-dir", str(tmp_path / "c"), str(prompt)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(f"autoglm-edge preload: {prompt}: the activation cache was not saved: cannot write "
                                  f"in {tmp_path / 'c'}") and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="drops root's DAC override")
def test_preload_with_a_cache_dir_the_app_may_not_enter_is_its_one_line(tiny_bundle, tmp_path):
    """A --cache-dir inside a folder the app may not enter ended every command at its start in a PermissionError
    traceback (EdgeConfig's check); the cache refuses it as a read-only one, and preload says so in its one line."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    os.chown(locked, 65534, 65534)  # nobody's: root without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH cannot enter it
    prompt = tmp_path / "p.txt"
    prompt.write_text("You are a phone agent. Tap, swipe and type to finish the task.")
    proc = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-m",
                           "edge_client.cli", "preload", "--bundle", str(tiny_bundle), "--cache-dir",
                           str(locked / "cache"), str(prompt)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"autoglm-edge preload: {prompt}: the activation cache was not saved: cannot "
                                  f"write in {locked / 'cache'}") and "Permission denied" in proc.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="drops root's DAC override")
@pytest.mark.parametrize("command", [["chat"], ["preload", "--update"]])
def test_a_bundle_in_a_folder_the_app_may_not_enter_is_one_line(command, tiny_bundle, tmp_path):
    """A bundle inside a folder the app may not enter ended chat / serve / preload --update (and EdgeClient) in a
    PermissionError traceback: bundle_sync.recover's and Manifest.load's Path.exists raised on EACCES."""
    locked = tmp_path / "locked"
    shutil.copytree(tiny_bundle, locked / "bundle")
    locked.chmod(0o700)
    os.chown(locked, 65534, 65534)  # nobody's: root without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH cannot enter it
    proc = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-m",
                           "edge_client.cli", command[0], "--bundle", str(locked / "bundle"), "--url",
                           "ws://127.0.0.1:9", *command[1:]], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"autoglm-edge {command[0]}: error: {locked / 'bundle'}: cannot be read (Permission denied); "
                           "the user running this needs read access to the bundle's files\n")


def test_preload_of_a_prompt_longer_than_the_edge_graph_is_one_line(tiny_bundle, tmp_path, capsys):
    """A prompt past the edge graph's positions (the 2.7 KB agent prompt through a tokenizer-less bundle's byte
    fallback: 2,048 positions) ended `autoglm-edge preload` in a FrontError traceback, half-way through the front."""
    long = tmp_path / "long.txt"
    long.write_text("x" * 3000)
    assert main(["preload", "--bundle", str(tiny_bundle), "--cache-dir", str(tmp_path / "c"), str(long)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoglm-edge preload: error: a prompt of ") and err.count("\n") == 1, err
    assert "exceeds the edge graph's 2048 positions" in err


def test_chat_samples_at_0_7_by_default_as_its_help_and_the_docs_say_and_the_api_stays_greedy():
    """chat's defaults (temperature 0.7, 512 tokens) differ from EdgeClient.generate's (greedy, 256): the edge
    guide said only the API's, so chat's sampling was a surprise."""
    import inspect
    from pathlib import Path

    from edge_client.client import EdgeClient

    args = build_parser().parse_args(["chat"])
    assert (args.temperature, args.max_tokens) == (0.7, 512)
    chat_help = " ".join(build_parser()._subparsers._group_actions[0].choices["chat"].format_help().split())
    assert "(default 0.7;" in chat_help and "(default 512)" in chat_help
    api = inspect.signature(EdgeClient.generate).parameters
    assert (api["temperature"].default, api["max_tokens"].default) == (0.0, 256)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "edge.md").read_text()
    assert "`temperature` (0 = greedy, the default)" in doc
    chat_section = " ".join(doc.split("## Interactive: `autoglm-edge chat`")[1].split("\n## ")[0].split())
    assert re.search(r"`--temperature` defaults to 0\.7", chat_section), chat_section
    assert "`--max-tokens` to 512" in chat_section and "`temperature=0.0`" in chat_section
    assert "`max_tokens=256`" in chat_section




def test_every_subcommand_and_option_has_help_text():
    """chat, serve and demo --help had no description; serve --log-level had no help; --url did not say where
    the edge connects without it."""
    assert undocumented(build_parser()) == []
    import dataclasses

    from edge_client.config import EdgeConfig

    default = next(f.default for f in dataclasses.fields(EdgeConfig) if f.name == "url")
    chat = build_parser()._subparsers._group_actions[0].choices["chat"]
    url = next(a for a in chat._actions if a.dest == "url")
    assert f"default {default};" in url.help


def _no_build(monkeypatch):
    """A stand-in for the SmolLM2 build (minutes): writes a bare manifest where the bundle goes."""
    import partition_tools.models
    import partition_tools.split

    def fake_split(lm, cfg):
        cfg.out.mkdir(parents=True)
        (cfg.out / "manifest.json").write_text("{}")

    monkeypatch.setattr(partition_tools.split, "split", fake_split)
    monkeypatch.setattr(partition_tools.models, "load_model", lambda source: None)


def test_demo_never_overwrites_a_path_that_is_not_a_bundle(tmp_path, monkeypatch, capsys):
    """`autoglm-edge demo --bundle DIR` deleted DIR whole (shutil.rmtree) to build the SmolLM2 bundle there when
    DIR held anything but a bundle: --bundle ~ would have taken the home directory with it."""
    _no_build(monkeypatch)
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "notes.txt").write_text("precious")
    assert main(["demo", "--bundle", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err == f"autoglm-edge demo: error: {folder}: exists and is not a bundle; refusing to overwrite it (give " \
                  "a new or empty path)\n"
    assert (folder / "notes.txt").read_text() == "precious"


def test_the_cache_root_expands_a_tilde(tmp_path, monkeypatch):
    """AUTOGLM_CACHE="~/c" (quoted, as a unit file or a Dockerfile ENV writes it) built the demo's bundles under a
    folder named '~' in the working directory."""
    from edge_client.demo import cache_root

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AUTOGLM_CACHE", "~/c")
    assert cache_root() == tmp_path / "c"


def test_demo_uses_the_bundle_it_is_given(tiny_bundle, tmp_path, monkeypatch):
    """A bundle of another model or split layer was replaced by the SmolLM2 bundle split at 8 (the cache's rule)."""
    import shutil

    from edge_client import demo

    _no_build(monkeypatch)
    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle, bundle)
    served = []

    class Stop(Exception):
        pass

    def local_cloud(path, **kw):
        served.append(path)
        raise Stop

    monkeypatch.setattr(demo, "LocalCloud", local_cloud)
    with pytest.raises(Stop):
        demo.run_demo(bundle=bundle, out=io.StringIO())
    assert served == [bundle] and (bundle / "edge").is_dir()  # the tiny bundle itself, untouched


def _demo_signalled_once_its_cloud_serves(bundle, sig, **wait) -> tuple[subprocess.Popen, str, int]:
    """``autoglm-edge demo`` on ``bundle``, sent ``sig`` once its local cloud serves (the answer streams meanwhile:
    max_tokens is the context): the ended process, its stderr and the cloud's port."""
    proc = subprocess.Popen([sys.executable, "-m", "edge_client.cli", "demo", "--bundle", str(bundle),
                             "--max-tokens", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "cloud server ready" not in line and proc.poll() is None:
            line = proc.stdout.readline()
        port = int(re.search(r":(\d+)/v1/split", line).group(1))
        proc.send_signal(sig)
        _, err = proc.communicate(**wait)
    finally:
        proc.kill()
    return proc, err, port


def _until_nothing_listens(port: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"the demo's cloud server still listens on {port}")


def test_a_demo_sent_sigterm_stops_its_local_cloud(tiny_bundle):
    """SIGTERM (``timeout``, ``kill``, a CI cancel) ended ``autoglm-edge demo`` by the signal (status -15) before
    its ``with LocalCloud`` block could stop the server: the cloud process (its own session, so a terminal's Ctrl-C
    reaches only the demo) ran on, orphaned, holding its port and the model's memory. It unwinds as Ctrl-C does."""
    proc, err, port = _demo_signalled_once_its_cloud_serves(tiny_bundle, signal.SIGTERM, timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", (proc.returncode, err)
    _until_nothing_listens(port, 5)  # LocalCloud.stop waited for the server to exit


def test_a_demo_killed_outright_takes_its_local_cloud_with_it(tiny_bundle):
    """SIGKILL (the OOM killer, ``kill -9``) gives the demo no time to stop its server: the server (its own session)
    served on, orphaned. It is told SIGTERM when the demo's process ends (``die_with_parent``, as the rig's are)."""
    proc, _, port = _demo_signalled_once_its_cloud_serves(tiny_bundle, signal.SIGKILL, timeout=30)
    assert proc.returncode == -signal.SIGKILL
    _until_nothing_listens(port, 30)  # SIGTERM: the server drains its one (now dropped) session and exits


@pytest.mark.parametrize("content, match", [
    ('{"messages": [5]}\n', "item 0: messages must be a non-empty list"),  # an AttributeError traceback
    ('"ok"\n{"messages": []}\n', "item 1: messages must be a non-empty list"),  # 0 tokens cached, silently
    ('{"messages": [{"content": "no role"}]}\n', "item 0: messages must be a non-empty list"),
    (b"\xff\xfe", "not UTF-8 text"),  # the decoder's message, naming no file
])
def test_a_malformed_prompts_file_is_one_line_naming_it(content, match, tiny_bundle, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["preload", "--bundle", str(tiny_bundle), "--cache-dir", str(tmp_path / "c"), str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"autoglm-edge preload: error: {bad}: ") and match in err and err.count("\n") == 1, err


def test_a_turn_that_fails_leaves_the_chat_and_its_conversation_going(tiny_bundle, tiny_cloud, monkeypatch, capsys):
    """A message too long for the context (ValueError) or an answer that failed (EdgeClientError: here a compute
    variant the CPU server lacks; the cloud unreachable through every retry likewise) ended `autoglm-edge chat`
    and its conversation; the turn is said in one line and dropped, the chat goes on (exit 1 if the last failed)."""
    argv = ["chat", "--bundle", str(tiny_bundle), "--url", tiny_cloud.ws_url, "--max-tokens", "3", "--no-stats"]
    monkeypatch.setattr("sys.stdin", io.StringIO("a " * 1100 + "\nhello\n"))
    assert main([*argv, "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert "exceeds the edge graph's 2048 positions" in captured.err and "assistant> " in captured.out
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nhello\n"))
    assert main([*argv, "--precision", "int8"]) == 1
    assert capsys.readouterr().err.count("compute 'int8' is not available") == 2  # both turns were asked


def test_the_caches_refusal_is_a_line_of_its_own_between_answers(tiny_bundle, tiny_cloud, tmp_path):
    """A --cache-dir that refuses the blocks (a full disk, here the file size limit: the refusal comes at the first
    block's write) was logged by the cache while it stored the prompt: in `autoglm-edge chat`, in the middle of the
    streamed answer ('assistant> WARNING edge_client.activation_cache: ...'). The chat says it once, on a line of its
    own after that answer (a real process, its stdout and stderr one stream as on a terminal)."""
    import resource

    from shared.manifest import Manifest

    def no_file_bytes():  # the file size limit (ulimit -f 0): every block's write is EFBIG (Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    prompt = "You are a phone agent. Tap, swipe and type to finish the task. " * 2
    proc = subprocess.run([sys.executable, "-m", "edge_client.cli", "chat", "--bundle", str(tiny_bundle), "--url",
                           tiny_cloud.ws_url, "--cache-dir", str(tmp_path / "c"), "--max-tokens", "8", "--no-stats"],
                          input=f"{prompt}\n{prompt}again\n", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                          preexec_fn=no_file_bytes)
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    said = f"autoglm-edge chat: activation cache: cannot write in {tmp_path / 'c' / Manifest.load(tiny_bundle).bundle_id}"
    assert [line for line in lines if "cannot write" in line] == [
        f"{said}: File too large; new blocks are kept in memory only"], proc.stdout
    assert lines[lines.index(f"{said}: File too large; new blocks are kept in memory only") - 1].startswith(
        "you> assistant> "), proc.stdout  # after the first answer
    assert proc.stdout.count("assistant> ") == 2


def test_an_answers_control_characters_reach_the_terminal_as_escapes(tiny_bundle, tiny_cloud, monkeypatch, capsys):
    """`autoglm-edge chat` printed an answer's characters raw: the random tiny model's sampled answers wrote ESC,
    shift-out (0x0e: a VT100's later letters as line-drawing glyphs), backspaces and carriage returns to the user's
    terminal, which acted on them (a prompt injection asks a real model for ESC sequences: OSC 52 sets the
    clipboard). They are shown as escapes; newlines, tabs and every printable character (CJK, emoji) as they are."""
    argv = ["chat", "--bundle", str(tiny_bundle), "--url", tiny_cloud.ws_url, "--max-tokens", "200", "--no-stats",
            "--temperature", "2"]
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nhello\nmore\n"))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> ") == 3
    raw = {ch for ch in out if (ord(ch) < 0x20 and ch not in "\n\t") or 0x7F <= ord(ch) < 0xA0}
    assert not raw, sorted(raw)
    assert "\\x" in out  # ~13 % of a near-uniform byte model's bytes are controls: 600 tokens held some
    from shared.cli_exit import shown

    assert shown("中文 😀\tok\n\x1b[2J\x0e\r\x85") == "中文 😀\tok\n\\x1b[2J\\x0e\\x0d\\x85"


def test_an_answers_bidi_controls_reach_the_terminal_as_escapes(monkeypatch, capsys):
    """Trojan Source: the chat printed an answer's bidirectional overrides and isolates (U+202A-U+202E,
    U+2066-U+2069) raw, and the terminal reordered what the user read - a command shown as harmless that does
    something else when pasted. They are escapes now, as the control characters are; right-to-left text itself
    (Hebrew, Arabic) and the marks within it are shown as they are."""
    from types import SimpleNamespace

    from edge_client.cli import _answer

    trojan = "rm -rf ~ \u202e# safe\u202c \u2066x\u2069 \u202a\u202b\u202d\u2067\u2068 שלום\u200f"

    class _Client:
        def generate(self, **_):
            return iter([trojan[:12], trojan[12:]])

    args = SimpleNamespace(max_tokens=8, temperature=0.0, thinking=False, precision=None)
    _answer(_Client(), [{"role": "user", "content": "hi"}], args)
    out = capsys.readouterr().out
    assert not {ch for ch in out if 0x202A <= ord(ch) <= 0x202E or 0x2066 <= ord(ch) <= 0x2069}, out
    assert out == ("assistant> rm -rf ~ \\u202e# safe\\u202c \\u2066x\\u2069 "
                   "\\u202a\\u202b\\u202d\\u2067\\u2068 שלום\u200f")


def test_a_conversation_over_the_context_forgets_its_oldest_exchange_and_goes_on(tiny_bundle, tiny_cloud, monkeypatch,
                                                                                capsys):
    """Once a chat's turns filled the context (the edge graph's 2048 positions here: ~620 tokens a turn), every later
    message was refused 'prompt of N tokens exceeds ...' and the chat could only be quit; the oldest exchanges are
    forgotten until the conversation fits (the system prompt stays), and it goes on."""
    argv = ["chat", "--bundle", str(tiny_bundle), "--url", tiny_cloud.ws_url, "--max-tokens", "3", "--no-stats",
            "--temperature", "0", "--system", "be brief"]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{'ab'[i % 2]} " * 300 + "\n" for i in range(5))))
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.count("assistant> ") == 5, captured.err
    assert captured.err.count("its oldest exchange is forgotten") == 2 and "exceeds" not in captured.err


def test_speculate_is_a_flag_of_chat_and_serve_with_an_environment_twin(tiny_bundle, tiny_cloud, monkeypatch, capsys):
    """Speculation (docs/edge.md, "Speculation"; the draft heads `autoglm-partition draft-head` adds) could be turned
    on from the Python API only: chat and serve had no flag, their every answer ran one token per round trip."""
    from edge_client.cli import _config
    from edge_client.generation import Session

    asked = []
    run = Session.run

    async def recording(self, spec, sink, stats, **kw):
        asked.append(spec.speculate)
        return await run(self, spec, sink, stats, **kw)

    monkeypatch.setattr(Session, "run", recording)
    argv = ["chat", "--bundle", str(tiny_bundle), "--url", tiny_cloud.ws_url, "--max-tokens", "8", "--temperature",
            "0"]
    for flags, env, want in (([], None, False), (["--speculate"], None, True), ([], "1", True),
                             (["--no-speculate"], "1", False)):
        if env is None:
            monkeypatch.delenv("AUTOGLM_EDGE_SPECULATE", raising=False)
        else:
            monkeypatch.setenv("AUTOGLM_EDGE_SPECULATE", env)
        monkeypatch.setattr("sys.stdin", io.StringIO("ab ab ab ab\n"))
        assert main([*argv, *flags]) == 0
        assert asked.pop() is want and not asked
    monkeypatch.delenv("AUTOGLM_EDGE_SPECULATE")
    serve = build_parser().parse_args(["serve", "--bundle", str(tiny_bundle), "--speculate"])
    assert _config(serve).speculate is True  # the local API's requests take the client's setting
    monkeypatch.setenv("AUTOGLM_EDGE_SPECULATE", "maybe")
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "AUTOGLM_EDGE_SPECULATE='maybe'" in err and err.count("\n") == 1


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])  # a UTF-8 locale's stdin; C.UTF-8's (UTF-8 mode)
def test_a_message_that_is_not_utf8_is_one_line_and_the_chat_goes_on(errors, tiny_bundle, tiny_cloud, monkeypatch,
                                                                       capsys):
    """A byte that is no UTF-8 on stdin (a Latin-1 terminal's 'é', a binary file piped in) ended the chat and its
    conversation with 'error: 'utf-8' codec can't decode byte 0xff', exit 2 (strict stdin: the earlier message in the
    same read was never answered), or failed its turn as "can't encode character '\\udcff' ... surrogates not
    allowed" (surrogateescape stdin); the message is refused in one line naming the byte, the chat goes on."""
    argv = ["chat", "--bundle", str(tiny_bundle), "--url", tiny_cloud.ws_url, "--max-tokens", "2", "--no-stats",
            "--temperature", "0"]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"hi\ncaf\xe9 \xff\nok\n"), encoding="utf-8",
                                                      errors=errors))
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.count("assistant> ") == 2
    assert "autoglm-edge chat: the message is not UTF-8 text (byte 0xe9 after 'caf'): not sent\n" in captured.err, captured.err


def _on_a_terminal(argv: list[str], keys: list, within_s: float = 60,
                   sigterm_after: bytes | None = None) -> tuple[int, str, bool]:
    """``autoglm-edge`` run on a pseudo-terminal (an xterm, which brackets pastes): each of ``keys`` is typed once
    the chat prompts for it (a signal number: sent to it), then Ctrl-D; ``sigterm_after``: a SIGTERM once it has
    written that. Its exit status, what it wrote (both streams) and whether the terminal echoes once it is gone."""
    import os
    import select
    import termios

    main_fd, tty_fd = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "edge_client.cli", *argv], stdin=tty_fd, stdout=tty_fd,
                            stderr=tty_fd, env={**os.environ, "TERM": "xterm"}, close_fds=True)
    os.close(tty_fd)
    shown, keys, sent, deadline = b"", [*keys, b"\x04"], 0, time.monotonic() + within_s
    try:
        while time.monotonic() < deadline:
            if select.select([main_fd], [], [], 0.2)[0]:
                try:
                    chunk = os.read(main_fd, 65536)
                except OSError:  # the terminal's last writer exited
                    break
                if not chunk:
                    break
                shown += chunk
            if sent < len(keys) and shown.count(b"you> ") > sent:  # a new prompt: type the next keys
                time.sleep(0.2)  # readline has taken the terminal
                os.write(main_fd, keys[sent]) if isinstance(keys[sent], bytes) else proc.send_signal(keys[sent])
                sent += 1
            if sigterm_after is not None and sigterm_after in shown:
                time.sleep(0.5)
                proc.send_signal(signal.SIGTERM)
                sigterm_after = None
            if proc.poll() is not None and not select.select([main_fd], [], [], 0.2)[0]:
                break
        status = proc.wait(timeout=10)
        return status, shown.decode(errors="replace"), bool(termios.tcgetattr(main_fd)[3] & termios.ECHO)
    finally:
        proc.kill()
        os.close(main_fd)


def test_a_message_pasted_on_a_terminal_is_one_message_blank_lines_and_all(tiny_bundle, tiny_cloud):
    """A paste of several lines was one message per line, each answered; its first blank line ended the chat (the
    conversation lost) and the lines after it went to the user's shell, which ran them. On a terminal the chat reads
    with line editing and bracketed paste (readline): a paste is one message, Enter sends it."""
    pytest.importorskip("readline")  # a Python built without it reads line by line, as before
    argv = ["chat", "--bundle", str(tiny_bundle), "--url", tiny_cloud.ws_url, "--max-tokens", "2", "--temperature",
            "0"]
    status, shown, _ = _on_a_terminal(argv, [b"\x1b[200~Summarise:\rone\rtwo\r\rthree\x1b[201~\r", b"ok\r"])
    assert status == 0 and shown.count("assistant> ") == 2, shown  # the paste's answer and ok's (it was 3, then exit)
    assert "^[[200~" not in shown  # the terminal's paste marks are no text of the message


def test_an_empty_media_dir_allows_no_local_paths_instead_of_the_working_directory(tiny_bundle, monkeypatch, capsys):
    """AUTOGLM_EDGE_MEDIA_DIR='' (an empty environment twin is unset) or `--media-dir "$DIR"` with DIR unset became
    Path('') = '.': every local app could read the images and audio of the directory serve was started in (its
    home, a repository) by relative path, where unset refuses local paths. The variable is unset; the flag is refused
    in one line."""
    from edge_client.local_api import ClosingServer

    served = []
    monkeypatch.setattr(ClosingServer, "run", lambda self: served.append(self.client.media_policy.local_dir))
    argv = ["serve", "--bundle", str(tiny_bundle), "--url", "ws://127.0.0.1:1", "--port", "0"]
    monkeypatch.setenv("AUTOGLM_EDGE_MEDIA_DIR", "")
    assert main(argv) == 0 and served == [None]
    assert main([*argv, "--media-dir", ""]) == 2
    err = capsys.readouterr().err
    assert err == ("autoglm-edge serve: error: --media-dir is empty (an unset variable?): give the folder, or leave "
                   "it unset to refuse local paths\n"), err


def test_the_serve_banner_names_a_url_an_openai_client_takes_on_an_ipv6_host(tiny_bundle, monkeypatch, capsys):
    """`--host ::1` printed 'endpoint on http://::1:PORT/v1', which no client parses (an IPv6 host is bracketed in a
    URL), while --port 0 leaves the banner as the one place that names the port."""
    from edge_client.local_api import ClosingServer

    startup = ClosingServer.startup

    async def started_then_stopping(self, sockets=None):
        await startup(self, sockets)
        self.should_exit = True

    monkeypatch.setattr(ClosingServer, "startup", started_then_stopping)
    assert main(["serve", "--bundle", str(tiny_bundle), "--url", "ws://127.0.0.1:1", "--port", "0", "--host", "::1"]) == 0
    assert re.search(r"endpoint on http://\[::1\]:\d+/v1 ", capsys.readouterr().err)


def test_demo_on_a_port_in_use_is_one_line_before_anything_runs(tiny_bundle, capsys):
    """`demo --port P` with P taken ended in a RuntimeError traceback ('cloud server ... exited with code 2 before it
    was ready') - or, with another cloud server on P, ran the demo against that server (its /ready answered first),
    numbers and all. It is serve's one-line usage error (shared.cli_exit.listen_problem), before the bundle loads."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["demo", "--bundle", str(tiny_bundle), "--port", str(port), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err == f"autoglm-edge demo: error: --port {port}: cannot listen there (Address already in use)\n", err


def test_a_system_prompt_that_is_not_utf8_is_one_line_before_the_bundle_loads(capsys):
    """`--system "$(cat prompt.txt)"` of a Windows-1252 file (argv decoded with surrogateescape) failed every turn
    as "can't encode character '\\udce9' ... surrogates not allowed"; it is a usage error naming the flag and the byte."""
    assert main(["chat", "--bundle", "/no/such/bundle", "--system", "caf\udce9 au lait"]) == 2
    err = capsys.readouterr().err
    assert err == "autoglm-edge chat: error: --system is not UTF-8 text (byte 0xe9 after 'caf')\n", err


def test_a_model_name_that_is_not_utf8_is_one_line_before_the_bundle_loads(capsys):
    """`--model-name` of bytes that are no UTF-8 (argv decodes them with surrogateescape) served every /v1/models
    and every completion as a 500 (the JSON body could not be encoded: a traceback per request in the log)."""
    assert main(["serve", "--bundle", "/no/such/bundle", "--port", "0", "--model-name", "caf\udce9"]) == 2
    err = capsys.readouterr().err
    assert err == "autoglm-edge serve: error: --model-name is not UTF-8 text (byte 0xe9 after 'caf')\n", err


def test_a_demo_prompt_that_is_not_utf8_is_one_line_before_anything_runs(capsys):
    """It failed once the local cloud had started, as "'utf-8' codec can't encode character '\\udce9' ..."."""
    assert main(["demo", "--bundle", "/no/such/bundle", "--prompt", "caf\udce9"]) == 2
    err = capsys.readouterr().err
    assert err == "autoglm-edge demo: error: --prompt is not UTF-8 text (byte 0xe9 after 'caf')\n", err


def test_chat_and_serve_preload_report_what_the_cache_bound_kept_and_fail_when_it_could_not_keep_it_all(
        tiny_bundle, tmp_path, monkeypatch, capsys):
    """`chat/serve --preload a --preload b` printed each file's tokens as they went in ('preloaded a: 64 tokens
    cached') while b's blocks evicted a's (0 held): preload's own rule (what the cache holds once all are in; exit 1,
    cache_too_small, when the bound kept less) did not reach their --preload."""
    from edge_client import EdgeClient

    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("You are a phone agent. Tap, swipe and type to finish the task. " * 3)
    second.write_text("Answer briefly and politely, in the user's language, and never guess. " * 3)
    with EdgeClient(tiny_bundle, "ws://127.0.0.1:1") as client:
        client.preload_prompts(first)
        one_file = client.cache._bytes  # payload bytes of a's blocks
    argv = ["chat", "--bundle", str(tiny_bundle), "--url", "ws://127.0.0.1:1", "--preload", str(first), "--preload",
            str(second)]
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(argv) == 0  # the default bound holds both
    full = {p: int(n) for p, n in re.findall(r"preloaded (.*): (\d+) tokens cached", capsys.readouterr().err)}
    assert main([*argv, "--cache-max-bytes", str(one_file * 3 // 2)]) == 1
    err = capsys.readouterr().err
    held = {p: int(n) for p, n in re.findall(r"preloaded (.*): (\d+) tokens cached", err)}
    assert held[str(first)] < full[str(first)] and held[str(second)] == full[str(second)], (held, full)
    assert f"--cache-max-bytes {one_file * 3 // 2} holds" in err and "later prompts' blocks evicted earlier ones" in err
    assert "empty line or Ctrl-D quits" not in err  # it fails before the chat starts
    # a memory-only cache holds at most --cache-memory-bytes (a phone app's budget), whatever --cache-max-bytes says
    assert main([*argv, "--cache-memory-bytes", str(one_file * 3 // 2)]) == 1
    err = capsys.readouterr().err
    assert f"--cache-memory-bytes {one_file * 3 // 2} holds" in err and "empty line or Ctrl-D quits" not in err, err


@pytest.mark.parametrize("when", ["at the prompt", "mid-answer"])
def test_a_chat_sent_sigterm_on_a_terminal_leaves_it_as_it_found_it(when, tiny_bundle, tiny_cloud):
    """With readline reading the prompt, a SIGTERM (kill, a parent's timeout) killed the chat with the terminal left
    without echo and in bracketed-paste mode - under a parent that does not reset it (dash, a script) the user typed
    blind. It unwinds as Ctrl-C does ('interrupted', 130, shared.cli_exit.sigterm_unwinds), the terminal restored -
    mid-answer too, where Ctrl-C only stops the answer: a SIGTERM ends the chat."""
    pytest.importorskip("readline")
    argv = ["chat", "--bundle", str(tiny_bundle), "--url", tiny_cloud.ws_url, "--temperature", "0", "--no-stats"]
    if when == "at the prompt":
        status, shown, echoes = _on_a_terminal(argv, [signal.SIGTERM])
    else:  # the answer streams for a while (the context's worth): SIGTERM it once it has begun
        status, shown, echoes = _on_a_terminal([*argv, "--max-tokens", "100000"], [b"hi\r"],
                                               sigterm_after=b"assistant> ")
    assert status == 130 and shown.rstrip().endswith("interrupted") and echoes, (status, shown)
    assert shown.count("\x1b[?2004h") == shown.count("\x1b[?2004l")  # bracketed paste off again
