"""FastGlmRunner: the GLM fast path behind the engine's ``ModelRunner.run(batch) -> logits`` interface.

The engine (``cloud_server.engine``) builds a flat :class:`~cloud_server.engine.model_runner.Batch` per step
and calls ``runner.run(batch)``; this runner computes the same float32 logits ``[S, V]`` with
:class:`FastGLM` instead of the library's modules:

* steps where every sequence brings one token (pure decode) replay a CUDA graph (:mod:`.graphs`);
* steps with prompt chunks of at most ``max_batch + flat_rows`` rows (a chunk beside the decode rows, as the
  engine's ``prefill_chunk_while_decoding`` schedules them) replay a graph too, as *flat steps*: one row per
  position, each attended by the paged decode kernel over its own context;
* anything else (longer prefill, GLM-4.1V 3-D image positions) runs eagerly: one pass over the weights for all
  rows, SDPA for the chunks and the paged decode kernel for the one-token rows.

It shares the engine's KV pool tensors (``KVCachePool.k`` [L, NB * BS, KVH, D] is viewed as
[L, NB, BS, KVH, D]: same memory; an 8-bit pool's scales likewise, ``--kv-cache-dtype int8 | fp8 | int8v``) and reserves block 0 as the graphs' padding block
(:attr:`reserved_blocks`, which the engine's block manager never hands out). The library's q/k/v weights
are re-pointed into the fused QKV tensor, so the fast path adds no weight memory.

Startup tuning: on CUDA (with Triton) the constructor first times the projection kernels and the decode
attention configs on this GPU (:func:`.tuning.tune`, ~30 s for the 9B half) and keeps the fastest, then
captures the graphs; ``tune=False`` skips it (cuBLAS and the heuristic split). On the CPU nothing is tuned.

Selection: :func:`fast_runner_factory` returns the engine's ``make_runner`` hook: the fast runner for float
variants of GLM-4 / GLM-4.1V models on CUDA (and on the CPU with ``EngineConfig.fast_path=True``), at any
tensor-parallel size (over the shard ``cloud_server.tp.shard_model`` made), the library's ``ModelRunner``
otherwise.
"""

from __future__ import annotations

import numpy as np
import torch

from .config import FAST_MODEL_TYPES, UnsupportedFastPath
from .glm import FastGLM, PrefillMeta
from .graphs import DecodeGraphs
from .kv import NULL_BLOCK, KVPool
from .tuning import DEFAULT_CONTEXT
from .tuning import tune as tune_for_device


def _alias_qkv(layers, fast: FastGLM) -> None:
    """Point the library's q/k/v weights and biases at slices of the fused tensors (frees the originals)."""
    d = fast.cfg.head_dim
    q, kv = fast.local_heads * d, fast.local_kv_heads * d  # this rank's rows of the fused [q; k; v]
    for layer, fl in zip(layers, fast.layers, strict=True):
        sa = layer.self_attn
        for proj, lo, hi in ((sa.q_proj, 0, q), (sa.k_proj, q, q + kv), (sa.v_proj, q + kv, q + 2 * kv)):
            if proj.weight.dtype == fl.qkv_weight.dtype and proj.weight.device == fl.qkv_weight.device:
                proj.weight.data = fl.qkv_weight.data[lo:hi]
                if proj.bias is not None and fl.qkv_bias is not None:
                    proj.bias.data = fl.qkv_bias.data[lo:hi]


