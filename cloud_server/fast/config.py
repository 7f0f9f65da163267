"""Shapes and settings of the GLM fast path, read from a transformers text config.

The fast path covers GLM-4 (``Glm4ForCausalLM``) and the GLM-4.1V text decoder (``Glm4vTextModel``); both
use the same layer: four RMSNorms (input, post-self-attention, post-attention, post-MLP), biased QKV, fused
gate-up SiLU MLP and *interleaved* partial rotary embedding over the first ``rotary_dim`` channels of each
head. GLM-4.1V's 3-D mrope reduces to that 1-D rope when the three axes carry equal positions (text tokens,
and every boundary hidden state the cloud receives carries one position per token).

Reference: ``transformers.models.glm4.modeling_glm4`` and ``transformers.models.glm4v.modeling_glm4v``.
"""

from __future__ import annotations

from dataclasses import dataclass

from partition_tools.adapters import kv_heads_of, text_config


class UnsupportedFastPath(Exception):
    """The model cannot run on the GLM fast path; the message says why in one line."""


FAST_MODEL_TYPES = ("glm4", "glm4v", "glm4v_text")


@dataclass(slots=True)
class FastGLMConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int  # decoder layers this half runs (L - N for the cloud half)
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rotary_dim: int = 64  # head_dim * partial_rotary_factor: GLM rotates half of each head
    attention_bias: bool = True  # GLM-4 / GLM-4.1V have biased q/k/v projections
    max_position: int = 32768  # rows of the cos/sin table; positions beyond it are refused
    # GLM-4.1V 3-D rope: rotary pairs per axis (temporal, height, width); None for GLM-4 (1-D rope)
    mrope_section: tuple[int, ...] | None = None

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "num_layers", "vocab_size", "max_position"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"FastGLMConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.mrope_section is not None:
            self.mrope_section = tuple(int(x) for x in self.mrope_section)
            if 2 * sum(self.mrope_section) != self.rotary_dim or len(self.mrope_section) != 3:
                raise ValueError(f"mrope_section {self.mrope_section} must be 3 sections covering rotary_dim / 2")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, config, num_layers: int | None = None, max_position: int | None = None) -> FastGLMConfig:
        """From a ``Glm4Config`` / ``Glm4vConfig`` / ``Glm4vTextConfig``; ``num_layers`` overrides the count."""
        text = text_config(config)
        model_type = getattr(text, "model_type", None)
        if model_type not in FAST_MODEL_TYPES:
            raise UnsupportedFastPath(f"the GLM fast path runs model types {', '.join(FAST_MODEL_TYPES)}, "
                                      f"not {model_type!r}")
        act = getattr(text, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedFastPath(f"the GLM fast path needs hidden_act='silu', got {act!r}")
        heads = int(text.num_attention_heads)
        if model_type == "glm4":
            head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
            bias = bool(getattr(text, "attention_bias", True))
        else:  # Glm4vTextAttention derives head_dim from hidden/heads and always has biases
            head_dim = int(text.hidden_size) // heads
            bias = True
        rope = dict(getattr(text, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise UnsupportedFastPath(f"the GLM fast path implements rope_type 'default', got {rope_type!r}")
        theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))
        factor = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
        rotary_dim = int(head_dim * factor)
        section = rope.get("mrope_section")
        if model_type != "glm4" and section is not None and 2 * sum(section) != rotary_dim:
            raise UnsupportedFastPath(f"mrope_section {section} does not cover rotary_dim {rotary_dim}")
        return cls(
            hidden_size=int(text.hidden_size),
            num_heads=heads,
            num_kv_heads=kv_heads_of(text),
            head_dim=head_dim,
            intermediate_size=int(text.intermediate_size),
            num_layers=int(num_layers if num_layers is not None else text.num_hidden_layers),
            vocab_size=int(text.vocab_size),
            rms_norm_eps=float(text.rms_norm_eps),
            rope_theta=float(theta),
            rotary_dim=rotary_dim,
            attention_bias=bias,
            max_position=int(max_position or getattr(text, "max_position_embeddings", 32768)),
            mrope_section=tuple(section) if (model_type != "glm4" and section is not None) else None,
        )

    # -- sizes the benchmark and the memory plan need ------------------------------------------
    def layer_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        qkv = h * (self.q_size + 2 * self.kv_size) + (self.q_size + 2 * self.kv_size if self.attention_bias else 0)
        return qkv + self.q_size * h + 2 * i * h + i * h + 4 * h

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes streamed per decode step: all layers, final norm and lm_head."""
        params = self.num_layers * self.layer_params() + self.hidden_size + self.vocab_size * self.hidden_size
        return params * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token occupies across all layers of this half."""
        return self.num_layers * 2 * self.kv_size * dtype_bytes
