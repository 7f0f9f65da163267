"""The edge-cloud wire protocol in one import: message types, frame encoding, errors, limits.

``from shared import protocol as P`` gives everything a transport needs::

    frame = P.encode_message(P.Hello(bundle_id=..., codecs=[...]))
    msg = P.decode_message(frame)          # raises only P.ProtocolError (with .code)

Implementation: :mod:`shared.messages` (the message set), :mod:`shared.wire` (msgpack framing and strict
decoding), :mod:`shared.tensors` (tensor wire types), :mod:`shared.errors` (codes). The normative
description, including the session state machine and versioning rules, is docs/protocol.md.
"""

from __future__ import annotations

from dataclasses import asdict

from .errors import PROTOCOL_ERROR_CODES, SESSION_ERROR_CODES, ProtocolError
from .messages import (
    FINISH_REASONS,
    MESSAGE_TYPES,
    PROGRESS_INTERVAL_S,
    PROTOCOL_VERSION,
    Cancel,
    ClientHints,
    Close,
    DecodeStep,
    Drain,
    Error,
    Hello,
    Message,
    Prefill,
    RequestState,
    Resume,
    Resumed,
    SamplingParams,
    ServerInfo,
    ServerTimings,
    SessionLimits,
    SpecStep,
    States,
    StatesStep,
    Tokens,
    TopLogprob,
    Usage,
    Welcome,
)
from .plan import PrecisionPlan
from .tensors import EncodedTensor, WireArray
from .wire import CLIENT_MESSAGE_ITEMS, DEFAULT_LIMITS, Limits, decode_message, encode_message


def to_dict(msg) -> dict:
    """A JSON-friendly dict of a message (for logs and debugging; bytes become their length)."""
    def clean(v):
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        if isinstance(v, bytes):
            return f"<{len(v)} bytes>"
        return v
    return {"type": type(msg).__name__, **clean(asdict(msg))}


__all__ = [
    "CLIENT_MESSAGE_ITEMS",
    "DEFAULT_LIMITS",
    "FINISH_REASONS",
    "MESSAGE_TYPES",
    "PROGRESS_INTERVAL_S",
    "PROTOCOL_ERROR_CODES",
    "PROTOCOL_VERSION",
    "SESSION_ERROR_CODES",
    "Cancel",
    "ClientHints",
    "Close",
    "DecodeStep",
    "Drain",
    "EncodedTensor",
    "Error",
    "Hello",
    "Limits",
    "Message",
    "PrecisionPlan",
    "Prefill",
    "ProtocolError",
    "RequestState",
    "Resume",
    "Resumed",
    "SamplingParams",
    "ServerInfo",
    "ServerTimings",
    "SessionLimits",
    "SpecStep",
    "States",
    "StatesStep",
    "Tokens",
    "TopLogprob",
    "Usage",
    "Welcome",
    "WireArray",
    "decode_message",
    "encode_message",
    "to_dict",
]
