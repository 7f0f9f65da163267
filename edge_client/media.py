"""A prompt with media: placeholder tokens expanded, encoder outputs placed, positions and content digests.

The chat template writes one placeholder token per image (``<|begin_of_image|><|image|><|end_of_image|>``)
or audio clip; the model needs one placeholder *per embedding row*. :func:`assemble` expands them, runs the
encoders, and returns what the front and the wire need:

* ``embeds [S, H]`` / ``mask [S]``: the encoder rows at their placeholder positions (the front's embeddings
  input, ``FrontRuntime.prefill_media``); text rows are unused;
* ``positions [3, S]`` and ``rope_delta``: GLM-4.1V's 3-D rope positions (``edge_client.mrope``); audio
  tokens count like text;
* ``spans``: ``(start, end, digest)`` per input, folded into the prefix-key chain of the blocks they overlap
  (``shared.prefix_keys.content_digests``): every image token has the same id, so without the digest two
  screenshots would share cached activations on the phone and in the cloud.

An item's rows are known before its encoder runs (its digest and row count come from preprocessing), so the
encoder runs are deferred to :meth:`MediaPrompt.encode`: the rows of an item that lies wholly inside the prefix
the activation cache covers are never needed (the front does not run there), so a chat's earlier screenshots
are not encoded again on every turn.

Only numpy: this module runs on the phone.
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shared.chat_tokens import Placeholder
from shared.prefix_keys import content_digests

from .audio import MAX_AUDIO_BYTES
from .mrope import ImageSpan, rope_index, text_positions
from .vision import MAX_IMAGE_BYTES, MediaError, is_pil_image


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One encoded input: its placeholder token, its embedding rows and its content digest."""

    kind: str  # "image" | "audio"
    token_id: int  # the placeholder token the template writes once and the model expects once per row
    embeds: np.ndarray | None  # float32 [n, H]; None: deferred (``encoder`` yields them, MediaPrompt.encode)
    digest: bytes  # 32 bytes: the content's identity (edge_client.vision.PreparedImage.digest, audio's)
    grid_thw: tuple[int, int, int] | None = None  # images: the patch grid (3-D rope positions)
    encoder: Callable[[], np.ndarray] | None = None  # a deferred item's encoder run
    n_rows: int = 0  # a deferred item's row count (from preprocessing: no encoder run needed)

    @property
    def rows(self) -> int:
        return self.embeds.shape[0] if self.embeds is not None else self.n_rows


@dataclass(slots=True)
class MediaPrompt:
    ids: list[int]  # placeholders expanded: one per embedding row
    embeds: np.ndarray  # float32 [S, H]; rows where ``mask`` is False are unused
    mask: np.ndarray  # bool [S]
    positions: np.ndarray  # int64 [3, S]
    rope_delta: int  # a later token's position = its index + rope_delta
    spans: list[tuple[int, int, bytes]] = field(default_factory=list)  # (start, end, digest) per item
    tokens_by_kind: dict[str, int] = field(default_factory=dict)  # usage: image / audio tokens
    items_by_kind: dict[str, int] = field(default_factory=dict)  # images / audio clips
    pending: list[tuple[int, MediaItem]] = field(default_factory=list)  # (start, item) of deferred items not run yet
    encode_s: float = 0.0  # seconds its encoders ran for this prompt (another request's runs beside it not counted)

    def encode(self, start: int = 0) -> float:
        """Run the deferred encoders of the items with rows at ``start`` or beyond and place their rows; the
        items wholly before ``start`` stay pending (the activation cache covers their positions: the front
        never reads their rows). Returns the seconds spent (added to :attr:`encode_s`)."""
        seconds, left = 0.0, []
        for a, it in self.pending:
            if a + it.rows <= start:
                left.append((a, it))
                continue
            t0 = time.perf_counter()
            rows = it.encoder()
            seconds += time.perf_counter() - t0
            _check_rows(it, rows, self.embeds.shape[1])
            self.embeds[a:a + it.rows] = rows
        self.pending = left
        self.encode_s += seconds
        return seconds

    def count(self, kind: str) -> int:
        return self.items_by_kind.get(kind, 0)

    @property
    def has_images(self) -> bool:
        return self.count("image") > 0

    def rope_positions(self, start: int, n: int) -> np.ndarray:
        """3-D rope positions int64 [3, n] of indices [start, start + n): the prompt's, then generated tokens'
        (index + rope delta)."""
        s = len(self.ids)
        head = self.positions[:, start:min(start + n, s)]
        tail = text_positions(max(start, s), max(0, start + n - max(start, s)), self.rope_delta)
        return np.concatenate([head, tail], axis=1)

    def content(self, block_tokens: int, n_tokens: int | None = None) -> list[bytes | None]:
        """Per full block of the first ``n_tokens`` (default: all) tokens, its content digest (None: text)."""
        return content_digests(len(self.ids) if n_tokens is None else n_tokens, block_tokens, self.spans)


