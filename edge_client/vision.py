"""The phone's image path for GLM-4.1V: decode, preprocess exactly as the model's processor, run the tower.

Preprocessing mirrors transformers' ``Glm4vImageProcessor`` (PIL backend) step by step:

1. decode (PIL), upright by the EXIF orientation tag (as transformers' ``load_image``), transparency
   composited onto white, RGB; a PNG's text chunks that cannot turn it, or that PIL would refuse, are dropped
   before PIL reads it (:func:`png_for_pil`); a JPEG of more scans or segments than an app writes is refused
   before it is decoded (:func:`check_jpeg`);
2. ``smart_resize``: height and width rounded to multiples of ``patch x merge`` (28), scaled so that
   ``temporal_patch x h x w`` stays within ``[min_pixels, max_pixels]``, then a bicubic resize;
3. rescale by 1/255, normalise with the CLIP mean/std;
4. patchify: ``[C, H, W]`` -> ``[N, C*T*P*P]`` patches in merge-block-major order (the 2x2 patches that
   become one visual token are adjacent), the single frame repeated ``T = 2`` times (temporal patch).

Steps 3 and 4 run in the other order here, with the same floats: the 8-bit levels are patchified, then each
channel's levels go through a 256-entry table of the processor's arithmetic (``normalize_table``).

The tower's data-dependent inputs (``partition_tools.export_vision``'s interface) are computed here too:
per-patch axial 2-D rotary angles and the bicubic sampling grid of the learned position table.

:class:`VisionEncoder` opens ``edge/vision.onnx`` on first use (a text-only app never pays its memory),
``warmup()`` loads and runs it once on request. Bad input raises :class:`MediaError` (a 4xx for the HTTP
endpoint, an ``EdgeClientError`` for the Python API); nothing here can take the process down.

Only numpy, PIL and onnxruntime: this module runs on the phone.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import struct
import sys
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .encoder_session import LazyEncoder, LazySession

VISION = "edge/vision.onnx"
VISION_CONFIG = "edge/vision.json"
VISION_INPUTS = ("pixel_values", "rope_cos", "rope_sin", "pos_grid")
# decoded by PIL on every platform we ship; MPO is a JPEG with more pictures after the first (PIL names a phone's
# JPEG so when its camera stores a depth map or preview there): the first is the photo
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "BMP", "GIF")
MAX_IMAGE_BYTES = 20 << 20  # an encoded image larger than this is refused before decoding
MAX_INPUT_PIXELS = 40_000_000  # decoded width x height above this is refused (decompression bombs)
ORIENTATION_TAG = 0x0112  # EXIF Orientation: 1 upright, 2-8 mirrored and/or rotated
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PNG_TEXT = (b"tEXt", b"zTXt", b"iTXt")  # a PNG's text chunks: metadata, no pixels
# the text keywords PIL's getexif reads an orientation from (ImageMagick's EXIF profile, an XMP packet's
# tiff:Orientation); every other text chunk is unused here
ORIENTATION_TEXT = (b"Raw profile type exif", b"XML:com.adobe.xmp")
MAX_PNG_CHUNKS = 1 << 16  # chunks in a PNG (a writer makes a few, plus its image data's: 2560 of 8 KB in 20 MB)
# A progressive JPEG's decoder runs over every block of the image once per scan: a writer makes ~10 (libjpeg's
# progressive script, mozjpeg's), but a scan can be a dozen bytes - 10,000 copies of one in 130 KB made a 1200 x 1200
# image take 10 s of the phone's CPU (each scan 1 ms there, 30 ms at 40 MP)
MAX_JPEG_SCANS = 64
MAX_JPEG_SEGMENTS = 4096  # markers with a length (metadata spread over 64 KB APPn segments: 320 in 20 MB)
# the marker after a scan's entropy-coded data: 0xFF but for a stuffed 0xFF00, a restart (RST0-7) or fill (0xFFFF)
_JPEG_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


class MediaError(ValueError):
    """An image or audio input the edge refuses; ``code`` is a stable machine-readable reason."""

    def __init__(self, message: str, code: str = "bad_media"):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """``edge/vision.json`` (written by ``partition_tools.export_vision``)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    in_channels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    min_pixels: int
    max_pixels: int  # the model's default pixel budget (smart_resize's max_pixels)
    head_dim: int
    rope_theta: float
    pos_table_side: int
    out_hidden_size: int
    image_token_id: int
    image_start_token_id: int
    image_end_token_id: int
    quant: str
    quant_report: dict = field(default_factory=dict)

    @classmethod
    def load(cls, bundle_dir: str | Path) -> VisionSpec:
        path = Path(bundle_dir) / VISION_CONFIG
        if not path.is_file():
            raise MediaError("this bundle has no vision encoder (not a GLM-4.1V split)", "no_encoder")
        raw = json.loads(path.read_text())
        raw["image_mean"], raw["image_std"] = tuple(raw["image_mean"]), tuple(raw["image_std"])
        return cls(**raw)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True, slots=True)
