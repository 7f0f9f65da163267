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


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


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
        self.config = _text_config(model.config)
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
        return int(getattr(self.config, "num_key_value_heads", None) or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(getattr(self.config, "head_dim", None) or self.hidden_size // self.num_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def eos_token_ids(self) -> list[int]:
        eos = getattr(self.config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        gen = getattr(self.model, "generation_config", None)
        if eos is None and gen is not None:
            eos = gen.eos_token_id
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

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
        """cos/sin for ``position_ids`` [B, S]; GLM-4.1V's 3-D rope gets the same ids on all three axes."""
        if self.family.mrope:
            position_ids = position_ids[None].expand(3, *position_ids.shape)  # [3, B, S]
        return self.rotary_emb(hidden, position_ids)

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
