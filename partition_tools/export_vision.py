"""Export GLM-4.1V's vision tower (patch embed, blocks, merger) to ONNX for the edge: ``edge/vision.onnx``.

The tower's data-dependent parts (per-patch 2-D rotary angles, the bicubic resampling coordinates of the
learned position table, one image per call so attention needs no mask) are computed on the phone in numpy
(``edge_client.vision``); the graph is a pure function of four tensors, for one image at a time::

    inputs   pixel_values  float32 [N, C*T*P*P]  patchified, normalised pixels (edge_client.vision.preprocess)
             rope_cos      float32 [N, Dh]       the tower's axial 2-D rotary angles per patch (Dh = head dim)
             rope_sin      float32 [N, Dh]
             pos_grid      float32 [1, N, 1, 2]  each patch's (w, h) centre in [-1, 1] on the position table
    outputs  image_embeds  float32 [N / m^2, H]  visual embeddings in the LM's hidden size, one per image token

The computation is the library's own ``Glm4vVisionModel.forward`` with its modules' weights; only the two
convolutions whose kernel equals their stride (the patch embedding, the 2x2 downsample) are written as the
matrix products they are, so the int8 quantizer (MatMulNBits, as for the front) reaches them too.

``edge/vision.json`` beside the graph holds what the edge's preprocessing and the prompt need (patch and
merge sizes, mean/std, the pixel budget, the image token ids, the rotary parameters). Both files are
manifest artifacts of role ``edge`` (the bundle id, which names the cloud half, does not change).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from edge_client.vision import VISION, VISION_CONFIG, VISION_INPUTS, VisionSpec

VISION_QUANTS = ("int8", "fp32")
# transformers' Glm4vImageProcessor defaults (GLM-4.1V's processor): CLIP mean/std, budget 28*28*15000
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_MIN_PIXELS = 112 * 112
DEFAULT_MAX_PIXELS = 28 * 28 * 15000
INT8_MAX_REL_ERROR = 0.05  # int8 tower kept only if its embeddings stay this close to fp32 (max abs / absmax)


def vision_spec(config, quant: str, report: dict | None = None) -> VisionSpec:
    """The spec of a ``Glm4vConfig`` (its ``vision_config`` and image token ids)."""
    v = config.vision_config
    rope = getattr(v, "rope_parameters", None) or {}
    side = int(v.image_size) // int(v.patch_size)
    return VisionSpec(
        patch_size=int(v.patch_size), temporal_patch_size=int(v.temporal_patch_size),
        merge_size=int(v.spatial_merge_size), in_channels=int(v.in_channels), image_mean=CLIP_MEAN,
        image_std=CLIP_STD, min_pixels=DEFAULT_MIN_PIXELS, max_pixels=DEFAULT_MAX_PIXELS,
        head_dim=int(v.hidden_size) // int(v.num_heads), rope_theta=float(rope.get("rope_theta", 10000.0)),
        pos_table_side=side, out_hidden_size=int(v.out_hidden_size), image_token_id=int(config.image_token_id),
        image_start_token_id=int(config.image_start_token_id), image_end_token_id=int(config.image_end_token_id),
        quant=quant, quant_report=report or {},
    )


class VisionTower(torch.nn.Module):
    """``Glm4vVisionModel.forward`` for one image, as a function of (pixels, rotary, position grid)."""

    def __init__(self, visual: torch.nn.Module):
        super().__init__()
        self.visual = visual
        cfg = visual.config
        self.merge = int(cfg.spatial_merge_size)
        self.heads = int(cfg.num_heads)

    def attention(self, attn: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        n = x.shape[1]
        qkv = attn.qkv(x).reshape(n, 3, self.heads, -1).permute(1, 0, 2, 3)  # [3, N, heads, Dh]
        q, k, v = qkv[0], qkv[1], qkv[2]
        c, s = cos[:, None, :], sin[:, None, :]  # [N, 1, Dh]

        def rot(t):  # rotate_half over the whole head (the tower's rotary has no partial factor)
            half = t.shape[-1] // 2
            return torch.cat([-t[..., half:], t[..., :half]], dim=-1)

        q, k = q * c + rot(q) * s, k * c + rot(k) * s
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, N, Dh]
        o = F.scaled_dot_product_attention(q, k, v, scale=attn.scaling)  # full attention within the image
        return attn.proj(o[0].transpose(0, 1).reshape(1, n, -1))  # [1, N, D]

    def forward(self, pixel_values, rope_cos, rope_sin, pos_grid):
        v = self.visual
        pe = v.patch_embed.proj  # Conv3d, kernel == stride == one patch: a matrix product per patch
        x = (pixel_values @ pe.weight.reshape(pe.weight.shape[0], -1).T + pe.bias)[None]  # [1, N, D]
        x = v.post_conv_layernorm(x)
        table = v.embeddings.position_embedding.weight  # [side^2, D]
        side = int(math.isqrt(table.shape[0]))
        grid_table = table.reshape(side, side, -1).permute(2, 0, 1)[None]  # [1, D, side, side]
        pos = F.grid_sample(grid_table, pos_grid, mode="bicubic", align_corners=False, padding_mode="border")
        x = x + pos[0, :, :, 0].T[None]  # [1, N, D]
        for blk in v.blocks:
            x = x + self.attention(blk.attn, blk.norm1(x), rope_cos, rope_sin)
            x = x + blk.mlp(blk.norm2(x))
        x = v.post_layernorm(x)[0]  # [N, D]
        m = self.merge
        x = x.reshape(-1, m, m, x.shape[-1]).permute(0, 3, 1, 2).reshape(-1, x.shape[-1] * m * m)  # [N/m^2, D m m]
        ds = v.downsample  # Conv2d, kernel == stride == m: one matrix product per merged token
        x = x @ ds.weight.reshape(ds.weight.shape[0], -1).T + ds.bias  # [N/m^2, H]
        return v.merger(x[None])[0]  # [N/m^2, H]


def example_inputs(visual: torch.nn.Module, grid_hw: tuple[int, int] = (4, 6)):
    """Inputs for one image of ``grid_hw`` patches (edge_client.vision computes the real ones)."""
    from edge_client.vision import position_grid, vision_rotary

    cfg = visual.config
    h, w = grid_hw
    n = h * w
    dim = int(cfg.in_channels) * int(cfg.temporal_patch_size) * int(cfg.patch_size) ** 2
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(n, dim, generator=g)
    hd = int(cfg.hidden_size) // int(cfg.num_heads)
    cos, sin = vision_rotary(h, w, int(cfg.spatial_merge_size), hd, float(cfg.rope_parameters["rope_theta"]))
    grid = position_grid(h, w, int(cfg.spatial_merge_size))
    return pixels, torch.from_numpy(cos), torch.from_numpy(sin), torch.from_numpy(grid)


def export_vision_fp32(visual: torch.nn.Module, out_path: Path) -> Path:
    """Write the fp32 tower graph (weights beside it as external data past 2 GB)."""
    from torch.export import Dim

    visual.config._attn_implementation = "sdpa"
    module = VisionTower(visual).eval()
    args = example_inputs(visual)
    n = Dim("n_patches", min=4)
    dyn = ({0: n}, {0: n}, {0: n}, {1: n})
    out_path.parent.mkdir(parents=True, exist_ok=True)
    from .export import quiet_exporter_logs

    quiet_exporter_logs()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, dynamo=True,
                                    input_names=list(VISION_INPUTS),
                                    output_names=["image_embeds"], dynamic_shapes=dyn, optimize=True,
                                    verbose=False)
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
    program.save(str(out_path), external_data=nbytes > (1 << 31) - (1 << 26))
    return out_path


def _run(path: Path, feeds: dict) -> np.ndarray:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def export_vision(model: torch.nn.Module, bundle_dir: Path, quant: str = "int8") -> VisionSpec:
    """Write ``edge/vision.onnx`` (+ ``edge/vision.json``) of a ``Glm4vForConditionalGeneration`` into a bundle.

    ``quant="int8"``: MatMulNBits int8 weights (``partition_tools.quantize``), kept only if the embeddings of a
    probe image stay within ``INT8_MAX_REL_ERROR`` of the fp32 graph's (else fp32 is written and the report
    says why); ``fp32``: the exported graph as is. Returns the spec written."""
    import tempfile

    from .quantize import quantize_front

    if quant not in VISION_QUANTS:
        raise ValueError(f"vision quantization {quant!r}: expected one of {', '.join(VISION_QUANTS)}")
    visual = model.model.visual
    bundle_dir = Path(bundle_dir)
    dst = bundle_dir / VISION
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = export_vision_fp32(visual, Path(tmp) / "vision.onnx")
        for f in dst.parent.glob(dst.name + "*"):
            f.unlink()
        written = quant
        report = quantize_front(fp32, dst, quant, block_size=32, accuracy_level=4)
        if quant == "int8":
            feeds = dict(zip(VISION_INPUTS, (t.numpy() for t in example_inputs(visual, (8, 8)))))
            ref, got = _run(fp32, feeds), _run(dst, feeds)
            rel = float(np.abs(got - ref).max() / max(float(np.abs(ref).max()), 1e-12))
            report["probe_max_rel_error"] = round(rel, 6)
            if rel > INT8_MAX_REL_ERROR:
                quantize_front(fp32, dst, "fp32")  # a plain copy
                written = "fp32"
                report["kept_fp32_because"] = f"int8 max rel error {rel:.4f} > {INT8_MAX_REL_ERROR}"
    spec = vision_spec(model.config, written, report)
    (bundle_dir / VISION_CONFIG).write_text(json.dumps(asdict(spec), indent=2, sort_keys=True) + "\n")
    return spec
