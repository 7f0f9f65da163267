"""int8 KV cache for the fused edge graph: GroupQueryAttention stores K and V as int8 with static scales.

``quantize_kv(model, ids)`` rewrites a fused front graph (``partition_tools.graph_builder``) in place:

* every ``past_*/present_*`` tensor becomes ``int8 [1, KVH, C, D]`` (a quarter of the fp32 bytes: SmolLM2
  split at 8 holds 12 KB per position in fp32, 3 KB in int8);
* each GroupQueryAttention node gets ``k_scale`` / ``v_scale`` initializers ``[1, KVH, 1, D]``
  (``PER_CHANNEL``: one scale per head and channel, ``kv_cache_bit_width=8``). The op quantizes the step's
  new K/V rows into the shared buffer (``round(x / scale)``, saturated) and dequantizes the cache when it
  attends, so the buffer stays shared between past and present;
* the scales are calibrated once: ``max |K|`` (after rotary: what the cache holds) and ``max |V|`` per
  head and channel over a prefill of the calibration ids through the fp32 graph, times ``headroom``,
  divided by 127. A later value beyond that range saturates;
* the scales are also written into the model's metadata (``autoglm.kv_scales``: JSON ``{"k": [...],
  "v": [...]}`` per layer, ``[KVH][D]``) so the runtime can dequantize rows it hands to the activation
  cache and quantize rows it restores (``edge_client.front``), from the graph alone.

The plain traced graph has no such option (its cache is concatenated arrays).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edge_client.front import KV_SCALES_KEY

QMAX = 127
# 512 calibration tokens see up to ~1/1.6 of a channel's range on other text (SmolLM2); saturating those
# values costs more than the coarser grid
HEADROOM = 2.0
_K_SCALE_INPUT = 12  # GroupQueryAttention's k_scale / v_scale input slots


def kv_absmax(model: onnx.ModelProto, ids: np.ndarray, threads: int = 2) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer (max |K|, max |V|) [KVH, D] over a prefill of ``ids [T]`` from an empty cache."""
    import onnxruntime as ort

    from .smoothing import calibration_feeds

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    n = sum(1 for o in model.graph.output if o.name.startswith("present_key."))
    names = [f"present_{kv}.{i}" for i in range(n) for kv in ("key", "value")]
    outs = session.run(names, calibration_feeds(model, ids))  # each [1, KVH, T, D]
    return [(np.abs(outs[2 * i][0]).max(1), np.abs(outs[2 * i + 1][0]).max(1)) for i in range(n)]


def quantize_kv(model: onnx.ModelProto, ids: np.ndarray, threads: int = 2, headroom: float = HEADROOM) -> dict:
    """Make the fused graph's KV cache int8 (in place); returns the report. ``ids``: calibration tokens [T];
    ``headroom``: the int8 range covers ``headroom`` x the calibrated max |K| / |V| of each channel."""
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    if not gqa:
        raise ValueError("int8 KV cache: the graph has no GroupQueryAttention (only the fused graph has it)")
    if model.ByteSize() > (1 << 31) - (1 << 26):
        raise ValueError("int8 KV cache: graphs above 2 GB are not supported (calibration runs in memory)")
    absmax = kv_absmax(model, np.asarray(ids, np.int64).reshape(-1), threads)
    scales = {"k": [], "v": []}
    for node in gqa:
        layer = int(node.input[3].split(".")[-1])  # past_key.{i}
        k_max, v_max = absmax[layer]
        names = []
        for kind, amax in (("k", k_max), ("v", v_max)):
            s = (np.maximum(amax, 1e-6) * headroom / QMAX).astype(np.float32)  # [KVH, D]
            scales[kind].append(s.tolist())
            name = f"layers.{layer}.self_attn.{kind}_scale"
            model.graph.initializer.append(numpy_helper.from_array(s[None, :, None, :], name))  # [1, KVH, 1, D]
            names.append(name)
        inputs = list(node.input) + [""] * (_K_SCALE_INPUT - len(node.input))
        del node.input[:]
        node.input.extend(inputs[:_K_SCALE_INPUT] + names)
        node.attribute.extend([helper.make_attribute("kv_cache_bit_width", 8),
                               helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                               helper.make_attribute("v_quant_type", "PER_CHANNEL")])
    for vi in list(model.graph.input) + list(model.graph.output):
        if vi.name.startswith(("past_", "present_")):
            vi.type.tensor_type.elem_type = TensorProto.INT8
    meta = {p.key: p for p in model.metadata_props}
    entry = meta.get(KV_SCALES_KEY) or model.metadata_props.add()
    entry.key, entry.value = KV_SCALES_KEY, json.dumps(scales)
    return {"kv_cache": "int8 PER_CHANNEL", "kv_headroom": headroom, "kv_calibration_tokens": int(np.size(ids))}
