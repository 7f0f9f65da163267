"""Protocol messages -> engine inputs, engine outputs -> protocol messages, for split sessions.

The split endpoint (``cloud_server.split_endpoint``) hands this module only messages the session's state
machine has accepted (``shared.session_state``), with the request's track; what is left here is translation:

* a request's first ``Prefill`` -> ``AsyncEngine.add_request`` (sampling parameters, compute variant chosen by
  the precision policy unless the edge named one, prefix keys in the session's tenant namespace - the shared
  one for an operator's key: ``shared.prefix_keys.tenant_scoped``), later chunks, ``DecodeStep``\\ s and
  ``SpecStep``\\ s (their drafts on the engine chunk: ``cloud_server.engine.speculation`` verifies them) ->
  ``add_input``, ``Cancel`` -> ``abort``, ``Resume`` -> ``Resumed`` from the server's record (u-shape: once
  the engine's work in flight for the request is back, its KV is rolled back to the positions whose States the
  edge holds, ``LLMEngine.rewind_states``, and those after are recomputed from the inputs the edge resends);
* coded hidden states -> float32 tensors ``[n, H]`` checked against the engine's fixed facts (width, RoPE);
  ``DecodeStep`` states are decoded together: the steps that arrive in one turn of the event loop (one per
  decoding session) are held until the loop's next turn and decoded in one pass per codec
  (``BoundaryCodec.decode_rows``), on a worker thread when there are many (``cloud_server.step_pipeline``),
  then handed to the engine in arrival order as one command: plain steps as one ``[S, H]`` array
  (``AsyncEngine.add_rows``: no engine chunk per row, one wakeup of the engine thread per turn), steps with
  3-D RoPE or asking for drafts as chunks (``add_inputs``). Anything else the translator does waits behind the
  steps held or decoding before it, so a request's messages reach the engine in the order they came;
* engine outputs (on the event-loop thread, through one :class:`~cloud_server.loop_inbox.LoopInbox`: one
  loop wakeup per engine step, not per token) -> ``Tokens`` / ``Error``, with the engine's error codes
  mapped to wire codes of the same meaning (:data:`WIRE_CODES`).

Every message goes out through ``Session.send``, so the state machine records it.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections.abc import Callable

import numpy as np
import torch

from cloud_server.engine.async_engine import EngineDeadError
from cloud_server.engine.llm_engine import RequestOutput
from cloud_server.engine.sampling_params import SamplingParams, SamplingParamsError
from cloud_server.engine.sequence import InputChunk
from cloud_server.engine_facts import EngineFacts
from cloud_server.limits import RETRY_AFTER_MS
from cloud_server.loop_inbox import LoopInbox
from cloud_server.precision_select import request_compute
from cloud_server.session_store import RequestRecord, Session
from cloud_server.step_pipeline import StepPipeline
from shared import protocol as P
from shared.prefix_keys import tenant_scoped
from shared.session_state import RequestTrack

log = logging.getLogger("autoglm.cloud.split")

# engine error code -> wire code (shared.errors.SESSION_ERROR_CODES); each keeps its meaning
WIRE_CODES = {"too_long": "context_full", "kv_cache_full": "overloaded", "engine_error": "internal",
              "engine_gone": "draining",  # a front-end worker's engine process was killed: the edge goes elsewhere
              "timeout": "timeout", "bad_input": "bad_input", "unknown_request": "unknown_request",
              "duplicate_request": "duplicate_request", "prefix_miss": "prefix_miss"}
# engine finish reason -> wire finish reason
WIRE_FINISH = {"stop": "stop", "length": "length", "abort": "cancelled", "cancelled": "cancelled"}
# A loop turn's decode steps are decoded on the loop below this many (cloud_server.step_pipeline): with the
# one-pass row decoders (fp16 ~5 us, int8-outlier ~9 us a row on a slow CPU) the hop to the worker thread
# and back (two GIL hand-overs and a self-pipe wakeup) cost the loop more than decoding 64 rows itself
# (bench/served_load.py, wide-cpu, S=64: loop CPU per token 179 -> 151 us fp16, 188 -> 160 us int8-outlier)
STEP_POOL_MIN_ROWS = 256


def engine_params(p: P.SamplingParams, max_context: int) -> SamplingParams:
    """The engine's sampling parameters for a request's wire ``params`` (raises ``SamplingParamsError``)."""
    want_lp = p.logprobs or p.top_logprobs > 0
    return SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                          max_tokens=min(p.max_tokens, max_context), stop_token_ids=list(p.stop_token_ids),
                          ignore_eos=p.ignore_eos, logprobs=p.top_logprobs if want_lp else None,
                          presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                          repetition_penalty=p.repetition_penalty)


class BadInput(Exception):
    """A message the state machine accepted whose contents the model cannot take; ``code`` is the wire code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class _RowBatch:
    """Consecutive plain decode steps of one hand-over: their rows stacked into one ``[S, H]`` tensor for
    ``add_rows`` (float16 where every row came as fp16, the default client's decode steps: half the bytes to
    pickle, pipe and upload, widened by the engine's copy into its input; else float32), their uplink counted
    once per codec."""

    def __init__(self, translator: SplitTranslator):
        self.t = translator
        self.ids: list[str] = []
        self.starts: list[int] = []
        self.rows: list[np.ndarray] = []  # [1, H] float32 or float16 each
        self.uplink: dict[str, list[int]] = {}  # codec -> frame sizes

    def add(self, engine_id: str, start: int, row: np.ndarray, codec: str, nbytes: int) -> None:
        self.ids.append(engine_id)
        self.starts.append(start)
        self.rows.append(row)
        self.uplink.setdefault(codec, []).append(nbytes)

    def send(self, steps: list) -> None:
        if not self.ids:
            return
        for codec, sizes in self.uplink.items():
            self.t.rt.metrics.on_uplink_steps(sizes, codec)
        hidden = self.rows[0] if len(self.rows) == 1 else np.concatenate(self.rows)  # [S, H] (mixed: float32)
        rows = (self.ids, self.starts, torch.from_numpy(np.ascontiguousarray(hidden)))
        self.ids, self.starts, self.rows, self.uplink = [], [], [], {}
        self.t._hand_over([], steps, rows)


