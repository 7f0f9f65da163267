"""The engine's models: :class:`~partition_tools.cloud_half.CloudModel` prepared for serving, per compute variant.

* split mode: the bundle's back half (decoder layers [N, L) renumbered from 0, final norm, lm_head), fed the
  edge's boundary hidden states (:func:`load_split_model`; :func:`random_split_model` for benchmarks);
* full-model mode: every layer plus the token embeddings (the all-cloud baseline), fed token ids
  (:func:`load_full_model`).

Either way the layers are the library's own decoder-layer modules; preparing a model routes their attention
to the engine's paged-KV attention (``cloud_server.attention``) through transformers' attention-function
registry, which is how vLLM's Transformers backend serves any architecture through one path.

Compute variants (per request, chosen by the shared precision policy): ``fp32`` (CPU), ``bf16`` / ``fp16``
(CUDA), and ``int8``: weight-only int8 decoder layers (per-output-channel symmetric scales, dequantized inside
the matmul) computing in the device's default dtype. Each variant is its own copy of the weights; the
engine batches sequences within their variant.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cloud_server.attention import ATTN_IMPL, register
from cloud_server.config import ConfigError
from partition_tools.cloud_half import CloudModel

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


def route_attention(model: CloudModel) -> None:
    """Send every layer's attention to the paged-KV implementation (outside an engine step it is SDPA)."""
    register()
    model.config._attn_implementation = ATTN_IMPL
    for layer in model.layers:  # modules may hold their own reference to a (sub)config
        for m in layer.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and cfg is not model.config and hasattr(cfg, "_attn_implementation"):
                cfg._attn_implementation = ATTN_IMPL


def _prepare(model: CloudModel, variant: str, device: str, shard=None) -> CloudModel:
    """Attention routed, ``shard(model)`` (tensor parallel) applied, int8 weights made, moved to ``device``."""
    route_attention(model)
    model.variant = variant
    if shard is not None:
        shard(model)
    if variant == "int8":
        quantize_int8_(model.layers)
    return model.to(device=device).eval()


def load_split_model(bundle_dir: str | Path, variant: str, device: str = "cpu", shard=None) -> CloudModel:
    """The bundle's back half in ``variant``; ``shard(model)`` (tensor parallel) runs before int8."""
    model = CloudModel.from_bundle(bundle_dir, dtype=compute_dtype(variant, device), device="cpu")
    return _prepare(model, variant, device, shard)


def load_draft_inputs(bundle_dir: str | Path, manifest) -> torch.Tensor | None:
    """The bundle's cloud drafter table ``[V, H]`` float16 (``partition_tools.cloud_drafter``), hash-checked;
    None when the bundle has none."""
    from shared.manifest import CLOUD_DRAFT_INPUTS, BundleError, sha256_file

    art = manifest.artifacts.get(CLOUD_DRAFT_INPUTS)
    if art is None:
        return None
    path = Path(bundle_dir) / CLOUD_DRAFT_INPUTS
    if not path.is_file() or path.stat().st_size != art.bytes or sha256_file(path) != art.sha256:
        raise BundleError(f"{path}: missing, truncated or not the manifest's (re-run `autoglm-partition draft-head "
                          f"--cloud`)")
    try:
        arr = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise BundleError(f"{path}: not a .npy array ({e})") from None
    if arr.dtype != np.float16 or arr.ndim != 2 or arr.shape[1] != manifest.hidden_size or not np.isfinite(arr).all():
        raise BundleError(f"{path}: expected finite float16 [V, {manifest.hidden_size}], got {arr.dtype} "
                          f"{list(arr.shape)}")
    return torch.from_numpy(arr)


def load_full_model(lm, variant: str, device: str = "cpu", shard=None) -> CloudModel:
    """Every layer of a loaded model (``partition_tools.models.LoadedModel``) plus its token embeddings."""
    src = copy.deepcopy(lm.model).to(dtype=compute_dtype(variant, device))  # one copy per variant
    return _prepare(CloudModel.from_model(src), variant, device, shard)


def random_split_model(config, split_layer: int, variant: str, device: str = "cpu", seed: int = 0,
                       eos_token_ids: list[int] | None = None) -> CloudModel:
    """A random-weight back half (:meth:`CloudModel.random`, made on ``device``) in ``variant``."""
    model = CloudModel.random(config, split_layer, compute_dtype(variant, device), device, seed, eos_token_ids)
    return _prepare(model, variant, device)
