"""Per-request sampling parameters as the engine uses them (wire and OpenAI shapes convert into this)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages import MIN_TEMPERATURE  # below it: greedy (1 / T would overflow float32 near 0)


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it."""


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (argmax; also below MIN_TEMPERATURE); ties go to the lowest token id
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request generator: the same seed gives the same tokens, batched or not
    max_tokens: int = 256  # generated tokens, the first one included
    stop_token_ids: list[int] = field(default_factory=list)  # finish (reason "stop") on any of these
    ignore_eos: bool = False  # when False the model's eos ids are stop ids too
    logprobs: int | None = None  # None = off; k >= 0 = the sampled token's logprob plus the top-k
    # Penalties over the *generated* tokens (in split mode the cloud never sees the prompt's ids):
    presence_penalty: float = 0.0  # OpenAI: logit -= p if the token occurred
    frequency_penalty: float = 0.0  # OpenAI: logit -= f * count
    repetition_penalty: float = 1.0  # HF: positive logits / r, negative logits * r, for occurred tokens
    plain_greedy: bool = field(init=False, repr=False, compare=False)  # greedy, no penalties, no logprobs

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise SamplingParamsError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise SamplingParamsError(f"top_k must be >= 0 (got {self.top_k})")
        if self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be >= 1 (got {self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError(f"logprobs must be in [0, 20] (got {self.logprobs})")
        if not -2.0 <= self.presence_penalty <= 2.0 or not -2.0 <= self.frequency_penalty <= 2.0:
            raise SamplingParamsError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise SamplingParamsError(f"repetition_penalty must be > 0 (got {self.repetition_penalty})")
        if self.temperature < MIN_TEMPERATURE:  # the sampler scales logits by 1 / T in float32: inf, then NaN
            self.temperature = 0.0
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        # the sampler's fast path (one argmax for the whole batch), read for every row of every step
        self.plain_greedy = self.greedy and not self.penalized and self.logprobs is None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
