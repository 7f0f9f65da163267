"""Verifying the edge's draft tokens: the k + 1 logits rows of a speculative step -> the tokens it emits.

A speculative step feeds the last emitted token and k draft tokens ``d_1..d_k`` (proposed on the edge by
prompt lookup, ``edge_client.drafting``) through the model at once; row ``i`` of its logits is the model's
distribution ``p_i`` for the token after ``d_i`` (row 0: after the fed token). :func:`verify` applies the rule
in ``shared.speculative_sampling`` (greedy: accept while the draft is the argmax, identical to plain greedy
decoding; sampling: the speculative-sampling rule with a point-mass proposal, exactly the model's
distribution) - the same rule the phone runs on its own tail's logits in u-shape. ``p`` is the request's
sampling distribution (penalties, temperature, top-k, top-p: ``cloud_server.engine.sampler``), with the
accepted drafts counted in the penalty history as the tokens they become.

The random draws come from the request's generator (its seed), so a seeded speculative run is reproducible,
though not the same sample path as a seeded plain run (rejected drafts consume draws).
"""

from __future__ import annotations

import torch

from cloud_server.engine.sampler import SampledToken, _filtered, _penalized
from cloud_server.engine.sampling_params import SamplingParams
from shared.speculative_sampling import accept_drafts

MAX_DRAFTS = 8  # drafts per step the server verifies (Welcome.server.max_draft_tokens); past ~8 acceptance decays


class _TorchOps:
    """``shared.speculative_sampling.Ops`` over torch rows, drawing from the request's generator."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def argmax(self, row: torch.Tensor) -> int:
        return int(torch.argmax(row))

    def prob(self, row: torch.Tensor, token: int) -> float:
        return float(row[token])

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator))

    def sample(self, row: torch.Tensor, exclude: int | None) -> int:
        if exclude is not None:
            row = row.clone()
            row[exclude] = 0.0
        return int(torch.multinomial(row, 1, generator=self.generator))


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

    def row(i: int, accepted: list[int]) -> torch.Tensor:  # [V]: scores (greedy) or probabilities
        r = _penalized(rows[i], params, [*history, *accepted]) if params.penalized else rows[i]
        return r if params.greedy else _filtered(r, params)

    return [SampledToken(t) for t in accept_drafts(drafts, row, _TorchOps(generator), params.greedy)]
