"""Weight-only quantization of the edge front graph (int8 / int4) with onnxruntime's block-quantized ops.

``quantize_front(src, dst, mode, **recipe)`` rewrites the fp32 graph written by ``partition_tools.export``:

* optionally first (``smooth_alpha``): SmoothQuant scales folded into the RMSNorm weights that feed
  q/k/v and the MLP input (``partition_tools.smoothing``; exact in fp32, calibrated on token ids);
* every MatMul with a constant weight becomes a ``MatMulNBits`` node (``block_size`` weights of one output
  column share an fp32 scale; symmetric unless ``symmetric=False``). Its ``accuracy_level`` picks the
  compute: 4 quantizes the activations to int8 per block of ``block_size`` input channels at run time and
  uses integer dot products (VNNI / ARM dotprod: the fast path), 1 dequantizes the weights and computes in
  fp32 (exact activations, but slower than a plain fp32 MatMul on x86). MatMuls whose module path matches
  a ``precise`` pattern get level 1; those matching ``keep_float`` stay fp32 ``MatMul``;
* ``float_outliers = k``: of the MatMuls matching ``outlier_patterns`` (down_proj), the k whose calibration
  inputs have the largest max / median channel ratio stay fp32 - the layers where the massive activations
  are written (SmolLM2: layers 2 and 1, ratios 139 and 31 against 7-18 elsewhere), whose int8 activation
  blocks lose the most (:func:`outlier_matmuls`);
* ``rotate``: module-path patterns of MatMuls whose input is rotated per activation block by a Hadamard
  matrix folded into the weights (``partition_tools.rotation``), after smoothing;
* ``gptq``: the 8-bit codes rounded by GPTQ on the calibration inputs (``partition_tools.gptq``) instead of to
  nearest;
* ``source_grid`` (``"offset"`` | ``"exact"``): a MatMul whose fp32 weight already sits on a 16-level blockwise
  grid (a Q4 GGUF checkpoint) keeps that grid in its codes instead of being rounded again
  (``partition_tools.source_grid``; ``"exact"`` adds the remaining per-block offsets in fp32 and is what
  4-bit codes need); weights off any grid are rounded as usual;
* ``outlier_channels = k`` (LLM.int8()-style static decomposition, after smoothing): in each quantized
  MatMul the k input channels with the largest calibration max |x| run in fp32 beside it and leave the int8
  MatMul's activation blocks (``partition_tools.outlier_channels``); ``outlier_channel_min_ratio`` limits it
  to MatMuls whose input's max / median channel ratio is at least that;
* with ``kv_cache="int8"`` (fused graph only) the KV cache is stored as int8 with calibrated per-channel
  scales (``partition_tools.kv_quant``);
* with ``embedding="int8"|"int4"`` the embedding table (the ``Gather`` that starts the graph, half of a
  small model's bytes) becomes a ``GatherBlockQuantized`` node: blocks of ``block_size`` channels of one
  token row share an fp32 scale, zero point 2^(bits-1) (symmetric);
* ``prefill="fp32"`` (precision by phase) also writes the prompt-phase graph beside ``dst``
  (``edge_client.front.prefill_graph_path``: ``front.onnx`` -> ``front_prefill.onnx``): the fp32 source
  graph as it is - no smoothing, fp32 MatMuls - except its embedding table, which gets the same
  quantization as the decode graph's. ``FrontRuntime`` runs the prompt through it and the decode steps
  through ``dst``, on one KV cache: the prompt's KV and boundary states are then the fp32 front's.

Nodes are addressed by the *module path* the torch exporter records on each node
(``pkg.torch.onnx.name_scopes``: ``layers.3.mlp.down_proj``, ``embed_tokens``), matched with fnmatch
patterns such as ``layers.*.mlp.down_proj``; graphs without that metadata fall back to the node name.

``recipe_for(adapter, split_layer, mode, tokenizer)`` is the default recipe per mode (docs/quality.md,
"Edge quantization", has every variant measured behind it). The returned report dict is stored in the
manifest's ``quant_report``.

References: MatMulNBits / GatherBlockQuantized (onnxruntime contrib ops); SmoothQuant (Xiao et al., 2023);
"Massive Activations in Large Language Models" (Sun et al., 2024) and LLM.int8() (Dettmers et al., 2022)
for why per-block activation scales matter on real weights.
"""

