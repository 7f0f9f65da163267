"""edge_client.config: validation with one-line errors, backoff schedule, environment twins."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from edge_client.config import ConfigError, EdgeConfig, RetryPolicy


@pytest.mark.parametrize("kw", [dict(connect_timeout_s=0), dict(max_retries=-1), dict(backoff_multiplier=0.5),
                                dict(backoff_jitter=1.0), dict(keepalive_interval_s=0)])
def test_retry_policy_refuses_bad_values(kw):
    with pytest.raises(ConfigError, match=next(iter(kw))):
        RetryPolicy(**kw)


def test_backoff_grows_to_its_cap_with_bounded_jitter():
    r = RetryPolicy(backoff_initial_s=0.1, backoff_max_s=1.0, backoff_multiplier=2.0, backoff_jitter=0.2)
    assert [round(r.backoff(k), 3) for k in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]  # rand=0.5: no jitter
    assert r.backoff(0, 0.0) == pytest.approx(0.08) and r.backoff(10, 0.999) <= 1.2
    assert r.backoff(5000) == 1.0  # a reconnect window of many short retries (2.0 ** 1100 overflowed)


@pytest.mark.parametrize("kw, field", [(dict(url="ftp://x"), "url"), (dict(threads=0), "threads"),
                                       (dict(cache_dtype="int8"), "cache_dtype"),
                                       (dict(prefill_chunk=0), "prefill_chunk"), (dict(draft_k=-1), "draft_k"),
                                       (dict(draft_k=2.5), "draft_k"), (dict(draft_k="3"), "draft_k"),
                                       (dict(draft_k=True), "draft_k"), (dict(cloud_drafts="no"), "cloud_drafts"),
                                       (dict(link_kbps=0), "link_kbps"), (dict(link_kbps=float("nan")), "link_kbps"),
                                       (dict(link_kbps="fast"), "link_kbps"),
                                       (dict(cache_dir=""), "cache_dir is empty"), (dict(cache_dir=" "), "cache_dir")])
def test_edge_config_refuses_bad_values(tmp_path, kw, field):
    with pytest.raises(ConfigError, match=field):
        EdgeConfig(bundle=tmp_path, **kw)


def test_environment_twins_and_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOGLM_BUNDLE", str(tmp_path))
    monkeypatch.setenv("AUTOGLM_URL", "ws://cloud:9/v1/split")
    monkeypatch.setenv("AUTOGLM_EDGE_THREADS", "3")
    monkeypatch.setenv("AUTOGLM_EDGE_CACHE_PROMPTS", "no")
    cfg = EdgeConfig.from_env(threads=None, prefill_chunk=64)  # None = flag not given
    assert (cfg.bundle, cfg.url, cfg.threads, cfg.prefill_chunk, cfg.cache_prompts) == \
        (tmp_path, "ws://cloud:9/v1/split", 3, 64, False)
    monkeypatch.setenv("AUTOGLM_EDGE_THREADS", "many")
    with pytest.raises(ConfigError, match="AUTOGLM_EDGE_THREADS"):
        EdgeConfig.from_env()
    monkeypatch.delenv("AUTOGLM_BUNDLE")
    monkeypatch.delenv("AUTOGLM_EDGE_THREADS")
    with pytest.raises(ConfigError, match="no bundle"):
        EdgeConfig.from_env()


def test_every_typed_field_parses_from_its_environment_twin(tmp_path, monkeypatch):
    """Each int / bool field's twin is parsed by its annotation (cloud_drafts=0 switches cloud drafts off;
    an unknown word is refused, not read as false)."""
    monkeypatch.setenv("AUTOGLM_BUNDLE", str(tmp_path))
    monkeypatch.setenv("AUTOGLM_EDGE_CLOUD_DRAFTS", "0")
    monkeypatch.setenv("AUTOGLM_EDGE_AUTO_UPDATE", "On")
    monkeypatch.setenv("AUTOGLM_EDGE_DRAFT_K", "3")
    cfg = EdgeConfig.from_env()
    assert (cfg.cloud_drafts, cfg.auto_update, cfg.draft_k) == (False, True, 3)
    for f in fields(EdgeConfig):
        if f.name == "retry" or f.type.split("|")[0].strip() not in ("int", "bool"):
            continue
        monkeypatch.setenv(f"AUTOGLM_EDGE_{f.name.upper()}", "maybe")
        with pytest.raises(ConfigError, match=f"AUTOGLM_EDGE_{f.name.upper()}"):
            EdgeConfig.from_env()
        monkeypatch.delenv(f"AUTOGLM_EDGE_{f.name.upper()}")


def test_none_in_an_optional_fields_twin_is_none(tmp_path, monkeypatch):
    """docs/edge.md: an environment twin's ``none`` is None for a field that may be None. AUTOGLM_EDGE_CODEC=none
    (the precision policy decides) was refused as "codec 'none'", AUTOGLM_EDGE_CACHE_DIR=none cached into ./none."""
    monkeypatch.setenv("AUTOGLM_BUNDLE", str(tmp_path))
    for name in ("CODEC", "CACHE_DIR", "CA_FILE", "DRAFT_K"):
        monkeypatch.setenv(f"AUTOGLM_EDGE_{name}", "None")
    cfg = EdgeConfig.from_env()
    assert (cfg.codec, cfg.cache_dir, cfg.ca_file, cfg.draft_k) == (None, None, None, None)
    monkeypatch.setenv("AUTOGLM_EDGE_CODEC", "fp32")
    assert EdgeConfig.from_env().codec == "fp32"


def test_the_reconnect_window_has_a_flag_and_an_environment_twin(tmp_path, monkeypatch):
    """The retry policy's fields have environment twins as the config's do (none had), the CLI's
    ``--reconnect-window-s`` wins over its twin, and a bad value is refused naming it."""
    from edge_client.cli import _config, build_parser

    monkeypatch.setenv("AUTOGLM_BUNDLE", str(tmp_path))
    monkeypatch.setenv("AUTOGLM_EDGE_RECONNECT_WINDOW_S", "45")
    monkeypatch.setenv("AUTOGLM_EDGE_KEEPALIVE_INTERVAL_S", "none")
    cfg = EdgeConfig.from_env()
    assert (cfg.retry.reconnect_window_s, cfg.retry.keepalive_interval_s, cfg.retry.max_retries) == (45.0, None, None)
    assert _config(build_parser().parse_args(["chat", "--reconnect-window-s", "120"])).retry.reconnect_window_s == 120
    monkeypatch.setenv("AUTOGLM_EDGE_RECONNECT_WINDOW_S", "soon")
    with pytest.raises(ConfigError, match="AUTOGLM_EDGE_RECONNECT_WINDOW_S"):
        EdgeConfig.from_env()
    with pytest.raises(ConfigError, match="reconnect_window_s"):
        RetryPolicy(reconnect_window_s=0)


def test_paths_starting_with_a_tilde_are_the_users_home(tmp_path, monkeypatch):
    """docs/edge.md's ``cache_dir="~/.cache/autoglm-edge"`` is under the home directory, not a folder named ``~``
    in the working directory (and so are the bundle and the CA file, from an argument or an environment twin)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AUTOGLM_EDGE_CACHE_DIR", "~/cache")
    cfg = EdgeConfig.from_env(bundle="~/bundle")
    assert (cfg.bundle, cfg.cache_dir) == (tmp_path / "bundle", tmp_path / "cache")
    with pytest.raises(ConfigError, match=str(tmp_path / "ca.pem")):
        EdgeConfig(bundle=tmp_path, ca_file="~/ca.pem")
    # a "~name" that is no user stays as written, as a shell leaves it (it was a RuntimeError traceback)
    assert EdgeConfig(bundle="~nosuchuser/b").bundle == Path("~nosuchuser/b")


