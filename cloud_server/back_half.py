"""The cloud half of a bundle: decoder layers [N, L) + final norm + lm_head, rebuilt from the library's classes.

The bundle stores the source's full config (``cloud/config.json``) and the back-half weights
(``cloud/back.safetensors``: ``layers.{i}.*`` renumbered from 0, ``norm.*``, ``lm_head.weight``).
We instantiate the family's own text-model class with ``num_hidden_layers = L - N`` on the meta device,
load exactly those weights, and drop the embedding table: the cloud never sees token ids' embeddings.

``BackHalf.forward`` is the simple full-sequence reference path (used by ``verify`` and tests); the serving
engine drives ``layers`` itself with its paged KV cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from partition_tools.adapters import ModelAdapter, adapter_for_config, call_layer
from shared.manifest import BundleError, Manifest

BACK_WEIGHTS = "cloud/back.safetensors"
BACK_CONFIG = "cloud/config.json"


def back_state_dict(adapter: ModelAdapter, split_layer: int) -> dict[str, torch.Tensor]:
    """The tensors the cloud half needs, with layer indices renumbered from 0."""
    sd: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(list(adapter.layers)[split_layer:]):
        for k, v in layer.state_dict().items():
            sd[f"layers.{i}.{k}"] = v.detach().contiguous()
    for k, v in adapter.norm.state_dict().items():
        sd[f"norm.{k}"] = v.detach().contiguous()
    sd["lm_head.weight"] = adapter.lm_head.weight.detach().clone().contiguous()  # clone: may be tied
    return sd


def back_config(config, split_layer: int, num_layers: int):
    """The text config of layers [split_layer, num_layers) alone: per-layer lists are sliced to match."""
    from transformers import AutoConfig

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    d = text.to_dict()
    d["num_hidden_layers"] = num_layers - split_layer
    if isinstance(d.get("layer_types"), list):
        d["layer_types"] = d["layer_types"][split_layer:num_layers]
    out = AutoConfig.for_model(**d)
    out._attn_implementation = "sdpa"
    return out


class BackHalf(torch.nn.Module):
    def __init__(self, config, split_layer: int, num_layers: int):
        super().__init__()
        from transformers import AutoModel

        self.family = adapter_for_config(config)
        self.config = text_config = back_config(config, split_layer, num_layers)
        self.split_layer = split_layer
        with torch.device("meta"):
            decoder = AutoModel.from_config(text_config)
        self.layers = decoder.layers
        self.norm = decoder.norm
        self.rotary_emb = type(decoder.rotary_emb)(config=text_config)  # real buffers, not meta
        self.lm_head = torch.nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False, device="meta")

    @classmethod
    def from_bundle(cls, bundle_dir: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", verify: bool = True) -> BackHalf:
        from safetensors.torch import load_file
        from transformers import AutoConfig

        bundle_dir = Path(bundle_dir)
        manifest = Manifest.load(bundle_dir)
        if verify:
            manifest.verify_files(bundle_dir, roles=("cloud", "shared"))
        raw = json.loads((bundle_dir / BACK_CONFIG).read_text())
        config = AutoConfig.for_model(**raw)
        half = cls(config, manifest.split_layer, manifest.num_layers)
        sd = load_file(str(bundle_dir / BACK_WEIGHTS), device=str(device))
        missing, unexpected = half.load_state_dict(sd, strict=False, assign=True)
        missing = [k for k in missing if not k.startswith("rotary_emb.")]
        if missing or unexpected:
            raise BundleError(f"{bundle_dir / BACK_WEIGHTS}: missing {missing[:3]} unexpected {unexpected[:3]}")
        half.manifest = manifest
        return half.to(device=device, dtype=dtype).eval()

    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        if self.family.mrope:
            position_ids = position_ids[None].expand(3, *position_ids.shape)  # [3, B, S]
        return self.rotary_emb(hidden, position_ids)

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence reference: boundary hidden [B, S, H] at positions [B, S] -> logits [B, S, V]."""
        hidden = hidden.to(self.lm_head.weight.dtype)
        cos_sin = self.position_embeddings(hidden, position_ids)
        for layer in self.layers:  # attention_mask=None + sdpa = causal over the whole sequence
            hidden = call_layer(layer, hidden, attention_mask=None, position_ids=position_ids,
                                position_embeddings=cos_sin)
        return self.lm_head(self.norm(hidden))

