"""Attention over the paged KV pool: split-K flash-decoding for decode steps, SDPA for prefill chunks.

Decode (one new token per sequence, sequences of mixed lengths). The Triton kernel runs one program per
(sequence, KV head, split of ``split`` tokens); each program loads the block-table entries of its tokens,
so the sequences' blocks may lie anywhere in the pool, and scores all ``G = heads / kv_heads`` query heads
of its KV head at once (a [G, D] x [D, 64] tile product: GLM's 16:1 GQA makes that a tensor-core-sized
tile and reads each cached key and value exactly once). Programs whose split lies beyond the sequence's
length return at once, so one captured graph serves every length up to the pool's maximum. A second kernel
merges the splits' partial (max, sum, accumulator) triples: the flash-decoding reduction. Everything the
kernels need (lengths, block tables) is read on the device: no host sync and no per-length graph.

Why not the alternatives: SDPA needs the mixed-length KV gathered into a padded [B, KVH, T, D] copy every
step (reading and writing the cache twice more than needed); FlexAttention needs torch.compile and a block
mask rebuilt per step. The torch version below is exactly that padded gather; it is the CPU path and the
reference the GPU run checks the kernel against.

An 8-bit pool (``cloud_server.kv_quant``: int8 / fp8 keys and values, or int8v's int8 values beside keys in the
compute dtype; one float32 scale per token and KV head of an 8-bit tensor, stored Hadamard-rotated) is read by the
same kernel: the stored integers (or e4m3 values) are exact in the query's dtype, so each tile is converted and
the per-token scales are applied to the tile's scores (8-bit keys) and to its softmax weights (8-bit values) in
registers; the program rotates its queries into the keys' basis first (8-bit keys only) and its partial output
back from the values' basis last (8-bit values; both linear, so the split merge is unchanged). The torch version
dequantizes the gathered copy with ``kv_quant.read`` and rotates as the generic runner does
(``cloud_server.attention``).

Prefill (query chunks, possibly after cached context): per sequence, SDPA with ``enable_gqa`` over the
chunk's own keys (causal, the flash kernel) or over its context's keys gathered from the pool under a
bottom-right causal bias (``causal_lower_right``: the flash kernel on CUDA; a materialized mask on the CPU).

References: Dao et al., "Flash-Decoding for long-context inference" (2023); vLLM's PagedAttention
(Kwon et al., SOSP 2023); ``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from cloud_server.kv_quant import read

from .kernels import HAVE_TRITON, _pow2, interpreting

if HAVE_TRITON:
    import triton
    import triton.language as tl

BLOCK_N = 64  # tokens per inner step of the decode kernel


MAX_SPLITS = 64  # the merge kernel holds all of a head's partials at once


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Launch config of the split-K decode kernel: ``split`` tokens per program, ``block_n`` per inner step."""

    split: int
    block_n: int = BLOCK_N
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.block_n not in (16, 32, 64, 128) or self.split % self.block_n:
            raise ValueError(f"decode config: split {self.split} must be a multiple of block_n {self.block_n} "
                             f"(16, 32, 64 or 128)")


