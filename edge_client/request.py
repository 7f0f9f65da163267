"""What the caller asks of one request (:class:`RequestSpec`) and what it cost (:class:`RequestStats`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.errors import ProtocolError
from shared.messages import MAX_POSITION, MAX_SEED, MAX_TEMPERATURE, MAX_TOP_K, MIN_TOP_P, SamplingParams
from shared.openai_compat import stop_problem
from shared.precision import PrecisionOverride

from .errors import EdgeClientError


_RANGES = {"max_tokens": f"an integer in [1, {MAX_POSITION}]", "temperature": f"a number in [0, {MAX_TEMPERATURE:g}]",
           "top_p": f"a number in [{MIN_TOP_P:g}, 1]", "top_k": f"an integer in [0, {MAX_TOP_K}] (0: off)",
           "seed": f"an integer in [0, {MAX_SEED}]"}


class SamplingRangeError(ValueError):
    """A sampling argument outside what the split protocol carries (``SamplingParams``' ranges); ``param``
    names it (the local API's 400 does). Refused here, before any network traffic: on the wire it was an
    ``internal`` failure of the request, after the prompt had run."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class RequestSpec:
    prompt_ids: list[int]
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    precision: str | None = None  # override: a codec ("int8-b32"), a compute variant ("bf16") or both ("fp16")
    media: object | None = None  # edge_client.media.MediaPrompt: images / audio; prompt_ids are its ids
    # speculative decoding across the split (edge_client.drafting): drafts by prompt lookup, verified in one step
    speculate: bool = False
    # drafts may come only from tokens the cloud has already seen (its own outputs): the private levels
    # (shared.exec_mode) never let a prompt n-gram leave the phone as a draft
    drafts_from_outputs_only: bool = False
    # the private levels: prefix keys keyed with this secret (shared.prefix_keys.KeyScope.secret)
    prefix_secret: bytes | None = field(default=None, repr=False)
    # u-shape (shared.exec_mode): the cloud runs the middle layers only, the phone's tail samples (edge_client.ushape)
    ushape: bool = False

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("empty prompt")
        if not isinstance(self.speculate, bool):  # "no" (a true value) speculated
            raise SamplingRangeError("speculate", f"speculate must be True or False, got {self.speculate!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise SamplingRangeError("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
        if (problem := stop_problem(self.stop)) is not None:  # the local API's rule (an empty one was dropped)
            raise SamplingRangeError("stop", f"{problem}, got {self.stop!r}")
        try:  # the wire's own rule (types and ranges): a value it cannot carry fails here, not after the prompt ran
            SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                           top_k=self.top_k, seed=self.seed)
        except ProtocolError as e:
            name = e.message.partition(":")[0].removeprefix("params.")
            raise SamplingRangeError(name, f"{name} must be {_RANGES[name]}, got {getattr(self, name)!r}") from None
        if self.media is not None and list(self.media.ids) != list(self.prompt_ids):
            raise ValueError("prompt_ids must be the media prompt's (placeholders expanded)")
        if self.precision is not None:
            PrecisionOverride.parse(self.precision)  # a codec or compute name; PrecisionError (a ValueError)


def fit_answer(prompt_len: int, max_tokens: int, room: tuple[int, str], context: int) -> int:
    """``max_tokens`` cut to the ``context`` positions a prompt of ``prompt_len`` leaves (the answer then ends
    ``"length"`` there: :func:`answer_end`); a prompt over ``room`` (the most it may fill, and whose limit that is)
    is refused, EdgeClientError ``context_full``. ``Session.fit`` and the rig's all-edge runner fit by it."""
    limit, whose = room
    if prompt_len > limit:
        raise EdgeClientError(f"prompt of {prompt_len} tokens exceeds {whose}", "context_full")
    return min(max_tokens, context - prompt_len)


def answer_end(done: int, new: list[int], max_tokens: int, stops: set[int]) -> tuple[list[int], str | None]:
    """``new`` (tokens after ``done`` already answered) up to the first that ends the answer, and the finish reason
    (None: it goes on): an end-of-sequence token in ``stops`` ends it, counted, as ``"stop"``; the
    ``max_tokens``-th (cut to the context by ``Session.fit``) as ``"length"``. The u-shape loop, the edge-only
    and all-cloud runners and the rig's edge-only answers end by it, as the cloud's engine does split."""
    for j, t in enumerate(new):
        if t in stops:
            return new[:j + 1], "stop"
        if done + j + 1 >= max_tokens:
            return new[:j + 1], "length"
    return new, None


def mark_token(stats, t0: float, last: float | None) -> float:
    """Record one token's arrival on ``stats`` (anything with ``ttft_s`` and ``itl_s``): the first token sets
    ``ttft_s = now - t0``, every later one appends its gap to ``itl_s``. ``last``: the previous token's time or
    None; returns now (the next call's ``last``)."""
    now = time.perf_counter()
    if last is None:
        stats.ttft_s = now - t0
    else:
        stats.itl_s.append(now - last)
    return now


@dataclass(slots=True)
class RequestStats:
    trace_id: str | None = None  # the request's id in the edge's and the cloud's logs (``trace=<id>``)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose front layers the activation cache skipped
    uploaded_prompt_tokens: int = 0  # prompt positions whose hidden states went up (the cloud has the rest)
    cloud_cached_tokens: int = 0  # prompt positions the cloud took from its prefix cache (its Usage)
    ttft_s: float | None = None  # request start -> first token delivered to the caller
    itl_s: list[float] = field(default_factory=list)  # gaps between successive tokens
    total_s: float = 0.0
    edge_compute_s: float = 0.0  # front-layer time for this request (prefill + decode steps)
    edge_prefill_s: float = 0.0
    edge_tail_s: float = 0.0  # u-shape: the tail's time (middle states -> logits) for this request
    edge_tail_prefill_s: float = 0.0  # of it: the prompt's positions, up to the first token
    bytes_up: int = 0  # WebSocket frames, both ways, this request
    bytes_down: int = 0
    prefill_bytes_up: int = 0  # of bytes_up: the prompt's hidden states
    codec: str = ""  # wire codec of the prompt's hidden states
    step_codec: str = ""  # wire codec of the decode steps' (and SpecSteps') hidden states
    compute: str = ""  # compute variant asked of the cloud
    edge_variant: str = ""  # what computed the edge states (Manifest.edge_variant: int8+fp32-prefill, fp32, ...)
    reconnects: int = 0
    resumes: int = 0  # the cloud session survived a drop
    replays: int = 0  # the cloud lost the session; the context was replayed
    prefix_misses: int = 0
    decode_round_trips: int = 0  # DecodeSteps, SpecSteps (u-shape: StatesSteps) answered (the first token comes with the prompt)
    draft_tokens: int = 0  # drafts sent in SpecSteps
    accepted_draft_tokens: int = 0  # of those, accepted by the cloud
    head_draft_tokens: int = 0  # of the drafts, those the bundle's draft head proposed (the rest: prompt lookup)
    accepted_head_draft_tokens: int = 0
    cloud_draft_tokens: int = 0  # of the drafts, those the cloud proposed (Tokens.draft_ids)
    accepted_cloud_draft_tokens: int = 0
    edge_draft_s: float = 0.0  # the bundle's drafter's compute (edge_client.draft_head), beside edge_compute_s
    exec_mode: str = ""  # shared.exec_mode: split | u-shape | all-cloud | edge-only (and why, below)
    exec_reason: str = ""
    image_tokens: int = 0  # prompt tokens that are visual embeddings (usage)
    audio_tokens: int = 0
    media_encode_s: float = 0.0  # edge encoder time for this request's images and audio

    @property
    def mean_itl_s(self) -> float | None:
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else None

    @property
    def tokens_per_s(self) -> float:
        """Decode rate after the first token (the TTFT is reported separately)."""
        gap = sum(self.itl_s)
        return len(self.itl_s) / gap if gap > 0 else 0.0

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__slots__ if k != "itl_s"}
        d.update(mean_itl_s=self.mean_itl_s, tokens_per_s=self.tokens_per_s)
        return d
