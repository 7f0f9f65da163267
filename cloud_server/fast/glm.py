"""FastGLM: the cloud half's GLM-4 / GLM-4.1V-text decoder layers written out in plain PyTorch + fused kernels.

Contract. ``forward(hidden [T, H], positions [T], slots [T], kv, meta) -> [T, H]`` runs all layers of this
half over a flat batch of tokens (several sequences, any mix of lengths), stores each token's keys and
values at its pool ``slots``, and returns the *final-normed* hidden states; ``compute_logits`` applies the
lm_head to the rows that need a next token. ``meta`` is :class:`DecodeMeta` (one token per sequence; the
paged decode kernel) or :class:`PrefillMeta` (query chunks; SDPA). It computes the same function as the
library's layers (``Glm4DecoderLayer`` / ``Glm4vTextDecoderLayer``): the tests check fp32 equality on the
tiny presets, and decode == prefill.

What differs from the library, for speed only:
* q/k/v projections fused into one [(Hq + 2 KVH) D, H] matrix (one GEMM + bias), gate and up already are;
* one kernel each for RoPE + KV store, residual-add + the two norms around it, and SiLU-mul
  (:mod:`.kernels`): ten kernels a layer instead of ~40;
* rotary cos/sin from a table built once with the library's formula (``position * inv_freq`` in fp32);
* the residual stream is updated in place, so one decode step allocates nothing new after warm-up (the
  precondition for CUDA graphs, :mod:`.graphs`).

Tensor parallelism: built from layers that ``cloud_server.tp.shard_model`` sharded (``tp`` is that model's
:class:`~cloud_server.tp.TPShard`), each rank holds its heads, KV heads, MLP channels and vocabulary rows;
``forward`` then all-reduces after the two row-parallel products (``all_reduce``, swappable for another
implementation of the same sum) and ``compute_logits`` all-gathers the vocabulary shards.

References: GLM-4.1V-Thinking (Hong et al., 2025) for the architecture; gpt-fast (PyTorch team, 2023)
for the shape of a fast plain-PyTorch decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import kernels
from .attention import DecodeWorkspace, chunk_context_slots, decode_attention, prefill_attention
from .config import FastGLMConfig
from .kv import KVPool
from .linear import LinearChooser


@dataclass(slots=True)
class DecodeMeta:
    """One new token per sequence: row i of the batch is sequence i."""

    block_tables: torch.Tensor  # [B, MAXB] int32
    seq_lens: torch.Tensor  # [B] int32, context length including the new token
    workspace: DecodeWorkspace | None = None  # split partials for the Triton kernel


@dataclass(slots=True)
class PrefillMeta:
    """Query chunks: sequence i contributes ``query_lens[i]`` consecutive rows ending at ``context_lens[i] - 1``.

    A mixed step (decode steps beside prefill chunks, as the engine's scheduler builds them) routes its
    one-token sequences through the decode kernel: :meth:`build` fills ``decode_*`` for those.
    """

    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor | None = None  # [B, MAXB] int32; needed when a chunk follows cached context
    decode_seqs: frozenset[int] = frozenset()  # sequences with one query token
    decode_rows: torch.Tensor | None = None  # [n] int64 rows of those tokens
    decode_seq_lens: torch.Tensor | None = None  # [n] int32
    workspace: DecodeWorkspace | None = None
    decode_block_tables: torch.Tensor | None = None  # [n, MAXB] int32: those sequences' rows of block_tables
    # pool slots [cl] of the context of each chunk that follows cached context (by sequence), once per step
    context_slots: dict[int, torch.Tensor] | None = None

    def __post_init__(self):
        if len(self.query_lens) != len(self.context_lens):
            raise ValueError("query_lens and context_lens must have one entry per sequence")
        if any(q <= 0 or c < q for q, c in zip(self.query_lens, self.context_lens)):
            raise ValueError(f"need 0 < query_len <= context_len, got {self.query_lens} / {self.context_lens}")

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: torch.Tensor | None,
              split_decode: bool = False, workspace: DecodeWorkspace | None = None,
              block_size: int = 0) -> PrefillMeta:
        """With ``split_decode`` (and more than one sequence), one-token sequences take the decode kernel.
        ``block_size`` (the pool's): the context slots of chunks after cached context are found here, once for
        all layers (0: each layer finds them)."""
        def slots(skip=frozenset()):
            if not block_size or block_tables is None:
                return None
            return chunk_context_slots(block_tables, block_size, query_lens, context_lens, skip)

        if not split_decode or block_tables is None or len(query_lens) < 2 or 1 not in query_lens:
            return cls(list(query_lens), list(context_lens), block_tables, context_slots=slots())
        dev = block_tables.device
        starts = [0]
        for q in query_lens[:-1]:
            starts.append(starts[-1] + q)
        seqs = [i for i, q in enumerate(query_lens) if q == 1]
        rows = torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=dev)
        lens = torch.tensor([context_lens[i] for i in seqs], dtype=torch.int32, device=dev)
        # gathered once per step, not per layer
        dec_tables = block_tables[torch.tensor(seqs, dtype=torch.long, device=dev)]  # [n, MAXB]
        return cls(list(query_lens), list(context_lens), block_tables, frozenset(seqs), rows, lens, workspace,
                   dec_tables, slots(frozenset(seqs)))


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


class FastLayer(nn.Module):
    """One GLM decoder layer's weights, fused: qkv [(Hq+2KVH)D, H] (+ bias), o [H, HqD], gate_up [2I, H], down [H, I]."""

    def __init__(self, qkv_weight, qkv_bias, o_weight, gate_up_weight, down_weight, input_ln, post_self_attn_ln,
                 post_attention_ln, post_mlp_ln):
        super().__init__()
        self.qkv_weight = _param(qkv_weight)
        self.qkv_bias = _param(qkv_bias)
        self.o_weight = _param(o_weight)
        self.gate_up_weight = _param(gate_up_weight)
        self.down_weight = _param(down_weight)
        self.input_ln = _param(input_ln)
        self.post_self_attn_ln = _param(post_self_attn_ln)
        self.post_attention_ln = _param(post_attention_ln)
        self.post_mlp_ln = _param(post_mlp_ln)

    @classmethod
    def from_hf(cls, layer, dtype, device) -> FastLayer:
        """From a ``Glm4DecoderLayer`` / ``Glm4vTextDecoderLayer``."""
        sa, mlp = layer.self_attn, layer.mlp

        def cvt(t):
            return None if t is None else t.detach().to(device=device, dtype=dtype)

        qkv_w = torch.cat([cvt(sa.q_proj.weight), cvt(sa.k_proj.weight), cvt(sa.v_proj.weight)])
        qkv_b = None
        if sa.q_proj.bias is not None:
            qkv_b = torch.cat([cvt(sa.q_proj.bias), cvt(sa.k_proj.bias), cvt(sa.v_proj.bias)])
        return cls(qkv_w, qkv_b, cvt(sa.o_proj.weight).contiguous(), cvt(mlp.gate_up_proj.weight).contiguous(),
                   cvt(mlp.down_proj.weight).contiguous(), cvt(layer.input_layernorm.weight),
                   cvt(layer.post_self_attn_layernorm.weight), cvt(layer.post_attention_layernorm.weight),
                   cvt(layer.post_mlp_layernorm.weight))


class FastGLM(nn.Module):
    def __init__(self, cfg: FastGLMConfig, layers: list[FastLayer], norm_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, backend: str | None = None, tp=None):
        super().__init__()
        if len(layers) != cfg.num_layers:
            raise ValueError(f"config says {cfg.num_layers} layers, got {len(layers)}")
        self.cfg = cfg
        self.layers = nn.ModuleList(layers)
        self.norm_weight = _param(norm_weight)
        self.lm_head_weight = _param(lm_head_weight)  # [V / tp, H]
        device = norm_weight.device
        self.backend = kernels.check_backend(backend or kernels.default_backend(device))
        # Tensor parallel: the shard's group (None: one rank); ``all_reduce(x)`` returns x [T, H] summed over ranks.
        self.tp = tp
        self.tp_size = 1 if tp is None else tp.world
        self.all_reduce = None if tp is None else tp.all_reduce
        self.linear = LinearChooser()  # cuBLAS, or the Triton skinny GEMM where measured faster (linear.py)
        # cos/sin table [max_position, rotary_dim / 2] in fp32, computed as the library's rotary embedding does.
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float) / cfg.rotary_dim))
        freqs = torch.arange(cfg.max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        self.register_buffer("rope_cos", freqs.cos().to(device), persistent=False)
        self.register_buffer("rope_sin", freqs.sin().to(device), persistent=False)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_modules(cls, layers, norm, lm_head, config, dtype: torch.dtype | None = None,
                     device: str | torch.device | None = None, backend: str | None = None,
                     max_position: int | None = None, tp=None) -> FastGLM:
        """From the library's decoder layers + final norm + lm_head (e.g. a ``CloudModel``'s); sharded layers
        (``cloud_server.tp.shard_model``) come with their ``tp`` shard."""
        dtype = dtype or lm_head.weight.dtype
        device = device or lm_head.weight.device
        cfg = FastGLMConfig.from_hf(config, num_layers=len(layers), max_position=max_position)
        fast = [FastLayer.from_hf(layer, dtype, device) for layer in layers]
        return cls(cfg, fast, norm.weight.detach().to(device=device, dtype=dtype),
                   lm_head.weight.detach().to(device=device, dtype=dtype).contiguous(), backend, tp)

    # -- shapes on this rank ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.norm_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm_weight.dtype

    @property
    def local_heads(self) -> int:
        return self.cfg.num_heads // self.tp_size

    @property
    def local_kv_heads(self) -> int:
        return self.cfg.num_kv_heads // self.tp_size

    # -- forward ----------------------------------------------------------------------------------
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(x) if self.tp_size > 1 else x

    def mrope_tables(self, rope_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cos/sin [T, rotary_dim / 2] for GLM-4.1V 3-D positions [3, T]: rotary pair i takes its
        angle from the axis of its mrope section (as ``Glm4vTextRotaryEmbedding.recomposition_frequencies``)."""
        if self.cfg.mrope_section is None:
            raise ValueError("3-D rope positions given to a model without mrope sections")
        axis = torch.repeat_interleave(torch.arange(3, device=rope_positions.device),
                                       torch.tensor(self.cfg.mrope_section, device=rope_positions.device))
        rows = rope_positions[axis].T  # [T, R/2]: the position each pair rotates by
        cols = torch.arange(axis.numel(), device=rope_positions.device)[None, :]
        return self.rope_cos[rows, cols], self.rope_sin[rows, cols]

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv: KVPool,
                meta: DecodeMeta | PrefillMeta, rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, H] (boundary states), positions [T] int64, slots [T] int64 -> final-normed [T, H].

        ``rope_positions`` [3, T]: GLM-4.1V multimodal positions (images); default: ``positions`` on all axes.
        """
        cfg, be, eps = self.cfg, self.backend, self.cfg.rms_norm_eps
        nq, nkv, d = self.local_heads, self.local_kv_heads, cfg.head_dim
        t = hidden.shape[0]
        scale = d ** -0.5
        decode = isinstance(meta, DecodeMeta)
        cos, sin, rope_idx = self.rope_cos, self.rope_sin, positions
        if rope_positions is not None:  # per-token tables, indexed by row
            cos, sin = self.mrope_tables(rope_positions)
            rope_idx = torch.arange(t, device=hidden.device)
        residual = hidden.to(self.dtype, copy=True)  # [T, H], updated in place layer by layer
        x = kernels.rmsnorm(residual, self.layers[0].input_ln, eps, be)  # [T, H]
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv.layer(i)  # [NB, BS, KVH, D]
            sc = kv.scales(i)  # an 8-bit pool's scales and rotation (None: 16/32-bit)
            qkv = self.linear(x, layer.qkv_weight, layer.qkv_bias)  # [T, (nq + 2 nkv) D]
            kernels.rope_store(qkv, rope_idx, cos, sin, k_cache, v_cache, slots, nq, nkv, d, cfg.rotary_dim, be, sc)
            q = qkv[:, : nq * d].view(t, nq, d)  # [T, Hq, D] (strided view)
            if decode:
                attn = decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, be,
                                        meta.workspace, sc)  # [T, Hq, D]
            else:
                k_new = qkv[:, nq * d: (nq + nkv) * d].view(t, nkv, d)
                v_new = qkv[:, (nq + nkv) * d:].view(t, nkv, d)
                attn = prefill_attention(q, k_new, v_new, k_cache, v_cache, meta.query_lens, meta.context_lens,
                                         meta.block_tables, scale, meta.decode_seqs, sc, meta.context_slots)
                if meta.decode_rows is not None:  # a mixed step's decode rows: the paged decode kernel
                    attn[meta.decode_rows] = decode_attention(q[meta.decode_rows], k_cache, v_cache,
                                                              meta.decode_block_tables, meta.decode_seq_lens,
                                                              scale, be, meta.workspace, sc)
            o = self._all_reduce(self.linear(attn.reshape(t, nq * d), layer.o_weight))  # [T, H]
            residual, x = kernels.add_norm_norm(o, residual, layer.post_self_attn_ln, layer.post_attention_ln,
                                                eps, be)
            gu = self.linear(x, layer.gate_up_weight)  # [T, 2I / tp]
            a = kernels.silu_mul(gu, be)  # [T, I / tp]
            down = self._all_reduce(self.linear(a, layer.down_weight))  # [T, H]
            w_next = self.layers[i + 1].input_ln if i + 1 < n else self.norm_weight
            residual, x = kernels.add_norm_norm(down, residual, layer.post_mlp_ln, w_next, eps, be)
        return x

    @torch.no_grad()
    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [N, H] -> logits [N, V] (gathered across tensor-parallel ranks)."""
        local = self.linear(x, self.lm_head_weight)  # [N, V / tp]
        return local if self.tp is None else self.tp.gather_vocab(local, self.cfg.vocab_size)

    # -- convenience for whole sequences (tests, the benchmark's prefill) ---------------------------
    @torch.no_grad()
    def prefill(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv: KVPool,
                meta: PrefillMeta) -> torch.Tensor:
        """Run query chunks and return the logits of each sequence's last row: [B, V]."""
        x = self.forward(hidden, positions, slots, kv, meta)
        last = torch.tensor(meta.query_lens, device=x.device).cumsum(0) - 1
        return self.compute_logits(x[last])
