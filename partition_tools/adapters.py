"""One adapter per model family: where the embeddings, layers, final norm, rotary embedding and lm_head live.

Everything downstream (export of the edge front, the cloud back half, verification) reaches into a model
only through :class:`ModelAdapter`, so a new decoder family that shares the transformers layout is one
entry in ``_FAMILIES``. Anything else gets :class:`UnsupportedArchitecture` naming what was found.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


class UnsupportedArchitecture(Exception):
    """The model's architecture has no adapter."""


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # adapter name recorded in the manifest ("glm4", "glm", "glm4v", "llama")
    mrope: bool  # 3-D multimodal rotary positions (GLM-4.1V)
    text_path: tuple[str, ...]  # attribute path from the top-level model to the text decoder


# model_type -> family. Llama-layout decoders (Qwen2, Mistral, ...) share one adapter.
_FAMILIES: dict[str, Family] = {
    "glm4": Family("glm4", False, ("model",)),
    "glm": Family("glm", False, ("model",)),
    "glm4v": Family("glm4v", True, ("model", "language_model")),
    "llama": Family("llama", False, ("model",)),
    "qwen2": Family("llama", False, ("model",)),
    "mistral": Family("llama", False, ("model",)),
    "qwen3": Family("llama", False, ("model",)),
}


def text_config(config):
    """The text decoder's config: GLM-4.1V nests it (``text_config``); a plain decoder's is its own."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_heads_of(text) -> int:
    """KV heads of a text config (``num_key_value_heads``; without GQA, the attention heads)."""
    return int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)


def head_dim_of(text) -> int:
    """Per-head width of a text config (``head_dim`` where given, else hidden / heads)."""
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def eos_ids_of(*configs) -> list[int]:
    """End-of-sequence ids: the first ``eos_token_id`` set among ``configs`` (generation config, text config, model
    config, in the caller's order; ``None`` entries are skipped), as a list."""
    for c in configs:
        eos = getattr(c, "eos_token_id", None) if c is not None else None
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    return []


def rope_cos_sin(rotary: torch.nn.Module, mrope: bool, hidden: torch.Tensor, position_ids: torch.Tensor,
                 rope_positions: torch.Tensor | None = None):
    """cos/sin of ``rotary`` for ``position_ids`` [B, S], the one place positions become rotary embeddings.

    GLM-4.1V's 3-D rope (``mrope``) takes ``rope_positions`` [3, B, S] when given (image tokens), else the
    same ids on all three axes; a 1-D rope model refuses ``rope_positions``."""
    if mrope:
        if rope_positions is not None:
            return rotary(hidden, rope_positions)
        position_ids = position_ids[None].expand(3, *position_ids.shape)  # [3, B, S]
    elif rope_positions is not None:
        raise ValueError("multimodal rope positions for a model without multimodal RoPE")
    return rotary(hidden, position_ids)


def adapter_for_config(config) -> Family:
    model_type = getattr(config, "model_type", None)
    family = _FAMILIES.get(model_type)
    if family is None:
        arch = ", ".join(getattr(config, "architectures", None) or []) or "?"
        raise UnsupportedArchitecture(
            f"unsupported architecture: model_type={model_type!r} (architectures: {arch}); "
            f"supported model types: {', '.join(sorted(_FAMILIES))}"
        )
    return family


class ModelAdapter:
    """Uniform access to a decoder-only (or GLM-4.1V text) model's pieces."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.family = adapter_for_config(model.config)
        self.config = text_config(model.config)
        decoder = model
        for attr in self.family.text_path:
            decoder = getattr(decoder, attr)
        self.decoder = decoder

    # -- pieces -----------------------------------------------------------------------------
    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.decoder.embed_tokens

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.decoder.layers

    @property
    def norm(self) -> torch.nn.Module:
        return self.decoder.norm

    @property
    def rotary_emb(self) -> torch.nn.Module:
        return self.decoder.rotary_emb

    @property
    def lm_head(self) -> torch.nn.Linear:
        return self.model.lm_head

    # -- shapes -----------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_heads(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return kv_heads_of(self.config)

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.config)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def eos_token_ids(self) -> list[int]:
        """Where the model's ``generate`` stops: its generation config's ids (generation_config.json, else made from
        the config by transformers), the config's only without one - a config's own id (Llama-3-Instruct's
        <|end_of_text|> alone, or LlamaConfig's default 2 where the file names none) missed the chat turn's end."""
        return eos_ids_of(getattr(self.model, "generation_config", None), self.config, self.model.config)

    def rope_settings(self) -> dict:
        rope = getattr(self.config, "rope_parameters", None) or {}
        rope = dict(rope)
        theta = rope.get("rope_theta", getattr(self.config, "rope_theta", None))
        return {
            "theta": float(theta) if theta is not None else None,
            "type": rope.get("rope_type", "default"),
            "partial_rotary_factor": float(
                rope.get("partial_rotary_factor", getattr(self.config, "partial_rotary_factor", 1.0))
            ),
            "mrope_section": list(rope["mrope_section"]) if rope.get("mrope_section") else None,
        }

    # -- forward helpers ----------------------------------------------------------------------
    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        """cos/sin for ``position_ids`` [B, S] (see :func:`rope_cos_sin`)."""
        return rope_cos_sin(self.rotary_emb, self.family.mrope, hidden, position_ids)

    def cache_kwarg(self) -> str:
        """Name of the decoder layers' cache argument (see :func:`cache_kwarg_of`)."""
        return cache_kwarg_of(type(self.layers[0]).forward)


def cache_kwarg_of(forward) -> str:
    """A model's or layer's cache argument: ``past_key_values`` before transformers 5.2x, ``cache`` after."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def call_layer(layer: torch.nn.Module, hidden: torch.Tensor, **kwargs) -> torch.Tensor:
    """Run one decoder layer; older transformers return a tuple, newer ones the tensor."""
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out
