"""Operator-shared prefixes over a real server (docs/security.md, "Shared prefixes"): blocks an operator's key
publishes serve every tenant; no tenant's upload reaches the shared scope or another tenant's output."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import torch
from cloud_support import EdgeSim, ServerThread, edge_front, greedy_reference

from cloud_server import auth
from cloud_server.app import create_app
from cloud_server.config import EngineConfig, ServerConfig
from cloud_server.runtime import CloudRuntime
from shared import protocol as P
from shared.errors import ProtocolError
from shared.manifest import Manifest
from shared.prefix_keys import SHARED_SCOPE

BLOCK = 4
PROMPT_LEN = 18  # 4 full blocks of 4 (the "system prompt": positions [0, 16)) + 2 of the user's


@pytest.fixture(scope="module")
def shared_server(tiny_bundle, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    keys = {name: auth.add_key(path, name, role=role)[1]
            for name, role in (("ops", "operator"), ("alice", "tenant"), ("bob", "tenant"), ("mallory", "tenant"))}
    rt = CloudRuntime(ServerConfig(bundle=tiny_bundle, keys_file=path, model_name="tiny",
                                   engine=EngineConfig(num_blocks=128, block_size=BLOCK))).start()
    app = create_app(rt)
    with ServerThread(app) as srv:
        srv.runtime, srv.keys, srv.front = rt, keys, edge_front(tiny_bundle)
        yield srv
    rt.stop()


def _edge(srv, bundle, who: str) -> EdgeSim:
    return EdgeSim(srv.ws_url, bundle, Manifest.load(bundle).bundle_id, api_key=srv.keys[who], front=srv.front)


def _case(seed: int, tag: str, lm) -> tuple[list[int], list[str], list[int]]:
    """A prompt, its block keys (named by ``tag``) and its greedy reference answer of 8 tokens."""
    prompt = torch.randint(4, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()
    return prompt, [f"{tag}-{i}" for i in range(PROMPT_LEN // BLOCK)], greedy_reference(lm.model, prompt, 8, [2, 3])


async def _publish(srv, bundle, prompt: list[int], keys: list[str]) -> str:
    """The operator's path: any request of an operator key publishes its prompt blocks into the shared scope."""
    ops = _edge(srv, bundle, "ops")
    await ops.connect()
    _, finish, _ = await ops.generate("p", prompt, 1, keys=keys)
    await ops.close()
    return finish


def _prefix_hits(srv) -> float:
    text = httpx.get(srv.url + "/metrics").text
    return float(re.search(r'^vllm:prefix_cache_hits_total\{model_name="tiny"\} (\S+)$', text, re.M).group(1))


def _cache_keys(srv) -> list[str]:
    fut = srv.runtime.engine.call(lambda e: list(e.block_managers[e.default_variant].block_of_key))
    return fut.result(timeout=10)


def _poison_prefill(keys: list[str], rid: str = "m") -> P.Prefill:
    """A whole prompt of crafted (all-zero) hidden states under ``keys``."""
    hidden = P.EncodedTensor(codec="fp16", shape=(PROMPT_LEN, 64), data=bytes(2 * 64 * PROMPT_LEN))
    return P.Prefill(request_id=rid, start=0, hidden=hidden, prefix_keys=keys, params=P.SamplingParams(max_tokens=1))


async def _plant(edge: EdgeSim, rid: str, keys: list[str]) -> None:
    """Upload crafted states under ``keys``; its blocks are published wherever its key publishes."""
    await edge.send(_poison_prefill(keys, rid))
    while not (isinstance(msg := await edge.recv(), P.Tokens) and msg.finish_reason):
        pass


def test_a_tenant_reuses_the_prefix_an_operator_published(shared_server, tiny_bundle, tiny_lm):
    prompt, keys, ref = _case(1, "sys-a", tiny_lm)

    async def main():
        published = await _publish(shared_server, tiny_bundle, prompt, keys)
        before = _prefix_hits(shared_server)
        alice = _edge(shared_server, tiny_bundle, "alice")
        welcome = await alice.connect()
        hit = await alice.generate("a", prompt, 8, start=16, keys=keys)  # sends only the 2 positions after it
        await alice.close()
        return published, welcome, before, hit

    published, welcome, before, (tokens, finish, last) = asyncio.run(main())
    assert published == "length"
    assert set(keys) <= set(welcome.cached_prefixes)  # the shared blocks are listed to every tenant
    assert tokens == ref and last.usage.cached_tokens == 16
    assert _prefix_hits(shared_server) - before == 16  # counted as prefix-cache hits
    held = _cache_keys(shared_server)
    assert {f"{SHARED_SCOPE}/{k}" for k in keys} <= set(held)
    assert not any(k.startswith("tenant:alice/sys-a") for k in held)  # alice's hit published nothing new