def expand(ids: Sequence[int], items: Sequence[MediaItem],
           placeholders: Collection[int] = ()) -> tuple[list[int], list[MediaItem], list[int]]:
    """Replace each single placeholder by its item's rows (the k-th placeholder of a token by the k-th item
    of that token) -> (ids, items in prompt order, their starts). ``placeholders``: the placeholder tokens of the
    bundle's encoders; each one in ``ids`` needs an item too, whether or not any input of its kind was given."""
    queues: dict[int, list[MediaItem]] = {int(t): [] for t in placeholders}
    for it in items:
        queues.setdefault(it.token_id, []).append(it)
    out: list[int] = []
    ordered: list[MediaItem] = []
    starts: list[int] = []
    for t in ids:
        q = queues.get(int(t))
        if q is None:
            out.append(int(t))
            continue
        if not q:
            raise MediaError("the prompt has more media placeholders than media inputs", "bad_media")
        it = q.pop(0)
        ordered.append(it)
        starts.append(len(out))
        out += [int(t)] * it.rows
    left = sum(len(q) for q in queues.values())
    if left:
        raise MediaError(f"{left} media input(s) without a placeholder in the prompt", "bad_media")
    return out, ordered, starts


def _check_rows(it: MediaItem, rows: np.ndarray, hidden_size: int) -> None:
    if rows.shape != (it.rows, hidden_size):
        raise MediaError(f"{it.kind} embeddings {list(rows.shape)}: expected [{it.rows}, {hidden_size}]", "bad_media")


def assemble(ids: Sequence[int], items: Sequence[MediaItem], hidden_size: int, merge: int = 2,
             placeholders: Collection[int] = ()) -> MediaPrompt:
    """The prompt of ``ids`` (one placeholder per item) with ``items`` placed (see the module docstring);
    deferred items' rows are filled in by :meth:`MediaPrompt.encode`. ``placeholders``: as :func:`expand`'s."""
    full, items, starts = expand(ids, items, placeholders)
    s = len(full)
    embeds = np.zeros((s, hidden_size), np.float32)
    mask = np.zeros(s, np.bool_)
    spans, images, kinds, counts, pending = [], [], {}, {}, []
    for it, a in zip(items, starts):
        n = it.rows
        if it.embeds is None:
            pending.append((a, it))
        else:
            _check_rows(it, it.embeds, hidden_size)
            embeds[a:a + n] = it.embeds
        mask[a:a + n] = True
        spans.append((a, a + n, it.digest))
        kinds[it.kind] = kinds.get(it.kind, 0) + n
        counts[it.kind] = counts.get(it.kind, 0) + 1
        if it.grid_thw is not None:
            images.append(ImageSpan(a, it.grid_thw))
    positions, delta = rope_index(s, images, merge)
    return MediaPrompt(full, embeds, mask, positions, delta, spans, kinds, counts, pending)




# ------------------------------------------------------------------------------------------------
# where media come from (OpenAI content parts, raw bytes) and the encoders that turn them into rows


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """Limits on fetching media; one per endpoint."""

    max_bytes: int = MAX_IMAGE_BYTES  # an input larger than this is refused (downloads stop there)
    fetch_timeout_s: float = 10.0  # an http(s) image must arrive within this (the phone's link may be slow)
    allow_http: bool = True  # fetch http(s) image URLs on the phone
    local_dir: Path | None = None  # local paths are served only from inside this folder (None: refused)
    max_pixels: int | None = None  # the pixel budget (None: the model's default, smart_resize's max_pixels)


