"""Activation cache for common prompts: the front KV cache and boundary hidden states of prompt prefixes.

An AutoGLM agent re-sends the same long system prompt every step. Its front-layer KV (what the edge needs to
continue from it) and its boundary hidden states (what the cloud needs to rebuild its own KV) are cached
per block of ``block_tokens`` tokens, so a hit skips the front layers for the prefix, and the edge sends the
cloud only the prefix's *keys*: the cloud keeps its KV for the same blocks under the same keys.

Keys form a hash chain (as in vLLM's automatic prefix caching), so a block's key names its whole prefix,
and they are scoped to what produced the states: ``shared.prefix_keys`` (the derivation the cloud's prefix
cache uses too) over the bundle id, the edge front's weights (``edge_variant``) and the storage dtype
(``encoding = "cache-<dtype>"``), plus a content digest per block for image/audio spans. An fp32 and an
int8 front of the same bundle, or a float16 and a float32 cache, sharing one directory never read each
other's blocks (they skip each other's files, which count in the directory's bound).

Only full blocks are cached, and a lookup never covers a prompt's last token (its hidden state must be
computed and sent for the cloud to sample the first new token).

Bounded in bytes with LRU eviction; a chain's deeper blocks are evicted before its head. Persisted (when
given a directory) as one file per block, ``<dir>/<bundle_id>/<key>.blk<key version>`` (:data:`FILE_SUFFIX`;
version 2's clients named theirs ``<key>.blk``)::

    magic b"AGLMACT1" | u32 LE header length | header JSON | payload (raw little-endian arrays)

The header holds the bundle id, the scope, the block's key, parent key, token ids and content digest (the key
is recomputed from them), array shapes and dtype, and the payload's sha256. No pickle. A file that fails any check is logged, removed
and treated as a miss; it never crashes the client. Files survive restarts; their mtime is the LRU clock.

Several clients (processes) may share the directory at once: a block is written to a temporary file of its
own (``<key>.<pid>-<random>.tmp``) and renamed into place, and a scan removes only temporary files older than
``STALE_TMP_S`` (left by a crash), never another client's write in progress. The byte bound is the whole
directory's, every bundle's folder in it: a client that has written re-reads its bundle's folder, indexes the blocks
the others of its scope wrote (they serve it too), drops the ones they evicted, and evicts the least recently used
block files of the directory by mtime, which every client's use sets - its own, and those of other scopes and
bundles (counted by their size on disk: a bundle the edge left, whose blocks no client retired, goes that way), and
those of another prefix-key version (an older or newer app on the phone: never read, never removed on sight, since
each version's files have their own suffix - the one way two versions share a directory without thrashing, as a
version-2 client removes any other ``.blk`` file of its folder as stale). A directory that cannot be
created or written (read-only, full) costs persistence, never a request: the blocks it refuses are kept in
memory only, the first refusal is logged and :attr:`ActivationCache.write_error` says why. A folder removed under
a running cache (a phone's cache cleaner) is made again at the next write.

What the cache holds in memory has its own, smaller bound, ``memory_bytes`` (:data:`MEMORY_BYTES`, 32 MiB: a phone
app's budget, where ``max_bytes`` is the directory's): past it the least recently used blocks let go of their arrays -
a block on disk is read again from its file on its next use, a block held in memory only (no directory, or one the
directory refused) is evicted. Without it a client kept every block it had inserted or read, up to ``max_bytes``
(512 MiB), on a writable directory as on a refusing one.

The cache never takes a phone's last free space: before each block file is written, one ``os.statvfs`` checks that
the file system keeps its *reserve* free after it - the larger of ``reserve_bytes`` and ``reserve_fraction`` of the
file system's size (the check took 6-11 us a block on this 2-core box, statvfs itself 1.5 us, beside the write's
0.1-1.4 ms: per block costs nothing worth batching). When it would not, the directory's least
recently used blocks go first (as under the byte bound: this cache's and other scopes' and bundles'); when even
that leaves too little, the block stays in memory only (a refusal as a full disk's). The directory's scans (at
start and after an insert) evict down to the reserve too, so a disk that other apps filled gets the cache's room
back. :func:`make_room` frees room for a bundle update the same way: other bundles' and scopes' blocks first.

A bundle the edge moved off (``edge_client.bundle_sync``) leaves its blocks behind: :func:`retire` removes one
scope's files at once (and the bundle's folder once nothing else is in it) unless a cache still holds that scope open -
every open cache with a directory holds a shared ``flock`` on its scope's lock file (``.scope-<digest>.lock`` in
the bundle's folder) until :meth:`ActivationCache.close`, and the retirer needs it exclusively. Other scopes'
files (another client's edge variant, dtype or block size) are never touched by it. What no retire removes (that
client exited first, a crash came before it) is evicted under the directory's bound, the oldest first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import struct
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shared.prefix_keys import PREFIX_KEY_VERSION, KeyScope, block_keys, chain_key
from shared.user_paths import user_path

log = logging.getLogger("edge_client.activation_cache")

MAGIC = b"AGLMACT1"
# A block file's name: its key (a sha256, hex) and its key version's suffix, ".blk<version>" (version 2's: ".blk").
# Each version's files are its own: a client of another version sharing the directory neither reads nor removes
# them (each removed the other's as stale: two apps of versions 2 and 3 recomputed every prompt in turn); they count
# in the directory's bound as another scope's do (_BLOCK_NAME: any version's), the least recently used first.
FILE_SUFFIX = f".blk{PREFIX_KEY_VERSION}"
_BLOCK_NAME = re.compile(r"[0-9a-f]{64}\.blk[0-9]*")
_HEADER_LIMIT = 1 << 20
STALE_TMP_S = 600.0  # a temporary file older than this is a write a crash cut short (a block takes milliseconds)
# The free space a cache directory's file system keeps: the larger of the two. Android tells the user storage is low
# under 5 % free (its cache cleaner starts there); 256 MiB keeps a small disk's updates and other apps writing.
RESERVE_BYTES = 256 << 20
RESERVE_FRACTION = 0.05
# The block arrays a cache holds in memory (a phone app's budget, not the directory's bound: Android kills background
# apps holding far less than cache_max_bytes' 512 MiB). 32 MiB: 2,730 of tiny-glm4's 12 KiB blocks. Past it a block on
# disk is read again on its next use, one held in memory only (no directory, or one that refused it) is evicted.
MEMORY_BYTES = 32 << 20


def memory_problem(memory_bytes) -> str | None:
    """What is wrong with an in-memory bound (``EdgeConfig.cache_memory_bytes``), or None."""
    if type(memory_bytes) is not int or memory_bytes < 0:
        return f"cache_memory_bytes must be an integer >= 0, got {memory_bytes!r}"
    return None


def reserve_problem(reserve_bytes, reserve_fraction) -> str | None:
    """What is wrong with a free-space reserve (``EdgeConfig.cache_reserve_bytes`` / ``_fraction``), or None."""
    if type(reserve_bytes) is not int or reserve_bytes < 0:
        return f"cache_reserve_bytes must be an integer >= 0, got {reserve_bytes!r}"
    if isinstance(reserve_fraction, bool) or not isinstance(reserve_fraction, (int, float)) \
            or not 0 <= reserve_fraction < 1:  # nan fails too
        return f"cache_reserve_fraction must be a number from 0 to below 1, got {reserve_fraction!r}"
    return None


class CacheFileError(Exception):
    """A cache file is corrupt, truncated or belongs to another bundle; the message says which check failed."""


class OtherScope(CacheFileError):
    """A valid file of another scope (edge variant, dtype, block size) sharing the directory: skipped, kept."""


@dataclass(slots=True)
class CacheHit:
    """The cached prefix of a prompt: ``tokens`` positions, as blocks."""

    tokens: int
    keys: list[str]  # chain keys of the hit blocks, in order
    kv_blocks: list[list[np.ndarray]]  # per block: 2N float32 arrays [KVH, B, D]
    hidden: np.ndarray  # [tokens, H] float32 boundary hidden states


@dataclass(slots=True)
class CacheStats:
    lookups: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0  # full-block tokens looked up but not found
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    rejected_files: int = 0  # corrupt / foreign files removed
    unwritten_blocks: int = 0  # blocks the directory refused (read-only, full): kept in memory only


@dataclass(slots=True)
class _Entry:
    key: str
    parent: str
    index: int  # block position in its chain
    tokens: list[int]
    content: bytes | None  # the block's content digest (None: text only)
    nbytes: int
    arrays: list[np.ndarray] | None = None  # 2N KV arrays [KVH, B, D] + hidden [B, H]; None: on disk only
    path: Path | None = None
    meta: dict = field(default_factory=dict)
    used: float = 0.0  # when last used (the LRU order): its file's mtime, which every client sharing it sets


class ActivationCache:
    """Per-block front KV + boundary hidden states, LRU-bounded in bytes, optionally persisted."""

    def __init__(self, bundle_id: str, n_layers: int, kv_heads: int, head_dim: int, hidden_size: int,
                 block_tokens: int = 16, max_bytes: int = 512 << 20, cache_dir: str | Path | None = None,
                 dtype: str = "float32", *, edge_variant: str, reserve_bytes: int = RESERVE_BYTES,
                 reserve_fraction: float = RESERVE_FRACTION, memory_bytes: int = MEMORY_BYTES):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if dtype not in ("float32", "float16"):
            raise ValueError(f"cache dtype {dtype!r}: expected float32 or float16")
        if (problem := reserve_problem(reserve_bytes, reserve_fraction) or memory_problem(memory_bytes)) is not None:
            raise ValueError(problem)
        self.bundle_id = bundle_id
        self.n_layers, self.kv_heads, self.head_dim, self.hidden_size = n_layers, kv_heads, head_dim, hidden_size
        self.block_tokens = block_tokens
        self.max_bytes = max_bytes
        self.reserve_bytes, self.reserve_fraction = reserve_bytes, reserve_fraction  # free space kept on the disk
        self.memory_bytes = memory_bytes  # the bound of the block arrays held in memory (:meth:`_trim_memory`)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.scope = KeyScope(bundle_id, edge_variant, f"cache-{dtype}")  # what produced (and stores) the states
        self.dir = Path(cache_dir) / bundle_id if cache_dir is not None else None
        self._scope_lock: weakref.finalize | None = None  # closes the descriptor locking this scope (see retire)
        self.write_error: str | None = None  # why the directory first refused a block (None: it never did)
        self.stats = CacheStats()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # LRU first
        self._skipped: set[str] = set()  # files left alone: other scopes' blocks, bad files it cannot remove
        self._bytes = 0
        self._held = 0  # bytes of the entries' arrays held in memory
        self._lock = threading.RLock()
        if self.dir is not None and self._open_dir():
            self._scan()

    def _open_dir(self) -> bool:
        """Create the bundle's folder and hold this scope open in it (see :func:`retire`); False, the reason
        noted (:meth:`_unwritable`), where the directory refuses: its blocks then live in memory only."""
        assert self.dir is not None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            self._unwritable(err)
            return False
        if self._scope_lock is not None:  # a lock on a file that went with its folder holds nothing
            self._scope_lock()
        fd = _hold_scope(self.dir, _scope_lock_name(self.scope, self.block_tokens))
        if fd is not None:  # closing the descriptor releases the lock: at close(), else when collected
            self._scope_lock = weakref.finalize(self, os.close, fd)
        return True

    def close(self) -> None:
        """Stop holding this scope open (its blocks stay; :func:`retire` may remove them now)."""
        if self._scope_lock is not None:
            self._scope_lock()

    # -- shapes ----------------------------------------------------------------------------------
    def _shapes(self) -> list[tuple[int, ...]]:
        kv = (self.kv_heads, self.block_tokens, self.head_dim)
        return [kv] * (2 * self.n_layers) + [(self.block_tokens, self.hidden_size)]

    @property
    def block_bytes(self) -> int:
        return sum(int(np.prod(s)) for s in self._shapes()) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Payload bytes of the blocks indexed (on disk or in memory), within ``max_bytes``."""
        return self._bytes

    @property
    def held_bytes(self) -> int:
        """Bytes of block arrays held in memory, within ``memory_bytes`` between calls."""
        return self._held

    def __len__(self) -> int:
        return len(self._entries)

    def keys_for(self, ids, content=None) -> list[str]:
        """Keys of the full blocks of ``ids``; ``content[i]``: block i's content digest (None: text)."""
        return block_keys(ids, self.scope, self.block_tokens, content)

    # -- lookup / insert ---------------------------------------------------------------------------
    def lookup(self, ids, max_tokens: int | None = None, content=None) -> CacheHit | None:
        """Longest cached prefix of ``ids`` in whole blocks, at most ``max_tokens`` (default ``len - 1``)."""
        ids = list(ids)
        limit = len(ids) - 1 if max_tokens is None else min(max_tokens, len(ids) - 1)
        keys = self.keys_for(ids[: max(limit, 0)], content)
        with self._lock:
            self.stats.lookups += 1
            hit: list[_Entry] = []
            for k in keys:
                e = self._entries.get(k)
                if e is None or self._load(e) is None:
                    break
                hit.append(e)
            self.stats.hit_tokens += len(hit) * self.block_tokens
            self.stats.miss_tokens += (len(keys) - len(hit)) * self.block_tokens
            if not hit:
                return None
            self._touch(hit)
            n = 2 * self.n_layers
            kv_blocks = [[a.astype(np.float32) for a in e.arrays[:n]] for e in hit]  # type: ignore[index]
            hidden = np.concatenate([e.arrays[n] for e in hit], axis=0).astype(np.float32)  # type: ignore[index]
            self._trim_memory()
            return CacheHit(len(hit) * self.block_tokens, [e.key for e in hit], kv_blocks, hidden)

    def contains(self, ids, content=None) -> int:
        """Tokens of ``ids`` covered by cached blocks (no LRU update, no payload load)."""
        n = 0
        with self._lock:
            for k in self.keys_for(ids, content):
                if k not in self._entries:
                    break
                n += self.block_tokens
        return n

    def insert(self, ids, kv_slice, hidden: np.ndarray, start_block: int = 0, content=None) -> int:
        """Cache every full block of ``ids`` not cached yet; returns how many blocks were added.

        ``kv_slice(a, b)`` returns the front KV of positions [a, b) as 2N arrays [KVH, b-a, D] (the runtime's
        ``kv_slice``); ``hidden`` [len(ids) or more, H] are the boundary hidden states of those positions.
        Blocks before ``start_block`` are skipped (the caller knows they are cached). ``content``: per block,
        its content digest (None: text).
        """
        ids = [int(t) for t in ids]
        keys = self.keys_for(ids, content)
        if hidden.shape[0] < len(keys) * self.block_tokens or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden {hidden.shape} does not cover {len(keys)} blocks of {self.block_tokens}")
        if self.block_bytes > self.max_bytes:
            return 0
        added = 0
        with self._lock:
            chain: list[_Entry] = []
            for i, key in enumerate(keys):
                if key in self._entries:
                    chain.append(self._entries[key])
                    continue
                if i < start_block:
                    break  # the caller's claim is stale: an earlier block is gone, so later ones are unreachable
                a, b = i * self.block_tokens, (i + 1) * self.block_tokens
                # copies, never views: a view of the caller's [L, H] prompt array would keep all of it alive
                # while the byte bound counts one block (the agent loop's RSS grew ~15 MB a step that way)
                arrays = [np.array(x, dtype=self.dtype, order="C") for x in kv_slice(a, b)]
                arrays.append(np.array(hidden[a:b], dtype=self.dtype, order="C"))
                self._check_shapes(arrays)
                e = _Entry(key, keys[i - 1] if i else "", i, ids[a:b], None if content is None else content[i],
                           sum(x.nbytes for x in arrays))
                self._hold(e, arrays)
                if self.dir is not None:
                    e.path = self._write(e)  # None: the directory refused it (the block is in memory only)
                self._entries[key] = e
                self._bytes += e.nbytes
                self.stats.inserted_blocks += 1
                chain.append(e)
                added += 1
            self._touch(chain)
            if added and self.dir is not None:
                self._scan()  # the directory's blocks, others' too, within the bound
            else:
                self._evict()
            self._trim_memory()
        return added

    def clear(self) -> None:
        with self._lock:
            for e in list(self._entries.values()):
                self._remove(e)

    # -- LRU ---------------------------------------------------------------------------------------
    def _touch(self, chain: list[_Entry]) -> None:
        """Mark a chain used: deepest block first, so the head ends up most recent and is evicted last."""
        now = time.time()
        for j, e in enumerate(reversed(chain)):
            if self._entries.get(e.key) is not e:  # evicted since, for the disk's reserve (:meth:`_write`)
                continue
            self._entries.move_to_end(e.key)
            e.used = now - 1e-3 * (len(chain) - j)  # strictly increasing towards the head
            if e.path is not None:
                try:
                    os.utime(e.path, (e.used, e.used))
                except OSError:
                    pass

    def _evict(self, others: list[tuple[float, int, Path]] = (), short: int = 0) -> None:
        """Remove the least recently used blocks until the bound holds and ``short`` more bytes of block files are
        gone (the disk's reserve, :meth:`_disk_short`): this cache's and ``others`` (the directory's other block
        files, :meth:`_others`), oldest first."""
        others = sorted(others, reverse=True)  # the oldest last, taken first
        total = self._bytes + sum(size for _, size, _ in others)
        while (over := total > self.max_bytes) or short > 0:
            # for the reserve alone, only blocks on disk: a block kept in memory frees none of it
            e = next((e for e in self._entries.values() if over or e.path is not None), None)
            if others and (e is None or others[-1][0] < e.used):
                _, size, path = others.pop()
                _remove_block_file(path)
                total -= size
                short -= size
            elif e is not None:
                self._remove(e)
                total -= e.nbytes
                short -= e.nbytes if e.path is not None else 0
                self.stats.evicted_blocks += 1
            else:
                break

    def _trim_memory(self) -> None:
        """Hold at most ``memory_bytes`` of block arrays, the least recently used let go first: a block on disk drops
        its arrays (read again from its file on its next use), a block held in memory only (no directory, or one
        that refused it) is evicted."""
        if self._held <= self.memory_bytes:
            return
        for e in list(self._entries.values()):  # oldest first
            if self._held <= self.memory_bytes:
                break
            if e.arrays is None:
                continue
            if e.path is not None:
                self._let_go(e)
            else:
                self._remove(e)
                self.stats.evicted_blocks += 1

    def _hold(self, e: _Entry, arrays: list[np.ndarray]) -> None:
        e.arrays = arrays
        self._held += e.nbytes

    def _let_go(self, e: _Entry) -> None:
        if e.arrays is not None:
            e.arrays = None
            self._held -= e.nbytes

    def _disk_short(self, size: int) -> int:
        """Bytes of block files to remove so that writing ``size`` more keeps the reserve free on the directory's
        file system (<= 0: none). One ``statvfs``; a directory it cannot look at is the write's to refuse."""
        assert self.dir is not None
        try:
            st = os.statvfs(self.dir)
        except OSError:
            return 0
        return self._reserve(st) + size - st.f_bavail * st.f_frsize

    def _reserve(self, st: os.statvfs_result) -> int:
        return max(self.reserve_bytes, int(self.reserve_fraction * st.f_blocks * st.f_frsize))

    def _others(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of the block files in the cache directory that are not this cache's: other scopes' and
        other key versions' in its bundle's folder, and every other bundle's folder's (a bundle the edge left, another
        app's)."""
        assert self.dir is not None
        try:
            folders = [p for p in self.dir.parent.iterdir() if p.is_dir() and not p.is_symlink()]
        except OSError:
            return []
        found = []
        for folder in folders:
            with contextlib.suppress(OSError):
                for path in folder.iterdir():
                    if _BLOCK_NAME.fullmatch(path.name) and not (folder == self.dir and path.suffix == FILE_SUFFIX
                                                                 and path.stem in self._entries):
                        with contextlib.suppress(OSError):
                            st = path.stat()
                            found.append((st.st_mtime, st.st_size, path))
        return found

    def _remove(self, e: _Entry) -> None:
        if self._entries.pop(e.key, None) is not None:
            self._bytes -= e.nbytes
            self._let_go(e)
        if e.path is not None:
            try:
                e.path.unlink()
            except OSError:  # gone already (another client evicted it), or a read-only directory
                pass

    def _check_shapes(self, arrays: list[np.ndarray]) -> None:
        want = self._shapes()
        got = [tuple(a.shape) for a in arrays]
        if got != want:
            raise ValueError(f"cache block shapes {got[:1]}...{got[-1:]} do not match {want[:1]}...{want[-1:]}")

    # -- persistence -------------------------------------------------------------------------------
    def _write(self, e: _Entry) -> Path | None:
        """Persist ``e``; its path, or None when the directory refuses the write (see :meth:`_unwritable`)."""
        assert self.dir is not None
        payload = b"".join(a.tobytes() for a in e.arrays)  # type: ignore[union-attr]
        header = {
            "bundle_id": self.bundle_id, "key_version": PREFIX_KEY_VERSION, "edge_variant": self.scope.edge_variant,
            "encoding": self.scope.encoding, "key": e.key, "parent": e.parent, "index": e.index,
            "tokens": e.tokens, "content": None if e.content is None else e.content.hex(),
            "block_tokens": self.block_tokens, "dtype": self.dtype.str,
            "shapes": [list(s) for s in self._shapes()], "payload_bytes": len(payload),
            "payload_sha256": hashlib.sha256(payload).hexdigest(),
        }
        hb = json.dumps(header, separators=(",", ":")).encode()
        if not self._room(len(MAGIC) + 4 + len(hb) + len(payload)):
            return None
        path = self.dir / f"{e.key}{FILE_SUFFIX}"
        # this write's own name: another client (or another cache of this process) may write the same block now
        tmp = self.dir / f"{e.key}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        try:
            try:
                f = open(tmp, "wb")
            except FileNotFoundError:  # the folder went (a phone's cache cleaner, the user): made again
                if self.dir.is_dir():
                    raise
                if not self._open_dir():  # (the reason noted)
                    return None
                f = open(tmp, "wb")
            with f:
                f.write(MAGIC + struct.pack("<I", len(hb)) + hb + payload)
            os.replace(tmp, path)  # atomic: a crash mid-write leaves no half file under the real name
        except OSError as err:
            with contextlib.suppress(OSError):  # a full disk leaves the part written; a read-only one none
                tmp.unlink()
            self._unwritable(err)
            return None
        e.meta = header
        return path

    def _room(self, size: int) -> bool:
        """Can a block file of ``size`` bytes be written keeping the disk's reserve free - after evicting the
        directory's least recently used blocks where needed? False (the refusal noted): it stays in memory."""
        if (short := self._disk_short(size)) <= 0:
            return True
        self._evict(self._others(), short)
        try:
            if self._disk_short(size) <= 0:
                return True
            st = os.statvfs(self.dir)
        except OSError:  # the folder went meanwhile: the write makes it again, or refuses
            return True
        self._refused(f"{st.f_bavail * st.f_frsize} bytes free on its disk, which keeps {self._reserve(st)} free "
                      f"(the reserve: the larger of cache_reserve_bytes and cache_reserve_fraction of "
                      f"{st.f_blocks * st.f_frsize} bytes)")
        return False

    def _unwritable(self, err: OSError) -> None:
        """The directory refused to create or keep a block: blocks stay in memory only (logged once)."""
        why = err.strerror or str(err)
        if isinstance(err, FileExistsError) and err.filename and os.path.islink(err.filename) \
                and not os.path.exists(err.filename):  # mkdir through a dangling symlink: 'File exists' said nothing
            why = f"{err.filename} is a symlink to {os.readlink(err.filename)}, which does not exist"
        self._refused(why)

    def _refused(self, why: str) -> None:
        """A block is kept in memory only, for ``why`` (the first refusal is logged and kept as ``write_error``)."""
        self.stats.unwritten_blocks += 1
        if self.write_error is None:  # the first refusal says why (later writes into a missing directory follow)
            log.warning("activation cache: cannot write in %s (%s); new blocks are kept in memory only", self.dir, why)
            self.write_error = f"cannot write in {self.dir}: {why}"

    def _read_header(self, path: Path) -> tuple[dict, int]:
        header, offset = _raw_header(path)
        if header.get("bundle_id") != self.bundle_id:
            raise CacheFileError(f"written for bundle {header.get('bundle_id')!r}, not {self.bundle_id!r}")
        if header.get("key_version") != PREFIX_KEY_VERSION:
            raise CacheFileError(f"keys of version {header.get('key_version')}, not {PREFIX_KEY_VERSION}")
        if (header.get("edge_variant"), header.get("encoding"), header.get("dtype"), header.get("block_tokens")) != (
                self.scope.edge_variant, self.scope.encoding, self.dtype.str, self.block_tokens):
            raise OtherScope("written by another edge variant, dtype or block size")
        if header.get("shapes") != [list(s) for s in self._shapes()]:
            raise CacheFileError("array shapes do not match this bundle's front")
        if type(header.get("payload_bytes")) is not int or header["payload_bytes"] != self.block_bytes:
            raise CacheFileError("payload size is not a block's")  # the bound counts it before the payload is read
        if not (type(header.get("index")) is int and header["index"] >= 0):  # Infinity: an OverflowError crashed it
            raise CacheFileError("header's block index is not a position in a chain")
        tokens, parent, content = header.get("tokens"), header.get("parent"), header.get("content")
        if not (isinstance(tokens, list) and len(tokens) == self.block_tokens and isinstance(parent, str)
                and (content is None or isinstance(content, str))):
            raise CacheFileError("header lacks the block's tokens, parent key or content digest")
        if not all(type(t) is int and 0 <= t < 1 << 63 for t in tokens):  # what a key hashes: int64 token ids
            raise CacheFileError("header's tokens are not token ids")
        digest = chain_key(bytes.fromhex(parent) if parent else self.scope.seed(), tokens,
                           None if content is None else bytes.fromhex(content)).hex()
        if digest != header.get("key") or path.name != f"{digest}{FILE_SUFFIX}":
            raise CacheFileError("key does not match the block's tokens and parent")
        return header, offset

    def _scan(self) -> None:
        """Bring the index in line with the directory, then evict down to the bound: at start every block of this
        scope there; after an insert, the blocks other clients sharing the directory wrote since (they serve this
        one too) and the ones they removed, every block ordered by its file's mtime (each client's use sets it).
        The bound is the whole directory's, however many clients, scopes and bundles write to it."""
        assert self.dir is not None
        try:
            paths = list(self.dir.iterdir())
        except OSError:  # gone or unreadable: nothing on disk to count
            paths = []
        on_disk = set()
        for path in paths:
            if path.suffix != FILE_SUFFIX:
                if path.suffix.startswith(".tmp"):
                    self._remove_stale_tmp(path)
                continue
            if path.name in self._skipped:
                continue
            try:
                e = self._entries.get(path.stem)
                if e is None:
                    e = self._index(path)
                    self._entries[e.key] = e
                    self._bytes += e.nbytes
                elif e.path is not None:
                    e.used = path.stat().st_mtime
                on_disk.add(e.key)
            except FileNotFoundError:
                continue  # another client evicted it while this one scanned
            except OtherScope:
                self._skipped.add(path.name)  # another client's valid block: not ours to use or to remove
            except (CacheFileError, OSError, KeyError, ValueError, TypeError) as err:
                self._reject(path, err)
        # names of files gone since (another scope's client evicted them, or cleared the folder): a long-running
        # client sharing the folder kept every name it had ever skipped
        self._skipped.intersection_update(p.name for p in paths)
        for e in [e for e in self._entries.values() if e.path is not None and e.key not in on_disk]:
            self._entries.pop(e.key)  # another client evicted it: the directory's LRU decided
            self._bytes -= e.nbytes
            self._let_go(e)
        self._entries = OrderedDict(sorted(self._entries.items(), key=lambda kv: kv[1].used))  # oldest first
        self._evict(self._others(), self._disk_short(0))  # a disk other apps filled gets the cache's room back

    def _index(self, path: Path) -> _Entry:
        """An entry for a block file of this scope (its payload is read on first use); raises if it is not one."""
        header, offset = self._read_header(path)
        st = path.stat()
        if st.st_size != offset + int(header["payload_bytes"]):
            raise CacheFileError("file size does not match its header (truncated?)")
        content = None if header["content"] is None else bytes.fromhex(header["content"])
        return _Entry(header["key"], header["parent"], int(header["index"]), header["tokens"], content,
                      int(header["payload_bytes"]), None, path, header, st.st_mtime)

    @staticmethod
    def _remove_stale_tmp(path: Path) -> None:
        """Remove a temporary file that a crash left (older than ``STALE_TMP_S``); a younger one is another
        client's write in progress, renamed into place in a moment."""
        try:
            if time.time() - path.stat().st_mtime > STALE_TMP_S:
                path.unlink()
        except OSError:
            pass

    def _load(self, e: _Entry) -> list[np.ndarray] | None:
        """The entry's arrays, reading and verifying the file on first use; None if it is corrupt."""
        if e.arrays is not None:
            return e.arrays
        assert e.path is not None
        try:
            header, offset = self._read_header(e.path)
            data = e.path.read_bytes()[offset:]
            if len(data) != header["payload_bytes"]:
                raise CacheFileError("payload is truncated")
            if hashlib.sha256(data).hexdigest() != header["payload_sha256"]:
                raise CacheFileError("payload sha256 mismatch")
            arrays, pos = [], 0
            for shape in self._shapes():
                n = int(np.prod(shape)) * self.dtype.itemsize
                arrays.append(np.frombuffer(data, dtype=self.dtype, count=n // self.dtype.itemsize,
                                            offset=pos).reshape(shape))
                pos += n
        except FileNotFoundError:  # another client evicted it: a miss, not a bad file
            self._remove(e)
            return None
        except (CacheFileError, OSError, KeyError, ValueError, TypeError) as err:
            self._reject(e.path, err)
            self._remove(e)
            return None
        self._hold(e, arrays)
        return arrays

    def _reject(self, path: Path, err: Exception) -> None:
        """Log and remove a file that fails a check; one that cannot be removed is left alone from then on."""
        self.stats.rejected_files += 1
        log.warning("activation cache: removing %s: %s", path, err)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError:  # a read-only directory, or a directory under a block's name: not read again
            self._skipped.add(path.name)


def _raw_header(path: Path) -> tuple[dict, int]:
    """A block file's header JSON and the payload's offset (its checks against a scope are the cache's)."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 4)
        if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
            raise CacheFileError("bad magic (not an activation-cache file, or another format version)")
        (hlen,) = struct.unpack("<I", head[len(MAGIC):])
        if hlen > _HEADER_LIMIT:
            raise CacheFileError(f"header length {hlen} is implausible")
        raw = f.read(hlen)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CacheFileError("header is not valid JSON") from None
    if not isinstance(header, dict):
        raise CacheFileError("header is not a JSON object")
    return header, len(MAGIC) + 4 + hlen


def _remove_block_file(path: Path) -> None:
    """Remove another scope's or bundle's block file (an activation-cache file: its magic is checked first)."""
    with contextlib.suppress(OSError):
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return
        path.unlink()


def _scope_lock_name(scope: KeyScope, block_tokens: int) -> str:
    """The lock file of one scope in its bundle's folder (a digest: an edge variant is no safe file name)."""
    what = json.dumps([scope.edge_variant, scope.encoding, block_tokens]).encode()
    return f".scope-{hashlib.sha256(what).hexdigest()[:16]}.lock"


def _hold_scope(directory: Path, name: str) -> int | None:
    """A descriptor holding a shared lock on ``directory/name`` (None where the directory refuses the file: then
    nothing can remove blocks there either). A :func:`retire` that removed the file meanwhile is waited out, and
    the lock taken on the file now at that name."""
    path = directory / name
    while True:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the folder went between the two calls: a retire finished
            continue
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)  # a retire holds it exclusively only while it removes files
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)  # locked a file a retire removed: take the one at that name now


