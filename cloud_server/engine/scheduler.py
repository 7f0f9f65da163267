"""What runs in the next step: ready decode steps of every session, then prefill chunks, under a token budget.

Scheduling is decided per iteration; one step is one forward pass per compute variant. Phones' steps arrive
at different times, so the scheduler never waits for anyone: it takes whatever is *ready* now (a sequence
whose next input chunk starts where its KV ends), in this order:

1. running sequences with a one-position chunk (decode steps: latency-critical, cheap) or a speculative
   step (the last token and the edge's drafts, verified together: never split across steps);
2. running sequences with a longer chunk (prefill continuing), oldest first;
3. waiting sequences (not yet holding KV), first come first served: one is admitted once the blocks of all its
   ready prompt positions can be its own (taken then), and admission stops at the first one that does not fit,
   so a long prompt is not starved by later short ones.

Each takes ``min(ready positions, remaining budget)``; a partially taken chunk is a *prefill chunk* and its
rest stays pending for the next step. KV blocks are allocated as positions are scheduled; a sequence that
cannot get blocks waits. If a ready running sequence is blocked and nothing else could run, the youngest
running sequence is returned for abort (fatal for that request, not the engine) so the others progress.

Admission and the prefix cache: :meth:`Scheduler.add` matches the request's prefix keys against the
variant's cache; a request whose first chunk starts at ``p > 0`` must be covered by cached blocks for
``[0, p)``, else :class:`PrefixMiss` (the edge then resends the full hidden states).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cloud_server.config import EngineConfig
from cloud_server.engine.kv_cache import BlockManager
from cloud_server.engine.sequence import InputChunk, Sequence, SequenceStatus


class RequestError(Exception):
    """Fatal for one request only; ``code`` is the wire error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class PrefixMiss(RequestError):
    def __init__(self, message: str):
        super().__init__("prefix_miss", message)


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    chunk: InputChunk  # positions [chunk.start, chunk.end) run this step
    sample: bool  # the chunk ends an input turn: sample a token from its last position


@dataclass(slots=True)
class ScheduledBatch:
    variant: str
    items: list[ScheduledChunk]
    # every item is one sampled position of a decode step, not a cloud draft (Scheduler._schedule_decodes): every
    # logits row is sampled, in item order
    plain_decode: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.items) if self.plain_decode else sum(it.chunk.n for it in self.items)


class _PrefillAllowance:
    """Prompt positions one step may still take. While any running sequence is decoding (has sampled a token
    here: a replayed request's earlier tokens are prompt positions to it), a step holds at most
    ``max_num_seqs + prefill_chunk_while_decoding`` positions (0 = no cap): the prompt chunks get what its decode
    rows leave of that, at least ``prefill_chunk_while_decoding``, so a long prompt arriving is computed in chunks
    riding on the decode steps instead of stalling them (Sarathi-Serve's chunked prefill under a token budget; on
    the fast path every such step fits the graphs of flat steps).
    Otherwise the whole token budget. The decode check runs once, at the first prompt chunk of the step."""

    __slots__ = ("scheduler", "left", "spent")

    def __init__(self, scheduler: Scheduler):
        self.scheduler, self.left, self.spent = scheduler, None, False

    def limit(self, budget: int) -> int:
        """``budget``: the step's token budget still free (what the decode rows scheduled so far left)."""
        if self.left is None:
            cfg = self.scheduler.config
            cap = cfg.prefill_chunk_while_decoding
            decoding = cap > 0 and any(s.last_token_time is not None for s in self.scheduler.running)
            rows = cfg.max_num_batched_tokens - budget  # this step's positions so far: its decode rows
            self.left = max(cap, cap + cfg.max_num_seqs - rows) if decoding else budget
        return min(budget, self.left)

    def take(self, k: int) -> None:
        """``k`` prompt positions were scheduled (after :meth:`limit`)."""
        self.left -= k
        self.spent = self.left <= 0


