"""The KV cache of the cloud's layers: a fixed, preallocated pool of blocks, block tables and a prefix cache.

Memory is allocated once at start (:class:`KVCachePool`): per layer, ``num_blocks * block_size`` slots of
``[KVH, D]`` keys and values. A sequence owns a *block table* (block ids in position order); position ``p``
lives in slot ``table[p // block_size] * block_size + p % block_size``.

:class:`BlockManager` does the accounting: free list, reference counts, and the prefix cache. The edge names
each full block of a common prefix (e.g. the agent's system prompt) by a key from a hash chain over the
token blocks, so key ``i`` identifies tokens ``[0, (i + 1) * block_size)`` exactly. Once a sequence has
computed such a block the manager publishes ``key -> block``; a later sequence presenting the same key chain
takes references to those blocks instead of recomputing (or even receiving) them. Full blocks are never
written again, so sharing needs no copy-on-write. A cached block whose last reference goes stays cached but
*evictable* (LRU); allocation evicts only when the free list is empty.

Keys are scoped by tenant (``shared.prefix_keys.tenant_scoped``); a key that misses in its tenant's scope is
looked up in the operator's shared scope (``shared_fallback``), and shared blocks are evicted only when no
tenant's cached block is left to evict: a system prompt the operator published stays resident under load.
Each scope's keyed blocks are indexed (in use / released, in release order), so listing a session's held keys
(:meth:`BlockManager.keys_by_recency`, at every ``Hello``) reads its scopes' first keys only, never the whole pool.

Invariant checked by the tests: once every sequence is released, ``num_used_blocks == 0``.
Reference: PagedAttention / vLLM's block manager and automatic prefix caching; nano-vLLM's block_manager.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterator
from itertools import chain

import torch

from cloud_server.kv_quant import SCALE_DTYPE, is_quantized, storage_dtypes
from shared.prefix_keys import SHARED_SCOPE, is_shared, shared_fallback


class KVCachePool:
    """Preallocated K and V tensors for all cloud layers: each ``[layers, num_blocks * block_size, KVH, D]``.

    ``kv_cache_dtype`` (``cloud_server.kv_quant``): ``auto`` stores ``dtype``; ``int8`` / ``fp8`` store 8-bit keys
    and values with float32 scales ``k_scale`` / ``v_scale`` ``[layers, slots, KVH]`` beside them; ``int8v`` keys
    in ``dtype`` and int8 values. A tensor stored in ``dtype`` has no scales (``k_scale`` / ``v_scale`` None).
    Blocks are blocks either way: the block manager and the prefix cache do not see the difference."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", kv_cache_dtype: str = "auto"):
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        k_store, v_store = storage_dtypes(kv_cache_dtype, dtype)
        self.k = torch.zeros(shape, dtype=k_store, device=device)
        self.v = torch.zeros(shape, dtype=v_store, device=device)
        # [L, slots, KVH] float32 for an 8-bit tensor
        self.k_scale, self.v_scale = (torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device)
                                      if is_quantized(store) else None for store in (k_store, v_store))
        self.kv_cache_dtype = kv_cache_dtype
        self.block_size = block_size
        self.num_blocks = num_blocks

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool: keys, values and their scales."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over all layers (what sizes the pool for a memory budget)."""
        return self.nbytes // self.num_blocks


