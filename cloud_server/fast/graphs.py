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

Off CUDA (or with ``use_graphs=False``) the same function runs eagerly, so the CPU tests cover the code
that is captured. Reference: gpt-fast / vLLM ``CUDAGraphRunner``; ``torch.cuda.CUDAGraph``.
"""

from __future__ import annotations

import torch

from .attention import DecodeWorkspace
from .glm import DecodeMeta, FastGLM
from .kv import NULL_BLOCK, KVPool

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class DecodeGraphs:
    def __init__(self, model: FastGLM, kv: KVPool, max_batch: int, max_blocks_per_seq: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, use_graphs: bool | None = None):
        if max_batch <= 0 or max_blocks_per_seq <= 0:
            raise ValueError("max_batch and max_blocks_per_seq must be positive")
        self.model, self.kv = model, kv
        dev = model.device
        self.use_graphs = dev.type == "cuda" if use_graphs is None else bool(use_graphs)
        if self.use_graphs and dev.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.buckets = sorted({b for b in buckets if 0 < b < max_batch} | {max_batch})
        self.max_batch = max_batch
        h = model.cfg.hidden_size
        self.hidden = torch.zeros(max_batch, h, dtype=model.dtype, device=dev)  # [B, H]
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)  # [B]
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)  # [B]
        self.block_tables = torch.full((max_batch, max_blocks_per_seq), NULL_BLOCK, dtype=torch.int32,
                                       device=dev)  # [B, MAXB]
        self.workspace = DecodeWorkspace(max_batch, model.local_heads, model.cfg.head_dim,
                                         max_blocks_per_seq * kv.block_size, dev, buckets=tuple(self.buckets))
        # 1 for live rows, 0 for padding: each step advances its live rows' position and length by this,
        # so an unchanged batch can run its next step with no metadata upload (:meth:`step_next`).
        self.advance = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self._live: tuple[int, int] | None = None  # (rows, bucket) the static buffers describe
        self.steps = 0  # steps run so far (a caller can tell whether anyone else stepped since its last step)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- the captured function --------------------------------------------------------------------
    def _step(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.kv.block_size
        pos = self.positions[:b]  # [b]
        tables = self.block_tables[:b]  # [b, MAXB]
        slots = tables.gather(1, (pos // bs)[:, None])[:, 0].long() * bs + pos % bs  # [b]
        meta = DecodeMeta(tables, self.seq_lens[:b], self.workspace)
        x = self.model.forward(self.hidden[:b], pos, slots, self.kv, meta)  # [b, H]
        logits = self.model.compute_logits(x)  # [b, V]
        ids = logits.argmax(dim=-1)  # [b] greedy; samplers with other settings read the logits
        self.positions[:b] += self.advance[:b]  # the static buffers now describe the next step
        self.seq_lens[:b] += self.advance[:b]
        return logits, ids

    def capture(self) -> None:
        """Capture every bucket (largest first, sharing one memory pool)."""
        if not self.use_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        main = torch.cuda.current_stream()
        for b in sorted(self.buckets, reverse=True):
            side = torch.cuda.Stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
                for _ in range(2):
                    self._step(b)
            main.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._step(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"decode batch {n} exceeds the largest bucket {self.max_batch}")

    # -- one step ---------------------------------------------------------------------------------
    def step(self, hidden: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
             block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [n, H], positions [n], seq_lens [n] (context incl. the new token), block_tables [n, w].

        Returns device views ``(logits [n, V], greedy ids [n])``, valid until the next step.
        """
        n, w = hidden.shape[0], block_tables.shape[1]
        if w > self.block_tables.shape[1]:
            raise ValueError(f"block table width {w} exceeds the captured {self.block_tables.shape[1]}")
        b = self.bucket_for(n) if self.use_graphs else n
        if n > self.max_batch:
            raise ValueError(f"decode batch {n} exceeds max_batch {self.max_batch}")
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
        return self._run(n, b)

    def step_next(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The next step of the same sequences as the last :meth:`step` (each one token further on): only the
        hidden states [n, H] are uploaded; positions and lengths were advanced by the previous replay."""
        n = hidden.shape[0]
        if self._live is None or self._live[0] != n:
            raise ValueError("step_next needs the same batch as the previous step; call step() first")
        self.hidden[:n].copy_(hidden, non_blocking=True)
        return self._run(n, self._live[1])

    def _run(self, n: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.steps += 1
        if not self.use_graphs:
            return self._step(n)
        self.graphs[b].replay()
        logits, ids = self.outputs[b]
        return logits[:n], ids[:n]
