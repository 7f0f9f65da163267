"""The link between a front-end worker process and the engine process: framing and the batched messages.

With ``autoglm-cloud serve --workers N`` (``cloud_server.front_workers``) the engine runs in the main process
and N worker processes run the WebSocket endpoint; each worker talks to the engine over one duplex
``multiprocessing`` pipe. Every frame on it is one pickled ``list`` of messages (tuples, the kind first), so a
worker sends one frame per event-loop turn and the engine one per step per worker:

worker -> engine
    ``("add", rid, chunk, params, variant, prefix_keys)``    a request's first input (``AsyncEngine.add_request``)
    ``("rows", rids, starts, hidden)``                       a loop turn's plain decode steps, one position each,
                                                             their states one ``[S, H]`` float32 array (float16
                                                             where all came as fp16)
                                                             (``AsyncEngine.add_rows``)
    ``("inputs", rids, chunks)``                             other inputs in order (``AsyncEngine.add_inputs``):
                                                             prompt chunks, 3-D RoPE, drafts; their rows in one array
    ``("abort", rid, reason)``
    ``("ask", call_id, op, args)``                           a request answered by ``("reply", ...)``: ``op``
                                                             ``"call"`` (``args``: a picklable ``fn(llm)``, run on
                                                             the engine thread), ``"admit"`` (``args``: session
                                                             id, resume token, the key's ``auth.Principal``, the
                                                             token presented: the session ledger), ``"metrics"``
    ``("release", session_id)``                              a session closed (the session ledger)
    ``("rendered", token, families)``                        this worker's metric families, for a ``render``
                                                             (``token`` None: unasked, once, when it started)
engine -> worker
    ``("hello", facts, model_name)``                         first frame: the engine's fixed facts
    ``("outputs", outs, open_requests)``                     a step's outputs for this worker's requests
    ``("reply", call_id, ok, value)``                        ``ok`` False: ``value`` is the error text
    ``("reclaim", session_id)``                              close this session: its edge resumed elsewhere
    ``("render", token)``                                    send your metric families (a scrape elsewhere)
    ``("dead", message, code)``                              the engine stopped: its open requests end with
                                                             ``code`` (engine_error; engine_gone if it stalled)

Hidden states cross as numpy arrays (raw bytes in the pickle, never torch's shared-memory reducers): the
chunks of an ``inputs`` message share one ``[n, H]`` float32 array. Both ends run the pipe's socket on an event
loop (``take_socket``; :func:`frame` writes a frame, :class:`FrameReader` reads them); the pure functions
convert engine chunks and outputs to and from their wire form.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import pickle
import socket
import struct
from collections.abc import Iterator
from types import MappingProxyType
from multiprocessing.connection import Connection

import numpy as np
import torch

from cloud_server.engine.llm_engine import RequestOutput
from cloud_server.engine.sequence import InputChunk
from cloud_server.engine_facts import EngineFacts

_OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(RequestOutput))
_STATES = _OUTPUT_FIELDS.index("states")
_output_values = operator.attrgetter(*_OUTPUT_FIELDS)  # a RequestOutput -> the tuple of its fields, in order


def take_socket(conn: Connection) -> socket.socket:
    """The pipe end ``conn`` (``multiprocessing.Pipe(duplex=True)``: a Unix socket pair) as a socket for an event
    loop's transport; ``conn`` itself is closed."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    conn.close()
    return sock


def frame(messages: list[tuple]) -> list[bytes]:
    """``messages`` as one frame: a signed 4-byte big-endian length (or -1 and an 8-byte one) and the pickle -
    ``multiprocessing.connection``'s own framing, so a ``Connection`` end reads it with ``recv_bytes`` too."""
    data = pickle.dumps(messages, protocol=5)
    n = len(data)
    return [struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n), data]


class FrameReader:
    """Frames in :func:`frame`'s format from a byte stream fed in pieces: ``feed(data)`` yields the message lists
    of the frames it completes, in order (an asyncio protocol's ``data_received``); a corrupt frame raises when
    it is reached, after the frames before it were yielded."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> Iterator[list[tuple]]:
        buf = self._buf
        buf += data
        at = 0
        try:
            while len(buf) - at >= 4:
                (n,) = struct.unpack_from("!i", buf, at)
                head = 4
                if n == -1:
                    if len(buf) - at < 12:
                        break
                    (n,) = struct.unpack_from("!Q", buf, at + 4)
                    head = 12
                elif n < 0:
                    raise ValueError(f"engine link: bad frame length {n}")
                if len(buf) - at - head < n:
                    break
                start, at = at + head, at + head + n
                with memoryview(buf) as view:
                    msgs = pickle.loads(view[start:at])  # (arrays come out as copies)
                yield msgs
        finally:
            del buf[:at]


# -- inputs -------------------------------------------------------------------------------------------
def pack_chunks(chunks: list[InputChunk]) -> tuple:
    """Split-mode chunks as ``(rows [n_i], starts, lasts, hidden [sum n_i, H] float32, ropes, drafts, asks)``."""
    hidden = [c.hidden.numpy() for c in chunks]  # [n_i, H] float32 each
    stacked = hidden[0] if len(hidden) == 1 else np.concatenate(hidden)  # [sum n_i, H]
    ropes = [None if c.rope_positions is None else c.rope_positions.numpy() for c in chunks]  # [3, n_i] int64
    drafts = [c.draft_ids for c in chunks]
    asks = [c.ask_drafts for c in chunks]
    return ([c.n for c in chunks], [c.start for c in chunks], [c.last for c in chunks],
            np.ascontiguousarray(stacked, dtype=np.float32),
            None if all(r is None for r in ropes) else ropes, None if all(d is None for d in drafts) else drafts,
            asks if any(asks) else None)


def unpack_chunks(packed: tuple) -> list[InputChunk]:
    """:func:`pack_chunks`'s chunks again; their hidden states are row views of one tensor."""
    rows, starts, lasts, stacked, ropes, drafts, asks = packed
    hidden = torch.from_numpy(stacked).split(rows)  # [n_i, H] views of one [sum n_i, H] tensor
    return [InputChunk(start, hidden=h, last=last,
                       rope_positions=None if ropes is None or ropes[i] is None else torch.from_numpy(ropes[i]),
                       draft_ids=None if drafts is None else drafts[i], ask_drafts=0 if asks is None else asks[i])
            for i, (h, start, last) in enumerate(zip(hidden, starts, lasts, strict=True))]


# -- outputs ------------------------------------------------------------------------------------------
def pack_output(out: RequestOutput) -> tuple:
    """A :class:`RequestOutput` as a plain tuple of its fields (u-shape states as a numpy array)."""
    t = _output_values(out)  # one C call (the engine thread packs every output of a step)
    if t[_STATES] is not None:
        t = list(t)
        t[_STATES] = t[_STATES].numpy()
    return tuple(t)


def unpack_output(t: tuple) -> RequestOutput:
    out = RequestOutput(*t)
    if out.states is not None:
        out.states = torch.from_numpy(out.states)
    return out


# -- the engine's facts -------------------------------------------------------------------------------
def facts_to_wire(facts: EngineFacts) -> dict:
    """:class:`EngineFacts` as a picklable dict (its read-only mapping as a plain one)."""
    d = {f.name: getattr(facts, f.name) for f in dataclasses.fields(facts)}
    d["variant_for"] = dict(facts.variant_for)
    return d


def facts_from_wire(d: dict) -> EngineFacts:
    return EngineFacts(**{**d, "variant_for": MappingProxyType(dict(d["variant_for"]))})
