"""Token sampling from a step's logits: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Each row is sampled on its own (with the request's own ``torch.Generator`` when it has a seed), so a
request's tokens do not depend on which others share its step. Greedy picks the argmax (lowest id on ties).
Logprobs are those of the model's raw distribution (temperature 1, no truncation, no penalties), as vLLM
reports them. Presence / frequency / repetition penalties apply to the generated tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cloud_server.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the sampled token, when asked for
    top_logprobs: list[tuple[int, float]] | None = None  # (token, logprob), best first


def _penalized(logits: torch.Tensor, p: SamplingParams, history: list[int]) -> torch.Tensor:
    """logits [V] with presence / frequency / repetition penalties over the generated ``history``."""
    if not history:
        return logits
    ids = torch.tensor(history, dtype=torch.long)
    counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones(len(history)))  # [V]
    seen = counts > 0
    logits = logits.clone()
    if p.repetition_penalty != 1.0:
        pen = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seen, pen, logits)
    return logits - p.presence_penalty * seen.float() - p.frequency_penalty * counts


def _filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [V] -> probabilities [V] after temperature, top-k and top-p."""
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = cum - sorted_p >= p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return probs


class Sampler:
    def __init__(self, seed: int | None = None):
        self.generator = torch.Generator()  # for requests without their own seed
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 histories: list[list[int]] | None = None) -> list[SampledToken]:
        """logits [S, V] float32 (CPU or device), one row per request -> one token each. ``histories``:
        each request's generated tokens (for the penalties)."""
        if all(p.greedy and not p.penalized and p.logprobs is None for p in params):
            # plain greedy rows: argmax where the logits are (first maximum = lowest id on ties, as below);
            # only S ids cross to the host instead of S x V floats and S host-side argmaxes
            return [SampledToken(int(t)) for t in logits.argmax(dim=-1).tolist()]
        logits = logits.float().cpu()
        histories = histories or [[] for _ in params]
        out = []
        for raw, p, gen, hist in zip(logits, params, generators, histories, strict=True):
            row = _penalized(raw, p, hist) if p.penalized else raw
            if p.greedy:
                tok = int(torch.argmax(row))
            else:
                probs = _filtered(row, p)
                tok = int(torch.multinomial(probs, 1, generator=gen or self.generator))
            s = SampledToken(tok)
            if p.logprobs is not None:
                lp = torch.log_softmax(raw, dim=-1)
                s.logprob = float(lp[tok])
                if p.logprobs > 0:
                    top = torch.topk(lp, p.logprobs)
                    s.top_logprobs = [(int(i), float(v)) for v, i in zip(top.values, top.indices, strict=True)]
            out.append(s)
        return out
