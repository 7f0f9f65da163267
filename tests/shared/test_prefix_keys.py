"""shared.prefix_keys: one chain per scope (bundle, edge variant, encoding), content digests, tenant names."""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from shared.prefix_keys import (
    PUBLIC_TENANT,
    SHARED_SCOPE,
    KeyScope,
    block_keys,
    chain_key,
    content_digests,
    is_shared,
    shared_fallback,
    tenant_of,
    tenant_scoped,
)

IDS = [int(t) for t in np.random.RandomState(1).randint(4, 512, 75)]  # 4 full blocks of 16 + 11
SCOPE = KeyScope("b1", "int8", "int8-outlier")


def test_keys_form_a_chain():
    k = block_keys(IDS, SCOPE, 16)
    assert len(k) == 4 and len(set(k)) == 4 and all(len(x) == 64 for x in k)
    assert block_keys(IDS[:40], SCOPE, 16) == k[:2]  # a key names its whole prefix...
    other = list(IDS)
    other[3] += 1
    assert all(a != b for a, b in zip(block_keys(other, SCOPE, 16), k))  # ...so a change early changes all


def test_the_documented_derivation():
    lp = lambda s: struct.pack("<I", len(s)) + s.encode()  # noqa: E731
    seed = hashlib.sha256(b"autoglm-prefix-key\x00" + struct.pack("<I", 3) + lp("b1") + lp("int8")
                          + lp("int8-outlier")).digest()
    k0 = hashlib.sha256(seed + np.asarray(IDS[:16], "<i8").tobytes() + bytes(32)).digest()
    k1 = hashlib.sha256(k0 + np.asarray(IDS[16:32], "<i8").tobytes() + bytes(32)).digest()
    assert block_keys(IDS, SCOPE, 16)[:2] == [k0.hex(), k1.hex()]


def test_every_part_of_the_scope_separates_keys():
    k = block_keys(IDS, SCOPE, 16)[0]
    for other in (KeyScope("b2", "int8", "int8-outlier"), KeyScope("b1", "fp32", "int8-outlier"),
                  KeyScope("b1", "int8", "fp16"), KeyScope("b1int8", "", "int8-outlier")):
        assert block_keys(IDS, other, 16)[0] != k


def test_content_digests_fold_into_the_blocks_they_overlap():
    img_a, img_b = hashlib.sha256(b"screenshot A").digest(), hashlib.sha256(b"screenshot B").digest()
    ca = content_digests(75, 16, [(20, 40, img_a)])  # blocks 1 and 2 hold image tokens
    cb = content_digests(75, 16, [(20, 40, img_b)])
    assert ca[0] is None and ca[3] is None and ca[1] is not None and ca[2] is not None
    ka, kb, text = block_keys(IDS, SCOPE, 16, ca), block_keys(IDS, SCOPE, 16, cb), block_keys(IDS, SCOPE, 16)
    assert ka[0] == kb[0] == text[0]  # before the image: shared
    assert ka[1] != kb[1] and ka[1] != text[1] and ka[3] != kb[3]  # from it on: never shared
    assert block_keys(IDS, SCOPE, 16, content_digests(75, 16, [(20, 40, img_a)])) == ka  # same image: same keys
    assert chain_key(b"p", IDS[:16]) == chain_key(b"p", IDS[:16], bytes(32))


def test_tenants_are_digests_of_the_token():
    a, b = tenant_of("Bearer sk-a"), tenant_of("Bearer sk-b")
    assert a != b and a == tenant_of("Bearer sk-a") and "sk-a" not in a
    assert tenant_of(None) == tenant_of("") == tenant_of("Basic xyz") == PUBLIC_TENANT
    assert tenant_scoped(a, "k") != tenant_scoped(b, "k")


def test_a_tenants_key_falls_back_to_the_shared_scope_which_no_tenant_name_reaches():
    a = tenant_of("Bearer sk-a")
    assert shared_fallback(tenant_scoped(a, "k")) == tenant_scoped(SHARED_SCOPE, "k")
    assert shared_fallback(tenant_scoped("tenant:acme", "k")) == tenant_scoped(SHARED_SCOPE, "k")
    assert shared_fallback(tenant_scoped(SHARED_SCOPE, "k")) is None and shared_fallback("k") is None
    assert is_shared(tenant_scoped(SHARED_SCOPE, "k")) and not is_shared(tenant_scoped(a, "k"))
    assert SHARED_SCOPE not in {a, PUBLIC_TENANT, tenant_of("Bearer shared")}
