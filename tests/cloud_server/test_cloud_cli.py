"""``autoglm-cloud serve`` options: flags, environment twins, config files, precedence, errors."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cloud_server.cli import OPTIONS, build_parser, log_level, main, resolve
from cloud_server.config import ConfigError


def _resolve(argv, env=None):
    return resolve(build_parser().parse_args(["serve", *argv]), environ=env or {})


def test_flags_set_server_and_engine_fields(tmp_path):
    cfg = _resolve([str(tmp_path), "--port", "9001", "--tp", "2", "--max-sessions", "3", "--api-key", "k",
                    "--variants", "fp32,int8", "--no-enable-prefix-cache", "--device", "cpu"])
    assert cfg.mode == "split" and cfg.bundle == tmp_path and cfg.port == 9001 and cfg.max_sessions == 3
    assert cfg.api_key == "k" and cfg.engine.tp == 2 and cfg.engine.variants == ("fp32", "int8")
    assert cfg.engine.enable_prefix_cache is False


def test_fast_path_is_cuda_by_default_and_can_be_forced_either_way(tmp_path):
    assert _resolve([str(tmp_path), "--device", "cpu"]).engine.fast_path is None  # on CUDA only
    assert _resolve([str(tmp_path), "--device", "cpu", "--fast-path"]).engine.fast_path is True
    assert _resolve([str(tmp_path), "--no-fast-path"]).engine.fast_path is False
    assert _resolve([str(tmp_path)], {"AUTOGLM_CLOUD_FAST_PATH": "true"}).engine.fast_path is True


def test_every_option_has_an_environment_twin(tmp_path):
    env = {"AUTOGLM_CLOUD_BUNDLE": str(tmp_path), "AUTOGLM_CLOUD_PORT": "7000",
           "AUTOGLM_CLOUD_MAX_SESSIONS": "5", "AUTOGLM_CLOUD_ENABLE_PREFIX_CACHE": "false",
           "AUTOGLM_CLOUD_BLOCK_SIZE": "32", "AUTOGLM_CLOUD_DEVICE": "cpu", "AUTOGLM_CLOUD_SESSION_GRACE_S": "2.5"}
    cfg = _resolve([], env)
    assert (cfg.bundle, cfg.port, cfg.max_sessions, cfg.session_grace_s) == (tmp_path, 7000, 5, 2.5)
    assert cfg.engine.block_size == 32 and cfg.engine.enable_prefix_cache is False
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for o in OPTIONS:
        assert f"AUTOGLM_CLOUD_{o.name.upper()}" in help_text


def test_help_states_each_dataclass_default_and_the_prompt_limit_defaults_to_the_context(tmp_path):
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    assert "refused with 1013 (default 64)" in help_text
    assert "(default 30)" in help_text and "prefix-cache granularity (default 16)" in help_text
    cfg = _resolve([str(tmp_path), "--device", "cpu", "--max-model-len", "1024"])
    assert cfg.max_prompt_tokens is None and cfg.prompt_limit == 1024
    cfg = _resolve([str(tmp_path), "--device", "cpu"], {"AUTOGLM_CLOUD_MAX_PROMPT_TOKENS": "300"})
    assert cfg.prompt_limit == 300


def test_precedence_cli_over_env_over_file(tmp_path):
    conf = tmp_path / "c.json"
    conf.write_text(json.dumps({"bundle": str(tmp_path), "port": 1111, "max_sessions": 9, "host": "0.0.0.0",
                                "device": "cpu"}))
    cfg = _resolve(["--config", str(conf), "--port", "3333"], {"AUTOGLM_CLOUD_PORT": "2222",
                                                                "AUTOGLM_CLOUD_MAX_SESSIONS": "8"})
    assert (cfg.port, cfg.max_sessions, cfg.host) == (3333, 8, "0.0.0.0")
    toml = tmp_path / "c.toml"
    toml.write_text(f'bundle = "{tmp_path}"\nnum_blocks = 77\ndevice = "cpu"\n')
    assert _resolve(["--config", str(toml)]).engine.num_blocks == 77


@pytest.mark.parametrize("argv, env, message", [
    ([], {}, "exactly one of"),
    (["B", "--full", "tiny-glm4"], {}, "exactly one of"),
    (["B", "--tp", "3", "--device", "cpu"], {}, "tp"),
    (["B", "--device", "cpu", "--variants", "bf16"], {}, None),  # validated when resolving variants
    (["B"], {"AUTOGLM_CLOUD_PORT": "eighty"}, "AUTOGLM_CLOUD_PORT"),
    (["B", "--device", "tpu"], {}, "device"),
    (["B", "--device", "cpu", "--max-model-len", "512", "--max-prompt-tokens", "513"], {}, "max_prompt_tokens"),
    # the pool bounds a request's context too (64 positions here): a limit no prompt could reach was served, and sent
    # in Welcome.limits beside max_context 64; every prompt over 63 was refused as over a context nobody had set
    (["B", "--device", "cpu", "--num-blocks", "4", "--block-size", "16", "--max-prompt-tokens", "200"], {},
     r"max_prompt_tokens \(200\) must be <= the KV pool's 64 positions \(num_blocks 4 x block_size 16, below "
     r"max_model_len 8192\)"),
    (["--full", "tiny-glm4", "--device", "cpu", "--num-blocks", "4", "--block-size", "16", "--max-prompt-tokens",
      "65"], {}, "max_prompt_tokens \\(65\\) must be <= the KV pool's 64 positions"),
    (["B", "--device", "cpu", "--kv-cache-dtype", "int4"], {}, "kv_cache_dtype: unknown"),
    (["B", "--device", "cpu", "--workers", "0"], {}, "workers must be >= 1"),
    (["B", "--device", "cpu", "--workers", "100000"], {}, "workers must be >= 1 and <= 256"),  # was EMFILE, a traceback
    (["--full", "tiny-glm4", "--device", "cpu", "--workers", "2"], {}, "workers > 1 serves split mode"),
    # split mode's alone, accepted and ignored with --full (a cap that capped nothing)
    (["--full", "tiny-glm4", "--device", "cpu", "--max-sessions", "4"], {}, "max_sessions: split mode's, given with full"),
    (["--full", "tiny-glm4", "--device", "cpu"], {"AUTOGLM_CLOUD_SESSION_GRACE_S": "5", "AUTOGLM_CLOUD_CLOUD_DRAFTS": "0"},
     r"session_grace_s, cloud_drafts: split mode's.*\[session_grace_s from AUTOGLM_CLOUD_SESSION_GRACE_S; "),
    (["B", "C", "--device", "cpu", "--workers", "2"], {}, "workers > 1 serves one bundle"),
    # divided between the workers, at least one each: 8 connections got in under a cap of 2
    (["B", "--device", "cpu", "--workers", "8", "--max-connections", "2"], {}, r"max_connections \(2\) must be >= "
                                                                             r"workers \(8\)"),
    (["B", "--device", "cpu", "--workers", "4", "--max-http-requests", "3"], {}, "max_http_requests \\(3\\) must be"),
    (["B", "--device", "cpu", "--loop", "trio"], {}, "loop must be one of auto, asyncio, uvloop"),
    # an origin is what a browser sends in Origin (no path), a host what it sends in Host without the port
    (["B", "--device", "cpu", "--allowed-origins", "https://app.example/"], {}, "allowed_origins: 'https://app.example/' "
                                                                              "is no origin"),
    (["B", "--device", "cpu"], {"AUTOGLM_CLOUD_ALLOWED_HOSTS": "api.example:443"}, "allowed_hosts: 'api.example:443' "
                                                                                  "is no host name"),
    # past what Welcome.limits carries: each was a ProtocolError / OverflowError traceback as the app was built
    (["B", "--device", "cpu", "--max-model-len", "10000000000"], {}, "max_model_len must be <= 2147483647"),
    (["B", "--device", "cpu", "--block-size", "100000"], {}, "block_size must be <= 65536"),
    (["B", "--device", "cpu", "--step-timeout-s", "inf"], {}, r"step_timeout_s must be a number of seconds from "
                                                             r"0\.001 to 2147483 \(got inf\)$"),
    (["B", "--device", "cpu", "--session-grace-s", "1e9"], {}, "session_grace_s must be a number of seconds from"),
    # under a millisecond: resume_window_ms 0, no resume at all
    (["B", "--device", "cpu", "--session-grace-s", "1e-9"], {}, "session_grace_s must be a number of seconds from"),
    # Drain.grace_ms: nan / inf were an exception in the SIGTERM drain, which never ended (the server hung)
    (["B", "--device", "cpu", "--drain-timeout-s", "nan"], {}, r"drain_timeout_s must be a number of seconds from 0 "
                                                              r"to 2147483 \(got nan\)$"),
    (["B", "--device", "cpu"], {"AUTOGLM_CLOUD_DRAIN_TIMEOUT_S": "inf"}, "drain_timeout_s must be a number of seconds"),
    (["B", "--device", "cpu", "--drain-timeout-s", "3e6"], {}, "drain_timeout_s must be a number of seconds from 0 to"),
    # infinity kept a silent socket, a WebSocket without Hello and a stalled upload for ever (the edge's rule refused
    # it), and so did 1e300 - accepted by the rule that refused infinity, a deadline that never came all the same
    (["B", "--device", "cpu", "--handshake-timeout-s", "inf"], {}, "handshake_timeout_s must be a number of seconds"),
    (["B", "--device", "cpu", "--handshake-timeout-s", "1e300"], {}, r"handshake_timeout_s must be a number of "
                                                                    r"seconds from 0\.001 to 2147483 \(got 1e\+300\)$"),
    (["B", "--device", "cpu"], {"AUTOGLM_CLOUD_HANDSHAKE_TIMEOUT_S": "nan"}, "handshake_timeout_s must be a number"),
    # the stall watchdog: infinity (or 1e300) never fired, a wedged engine served its probes for ever; 1e-9 (or any
    # value under a real step's time) fired at the first request, a healthy server stopped (exit 1)
    *[(["B", "--device", "cpu", "--engine-stall-s", v], {}, rf"engine_stall_s must be a number of seconds from 1 to "
                                                           rf"2147483 \(got {re.escape(repr(float(v)))}\)$")
      for v in ("inf", "1e300", "1e-9", "0.5", "0", "-1", "nan")],
    (["B", "--device", "cpu"], {"AUTOGLM_CLOUD_ENGINE_STALL_S": "inf"}, "engine_stall_s must be a number of seconds"),
    # `--config "$CFG"` with CFG unset served without the file (its keys file: an open server); '' as a path was '.'
    # and an empty --model-name served the default one
    (["B", "--device", "cpu", "--config", ""], {}, "--config is empty \\(an unset variable\\?\\)"),
    (["B", "--device", "cpu", "--keys-file", ""], {}, "keys_file is empty"),
    (["B", "--device", "cpu", "--model-name", ""], {}, "model_name is empty"),
    (["B", "", "--device", "cpu"], {}, "more_bundles is empty"),
    (["--full", "", "--device", "cpu"], {}, "full is empty"),
    # an empty key (the deployment's secret made from an unset $KEY) served with no auth at all, silently
    (["B", "--device", "cpu", "--api-key", ""], {}, "api_key is empty"),
    (["B", "--device", "cpu"], {"AUTOGLM_CLOUD_API_KEY": ""}, "api_key is empty"),
    # a secret file's trailing newline: the header's token is stripped, so every client got 401
    (["B", "--device", "cpu"], {"AUTOGLM_CLOUD_API_KEY": "abc\n"}, "api_key has whitespace at an end"),
    (["B", "--device", "cpu", "--api-key", "a\tb"], {}, "or a control character"),
    # a header's bytes are read as Latin-1: a UTF-8 client's key got 401, httpx could not send it
    (["B", "--device", "cpu", "--api-key", "caf\u00e9"], {}, "api_key has a character outside ASCII"),
    (["B", "--device", "cpu", "--api-key", "k\udcff"], {}, "api_key has a character outside ASCII"),  # not UTF-8
    # an empty host (`--host "$HOST"`, HOST unset) listened on every interface, where the default is loopback only
    (["B", "--device", "cpu", "--host", ""], {}, "host is empty"),
    (["B", "--device", "cpu", "--host", "[::1]"], {}, r"host \[::1\]: give an IPv6 address without brackets \(::1\)"),
    # a TypeError traceback from the listen probe's bind (shared.cli_exit.host_problem)
    (["B", "--device", "cpu"], {"AUTOGLM_CLOUD_HOST": "a\x00b"}, r"host 'a\\x00b': a control or invisible character"),
    # argv's bytes that are no UTF-8 (surrogateescape): every /v1/models and /metrics answer was a 500
    (["B", "--device", "cpu", "--model-name", "caf\udce9"], {}, "model_name is not UTF-8 text \\(byte 0xe9 after 'caf'\\)"),
    (["B", "--device", "cpu"], {"AUTOGLM_CLOUD_MODEL_NAME": "m\ud800"}, "model_name is not text \\(a lone surrogate U\\+D800"),
])
def test_bad_configuration_is_a_one_line_error(argv, env, message):
    if message is None:
        cfg = _resolve(argv, env)
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            cfg.engine.resolved_variants()
        return
    with pytest.raises(ConfigError, match=message):
        _resolve(argv, env)


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prot": 1}))
    with pytest.raises(ConfigError, match="unknown option"):
        _resolve(["--config", str(bad)])
    bad.write_text(json.dumps({"bundle": "x", "port": "80"}))
    with pytest.raises(ConfigError, match="port must be int"):
        _resolve(["--config", str(bad)])


def test_paths_under_home_in_a_config_file_or_env_are_expanded_as_a_shell_would(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.toml").write_text('bundle = "~/b"\nkeys_file = "~/keys"\nssl_certfile = "~/c.pem"\n'
                                     'ssl_keyfile = "~/k.pem"\ndevice = "cpu"\n')
    cfg = _resolve([], {"AUTOGLM_CLOUD_CONFIG": "~/c.toml"})  # the file itself was "no such file"
    assert (cfg.bundle, cfg.keys_file, cfg.ssl_certfile, cfg.ssl_keyfile) == (
        tmp_path / "b", tmp_path / "keys", tmp_path / "c.pem", tmp_path / "k.pem")
    cfg = _resolve(["--device", "cpu"], {"AUTOGLM_CLOUD_FULL": "~/m.gguf"})
    assert cfg.full == str(tmp_path / "m.gguf")
    assert _resolve(["--full", "tiny-glm4", "--device", "cpu"]).full == "tiny-glm4"
    assert _resolve(["~nosuchuser/b", "--device", "cpu"]).bundle == Path("~nosuchuser/b")  # as a shell leaves it

def test_every_serve_flag_has_a_row_in_the_docs_options_table():
    """--model-name and --config were in --help, not in docs/cloud.md's table of the options."""
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "cloud.md").read_text()
    table = doc[doc.index("## Options"):]
    table = table[:table.index("\n## ")]
    rows = {m for line in table.splitlines() if line.startswith("| `")
            for m in re.findall(r"`(--[a-z0-9\[\]-]+)", line.split("|")[1])}
    rows = {f for r in rows for f in ([r.replace("[no-]", ""), r.replace("[no-]", "no-")] if "[no-]" in r else [r])}
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {o for a in serve._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    assert not flags - rows, sorted(flags - rows)

def test_a_bad_log_level_variable_is_a_one_line_error_and_an_empty_one_is_unset(tmp_path, capsys, monkeypatch):
    """Both were a ValueError traceback from logging.basicConfig (the variable was never checked)."""
    monkeypatch.setenv("AUTOGLM_CLOUD_LOG_LEVEL", "verbose")
    assert main(["serve", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "AUTOGLM_CLOUD_LOG_LEVEL='verbose': expected one of debug, info" in err and "Traceback" not in err
    args = build_parser().parse_args(["serve", str(tmp_path)])
    assert [log_level(args, {"AUTOGLM_CLOUD_LOG_LEVEL": v}) for v in ("", "WARNING")] == ["info", "warning"]

def test_a_config_key_given_twice_is_refused_and_a_dashed_key_gets_its_spelling(tmp_path):
    conf = tmp_path / "c.json"
    conf.write_text('{"bundle": "b", "port": 1, "port": 2}')  # served on 2 without a word
    with pytest.raises(ConfigError, match="key 'port' given twice"):
        _resolve(["--config", str(conf)])
    conf.write_text('{"bundle": "b", "max-sessions": 3}')
    with pytest.raises(ConfigError, match="keys are spelt with _: max-sessions -> max_sessions"):
        _resolve(["--config", str(conf)])

def test_a_bad_value_from_a_variable_or_the_config_file_names_where_it_came_from(tmp_path):
    """'keys_file and api_key: give one' with no --api-key typed: the key was the environment's."""
    with pytest.raises(ConfigError, match=r"give one .*\[api_key from AUTOGLM_CLOUD_API_KEY\]$"):
        _resolve(["B", "--device", "cpu", "--keys-file", "k"], {"AUTOGLM_CLOUD_API_KEY": "abc"})
    conf = tmp_path / "c.json"
    conf.write_text('{"bundle": "b", "port": 70000}')
    with pytest.raises(ConfigError, match=rf"not a TCP port \[port from --config {conf}\]$"):
        _resolve(["--config", str(conf), "--device", "cpu"])
    with pytest.raises(ConfigError, match=rf"^AUTOGLM_CLOUD_CONFIG={tmp_path}: not a file$"):  # was "--config ...:
        _resolve(["--device", "cpu"], {"AUTOGLM_CLOUD_CONFIG": str(tmp_path)})  # no such file", a flag never typed
    with pytest.raises(ConfigError, match=r"max_sessions must be > 0 \(got 0\)$"):  # typed: said as it was
        _resolve(["B", "--device", "cpu", "--max-sessions", "0"], {"AUTOGLM_CLOUD_MAX_SESSIONS": "0"})

def test_an_unknown_variable_of_the_prefix_is_warned_with_the_nearest_name(tmp_path, monkeypatch, caplog):
    """AUTOGLM_CLOUD_API_KEYS=... (a typo) was ignored without a word: a server without a key."""
    import os

    for name in [k for k in os.environ if k.startswith("AUTOGLM_CLOUD_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AUTOGLM_CLOUD_API_KEYS", "secret")
    monkeypatch.setenv("AUTOGLM_CLOUD_ZZZ", "1")
    with caplog.at_level(logging.WARNING, logger="autoglm.cloud"):
        assert main(["serve", str(tmp_path), "--device", "cpu", "--port", "70000"]) == 2
    said = [r.getMessage() for r in caplog.records if "unknown variable" in r.getMessage()]
    assert said == ["ignoring unknown variable(s): AUTOGLM_CLOUD_API_KEYS (did you mean AUTOGLM_CLOUD_API_KEY?), "
                    "AUTOGLM_CLOUD_ZZZ"]

def test_a_config_file_value_a_variable_overrides_is_warned(tmp_path, monkeypatch, caplog):
    """The image sets AUTOGLM_CLOUD_PORT=8000 and _HOST=0.0.0.0 (deploy/Dockerfile): `docker run IMAGE --config F`
    whose file says port 9000 served on 8000 without a word (the environment beats the file)."""
    import os

    for name in [k for k in os.environ if k.startswith("AUTOGLM_CLOUD_")]:
        monkeypatch.delenv(name)
    conf = tmp_path / "cloud.json"
    conf.write_text(json.dumps({"port": 9000, "host": "0.0.0.0", "drain_timeout_s": 60}))
    monkeypatch.setenv("AUTOGLM_CLOUD_PORT", "8000")
    monkeypatch.setenv("AUTOGLM_CLOUD_HOST", "0.0.0.0")  # the same value: nothing to say
    monkeypatch.setenv("AUTOGLM_CLOUD_DRAIN_TIMEOUT_S", "60")
    with caplog.at_level(logging.WARNING, logger="autoglm.cloud"):
        assert main(["serve", str(tmp_path), "--config", str(conf), "--device", "cpu"]) == 2  # not a bundle
    said = [r.getMessage() for r in caplog.records if "overrides" in r.getMessage()]
    assert said == [f"AUTOGLM_CLOUD_PORT=8000 overrides port = 9000 of --config {conf} (command line > environment > "
                    "config file)"]


def test_main_reports_errors_without_a_traceback(tmp_path, capsys):
    assert main(["serve", str(tmp_path), "--device", "cpu"]) == 2
    assert "not a bundle" in capsys.readouterr().err
    r = subprocess.run([sys.executable, "-m", "cloud_server.cli", "serve", "--help"], capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0 and "--max-sessions" in r.stdout and "AUTOGLM_CLOUD_API_KEY" in r.stdout


def test_the_event_loop_is_uvicorns_choice_and_reaches_every_front_end():
    """``--loop`` takes uvicorn's names; ``auto`` is uvloop where it is installed, else asyncio's own loop."""
    import asyncio
    import importlib.util

    from cloud_server.app import loop_factory

    assert _resolve(["B", "--device", "cpu"]).loop == "auto"
    assert _resolve(["B", "--device", "cpu", "--loop", "asyncio"]).loop == "asyncio"
    assert loop_factory("asyncio") is asyncio.new_event_loop
    if importlib.util.find_spec("uvloop") is None:
        assert loop_factory("auto") is asyncio.new_event_loop
        with pytest.raises(ConfigError, match="uvloop is not installed"):
            _resolve(["B", "--device", "cpu", "--loop", "uvloop"])
    else:
        import uvloop

        assert loop_factory("auto") is loop_factory("uvloop") is uvloop.new_event_loop


def test_a_full_models_kv_pool_larger_than_the_device_is_refused_before_it_loads(tmp_path, capsys, monkeypatch):
    """Only a bundle's pool was checked: with --full the model loaded, then the pool's allocation failed in the
    app's startup (a RuntimeError traceback, exit 3). A preset's config and a checkpoint directory's config.json
    give its layers, KV heads and head width without the weights."""
    import partition_tools.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    (tmp_path / "config.json").write_text(json.dumps(models.tiny_glm4_config().to_dict()))
    for source in ("tiny-glm4", str(tmp_path)):
        assert main(["serve", "--full", source, "--device", "cpu", "--num-blocks", str(10**9), "--port", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("autoglm-cloud: error: --num-blocks 1000000000 x --block-size 16: the KV pool needs at "
                              "least 3814.7 GiB per variant, more than this cpu's ") and err.count("\n") == 1, err


def test_a_full_source_that_names_nothing_is_refused_before_the_server_starts(tmp_path, capsys):
    from cloud_server.cli import main

    (tmp_path / "notes.txt").write_text("x")
    for source, message in (("no-such-model", "no such preset"), (str(tmp_path / "notes.txt"), "not a checkpoint")):
        assert main(["serve", "--full", source, "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


@pytest.mark.parametrize("damage, message", [
    ("manifest.json", "not valid JSON"),
    ("cloud/back.safetensors", "manifest says"),
    ("cloud/config.json", "manifest says"),
    ("calibration.json", "manifest says"),
])
def test_a_damaged_bundle_is_refused_in_one_line_before_the_server_starts(tiny_bundle, tmp_path, capsys, damage,
                                                                          message):
    """A truncated manifest or cloud file: the manifest's BundleError escaped main, and a truncated cloud file
    failed the runtime's start inside uvicorn's lifespan ('Application startup failed', a traceback, exit 3)."""
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle, bundle)
    path = bundle / damage
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert main(["serve", str(bundle), "--device", "cpu", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and damage in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    if damage == "cloud/back.safetensors":
        path.unlink()
        assert main(["serve", str(bundle), "--device", "cpu", "--port", "1"]) == 2
        assert "missing artifact" in capsys.readouterr().err


def test_a_bundle_file_the_server_may_not_read_is_refused_in_one_line(tiny_bundle, tmp_path):
    """Another user's bundle (cloud/back.safetensors came out 0600 from split): reading the manifest or hashing a
    cloud file raised PermissionError, a traceback, exit 1. The server runs where file modes bind it (as root:
    without the capabilities that bypass them)."""
    import os
    import shutil

    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: file modes do not bind")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
                  "--inh-caps=-dac_override,-dac_read_search", "--"]
    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle, bundle)
    for rel in ("cloud/back.safetensors", "manifest.json", "."):  # ".": a bundle folder it may not enter
        (bundle / rel).chmod(0)
        r = subprocess.run([*prefix, sys.executable, "-m", "cloud_server.cli", "serve", str(bundle), "--device", "cpu",
                            "--port", "1"], capture_output=True, text=True, timeout=60)
        (bundle / rel).chmod(0o755)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        named = bundle if rel == "." else bundle / rel
        assert f"{named}: cannot be read (Permission denied)" in r.stderr.strip().splitlines()[-1], r.stderr
    bundle.chmod(0o311)  # one it may enter but not list (as others may a 0711 one) serves: the next check says so
    r = subprocess.run([*prefix, sys.executable, "-m", "cloud_server.cli", "serve", str(bundle), "--device", "cpu",
                        "--num-blocks", str(1 << 40), "--port", "1"], capture_output=True, text=True, timeout=60)
    bundle.chmod(0o755)
    assert r.returncode == 2 and "the KV pool needs at least" in r.stderr, r.stderr


def test_a_cloud_file_changed_in_place_is_refused_in_one_line_before_the_server_starts(tiny_bundle, tmp_path,
                                                                                          capsys, monkeypatch):
    """Same size, other bytes (a back half swapped from another model of the same shape, bit rot): the start check
    compared sizes only, and the runtime's load found the sha256 mismatch inside uvicorn's lifespan ('Application
    startup failed', a traceback, exit 3)."""
    import shutil

    import cloud_server.cli as cli

    monkeypatch.setattr(cli, "serve", lambda *a, **k: pytest.fail("the server started"))
    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle, bundle)
    path = bundle / "cloud/back.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["serve", str(bundle), "--device", "cpu", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "sha256 mismatch" in err and str(path) in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_what_would_fail_the_start_is_a_one_line_error_before_it(tiny_bundle, tmp_path, capsys):
    """Each of these failed inside uvicorn's lifespan (a traceback, 'Application startup failed', exit 3), or in
    main before it (a traceback, exit 1): bf16 on a CPU, a CUDA device that is not there, a KV pool larger than
    the machine, a keys file or config file that is not UTF-8 or not JSON."""
    import torch

    not_utf8 = tmp_path / "not-utf8.json"
    not_utf8.write_bytes(b"\xff\xfe{")
    cases = [
        (["--variants", "bf16"], "bf16 compute needs a CUDA device"),
        (["--num-blocks", str(10**12)], "the KV pool needs at least"),
        (["--keys-file", str(not_utf8)], "--keys-file"),
        (["--config", str(not_utf8)], "cannot read"),
        (["--keys-file", str(tmp_path)], f"--keys-file {tmp_path}: not a file"),  # was "no such file"
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "no such CUDA device"))
    for argv, message in cases:
        assert main(["serve", str(tiny_bundle), "--port", "1", *argv] +
                    ([] if "--device" in argv else ["--device", "cpu"])) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)



def test_a_port_in_use_is_a_one_line_error_before_the_model_loads(tiny_bundle, capsys):
    """It loaded the model, then uvicorn could not bind: 'address already in use' among the lifespan's log lines,
    exit status 3 (minutes into the start of a 9B model)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(tiny_bundle), "--device", "cpu", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"autoglm-cloud: error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in use)\n"


def test_a_truncated_gguf_for_full_is_refused_in_one_line_before_the_server_starts(tmp_path, capsys, monkeypatch):
    """A .gguf with the GGUF magic but cut short passed the start checks and failed the runtime's start inside
    uvicorn's lifespan (a ModelLoadError traceback, 'Application startup failed')."""
    import cloud_server.cli as cli
    from partition_tools.models import ModelLoadError, smollm2_gguf_path

    monkeypatch.setattr(cli, "serve", lambda *a, **k: pytest.fail("the server started"))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 40)
    cases = [garbage]
    try:
        real = smollm2_gguf_path().read_bytes()
    except ModelLoadError:
        real = None
    if real is not None:
        for name, keep in (("header.gguf", 4096), ("half.gguf", len(real) // 2), ("one-short.gguf", len(real) - 1)):
            (tmp_path / name).write_bytes(real[:keep])
            cases.append(tmp_path / name)
    for path in cases:
        assert main(["serve", "--full", str(path), "--device", "cpu", "--port", "1"]) == 2, path
        err = capsys.readouterr().err
        assert "cut short" in err and str(path) in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_a_checkpoint_whose_weights_do_not_load_is_refused_in_one_line_before_the_server_starts(tmp_path, capsys):
    """A checkpoint directory that passes the start checks (config.json, a weights file) but whose weights do not
    load (a safetensors file cut short) failed the runtime's load inside uvicorn's lifespan: a ModelLoadError
    traceback, 'Application startup failed', exit 3. The model is loaded before the server starts."""
    import socket

    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    capsys.readouterr()  # save_pretrained's progress bar
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["serve", "--full", str(tmp_path / "m"), "--device", "cpu", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"autoglm-cloud: error: --full {tmp_path / 'm'}: cannot load weights") and \
        "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_full_source_the_load_would_refuse_is_refused_in_one_line_before_the_server_starts(tmp_path, capsys,
                                                                                          monkeypatch):
    """A directory without config.json, the smollm2 preset on a machine without its GGUF, and a GGUF without the
    packages that load it (a `pip install .[cloud]` image) passed the start checks, then failed the runtime's
    load inside uvicorn's lifespan: a ModelLoadError traceback, 'Application startup failed', exit 3."""
    import importlib.util

    import cloud_server.cli as cli
    from partition_tools.models import ModelLoadError, smollm2_gguf_path

    monkeypatch.setattr(cli, "serve", lambda *a, **k: pytest.fail("the server started"))

    def refused(source: str, message: str) -> None:
        assert main(["serve", "--full", source, "--device", "cpu", "--port", "1"]) == 2, source
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err

    (tmp_path / "empty").mkdir()
    refused(str(tmp_path / "empty"), "not a checkpoint directory (no config.json)")
    monkeypatch.setenv("AUTOGLM_SMOLLM2_GGUF", str(tmp_path / "gone.gguf"))
    monkeypatch.setattr("sysconfig.get_paths", lambda: {"purelib": str(tmp_path), "platlib": str(tmp_path)})
    refused("smollm2", "needs the SmolLM2 GGUF file")
    monkeypatch.undo()
    monkeypatch.setattr(cli, "serve", lambda *a, **k: pytest.fail("the server started"))
    try:
        gguf = smollm2_gguf_path()
    except ModelLoadError:
        return
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate"
                        else real_find_spec(name, *a))
    for source in ("smollm2", str(gguf)):
        refused(source, "loading GGUF needs the 'gguf' and 'accelerate' packages (missing: accelerate")


@pytest.mark.parametrize("device,ok", [("cpu", True), ("cuda", True), ("cuda:0", True), ("cuda:1", False),
                                       ("cuda:x", False)])
def test_the_device_check_counts_bare_cuda_as_device_0(monkeypatch, device, ok):
    """`--device cuda` on a one-GPU host was refused with 'no such CUDA device (1 visible)': the check read the
    missing index as invalid instead of as device 0 (caught by the GPU benchmark's first start)."""
    import torch

    import cloud_server.cli as cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    problem = cli._device_problem(device)
    assert problem is None if ok else "no such CUDA device (1 visible)" in problem


def test_tp_2_needs_a_device_for_every_rank(monkeypatch, tiny_bundle, capsys):
    """`--device cuda --tp 2` on a one-GPU host passed the check (device 0 is there) and failed after it, in rank 1's
    process (cuda:1); every rank's device is checked before anything loads, through torch's own device count."""
    import torch

    import cloud_server.cli as cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["serve", str(tiny_bundle), "--port", "1", "--device", "cuda", "--tp", "2",
                 "--variants", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "--tp 2: rank 1 runs on cuda:1: no such CUDA device (1 visible)" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cli._device_problem("cuda", 2) is None and cli._device_problem("cuda:1", 2) is None


def test_serve_help_shows_plain_backticks_not_rst_markup():
    """serve --help printed the module docstring's reST ``literals`` as they are."""
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "``" not in text and "`autoglm-cloud serve --full SOURCE`" in text



def test_bundles_that_cannot_be_served_together_are_a_one_line_error_before_the_load(tiny_bundle,
                                                                                    tiny_glm4_l1_bundle, capsys):
    """One bundle directory given twice (the download catalog's 'a second int8 edge for bundle ...') and several
    bundles with --tp 2 (BundleSet's rule) were BundleError / ConfigError tracebacks after the model load."""
    cases = [
        ([str(tiny_bundle), str(tiny_bundle)], f"{tiny_bundle}: a second"),
        ([str(tiny_bundle), str(tiny_glm4_l1_bundle), "--tp", "2"], "several bundles in one process run without "
                                                                     "tensor parallelism"),
    ]
    for argv, message in cases:
        assert main(["serve", *argv, "--device", "cpu", "--port", "1"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"autoglm-cloud: error: {message}") and len(err.strip().splitlines()) == 1, err


def test_ctrl_c_before_the_server_serves_is_interrupted_exit_130(tiny_bundle, capsys, monkeypatch):
    """Ctrl-C while the command starts (imports, the start checks: uvicorn does not yet turn it into a drain)
    was a KeyboardInterrupt traceback and a death by SIGINT; it ends as every console script's Ctrl-C does
    (shared.cli_exit): 'interrupted', exit 130. Once serving, the first Ctrl-C drains and exits 0 (test_tp.py)."""
    import socket

    import cloud_server.cli as cli

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "serve", interrupted)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["serve", str(tiny_bundle), "--device", "cpu", "--port", str(port)]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_sigterm_before_the_server_serves_is_interrupted_exit_130(tiny_bundle):
    """A SIGTERM while the command starts (its model loading, its bundle's hashes) ended the process by the
    default disposition - and as a container's PID 1, which ignores a signal left at its default, it was not
    heard at all: a pod stopped then waited out its grace period. It ends as Ctrl-C does then: 'interrupted', 130."""
    import subprocess
    import sys

    code = ("import os, signal, sys, time\n"
            "import cloud_server.cli as cli\n"
            "def loading(*_a, **_k):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(30)\n"
            "cli.serve = loading\n"
            f"sys.exit(cli.main(['serve', {str(tiny_bundle)!r}, '--device', 'cpu', '--port', '1']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr.strip().splitlines()[-1:]) == (130, ["interrupted"]), (r.returncode, r.stderr)


def test_a_sighup_before_the_server_serves_leaves_it_starting(tiny_bundle):
    """A SIGHUP while the command starts (its checks, its bundle's hashes, a --full model's load) ended the process
    by the default action, no word, status 129 (a keys rotation's `kill -HUP` just after a restart); it is noted and
    the start goes on to serve (which then reloads the keys file on SIGHUP)."""
    import subprocess
    import sys

    code = ("import os, signal, sys, time\n"
            "import cloud_server.cli as cli\n"
            "def loading(*_a, **_k):\n"
            "    os.kill(os.getpid(), signal.SIGHUP)\n"
            "    time.sleep(0.5)\n"
            "    print('served')\n"
            "    return 0\n"
            "cli.serve = loading\n"
            f"sys.exit(cli.main(['serve', {str(tiny_bundle)!r}, '--device', 'cpu', '--port', '0']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, "served"), (r.returncode, r.stderr)


def test_the_server_opens_as_many_files_as_its_connection_cap(tiny_bundle, tmp_path):
    """Under the usual soft open-file limit of 1024 (a shell's, a container's) the server held ~1000 sockets, far
    below its --max-connections (2048): then every accept failed (EMFILE, 'socket.accept() out of system resource',
    tens of thousands of log lines) and /health and /ready timed out - a liveness restart - though the cap's own
    refusal (503, the probes let through) never came. It raises its soft limit for the cap (up to the hard limit)."""
    import resource
    import socket
    import time
    import urllib.request

    from edge_client.demo import stop_gracefully, wait_ready

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1400:  # this test's own 1100 sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from cloud_server.cli import main; sys.exit(main())", "serve",
             str(tiny_bundle), "--device", "cpu", "--variants", "fp32", "--num-blocks", "32", "--port", str(port),
             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)))
    idle: list[socket.socket] = []
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/ready", 120, "the server")
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(1100)]  # each holds a socket there
        time.sleep(1.0)
        start = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=20) as r:
            assert r.status == 200
        assert time.monotonic() - start < 10
    finally:
        for s in idle:
            s.close()
        stop_gracefully(proc)
    assert "out of system resource" not in (tmp_path / "serve.log").read_text()


def test_a_second_sigterm_just_after_a_drain_never_kills_the_process(tiny_bundle, tmp_path):
    """With nothing open the first SIGTERM drained at once, and the interpreter's teardown (about a second of torch's
    and onnxruntime's native finalizers) ran with the default dispositions back: a second SIGTERM then ended the
    process by the signal (status -15 / 143, no message). The console script now exits without that teardown: the
    second signal finds it gone (0) or still shutting down ('interrupted', 130)."""
    import signal

    from cloud_support import signal_twice

    args = ["--device", "cpu", "--variants", "fp32", "--num-blocks", "32", "--block-size", "4"]
    # uvicorn is done and the command returns 0.3 s later: the process is on its way out
    code, text = signal_twice(tiny_bundle, tmp_path / "serve.log", args, signal.SIGTERM, "Finished server process",
                              signal.SIGTERM, delay_s=0.3)
    assert code in (0, 130), text
    assert "Traceback" not in text, text
    if code == 130:
        assert text.rstrip().endswith("interrupted"), text
