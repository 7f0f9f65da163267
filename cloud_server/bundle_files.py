"""The edge halves of the served bundles over HTTP: a phone downloads, resumes and updates its bundle here.

Routes (behind the API key, like every ``/v1`` route):

* ``GET /v1/bundles`` - the served bundles: id, model, split layer, and the edge variants on offer
  (``edge_quant``, bytes, files, ``manifest_sha256``: which export of that edge half, ``shared.manifest.
  export_digest``). Several bundle directories with one bundle id are edge variants of one
  bundle (an int8 and an fp32 front of the same split: the id ignores the edge quantization);
* ``GET /v1/bundles/{id}/manifest[?edge=VARIANT]`` - that variant's ``manifest.json``, byte for byte (its
  ``bundle_id`` re-derives from its hashes, so a client checks it with ``Manifest.load``); default variant:
  the first directory given;
* ``GET|HEAD /v1/bundles/{id}/files/{path}[?edge=VARIANT]`` - one artifact of role ``edge`` or ``shared``.
  ``ETag`` is the manifest's sha256 (quoted); ``Range: bytes=a-b`` (one range) answers 206 with
  ``Content-Range``, a range past the end 416 with ``Content-Range: bytes */size``; ``If-Range`` with another
  ETag gets the whole file (200); ``If-None-Match`` with this one 304.

What is served is looked up by exact name in the manifest's artifacts, never joined from the request path:
a name that is not an edge/shared artifact (the cloud weights, ``../`` anything, the manifest's own
neighbours) is 404, and a listed file that resolves outside its bundle directory (a symlink) is 404 too.
A file that is missing on disk or whose size or sha256 there differs from the manifest is refused (500, and
logged): the server never sends bytes that cannot verify. The hash is taken off the event loop on a file's first
request and again only when its size, mtime or inode changes (:meth:`BundleCatalog.check`). A download whose client takes no byte for ``SEND_STALL_S`` is dropped (the client resumes with
``Range``), so a reader that stalls gives back its ``--max-http-requests`` slot.

References: RFC 9110 sections 13.1.5 (If-Range), 14 (range requests), 8.8.3 (ETag).
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response, StreamingResponse

from shared.manifest import EDGE_HALF_ROLES, MANIFEST_NAME, Artifact, BundleError, Manifest, export_digest, sha256_file
from shared.openai_routes import get_route

log = logging.getLogger("autoglm.cloud.bundles")

CHUNK_BYTES = 1 << 20  # read and sent per step of a download
SEND_BYTES = 64 << 10  # one send of a download
SEND_STALL_S = 60.0  # a download whose client takes no byte for this long is dropped (it resumes with Range):
# else a client that stops reading holds its --max-http-requests slot and an open file forever
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")
_POS_DIGITS = 19  # a byte position with more significant digits than this is past any file (and int() refuses
# strings over 4300 digits): it is read as _PAST_ANY_FILE
_PAST_ANY_FILE = 10 ** _POS_DIGITS


class RangeNotSatisfiable(Exception):
    """The Range header names no byte of the file (answered 416)."""


class Tampered(Exception):
    """A served file on disk is not the one its manifest names (answered 500); the message says how."""


@dataclass(frozen=True, slots=True)
class EdgeVariant:
    """One bundle directory's edge half: what ``/v1/bundles/{id}/...?edge=<edge_quant>`` serves."""

    edge_quant: str
    directory: Path
    manifest: Manifest
    manifest_bytes: bytes

    def summary(self) -> dict:
        served = [a for a in self.manifest.artifacts.values() if a.role in EDGE_HALF_ROLES]
        return {"edge_quant": self.edge_quant, "files": len(served), "bytes": sum(a.bytes for a in served),
                "manifest_sha256": export_digest(self.manifest_bytes)}


