"""Block-Hadamard rotation of MatMul inputs (QuaRot-style, per activation block), folded into the weights.

MatMulNBits at accuracy level 4 quantizes each token's activations to int8 per block of ``block`` input
channels: one large channel sets the scale of its whole block and the other channels of that block lose
their precision. Rotating each block by an orthonormal Hadamard matrix ``Hb = hadamard(block) / sqrt(block)``
spreads such a channel over the whole block (the block's max shrinks towards its RMS), and the MatMul still
computes the same function because the inverse rotation is folded into the weight rows:

    y = x @ W = (x @ B) @ (B^T @ W),    B = blockdiag(Hb, ..., Hb)  [K, K]

``B^T @ W`` is exact in fp32; at run time ``x @ B`` is three cheap nodes (``Reshape [.., K/b, b]``,
``MatMul`` by the constant ``Hb`` ``[b, b]``, ``Reshape`` back): K x b multiply-adds per token, 1/N_out of
the MatMul's own. Quantizing ``B^T @ W`` to int8 afterwards is as accurate as quantizing ``W`` (the weights
stay smooth). Applied to the MatMuls chosen by module-path patterns (``layers.*.mlp.down_proj``), before
weight quantization.

References: Ashkboos et al., "QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs" (2024); Chee et al.,
"QuIP" (2023) for incoherence processing.
"""

from __future__ import annotations

import fnmatch

import numpy as np
import onnx
from onnx import helper, numpy_helper


def hadamard(n: int) -> np.ndarray:
    """Orthonormal Sylvester Hadamard matrix [n, n] (n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size {n}: must be a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def rotate_matmul_inputs(model: onnx.ModelProto, patterns: list[str] | tuple[str, ...], block: int = 32) -> list[str]:
    """Rotate the input of every constant-weight MatMul whose name matches ``patterns`` (in place).

    Node names are module paths in the fused graph (``partition_tools.graph_builder``). Returns the
    rotated nodes' names. The weight initializer must be read by that MatMul alone.
    """
    hb = hadamard(block)
    inits = {i.name: i for i in model.graph.initializer}
    readers: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    hname = f"rotation.hadamard{block}"
    model.graph.initializer.append(numpy_helper.from_array(hb, hname))
    done, new_nodes = [], []
    for node in model.graph.node:
        if not (node.op_type == "MatMul" and node.input[1] in inits
                and any(fnmatch.fnmatchcase(node.name, p) for p in patterns)):
            new_nodes.append(node)
            continue
        w = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)  # [K, N]
        k = w.shape[0]
        if k % block or readers[node.input[1]] != 1:
            raise ValueError(f"{node.name}: K = {k} not a multiple of {block}, or its weight is shared")
        rot_w = (hb.T @ w.reshape(k // block, block, -1)).reshape(k, -1)  # B^T W, block by block
        inits[node.input[1]].CopyFrom(numpy_helper.from_array(rot_w.astype(np.float32), node.input[1]))
        p = node.name
        shape_in = model.graph.initializer.add()
        shape_in.CopyFrom(numpy_helper.from_array(np.array([0, 0, k // block, block], np.int64), f"{p}.rot.blocks"))
        shape_out = model.graph.initializer.add()
        shape_out.CopyFrom(numpy_helper.from_array(np.array([0, 0, k], np.int64), f"{p}.rot.flat"))
        x = node.input[0]  # [1, S, K]
        new_nodes += [
            helper.make_node("Reshape", [x, f"{p}.rot.blocks"], [f"{p}.rot.in"], name=f"{p}.rot.reshape_in"),
            helper.make_node("MatMul", [f"{p}.rot.in", hname], [f"{p}.rot.mul"], name=f"{p}.rot.hadamard"),
            helper.make_node("Reshape", [f"{p}.rot.mul", f"{p}.rot.flat"], [f"{p}.rot.out"],
                             name=f"{p}.rot.reshape_out"),
        ]
        node.input[0] = f"{p}.rot.out"
        new_nodes.append(node)
        done.append(node.name)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return done
