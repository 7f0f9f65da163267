"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of the 28-layer half is ~290 kernel launches; issued one by one from Python they take longer
than the GPU needs to stream the weights at batch 1. Capturing the step once per bucket (1, 2, 4, ..., 128)
and replaying it costs one launch. A batch of ``n`` sequences runs in the smallest bucket ``b >= n``; rows
``[n, b)`` are padding that reads and writes only the pool's null block (:data:`kv.NULL_BLOCK`).

Everything a step needs lives in static device buffers the graphs were captured on: the boundary hidden
states [B, H], positions [B], context lengths [B] and block tables [B, MAXB]; the pool slot of each new token
is computed inside the graph from its position and block table. :meth:`DecodeGraphs.step` copies the step's
inputs into those buffers (asynchronously; from pinned host memory when the caller's tensors are there),
replays, and returns device views of the logits and greedy ids: the only host sync a serving loop needs is
reading the sampled ids. Each replay also advances its live rows' positions and lengths, so when the next
step carries the same sequences (the steady state of a decode batch) :meth:`DecodeGraphs.step_next` uploads
only the new hidden states (vLLM v1's "persistent batch" idea).

*Sampling in the graph* (``sampling``: the engine sampler's ``GraphSampling``): each decode bucket is captured a
second time with the sampler's rule after the logits, reading the composition's columns from static buffers
(``GraphSampling.load``); :meth:`DecodeGraphs.step_next_sampled` replays it: the sampling is part of the
step's one launch, and nothing of it runs on the host.

*Flat steps* (``flat_rows > 0``): a step that is not a pure decode step (a prompt chunk beside decode rows, as
the engine's chunked prefill schedules it) runs through the same captured function too, with one row per
position: a position ``p`` of a chunk is a query row whose context is ``[0, p]`` (its length ``p + 1``, its
sequence's block table), and the paged decode kernel attends each row on its own. Every layer stores all the
rows' keys before it attends, so a chunk's rows see each other causally. Graphs of up to ``max_batch +
flat_rows`` rows (buckets of 64) replay such steps; their lm_head runs on the first ``max_batch`` rows only (the
caller puts the rows it samples first). Eagerly, a mixed step of 28 layers is host-bound: its ~450 launches
took ~45 ms on the H200 host against ~9 ms of GPU work.

Off CUDA (or with ``use_graphs=False``) the same function runs eagerly, so the CPU tests cover the code
that is captured. Reference: gpt-fast / vLLM ``CUDAGraphRunner``; ``torch.cuda.CUDAGraph``.
"""

from __future__ import annotations

import math

import torch

from .attention import BLOCK_N, MAX_SPLITS, DecodeConfig, DecodeWorkspace
from .glm import DecodeMeta, FastGLM
from .kv import NULL_BLOCK, KVPool

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
FLAT_BUCKET = 64  # rows between two flat-step graphs
FLAT_SPLIT = 512  # tokens per split of a flat step's attention (its rows are many: few splits each suffice)


class DecodeGraphs:
    def __init__(self, model: FastGLM, kv: KVPool, max_batch: int, max_blocks_per_seq: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, use_graphs: bool | None = None, flat_rows: int = 0,
                 sampling=None):
        """``flat_rows``: rows beyond ``max_batch`` a flat step may have (0: no flat-step graphs); ``sampling``:
        ``(logits [b, V], argmax [b], positions [b]) -> (ids [b], missed [b])`` over static buffers, captured into
        a second graph per decode bucket (None: none)."""
        if max_batch <= 0 or max_blocks_per_seq <= 0 or flat_rows < 0:
            raise ValueError("max_batch and max_blocks_per_seq must be positive, flat_rows >= 0")
        self.model, self.kv = model, kv
        dev = model.device
        self.use_graphs = dev.type == "cuda" if use_graphs is None else bool(use_graphs)
        if self.use_graphs and dev.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.buckets = sorted({b for b in buckets if 0 < b < max_batch} | {max_batch})
        self.max_batch = max_batch
        self.max_rows = rows = max_batch + flat_rows  # the most rows a step (a flat one) may have
        self.flat_buckets = sorted({min(max_batch + FLAT_BUCKET * k, rows)
                                    for k in range(1, -(-flat_rows // FLAT_BUCKET) + 1)})
        h = model.cfg.hidden_size
        self.hidden = torch.zeros(rows, h, dtype=model.dtype, device=dev)  # [R, H]
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)  # [R]
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=dev)  # [R]
        self.block_tables = torch.full((rows, max_blocks_per_seq), NULL_BLOCK, dtype=torch.int32,
                                       device=dev)  # [R, MAXB]
        max_tokens = max_blocks_per_seq * kv.block_size
        self.workspace = DecodeWorkspace(max_batch, model.local_heads, model.cfg.head_dim, max_tokens, dev,
                                         buckets=tuple(self.buckets))
        self.flat_workspace = None  # flat steps: one (untuned) split size, scratch for its few splits per row
        if self.flat_buckets:
            split = max(FLAT_SPLIT, -(-max_tokens // (MAX_SPLITS * BLOCK_N)) * BLOCK_N)
            self.flat_workspace = DecodeWorkspace(rows, model.local_heads, model.cfg.head_dim, max_tokens, dev,
                                                  {b: DecodeConfig(split) for b in self.flat_buckets},
                                                  tuple(self.flat_buckets), math.ceil(max_tokens / split))
        # 1 for live rows, 0 for padding: each step advances its live rows' position and length by this,
        # so an unchanged batch can run its next step with no metadata upload (:meth:`step_next`).
        self.advance = torch.zeros(rows, dtype=torch.int32, device=dev)
        self._live: tuple[int, int] | None = None  # (rows, bucket) the static buffers describe
        self.steps = 0  # steps run so far (a caller can tell whether anyone else stepped since its last step)
        self.sampling = sampling
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (bucket, sampled)
        self.outputs: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}

    # -- the captured function --------------------------------------------------------------------
    def _step(self, b: int, sampled: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        bs = self.kv.block_size
        pos = self.positions[:b]  # [b]
        tables = self.block_tables[:b]  # [b, MAXB]
        slots = tables.gather(1, (pos // bs)[:, None])[:, 0].long() * bs + pos % bs  # [b]
        meta = DecodeMeta(tables, self.seq_lens[:b], self.workspace if b <= self.max_batch else self.flat_workspace)
        x = self.model.forward(self.hidden[:b], pos, slots, self.kv, meta)  # [b, H]
        logits = self.model.compute_logits(x[: self.max_batch])  # [min(b, max_batch), V]: a flat step's first rows
        ids = logits.argmax(dim=-1)  # greedy; samplers with other settings read the logits
        missed = None
        if sampled:  # the sampler's rule (its columns in static buffers): the tokens, and the rows to redraw
            ids, missed = self.sampling(logits, ids, pos)  # [b], [b]
        self.positions[:b] += self.advance[:b]  # the static buffers now describe the next step
        self.seq_lens[:b] += self.advance[:b]
        return logits, ids, missed

    def capture(self) -> None:
        """Capture every bucket, the flat steps' too (largest first, sharing one memory pool)."""
        if not self.use_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        main = torch.cuda.current_stream()
        kinds = [(b, False) for b in self.buckets + self.flat_buckets]
        if self.sampling is not None:
            kinds += [(b, True) for b in self.buckets]
        for key in sorted(kinds, reverse=True):
            side = torch.cuda.Stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
                for _ in range(2):
                    self._step(*key)
            main.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self._step(*key)
            self.graphs[key] = graph
        for key in self.graphs:  # one replay each (the static buffers hold padding rows: only the null block is
            self.graphs[key].replay()  # touched), so a bucket's first real step does not pay the graph's upload
        torch.cuda.synchronize()

    def bucket_for(self, n: int) -> int:
        for b in self.buckets + self.flat_buckets:
            if b >= n:
                return b
        raise ValueError(f"a step of {n} rows exceeds the largest bucket {self.max_rows}")

    # -- one step ---------------------------------------------------------------------------------
    def step(self, hidden: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
             block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [n, H], positions [n], seq_lens [n] (context incl. the new token), block_tables [n, w]; one row
        per query token (``n`` up to ``max_rows``: beyond ``max_batch`` a flat step).

        Returns device views ``(logits [min(n, max_batch), V], greedy ids)`` of the first rows, valid until the
        next step.
        """
        n, w = hidden.shape[0], block_tables.shape[1]
        if w > self.block_tables.shape[1]:
            raise ValueError(f"block table width {w} exceeds the captured {self.block_tables.shape[1]}")
        if n > self.max_rows:
            raise ValueError(f"a step of {n} rows exceeds max_rows {self.max_rows}")
        b = self.bucket_for(n) if self.use_graphs else n
        self.hidden[:n].copy_(hidden, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, :w].copy_(block_tables, non_blocking=True)
        if b > n:  # padding rows: position 0 of the null block
            self.positions[n:b].zero_()
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b, 0].fill_(NULL_BLOCK)
        if self._live != (n, b):
            self.advance[:n].fill_(1)
            self.advance[n:b].zero_()
            self._live = (n, b)
        return self._run(n, b)[:2]

    def step_next(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The next step of the same sequences as the last :meth:`step` (each one token further on): only the
        hidden states [n, H] are uploaded; positions and lengths were advanced by the previous replay."""
        return self._run(*self._next(hidden))[:2]

    def step_next_sampled(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`step_next` through the bucket's sampled graph: (logits [n, V], the sampled ids [n], missed [n]) of
        the columns ``sampling`` holds (its ``load``, before this call)."""
        if self.sampling is None:
            raise ValueError("these graphs were built without sampling")
        return self._run(*self._next(hidden), sampled=True)

    def _next(self, hidden: torch.Tensor) -> tuple[int, int]:
        n = hidden.shape[0]
        if self._live is None or self._live[0] != n:
            raise ValueError("step_next needs the same batch as the previous step; call step() first")
        self.hidden[:n].copy_(hidden, non_blocking=True)
        return n, self._live[1]

    def _run(self, n: int, b: int, sampled: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        self.steps += 1
        if not self.use_graphs:
            return self._step(n, sampled)
        self.graphs[b, sampled].replay()
        logits, ids, missed = self.outputs[b, sampled]
        return logits[:n], ids[:n], None if missed is None else missed[:n]
