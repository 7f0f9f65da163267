"""API keys: a keys file of hashes, one entry per key, each naming its tenant; constant-time checks.

The keys file (JSON, written by ``autoglm-cloud keys add``)::

    {"version": 1, "keys": [
      {"key_id": "k3f9a1c2", "tenant": "acme", "hash": "sha256:<hex of sha256(key)>", "max_sessions": 8},
      {"key_id": "k0c4e7d1", "tenant": "ops", "hash": "sha256:<hex>", "role": "operator"}
    ]}

* The fields are these and ``created`` (``keys add``'s timestamp, not read); an unknown field, one given twice and a
  hash two entries give are refused (:func:`parse_keys`), never read past.
* The file holds hashes only: a leaked file does not let anyone in. Keys are 32 random bytes (``agk_`` +
  base64url), so an unsalted SHA-256 is enough (there is no dictionary to try); ``hash`` names its algorithm
  so a slower one can be added later without a format change.
* A presented key is hashed and compared with *every* stored hash by ``hmac.compare_digest`` (no early exit),
  so the time taken says nothing about which bytes matched or which entry did.
* Keys come from the ``Authorization: Bearer <key>`` header only (an HTTP request's or the WebSocket
  handshake's), never from a query string: URLs end up in proxy and access logs.
* ``role`` (default ``tenant``): an ``operator`` key's sessions publish their prompt blocks into the shared
  prefix scope (``shared.prefix_keys.SHARED_SCOPE``) that every tenant's lookups fall back to - the one way
  in; no other key, and no client of an open server, can write there (docs/security.md, "Shared prefixes").
* Reloadable: the file is re-read when its mtime changes (checked at most once per :data:`STAT_EVERY_S` on the
  request path) and on SIGHUP (:func:`install_sighup`). A reload that fails to parse keeps the keys already
  loaded and logs why: a typo in an edit must not lock every tenant out. A file deleted (or unmounted) under the
  server likewise keeps the last keys, with one warning; it is read again once it is back.
* Revocable: a key removed from the file opens nothing from the reload on - no HTTP request, no WebSocket, and
  no new request on a split session it opened before (:func:`still_authorized`; the session ends with a fatal
  ``Error(unauthorized)``; a request already running finishes). A key whose entry now names another tenant or role
  (an operator key demoted) likewise starts no new request on a session it opened as the old one; a new session
  opens as the entry says now.

:class:`Authenticator` is what the app asks: ``authenticate(header) -> Principal | None`` (None: refuse with
401). Without a keys file or ``--api-key`` every client is let in; its tenant is then the digest of whatever
bearer token it sent (``shared.prefix_keys.tenant_of``), so clients still do not share prefix blocks by
accident. ``Principal.tenant`` is the namespace of the session's prefix cache and the ``tenant`` label of the
usage metrics (``cloud_server.usage``); ``Principal.prefix_scope`` is where its sessions publish prefix blocks.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
import signal
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from shared.json_keys import unique_keys
from shared.prefix_keys import SHARED_SCOPE, bearer_token, tenant_of

log = logging.getLogger("autoglm.cloud.auth")

KEY_PREFIX = "agk_"
STAT_EVERY_S = 1.0  # the request path looks at the file's mtime at most this often
_TENANT_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
ROLES = ("tenant", "operator")  # operator: publishes into the shared prefix scope
ENTRY_FIELDS = ("key_id", "tenant", "hash", "max_sessions", "role", "created")  # created: `keys add`'s note only


class KeysFileError(ValueError):
    """The keys file is missing, unreadable or malformed; the message names the file and the entry."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is from. ``tenant``: prefix-cache namespace and metrics label; ``key_id``: the key's public
    id (None: no key store, an open server); ``max_sessions``: this key's cap on open split sessions (None:
    only the server's); ``role``: :data:`ROLES`."""

    tenant: str
    key_id: str | None = None
    max_sessions: int | None = None
    metered: bool = False  # a key of the store: usage is recorded under its tenant (bounded label set)
    role: str = "tenant"

    @property
    def prefix_scope(self) -> str:
        """The namespace its sessions publish prefix blocks in: the shared scope for an operator, else its
        tenant's (lookups fall back from a tenant's scope to the shared one: ``cloud_server.engine.kv_cache``)."""
        return SHARED_SCOPE if self.role == "operator" else self.tenant

    def acts_as(self, other: Principal) -> bool:
        """Whether this principal reads and writes what ``other`` does: the same tenant (its prefix blocks, its usage
        label) and role (where it publishes). A session holds to the principal it opened with: a resume, and each new
        request, must present a key that still acts as it (:func:`still_authorized`); the key's id and cap may
        differ (another key of the tenant, a cap edited since)."""
        return self.tenant == other.tenant and self.role == other.role


