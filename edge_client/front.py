"""The edge front: embeddings + decoder layers [0, N) of a bundle, run in onnxruntime with our own KV cache.

Contract (one sequence at a time, positions are absolute and contiguous):

* ``prefill(ids)`` runs the tokens at positions ``[len, len + S)`` in chunks of ``chunk`` tokens and returns
  the boundary hidden states ``[S, H]``; ``decode(token)`` is the one-token case ``[1, H]``.
* ``truncate(n)`` rolls the cache back to the first ``n`` positions (a new prompt that shares a prefix with
  the last one, or a rejected speculative step); ``kv_slice(a, b)`` / ``extend_kv(blocks)`` copy positions
  out and back in (2N arrays ``[KVH, T, D]``, K then V per layer), which is how the activation cache stores
  and restores prefixes.

Two edge graphs run here, told apart by their inputs:

* the **fused** graph (``partition_tools.graph_builder``: GroupQueryAttention & co.): the KV cache is one
  preallocated buffer ``[1, KVH, C, D]`` per layer and tensor, bound once through IO binding as both the
  past input and the present output of the same OrtValue, so a step writes its S new rows in place and
  copies nothing else. ``truncate`` only moves the length. The buffer grows (doubling, one copy) when a
  sequence outgrows it. An int8-KV graph (``partition_tools.kv_quant``) keeps int8 buffers; ``kv_slice``
  dequantizes and ``extend_kv`` quantizes with the graph's own scales, so callers always see float32;
* the **plain** traced graph (``partition_tools.export``, the portable fallback): explicit past -> present
  concatenation, arrays in and out, the cache copied on every step.

**Precision by phase.** A quantized bundle may carry a second graph for the prompt, ``edge/front_prefill.onnx``
(``partition_tools.quantize``, ``prefill="fp32"``): the same layers, inputs and KV layout in fp32. ``prefill*``
then run the prompt through it and ``decode`` / ``step`` (a speculative step's k + 1 tokens) through
``edge/front.onnx``; both read and write the same KV buffers, so the prompt's states and KV are the fp32
front's and only the answer's own rows carry the int8 error. (int8 buys nothing at prefill on a CPU - a
compute-bound GEMM that fp32 MLAS batches well - and ~3x per decode step: docs/quality.md, "Edge answers".)

Only numpy and onnxruntime: this module runs on the phone.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from shared.manifest import EDGE_HALF_ROLES, BundleError, Manifest

from .rope import rope_feeds

FRONT = "edge/front.onnx"
PREFILL_GRAPH = "edge/front_prefill.onnx"  # optional: the prompt-phase graph (precision by phase)
FUSED_INPUTS = ("seqlens_k", "total_sequence_length")  # partition_tools.graph_builder's interface
ROPE_INPUTS = ("rope_cos", "rope_sin")
MAX_POSITIONS_KEY = "autoglm.max_positions"  # graph metadata: rows of the rotary caches
MROPE_KEY = "autoglm.mrope"  # graph metadata (3-D rope graphs): JSON {theta, rotary_dim, mrope_section}
EMBEDS_INPUTS = ("inputs_embeds", "embeds_mask")  # media rows in place of token embeddings (front_embeds)
KV_SCALES_KEY = "autoglm.kv_scales"  # graph metadata (int8 KV graphs): JSON {"k", "v"}: per layer [KVH][D]
INITIAL_CAPACITY = 256  # KV rows allocated up front (SmolLM2 split at 8: 3 MB); grows by doubling


def prefill_graph_path(front: str | Path) -> Path:
    """The prompt-phase graph written beside the edge graph ``front`` (``front.onnx`` -> ``front_prefill.onnx``)."""
    front = Path(front)
    return front.with_name(front.stem + "_prefill" + front.suffix)


class FrontError(Exception):
    """Bad input to the front runtime (token id out of range, position mismatch); one-line message."""


@dataclass(slots=True)
class FrontStats:
    """Cumulative edge compute: what the activation cache saves is measured here."""

    forward_calls: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def count(self, started: float, tokens: int) -> None:
        """One graph call over ``tokens`` positions that began at ``started`` (``time.perf_counter()``)."""
        self.seconds += time.perf_counter() - started
        self.forward_calls += 1
        self.tokens += tokens


def open_session(path: str | Path, threads: int = 2, profile_prefix: str | None = None) -> ort.InferenceSession:
    """An onnxruntime CPU session over an edge graph with ``threads`` intra-op threads (as the phone opens it).

    ``profile_prefix``: turn on onnxruntime's profiler (per-op times; ``session.end_profiling()`` writes them).
    """
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    try:
        return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
        first = str(e).splitlines()[0]
        hint = ("; the bundle's fused edge graph needs onnxruntime's com.microsoft contrib ops: re-split with "
                "--edge-graph plain for this runtime") if "com.microsoft" in first or "not a registered" in first else ""
        raise BundleError(f"{path}: onnxruntime cannot load it: {first}{hint}") from None


class _ConcatKV:
    """The plain graph's cache: 2N arrays [1, KVH, P, D], replaced by the graph's outputs every step."""

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int):
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.kv: list[np.ndarray] = []
        self.reset()

    @property
    def length(self) -> int:
        return int(self.kv[0].shape[2])

    def reset(self) -> None:
        empty = np.zeros((1, self.kv_heads, 0, self.head_dim), dtype=np.float32)  # [1, KVH, 0, D]
        self.kv = [empty] * (2 * self.n_layers)

    def truncate(self, n: int) -> None:
        self.kv = [np.ascontiguousarray(t[:, :, :n]) for t in self.kv]

    def rows(self, j: int, start: int, end: int) -> np.ndarray:
        return self.kv[j][0, :, start:end]  # [KVH, T, D]

    def append(self, blocks: list[list[np.ndarray]]) -> None:
        self.kv = [np.concatenate([t[0]] + [np.asarray(b[j], np.float32) for b in blocks], axis=1)[None]
                   for j, t in enumerate(self.kv)]  # [1, KVH, P', D]

    def run(self, session: ort.InferenceSession, ids: np.ndarray, extra: dict) -> np.ndarray:
        p, s, n = self.length, ids.shape[0], self.n_layers
        feeds = {"input_ids": ids[None], "position_ids": np.arange(p, p + s, dtype=np.int64)[None]}  # [1, S]
        for i in range(n):
            feeds[f"past_key.{i}"], feeds[f"past_value.{i}"] = self.kv[2 * i], self.kv[2 * i + 1]  # [1, KVH, P, D]
        feeds.update(extra)  # the embeddings inputs, when the graph has them
        names = ["hidden_states"] + [f"present_{kv}.{i}" for i in range(n) for kv in ("key", "value")]
        out = session.run(names, feeds)
        self.kv = out[1:]  # [1, KVH, P+S, D] each
        return out[0][0]  # [S, H]


class _SharedBufferKV:
    """The fused graph's cache: one buffer [1, KVH, C, D] per layer and tensor, bound once as past *and*
    present (GroupQueryAttention updates it in place); rows [0, length) are valid."""

    def __init__(self, sessions: list[ort.InferenceSession], n_layers: int, kv_heads: int, head_dim: int,
                 capacity: int, max_positions: int, scales: list[np.ndarray] | None = None):
        """``sessions``: the graphs that share this cache (one, or the decode and the prompt graph of a
        bundle with precision by phase), each with its own IO binding over the same buffers. ``scales``:
        int8 cache (``partition_tools.kv_quant``): 2N arrays [KVH, 1, D] (K, V per layer)."""
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.max_positions = max_positions
        self.scales = scales
        self.dtype = np.int8 if scales is not None else np.float32
        self.hidden_size = int(sessions[0].get_outputs()[0].shape[-1])
        self.bindings = {id(sess): sess.io_binding() for sess in sessions}
        # per binding: the bound output [1, S, H] of the last S it ran
        self._hidden: dict[int, tuple[np.ndarray, ort.OrtValue]] = {}
        self.length = 0
        self.buffers: list[np.ndarray] = []
        self._values: list[ort.OrtValue] = []  # share memory with ``buffers``
        self._allocate(min(capacity, max_positions))

    @property
    def capacity(self) -> int:
        return int(self.buffers[0].shape[2]) if self.buffers else 0

    def _allocate(self, capacity: int) -> None:
        old, n = self.buffers, self.length
        self.buffers = [np.zeros((1, self.kv_heads, capacity, self.head_dim), self.dtype)  # [1, KVH, C, D]
                        for _ in range(2 * self.n_layers)]
        for new, prev in zip(self.buffers, old):
            new[:, :, :n] = prev[:, :, :n]
        self._values = [ort.OrtValue.ortvalue_from_numpy(b) for b in self.buffers]
        for binding in self.bindings.values():
            for i in range(self.n_layers):
                for k, kind in enumerate(("key", "value")):
                    value = self._values[2 * i + k]
                    binding.bind_ortvalue_input(f"past_{kind}.{i}", value)
                    binding.bind_ortvalue_output(f"present_{kind}.{i}", value)

    def reserve(self, total: int) -> None:
        """Make room for ``total`` positions (one copy of the valid rows when the buffer grows)."""
        if total > self.max_positions:
            raise FrontError(f"{total} positions exceed the edge graph's {self.max_positions}")
        if total > self.capacity:
            self._allocate(min(max(2 * self.capacity, total), self.max_positions))

    def reset(self) -> None:
        self.length = 0

    def truncate(self, n: int) -> None:
        self.length = n  # rows past n are overwritten by the next step

    def rows(self, j: int, start: int, end: int) -> np.ndarray:
        rows = self.buffers[j][0, :, start:end]  # [KVH, T, D]
        return rows if self.scales is None else rows.astype(np.float32) * self.scales[j]

    def append(self, blocks: list[list[np.ndarray]]) -> None:
        total = self.length + sum(int(np.shape(b[0])[1]) for b in blocks)
        self.reserve(total)
        p = self.length
        for b in blocks:
            t = int(np.shape(b[0])[1])
            for j, arr in enumerate(b):
                if self.scales is not None:  # as the op stores a row: round to the grid, saturate
                    arr = np.clip(np.rint(np.asarray(arr, np.float32) / self.scales[j]), -128, 127)
                self.buffers[j][0, :, p:p + t] = arr  # [KVH, T, D]
            p += t
        self.length = total

    def run(self, session: ort.InferenceSession, ids: np.ndarray, extra: dict) -> np.ndarray:
        s = ids.shape[0]
        total = self.length + s
        self.reserve(total)
        b = self.bindings[id(session)]
        b.bind_cpu_input("input_ids", ids[None])  # [1, S]
        b.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))  # [1]
        b.bind_cpu_input("total_sequence_length", np.array(total, np.int32))  # []
        for name, value in extra.items():
            b.bind_cpu_input(name, value)
        hidden = self._hidden.get(id(session))
        if hidden is None or hidden[0].shape[1] != s:  # decode steps reuse one binding
            out = np.empty((1, s, self.hidden_size), np.float32)  # [1, S, H]
            hidden = self._hidden[id(session)] = (out, ort.OrtValue.ortvalue_from_numpy(out))
            b.bind_ortvalue_output("hidden_states", hidden[1])
        session.run_with_iobinding(b)
        self.length = total
        return hidden[0][0].copy()  # [S, H]: the bound buffer is overwritten by the next step


class FrontRuntime:
    """onnxruntime session over ``edge/front.onnx`` plus the sequence's KV cache for layers [0, N)."""

    def __init__(self, bundle_dir: str | Path, threads: int = 2, chunk: int = 128, verify: bool = True,
                 graph: str | Path | None = None, capacity: int = INITIAL_CAPACITY,
                 profile_prefix: str | None = None, prefill_graph: str | Path | None = "auto"):
        """``verify``: check the bundle's edge files, and the shared ones it holds (calibration), against the
        manifest's hashes first. ``graph``: another
        edge graph of this bundle's split in place of ``edge/front.onnx`` (how the partition tools score
        candidate quantizations of one split). ``capacity``: KV rows allocated up front by the fused graph.
        ``profile_prefix``: onnxruntime profiling on (``session.end_profiling()`` writes the JSON).
        ``prefill_graph``: the prompt-phase graph (module docstring, "Precision by phase"): ``"auto"`` = the
        bundle's ``edge/front_prefill.onnx`` when its manifest lists one and ``graph`` is not given, a path =
        that graph, None = one graph for every call."""
        if threads < 1 or chunk < 1 or capacity < 1:
            raise ValueError(f"threads ({threads}), chunk ({chunk}) and capacity ({capacity}) must be >= 1")
        self.bundle_dir = Path(bundle_dir)
        self.manifest = Manifest.load(self.bundle_dir)
        if verify:
            self.manifest.verify_files(self.bundle_dir, roles=EDGE_HALF_ROLES, if_present=("shared",))
        m = self.manifest
        self.n_layers = m.split_layer
        self.hidden_size = m.hidden_size
        self.kv_heads = m.num_kv_heads
        self.head_dim = m.head_dim
        self.vocab_size = m.vocab_size
        self.chunk = chunk
        self.capacity = capacity
        path = Path(graph) if graph is not None else self.bundle_dir / FRONT
        if not path.is_file():
            raise BundleError(f"{path}: missing (not an edge bundle?)")
        self.session = open_session(path, threads, profile_prefix)
        if prefill_graph == "auto":
            prefill_graph = self.bundle_dir / PREFILL_GRAPH if graph is None and PREFILL_GRAPH in m.artifacts else None
        self.prefill_session = self.session  # the prompt's graph (the same one unless precision by phase)
        if prefill_graph is not None:
            self.prefill_session = self._phase_session(Path(prefill_graph), threads, profile_prefix)
        names = {i.name for i in self.session.get_inputs()}
        self.fused = set(FUSED_INPUTS) <= names
        self.mrope = set(ROPE_INPUTS) <= names
        # media (GLM-4.1V images): the embeddings inputs, fed a no-op on text chunks
        self.embeds_input = set(EMBEDS_INPUTS) <= names
        kv_names = {f"past_{kv}.{i}" for i in range(self.n_layers) for kv in ("key", "value")}
        if self.fused:
            expected = kv_names | {"input_ids", *FUSED_INPUTS, *(ROPE_INPUTS if self.mrope else ()),
                                   *(EMBEDS_INPUTS if self.embeds_input else ())}
        else:
            expected = kv_names | {"input_ids", "position_ids", *(EMBEDS_INPUTS if self.embeds_input else ())}
        if names != expected:
            raise BundleError(f"{path}: inputs {sorted(names)[:4]}... do not match a {self.n_layers}-layer "
                              f"front graph")
        kv_shape = next(i.shape for i in self.session.get_inputs() if i.name == "past_key.0")  # [1, KVH, P, D]
        for axis, what, want in ((1, "num_kv_heads", self.kv_heads), (3, "head_dim", self.head_dim)):
            if isinstance(kv_shape[axis], int) and kv_shape[axis] != want:
                raise BundleError(f"{path}: the graph's KV has {what} {kv_shape[axis]}, the manifest says {want}")
        meta = self.session.get_modelmeta().custom_metadata_map
        self.max_positions = int(meta.get(MAX_POSITIONS_KEY, 1 << 20))
        self.mrope_params = json.loads(meta[MROPE_KEY]) if self.mrope else None
        self.kv_scales = None  # int8 KV graphs: 2N arrays [KVH, 1, D]
        if KV_SCALES_KEY in meta:
            sc = json.loads(meta[KV_SCALES_KEY])
            self.kv_scales = [np.asarray(sc[kind][i], np.float32)[:, None, :] for i in range(self.n_layers)
                              for kind in ("k", "v")]
        self.rope_delta = 0  # 3-D rope: a later token's position is its index + this (edge_client.mrope)
        self.stats = FrontStats()
        self._cache = self._new_cache()

    def _phase_session(self, path: Path, threads: int, profile_prefix: str | None) -> ort.InferenceSession:
        """The prompt-phase session over ``path``: it must take and return exactly what the decode graph does
        (same inputs, same KV element types), since both run on one KV cache."""
        if not path.is_file():
            raise BundleError(f"{path}: missing (the prompt-phase graph)")
        session = open_session(path, threads, profile_prefix and profile_prefix + "_prefill")

        def io(s: ort.InferenceSession) -> set[tuple[str, str]]:
            return {(a.name, a.type) for a in [*s.get_inputs(), *s.get_outputs()]}

        if io(session) != io(self.session):
            diff = sorted(io(session) ^ io(self.session))[:3]
            raise BundleError(f"{path}: inputs/outputs differ from the edge graph's ({diff}...); both phases "
                              "must share one KV cache")
        return session

    @property
    def phased(self) -> bool:
        """Whether the prompt runs through its own graph (precision by phase)."""
        return self.prefill_session is not self.session

    def _new_cache(self) -> _ConcatKV | _SharedBufferKV:
        if self.fused:
            sessions = [self.session] + ([self.prefill_session] if self.phased else [])
            return _SharedBufferKV(sessions, self.n_layers, self.kv_heads, self.head_dim, self.capacity,
                                   self.max_positions, self.kv_scales)
        return _ConcatKV(self.n_layers, self.kv_heads, self.head_dim)

    # -- cache state ------------------------------------------------------------------------------
    @property
    def graph_kind(self) -> str:
        """``fused`` (in-place KV through IO binding) or ``plain`` (the traced portable graph)."""
        return "fused" if self.fused else "plain"

    @property
    def length(self) -> int:
        """Positions held in the KV cache (the next token's position)."""
        return self._cache.length

    def fork(self) -> FrontRuntime:
        """A runtime for another sequence over the same loaded graph: an empty cache and its own stats."""
        other = object.__new__(FrontRuntime)
        for name in ("bundle_dir", "manifest", "n_layers", "hidden_size", "kv_heads", "head_dim", "vocab_size",
                     "chunk", "capacity", "session", "prefill_session", "fused", "mrope", "max_positions",
                     "mrope_params", "kv_scales", "embeds_input"):
            setattr(other, name, getattr(self, name))
        other.rope_delta = 0
        other.stats = FrontStats()
        other._cache = other._new_cache()
        return other

    def reset(self) -> None:
        self._cache.reset()
        self.rope_delta = 0

    def truncate(self, n: int) -> None:
        """Keep positions [0, n) of the cache (O(1) on the fused graph)."""
        if not 0 <= n <= self.length:
            raise FrontError(f"truncate({n}): the cache holds {self.length} positions")
        if n < self.length:
            self._cache.truncate(n)

    def kv_slice(self, start: int, end: int) -> list[np.ndarray]:
        """Copies of positions [start, end) of every layer's K and V: 2N arrays [KVH, end-start, D]."""
        if not 0 <= start <= end <= self.length:
            raise FrontError(f"kv_slice({start}, {end}): the cache holds {self.length} positions")
        return [np.array(self._cache.rows(j, start, end), dtype=np.float32) for j in range(2 * self.n_layers)]

    def extend_kv(self, blocks: list[list[np.ndarray]]) -> None:
        """Append stored positions (each block: 2N arrays [KVH, T, D], as ``kv_slice`` returns them)."""
        if not blocks:
            return
        shape = (self.kv_heads, self.head_dim)
        for b in blocks:
            if len(b) != 2 * self.n_layers:
                raise FrontError(f"KV block has {len(b)} arrays, expected {2 * self.n_layers}")
            t = np.shape(b[0])[1] if np.ndim(b[0]) == 3 else -1
            if any(np.shape(a) != (shape[0], t, shape[1]) for a in b):
                raise FrontError(f"KV block arrays must all be [{shape[0]}, T, {shape[1]}]")
        self._cache.append(blocks)

    # -- forward ---------------------------------------------------------------------------------
    def _rope_inputs(self, s: int) -> dict[str, np.ndarray]:
        """cos/sin [S, R/2] of text positions [len, len + S) (+ ``rope_delta`` after an image) for a 3-D rope
        graph (``edge_client.rope``)."""
        if not self.mrope:
            return {}
        return rope_feeds(np.arange(self.length, self.length + s) + self.rope_delta, self.mrope_params)

    def _run(self, ids: np.ndarray, positions: np.ndarray | None = None,
             embeds: np.ndarray | None = None, mask: np.ndarray | None = None, prompt: bool = True) -> np.ndarray:
        """One graph call; ``positions`` [3, S] explicit 3-D rope positions, ``embeds`` [S, H] rows used where
        ``mask`` [S] is True (see ``prefill_media``); ``prompt``: the prompt-phase graph, else the decode one."""
        s = ids.shape[0]
        extra = self._rope_inputs(s) if positions is None else rope_feeds(positions, self.mrope_params)
        if self.embeds_input:
            if embeds is None:
                embeds, mask = np.zeros((1, self.hidden_size), np.float32), np.zeros(1, np.bool_)
            extra["inputs_embeds"] = np.ascontiguousarray(embeds, np.float32)[None]  # [1, S, H] (or the no-op)
            extra["embeds_mask"] = np.ascontiguousarray(mask, np.bool_).reshape(1, -1, 1)  # [1, S, 1]
        t0 = time.perf_counter()
        hidden = self._cache.run(self.prefill_session if prompt else self.session, ids, extra)  # [S, H]
        self.stats.count(t0, ids.shape[0])
        return hidden

    def check_ids(self, ids) -> np.ndarray:
        """``ids`` as int64 [S]; FrontError for an id outside the vocabulary."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)  # [S]
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
            raise FrontError(f"token id {bad} out of range [0, {self.vocab_size})")
        return arr

    def prefill(self, ids, start_pos: int | None = None) -> np.ndarray:
        """Run tokens at positions [len, len + S) in chunks; returns boundary hidden states [S, H]."""
        arr = self.check_ids(ids)
        if start_pos is not None and start_pos != self.length:
            raise FrontError(f"prefill at position {start_pos}, but the cache holds {self.length}")
        if arr.size == 0:
            return np.zeros((0, self.hidden_size), dtype=np.float32)
        outs = [self._run(arr[i:i + self.chunk]) for i in range(0, arr.size, self.chunk)]
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=0)  # [S, H]

    def prefill_media(self, ids, positions: np.ndarray | None, embeds: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """``prefill`` of a prompt span holding media tokens (images, audio): ``embeds`` float32 [S, H] replace
        the token embeddings where ``mask`` [S] is True (the encoders' rows at their placeholder tokens);
        ``positions`` int [3, S]: the span's 3-D rope positions (GLM-4.1V, ``edge_client.mrope``), or None for
        text positions. Needs a graph with the embeddings input (``partition_tools.front_embeds``); returns
        boundary hidden states [S, H]."""
        outs = [h for _, h in self.prefill_media_chunks(ids, positions, embeds, mask)]
        if not outs:
            return np.zeros((0, self.hidden_size), dtype=np.float32)
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=0)  # [S, H]

    def prefill_media_chunks(self, ids, positions: np.ndarray | None, embeds: np.ndarray, mask: np.ndarray):
        """``prefill_media`` yielding ``(start_pos, hidden [n, H])`` per chunk (as ``prefill_chunks``)."""
        arr = self.check_ids(ids)
        s = arr.size
        if not self.embeds_input:
            raise FrontError("this edge graph takes no media (split without an encoder)")
        if positions is not None and not self.mrope:
            raise FrontError("3-D rope positions for a graph without multimodal RoPE")
        if (positions is not None and np.shape(positions) != (3, s)) or np.shape(embeds) != (s, self.hidden_size) \
                or np.shape(mask) != (s,):
            raise FrontError(f"prefill_media: positions [3, {s}], embeds [{s}, {self.hidden_size}] and mask "
                             f"[{s}] expected, got {np.shape(positions)}, {np.shape(embeds)}, {np.shape(mask)}")
        for i in range(0, s, self.chunk):
            j = min(i + self.chunk, s)
            media = bool(np.any(mask[i:j]))
            start = self.length
            yield start, self._run(arr[i:j], None if positions is None else positions[:, i:j],
                                   embeds[i:j] if media else None, mask[i:j] if media else None)

    def prefill_chunks(self, ids):
        """Like ``prefill`` but yields ``(start_pos, hidden [n, H])`` per chunk, so sending can overlap."""
        arr = self.check_ids(ids)
        for i in range(0, arr.size, self.chunk):
            start = self.length
            yield start, self._run(arr[i:i + self.chunk])

    def decode(self, token: int, pos: int | None = None) -> np.ndarray:
        """One token at position ``len`` through the decode graph; returns its boundary hidden state [1, H]."""
        if pos is not None and pos != self.length:
            raise FrontError(f"decode at position {pos}, but the cache holds {self.length}")
        return self._run(self.check_ids([token]), prompt=False)

    def step(self, ids) -> np.ndarray:
        """Tokens at positions [len, len + S) through the *decode* graph in one call (a speculative step's
        last token and k drafts; generated tokens): their boundary states [S, H]. Without a prompt-phase
        graph this is ``prefill`` in one chunk."""
        arr = self.check_ids(ids)
        if arr.size == 0:
            return np.zeros((0, self.hidden_size), dtype=np.float32)
        return self._run(arr, prompt=False)