def retire(cache_dir: str | Path, bundle_id: str, edge_variant: str, dtype: str = "float32",
           block_tokens: int = 16) -> bool:
    """Remove the blocks a cache of this scope (bundle, edge variant, storage dtype, block size) wrote under
    ``cache_dir`` - a bundle the edge moved off -, and the bundle's folder when nothing else is left in it; False
    (nothing removed) while a cache holds the scope open (another client still on that bundle). Other scopes'
    blocks stay; so do another client's temporary files, except those a crash left (see :data:`STALE_TMP_S`)."""
    directory = user_path(cache_dir) / bundle_id
    scope = KeyScope(bundle_id, edge_variant, f"cache-{dtype}")
    path = directory / _scope_lock_name(scope, block_tokens)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:  # no folder: nothing of this bundle was ever kept here
        return True
    except OSError as err:
        log.warning("activation cache: cannot remove the blocks of bundle %s in %s: %s", bundle_id, directory, err)
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("activation cache: bundle %s's blocks in %s stay: another client uses them", bundle_id, directory)
            return False
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                return False  # another retire removed that file meanwhile
        try:
            for entry in directory.iterdir():
                if entry.suffix.startswith(".tmp"):
                    ActivationCache._remove_stale_tmp(entry)
                elif entry.suffix == FILE_SUFFIX and _of_scope(entry, scope, dtype, block_tokens):
                    with contextlib.suppress(OSError):
                        entry.unlink()
            path.unlink()
        except OSError as err:  # a directory that refuses removals (read-only): the blocks stay, as the cache's do
            log.warning("activation cache: cannot remove the blocks of bundle %s in %s: %s", bundle_id, directory, err)
            return False
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):  # another scope's blocks, or a client starting on it now: it stays
        directory.rmdir()
    log.info("activation cache: removed bundle %s's blocks from %s", bundle_id, directory)
    return True


