"""Export the whole decoder (embeddings + every layer + final norm + lm_head) as one ONNX graph: the
all-edge baseline, the model run entirely on the phone with the same quantization recipe as the edge front.

Interface (``rig.all_edge`` runs it; the KV convention is the front graph's, see ``partition_tools.export``):

    inputs   input_ids      int64   [1, S]
             position_ids   int64   [1, S]
             past_key.{i}   float32 [1, KVH, P, D]  for i in [0, L)
             past_value.{i} float32 [1, KVH, P, D]
    outputs  logits         float32 [1, V]          of the last position only (all a sampler needs)
             present_key.{i}, present_value.{i}  float32 [1, KVH, P + S, D]

``export_whole(lm, out_dir, quant)`` writes ``out_dir/model.onnx`` and ``out_dir/whole.json`` (what the
runner needs: layers, KV heads, head dim, vocab, eos ids, the positions a request may fill -
``graph_builder.model_positions``, as the split's front -, quantization report).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from shared.whole_model import WHOLE_GRAPH, WHOLE_META

from .adapters import ModelAdapter
from .export import FrontModule, _param_bytes, example_inputs, input_names, quiet_exporter_logs
from .graph_builder import model_positions
from .models import LoadedModel
from .quantize import QUANT_MODES, QuantizationError, _save, quantize_front, recipe_for

def output_names(n_layers: int) -> list[str]:
    names = ["logits"]
    for i in range(n_layers):
        names += [f"present_key.{i}", f"present_value.{i}"]
    return names


class WholeModule(torch.nn.Module):
    """Every layer (the front module over all L layers), then the final norm and the lm_head of the last
    position: (ids, positions, past) -> (logits [B, V], present)."""

    def __init__(self, adapter: ModelAdapter):
        super().__init__()
        self.body = FrontModule(adapter, adapter.num_layers)
        self.norm = adapter.norm
        self.lm_head = adapter.lm_head

    def forward(self, input_ids, position_ids, *past):
        hidden, *present = self.body(input_ids, position_ids, *past)  # hidden: [B, S, H]
        logits = self.lm_head(self.norm(hidden[:, -1]))  # [B, V]
        return (logits, *present)


def _export_fp32(adapter: ModelAdapter, out_path: Path) -> Path:
    from torch.export import Dim

    adapter.model.config._attn_implementation = "sdpa"
    adapter.config._attn_implementation = "sdpa"
    n = adapter.num_layers
    module = WholeModule(adapter).eval()
    args = example_inputs(adapter, n)
    dyn = ({0: Dim.AUTO, 1: Dim.AUTO}, {0: Dim.AUTO, 1: Dim.AUTO},
           tuple({0: Dim.AUTO, 2: Dim.AUTO} for _ in range(2 * n)))
    quiet_exporter_logs()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, dynamo=True, input_names=input_names(n),
                                    output_names=output_names(n), dynamic_shapes=dyn, optimize=True,
                                    verbose=False)
    program.save(str(out_path), external_data=_param_bytes(module) > (1 << 31) - (1 << 26))
    return out_path


def gemm_to_matmul(model: onnx.ModelProto) -> int:
    """Rewrite ``Gemm(x, W, transB=1)`` without bias (how the exporter writes the lm_head) as
    ``MatMul(x, W^T)`` on a transposed copy of ``W``, so the weight quantizer sees it like every other
    projection; returns the number of nodes rewritten. A table shared with the embedding stays for the
    Gather."""
    inits = {i.name: i for i in model.graph.initializer}
    done = 0
    for idx, node in enumerate(list(model.graph.node)):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or len(node.input) != 2 or node.input[1] not in inits
                or attrs.get("transB", 0) != 1 or attrs.get("transA", 0) != 0
                or attrs.get("alpha", 1.0) != 1.0):
            continue
        w = numpy_helper.to_array(inits[node.input[1]])  # [V, H]
        wt = numpy_helper.from_array(np.ascontiguousarray(w.T), node.input[1] + "_t")  # [H, V]
        model.graph.initializer.append(wt)
        mm = helper.make_node("MatMul", [node.input[0], wt.name], list(node.output), name=node.name + "_mm")
        mm.metadata_props.extend(node.metadata_props)
        model.graph.node.remove(node)
        model.graph.node.insert(idx, mm)
        if not any(inits[node.input[1]].name in n.input for n in model.graph.node):
            model.graph.initializer.remove(inits[node.input[1]])
        done += 1
    return done


def export_whole(lm: LoadedModel, out_dir: Path, quant: str = "int8") -> dict:
    """Write the whole model as ONNX (``quant``: int8 | int4 | fp32, the edge front's recipe) into
    ``out_dir``; returns the metadata written to ``whole.json``."""
    if quant not in QUANT_MODES:
        raise QuantizationError(f"whole-model quantization {quant!r}: expected one of {', '.join(QUANT_MODES)}")
    adapter = ModelAdapter(lm.model)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"mode": "fp32"}
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = _export_fp32(adapter, Path(tmp) / WHOLE_GRAPH)
        if quant != "fp32":  # the lm_head is a Gemm: make it a MatMul the quantizer handles
            model = onnx.load(str(fp32))
            if gemm_to_matmul(model):
                _save(model, fp32)
            del model
        if quant == "fp32":
            for p in Path(tmp).iterdir():
                shutil.move(str(p), out_dir / p.name)
        else:
            recipe = recipe_for(adapter, adapter.num_layers, quant, lm.tokenizer)
            report = quantize_front(fp32, out_dir / WHOLE_GRAPH, quant, **recipe)
    meta = {
        "source": lm.source, "source_identity": lm.identity, "num_layers": adapter.num_layers,
        "hidden_size": adapter.hidden_size, "num_kv_heads": adapter.num_kv_heads, "head_dim": adapter.head_dim,
        "vocab_size": adapter.vocab_size, "eos_token_ids": adapter.eos_token_ids(),
        "max_positions": model_positions(adapter), "quant": quant,
        "quant_report": report,
    }
    (out_dir / WHOLE_META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta
