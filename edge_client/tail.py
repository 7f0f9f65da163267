"""The u-shape tail on the phone: the last M decoder layers, the final norm and the lm_head of a bundle split with
``--tail M`` (``edge/tail.onnx``, written by ``partition_tools.export_tail``), run in onnxruntime with its own
KV cache.

Contract (one sequence at a time, positions absolute and contiguous, as :class:`edge_client.front.FrontRuntime`):

* ``run(states, logits_rows)`` takes the hidden states the cloud returned for positions ``[len, len + S)``
  (``[S, H]``, the output of the middle layers), appends them to the tail's KV and returns the logits of the
  last ``logits_rows`` positions ``[logits_rows, V]``; ``prefill(states)`` does that in chunks and returns
  the last row's logits ``[1, V]``;
* ``truncate(n)`` rolls the cache back to the first ``n`` positions (the rejected drafts of a speculative
  step), ``reset()`` empties it.

The KV cache is the front's fused-graph buffer (``edge_client.front``: one ``[1, KVH, C, D]`` buffer per layer
and tensor, bound as past *and* present so each step writes its rows in place; ``truncate`` only moves the
length). :class:`StatesRuntime` is that runtime for any graph of the tail's interface (the layer-skipping
drafter, ``edge_client.draft_layers``, is another). Only numpy and onnxruntime: this module runs on the phone.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from shared.manifest import EDGE_HALF_ROLES, BundleError, Manifest

from .front import (FUSED_INPUTS, INITIAL_CAPACITY, MAX_POSITIONS_KEY, MROPE_KEY, ROPE_INPUTS, FrontError, FrontStats,
                    _SharedBufferKV, open_session)
from .rope import rope_feeds

TAIL = "edge/tail.onnx"  # partition_tools.export_tail writes it under the same name
TAIL_INPUT, TAIL_ROWS, TAIL_OUTPUT = "boundary_states", "logits_rows", "logits"  # partition_tools.graph_builder


class _TailKV(_SharedBufferKV):
    """The front's in-place KV buffer, driven with hidden states in and logits out."""

    _logits: dict[int, tuple[np.ndarray, ort.OrtValue]] | None = None  # bound output [1, rows, V] per rows

    def run_states(self, session: ort.InferenceSession, states: np.ndarray, rows: int, extra: dict) -> np.ndarray:
        s = states.shape[0]
        total = self.length + s
        self.reserve(total)
        b = self.bindings[id(session)]
        b.bind_cpu_input(TAIL_INPUT, np.ascontiguousarray(states, np.float32)[None])  # [1, S, H]
        b.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))  # [1]
        b.bind_cpu_input("total_sequence_length", np.array(total, np.int32))  # []
        b.bind_cpu_input(TAIL_ROWS, np.array([rows], np.int64))  # [1]
        for name, value in extra.items():  # 3-D rope graphs: rope_cos / rope_sin [S, R/2]
            b.bind_cpu_input(name, value)
        if self._logits is None:
            self._logits = {}
        if rows not in self._logits:  # 1 (prefill, plain steps) or k + 1 (speculative steps): a few shapes
            out = np.empty((1, rows, self.hidden_size), np.float32)  # [1, rows, V] (the base's width: V here)
            self._logits[rows] = (out, ort.OrtValue.ortvalue_from_numpy(out))
        out, value = self._logits[rows]
        b.bind_ortvalue_output(TAIL_OUTPUT, value)
        session.run_with_iobinding(b)
        self.length = total
        return out[0].copy()  # [rows, V]: the bound buffer is overwritten by the next call


