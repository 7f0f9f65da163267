"""The module the engine runs, in one shape for both serving modes, and its compute variants.

* split mode: the bundle's back half (decoder layers [N, L) renumbered from 0, final norm, lm_head), fed the
  edge's boundary hidden states;
* full-model mode: every layer plus the token embeddings (the all-cloud baseline), fed token ids.

Either way the layers are the library's own decoder-layer modules; their attention is routed to the engine's
paged-KV attention (``cloud_server.attention``) through transformers' attention-function registry, which is
how vLLM's Transformers backend serves any architecture through one path.

Compute variants (per request, chosen by the shared precision policy): ``fp32`` (CPU), ``bf16`` / ``fp16``
(CUDA), and ``int8``: weight-only int8 decoder layers (per-output-channel symmetric scales, dequantized inside
the matmul) computing in the device's default dtype. Each variant is its own copy of the weights; the
engine batches sequences within their variant.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F

from cloud_server.attention import ATTN_IMPL, register
from cloud_server.config import ConfigError

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(variant: str, device: str) -> torch.dtype:
    """The activation/KV dtype of a variant on a device (int8 weights compute in the device default)."""
    if variant == "int8":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if variant not in _DTYPES:
        raise ConfigError(f"unknown compute variant {variant!r}")
    return _DTYPES[variant]


class Int8Linear(torch.nn.Module):
    """Weight-only int8 ``nn.Linear``: int8 weight [out, in] + fp32 scale [out]; dequantized per forward."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()  # [out, in]
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [out]
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = (self.qweight.to(torch.float32) * self.scale[:, None]).to(x.dtype)  # [out, in]
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


