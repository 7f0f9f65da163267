"""Export the u-shape *tail*: the last M decoder layers, the final norm and the lm_head as ``edge/tail.onnx``.

A bundle split with ``--tail M`` keeps both ends of the model on the phone: the front (layers [0, N)) and
this tail (layers [L - M, L)), so the cloud runs the middle and never sees a token of the output
(docs/protocol.md, "U-shape"). The graph is the fused one of ``partition_tools.graph_builder``
(``build_fused_layers``: GroupQueryAttention with the KV buffer updated in place, as the front's), read by
``edge_client.tail.TailRuntime``::

    inputs   boundary_states        float32 [1, S, H]       hidden states after layer L - M - 1 (from the cloud)
             seqlens_k              int32   [1]             P + S - 1
             total_sequence_length  int32   []              P + S
             logits_rows            int64   [1]             n: logits of the last n rows (1 in prefill, k + 1
                                                            in a speculative step)
             past_key.{j}, past_value.{j}  float32 [1, KVH, C, D]  layer L - M + j's KV buffer
    outputs  logits                 float32 [1, n, V]
             present_key.{j}, present_value.{j}                   the same buffers (in place)

Quantization (``--edge-quant``) is the front's weight-only recipe (``partition_tools.quantize``: MatMulNBits,
block 32, int8 activations at accuracy level 4), the lm_head included, without the smoothing pass (its
calibration runs token ids through a graph that starts at the embeddings; the tail starts at hidden states)
and without an embedding table. There is no traced fallback: a model the fused graph cannot express (q/k
norms, sliding windows) cannot be split with a tail.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from .adapters import ModelAdapter
from .graph_builder import build_fused_layers
from .quantize import quantize_front, recipe_for

TAIL = "edge/tail.onnx"  # edge_client.tail reads it under the same name


def tail_recipe(adapter: ModelAdapter, mode: str) -> dict:
    """The front's default recipe for ``mode`` less what is calibrated on token ids at the graph's input
    (smoothing, fp32 outlier MatMuls and channels, GPTQ: a tail or drafter graph starts from hidden states) or
    needs an embedding table."""
    recipe = recipe_for(adapter, adapter.num_layers, mode)
    for key in ("smooth_alpha", "calibration_ids", "embedding", "float_outliers", "gptq", "outlier_channels",
                "outlier_channel_patterns", "outlier_channel_min_ratio", "outlier_channel_fold"):
        recipe.pop(key, None)
    return recipe


def export_tail(adapter: ModelAdapter, tail_layers: int, out_path: Path, quant: str) -> dict:
    """Write the tail of ``tail_layers`` layers to ``out_path`` in ``quant`` (fp32 | int8 | int4); returns its
    quantization report (``Manifest.quant_report["tail"]``)."""
    first = adapter.num_layers - tail_layers
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = build_fused_layers(adapter, first, adapter.num_layers, Path(tmp) / "tail.onnx")
        if quant == "fp32":
            shutil.move(str(fp32), out_path)
            report = {"mode": "fp32"}
        else:
            report = quantize_front(fp32, out_path, quant, **tail_recipe(adapter, quant))
    return {**report, "layers": [first, adapter.num_layers]}