from __future__ import annotations

import ast
import fnmatch
import logging
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from shared.manifest import EDGE_QUANTS

from .gptq import DAMP, gptq_round, write_codes

QUANT_MODES = EDGE_QUANTS  # what a manifest's edge_quant may say
EDGE_QUANT_CHOICES = ("auto", *QUANT_MODES)  # auto: resolve_edge_quant picks int4 or int8 by the source
EMBEDDING_MODES = ("fp32", "int8", "int4")
PREFILL_MODES = ("fp32",)  # the prompt-phase graph's weights (precision by phase); None: no such graph
KV_MODES = ("fp32", "int8")  # int8: the fused graph's GroupQueryAttention cache (partition_tools.kv_quant)
ACCURACY_LEVELS = (1, 2, 3, 4)  # MatMulNBits: 1 fp32, 2 fp16, 3 bf16, 4 int8 activation compute
SOURCE_GRID_BLOCK = 32  # GGUF's Q4_0 / Q4_1 / Q8_0 block: the rows sharing one scale (and minimum)
CALIBRATION_TOKENS = 512  # smoothing statistics: enough to see every outlier channel, < 1 s to collect


class QuantizationError(ValueError):
    """The graph cannot be quantized as asked; the message says why in one line."""


def module_path(node: onnx.NodeProto) -> str:
    """The torch module a node came from (``layers.0.mlp.down_proj``), or its node name when unrecorded."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(prop.value)  # "['', 'layers.0', ..., 'layers.0.mlp.down_proj', 'linear_6']"
            except (ValueError, SyntaxError):
                break
            if isinstance(scopes, list) and len(scopes) >= 2 and scopes[-2]:
                return str(scopes[-2])
    return node.name


def weight_matmuls(model: onnx.ModelProto) -> dict[str, str]:
    """node name -> module path of every MatMul whose weight (input 1) is an initializer."""
    inits = {i.name for i in model.graph.initializer}
    return {n.name: module_path(n) for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits}


def embedding_gathers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Gather nodes reading a 2-D float initializer table (the token embedding)."""
    inits = {i.name: i for i in model.graph.initializer}
    return [n for n in model.graph.node if n.op_type == "Gather" and n.input[0] in inits
            and len(inits[n.input[0]].dims) == 2 and inits[n.input[0]].data_type == TensorProto.FLOAT]


def _matching(paths: dict[str, str], patterns: tuple[str, ...] | list[str]) -> list[str]:
    return [name for name, path in paths.items() if any(fnmatch.fnmatchcase(path, p) for p in patterns)]


def outlier_matmuls(model: onnx.ModelProto, ids: np.ndarray, patterns: tuple[str, ...] | list[str],
                    k: int) -> dict[str, float]:
    """The ``k`` constant-weight MatMuls matching ``patterns`` whose inputs, over a prefill of the calibration
    ids ``[T]``, have the largest ratio of the largest to the median per-channel max |x|: node name -> ratio."""
    from .smoothing import matmul_input_absmax

    nodes = {n.name: n for n in model.graph.node}
    chosen = _matching(weight_matmuls(model), patterns)
    absmax = matmul_input_absmax(model, ids, sorted({nodes[n].input[0] for n in chosen}))  # tensor -> [K]
    ratio = {n: float(absmax[nodes[n].input[0]].max() / max(np.median(absmax[nodes[n].input[0]]), 1e-12))
             for n in chosen}
    return dict(sorted(ratio.items(), key=lambda kv: -kv[1])[:k])


# ------------------------------------------------------------------------------------------------
# embedding table -> GatherBlockQuantized


