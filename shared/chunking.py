"""Prefill chunking: split a prompt's boundary hidden states into Prefill messages that respect the limits.

The server's ``Welcome.limits`` bound every frame (``max_frame_bytes``) and every Prefill
(``max_prefill_chunk_tokens``), and a receiver decodes no tensor whose float32 states exceed its decoded-tensor
limit (``shared.wire.Limits.max_decoded_tensor_bytes``, 64 MiB by default). :func:`prefill_messages` sizes
each chunk from the codec's typical payload per row and the exact envelope of the message (the first one alone
carries the sampling parameters and prefix keys), encodes it, and if the frame still exceeds the limit (many
float16 sink rows) shrinks the chunk and encodes again, so every returned message fits.
"""

from __future__ import annotations

import numpy as np

from .codec_base import BoundaryCodec
from .errors import TOO_LARGE, ProtocolError
from .messages import Prefill, SamplingParams, SessionLimits
from .tensors import EncodedTensor, WireArray
from .wire import DEFAULT_LIMITS, encode_message

_BIN_HEADER = 5  # msgpack bin32 header: the most a payload's length prefix can take


def prefill_messages(request_id: str, hidden: np.ndarray, codec: BoundaryCodec, limits: SessionLimits, *,
                     start: int = 0, last: bool = True, params: SamplingParams | None = None,
                     prefix_keys: list[str] | None = None, compute: str | None = None, zstd: bool = False,
                     rope_positions: np.ndarray | None = None, return_states: bool = False,
                     prompt_len: int | None = None) -> list[Prefill]:
    """Prefill messages for positions ``[start, start + S)`` of ``hidden`` [S, H].

    ``params`` / ``prefix_keys`` / ``compute`` / ``return_states`` (u-shape) / ``prompt_len`` go on the first
    message only (the protocol's rule);
    ``last`` marks the final chunk. ``rope_positions``: int32 [3, S] for multimodal RoPE, sliced per chunk.
    Raises ``ProtocolError("too_large")`` if not even one token fits in a frame.
    """
    s, h = hidden.shape
    if s < 1:
        raise ValueError("no hidden states to send")
    if rope_positions is not None and rope_positions.shape != (3, s):
        raise ValueError(f"rope_positions: expected [3, {s}], got {list(rope_positions.shape)}")
    per_row = codec.payload_bytes(1, h)  # [1, H] typical (no sink rows)
    rope_row = 0 if rope_positions is None else 3 * 4
    out: list[Prefill] = []
    i = 0
    while i < s:
        first = not out
        meta = {"params": params, "prefix_keys": list(prefix_keys or []), "compute": compute,
                "return_states": return_states, "prompt_len": prompt_len} if first else {}
        probe = Prefill(request_id=request_id, start=start + i,
                        hidden=EncodedTensor(codec=codec.name, shape=(1, h), data=b""), last=last, **meta,
                        rope_positions=None if rope_positions is None else
                        WireArray.from_numpy(np.zeros((3, 1), np.int32)))
        envelope = len(encode_message(probe)) + 2 * _BIN_HEADER + 16  # + shape/position growth
        rows = min(limits.max_prefill_chunk_tokens, s - i, DEFAULT_LIMITS.max_decoded_tensor_bytes // (4 * h),
                   (limits.max_frame_bytes - envelope) // (per_row + rope_row) if per_row + rope_row else s)
        if rows < 1:
            raise ProtocolError(TOO_LARGE, f"one token of {codec.name} [1, {h}] does not fit in a "
                                           f"{limits.max_frame_bytes}-byte frame")
        while True:
            rope = None if rope_positions is None else WireArray.from_numpy(
                np.ascontiguousarray(rope_positions[:, i:i + rows], np.int32))
            msg = Prefill(request_id=request_id, start=start + i, hidden=codec.encode(hidden[i:i + rows], zstd=zstd),
                          last=last and i + rows == s, rope_positions=rope, **meta)
            size = len(encode_message(msg))
            if size <= limits.max_frame_bytes:
                break
            if rows == 1:
                raise ProtocolError(TOO_LARGE, f"one token of {codec.name} [1, {h}] needs a {size}-byte frame; "
                                               f"the limit is {limits.max_frame_bytes}")
            rows = max(1, min(rows - 1, int(rows * (limits.max_frame_bytes - envelope) / size)))
        out.append(msg)
        i += rows
    return out