@dataclass(frozen=True, slots=True)
class KeyEntry:
    key_id: str
    tenant: str
    digest: bytes  # sha256 of the key
    max_sessions: int | None
    role: str = "tenant"


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")


def parse_keys(text: str, source: str) -> list[KeyEntry]:
    """The entries of a keys file's text; raises :class:`KeysFileError` naming ``source`` and the entry. A field this
    does not know (a hand edit's ``"max_sesions": 8``: a cap that capped nothing), a field given twice in one object
    (``json`` kept the last) and a hash given by two entries (the key opened as whichever came last: its tenant,
    cap and role) are refused, not read past."""
    try:
        data = json.loads(text, object_pairs_hook=unique_keys)
    except ValueError as e:  # json.JSONDecodeError is one, and so is unique_keys' key given twice
        raise KeysFileError(f"{source}: not JSON ({e})") from None
    if (not isinstance(data, dict) or set(data) != {"version", "keys"} or type(data["version"]) is not int
            or data["version"] != 1 or not isinstance(data["keys"], list)):
        raise KeysFileError(f"{source}: expected {{\"version\": 1, \"keys\": [...]}} and nothing else")
    out: list[KeyEntry] = []
    seen: set[str] = set()
    hashes: dict[bytes, int] = {}
    for i, e in enumerate(data["keys"]):
        where = f"{source}: keys[{i}]"
        if not isinstance(e, dict):
            raise KeysFileError(f"{where}: expected an object")
        if unknown := sorted(set(e) - set(ENTRY_FIELDS)):
            raise KeysFileError(f"{where}: unknown field(s) {', '.join(unknown)} (an entry has "
                                f"{', '.join(ENTRY_FIELDS)})")
        key_id, tenant, digest, cap = e.get("key_id"), e.get("tenant"), e.get("hash"), e.get("max_sessions")
        role = e.get("role", "tenant")
        if not isinstance(key_id, str) or not key_id or key_id in seen:
            raise KeysFileError(f"{where}: key_id must be a unique non-empty string")
        if not isinstance(tenant, str) or not tenant or not set(tenant) <= _TENANT_CHARS or len(tenant) > 64:
            raise KeysFileError(f"{where}: tenant must be 1-64 characters of [A-Za-z0-9._-]")
        if not isinstance(digest, str) or not digest.startswith("sha256:") or len(digest) != 7 + 64:
            raise KeysFileError(f"{where}: hash must be 'sha256:<64 hex digits>'")
        try:
            raw = bytes.fromhex(digest[7:])
        except ValueError:
            raise KeysFileError(f"{where}: hash is not hex") from None
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise KeysFileError(f"{where}: max_sessions must be a positive integer or absent")
        if role not in ROLES:
            raise KeysFileError(f"{where}: role must be one of {', '.join(ROLES)} (got {role!r})")
        if raw in hashes:
            raise KeysFileError(f"{where}: hash is keys[{hashes[raw]}]'s too (one key, one entry: give each "
                                "tenant a key of its own)")
        hashes[raw] = i
        seen.add(key_id)
        out.append(KeyEntry(key_id, tenant, raw, cap, role))
    return out