def load_source(src: bytes | str | os.PathLike, policy: MediaPolicy, kind: str = "image") -> bytes:
    """Raw bytes as given; a ``data:`` URL decoded; ``http(s)`` fetched within the policy's size and time
    limits (``kind``: the content type it must serve, ``image`` or ``audio``); a local path (a string, a
    ``pathlib.Path`` or ``file:``) only from inside ``policy.local_dir``. A string's leading and trailing spaces
    and control characters are not part of it (the URL standard strips them)."""
    if isinstance(src, str):
        src = src.strip(_C0_AND_SPACE)
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
    elif isinstance(src, os.PathLike):  # a pathlib.Path: a local path as its string is (it was 'not PosixPath')
        data = _local(os.fsdecode(src), policy, kind)
    elif not isinstance(src, str) or not src:
        what = "an image is bytes, a URL or path string, a path or a PIL image" if kind == "image" else \
            "an audio clip is bytes, a URL or path string or a path"
        raise MediaError(f"{what}, not {'an empty string' if isinstance(src, str) else type(src).__name__}",
                         "bad_media")
    elif (scheme := _scheme(src)) == "data":  # RFC 2397; the media type is not checked: the bytes tell
        head, _, payload = src.partition(",")
        if ";base64" not in head.lower():
            raise MediaError("data URL without base64 encoding", "bad_media")
        data = b64decode(urllib.parse.unquote(payload), "data URL",  # a URL: %2B, %2F, %3D are +, /, =
                         limit=(policy.max_bytes, kind))
    elif scheme in ("http", "https"):
        data = _fetch(src, policy, kind)
    elif scheme == "file":  # a URL: its path percent-encoded (file:///sdcard/My%20shot.png)
        data = _local(urllib.parse.unquote(_FILE_URL.sub("", src, count=1)), policy, kind)
    elif scheme is not None:
        raise MediaError(f"{src[:40]}: unsupported URL scheme (accepted: data:, http(s)://, file:// and paths)",
                         "bad_media")
    else:
        data = _local(src, policy, kind)
    if len(data) > policy.max_bytes:
        raise MediaError(f"{kind} of {len(data)} bytes exceeds the {policy.max_bytes}-byte limit", f"{kind}_too_large")
    return data


