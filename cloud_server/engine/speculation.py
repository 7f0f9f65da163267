"""Verifying the edge's draft tokens: the k + 1 logits rows of a speculative step -> the tokens it emits.

A speculative step feeds the last emitted token and k draft tokens ``d_1..d_k`` (proposed on the edge by
prompt lookup, ``edge_client.drafting``) through the model at once; row ``i`` of its logits is the model's
distribution ``p_i`` for the token after ``d_i`` (row 0: after the fed token). :func:`verify` walks the rows in
order and returns the accepted drafts followed by one token of the model's own, so one step emits between
1 and k + 1 tokens:

* greedy (temperature 0): accept ``d_{i+1}`` while it is the argmax of row ``i``; the first row whose argmax
  differs (or row k) gives the model's token. The output is identical to plain greedy decoding.
* sampling: the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023) with a deterministic
  draft, i.e. a point-mass proposal ``q = δ(d)``: accept ``d`` with probability ``min(1, p(d) / q(d)) = p(d)``;
  on rejection sample from the residual ``max(0, p - q)`` normalised, which is ``p`` with ``d`` removed and
  renormalised. Each emitted token is then distributed exactly as plain sampling's: P(d) = p(d), and for
  ``y != d``, P(y) = (1 - p(d)) · p(y) / (1 - p(d)) = p(y). ``p`` is the request's sampling distribution
  (penalties, temperature, top-k, top-p: ``cloud_server.engine.sampler``), with the accepted drafts counted
  in the penalty history as the tokens they become.

The random draws come from the request's generator (its seed), so a seeded speculative run is reproducible,
though not the same sample path as a seeded plain run (rejected drafts consume draws).
"""

from __future__ import annotations

import torch

from cloud_server.engine.sampler import SampledToken, _filtered, _penalized
from cloud_server.engine.sampling_params import SamplingParams

MAX_DRAFTS = 8  # drafts per step the server verifies (Welcome.server.max_draft_tokens); past ~8 acceptance decays


@torch.inference_mode()
def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator,
           history: list[int]) -> list[SampledToken]:
    """The tokens a speculative step emits: accepted drafts, then the model's own next token.

    ``logits`` float32 ``[k + 1, V]`` (row i: the distribution after draft i; row 0 after the fed token),
    ``drafts`` the k draft ids, ``history`` the request's generated tokens so far (for the penalties)."""
    k = len(drafts)
    if logits.dim() != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"a speculative step with {k} drafts needs [{k + 1}, V] logits, got {list(logits.shape)}")
    rows = logits.float().cpu()  # [k + 1, V]
    out: list[SampledToken] = []
    hist = list(history)
    for i in range(k + 1):
        row = _penalized(rows[i], params, hist) if params.penalized else rows[i]  # [V]
        draft = drafts[i] if i < k else None
        if params.greedy:
            best = int(torch.argmax(row))
            if best != draft:
                out.append(SampledToken(best))
                return out
        else:
            probs = _filtered(row, params)  # [V]
            if draft is None:
                out.append(SampledToken(int(torch.multinomial(probs, 1, generator=generator))))
                return out
            p_draft = float(probs[draft])
            if float(torch.rand((), generator=generator)) >= p_draft:  # rejected: sample p without the draft
                residual = probs.clone()
                residual[draft] = 0.0
                out.append(SampledToken(int(torch.multinomial(residual, 1, generator=generator))))
                return out
        out.append(SampledToken(draft))
        hist.append(draft)
    raise AssertionError("unreachable: row k always emits the model's token")
