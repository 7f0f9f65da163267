"""An input-embeddings path into an edge front graph: where images' visual embeddings enter.

GLM-4.1V places the vision tower's output at the image-token positions *instead of* the token embeddings
(``inputs_embeds.masked_scatter(image_mask, image_embeds)``). The front graph embeds token ids itself, so
:func:`add_embeds_input` rewires it: the embedding lookup's output ``E [1, S, H]`` becomes
``Where(embeds_mask, inputs_embeds, E)`` for every node that read it, with two new inputs::

    inputs_embeds  float32 [1, S, H]  rows to use instead of the token embeddings (or [1, 1, H], broadcast)
    embeds_mask    bool    [1, S, 1]  True where ``inputs_embeds`` replaces the lookup (or [1, 1, 1])

A caller without media feeds the no-op ``inputs_embeds = zeros [1, 1, H]``, ``embeds_mask = False [1, 1, 1]``
(``Where`` broadcasts them) and gets exactly the graph's text output; ``edge_client.front.FrontRuntime`` does
so on every text chunk. (They are plain inputs, not initializer defaults: an IO binding can bind only inputs.)

Works on any front graph whose embedding lookup is the ``Gather`` / ``GatherBlockQuantized`` node reading
``input_ids`` (the fused, plain, fp32 and quantized fronts), so it runs after quantization.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from edge_client.front import EMBEDS_INPUTS

EMBEDS_INPUT, EMBEDS_MASK = EMBEDS_INPUTS
_LOOKUPS = ("Gather", "GatherBlockQuantized")


class EmbedsInputError(ValueError):
    """The graph has no embedding lookup to rewire (or has one already); one-line reason."""


def add_embeds_input(model: onnx.ModelProto, hidden_size: int) -> onnx.ModelProto:
    """Rewire ``model`` in place (see the module docstring); returns it."""
    g = model.graph
    if any(i.name == EMBEDS_INPUT for i in g.input):
        raise EmbedsInputError(f"the graph already has an {EMBEDS_INPUT!r} input")
    lookups = [n for n in g.node if n.op_type in _LOOKUPS and "input_ids" in list(n.input)]
    if len(lookups) != 1:
        raise EmbedsInputError(f"expected one embedding lookup reading input_ids, found {len(lookups)}")
    lookup_out = lookups[0].output[0]
    merged = f"{lookup_out}.with_embeds"
    for node in g.node:
        for k, name in enumerate(node.input):
            if name == lookup_out:
                node.input[k] = merged
    for out in g.output:
        if out.name == lookup_out:
            raise EmbedsInputError("the embedding lookup is a graph output; nothing to rewire")
    where = helper.make_node("Where", [EMBEDS_MASK, EMBEDS_INPUT, lookup_out], [merged], name="embeds_input.where")
    idx = list(g.node).index(lookups[0]) + 1
    g.node.insert(idx, where)
    g.input.extend([helper.make_tensor_value_info(EMBEDS_INPUT, TensorProto.FLOAT, [1, "S_embeds", hidden_size]),
                    helper.make_tensor_value_info(EMBEDS_MASK, TensorProto.BOOL, [1, "S_embeds", 1])])
    return model


def add_embeds_input_file(path: Path, hidden_size: int) -> Path:
    """:func:`add_embeds_input` on a graph file, rewritten in place (external weight data left where it is)."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    add_embeds_input(model, hidden_size)
    onnx.save(model, str(path))
    return path
