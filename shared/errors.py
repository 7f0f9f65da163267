"""The one exception that malformed wire input raises, and its stable error codes.

Every decoder in :mod:`shared` (frames, messages, tensors, zstd payloads, codec payloads) turns bad input into
``ProtocolError(code, message)``; nothing else escapes, so a server can answer any garbage with an ``Error``
message and a client can log one thing. The codes are part of the wire contract (docs/protocol.md) and never
change meaning; new codes may be added.

References: docs/protocol.md ("Error codes"); vLLM v1 splits errors into fatal-for-the-engine and
fatal-for-one-request, which ``Error.fatal`` carries on the wire.
"""

from __future__ import annotations

# -- decode-side codes (ProtocolError.code) ----------------------------------------------------------------
BAD_FRAME = "bad_frame"  # not one well-formed msgpack value, trailing bytes, ext types, bad utf-8
BAD_TYPE = "bad_type"  # unknown message type, a field of the wrong type, missing required fields
BAD_VALUE = "bad_value"  # a field of the right type but out of range (negative position, top_p > 1, ...)
TOO_LARGE = "too_large"  # frame, string, bin, array, map or tensor over its limit
BAD_TENSOR = "bad_tensor"  # dtype not allowed, size mismatch, NaN/Inf, value out of the codec's range
BAD_CODEC = "bad_codec"  # unknown codec name or codec parameters
DECOMPRESS = "decompress"  # zstd payload corrupt, over its size/ratio/window caps
VERSION = "version"  # protocol major version not supported

PROTOCOL_ERROR_CODES = (BAD_FRAME, BAD_TYPE, BAD_VALUE, TOO_LARGE, BAD_TENSOR, BAD_CODEC, DECOMPRESS, VERSION)

# -- session-level codes (sent in Error messages by either peer; see docs/protocol.md) -------------------
SESSION_ERROR_CODES = (
    "unauthorized",  # API key refused (normally an HTTP 401 before the upgrade)
    "bundle_mismatch",  # Hello.bundle_id is not the bundle this server serves
    "bad_state",  # a message not allowed in the session's current state
    "unknown_request",  # request_id the server does not know (finished, cancelled, or never opened)
    "duplicate_request",  # a Prefill opened a request_id that is already active
    "bad_position",  # Prefill.start / DecodeStep.position not where the server's KV cache ends
    "prefix_miss",  # Prefill referenced prefix_keys the server does not hold: resend from position 0
    "resume_failed",  # Resume for a request whose KV cache is gone: replay the context as a new request
    "context_full",  # the request would exceed Welcome.limits.max_context
    "prompt_too_long",  # a prompt (its Prefills) beyond Welcome.limits.max_prompt_tokens
    "overloaded",  # too many requests; retry later (Error.retry_after_ms)
    "draining",  # server is draining; no new requests on this connection
    "codec_not_negotiated",  # a tensor whose codec is not in Welcome.codecs
    "too_large",  # a Prefill over max_prefill_chunk_tokens, or a frame over max_frame_bytes: that request fails
    "bad_input",  # hidden states the model cannot take (width != its hidden size, 3-D RoPE to a 1-D model)
    "timeout",  # the request waited longer than the server's step timeout for its next input; its KV is freed
    "internal",  # the server's fault; the request failed
)


def fatal_close_code(code: str) -> int:
    """The WebSocket close code that follows a fatal ``Error(code)`` about what the peer sent (a frame, or a rule it
    broke; docs/protocol.md, "Transport"): ``version`` 1008, ``too_large`` 1009 (a frame over the decoder's limits or
    over ``max_frame_bytes`` naming no request), any other 1002. The server and the scripted fake close by it."""
    return {VERSION: 1008, TOO_LARGE: 1009}.get(code, 1002)


class ProtocolError(ValueError):
    """Malformed or out-of-contract wire input. ``code`` is one of :data:`PROTOCOL_ERROR_CODES`."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self):  # copy.copy / deepcopy rebuild from (code, message), not from str(self)
        return (type(self), (self.code, self.message))