def test_a_cache_dir_the_app_may_not_look_into_is_left_to_the_cache(tmp_path, monkeypatch):
    """A cache_dir under a folder the app cannot enter (another app's, another user's) was a PermissionError
    traceback from the config's 'is it a file?' check - autoglm-edge chat / serve / preload and EdgeClient failed to
    start (real: as root without CAP_DAC_OVERRIDE, a nobody-owned 0700 parent); the cache refuses it as it refuses a
    read-only one (its blocks in memory). Simulated here: stat refused under that folder."""
    import os

    locked = tmp_path / "locked"
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if str(path).startswith(str(locked)):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    assert EdgeConfig(bundle=tmp_path, cache_dir=locked / "cache").cache_dir == locked / "cache"
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="exists and is not a directory"):  # a file there is still refused
        EdgeConfig(bundle=tmp_path, cache_dir=tmp_path / "file")


@pytest.mark.parametrize("where", ["a folder it may not enter", "a file it may not read"])
def test_a_ca_file_the_app_may_not_read_is_a_config_error(tmp_path, monkeypatch, where):
    """A ca_file in a folder the app may not enter, or another user's (mode 0600), was a PermissionError traceback
    from EdgeConfig (real: root without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH); it is a one-line ConfigError.
    Simulated: stat, or the read, refused."""
    import os
    import ssl

    ca = tmp_path / "ca.pem"
    ca.write_text("")
    if where == "a folder it may not enter":
        real_stat = os.stat

        def stat(path, *args, **kwargs):
            if str(path) == str(ca):
                raise PermissionError(13, "Permission denied", str(path))
            return real_stat(path, *args, **kwargs)

        monkeypatch.setattr(os, "stat", stat)
    else:
        def refused(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(ssl, "create_default_context", refused)
    with pytest.raises(ConfigError, match=f"^ca_file {ca}: cannot be read \\(Permission denied\\); the user running "
                                          "this needs read access to it$"):
        EdgeConfig(bundle=tmp_path, url="wss://h:8000", ca_file=ca)


@pytest.mark.parametrize("given, expected", [
    (" ws://h:8000 ", "ws://h:8000/v1/split"),  # an environment twin read from a file: the port was ' 8000'
    ("wss://gw/autoglm/v1 \n", "wss://gw/autoglm/v1/split"),  # the path was '/v1 ', its server's answer HTTP 400
    ("ws://[::1]:8000/", "ws://[::1]:8000/v1/split"),
    ("ws://h:8000/v1?tenant=a", "ws://h:8000/v1/split?tenant=a"),
    # an OpenAI client's base_url (a ConfigError before): the same server's WebSocket, the same path rules
    ("http://h:8000/v1", "ws://h:8000/v1/split"),
    ("https://gw/autoglm/v1/", "wss://gw/autoglm/v1/split"),
    ("HTTPS://h:8443", "wss://h:8443/v1/split"),
    ("http://h/v1/split?tenant=a", "ws://h/v1/split?tenant=a"),
])
def test_a_url_with_whitespace_around_it_is_the_url(given, expected):
    from edge_client.config import split_url

    assert split_url(given) == expected


@pytest.mark.parametrize("url, match", [
    ("ws://127.0.0.1:0", "port 0"),  # dialled port 80 instead
    ("ws://h:8000/v 1", "whitespace inside"),
    ("ws://user:s3cret@h:8000/v1", "credentials in the URL"),  # sent as Basic auth and shown in every error
    ("ws://user:s3cret@h:bad/v1", "credentials in the URL"),
    ("https://user:s3cret@h/v1", "credentials in the URL"),
    ("ftp://h/v1", "expected ws://, wss://, http:// or https://"),
])
def test_a_url_the_client_cannot_dial_as_written_is_a_config_error_that_shows_no_password(tmp_path, url, match):
    with pytest.raises(ConfigError, match=match) as e:
        EdgeConfig(bundle=tmp_path, url=url)
    assert "s3cret" not in str(e.value)