_C0_AND_SPACE = "".join(map(chr, range(0x21)))  # what the URL standard strips from both ends of a URL
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(//)?")
# what precedes a file: URL's path (RFC 8089): file:///p, file://localhost/p, and file:/p (Java's File.toURI())
_FILE_URL = re.compile(r"file:(//(localhost(?=/))?)?", re.IGNORECASE)


def _scheme(src: str) -> str | None:
    """The URL scheme of ``src``, lower case (schemes are case-insensitive): ``data`` for ``data:...``, ``file``
    for ``file:/...``, else one followed by ``//``; None for a path."""
    m = _URL_SCHEME.match(src)
    if m is None:
        return None
    scheme = m.group(1).lower()
    if m.group(2) is None and scheme != "data" and not (scheme == "file" and src[m.end():].startswith("/")):
        return None
    return scheme


_SPLIT_SPACE = b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"  # the ASCII characters str.split() drops
_COUNT_STEP = 1 << 20  # characters of base64 counted at a time


def _decoded_at_least(text: str) -> int:
    """The fewest bytes the ASCII ``text`` decodes to as base64: 3 per 4 characters but whitespace, less the (at
    most two) '=' of its padding; counted a slice at a time, never a copy of the whole text."""
    chars = sum(len(text[i:i + _COUNT_STEP].encode("ascii").translate(None, _SPLIT_SPACE))
                for i in range(0, len(text), _COUNT_STEP))
    return chars * 3 // 4 - 2


def b64decode(text: str, what: str, code: str = "bad_media", limit: tuple[int, str] | None = None) -> bytes:
    """Standard base64 (``what``: the field, for the error) as the URL standard's forgiving-base64 decode reads a
    data: URL's: ASCII whitespace ignored (line breaks of ``base64``'s output, a trailing newline), the ``=``
    padding optional (unpadded encoders); anything else outside the alphabet is refused. ``limit``: (bytes, kind):
    a text that holds more is ``{kind}_too_large`` before it is decoded or copied whole (an hour of WAV as 154 MB of
    base64 was decoded, 4.5 s and 131 MB, before its size was refused)."""
    try:
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("ascii")  # UnicodeDecodeError: a ValueError
        if not isinstance(text, str) or not text.isascii():
            raise ValueError
        if limit is not None and len(text) * 3 // 4 - 2 > limit[0] and (least := _decoded_at_least(text)) > limit[0]:
            raise MediaError(f"{what}: {limit[1]} of at least {least} bytes exceeds the {limit[0]}-byte limit",
                             f"{limit[1]}_too_large")
        text = "".join(text.split())
        if len(text) % 4 == 1:  # no base64 of any padding
            raise ValueError
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except MediaError:  # a ValueError: raised above, with its own code
        raise
    except (binascii.Error, ValueError):
        raise MediaError(f"{what}: invalid base64", code) from None


FETCH_CHUNK = 64 << 10  # bytes read per socket read while fetching
UNTYPED = ("application/octet-stream", "binary/octet-stream")  # bytes of no stated type (the second: S3's default)


class _Deadline:
    """One fetch's deadline over every connection it opens (each redirect opens one): each connects within the
    time left, and when the time is up every socket still open is shut down, which ends a read blocked on it
    at once. So a server that trickles its headers, a TLS handshake, or a chain of slow redirects is cut off
    at the deadline too, not only a slow body (name resolution, which nothing can interrupt, excepted)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.expired = False
        self._socks: list = []  # duplicates of the connections' sockets: they outlive a TLS wrap's detach()
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return self.end - time.monotonic()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for s in self._socks:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def create_connection(self, address, timeout=None, source_address=None):
        """``socket.create_connection`` within the time left (http.client's ``_create_connection``)."""
        left = self.left()
        if left <= 0:
            raise TimeoutError
        sock = socket.create_connection(address, left, source_address)
        with self._lock:
            self._socks.append(sock.dup())
            if self.expired:
                sock.close()
                raise TimeoutError
        return sock

    def connection(self, http_class):
        """``http_class`` (http.client's HTTP(S)Connection) opening its socket through this deadline."""
        guard = self

        class Guarded(http_class):
            def connect(self):
                self._create_connection = guard.create_connection
                super().connect()

        return Guarded

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            for s in self._socks:
                s.close()
            self._socks.clear()


def _opener(guard: _Deadline, shown: str):
    """urllib's opener with every connection under ``guard`` and redirects followed to http(s) URLs only
    (urllib's own would follow one to ftp://)."""
    import urllib.request

    class Guarded:
        def do_open(self, http_class, req, **kwargs):
            return super().do_open(guard.connection(http_class), req, **kwargs)

    class HTTP(Guarded, urllib.request.HTTPHandler):
        pass

    class HTTPS(Guarded, urllib.request.HTTPSHandler):
        pass

    class Redirects(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            if not newurl.lower().startswith(("http://", "https://")):
                fp.close()
                raise MediaError(f"{shown}: redirected to {newurl[:80]}: only http(s) URLs are fetched",
                                 "fetch_failed")
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    return urllib.request.build_opener(HTTP(), HTTPS(), Redirects())


def _fetch(url: str, policy: MediaPolicy, kind: str) -> bytes:
    """GET ``url`` within ``policy``: the whole fetch (connecting, redirects, headers, body) within
    ``fetch_timeout_s`` (:class:`_Deadline`; each socket read also times out by then), at most ``max_bytes``
    (a larger Content-Length is refused before the body), a content type of ``kind/*`` (or none /
    octet-stream). Each failure is a MediaError with its own code."""
    import http.client
    import urllib.error

    if not policy.allow_http:
        raise MediaError("fetching media URLs is disabled on this endpoint", "url_refused")
    shown = url[:80]
    guard = _Deadline(policy.fetch_timeout_s)
    try:
        with _opener(guard, shown).open(url, timeout=policy.fetch_timeout_s) as r:
            ctype = (r.headers.get_content_type() if r.headers.get("Content-Type") else "").lower()
            if ctype and not ctype.startswith(f"{kind}/") and ctype not in UNTYPED:
                raise MediaError(f"{shown}: serves {ctype}, not {'an image' if kind == 'image' else kind}",
                                 f"bad_{kind}")
            length = r.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > policy.max_bytes:
                raise MediaError(f"{shown}: {length} bytes exceeds the {policy.max_bytes}-byte limit",
                                 f"{kind}_too_large")
            buf = bytearray()
            while chunk := r.read1(min(FETCH_CHUNK, policy.max_bytes + 1 - len(buf))):  # one socket read each
                buf += chunk
                if len(buf) > policy.max_bytes:
                    raise MediaError(f"{shown}: larger than the {policy.max_bytes}-byte limit", f"{kind}_too_large")
                if guard.left() <= 0:
                    raise TimeoutError
            if guard.expired:  # the deadline shut the socket: what ended the headers or the body was not the server
                raise TimeoutError
    except MediaError:  # a ValueError: raised above, with its own code
        raise
    except (OSError, ValueError, http.client.HTTPException) as e:  # URLError and HTTPError are OSErrors
        if guard.expired or isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            raise MediaError(f"{shown}: not fetched within {policy.fetch_timeout_s:g} s", "fetch_timeout") from None
        if isinstance(e, urllib.error.HTTPError):
            raise MediaError(f"cannot fetch {shown}: HTTP {e.code} {e.reason}", "fetch_failed") from None
        raise MediaError(f"cannot fetch {shown}: {e.reason if isinstance(e, urllib.error.URLError) else e}",
                         "fetch_failed") from None
    finally:
        guard.close()
    return bytes(buf)


def _local(path: str, policy: MediaPolicy, kind: str) -> bytes:
    if policy.local_dir is None:
        raise MediaError("local file paths are not accepted here (no allow-listed media folder: MediaPolicy.local_dir, "
                         "autoglm-edge serve --media-dir)", "path_refused")
    shown = path[:200]
    try:  # a NUL byte (ValueError) or a name too long for the file system (OSError) is no file of the folder
        root = Path(policy.local_dir).resolve()
        p = (root / path).resolve() if not Path(path).is_absolute() else Path(path).resolve()
        if not p.is_relative_to(root):
            raise MediaError(f"{shown}: outside the allow-listed media folder", "path_refused")
        if not p.is_file():
            raise MediaError(f"{shown}: no such file in the media folder", "bad_media")
        if p.stat().st_size > policy.max_bytes:
            raise MediaError(f"{shown}: larger than the {policy.max_bytes}-byte limit", f"{kind}_too_large")
        return p.read_bytes()
    except MediaError:  # a ValueError: raised above, with its own code
        raise
    except (OSError, ValueError) as e:
        raise MediaError(f"{shown}: not a readable file of the media folder ({type(e).__name__})", "bad_media") \
            from None


@dataclass(frozen=True, slots=True)
class MediaPart:
    """One media input of a request, in prompt order."""

    kind: str  # "image" | "audio"
    source: object  # raw bytes or a URL / path (load_source); an image may be a PIL image (vision.open_image)


def extract_parts(messages: list[dict],
                  placeholder: Callable[[str], Placeholder]) -> tuple[list[dict], list[MediaPart]]:
    """OpenAI chat messages -> (messages with text content, the media parts in order). An ``image_url``
    part (``{"url": ...}``), an ``image`` part (raw bytes, the Python API) or an ``input_audio`` part
    (``{"data": base64 WAV, "format": "wav"}``) becomes ``placeholder(kind)`` (a ``shared.chat_tokens.Placeholder``:
    its special tokens stay tokens) between the text parts, which are joined: the content is a list of pieces, the
    text and the placeholders (``EdgeTokenizer.render_chat`` joins them, the text's special tokens' strings marked
    as text)."""
    out, parts = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        text: list[str] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":  # joined with the text before it: a special token's string split over two parts
                piece = str(part.get("text", ""))  # is one string, marked as text
                if text and not isinstance(text[-1], Placeholder):
                    text[-1] += piece
                else:
                    text.append(piece)
                continue
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                parts.append(MediaPart("image", url))
            elif kind == "image":
                parts.append(MediaPart("image", part.get("image")))
            elif kind == "input_audio":
                a = part.get("input_audio") or {}
                if not isinstance(a, dict):
                    raise MediaError(f"messages[{i}].content[{j}].input_audio: expected an object with 'data' and "
                                     "'format'", "bad_audio")
                if str(a.get("format") or "wav").lower() != "wav":  # absent: wav; any case, as the data: scheme
                    raise MediaError(f"messages[{i}].content[{j}]: audio format {a.get('format')!r} (accepted: wav)",
                                     "unsupported_format")
                parts.append(MediaPart("audio", b64decode(a.get("data") or "",
                                                          f"messages[{i}].content[{j}].input_audio.data", "bad_audio",
                                                          (MAX_AUDIO_BYTES, "audio"))))
            else:
                raise MediaError(f"messages[{i}].content[{j}]: part type {kind!r} is not supported", "bad_media")
            text.append(placeholder(parts[-1].kind))
        out.append({**m, "content": text})
    return out, parts


class MediaEncoders:
    """A bundle's encoders, each opened on first use: a text-only app never loads them. ``bundle_dir`` is taken as
    a path then (``EdgeClient`` passes its ``bundle_sync.HeldVersion``: the version its front runs on)."""

    def __init__(self, bundle_dir: str | os.PathLike, threads: int = 2):
        self.bundle_dir = bundle_dir
        self.threads = threads
        self._vision = None
        self._audio = None
        self._placeholders: frozenset[int] | None = None
        self._opening = threading.Lock()  # requests side by side (serve) open each encoder once: one graph in memory
        self.turn = threading.Lock()  # held by a request while its media are decoded and encoded (items, encode)

    @property
    def vision(self):
        with self._opening:
            if self._vision is None:
                from .vision import VisionEncoder

                self._vision = VisionEncoder(self.bundle_dir, self.threads)
        return self._vision

    @property
    def audio(self):
        with self._opening:
            if self._audio is None:
                from .audio import AudioEncoder

                self._audio = AudioEncoder(self.bundle_dir, self.threads)
        return self._audio

    def placeholder_ids(self, kind: str) -> list[int]:
        """The token ids the template writes for one input of ``kind`` (image: begin, image, end)."""
        if kind == "image":
            sp = self.vision.spec
            return [sp.image_start_token_id, sp.image_token_id, sp.image_end_token_id]
        return [self.audio.spec.audio_token_id]

    def placeholders(self) -> frozenset[int]:
        """The token each of the bundle's encoders expands into its rows (image, audio; none for a text bundle): in
        a prompt, each needs an input of its kind (:func:`expand`)."""
        if self._placeholders is None:
            found = set()
            for kind in ("image", "audio"):
                try:
                    found.add(self.vision.spec.image_token_id if kind == "image" else self.audio.spec.audio_token_id)
                except MediaError:  # no such encoder: its token is text
                    pass
            self._placeholders = frozenset(found)
        return self._placeholders

    def warmup(self, kinds: Sequence[str] = ("image", "audio")) -> dict[str, float]:
        """Load and run each available encoder of ``kinds`` once; kind -> seconds (absent: none in the bundle)."""
        out = {}
        for kind in kinds:
            try:
                enc = self.vision if kind == "image" else self.audio
            except MediaError:
                continue
            out[kind] = enc.warmup()
        return out

    def check(self, parts: Sequence[MediaPart], policy: MediaPolicy,
              room: tuple[int, str] | None = None) -> list[tuple[str, object]]:
        """Load (read, fetch) and check every part (MediaError on the first bad one): (kind, source) per part for
        :meth:`items`, nothing decoded yet.

        ``room``: how many positions the prompt may grow by when each part's one placeholder becomes its rows,
        and whose limit that is (None: no bound). Every part is loaded and checked, and its rows counted (from its header: an image's size, a clip's frames),
        before any is decoded in full or encoded: parts whose rows do not fit are refused (``context_full``)
        without running an encoder, so a small file declaring a huge image, or a message of many images, costs
        no tower run (a 38 KB 6300 x 6300 PNG used to take 36 s and 14 GB here before the cloud refused it)."""
        checked, grow = [], 0
        for i, p in enumerate(parts):
            data = p.source if p.kind == "image" and is_pil_image(p.source) else load_source(p.source, policy, p.kind)
            if p.kind == "image":
                src, n = self.vision.check(data, policy.max_pixels, policy.max_bytes)
            elif p.kind == "audio":
                src, n = self.audio.check(data)
            else:
                raise MediaError(f"media kind {p.kind!r}: expected image or audio", "bad_media")
            grow += n - 1
            if room is not None and grow > room[0]:
                raise MediaError(f"{p.kind} {i + 1} of {len(parts)} ({n} tokens) does not fit: the media so far "
                                 f"take {grow} positions beyond their placeholders, {max(room[0], 0)} are left "
                                 f"({room[1]})", "context_full")
            checked.append((p.kind, src))
        return checked

    def items(self, checked: Sequence[tuple[str, object]], policy: MediaPolicy) -> list[MediaItem]:
        """:meth:`check`'s parts decoded and preprocessed; the encoder runs are deferred (:meth:`MediaPrompt.encode`).
        A caller preparing several requests' media at once decodes and encodes them one request at a time
        (:attr:`turn`): a 40 MP photo peaks near 0.5 GB, and the phone's cores are the encoders' anyway."""
        items = []
        for kind, src in checked:
            if kind == "image":
                enc = self.vision
                img = enc.prepared(src, policy.max_pixels)
                items.append(MediaItem("image", enc.spec.image_token_id, None, img.digest, img.grid_thw,
                                       functools.partial(enc.encode, img), img.n_tokens))
            else:
                enc = self.audio
                clip = enc.prepared(src)
                items.append(MediaItem("audio", enc.spec.audio_token_id, None, clip.digest, None,
                                       functools.partial(enc.encode, clip), clip.n_tokens))
        return items

    @property
    def merge_size(self) -> int:
        return self.vision.spec.merge_size if self._vision is not None else 2