class BundleCatalog:
    """The bundles a server hosts for download, by bundle id then edge variant (first directory first)."""

    def __init__(self, directories: list[Path], model_name: str | None = None):
        """``directories``: bundle directories (the served ones and extra edge variants of them).
        ``model_name``: the served model id of the first bundle (default: each bundle's first directory's
        name, with its id's first 8 characters when two bundles' directories share a name). Raises BundleError for a directory that is no bundle, or two directories of one bundle id
        with the same edge variant."""
        self.bundles: dict[str, dict[str, EdgeVariant]] = {}
        self.model_names: dict[str, str] = {}
        self._verified: dict[Path, tuple[int, int, int]] = {}  # file -> (size, mtime_ns, inode) its hash matched at
        self._hashing: dict[Path, asyncio.Lock] = {}  # per file: phones asking for it at once wait for one hash
        for d in directories:
            d = Path(d)
            m = Manifest.load(d)
            variants = self.bundles.setdefault(m.bundle_id, {})
            if m.edge_quant in variants:
                raise BundleError(f"{d}: a second {m.edge_quant} edge for bundle {m.bundle_id} (first: "
                                  f"{variants[m.edge_quant].directory})")
            variants[m.edge_quant] = EdgeVariant(m.edge_quant, d, m, (d / MANIFEST_NAME).read_bytes())
            if m.bundle_id not in self.model_names:
                name = (model_name if not self.model_names else None) or d.name
                if name in self.model_names.values():  # two bundle directories of one name: tell them apart
                    name = f"{name}-{m.bundle_id[:8]}"
                self.model_names[m.bundle_id] = name

    @property
    def ids(self) -> list[str]:
        return list(self.bundles)

    def listing(self) -> list[dict]:
        out = []
        for bid, variants in self.bundles.items():
            m = next(iter(variants.values())).manifest
            out.append({"id": bid, "model": self.model_names[bid], "source": m.source,
                        "source_identity": m.source_identity, "architecture": m.architecture,
                        "split_layer": m.split_layer, "num_layers": m.num_layers,
                        "edge_variants": [v.summary() for v in variants.values()]})
        return out

    def variant(self, bundle_id: str, edge: str | None) -> EdgeVariant:
        """The edge variant ``edge`` (None: the first) of ``bundle_id``; KeyError with the reason."""
        variants = self.bundles.get(bundle_id)
        if variants is None:
            raise KeyError(f"bundle {bundle_id!r} is not served here (served: {', '.join(self.bundles) or 'none'})")
        if edge is None:
            return next(iter(variants.values()))
        if edge not in variants:
            raise KeyError(f"bundle {bundle_id} has no {edge!r} edge (variants: {', '.join(variants)})")
        return variants[edge]

    def artifact(self, bundle_id: str, edge: str | None, rel: str) -> tuple[Path, Artifact]:
        """The file behind ``rel`` and its manifest entry; KeyError unless it is a served artifact inside its
        bundle directory."""
        v = self.variant(bundle_id, edge)
        art = v.manifest.artifacts.get(rel)
        if art is None or art.role not in EDGE_HALF_ROLES:
            raise KeyError(f"{rel!r} is not an edge file of bundle {bundle_id}")
        root = v.directory.resolve()
        path = (v.directory / rel).resolve()
        if not path.is_relative_to(root):
            raise KeyError(f"{rel!r} is not an edge file of bundle {bundle_id}")
        return path, art  # (missing on disk: check() says so, 500 and logged - the operator's, not the client's)

    async def check(self, path: Path, art: Artifact) -> None:
        """Raise :class:`Tampered` unless ``path`` is the file ``art`` names: its size, and its sha256 - hashed
        off the event loop the first time and whenever its size, mtime or inode changed since."""
        st = path.stat()
        if st.st_size != art.bytes:
            raise Tampered(f"{st.st_size} bytes on disk, manifest says {art.bytes}")
        seen = (st.st_size, st.st_mtime_ns, st.st_ino)
        async with self._hashing.setdefault(path, asyncio.Lock()):
            if self._verified.get(path) != seen:
                if await asyncio.to_thread(sha256_file, path) != art.sha256:
                    raise Tampered("its sha256 differs from the manifest's")
                self._verified[path] = seen


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``Range: bytes=a-b`` -> the inclusive byte span ``(a, b)`` within ``size`` bytes; None: serve it all
    (no header, several ranges, or a unit other than bytes: RFC 9110 lets a server ignore those).
    Raises RangeNotSatisfiable for a range with no byte in the file."""
    if not header:
        return None
    m = _RANGE.fullmatch(header.strip())
    if m is None:
        return None
    first, last = m.group(1), m.group(2)
    if not first and not last:
        return None
    if not first:  # bytes=-n: the last n bytes
        n = _position(last)
        if n == 0 or size == 0:
            raise RangeNotSatisfiable
        return max(0, size - n), size - 1
    a = _position(first)
    b = min(_position(last), size - 1) if last else size - 1
    if a >= size or (last and _position(last) < a):
        raise RangeNotSatisfiable
    return a, b


def _position(digits: str) -> int:
    """A Range header's decimal byte position; absurdly long ones are clamped past any file."""
    digits = digits.lstrip("0") or "0"
    return _PAST_ANY_FILE if len(digits) > _POS_DIGITS else int(digits)


