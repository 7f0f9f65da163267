"""Frames <-> messages: msgpack with strict, bounded decoding.

``encode_message(msg)`` packs ``[type, field, ...]`` (nested structs as arrays, bytes as msgpack bin).
``decode_message(frame, limits)`` is the only way bytes from the network become objects:

1. the frame length is checked against ``limits.max_frame_bytes`` before anything is parsed;
2. ``msgpack.unpackb`` runs with explicit ``max_bin_len`` / ``max_str_len`` / ``max_array_len`` /
   ``max_map_len`` and ``max_ext_len=0`` (no ext types, hence no msgpack timestamps), and at most
   ``limits.max_items`` array elements in all, counted as each array is built (each element is a Python object of
   up to ~70 bytes from one byte of frame: a 16 MiB frame of empty arrays took 1.2 GB and 11 s); exactly one value
   must fill the frame;
3. the value is converted field by field against the message dataclass's annotations (no ``eval``, no
   pickle, no object hooks) and the dataclass validates ranges in ``__post_init__``;
4. zstd-compressed tensors have their frame header checked here (declared size within what the tensor's
   shape can need); full bounded decompression happens in the codec (:mod:`shared.codecs`).

Anything wrong raises ``ProtocolError`` with a stable code (:mod:`shared.errors`), never another exception.

References: msgpack spec (https://github.com/msgpack/msgpack/blob/master/spec.md); docs/protocol.md.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import threading
import types
import typing
from dataclasses import dataclass

import msgpack
import zstandard

from . import messages as _messages
from .errors import BAD_FRAME, BAD_TYPE, DECOMPRESS, TOO_LARGE, VERSION, ProtocolError
from .messages import MESSAGE_TYPES, PROTOCOL_VERSION, Hello, Message, Welcome
from .tensors import EncodedTensor


# Array elements in a frame, each array counting as one more. A server's Tokens may hold 65,536 tokens with 20
# alternatives each (5.3 M), so by default none but the frame's own (an element takes a byte at least); a client's
# message holds far fewer (a Prefill's 4,096 prefix keys, a Hello's 32 codecs): the server decodes with
# CLIENT_MESSAGE_ITEMS, 16x that, so one frame costs it a few MB of objects at most.
MAX_ITEMS = 1 << 25
CLIENT_MESSAGE_ITEMS = 1 << 16


class _TooManyItems(Exception):
    pass


@dataclass(slots=True)
class Limits:
    """Local decoding limits (not sent anywhere). Defaults fit the SessionLimits defaults."""

    max_frame_bytes: int = (16 << 20) + 4096  # the session's frame limit plus envelope slack
    max_str_len: int = 1 << 16  # error messages are cut at 1 KiB; ids are at most 256 characters
    max_array_len: int = 1 << 17  # token lists, prefix keys; tensors are bin, not arrays
    max_items: int = MAX_ITEMS  # array elements of a frame in all (arrays included); a server: CLIENT_MESSAGE_ITEMS
    max_map_len: int = 0  # the protocol uses no msgpack maps
    max_decoded_tensor_bytes: int = 64 << 20  # at most: a decoded tensor's float32 states, a decompressed payload
    max_zstd_ratio: float = 256.0  # decompressed / compressed
    zstd_window_log_max: int = 23  # 8 MiB window

    def __post_init__(self):
        for name in ("max_frame_bytes", "max_str_len", "max_array_len", "max_items", "max_decoded_tensor_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be a positive int")
        if self.max_map_len < 0:
            raise ValueError("Limits.max_map_len must be >= 0")
        if not (self.max_zstd_ratio > 1 and math.isfinite(self.max_zstd_ratio)):
            raise ValueError("Limits.max_zstd_ratio must be a finite number > 1")
        if not 10 <= self.zstd_window_log_max <= 31:
            raise ValueError("Limits.zstd_window_log_max must be in [10, 31]")


DEFAULT_LIMITS = Limits()


# -- encoding ----------------------------------------------------------------------------------------------

_PACKERS = threading.local()
_FIELDS_OF: dict[type, typing.Callable] = {}  # message/struct class -> obj -> its field values, in wire order


def _fields(v) -> tuple | list:
    """A message's or nested struct's field values in wire order; msgpack's ``default`` for what it cannot
    pack itself (so scalars, lists, tuples and bytes are packed in C, and only structs call back here)."""
    get = _FIELDS_OF.get(type(v))
    if get is None:
        if not dataclasses.is_dataclass(v) or isinstance(v, type):
            raise TypeError(f"can not serialize {type(v).__name__!r} object")
        names = tuple(f.name for f in dataclasses.fields(v))
        many = operator.attrgetter(*names) if len(names) > 1 else None
        get = _FIELDS_OF[type(v)] = many or (lambda o, n=names: [getattr(o, x) for x in n])
    return get(v)


def encode_message(msg: Message, max_frame_bytes: int | None = None) -> bytes:
    """One binary frame for ``msg``; ``ProtocolError("too_large")`` if it exceeds ``max_frame_bytes``."""
    if type(msg) not in _TYPE_CODES:
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    packer = getattr(_PACKERS, "packer", None)
    if packer is None:  # one per thread (a Packer keeps its buffer between calls; packb builds one per frame)
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=True, default=_fields)
    frame = packer.pack([msg.TYPE, *_fields(msg)])
    if max_frame_bytes is not None and len(frame) > max_frame_bytes:
        raise ProtocolError(TOO_LARGE, f"{type(msg).__name__} frame is {len(frame)} bytes (limit {max_frame_bytes})")
    return frame


_TYPE_CODES = {cls: code for code, cls in MESSAGE_TYPES.items()}


# -- decoding: wire value -> typed object, driven by the dataclass annotations ------------------------------

def _fail(what: str, expected: str, v) -> typing.NoReturn:
    raise ProtocolError(BAD_TYPE, f"{what}: expected {expected}, got {type(v).__name__}")


def _converter(tp, what: str):
    """A function wire_value -> typed value for annotation ``tp`` (built once per field)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"{what}: only X | None unions are supported")
        conv = _converter(inner[0], what)
        return lambda v: None if v is None else conv(v)
    if origin is list:
        conv = _converter(args[0], what + "[]")

        def list_conv(v):
            if not isinstance(v, list):
                _fail(what, "an array", v)
            return [conv(x) for x in v]
        return list_conv
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"{what}: only tuple[X, ...] is supported")
        conv = _converter(args[0], what + "[]")

        def tuple_conv(v):
            if not isinstance(v, list):
                _fail(what, "an array", v)
            return tuple([conv(x) for x in v])
        return tuple_conv
    if dataclasses.is_dataclass(tp):
        return _struct_converter(tp)
    if tp is bool:
        return lambda v: v if isinstance(v, bool) else _fail(what, "a boolean", v)
    if tp is int:
        return lambda v: v if isinstance(v, int) and not isinstance(v, bool) else _fail(what, "an integer", v)
    if tp is float:
        def float_conv(v):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                _fail(what, "a number", v)
            return float(v)
        return float_conv
    if tp is str:
        return lambda v: v if isinstance(v, str) else _fail(what, "a string", v)
    if tp is bytes:
        return lambda v: v if isinstance(v, bytes) else _fail(what, "binary data", v)
    raise TypeError(f"{what}: unsupported annotation {tp!r}")


