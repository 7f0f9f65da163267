"""The edge front: embeddings + decoder layers [0, N) of a bundle, run in onnxruntime with our own KV cache.

Contract (one sequence at a time, positions are absolute and contiguous):

* ``prefill(ids)`` runs the tokens at positions ``[len, len + S)`` in chunks of ``chunk`` tokens and returns
  the boundary hidden states ``[S, H]``; ``decode(token)`` is the one-token case ``[1, H]``.
* The KV cache is a list of ``2N`` float32 arrays ``[1, KVH, P, D]`` (``past_key.i``, ``past_value.i`` as
  the graph names them, see ``partition_tools.export``); ``len`` is ``P``.
* ``truncate(n)`` rolls the cache back to the first ``n`` positions (a new prompt that shares a prefix with
  the last one, or a rejected speculative step); ``kv_slice(a, b)`` / ``extend_kv(blocks)`` copy positions
  out and back in, which is how the activation cache stores and restores prefixes.

Only numpy and onnxruntime: this module runs on the phone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from shared.manifest import BundleError, Manifest

FRONT = "edge/front.onnx"


class FrontError(Exception):
    """Bad input to the front runtime (token id out of range, position mismatch); one-line message."""


@dataclass(slots=True)
class FrontStats:
    """Cumulative edge compute: what the activation cache saves is measured here."""

    forward_calls: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def snapshot(self) -> FrontStats:
        return FrontStats(self.forward_calls, self.tokens, self.seconds)


class FrontRuntime:
    """onnxruntime session over ``edge/front.onnx`` plus the sequence's KV cache for layers [0, N)."""

    def __init__(self, bundle_dir: str | Path, threads: int = 2, chunk: int = 128, verify: bool = True):
        if threads < 1 or chunk < 1:
            raise ValueError(f"threads ({threads}) and chunk ({chunk}) must be >= 1")
        self.bundle_dir = Path(bundle_dir)
        self.manifest = Manifest.load(self.bundle_dir)
        if verify:
            self.manifest.verify_files(self.bundle_dir, roles=("edge",))
        m = self.manifest
        self.n_layers = m.split_layer
        self.hidden_size = m.hidden_size
        self.kv_heads = m.num_kv_heads
        self.head_dim = m.head_dim
        self.vocab_size = m.vocab_size
        self.chunk = chunk
        path = self.bundle_dir / FRONT
        if not path.is_file():
            raise BundleError(f"{path}: missing (not an edge bundle?)")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
            raise BundleError(f"{path}: onnxruntime cannot load it: {str(e).splitlines()[0]}") from None
        names = [i.name for i in self.session.get_inputs()]
        expected = ["input_ids", "position_ids"] + [f"past_{kv}.{i}" for i in range(self.n_layers)
                                                    for kv in ("key", "value")]
        if sorted(names) != sorted(expected):
            raise BundleError(f"{path}: inputs {names[:4]}... do not match a {self.n_layers}-layer front graph")
        self.output_names = ["hidden_states"] + [f"present_{kv}.{i}" for i in range(self.n_layers)
                                                 for kv in ("key", "value")]
        self.stats = FrontStats()
        self.kv: list[np.ndarray] = []
        self.reset()

    # -- cache state ------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Positions held in the KV cache (the next token's position)."""
        return int(self.kv[0].shape[2])

    def reset(self) -> None:
        empty = np.zeros((1, self.kv_heads, 0, self.head_dim), dtype=np.float32)  # [1, KVH, 0, D]
        self.kv = [empty] * (2 * self.n_layers)

    def truncate(self, n: int) -> None:
        """Keep positions [0, n) of the cache."""
        if not 0 <= n <= self.length:
            raise FrontError(f"truncate({n}): the cache holds {self.length} positions")
        if n < self.length:
            self.kv = [np.ascontiguousarray(t[:, :, :n]) for t in self.kv]

    def kv_slice(self, start: int, end: int) -> list[np.ndarray]:
        """Copies of positions [start, end) of every layer's K and V: 2N arrays [KVH, end-start, D]."""
        if not 0 <= start <= end <= self.length:
            raise FrontError(f"kv_slice({start}, {end}): the cache holds {self.length} positions")
        return [np.array(t[0, :, start:end], dtype=np.float32) for t in self.kv]

    def extend_kv(self, blocks: list[list[np.ndarray]]) -> None:
        """Append stored positions (each block: 2N arrays [KVH, T, D], as ``kv_slice`` returns them)."""
        if not blocks:
            return
        for b in blocks:
            if len(b) != 2 * self.n_layers:
                raise FrontError(f"KV block has {len(b)} arrays, expected {2 * self.n_layers}")
        new = []
        for j, t in enumerate(self.kv):
            parts = [t[0]] + [np.asarray(b[j], dtype=np.float32) for b in blocks]  # each [KVH, T, D]
            new.append(np.concatenate(parts, axis=1)[None])  # [1, KVH, P', D]
        self.kv = new

    # -- forward ---------------------------------------------------------------------------------
    def _run(self, ids: np.ndarray) -> np.ndarray:
        s = ids.shape[0]
        p = self.length
        feeds = {
            "input_ids": ids[None],  # [1, S]
            "position_ids": np.arange(p, p + s, dtype=np.int64)[None],  # [1, S]
        }
        for i in range(self.n_layers):
            feeds[f"past_key.{i}"] = self.kv[2 * i]  # [1, KVH, P, D]
            feeds[f"past_value.{i}"] = self.kv[2 * i + 1]
        t0 = time.perf_counter()
        out = self.session.run(self.output_names, feeds)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.forward_calls += 1
        self.stats.tokens += s
        self.kv = out[1:]  # [1, KVH, P+S, D] each
        return out[0][0]  # [S, H]

    def _check_ids(self, ids) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)  # [S]
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
            raise FrontError(f"token id {bad} out of range [0, {self.vocab_size})")
        return arr

    def prefill(self, ids, start_pos: int | None = None) -> np.ndarray:
        """Run tokens at positions [len, len + S) in chunks; returns boundary hidden states [S, H]."""
        arr = self._check_ids(ids)
        if start_pos is not None and start_pos != self.length:
            raise FrontError(f"prefill at position {start_pos}, but the cache holds {self.length}")
        if arr.size == 0:
            return np.zeros((0, self.hidden_size), dtype=np.float32)
        outs = [self._run(arr[i:i + self.chunk]) for i in range(0, arr.size, self.chunk)]
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=0)  # [S, H]

    def prefill_chunks(self, ids):
        """Like ``prefill`` but yields ``(start_pos, hidden [n, H])`` per chunk, so sending can overlap."""
        arr = self._check_ids(ids)
        for i in range(0, arr.size, self.chunk):
            start = self.length
            yield start, self._run(arr[i:i + self.chunk])

    def decode(self, token: int, pos: int | None = None) -> np.ndarray:
        """One token at position ``len``; returns its boundary hidden state [1, H]."""
        if pos is not None and pos != self.length:
            raise FrontError(f"decode at position {pos}, but the cache holds {self.length}")
        return self._run(self._check_ids([token]))
