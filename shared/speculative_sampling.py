"""The verification rule of speculative decoding, for whichever side holds the logits: the cloud in split mode
(``cloud_server.engine.speculation``, torch) and the phone in u-shape (``edge_client.ushape``, numpy).

A speculative step feeds the last emitted token and k drafts ``d_1..d_k`` through the model at once; row ``i``
of the result is the model's distribution for the token after ``d_i`` (row 0: after the fed token).
:func:`accept_drafts` walks the rows in order and returns the accepted drafts followed by one token of the
model's own, so a step emits between 1 and k + 1 tokens:

* greedy: accept ``d_{i+1}`` while it is the argmax of row ``i``; the first row whose argmax differs (or row k)
  gives the model's token. The output is identical to plain greedy decoding;
* sampling: the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023) with a deterministic
  draft, a point-mass proposal ``q = δ(d)``: accept ``d`` with probability ``min(1, p(d) / q(d)) = p(d)``; on
  rejection sample from the residual ``max(0, p - q)`` normalised, which is ``p`` with ``d`` removed and
  renormalised. Each emitted token is then distributed exactly as plain sampling's: P(d) = p(d), and for
  ``y != d``, P(y) = (1 - p(d)) · p(y) / (1 - p(d)) = p(y).

The walk is plain Python over an :class:`Ops` of the caller's array library (argmax, one probability, a
uniform draw, a draw from a row with one token removed), so both sides run the same rule. Pure Python: the
phone runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Ops(Protocol):
    """What the walk needs of a row (a 1-D array of scores or probabilities over the vocabulary)."""

    def argmax(self, row: Any) -> int:
        """The best token (the lowest id on ties)."""

    def prob(self, row: Any, token: int) -> float:
        """``row[token]`` of a probability row."""

    def uniform(self) -> float:
        """A draw in [0, 1) from the request's generator."""

    def sample(self, row: Any, exclude: int | None) -> int:
        """A draw from the probability row, with ``exclude`` (if not None) removed and the rest renormalised."""


def accept_drafts(drafts: Sequence[int], row: Callable[[int, list[int]], Any], ops: Ops, greedy: bool) -> list[int]:
    """The tokens a speculative step emits: the accepted drafts, then the model's own next token.

    ``row(i, accepted)`` is row ``i`` of the step - greedy: scores whose argmax is the token; sampling: the
    request's sampling distribution (probabilities) - given the drafts ``accepted`` so far (for penalties over
    the history); it is called for rows 0, 1, ... only as far as the walk gets."""
    out: list[int] = []
    for i in range(len(drafts) + 1):
        r = row(i, out)
        draft = drafts[i] if i < len(drafts) else None
        if greedy:
            best = ops.argmax(r)
            if best != draft:
                return [*out, best]
        elif draft is None:
            return [*out, ops.sample(r, None)]
        elif ops.uniform() >= ops.prob(r, draft):  # rejected: sample p without the draft
            return [*out, ops.sample(r, draft)]
        out.append(draft)
    raise AssertionError("unreachable: row k always emits the model's token")