def test_a_tenant_cannot_write_into_the_shared_scope_or_change_another_tenants_output(shared_server, tiny_bundle,
                                                                                       tiny_lm):
    prompt, keys, ref = _case(2, "sys-b", tiny_lm)
    fresh = [k.replace("sys-b", "sys-c") for k in keys]

    async def main():
        mallory = _edge(shared_server, tiny_bundle, "mallory")
        await mallory.connect()
        await _plant(mallory, "m1", keys)  # before the operator, under the keys it is about to publish
        await _plant(mallory, "m2", fresh)  # keys nobody publishes
        await _publish(shared_server, tiny_bundle, prompt, keys)
        own = await mallory.generate("m4", prompt, 8, start=16, keys=keys)
        own_fresh = await mallory.generate("m5", prompt, 8, start=16, keys=fresh)
        await mallory.close()
        bob = _edge(shared_server, tiny_bundle, "bob")
        await bob.connect()
        honest = await bob.generate("b1", prompt, 8, start=16, keys=keys)
        planted = await bob.generate("b2", prompt, 8, start=16, keys=fresh)
        await bob.close()
        return own, own_fresh, honest, planted

    own, own_fresh, honest, planted = asyncio.run(main())
    for poisoned in (own, own_fresh):  # the crafted states work - on mallory's own requests only
        assert poisoned[2].usage.cached_tokens == 16 and poisoned[0] != ref
    assert honest[0] == ref and honest[2].usage.cached_tokens == 16  # bob gets the operator's blocks
    assert planted[1] == "error:prefix_miss"  # mallory's blocks reach no other tenant
    shared = [k for k in _cache_keys(shared_server) if k.startswith(SHARED_SCOPE + "/")]
    assert len(shared) >= 4 and not any("sys-c" in k for k in shared)  # nothing of mallory's is shared
    with pytest.raises(ProtocolError, match="prefix_keys"):  # and no key can name a scope: '/' is not on the wire
        _poison_prefill([f"{SHARED_SCOPE}/{k}" for k in fresh])


def test_tenants_stay_isolated_beside_the_shared_scope(shared_server, tiny_bundle, tiny_lm):
    prompt, keys, ref = _case(3, "alice-own", tiny_lm)

    async def main():
        alice = _edge(shared_server, tiny_bundle, "alice")
        await alice.connect()
        first = await alice.generate("a1", prompt, 8, keys=keys)
        again = await alice.generate("a2", prompt, 8, start=16, keys=keys)
        await alice.close()
        bob = _edge(shared_server, tiny_bundle, "bob")
        welcome = await bob.connect()
        other = await bob.generate("b", prompt, 8, start=16, keys=keys)
        await bob.close()
        return first, again, welcome, other

    first, again, welcome, other = asyncio.run(main())
    assert first[0] == ref and again[0] == ref and again[2].usage.cached_tokens == 16
    assert not set(keys) & set(welcome.cached_prefixes)
    assert other[1] == "error:prefix_miss"  # a tenant's blocks are its own, shared scope or not


def test_the_keys_file_gives_the_operator_role(tmp_path, capsys):
    path = tmp_path / "keys.json"
    assert auth.keys_main(["add", str(path), "--tenant", "ops", "--role", "operator"]) == 0
    key = capsys.readouterr().out.strip()
    principal = auth.Authenticator(path).authenticate(f"Bearer {key}")
    assert principal.role == "operator" and principal.prefix_scope == SHARED_SCOPE
    assert principal.tenant == "tenant:ops"  # usage is still counted under its tenant
    _, plain = auth.add_key(path, "acme")
    assert auth.Authenticator(path).authenticate(f"Bearer {plain}").prefix_scope == "tenant:acme"
    assert auth.Authenticator().authenticate(f"Bearer {key}").prefix_scope.startswith("t")  # open: no operator
    with pytest.raises(auth.KeysFileError, match="role must be one of"):
        auth.parse_keys('{"version": 1, "keys": [{"key_id": "a", "tenant": "x", "hash": "sha256:' + "0" * 64
                        + '", "role": "admin"}]}', "f")
