"""Block pool accounting: allocation, reference counts, the prefix cache and its LRU eviction."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_server.engine.kv_cache import BlockManager, KVCachePool


def test_pool_is_preallocated_with_the_right_shape():
    pool = KVCachePool(num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    assert pool.k.shape == (3, 40, 2, 8) and pool.v.shape == (3, 40, 2, 8)
    assert pool.nbytes == 2 * 3 * 40 * 2 * 8 * 4


def test_allocate_grow_release():
    bm = BlockManager(num_blocks=4, block_size=4)
    table: list[int] = []
    assert bm.ensure(table, 5) and len(table) == 2
    assert bm.ensure(table, 8) and len(table) == 2  # still fits
    assert bm.num_used_blocks == 2 and bm.num_free_blocks == 2
    assert not bm.ensure(table, 17)  # would need 5 blocks: refused, table unchanged
    assert len(table) == 2
    bm.release(table)
    assert table == [] and bm.num_used_blocks == 0
    with pytest.raises(MemoryError):
        bm.allocate(5)
    bm.check()


def _published(num_blocks: int, block_size: int, tokens: int, keys: dict[int, str]):
    """A block manager holding one sequence of ``tokens`` tokens whose blocks ``keys`` names are published."""
    bm = BlockManager(num_blocks=num_blocks, block_size=block_size)
    table: list[int] = []
    bm.ensure(table, tokens)
    for i, key in keys.items():
        bm.publish(table[i], key)
    return bm, table


def test_prefix_blocks_are_shared_and_stay_cached_after_release():
    bm, a = _published(4, 4, 8, {0: "k0", 1: "k1"})
    hit = bm.lookup(["k0", "k1", "k2"])
    assert hit == a
    bm.acquire(hit, queried=3)
    assert bm.ref_count[a[0]] == 2 and bm.num_used_blocks == 2
    bm.release(a)
    assert bm.num_used_blocks == 2  # still referenced by the second sequence
    b = list(hit)
    bm.release(b)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2  # unreferenced but kept
    assert bm.lookup(["k0", "k1"]) == hit
    assert (bm.prefix_hits, bm.prefix_queries) == (2, 3)
    bm.check()


def test_lookup_stops_at_the_first_unknown_key():
    bm, t = _published(4, 2, 6, {0: "a", 2: "c"})
    assert bm.lookup(["a", "b", "c"]) == [t[0]]
    assert bm.lookup(["x", "a"]) == []


def test_cached_blocks_are_evicted_lru_only_when_the_free_list_is_empty():
    bm, t = _published(3, 1, 2, {0: "old", 1: "new"})
    first, second = t
    bm.release([first])
    bm.release([second])  # released after: more recently used
    fresh = bm.allocate(1)  # the free block first: nothing evicted
    assert bm.num_cached_blocks == 2
    more = bm.allocate(1)  # now the least recently released cached block goes
    assert more == [first] and bm.lookup(["old"]) == [] and bm.lookup(["new"]) == [second]
    bm.release(fresh + more)
    bm.check()


def test_first_writer_wins_and_double_release_is_an_error():
    bm = BlockManager(num_blocks=2, block_size=1)
    a, b = bm.allocate(1), bm.allocate(1)
    bm.publish(a[0], "k")
    bm.publish(b[0], "k")  # same key computed twice at once: the first mapping stays
    assert bm.lookup(["k"]) == a
    block = a[0]
    bm.release(a)
    with pytest.raises(RuntimeError, match="released more often"):
        bm.release([block])


def test_reserved_blocks_are_never_handed_out():
    bm = BlockManager(num_blocks=4, block_size=1, reserved=(0,))
    assert bm.num_blocks == 3
    got = bm.allocate(3)
    assert 0 not in got and bm.num_free_blocks == 0
    bm.release(got)
    bm.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "release", "share"]), st.integers(0, 5), st.integers(1, 12)),
                max_size=60))
def test_accounting_returns_to_zero_after_any_sequence_of_operations(ops):
    bm = BlockManager(num_blocks=16, block_size=4)
    tables: list[list[int]] = [[] for _ in range(6)]
    for op, i, n in ops:
        if op == "grow":
            bm.ensure(tables[i], len(tables[i]) * 4 + n)
            for j, blk in enumerate(tables[i]):
                bm.publish(blk, f"{i}-{j}")
        elif op == "release":
            bm.release(tables[i])
        else:  # take references on another table's cached prefix
            keys = [f"{i}-{j}" for j in range(n)]
            hit = bm.lookup(keys)
            if not tables[(i + 1) % 6]:
                bm.acquire(hit, len(keys))
                tables[(i + 1) % 6] = list(hit)
        bm.check()
    for t in tables:
        bm.release(t)
    bm.check()
    assert bm.num_used_blocks == 0


def test_a_tenants_lookup_falls_back_to_the_shared_scope_whose_blocks_are_evicted_last():
    bm = BlockManager(num_blocks=3, block_size=1)
    t: list[int] = []
    bm.ensure(t, 3)
    bm.publish(t[0], "shared/sys")  # the operator's
    bm.publish(t[1], "tenant:a/own")
    bm.publish(t[2], "tenant:a/sys")  # tenant a's own copy shadows the shared one for a only
    assert bm.lookup(["tenant:b/sys", "tenant:b/own"]) == [t[0]]  # b: the shared block, never a's
    assert bm.lookup(["tenant:a/sys", "tenant:a/own"]) == [t[2], t[1]]
    assert bm.lookup(["shared/own"]) == []  # the shared scope falls back to nothing
    shared, *rest = t
    bm.release([shared])  # released first: the least recently used ...
    bm.release(list(rest))
    assert bm.allocate(2) == rest  # ... yet the tenants' cached blocks go first
    assert bm.lookup(["tenant:b/sys"]) == [shared]
    assert bm.allocate(1) == [shared] and bm.lookup(["tenant:b/sys"]) == []  # then the shared one
    bm.check()


def test_the_welcome_lists_the_most_recently_used_keys_first():
    """Welcome.cached_prefixes lists 256 keys at most, and the edge skips uploading only the blocks listed. The
    pool's first-published keys were listed, so a busy tenant's system prompt published after 256 other blocks
    was left out and went up again from every new connection; now the keys of blocks in use come first, then the
    released ones from the last released (the shared scope's before a tenant's), each tenant's own only."""
    from types import SimpleNamespace

    from cloud_server.split_endpoint import held_prefix_keys
    from shared.prefix_keys import SHARED_SCOPE

    bm, t = _published(6, 1, 6, {0: "a/sys", 1: "a/old1", 2: "a/old2", 3: "b/x", 4: "shared/op", 5: "a/busy"})
    bm.release(t[:5])  # in this order: a/sys is the least recently used ...
    sys_block = bm.lookup(["a/sys"])
    bm.acquire(sys_block, queried=1)
    bm.release(sys_block)  # ... until a request reuses it
    engine = SimpleNamespace(block_managers={"fp32": bm})
    spaces = ("a", SHARED_SCOPE)
    assert held_prefix_keys(engine, "fp32", spaces, limit=3) == ["busy", "op", "sys"]  # t[5] is still in use
    assert held_prefix_keys(engine, "fp32", spaces, limit=10) == ["busy", "op", "sys", "old2", "old1"]
    assert held_prefix_keys(engine, "fp32", (SHARED_SCOPE, SHARED_SCOPE), limit=10) == ["op"]  # an operator's session
    bm.check()


