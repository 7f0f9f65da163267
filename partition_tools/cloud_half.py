"""The cloud half of a bundle: its on-disk format, and :class:`CloudModel`, the one module that runs it.

A bundle stores the source's full config (``cloud/config.json``), its generation config
(``cloud/generation_config.json``, bundles split since it was added) and the back-half weights
(``cloud/back.safetensors``: ``layers.{i}.*`` renumbered from 0, ``norm.*``, ``lm_head.weight``). A u-shape
bundle's (``Manifest.tail_layers`` M > 0) holds the middle layers [N, L - M) alone: no norm, no lm_head, and
its :class:`CloudModel` returns hidden states (the phone runs the tail and samples).
``partition_tools.split`` writes them with :func:`back_state_dict`; :meth:`CloudModel.from_bundle` reads
them back into the family's own decoder-layer classes (the text model built with ``num_hidden_layers =
L - N`` on the meta device, exactly those weights loaded, the embedding table dropped: the cloud never
embeds tokens in split mode).

One class serves every user: ``verify`` and the tests run :meth:`CloudModel.forward`, the full-sequence
reference; the serving engine (``cloud_server.model``) routes the same layers' attention to its paged KV
cache and drives them itself. :meth:`CloudModel.from_model` is the all-cloud baseline (every layer plus the
token embeddings of a loaded model), :meth:`CloudModel.random` a back half of random weights for benchmarks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shared.manifest import BundleError, Manifest

from .adapters import (ModelAdapter, adapter_for_config, call_layer, eos_ids_of, head_dim_of, kv_heads_of,
                       rope_cos_sin, text_config)

BACK_WEIGHTS = "cloud/back.safetensors"
BACK_CONFIG = "cloud/config.json"
# the source's generation config, where the manifest's eos_token_ids come from (ModelAdapter.eos_token_ids): a
# cloud file, so the bundle id covers them - two splits stopping at other tokens are two cloud halves
GENERATION_CONFIG = "cloud/generation_config.json"


def back_state_dict(adapter: ModelAdapter, split_layer: int, tail_layers: int = 0) -> dict[str, torch.Tensor]:
    """The tensors the cloud half needs, with layer indices renumbered from 0: layers [N, L) + norm + lm_head,
    or with a u-shape tail of M layers on the edge, layers [N, L - M) alone."""
    sd: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(list(adapter.layers)[split_layer:adapter.num_layers - tail_layers]):
        for k, v in layer.state_dict().items():
            sd[f"layers.{i}.{k}"] = v.detach().contiguous()
    if tail_layers:
        return sd
    for k, v in adapter.norm.state_dict().items():
        sd[f"norm.{k}"] = v.detach().contiguous()
    sd["lm_head.weight"] = adapter.lm_head.weight.detach().clone().contiguous()  # clone: may be tied
    return sd


def back_config(config, split_layer: int, num_layers: int):
    """The text config of layers [split_layer, num_layers) alone: per-layer lists are sliced to match."""
    from transformers import AutoConfig

    d = text_config(config).to_dict()
    d["num_hidden_layers"] = num_layers - split_layer
    if isinstance(d.get("layer_types"), list):
        d["layer_types"] = d["layer_types"][split_layer:num_layers]
    out = AutoConfig.for_model(**d)
    out._attn_implementation = "sdpa"
    return out


class CloudModel(torch.nn.Module):
    """Decoder layers + final norm + lm_head + rotary embedding (+ token embeddings for the full model).

    ``norm`` and ``lm_head`` are None for a u-shape bundle's middle (:attr:`returns_states`): it ends at the
    hidden states the phone's tail takes.

    ``config`` is the text config of exactly these layers. The rotary embedding is always built fresh from
    it, in fp32: casting a module to bf16/fp16 would round ``inv_freq`` too. ``dtype`` is the weights'
    (and activations') dtype. Sizes are plain attributes: tensor parallelism (``cloud_server.tp``) divides
    ``num_heads`` / ``num_kv_heads`` by the world size when it shards the layers.
    """

    def __init__(self, *, layers: torch.nn.ModuleList, norm: torch.nn.Module | None, lm_head: torch.nn.Linear | None,
                 rotary_type: type, config, mrope: bool, eos_token_ids: list[int],
                 embed_tokens: torch.nn.Embedding | None = None, manifest: Manifest | None = None):
        super().__init__()
        self.layers, self.norm, self.lm_head, self.embed_tokens = layers, norm, lm_head, embed_tokens
        self.rotary_emb = rotary_type(config=config)  # fp32 buffers on the host; .to(device) keeps them fp32
        self.config = config
        self.mrope = mrope  # GLM-4.1V's 3-D rotary positions
        self.eos_token_ids = list(eos_token_ids)
        self.manifest = manifest  # the bundle's, when built from one
        self.variant: str | None = None  # the serving engine's compute variant, once it prepares this model
        self.dtype = (lm_head.weight if lm_head is not None else next(layers.parameters())).dtype
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = kv_heads_of(config)
        self.head_dim = head_dim_of(config)

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def from_bundle(cls, bundle_dir: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", verify: bool = True) -> CloudModel:
        """The bundle's back half in ``dtype`` on ``device``; ``verify`` checks the cloud files' hashes first."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModel

        bundle_dir = Path(bundle_dir)
        manifest = Manifest.load(bundle_dir)
        if verify:
            manifest.verify_files(bundle_dir, roles=("cloud", "shared"))
        try:
            source_config = AutoConfig.for_model(**json.loads((bundle_dir / BACK_CONFIG).read_text()))
        except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError) as e:  # not JSON, no/unknown model_type
            raise BundleError(f"{bundle_dir / BACK_CONFIG}: not a model config ({type(e).__name__}: {e})"
                              .splitlines()[0]) from None
        config = back_config(source_config, *manifest.cloud_layers)
        middle = manifest.tail_layers > 0  # u-shape: no norm, no lm_head
        with torch.device("meta"):
            decoder = AutoModel.from_config(config)
            lm_head = None if middle else torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        norm = None if middle else decoder.norm
        weights = torch.nn.ModuleDict({"layers": decoder.layers, **({} if middle else
                                                                     {"norm": norm, "lm_head": lm_head})})
        try:
            sd = {k: v.to(dtype) for k, v in load_file(str(bundle_dir / BACK_WEIGHTS), device=str(device)).items()}
        except (OSError, SafetensorError) as e:  # cut short or not safetensors (a manifest re-hashed over it)
            raise BundleError(f"{bundle_dir / BACK_WEIGHTS}: not a readable safetensors file ({e})") from None
        missing, unexpected = weights.load_state_dict(sd, strict=False, assign=True)
        if missing or unexpected:
            raise BundleError(f"{bundle_dir / BACK_WEIGHTS}: missing {missing[:3]} unexpected {unexpected[:3]}")
        model = cls(layers=decoder.layers, norm=norm, lm_head=lm_head, rotary_type=type(decoder.rotary_emb),
                    config=config, mrope=adapter_for_config(source_config).mrope,
                    eos_token_ids=manifest.eos_token_ids, manifest=manifest)
        return model.to(device).eval()

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> CloudModel:
        """Every layer of a loaded ``*ForCausalLM`` plus its token embeddings (the all-cloud baseline).

        Shares the modules (and the text config) with ``model``: copy it first to keep it untouched."""
        a = ModelAdapter(model)
        return cls(layers=a.layers, norm=a.norm, lm_head=a.lm_head, rotary_type=type(a.rotary_emb),
                   config=a.config, mrope=a.family.mrope, eos_token_ids=a.eos_token_ids(),
                   embed_tokens=a.embed_tokens).eval()

    @classmethod
    def random(cls, config, split_layer: int, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", seed: int = 0,
               eos_token_ids: list[int] | None = None) -> CloudModel:
        """A back half of random weights (layers [split_layer, L) of ``config``), built directly on ``device``.

        For benchmarks of full-size models without a bundle: the layer classes :meth:`from_bundle` gives, with
        the library's random initialisation made on the device itself, so a 9B model's half never passes
        through host memory (speed does not depend on values). Seeded without touching the caller's RNGs."""
        from transformers import AutoModel

        mrope = adapter_for_config(config).mrope
        text = text_config(config)
        total = int(text.num_hidden_layers)
        if not 0 < split_layer < total:
            raise ValueError(f"split layer must be in [1, {total - 1}] (got {split_layer})")
        half = back_config(config, split_layer, total)
        if eos_token_ids is None:
            eos_token_ids = eos_ids_of(text)
        cuda = [torch.device(device).index or 0] if str(device).startswith("cuda") else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            with torch.device(device):
                decoder = AutoModel.from_config(half, dtype=dtype)
                lm_head = torch.nn.Linear(half.hidden_size, half.vocab_size, bias=False, dtype=dtype)
        model = cls(layers=decoder.layers, norm=decoder.norm, lm_head=lm_head, rotary_type=type(decoder.rotary_emb),
                    config=half, mrope=mrope, eos_token_ids=eos_token_ids)
        return model.to(device).eval()  # the decoder (and its embedding table) is dropped here

    # -- forward --------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def returns_states(self) -> bool:
        """A u-shape middle: its output is hidden states [.., H], not logits."""
        return self.lm_head is None

    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                            rope_positions: torch.Tensor | None = None):
        """cos/sin for ``position_ids`` [B, S] (GLM-4.1V: ``rope_positions`` [3, B, S]; see ``rope_cos_sin``)."""
        return rope_cos_sin(self.rotary_emb, self.mrope, hidden, position_ids, rope_positions)

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Full-sequence reference: boundary hidden [B, S, H] at positions [B, S] (GLM-4.1V with images: 3-D
        ``rope_positions`` [3, B, S]) -> logits [B, S, V] (a u-shape middle: hidden states [B, S, H])."""
        hidden = hidden.to(self.dtype)
        cos_sin = self.position_embeddings(hidden, position_ids, rope_positions)
        for layer in self.layers:  # attention_mask=None + sdpa = causal over the whole sequence
            hidden = call_layer(layer, hidden, attention_mask=None, position_ids=position_ids,
                                position_embeddings=cos_sin)
        return hidden if self.returns_states else self.lm_head(self.norm(hidden))
