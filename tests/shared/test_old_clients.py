"""Frames recorded from a shipped older client (docs/protocol.md, "Compatibility"): phones update slowly, so the
current server and the current client's caches must handle what they send.

``old_clients/`` holds frames that the client of commit 4aab6fc (6 December, before prefix keys named the
activation cache's rounding) sent to a real ``autoglm-cloud serve`` of today, tiny-glm4 split at 2 with an fp32
edge (bundle ``6bdb5512...``, ``Manifest.states_variant`` below), ``codec="fp32"``, ``cache_dtype="float16"``:

* ``hello.bin``: its Hello;
* ``float16_cache_prefill.bin``: the first Prefill of the request it resent after a ``prefix_miss`` (its prompt,
  token ids 100..149, was in its activation cache, not in that server's): 48 positions read back from its float16
  cache - rounded - under the keys of its 3 full blocks.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from edge_client.generation import Session
from shared import codecs as C
from shared import protocol as P
from shared.prefix_keys import block_keys

OLD = Path(__file__).parent / "old_clients"
PROMPT = list(range(100, 150))  # the recorded request's prompt
STATES_VARIANT = "fp32#76d4541c263649f6"  # the recorded bundle's Manifest.states_variant (in no frame)


def _current_edge_scope(bundle_id: str, cache_dtype: str, codec: str):
    """The scope today's edge keys the cloud's blocks with (``Session._cloud_scope``), for that bundle."""
    cache = SimpleNamespace(dtype=np.dtype(cache_dtype), scope=SimpleNamespace(encoding=f"cache-{cache_dtype}"))
    edge = SimpleNamespace(cache=cache, manifest=SimpleNamespace(bundle_id=bundle_id, states_variant=STATES_VARIANT))
    return Session._cloud_scope(edge, codec)


def test_an_old_clients_hello_and_prefill_decode_as_protocol_version_1():
    hello = P.decode_message((OLD / "hello.bin").read_bytes())
    prefill = P.decode_message((OLD / "float16_cache_prefill.bin").read_bytes())
    assert isinstance(hello, P.Hello) and hello.protocol_version == P.PROTOCOL_VERSION == 1
    assert hello.hints.client == "autoglm-edge/0.1.0"  # the version string never changed: nothing tells it apart
    assert isinstance(prefill, P.Prefill) and prefill.params is not None and prefill.start == 0
    assert prefill.prompt_len is None  # a field it predates: read with its default


def test_an_old_clients_rounded_blocks_never_answer_a_current_client_that_sends_exact_states():
    """A client before 236f8e7 keyed the states it sent from its float16 activation cache by the bare codec
    (``fp32``), as version 2 of the derivation; 236f8e7 added ``+cache-float16`` under the same version 2, so
    today's exact client (float32 cache) derived the very keys of those rounded blocks: reproduced on a real
    server, it was served 48 prompt positions of the old phone's rounded states (``cloud_cached_tokens`` 48).
    The derivation carries its own version (3) now: no old key names a current client's block."""
    hello = P.decode_message((OLD / "hello.bin").read_bytes())
    old = P.decode_message((OLD / "float16_cache_prefill.bin").read_bytes())
    rows = C.get_codec(old.hidden.codec).decode(old.hidden)  # [48, H]
    assert rows.shape[0] == 48 and np.array_equal(rows, rows.astype(np.float16).astype(np.float32))  # rounded
    assert len(old.prefix_keys) == 3
    exact = block_keys(PROMPT, _current_edge_scope(hello.bundle_id, "float32", old.hidden.codec), 16)
    rounded = block_keys(PROMPT, _current_edge_scope(hello.bundle_id, "float16", old.hidden.codec), 16)
    assert not set(exact) & set(old.prefix_keys)
    assert not set(rounded) & set(old.prefix_keys)  # a different derivation: not shared either (a miss, not a risk)
