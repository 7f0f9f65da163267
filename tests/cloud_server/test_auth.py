"""API keys (cloud_server.auth) and per-key limits and usage over a real server: the keys file holds hashes
only, every entry is compared in constant time, reloads follow the file, the WebSocket and /v1 need the
header (never the query string), per-key session caps, per-tenant usage in /metrics, trace ids in the log."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import stat
import time

import httpx
import pytest
import websockets
from cloud_support import EdgeSim, ServerThread

from cloud_server import auth
from cloud_server.app import create_app
from cloud_server.config import ConfigError, EngineConfig, ServerConfig
from cloud_server.runtime import CloudRuntime
from shared import protocol as P
from shared.manifest import Manifest


# -- the keys file ------------------------------------------------------------------------------------
def test_keys_cli_prints_the_key_once_and_stores_only_its_hash(tmp_path, capsys):
    path = tmp_path / "keys.json"
    assert auth.keys_main(["add", str(path), "--tenant", "acme", "--max-sessions", "3"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("agk_") and len(key) > 40
    text = path.read_text()
    assert key not in text and auth.hash_key(key) in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    (entry,) = json.loads(text)["keys"]
    assert entry["tenant"] == "acme" and entry["max_sessions"] == 3
    assert auth.keys_main(["add", str(path), "--tenant", "bad name!"]) == 2  # refused, file unchanged
    assert json.loads(path.read_text())["keys"] == [entry]


@pytest.mark.parametrize("argv, said", [
    (["--tenant", "bad name!"], "autoglm-cloud keys: error: tenant 'bad name!': must be 1-64 characters"),
    (["--tenant", "ok", "--max-sessions", "0"], "autoglm-cloud keys: error: max_sessions 0: must be a positive"),
])
def test_keys_add_names_the_bad_value_not_an_entry_of_the_file(tmp_path, capsys, argv, said):
    """It said 'keys.json: keys[1]: tenant must be ...', an entry that was never written, as if the file were
    broken."""
    path = tmp_path / "keys.json"
    assert auth.keys_main(["add", str(path), "--tenant", "acme"]) == 0
    before = path.read_text()
    capsys.readouterr()
    assert auth.keys_main(["add", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and "keys[" not in err and path.read_text() == before


def test_lookup_compares_every_entry_in_constant_time(tmp_path, monkeypatch):
    path = tmp_path / "keys.json"
    keys = [auth.add_key(path, f"t{i}")[1] for i in range(5)]
    store = auth.KeyStore(path)
    calls = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    assert store.lookup(keys[0]).tenant == "t0"  # a match on the first entry still compares all five
    assert len(calls) == 5
    assert store.lookup("agk_wrong") is None and store.lookup(keys[0][:-1]) is None


def test_the_store_reloads_on_change_and_on_sighup_and_keeps_keys_over_a_broken_file(tmp_path, monkeypatch):
    monkeypatch.setattr(auth, "STAT_EVERY_S", 0.0)
    path = tmp_path / "keys.json"
    _, alice = auth.add_key(path, "alice")
    store = auth.KeyStore(path)
    _, bob = auth.add_key(path, "bob")
    os.utime(path, (time.time() + 5, time.time() + 5))  # a new mtime even on a coarse clock
    assert store.lookup(bob).tenant == "bob" and store.reloads == 1
    good = path.read_text()
    path.write_text("{not json")
    os.utime(path, (time.time() + 10, time.time() + 10))
    assert store.lookup(alice).tenant == "alice"  # the broken edit did not lock anyone out
    path.write_bytes(b"\xff\xfe" + good.encode())  # not UTF-8: UnicodeDecodeError escaped (a 500 for the request)
    os.utime(path, (time.time() + 15, time.time() + 15))
    assert store.lookup(alice).tenant == "alice"
    path.write_text(good)
    old = signal.getsignal(signal.SIGHUP)
    try:
        assert auth.install_sighup(store)
        os.kill(os.getpid(), signal.SIGHUP)
        assert store.reloads == 2
    finally:
        signal.signal(signal.SIGHUP, old)
    with pytest.raises(auth.KeysFileError, match="keys\\[0\\]: hash"):
        auth.parse_keys('{"version": 1, "keys": [{"key_id": "a", "tenant": "x", "hash": "md5:00"}]}', "f")
    with pytest.raises(ConfigError, match="give one"):
        ServerConfig(bundle=tmp_path, keys_file=path, api_key="k")


def test_a_deleted_keys_file_keeps_the_last_keys_with_one_warning_and_is_read_again_when_back(tmp_path,
                                                                                             monkeypatch, caplog):
    monkeypatch.setattr(auth, "STAT_EVERY_S", 0.0)
    path = tmp_path / "keys.json"
    _, alice = auth.add_key(path, "alice")
    store = auth.KeyStore(path)
    good = path.read_text()
    path.unlink()
    with caplog.at_level(logging.WARNING, logger="autoglm.cloud.auth"):
        assert store.lookup(alice).tenant == "alice" and store.lookup(alice).tenant == "alice"
    gone = [r.getMessage() for r in caplog.records if "is gone" in r.getMessage()]
    assert len(gone) == 1 and str(path) in gone[0] and "last 1 keys" in gone[0]  # silent before
    path.write_text(good.replace("alice", "carol"))  # back: read again
    assert store.lookup(alice).tenant == "carol" and store.reloads == 1


@pytest.mark.parametrize("where, said", [("missing/keys.json", "missing is not an existing folder"),
                                         ("a_file/keys.json", "a_file is not an existing folder")])
def test_keys_add_into_a_folder_that_is_not_there_names_the_folder(tmp_path, capsys, monkeypatch, where, said):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")
    assert auth.keys_main(["add", where, "--tenant", "acme"]) == 2
    err = capsys.readouterr().err
    assert said in err and ".lock" not in err and ".tmp" not in err  # it named .keys.json.lock
    assert auth.keys_main(["add", "/proc/keys.json", "--tenant", "acme"]) == 2  # a folder that takes no new file
    err = capsys.readouterr().err
    assert "/proc/keys.json: cannot write it there" in err and ".lock" not in err
    (tmp_path / "k.json").write_bytes(b"\xff\xfe")
    assert auth.keys_main(["add", "k.json", "--tenant", "acme"]) == 2  # a UnicodeDecodeError traceback
    assert "k.json: not UTF-8 text" in capsys.readouterr().err

def test_keys_add_through_a_symlink_writes_the_file_it_names(tmp_path, capsys):
    """The link was replaced by a file of its own: the key was printed, and the file a server reads (the link's
    target, on a shared volume) never had it."""
    real = tmp_path / "volume" / "keys.json"
    real.parent.mkdir()
    auth.add_key(real, "alice")
    link = tmp_path / "keys.json"
    link.symlink_to(real)
    _, bob = auth.add_key(link, "bob")
    assert link.is_symlink() and auth.KeyStore(real).lookup(bob).tenant == "bob"
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    assert auth.keys_main(["add", str(tmp_path / "loop1"), "--tenant", "carol"]) == 2
    assert "a symlink loop, no keys file" in capsys.readouterr().err and (tmp_path / "loop1").is_symlink()


def test_keys_add_keeps_the_files_mode_and_owner(tmp_path):
    """A root:autoglm 0640 file came back root:root 0600 from 'keys add' (the .tmp's): the server's user could no
    longer read it."""
    path = tmp_path / "keys.json"
    auth.add_key(path, "alice")
    path.chmod(0o640)
    group = 1 if os.geteuid() == 0 else os.getgid()  # root can give it another group
    os.chown(path, -1, group)
    auth.add_key(path, "bob")
    st = path.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o640, group) and len(json.loads(path.read_text())["keys"]) == 2

def test_sighup_without_a_keys_file_leaves_the_server_running():
    """serve (and each front-end worker) installed no SIGHUP handler without a keys file: a `kill -HUP` (a reload
    habit, logrotate's postrotate) ended it at once by the signal, undrained (status 129)."""
    import subprocess
    import sys

    code = ("import logging, os, signal; logging.basicConfig(level='INFO'); from cloud_server.auth import "
            "install_sighup; assert install_sighup(None); os.kill(os.getpid(), signal.SIGHUP); print('alive')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert (r.returncode, r.stdout.strip()) == (0, "alive") and "no keys file to reload" in r.stderr

def _add_one(args):
    path, tenant = args
    return auth.add_key(path, tenant)[1]


def test_keys_added_at_once_are_all_stored(tmp_path):
    """Two `keys add` at once each wrote back the file as they had read it: a key printed but never stored."""
    import multiprocessing

    path = tmp_path / "keys.json"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        keys = pool.map(_add_one, [(path, f"t{i}") for i in range(12)])
    store = auth.KeyStore(path)
    assert len(store) == 12 and all(store.lookup(k) is not None for k in keys)


# -- over a server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(tiny_bundle, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    _, alice = auth.add_key(path, "alice", max_sessions=2)
    _, bob = auth.add_key(path, "bob")
    _, ops = auth.add_key(path, "ops", role="operator")  # reads /metrics; opens no session here
    rt = CloudRuntime(ServerConfig(bundle=tiny_bundle, keys_file=path, open_probes=False, model_name="tiny",
                                   engine=EngineConfig(num_blocks=64, block_size=4))).start()
    app = create_app(rt)
    with ServerThread(app) as srv:
        srv.runtime, srv.app, srv.keys_path, srv.alice, srv.bob, srv.ops = rt, app, path, alice, bob, ops
        yield srv
    rt.stop()


def _edge(srv, bundle, key):
    return EdgeSim(srv.ws_url, bundle, Manifest.load(bundle).bundle_id, api_key=key)


def _bearer(key):
    return {"Authorization": f"Bearer {key}"}


def test_http_needs_the_header_and_probes_can_be_closed(keyed):
    refused = httpx.get(keyed.url + "/v1/models")
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"  # RFC 9110 15.5.2
    assert httpx.get(keyed.url + "/v1/models", headers=_bearer("agk_guess")).status_code == 401
    assert httpx.get(keyed.url + f"/v1/models?api_key={keyed.alice}").status_code == 401  # never the URL
    assert httpx.get(keyed.url + "/v1/models", headers=_bearer(keyed.alice)).status_code == 200
    # the scheme is case-insensitive (RFC 9110 section 11.1); the key is not
    assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"bearer {keyed.alice}"}).status_code == 200
    assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {keyed.alice.upper()}"}
                     ).status_code == 401
    body = httpx.get(keyed.url + "/metrics").json()
    assert body["error"]["code"] == "invalid_api_key"  # open_probes=False
    assert httpx.get(keyed.url + "/ready", headers=_bearer(keyed.bob)).status_code == 200


def test_an_openai_client_pointed_at_a_split_server_is_told_where_chat_is(keyed):
    """The model is listed in /v1/models, and chat was a bare 404 'Not Found': the openai client's NotFoundError
    now says that chat is full-model mode's and the edge's local API's. Behind the key, as every /v1 route."""
    import openai

    oa = openai.OpenAI(base_url=keyed.url + "/v1", api_key=keyed.alice, max_retries=0)
    assert [m.id for m in oa.models.list().data] == ["tiny"]
    for create in (lambda: oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}]),
                   lambda: oa.completions.create(model="tiny", prompt="hi")):
        with pytest.raises(openai.NotFoundError, match="split mode.*autoglm-edge serve") as e:
            create()
        assert e.value.code == "not_found"
    assert httpx.post(keyed.url + "/v1/completions", json={"prompt": "hi"}).status_code == 401


def test_websocket_keys_caps_usage_and_trace(keyed, tiny_bundle, caplog):
    async def main():
        with pytest.raises(websockets.InvalidStatus) as nokey:
            await _edge(keyed, tiny_bundle, None).connect()
        query = EdgeSim(keyed.ws_url + f"?api_key={keyed.alice}", tiny_bundle,
                        Manifest.load(tiny_bundle).bundle_id)
        with pytest.raises(websockets.InvalidStatus) as inquery:
            await query.connect()
        a1, a2, a3 = (_edge(keyed, tiny_bundle, keyed.alice) for _ in range(3))
        await a1.connect()
        await a2.connect()
        refused = await a3.connect()  # alice's key holds 2 sessions at most
        b = _edge(keyed, tiny_bundle, keyed.bob)
        await b.connect()  # bob is not affected by alice's cap
        tokens, finish, _ = await a1.generate("trace-me-1", [5, 6, 7, 8, 9], 4)
        sessions = {s.principal.tenant for s in keyed.app.state.split.registry.by_id.values()}
        for e in (a1, a2, b):
            await e.close()
        nokey = nokey.value.response.status_code, nokey.value.response.headers.get("WWW-Authenticate")
        return nokey, inquery.value.response.status_code, refused, tokens, finish, \
            sessions

    with caplog.at_level(logging.INFO, logger="autoglm.cloud.trace"):
        nokey, inquery, refused, tokens, finish, tenants = asyncio.run(main())
    assert nokey == (401, "Bearer") and inquery == 401
    assert isinstance(refused, P.Error) and refused.code == "overloaded" and refused.retry_after_ms
    assert "holds its limit of 2 sessions" in refused.message
    assert len(tokens) == 4 and finish == "length"
    assert tenants == {"tenant:alice", "tenant:bob"}  # Session.principal.tenant: the prefix-cache namespace
    # /metrics names every tenant's usage: not for another tenant's key, only an operator's
    assert httpx.get(keyed.url + "/metrics", headers=_bearer(keyed.bob)).status_code == 403
    text = httpx.get(keyed.url + "/metrics", headers=_bearer(keyed.ops)).text
    assert 'autoglm:tenant_generation_tokens_total{model_name="tiny",tenant="alice"} 4.0' in text
    assert 'autoglm:tenant_prompt_tokens_total{model_name="tiny",tenant="alice"} 5.0' in text
    assert 'autoglm:tenant_requests_total{model_name="tiny",tenant="alice"} 1.0' in text
    assert 'autoglm:tenant_sessions_total{model_name="tiny",tenant="alice"} 2.0' in text
    assert 'autoglm:tenant_sessions_total{model_name="tiny",tenant="bob"} 1.0' in text
    assert 'autoglm:sessions_refused_total{model_name="tiny",reason="key_session_cap"} 1.0' in text
    assert 'tenant_uplink_bytes_total{model_name="tiny",tenant="alice"}' in text
    lines = [r.getMessage() for r in caplog.records if "trace=trace-me-1" in r.getMessage()]
    assert any("open" in m for m in lines) and any("finish=length tokens=4" in m for m in lines), lines


def test_a_websocket_refused_for_its_key_is_counted(keyed, tiny_bundle):
    """A WebSocket upgrade without a key or with a wrong one (a revoked phone, a guesser on /v1/split) got its 401
    and was counted nowhere - neither in autoglm:http_requests_refused_total (HTTP routes only) nor in
    autoglm:sessions_refused_total, which names every session refused at its handshake: an operator could not see
    it. It counts as a refused session, reason unauthorized (the protocol's code for it)."""
    series = 'autoglm:sessions_refused_total{model_name="tiny",reason="unauthorized"} '

    def refused() -> float:
        text = httpx.get(keyed.url + "/metrics", headers=_bearer(keyed.ops)).text
        return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(series)), 0.0)

    async def upgrade(key):
        with pytest.raises(websockets.InvalidStatus) as e:
            await _edge(keyed, tiny_bundle, key).connect()
        return e.value.response.status_code

    before = refused()
    assert [asyncio.run(upgrade(key)) for key in (None, "agk_guess")] == [401, 401]
    assert refused() == before + 2


def test_a_key_added_to_the_file_works_without_a_restart(keyed, tiny_bundle):
    _, carol = auth.add_key(keyed.keys_path, "carol")
    os.utime(keyed.keys_path, (time.time() + 5, time.time() + 5))
    deadline = time.monotonic() + 5
    while httpx.get(keyed.url + "/v1/models", headers=_bearer(carol)).status_code != 200:
        assert time.monotonic() < deadline, "the new key was not picked up"
        time.sleep(0.2)


async def _until_status(url: str, key: str, status: int) -> None:
    """Wait (5 s at most) until ``url`` answers ``key`` with ``status``: the server re-reads its keys file at most
    once a second."""
    deadline = time.monotonic() + 5
    while httpx.get(url, headers=_bearer(key)).status_code != status:
        assert time.monotonic() < deadline, f"the keys file change was not picked up (want {status})"
        await asyncio.sleep(0.2)


def test_a_revoked_key_starts_no_new_request_on_a_session_it_opened(keyed, tiny_bundle):
    _, dave = auth.add_key(keyed.keys_path, "dave")
    data = json.loads(keyed.keys_path.read_text())

    def until(status):  # the server re-reads the file at most once a second
        return _until_status(keyed.url + "/v1/models", dave, status)

    async def main():
        await until(200)
        edge = _edge(keyed, tiny_bundle, dave)
        await edge.connect()
        before = await edge.generate("before-revoke", [5, 6, 7, 8, 9], 2)
        data["keys"] = [k for k in data["keys"] if k["tenant"] != "dave"]  # revoked: removed from the file
        keyed.keys_path.write_text(json.dumps(data))
        os.utime(keyed.keys_path, (time.time() + 10, time.time() + 10))
        await until(401)
        after = await edge.generate("after-revoke", [5, 6, 7, 8, 9], 2)
        await edge.close()
        return before, after

    before, after = asyncio.run(main())
    assert before[1] == "length"
    assert after[0] == [] and after[1] == "error:unauthorized" and after[2].fatal, after


def _edit_entry(path, key_id, **fields):
    """Set (None: drop) ``fields`` of the keys file's entry ``key_id``, with an mtime the server's next look sees."""
    data = json.loads(path.read_text())
    for e in data["keys"]:
        if e["key_id"] == key_id:
            e.update(fields)
            for k in [k for k, v in fields.items() if v is None]:
                del e[k]
    path.write_text(json.dumps(data))
    os.utime(path, (time.time() + 20, time.time() + 20))


def test_an_operator_key_demoted_in_the_file_publishes_nothing_more_on_its_open_session(keyed, tiny_bundle):
    """An operator key demoted to a tenant key (its ``role`` removed from its entry) was still an operator on a
    session it had opened: its next prompts went into the shared scope, which every tenant's lookups fall back to -
    on a real autoglm-cloud serve bob was served the demoted key's uploaded states (cached_tokens 16) and saw its keys
    in Welcome.cached_prefixes. A session holds to the tenant and role it opened with (auth.Principal.acts_as): once
    the entry names another, it starts no new request (Error unauthorized, fatal), as a revoked key's; a new session
    opens as the entry says now."""
    key_id, pub = auth.add_key(keyed.keys_path, "pub", role="operator")
    prompt = list(range(5, 22))  # 17 tokens: 4 full blocks of 4, then the one position a request sends

    def until(status):  # /metrics takes an operator key: 403 once the server has read the demotion
        return _until_status(keyed.url + "/metrics", pub, status)

    async def main():
        await until(200)
        op = _edge(keyed, tiny_bundle, pub)
        await op.connect()
        published = await op.generate("published", prompt, 1, keys=[f"pub-a{i}" for i in range(4)])
        _edit_entry(keyed.keys_path, key_id, role=None)
        await until(403)
        demoted = await op.generate("demoted", prompt, 1, keys=[f"pub-b{i}" for i in range(4)])
        bob = _edge(keyed, tiny_bundle, keyed.bob)
        welcome = await bob.connect()
        listed = [k for k in welcome.cached_prefixes if k.startswith("pub-")]
        hit = await bob.generate("reuse", prompt, 1, start=16, keys=[f"pub-b{i}" for i in range(4)])
        again = _edge(keyed, tiny_bundle, pub)  # a new session of the demoted key: its tenant's scope
        await again.connect()
        mine = await again.generate("own", prompt, 1, keys=[f"pub-c{i}" for i in range(4)])
        theirs = await bob.generate("theirs", prompt, 1, start=16, keys=[f"pub-c{i}" for i in range(4)])
        for e in (bob, again):
            await e.close()
        return published, demoted, listed, hit, mine, theirs

    published, demoted, listed, hit, mine, theirs = asyncio.run(main())
    assert published[1] == "length"
    assert demoted[1] == "error:unauthorized" and demoted[2].fatal, demoted
    assert sorted(listed) == [f"pub-a{i}" for i in range(4)]  # published as an operator: shared, listed to bob
    assert hit[1] == "error:prefix_miss", hit
    assert mine[1] == "length" and theirs[1] == "error:prefix_miss", (mine, theirs)


def test_a_resume_token_reopens_its_session_only_for_a_key_acting_as_its_own(keyed, tiny_bundle):
    """A resume token opens its session again only with a key of the same tenant and role: bob's key presenting
    alice's token, and a tenant key presenting the token of its tenant's operator key's session (which publishes
    into the shared scope), each open a new session of their own (``Welcome.resumed`` false)."""
    _, op = auth.add_key(keyed.keys_path, "mixed", role="operator")
    _, member = auth.add_key(keyed.keys_path, "mixed")
    _, member2 = auth.add_key(keyed.keys_path, "mixed")
    os.utime(keyed.keys_path, (time.time() + 30, time.time() + 30))

    async def main():
        deadline = time.monotonic() + 5
        while httpx.get(keyed.url + "/v1/models", headers=_bearer(member2)).status_code != 200:
            assert time.monotonic() < deadline, "the new keys were not picked up"
            await asyncio.sleep(0.2)
        opened = {}
        for name, key in (("alice", keyed.alice), ("op", op), ("member", member)):
            edge = _edge(keyed, tiny_bundle, key)
            opened[name] = (edge, (await edge.connect()).resume_token)
            edge.kill()  # the link drops: the session waits for its resume
        resumed = {}
        for name, key, token in (("bob with alice's", keyed.bob, opened["alice"][1]),
                                 ("member with op's", member, opened["op"][1]),
                                 ("member2 with member's", member2, opened["member"][1])):
            edge = _edge(keyed, tiny_bundle, key)
            resumed[name] = (await edge.connect(resume_token=token)).resumed
            await edge.close()
        return resumed

    assert asyncio.run(main()) == {"bob with alice's": False, "member with op's": False,
                                   "member2 with member's": True}  # another key of the same tenant and role may


def test_an_edges_error_message_writes_one_log_line_and_forges_no_trace(keyed, tiny_bundle, caplog):
    """The server logs an edge's ``Error`` (``edge <session> reports <code>: <message>``); its message is the peer's
    free text (up to 1024 characters), and a newline in it wrote lines of the sender's making into the server's log:
    on a real autoglm-cloud serve bob's key wrote a ``autoglm.cloud.trace: ... tenant=alice finish=length
    tokens=99999`` line that a log-based usage count bills to alice. It is logged quoted and escaped, on one line."""
    forged = ("ok\n2026-12-07 23:59:59,000 INFO autoglm.cloud.trace: trace=bill-me session=0123456789abcdef "
              "tenant=alice finish=length tokens=99999\r\x1b[2K")

    async def main():
        bob = _edge(keyed, tiny_bundle, keyed.bob)
        await bob.connect()
        await bob.send(P.Error(code="note", message=forged))
        tokens = await bob.generate("after-the-note", [5, 6, 7, 8, 9], 1)  # answered: the note was read first
        await bob.close()
        return tokens

    with caplog.at_level(logging.INFO):
        assert asyncio.run(main())[1] == "length"
    said = [r.getMessage() for r in caplog.records if "reports note" in r.getMessage()]
    assert len(said) == 1 and not any(c in said[0] for c in "\n\r\x1b"), said
    assert "trace=bill-me" in said[0] and "\\n2026" in said[0]  # shown, escaped


def test_autoglm_cloud_keys_add_is_the_cli_entry(tmp_path, capsys):
    from cloud_server import cli

    path = tmp_path / "k.json"
    assert cli.main(["keys", "add", str(path), "--tenant", "ops"]) == 0
    key = capsys.readouterr().out.strip()
    assert auth.KeyStore(path).lookup(key).tenant == "ops"


_HASH = "sha256:" + "ab" * 32


@pytest.mark.parametrize("keys, said", [
    # a hand edit's typo: the cap (or the operator role) it meant was read as absent, without a word
    ([{"key_id": "a", "tenant": "acme", "hash": _HASH, "max_sesions": 1}], "keys[0]: unknown field(s) max_sesions"),
    # one key in two entries opened as the last one's tenant, cap and role
    ([{"key_id": "a", "tenant": "acme", "hash": _HASH},
      {"key_id": "b", "tenant": "evil", "hash": "sha256:" + "AB" * 32}], "keys[1]: hash is keys[0]'s"),  # in capitals
])
def test_a_keys_file_that_would_be_misread_is_refused(tmp_path, keys, said):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"version": 1, "keys": keys}))
    with pytest.raises(auth.KeysFileError, match=f"^{re.escape(f'{path}: {said}')}"):
        auth.KeyStore(path)


def test_a_keys_file_field_given_twice_is_refused_not_read_as_the_last():
    """``{"tenant": "acme", "tenant": "evil"}``: json kept the last."""
    text = ('{"version": 1, "keys": [{"key_id": "a", "tenant": "acme", "tenant": "evil", "hash": "' + _HASH + '"}]}')
    with pytest.raises(auth.KeysFileError, match="not JSON \\(key 'tenant' given twice\\)"):
        auth.parse_keys(text, "f")
    with pytest.raises(auth.KeysFileError, match="and nothing else"):
        auth.parse_keys('{"version": 1, "keys": [], "kyes": []}', "f")
