"""edge_client.activation_cache: hash-chain keys, hits equal recomputation, LRU bound, persistence, corruption."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from edge_client.activation_cache import FILE_SUFFIX, MAGIC, STALE_TMP_S, ActivationCache
from edge_client.front import FrontRuntime
from shared.prefix_keys import PREFIX_KEY_VERSION

B = 16


def _cache(rt: FrontRuntime, **kw) -> ActivationCache:
    kw.setdefault("edge_variant", rt.manifest.edge_quant)
    kw.setdefault("reserve_bytes", 0)  # the test box's disk may be fuller than a phone's reserve allows
    kw.setdefault("reserve_fraction", 0)
    return ActivationCache(rt.manifest.bundle_id, rt.n_layers, rt.kv_heads, rt.head_dim, rt.hidden_size,
                           block_tokens=B, **kw)


@pytest.fixture(scope="module")
def rt(tiny_bundle):
    return FrontRuntime(tiny_bundle, threads=1)


IDS = list(np.random.RandomState(1).randint(4, 512, 75))  # 4 full blocks + 11 tokens


def _fill(rt, cache, ids=IDS):
    rt.reset()
    h = rt.prefill(ids)
    return cache.insert(ids, rt.kv_slice, h), h


def test_keys_are_the_shared_derivation_in_the_cache_scope(rt):
    from shared.prefix_keys import KeyScope, block_keys

    scope = KeyScope(rt.manifest.bundle_id, rt.manifest.edge_quant, "cache-float32")
    assert _cache(rt).keys_for(IDS) == block_keys(IDS, scope, B)
    assert _cache(rt, dtype="float16").keys_for(IDS)[0] != block_keys(IDS, scope, B)[0]


def test_hit_restores_the_same_state_as_recomputing(rt):
    cache = _cache(rt)
    added, h_cold = _fill(rt, cache)
    assert added == 4 and len(cache) == 4
    prompt = IDS[:70] + [9, 9, 9]
    hit = cache.lookup(prompt)
    assert hit is not None and hit.tokens == 64 and len(hit.keys) == 4
    np.testing.assert_array_equal(hit.hidden, h_cold[:64])
    rt.reset()
    rt.extend_kv(hit.kv_blocks)
    warm = rt.prefill(prompt[64:])
    rt.reset()
    cold = rt.prefill(prompt)
    np.testing.assert_allclose(warm, cold[64:], atol=2e-5)
    # never the whole prompt: its last token must be computed
    assert cache.lookup(IDS[:64]).tokens == 48
    assert cache.lookup([5] * 40) is None
    assert cache.stats.hit_tokens == 64 + 48


def test_lru_bound_evicts_deepest_blocks_first(rt):
    probe = _cache(rt)
    cache = _cache(rt, max_bytes=6 * probe.block_bytes)
    _fill(rt, cache)  # chain A: 4 blocks
    other = list(np.random.RandomState(2).randint(4, 512, 48))
    _fill(rt, cache, other)  # chain B: 3 blocks -> 7 > 6: evict A's deepest block
    assert len(cache) == 6 and cache.nbytes <= cache.max_bytes and cache.stats.evicted_blocks == 1
    assert cache.contains(IDS) == 48 and cache.contains(other) == 48
    cache.lookup(IDS[:50])  # touch A's first three blocks: B becomes least recent
    _fill(rt, cache, list(np.random.RandomState(3).randint(4, 512, 33)))  # 2 more blocks
    assert cache.contains(IDS) == 48 and cache.contains(other) == 16


def test_persisted_entries_survive_a_restart(rt, tmp_path):
    cache = _cache(rt, cache_dir=tmp_path)
    _, h = _fill(rt, cache)
    files = sorted((tmp_path / rt.manifest.bundle_id).glob(f"*{FILE_SUFFIX}"))
    assert len(files) == 4 and files[0].read_bytes().startswith(MAGIC)
    again = _cache(rt, cache_dir=tmp_path)
    assert len(again) == 4 and again.nbytes == cache.nbytes
    hit = again.lookup(IDS)
    assert hit.tokens == 64
    np.testing.assert_array_equal(hit.hidden, h[:64])
    for a, b in zip(hit.kv_blocks[1], rt.kv_slice(16, 32)):
        np.testing.assert_array_equal(a, b)


def test_other_bundle_does_not_see_entries(rt, tmp_path):
    _fill(rt, _cache(rt, cache_dir=tmp_path))
    other = ActivationCache("another-bundle", rt.n_layers, rt.kv_heads, rt.head_dim, rt.hidden_size,
                            block_tokens=B, cache_dir=tmp_path, edge_variant=rt.manifest.edge_quant)
    assert len(other) == 0 and other.lookup(IDS) is None


def test_other_edge_variants_and_dtypes_share_a_directory_without_sharing_blocks(rt, tmp_path):
    mine = _cache(rt, cache_dir=tmp_path)
    _fill(rt, mine)
    files = sorted((tmp_path / rt.manifest.bundle_id).glob(f"*{FILE_SUFFIX}"))
    for kw in ({"edge_variant": "int8"}, {"dtype": "float16"}):
        other = _cache(rt, cache_dir=tmp_path, **kw)  # an int8 front of the same bundle; a float16 cache
        assert len(other) == 0 and other.lookup(IDS) is None and other.stats.rejected_files == 0
        _fill(rt, other)
    assert set(files) < set((tmp_path / rt.manifest.bundle_id).glob(f"*{FILE_SUFFIX}"))  # each kept the others' files
    again = _cache(rt, cache_dir=tmp_path)
    assert again.lookup(IDS).tokens == 64 and again.stats.rejected_files == 0



def test_a_retired_bundles_blocks_go_unless_a_client_still_holds_them(rt, tmp_path):
    """A bundle update left the old bundle's blocks in the directory for good (up to the byte bound per retired
    bundle). retire() removes one scope's blocks - not while a cache of that scope is open (another client still
    on that bundle, sharing the directory), never another scope's - and the bundle's folder once empty."""
    from edge_client.activation_cache import retire

    folder = tmp_path / rt.manifest.bundle_id
    scope = dict(cache_dir=tmp_path, bundle_id=rt.manifest.bundle_id, edge_variant=rt.manifest.edge_quant,
                 block_tokens=B)
    leaving = _cache(rt, cache_dir=tmp_path)
    _fill(rt, leaving)
    staying = _cache(rt, cache_dir=tmp_path)  # another client of that bundle, sharing the directory
    leaving.close()
    assert not retire(**scope) and len(list(folder.glob(f"*{FILE_SUFFIX}"))) == 4  # the other client still uses them
    assert staying.lookup(IDS).tokens == 64
    del staying  # a cache nobody closed releases its scope when collected
    int8 = _cache(rt, cache_dir=tmp_path, edge_variant="int8")  # another scope in the folder: never touched
    _fill(rt, int8)
    int8.close()
    assert len(list(folder.glob(f"*{FILE_SUFFIX}"))) == 8
    assert retire(**scope) and len(list(folder.glob(f"*{FILE_SUFFIX}"))) == 4  # the int8 client's only
    assert retire(**{**scope, "edge_variant": "int8"}) and not folder.exists()
    assert retire(**scope)  # nothing left to remove
    back = _cache(rt, cache_dir=tmp_path)  # a client starting on it again (a rollback) begins empty, and writes
    assert _fill(rt, back)[0] == 4 and len(list(folder.glob(f"*{FILE_SUFFIX}"))) == 4
    assert not retire(**scope)


def _as_version_2(block: Path, folder: Path) -> Path:
    """A version-2 client's file of ``block`` (the documented layout: magic, u32 LE header length, header JSON,
    payload; named ``<key>.blk``; header ``key_version`` 2) in ``folder``."""
    raw = block.read_bytes()
    n = struct.unpack("<I", raw[len(MAGIC):len(MAGIC) + 4])[0]
    header = json.loads(raw[len(MAGIC) + 4:len(MAGIC) + 4 + n])
    header["key_version"] = 2
    hb = json.dumps(header, separators=(",", ":")).encode()
    old = folder / f"{header['key']}.blk"
    old.write_bytes(MAGIC + struct.pack("<I", len(hb)) + hb + raw[len(MAGIC) + 4 + n:])
    return old


def test_another_key_versions_files_in_the_directory_are_neither_read_nor_removed(rt, tmp_path):
    """Two apps on one phone sharing a cache directory, one on prefix keys of version 2 (a client before 40c1bc0),
    one on version 3, removed each other's block files as stale at every scan: each recomputed its prompts every
    time the other had run (reproduced with a worktree of 40c1bc0~1 and this tree). Each version's files now have
    its own suffix, so neither reads the other's (version 2 removes any .blk of its folder that is not its own):
    another version's files are kept, counted in the directory's bound and evicted least recently used first."""
    source = _cache(rt, cache_dir=tmp_path / "src")
    _fill(rt, source)
    source.close()
    folder = tmp_path / "c" / rt.manifest.bundle_id
    folder.mkdir(parents=True)
    old = [_as_version_2(p, folder) for p in sorted((tmp_path / "src" / rt.manifest.bundle_id).glob("*.blk*"))]
    kept = {p: p.read_bytes() for p in old}
    cache = _cache(rt, cache_dir=tmp_path / "c")
    other = list(np.random.RandomState(3).randint(4, 512, 70))
    assert _fill(rt, cache, other)[0] == 4 and _fill(rt, cache)[0] == 4  # the version-2 blocks serve no lookup
    assert {p: p.read_bytes() for p in old if p.exists()} == kept  # and stay, whole
    cache.close()
    mine = sorted(folder.glob(f"*{FILE_SUFFIX}"))
    assert len(mine) == 8 and FILE_SUFFIX == f".blk{PREFIX_KEY_VERSION}"
    assert all(p.suffix != ".blk" for p in mine)  # a version-2 client reads (and checks) only <key>.blk files
    # another version's blocks count in the directory's bound: the least recently used go first
    for p in old:
        os.utime(p, (1, 1))
    bounded = _cache(rt, cache_dir=tmp_path / "c", max_bytes=8 * source.block_bytes)
    assert not any(p.exists() for p in old) and bounded.contains(IDS) == 64 and bounded.contains(other) == 64


def test_the_names_of_another_scopes_files_are_forgotten_once_they_are_gone(rt, tmp_path):
    """A client sharing its folder with another scope's (an int8 client beside it) remembered the name of every
    file of that scope it had ever skipped, long after they were evicted: its memory grew for as long as it ran."""
    from edge_client.activation_cache import retire

    ours = _cache(rt, cache_dir=tmp_path)
    other = _cache(rt, cache_dir=tmp_path, edge_variant="int8")
    _fill(rt, other)
    other.close()
    assert _fill(rt, ours)[0] == 4 and len(ours._skipped) == 4  # the int8 blocks, left alone
    assert retire(cache_dir=tmp_path, bundle_id=rt.manifest.bundle_id, edge_variant="int8", block_tokens=B)
    assert _fill(rt, ours, IDS[::-1])[0] == 4 and ours._skipped == set()


def test_retiring_blocks_a_directory_will_not_remove_leaves_them(rt, tmp_path, monkeypatch, caplog):
    """A cache directory that refuses removals (read-only for the app; simulated: the tests run as root, whom
    permissions do not stop) raised out of retire(), failing the request whose bundle update had succeeded;
    the blocks now stay, as the cache itself leaves what it cannot remove, and a warning says why."""
    from pathlib import Path

    from edge_client.activation_cache import retire

    c = _cache(rt, cache_dir=tmp_path)
    _fill(rt, c)
    c.close()

    def refuse(self, missing_ok=False):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    with caplog.at_level(logging.WARNING, logger="edge_client.activation_cache"):
        assert not retire(tmp_path, rt.manifest.bundle_id, rt.manifest.edge_quant, block_tokens=B)
    assert "cannot remove the blocks" in caplog.text
    monkeypatch.undo()
    assert len(_cache(rt, cache_dir=tmp_path)) == 4


@pytest.mark.parametrize("damage", ["payload", "truncate", "magic", "header", "garbage", "tokens", "index",
                                    "payload_bytes"])
def test_corrupt_file_is_rejected_and_removed(rt, tmp_path, caplog, damage):
    cache = _cache(rt, cache_dir=tmp_path)
    _fill(rt, cache)
    d = tmp_path / rt.manifest.bundle_id
    victim = d / f"{cache.keys_for(IDS)[1]}{FILE_SUFFIX}"
    data = bytearray(victim.read_bytes())
    if damage == "payload":
        data[-5] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "magic":
        data[:4] = b"JUNK"
    elif damage == "header":
        data[20:24] = b"\xff\xfe{]"
    elif damage in ("tokens", "index", "payload_bytes"):
        # a token id past int64 (an OverflowError out of the key check crashed the client), and JSON's Infinity as
        # the block's index or payload size (OverflowError out of the scan: the client did not start)
        (hlen,) = struct.unpack("<I", data[8:12])
        header = json.loads(bytes(data[12:12 + hlen]))
        if damage == "tokens":
            header["tokens"][0] = 2 ** 64
        else:
            header[damage] = float("inf")
        hb = json.dumps(header).encode()
        data = bytearray(MAGIC + struct.pack("<I", len(hb)) + hb + data[12 + hlen:])
    else:
        data = bytearray(b"\x00" * 7)
    victim.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="edge_client.activation_cache"):
        again = _cache(rt, cache_dir=tmp_path)
        hit = again.lookup(IDS)
    assert hit is not None and hit.tokens == 16  # the chain stops at the damaged block
    assert not victim.exists() and again.stats.rejected_files == 1
    assert any("removing" in r.message for r in caplog.records)


def test_bad_arguments(rt):
    with pytest.raises(ValueError):
        _cache(rt, dtype="int8")
    with pytest.raises(ValueError):
        _cache(rt).insert(IDS, rt.kv_slice, np.zeros((3, rt.hidden_size), np.float32))


def test_float16_store_halves_bytes(rt):
    c32, c16 = _cache(rt), _cache(rt, dtype="float16")
    assert c16.block_bytes * 2 == c32.block_bytes
    _, h = _fill(rt, c16)
    np.testing.assert_allclose(c16.lookup(IDS).hidden, h[:64], rtol=1e-3, atol=1e-3)


def test_cached_blocks_do_not_keep_the_callers_arrays_alive(rt):
    """The byte bound counts one block per entry, so an entry must own its bytes: a view of the caller's
    [L, H] prompt states (or of its KV) would keep the whole array alive (the agent loop's unbounded RSS)."""
    import gc
    import weakref

    cache = _cache(rt)
    rt.reset()
    hidden = rt.prefill(IDS)  # [75, H]
    kv = [np.array(x) for x in rt.kv_slice(0, len(IDS))]  # 2N [KVH, 75, D]
    refs = [weakref.ref(hidden), *(weakref.ref(x) for x in kv)]
    assert cache.insert(IDS, lambda a, b, kv=kv: [x[:, a:b] for x in kv], hidden) == 4  # views of kv
    del hidden, kv
    gc.collect()
    assert all(r() is None for r in refs)
    assert cache.lookup(IDS).tokens == 64  # and the blocks are still served


def test_a_scan_keeps_another_clients_write_in_progress(rt, tmp_path):
    """Two clients share the directory: one starting up removed every temporary file, so the other's write in
    progress failed its rename and the request that was caching its prompt failed (FileNotFoundError). Only a
    temporary file a crash left (older than STALE_TMP_S) is removed."""
    d = tmp_path / rt.manifest.bundle_id
    d.mkdir()
    writing, crashed, legacy = d / "ab.123-0f0f0f0f.tmp", d / "cd.456-1e1e1e1e.tmp", d / "ef.tmp789"
    for f in (writing, crashed, legacy):
        f.write_bytes(MAGIC)
    old = time.time() - STALE_TMP_S - 60
    for f in (crashed, legacy):
        os.utime(f, (old, old))
    cache = _cache(rt, cache_dir=tmp_path)
    assert writing.exists() and not crashed.exists() and not legacy.exists()
    _fill(rt, cache)
    _fill(rt, _cache(rt, cache_dir=tmp_path), IDS[:40])  # a second client writing the same blocks
    assert len(list(d.glob(f"*{FILE_SUFFIX}"))) == 4 and {p.name for p in d.glob("*.tmp")} == {writing.name}


def test_a_directory_that_refuses_writes_keeps_blocks_in_memory(rt, tmp_path, caplog):
    """A read-only or full cache directory failed the request that was caching its prompt (OSError out of
    generate), and one that could not be created failed the client's construction. Now the blocks stay in
    memory, the first refusal is logged once and ``write_error`` says why."""
    with caplog.at_level(logging.WARNING, logger="edge_client.activation_cache"):
        (tmp_path / "c").mkdir()
        (tmp_path / "c" / rt.manifest.bundle_id).write_text("not a directory")  # mkdir (and every write) fails
        cache = _cache(rt, cache_dir=tmp_path / "c")
        assert _fill(rt, cache)[0] == 4 and cache.lookup(IDS).tokens == 64
        assert cache.write_error and cache.stats.unwritten_blocks == 5
        live = _cache(rt, cache_dir=tmp_path / "d")  # created fine, then the directory goes (a write fails)
        shutil.rmtree(tmp_path / "d" / rt.manifest.bundle_id)  # (its scope's lock file with it)
        (tmp_path / "d" / rt.manifest.bundle_id).write_text("")
        assert _fill(rt, live)[0] == 4 and live.lookup(IDS).tokens == 64 and live.write_error
    assert sum("kept in memory only" in r.message for r in caplog.records) == 2


def test_a_cache_dir_that_is_a_dangling_symlink_says_so(rt, tmp_path):
    """A cache_dir symlinked to a place that is gone (an unmounted card, a removed folder) kept blocks in memory as
    it should, but said only 'File exists' (mkdir's error on the link), in write_error and in preload's exit 1."""
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    cache = _cache(rt, cache_dir=tmp_path / "link")
    assert _fill(rt, cache)[0] == 4 and cache.lookup(IDS).tokens == 64
    assert f"{tmp_path / 'link'} is a symlink to {tmp_path / 'gone'}, which does not exist" in cache.write_error


def test_a_cache_folder_removed_under_a_running_client_is_made_again(rt, tmp_path):
    """A phone's system empties an app's cache folder under storage pressure (Android's cache dir), a user clears
    it: the running client then failed every write ('No such file or directory') and kept its blocks in memory only
    until a restart - nothing it cached since persisted. The folder is made again (and the scope held open in it,
    against a retire) at the next write."""
    from edge_client.activation_cache import retire

    cache = _cache(rt, cache_dir=tmp_path)
    shutil.rmtree(tmp_path / rt.manifest.bundle_id)
    assert _fill(rt, cache)[0] == 4 and cache.write_error is None and cache.stats.unwritten_blocks == 0
    assert not retire(tmp_path, rt.manifest.bundle_id, rt.manifest.edge_quant, block_tokens=B)  # held again
    cache.close()
    assert _cache(rt, cache_dir=tmp_path).contains(IDS) == 64  # they survive a restart


def test_clients_sharing_a_directory_keep_it_within_the_bound(rt, tmp_path):
    """Each client bounded only the blocks it wrote itself, so n clients sharing a directory kept up to n times
    cache_max_bytes on disk (three writers bounded to 200 KB each: 634 KB). A client that writes now indexes the
    blocks the others wrote since (and serves them), and evicts the least recently used down to the bound."""
    d = tmp_path / rt.manifest.bundle_id
    bound = 6 * _cache(rt).block_bytes
    a, b = _cache(rt, cache_dir=tmp_path, max_bytes=bound), _cache(rt, cache_dir=tmp_path, max_bytes=bound)
    _fill(rt, a)  # 4 blocks
    other = list(np.random.RandomState(2).randint(4, 512, 64))
    _fill(rt, b, other)  # 4 more: 8 on disk > 6
    assert len(list(d.glob(f"*{FILE_SUFFIX}"))) == 6 and b.nbytes <= bound
    assert b.contains(other) == 64 and b.contains(IDS) == 32  # a's deepest blocks went first; its head serves b
    assert b.lookup(IDS[:40]).tokens == 32
    _fill(rt, a, list(np.random.RandomState(3).randint(4, 512, 33)))  # a drops b's deletions, adds 2 blocks
    assert len(list(d.glob(f"*{FILE_SUFFIX}"))) == 6 and a.nbytes <= bound and a.contains(other) == 64 - 2 * B


def test_a_bundle_left_behind_counts_in_the_directorys_bound(rt, tmp_path):
    """The bound held per bundle (per scope): a bundle the edge updated away from, whose blocks no client retired (a
    second client still had them open, then exited; a crash before the retire), kept its blocks for good beside the
    new bundle's - 12 blocks in a directory bounded to 6. The directory's least recently used block files go first,
    whichever bundle or scope wrote them; a file that is no activation-cache block stays."""
    from edge_client.activation_cache import retire

    bound = 6 * _cache(rt).block_bytes
    old = _cache(rt, cache_dir=tmp_path, max_bytes=bound)
    _fill(rt, old)  # 4 blocks of the bundle left behind
    second = _cache(rt, cache_dir=tmp_path, max_bytes=bound)  # another app process on it
    old.close()
    assert not retire(tmp_path, rt.manifest.bundle_id, rt.manifest.edge_quant, block_tokens=B)
    second.close()  # it exits without updating: nobody retires those blocks
    stranger = tmp_path / "elsewhere" / ("0" * 64 + FILE_SUFFIX)  # a block's name, not a block
    stranger.parent.mkdir()
    stranger.write_bytes(b"x" * 10)
    time.sleep(0.01)
    new = ActivationCache("f" * 32, rt.n_layers, rt.kv_heads, rt.head_dim, rt.hidden_size, block_tokens=B,
                          max_bytes=bound, cache_dir=tmp_path, edge_variant=rt.manifest.edge_quant)
    for seed in (2, 3):
        _fill(rt, new, list(np.random.RandomState(seed).randint(4, 512, 64)))
    assert len(list((tmp_path / rt.manifest.bundle_id).glob(f"*{FILE_SUFFIX}"))) == 0
    assert len(list((tmp_path / ("f" * 32)).glob(f"*{FILE_SUFFIX}"))) == 6 and new.nbytes <= bound
    assert stranger.exists()


def test_a_bad_file_that_cannot_be_removed_is_reported_once_and_a_vanished_one_is_a_plain_miss(rt, tmp_path, caplog):
    """Since a client re-reads its directory after each write, a bad file it could not remove (in a read-only
    directory; here a folder under a block's name) was logged and counted again at every write; and a block
    another client evicted was logged as a corrupt file 'removed' when this one went to read it."""
    d = tmp_path / rt.manifest.bundle_id
    (d / f"{'0' * 64}{FILE_SUFFIX}").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="edge_client.activation_cache"):
        cache = _cache(rt, cache_dir=tmp_path)
        _fill(rt, cache)
        _fill(rt, cache, list(np.random.RandomState(2).randint(4, 512, 40)))
        assert cache.stats.rejected_files == 1 and len(caplog.records) == 1
        fresh = _cache(rt, cache_dir=tmp_path)  # indexes the blocks (the folder: logged again, by this client)
        for f in d.glob(f"*{FILE_SUFFIX}"):
            if f.is_file():
                f.unlink()  # another client evicted them
        assert fresh.lookup(IDS) is None and fresh.stats.rejected_files == 1 and len(caplog.records) == 2


