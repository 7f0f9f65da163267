"""The engine's fixed facts, read once when the runtime starts and frozen.

Network handlers run on the event-loop thread while the engine mutates its state on its own thread, so they
never read the engine: what they need to know about it that cannot change while it runs (the loaded compute
variants, the model's sizes, its end-of-sequence ids) is captured here by :meth:`EngineFacts.of` before the
engine thread starts (``CloudRuntime.start`` publishes it as ``runtime.facts``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from shared.plan import COMPUTE_VARIANTS


@dataclass(frozen=True, slots=True)
class EngineFacts:
    variants: tuple[str, ...]  # the loaded compute variants, the default first
    variant_for: Mapping[str | None, str]  # requested compute variant (None: none) -> the loaded one serving it
    hidden_size: int  # width of the hidden states the model takes (split mode: the boundary)
    vocab_size: int
    mrope: bool  # the model takes 3-D multimodal RoPE positions (GLM-4.1V)
    eos_token_ids: tuple[int, ...]
    block_size: int  # tokens per KV block = the prefix-cache granularity
    max_context: int  # positions per sequence (prompt + generated): EngineConfig.max_context
    max_num_seqs: int  # sequences the engine runs at once (the load figure's denominator)
    max_num_batched_tokens: int  # tokens per engine step
    returns_states: bool = False  # u-shape: the model ends at its middle layers (States, never tokens)
    cloud_drafts: int = 0  # drafts the engine proposes per Tokens at most (0: no cloud drafter)
    prefix_cache: bool = True  # full prompt blocks are published and reused across requests (EngineConfig)

    @property
    def default_variant(self) -> str:
        return self.variants[0]

    def resolve_variant(self, requested: str | None) -> str:
        """The loaded variant that serves a request asking for ``requested`` (the engine's own rule)."""
        return self.variant_for.get(requested, self.default_variant)

    @classmethod
    def of(cls, engine) -> EngineFacts:
        """Read from an :class:`~cloud_server.engine.llm_engine.LLMEngine` that is not running yet."""
        model = engine.runners[engine.default_variant].model
        cfg = engine.config
        return cls(variants=tuple(engine.runners),
                   variant_for=MappingProxyType({v: engine.resolve_variant(v) for v in (None, *COMPUTE_VARIANTS)}),
                   hidden_size=int(model.hidden_size), vocab_size=int(engine.vocab_size), mrope=bool(model.mrope),
                   eos_token_ids=tuple(int(t) for t in engine.eos_token_ids), block_size=int(cfg.block_size),
                   max_context=int(cfg.max_context), max_num_seqs=int(cfg.max_num_seqs),
                   max_num_batched_tokens=int(cfg.max_num_batched_tokens),
                   returns_states=bool(engine.output_states), cloud_drafts=int(engine.max_cloud_drafts),
                   prefix_cache=bool(cfg.enable_prefix_cache))