def quantize_table(table: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric blockwise quantization of a [V, H] table along H -> (codes uint8 [V, H], scales [V, ceil(H/bs)]).

    Codes are offset by the zero point 2^(bits-1); a last partial block is allowed (GatherBlockQuantized too).
    """
    V, H = table.shape
    nb = -(-H // block_size)
    qmax = (1 << (bits - 1)) - 1  # 127 | 7
    blocks = np.pad(table, ((0, 0), (0, nb * block_size - H))).reshape(V, nb, block_size)  # [V, nb, bs]
    scales = np.abs(blocks).max(-1) / qmax  # [V, nb]
    scales = np.where(scales > 0, scales, 1.0).astype(np.float32)
    codes = np.clip(np.rint(blocks / scales[..., None]), -qmax, qmax).astype(np.int16) + (1 << (bits - 1))
    return codes.reshape(V, nb * block_size)[:, :H].astype(np.uint8), scales


def _pack_uint4(codes: np.ndarray) -> bytes:
    flat = codes.reshape(-1)
    if flat.size % 2:
        flat = np.append(flat, 0)
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8).tobytes()  # low nibble first


def _quantize_embedding(model: onnx.ModelProto, node: onnx.NodeProto, bits: int, block_size: int) -> int:
    """Replace ``node`` (Gather on a float table) by GatherBlockQuantized; returns the table's new byte size."""
    graph = model.graph
    init = next(i for i in graph.initializer if i.name == node.input[0])
    table = numpy_helper.to_array(init).astype(np.float32)  # [V, H]
    codes, scales = quantize_table(table, bits, block_size)
    zp = np.full(scales.shape, 1 << (bits - 1), np.uint8)
    if bits == 8:
        data = numpy_helper.from_array(codes, init.name + "_q8")
        zero = numpy_helper.from_array(zp, init.name + "_zp")
    else:
        data = helper.make_tensor(init.name + "_q4", TensorProto.UINT4, codes.shape, _pack_uint4(codes), raw=True)
        zero = helper.make_tensor(init.name + "_zp", TensorProto.UINT4, zp.shape, _pack_uint4(zp), raw=True)
    scale = numpy_helper.from_array(scales, init.name + "_scales")
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    new = helper.make_node("GatherBlockQuantized", [data.name, node.input[1], scale.name, zero.name],
                           list(node.output), name=node.name + f"_Q{bits}", domain="com.microsoft",
                           gather_axis=axis, quantize_axis=1, block_size=block_size, bits=bits)
    new.metadata_props.extend(node.metadata_props)
    idx = list(graph.node).index(node)
    graph.node.remove(node)
    graph.node.insert(idx, new)
    if not any(init.name in n.input for n in graph.node):
        graph.initializer.remove(init)
    graph.initializer.extend([data, scale, zero])
    return len(data.raw_data) + len(scale.raw_data) + len(zero.raw_data)


# ------------------------------------------------------------------------------------------------


def quantize_front(src: Path, dst: Path, mode: str, block_size: int = 32, accuracy_level: int = 4,
                   precise: tuple[str, ...] | list[str] = (), keep_float: tuple[str, ...] | list[str] = (),
                   embedding: str = "fp32", embedding_block_size: int | None = None, symmetric: bool = True,
                   smooth_alpha: float | None = None, calibration_ids: np.ndarray | None = None,
                   kv_cache: str = "fp32", kv_calibration_ids: np.ndarray | None = None,
                   rotate: tuple[str, ...] | list[str] = (), float_outliers: int = 0,
                   outlier_patterns: tuple[str, ...] | list[str] = ("*.mlp.down_proj",),
                   prefill: str | None = None, gptq: bool = False, source_grid: str | None = None,
                   outlier_channels: int = 0, outlier_channel_patterns: tuple[str, ...] | list[str] = ("*",),
                   outlier_channel_min_ratio: float = 0.0, outlier_channel_fold: bool = True) -> dict:
    """Quantize the fp32 edge graph ``src`` into ``dst``; returns the report recorded in the manifest.

    mode: int8 | int4 (fp32 is a plain copy). ``precise`` / ``keep_float``: module-path patterns run at
    accuracy level 1 / left in fp32. ``embedding``: fp32 | int8 | int4 table (block ``embedding_block_size``,
    default ``block_size``). ``symmetric=False``: MatMul weights get zero points (asymmetric).
    ``smooth_alpha``: fold SmoothQuant scales into the RMSNorm weights first (``partition_tools.smoothing``),
    calibrated on ``calibration_ids [T]``. ``float_outliers``: that many of the ``outlier_patterns`` MatMuls,
    those with the most extreme calibration inputs, stay fp32 (:func:`outlier_matmuls`). ``prefill``: None,
    or ``"fp32"`` to write the prompt-phase graph beside ``dst`` (module docstring; report key ``prefill``).
    ``gptq``: round the 8-bit weights with GPTQ on the calibration inputs (``partition_tools.gptq``) instead of
    to nearest. ``source_grid``: None, ``"offset"`` or ``"exact"``: the 8-bit weights of every MatMul whose
    fp32 weight already sits on a 16-level blockwise grid (a Q4 checkpoint) keep that grid
    (``partition_tools.source_grid``; ``"exact"`` also adds the remaining per-block offset in fp32).
    """
    if prefill is not None and prefill not in PREFILL_MODES:
        raise QuantizationError(f"prefill graph {prefill!r}: expected None or one of {', '.join(PREFILL_MODES)}")
    if prefill is not None and (mode == "fp32" or kv_cache != "fp32"):
        raise QuantizationError("a separate fp32 prefill graph is for a quantized front with the fp32 KV cache "
                                f"(got {mode} weights, {kv_cache} KV)")
    if mode not in QUANT_MODES:
        raise QuantizationError(f"edge quantization {mode!r}: expected one of {', '.join(QUANT_MODES)}")
    if embedding not in EMBEDDING_MODES:
        raise QuantizationError(f"embedding quantization {embedding!r}: expected one of {', '.join(EMBEDDING_MODES)}")
    if accuracy_level not in ACCURACY_LEVELS:
        raise QuantizationError(f"accuracy level {accuracy_level}: expected one of {ACCURACY_LEVELS}")
    if block_size < 16 or block_size & (block_size - 1):
        raise QuantizationError(f"block size {block_size}: must be a power of two >= 16")
    emb_block = embedding_block_size or block_size
    if emb_block < 16 or emb_block & (emb_block - 1):
        raise QuantizationError(f"embedding block size {emb_block}: must be a power of two >= 16")
    if (smooth_alpha is not None or float_outliers or gptq or outlier_channels) and calibration_ids is None:
        raise QuantizationError("smoothing, float_outliers, outlier_channels and gptq need calibration_ids (token "
                                "ids of calibration text)")
    if outlier_channels < 0:
        raise QuantizationError(f"outlier_channels {outlier_channels}: must be >= 0")
    if outlier_channels and rotate:
        raise QuantizationError("outlier_channels and rotate: pick one (the rotation would mix the split channels)")
    if source_grid not in (None, "offset", "exact"):
        raise QuantizationError(f"source grid {source_grid!r}: expected None, 'offset' or 'exact'")
    if source_grid and (mode not in ("int8", "int4") or gptq):
        raise QuantizationError(f"source grid: int8 / int4 weights rounded to nearest only (got {mode}, gptq={gptq})")
    if source_grid == "offset" and mode == "int4":
        raise QuantizationError("source grid 'offset' with int4 weights: the 4-bit zero points leave up to half a "
                                "step of offset, use 'exact'")
    if gptq and (mode != "int8" or not symmetric):
        raise QuantizationError(f"gptq: symmetric int8 weights only (got {mode}, symmetric={symmetric})")
    if float_outliers < 0:
        raise QuantizationError(f"float_outliers {float_outliers}: must be >= 0")
    if kv_cache not in KV_MODES:
        raise QuantizationError(f"KV cache {kv_cache!r}: expected one of {', '.join(KV_MODES)}")
    kv_ids = kv_calibration_ids if kv_calibration_ids is not None else calibration_ids
    if kv_cache != "fp32" and kv_ids is None:
        raise QuantizationError("an int8 KV cache needs calibration ids (kv_calibration_ids or calibration_ids)")
    model = onnx.load(str(src))
    calibration_ids, kv_ids = (_fitting(model, ids) for ids in (calibration_ids, kv_ids))
    kv_report = {}
    if kv_cache == "int8":
        from .kv_quant import quantize_kv

        try:
            kv_report = quantize_kv(model, np.asarray(kv_ids, dtype=np.int64).reshape(-1))
        except ValueError as e:
            raise QuantizationError(str(e)) from None
    if mode == "fp32":
        _save(model, Path(dst))
        return {"mode": "fp32", **kv_report}
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    outliers = {} if not float_outliers else outlier_matmuls(
        model, np.asarray(calibration_ids, dtype=np.int64).reshape(-1), outlier_patterns, float_outliers)
    smoothed: list[int] = []
    if smooth_alpha is not None:
        from .smoothing import smooth_norm_inputs

        smoothed = smooth_norm_inputs(model, np.asarray(calibration_ids, dtype=np.int64).reshape(-1), smooth_alpha)

    split: dict[str, dict] = {}
    if outlier_channels:
        from .outlier_channels import split_outlier_channels

        keep = set(_matching(weight_matmuls(model), keep_float)) | set(outliers)
        targets = [n for n in _matching(weight_matmuls(model), outlier_channel_patterns) if n not in keep]
        split = split_outlier_channels(model, np.asarray(calibration_ids, dtype=np.int64).reshape(-1), targets,
                                       outlier_channels, outlier_channel_min_ratio, outlier_channel_fold,
                                       zero_rows=not source_grid)
    sides = [v["side"] for v in split.values()]  # the fp32 side MatMuls: not quantized, not "float" MatMuls
    rotated: list[str] = []
    if rotate:
        from .rotation import rotate_matmul_inputs

        rotated = rotate_matmul_inputs(model, rotate, block_size)
    paths = {n: p for n, p in weight_matmuls(model).items() if n not in sides}  # node name -> module path
    floats = _matching(paths, list(keep_float) + (["*.rot.hadamard"] if rotated else []))
    floats += [n for n in outliers if n not in floats]
    precise_nodes = [n for n in _matching(paths, precise) if n not in floats]
    bits = 8 if mode == "int8" else 4
    codes = {} if not gptq else _gptq_codes(model, [n for n in paths if n not in floats],
                                            np.asarray(calibration_ids, dtype=np.int64).reshape(-1), block_size)
    grids = {} if not source_grid else _source_grids(model, [n for n in paths if n not in floats], block_size, bits)
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=symmetric,
                             accuracy_level=accuracy_level, nodes_to_exclude=floats + sides)
    q.process()
    model = q.model.model
    # per-node compute precision: the quantizer names each MatMulNBits "<matmul name>_Q<bits>"
    wanted = {f"{n}_Q{bits}" for n in precise_nodes}
    nbits = {n.name: n for n in model.graph.node if n.op_type == "MatMulNBits"}
    if len(nbits) != len(paths) - len(floats) or not wanted <= set(nbits):
        raise QuantizationError(f"{src}: quantizer produced {len(nbits)} MatMulNBits for "
                                f"{len(paths) - len(floats)} MatMuls; cannot apply per-node settings")
    for name, (qc, sc) in codes.items():
        write_codes(model, nbits[f"{name}_Q{bits}"], qc, sc, bits)
    for name, grid in grids.items():
        from .source_grid import add_offset_correction, write_codes as write_grid_codes

        write_grid_codes(model, nbits[f"{name}_Q{bits}"], *grid[:3])
        if source_grid == "exact":
            add_offset_correction(model, nbits[f"{name}_Q{bits}"], grid[3], block_size, split.get(name))
    for name in wanted:
        for attr in nbits[name].attribute:
            if attr.name == "accuracy_level":
                attr.i = 1
                break
        else:
            nbits[name].attribute.append(helper.make_attribute("accuracy_level", 1))
    report = {
        "mode": mode, "method": "MatMulNBits", "bits": bits, "block_size": block_size, "symmetric": symmetric,
        "accuracy_level": accuracy_level, "quantized_matmuls": len(nbits),
        "smoothing": None if smooth_alpha is None else {
            "alpha": smooth_alpha, "groups": len(smoothed), "calibration_tokens": int(np.size(calibration_ids))},
        "precise_matmuls": sorted(paths[n] for n in precise_nodes),
        "float_matmuls": sorted(paths[n] for n in floats if not n.endswith(".rot.hadamard")),
        "rotated_matmuls": sorted(rotated), "embedding": "fp32",
        "float_outliers": {paths[n]: round(r, 1) for n, r in outliers.items()},
        "outlier_channels": None if not outlier_channels else {
            "k": outlier_channels, "min_ratio": outlier_channel_min_ratio, "fold": outlier_channel_fold,
            "matmuls": {paths[n]: {"ratio": v["ratio"], "masked_by": v["masked_by"]} for n, v in split.items()}},
        "source_grid": None if not source_grid else {"mode": source_grid, "matmuls": sorted(paths[n] for n in grids)},
        "rounding": "nearest" if not gptq else {
            "method": "GPTQ", "damp": DAMP, "matmuls": len(codes), "calibration_tokens": int(np.size(calibration_ids))},
    }
    if embedding != "fp32":
        gathers = embedding_gathers(model)
        if len(gathers) != 1:
            raise QuantizationError(f"{src}: expected one embedding Gather on a float table, found {len(gathers)}")
        nbytes = _quantize_embedding(model, gathers[0], 8 if embedding == "int8" else 4, emb_block)
        report["embedding"] = f"{embedding} GatherBlockQuantized block {emb_block}"
        report["embedding_bytes"] = nbytes
    report.update(kv_report)
    _save(model, Path(dst))
    report["bytes"] = _graph_bytes(Path(dst))
    if prefill is not None:
        report["prefill"] = write_prefill_graph(Path(src), Path(dst), embedding, emb_block)
    return report