class PreparedImage:
    """One image ready for the tower: what the model's processor returns, plus a content digest."""

    pixel_values: np.ndarray  # float32 [N, C*T*P*P], N = grid_h * grid_w
    grid_thw: tuple[int, int, int]  # (1, grid_h, grid_w) in patches
    digest: bytes  # sha256 of the resized pixels and the grid: the image's identity in every cache
    source_size: tuple[int, int]  # decoded (height, width)
    merge_size: int

    @property
    def n_tokens(self) -> int:
        """Visual tokens in the prompt: patches / merge^2."""
        return self.pixel_values.shape[0] // self.merge_size ** 2


# ------------------------------------------------------------------------------------------------
# the processor's steps


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 112 * 112,
                 max_pixels: int = 28 * 28 * 15000, temporal_factor: int = 2) -> tuple[int, int]:
    """transformers' ``glm4v.smart_resize`` for one image (``num_frames = temporal_factor``), exactly."""
    num_frames = temporal_factor
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise MediaError(f"image aspect ratio {max(height, width) / min(height, width):.0f}:1 exceeds 200:1",
                         "bad_image")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@contextmanager
def _pil_errors(max_pixels: int):
    """PIL's failures on untrusted bytes as MediaErrors (a MediaError raised inside passes unchanged)."""
    from PIL import Image, UnidentifiedImageError

    try:
        yield
    except MediaError:
        raise
    except UnidentifiedImageError:
        raise MediaError("not a recognised image (corrupt, or an unsupported format)", "bad_image") from None
    except Image.DecompressionBombError as e:  # PIL's own guard fires in open() for a header over ~179 M pixels
        raise MediaError(f"image exceeds the {max_pixels}-pixel limit ({str(e).split(',')[0]})",
                         "image_too_large") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise MediaError(f"cannot decode the image: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                         "bad_image") from None


def is_pil_image(x) -> bool:
    """Whether ``x`` is a PIL image (an app's own, e.g. a screenshot it captured), without importing PIL."""
    pil = sys.modules.get("PIL.Image")
    return pil is not None and isinstance(x, pil.Image)


HEIF_BRANDS = {b"heic": "HEIC", b"heix": "HEIC", b"hevc": "HEIC", b"hevx": "HEIC", b"heim": "HEIC", b"heis": "HEIC",
               b"mif1": "HEIF", b"msf1": "HEIF", b"avif": "AVIF", b"avis": "AVIF"}  # an ISO-BMFF ftyp's major brand


def _format_pil_cannot_open(data: bytes) -> str | None:
    """The name of an image format PIL does not open here but a phone or a web page sends (HEIC/HEIF, what a camera
    may save; AVIF where PIL lacks it; SVG, JPEG XL), from the first bytes; None for any other bytes."""
    head = bytes(data[:256])
    if head[4:8] == b"ftyp" and head[8:12] in HEIF_BRANDS:
        return HEIF_BRANDS[head[8:12]]
    if head.startswith((b"\xff\x0a", b"\x00\x00\x00\x0cJXL ")):
        return "JPEG XL"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if text.startswith(b"<svg") or text.startswith(b"<?xml") and b"<svg" in bytes(data[:4096]).lower():
        return "SVG"
    return None


def _text_size(cid: bytes, body: bytes, budget: int) -> int | None:
    """The bytes of a PNG text chunk's text (``body``: the chunk's data) as PIL reads it, at most ``budget``; None if
    it holds more, or its compressed text is broken. Decompresses at most ``budget`` bytes, as PIL's
    ``_safe_zlib_decompress`` does MAX_TEXT_CHUNK."""
    rest = body.partition(b"\0")[2]  # after the keyword
    if cid == b"tEXt":
        text, compressed = rest, False
    elif cid == b"zTXt":
        text, compressed = rest[1:], True  # a method byte, then zlib
    else:  # iTXt: compression flag, method, language \0 translated keyword \0 text
        fields = rest[2:].split(b"\0", 2)
        if len(fields) < 3:
            return None
        text, compressed = fields[2], rest[:1] != b"\0"
    if compressed:
        z = zlib.decompressobj()
        try:
            text = z.decompress(text, budget)
        except zlib.error:
            return None
        if z.unconsumed_tail:
            return None
    return len(text) if len(text) <= budget else None


def check_jpeg(data: bytes) -> None:
    """Refuse (``bad_image``) a JPEG whose first image (an MPO's first frame: the one decoded) has more than
    MAX_JPEG_SCANS scans or MAX_JPEG_SEGMENTS segments, from its markers alone: each scan costs a pass over the whole
    image however few bytes it takes, and PIL reads the segments before the first scan in a Python loop. The walk
    stops at those bounds, the image's end, or where the file breaks (PIL then says how)."""
    scans = segments = 0
    pos = 2  # after SOI
    while (m := _JPEG_MARKER.search(data, pos)) is not None and m.start() + 4 <= len(data):
        marker, pos = data[m.start() + 1], m.start() + 2
        if marker == 0xD9:  # EOI
            return
        if marker == 0x01:  # TEM: no length
            continue
        segments, scans = segments + 1, scans + (marker == 0xDA)
        if scans > MAX_JPEG_SCANS or segments > MAX_JPEG_SEGMENTS:
            what = f"{MAX_JPEG_SCANS} scans" if scans > MAX_JPEG_SCANS else f"{MAX_JPEG_SEGMENTS} segments"
            raise MediaError(f"not a JPEG an app writes (over {what})", "bad_image")
        pos += int.from_bytes(data[pos:pos + 2], "big")  # a scan's entropy-coded data: the next search skips it


def png_for_pil(data: bytes) -> bytes:
    """A PNG's bytes as PIL should read them: its text chunks (tEXt, zTXt, iTXt: metadata, no pixels) dropped but for
    those PIL turns the image by (``ORIENTATION_TEXT``) that it can read within its own limits (``PngImagePlugin``'s
    MAX_TEXT_CHUNK decompressed a chunk, MAX_TEXT_MEMORY in all): PIL refused the whole image for text over them
    ('Decompressed data too large', 'Too much memory used in text chunks'), so a screenshot with a large XMP packet
    was bad_image. At most MAX_TEXT_MEMORY of text is decompressed here. A PNG of over MAX_PNG_CHUNKS chunks is
    refused (PIL reads each in a Python loop: 1.4 M tiny text chunks in 20 MB took 3 s). Other bytes, and a PNG with
    nothing to drop, are returned as they are."""
    if not data.startswith(PNG_MAGIC):
        return data
    from PIL import PngImagePlugin

    left = PngImagePlugin.MAX_TEXT_MEMORY  # text PIL may still hold, and the most this may still decompress
    kept, start, pos, chunks = [], 0, len(PNG_MAGIC), 0  # the bytes kept are kept + data[start:]
    while pos + 8 <= len(data) and data[pos + 4:pos + 8] != b"IEND":
        if (chunks := chunks + 1) > MAX_PNG_CHUNKS:
            raise MediaError(f"not a PNG an app writes (over {MAX_PNG_CHUNKS} chunks)", "bad_image")
        cid, end = data[pos + 4:pos + 8], pos + 12 + int.from_bytes(data[pos:pos + 4], "big")
        if end > len(data):  # cut short: PIL says how
            break
        if cid in PNG_TEXT:
            body, size = data[pos + 8:end - 4], None
            if left > 0 and body.partition(b"\0")[0] in ORIENTATION_TEXT:
                budget = min(PngImagePlugin.MAX_TEXT_CHUNK, left)
                size = _text_size(cid, body, budget)
                left -= budget if size is None else size
            if size is None:
                kept.append(data[start:pos])
                start = end
        pos = end
    return data if start == 0 else b"".join(kept) + data[start:]


def open_image(data, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_INPUT_PIXELS):
    """Encoded bytes -> a PIL image whose header alone is read: format and size checked, nothing decoded yet
    (:func:`load_image` decodes it). Its size tells the visual tokens before any pixel is decoded. A PIL image
    the app already holds is taken as it is (whatever format PIL read it from), its size checked."""
    from PIL import Image

    if is_pil_image(data):
        img = data
    elif not data:
        raise MediaError("empty image (0 bytes)", "bad_image")
    elif len(data) > max_bytes:
        raise MediaError(f"image of {len(data)} bytes exceeds the {max_bytes}-byte limit", "image_too_large")
    elif (known := _format_pil_cannot_open(data)) is not None:  # was bad_image 'corrupt, or an unsupported format'
        raise MediaError(f"unsupported image format {known!r} (accepted: {', '.join(IMAGE_FORMATS)})",
                         "unsupported_format")
    else:
        with _pil_errors(max_pixels):
            img = Image.open(io.BytesIO(png_for_pil(data)))
            if img.format not in IMAGE_FORMATS:
                raise MediaError(f"unsupported image format {img.format!r} (accepted: {', '.join(IMAGE_FORMATS)})",
                                 "unsupported_format")
            if img.format in ("JPEG", "MPO"):
                check_jpeg(data)
    w, h = img.size
    if w * h == 0:
        raise MediaError(f"zero-size image ({w}x{h})", "bad_image")
    if w * h > max_pixels:
        raise MediaError(f"image of {w}x{h} pixels exceeds the {max_pixels}-pixel limit", "image_too_large")
    return img


def _sixteen_bit(img) -> bool:
    """Whether a PIL image holds 16-bit grayscale samples: the 'I;16' modes, or 'I' read from a PNG (as an older Pillow
    opens a 16-bit PNG). Any other 'I' image (32-bit integers: an app's ``convert("I")`` of an 8-bit image,
    an int32 array) has no bit depth to scale from; PIL's conversion, as the model's processor, reads its values
    as 8-bit levels (clipped to 0..255)."""
    return img.mode.startswith("I;16") or img.mode == "I" and img.format == "PNG"


def load_image(img, max_pixels: int = MAX_INPUT_PIXELS):
    """An :func:`open_image` result -> a decoded PIL RGB image: turned upright by its EXIF orientation (a phone
    photo's tag, as every viewer and transformers' ``load_image`` apply it), transparency on white (as the
    processor's ``convert_to_rgb``)."""
    from PIL import Image

    with _pil_errors(max_pixels):
        img.load()  # decode now: truncated or corrupt data fails here, not later
    sixteen_bit = _sixteen_bit(img)  # before the turn: a transposed image has no format
    try:
        orientation = img.getexif().get(ORIENTATION_TAG, 1)
    except (OSError, ValueError, SyntaxError, KeyError, TypeError, struct.error):  # unreadable metadata: as stored
        orientation = 1
    if isinstance(orientation, int) and orientation in range(2, 9):  # ImageOps.exif_transpose's turn, without its
        # rewrite of the metadata, which raised (struct.error, TypeError) on a tag PIL reads but cannot write back
        t = Image.Transpose
        img = img.transpose({2: t.FLIP_LEFT_RIGHT, 3: t.ROTATE_180, 4: t.FLIP_TOP_BOTTOM, 5: t.TRANSPOSE,
                             6: t.ROTATE_270, 7: t.TRANSVERSE, 8: t.ROTATE_90}[orientation])
    with _pil_errors(max_pixels):  # a mode PIL cannot convert (an app's own image): bad_image, not a ValueError
        if sixteen_bit:  # 16-bit grayscale: to 8 bits (the top byte), not clipped to white
            levels = np.asarray(img, np.int64)
            key = img.info.get("transparency")  # a PNG's tRNS: the 16-bit level that is transparent
            img = Image.fromarray((np.clip(levels, 0, 65535) >> 8).astype(np.uint8))  # mode L, no info
            if isinstance(key, int):  # kept as alpha: on white below, as every other transparent image
                img.putalpha(Image.fromarray(np.where(levels == key, 0, 255).astype(np.uint8)))
        if img.mode in ("La", "RGBa"):  # premultiplied alpha ("La" converts to nothing else): straight alpha first
            img = img.convert(img.mode.upper())
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            rgba = img.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, rgba).convert("RGB")
        return img.convert("RGB")


