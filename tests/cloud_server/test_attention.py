"""The registered paged attention against plain causal SDPA, and its batch invariance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cloud_server.attention import AttentionContext, attention_context, paged_attention_forward, register


class _Attn(torch.nn.Module):
    layer_idx = 0
    is_causal = True
    num_key_value_groups = 2


def _reference(q, k, v):
    """q [Hq, S, D], k/v [KVH, S, D], whole sequence, causal."""
    rep = q.shape[0] // k.shape[0]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0),
                                          is_causal=True)  # [Hq, S, D]


def _run_steps(seqs, chunks, batch_invariant=True, hq=4, kvh=2, d=8, block=4):
    """Feed each sequence's [Hq/KVH, S, D] q/k/v through the pool in the given per-step chunk sizes."""
    num_blocks = 64
    kc = torch.zeros(1, num_blocks * block, kvh, d)
    vc = torch.zeros_like(kc)
    free = list(range(num_blocks))
    tables = {i: [] for i in range(len(seqs))}
    done = {i: 0 for i in range(len(seqs))}
    outs = {i: [] for i in range(len(seqs))}
    for step in chunks:  # step: {seq index: n tokens}
        qs, ks, vs, slots, qlens, clens, seq_slots = [], [], [], [], [], [], []
        order = list(step)
        for i in order:
            q, k, v = seqs[i]
            a, n = done[i], step[i]
            while len(tables[i]) * block < a + n:
                tables[i].append(free.pop(0))
            pos = torch.arange(a, a + n)
            tab = torch.tensor(tables[i])
            slots.append(tab[pos // block] * block + pos % block)
            all_pos = torch.arange(a + n)
            seq_slots.append(tab[all_pos // block] * block + all_pos % block)
            qs.append(q[:, a:a + n]), ks.append(k[:, a:a + n]), vs.append(v[:, a:a + n])
            qlens.append(n), clens.append(a + n)
            done[i] += n
        ctx = AttentionContext(kc, vc, torch.cat(slots), qlens, clens, seq_slots, batch_invariant)
        with attention_context(ctx):
            out, _ = paged_attention_forward(_Attn(), torch.cat(qs, 1)[None], torch.cat(ks, 1)[None],
                                             torch.cat(vs, 1)[None], None, scaling=d ** -0.5)
        t = 0
        for i, n in zip(order, qlens):
            outs[i].append(out[0, t:t + n].transpose(0, 1))  # [Hq, n, D]
            t += n
    return {i: torch.cat(o, 1) for i, o in outs.items()}


def _seqs(lens, hq=4, kvh=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(hq, s, d, generator=g), torch.randn(kvh, s, d, generator=g),
             torch.randn(kvh, s, d, generator=g)) for s in lens]


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_chunked_prefill_and_decode_equal_causal_attention(batch_invariant):
    seqs = _seqs([9, 6, 5])
    # seq 0: two prefill chunks; seq 1: one; seq 2: a chunk then two decode steps
    chunks = [{0: 4, 1: 6}, {0: 5, 2: 3}, {2: 1}, {2: 1}]
    out = _run_steps(seqs, chunks, batch_invariant)
    for i, (q, k, v) in enumerate(seqs):
        torch.testing.assert_close(out[i], _reference(q, k, v), rtol=1e-5, atol=1e-5)


def test_batched_decode_path_equals_reference():
    seqs = _seqs([7, 3, 5], seed=1)
    prefill = {0: 6, 1: 2, 2: 4}
    out = _run_steps(seqs, [prefill, {0: 1, 1: 1, 2: 1}], batch_invariant=False)
    for i, (q, k, v) in enumerate(seqs):
        torch.testing.assert_close(out[i], _reference(q, k, v), rtol=1e-5, atol=1e-5)


def test_a_sequence_gets_bitwise_the_same_output_alone_or_batched():
    seqs = _seqs([8, 12, 5], seed=2)
    alone = _run_steps([seqs[0]], [{0: 5}, {0: 3}])
    batched = _run_steps(seqs, [{1: 7, 0: 5, 2: 5}, {0: 3, 1: 5}])
    assert torch.equal(alone[0], batched[0])


def test_outside_an_engine_step_it_is_plain_sdpa():
    register()
    q, k, v = _seqs([6], seed=3)[0]
    out, _ = paged_attention_forward(_Attn(), q[None], k[None], v[None], None, scaling=8 ** -0.5)
    torch.testing.assert_close(out[0].transpose(0, 1), _reference(q, k, v), rtol=1e-5, atol=1e-5)