class SplitTranslator:
    """One per endpoint. ``codecs``: name -> codec able to decode; ``load()``: the server's busy fraction."""

    def __init__(self, runtime, codecs: dict, wire_limits: P.Limits, load: Callable[[], float]):
        self.rt = runtime
        self.codecs = codecs
        self.wire_limits = wire_limits
        self.load = load
        # DecodeSteps (session, track, msg, nbytes), decoded a loop turn's worth at a time off the loop
        self._pipeline = StepPipeline(self._decode_steps, self._hand_over_steps, self._dead,
                                      pool_min_rows=STEP_POOL_MIN_ROWS)
        self._outputs: LoopInbox | None = None  # engine outputs -> on_output, made on the loop at first use
        # u-shape Resumes waiting for the engine's work in flight: engine id -> (session, track, have, generation)
        self._resuming: dict[str, tuple[Session, RequestTrack, int, int]] = {}
        # what to do when the engine has stopped while handing over held steps (the endpoint closes the link)
        self.on_engine_dead: Callable[[Session, EngineDeadError], None] | None = None

    @property
    def facts(self) -> EngineFacts:
        return self.rt.facts

    # -- inputs -----------------------------------------------------------------------------------
    def _inputs(self, msg: P.Prefill | P.DecodeStep | P.SpecStep, start: int, last: bool,
                arr: np.ndarray | None = None) -> InputChunk:
        """The message's hidden states [n, H] float32 (``arr`` if already decoded) and 3-D RoPE positions
        [3, n], as an engine chunk."""
        self._check_width(msg.hidden)
        if arr is None:
            try:
                arr = self.codecs[msg.hidden.codec].decode(msg.hidden, self.wire_limits)  # [n, H] float32
            except P.ProtocolError as e:
                raise BadInput(e.code, e.message) from None
        rope = None
        if msg.rope_positions is not None:
            if not self.facts.mrope:
                raise BadInput("bad_input", "rope_positions sent to a model without multimodal RoPE")
            rope = torch.from_numpy(msg.rope_positions.to_numpy().astype(np.int64))  # [3, n]
        hidden = arr if isinstance(arr, torch.Tensor) else torch.from_numpy(
            np.ascontiguousarray(arr, dtype=np.float32))
        drafts = list(msg.draft_ids) if isinstance(msg, P.SpecStep) else None
        if drafts and max(drafts) >= self.facts.vocab_size:
            raise BadInput("bad_input", f"draft token {max(drafts)} is not in the model's vocabulary of "
                                        f"{self.facts.vocab_size}")
        ask = getattr(msg, "ask_drafts", 0) if last else 0  # StatesSteps carry none
        return InputChunk(start, hidden=hidden, last=last, rope_positions=rope, draft_ids=drafts, ask_drafts=ask)

    def _check_width(self, hidden: P.EncodedTensor) -> None:
        """``BadInput`` unless the tensor's declared shape [n, W] has the model's width W: checked before its payload
        is decoded (a small frame can declare rows of any width, and decoding them costs the server their size)."""
        if hidden.shape[1] != self.facts.hidden_size:
            raise BadInput("bad_input", f"hidden states of width {hidden.shape[1]}; the model takes "
                                        f"{self.facts.hidden_size}")

    def open(self, session: Session, track: RequestTrack, msg: P.Prefill, nbytes: int) -> None:
        """A request's first Prefill: admit it to the engine."""
        if self._pipeline.defer(self.open, session, track, msg, nbytes):
            return
        if track.finish is not None:  # failed while this waited behind decoding steps: nothing to admit
            return
        if track.owner is not None:  # a later chunk, dispatched while the first one waited: admitted by now
            self._add_input(session, track, msg, nbytes)
            return
        rid = msg.request_id
        try:
            chunk = self._inputs(msg, msg.start, msg.last)
            params = engine_params(msg.params, self.facts.max_context)
        except BadInput as e:
            self.fail(session, rid, e.code, e.message)
            return
        except SamplingParamsError as e:
            self.fail(session, rid, "bad_value", str(e))
            return
        if msg.return_states != self.facts.returns_states:  # u-shape: the bundle decides what the cloud returns
            self.fail(session, rid, "bad_input", "this server's bundle ends at its middle layers (split with --tail): "
                      "open requests with return_states" if self.facts.returns_states else
                      "this server samples (a bundle split without --tail): it cannot return states")
            return
        self.rt.metrics.on_uplink(nbytes, msg.hidden.codec, msg.n_tokens)
        end = msg.start + msg.n_tokens
        # The prompt's length: said (Prefill.prompt_len), or known when its first message is also its last; else
        # unknown, and planned as at least max_prefill_chunk_tokens (by default beyond the policy's long prompt).
        prompt = msg.prompt_len or (end if msg.last else max(end, session.state.limits.max_prefill_chunk_tokens))
        planned = msg.compute or request_compute(self.facts, self.load(), session.codecs, prompt,
                                                 msg.rope_positions is not None)
        rec = RequestRecord(track, f"{session.session_id}/{rid}", msg.hidden.codec,
                            self.facts.resolve_variant(planned), prompt_tokens=end)
        track.owner = rec
        inbox = self._inbox()

        def sink(out: RequestOutput, s=session, r=rec) -> None:  # engine thread -> event loop
            inbox.put((s, r, out))

        # a tenant reuses its own blocks and the operator's shared ones, and publishes only into its own scope
        # (none for u-shape: a cached block's positions would be skipped, and the edge's tail needs their states)
        keys = [] if msg.return_states else [tenant_scoped(session.prefix_scope, k) for k in msg.prefix_keys]
        self.rt.engine.add_request(rec.engine_id, sink, chunk, params, rec.compute, keys)

    def _inbox(self) -> LoopInbox:
        loop = asyncio.get_running_loop()
        if self._outputs is None or self._outputs.loop is not loop:  # a new loop (tests restart apps)
            self._outputs = LoopInbox(loop, lambda item: self.on_output(*item))
        return self._outputs

    def more_input(self, session: Session, track: RequestTrack, msg: P.Prefill | P.DecodeStep | P.SpecStep,
                   nbytes: int) -> None:
        """A later Prefill chunk, a DecodeStep or a SpecStep (k + 1 positions to verify) of an admitted request.
        A DecodeStep is held for the pipeline (``cloud_server.step_pipeline``: decoded with the others of this
        loop turn, off the loop when there are many)."""
        if isinstance(msg, P.DecodeStep):
            self._pipeline.hold((session, track, msg, nbytes))
            return
        if self._pipeline.defer(self.more_input, session, track, msg, nbytes):
            return
        if track.finish is None and track.owner is not None:  # else it failed while this waited
            self._add_input(session, track, msg, nbytes)

    def _decode_steps(self, steps: list) -> list[np.ndarray | BadInput | None]:
        """The held steps' states [1, H] each, one ``decode_rows`` pass per codec: float32, or for fp16 steps
        (``half_rows``) float16 as they came, which the engine widens on its copy (on the GPU after the upload).
        A batch that fails is decoded step by step, so only a bad step fails: its entry is the ``BadInput`` (a
        step of another width than the model's is one, not decoded); None: an unknown codec, refused on the loop.
        Runs on the pipeline's worker thread for large batches: it reads only the messages."""
        by_codec: dict[str, list[int]] = {}
        rows: list[np.ndarray | BadInput | None] = [None] * len(steps)
        for i, (_, _, msg, _) in enumerate(steps):
            try:
                self._check_width(msg.hidden)
            except BadInput as e:
                rows[i] = e
                continue
            by_codec.setdefault(msg.hidden.codec, []).append(i)
        for name, idx in by_codec.items():
            codec = self.codecs.get(name)
            if codec is None:
                continue
            tensors = [steps[i][2].hidden for i in idx]
            half_rows = getattr(codec, "half_rows", None)  # fp16: the rows as float16
            try:
                arr = half_rows(tensors, self.wire_limits) if half_rows is not None else None  # [N, H] float16
                if arr is None:
                    arr = codec.decode_rows(tensors, self.wire_limits)  # [N, H] float32
            except P.ProtocolError:
                arr = None  # one by one below: which step is bad
            if arr is not None:
                for j, i in enumerate(idx):
                    rows[i] = arr[j:j + 1]
                continue
            for i in idx:
                try:
                    rows[i] = codec.decode(steps[i][2].hidden, self.wire_limits)  # [1, H]
                except P.ProtocolError as e:
                    rows[i] = BadInput(e.code, e.message)
        return rows

    def _hand_over_steps(self, steps: list, rows: list[np.ndarray | BadInput | None]) -> None:
        """Decoded steps to the engine in arrival order: runs of plain steps (no 3-D RoPE, no drafts asked) as
        one ``[S, H]`` array (``add_rows``), the others as chunks (``add_inputs``); a bad step fails its request
        after the steps before it went."""
        plain = _RowBatch(self)  # consecutive plain steps
        chunks: list[tuple[str, InputChunk]] = []  # consecutive other steps
        now = time.monotonic()
        for (session, track, msg, nbytes), arr in zip(steps, rows):
            rec: RequestRecord = track.owner
            if session.closed or rec is None or not rec.active:  # closed or failed while held: let go
                continue
            try:
                if isinstance(arr, BadInput):
                    raise arr
                if msg.rope_positions is None and not msg.ask_drafts:
                    self._hand_over(chunks, steps)
                    chunks = []
                    rec.last_input = now
                    plain.add(rec.engine_id, msg.position, arr, msg.hidden.codec, nbytes)
                else:
                    plain.send(steps)
                    chunks.append((rec.engine_id, self._chunk_for(track, msg, nbytes, arr)))
            except BadInput as e:  # the steps before it go first: each request's inputs stay in order
                plain.send(steps)
                self._hand_over(chunks, steps)
                chunks = []
                self.fail(session, track.request_id, e.code, e.message)
        plain.send(steps)
        self._hand_over(chunks, steps)

    def _dead(self, session: Session, e: EngineDeadError) -> None:
        if self.on_engine_dead is None:
            raise e
        self.on_engine_dead(session, e)

    def _hand_over(self, batch: list[tuple[str, InputChunk]], steps: list, rows: tuple | None = None) -> None:
        """``batch`` (chunks) or ``rows`` (``(request ids, starts, [S, H] float32)``) to the engine, one command."""
        if not batch and rows is None:
            return
        try:
            if rows is None:
                self.rt.engine.add_inputs(batch)
            else:
                self.rt.engine.add_rows(*rows)
        except EngineDeadError as e:
            if self.on_engine_dead is None:
                raise
            for session in {id(st[0]): st[0] for st in steps}.values():
                self.on_engine_dead(session, e)

    def _add_input(self, session: Session, track: RequestTrack, msg: P.Prefill | P.DecodeStep | P.SpecStep,
                   nbytes: int) -> None:
        try:
            chunk = self._chunk_for(track, msg, nbytes)
        except BadInput as e:
            self.fail(session, track.request_id, e.code, e.message)
            return
        self.rt.engine.add_input(track.owner.engine_id, chunk)

    def _chunk_for(self, track: RequestTrack, msg: P.Prefill | P.DecodeStep | P.SpecStep, nbytes: int,
                   arr: np.ndarray | None = None) -> InputChunk:
        """The engine chunk of a later input of an admitted request, recorded (raises ``BadInput``)."""
        rec: RequestRecord = track.owner
        is_step = isinstance(msg, (P.DecodeStep, P.SpecStep, P.StatesStep))
        start, n = (msg.position, getattr(msg, "n_tokens", 1)) if is_step else (msg.start, msg.n_tokens)
        chunk = self._inputs(msg, start, True if is_step else msg.last, arr)
        self.rt.metrics.on_uplink(nbytes, msg.hidden.codec, n)
        rec.last_input = time.monotonic()
        if not is_step:
            rec.prompt_tokens = start + n
        return chunk

    def cancel(self, track: RequestTrack) -> None:
        if self._pipeline.defer(self.cancel, track):
            return
        if track.owner is not None:  # None: refused before the engine saw it
            self.rt.engine.abort(track.owner.engine_id, "cancelled")

    def resume(self, session: Session, track: RequestTrack, msg: P.Resume) -> None:
        if self._pipeline.defer(self.resume, session, track, msg):
            return
        rec: RequestRecord | None = track.owner
        if rec is None:  # refused before the engine saw it: nothing to resume
            session.send(P.Error(code="resume_failed", message=f"request {track.request_id} was never admitted",
                                 request_id=track.request_id))
            return
        have = msg.have_tokens
        if track.states:
            self._resuming[rec.engine_id] = (session, track, have, session.generation)
            self._resume_states(rec)
            return
        session.send(P.Resumed(request_id=track.request_id, received=track.received, index=have,
                               token_ids=rec.tokens[have:], finish_reason=track.finish))

    def _resume_states(self, rec: RequestRecord) -> None:
        """u-shape Resume, once the States of every position the server holds have gone out (``answered =
        received``: the engine has nothing of the request in flight): roll its KV back to ``have`` on the engine
        thread, then ``Resumed(received=have)``. A newer connection, the request's end or the session's drops
        it (the edge resends Resume on the newer link, or replays)."""
        entry = self._resuming.get(rec.engine_id)
        if entry is None:
            return
        session, track, have, generation = entry
        if not rec.active or session.closed or session.generation != generation:
            del self._resuming[rec.engine_id]
            return
        if track.answered < track.received:
            return  # on_output calls again as the engine's States come back
        del self._resuming[rec.engine_id]
        try:
            # picklable, for a front-end worker's engine link too
            fut = self.rt.engine.call(operator.methodcaller("rewind_states", rec.engine_id, have))
        except EngineDeadError as e:
            self._dead(session, e)
            return
        asyncio.get_running_loop().create_task(self._resumed_states(session, rec, have, generation, fut))

    async def _resumed_states(self, session: Session, rec: RequestRecord, have: int, generation: int,
                              fut) -> None:
        try:
            ok = await asyncio.wrap_future(fut)
        except Exception:  # noqa: BLE001 - the engine stopped or refused: the edge replays
            log.warning("trace=%s u-shape rollback to %d failed", rec.request_id, have, exc_info=True)
            ok = False
        if not rec.active or session.closed or session.generation != generation:
            return  # a newer link resumes it again (the rollback to the same position is then a no-op)
        if not ok:
            self.fail(session, rec.request_id, "resume_failed", f"u-shape request {rec.request_id} could not be "
                                                                f"rolled back to position {have}: replay it")
            return
        session.send(P.Resumed(request_id=rec.request_id, received=have, index=0, token_ids=[]))

    def fail(self, session: Session, rid: str, code: str, message: str, retry_after_ms: int | None = None) -> None:
        """Close request ``rid`` with ``Error(code)``: the engine drops it, the state machine records it.
        ``retry_after_ms``: the wait it asks for (default: ``RETRY_AFTER_MS`` of ``code``)."""
        if self._pipeline.defer(self.fail, session, rid, code, message, retry_after_ms):
            return
        rec = session.record(rid)
        if rec is not None and rec.active:
            self.rt.engine.abort(rec.engine_id, "error")
            self._resuming.pop(rec.engine_id, None)
        session.send(P.Error(code=code, message=message, request_id=rid,
                             retry_after_ms=RETRY_AFTER_MS.get(code) if retry_after_ms is None else retry_after_ms))

    # -- engine outputs (event loop thread) -------------------------------------------------------
    def on_output(self, session: Session, rec: RequestRecord, out: RequestOutput) -> None:
        try:
            self._output(session, rec, out)
        finally:
            if self._resuming and rec.engine_id in self._resuming:
                self._resume_states(rec)  # a u-shape Resume waited for these States (or the request ended)

    def send_progress(self, session: Session, now: float, interval_s: float) -> None:
        """A progress Tokens (no token) for each request of ``session`` that has owed an answer for
        ``interval_s``: a long prefill or a wait in the queue is compute, not a dead link, to the edge."""
        for rec in session.active_requests():
            if rec.progress_due(now, interval_s):
                rec.last_progress = now
                session.send(P.Tokens(request_id=rec.request_id, index=len(rec.tokens), token_ids=[]))

    def _output(self, session: Session, rec: RequestRecord, out: RequestOutput) -> None:
        if not rec.active:
            return  # the edge was already told (an error, a cancel, the session closed) and raced the engine
        rec.last_output = time.monotonic()
        if out.error_code is not None and out.token_id is None:
            code = WIRE_CODES.get(out.error_code, "internal")
            session.send(P.Error(code=code, message=out.error_message or out.error_code, request_id=rec.request_id,
                                 retry_after_ms=RETRY_AFTER_MS.get(code)))
            return
        rec.cached_tokens = out.num_cached_tokens
        if out.states is not None:  # u-shape: the middle's hidden states, coded as the request's uplink
            session.send(self._states(rec, out))
            return
        if out.token_id is None:  # finished without a token: cancelled, aborted
            session.send(self._tokens(rec, [], out, WIRE_FINISH.get(out.finish_reason or "", "error")))
            return
        ids = out.token_ids  # one, or a speculative step's accepted drafts and the model's next token
        rec.tokens.extend(ids)
        finish = WIRE_FINISH.get(out.finish_reason or "", "error") if out.finished else None
        session.send(self._tokens(rec, ids, out, finish))

    def _states(self, rec: RequestRecord, out: RequestOutput) -> P.States:
        """u-shape: ``out.states`` [n, H] as a States message in the codec of the request's first Prefill."""
        hidden = self.codecs[rec.codec].encode(np.ascontiguousarray(out.states.numpy(), dtype=np.float32))
        msg = P.States(request_id=rec.request_id, start=out.states_start, hidden=hidden,
                       timings=P.ServerTimings(total_ms=max(0.0, (time.monotonic() - rec.last_input) * 1000)),
                       plan=None if rec.plan_sent else P.PrecisionPlan(codec=rec.codec, compute=rec.compute))
        rec.plan_sent = True
        return msg

    def _tokens(self, rec: RequestRecord, ids: list[int], out: RequestOutput, finish: str | None) -> P.Tokens:
        """``ids`` as Tokens; the final one (``finish``) also says the server's load: the edge plans the session's
        next request by it (docs/protocol.md, "Precision")."""
        total_ms = (time.monotonic() - rec.last_input) * 1000
        msg = P.Tokens(
            request_id=rec.request_id, index=len(rec.tokens) - len(ids), token_ids=ids,
            logprobs=[max(-1e4, out.logprob)] if ids and out.logprob is not None else None,
            top_logprobs=[[P.TopLogprob(token_id=t, logprob=max(-1e4, lp)) for t, lp in out.top_logprobs]]
            if ids and out.top_logprobs is not None else None,
            finish_reason=finish,
            usage=P.Usage(prompt_tokens=rec.prompt_tokens, completion_tokens=len(rec.tokens),
                          cached_tokens=rec.cached_tokens) if finish is not None else None,
            timings=P.ServerTimings(total_ms=max(0.0, total_ms), draft_ms=min(max(0.0, total_ms), out.draft_s * 1000)),
            plan=None if rec.plan_sent else P.PrecisionPlan(codec=rec.codec, compute=rec.compute),
            draft_ids=out.draft_ids if finish is None else None,
            load=None if finish is None else float(self.load()))
        rec.plan_sent = True
        return msg