def decode_image(data: bytes, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_INPUT_PIXELS):
    """Encoded bytes -> a PIL RGB image (:func:`open_image`, then :func:`load_image`)."""
    return load_image(open_image(data, max_bytes, max_pixels), max_pixels)


def patchify(image: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """[C, H, W] -> [grid_h * grid_w, C*T*P*P] in merge-block-major order (the processor's layout), same dtype."""
    c, h, w = image.shape
    gh, gw = h // patch, w // patch
    x = image.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, *x.shape[5:]))  # T copies of the frame
    return np.ascontiguousarray(x.reshape(gh * gw, c * temporal * patch * patch))


def normalize_table(spec: VisionSpec) -> np.ndarray:
    """float32 [C, 256]: each channel's normalized value of each 8-bit level, by the processor's arithmetic
    (rescale in float64, then float32 ``(x - mean) / std``): a pixel's value depends only on its level and
    channel, so a lookup gives the same floats with no full-size float64 / float32 intermediates."""
    levels = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)  # [256]
    mean = np.asarray(spec.image_mean, np.float32)[:, None]  # [C, 1]
    std = np.asarray(spec.image_std, np.float32)[:, None]
    return (levels[None, :] - mean) / std


def preprocess(img, spec: VisionSpec, max_pixels: int | None = None) -> PreparedImage:
    """A PIL RGB image -> :class:`PreparedImage` at pixel budget ``max_pixels`` (default: the model's)."""
    from PIL import Image

    budget = spec.max_pixels if max_pixels is None else int(max_pixels)
    if budget < spec.min_pixels:
        raise MediaError(f"pixel budget {budget} is below the model's minimum {spec.min_pixels}", "bad_budget")
    w, h = img.size
    rh, rw = smart_resize(h, w, spec.factor, spec.min_pixels, budget, spec.temporal_patch_size)
    resized = np.asarray(img.resize((rw, rh), resample=Image.Resampling.BICUBIC), dtype=np.uint8)  # [H, W, 3]
    digest = hashlib.sha256(b"image/v1" + np.array([rh, rw], np.int64).tobytes() + resized.tobytes()).digest()
    # patches of the 8-bit levels, then each channel's block of C*T*P*P through its lookup table: the tower's
    # float32 input is the only full-size float array (a 40 MP upload peaked at ~800 MB with float64 math)
    levels = patchify(resized.transpose(2, 0, 1), spec.patch_size, spec.merge_size, spec.temporal_patch_size)
    table = normalize_table(spec)  # [C, 256]
    channel = np.repeat(np.arange(table.shape[0]), levels.shape[1] // table.shape[0])[None, :]  # [1, C*T*P*P]
    pixels = np.empty(levels.shape, np.float32)  # [N, C*T*P*P]
    for i in range(0, len(levels), 1024):  # the lookup's temporaries stay a few MB
        pixels[i:i + 1024] = table[channel, levels[i:i + 1024]]
    return PreparedImage(pixels, (1, rh // spec.patch_size, rw // spec.patch_size), digest, (h, w),
                         spec.merge_size)


def visual_tokens(height: int, width: int, spec: VisionSpec, max_pixels: int | None = None) -> int:
    """Visual tokens of an image of ``height x width`` at a pixel budget, without decoding it."""
    rh, rw = smart_resize(height, width, spec.factor, spec.min_pixels,
                          spec.max_pixels if max_pixels is None else max_pixels, spec.temporal_patch_size)
    return (rh // spec.factor) * (rw // spec.factor)


# ------------------------------------------------------------------------------------------------
# the tower's data-dependent inputs


def patch_positions(grid_h: int, grid_w: int, merge: int) -> np.ndarray:
    """(h, w) of each patch in merge-block-major order: int64 [N, 2] (transformers' get_vision_position_ids)."""
    hpos, wpos = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    shape = (grid_h // merge, merge, grid_w // merge, merge)
    hpos = hpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    wpos = wpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.stack([hpos, wpos], axis=-1)


def vision_rotary(grid_h: int, grid_w: int, merge: int, head_dim: int, theta: float):
    """The tower's axial rope: cos/sin float32 [N, head_dim] (h angles, w angles, then both again)."""
    spatial = head_dim // 2
    inv_freq = (1.0 / (theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial))).astype(np.float32)
    pos = patch_positions(grid_h, grid_w, merge).astype(np.float32)  # [N, 2]
    freqs = pos[:, :, None] * inv_freq  # [N, 2, Dh/4]
    hw = freqs.reshape(freqs.shape[0], -1)  # [N, Dh/2]: h frequencies then w frequencies
    full = np.concatenate([hw, hw], axis=-1)  # [N, Dh]
    return np.cos(full).astype(np.float32), np.sin(full).astype(np.float32)


def position_grid(grid_h: int, grid_w: int, merge: int) -> np.ndarray:
    """Sampling grid of the learned position table: float32 [1, N, 1, 2], (w, h) patch centres in [-1, 1]."""
    pos = patch_positions(grid_h, grid_w, merge).astype(np.float32)
    norm_h = ((pos[:, 0] + 0.5) / np.float32(grid_h)) * 2 - 1
    norm_w = ((pos[:, 1] + 0.5) / np.float32(grid_w)) * 2 - 1
    return np.stack([norm_w, norm_h], axis=-1)[None, :, None, :].astype(np.float32)


def tower_feeds(image: PreparedImage, spec: VisionSpec) -> dict[str, np.ndarray]:
    """The vision graph's four inputs for one prepared image."""
    _, gh, gw = image.grid_thw
    cos, sin = vision_rotary(gh, gw, spec.merge_size, spec.head_dim, spec.rope_theta)
    return {"pixel_values": image.pixel_values, "rope_cos": cos, "rope_sin": sin,
            "pos_grid": position_grid(gh, gw, spec.merge_size)}


# ------------------------------------------------------------------------------------------------
# the encoder


class VisionEncoder(LazyEncoder):
    """``edge/vision.onnx`` of a bundle, opened on first use; one image per ``encode`` call."""

    def __init__(self, bundle_dir: str | Path, threads: int = 2, graph: str | Path | None = None):
        self.bundle_dir = Path(bundle_dir)
        self.spec = VisionSpec.load(self.bundle_dir)
        self.path = Path(graph) if graph is not None else self.bundle_dir / VISION
        self.graph = LazySession(self.path, threads, "a vision encoder")

    def prepare(self, data, max_pixels: int | None = None) -> PreparedImage:
        """Encoded image bytes (or a PIL image) -> :class:`PreparedImage` (:meth:`check`, then :meth:`prepared`)."""
        return self.prepared(self.check(data, max_pixels)[0], max_pixels)

    def check(self, data, max_pixels: int | None = None, max_bytes: int = MAX_IMAGE_BYTES) -> tuple[object, int]:
        """Encoded image bytes (or a PIL image) -> (the :func:`open_image` result, its visual tokens at a pixel budget), from the
        header alone: nothing decoded yet. ``max_bytes``: the size limit (``MediaPolicy.max_bytes``)."""
        img = open_image(data, max_bytes)
        w, h = img.size  # an EXIF rotation swaps the sides, not the count
        return img, visual_tokens(h, w, self.spec, max_pixels)

    def prepared(self, img, max_pixels: int | None = None) -> PreparedImage:
        """A :meth:`check` result's image -> :class:`PreparedImage` (decode + preprocess)."""
        return preprocess(load_image(img), self.spec, max_pixels)

    def encode(self, image: PreparedImage) -> np.ndarray:
        """Visual embeddings float32 [n_tokens, H] of one prepared image."""
        return self.graph.run("image_embeds", tower_feeds(image, self.spec))

    def warmup(self) -> float:
        """Load the graph and run one small image; returns the seconds it took."""
        from PIL import Image

        t0 = time.perf_counter()
        side = self.spec.factor * 2
        self.encode(preprocess(Image.new("RGB", (side, side), (128, 128, 128)), self.spec))
        return time.perf_counter() - t0