def _gptq_codes(model: onnx.ModelProto, names: list[str], ids: np.ndarray,
                block: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """GPTQ codes (``partition_tools.gptq``) of the named constant-weight MatMuls of ``model`` from one prefill
    of the calibration ``ids [T]``: name -> (q [K, N], scales [K / block, N])."""
    from .smoothing import probe_tensors

    nodes = {n.name: n for n in model.graph.node}
    inits = {i.name: i for i in model.graph.initializer}
    xs = probe_tensors(model, ids, sorted({nodes[n].input[0] for n in names}))  # tensor -> [T, K]
    out = {}
    for name in names:
        x = xs[nodes[name].input[0]].astype(np.float64)  # [T, K]
        w = numpy_helper.to_array(inits[nodes[name].input[1]]).astype(np.float32)  # [K, N]
        out[name] = gptq_round(w, x.T @ x, 8, block)
    return out


def _source_grids(model: onnx.ModelProto, names: list[str], block: int, bits: int) -> dict[str, tuple]:
    """name -> ``source_grid.grid_codes`` of each named MatMul whose weight is on a 16-level blockwise grid."""
    from .source_grid import fit_grid, grid_codes

    nodes = {n.name: n for n in model.graph.node}
    inits = {i.name: i for i in model.graph.initializer}
    out = {}
    for name in names:
        fit = fit_grid(numpy_helper.to_array(inits[nodes[name].input[1]]), max(block, SOURCE_GRID_BLOCK))
        if fit is not None:
            lo, d, q = fit
            rep = max(1, SOURCE_GRID_BLOCK // block)  # smaller blocks: each a part of one source block
            out[name] = grid_codes(np.repeat(lo, rep, axis=0), np.repeat(d, rep, axis=0), q, block, bits)
    return out


def _graph_bytes(path: Path) -> int:
    """A graph's bytes on disk (with its external-data file, if any)."""
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def write_prefill_graph(src: Path, dst: Path, embedding: str, block_size: int) -> dict:
    """The prompt-phase graph of the decode graph ``dst``: the fp32 graph ``src`` with its embedding table
    quantized as ``dst``'s (``embedding`` int8 | int4 | fp32, blocks of ``block_size``), written to
    ``edge_client.front.prefill_graph_path(dst)``; returns its report entry."""
    from edge_client.front import prefill_graph_path

    model = onnx.load(str(src))
    if embedding != "fp32":
        gathers = embedding_gathers(model)
        if len(gathers) != 1:
            raise QuantizationError(f"{src}: expected one embedding Gather on a float table, found {len(gathers)}")
        _quantize_embedding(model, gathers[0], 8 if embedding == "int8" else 4, block_size)
    path = prefill_graph_path(dst)
    _save(model, path)
    return {"mode": "fp32", "graph": path.name, "embedding": embedding, "bytes": _graph_bytes(path),
            "runs": "prompt chunks (decode steps and speculative steps run the quantized graph)"}


def _save(model: onnx.ModelProto, dst: Path) -> None:
    """Weights inline below protobuf's 2 GB ceiling, else in ``<dst>.data`` beside the graph."""
    weight_bytes = sum(len(i.raw_data) for i in model.graph.initializer)
    if weight_bytes > (1 << 31) - (1 << 26):
        onnx.save(model, str(dst), save_as_external_data=True, location=dst.name + ".data")
    else:
        onnx.save(model, str(dst))


def calibration_tokens(tokenizer, vocab_size: int, n: int = CALIBRATION_TOKENS) -> np.ndarray:
    """Smoothing calibration ids [n]: the *last* n tokens of the built-in text (the quality evaluation reads
    its first tokens, so the two do not overlap), or seeded random ids for a model without a tokenizer."""
    if tokenizer is None:
        return np.random.default_rng(0).integers(4, vocab_size, n).astype(np.int64)
    from .split import sample_text

    ids = np.asarray(tokenizer(sample_text()).input_ids, dtype=np.int64)
    return ids[-n:]


def kv_calibration_tokens(tokenizer, vocab_size: int, n: int = CALIBRATION_TOKENS) -> np.ndarray:
    """int8-KV calibration ids: the smoothing text split into two chat turns (``calibration_tokens``'s
    text, disjoint from every evaluation) so the chat template's special tokens - whose keys and values
    are the cache's largest - are in the calibration; random ids for a model without a tokenizer."""
    text_ids = calibration_tokens(tokenizer, vocab_size, n)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return text_ids
    half = tokenizer.decode(text_ids[: n // 2]), tokenizer.decode(text_ids[n // 2:])
    chat = [{"role": "user", "content": half[0]}, {"role": "assistant", "content": half[1]}]
    return np.asarray(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False), np.int64).reshape(-1)


def on_source_grid(adapter, split_layer: int, block: int = SOURCE_GRID_BLOCK) -> bool:
    """Whether every linear weight of the edge layers [0, split_layer) already sits on a 16-level blockwise
    grid along its input dimension (a Q4_0 / Q4_1 / Q4_K checkpoint): ``partition_tools.source_grid``."""
    from .source_grid import fit_grid

    linears = [m for layer in list(adapter.layers)[:split_layer] for m in layer.modules()
               if isinstance(m, torch.nn.Linear)]
    return bool(linears) and all(fit_grid(m.weight.detach().float().numpy().T, block) is not None for m in linears)


def _fitting(model: onnx.ModelProto, ids) -> np.ndarray | None:
    """Calibration ``ids`` [T] as one prefill of ``model`` takes them: the first of them that fit the positions its
    rotary caches hold (the fused graph's ``MAX_POSITIONS_KEY``; the plain graph names none, all fit). A checkpoint
    of a 256-token context was calibrated on 512: an onnxruntime InvalidArgument traceback ('cos_cache dimension
    0 shall not be less than total_sequence_length') out of split."""
    from edge_client.front import MAX_POSITIONS_KEY

    if ids is None:
        return None
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)  # [T]
    held = {p.key: p.value for p in model.metadata_props}.get(MAX_POSITIONS_KEY)
    return ids[: int(held)] if held is not None else ids


def recipe_for(adapter, split_layer: int, mode: str = "int8", tokenizer=None) -> dict:
    """The default recipe for ``mode`` (kwargs of :func:`quantize_front`); docs/quality.md has the numbers.

    int8: every MatMul as MatMulNBits 8-bit, block 32, accuracy level 4 (int8 activations: the fast path),
    except the two down_proj with the most extreme inputs (``float_outliers=2``: the massive-activation
    layers, SmolLM2's 1 and 2), which stay fp32; embedding table int8 block 32 (3/4 of its bytes saved, no
    measurable loss). Then, by the source:

    * a checkpoint already on a 4-bit grid (:func:`on_source_grid`, SmolLM2's Q4_1 GGUF): the 8-bit codes keep
      that grid (``source_grid="offset"``: the weights are the source's, to ~1/140 of a 4-bit step), no
      smoothing (it would move the weights off their grid), and the 16 largest calibration input channels of
      every MatMul in fp32 beside it (``outlier_channels=16``): with exact weights the int8 *activations*
      are what flips answers. Held-out, served, default policy: 46/60 answers identical to the unsplit model
      vs 40/60 for the rounded recipe (fp16 wire: 51 vs 42), for 7-24 % more step time (its ~100 side kernels);
    * otherwise (bf16 / fp32 checkpoints): round to nearest, SmoothQuant alpha 0.5 folded into the RMSNorm
      weights (free at run time; cuts the error of the norm-fed q/k/v and gate/up MatMuls by about a third).

    int4: 4-bit MatMul weights, no fp32 down_proj; the table stays int8 (a 4-bit table alone costs more KL than
    all 8-bit MatMuls together). A grid source keeps its own 4-bit codes (scale ``d``, a 4-bit zero point) with
    the offsets the zero point misses added back exactly in fp32 (``source_grid="exact"``), and runs them with
    fp32 activations (``accuracy_level=1``: MLAS's fp32-compute 4-bit kernel, about as fast as the 8-bit
    int8-activation one on session 4's dev box, but ~2x slower - the fp32 front's speed - on an AVX2 box without
    VNNI, docs/performance.md session 16; 8-bit weights at level 1 dequantize per call): the weights are the source's and
    the activations are not rounded, so the front computes the fp32 front's function (tuning, teacher-forced,
    fp16 wire: 79/80 answers identical, the int8 recipe 67/80). This is what ``auto`` picks for a grid source.
    Off a grid: smoothing and rounding at int8 activations (a small, fast variant that keeps few answers).
    """
    if mode not in ("int8", "int4"):
        raise QuantizationError(f"no quantization recipe for {mode!r}")
    recipe = {
        "block_size": 32,
        "accuracy_level": 4,
        "embedding": "int8",
        "smooth_alpha": 0.5,
        "float_outliers": 2 if mode == "int8" else 0,
        "calibration_ids": calibration_tokens(tokenizer, adapter.vocab_size),
    }
    if on_source_grid(adapter, split_layer):
        if mode == "int8":
            recipe.update(smooth_alpha=None, source_grid="offset", outlier_channels=16)
        else:
            recipe.update(smooth_alpha=None, source_grid="exact", accuracy_level=1)
    return recipe


def resolve_edge_quant(mode: str, adapter, split_layer: int) -> str:
    """``auto`` -> ``int4`` for a source whose edge layers sit on a 4-bit grid (a Q4 GGUF: its own codes run
    exactly, :func:`recipe_for`), else ``int8`` (bf16 / fp32 checkpoints); any other mode as given."""
    if mode not in EDGE_QUANT_CHOICES:
        raise QuantizationError(f"edge quantization {mode!r}: expected one of {', '.join(EDGE_QUANT_CHOICES)}")
    if mode != "auto":
        return mode
    return "int4" if on_source_grid(adapter, split_layer) else "int8"