_STRUCTS: dict[type, typing.Callable] = {}


def _struct_converter(cls):
    if cls in _STRUCTS:
        return _STRUCTS[cls]
    hints = typing.get_type_hints(cls, vars(_messages))
    spec = []  # (name, converter, required)
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        spec.append((f.name, _converter(hints[f.name], f"{cls.__name__}.{f.name}"), required))
    # Every field up to the last required one must be present; trailing ones may be omitted (defaults).
    n_required = max((i + 1 for i, (*_, r) in enumerate(spec) if r), default=0)
    conv = _compile_struct(cls, [(name, c, _fast_check(hints[name])) for name, c, _ in spec], n_required)
    _STRUCTS[cls] = conv
    return conv


_EXACT = {int: "type({x}) is int", str: "type({x}) is str", bytes: "type({x}) is bytes",
          float: "type({x}) is float", bool: "({x} is True or {x} is False)"}


def _fast_check(tp) -> str | None:
    """A Python condition on ``{x}`` that holds for the common well-typed wire value of annotation ``tp`` (a
    scalar, or an optional one), which then passes as it is; None: always through the field's converter."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = _EXACT.get(args[0] if args[1] is type(None) else args[1])
        return None if inner is None else f"({{x}} is None or {inner})"
    return _EXACT.get(tp)


def _compile_struct(cls, fields: list[tuple[str, typing.Callable, str | None]], n_required: int) -> typing.Callable:
    """``conv(v)``: the wire array ``v`` as a ``cls``, each field through its converter, in field order.

    Generated from the dataclass's fields (as ``dataclasses`` generates ``__init__``): a well-typed scalar
    passes on an exact type test (its converter would return it unchanged), anything else goes through its
    converter; one keyword call per accepted field count, no per-frame dict or zip (a frame is decoded per
    token). Extra trailing fields come from a newer minor revision and are ignored (docs/protocol.md,
    Versioning)."""
    ns = {"cls": cls, "_fail": _fail, "ProtocolError": ProtocolError, "BAD_TYPE": BAD_TYPE, "list": list,
          "isinstance": isinstance, "len": len, "type": type, "int": int, "str": str, "bytes": bytes,
          "float": float, **{f"c{i}": c for i, (_, c, _) in enumerate(fields)}}
    what = cls.__name__
    lines = ["def conv(v):",
             "    if not isinstance(v, list):",
             f"        _fail({what!r}, 'an array', v)",
             "    n = len(v)",
             f"    if n < {n_required}:",
             f"        raise ProtocolError(BAD_TYPE, f'{what}: {{n}} fields, at least {n_required} required')"]
    for i, (_, _, fast) in enumerate(fields):  # in field order: the first bad field is the one reported
        pad = "    " if i < n_required else "        "
        if i >= n_required:
            lines.append(f"    if n > {i}:")
        lines.append(f"{pad}x{i} = v[{i}]")
        lines.append(f"{pad}if not {fast.format(x=f'x{i}')}:" if fast else f"{pad}if True:")
        lines.append(f"{pad}    x{i} = c{i}(x{i})")
    for k in range(len(fields), n_required - 1, -1):  # every field present first: the common frame
        args = ", ".join(f"{name}=x{i}" for i, (name, _, _) in enumerate(fields[:k]))
        lines += [f"    if n >= {k}:" if k > n_required else "    if True:", f"        return cls({args})"]
    exec("\n".join(lines), ns)  # noqa: S102 - the source is built from field names above, never from input
    return ns["conv"]


_MESSAGE_CONVERTERS = {code: _struct_converter(cls) for code, cls in MESSAGE_TYPES.items()}


def _check_zstd_header(t: EncodedTensor, limits: Limits) -> None:
    """Refuse a compressed tensor whose header declares more than its shape can need (before allocating)."""
    s, h = t.shape
    worst = s * h * 4 + (s + 7) // 8 + 64  # float32 everywhere (fp32) plus a row bitmap: no codec needs more
    try:
        declared = zstandard.frame_content_size(t.data)
    except zstandard.ZstdError:
        raise ProtocolError(DECOMPRESS, "bad zstd frame header") from None
    if declared > min(worst, limits.max_decoded_tensor_bytes) and declared != zstandard.CONTENTSIZE_UNKNOWN:
        raise ProtocolError(DECOMPRESS, f"zstd frame declares {declared} bytes for a [{s}, {h}] tensor")


_FIXED_SIZE = {0xca: 5, 0xcb: 9, 0xcc: 2, 0xcd: 3, 0xce: 5, 0xcf: 9, 0xd0: 2, 0xd1: 3, 0xd2: 5, 0xd3: 9,
               0xd4: 3, 0xd5: 4, 0xd6: 6, 0xd7: 10, 0xd8: 18}  # numbers and fixext: header byte included
_LENGTH_BYTES = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4,  # bin, str: that many bytes follow
                 0xc7: 1, 0xc8: 2, 0xc9: 4,  # ext: and a type byte
                 0xdc: 2, 0xdd: 4, 0xde: 2, 0xdf: 4}  # array, map: that many items (pairs)


def _reserved_byte_offset(data) -> int | None:
    """Where the first value's type byte is 0xc1 (what msgpack's FormatError means), walking the frame's values
    in order without building them; None if none is found before the frame ends."""
    i, pending = 0, 1  # values still to read
    while pending and i < len(data):
        b, pending = data[i], pending - 1
        if b == 0xc1:
            return i
        if 0x80 <= b <= 0x8f:
            pending += 2 * (b & 0x0F)
        elif 0x90 <= b <= 0x9f:
            pending += b & 0x0F
        elif 0xa0 <= b <= 0xbf:
            i += b & 0x1F
        elif b in _FIXED_SIZE:
            i += _FIXED_SIZE[b] - 1
        elif b in _LENGTH_BYTES:
            k = _LENGTH_BYTES[b]
            n = int.from_bytes(data[i + 1:i + 1 + k], "big")
            i += k
            if b >= 0xdc:
                pending += 2 * n if b >= 0xde else n
            else:
                i += n + (1 if b in (0xc7, 0xc8, 0xc9) else 0)
        i += 1
    return None


def decode_message(data: bytes, limits: Limits | None = None) -> Message:
    """Parse and validate one frame (see the module docstring). Raises only ``ProtocolError``."""
    limits = limits or DEFAULT_LIMITS
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(BAD_FRAME, f"frames are binary, got {type(data).__name__}")
    if len(data) > limits.max_frame_bytes:
        raise ProtocolError(TOO_LARGE, f"frame of {len(data)} bytes (limit {limits.max_frame_bytes})")
    if len(data) == 0:
        raise ProtocolError(BAD_FRAME, "empty frame")
    left = limits.max_items

    def counted(items: list) -> list:  # each array once built: a frame stops within max_items + one array
        nonlocal left
        left -= len(items) + 1
        if left < 0:
            raise _TooManyItems
        return items

    try:  # one call, no Unpacker object: a frame is parsed per token
        value = msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=True, max_bin_len=limits.max_frame_bytes,
            max_str_len=limits.max_str_len, max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len, max_ext_len=0, list_hook=counted)
    except _TooManyItems:
        raise ProtocolError(TOO_LARGE, f"more than {limits.max_items} array elements in one frame") from None
    except msgpack.ExtraData as e:
        raise ProtocolError(BAD_FRAME, f"{len(e.extra)} trailing bytes after the message") from None
    except ValueError as e:  # msgpack reports limit violations (and StackError, FormatError) as ValueError
        text = str(e)
        if "incomplete input" in text:
            raise ProtocolError(BAD_FRAME, "truncated frame") from None
        if isinstance(e, msgpack.StackError):  # its text is empty
            raise ProtocolError(BAD_FRAME, "nesting too deep") from None
        if "max_ext_len" in text:
            raise ProtocolError(BAD_FRAME, "msgpack ext types (timestamps included) are not used") from None
        if "max_map_len" in text and limits.max_map_len == 0:
            raise ProtocolError(BAD_TYPE, "msgpack maps are not used; messages are arrays") from None
        if isinstance(e, msgpack.FormatError):  # its text is empty too: msgpack's one reserved byte, 0xc1
            at = _reserved_byte_offset(data)
            where = "" if at is None else f" at byte {at}"
            raise ProtocolError(BAD_FRAME, f"msgpack: FormatError: the reserved type byte 0xc1{where} (never used "
                                           f"in msgpack)") from None
        code = TOO_LARGE if "exceeds max" in text else BAD_FRAME
        raise ProtocolError(code, f"msgpack: {type(e).__name__}: {text}") from None
    except Exception as e:  # noqa: BLE001 - FormatError, StackError, UnicodeDecodeError, ...
        raise ProtocolError(BAD_FRAME, f"msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(value, list) or not value or isinstance(value[0], bool) or not isinstance(value[0], int):
        raise ProtocolError(BAD_TYPE, "a frame is an array [type, fields...]")
    conv = _MESSAGE_CONVERTERS.get(value[0])
    if conv is None:
        raise ProtocolError(BAD_TYPE, f"unknown message type {value[0]}")
    # Version first: a peer of another major version gets "version", not a confusing field error.
    if value[0] in (Hello.TYPE, Welcome.TYPE) and len(value) > 1 and isinstance(value[1], int) \
            and value[1] != PROTOCOL_VERSION:
        raise ProtocolError(VERSION, f"protocol version {value[1]} (this side speaks {PROTOCOL_VERSION})")
    try:
        msg = conv(value[1:])
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError(BAD_FRAME, "nesting too deep") from None
    except Exception as e:  # noqa: BLE001 - a validator bug must still surface as a protocol error
        raise ProtocolError(BAD_TYPE, f"{type(e).__name__}: {e}") from None
    for t in _tensors_of(msg):
        if t.zstd:
            _check_zstd_header(t, limits)
    return msg


def _tensors_of(msg: Message):
    hidden = getattr(msg, "hidden", None)
    if isinstance(hidden, EncodedTensor):
        yield hidden