class Scheduler:
    def __init__(self, config: EngineConfig, block_managers: dict[str, BlockManager]):
        self.config = config
        self.block_managers = block_managers
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # -- admission --------------------------------------------------------------------------
    def add(self, seq: Sequence, first: InputChunk) -> None:
        """Admit ``seq`` with its first input chunk, reusing cached prefix blocks; may raise RequestError."""
        bm = self.block_managers[seq.variant]
        bs = self.config.block_size
        if first.end > self.config.max_model_len:
            raise RequestError("too_long", f"prompt of {first.end} positions exceeds max_model_len "
                                           f"{self.config.max_model_len}")
        if bm.blocks_for(first.end) > bm.num_blocks:
            raise RequestError("too_long", f"prompt of {first.end} positions needs more KV blocks than the "
                                           f"pool holds ({bm.num_blocks} x {bs})")
        # Leave the final position of a sampled turn to compute: its logits are needed.
        limit = (first.end - (1 if first.last else 0)) // bs
        blocks = bm.lookup(seq.prefix_keys)[:limit] if self.config.enable_prefix_cache else []
        if first.start > 0 and len(blocks) * bs < first.start:
            have = len(blocks) * bs
            raise PrefixMiss(f"positions [0, {first.start}) were omitted but the prefix cache holds only "
                             f"[0, {have}) of the named keys")
        bm.acquire(blocks, queried=min(len(seq.prefix_keys), limit))
        # a prefix hit runs at once with the blocks of the rest of its prompt as received (taken now), or waits
        # holding its hits until they fit, as a waiting prompt does (schedule()): running with what was free it
        # was the victim of the next step where nobody else was ready, a shared system prompt's every request
        rest = bm.blocks_for(first.end) - len(blocks)
        fits = not blocks or bm.can_allocate(rest)
        seq.admit(first, blocks, bs, wait=not fits)
        if blocks and fits:
            bm.ensure(seq.block_table, first.end)
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).append(seq)

    def remove(self, seq: Sequence, reason: str) -> None:
        """Release everything ``seq`` holds and finish it with ``reason`` (finish, cancel, disconnect,
        timeout); idempotent."""
        self.block_managers[seq.variant].release(seq.block_table)
        seq.finish(reason)
        if seq in self.running:
            self.running.remove(seq)
        try:
            self.waiting.remove(seq)
        except ValueError:
            pass

    # -- one step ---------------------------------------------------------------------------
    def schedule(self, preempt: bool = True,
                 prefill_alone: bool = True) -> tuple[list[ScheduledBatch], list[Sequence]]:
        """This step's batches (one per variant) and the sequences to abort because the pool is full (only when
        ``preempt``: the engine passes False while a step is in flight, whose end may free blocks).

        ``prefill_alone=False``: prompt chunks run only beside a decode step of this batch (the engine passes it
        while a step with decode rows is in flight: a prompt-only step queued behind it would delay those
        sequences' next step by a whole chunk; the chunk joins their next step instead)."""
        budget, slots = self.config.max_num_batched_tokens, self.config.max_num_seqs
        if not self.waiting:
            decodes = self._schedule_decodes(preempt)
            if decodes is not None:
                return decodes
        # (seq, ready positions): each sequence's readiness is read once per step
        ready = [(s, n) for s in self.running if (n := s.num_ready_tokens)]
        chosen: dict[str, list[ScheduledChunk]] = {}
        blocked_running = False
        # stable: decode steps (speculative ones too) first, oldest first. One-position steps that all fit
        # (max_num_batched_tokens >= max_num_seqs) keep the running order instead: the same rows step after step
        # (the fast runner's persistent batch), and no sort is paid
        if len(ready) > slots or any(n > 1 for _, n in ready):
            ready.sort(key=lambda p: (p[1] > 1 and not p[0].pending[0].is_spec, p[0].arrival_time))
        prefill = _PrefillAllowance(self)
        for seq, n in ready:
            if budget == 0 or slots == 0:
                break
            chunked = n > 1 and not seq.pending[0].is_spec
            if chunked and not prefill_alone and not chosen:
                break  # no decode step this time: the prompts wait for one (decode steps sort first)
            k = self._fit(seq, prefill.limit(budget) if chunked else budget, n)
            if k == 0 and chunked and prefill.spent:
                continue  # this step's prefill share is used up: not blocked by the pool
            if k == 0 or (k < n and seq.pending[0].is_spec):  # a speculative step runs whole or waits
                blocked_running = True
                continue
            items = chosen.get(seq.variant)
            if items is None:
                items = chosen[seq.variant] = []
            items.append(ScheduledChunk(seq, *seq.take(k)))
            budget, slots = budget - k, slots - 1
            if chunked:
                prefill.take(k)
        while self.waiting and budget > 0 and slots > 0 and (prefill_alone or chosen):
            seq = self.waiting[0]
            n = seq.num_ready_tokens
            if not n:  # its first chunk is still arriving in pieces? (never: add() pushes one)
                break
            # admitted once the blocks of all its ready prompt positions are its own, or it waits (FCFS: later
            # arrivals do not overtake a blocked one). Admitted with the few blocks free, it ran out of pool at its
            # next chunk and, the youngest, was the victim of the first step where nobody else was ready (at once
            # in split mode, where a decoding phone is away most of the time): dropped for load, never queued
            limit = prefill.limit(budget)
            if not limit or not self.block_managers[seq.variant].ensure(seq.block_table, seq.num_computed + n):
                break
            k = self._fit(seq, limit, n)  # min(n, limit): its blocks are held
            self.waiting.popleft()
            seq.start_running()
            self.running.append(seq)
            chosen.setdefault(seq.variant, []).append(ScheduledChunk(seq, *seq.take(k)))
            budget, slots = budget - k, slots - 1
            prefill.take(k)
        batches = [ScheduledBatch(v, items) for v, items in chosen.items()]
        victims: list[Sequence] = []
        if preempt and not batches and blocked_running:
            victims.append(max(self.running, key=lambda s: s.arrival_time))
        elif preempt and not batches and not self.running and self.waiting:
            # the head waits for blocks that waiting prefix hits hold, and nobody runs to free any: the youngest
            # of those goes, as a running sequence would
            holders = [s for s in self.waiting if s.block_table]
            if holders:
                victims.append(max(holders, key=lambda s: s.arrival_time))
        return batches, victims

    def _schedule_decodes(self, preempt: bool) -> tuple[list[ScheduledBatch], list[Sequence]] | None:
        """The steady state's schedule, or None: nothing waits for admission (the caller checks), every ready
        sequence has a one-position chunk and they all fit the step's slots and budget. :meth:`schedule`'s loop
        would then take each in running order (no sort, no prefill allowance); this is that loop without its
        prefill branches: the same batches, the same victims. A batch whose every item is a sampled decode step
        (no cloud draft) is marked ``plain_decode``."""
        finished = SequenceStatus.FINISHED
        # Sequence.num_ready_tokens, inlined: (seq, its ready chunk)
        ready = [(s, p[0]) for s in self.running
                 if (p := s.pending) and p[0].start == s.num_computed and s.status is not finished]
        if len(ready) > min(self.config.max_num_batched_tokens, self.config.max_num_seqs) or any(
                c.n != 1 for _, c in ready):
            return None
        chosen: dict[str, list[ScheduledChunk]] = {}
        plain: dict[str, bool] = {}
        bs = self.config.block_size
        blocked_running = False
        for seq, chunk in ready:
            # its block already held (the common step), else one allocated: _fit's two cases
            if seq.num_computed >= len(seq.block_table) * bs and not self._fit(seq, 1, 1):
                blocked_running = True
                continue
            seq.take(1)
            v = seq.variant
            items = chosen.get(v)
            if items is None:
                items = chosen[v] = []
                plain[v] = True
            items.append(ScheduledChunk(seq, chunk, chunk.last))
            if not chunk.last or chunk.cloud_draft:
                plain[v] = False
        batches = [ScheduledBatch(v, items, plain_decode=plain[v]) for v, items in chosen.items()]
        if preempt and not batches and blocked_running:
            return batches, [max(self.running, key=lambda s: s.arrival_time)]
        return batches, []

    def _fit(self, seq: Sequence, budget: int, ready: int) -> int:
        """Positions of ``seq`` to run now (<= budget, <= its ``ready`` positions), with KV blocks allocated
        for them; 0 if none fit."""
        bs = self.config.block_size
        k = min(ready, budget)
        table, computed = seq.block_table, seq.num_computed
        if 0 < k and computed + k <= len(table) * bs:  # the common decode step: its blocks are already held
            return k
        bm = self.block_managers[seq.variant]
        capacity = (len(table) + bm.num_free_blocks) * bs - computed
        k = min(k, capacity)
        if k <= 0 or not bm.ensure(table, computed + k):
            return 0
        return k

    # -- after the step -----------------------------------------------------------------------
    def publish_prefix(self, seq: Sequence) -> None:
        """Publish ``seq``'s newly completed prefix blocks under their keys: blocks of the *prompt* only. A key
        names prompt block i (the edge hashes its token ids), so keys beyond the prompt's full blocks are never
        published: a block finished by decode steps holds generated positions (possibly drafts rolled back and
        rewritten), which no client's key can name."""
        if seq.num_registered_blocks >= len(seq.prefix_keys):  # nothing left to publish (or no keys at all)
            return
        bm = self.block_managers[seq.variant]
        done = min(seq.num_computed, seq.num_prompt_tokens)
        full = min(done // self.config.block_size, len(seq.prefix_keys))
        for i in range(seq.num_registered_blocks, full):
            bm.publish(seq.block_table[i], seq.prefix_keys[i])
        seq.mark_published(full)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
