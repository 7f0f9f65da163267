"""Keep the edge's bundle in step with its cloud: download the server's edge half, resumably and verified, and
switch to it atomically.

When the cloud moves to a new bundle (another split layer, a re-export), a phone holding the old one is
refused with ``Error(bundle_mismatch, bundle_ids=[...])``. With ``EdgeConfig.auto_update`` (or
``autoglm-edge preload --update``) the edge instead:

1. asks ``GET /v1/bundles`` what the server hosts and picks the bundle of *the same model* (same
   ``source_identity``; an update never changes the model), preferring the ids the Error named and the edge
   variant (``edge_quant``) it has now. A server serving the held bundle id serves the phone's bundle, unless its
   export of the held edge variant is another one (``manifest_sha256`` in the listing,
   ``shared.manifest.export_digest``: an edge half re-exported under the id - another quantization recipe, a fixed
   tokenizer - keeps the id, which covers the cloud half): that export is the update;
2. downloads that bundle's ``manifest.json`` and every ``edge``/``shared`` artifact into a staging directory
   next to the old bundle. A file grows as ``<name>.part``; an interrupted download (a killed app, a dropped
   link, a full disk) continues where it stopped with ``Range: bytes=<have>-`` and ``If-Range: <etag>`` (a file
   that changed on the server starts over); the staged downloads of other exports (the server moved on meanwhile)
   are removed first, their room is this one's (:func:`_drop_other_downloads`); a download short of room on its disk
   takes it from the activation cache's blocks there, other bundles' and scopes' first, when that makes it
   (:func:`_cache_room`). A version directory of this very
   manifest already there (a rollback to the version kept) is used once its files verify again; one that does not
   (a removal a crash cut short, the phone's storage) is removed, unless held, and downloaded again. Each file is checked against the manifest's sha256 and size before it
   takes its name; the manifest's bundle id must re-derive from its hashes (``Manifest.load``). Then every edge
   graph (``edge/*.onnx``: front, prompt-phase graph, tail, drafters, encoders) is opened with this device's
   onnxruntime, as the phone opens it (``edge_client.front.open_session``), one at a time, and let go
   (:func:`check_loads`): a bundle whose files verify but which this runtime cannot run (an IR version or opset
   newer than it supports, a contrib op its build lacks) never becomes a version - it stays staged, the link
   stays on the version held (``unloadable``);
3. switches atomically: the configured bundle path becomes (or already is) a symbolic link into
   ``.<name>.versions/<bundle id>-<edge quant>/`` (``...~<manifest hash>`` when another export of that id holds
   the name: :func:`_version_path`), replaced by one ``rename(2)`` of a new link over it (the version's files and
   every rename are fsynced first: a power cut after the switch finds the whole version). A plain directory
   there (the first update) is moved into the versions folder first, under a free name; a crash between that
   move and the link's rename is finished by :func:`recover` at the next start. The previous version is kept
   (rollback: point the link back); older ones are removed, except one a running client still uses: every
   client resolves the link once when it opens the bundle and holds a shared ``flock`` on that version's
   directory until it closes (:class:`HeldVersion`), so it runs on one version for its lifetime - its encoders,
   opened later, included - and that version stays until a later update finds it unused. Two updaters of one bundle path (two processes
   of an app, an app beside ``preload --update``) take turns on a lock file beside it; the second finds the
   bundle current and returns;
4. the caller then drops the activation cache of the bundle it left (:func:`retire_cache`): its blocks of this
   config's scope in ``cache_dir``, unless another client still has that bundle's cache open.

Errors are :class:`BundleSyncError` with a code: ``no_bundle_endpoint`` (the server hosts no bundles:
an older server, or full-model mode), ``not_served`` / ``other_model`` (nothing to update to),
``hash_mismatch`` (a file that does not verify, after one fresh download), ``unloadable`` (the files verify
but this device's onnxruntime cannot load an edge graph of them: the bundle held stays in use, and its requests are
refused ``bundle_mismatch`` unless the server still serves it; the staged files stay, so a run after an onnxruntime
upgrade needs no download), ``bundle_changed`` (the server moved to
another export of the bundle during the download, twice: run again), ``truncated`` (the transfer kept
stopping short; the part file stays, run again to resume), ``unauthorized``, ``tls_verify_failed`` /
``tls_required`` / ``tls_error`` (as the split link's, ``edge_client.tls``), ``unreachable``, ``http_error``
(also a bundle id or edge variant that is no plain name: they name directories here), ``bad_manifest``,
``write_failed`` (the phone's storage refused a write, the file or folder named: full - what came down stays,
make room and run again to resume - or not writable by the app).

HTTP is the standard library's ``urllib`` (nothing more to install on a phone); the base URL is the split
endpoint's with ``ws`` -> ``http``. References: RFC 9110 (Range, If-Range, ETag).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import ssl
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from shared.manifest import (EDGE_HALF_ROLES, MANIFEST_NAME, Artifact, BundleError, Manifest, export_digest,
                             no_room, same_source)

from . import tls
from .activation_cache import make_room, retire
from .config import DEFAULT_SPLIT_PATH, EdgeConfig, split_url
from .front import open_session

log = logging.getLogger("edge_client.bundle_sync")

CHUNK_BYTES = 1 << 20  # read per step of a download
MAX_ATTEMPTS = 5  # transfers of one file that stop short or get no answer before giving up (each resumes the last)
BUSY_WAIT_S = 120.0  # a server at its request limit (429/503 + Retry-After) is waited for this long per request
BUSY_WAIT_STEP_S = 10.0  # the longest one Retry-After is taken at its word
# What the server names a bundle and an edge variant becomes a directory name here (``<id>-<edge>``): only a
# bundle id (hex, as ``Manifest.compute_bundle_id`` makes them) and a plain variant name are taken
_BUNDLE_ID = re.compile(r"[0-9a-f]{16,64}")
_EDGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")

Progress = Callable[[int, int], None]  # (bytes done, bytes total) over the whole bundle


class _Busy(Exception):
    """The server answered 429/503 with Retry-After: ask again in ``wait_s`` (else ``error``)."""

    def __init__(self, wait_s: float, error: BundleSyncError):
        self.wait_s, self.error = wait_s, error


class BundleSyncError(Exception):
    """Updating the bundle failed; ``code`` says why (see the module docstring)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def http_base(url: str) -> str:
    """The server's HTTP base URL from its split URL: ``ws://h:p/v1/split`` -> ``http://h:p`` (``wss`` ->
    ``https``; a path prefix before ``/v1/split``, as a proxy adds, is kept)."""
    parts = urlsplit(split_url(url))
    path = parts.path.removesuffix(DEFAULT_SPLIT_PATH)
    return urlunsplit(("https" if parts.scheme == "wss" else "http", parts.netloc, path, "", ""))


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an error (urllib would follow it, https -> http included, with the Authorization header)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