class KeyStore:
    """The keys of one file, reloaded when it changes (see the module docstring). Thread-safe."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._entries: list[KeyEntry] = []
        self._mtime: float | None = None
        self._checked = 0.0
        self._gone = False  # the file could not be stat'ed at the last check (deleted, moved, its mount gone)
        self.reloads = 0  # successful loads after the first (tests, logs)
        self._load(strict=True)

    def _load(self, strict: bool) -> None:
        try:
            st = self.path.stat()
            entries = parse_keys(self.path.read_text(encoding="utf-8"), str(self.path))
        except (OSError, UnicodeDecodeError, KeysFileError) as e:  # not UTF-8: a 500 on the request that reloaded
            if strict:
                raise KeysFileError(str(e) if isinstance(e, KeysFileError) else f"{self.path}: {e}") from None
            log.error("keys file not reloaded, keeping %d keys: %s", len(self._entries), e)
            return
        with self._lock:
            first = self._mtime is None
            self._entries, self._mtime = entries, st.st_mtime
        if not first:
            self.reloads += 1
            log.info("keys file %s reloaded: %d keys", self.path, len(entries))

    def reload(self) -> None:
        """Re-read the file now (SIGHUP); a broken file keeps the current keys."""
        self._load(strict=False)

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < STAT_EVERY_S:
            return
        self._checked = now
        try:
            mtime = self.path.stat().st_mtime
        except OSError as e:
            if not self._gone:  # once per disappearance: it was silent, the operator thinking the keys were gone
                self._gone = True
                log.warning("keys file %s is gone (%s): still serving its last %d keys until it is back (revoke a "
                            "key by removing its entry)", self.path, e.strerror or e, len(self._entries))
            return
        if mtime != self._mtime or self._gone:  # back, maybe restored with its old mtime: read it again
            self._gone = False
            self._load(strict=False)

    def lookup(self, key: str) -> KeyEntry | None:
        """The entry whose hash matches ``key``, comparing against every entry in constant time each."""
        self._maybe_reload()
        digest = hashlib.sha256(key.encode()).digest()
        with self._lock:
            entries = self._entries
        found = None
        for e in entries:  # no early exit: the time does not depend on which entry matched
            if hmac.compare_digest(digest, e.digest):
                found = e
        return found

    def __len__(self) -> int:
        return len(self._entries)


class Authenticator:
    """``authenticate(Authorization header) -> Principal | None``: a keys file, a single ``--api-key``, or open."""

    def __init__(self, keys_file: str | Path | None = None, api_key: str | None = None):
        if keys_file is not None and api_key is not None:
            raise KeysFileError("give either a keys file or --api-key, not both")
        self.store = KeyStore(keys_file) if keys_file is not None else None
        self._api_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None

    @property
    def required(self) -> bool:
        return self.store is not None or self._api_digest is not None

    def authenticate(self, header: str | None) -> Principal | None:
        token = bearer_token(header)
        if self.store is not None:
            entry = self.store.lookup(token) if token is not None else None
            if entry is None:
                return None
            return Principal(f"tenant:{entry.tenant}", entry.key_id, entry.max_sessions, metered=True,
                             role=entry.role)
        if self._api_digest is not None:
            ok = token is not None and hmac.compare_digest(hashlib.sha256(token.encode()).digest(),
                                                           self._api_digest)
            return Principal(tenant_of(header), "api-key", metered=False) if ok else None
        return Principal(tenant_of(header))


def principal_of(ws) -> Principal:
    """The :class:`Principal` the app authenticated for this WebSocket (``ws.state.principal``); an endpoint
    served without the app's check (tests) gets the open server's: the digest of its bearer token."""
    p = getattr(ws.state, "principal", None)
    return p if isinstance(p, Principal) else Principal(tenant_of(ws.headers.get("authorization")))


def still_authorized(ws, principal: Principal) -> bool:
    """Whether the key this WebSocket presented at its upgrade still opens the server as ``principal``, its session's
    (:meth:`Principal.acts_as`). A key removed from the keys file since (revoked, rotated out) does not, nor one whose
    entry now names another tenant or role: a demoted operator key's open session went on publishing into the shared
    scope every tenant reads, a key moved to another tenant went on reading its old tenant's blocks. Such a session
    starts no new request. True for an endpoint served without the app's check (tests), which keeps no
    ``ws.state.authenticator``."""
    authn = getattr(ws.state, "authenticator", None)
    if authn is None:
        return True
    now = authn.authenticate(ws.headers.get("authorization"))
    return now is not None and now.acts_as(principal)


def hold_sighup() -> None:
    """SIGHUP noted, not acted on, until :func:`install_sighup` (call it from the main thread as the command starts).
    Its default action ended a server still starting - its checks, its bundle's hashes, its model's load: minutes for
    a large one - at once, with no word (status 129), e.g. a keys rotation's ``kill -HUP`` or ``systemctl reload``
    just after a restart; the keys file is read as the server starts (and again whenever it changes). A SIGHUP
    ignored (``nohup``) stays ignored."""
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        signal.signal(signal.SIGHUP, lambda *_: log.info("SIGHUP while the server starts: nothing to reload yet"))


def install_sighup(store: KeyStore | None) -> bool:
    """Reload ``store`` on SIGHUP (main thread only; returns whether the handler is installed). Without a keys file
    the signal is noted in the log: its default action ended the server at once, undrained (status 129; with
    front-end workers, each worker the main process passes it to)."""
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return False
    if store is None:
        signal.signal(signal.SIGHUP, lambda *_: log.info("SIGHUP: no keys file to reload (nothing else reloads)"))
    else:
        signal.signal(signal.SIGHUP, lambda *_: store.reload())
    return True


# -- `autoglm-cloud keys add` -------------------------------------------------------------------------
def add_key(path: str | Path, tenant: str, max_sessions: int | None = None,
            role: str = "tenant") -> tuple[str, str]:
    """Append a new key for ``tenant`` with ``role`` (:data:`ROLES`) to the keys file (created if absent, mode
    0600; through a symlink, the file it names); returns ``(key_id, key)``. The key itself is not stored: this is
    the only time it is seen."""
    # the new entry's own values, named as given (the file's check below named them "FILE: keys[<n>]", as if
    # the file were broken)
    if not isinstance(tenant, str) or not tenant or not set(tenant) <= _TENANT_CHARS or len(tenant) > 64:
        raise KeysFileError(f"tenant {tenant!r}: must be 1-64 characters of [A-Za-z0-9._-]")
    if max_sessions is not None and (type(max_sessions) is not int or max_sessions < 1):
        raise KeysFileError(f"max_sessions {max_sessions!r}: must be a positive integer")
    if role not in ROLES:
        raise KeysFileError(f"role {role!r}: must be one of {', '.join(ROLES)}")
    # the file a symlink names (a keys file kept on a shared volume, the link what --keys-file gives): os.replace
    # below replaced the link with a file of its own, so the file the server reads never got the printed key
    path = Path(os.path.realpath(path))
    if path.is_symlink():  # realpath stops at a loop
        raise KeysFileError(f"{path}: a symlink loop, no keys file")
    if not path.parent.is_dir():  # else the error named the lock file beside it, which the user never asked for
        raise KeysFileError(f"{path}: {path.parent} is not an existing folder (create it first)")
    with _one_writer(path):
        data = {"version": 1, "keys": []}
        if path.exists():
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:  # was a traceback
                raise KeysFileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            parse_keys(text, str(path))  # refuse to append to a broken file
            data = json.loads(text)
        key, key_id = new_key(), "k" + secrets.token_hex(4)
        entry = {"key_id": key_id, "tenant": tenant, "hash": hash_key(key),
                 "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if max_sessions is not None:
            entry["max_sessions"] = max_sessions
        if role != "tenant":
            entry["role"] = role
        data["keys"].append(entry)
        parse_keys(json.dumps(data), str(path))  # the new entry is valid (tenant name, cap)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        if path.exists():  # the file's mode and owner stay: a root:autoglm 0640 file became root:root 0600,
            st = path.stat()  # which the server (user autoglm) could no longer read
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
            with contextlib.suppress(PermissionError):  # only root (or the group's member) may give it back
                os.fchown(fd, st.st_uid, st.st_gid)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)  # atomic: a server reloading meanwhile sees the old or the new file, whole
    return key_id, key


@contextlib.contextmanager
def _one_writer(path: Path):
    """One ``add_key`` of a keys file at a time: two at once each wrote back the file as they had read it, so one
    key was printed but never stored (and the two shared one ``.tmp``). An advisory ``flock`` on ``.<name>.lock``
    beside the file; the kernel releases it if the holder dies."""
    fd = os.open(path.parent / f".{path.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def keys_main(argv: list[str] | None = None) -> int:
    """``autoglm-cloud keys add FILE --tenant NAME [--max-sessions N] [--role operator]``: prints the new key
    once."""
    ap = argparse.ArgumentParser(prog="autoglm-cloud keys", description="Manage the API keys file.")
    sub = ap.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="add a key for a tenant; prints the key once (the file keeps its hash)")
    add.add_argument("file", type=Path, help="keys file (created if absent)")
    add.add_argument("--tenant", required=True, help="tenant name ([A-Za-z0-9._-], 1-64 characters)")
    add.add_argument("--max-sessions", type=int, help="open split sessions this key may hold (default: "
                                                      "only the server's --max-sessions)")
    add.add_argument("--role", choices=ROLES, default="tenant",
                     help="operator: the key's sessions publish their prompt blocks for every tenant to reuse "
                          "(trusted system prompts; docs/security.md); default tenant")
    args = ap.parse_args(argv)
    try:
        key_id, key = add_key(args.file, args.tenant, args.max_sessions, args.role)
    except KeysFileError as e:
        print(f"autoglm-cloud keys: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # it named the lock or .tmp file beside the keys file, which the user never asked for
        print(f"autoglm-cloud keys: error: {args.file}: cannot write it there ({e.strerror or e})", file=sys.stderr)
        return 2
    print(key)
    print(f"added {args.role} key {key_id} for tenant {args.tenant} to {args.file}; the key is shown only now",
          file=sys.stderr)
    return 0