class FastGlmRunner:
    """Runs one GLM ``CloudModel`` (a float variant; on a tensor-parallel rank, its shard) against the engine's
    ``KVCachePool``."""

    reserved_blocks = (NULL_BLOCK,)

    def __init__(self, model, pool, max_batch: int = 64, max_model_len: int = 8192,
                 use_graphs: bool | None = None, backend: str | None = None, tune: bool = True,
                 tune_context: int = DEFAULT_CONTEXT, flat_rows: int = 0, flat_steps: bool | None = None):
        """``flat_rows``: prompt positions a step beside up to ``max_batch`` decode rows may add and still replay a
        graph (the engine's ``prefill_chunk_while_decoding``); ``flat_steps``: run steps that are not pure decode
        steps, up to ``max_batch + flat_rows`` rows, as flat steps (:mod:`.graphs`); None: where graphs run."""
        if getattr(model, "variant", None) == "int8":
            raise UnsupportedFastPath("the GLM fast path runs float variants (bf16/fp16/fp32), not int8")
        if max_batch <= 0 or max_model_len <= 0:
            raise ValueError("max_batch and max_model_len must be positive")
        self.model, self.pool = model, pool
        self.device = pool.k.device
        self._pin = self.device.type == "cuda"  # page-locked staging buffers for the per-step uploads
        self.fast = FastGLM.from_modules(model.layers, model.norm, model.lm_head, model.config, dtype=model.dtype,
                                         device=self.device, backend=backend, tp=getattr(model, "tp", None))
        _alias_qkv(model.layers, self.fast)
        self.kv = KVPool.view_of(pool, model.dtype)  # [L, NB, BS, KVH / tp, D] (+ an 8-bit pool's scales)
        if self.kv.k.shape[3] != self.fast.local_kv_heads:
            raise ValueError(f"the KV pool holds {self.kv.k.shape[3]} KV heads, this rank runs "
                             f"{self.fast.local_kv_heads}")
        self.max_blocks = -(-max_model_len // pool.block_size)
        graphs_on = self.device.type == "cuda" if use_graphs is None else bool(use_graphs)
        self.flat_steps = graphs_on if flat_steps is None else bool(flat_steps)
        from cloud_server.engine.sampler import GraphSampling  # (the engine's rule; imported here: fast -> engine)

        self.sampling = GraphSampling(max_batch, self.device)
        self.graphs = DecodeGraphs(self.fast, self.kv, max_batch, self.max_blocks, use_graphs=use_graphs,
                                   flat_rows=flat_rows if self.flat_steps else 0, sampling=self.sampling)
        # what the startup tuning measured and chose (None: not tuned, e.g. on the CPU)
        self.tuning = tune_for_device(self.fast, self.kv, self.graphs, tune_context) if tune else None
        self.graphs.capture()
        if self._pin:  # page-locked staging of the largest graph step, once: its first use mid-serving then finds
            rows = self.graphs.max_rows  # the blocks cached instead of paying a cudaHostAlloc
            for shape, dtype in (((rows, self.fast.cfg.hidden_size), torch.float32), ((3, rows), torch.int64),
                                 ((max_batch, self.max_blocks), torch.int32)):
                self._staged(shape, dtype)
        # the last decode batch: (block tables, context lens, graphs.steps after it), for _continues
        self._last_decode: tuple[list[list[int]], list[int], int] | None = None

    def _staged(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer to fill and upload: page-locked on CUDA, so the copy is a true async DMA.

        Taken from PyTorch's caching host allocator, which records the copy's stream event and does not hand
        the block out again before the copy is done, so refilling next step is safe without a sync."""
        return torch.empty(shape, dtype=dtype, pin_memory=self._pin)

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Where the engine's ``build_batch`` concatenates a step's hidden states: the staging buffer itself, so
        they go up without another host copy."""
        return self._staged(shape, dtype)

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device (through a pinned staging buffer on CUDA, unless it is one); device
        tensors pass through."""
        if t.device == self.device or not self._pin or t.is_pinned():
            return t.to(self.device, non_blocking=True)
        staged = self._staged(tuple(t.shape), t.dtype)
        staged.copy_(t)
        return staged.to(self.device, non_blocking=True)

    def _tables(self, tables: list[list[int]], width: int = 1) -> torch.Tensor:
        """Block tables [B, W] int32 on the device, padded with the null block to at least ``width`` columns."""
        width = max(width, max(len(t) for t in tables))
        staged = self._staged((len(tables), width), torch.int32)
        arr = staged.numpy()
        arr.fill(NULL_BLOCK)
        for i, t in enumerate(tables):
            arr[i, : len(t)] = t
        return staged.to(self.device, non_blocking=True)  # [B, W] int32

    def _continues(self, batch) -> bool:
        """``batch`` is the previous decode batch one position further on: the same rows, block tables unchanged,
        every context one longer, and no other step of the graphs since. Their static buffers then already
        describe it (each replay advances its rows' positions and lengths), so the step uploads only the hidden
        states (vLLM's persistent batch)."""
        if self._last_decode is None:
            return False
        tables, lens, steps = self._last_decode
        return (steps == self.graphs.steps and len(lens) == len(batch.context_lens) and batch.block_tables == tables
                and all(a == b + 1 for a, b in zip(batch.context_lens, lens)))

    @torch.inference_mode()
    def run(self, batch) -> torch.Tensor:
        """Forward an engine ``Batch``; float32 logits [S, V] for ``batch.logits_indices``."""
        fast, dev = self.fast, self.device
        if batch.hidden is not None:
            hidden = self._upload(batch.hidden).to(dtype=fast.dtype)  # [T, H]
        else:
            if self.model.embed_tokens is None:
                raise ValueError("this model has no token embeddings (split mode expects hidden states)")
            hidden = self.model.embed_tokens(self._upload(batch.input_ids)).to(fast.dtype)  # [T, H]
        nseq = len(batch.query_lens)
        num_rows = int(batch.logits_indices.shape[0])
        rope = getattr(batch, "rope_positions", None)  # [3, T] GLM-4.1V image positions, or None
        if rope is not None and bool((rope == batch.positions[None]).all()):
            rope = None  # text positions on all three axes: plain 1-D rope
        if rope is None and all(q == 1 for q in batch.query_lens) and nseq <= self.graphs.max_batch:
            if self._continues(batch):  # the last decode batch one position on: only the hidden states go up
                logits, _ = self.graphs.step_next(hidden)  # [B, V]
            else:
                lens = self._staged((nseq,), torch.int32)
                lens.numpy()[:] = batch.context_lens
                logits, _ = self.graphs.step(hidden, self._upload(batch.positions), lens.to(dev, non_blocking=True),
                                             self._tables(batch.block_tables))  # [B, V]
            self._last_decode = (batch.block_tables, batch.context_lens, self.graphs.steps)
            if num_rows == nseq and batch.logits_indices.tolist() == list(range(nseq)):  # every row, in order
                return logits.float() if logits.dtype != torch.float32 else logits.clone()
            return logits[self._upload(batch.logits_indices)].float()
        if (rope is None and self.flat_steps and hidden.shape[0] <= self.graphs.max_rows
                and nseq <= self.graphs.max_batch and num_rows <= self.graphs.max_batch):
            return self._run_flat(batch, hidden, num_rows)
        rows = self._upload(batch.logits_indices)  # [S]
        # full-width tables [B, MAXB], as the graphs have: a mixed step's decode rows then launch the decode kernel
        # the graphs compiled (its specialization depends on the table width); a table width growing with each
        # prefill chunk made every chunk of a long prompt JIT-compile a new kernel (~0.6 s a step on the H200)
        positions, tables = self._upload(batch.positions), self._tables(batch.block_tables, self.max_blocks)
        meta = PrefillMeta.build(batch.query_lens, batch.context_lens, tables, split_decode=True,
                                 workspace=self.graphs.workspace if nseq <= self.graphs.max_batch else None,
                                 block_size=self.kv.block_size)
        x = fast.forward(hidden, positions, self._upload(batch.slot_mapping), self.kv, meta,
                         None if rope is None else self._upload(rope))  # [T, H]
        return fast.compute_logits(x[rows]).float()


    samples_in_graph = True  # continue_decode samples a composition the sampler's graph_columns describe
    time_replays = False  # set by an engine with metrics on CUDA: continue_decode records replay_event (below)
    replay_event = None  # a CUDA timing event recorded just before the steady step's replay

    @torch.inference_mode()
    def continue_decode(self, hidden: torch.Tensor, grown: list[tuple[int, int, int]] = (),
                        order: list[int] | None = None, sampling=None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """The engine's steady decode step: the rows of the last decode batch, each one position on (the caller
        knows: the same sequences in the same order, every row sampled), given only their hidden states (host,
        float32 or float16, widened by the graph's input copy on the device; page-locked ones go up without another
        copy): ``hidden`` [n, H], or with ``order`` (the batch's
        rows as indices into ``hidden`` [N, H]) picked on the device after the upload; and the blocks appended to
        their tables since, ``(row, column, block)`` each: written into the graphs' tables (one small upload), so a
        row crossing into a new block does not end the persistent batch.

        ``sampling`` (the engine sampler's ``GraphColumns`` of this composition, or None): the step replays the
        bucket's sampled graph with them loaded.

        Returns (logits [n, V], ids [n], missed [n] or None) on the device, or None when another step of the graphs
        ran since (the caller then runs the full batch). Without ``sampling`` the ids are the argmax the graph
        computed (lowest id on ties), so a greedy batch needs no pass of its own over the logits, and missed is
        None; with it, the sampled ids and the rows to redraw (``GraphSampling``). The logits are in the model's
        dtype (no float32 copy of [n, V] for a greedy batch): a bf16/fp16 graph output the next step overwrites,
        so the caller reads them before it launches another step (a float32 model's are a copy)."""
        last = self._last_decode
        n = hidden.shape[0] if order is None else len(order)
        if last is None or last[2] != self.graphs.steps or len(last[1]) != n:
            return None
        if grown:
            tables = last[0]
            if any(c != len(tables[r]) or c >= self.max_blocks for r, c, _ in grown):
                return None  # not an append within the graphs' width: the full batch decides
            for r, _, b in grown:
                tables[r].append(b)  # (the runner's own copies of the batch's tables, for _continues)
            rcb = self._upload(torch.tensor(grown, dtype=torch.long))  # [k, 3]
            self.graphs.block_tables[rcb[:, 0], rcb[:, 1]] = rcb[:, 2].to(torch.int32)
        x = self._upload(hidden)  # [n, H] (with order: [N, H])
        if order is not None:
            x = x[self._upload(torch.tensor(order, dtype=torch.long))]  # [n, H]
        if self.time_replays:  # the engine's device-time metric: this step's span starts at its replay
            self.replay_event = torch.cuda.Event(enable_timing=True)
            self.replay_event.record()
        if sampling is None:
            (logits, ids), missed = self.graphs.step_next(x), None  # [n, V], [n]; the copy into the input casts
        else:
            self.sampling.load(sampling)
            logits, ids, missed = self.graphs.step_next_sampled(x)  # [n, V], [n], [n]
        self._last_decode = (last[0], [c + 1 for c in last[1]], self.graphs.steps)
        return (logits.clone() if logits.dtype == torch.float32 else logits), ids, missed

    def _run_flat(self, batch, hidden: torch.Tensor, num_rows: int) -> torch.Tensor:
        """A step with prompt chunks as a flat step (:mod:`.graphs`): one row per position, each attending to its
        context ``[0, position]`` through its sequence's block table; the rows whose logits are wanted first, in
        order. hidden [T, H] on the device -> float32 logits [S, V]."""
        t = hidden.shape[0]
        wanted = batch.logits_indices.numpy()  # [S] rows of the batch, in order
        rest = np.ones(t, dtype=bool)
        rest[wanted] = False
        staged = self._staged((3, t), torch.int64)
        meta = staged.numpy()
        meta[0, :num_rows], meta[0, num_rows:] = wanted, np.flatnonzero(rest)  # graph row -> batch row
        meta[1] = np.repeat(np.arange(len(batch.query_lens)), batch.query_lens)[meta[0]]  # each row's sequence
        meta[2] = batch.positions.numpy()[meta[0]]  # each row's position
        perm, seq, pos = staged.to(self.device, non_blocking=True)  # [T] each
        tables = self._tables(batch.block_tables, self.max_blocks)[seq]  # [T, MAXB]
        logits, _ = self.graphs.step(hidden[perm], pos, (pos + 1).to(torch.int32), tables)  # [min(T, B), V]
        return logits[:num_rows].float()


def fast_path_supported(model, device: str, fast_path: bool | None = None) -> bool:
    """A GLM-4 / GLM-4.1V float variant (sharded or not), on CUDA, or on the CPU when ``fast_path`` is True
    (the plain-torch kernels); never when ``fast_path`` is False."""
    cfg = getattr(model, "config", None)
    where = str(device).startswith("cuda") if fast_path is None else fast_path
    return (where and getattr(model, "variant", None) != "int8" and not getattr(model, "returns_states", False)
            and getattr(cfg, "model_type", None) in FAST_MODEL_TYPES)  # a u-shape middle has no lm_head to fuse


def fast_runner_factory(engine_config):
    """The engine's ``make_runner(index, model, pool)``: the fast path where :func:`fast_path_supported`
    (``engine_config.fast_path``), the library's ``ModelRunner`` elsewhere. Every tensor-parallel rank builds its
    runners with this, so all ranks take the same path."""
    from cloud_server.engine.model_runner import ModelRunner

    def make_runner(index, model, pool):
        if fast_path_supported(model, engine_config.device, engine_config.fast_path):
            return FastGlmRunner(model, pool, max_batch=engine_config.max_num_seqs,
                                 max_model_len=engine_config.max_model_len,
                                 flat_rows=engine_config.prefill_chunk_while_decoding)
        return ModelRunner(model, pool, batch_invariant=engine_config.batch_invariant)

    return make_runner
