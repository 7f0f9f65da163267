"""One request's state inside the engine: its inputs as they arrive, its KV blocks, its generated tokens.

Inputs arrive asynchronously as :class:`InputChunk`s covering positions ``[start, start + n)``: boundary
hidden states from the edge (split mode) or token ids (full-model mode). A chunk marked ``last`` ends an
input turn: once it is computed the engine samples a token. In split mode the edge then runs its front
layers on that token and sends the next one-position chunk (a decode step); in full-model mode the engine
feeds the token back itself.

A sequence is *ready* when the next chunk starts exactly where its KV ends (``num_computed``): the
scheduler may then run some or all of that chunk's positions.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from cloud_server.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"  # admitted, holds no KV blocks of its own yet
    RUNNING = "running"  # holds KV blocks
    FINISHED = "finished"


@dataclass(slots=True)
class InputChunk:
    start: int  # first position
    hidden: torch.Tensor | None = None  # [n, H] boundary hidden states (split mode)
    token_ids: torch.Tensor | None = None  # [n] int64 (full-model mode)
    last: bool = True  # sample a token after this chunk
    # [3, n] int64 multimodal RoPE positions (GLM-4.1V images); None: the sequence positions on all axes
    rope_positions: torch.Tensor | None = None
    # a speculative step (cloud_server.engine.speculation): the edge's n - 1 draft tokens at positions
    # [start + 1, end); logits of all n positions are sampled, and the chunk runs whole (never split)
    draft_ids: list[int] | None = None
    # the edge asks the cloud drafter for up to this many drafts after the token this chunk yields (last chunks)
    ask_drafts: int = 0
    # a cloud draft step (LLMEngine, "cloud drafts"): one position fed the draft table's row of a token, its
    # logits row's argmax is the next draft; never sampled, its KV dropped when the round's drafting ends
    cloud_draft: bool = False
    # positions carried, the first position after them, and whether it is a speculative step; derived once here
    # (the scheduler, the engine and build_batch read them many times per step), so a chunk's fields are not
    # reassigned after construction
    n: int = field(init=False, repr=False, compare=False)
    end: int = field(init=False, repr=False, compare=False)
    is_spec: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        h, t = self.hidden, self.token_ids
        if (h is None) == (t is None):
            raise ValueError("an input chunk carries either hidden states or token ids")
        if self.start < 0:
            raise ValueError(f"input chunk start {self.start} < 0")
        shape = h.shape if h is not None else t.shape  # read once: a tensor's shape is built on each read
        if h is not None and len(shape) != 2:
            raise ValueError(f"hidden states must be [n, H], got shape {tuple(shape)}")
        if t is not None and len(shape) != 1:
            raise ValueError(f"token ids must be [n], got shape {tuple(shape)}")
        self.n = shape[0]
        self.end = self.start + self.n
        self.is_spec = self.draft_ids is not None
        if self.n == 0:
            raise ValueError("empty input chunk")
        if self.rope_positions is not None and tuple(self.rope_positions.shape) != (3, self.n):
            raise ValueError(f"rope positions must be [3, {self.n}], got {tuple(self.rope_positions.shape)}")
        if self.draft_ids is not None and (len(self.draft_ids) != self.n - 1 or not self.draft_ids or not self.last):
            raise ValueError(f"a speculative chunk of {self.n} positions carries {self.n - 1} >= 1 drafts and "
                             f"is last; got {len(self.draft_ids)} drafts, last={self.last}")

    @staticmethod
    def decode_step(start: int, rows: torch.Tensor, row: int) -> InputChunk:
        """``InputChunk(start, hidden=rows[row:row + 1])``: a decode step whose state is row ``row`` of an
        ``[S, H]`` array the caller has checked (``LLMEngine.add_inputs``)."""
        c = object.__new__(_RowChunk)
        c.start, c.token_ids, c.last, c.rope_positions, c.draft_ids = start, None, True, None, None
        c.ask_drafts, c.cloud_draft, c.n, c.end, c.is_spec = 0, False, 1, start + 1, False
        c.rows, c.row = rows, row
        return c

    def split(self, k: int) -> tuple[InputChunk, InputChunk]:
        """The first ``k`` positions (never ``last``) and the rest."""
        if self.draft_ids is not None:
            raise ValueError("a speculative chunk runs whole")
        h, t, r = self.hidden, self.token_ids, self.rope_positions
        head = InputChunk(self.start, None if h is None else h[:k], None if t is None else t[:k], last=False,
                          rope_positions=None if r is None else r[:, :k])
        tail = InputChunk(self.start + k, None if h is None else h[k:], None if t is None else t[k:], self.last,
                          rope_positions=None if r is None else r[:, k:], ask_drafts=self.ask_drafts)
        return head, tail


class _RowChunk(InputChunk):
    """:meth:`InputChunk.decode_step`'s chunk: its fields set directly (a decode step passes ``__post_init__``'s
    checks), its ``[1, H]`` view of the array made only when read (the steady decode step hands the runner the whole
    array instead). Making one costs less than one tensor view, once per session per step."""

    __slots__ = ("rows", "row")

    @property
    def hidden(self) -> torch.Tensor:
        return self.rows[self.row:self.row + 1]  # [1, H]


class Sequence:
    """Engine-side state of one request (see the module docstring).

    Every state transition is one method here, and no other class writes a sequence's fields:
    :meth:`admit` (the scheduler, with the prefix-cache hit), :meth:`push` (input arrives),
    :meth:`take` and :meth:`start_running` (scheduled), :meth:`update_from_output` (the step ran),
    :meth:`mark_published` (prefix blocks published) and :meth:`finish`. The one shared structure is
    ``block_table``, which the block manager grows and empties in place (``BlockManager.ensure`` / ``release``).
    """

    def __init__(self, request_id: str, params: SamplingParams, variant: str,
                 prefix_keys: list[str] | None = None, feed_back_tokens: bool = False,
                 output_ids: list[int] | None = None):
        self.request_id = request_id
        self.params = params
        self.variant = variant
        self.prefix_keys = list(prefix_keys or [])  # key of block i covers tokens [i*bs, (i+1)*bs)
        self.feed_back_tokens = feed_back_tokens  # full-model mode: the sampled token is the next input
        self.status = SequenceStatus.WAITING
        self.pending: deque[InputChunk] = deque()
        self.num_computed = 0  # positions whose K/V are in the pool
        self.num_received = 0  # positions received (computed + pending)
        self.num_prompt_tokens = 0  # positions of the first input turn (the prompt)
        self.prompt_complete = False  # the chunk ending the first input turn arrived (u-shape steps never add to it)
        self.num_cached_tokens = 0  # prompt positions served by the prefix cache
        self.num_registered_blocks = 0  # prefix blocks already published to the cache
        self.block_table: list[int] = []
        # every token the request generated, in order: a replayed request's earlier ones first (``output_ids``, the
        # last of its prompt's positions), so that its penalties, max_tokens and counts go on as the original's
        self.output_ids: list[int] = list(output_ids or ())
        self.finish_reason: str | None = None
        # cloud drafts: what the edge asked for with its last input turn, and the round being drafted (its first
        # draft position, the drafts so far, how many, and the token output held back until they are done)
        self.ask_drafts = 0
        self.draft_start: int | None = None
        self.drafts: list[int] = []
        self.draft_goal = 0
        self.held_output = None  # LLMEngine's RequestOutput, delivered with the drafts
        self.draft_began = 0.0  # monotonic time the round's drafting began
        now = time.monotonic()
        self.arrival_time = now
        # None until it samples a token here (it decodes from then on, to the scheduler); metrics: TTFT while None,
        # then inter-token latency
        self.last_token_time: float | None = None
        self.waiting_since = now  # when it last became idle waiting for input (step timeouts)

    # -- transitions ----------------------------------------------------------------------------
    def admit(self, first: InputChunk, cached_blocks: list[int], block_size: int, wait: bool = False) -> None:
        """Start with ``first``; ``cached_blocks`` (prefix-cache hits) already hold positions
        ``[0, len(cached_blocks) * block_size)``, so their inputs are dropped and they count as computed.
        A sequence holding cached blocks is RUNNING at once (unless ``wait``: the rest of its prompt's blocks are
        not free, and it waits holding its hits); otherwise it WAITS for admission to a step."""
        cached = len(cached_blocks) * block_size
        self.block_table = list(cached_blocks)
        self.num_cached_tokens = self.num_computed = cached
        self.num_registered_blocks = len(cached_blocks)
        self.num_received = first.start
        self.push(first)
        while self.pending and self.pending[0].end <= cached:
            self.pending.popleft()
        if self.pending and self.pending[0].start < cached:
            _, self.pending[0] = self.pending[0].split(cached - self.pending[0].start)
        self.num_received = max(self.num_received, cached)
        self.num_prompt_tokens = first.end
        if cached_blocks and not wait:
            self.status = SequenceStatus.RUNNING

    def push(self, chunk: InputChunk) -> None:
        """The next input chunk arrived (must start where the inputs so far end)."""
        if chunk.start != self.num_received:
            raise ValueError(f"input for positions [{chunk.start}, {chunk.end}) but the next position "
                             f"expected is {self.num_received}")
        self.pending.append(chunk)
        self.num_received = chunk.end
        self.waiting_since = time.monotonic()  # input arrived: the edge is alive
        if chunk.last and not chunk.cloud_draft:
            self.ask_drafts = chunk.ask_drafts
        if not self.prompt_complete:
            self.num_prompt_tokens = self.num_received
            self.prompt_complete = chunk.last

    def take(self, k: int) -> tuple[InputChunk, bool]:
        """Scheduled: pop up to ``k`` ready positions; returns the chunk and whether to sample after it."""
        chunk = self.pending[0]
        if k < chunk.n:
            head, self.pending[0] = chunk.split(k)
            return head, False
        self.pending.popleft()
        if not self.pending:  # all it was sent is in a step: from here it waits for the edge (a long prompt's
            self.waiting_since = time.monotonic()  # prefill is the engine's time, not an idle edge's)
        return chunk, chunk.last

    def start_running(self) -> None:
        """Admitted to a step: from now on it holds KV blocks of its own."""
        self.status = SequenceStatus.RUNNING

    def update_from_output(self, computed_end: int, token: int | None = None, now: float | None = None) -> None:
        """The step computed this sequence's positions up to ``computed_end`` and, if it sampled, ``token``.

        The engine calls it when a step is launched (positions only) and again when its token is back; a
        later step already launched for the sequence (a prompt's next chunk) is never undone."""
        if computed_end > self.num_computed:
            self.num_computed = computed_end
        if token is not None:
            now = time.monotonic() if now is None else now
            self.output_ids.append(token)
            self.last_token_time = now
            self.waiting_since = now  # the edge now runs its front layers on the token

    def accept_speculation(self, start: int, tokens: list[int], now: float | None = None) -> None:
        """A speculative chunk at ``start`` was verified: ``tokens`` are the accepted drafts and the next
        token. Only positions ``[0, start + len(tokens))`` stay (the fed token and the accepted drafts); the KV
        of the rejected drafts is dropped (the block manager trims ``block_table`` to match)."""
        if self.pending:
            raise ValueError("input arrived behind a speculative step before its verdict")
        now = time.monotonic() if now is None else now
        self.output_ids.extend(tokens)
        self.num_computed = self.num_received = start + len(tokens)
        self.last_token_time = now
        self.waiting_since = now

    def returned_states(self, now: float | None = None) -> None:
        """u-shape: this step's hidden states went back to the edge, which now runs its tail and samples."""
        self.waiting_since = time.monotonic() if now is None else now

    def rewind(self, position: int, into_prompt: bool = False) -> None:
        """u-shape: keep positions [0, position) only (the block manager trims ``block_table`` to match): the
        edge rejected drafts, or (``into_prompt``, a Resume) lost the States of positions it will send again - a
        position inside the prompt reopens it (its lost chunks come again, the last one ends it again). Only
        between steps: nothing pending, every received position computed."""
        low = 0 if into_prompt else self.num_prompt_tokens
        at_rest = not self.pending and (not into_prompt or self.num_computed == self.num_received)
        if not at_rest or not low <= position <= self.num_computed:
            raise ValueError(f"rewind to {position}: the sequence holds [0, {self.num_computed}) of "
                             f"{self.num_received} received with {len(self.pending)} inputs pending "
                             f"(prompt {self.num_prompt_tokens})")
        if into_prompt and (position < self.num_prompt_tokens or not self.prompt_complete):
            self.num_prompt_tokens, self.prompt_complete = position, False
        self.num_computed = self.num_received = position

    def begin_drafting(self, held_output, goal: int) -> None:
        """A token went out to be drafted after: hold its output until ``goal`` drafts (or a stop) are proposed."""
        self.draft_start, self.drafts, self.draft_goal, self.held_output = self.num_received, [], goal, held_output
        self.draft_began = time.monotonic()

    def end_drafting(self):
        """The round's drafts are done: drop the draft positions (their KV came from approximate states) and
        return the held output; the edge's next input starts at the drafted token's position again."""
        out, self.held_output = self.held_output, None
        self.num_computed = self.num_received = self.draft_start
        self.draft_start = None
        return out

    def mark_published(self, num_blocks: int) -> None:
        """Its first ``num_blocks`` prefix blocks are in the prefix cache."""
        self.num_registered_blocks = max(self.num_registered_blocks, num_blocks)

    def finish(self, reason: str) -> None:
        """Finished (stop, length, abort, timeout, error): drops pending inputs; idempotent."""
        if self.finish_reason is None:
            self.finish_reason = reason
        self.status = SequenceStatus.FINISHED
        self.pending.clear()

    # -- reads ----------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return (self.status is not SequenceStatus.FINISHED and bool(self.pending)
                and self.pending[0].start == self.num_computed)

    @property
    def num_ready_tokens(self) -> int:
        """Positions of the ready chunk (0 if not ready); one check, read once per step by the scheduler."""
        pending = self.pending
        if pending and self.status is not SequenceStatus.FINISHED:
            head = pending[0]
            if head.start == self.num_computed:
                return head.n
        return 0

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, computed={self.num_computed}, "
                f"received={self.num_received}, out={len(self.output_ids)}, blocks={len(self.block_table)})")


def advance(seqs: list[Sequence], ends: list[int]) -> None:
    """A step was launched: ``seqs[i]``'s positions up to ``ends[i]`` count as computed (what
    :meth:`Sequence.update_from_output` does without a token, for a whole batch in one loop)."""
    for seq, end in zip(seqs, ends, strict=True):
        if end > seq.num_computed:
            seq.num_computed = end