class _Disk:
    """``os.statvfs`` of a file system of ``capacity`` bytes holding ``root``: what is under it is what is used."""

    def __init__(self, root, capacity: int):
        self.root, self.capacity = root, capacity

    def free(self) -> int:
        return max(0, self.capacity - sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file()))

    def __call__(self, path):
        free = self.free()
        return os.statvfs_result((4096, 1, self.capacity, free, free, 1 << 20, 1 << 20, 1 << 20, 0, 255))


def _prompts(n: int):
    return [list(np.random.RandomState(10 + i).randint(4, 512, 65)) for i in range(n)]  # 4 full blocks each


def test_a_cache_keeps_its_disks_reserve_free_evicting_its_oldest_blocks_first(rt, tmp_path, monkeypatch, caplog):
    """The cache grew to cache_max_bytes whatever the disk's free space, and did not shrink when the disk filled:
    a phone with less free space than that gave its last bytes to it (a real 4 MiB tmpfs under a real server: 12 KB
    left, the next bundle update 'write_failed ... make room'). Each block file is written only with the reserve
    left free, the directory's oldest blocks evicted first; a disk other apps filled gets the cache's room back at
    the next scan; where even that is not enough, blocks stay in memory (write_error names the reserve)."""
    file_bytes = _cache(rt).block_bytes + 1024  # a block file: the payload and its header
    disk = _Disk(tmp_path, 40 * file_bytes)
    monkeypatch.setattr(os, "statvfs", disk)
    cache = _cache(rt, cache_dir=tmp_path / "c", reserve_bytes=28 * file_bytes)  # room for about 12 blocks
    prompts = _prompts(5)  # 20 blocks
    for ids in prompts:
        assert _fill(rt, cache, ids)[0] == 4
        assert disk.free() >= cache.reserve_bytes, disk.free()
    assert cache.write_error is None and cache.stats.unwritten_blocks == 0
    assert cache.contains(prompts[-1]) == 64 and cache.contains(prompts[0]) == 0  # the oldest went
    held = len(list((tmp_path / "c").rglob(f"*{FILE_SUFFIX}")))
    assert 8 <= held <= 12, held
    (tmp_path / "other-app").write_bytes(b"x" * (6 * file_bytes))  # another app fills the disk
    cache.close()
    reopened = _cache(rt, cache_dir=tmp_path / "c", reserve_bytes=28 * file_bytes)
    assert disk.free() >= reopened.reserve_bytes and len(list((tmp_path / "c").rglob(f"*{FILE_SUFFIX}"))) <= held - 6
    assert reopened.contains(prompts[-1]) == 64  # the newest blocks stay
    (tmp_path / "other-app").write_bytes(b"x" * (20 * file_bytes))  # now nothing the cache holds makes the room
    with caplog.at_level(logging.WARNING, logger="edge_client.activation_cache"):
        assert _fill(rt, reopened)[0] == 4 and reopened.lookup(IDS).tokens == 64  # served from memory
    assert not list((tmp_path / "c").rglob(f"*{FILE_SUFFIX}"))
    assert "which keeps" in reopened.write_error and "cache_reserve_bytes" in reopened.write_error
    assert sum("kept in memory only" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("where", ["refused", "no directory", "on disk"])
def test_the_blocks_held_in_memory_stay_within_memory_bytes(rt, tmp_path, where):
    """A cache kept every block it inserted or read in memory up to cache_max_bytes (512 MiB, a phone app's whole
    budget): a real client of a real server with its cache_dir's writes refused (ulimit -f 0) held 63 MiB after 60
    prompts, and as much with a writable one. Past memory_bytes the least recently used blocks let go: a block in
    memory only (the directory refused it, or there is none) is evicted, one on disk is read again from its file."""
    one = _cache(rt).block_bytes
    if where == "refused":
        (tmp_path / "c").mkdir()
        (tmp_path / "c" / rt.manifest.bundle_id).write_text("not a directory")  # every write refused
    cache = _cache(rt, cache_dir=None if where == "no directory" else tmp_path / "c", memory_bytes=6 * one)
    prompts = _prompts(10)  # 40 blocks
    for ids in prompts:
        time.sleep(0.01)  # a chain's blocks are used 1 ms apart (the LRU clock): the previous prompt's are older
        _, h = _fill(rt, cache, ids)
        assert cache.held_bytes <= 6 * one, (cache.held_bytes, one)
    assert cache.contains(prompts[-1]) == 64 and np.array_equal(cache.lookup(prompts[-1]).hidden, h[:64])
    if where == "on disk":  # every block stays cached, the oldest read back from its file
        assert len(cache) == 40 and cache.nbytes == 40 * one and cache.stats.evicted_blocks == 0
        rt.reset()
        assert np.array_equal(cache.lookup(prompts[0]).hidden, rt.prefill(prompts[0])[:64])
    else:
        assert len(cache) == 6 and cache.contains(prompts[0]) == 0 and cache.stats.evicted_blocks == 34
    assert cache.held_bytes <= 6 * one
    with pytest.raises(ValueError, match="cache_memory_bytes must be an integer >= 0, got -1"):
        _cache(rt, memory_bytes=-1)


def test_the_reserve_is_the_larger_of_its_bytes_and_its_fraction_of_the_disk(rt, tmp_path, monkeypatch):
    """By default a cache keeps max(256 MiB, 5 % of the disk) free: on a 1 GiB disk with 200 MiB free it writes
    nothing (it wrote every block, up to its 512 MiB bound)."""
    disk = _Disk(tmp_path, 1 << 30)
    monkeypatch.setattr(os, "statvfs", disk)
    (tmp_path / "other-app").write_bytes(b"")
    os.truncate(tmp_path / "other-app", (1 << 30) - (200 << 20))  # (sparse: st_size is what the fake disk counts)
    default = ActivationCache(rt.manifest.bundle_id, rt.n_layers, rt.kv_heads, rt.head_dim, rt.hidden_size,
                              block_tokens=B, cache_dir=tmp_path / "default", edge_variant=rt.manifest.edge_quant)
    assert _fill(rt, default)[0] == 4 and default.lookup(IDS).tokens == 64
    assert not list((tmp_path / "default").rglob(f"*{FILE_SUFFIX}")) and f"which keeps {256 << 20} free" in default.write_error
    disk.capacity = 100 << 20
    (tmp_path / "other-app").write_bytes(b"x" * (90 << 20))  # 10 MiB free
    assert _fill(rt, _cache(rt, cache_dir=tmp_path / "a", reserve_bytes=1 << 20, reserve_fraction=0.05))[0] == 4
    assert len(list((tmp_path / "a").rglob(f"*{FILE_SUFFIX}"))) == 4  # 10 MiB free > max(1 MiB, 5 MiB)
    c = _cache(rt, cache_dir=tmp_path / "b", reserve_bytes=1 << 20, reserve_fraction=0.2)  # 20 MiB
    assert _fill(rt, c)[0] == 4 and c.write_error and not list((tmp_path / "b").rglob(f"*{FILE_SUFFIX}"))
    c = _cache(rt, cache_dir=tmp_path / "d", reserve_bytes=11 << 20, reserve_fraction=0.05)
    assert _fill(rt, c)[0] == 4 and c.write_error and not list((tmp_path / "d").rglob(f"*{FILE_SUFFIX}"))
    with pytest.raises(ValueError, match="cache_reserve_fraction"):
        _cache(rt, reserve_fraction=1.0)
    with pytest.raises(ValueError, match="cache_reserve_bytes"):
        _cache(rt, reserve_bytes=-1)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs (needs the right to mount: root, or skipped)."""
    where = tmp_path / "small"
    where.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True,
                              timeout=30)
    except OSError:
        done = None
    if done is None or done.returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True, timeout=30)


def test_a_cache_on_a_real_small_disk_keeps_its_reserve_free(rt, small_tmpfs):
    cache = _cache(rt, cache_dir=small_tmpfs / "c", reserve_bytes=512 << 10)
    for ids in _prompts(12):  # 48 blocks of ~13 KB: more than the 1 MiB disk holds
        assert _fill(rt, cache, ids)[0] == 4
        st = os.statvfs(small_tmpfs)
        assert st.f_bavail * st.f_frsize >= 512 << 10
    assert cache.write_error is None and cache.contains(_prompts(12)[-1]) == 64
