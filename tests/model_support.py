"""The unsplit model's answer, the reference every split test compares against."""

from __future__ import annotations

import torch


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of the transformers ``model`` after ``ids``, EOS ignored (random weights may end
    anywhere: the comparison wants all ``n``)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()
