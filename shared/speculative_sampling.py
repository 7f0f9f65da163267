"""The verification rule of speculative decoding, for whichever side holds the logits: the cloud in split mode
(``cloud_server.engine.speculation``, torch) and the phone in u-shape (``edge_client.ushape``, numpy).

A speculative step feeds the last emitted token and k drafts ``d_1..d_k`` through the model at once; row ``i``
of the result is the model's distribution for the token after ``d_i`` (row 0: after the fed token).
:func:`accept_drafts` walks the rows in order and returns the accepted drafts followed by one token of the
model's own, so a step emits between 1 and k + 1 tokens.

Each row gives the token plain decoding would emit at that row's position - greedy: the argmax; sampling: the
draw of the request's sampler, whose randomness is keyed by the request's seed and the token's position - and a
draft is accepted while it equals that token. So a speculative run emits exactly the tokens of a plain run with
the same seed, whatever was drafted, however many drafts each step carried, and across a replay of the request
from its context (a restart of the cloud): the draws depend on nothing but the seed and the position. With a
deterministic draft (a point-mass proposal ``q = δ(d)``) this is the speculative-sampling rule (Leviathan et al.
2023; Chen et al. 2023) in its coupled form: ``d`` is accepted with probability ``p(d)``, as that rule's
``min(1, p(d) / q(d))``, and every emitted token is a draw from ``p``. Pure Python: the phone runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def accept_drafts(drafts: Sequence[int], token: Callable[[int, list[int]], int]) -> list[int]:
    """The tokens a speculative step emits: the accepted drafts, then the model's own next token.

    ``token(i, accepted)`` is the model's token of row ``i`` (the argmax, or the sampler's draw at that row's
    position) given the drafts ``accepted`` so far (for penalties over the history); it is called for rows 0, 1,
    ... only as far as the walk gets."""
    out: list[int] = []
    for i, draft in enumerate(drafts):
        t = token(i, out)
        if t != draft:
            return [*out, t]
        out.append(t)
    return [*out, token(len(drafts), out)]
