"""Prefix-block keys: the one derivation behind the edge's activation cache and the cloud's prefix cache.

A key names one full block of ``B`` prompt tokens *together with everything before it and everything that
produced its states*, so two requests share a cached block only when sharing cannot change an answer.
Version 3 (docs/protocol.md, "Prefix keys")::

    seed   = sha256("autoglm-prefix-key" 0x00 || u32le(3) || lp(bundle_id) || lp(edge_variant) || lp(encoding))
    k_0    = sha256(seed    || int64le(ids of block 0) || c_0)
    k_i    = sha256(k_{i-1} || int64le(ids of block i) || c_i)        key_i = hex(k_i)

``lp(s)`` is ``u32le(len) || utf-8 bytes``. The scope (:class:`KeyScope`) says what produced the states:
the bundle (``Manifest.bundle_id``: the model and the split), the edge front's weights (``edge_variant``:
``Manifest.states_variant``, the edge variant plus a digest of the edge graphs that compute the states, since an int8 front's states differ from an fp32 one's, and a front whose prompt
runs through an fp32 copy differs from both) and how the states were
carried (``encoding``: the wire codec for the cloud's blocks, ``+cache-float16`` added by an edge whose
activation cache rounds the prefixes it sends from there; the storage dtype for the edge's own cache).
``c_i`` is block i's 32-byte content digest: all zeros for text, else a digest of the non-text inputs
(image, audio) whose placeholder tokens fall in the block (:func:`content_digests`), because every image
token has the same id and two screenshots must never share a block.

Any change to what a key hashes, or to what a scope's strings mean, bumps :data:`PREFIX_KEY_VERSION` (it is in
every seed): phones run old clients for weeks, and the cloud cannot check a key, so a derivation changed under
the same version names different states by one key - a miss is only slower, a block of other states a wrong
answer. Clients of different versions then never share a block.

Unsalted keys let whoever holds them test a guess: hash a candidate prompt and compare. The private levels
therefore key the chain with a per-tenant secret (:attr:`KeyScope.secret`): an HMAC seed the cloud cannot
recompute. The cloud never sees token ids, so it cannot check a key; it therefore keeps every tenant's blocks apart
(:func:`tenant_scoped`): a client can only ever be served states that its own tenant uploaded - or states the
operator published in the shared scope (:data:`SHARED_SCOPE`): a key of the keys file with the ``operator`` role
publishes there, no other client can, and a tenant's lookup that misses its own scope falls back to it
(:func:`shared_fallback`), so a system prompt the operator preloads serves every tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# 1: sha256(k_{i-1} || ids || bundle_id), no scope, no content, no tenant. 2: the seed and scope above, whose
# encoding was at first the bare codec even for the states an edge sends rounded from its float16 activation cache,
# and later (commit 236f8e7) names that rounding (+cache-float16) under the same number: an older client's rounded
# blocks had a newer exact client's keys. 3: version 2's last derivation, under a number of its own.
PREFIX_KEY_VERSION = 3
NO_CONTENT = bytes(32)  # c_i of a text-only block
PUBLIC_TENANT = "public"  # the tenant of clients that present no API key
SHARED_SCOPE = "shared"  # the operator's prefix namespace; no tenant name maps to it (tenant_of, cloud_server.auth)


def _lp(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<I", len(b)) + b


@dataclass(frozen=True, slots=True)
class KeyScope:
    """What produced a block's states; blocks are shared only within one scope (see the module docstring)."""

    bundle_id: str
    edge_variant: str  # what computes the prompt's edge states: Manifest.states_variant
    encoding: str  # the wire codec of the uploaded states (cloud), or the edge cache's storage ("cache-float32")
    # the private levels (shared.exec_mode): a per-tenant secret the cloud never sees. The seed becomes
    # HMAC-SHA256(secret, the seed's input), so the chain cannot be recomputed - and a guessed prompt cannot be
    # confirmed - without it; blocks are then shared only among devices that hold the same secret.
    secret: bytes | None = field(default=None, repr=False)

    def seed(self) -> bytes:
        material = (b"autoglm-prefix-key\x00" + struct.pack("<I", PREFIX_KEY_VERSION) + _lp(self.bundle_id)
                    + _lp(self.edge_variant) + _lp(self.encoding))
        if self.secret is not None:
            if len(self.secret) < 16:
                raise ValueError(f"a prefix-key secret needs at least 16 bytes, got {len(self.secret)}")
            return hmac.new(self.secret, material, hashlib.sha256).digest()
        return hashlib.sha256(material).digest()


