"""LLM.int8()-style static outlier decomposition of the front's MatMuls (Dettmers et al., 2022).

Per MatMul ``y = x @ W``: the ``k`` input channels with the largest calibration max |x| run in fp32 on a side
path (``Gather`` + a k-row fp32 ``MatMul`` + ``Add``) and leave the int8 MatMul's activation blocks, whose
int8 scales no longer see them; with ``zero_rows`` their main weight rows are zeroed too (else - the source
grid, ``partition_tools.source_grid`` - they stay, and the side path carries the rest). Where free, the
channels are masked by scaling them by 2^-16 at the weights that produce them (``_fold_site``: a norm weight,
up_proj columns); elsewhere by a 0/1 ``Mul``. The graph computes the same function in fp32.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .smoothing import _NORM_OPS, matmul_input_absmax

OUTLIER_FOLD = 2.0 ** -16  # the folded channels' scale on the int8 path: exact in fp32 (a power of two)


def _fold_site(model: onnx.ModelProto, node: onnx.NodeProto, producer: dict, readers: dict,
               inits: dict) -> tuple[str, str, int] | None:
    """Where ``node``'s input channels can be scaled for free: ("norm", weight initializer, 0) for a norm
    output read by this MatMul alone, ("cols", producing MatMul's weight, column offset) for an MLP product
    ``Mul(silu, up)`` whose linear factor ``up`` is ``x @ W_up`` (traced graph) or ``Split(x @ W_gu)[i]``
    (fused graph; channel j = column offset + j of W_gu), read by that Mul alone; None otherwise."""
    x = node.input[0]
    if len(readers[x]) != 1:
        return None
    src = producer.get(x)
    k = inits[node.input[1]].dims[0]
    if src is not None and src.op_type in _NORM_OPS and src.output[0] == x:
        ws = [i for i in src.input if i in inits and list(inits[i].dims) == [k]]
        if len(ws) == 1:
            return "norm", ws[0], 0
    if src is None or src.op_type != "Mul":
        return None
    for part in src.input:
        split = producer.get(part)
        if split is not None and split.op_type == "MatMul" and split.input[1] in inits and len(readers[part]) == 1 \
                and inits[split.input[1]].dims[-1] == k:  # the traced graph's separate up_proj
            return "cols", split.input[1], 0
        if split is None or split.op_type != "Split" or len(readers[part]) != 1 or len(split.input) < 2 \
                or split.input[1] not in inits:
            continue
        sizes = numpy_helper.to_array(inits[split.input[1]]).astype(np.int64)
        at = list(split.output).index(part)
        mm = producer.get(split.input[0])
        if mm is None or mm.op_type != "MatMul" or mm.input[1] not in inits or len(readers[split.input[0]]) != 1 \
                or sizes[at] != k:
            continue
        axis = next((a.i for a in split.attribute if a.name == "axis"), 0)
        if axis not in (-1, 2):
            continue
        return "cols", mm.input[1], int(sizes[:at].sum())
    return None


def split_outlier_channels(model: onnx.ModelProto, ids: np.ndarray, names: list[str], k: int,
                           min_ratio: float = 0.0, fold: bool = True, threads: int = 2,
                           zero_rows: bool = True) -> dict[str, dict]:
    """Static LLM.int8()-style decomposition of the named constant-weight MatMuls (in place).

    Per MatMul ``y = x @ W`` [K, N]: the ``k`` input channels with the largest max |x| over a prefill of the
    calibration ``ids [T]`` (``idx``) are computed in fp32 by a side path, ``Gather(x, idx, axis=-1) @ W[idx]``,
    added to the main MatMul's output; the main MatMul (quantized afterwards) gets ``W`` with those rows
    zeroed - its weight block scales no longer see them - and an input whose ``idx`` channels no longer set
    its int8 activation block scales: with ``fold`` the channels are scaled by ``OUTLIER_FOLD`` (2^-16) where
    that is free - the RMSNorm weight that produces a q/k/v or gate/up input, the up_proj columns that
    produce a down_proj input (``_fold_site``) - and the side path's weight rows by the inverse (exact: powers
    of two); elsewhere (o_proj) or without ``fold`` a ``Mul`` by a constant 0/1 mask. The graph computes the
    same function in fp32. ``min_ratio``: only MatMuls whose calibration input has max / median channel
    max |x| >= that. Returns node name -> {"channels", "ratio", "masked_by", "side": side MatMul name}.
    """
    if k < 1:
        raise ValueError(f"outlier channels {k}: must be >= 1")
    nodes = {n.name: n for n in model.graph.node}
    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, list] = defaultdict(list)
    for n in model.graph.node:
        for i in n.input:
            readers[i].append(n)
    for o in model.graph.output:
        readers[o.name].append(None)
    absmax = matmul_input_absmax(model, ids, sorted({nodes[n].input[0] for n in names}), threads)
    plans = {}
    for name in names:
        a = absmax[nodes[name].input[0]]
        ratio = float(a.max() / max(np.median(a), 1e-12))
        if ratio < min_ratio or k >= a.size:
            continue
        plans[name] = (np.sort(np.argsort(-a, kind="stable")[:k]).astype(np.int64), ratio)
    # the folds first (they rescale weights that a later side path may read: gate_up's columns)
    sites = {n: (_fold_site(model, nodes[n], producer, readers, inits) if fold else None) for n in plans}
    for name, site in sites.items():
        if site is None:
            continue
        kind, target, offset = site
        idx = plans[name][0]
        if kind == "norm" and len(readers[target]) > 1:  # a shared norm weight: give this norm its own copy
            src = producer[nodes[name].input[0]]
            private = f"{target}.outlier.{name}"
            model.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(inits[target]), private))
            inits[private] = model.graph.initializer[-1]
            src.input[list(src.input).index(target)] = private
            readers[target].remove(src)
            readers[private] = [src]
            target = private
            sites[name] = (kind, target, offset)
        t = numpy_helper.to_array(inits[target]).astype(np.float32).copy()
        if kind == "norm":
            t[idx] *= OUTLIER_FOLD
        else:
            if len(readers[target]) != 1:
                sites[name] = None
                continue
            t[:, offset + idx] *= OUTLIER_FOLD
        inits[target].CopyFrom(numpy_helper.from_array(t, target))
    new_nodes, done = [], {}
    for node in model.graph.node:
        if node.name not in plans:
            new_nodes.append(node)
            continue
        idx, ratio = plans[node.name]
        p = node.name
        w = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32).copy()  # [K, N]
        if len(readers[node.input[1]]) != 1:
            raise ValueError(f"{p}: its weight is shared; cannot split its outlier channels")
        # a folded channel reaches the side path scaled by 2^-16; with its main row kept it also adds 2^-16 of
        # itself there, so the side carries the rest: fp32-exact either way
        side_w = w[idx] * ((1.0 / OUTLIER_FOLD - (0.0 if zero_rows else 1.0)) if sites[p] is not None else 1.0)
        if zero_rows:  # else the rows stay (on their grid); their masked inputs add <= 2^-16 of them
            w[idx] = 0.0
            inits[node.input[1]].CopyFrom(numpy_helper.from_array(w, node.input[1]))
        x, y = node.input[0], node.output[0]
        model.graph.initializer.extend([numpy_helper.from_array(idx, f"{p}.outlier.idx"),
                                        numpy_helper.from_array(side_w.astype(np.float32), f"{p}.outlier.weight")])
        new_nodes += [helper.make_node("Gather", [x, f"{p}.outlier.idx"], [f"{p}.outlier.x"], name=f"{p}.outlier.gather",
                                       axis=-1),
                      helper.make_node("MatMul", [f"{p}.outlier.x", f"{p}.outlier.weight"], [f"{p}.outlier.y"],
                                       name=f"{p}.outlier.matmul")]
        if sites[p] is None:
            mask = np.ones(w.shape[0], np.float32)
            mask[idx] = 0.0
            model.graph.initializer.append(numpy_helper.from_array(mask, f"{p}.outlier.mask"))
            new_nodes.append(helper.make_node("Mul", [x, f"{p}.outlier.mask"], [f"{p}.outlier.masked"],
                                              name=f"{p}.outlier.mask"))
            node.input[0] = f"{p}.outlier.masked"
        node.output[0] = f"{p}.outlier.main"
        new_nodes += [node, helper.make_node("Add", [f"{p}.outlier.main", f"{p}.outlier.y"], [y],
                                             name=f"{p}.outlier.add")]
        done[p] = {"channels": [int(i) for i in idx], "ratio": round(ratio, 1),
                   "masked_by": "mask" if sites[p] is None else sites[p][0], "side": f"{p}.outlier.matmul",
                   "gather": f"{p}.outlier.gather"}
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return done
