"""The engine: requests in, tokens out; one ``step`` = schedule -> run -> postprocess.

:class:`LLMEngine` is synchronous and single-threaded (``cloud_server.engine.async_engine`` drives it from
its own thread). Requests are added with their first input chunk and receive further chunks as the edge
sends them (``add_input``; a turn's decode steps of many requests as one ``[S, H]`` array: ``add_inputs``);
every ``step`` returns :class:`RequestOutput` events: a sampled token, a finish, or a per-request error.

Errors come in two kinds, as in vLLM v1: :class:`~cloud_server.engine.scheduler.RequestError` is fatal for
one request (bad input, prefix miss, prompt too long, pool exhausted) and becomes an error output;
any exception out of the model runner is fatal for the engine and propagates from ``step``.

Cloud drafts (split mode, a bundle with a cloud drafter: :meth:`LLMEngine.set_draft_inputs`). Computing token
t + 1 needs the boundary state of token t, which only the edge can compute: one round trip per token. But the
engine holds everything else the next prediction needs - the deep layers and the true KV of every earlier
position - and lacks only that one row, so it approximates it from the token alone: ``draft_inputs[t]``, a
calibrated map of the token's embedding to its boundary state (``partition_tools.cloud_drafter``). When the
edge asks (``InputChunk.ask_drafts``), a sampled token's output is held back and the token is fed its draft
row as a one-position *cloud draft* chunk, scheduled with everyone else's work; the argmax of its logits is
draft d1, fed in turn for d2, up to the asked count (or a stop token). Then the draft positions are dropped
(their KV came from approximate states; the edge's next input starts at the token's position again) and the
held output goes out with ``draft_ids``: the edge runs the token and the drafts through its front as one
chunk and sends them back as a speculative step, verified exactly as its own drafts are (the tokens of plain
decoding, greedy or seeded: ``cloud_server.engine.speculation``). The drafts never touch the request's sampling
or penalty history.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

import torch

from cloud_server.config import EngineConfig
from cloud_server.engine.kv_cache import BlockManager, KVCachePool
from cloud_server.engine.model_runner import ModelRunner, build_batch
from cloud_server.engine.sampler import PendingSample, SampledToken, Sampler, warm_up
from cloud_server.engine.sampling_params import SamplingParams
from cloud_server.engine.scheduler import RequestError, ScheduledBatch, Scheduler
from cloud_server.engine.sequence import InputChunk, Sequence, SequenceStatus, advance
from cloud_server.engine.speculation import verify
from cloud_server.model import CloudModel

_ROW_DTYPES = (torch.float32, torch.float16)  # the add_inputs arrays the steady decode step takes as they are


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    token_id: int | None = None  # the token sampled this step, if any
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "timeout" | "error"
    error_code: str | None = None  # set with finish_reason "error" (or alone for a non-fatal refusal)
    error_message: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt positions served from the prefix cache
    num_output_tokens: int = 0
    # a speculative step: the edge's drafts accepted before ``token_id`` (they were emitted in this order)
    accepted_ids: tuple[int, ...] = ()
    # u-shape (a model that ends at the middle layers): the hidden states [n, H] float32 of positions
    # [states_start, states_start + n) this step computed, in place of a token
    states: torch.Tensor | None = None
    states_start: int = 0
    # cloud drafts: the engine's proposal for the tokens after ``token_id`` (the edge asked for them), and how
    # long the output was held back while it drafted
    draft_ids: list[int] | None = None
    draft_s: float = 0.0

    @property
    def token_ids(self) -> list[int]:
        """Every token this output emits, in order (accepted drafts, then ``token_id``)."""
        return [*self.accepted_ids, self.token_id] if self.token_id is not None else []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _Launched:
    """A step on the device: its batch, its speculative items' logits rows, its sampled ids on their way."""

    batch: ScheduledBatch
    spec_rows: list[torch.Tensor]  # [k + 1, V] per speculative item, in item order
    sample: PendingSample | None  # the plain sampled rows, in item order
    states: torch.Tensor | None = None  # u-shape: [T, H] hidden states of every scheduled position
    drafted: torch.Tensor | None = None  # [D] int64: the argmax of each cloud draft item's row, in item order
    decodes: bool = True  # it holds decode steps (one-position or speculative chunks), not only prompt chunks
    device_span: tuple | None = None  # (replay, end) CUDA timing events of a steady decode step (metrics on CUDA)


@dataclass(slots=True)
class _DecodeRows:
    """A variant's last launched pure decode batch (vLLM's persistent batch, host side): what the next step needs
    to tell that it continues it (:meth:`LLMEngine._continue_decode`), and the sampler's per-row inputs, kept while
    the same sequences step on (the sampler then reuses what it derived from them)."""

    seqs: list[Sequence]
    next_ends: list[int]  # each chunk's end + 1: the chunk ends of the step that continues this one
    table_lens: list[int]  # each block table's length
    params: list[SamplingParams]
    histories: list[list[int]]  # each sequence's output_ids (the list itself: it grows in place)