class StatesRuntime:
    """onnxruntime session over a graph of the tail's interface (hidden states in, logits out: ``n_layers``
    decoder layers + norm + lm_head) plus the sequence's KV cache for its layers. The u-shape tail is one
    (:class:`TailRuntime`), the layer-skipping drafter another (``edge_client.draft_layers``)."""

    def __init__(self, path: Path, manifest: Manifest, n_layers: int, threads: int = 2, chunk: int = 128,
                 capacity: int = INITIAL_CAPACITY):
        if threads < 1 or chunk < 1 or capacity < 1:
            raise ValueError(f"threads ({threads}), chunk ({chunk}) and capacity ({capacity}) must be >= 1")
        m = self.manifest = manifest
        self.n_layers, self.hidden_size, self.vocab_size = n_layers, m.hidden_size, m.vocab_size
        self.chunk = chunk
        self.session = open_session(path, threads)
        names = {i.name for i in self.session.get_inputs()}
        kv = {f"past_{kind}.{j}" for j in range(self.n_layers) for kind in ("key", "value")}
        self.mrope = set(ROPE_INPUTS) <= names  # GLM-4.1V: the caller's 3-D positions -> cos/sin inputs
        if names != kv | {TAIL_INPUT, TAIL_ROWS, *FUSED_INPUTS, *(ROPE_INPUTS if self.mrope else ())}:
            raise BundleError(f"{path}: inputs {sorted(names)[:4]}... are not a {self.n_layers}-layer tail graph's")
        self.meta = meta = self.session.get_modelmeta().custom_metadata_map
        self.mrope_params = json.loads(meta[MROPE_KEY]) if self.mrope else None
        self.stats = FrontStats()
        self._cache = _TailKV([self.session], self.n_layers, m.num_kv_heads, m.head_dim, capacity,
                              int(meta.get(MAX_POSITIONS_KEY, 1 << 20)))

    @property
    def length(self) -> int:
        """Positions held in the tail's KV cache."""
        return self._cache.length

    def reset(self) -> None:
        self._cache.reset()

    def truncate(self, n: int) -> None:
        """Keep positions [0, n) (O(1): the buffer's length moves)."""
        if not 0 <= n <= self.length:
            raise FrontError(f"truncate({n}): the tail's cache holds {self.length} positions")
        self._cache.truncate(n)

    def run(self, states: np.ndarray, logits_rows: int = 1, positions: np.ndarray | None = None) -> np.ndarray:
        """States [S, H] at positions [len, len + S) -> logits [logits_rows, V] of the last rows (one call).
        ``positions``: int [3, S] 3-D rope positions of a span with images (GLM-4.1V); None: text positions."""
        states = np.asarray(states, np.float32)
        if states.ndim != 2 or states.shape[1] != self.hidden_size or not states.shape[0]:
            raise FrontError(f"tail input: expected [S >= 1, {self.hidden_size}] states, got {list(states.shape)}")
        if not 1 <= logits_rows <= states.shape[0]:
            raise FrontError(f"logits of {logits_rows} rows from {states.shape[0]} states")
        extra = {}
        if self.mrope:
            s = states.shape[0]
            extra = rope_feeds(np.arange(self.length, self.length + s) if positions is None else positions,
                               self.mrope_params)
        t0 = time.perf_counter()
        logits = self._cache.run_states(self.session, states, logits_rows, extra)  # [rows, V]
        self.stats.count(t0, states.shape[0])
        return logits

    def prefill(self, states: np.ndarray) -> np.ndarray:
        """States [S, H] in chunks of ``chunk`` rows; returns the last row's logits [1, V]."""
        states = np.asarray(states, np.float32)
        last = (states.shape[0] - 1) // self.chunk * self.chunk  # the last chunk's start
        for i in range(0, last, self.chunk):  # every chunk but the last: its KV is what counts
            self.run(states[i:i + self.chunk], 1)
        return self.run(states[last:], 1)


class TailRuntime(StatesRuntime):
    """The u-shape tail of a bundle split with ``--tail M``: ``edge/tail.onnx``, layers [L - M, L)."""

    def __init__(self, bundle_dir: str | Path, threads: int = 2, chunk: int = 128, verify: bool = True,
                 capacity: int = INITIAL_CAPACITY):
        self.bundle_dir = Path(bundle_dir)
        m = Manifest.load(self.bundle_dir)
        if not m.tail_layers:
            raise BundleError(f"{self.bundle_dir}: not a u-shape bundle (split without --tail)")
        if verify:
            m.verify_files(self.bundle_dir, roles=EDGE_HALF_ROLES, if_present=("shared",))
        path = self.bundle_dir / TAIL
        if not path.is_file():
            raise BundleError(f"{path}: missing (the manifest says the bundle has a tail)")
        super().__init__(path, m, m.tail_layers, threads, chunk, capacity)
