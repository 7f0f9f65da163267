"""The phone's side of a u-shape request: the tail turns the cloud's middle states into logits, the phone samples.

A bundle split with ``--tail M`` keeps layers [0, N) *and* [L - M, L) + norm + lm_head on the phone; the cloud
runs the middle and returns hidden states (``States``), never a token: no token id of the output crosses the
link (docs/protocol.md, "U-shape")::

    Prefill(return_states, start=0, front states [0, n)) ...   <- States(start=0, middle states [0, n)) ...
    the tail over every prompt position (its own KV); the last row's logits -> sample t0 (on the phone)
    StatesStep(position=L, front(t0))                          <- States(start=L, [1, H]) -> tail -> t1 ...
    ... until a stop token, max_tokens or a stop string: Cancel (the phone alone knows when to stop)

Speculation (``speculate``): the phone drafts k tokens (``edge_client.drafting``), runs the last token and the
drafts through the front's decode graph as one chunk (``FrontRuntime.step``, as plain steps) and sends one
StatesStep of k + 1 rows (no draft id leaves the phone); the cloud's k + 1 middle states come back, the tail
turns them into k + 1 logits rows and the phone verifies them with the shared rule
(``shared.speculative_sampling``: the tokens of plain decoding, greedy or sampled with the same seed). The front
and the tail truncate their KV past the first rejected draft; the next StatesStep starts there, which rolls the
cloud's KV back in the same message.

Costs against split: the downlink carries a hidden row per position (prompt positions included) instead of a
token id; the phone runs the tail (and the lm_head) per token; there is no cloud prefix cache (a cached
block's middle states would not come back, and the tail needs every position's KV).

A dropped link: if the cloud session survived, the edge resumes (``Session._resume``) with ``have`` = the
positions whose middle states it holds (:meth:`UShape.resume_point`: the tail's, and those received but not yet
run, cut back to the start of a recorded input they end inside); the cloud drops its KV from there and the
edge resends its recorded inputs from there (prompt chunks, or the StatesStep in flight), so only the states
lost in flight are computed again. Else it replays the request from the record: the front states go up again,
the cloud returns the middle states of the whole context, and the tail skips the positions it already holds.
A bundle update under the request (``Session._rebuild``) gives the loop the new bundle's tail, empty: it runs the
new middle's States of the whole context (the old tail's KV came from the old middle).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import numpy as np

from shared import protocol as P
from shared.speculative_sampling import accept_drafts
from shared.tensors import WireArray

from .errors import EdgeClientError
from .request import answer_end
from .sampling import EdgeSampler
from .tail import TailRuntime


class UShape:
    """The u-shape token loop of one :class:`edge_client.generation.Session` (module docstring)."""

    def __init__(self, session, tail: TailRuntime):
        self.session = session
        self.tail = tail
        self.request = None  # the request whose context the tail holds (from its first States on)

    async def tokens(self, req, stats) -> AsyncIterator[int]:
        """Yield the request's tokens in order (sampled here); drives the steps, verification and recovery."""
        from .generation import _compute  # generation imports this module

        s, tail = self.session, self.tail
        spec = req.spec
        sampler = EdgeSampler(spec.temperature, spec.top_p, spec.top_k, spec.seed)
        stops = set(s.manifest.eos_token_ids)
        tail.reset()
        self.request = req
        t_tail0 = tail.stats.seconds
        try:
            while req.finish is None:
                msg = await s._next_message(req, stats)
                if self.tail is not tail:  # a bundle update rebuilt the request (Session._rebuild): the new bundle's
                    stats.edge_tail_s += tail.stats.seconds - t_tail0  # tail runs its States from position 0
                    tail, t_tail0 = self.tail, self.tail.stats.seconds
                if isinstance(msg, P.Error):
                    raise EdgeClientError(f"cloud error {msg.code}: {msg.message}", msg.code)
                if not isinstance(msg, P.States) or msg.request_id != req.rid:
                    continue
                rows = self._new_rows(req, msg)  # [n, H]: the positions the tail lacks
                if rows is None:
                    continue
                if msg.start + msg.n_tokens < s.runtime.length:  # a prompt chunk: the tail's KV only
                    await _compute(tail.run, rows, 1, s._rope(req, tail.length, rows.shape[0]))
                    continue
                new = await self._next_tokens(req, rows, sampler, stats)
                if not req.tokens:  # the first token: the prompt's tail work ends here
                    stats.edge_tail_prefill_s = tail.stats.seconds - t_tail0
                new, req.finish = answer_end(len(req.tokens), new, req.spec.max_tokens, stops)
                req.tokens.extend(new)
                for t in new:
                    yield t
                if req.finish is None:
                    await s._guarded(req, stats, self._step(req, stats))
        finally:
            stats.edge_tail_s += tail.stats.seconds - t_tail0
            self.request = None
        await s._cancel(req)  # the end of the request: the cloud frees its KV

    def resume_point(self, req, answered: int) -> int:
        """Where a Resume of ``req`` restarts: the positions [0, have) whose middle states the edge holds - the
        tail's (once it works for ``req``) and those of States received but not run yet (``req.pending``), at
        most ``answered`` (what the cloud returned on this request id) - cut back to the start of a recorded
        input that ``have`` falls inside (an input is resent whole; the tail skips what it holds)."""
        held = self.tail.length if self.request is req else 0
        for m in req.pending:
            if isinstance(m, P.States) and m.request_id == req.rid and m.start <= held:
                held = max(held, m.start + m.n_tokens)
        held = min(held, answered)
        return next((s.start for s in req.sent if s.start < held < s.start + s.n), held)

    def _new_rows(self, req, msg: P.States) -> np.ndarray | None:
        """The decoded rows of ``msg`` at positions the tail does not hold yet (a replay resends all)."""
        s = self.session
        skip = self.tail.length - msg.start
        if skip < 0:
            raise EdgeClientError(f"the cloud skipped positions [{self.tail.length}, {msg.start})", "bad_server")
        if skip >= msg.n_tokens:
            return None
        # before decoding: a few bytes can declare any width, and (a compact codec) hundreds of thousands of rows
        if msg.hidden.shape[1] != self.tail.hidden_size:
            raise EdgeClientError(f"States of width {msg.hidden.shape[1]}, the tail takes {self.tail.hidden_size}",
                                  "bad_server")
        track = s.state.track(req.rid)
        sent = 0 if track is None else track.received  # the positions the edge sent: all it can get States of
        if msg.start + msg.n_tokens > sent:
            raise EdgeClientError(f"States of positions [{msg.start}, {msg.start + msg.n_tokens}), the edge sent "
                                  f"[0, {sent})", "bad_server")
        try:
            rows = s.codecs[req.codec].decode(msg.hidden)  # [n, H] float32
        except P.ProtocolError as e:
            raise EdgeClientError(f"undecodable States from the cloud: {e}", "bad_server") from None
        return rows[skip:]

    async def _next_tokens(self, req, rows: np.ndarray, sampler: EdgeSampler, stats) -> list[int]:
        """The tail over the last span's rows; the sampled token (plain) or the verdict on the drafts in flight."""
        from .generation import _compute, _Sent  # generation imports this module

        s, step = self.session, req.spec_step
        if step is not None and (self.tail.length != step.position or rows.shape[0] != len(step.drafts) + 1):
            raise EdgeClientError(f"the cloud answered a {len(step.drafts) + 1}-row StatesStep at {step.position} "
                                  f"with {rows.shape[0]} rows at {self.tail.length}", "bad_server")
        if step is None:
            logits = await _compute(self.tail.run, rows, 1, s._rope(req, self.tail.length, rows.shape[0]))  # [1, V]
            position = self.tail.length
            if req.plain_started is not None:  # a plain step answered: the sizer's base cost
                s.sizer.observe(0, 0, time.perf_counter() - req.plain_started)
                req.plain_started = None
            return [sampler.sample(logits[-1], position)]
        k = len(step.drafts)
        logits = await _compute(self.tail.run, rows, k + 1)  # [k + 1, V]: row i after draft i

        def token(i: int, _accepted: list[int]) -> int:  # row i's token is at step.position + 1 + i
            return sampler.sample(logits[i], step.position + 1 + i)

        new = accept_drafts(step.drafts, token)
        req.spec_step = None
        keep = len(new)  # positions kept: the fed token and the accepted drafts (len(new) - 1 of them)
        s.runtime.truncate(step.position + keep)
        self.tail.truncate(step.position + keep)
        codec = s.codecs[req.step_codec]
        req.sent.append(_Sent(step.position, keep, codec.encode(
            np.ascontiguousarray(step.hidden[:keep]), zstd=s.config.wire_zstd)))
        stats.decode_round_trips += 1
        stats.accepted_draft_tokens += keep - 1
        s.sizer.observe(k, keep - 1, time.perf_counter() - step.started)
        return new

    async def _step(self, req, stats) -> None:
        """Feed the last token through the front (with drafts when the request speculates); one StatesStep."""
        from .generation import _Sent, _Spec, _compute  # generation imports this module

        s, rt = self.session, self.session.runtime
        codec = s.codecs[req.step_codec]
        last = req.tokens[-1]
        drafts = s._drafts(req) if s._drafts_wanted(req) else []
        pos = rt.length
        if drafts:
            t0 = time.perf_counter()
            hidden = await _compute(rt.step, [last, *drafts])  # [k + 1, H]: the decode graph, as plain steps
            msg = P.StatesStep(request_id=req.rid, position=pos,
                               hidden=codec.encode(hidden, zstd=s.config.wire_zstd))
            req.spec_step = _Spec(pos, list(drafts), hidden, msg, t0)
            stats.draft_tokens += len(drafts)
            await s._send(msg)
            return
        req.plain_started = time.perf_counter()
        hidden = await _compute(rt.decode, last)  # [1, H]
        rope = s._rope(req, pos, 1)  # after an image: index + rope delta on the three axes
        span = _Sent(pos, 1, codec.encode(hidden, zstd=s.config.wire_zstd),
                     None if rope is None else WireArray.from_numpy(rope))
        req.sent.append(span)
        stats.decode_round_trips += 1
        await s._send(P.StatesStep(request_id=req.rid, position=pos, hidden=span.tensor, rope_positions=span.rope))