def quantize_int8_(module: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``module`` by an :class:`Int8Linear`, in place; returns the count."""
    n = 0
    for name, child in list(module.named_children()):
        if type(child) is torch.nn.Linear:
            setattr(module, name, Int8Linear(child))
            n += 1
        else:
            n += quantize_int8_(child)
    return n


class CloudModel(torch.nn.Module):
    """Decoder layers + final norm + lm_head (+ token embeddings in full-model mode) of one compute variant."""

    def __init__(self, *, layers, norm, lm_head, rotary, config, embed_tokens=None, variant: str,
                 dtype: torch.dtype, eos_token_ids: list[int], mrope: bool):
        super().__init__()
        self.layers, self.norm, self.lm_head, self.rotary_emb = layers, norm, lm_head, rotary
        self.embed_tokens = embed_tokens
        self.config = config
        self.variant, self.dtype, self.mrope = variant, dtype, mrope
        self.eos_token_ids = list(eos_token_ids)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or self.hidden_size // self.num_heads)
        register()
        config._attn_implementation = ATTN_IMPL  # outside an engine step it falls back to sdpa
        for layer in self.layers:  # modules may hold their own reference to a (sub)config
            for m in layer.modules():
                cfg = getattr(m, "config", None)
                if cfg is not None and cfg is not config and hasattr(cfg, "_attn_implementation"):
                    cfg._attn_implementation = ATTN_IMPL

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                            rope_positions: torch.Tensor | None = None):
        """cos/sin for ``position_ids`` [B, S]. GLM-4.1V's 3-D rope takes ``rope_positions`` [3, B, S]
        when given (image tokens), else the same ids on all three axes."""
        if self.mrope:
            if rope_positions is not None:
                return self.rotary_emb(hidden, rope_positions)
            position_ids = position_ids[None].expand(3, *position_ids.shape)  # [3, B, S]
        elif rope_positions is not None:
            raise ValueError("multimodal rope positions for a model without multimodal RoPE")
        return self.rotary_emb(hidden, position_ids)


def _fp32_rotary(rotary: torch.nn.Module, config) -> torch.nn.Module:
    """A fresh rotary embedding: casting the model to bf16/fp16 also rounds ``inv_freq``; rebuilt, it is fp32."""
    return type(rotary)(config=config)


def _finish(model: CloudModel, variant: str, device: str) -> CloudModel:
    if variant == "int8":
        quantize_int8_(model.layers)
    return model.to(device=device).eval()


def load_split_model(bundle_dir: str | Path, variant: str, device: str = "cpu",
                     shard=None) -> CloudModel:
    """The bundle's back half as a :class:`CloudModel`; ``shard(model)`` (tensor parallel) runs before int8."""
    from cloud_server.back_half import BackHalf

    dtype = compute_dtype(variant, device)
    half = BackHalf.from_bundle(bundle_dir, dtype=dtype, device="cpu")
    m = half.manifest
    model = CloudModel(layers=half.layers, norm=half.norm, lm_head=half.lm_head,
                       rotary=_fp32_rotary(half.rotary_emb, half.config), config=half.config, variant=variant, dtype=dtype, eos_token_ids=m.eos_token_ids,
                       mrope=half.family.mrope)
    model.manifest = m
    if shard is not None:
        shard(model)
    return _finish(model, variant, device)


def load_full_model(lm, variant: str, device: str = "cpu", shard=None) -> CloudModel:
    """Every layer of a loaded model (``partition_tools.models.LoadedModel``) plus its token embeddings."""
    from partition_tools.adapters import ModelAdapter

    dtype = compute_dtype(variant, device)
    src = copy.deepcopy(lm.model).to(dtype=dtype)  # one copy per variant; the caller's model is untouched
    a = ModelAdapter(src)
    model = CloudModel(layers=a.layers, norm=a.norm, lm_head=a.lm_head,
                       rotary=_fp32_rotary(a.rotary_emb, a.config), config=a.config,
                       embed_tokens=a.embed_tokens, variant=variant, dtype=dtype,
                       eos_token_ids=a.eos_token_ids(), mrope=a.family.mrope)
    if shard is not None:
        shard(model)
    return _finish(model, variant, device)


def random_split_model(config, split_layer: int, variant: str, device: str = "cpu", seed: int = 0,
                       eos_token_ids: list[int] | None = None) -> CloudModel:
    """A back half of random weights (layers [split_layer, L) of ``config``), built directly on ``device``.

    For benchmarks of full-size models without a bundle: the library's decoder-layer classes, as
    :func:`load_split_model` gives them, but the weights are the library's random initialisation made on the
    device itself, so a 9B model's half never passes through host memory. Speed does not depend on values.
    """
    from transformers import AutoModel

    from cloud_server.back_half import back_config
    from partition_tools.adapters import adapter_for_config

    family = adapter_for_config(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    total = int(text.num_hidden_layers)
    if not 0 < split_layer < total:
        raise ConfigError(f"split layer must be in [1, {total - 1}] (got {split_layer})")
    dtype = compute_dtype(variant, device)
    half_cfg = back_config(config, split_layer, total)
    if eos_token_ids is None:
        eos = getattr(text, "eos_token_id", None)
        eos_token_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])]
    cuda = [torch.device(device).index or 0] if str(device).startswith("cuda") else []
    with torch.random.fork_rng(devices=cuda):  # seeded without touching the caller's generators
        torch.manual_seed(seed)
        with torch.device(device):
            decoder = AutoModel.from_config(half_cfg, dtype=dtype)
            lm_head = torch.nn.Linear(half_cfg.hidden_size, half_cfg.vocab_size, bias=False, dtype=dtype)
    decoder.embed_tokens = None  # the cloud half never embeds tokens: free the table
    model = CloudModel(layers=decoder.layers, norm=decoder.norm, lm_head=lm_head,
                       rotary=_fp32_rotary(decoder.rotary_emb, half_cfg), config=half_cfg, variant=variant,
                       dtype=dtype, eos_token_ids=eos_token_ids, mrope=family.mrope)
    return _finish(model, variant, device)