def test_listing_a_sessions_held_keys_costs_the_same_however_many_keys_other_tenants_hold():
    """Every Hello lists its session's held keys on the engine thread (Welcome.cached_prefixes). The listing walked
    every cached key of the pool to pick its scopes' out: on a real autoglm-cloud serve (tiny-glm4, --block-size 1)
    whose pool held 102,400 keys of another tenant, another tenant's Hello took 36 ms (2 ms on an empty pool), each
    stalling every session's steps - a cheap Hello flood held the engine. Now each scope's keys are indexed: the
    listing reads its scopes' first keys only. (Cost ratio with a generous margin: the walk took ~20 ms here.)"""
    from types import SimpleNamespace

    from cloud_server.split_endpoint import held_prefix_keys
    from shared.prefix_keys import SHARED_SCOPE

    def pool(others: int) -> BlockManager:
        bm = BlockManager(num_blocks=others + 600, block_size=1)
        mine = bm.allocate(300)
        for i, b in enumerate(mine):
            bm.publish(b, f"a/k{i}")
        bm.release(mine[:200])  # released, each its own LRU entry
        theirs = bm.allocate(others)
        for i, b in enumerate(theirs):
            bm.publish(b, f"b/k{i}")
        bm.release(theirs[: others // 2])
        return bm

    def cost(bm: BlockManager) -> tuple[float, list[str]]:
        engine, best = SimpleNamespace(block_managers={"fp32": bm}), float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            keys = held_prefix_keys(engine, "fp32", ("a", SHARED_SCOPE), 256)
            best = min(best, time.perf_counter() - t0)
        return best, keys

    (alone, listed), (crowded, listed_crowded) = cost(pool(0)), cost(pool(100_000))
    assert listed == listed_crowded and len(listed) == 256 and listed[:100] == [f"k{i}" for i in range(200, 300)]
    assert crowded <= 10 * alone + 0.002, f"{crowded * 1e3:.1f} ms beside 100,000 other keys, {alone * 1e3:.2f} ms alone"
