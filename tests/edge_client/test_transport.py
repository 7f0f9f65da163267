"""edge_client.transport: the routing header a prefix-aware proxy hashes on (deploy/nginx)."""

from __future__ import annotations

import asyncio

import pytest
from websockets.asyncio.server import serve

from edge_client.config import RetryPolicy
from edge_client.transport import ROUTE_HEADER, HandshakeRefused, Link, route_key
from shared import protocol as P
from shared.prefix_keys import KeyScope, block_keys, tenant_of, tenant_scoped

SCOPE = KeyScope("bundle-1", "fp32", "fp16")
RETRY = RetryPolicy(connect_timeout_s=2.0, reply_timeout_s=2.0, max_retries=0)


def test_route_key_is_the_first_prefix_key_in_the_tenants_namespace():
    ids = list(range(40))
    first = block_keys(ids, SCOPE, 16)[0]
    assert route_key(ids, SCOPE, 16, "k1") == tenant_scoped(tenant_of("Bearer k1"), first)
    assert route_key(ids, SCOPE, 16, None) == tenant_scoped(tenant_of(None), first)
    assert route_key(ids, SCOPE, 16, "k1") != route_key(ids, SCOPE, 16, "k2")  # tenants never share a route
    assert route_key(ids + [7], SCOPE, 16, "k1") == route_key(ids, SCOPE, 16, "k1")  # only block 0 counts
    assert route_key(ids[:15], SCOPE, 16, "k1") is None  # shorter than a block: no key, no header


@pytest.mark.parametrize("key", [None, "tenant/abc123"])
def test_the_upgrade_carries_the_route_key_only_when_there_is_one(key):
    async def go():
        seen = []

        async def handler(ws):
            seen.append(ws.request.headers.get(ROUTE_HEADER))
            await ws.recv()  # the Hello
            await ws.send(P.encode_message(P.Error(code="bad_state", message="test", fatal=True)))

        async with serve(handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            link = Link(f"ws://127.0.0.1:{port}/v1/split", None, RETRY)
            link.route_key = key
            with pytest.raises(HandshakeRefused):  # the test server refuses the session; the upgrade is the point
                await link.connect(P.Hello(bundle_id="bundle-1", codecs=["fp16"]))
            await link.close()
        return seen

    assert asyncio.run(go()) == [key]