@dataclass(slots=True)
class _Response:
    status: int
    headers: dict[str, str]
    body: object  # a file-like HTTP response


class BundleServer:
    """The ``/v1/bundles`` routes of one server (see cloud_server.bundle_files)."""

    def __init__(self, url: str, api_key: str | None = None, ca_file: Path | None = None, timeout_s: float = 60.0):
        self.url, self.base = split_url(url), http_base(url)
        self.api_key, self.ca_file = api_key, ca_file
        self.timeout_s = timeout_s
        self._ssl = tls.client_context(self.url, ca_file)
        self._opener = urllib.request.build_opener(_NoRedirect, urllib.request.HTTPSHandler(context=self._ssl))
        self.bytes_received = 0  # body bytes of file downloads (what a resume saved shows here)

    def _open(self, path: str, headers: dict[str, str] | None = None) -> _Response:
        """One request; a server at its limit (429, or 503, with ``Retry-After``) is asked again after the wait it
        names (at most ``BUSY_WAIT_S`` in all): many phones updating at once take turns instead of failing."""
        waited = 0.0
        while True:
            try:
                return self._open_once(path, headers)
            except _Busy as busy:
                if waited + busy.wait_s > BUSY_WAIT_S:
                    raise busy.error from None
                log.info("%s%s: server busy, trying again in %.1f s", self.base, path, busy.wait_s)
                time.sleep(busy.wait_s)
                waited += busy.wait_s

    def _open_once(self, path: str, headers: dict[str, str] | None) -> _Response:
        req = urllib.request.Request(self.base + path, headers=dict(headers or {}))
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            r = self._opener.open(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:
            if e.code in (206, 304, 416):  # urllib treats these as errors; they are answers here
                return _Response(e.code, {k.lower(): v for k, v in e.headers.items()}, e)
            detail = e.read(300).decode("utf-8", "replace").strip()
            e.close()
            retry_after = e.headers.get("retry-after", "").strip()
            if e.code in (429, 503) and retry_after:
                wait_s = min(BUSY_WAIT_STEP_S, max(0.1, float(retry_after))) if retry_after.isdigit() else 1.0
                raise _Busy(wait_s, BundleSyncError("http_error", f"{self.base}{path}: HTTP {e.code} (still busy "
                                                                  f"after {BUSY_WAIT_S:.0f} s: {detail})")) from None
            if 300 <= e.code < 400:
                raise BundleSyncError("http_error", f"{self.base}{path}: HTTP {e.code} redirect to "
                                      f"{e.headers.get('location')!r} not followed (it could leave TLS or take the "
                                      "API key to another host; the bundles are served beside the split "
                                      "endpoint)") from None
            if e.code == 401:
                raise BundleSyncError("unauthorized", f"{self.base}{path}: HTTP 401: API key refused") from None
            if e.code == 404 and path == "/v1/bundles":
                raise BundleSyncError("no_bundle_endpoint", f"{self.base} hosts no bundles (GET /v1/bundles: HTTP "
                                      "404): a server from before bundle downloads, or one in full-model mode") from None
            raise BundleSyncError("http_error", f"{self.base}{path}: HTTP {e.code}" + (f" ({detail})" if detail
                                                                                   else "")) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            why = tls.explain(self.url, reason, self.ca_file) if isinstance(reason, BaseException) else None
            if why is not None:  # as the split link names it (edge_client.tls): tls_verify_failed, ...
                raise BundleSyncError(*why) from None
            raise BundleSyncError("unreachable", f"{self.base}{path}: cannot connect ({reason})") from None
        return _Response(r.status, {k.lower(): v for k, v in r.headers.items()}, r)

    def _read(self, r: _Response, path: str) -> bytes:
        """A whole (small) answer body; a connection that breaks meanwhile is ``unreachable``."""
        try:
            with r.body:
                return r.body.read()
        except (HTTPException, OSError) as e:  # OSError covers timeouts
            raise BundleSyncError("unreachable", f"{self.base}{path}: the answer broke off ({e})") from None

    def _json(self, path: str):
        data = self._read(self._open(path), path)
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BundleSyncError("http_error", f"{self.base}{path}: not JSON ({data[:80]!r})") from None

    def listing(self) -> list[dict]:
        """``GET /v1/bundles``: the bundles the server hosts."""
        body = self._json("/v1/bundles")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise BundleSyncError("http_error", f"{self.base}/v1/bundles: no bundle list in the answer")
        return data

    def manifest_bytes(self, bundle_id: str, edge: str) -> bytes:
        path = f"/v1/bundles/{quote(bundle_id)}/manifest?edge={quote(edge)}"
        return self._read(self._open(path), path)

    def download(self, bundle_id: str, edge: str, rel: str, part: Path, art: Artifact,
                 on_bytes: Callable[[int], None]) -> None:
        """Bring ``part`` to the whole file ``rel`` (``art.bytes`` long), continuing what it holds. Raises
        BundleSyncError("truncated") when this transfer stops short (``part`` keeps what came)."""
        have = part.stat().st_size if part.exists() else 0
        if have > art.bytes:
            part.unlink()
            have = 0
        if have == art.bytes:
            part.touch()  # an empty file has no byte to fetch, but its part must exist to be hashed and renamed
            return
        etag = f'"{art.sha256}"'
        headers = {"Range": f"bytes={have}-", "If-Range": etag} if have else {}
        r = self._open(f"/v1/bundles/{quote(bundle_id)}/files/{quote(rel)}?edge={quote(edge)}", headers)
        with r.body:
            if r.status == 416:  # what we hold is no prefix of the file: start over
                part.unlink()
                raise BundleSyncError("truncated", f"{rel}: the server refused the resume range; starting over")
            if r.headers.get("etag") not in (None, etag):  # not a damaged copy: another export's file
                raise BundleSyncError("bundle_changed", f"{rel}: the server serves another export of the bundle now "
                                      f"(ETag {r.headers['etag']}, the manifest this download began with says sha256 "
                                      f"{art.sha256}: it restarted on a new one, or another replica answered)")
            if r.status == 200 and have:  # the server sent the whole file (it ignored the range)
                on_bytes(-have)
                have = 0
            elif r.status not in (200, 206):
                raise BundleSyncError("http_error", f"{rel}: HTTP {r.status}")
            with open(part, "ab" if have else "wb") as f:
                left = art.bytes - have  # never a byte past the manifest's size (a broken server may send more)
                while left > 0:
                    try:  # read1: what has arrived (one recv); read(n) waits for n bytes, and a reset or a timeout
                        # meanwhile lost all it had read - up to CHUNK_BYTES, a whole edge file, every resume
                        chunk = r.body.read1(min(CHUNK_BYTES, left))
                    except (HTTPException, OSError, ssl.SSLError):  # OSError covers timeouts
                        chunk = b""  # the connection broke: what arrived is kept
                    if not chunk:
                        break
                    left -= len(chunk)
                    f.write(chunk)
                    self.bytes_received += len(chunk)
                    on_bytes(len(chunk))
        got = part.stat().st_size
        if got < art.bytes:
            raise BundleSyncError("truncated", f"{rel}: the transfer stopped at {got} of {art.bytes} bytes; run "
                                               "again to resume")


def choose(current: Manifest, listing: list[dict], preferred_ids: list[str] = (),
           current_export: str | None = None) -> tuple[str, str] | None:
    """The (bundle id, edge variant) to update to; None when the server already serves ``current``.

    ``current_export``: the held export's ``export_digest``. A server serving ``current``'s bundle id serves it
    unless its export of the held edge variant is another one (the edge half re-exported under the id, which
    leaves the edge graphs out): then that export (a server or an export that names no digest: the id decides).
    Else the candidates are the server's bundles of the same model (``source_identity`` and ``architecture``), the
    ids in ``preferred_ids`` (the refusal's ``bundle_ids``) first; the edge variant is the one held now when
    offered, else the server's first. Entries of the listing that are no mapping are ignored; an id or a
    variant that is no plain name is refused (``http_error``): they become directory names here."""
    listing = [b for b in listing if isinstance(b, dict)]
    served = next((b for b in listing if b.get("id") == current.bundle_id), None)
    if served is not None:
        held = [v for v in _variants(served) if v.get("edge_quant") == current.edge_quant]
        if not held or current_export is None or held[0].get("manifest_sha256") in (None, current_export):
            return None
        pick = current.bundle_id, current.edge_quant
        _check_names(*pick)
        return pick
    same = [b for b in listing if same_source(str(b.get("source_identity")), current.source_identity)
            and b.get("architecture") == current.architecture]
    if not same:
        models = ", ".join(sorted({str(b.get("source")) for b in listing})) or "nothing"
        code = "other_model" if listing else "not_served"
        raise BundleSyncError(code, f"the server hosts {models}; this edge holds {current.source}: an update "
                                    "never changes the model")
    rank = {bid: i for i, bid in enumerate(preferred_ids)}
    best = min(same, key=lambda b: rank.get(b.get("id"), len(rank)))
    variants = [v.get("edge_quant") for v in _variants(best)]
    if not variants:
        raise BundleSyncError("not_served", f"bundle {best.get('id')!r} offers no edge half for download")
    pick = best.get("id"), current.edge_quant if current.edge_quant in variants else variants[0]
    _check_names(*pick)
    return pick


def _variants(entry: dict) -> list[dict]:
    """A listing entry's edge variants (mappings only)."""
    offered = entry.get("edge_variants")
    return [v for v in offered if isinstance(v, dict)] if isinstance(offered, list) else []


def _check_names(bundle_id, edge) -> None:
    """Refuse a bundle id or edge variant from the server that could not be one (``../x``, ``/abs``, empty):
    ``fetch`` makes a directory ``<id>-<edge>`` of them."""
    if not (isinstance(bundle_id, str) and _BUNDLE_ID.fullmatch(bundle_id)
            and isinstance(edge, str) and _EDGE_NAME.fullmatch(edge)):
        raise BundleSyncError("http_error", f"the server names bundle id {str(bundle_id)[:80]!r} with edge "
                                            f"variant {str(edge)[:80]!r}: not a bundle id (hex) and a plain "
                                            "variant name; refused")


# -- layout ------------------------------------------------------------------------------------------------

def versions_dir(bundle: Path) -> Path:
    """Where the versions of the bundle at ``bundle`` live: ``.<name>.versions`` beside it."""
    return bundle.parent / f".{bundle.name}.versions"


def _link_tmp(bundle: Path) -> Path:
    return bundle.parent / f".{bundle.name}.link-tmp"


def recover(bundle: Path) -> None:
    """Finish a switch a crash interrupted (the old directory moved away, the new link not yet in place)."""
    bundle, tmp = Path(bundle), _link_tmp(Path(bundle))
    # (os.path's checks: a bundle in a folder the app may not enter was a PermissionError traceback at every client's
    # start; Manifest.load says it in one line)
    if not os.path.lexists(bundle) and os.path.islink(tmp):
        os.replace(tmp, bundle)
        log.info("%s: finished an interrupted bundle switch", bundle)


class HeldVersion(os.PathLike):
    """The bundle version a client runs on for its lifetime: the bundle path resolved once, when the client opens
    it, and a shared ``flock`` on that directory, which :func:`switch` honours (no update removes it before
    :meth:`close`). As a path (``os.fspath``) it is that directory wherever it is now: the first update moves a
    plain bundle directory into the versions folder, where it is found (by its inode)."""

    def __init__(self, bundle: str | Path):
        self.bundle = Path(bundle).absolute()  # its versions folder is looked in later, whatever the cwd is then
        self.path, self._fd = self.bundle, None  # no directory to hold: the caller's load says what is wrong
        for _ in range(3):
            directory = self.bundle.resolve()
            try:
                fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                return
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a removal in progress (switch holds it exclusively)
            if (directory / MANIFEST_NAME).is_file():
                self.path, self._fd = directory, fd
                self._release = weakref.finalize(self, os.close, fd)  # at close(), else when collected
                return
            os.close(fd)  # removed by an update between the resolve and the lock: the link names another now

    def __fspath__(self) -> str:
        if self._fd is not None and not _is_dir_of(self.path, self._fd):
            versions = versions_dir(self.bundle)
            moved = [p for p in versions.iterdir() if _is_dir_of(p, self._fd)] if versions.is_dir() else []
            if not moved:  # moved or deleted by hand: the path may name another version now - never mix them
                raise FileNotFoundError(f"{self.path}: the bundle version this client runs on was moved or removed "
                                        "while it ran; open the client again")
            self.path = moved[0]
        return str(self.path)

    def close(self) -> None:
        """Let go: a later update may remove this version."""
        if self._fd is not None:
            self._release()
            self._fd = None


def _is_dir_of(path: Path, fd: int) -> bool:
    try:
        a, b = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


@contextlib.contextmanager
def unheld(directory: Path):
    """Whether no running client holds ``directory`` (:class:`HeldVersion`): True, and none opens it until the
    block ends (an exclusive ``flock``: a client opening it waits, then reads what the block left there); False when
    one holds it, which must then not be changed or removed. True for a path that is no directory."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # not a directory
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _remove_unless_held(version: Path) -> None:
    """Remove an old version, unless a running client holds it (:class:`HeldVersion`)."""
    with unheld(version) as free:
        if not free:
            log.info("%s: kept, a running client uses it (a later update removes it)", version)
            return
        shutil.rmtree(version, ignore_errors=True)


def fetch(server: BundleServer, bundle_id: str, edge: str, bundle: Path, progress: Progress | None = None,
          threads: int = 2, room: Callable[[Path, int], object] | None = None) -> Path:
    """Download the edge half of ``bundle_id`` (variant ``edge``) beside ``bundle``; returns its verified
    directory in the versions folder (:func:`_version_path`), whose edge graphs load with this onnxruntime
    (:func:`check_loads`, with ``threads`` intra-op threads: ``EdgeConfig.threads``; else ``unloadable``, the
    download left staged). Resumes a staging directory an earlier call left for this export; removes those of other
    exports (:func:`_drop_other_downloads`). ``room(stage, bytes)``, before the files are written: make that room on the
    staging directory's disk (``update``'s frees the activation cache's blocks, :func:`_cache_room`).
    Removes no version: :func:`switch` does, unless a running client holds it. A server that moves to another export
    of the bundle meanwhile (``bundle_changed``: a restart on a re-export) is followed once, from its new manifest."""
    _check_names(bundle_id, edge)  # before either becomes a path
    try:
        return _fetch(server, bundle_id, edge, bundle, progress, threads, room)
    except BundleSyncError as e:
        if e.code != "bundle_changed":
            raise
        log.info("%s; starting over with the server's manifest", e)
    return _fetch(server, bundle_id, edge, bundle, progress, threads, room)


def _fetch(server: BundleServer, bundle_id: str, edge: str, bundle: Path, progress: Progress | None,
           threads: int, room: Callable[[Path, int], object] | None) -> Path:
    """:func:`fetch` over the manifest the server serves now."""
    raw = server.manifest_bytes(bundle_id, edge)
    final = _version_path(bundle, bundle_id, edge, raw, reuse=True)
    if final.is_dir():  # complete from an earlier run, its files verified again (_version_path)
        return final
    stage = final.with_name(final.name + ".partial")
    if stage.is_dir() and not _same_manifest(stage, raw):
        shutil.rmtree(stage)
    _drop_other_downloads(stage)
    stage.mkdir(parents=True, exist_ok=True)
    (stage / MANIFEST_NAME).write_bytes(raw)
    try:
        m = Manifest.load(stage)
    except BundleError as e:
        raise BundleSyncError("bad_manifest", f"the server's manifest for {bundle_id}: {e}") from None
    if m.bundle_id != bundle_id or m.edge_quant != edge:
        raise BundleSyncError("bad_manifest", f"asked for bundle {bundle_id} ({edge} edge), the server sent "
                                              f"{m.bundle_id} ({m.edge_quant})")
    todo = sorted((rel, a) for rel, a in m.artifacts.items() if a.role in EDGE_HALF_ROLES)
    total = sum(a.bytes for _, a in todo)
    done = 0
    if room is not None:  # what is left to write, a 4 KiB page more per file (what a file system allocates in)
        room(stage, sum(a.bytes - _staged_bytes(stage / rel) + 4096 for rel, a in todo))

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    for rel, art in todo:
        dest = stage / rel
        if not _safe(stage, dest):
            raise BundleSyncError("bad_manifest", f"artifact path {rel!r} leaves the bundle directory")
        if dest.is_file() and dest.stat().st_size == art.bytes and _sha256(dest) == art.sha256:
            on_bytes(art.bytes)  # verified when it took its name, and hashed again: the phone's storage may have
            continue             # changed it since (else the switch put a version no client opens in place)
        dest.parent.mkdir(parents=True, exist_ok=True)
        _download_verified(server, bundle_id, edge, rel, dest, art, on_bytes)
    check_loads(stage, m, threads)  # a version is one this phone runs: else it stays staged, never switched to
    _sync_tree(stage)  # on storage before it takes its name: a power cut after the switch finds whole files
    os.replace(stage, final)
    _sync_dir(final.parent)
    log.info("bundle %s (%s edge): %d files, %d bytes, verified", bundle_id, edge, len(todo), total)
    return final


def _staged_bytes(dest: Path) -> int:
    """Bytes of ``dest`` already down: the file, or its part file."""
    for path in (dest, dest.with_name(dest.name + ".part")):
        with contextlib.suppress(OSError):
            return path.stat().st_size
    return 0


def _drop_other_downloads(stage: Path) -> None:
    """Remove the staging directories beside ``stage``: downloads of other exports that an earlier update left (cut
    short by a full disk or a link, or ``unloadable``) for a bundle the server no longer serves. The room they hold
    is the new download's: kept until a switch, a download that had filled the disk failed every update after it
    (``write_failed``, 'make room') while the room was the updater's own. One update of a bundle path runs at a
    time (:func:`_update_lock`), so none of them is being written."""
    for other in stage.parent.glob("*.partial"):
        if other != stage and other.is_dir() and not other.is_symlink():
            shutil.rmtree(other, ignore_errors=True)


def check_loads(directory: Path, m: Manifest, threads: int) -> None:
    """Open every edge graph of the bundle ``m`` in ``directory`` (its ``edge`` artifacts ending ``.onnx``) with
    this device's onnxruntime and the phone's session options (``edge_client.front.open_session``), one at a time,
    each let go before the next. Raises BundleSyncError("unloadable") naming the first graph that does not load."""
    for rel in sorted(r for r, a in m.artifacts.items() if a.role == "edge" and r.endswith(".onnx")):
        try:
            session = open_session(directory / rel, threads)
        except BundleError as e:  # onnxruntime's first line, e.g. "Unsupported model IR version: ..."
            raise BundleSyncError("unloadable", f"bundle {m.bundle_id} ({m.edge_quant} edge) verifies but this "
                                                f"device cannot run it: {e}") from None
        del session


def _sync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``: a rename is atomic, but without this the renamed
    directory may hold empty or partly written files after a power cut (ext4 / f2fs delayed allocation)."""
    for here, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(here, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _sync_dir(Path(here))


def _sync_dir(directory: Path) -> None:
    """fsync a directory: the renames and new names in it survive a power cut."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _version_path(bundle: Path, bundle_id: str, edge: str, raw: bytes, *, reuse: bool) -> Path:
    """The versions-folder directory of the version ``<bundle_id>-<edge>`` whose manifest is ``raw``: that name,
    or, when a directory of another export holds it - an edge half re-exported under one bundle id (the id covers
    the cloud half only), a plain copy put back at the bundle path - ``<that>~<12 hex of the manifest's sha256>``
    (then ``.2``, ``.3``...): a taken name is never freed here, so no version a running client holds is removed
    or replaced (:func:`switch` removes old versions, unless held). ``reuse``: a directory of this very manifest
    already there is the answer when its files verify again (:func:`_damage`); one that does not - a removal a crash
    cut short, files the phone's storage or a cleaner took - is removed, unless a running client holds it, and the
    version downloaded again (it was switched to as it was: every client then failed to open the bundle, and
    ``preload --update`` said 'up to date')."""
    base = versions_dir(bundle) / f"{bundle_id}-{edge}"
    if reuse:
        taken = [base, *sorted(base.parent.glob(glob.escape(base.name) + "~*"))]
        for path in taken:
            if not path.name.endswith(".partial") and path.is_dir() and _same_manifest(path, raw):
                if (damage := _damage(path)) is None:
                    return path
                log.info("%s: not whole (%s); downloading the version again", path, damage)
                _remove_unless_held(path)
    tag = export_digest(raw)[:12]
    names = itertools.chain([base.name, f"{base.name}~{tag}"],
                            (f"{base.name}~{tag}.{n}" for n in itertools.count(2)))
    return next(path for path in map(base.with_name, names) if not (path.exists() or path.is_symlink()))


def _damage(version: Path, hashes: bool = True) -> str | None:
    """Why the bundle directory ``version`` is no edge half a client opens - an edge file missing, or one of it or
    of the shared files it holds of another size or (``hashes``) sha256 than its manifest says -, or None."""
    try:
        Manifest.load(version).verify_files(version, roles=EDGE_HALF_ROLES, hashes=hashes, if_present=("shared",))
    except BundleError as e:
        return str(e)
    return None


def _serves(listing: list[dict], m: Manifest) -> bool:
    """Does the server's listing offer ``m``'s bundle id with its edge variant for download?"""
    return any(b.get("id") == m.bundle_id and any(v.get("edge_quant") == m.edge_quant for v in _variants(b))
               for b in listing if isinstance(b, dict))


def _same_manifest(directory: Path, raw: bytes) -> bool:
    path = directory / MANIFEST_NAME
    return path.is_file() and path.read_bytes() == raw


def _safe(root: Path, path: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def _download_verified(server: BundleServer, bundle_id: str, edge: str, rel: str, dest: Path, art: Artifact,
                       on_bytes: Callable[[int], None]) -> None:
    """One file into ``dest`` via ``dest.part``: resumed up to MAX_ATTEMPTS times, then hashed; a file that
    does not verify is fetched once more from scratch (a corrupt part) before failing."""
    part = dest.with_name(dest.name + ".part")
    if part.exists():
        on_bytes(min(part.stat().st_size, art.bytes))
    for fresh in (False, True):
        for attempt in range(MAX_ATTEMPTS):
            try:
                server.download(bundle_id, edge, rel, part, art, on_bytes)
                break
            except BundleSyncError as e:  # unreachable: also a link dropped before the answer's first byte (a reset,
                # a timeout), no less resumable than one dropped after it
                if e.code not in ("truncated", "unreachable") or attempt == MAX_ATTEMPTS - 1:
                    raise
                log.info("%s; resuming (%d/%d)", e, attempt + 1, MAX_ATTEMPTS - 1)
                time.sleep(min(2.0, 0.1 * 2 ** attempt))
        if _sha256(part) == art.sha256:
            os.replace(part, dest)
            return
        on_bytes(-part.stat().st_size)
        part.unlink()
        if fresh:
            break
    raise BundleSyncError("hash_mismatch", f"{rel}: the downloaded file does not match the manifest's sha256 "
                                           f"{art.sha256} (twice); the server's copy is damaged")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
            h.update(chunk)
    return h.hexdigest()


def switch(bundle: Path, new: Path) -> None:
    """Make ``bundle`` point at the verified version ``new`` (one rename of a link over it; see the module
    docstring). The version it pointed at stays; older ones are removed unless a running client holds them."""
    bundle = Path(bundle)
    versions = versions_dir(bundle)
    previous: Path | None = None
    if bundle.is_symlink():
        previous = (bundle.parent / os.readlink(bundle)).resolve()
    elif bundle.is_dir():  # the first update: the plain directory becomes a version (under a free name)
        m = Manifest.load(bundle)
        raw = (bundle / MANIFEST_NAME).read_bytes()
        previous = _version_path(bundle, m.bundle_id, m.edge_quant, raw, reuse=False)
    tmp = _link_tmp(bundle)
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(os.path.relpath(new, bundle.parent))
    if previous is not None and not bundle.is_symlink():
        os.replace(bundle, previous)  # a crash right here is what recover() finishes
        _sync_dir(previous.parent)
    os.replace(tmp, bundle)
    _sync_dir(bundle.parent)
    keep = {new.resolve(), previous.resolve() if previous is not None else None}
    for old in versions.iterdir():
        if old.resolve() not in keep:
            _remove_unless_held(old)


def update(config: EdgeConfig, current: Manifest, preferred_ids: list[str] = (),
           progress: Progress | None = None) -> Manifest | None:
    """Bring ``config.bundle`` to the server's bundle of the same model; returns the new manifest, or None
    when the server serves ``current`` already and the copy held is whole (one that lost files - a power cut, a
    cleaner - is downloaded again: the manifest returned is ``current``'s). Raises BundleSyncError."""
    server = BundleServer(config.url, config.api_key, config.ca_file, timeout_s=config.retry.reply_timeout_s)
    bundle = Path(config.bundle)
    listing = server.listing()
    pick = choose(current, listing, list(preferred_ids), _export_at(bundle))
    if pick is None:
        damage = _damage(bundle, hashes=False)
        if damage is None or not _serves(listing, current):
            return None
        # the phone's copy lost files (a power cut, a cleaner) while the server serves it: no client opens it (and
        # 'preload --update' said 'up to date'); the same export is downloaded again
        log.info("%s: not whole (%s); downloading bundle %s again", bundle, damage, current.bundle_id)
        pick = current.bundle_id, current.edge_quant
    bundle_id, edge = pick
    log.info("updating %s: bundle %s -> %s (%s edge) from %s", config.bundle, current.bundle_id, bundle_id, edge,
             server.base)
    try:
        with _update_lock(bundle):
            if _is_version(bundle, server.manifest_bytes(bundle_id, edge)):  # another updater got there first
                return Manifest.load(bundle)
            switch(bundle, fetch(server, bundle_id, edge, bundle, progress, config.threads,
                                 _cache_room(config, current)))
    except BundleSyncError as e:
        if e.code != "unloadable":
            raise
        raise BundleSyncError(e.code, f"{e}. Kept bundle {current.bundle_id} ({current.edge_quant} edge) at "
                                      f"{config.bundle}, not switched (the verified download stays staged: the next "
                                      f"update checks it again without downloading it); "
                                      + _after_unloadable(current, bundle_id)) from None
    except OSError as e:  # the phone's storage (the network's OSErrors are BundleSyncErrors by now)
        raise BundleSyncError("write_failed", _unwritten(bundle, e)) from None
    return Manifest.load(config.bundle)


def _cache_room(config: EdgeConfig, current: Manifest) -> Callable[[Path, int], object] | None:
    """An update's ``room``: a download that lacks room frees the activation cache's blocks on its disk, other
    bundles' and scopes' first, then the bundle held's (its switch retires them) - only when that makes the room
    (``edge_client.activation_cache.make_room``): the cache is an optimisation, the update what the phone runs."""
    if config.cache_dir is None:
        return None
    return lambda where, need: make_room(config.cache_dir, where, need, current.bundle_id, current.states_variant,
                                         config.cache_dtype, config.cache_block_tokens)


def _unwritten(bundle: Path, e: OSError) -> str:
    """The line of an update the phone's storage refused (``e``): where - a write's error names no file: the
    versions folder it wrote in (it said 'a file') - and what helps: room (``shared.manifest.no_room``: a full disk,
    a quota; what came down is kept for the rerun), else write access there (a read-only or foreign folder, where
    'make room' was the advice)."""
    head = f"cannot write the new bundle beside {bundle}: {e.strerror or e} ({e.filename or versions_dir(bundle)})"
    if no_room(e) is not None:
        return f"{head}; what came down is kept: make room and run again to resume"
    return f"{head}; the app needs write access there (the bundle held stays in use)"


def _after_unloadable(current: Manifest, bundle_id: str) -> str:
    """What an edge left on ``current`` can do when the server's bundle ``bundle_id`` does not load here."""
    if bundle_id == current.bundle_id:  # another export of the held id: the server still takes its Hello
        return ("the server serves this bundle id, so the edge carries on with the export it holds (the cloud half "
                "is the same)")
    return (f"this edge cannot run against a server that serves only bundle {bundle_id}: its requests are "
            "refused (bundle_mismatch) until the server also serves the bundle held or an export this onnxruntime "
            "loads, or the app ships an onnxruntime that loads this one")


def retire_cache(config: EdgeConfig, old: Manifest, new: Manifest) -> None:
    """After a switch from ``old`` to ``new``: remove ``old``'s blocks of this config's scope from the activation
    cache directory (``edge_client.activation_cache.retire``: kept while another client has them open; other
    scopes and bundles are never touched). A rollback to ``old`` starts with an empty cache."""
    if config.cache_dir is None or (old.bundle_id, old.states_variant) == (new.bundle_id, new.states_variant):
        return  # nothing kept on disk, or the new bundle's blocks are the old ones
    retire(config.cache_dir, old.bundle_id, old.states_variant, config.cache_dtype, config.cache_block_tokens)


@contextlib.contextmanager
def _update_lock(bundle: Path):
    """One update of a bundle path at a time (two processes of one app, an app beside ``preload --update``):
    they would write the same part files and the second switch would drop the rollback version. The second
    waits for the first (an advisory ``flock`` on ``.<name>.update-lock`` beside the bundle; the kernel
    releases it if the holder dies)."""
    fd = os.open(bundle.parent / f".{bundle.name}.update-lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s: another update of this bundle is running; waiting for it", bundle)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _is_version(bundle: Path, raw: bytes) -> bool:
    """Is the bundle at ``bundle`` already a verified version of the export whose manifest is ``raw`` (whatever its
    folder's name: :func:`_version_path`), its files all there?"""
    return bundle.is_symlink() and _same_manifest(bundle, raw) and _damage(bundle, hashes=False) is None


def _export_at(bundle: Path) -> str | None:
    """The ``export_digest`` of the bundle at ``bundle`` (None: no manifest to read; its load says why)."""
    try:
        return export_digest((bundle / MANIFEST_NAME).read_bytes())
    except OSError:
        return None


class LogProgress:
    """A progress callback that logs every ``step`` (fraction) of a long download, and its end."""

    def __init__(self, step: float = 0.1, min_bytes: int = 8 << 20):
        self.step, self.min_bytes, self._next = step, min_bytes, step

    def __call__(self, done: int, total: int) -> None:
        if total < self.min_bytes or done < self._next * total:
            return
        log.info("bundle download: %.0f %% of %.1f MB", 100 * done / total, total / 1e6)
        while self._next * total <= done:
            self._next += self.step
