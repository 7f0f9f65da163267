"""The steady decode step's fast paths give the general path's outputs, token for token.

The fast paths: the scheduler's decode-only schedule (``Scheduler._schedule_decodes``), the engine's plain decode
launch and persistent decode rows (``LLMEngine._continue_decode``: a runner's ``continue_decode``, which returns
logits in the model's dtype and the greedy ids its graph computed), the batched input path (``add_inputs``: its
``[S, H]`` array handed to the runner as it is), the sampler's per-composition parameters (``_BatchParams``). The
reference engine has each one switched off: the general schedule, a runner without ``continue_decode`` (every step
a full batch, float32 logits, the sampler's own argmax), one ``add_input`` per session, a sampler that derives its
parameters afresh every step. Both run the same workload: greedy, seeded and unseeded sampled sessions, logprobs,
stop ids, max_tokens, sessions arriving late and answering after different delays (so steps mix decodes with
prompt chunks and leave sessions out), an abort, cloud drafts, a pool that runs out (an error) and blocks
allocated mid-decode.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cloud_server.config import EngineConfig
from cloud_server.engine.kv_cache import KVCachePool
from cloud_server.engine.llm_engine import LLMEngine
from cloud_server.engine.sampling_params import SamplingParams
from cloud_server.engine.scheduler import ScheduledBatch, Scheduler
from cloud_server.engine.sequence import InputChunk, Sequence

H, V = 16, 64


class _Model:
    hidden_size, vocab_size, eos_token_ids = H, V, [1]
    embed_tokens, mrope, returns_states = None, False, False


class _Runner:
    """Logits that depend on each sampled row's hidden state and position: a step run at the wrong positions (a
    continued batch that was not the last one a position on), or on another row's state, gives other tokens. They
    are rounded to bfloat16, as a bf16 model's are: ``run`` returns them as float32 (the library runner),
    ``continue_decode`` as bfloat16 with their argmax (the fast runner's graph)."""

    def __init__(self, num_blocks: int, block_size: int, persistent: bool, device: str = "cpu"):
        self.model, self.device = _Model(), device
        self.pool = KVCachePool(1, num_blocks, block_size, 1, 8, torch.float32)
        self.w = torch.randn(H, V, generator=torch.Generator().manual_seed(0))  # [H, V]
        self.freq = torch.arange(V, dtype=torch.float32) / V  # [V]
        self.persistent = persistent
        self.next_pos: torch.Tensor | None = None  # [B] the positions a continued decode batch is at
        self.continued = 0
        self.fed: list[torch.Tensor] = []  # the add_inputs arrays of the driver (_drive)
        self.took_fed = 0  # continued steps given one of them as it is
        self.took_joined = 0  # continued steps given a concatenation of several, with the batch's rows in it
        self.dtypes: set[torch.dtype] = set()  # of the hidden states continued steps were given
        self.time_replays, self.replay_event = False, None  # the fast runner's replay event (device-time metric)

    def _logits(self, hidden: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        logits = hidden @ self.w + 3.0 * torch.sin(pos[:, None].float() * self.freq * 7.0)  # [S, V]
        return logits.to(self.device, torch.bfloat16)  # (where the sampler then runs)

    def run(self, batch) -> torch.Tensor:
        rows = batch.logits_indices  # [S]
        decode = all(q == 1 for q in batch.query_lens) and rows.shape[0] == len(batch.query_lens)
        self.next_pos = batch.positions + 1 if decode else None
        return self._logits(batch.hidden[rows], batch.positions[rows]).float()

    def host_buffer(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def continue_decode(self, hidden: torch.Tensor, grown=(), order=None, sampling=None) -> tuple | None:
        n = hidden.shape[0] if order is None else len(order)
        if not self.persistent or self.next_pos is None or self.next_pos.shape[0] != n:
            return None
        pos, self.next_pos = self.next_pos, self.next_pos + 1
        self.continued += 1
        if self.time_replays and self.device == "cuda":
            self.replay_event = torch.cuda.Event(enable_timing=True)
            self.replay_event.record()
        self.dtypes.add(hidden.dtype)
        self.took_fed += any(hidden is f for f in self.fed)
        self.took_joined += order is not None and not any(hidden is f for f in self.fed) and hidden.shape[0] > 1
        if order is not None:
            hidden = hidden[order]  # [n, H] the batch's rows
        logits = self._logits(hidden.float(), pos)  # [S, V] bfloat16 (float16 rows widened, as a graph's copy does)
        return logits, logits.argmax(dim=-1), None


def _engine(fast: bool, overlap: bool, num_blocks: int, block_size: int = 4, device: str = "cpu") -> LLMEngine:
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, num_blocks=num_blocks,
                       block_size=block_size, enable_prefix_cache=False, async_scheduling=overlap,
                       cloud_drafts=2)
    eng = LLMEngine(cfg, {"fp32": _Runner(num_blocks, block_size, persistent=fast, device=device)}, sampler_seed=7)
    eng.set_draft_inputs(torch.randn(V, H, generator=torch.Generator().manual_seed(1)))
    if not fast:
        eng.scheduler._schedule_decodes = lambda preempt: None  # the general schedule, every step
        launch = eng.sampler.launch

        def fresh_launch(*args, **kw):
            eng.sampler._batch = None  # no composition kept from the last step
            return launch(*args, **kw)

        eng.sampler.launch = fresh_launch
    return eng


# (name, params, prompt length, arrival step, reply delay in steps, ask_drafts)
_SESSIONS = [
    ("greedy", SamplingParams(0.0, max_tokens=14, ignore_eos=True), 5, 0, 0, 0),
    ("seeded", SamplingParams(0.7, top_p=0.9, seed=3, max_tokens=12), 7, 0, 0, 0),
    ("unseeded", SamplingParams(0.9, top_k=8, max_tokens=10, ignore_eos=True), 3, 0, 0, 0),
    ("slow", SamplingParams(0.0, max_tokens=9, ignore_eos=True), 4, 1, 2, 0),
    ("logprobs", SamplingParams(0.8, seed=5, logprobs=2, max_tokens=8, ignore_eos=True), 6, 2, 0, 0),
    ("stop", SamplingParams(0.0, stop_token_ids=list(range(2, 40)), max_tokens=30), 3, 3, 1, 0),
    ("late", SamplingParams(0.7, top_p=0.9, seed=9, max_tokens=11, ignore_eos=True), 22, 5, 0, 0),
    ("drafts", SamplingParams(0.0, max_tokens=10, ignore_eos=True), 5, 1, 0, 2),
    ("aborted", SamplingParams(0.0, max_tokens=30, ignore_eos=True), 4, 0, 0, 0),
]


# lockstep: every session answers at once, so the same rows step on (the persistent batch; blocks of 16 positions)
_STEADY = [
    ("greedy", SamplingParams(0.0, max_tokens=30, ignore_eos=True), 5, 0, 0, 0),
    ("seeded", SamplingParams(0.7, top_p=0.9, seed=3, max_tokens=28, ignore_eos=True), 7, 0, 0, 0),
    ("unseeded", SamplingParams(0.9, top_k=8, max_tokens=30, ignore_eos=True), 3, 0, 0, 0),
    ("logprobs", SamplingParams(0.8, seed=5, logprobs=2, max_tokens=25, ignore_eos=True), 6, 0, 0, 0),
    ("stop", SamplingParams(0.0, stop_token_ids=[11, 12, 13], max_tokens=30), 3, 0, 0, 0),
    ("aborted", SamplingParams(0.0, max_tokens=30, ignore_eos=True), 4, 0, 0, 0),
    ("penalized", SamplingParams(0.0, frequency_penalty=1.5, max_tokens=26, ignore_eos=True), 4, 0, 0, 0),
]

# lockstep, greedy rows only: the plain greedy launch, its ids the runner's own argmax
_GREEDY = [
    ("greedy", SamplingParams(0.0, max_tokens=30, ignore_eos=True), 5, 0, 0, 0),
    ("stop", SamplingParams(0.0, stop_token_ids=[11, 12, 13], max_tokens=30), 3, 0, 0, 0),
    ("short", SamplingParams(0.0, max_tokens=17, ignore_eos=True), 7, 0, 0, 0),
    ("aborted", SamplingParams(0.0, max_tokens=30, ignore_eos=True), 4, 0, 0, 0),
]


def _state(name: str, token: int) -> torch.Tensor:
    """The boundary state a phone sends for ``token`` (deterministic, per session; exact in float16, so that the
    ``"half"`` feed carries the same values). [1, H]"""
    g = torch.Generator().manual_seed(1000 * token + sum(map(ord, name)))
    return torch.randn(1, H, generator=g).half().float()


def _drive(eng: LLMEngine, sessions: list[tuple], abort_at: int = 9, steps: int = 80,
           batched: str | None = None) -> list[tuple]:
    """Every output of the workload, in order, with the step it came out of. ``batched``: the decode steps of a
    turn that ask for no drafts go in as one ``add_inputs`` (an ``input_buffer`` filled in the sessions' order, or
    ``"reversed"``: the other way round, so that the runner picks the batch's rows from it; ``"split"``: reversed and
    cut into up to 3 arrays, which the engine concatenates once; ``"half"``: as split, the arrays float16 as fp16 decode
    steps reach the engine, but one of them float32, as a worker whose phones send another codec)."""
    log, waiting_since, pos, last, turns = [], {}, {}, {}, 0
    for k in range(steps):
        for name, params, n, arrive, _, _ in sessions:
            if k == arrive:
                prompt = torch.randn(n, H, generator=torch.Generator().manual_seed(len(name)))
                assert eng.add_request(name, InputChunk(0, hidden=prompt), params) == []
                pos[name] = n
        group = []
        for name, _, _, _, delay, ask in sessions:
            if name in waiting_since and k - waiting_since[name] >= delay and name in eng.seqs:
                del waiting_since[name]
                seq = eng.seqs[name]
                if batched and not ask:
                    group.append((name, seq.num_received, _state(name, last[name])))
                    continue
                eng.add_input(name, InputChunk(seq.num_received, hidden=_state(name, last[name]), ask_drafts=ask))
        if group:
            turns += 1
            if batched in ("reversed", "split", "half"):
                group.reverse()
            # "split": up to 3 arrays, as several front-end workers' turns reach the engine (concatenated once there)
            cuts = ([0, len(group)] if batched not in ("split", "half") else
                    sorted({0, len(group) // 3, 2 * len(group) // 3, len(group)}))
            for j, (a, b) in enumerate(zip(cuts, cuts[1:])):
                rows = eng.input_buffer(b - a)  # [G, H]
                torch.cat([h for _, _, h in group[a:b]], out=rows)
                if batched == "half" and (j != 1 or turns % 2):  # (every other turn all float16)
                    rows = rows.half()
                eng.runners["fp32"].fed.append(rows)
                assert eng.add_inputs([g[0] for g in group[a:b]], [g[1] for g in group[a:b]], rows) == []
        if k == abort_at:
            log += [(k, o.request_id, o.finish_reason) for o in eng.abort("aborted")]
        for o in eng.step():
            log.append((k, o.request_id, o.token_id, o.finish_reason, o.error_code, o.logprob, o.top_logprobs,
                        o.draft_ids, o.num_output_tokens, o.accepted_ids))
            if o.token_id is not None and not o.finished:
                waiting_since[o.request_id], last[o.request_id] = k, o.token_id
        if not eng.seqs and not eng.has_work() and k > max(s[3] for s in sessions):
            break
    return log


@pytest.mark.parametrize("batched", [None, "in order", "reversed", "split", "half"])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("num_blocks", [256, 14])  # 14 blocks of 4: the pool runs out, sessions are aborted
def test_the_fast_paths_give_the_general_paths_outputs(overlap, num_blocks, batched):
    fast, ref = _engine(True, overlap, num_blocks), _engine(False, overlap, num_blocks)
    got, want = _drive(fast, _SESSIONS, batched=batched), _drive(ref, _SESSIONS)
    assert got == want
    tokens = [e for e in want if len(e) > 3 and e[2] is not None]
    assert {e[1] for e in tokens} >= {"greedy", "seeded", "unseeded", "slow", "logprobs", "late", "drafts"}
    assert any(e[7] for e in tokens)  # cloud drafts went out
    if num_blocks == 14:
        assert any(e[4] == "kv_cache_full" for e in want if len(e) > 4)
    assert not fast.seqs and fast.num_used_blocks() == 0


@pytest.mark.parametrize("sessions", [_STEADY, _GREEDY], ids=["mixed", "greedy"])
@pytest.mark.parametrize("batched", [None, "in order", "reversed", "split", "half"])
@pytest.mark.parametrize("overlap", [True, False])
def test_lockstep_decoding_continues_the_persistent_batch_with_the_same_tokens(overlap, batched, sessions):
    fast, ref = _engine(True, overlap, 64, block_size=16), _engine(False, overlap, 64, block_size=16)
    got, want = _drive(fast, sessions, abort_at=14, batched=batched), _drive(ref, sessions, abort_at=14)
    assert got == want
    runner = fast.runners["fp32"]
    assert runner.continued >= 15  # the persistent batch was taken (and gave the same tokens)
    if batched in ("in order", "reversed"):  # and was given the fed arrays themselves, not a gather of their rows
        assert runner.took_fed >= 15
    if batched in ("split", "half"):  # several arrays: one concatenation of them, rows picked by order
        assert runner.took_joined > 0
    # float16 arrays stay float16 up to the runner's copy; float32 where one of a step's arrays is
    assert runner.dtypes == ({torch.float16, torch.float32} if batched == "half" else {torch.float32})
    assert {e[1] for e in want if len(e) > 3 and e[2] is not None} == {s[0] for s in sessions}
    assert not fast.seqs and fast.num_used_blocks() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
def test_the_fast_paths_on_cuda_give_the_general_paths_outputs(overlap):
    """The sampler on the device (its parameter columns uploaded once per composition, the uniforms each step, the
    ids copied to pinned memory and waited for at postprocess): the same outputs as the general paths there."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for sessions, blocks, size in ((_SESSIONS, 256, 4), (_STEADY, 64, 16), (_GREEDY, 64, 16)):
        for batched in (None, "in order", "reversed", "split"):
            fast, ref = _engine(True, overlap, blocks, size, "cuda"), _engine(False, overlap, blocks, size, "cuda")
            assert _drive(fast, sessions, batched=batched) == _drive(ref, sessions)
            assert not fast.seqs and fast.num_used_blocks() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
def test_each_steady_step_on_cuda_reports_its_device_time(overlap):
    """With metrics on a CUDA runner every continued decode step observes its device time once (CUDA events from
    its replay to its ids' copy; observed once its work has ended, without a sync of its own)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from cloud_server.metrics import ServerMetrics

    eng = _engine(True, overlap, 64, 16, "cuda")
    seen = []
    metrics = ServerMetrics("t")
    metrics.on_device_step = seen.append
    eng.metrics = metrics
    _drive(eng, _GREEDY)
    continued = eng.runners["fp32"].continued
    assert continued - 1 <= len(seen) <= continued and continued > 10  # (the last one may still be pending)
    assert all(0 < t < 1.0 for t in seen)


def _seq(name: str, n: int, sched: Scheduler, params: SamplingParams | None = None) -> Sequence:
    seq = Sequence(name, params or SamplingParams(0.0), "fp32")
    sched.add(seq, InputChunk(0, hidden=torch.zeros(n, H)))
    return seq


def _view(batches: list[ScheduledBatch]) -> list:
    return [(b.variant, [(it.seq.request_id, it.chunk.start, it.chunk.n, it.sample) for it in b.items])
            for b in batches]


def test_the_decode_only_schedule_is_the_general_one():
    """Decode steps only (some sessions not ready, one needing a new block, a cloud draft row): the fast schedule
    takes the general loop's batches; a waiting request or a longer chunk sends it to the general loop."""
    from cloud_server.engine.kv_cache import BlockManager

    def make():
        cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64, block_size=4)
        sched = Scheduler(cfg, {"fp32": BlockManager(64, 4)})
        seqs = [_seq(f"s{i}", 3 + i, sched) for i in range(5)]
        [batch], _ = sched.schedule()  # the prompts
        for it in batch.items:
            it.seq.update_from_output(it.chunk.end)
        return sched, seqs

    (fast, fs), (general, gs) = make(), make()
    general._schedule_decodes = lambda preempt: None
    for seqs in (fs, gs):
        for i, s in enumerate(seqs):
            if i != 2:  # s2's phone is slow
                s.push(InputChunk(s.num_received, hidden=torch.zeros(1, H), cloud_draft=i == 4))
    (fb, fv), (gb, gv) = fast.schedule(), general.schedule()
    assert _view(fb) == _view(gb) and fv == gv == []
    assert [it.seq.request_id for it in fb[0].items] == ["s0", "s1", "s3", "s4"]
    assert [len(s.block_table) for s in fs] == [len(s.block_table) for s in gs]  # s1 (4 positions) took a block
    assert not fb[0].plain_decode  # a cloud draft row: the engine splits its rows
    # a longer chunk, or a request waiting for admission: the general loop decides
    fs[2].push(InputChunk(fs[2].num_received, hidden=torch.zeros(2, H)))
    assert fast._schedule_decodes(True) is None


def test_the_sampler_keeps_a_compositions_parameters_and_draws_the_same_tokens():
    """The same rows step after step: the sampler derives their parameters once (an equal list is the same
    composition) and draws what a sampler deriving them afresh draws; another composition derives its own."""
    from cloud_server.engine.sampler import Sampler

    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(0.7, top_p=0.9, seed=1), SamplingParams(0.0), SamplingParams(1.0, top_k=5),
              SamplingParams(0.8, seed=2, logprobs=1)]
    kept, fresh = Sampler(3), Sampler(3)
    for step in range(6):
        logits = torch.randn(4, V, generator=g)
        rows = params if step % 2 else list(params)  # the same list, or an equal one
        if step == 4:
            rows = params[::-1]  # another composition
        fresh._batch = None
        a = kept.launch(logits, rows, [10 + step] * 4).result()
        b = fresh.launch(logits, rows, [10 + step] * 4).result()
        assert [(t.token_id, t.logprob) for t in a] == [(t.token_id, t.logprob) for t in b]
        assert kept._batch.params == rows


def test_add_inputs_refuses_what_add_input_refuses():
    """Row by row, add_inputs returns the errors add_input returns (an unknown request, a wrong position, past
    max_model_len, the wrong width) and takes the other rows."""
    def run(batched: bool) -> tuple[list, list]:
        eng = _engine(True, False, 64, block_size=16)
        eng.config.max_model_len = 8
        for name, n in (("a", 3), ("b", 3), ("c", 5), ("d", 3)):
            assert eng.add_request(name, InputChunk(0, hidden=torch.randn(n, H)), SamplingParams(0.0)) == []
        while len([o for o in eng.step() if o.token_id is not None]) < 4:
            pass
        ids, starts, rows = ["a", "x", "b", "c", "d"], [3, 3, 5, 20, 3], torch.randn(5, H)
        if batched:
            outs = eng.add_inputs(ids, starts, rows)
            wide = eng.add_inputs(["d"], [4], torch.randn(1, H + 1))
        else:
            outs = [o for i, s, r in zip(ids, starts, rows.split(1)) for o in eng.add_input(i, InputChunk(s, hidden=r))]
            wide = eng.add_input("d", InputChunk(4, hidden=torch.randn(1, H + 1)))
        view = [(o.request_id, o.finish_reason, o.error_code, o.error_message) for o in outs + wide]
        return view, sorted((s.request_id, s.num_received) for s in eng.seqs.values())

    got, want = run(True), run(False)
    assert got == want
    assert [v[:3] for v in want[0]] == [("x", "error", "unknown_request"), ("b", "error", "bad_input"),
                                        ("c", "error", "too_long"), ("d", "error", "bad_input")]
    assert want[1] == [("a", 4)]
    with pytest.raises(ValueError, match="one \\[1, H\\] row per request"):
        _engine(True, False, 64).add_inputs(["a"], [0, 1], torch.randn(1, H))


def _glm_lockstep(device: str, variant: str, fast: bool, steps: int = 6,
                  params: list[SamplingParams] | None = None) -> tuple[list, list]:
    """A random tiny GLM-4.1V back half on the fast runner, 4 sessions (greedy, seeded top-p, greedy with logprobs,
    seeded top-k) in lockstep. ``fast``: the batched feed into ``input_buffer`` and the runner's continued decode
    batch (bf16 logits and its graph's greedy ids on CUDA); else one ``add_input`` per session and a full batch every
    step (``continue_decode`` switched off). ``params``: the sessions' (``max_tokens`` set here), else the four
    above. Every output, and per continued step (the blocks it appended, whether its graph sampled)."""
    from cloud_server.fast.runner import FastGlmRunner
    from cloud_server.model import random_split_model
    from partition_tools.models import tiny_glm4v_config

    model = random_split_model(tiny_glm4v_config(), 1, variant, device, seed=3)
    cfg = EngineConfig(device=device, variants=(variant,), block_size=16, num_blocks=32, max_num_seqs=4,
                       max_num_batched_tokens=64, max_model_len=64, enable_prefix_cache=False)
    eng = LLMEngine.from_models(cfg, {variant: model}, make_runner=lambda i, m, p: FastGlmRunner(
        m, p, max_batch=4, max_model_len=64, tune=False))
    eng.sampler.generator.manual_seed(11)  # (the keys of unseeded requests: the same in both engines)
    runner, continued = eng.runners[variant], []
    if fast:
        cont = runner.continue_decode

        def counted(h, grown, order, sampling=None):  # the steps the runner continued, and the blocks each appended
            out = cont(h, grown, order, sampling)
            if out is not None:
                continued.append((len(grown), sampling is not None))
            return out

        runner.continue_decode = counted
    else:
        runner.continue_decode = None  # (the engine then builds every step's batch)
    if params is None:
        params = [SamplingParams(0.0), SamplingParams(0.7, top_p=0.9, seed=4), SamplingParams(0.0, logprobs=2),
                  SamplingParams(0.9, top_k=20, seed=5)]
    params = [replace(p, max_tokens=steps + 1, ignore_eos=True) for p in params]
    g = torch.Generator().manual_seed(8)
    h = model.hidden_size
    ids = [f"s{i}" for i in range(4)]
    for i, p in enumerate(params):
        assert eng.add_request(ids[i], InputChunk(0, hidden=torch.randn(5 + 3 * i, h, generator=g)), p) == []
    log = []

    def until_tokens(k):  # every session's next token
        got = 0
        while got < 4:
            outs = eng.step()
            log.extend((k, o.request_id, o.token_id, o.logprob, o.top_logprobs, o.finish_reason) for o in outs)
            got += sum(o.token_id is not None for o in outs)

    until_tokens(-1)
    for k in range(steps):
        states = torch.randn(4, h, generator=g)  # [4, H]
        starts = [eng.seqs[r].num_received for r in ids]
        if fast:  # in another order than the batch's (on odd steps): the runner picks the rows on the device
            perm = [2, 0, 3, 1] if k % 2 else [0, 1, 2, 3]
            rows = eng.input_buffer(4)
            rows.copy_(states[perm])
            assert eng.add_inputs([ids[i] for i in perm], [starts[i] for i in perm], rows) == []
        else:
            for r, s, row in zip(ids, starts, states.split(1)):
                assert eng.add_input(r, InputChunk(s, hidden=row)) == []
        until_tokens(k)
    assert not eng.seqs
    return log, continued


@pytest.mark.parametrize("device,variant", [("cpu", "fp32"), pytest.param("cuda", "bf16", marks=pytest.mark.gpu)])
def test_the_fast_runner_continued_with_batched_inputs_gives_the_full_batches_outputs(device, variant):
    """The fast runner end to end: the batched feed and its continued decode batch (on CUDA: the graph's own
    greedy ids, bf16 logits sampled in float32) give what a full batch every step gives, token for token."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    steps = 6
    (got, continued), (want, _) = _glm_lockstep(device, variant, True, steps), _glm_lockstep(device, variant, False, steps)
    assert got == want
    assert len(continued) == steps - 1 and any(g for g, _ in continued)  # the persistent batch, also where tables grew
    assert not any(sampled for _, sampled in continued)  # (logprobs and top-k: the sampler's own launch)
    assert {e[1] for e in want if e[2] is not None} == {"s0", "s1", "s2", "s3"}


@pytest.mark.parametrize("device,variant", [("cpu", "fp32"), pytest.param("cuda", "bf16", marks=pytest.mark.gpu)])
def test_the_fast_runners_sampled_graph_draws_the_samplers_tokens(device, variant):
    """A composition the decode graph samples (greedy, seeded and unseeded top-p and temperature rows; one row with
    so small a nucleus that its draws often all miss, so the redraw runs): the graph's tokens are those the sampler
    draws from a full batch's logits every step, token for token (unseeded requests: the key the engine gave each,
    the same in both engines)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    params = [SamplingParams(0.0), SamplingParams(0.7, top_p=0.9, seed=4), SamplingParams(0.8),
              SamplingParams(1.5, top_p=0.02)]
    steps = 8
    (got, continued), (want, _) = (_glm_lockstep(device, variant, fast, steps, params) for fast in (True, False))
    assert got == want
    assert len(continued) == steps - 1 and all(sampled for _, sampled in continued)
    assert len({e[2] for e in want if e[1] == "s3"}) > 1  # the tiny nucleus still draws (not only the argmax)