def chain_key(parent: bytes, block_ids: Sequence[int], content: bytes | None = None) -> bytes:
    """``k_i`` from ``parent`` (``k_{i-1}``, or the scope's seed for block 0), the block's ids and its content
    digest (None: text only)."""
    digest = NO_CONTENT if content is None else content
    if len(digest) != 32:
        raise ValueError(f"a content digest is 32 bytes, got {len(digest)}")
    return hashlib.sha256(parent + np.asarray(block_ids, dtype="<i8").tobytes() + digest).digest()


def block_keys(ids: Sequence[int], scope: KeyScope, block_tokens: int,
               content: Sequence[bytes | None] | None = None) -> list[str]:
    """Keys (hex) of every full block of ``ids``; ``content[i]``: block i's content digest (None: text)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    arr = np.asarray(ids, dtype="<i8").reshape(-1)  # [S]
    n = arr.size // block_tokens
    if content is not None and len(content) < n:
        raise ValueError(f"{len(content)} content digests for {n} blocks")
    keys, prev = [], scope.seed()
    for i in range(n):
        prev = chain_key(prev, arr[i * block_tokens:(i + 1) * block_tokens], None if content is None else content[i])
        keys.append(prev.hex())
    return keys


def content_digests(n_tokens: int, block_tokens: int, spans: Sequence[tuple[int, int, bytes]]) -> list[bytes | None]:
    """Per full block of a ``n_tokens`` prompt, the digest of the non-text spans that overlap it.

    ``spans``: ``(start, end, digest)`` per image/audio input, positions ``[start, end)`` of its placeholder
    tokens and a digest of its content (e.g. sha256 of the encoder's input). A block's digest folds in every
    overlapping span's digest and extent, in order; a block with none gets None (text)."""
    out: list[bytes | None] = []
    for i in range(n_tokens // block_tokens):
        a, b = i * block_tokens, (i + 1) * block_tokens
        parts = [struct.pack("<qq", s, e) + d for s, e, d in spans if s < b and e > a]
        out.append(hashlib.sha256(b"".join(parts)).digest() if parts else None)
    return out


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None (no header, another scheme, no token).
    The scheme's case does not matter (RFC 9110 section 11.1: ``bearer`` is ``Bearer``)."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def bearer_key_problem(key: str) -> str | None:
    """Why ``key`` cannot be an API key, or None: empty (``--api-key "$KEY"`` with KEY unset, a secret made from an
    unset variable: taken as no key, a server meant to be protected served everyone, a client went without the key
    it was given), or whitespace at an end or a control character (a secret file's trailing newline) -
    :func:`bearer_token` reads a header's token stripped, so a server's such key never matches, and a client's
    cannot be sent (a newline) or is not the key it names; or a character outside ASCII (RFC 6750's token is ASCII):
    the server reads a header's bytes as Latin-1, so a UTF-8 client's ``café`` got 401 and httpx could not send it
    (argv's bytes that are no UTF-8 likewise). The one rule for every key option (cloud and edge)."""
    if not key:
        return "is empty (an unset variable?): give the key, or leave the option unset for none"
    if not key.isascii():
        return ("has a character outside ASCII: an 'Authorization: Bearer' header carries ASCII (RFC 6750), so no "
                "client could present it")
    if key != key.strip() or not key.isprintable():
        return ("has whitespace at an end or a control character (a secret file's trailing newline?): an "
                "'Authorization: Bearer' header cannot carry it")
    return None


def tenant_of(authorization: str | None) -> str:
    """The tenant a client's ``Authorization`` header names: a digest of its bearer token (never the token
    itself), or :data:`PUBLIC_TENANT` without one."""
    token = bearer_token(authorization)
    if token is None:
        return PUBLIC_TENANT
    return "t" + hashlib.sha256(b"autoglm-tenant\x00" + token.encode()).hexdigest()[:24]


def tenant_scoped(tenant: str, key: str) -> str:
    """The cloud's name for a client's key within its tenant's namespace (what its prefix cache stores)."""
    return f"{tenant}/{key}"


def shared_fallback(scoped_key: str) -> str | None:
    """Where a lookup of a tenant's ``scoped_key`` (from :func:`tenant_scoped`) goes when its own scope misses:
    the same key in :data:`SHARED_SCOPE`; None for a key already there or not scoped at all."""
    scope, sep, key = scoped_key.partition("/")
    if not sep or scope == SHARED_SCOPE:
        return None
    return tenant_scoped(SHARED_SCOPE, key)


def is_shared(scoped_key: str) -> bool:
    """Whether ``scoped_key`` names a block of the operator's shared scope."""
    return scoped_key.startswith(SHARED_SCOPE + "/")
