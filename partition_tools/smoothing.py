"""SmoothQuant-style smoothing of the edge graph, folded into the RMSNorm weights (exact in fp32).

MatMulNBits at accuracy level 4 quantizes each token's activations to int8 in blocks of ``block_size``
input channels. Real LLMs have a few channels with outsized magnitude in the RMSNorm outputs that feed
q/k/v and gate/up (SmolLM2: channels 260, 308, 507 reach ~5 while the median channel is ~0.4): the block
holding such a channel gets a coarse scale and its other channels lose precision. SmoothQuant moves part
of that range into the weights, where it is harmless:

    y = (x / s) @ (diag(s) W),     s_j = max|x_j|^alpha / max_n |W_jn|^(1 - alpha)

and ``x / s`` is free when ``x = norm_weight * rms_normalize(h)``: divide the norm weight by ``s`` and
multiply row j of every MatMul reading that norm's output by ``s_j``. The graph computes the same function;
only the rounding of the quantized ops changes. The per-channel ``max|x_j|`` comes from running the fp32
graph over calibration tokens (:func:`matmul_input_absmax`).

A group is smoothed only when the pattern is unambiguous: the MatMuls' shared input is produced by a
``Mul`` (traced graph) or a ``(Skip)SimplifiedLayerNormalization`` (fused graph) with one 1-D ``[K]``
initializer (the norm weight), and every consumer of that input is a MatMul with
a constant weight read by nothing else. Anything else (other readers of the norm output, shared or fused
weights) is left untouched, so the pass is safe on any exported decoder family. A norm weight that the
exporter deduplicated across layers (identical values, e.g. all-ones in random-weight models) gets a
private copy before it is rescaled.

References: Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large Language
Models" (ICML 2023); Sun et al., "Massive Activations in Large Language Models" (2024).
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

_PROTO_LIMIT = (1 << 31) - (1 << 26)  # protobuf's 2 GB ceiling, with headroom
# nodes whose output 0 is "normalized x times a [K] weight": the traced graph's Mul, the fused graph's norms
_NORM_OPS = ("Mul", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


def calibration_feeds(model: onnx.ModelProto, ids: np.ndarray) -> dict[str, np.ndarray]:
    """A prefill of ``ids [T]`` from an empty cache (P = 0) for either edge graph (``edge_client.front``)."""
    from edge_client.front import MROPE_KEY
    from edge_client.rope import rope_feeds

    t = ids.size
    feeds = {"input_ids": ids[None].astype(np.int64)}
    names = {i.name for i in model.graph.input}
    if "position_ids" in names:  # plain graph
        feeds["position_ids"] = np.arange(t, dtype=np.int64)[None]
    if "seqlens_k" in names:  # fused graph
        feeds["seqlens_k"] = np.array([t - 1], np.int32)
        feeds["total_sequence_length"] = np.array(t, np.int32)
    if "rope_cos" in names:
        meta = {p.key: p.value for p in model.metadata_props}
        feeds.update(rope_feeds(np.arange(t), json.loads(meta[MROPE_KEY])))
    for inp in model.graph.input:
        if inp.name in feeds:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in inp.type.tensor_type.shape.dim]
        dims[0] = 1  # batch
        dtype = onnx.helper.tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type)  # float32, or int8 KV
        feeds[inp.name] = np.zeros(dims, dtype)  # [1, KVH, 0, D]
    return feeds


def probe_tensors(model: onnx.ModelProto, ids: np.ndarray, tensors: list[str],
                  threads: int = 2) -> dict[str, np.ndarray]:
    """The values of the named graph tensors over a prefill of ``ids [T]``: name -> [T, K] (rows: tokens)."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {o.name for o in probe.graph.output}
    for name in tensors:
        if name not in present:
            probe.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.onnx"
        onnx.save(probe, str(path), save_as_external_data=probe.ByteSize() > _PROTO_LIMIT)
        session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        outs = session.run(tensors, calibration_feeds(model, ids))
    return {name: o.reshape(-1, o.shape[-1]) for name, o in zip(tensors, outs)}  # [T, K]


