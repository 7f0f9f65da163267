"""Export the edge front (embeddings + decoder layers [0, N)) to ONNX.

:func:`build_front` picks the graph: the *fused* one written from the weights by
``partition_tools.graph_builder`` (the default where it fits: in-place KV, fused contrib ops), or the
*plain* traced one below, the portable fallback. The plain graph serves prefill and single-token decode
with an explicit KV cache. Its interface (the edge runtime relies on it):

    inputs   input_ids      int64   [B, S]
             position_ids   int64   [B, S]          (absolute positions; GLM-4.1V's 3-D rope is built inside)
             past_key.{i}   float32 [B, KVH, P, D]  for i in [0, N)  (P may be 0)
             past_value.{i} float32 [B, KVH, P, D]
    outputs  hidden_states  float32 [B, S, H]       the boundary activations sent to the cloud
             present_key.{i}, present_value.{i}  float32 [B, KVH, P + S, D]

The attention mask is built inside from the shapes: query s sits at position P + s and sees keys [0, P + s].
Batches are unpadded (the edge runs one sequence).

We use torch's dynamo exporter: the TorchScript exporter fails on GLM-4's rotary ``repeat_interleave``.
The layers are the library's own modules; only the cache is ours (it implements ``update`` alone).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch

from .adapters import ModelAdapter, call_layer


def input_names(n_layers: int) -> list[str]:
    names = ["input_ids", "position_ids"]
    for i in range(n_layers):
        names += [f"past_key.{i}", f"past_value.{i}"]
    return names


def output_names(n_layers: int) -> list[str]:
    names = ["hidden_states"]
    for i in range(n_layers):
        names += [f"present_key.{i}", f"present_value.{i}"]
    return names


class _ExportCache:
    """The smallest cache the library's attention accepts: append and return the full K/V."""

    def __init__(self, past: list[torch.Tensor]):
        self.past = past  # [k0, v0, k1, v1, ...], each [B, KVH, P, D]
        self.present: list[torch.Tensor] = []

    def update(self, key, value, layer_idx, *args, **kwargs):
        k = torch.cat([self.past[2 * layer_idx], key], dim=2)  # [B, KVH, P+S, D]
        v = torch.cat([self.past[2 * layer_idx + 1], value], dim=2)
        self.present += [k, v]
        return k, v


class FrontModule(torch.nn.Module):
    """Embeddings + layers [0, N) as a pure function of (ids, positions, past) -> (hidden, present)."""

    def __init__(self, adapter: ModelAdapter, n_layers: int):
        super().__init__()
        self.adapter = adapter
        self.embed_tokens = adapter.embed_tokens
        self.layers = torch.nn.ModuleList(list(adapter.layers)[:n_layers])
        self.rotary_emb = adapter.rotary_emb
        self.cache_kw = adapter.cache_kwarg()

    def forward(self, input_ids, position_ids, *past):
        hidden = self.embed_tokens(input_ids)  # [B, S, H]
        cos_sin = self.adapter.position_embeddings(hidden, position_ids)
        s = input_ids.shape[1]
        p = past[0].shape[2]
        q_pos = torch.arange(s, device=hidden.device)[:, None] + p  # [S, 1]
        k_pos = torch.arange(p + s, device=hidden.device)[None, :]  # [1, P+S]
        mask = torch.zeros(s, p + s, dtype=hidden.dtype, device=hidden.device)
        mask = mask.masked_fill(k_pos > q_pos, torch.finfo(hidden.dtype).min)[None, None]  # [1, 1, S, P+S]
        cache = _ExportCache(list(past))
        for layer in self.layers:
            hidden = call_layer(layer, hidden, attention_mask=mask, position_ids=position_ids,
                                position_embeddings=cos_sin, **{self.cache_kw: cache})
        return (hidden, *cache.present)


def example_inputs(adapter: ModelAdapter, n_layers: int, seq: int = 3, past: int = 2):
    ids = torch.randint(0, adapter.vocab_size, (1, seq))
    pos = torch.arange(past, past + seq)[None]
    kv = [torch.randn(1, adapter.num_kv_heads, past, adapter.head_dim) for _ in range(2 * n_layers)]
    return (ids, pos, *kv)


EDGE_GRAPHS = ("auto", "fused", "plain")


def build_front(adapter: ModelAdapter, n_layers: int, out_path: Path, graph: str = "auto") -> tuple[Path, str]:
    """Write the fp32 front graph of kind ``graph`` -> (path, kind written: "fused" | "plain").

    ``fused``: ``partition_tools.graph_builder`` (contrib ops, in-place KV; fails loudly if the model does not
    fit it); ``plain``: the traced portable graph (:func:`export_front`); ``auto``: fused when the model fits
    it and the installed onnxruntime loads it, else plain.
    """
    from .graph_builder import GraphBuildError, build_fused_front

    if graph not in EDGE_GRAPHS:
        raise ValueError(f"edge graph {graph!r}: expected one of {', '.join(EDGE_GRAPHS)}")
    if graph == "plain":
        return export_front(adapter, n_layers, out_path), "plain"
    try:
        path = build_fused_front(adapter, n_layers, out_path)
        _check_loads(path)
        return path, "fused"
    except (GraphBuildError, RuntimeError) as e:
        if graph == "fused":
            raise
        logging.getLogger(__name__).info("fused edge graph not built (%s); writing the plain graph", e)
        return export_front(adapter, n_layers, out_path), "plain"


def _check_loads(path: Path) -> None:
    """RuntimeError unless this onnxruntime loads ``path`` and runs a 2-token prefill on it (a contrib op
    missing, or a shape its kernels refuse)."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from .smoothing import calibration_feeds

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        session.run(["hidden_states"], calibration_feeds(onnx.load(str(path), load_external_data=False),
                                                          np.array([1, 2], np.int64)))
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise RuntimeError(f"onnxruntime cannot run the fused graph: {str(e).splitlines()[0]}") from None


def quiet_exporter_logs() -> None:
    """Before a torch.onnx export: the exporters' INFO chatter is not progress, and torch's op registry warns
    "torchvision is not installed. Skipping torchvision::nms" (and three more) on every export without
    torchvision, which no graph here uses: a user took it for a missing dependency."""
    for name in ("onnxscript", "onnx_ir", "torch.onnx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)


def export_front(adapter: ModelAdapter, n_layers: int, out_path: Path) -> Path:
    """Write the fp32 front graph (weights inline if < 2 GB, else as external data beside it)."""
    from torch.export import Dim

    adapter.model.config._attn_implementation = "sdpa"
    adapter.config._attn_implementation = "sdpa"
    module = FrontModule(adapter, n_layers).eval()
    args = example_inputs(adapter, n_layers)
    batch, seq, past = Dim.AUTO, Dim.AUTO, Dim.AUTO
    dyn = ({0: batch, 1: seq}, {0: batch, 1: seq}, tuple({0: batch, 2: past} for _ in range(2 * n_layers)))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    quiet_exporter_logs()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, args, dynamo=True, input_names=input_names(n_layers),
            output_names=output_names(n_layers), dynamic_shapes=dyn, optimize=True, verbose=False,
        )
    program.save(str(out_path), external_data=_param_bytes(module) > (1 << 31) - (1 << 26))
    return out_path


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())
