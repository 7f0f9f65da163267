"""Weight-only quantization of the edge front graph (int8 / int4) with onnxruntime's MatMulNBits.

``quantize_front(src, dst, mode)`` rewrites every MatMul with a constant weight into a MatMulNBits node
(blockwise, symmetric), except the nodes listed as sensitive. Returns a report dict recorded in the manifest.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

QUANT_MODES = ("fp32", "int8", "int4")


def _matmul_weight_nodes(model: onnx.ModelProto) -> list[str]:
    inits = {i.name for i in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]


def quantize_front(src: Path, dst: Path, mode: str, block_size: int = 32, accuracy_level: int = 4,
                   exclude: list[str] | None = None) -> dict:
    if mode not in QUANT_MODES:
        raise ValueError(f"edge quantization {mode!r}: expected one of {', '.join(QUANT_MODES)}")
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(src))
    candidates = _matmul_weight_nodes(model)
    exclude = list(exclude or [])
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    q = MatMulNBitsQuantizer(model, bits=8 if mode == "int8" else 4, block_size=block_size, is_symmetric=True,
                             accuracy_level=accuracy_level, nodes_to_exclude=exclude)
    q.process()
    onnx.save(q.model.model, str(dst))
    return {"mode": mode, "method": "MatMulNBits", "block_size": block_size, "accuracy_level": accuracy_level,
            "quantized_matmuls": len(candidates) - len(exclude), "float_matmuls": exclude}


def recipe_for(adapter, split_layer: int) -> dict:
    """The per-model quantization recipe: block size, accuracy level, float-kept MatMuls."""
    return {"block_size": 32, "accuracy_level": 4}