def matmul_input_absmax(model: onnx.ModelProto, ids: np.ndarray, tensors: list[str],
                        threads: int = 2) -> dict[str, np.ndarray]:
    """Per-channel max |x| of each named graph tensor over a prefill of ``ids [T]``: name -> [K]."""
    return {name: np.abs(x).max(0) for name, x in probe_tensors(model, ids, tensors, threads).items()}  # [K]


def norm_fed_groups(model: onnx.ModelProto) -> list[tuple[str, onnx.NodeProto, str, list[onnx.NodeProto]]]:
    """(matmul input, norm Mul node, norm-weight initializer, [MatMul nodes]) for every smoothable group."""
    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto | None]] = defaultdict(list)
    for n in model.graph.node:
        for i in n.input:
            readers[i].append(n)
    for o in model.graph.output:
        readers[o.name].append(None)  # a graph output must keep its value
    groups, seen = [], set()
    for n in model.graph.node:
        if n.op_type != "MatMul" or n.input[1] not in inits or n.input[0] in seen:
            continue
        x = n.input[0]
        seen.add(x)
        users = readers[x]
        if any(u is None or u.op_type != "MatMul" or u.input[0] != x or u.input[1] not in inits
               or len(readers[u.input[1]]) != 1 for u in users):
            continue
        mul = producer.get(x)
        if mul is None or mul.op_type not in _NORM_OPS or mul.output[0] != x:
            continue
        k = inits[n.input[1]].dims[0]
        weights = [i for i in mul.input if i in inits and list(inits[i].dims) == [k]]
        if len(weights) == 1:
            groups.append((x, mul, weights[0], users))
    return groups


def smooth_norm_inputs(model: onnx.ModelProto, ids: np.ndarray, alpha: float = 0.5,
                       threads: int = 2) -> list[int]:
    """Fold SmoothQuant scales into every norm -> MatMul group of ``model`` (in place).

    Returns the K of each smoothed group (for the report). ``ids``: calibration tokens [T].
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"smoothing alpha {alpha}: must be in (0, 1)")
    if ids.ndim != 1 or ids.size < 1:
        raise ValueError(f"calibration ids: expected a non-empty 1-D array, got shape {ids.shape}")
    groups = norm_fed_groups(model)
    if not groups:
        return []
    inits = {i.name: i for i in model.graph.initializer}
    uses: dict[str, int] = defaultdict(int)
    for n in model.graph.node:
        for i in n.input:
            uses[i] += 1
    absmax = matmul_input_absmax(model, ids, [x for x, _, _, _ in groups], threads)
    done = []
    for x, mul, norm_name, users in groups:
        if uses[norm_name] > 1:  # deduplicated by the exporter: give this norm its own weight
            private = f"{norm_name}.smooth.{mul.name or len(done)}"
            model.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(inits[norm_name]), private))
            inits[private] = model.graph.initializer[-1]
            uses[norm_name] -= 1
            uses[private] = 1
            mul.input[list(mul.input).index(norm_name)] = private
            norm_name = private
        ws = [numpy_helper.to_array(inits[u.input[1]]) for u in users]  # each [K, N_u]
        w_absmax = np.max([np.abs(w).max(1) for w in ws], axis=0)  # [K]
        s = absmax[x] ** alpha / np.maximum(w_absmax, 1e-8) ** (1.0 - alpha)
        s = np.where(np.isfinite(s) & (s > 0), s, 1.0)
        s = np.clip(s, 1e-4, 1e4).astype(np.float32)  # [K]; dead channels keep their scale
        norm = numpy_helper.to_array(inits[norm_name]).astype(np.float32)
        inits[norm_name].CopyFrom(numpy_helper.from_array(norm / s, norm_name))
        for u, w in zip(users, ws):
            inits[u.input[1]].CopyFrom(numpy_helper.from_array((w * s[:, None]).astype(np.float32), u.input[1]))
        done.append(int(s.size))
    return done
