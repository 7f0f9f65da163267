"""Paged-KV attention, plugged into the library's own attention modules through transformers' registry.

The engine flattens a step's sequences into one varlen batch ``[1, T, H]`` and runs the library's decoder
layers on it. Each layer's attention module projects q/k/v and applies its rotary embedding as usual, then
calls the registered function :func:`paged_attention_forward` (``config._attn_implementation =
"autoglm_paged"``), which

1. writes this step's keys/values into the preallocated pool at the step's slot mapping, and
2. attends each sequence's queries over that sequence's cached keys/values (its earlier steps + this one),
   causally: query ``i`` of a chunk of ``n`` sits at position ``ctx - n + i`` and sees keys ``[0, ctx - n + i]``.

An 8-bit pool (``kv_cache_dtype`` int8 / fp8 / int8v, ``cloud_server.kv_quant``) is quantized on the write and its
gathered slots dequantized to the compute dtype on the read; its 8-bit tensors are stored Hadamard-rotated, so
this step's queries are rotated into the keys' basis and the outputs back from the values' basis
(``kv_quant.stored_rotation``: both for int8 / fp8; only the outputs for int8v, whose keys are plain).

The per-step metadata (slot mapping, per-sequence query lengths, context lengths and slot lists) comes from
an :class:`AttentionContext` that the model runner installs around the forward pass. Outside such a context
the function delegates to the library's SDPA attention, so the same modules keep working as a plain model
(``CloudModel.forward``, the reference path).

Batch invariance: with ``batch_invariant`` (the CPU default) every sequence's attention is computed on its
own, so a sequence's numbers do not depend on which others share its step. Otherwise decode steps
(one query each) share one padded SDPA call. References: vLLM's Transformers backend and PagedAttention
(Kwon et al., SOSP 2023); nano-vLLM's ``layers/attention.py``.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cloud_server.kv_quant import read, stored_rotation, write

ATTN_IMPL = "autoglm_paged"


@dataclass(slots=True)
class AttentionContext:
    k_cache: torch.Tensor  # [layers, slots, KVH, D]  (slots = num_blocks * block_size)
    v_cache: torch.Tensor  # [layers, slots, KVH, D]
    slot_mapping: torch.Tensor  # [T] int64: where each of this step's tokens is written
    query_lens: list[int]  # [B] tokens of each sequence in this step (their order in T)
    context_lens: list[int]  # [B] cached tokens of each sequence after this step's writes
    seq_slots: list[torch.Tensor]  # [B] x [context_len] int64: slots of each sequence's tokens, in order
    batch_invariant: bool = True
    k_scale: torch.Tensor | None = None  # [layers, slots, KVH] float32: 8-bit keys' scales (None: compute dtype)
    v_scale: torch.Tensor | None = None


_local = threading.local()


def current() -> AttentionContext | None:
    return getattr(_local, "ctx", None)


@contextmanager
def attention_context(ctx: AttentionContext):
    prev = current()
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = prev


def _causal_mask(n: int, ctx_len: int, device) -> torch.Tensor:
    q_pos = torch.arange(n, device=device)[:, None] + (ctx_len - n)  # [n, 1]
    return torch.arange(ctx_len, device=device)[None, :] <= q_pos  # [n, ctx] True = attend


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [1, Hq, T, D], key/value [1, KVH, T, D] (post-rope) -> (out [1, T, Hq, D], None)."""
    ctx = current()
    if ctx is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"paged attention expects a flattened batch [1, T, ...], got batch {query.shape[0]}")
    layer = module.layer_idx
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]  # [slots, KVH, D]
    k_scale = None if ctx.k_scale is None else ctx.k_scale[layer]  # [slots, KVH]
    v_scale = None if ctx.v_scale is None else ctx.v_scale[layer]
    # [D, D] or None each: 8-bit keys / values are held rotated; attend in the keys' basis (kv_quant's basis rule)
    rot_k, rot_v = (stored_rotation(sc, query.shape[-1], query.device, query.dtype) for sc in (k_scale, v_scale))
    if rot_k is not None:
        query, key = query @ rot_k, key @ rot_k
    if rot_v is not None:
        value = value @ rot_v
    # 1. this step's K/V into the pool
    write(k_cache, k_scale, ctx.slot_mapping, key[0].transpose(0, 1))  # [T, KVH, D]
    write(v_cache, v_scale, ctx.slot_mapping, value[0].transpose(0, 1))
    q_all = query[0]  # [Hq, T, D]
    hq, t, d = q_all.shape
    rep = hq // k_cache.shape[1]  # GQA: query head h reads KV head h // rep
    out = torch.empty(t, hq, d, dtype=query.dtype, device=query.device)  # [T, Hq, D]
    starts = [0]
    for n in ctx.query_lens:
        starts.append(starts[-1] + n)

    # 2. attention per sequence over its cached K/V
    todo = range(len(ctx.query_lens))
    if not ctx.batch_invariant:
        decodes = [i for i in todo if ctx.query_lens[i] == 1]
        if len(decodes) > 1:
            _batched_decode(q_all, (k_cache, k_scale), (v_cache, v_scale), ctx, decodes, starts, rep, scaling,
                            out)
            todo = [i for i in todo if ctx.query_lens[i] != 1]
    for i in todo:
        a, b, n, c = starts[i], starts[i + 1], ctx.query_lens[i], ctx.context_lens[i]
        slots = ctx.seq_slots[i]  # [c]
        k = read(k_cache, k_scale, slots, query.dtype).transpose(0, 1)  # [KVH, c, D]
        v = read(v_cache, v_scale, slots, query.dtype).transpose(0, 1)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)  # [Hq, c, D]
        q = q_all[:, a:b]  # [Hq, n, D]
        mask = None if n == 1 else _causal_mask(n, c, query.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)  # [Hq, n, D]
        out[a:b] = o.transpose(0, 1)
    if rot_v is not None:
        out = out @ rot_v  # back from the values' rotated basis (H is its own inverse)
    return out[None], None


def _batched_decode(q_all, k_pool, v_pool, ctx, rows, starts, rep, scaling, out):
    """One padded SDPA call for sequences with a single query token each; ``k_pool`` / ``v_pool`` are one
    layer's (cache, scale or None)."""
    lens = [ctx.context_lens[i] for i in rows]
    width = max(lens)
    dev = q_all.device
    slots = torch.zeros(len(rows), width, dtype=torch.long, device=dev)  # [B, Lmax], pad -> slot 0
    for j, i in enumerate(rows):
        slots[j, : lens[j]] = ctx.seq_slots[i]
    valid = torch.arange(width, device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None]  # [B, Lmax]
    k = read(*k_pool, slots, q_all.dtype).permute(0, 2, 1, 3)  # [B, KVH, Lmax, D]
    v = read(*v_pool, slots, q_all.dtype).permute(0, 2, 1, 3)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [B, Hq, Lmax, D]
    idx = torch.tensor([starts[i] for i in rows], device=dev)
    q = q_all[:, idx].transpose(0, 1)[:, :, None]  # [B, Hq, 1, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scaling)
    out[idx] = o[:, :, 0]  # [B, Hq, D]


def register() -> None:
    """Make ``autoglm_paged`` a valid ``config._attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPL, paged_attention_forward)
    # Models that build their own masks look the implementation up here too.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPL, sdpa_mask)