class LLMEngine:
    def __init__(self, config: EngineConfig, runners: dict[str, ModelRunner], metrics=None,
                 sampler_seed: int | None = None):
        if not runners:
            raise ValueError("an engine needs at least one model variant")
        self.config = config
        self.runners = runners
        self.default_variant = next(iter(runners))
        # A runner may reserve pool blocks for itself (a fast path's padding block): never hand those out.
        self.block_managers = {v: BlockManager(r.pool.num_blocks, r.pool.block_size, config.enable_prefix_cache,
                                               tuple(getattr(r, "reserved_blocks", ())))
                               for v, r in runners.items()}
        self.scheduler = Scheduler(config, self.block_managers)
        self.sampler = Sampler(sampler_seed)
        # speculative verdicts draw row by row (cloud_server.engine.speculation): a sampler of their own keeps the
        # decode batches' plan cached in the one above
        self.spec_sampler = Sampler(sampler_seed)
        self.metrics = metrics
        self.seqs: dict[str, Sequence] = {}
        self._in_flight: list[_Launched] = []  # launched by the last step(), postprocessed by the next
        # per variant, the last launched pure decode batch; dropped by any other launch of that variant
        self._last_decode: dict[str, _DecodeRows] = {}
        self._device_spans: deque = deque()  # postprocessed steady steps' (replay, end) events not yet observed
        self._timed_runners = [r for r in runners.values() if hasattr(r, "time_replays")
                               and torch.device(getattr(r, "device", "cpu")).type == "cuda"]  # (_device_span)
        first = next(iter(runners.values())).model
        self._first_model = first  # input checks read its sizes on every add_input
        self._hidden_size = first.hidden_size
        # u-shape: the model ends at the middle layers; every computed position's hidden state is returned
        self.output_states = first.returns_states
        self.eos_token_ids = list(first.eos_token_ids)
        self.vocab_size = first.vocab_size
        self.draft_inputs: torch.Tensor | None = None  # [V, H] the cloud drafter's rows (set_draft_inputs)
        if not self.output_states:  # the sampler's kernels compiled now, not by the first sampled request (CUDA)
            for r in runners.values():
                if r.pool.k.device.type == "cuda":
                    warm_up(self.vocab_size, tuple({torch.float32, getattr(r.model, "dtype", torch.float32)}),
                            r.pool.k.device)

    @classmethod
    def from_models(cls, config: EngineConfig, models: dict[str, CloudModel], metrics=None,
                    make_runner=None) -> LLMEngine:
        """Allocate one KV pool per variant (``config.num_blocks`` blocks) and wrap each model in a runner.

        ``make_runner(index, model, pool)`` builds a custom runner (tensor parallel, a fast path)."""
        runners = {}
        for i, (variant, model) in enumerate(models.items()):
            pool = KVCachePool(model.num_layers, config.num_blocks, config.block_size, model.num_kv_heads,
                               model.head_dim, model.dtype, next(model.parameters()).device,
                               config.kv_cache_dtype)
            runners[variant] = (make_runner(i, model, pool) if make_runner is not None
                                else ModelRunner(model, pool, batch_invariant=config.batch_invariant))
        return cls(config, runners, metrics)

    def set_draft_inputs(self, table: torch.Tensor) -> None:
        """Load the cloud drafter's table ``[V, H]`` (any float dtype, host memory): row v approximates the
        boundary state of token v (module docstring, "cloud drafts")."""
        model = self._first_model
        if self.output_states:
            raise ValueError("a u-shape model returns states, not tokens: it cannot draft")
        if table.dim() != 2 or tuple(table.shape) != (self.vocab_size, model.hidden_size):
            raise ValueError(f"draft inputs of shape {tuple(table.shape)}; the model needs "
                             f"({self.vocab_size}, {model.hidden_size})")
        self.draft_inputs = table

    @property
    def max_cloud_drafts(self) -> int:
        """Drafts the engine proposes per round at most (0: no drafter loaded, or switched off)."""
        return self.config.cloud_drafts if self.draft_inputs is not None else 0

    # -- requests ---------------------------------------------------------------------------
    def resolve_variant(self, requested: str | None) -> str:
        """The loaded variant serving a request that asks for ``requested`` (the default if not loaded)."""
        if requested in self.runners:
            return requested
        if requested in ("bf16", "fp16", "fp32"):  # same family, another float: closest loaded float variant
            for v in ("bf16", "fp16", "fp32"):
                if v in self.runners:
                    return v
        return self.default_variant

    def add_request(self, request_id: str, first: InputChunk, params: SamplingParams,
                    variant: str | None = None, prefix_keys: list[str] | None = None,
                    output_ids: list[int] | None = None) -> list[RequestOutput]:
        """Admit a request; returns an error output (and admits nothing) if it is refused.

        ``output_ids``: a replayed request's tokens generated so far (full-model mode's replay of a request dropped
        for load; they end its prompt): the request goes on as the one that generated them - its penalties count
        them, ``params.max_tokens`` and the outputs' ``num_output_tokens`` include them."""
        if request_id in self.seqs:
            return [self._error_output(request_id, "duplicate_request", f"request {request_id!r} is active")]
        if params.seed is None and not params.greedy:  # a key of its own: its draws are a function of it and the
            params = replace(params, seed=self.sampler.fresh_key())  # position, which a decode graph can compute
        seq = Sequence(request_id, params, self.resolve_variant(variant), prefix_keys,
                       feed_back_tokens=first.token_ids is not None, output_ids=output_ids)
        try:
            self._check_input(first)
            self._check_output_ids(seq)
            self.scheduler.add(seq, first)
        except RequestError as e:
            self.scheduler.remove(seq, "error")
            return [self._error_output(request_id, e.code, e.message)]
        self.seqs[request_id] = seq
        if self.metrics is not None and seq.prompt_complete:  # (a prompt sent in chunks: at its last, _push)
            self.metrics.on_admit(seq)
        return []

    def add_input(self, request_id: str, chunk: InputChunk) -> list[RequestOutput]:
        """The next input chunk of a running request (a decode step's hidden state, or more prompt)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return [self._error_output(request_id, "unknown_request", f"no active request {request_id!r}")]
        h = chunk.hidden
        if h is None or chunk.rope_positions is not None or h.shape[1] != self._hidden_size:
            try:
                self._check_input(chunk)  # (a plain [n, H] state of the right width passes its checks)
            except RequestError as e:
                return [self._finish(seq, "error", e.code, e.message)]
        return self._push(seq, chunk)

    def add_inputs(self, request_ids: list[str], starts: list[int], hidden: torch.Tensor) -> list[RequestOutput]:
        """Decode steps of several requests at once: row ``i`` of ``hidden`` ``[S, H]`` is the boundary state of
        ``request_ids[i]``'s position ``starts[i]`` (one position each, ending its input turn; float32, or float16
        as the default client's decode steps come: the runner widens them on its copy), as ``add_input``
        with ``InputChunk(starts[i], hidden=hidden[i:i + 1])`` would take it, same checks, same errors. Where the
        next step continues the last decode batch with rows of this array only (in any order), the runner takes
        ``hidden`` itself and the rows' order: no per-row gather on the host; a float32 array from
        :meth:`input_buffer` goes up without a copy. The engine may read ``hidden`` until that step's tokens are
        out: write the next step's states elsewhere."""
        n = len(request_ids)
        if len(starts) != n or hidden.dim() != 2 or hidden.shape[0] != n:
            raise ValueError(f"{n} request ids, {len(starts)} starts and hidden states of shape "
                             f"{tuple(hidden.shape)}: one [1, H] row per request")
        if hidden.shape[1] != self._hidden_size:  # every row fails add_input's width check
            return [o for i, (rid, s) in enumerate(zip(request_ids, starts))
                    for o in self.add_input(rid, InputChunk(s, hidden=hidden[i:i + 1]))]
        outputs, seqs, decode_step = [], self.seqs, InputChunk.decode_step
        for i, (rid, start) in enumerate(zip(request_ids, starts)):
            seq = seqs.get(rid)
            if seq is None:
                outputs.append(self._error_output(rid, "unknown_request", f"no active request {rid!r}"))
                continue
            outputs += self._push(seq, decode_step(start, hidden, i))
        return outputs

    def input_buffer(self, rows: int) -> torch.Tensor:
        """A host float32 array ``[rows, H]`` to write decode steps' states into for :meth:`add_inputs`:
        page-locked where the default variant's runner uploads from such memory (the CUDA fast path), so the
        states go up from it directly. A fresh buffer per call (its memory is reused only once the device has
        read it)."""
        make = getattr(self.runners[self.default_variant], "host_buffer", None)
        shape = (rows, self._hidden_size)
        return make(shape, torch.float32) if make is not None else torch.empty(shape, dtype=torch.float32)

    def _push(self, seq: Sequence, chunk: InputChunk) -> list[RequestOutput]:
        """``chunk`` (its own checks passed) is ``seq``'s next input: the request-level rules, then queued."""
        try:
            if chunk.end > self.config.max_context:
                raise RequestError("too_long", f"position {chunk.end} exceeds the context of "
                                               f"{self.config.max_context}")
            if chunk.is_spec and seq.params.logprobs is not None:
                raise RequestError("bad_input", "speculative steps do not report logprobs: send DecodeSteps")
            if self.output_states and chunk.start < seq.num_received:  # u-shape: the edge rolled back drafts
                seq.rewind(chunk.start)
                self.block_managers[seq.variant].truncate(seq.block_table, chunk.start)
            counted = seq.prompt_complete
            seq.push(chunk)
            if not counted and seq.prompt_complete and self.metrics is not None:  # its prompt's last chunk: the
                self.metrics.on_admit(seq)  # counters take the whole prompt (its first chunk was 128 of 700)
        except (RequestError, ValueError) as e:
            code = e.code if isinstance(e, RequestError) else "bad_input"
            return [self._finish(seq, "error", code, str(e))]
        return []

    def rewind_states(self, request_id: str, position: int) -> bool:
        """u-shape ``Resume``: keep the request's KV ``[0, position)`` only - into the prompt too - so that the
        inputs the edge sends again from ``position`` are computed again. Only for a request at rest (nothing
        pending, every received position computed: the endpoint asks once the States of every position are back
        and admits no input before its ``Resumed``). False: the request is gone, or not at rest."""
        seq = self.seqs.get(request_id)
        if seq is None or not self.output_states:
            return False
        try:
            seq.rewind(position, into_prompt=True)
        except ValueError:
            return False
        self.block_managers[seq.variant].truncate(seq.block_table, position)
        return True

    def abort(self, request_id: str, reason: str = "abort") -> list[RequestOutput]:
        seq = self.seqs.get(request_id)
        return [] if seq is None else [self._finish(seq, reason)]

    def abort_idle(self, timeout_s: float) -> list[RequestOutput]:
        """Abort requests that have waited more than ``timeout_s`` for their next input (a vanished edge)."""
        now = time.monotonic()
        stale = [s for s in self.seqs.values() if not s.pending and now - s.waiting_since > timeout_s]
        return [self._finish(s, "timeout", "timeout", f"no input for {timeout_s:g} s") for s in stale]

    def _check_input(self, chunk: InputChunk) -> None:
        model = self._first_model
        if chunk.hidden is not None and chunk.hidden.shape[1] != model.hidden_size:
            raise RequestError("bad_input", f"hidden size {chunk.hidden.shape[1]}, the model's is "
                                            f"{model.hidden_size}")
        if chunk.rope_positions is not None and not model.mrope:
            raise RequestError("bad_input", "rope_positions sent to a model without multimodal RoPE")
        if chunk.token_ids is not None:
            if model.embed_tokens is None:
                raise RequestError("bad_input", "this server runs the back layers only: send hidden states")
            if int(chunk.token_ids.min()) < 0 or int(chunk.token_ids.max()) >= self.vocab_size:
                raise RequestError("bad_input", f"token id out of range [0, {self.vocab_size})")

    def _check_output_ids(self, seq: Sequence) -> None:
        """A replay's tokens so far (:meth:`add_request`): token ids (the penalties count them by id) that leave a
        token to generate."""
        out = seq.output_ids
        if out and (min(out) < 0 or max(out) >= self.vocab_size):
            raise RequestError("bad_input", f"generated token id out of range [0, {self.vocab_size})")
        if len(out) >= seq.params.max_tokens:
            raise RequestError("bad_input", f"{len(out)} tokens generated already, max_tokens "
                                            f"{seq.params.max_tokens}: nothing left to generate")

    # -- the step ---------------------------------------------------------------------------
    def has_ready(self) -> bool:
        """A sequence is ready to be scheduled (:attr:`Sequence.ready`, inlined: the serving loop asks every turn)."""
        finished = SequenceStatus.FINISHED
        return any((p := s.pending) and p[0].start == s.num_computed and s.status is not finished
                   for s in self.seqs.values())

    def has_work(self) -> bool:
        """:meth:`step` has something to do: a sequence is ready, or a launched step awaits its postprocess."""
        return bool(self._in_flight) or self.has_ready()

    def has_in_flight(self) -> bool:
        """A launched step awaits its postprocess (the next :meth:`step` delivers its outputs)."""
        return bool(self._in_flight)

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> launch on the device (one forward pass per variant) -> postprocess.

        With ``config.async_scheduling`` (the default) the step launched here is postprocessed by the next
        call, after that call has launched its own: the host's scheduling, batch building and input copies
        for step t + 1 and the postprocessing of step t overlap the device's work. A sequence whose token is
        in flight is not scheduled again before it is postprocessed (its next input depends on the token), so
        the outputs are the synchronous engine's, one call later; a call that launches nothing postprocesses
        at once."""
        # a prompt-only step queued behind in-flight decode rows would delay their next step by a whole chunk
        prefill_alone = not any(step.decodes for step in self._in_flight)
        batches, victims = self.scheduler.schedule(preempt=not self._in_flight, prefill_alone=prefill_alone)
        outputs = [self._finish(s, "error", "kv_cache_full", "the KV pool is exhausted; request aborted")
                   for s in victims]
        launched = [self._launch(b) for b in batches]
        done, self._in_flight = ((self._in_flight, launched) if self.config.async_scheduling
                                 else (self._in_flight + launched, []))  # (switched off with a step in flight)
        for step in done:
            outputs += self._postprocess(step)
        if self.metrics is not None:
            self.metrics.on_step(self, sum(b.num_tokens for b in batches))
        return outputs

    def _launch(self, batch: ScheduledBatch) -> _Launched:
        """Queue ``batch``'s forward pass and its sampling on the device (no host sync). Its positions count as
        computed from here on (the device runs steps in order: a later step reads their KV after it is
        written), so a prompt's next chunk can be scheduled before this one finishes; full prefix blocks are
        published."""
        items = batch.items
        seqs = [it.seq for it in items]
        ends = [it.chunk.end for it in items]
        plain = batch.plain_decode and not self.output_states  # the steady decode step: no rows to split off
        logits, ids, missed = self._run(batch, seqs, ends)  # [S, V] (u-shape: [T, H]); ids [S] or None (below)
        decodes = plain or any(it.chunk.n == 1 or it.chunk.is_spec for it in items)
        if self.output_states:  # u-shape: the rows are hidden states [T, H]; nothing is sampled
            advance(seqs, ends)
            return _Launched(batch, [], None, states=logits, decodes=decodes)
        if plain:
            spec_rows, drafted = [], None
            rows = self._last_decode.get(batch.variant)
            if rows is None or rows.seqs is not seqs:  # (its hidden states were not float32 rows)
                rows = _DecodeRows(seqs, [], [], [s.params for s in seqs], [s.output_ids for s in seqs])
            pending = (self.sampler.launch(logits, rows.params, ends, rows.histories, ids) if missed is None else
                       self.sampler.launch(logits, rows.params, ends, drawn=(ids, missed)))
        else:
            spec_rows, drafted, logits = self._split_rows(batch, logits)
            sampled = [it for it in items if it.sample and not it.chunk.is_spec and not it.chunk.cloud_draft]
            pending = self.sampler.launch(logits, [it.seq.params for it in sampled],
                                          [it.chunk.end for it in sampled],
                                          [it.seq.output_ids for it in sampled]) if sampled else None
        advance(seqs, ends)
        for seq in seqs:
            if seq.prefix_keys:
                self.scheduler.publish_prefix(seq)
        return _Launched(batch, spec_rows, pending, drafted=drafted, decodes=decodes,
                         device_span=self._device_span(self.runners[batch.variant]))

    def _device_span(self, runner) -> tuple | None:
        """The steady decode step's device span (CUDA, with metrics): the runner's event recorded at its graph
        replay (``replay_event``, asked for with ``time_replays``) and one recorded now, after the ids' copy was
        queued. Events are timestamped in stream order, so an overlapped step's span starts where the device began
        it, not at its launch. None for passes without a replay event (rebuilt batches: their host work is inside)."""
        if self.metrics is None or runner not in self._timed_runners:
            return None
        runner.time_replays = True
        begin, runner.replay_event = getattr(runner, "replay_event", None), None
        if begin is None:
            return None
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return begin, end

    def _device_time(self, step: _Launched) -> None:
        """``autoglm:engine_device_step_seconds`` of each postprocessed steady step whose device work has ended, in
        launch order (never a sync of its own)."""
        if step.device_span is not None:
            self._device_spans.append(step.device_span)
        spans = self._device_spans
        while spans and spans[0][1].query():
            begin, end = spans.popleft()
            self.metrics.on_device_step(begin.elapsed_time(end) / 1e3)

    def _run(self, batch: ScheduledBatch, seqs: list[Sequence] | None = None, ends: list[int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The forward pass of ``batch`` (``seqs`` and ``ends``: its items' sequences and chunk ends, if the caller
        has them), queued on the device: the logits ``[S, V]`` of its sampled rows (u-shape: the hidden states
        ``[T, H]`` of all its positions), float32 or the model's dtype (:meth:`_continue_decode`); ids ``[S]``
        where the runner computed them (else None): their argmax, or with missed ``[S]`` (not None) the tokens its
        graph sampled (the sampler's ``GraphSampling``)."""
        items = batch.items
        if seqs is None or ends is None:
            seqs, ends = [it.seq for it in items], [it.chunk.end for it in items]
        runner = self.runners[batch.variant]
        out = self._continue_decode(batch, runner, seqs, ends)
        if self.metrics is not None:
            self.metrics.on_batch(out is not None)
        if out is not None:
            return out
        flat = build_batch([it.chunk for it in items], [s.block_table for s in seqs],
                           self.config.block_size, [it.sample for it in items], all_rows=self.output_states,
                           host_buffer=getattr(runner, "host_buffer", None))
        return runner.run(flat), None, None

    def _continue_decode(self, batch: ScheduledBatch, runner, seqs: list[Sequence], ends: list[int]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """The steady decode step without rebuilding its batch: when ``batch`` is the last launched decode batch
        one position on (the same sequences in the same order, each one token further, every row sampled), a runner
        that keeps its last decode batch (``continue_decode``, the fast runner's persistent batch) gets only the
        hidden states - the :meth:`add_inputs` array itself and the batch's rows in it when every chunk is a row of
        one such array (of several: one per front-end worker's turn, concatenated once), else the rows gathered into
        the runner's buffer ``[S, H]`` - and the blocks appended to its
        rows' tables since, ``(row, column, block)`` each (a step one position on adds at most one per table, at its
        end; any other change to a table moves its positions too); and, where the runner samples in its graph
        (``samples_in_graph``), the composition's sampling columns (``Sampler.graph_columns``). Returns its
        (logits ``[S, V]`` in the model's dtype, ids ``[S]``, missed ``[S]`` or None: see :meth:`_run`), or None:
        run the full batch."""
        items = batch.items
        last = self._last_decode.pop(batch.variant, None)
        if self.output_states or not (batch.plain_decode or all(it.sample and it.chunk.n == 1 for it in items)):
            return None
        f32 = torch.float32
        chunks = [it.chunk for it in items]
        fed, order = self._fed_rows(chunks)  # the add_inputs arrays ([N_i, H] each), [S] the batch's rows in them
        if fed is None:
            hidden = [c.hidden for c in chunks]  # [1, H] each
            if not all(h is not None and h.dtype is f32 for h in hidden):
                return None
        lens = [len(s.block_table) for s in seqs]
        same = last is not None and last.seqs == seqs
        params = last.params if same else [s.params for s in seqs]
        cont = getattr(runner, "continue_decode", None)
        out = None
        if cont is not None and same and last.next_ends == ends:
            grown = [] if last.table_lens == lens else self._grown(seqs, last.table_lens, lens)
            if grown is not None:
                if fed is None:  # [S, H]: the [1, H] rows gathered into the runner's buffer, in the batch's order
                    rows, order = torch.cat(hidden, out=runner.host_buffer((len(hidden), hidden[0].shape[1]), f32)), None
                else:  # [N, H]: the array, or the arrays of several front-end workers' turns concatenated once
                    dtype = fed[0].dtype if all(a.dtype == fed[0].dtype for a in fed) else f32  # (mixed: widened)
                    rows = fed[0] if len(fed) == 1 else torch.cat(
                        fed, out=runner.host_buffer((sum(a.shape[0] for a in fed), fed[0].shape[1]), dtype))
                    if order == list(range(rows.shape[0])):
                        order = None  # its rows in the batch's order (lockstep): nothing to pick on the device
                cols = (self.sampler.graph_columns(params, runner.device)
                        if getattr(runner, "samples_in_graph", False) else None)
                out = cont(rows, grown, order, cols)  # (logits, ids, missed), or None: the runner ran another step
        # (recorded after the launch: the device is busy meanwhile)
        self._last_decode[batch.variant] = _DecodeRows(
            seqs, [e + 1 for e in ends], lens, params, last.histories if same else [s.output_ids for s in seqs])
        return out

    @staticmethod
    def _fed_rows(chunks: list[InputChunk]) -> tuple[list[torch.Tensor] | None, list[int] | None]:
        """Where every chunk is a row of an :meth:`add_inputs` array (``InputChunk.decode_step``; float32 or
        float16): those arrays in first-use order (one per front-end worker's turn) and each chunk's row in their
        concatenation; else (None, None)."""
        first = getattr(chunks[0], "rows", None)
        if first is None or first.dtype not in _ROW_DTYPES:
            return None, None
        offsets: dict[int, int] = {id(first): 0}
        arrays, n, order = [first], first.shape[0], []
        for c in chunks:
            rows = getattr(c, "rows", None)
            if rows is None:
                return None, None
            at = offsets.get(id(rows))
            if at is None:
                if rows.dtype not in _ROW_DTYPES:
                    return None, None
                at = offsets[id(rows)] = n
                arrays.append(rows)
                n += rows.shape[0]
            order.append(at + c.row)
        return arrays, order

    @staticmethod
    def _grown(seqs: list[Sequence], before: list[int], now: list[int]) -> list[tuple[int, int, int]] | None:
        """The block appended to each table of ``seqs`` whose length went from ``before[i]`` to ``now[i]``: (row,
        column, block) each; None when a table's length changed by anything but one block more."""
        grown = []
        for i, (seq, a, b) in enumerate(zip(seqs, before, now)):
            if b != a:
                if b != a + 1:
                    return None
                grown.append((i, a, seq.block_table[a]))
        return grown

    def _postprocess(self, step: _Launched) -> list[RequestOutput]:
        """A launched step's tokens: each sampled sequence takes its token (:meth:`Sequence.update_from_output`)
        or its speculative verdict, then stops or continues. A sequence finished while the step was in flight
        (abort, timeout) is skipped: its final output went out then."""
        if step.states is not None:
            return self._states_outputs(step)
        sample = step.sample
        ids = sample.token_ids() if sample is not None else []  # the plain sampled rows' tokens, in item order
        self._device_time(step)
        with_lp = sample.result() if sample is not None and sample.logprobs else None  # SampledToken per row
        spec_rows = iter(step.spec_rows)
        drafted = iter(step.drafted.tolist() if step.drafted is not None else ())
        now = time.monotonic()
        metrics, finished = self.metrics, SequenceStatus.FINISHED
        outputs = []
        r = 0  # the next plain sampled row
        for it in step.batch.items:
            if not it.sample:
                continue
            seq, chunk = it.seq, it.chunk
            if chunk.cloud_draft:
                draft = next(drafted)
                if seq.status is not finished:
                    outputs += self._after_draft(seq, chunk, draft)
                continue
            if chunk.is_spec:
                rows = next(spec_rows)
                if seq.status is finished:
                    continue
                out = self._after_verdict(seq, chunk, rows, now)
            else:
                r += 1
                if seq.status is finished:
                    continue
                if metrics is not None:
                    metrics.on_token(seq, now)  # reads the previous token's time: before the update
                seq.update_from_output(chunk.end, ids[r - 1], now)
                out = self._after_token(seq, ids[r - 1], with_lp[r - 1] if with_lp is not None else None)
            if seq.ask_drafts <= 0 or not self._draft_after(seq, out):
                outputs.append(out)
        return outputs

    def _states_outputs(self, step: _Launched) -> list[RequestOutput]:
        """u-shape: each scheduled chunk's hidden states go back to its edge (prompt chunks too: the edge's tail
        needs every position's KV)."""
        now, row, outputs = time.monotonic(), 0, []
        states = step.states.cpu()  # [T, H]: one copy to the host per step
        for it in step.batch.items:
            n, seq = it.chunk.n, it.seq
            rows = states[row:row + n]  # [n, H]
            row += n
            if seq.status is SequenceStatus.FINISHED:
                continue
            seq.returned_states(now)
            outputs.append(RequestOutput(seq.request_id, num_prompt_tokens=seq.num_prompt_tokens,
                                         states=rows, states_start=it.chunk.start))
        return outputs

    @staticmethod
    def _split_rows(batch: ScheduledBatch, logits: torch.Tensor
                    ) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
        """Separate the logits rows of speculative steps (k + 1 each, ``[k + 1, V]`` per step, in item order) and
        of cloud draft steps (their argmax ids ``[D]``, queued on the device) from the plain sampled rows
        (``[S, V]``, one per sampled item)."""
        if not any(it.chunk.is_spec or it.chunk.cloud_draft for it in batch.items):
            return [], None, logits
        spec, drafts, plain, row = [], [], [], 0
        for it in batch.items:
            if not it.sample:
                continue
            if it.chunk.is_spec:
                spec.append(logits[row:row + it.chunk.n])
                row += it.chunk.n
                continue
            (drafts if it.chunk.cloud_draft else plain).append(row)
            row += 1
        dev = logits.device
        drafted = logits[torch.tensor(drafts, dtype=torch.long, device=dev)].argmax(-1) if drafts else None
        return spec, drafted, logits[torch.tensor(plain, dtype=torch.long, device=dev)]

    # -- cloud drafts -------------------------------------------------------------------------
    def _draft_after(self, seq: Sequence, out: RequestOutput) -> bool:
        """After ``out`` (a token that does not finish ``seq``): if its edge asked for cloud drafts, hold ``out``
        back and feed the token's draft row (module docstring, "cloud drafts"); True when held."""
        goal = min(seq.ask_drafts, self.max_cloud_drafts, seq.params.max_tokens - len(seq.output_ids) - 1,
                   self.config.max_context - seq.num_received - 2)
        if out.finished or goal <= 0 or seq.feed_back_tokens or seq.params.logprobs is not None:
            return False
        seq.begin_drafting(out, goal)
        self._push_draft(seq, out.token_id)
        return True

    def _push_draft(self, seq: Sequence, token: int) -> None:
        row = self.draft_inputs[token].to(torch.float32)[None]  # [1, H]
        seq.push(InputChunk(seq.num_received, hidden=row, cloud_draft=True))

    def _after_draft(self, seq: Sequence, chunk: InputChunk, draft: int) -> list[RequestOutput]:
        """A cloud draft step's argmax ``draft``: feed it for the next one, or end the round and release the held
        output with the drafts."""
        seq.update_from_output(chunk.end)
        seq.drafts.append(draft)
        p = seq.params
        stops = draft in p.stop_token_ids or (not p.ignore_eos and draft in self.eos_token_ids)
        if len(seq.drafts) < seq.draft_goal and not stops:
            self._push_draft(seq, draft)
            return []
        drafts, began = seq.drafts, seq.draft_began
        out = seq.end_drafting()
        self.block_managers[seq.variant].truncate(seq.block_table, seq.num_computed)
        out.draft_ids, out.draft_s = list(drafts), time.monotonic() - began
        return [out]

    def _after_verdict(self, seq: Sequence, chunk: InputChunk, rows: torch.Tensor, now: float) -> RequestOutput:
        """A verified speculative step: emit the accepted drafts and the model's next token (cut at the first
        that stops the request), keep only their positions' KV (the rejected drafts' blocks go back to the
        pool), then stop or continue as after a plain token."""
        tokens = [t.token_id for t in verify(rows, chunk.draft_ids, seq.params, self.spec_sampler, chunk.start,
                                             seq.output_ids)]
        reason = None
        for j, t in enumerate(tokens):  # the stop rules of _after_token, for the j-th emitted token
            p = seq.params
            if t in p.stop_token_ids or (not p.ignore_eos and t in self.eos_token_ids):
                reason = "stop"
            elif len(seq.output_ids) + j + 1 >= p.max_tokens or chunk.start + j + 2 >= self.config.max_context:
                reason = "length"
            if reason is not None:
                tokens = tokens[:j + 1]
                break
        if self.metrics is not None:
            self.metrics.on_token(seq, now)
        seq.accept_speculation(chunk.start, tokens, now)
        self.block_managers[seq.variant].truncate(seq.block_table, seq.num_computed)
        out = RequestOutput(seq.request_id, tokens[-1], finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens,
                            num_cached_tokens=seq.num_cached_tokens, num_output_tokens=len(seq.output_ids),
                            accepted_ids=tuple(tokens[:-1]))
        if reason is not None:
            self._release(seq, reason)
        return out

    def _after_token(self, seq: Sequence, token: int, sampled: SampledToken | None = None) -> RequestOutput:
        """The output for a freshly sampled ``token`` (``sampled``: its logprobs, when asked for); finishes ``seq``
        if it stops, feeds the token back in full-model mode."""
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or seq.num_received + 1 >= self.config.max_context:
            reason = "length"  # (max_context: the token itself needs a position)
        else:
            reason = None
        lp, top = (None, None) if sampled is None else (sampled.logprob, sampled.top_logprobs)
        # (positional: request_id, token_id, logprob, top_logprobs, finish_reason, error_code, error_message, the
        # counts; the keyword call cost ~0.4 us more, once per token)
        out = RequestOutput(seq.request_id, token, lp, top, reason, None, None, seq.num_prompt_tokens,
                            seq.num_cached_tokens, len(seq.output_ids))
        if reason is not None:
            self._release(seq, reason)
        elif seq.feed_back_tokens:
            seq.push(InputChunk(seq.num_received, token_ids=torch.tensor([token])))
        return out

    # -- release ----------------------------------------------------------------------------
    def _release(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq, reason)
        self.seqs.pop(seq.request_id, None)
        if self.metrics is not None:
            self.metrics.on_finish(seq)

    def _finish(self, seq: Sequence, reason: str, code: str | None = None,
                message: str | None = None) -> RequestOutput:
        self._release(seq, reason)
        return RequestOutput(seq.request_id, finish_reason=reason, error_code=code, error_message=message,
                             num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                             num_output_tokens=len(seq.output_ids))

    @staticmethod
    def _error_output(request_id: str, code: str, message: str) -> RequestOutput:
        return RequestOutput(request_id, finish_reason="error", error_code=code, error_message=message)

    # -- accounting -------------------------------------------------------------------------
    def num_used_blocks(self) -> int:
        return sum(bm.num_used_blocks for bm in self.block_managers.values())

    def kv_usage(self) -> float:
        total = sum(bm.num_blocks for bm in self.block_managers.values())
        return self.num_used_blocks() / total