def _etag(sha256: str) -> str:
    return f'"{sha256}"'


def _etag_matches(header: str | None, etag: str) -> bool:
    if not header:
        return False
    return any(t.strip().removeprefix("W/") in (etag, "*") for t in header.split(","))


async def _stream(path: Path, start: int, length: int):
    """The bytes ``[start, start + length)`` of ``path``, in chunks read off the event loop."""
    with open(path, "rb") as f:
        f.seek(start)
        left = length
        while left > 0:
            chunk = await asyncio.to_thread(f.read, min(CHUNK_BYTES, left))
            if not chunk:  # shrank under us: the client sees a short body and resumes
                log.warning("%s: ended %d bytes early", path, left)
                return
            left -= len(chunk)
            for i in range(0, len(chunk), SEND_BYTES):  # SEND_STALL_S bounds one of these: >= 1 KiB/s passes
                yield chunk[i:i + SEND_BYTES]


class _Stalled(Exception):
    """The client took no byte of a download for SEND_STALL_S."""


class _Download(StreamingResponse):
    """A file's bytes; a send the client does not take within SEND_STALL_S ends the download (see above)."""

    async def __call__(self, scope, receive, send) -> None:
        stalled = False

        async def send_or_stall(message) -> None:
            nonlocal stalled
            try:
                await asyncio.wait_for(send(message), SEND_STALL_S)
            except asyncio.TimeoutError:
                stalled = True
                raise _Stalled from None

        try:
            await super().__call__(scope, receive, send_or_stall)
        except Exception:  # _Stalled, alone or in starlette's task group (no except*: Python 3.10 runs this)
            if not stalled:
                raise
            log.warning("%s: download stalled (no byte taken for %.0f s); dropped", scope.get("path"), SEND_STALL_S)


def file_response(request: Request, path: Path, art: Artifact) -> Response:
    """The 200 / 206 / 304 / 416 answer for one artifact that passed :meth:`BundleCatalog.check` (see the module
    docstring)."""
    etag = _etag(art.sha256)
    size = art.bytes  # BundleCatalog.check: the file on disk is this one
    headers = {"ETag": etag, "Accept-Ranges": "bytes", "Cache-Control": "private, max-age=0"}
    if _etag_matches(request.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers=headers)
    span = None
    if_range = request.headers.get("if-range")
    if if_range is None or if_range.strip() == etag:
        try:
            span = parse_range(request.headers.get("range"), size)
        except RangeNotSatisfiable:
            return Response(status_code=416, headers={**headers, "Content-Range": f"bytes */{size}"})
    start, end = span if span is not None else (0, size - 1)
    length = end - start + 1 if size else 0
    headers["Content-Length"] = str(length)
    status = 200
    if span is not None:
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    if request.method == "HEAD":
        return Response(status_code=status, headers=headers, media_type="application/octet-stream")
    return _Download(_stream(path, start, length), status_code=status, headers=headers,
                     media_type="application/octet-stream")


def install(app: FastAPI, catalog: BundleCatalog, auth) -> None:
    """Add the ``/v1/bundles`` routes over ``catalog`` to ``app``; ``auth`` is the app's ``/v1`` dependency."""

    def lookup(fn, *args):
        try:
            return fn(*args)
        except KeyError as e:
            raise HTTPException(404, detail=str(e.args[0])) from None

    @get_route(app, "/v1/bundles", dependencies=[auth])
    async def bundles():
        return {"object": "list", "data": catalog.listing()}

    @get_route(app, "/v1/bundles/{bundle_id}/manifest", dependencies=[auth])
    async def manifest(bundle_id: str, edge: str | None = None):
        v = lookup(catalog.variant, bundle_id, edge)
        return Response(v.manifest_bytes, media_type="application/json")

    @get_route(app, "/v1/bundles/{bundle_id}/files/{rel:path}", dependencies=[auth])
    async def file(request: Request, bundle_id: str, rel: str, edge: str | None = None):
        path, art = lookup(catalog.artifact, bundle_id, edge, rel)
        try:
            await catalog.check(path, art)
        except (Tampered, OSError) as e:  # OSError: removed or unreadable since the lookup
            log.error("%s: %s; not served", path, e)
            raise HTTPException(500, detail=f"{rel} on the server differs from its manifest; tell the operator") \
                from None
        return file_response(request, path, art)

    app.state.bundles = catalog

