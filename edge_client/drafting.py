"""Draft tokens for speculative decoding across the split: prompt lookup, and how many drafts to send.

The phone holds what the cloud never sees: the prompt, the conversation and the outputs of earlier agent
steps. Agent actions and chat answers copy long spans from them (an element's coordinates, a name on the
screen, the previous step's action), so the tokens after the longest earlier occurrence of the context's last
n-gram are a good guess at what comes next: *prompt lookup decoding* (Saxena 2023; "n-gram lookahead" in
arXiv 2602.16760 on a split Mistral-7B). :class:`PromptLookupDrafter` proposes them from the current context
first (most recent occurrence wins) and then from a bounded memory of earlier outputs
(:meth:`PromptLookupDrafter.remember`). An output the cloud never saw as tokens (a u-shape answer, sampled on
the phone) is drawn from only by a proposal whose drafts stay on the phone (u-shape's): a split SpecStep sends
its drafts' ids up, and such an output must not reach the cloud as drafts (after a bundle update from a u-shape
bundle to a plain one, or as a ``private`` request's drafts, which may be only tokens the cloud produced).

:class:`DraftSizer` picks k per step. A draft is accepted with a probability ``alpha`` (measured: accepted
drafts over drafts that were tried), so a step with k drafts emits ``(1 - alpha^(k+1)) / (1 - alpha)`` tokens
in expectation and costs one plain step's round trip plus k marginal positions. Both are measured from the
steps themselves: the round trip of plain steps, and what each draft adds to a speculative step's round trip
(front compute, uplink of its row, the cloud's extra position). It picks the k that maximises tokens per
second; on a long RTT that is a larger k, on a fast link or with poor acceptance a smaller one (k = 0: a
plain DecodeStep). ``SizerConfig.fixed_k`` (``EdgeConfig.draft_k``) pins k instead, for tests and benchmarks
that must not depend on timing. Drafts of the bundle's drafter (``edge_client.draft_head``: its layer drafter
or its lens, used where prompt lookup finds nothing) get their own sizer (:data:`DRAFTER_SIZERS`' prior for
its kind): their acceptance and their cost (a front step and a drafter step per draft) differ from a lookup's.
So do the cloud's drafts (``Tokens.draft_ids``), whose sizer also prices the server's drafting time. When both
prompt lookup and the cloud propose, the edge sends the proposal with the higher :meth:`DraftSizer.rate` (the
cloud's drafting is already paid for by then) and scores the other against the verdict
(:meth:`DraftSizer.observe_shadow`), so neither source's acceptance estimate goes stale while the other wins.

Nothing here imports torch; all inputs are token id lists.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np


@dataclass(slots=True)
class DraftConfig:
    max_ngram: int = 4  # longest context suffix looked up (longer matches predict better but are rarer)
    min_ngram: int = 1  # a one-token match still pays off on agent transcripts (", element=[" ...)
    max_drafts: int = 8  # drafts per step at most (the server's cap applies too)
    memory_tokens: int = 1 << 16  # tokens of earlier outputs kept for lookup (~4 MB when full: deques of Python ints
    # and flags, ~3.9 MB measured with tracemalloc, plus up to two int64 copies, 0.5 MB each, while lookups run)

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.max_drafts < 0:
            raise ValueError(f"max_drafts must be >= 0, got {self.max_drafts}")
        if self.memory_tokens < 0:
            raise ValueError(f"memory_tokens must be >= 0, got {self.memory_tokens}")


_SEP = -1  # between remembered outputs: a match never spans two of them


def _lookup(text: np.ndarray, suffix: np.ndarray, k: int, exclude_tail: bool) -> list[int]:
    """Up to ``k`` tokens following the last occurrence of ``suffix`` in ``text`` [L] (not the suffix at the
    very end of ``text`` itself when ``exclude_tail``); [] if none."""
    n = suffix.size
    end = text.size - (1 if exclude_tail else 0)  # a match must leave at least one token after it
    if end < n + (0 if exclude_tail else 1):
        return []
    windows = np.lib.stride_tricks.sliding_window_view(text[:end], n)  # [end - n + 1, n]
    hits = np.flatnonzero((windows == suffix).all(axis=1))
    for i in hits[::-1]:  # most recent first
        cont = text[i + n:i + n + k]
        cont = cont[:np.argmax(cont == _SEP)] if (cont == _SEP).any() else cont
        if cont.size:
            return [int(t) for t in cont]
    return []


class PromptLookupDrafter:
    """Proposes drafts by n-gram lookup over the context and the remembered outputs (module docstring)."""

    def __init__(self, config: DraftConfig | None = None):
        self.config = config or DraftConfig()
        self._memory: deque[int] = deque(maxlen=self.config.memory_tokens or 1)
        # per remembered token: True for an output the cloud never saw as tokens (a u-shape answer, sampled here)
        self._phone_only: deque[bool] = deque(maxlen=self.config.memory_tokens or 1)
        self._arrays: dict[bool, np.ndarray] = {}  # phone_only -> the memory as lookups see it (rebuilt after remember)

    def remember(self, tokens: Sequence[int], phone_only: bool = False) -> None:
        """Keep an output (an earlier agent step's action, an answer) for later lookups. ``phone_only``: the cloud
        never saw it as tokens (a u-shape answer): only a proposal whose drafts stay on the phone draws from it."""
        if not self.config.memory_tokens or not tokens:
            return
        self._memory.extend(int(t) for t in tokens)
        self._memory.append(_SEP)
        self._phone_only.extend([phone_only] * (len(tokens) + 1))
        self._arrays = {}

    def forget(self) -> None:
        self._memory.clear()
        self._phone_only.clear()
        self._arrays = {}

    def _memory_for(self, phone_only: bool) -> np.ndarray:
        """The memory a proposal may draw from: all of it where the drafts stay on the phone, else the outputs the
        cloud saw, the others' tokens masked as separators (a draft id that goes up never comes from them)."""
        if phone_only not in self._arrays:
            arr = np.asarray(self._memory, dtype=np.int64)
            if not phone_only:
                arr[np.asarray(self._phone_only, dtype=bool)] = _SEP
            self._arrays[phone_only] = arr
        return self._arrays[phone_only]

    def propose(self, context: Sequence[int], k: int, phone_only: bool = False) -> list[int]:
        """Up to ``k`` draft tokens to follow ``context`` (the tokens so far, ending with the last emitted one).
        ``phone_only``: the drafts never leave the phone as ids (u-shape verifies them here), so the outputs the
        cloud never saw may be drawn from too; otherwise they go up in a SpecStep and those are left out."""
        cfg = self.config
        k = min(k, cfg.max_drafts)
        if k <= 0 or not context:
            return []
        text = np.asarray(context, dtype=np.int64)  # [L]
        memory = self._memory_for(phone_only)
        for n in range(min(cfg.max_ngram, text.size), cfg.min_ngram - 1, -1):
            suffix = text[-n:]
            found = _lookup(text, suffix, k, exclude_tail=True)
            if not found and memory.size:
                found = _lookup(memory, suffix, k, exclude_tail=False)
            if found:
                return found
        return []


@dataclass(slots=True)
class SizerConfig:
    prior_alpha: float = 0.6  # acceptance assumed before any step is measured
    prior_weight: float = 4.0  # pseudo-trials behind the prior
    decay: float = 0.9  # per-step weight of old observations: acceptance drifts within an answer
    default_round_s: float = 0.08  # a plain step's round trip before one is measured
    default_row_s: float = 0.004  # a draft's marginal cost before one is measured
    smoothing: float = 0.3  # weight of a new cost measurement
    fixed_k: int | None = None  # pin k (tests, benchmarks that need determinism); None: chosen per step

    def __post_init__(self):
        if self.fixed_k is not None and self.fixed_k < 0:
            raise ValueError(f"fixed_k must be >= 0, got {self.fixed_k}")


    def with_fixed_k(self, k: int | None) -> SizerConfig:
        return replace(self, fixed_k=k)


# the bundle drafter's sizer, per kind (edge_client.draft_head): a calibrated lens at an early layer agrees
# with the model far less often than a matching n-gram (SmolLM2 at N = 8: ~25-30 % top-1 on held-out text), a
# few of the cloud's own layers more often; each of their drafts costs a front step and a drafter step
DRAFTER_SIZERS = {"lens": SizerConfig(prior_alpha=0.35), "layers": SizerConfig(prior_alpha=0.5),
                  # the cloud drafter (the cloud's own layers from an approximate boundary state): ~70 % one deep
                  # on SmolLM2 chat; a draft costs the edge one front row and the cloud one decode row per draft
                  "cloud": SizerConfig(prior_alpha=0.65)}


class DraftSizer:
    """Chooses k per step from measured acceptance and costs (module docstring)."""

    def __init__(self, max_drafts: int, config: SizerConfig | None = None):
        self.max_drafts = max_drafts
        self.config = cfg = config or SizerConfig()
        self._accepted = self._tried = 0.0
        self.new_request()
        self.round_s = cfg.default_round_s  # a plain step: send -> Tokens (RTT + the server's step)
        self.row_s = cfg.default_row_s  # what one more draft adds to a step: front + uplink + cloud position
        # what one more draft costs the server before the step starts (cloud drafts: one engine step per draft,
        # reported as Tokens.timings.draft_ms); 0 for the phone's own drafters
        self.server_row_s = 0.0
        self._round_measured = False  # row_s is measured against a measured plain step only

    def new_request(self) -> None:
        """A new request: acceptance starts again from the prior (a chat answer that copies nothing says little
        about the next agent step), the link's costs carry over."""
        cfg = self.config
        self._accepted = cfg.prior_alpha * cfg.prior_weight  # decayed accepted drafts
        self._tried = cfg.prior_weight  # decayed drafts whose verdict was known (accepted or the rejected one)

    @property
    def alpha(self) -> float:
        return min(0.99, self._accepted / self._tried)

    def observe(self, drafts: int, accepted: int, step_s: float | None = None) -> None:
        """One answered step with ``drafts`` drafts (0: a plain DecodeStep), ``accepted`` of them accepted,
        ``step_s`` from sending it to its Tokens (the edge's front work for it included)."""
        cfg = self.config
        w, d = cfg.smoothing, cfg.decay
        if drafts == 0:
            if step_s is not None:
                self.round_s = self.round_s + w * (step_s - self.round_s) if self._round_measured else step_s
                self._round_measured = True
            # no verdict: the acceptance estimate drifts back to the prior, so a k = 0 phase (a chat answer
            # that copies nothing) does not stop drafting for good once the text starts repeating
            self._accepted = d * self._accepted + (1 - d) * cfg.prior_alpha * cfg.prior_weight
            self._tried = d * self._tried + (1 - d) * cfg.prior_weight
            return
        self._verdict(accepted, rejected=accepted < drafts)
        if step_s is not None and self._round_measured:  # a draft's cost: what it adds to a plain step
            # one slow step (a busy CPU, a retransmission) must not price drafts out for good: the k + 1 rows
            # run in one pass, so a sample is capped at half a round trip
            marginal = min(max(0.0, (step_s - self.round_s) / drafts), 0.5 * self.round_s)
            self.row_s += w * (marginal - self.row_s)

    def observe_shadow(self, drafts: Sequence[int], truth: Sequence[int]) -> None:
        """A proposal that was not sent, scored against what the cloud emitted instead (``truth``: the verified
        step's tokens): its acceptance estimate learns without paying for a step. Only the positions ``truth``
        covers are judged (a proposal longer than the step's tokens is censored there)."""
        n = min(len(drafts), len(truth))
        if n == 0:
            return
        agreed = next((i for i in range(n) if drafts[i] != truth[i]), n)
        self._verdict(agreed, rejected=agreed < n)

    def _verdict(self, accepted: int, rejected: bool) -> None:
        """A verdict on drafts: ``accepted`` of them agreed, then one was rejected (or none was judged)."""
        d = self.config.decay
        self._accepted = d * self._accepted + accepted
        self._tried = d * self._tried + accepted + (1 if rejected else 0)

    def rate(self, k: int, server_paid: bool = False) -> float:
        """Expected tokens per second of a step with ``k`` drafts (``server_paid``: the server has drafted them
        already, so its drafting time is spent whatever the edge sends)."""
        row_s = min(self.row_s, 0.5 * self.round_s) + (0.0 if server_paid else self.server_row_s)
        return self.expected_tokens(k) / (self.round_s + k * row_s)

    def price_server_rows(self, seconds: float, drafts: int) -> None:
        """The server spent ``seconds`` drafting ``drafts`` drafts (Tokens.timings.draft_ms)."""
        if drafts > 0:
            self.server_row_s += self.config.smoothing * (seconds / drafts - self.server_row_s)

    def expected_tokens(self, k: int) -> float:
        a = self.alpha
        return (1 - a ** (k + 1)) / (1 - a)

    def choose(self, limit: int | None = None) -> int:
        """The k in [0, min(max_drafts, limit)] with the most expected tokens per second (``fixed_k``, capped
        the same way, when the config pins it)."""
        top = self.max_drafts if limit is None else max(0, min(self.max_drafts, limit))
        if self.config.fixed_k is not None:
            return min(self.config.fixed_k, top)
        # rate() caps the row cost as a measured sample is capped: before any draft is priced, the default row
        # cost must not exceed half a (fast, e.g. loopback) round trip, or k = 0 would be chosen forever
        return max(range(top + 1), key=self.rate)