def _of_scope(path: Path, scope: KeyScope, dtype: str, block_tokens: int) -> bool:
    """Is ``path`` a block file a cache of this scope (bundle, edge variant, storage dtype, block size) wrote?"""
    try:
        h, _ = _raw_header(path)
    except (CacheFileError, OSError):
        return False
    return (h.get("bundle_id"), h.get("edge_variant"), h.get("encoding"), h.get("dtype"), h.get("block_tokens")) == (
        scope.bundle_id, scope.edge_variant, scope.encoding, np.dtype(dtype).newbyteorder("<").str, block_tokens)


def make_room(cache_dir: str | Path, where: Path, need: int, bundle_id: str, edge_variant: str,
              dtype: str = "float32", block_tokens: int = 16) -> int:
    """Remove block files of the cache directory ``cache_dir`` until ``need`` bytes are free on ``where``'s file
    system (a bundle update's download): every other bundle's and scope's blocks first, then those of the scope
    given (the bundle held, which its switch retires), each group oldest first. Nothing is removed when all of them
    would not make the room, or when ``cache_dir`` is on another file system. Returns the bytes freed."""
    directory = user_path(cache_dir)
    try:
        st = os.statvfs(where)
        if os.stat(directory).st_dev != os.stat(where).st_dev:
            return 0
        folders = [p for p in directory.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:  # no cache directory (nothing to free), or one it may not look at
        return 0
    missing = need - st.f_bavail * st.f_frsize
    if missing <= 0:
        return 0
    scope = KeyScope(bundle_id, edge_variant, f"cache-{dtype}")
    found = []  # (the held scope's: last, mtime, size, path)
    for folder in folders:
        with contextlib.suppress(OSError):
            for path in folder.iterdir():
                if _BLOCK_NAME.fullmatch(path.name):
                    with contextlib.suppress(OSError):
                        held = folder.name == bundle_id and path.suffix == FILE_SUFFIX and _of_scope(
                            path, scope, dtype, block_tokens)
                        fst = path.stat()
                        found.append((held, fst.st_mtime, fst.st_size, path))
    if sum(size for _, _, size, _ in found) < missing:
        log.info("activation cache: its %d blocks in %s would not make the %d bytes a bundle update needs; kept",
                 len(found), directory, need)
        return 0
    freed = 0
    for _, _, size, path in sorted(found):
        if freed >= missing:
            break
        _remove_block_file(path)
        freed += size
    log.info("activation cache: removed %d bytes of blocks from %s for a bundle update", freed, directory)
    return freed