def decode_split_tokens(batch: int, kv_heads: int, max_tokens: int) -> int:
    """Tokens per split: small batches split finely so that enough programs stream the cache at once.

    At most :data:`MAX_SPLITS` splits cover ``max_tokens``; always a multiple of :data:`BLOCK_N`.
    """
    work = batch * kv_heads
    split = 64 if work <= 8 else 128 if work <= 32 else 256 if work <= 128 else 512
    floor = -(-max_tokens // MAX_SPLITS)
    split = max(split, -(-floor // BLOCK_N) * BLOCK_N)
    return split


# ------------------------------------------------------------------------------------------------
# decode: torch reference (padded gather)


def _context_slots(block_tables: torch.Tensor, block_size: int, num_tokens: int) -> torch.Tensor:
    """Slot index of token t of each sequence for t < num_tokens: [B, num_tokens]."""
    t = torch.arange(num_tokens, device=block_tables.device)
    return block_tables[:, t // block_size].long() * block_size + t % block_size


def _pool_kv(k_cache, v_cache, scales, slots: torch.Tensor, dtype: torch.dtype):
    """Keys and values at ``slots`` (int64 [...]) of one layer's pool [NB, BS, KVH, D] as ``dtype`` [..., KVH, D],
    dequantized for an 8-bit pool (``scales``: its :class:`~cloud_server.fast.kv.LayerScales`)."""
    kvh, d = k_cache.shape[-2:]
    ks, vs = (None, None) if scales is None else (None if sc is None else sc.view(-1, kvh)
                                                  for sc in (scales.k, scales.v))
    return read(k_cache.view(-1, kvh, d), ks, slots, dtype), read(v_cache.view(-1, kvh, d), vs, slots, dtype)


def decode_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, scale: float, scales=None) -> torch.Tensor:
    """q [B, Hq, D]; caches [NB, BS, KVH, D]; block_tables [B, MAXB]; seq_lens [B] -> [B, Hq, D].

    Static shapes (the whole block table is gathered) so that it can be captured in a CUDA graph too. ``scales``
    (an 8-bit pool's layer): the gathered 8-bit keys/values are dequantized, the queries are turned into the keys'
    basis and the output back from the values' one (q and the output stay in the model's basis for the caller).
    """
    _, bs, kvh, d = k_cache.shape
    hq = q.shape[1]
    t = block_tables.shape[1] * bs
    slots = _context_slots(block_tables, bs, t)  # [B, T]
    k, v = _pool_kv(k_cache, v_cache, scales, slots, q.dtype)  # [B, T, KVH, D]
    rot_k, rot_v = (None, None) if scales is None else (scales.k_rotation, scales.v_rotation)
    if rot_k is not None:
        q = q @ rot_k
    valid = torch.arange(t, device=q.device)[None, :] < seq_lens[:, None].long()  # [B, T]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=valid[:, None, None, :], scale=scale,
                                         enable_gqa=hq != kvh)  # [B, Hq, 1, D]
    return out[:, :, 0, :] if rot_v is None else out[:, :, 0, :] @ rot_v


# ------------------------------------------------------------------------------------------------
# decode: Triton split-K flash-decoding

if HAVE_TRITON:

    @triton.jit
    def _attend_chunk(q, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, n0, end, b, kvh, scale, m_i, l_i, acc, offs_d,
                      dmask, stride_kblk, stride_ktok, stride_kh, stride_bt, BS: tl.constexpr, BLOCK: tl.constexpr,
                      IEEE: tl.constexpr, QK: tl.constexpr, QV: tl.constexpr, NKV: tl.constexpr):
        """Online-softmax update of (m, l, acc) [G_PAD], [G_PAD], [G_PAD, D_PAD] with tokens [n0, n0 + BLOCK).

        QK / QV: 8-bit keys / values, converted exactly to q's dtype; token t's scale multiplies its scores (keys)
        and its softmax weights before the value product (values). Scales are laid out [NB, BS, NKV]."""
        toks = n0 + tl.arange(0, BLOCK)
        valid = toks < end
        blk = tl.load(bt_ptr + b * stride_bt + toks // BS, mask=valid, other=0).to(tl.int64)
        row = blk * stride_kblk + (toks % BS) * stride_ktok + kvh * stride_kh  # [BLOCK] element offsets
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK, D_PAD]
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # both loads in flight
        srow = (blk * BS + toks % BS) * NKV + kvh  # [BLOCK] offsets into the scales (8-bit tensors)
        if QK:
            k_sc = tl.load(ks_ptr + srow, mask=valid, other=0.0)
            k = k.to(q.dtype)
        if QV:
            v_sc = tl.load(vs_ptr + srow, mask=valid, other=0.0)
            v = v.to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if QK:
            s = s * k_sc[None, :]
        s = tl.where(valid[None, :], s * scale, float("-inf"))  # [G_PAD, BLOCK]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QV:
            pw = p * v_sc[None, :]
        else:
            pw = p
        if IEEE:
            pv = tl.dot(pw.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(pw.to(v.dtype), v)
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit
    def _rotate(x, rot_ptr, offs_d, dmask, D: tl.constexpr, IEEE: tl.constexpr):
        """x [G_PAD, D_PAD] times a rotation [D, D] (the compute dtype; x is rounded to it) -> fp32."""
        h = tl.load(rot_ptr + offs_d[:, None] * D + offs_d[None, :], mask=dmask[:, None] & dmask[None, :],
                    other=0.0)  # [D_PAD, D_PAD]
        if IEEE:
            return tl.dot(x.to(h.dtype), h, input_precision="ieee")
        return tl.dot(x.to(h.dtype), h)

    @triton.jit
    def _decode_partial_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, rot_ptr, unrot_ptr, bt_ptr, lens_ptr, acc_ptr,
                               ml_ptr, scale, stride_qb, stride_qh, stride_kblk, stride_ktok, stride_kh, stride_bt,
                               NUM_SPLITS: tl.constexpr, SPLIT: tl.constexpr, G: tl.constexpr,
                               G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
                               BLOCK: tl.constexpr, NQ: tl.constexpr, IEEE: tl.constexpr,
                               DYNAMIC_LOOP: tl.constexpr, STATIC_ITERS: tl.constexpr, QK: tl.constexpr,
                               QV: tl.constexpr, ROTATE_Q: tl.constexpr, ROTATE_O: tl.constexpr,
                               NKV: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        seq_len = tl.load(lens_ptr + b)
        start = sp * SPLIT
        if start < seq_len:
            end = tl.minimum(start + SPLIT, seq_len)
            offs_g = tl.arange(0, G_PAD)
            offs_d = tl.arange(0, D_PAD)
            gmask = offs_g < G
            dmask = offs_d < D
            heads = kvh * G + offs_g
            q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=gmask[:, None] & dmask[None, :], other=0.0)  # [G_PAD, D_PAD]
            if ROTATE_Q:  # into the keys' basis, rounded to q's dtype as the generic runner's q @ H is
                q = _rotate(q, rot_ptr, offs_d, dmask, D, IEEE).to(q_ptr.dtype.element_ty)
            m_i = tl.full([G_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([G_PAD], tl.float32)
            acc = tl.zeros([G_PAD, D_PAD], tl.float32)
            if DYNAMIC_LOOP:
                for it in range(tl.cdiv(end - start, BLOCK)):
                    m_i, l_i, acc = _attend_chunk(q, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, start + it * BLOCK, end,
                                                  b, kvh, scale, m_i, l_i, acc, offs_d, dmask, stride_kblk,
                                                  stride_ktok, stride_kh, stride_bt, BS, BLOCK, IEEE, QK, QV,
                                                  NKV)
            else:  # the Triton interpreter cannot loop over run-time bounds: masks cover the tail
                for it in range(STATIC_ITERS):
                    m_i, l_i, acc = _attend_chunk(q, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, start + it * BLOCK, end,
                                                  b, kvh, scale, m_i, l_i, acc, offs_d, dmask, stride_kblk,
                                                  stride_ktok, stride_kh, stride_bt, BS, BLOCK, IEEE, QK, QV,
                                                  NKV)
            if ROTATE_O:  # back from the values' basis to the model's (linear: the split merge is unaffected); the inverse is its own
                # pointer (the same H: a Sylvester Hadamard matrix is its own inverse), so the compiler cannot keep
                # the first read of it live through the token loop
                acc = _rotate(acc, unrot_ptr, offs_d, dmask, D, IEEE)
            out_row = (b * NQ + heads) * NUM_SPLITS + sp  # partials laid out [B, Hq, NUM_SPLITS, ...]
            tl.store(acc_ptr + out_row[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
            tl.store(ml_ptr + out_row * 2, m_i, mask=gmask)
            tl.store(ml_ptr + out_row * 2 + 1, l_i, mask=gmask)

    @triton.jit
    def _decode_reduce_kernel(acc_ptr, ml_ptr, lens_ptr, o_ptr, stride_ob, stride_oh,
                              NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLIT: tl.constexpr,
                              D: tl.constexpr, D_PAD: tl.constexpr, NQ: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        seq_len = tl.load(lens_ptr + b)
        active = (seq_len + SPLIT - 1) // SPLIT  # only splits that held tokens wrote partials
        sp = tl.arange(0, SPLITS_PAD)
        smask = sp < active
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < D
        row = (b * NQ + h) * NUM_SPLITS + sp
        m = tl.load(ml_ptr + row * 2, mask=smask, other=float("-inf"))
        l_ = tl.load(ml_ptr + row * 2 + 1, mask=smask, other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.where(smask, tl.exp(m - m_max), 0.0)
        denom = tl.sum(w * l_, axis=0)
        acc = tl.load(acc_ptr + row[:, None] * D + offs_d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / denom
        tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=dmask)


@dataclass(slots=True)
class DecodeWorkspace:
    """Scratch for the split partials, sized once for the largest batch (graph-capture safe), and the launch
    config per batch size (tuned on the device by :mod:`.tuning`; the heuristic where absent)."""

    max_batch: int
    num_heads: int
    head_dim: int
    max_tokens: int
    device: torch.device | str
    configs: dict[int, DecodeConfig] = field(default_factory=dict)
    buckets: tuple[int, ...] = ()  # the decode graphs' batch sizes (ascending); empty: every batch is its own
    max_splits: int = MAX_SPLITS  # splits per row the scratch holds (fewer: a smaller scratch for many rows)
    acc: torch.Tensor = field(init=False)
    ml: torch.Tensor = field(init=False)

    def __post_init__(self):
        n = self.max_batch * self.num_heads * self.max_splits
        self.acc = torch.empty(n * self.head_dim, dtype=torch.float32, device=self.device)
        self.ml = torch.empty(n * 2, dtype=torch.float32, device=self.device)

    def config_for(self, batch: int, kv_heads: int, max_tokens: int) -> DecodeConfig:
        """The launch config for ``batch`` rows: that of the smallest graph bucket holding them (tuned, or the
        heuristic for the bucket). A mixed step's decode rows (any count) thus launch a kernel the graphs
        already compiled, instead of JIT-compiling a new specialization (~0.5 s) mid-serving."""
        bucket = next((b for b in self.buckets if b >= batch), batch)
        cfg = self.configs.get(bucket)
        return cfg if cfg is not None else DecodeConfig(decode_split_tokens(bucket, kv_heads, max_tokens))


def decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale: float,
                            workspace: DecodeWorkspace | None = None, split: int | None = None,
                            config: DecodeConfig | None = None, scales=None) -> torch.Tensor:
    """Same contract as :func:`decode_attention_torch`; q may be a strided view (row stride, head stride)."""
    _, bs, kvh, d = k_cache.shape
    b, hq, _ = q.shape
    if q.stride(2) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("decode attention needs unit-stride head_dim and contiguous caches")
    g = hq // kvh
    max_tokens = block_tables.shape[1] * bs
    if config is None and split is None and workspace is not None:
        config = workspace.config_for(b, kvh, max_tokens)
    if config is None:
        config = DecodeConfig(split or decode_split_tokens(b, kvh, max_tokens))
    split = config.split
    num_splits = max(1, math.ceil(max_tokens / split))
    if num_splits > MAX_SPLITS:
        raise ValueError(f"{num_splits} splits of {split} tokens exceed {MAX_SPLITS}")
    if workspace is None:
        workspace = DecodeWorkspace(b, hq, d, max_tokens, q.device)
    if b * hq * num_splits > workspace.ml.numel() // 2 or workspace.head_dim < d:
        raise ValueError("decode workspace too small for this batch")
    ks, vs = (None, None) if scales is None else (scales.k, scales.v)
    rot_k, rot_v = (None, None) if scales is None else (scales.k_rotation, scales.v_rotation)
    if any(sc is not None and not (sc.is_contiguous() and sc.shape == k_cache.shape[:3]) for sc in (ks, vs)):
        raise ValueError(f"decode attention needs contiguous scales {tuple(k_cache.shape[:3])}")
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    ieee = q.dtype == torch.float32
    _decode_partial_kernel[(b, kvh, num_splits)](
        q, k_cache, v_cache, q if ks is None else ks, q if vs is None else vs,
        q if rot_k is None else rot_k, q if rot_v is None else rot_v, block_tables, seq_lens, workspace.acc, workspace.ml, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_SPLITS=num_splits, SPLIT=split, G=g, G_PAD=max(16, _pow2(g)), D=d, D_PAD=max(16, _pow2(d)), BS=bs,
        BLOCK=config.block_n, NQ=hq, IEEE=ieee, DYNAMIC_LOOP=not interpreting(),
        STATIC_ITERS=split // config.block_n, QK=ks is not None, QV=vs is not None, ROTATE_Q=rot_k is not None,
        ROTATE_O=rot_v is not None, NKV=kvh,
        num_warps=config.num_warps, num_stages=config.num_stages)
    _decode_reduce_kernel[(b, hq)](
        workspace.acc, workspace.ml, seq_lens, out, out.stride(0), out.stride(1), NUM_SPLITS=num_splits,
        SPLITS_PAD=max(2, _pow2(num_splits)), SPLIT=split, D=d, D_PAD=_pow2(d), NQ=hq, num_warps=4)
    return out


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float, backend: str,
                     workspace: DecodeWorkspace | None = None, scales=None) -> torch.Tensor:
    """``scales``: an 8-bit pool's :class:`~cloud_server.fast.kv.LayerScales` for this layer (None: 16/32-bit)."""
    if backend == "triton":
        return decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, workspace, scales=scales)
    return decode_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, scale, scales)


# ------------------------------------------------------------------------------------------------
# prefill


def chunk_context_slots(block_tables: torch.Tensor, block_size: int, query_lens: list[int],
                        context_lens: list[int], skip: frozenset[int] = frozenset()) -> dict[int, torch.Tensor]:
    """Pool slots ``[cl]`` of the whole context of every sequence whose chunk follows cached context (not in
    ``skip``): computed once per step, read by every layer's :func:`prefill_attention`."""
    return {i: _context_slots(block_tables[i:i + 1], block_size, cl)[0]
            for i, (ql, cl) in enumerate(zip(query_lens, context_lens)) if cl > ql and i not in skip}


def prefill_attention(q, k_new, v_new, k_cache, v_cache, query_lens: list[int], context_lens: list[int],
                      block_tables: torch.Tensor | None, scale: float,
                      skip: frozenset[int] = frozenset(), scales=None,
                      context_slots: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention for query chunks of several sequences, flat.

    q [T, Hq, D]; k_new/v_new [T, KVH, D] (already stored in the pool); ``query_lens[i]`` tokens of sequence i
    end at position ``context_lens[i] - 1``. A chunk with no earlier context attends to its own keys (flash
    kernel, causal); otherwise to its whole context, read from the pool at ``context_slots[i]`` (default: from
    ``block_tables[i]``), under a bottom-right-aligned causal mask (``causal_lower_right``: on CUDA the flash
    kernel with its native GQA, no mask tensor and no copy of the keys per query head). ``scales`` (an 8-bit
    pool's layer): every chunk reads its keys and values from the pool, dequantized, queries turned into the
    keys' basis and outputs back from the values' one, as the generic runner does. Sequences in ``skip`` (a mixed step's decode rows,
    which the caller runs through the decode kernel) are left unwritten. Returns [T, Hq, D].
    """
    out = torch.empty_like(q)
    hq, kvh = q.shape[1], k_new.shape[1]
    gqa = hq != kvh
    rot_k, rot_v = (None, None) if scales is None else (scales.k_rotation, scales.v_rotation)
    if rot_k is not None:
        q = q @ rot_k  # [T, Hq, D] in the keys' basis
    start = 0
    for i, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        if i in skip:
            start += ql
            continue
        qi = q[start:start + ql].transpose(0, 1)[None]  # [1, Hq, ql, D]
        if cl == ql and scales is None:  # no earlier context: the chunk's own keys, plain causal
            ki = k_new[start:start + ql].transpose(0, 1)[None]  # [1, KVH, ql, D]
            vi = v_new[start:start + ql].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            slots = context_slots.get(i) if context_slots is not None else None
            if slots is None:
                if block_tables is None:
                    raise ValueError("prefill after cached context needs block tables")
                slots = _context_slots(block_tables[i:i + 1], k_cache.shape[1], cl)[0]  # [cl]
            ki, vi = _pool_kv(k_cache, v_cache, scales, slots, q.dtype)  # [cl, KVH, D] each
            o = F.scaled_dot_product_attention(qi, ki.transpose(0, 1)[None], vi.transpose(0, 1)[None],
                                               attn_mask=causal_lower_right(ql, cl), scale=scale, enable_gqa=gqa)
        out[start:start + ql] = o[0].transpose(0, 1)
        start += ql
    return out if rot_v is None else out @ rot_v
