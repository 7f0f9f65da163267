"""Verifying the edge's draft tokens: the k + 1 logits rows of a speculative step -> the tokens it emits.

A speculative step feeds the last emitted token and k draft tokens ``d_1..d_k`` (proposed on the edge by
prompt lookup, ``edge_client.drafting``) through the model at once; row ``i`` of its logits is the model's
distribution for the token after ``d_i`` (row 0: after the fed token). :func:`verify` applies the rule in
``shared.speculative_sampling`` - the same rule the phone runs on its own tail's logits in u-shape: each row's
token is what the request's sampler (``cloud_server.engine.sampler``: penalties, temperature, top-k, top-p, the
uniforms keyed by the request's seed and the token's position) draws at that row's position, with the accepted
drafts counted in the penalty history as the tokens they become; a draft is accepted while it equals it. So a
speculative run emits a plain run's tokens - greedy, and sampled with the same seed (the engine gives an
unseeded sampled request a key of its own) - and a replay of it from its context draws them again.
"""

from __future__ import annotations

import torch

from cloud_server.engine.sampler import Sampler, SampledToken
from cloud_server.engine.sampling_params import SamplingParams
from shared.speculative_sampling import accept_drafts

MAX_DRAFTS = 8  # drafts per step the server verifies (Welcome.server.max_draft_tokens); past ~8 acceptance decays


@torch.inference_mode()
def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams, sampler: Sampler, start: int,
           history: list[int]) -> list[SampledToken]:
    """The tokens a speculative step emits: accepted drafts, then the model's own next token.

    ``logits`` ``[k + 1, V]`` (row i: the distribution after draft i; row 0 after the fed token), ``drafts`` the k
    draft ids, ``start`` the fed token's position (row i's token is at ``start + 1 + i``), ``history`` the
    request's generated tokens so far (for the penalties)."""
    k = len(drafts)
    if logits.dim() != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"a speculative step with {k} drafts needs [{k + 1}, V] logits, got {list(logits.shape)}")
    rows = logits.float().cpu()  # [k + 1, V]

    def token(i: int, accepted: list[int]) -> int:
        return sampler(rows[i:i + 1], [params], [start + 1 + i], [[*history, *accepted]])[0].token_id

    return [SampledToken(t) for t in accept_drafts(drafts, token)]