class BlockManager:
    """Block allocation, reference counts and the prefix cache for one pool (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True,
                 reserved: tuple[int, ...] = ()):
        self.reserved = frozenset(reserved)  # never handed out (e.g. a fast path's padding "null block")
        self.num_blocks = num_blocks - len(self.reserved)  # usable blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_count = [0] * num_blocks
        # unreferenced, holding nothing worth keeping
        self.free: deque[int] = deque(b for b in range(num_blocks) if b not in self.reserved)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced but cached (LRU first)
        self.evictable_shared: OrderedDict[int, None] = OrderedDict()  # the same, of the shared scope: evicted last
        self.block_of_key: dict[str, int] = {}
        self.key_of_block: dict[int, str] = {}
        # per key scope (a tenant's, the shared one): its keyed blocks in use, and its released ones (LRU first)
        self.scopes: dict[str, tuple[dict[int, None], OrderedDict[int, None]]] = {}
        self.prefix_hits = 0  # blocks served from the cache
        self.prefix_queries = 0  # blocks looked up

    # -- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + evictable cached)."""
        return len(self.free) + len(self.evictable) + len(self.evictable_shared)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one live sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.block_of_key)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    # -- prefix cache -----------------------------------------------------------------------
    def lookup(self, keys: list[str]) -> list[int]:
        """Blocks of the longest cached run of ``keys`` from the first (no references taken); a key missing in
        its tenant's scope may be served from the shared scope."""
        if not self.enable_prefix_cache:
            return []
        out = []
        for key in keys:
            block = self.block_of_key.get(key)
            if block is None and (alt := shared_fallback(key)) is not None:
                block = self.block_of_key.get(alt)
            if block is None:
                break
            out.append(block)
        return out

    def acquire(self, blocks: list[int], queried: int) -> None:
        """Take a reference on cached ``blocks`` (from :meth:`lookup`); ``queried`` counts the lookup."""
        self.prefix_queries += queried
        self.prefix_hits += len(blocks)
        for b in blocks:
            if self.ref_count[b] == 0:
                self.evictable.pop(b, None)
                self.evictable_shared.pop(b, None)
                in_use, released = self._scope_of(b)
                released.pop(b)
                in_use[b] = None
            self.ref_count[b] += 1

    def keys_by_recency(self, scopes: tuple[str, ...]) -> Iterator[str]:
        """The cached keys of ``scopes`` (key scopes: a tenant's, ``SHARED_SCOPE``), most recently used first: those
        of blocks in use now, then the released ones from the last released (eviction's LRU order reversed; the
        shared scope's, evicted last, before a tenant's). Lazy, over those scopes' index only: its first keys cost
        the same however many keys other scopes hold."""
        held = [self.scopes[s] for s in sorted(set(scopes), key=lambda s: s != SHARED_SCOPE) if s in self.scopes]
        in_use = chain.from_iterable(u for u, _ in held)
        released = chain.from_iterable(reversed(r) for _, r in held)
        return (self.key_of_block[b] for b in chain(in_use, released))

    def _scope_of(self, block: int) -> tuple[dict[int, None], OrderedDict[int, None]]:
        """The index of the scope of keyed ``block``'s key: (in use, released)."""
        return self.scopes[self.key_of_block[block].partition("/")[0]]

    def publish(self, block: int, key: str) -> None:
        """Record that full block ``block`` holds the tokens named by ``key`` (first writer wins)."""
        if not self.enable_prefix_cache or key in self.block_of_key or block in self.key_of_block:
            return
        self.block_of_key[key] = block
        self.key_of_block[block] = key
        in_use, released = self.scopes.setdefault(key.partition("/")[0], ({}, OrderedDict()))
        (in_use if self.ref_count[block] > 0 else released)[block] = None

    # -- allocation -------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise MemoryError(f"KV pool exhausted: {n} blocks wanted, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:  # evict the least recently released cached block, a tenant's before a shared one
                b, _ = (self.evictable or self.evictable_shared).popitem(last=False)
                scope = self.key_of_block[b].partition("/")[0]
                self.scopes[scope][1].pop(b)
                if not any(self.scopes[scope]):
                    del self.scopes[scope]
                del self.block_of_key[self.key_of_block.pop(b)]
            self.ref_count[b] = 1
            out.append(b)
        return out

    def ensure(self, table: list[int], num_tokens: int) -> bool:
        """Grow ``table`` in place to cover ``num_tokens`` positions; False (unchanged) if the pool is short."""
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if not self.can_allocate(need):
            return False
        table.extend(self.allocate(need))
        return True

    def truncate(self, table: list[int], num_tokens: int) -> None:
        """Shrink ``table`` in place to the blocks covering ``num_tokens`` positions, releasing the rest (the
        rejected drafts of a speculative step). Slots of a kept block beyond ``num_tokens`` are rewritten later."""
        keep = self.blocks_for(num_tokens)
        if keep < len(table):
            self.release(table[keep:])
            del table[keep:]

    def release(self, table: list[int]) -> None:
        """Drop one reference on every block of ``table`` (a finished, cancelled or dropped sequence)."""
        for b in table:
            if self.ref_count[b] <= 0:
                raise RuntimeError(f"block {b} released more often than acquired")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if b in self.key_of_block:
                    (self.evictable_shared if is_shared(self.key_of_block[b]) else self.evictable)[b] = None
                    in_use, released = self._scope_of(b)
                    del in_use[b]
                    released[b] = None
                else:
                    self.free.append(b)
        table.clear()

    def check(self) -> None:
        """Consistency of the bookkeeping (used by tests and debug builds)."""
        free, evict = set(self.free), set(self.evictable) | set(self.evictable_shared)
        if free & evict or len(free) != len(self.free) or set(self.evictable) & set(self.evictable_shared):
            raise RuntimeError("block on two free lists")
        for b in range(len(self.ref_count)):
            if b in self.reserved:
                if self.ref_count[b] or b in free or b in evict:
                    raise RuntimeError(f"reserved block {b} was handed out")
                continue
            zero = self.ref_count[b] == 0
            if zero != (b in free or b in evict):
                raise RuntimeError(f"block {b}: ref_count {self.ref_count[b]} disagrees with the free lists")
        if any(self.block_of_key[k] != b for b, k in self.key_of_block.items()):
            raise RuntimeError("prefix-cache maps disagree")
        indexed = {b: (scope, b in in_use) for scope, (in_use, released) in self.scopes.items()
                   for b in chain(in_use, released)}
        if indexed != {b: (k.partition("/")[0], self.ref_count[b] > 0) for b, k in self.key_of_block.items()}:
            raise RuntimeError("the scopes' index disagrees with the prefix cache")
