"""Build the edge front's *fused* ONNX graph directly from the model's weights (no tracing).

The graph is written node by node with ``onnx.helper``, the way ONNX Runtime GenAI's model builder writes
its decoders, out of onnxruntime's fused contrib ops (domain ``com.microsoft``):

* ``Gather`` on the embedding table;
* per layer ``SimplifiedLayerNormalization`` (layer 0's input norm) / ``SkipSimplifiedLayerNormalization``
  (every later norm: residual add + RMSNorm in one kernel, its 4th output is the new residual);
* one packed q|k|v ``MatMul`` (+ ``Add`` for a bias), ``GroupQueryAttention`` with the KV cache updated in
  place, one ``MatMul`` for o_proj, a packed gate|up ``MatMul`` + ``Split`` + SiLU gate + down ``MatMul``.
  Every weight MatMul is named by its module path (``layers.3.mlp.gate_up_proj``), so
  ``partition_tools.quantize`` turns them into ``MatMulNBits`` with the same patterns as the traced graph.

Interface (``edge_client.front.FUSED_INPUTS`` tells the two graphs apart; ``FrontRuntime`` runs both)::

    inputs   input_ids              int64   [1, S]
             seqlens_k              int32   [1]            P + S - 1 (tokens in the cache after the step, - 1)
             total_sequence_length  int32   []             P + S
             past_key.{i}           float32 [1, KVH, C, D] the KV buffer (C = capacity >= P + S)
             past_value.{i}         float32 [1, KVH, C, D]
             rope_cos, rope_sin     float32 [S, R/2]       mrope families only (see below)
    outputs  hidden_states          float32 [1, S, H]
             present_key.{i}, present_value.{i}  [1, KVH, C, D]: the same buffer when bound to the same
             OrtValue (GroupQueryAttention's past_present_share_buffer: the step writes S rows in place)

Rotary: for 1-D rope families the op rotates q/k itself (``do_rotary=1``) from cos/sin caches stored in the
graph (``[max_positions, R/2]``, computed by the model's own rotary module, so scaling types come along)
at positions ``P + s``. GLM-4.1V's 3-D multimodal rope gives each token a (t, h, w) position and
interleaves sections of the frequency axis from the three axes; neither the fused op nor a position
cache can express that, so for ``mrope`` families the *caller* computes each token's cos/sin
(``edge_client.rope``) and passes them in, the graph rotates q and k with the ``RotaryEmbedding`` contrib op
(row s of the inputs is token s's angle) and GroupQueryAttention runs with ``do_rotary=0``. Text tokens
have t = h = w, where this equals 1-D rope; images only change the positions the caller sends.

The same builder writes the u-shape *tail* (``build_fused_layers`` with ``first > 0``, used by
``partition_tools.export_tail``): the last M layers from the boundary states the cloud returns, then the final
norm and the lm_head over the last ``logits_rows`` rows, with its own in-place KV buffer; and, with the same
interface, any increasing subset of layers (``build_fused_stack``: the layer-skipping drafter of
``partition_tools.draft_layers``).

Families: Llama layout (SmolLM2, Qwen2, Mistral) and GLM-4 / GLM / GLM-4.1V (partial interleaved rotary,
fused gate_up_proj, GLM-4's post-attention and post-MLP norms). Anything else (q/k norms, non-SiLU MLPs,
sliding windows) raises :class:`GraphBuildError`; ``partition_tools.export`` then writes the traced graph.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from edge_client.front import MAX_POSITIONS_KEY, MROPE_KEY, ROPE_INPUTS

from .adapters import ModelAdapter

MS = "com.microsoft"
GRAPH_KIND_KEY = "autoglm.edge_graph"  # model metadata: "fused-gqa" (front) | "fused-gqa-tail"
TAIL_INPUT, TAIL_ROWS, TAIL_OUTPUT = "boundary_states", "logits_rows", "logits"  # the tail's own I/O
MAX_CACHED_POSITIONS = 32768  # rotary cache rows at most (SmolLM2: 8,192 -> 2 MB of cos/sin)
OPSET = 17
_INTERLEAVED = {"glm", "glm4", "glm4v"}  # families whose rotary pairs adjacent channels (2i, 2i+1)


class GraphBuildError(ValueError):
    """The model does not fit the fused graph; the message says what (the traced graph still works)."""


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's fp32 weights, MatMul weights transposed to [in, out]."""

    input_norm: np.ndarray  # [H]
    qkv: np.ndarray  # [H, (NH + 2 KVH) D]
    qkv_bias: np.ndarray | None  # [(NH + 2 KVH) D]
    o: np.ndarray  # [NH D, H]
    post_attn_norm: np.ndarray | None  # [H]  GLM-4: on the attention output, before the residual add
    mlp_norm: np.ndarray  # [H]  post_attention_layernorm: the MLP's input norm
    gate_up: np.ndarray  # [H, 2 I]  gate columns first
    down: np.ndarray  # [I, H]
    post_mlp_norm: np.ndarray | None  # [H]  GLM-4: on the MLP output, before the residual add
    eps: float
    scaling: float  # softmax scale


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _linear(mod: torch.nn.Linear) -> tuple[np.ndarray, np.ndarray | None]:
    return _np(mod.weight).T, None if mod.bias is None else _np(mod.bias)  # [in, out], [out]


def layer_weights(adapter: ModelAdapter, i: int) -> LayerWeights:
    """Read layer ``i``'s weights, refusing any layout the fused graph would compute differently."""
    layer = adapter.layers[i]
    attn, mlp = layer.self_attn, layer.mlp
    for name in ("q_norm", "k_norm"):
        if getattr(attn, name, None) is not None:
            raise GraphBuildError(f"layer {i}: attention has {name} (not built by the fused graph)")
    if getattr(attn, "sliding_window", None):
        raise GraphBuildError(f"layer {i}: sliding-window attention (not built by the fused graph)")
    act = getattr(adapter.config, "hidden_act", "silu")
    if act != "silu":
        raise GraphBuildError(f"MLP activation {act!r}: the fused graph builds SiLU-gated MLPs only")
    parts = [_linear(getattr(attn, p)) for p in ("q_proj", "k_proj", "v_proj")]
    biases = [b for _, b in parts]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise GraphBuildError(f"layer {i}: bias on some of q/k/v only")
    qkv = np.concatenate([w for w, _ in parts], axis=1)
    qkv_bias = None if biases[0] is None else np.concatenate(biases)
    o, o_bias = _linear(attn.o_proj)
    if hasattr(mlp, "gate_up_proj"):
        gate_up, gu_bias = _linear(mlp.gate_up_proj)
    else:
        (g, gb), (u, ub) = _linear(mlp.gate_proj), _linear(mlp.up_proj)
        gate_up, gu_bias = np.concatenate([g, u], axis=1), gb if gb is None else np.concatenate([gb, ub])
    down, d_bias = _linear(mlp.down_proj)
    if o_bias is not None or gu_bias is not None or d_bias is not None:
        raise GraphBuildError(f"layer {i}: bias on o_proj or the MLP (not built by the fused graph)")

    def norm(name: str) -> np.ndarray | None:
        mod = getattr(layer, name, None)
        return None if mod is None else _np(mod.weight)

    eps = getattr(layer.input_layernorm, "variance_epsilon", None) or getattr(layer.input_layernorm, "eps", 1e-6)
    scaling = float(getattr(attn, "scaling", adapter.head_dim ** -0.5))
    return LayerWeights(norm("input_layernorm"), qkv, qkv_bias, o, norm("post_self_attn_layernorm"),
                        norm("post_attention_layernorm"), gate_up, down, norm("post_mlp_layernorm"),
                        float(eps), scaling)


def model_positions(adapter: ModelAdapter) -> int:
    """Positions a graph of the model serves (prompt + answer): its ``max_position_embeddings`` (4,096 when the
    config names none), at most ``MAX_CACHED_POSITIONS``; the fused graphs' rotary caches and the whole-model
    export (the all-edge baseline's context) both."""
    return min(int(getattr(adapter.config, "max_position_embeddings", 4096)), MAX_CACHED_POSITIONS)


def rotary_dim(adapter: ModelAdapter) -> int:
    """Rotated channels per head (R): head_dim x partial_rotary_factor."""
    return int(adapter.head_dim * adapter.rope_settings()["partial_rotary_factor"])


@torch.no_grad()
def rotary_caches(adapter: ModelAdapter, n_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [n_positions, R/2] from the model's own rotary module (its scaling included)."""
    pos = torch.arange(n_positions)[None]  # [1, P]
    probe = torch.zeros(1, 1, adapter.hidden_size)
    cos, sin = adapter.rotary_emb(probe, pos)  # [1, P, R] (halves repeated)
    half = rotary_dim(adapter) // 2
    if cos.shape[-1] != 2 * half:
        raise GraphBuildError(f"rotary module returns {cos.shape[-1]} channels, expected {2 * half}")
    return _np(cos[0, :, :half]), _np(sin[0, :, :half])


class _Graph:
    """Accumulates nodes and initializers; ``op`` returns the output names."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: list[str], name: str, domain: str = "", **attrs):
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, domain=domain or None, **attrs))
        return outputs

    def norm(self, x: str, weight: np.ndarray, name: str, eps: float) -> str:
        """RMSNorm(x) * weight."""
        w = self.const(f"{name}.weight", weight)
        return self.op("SimplifiedLayerNormalization", [x, w], [f"{name}.out"], name, axis=-1, epsilon=eps,
                       stash_type=1)[0]

    def skip_norm(self, x: str, residual: str | None, weight: np.ndarray, name: str, eps: float) -> tuple[str, str]:
        """RMSNorm(x + residual) * weight -> (normed, x + residual); no residual yet: (RMSNorm(x), x)."""
        if residual is None:
            return self.norm(x, weight, name, eps), x
        w = self.const(f"{name}.weight", weight)
        out = self.op("SkipSimplifiedLayerNormalization", [x, residual, w],
                      [f"{name}.out", "", "", f"{name}.sum"], name, domain=MS, epsilon=eps)
        return out[0], out[3]

    def matmul(self, x: str, weight: np.ndarray, module: str, bias: np.ndarray | None = None) -> str:
        """x @ weight [K, N] (+ bias), the node named by its module path."""
        y = self.op("MatMul", [x, self.const(f"{module}.weight", weight)], [f"{module}.out"], module)[0]
        if bias is not None:
            y = self.op("Add", [y, self.const(f"{module}.bias", bias)], [f"{module}.biased"], f"{module}.bias")[0]
        return y


def _head(g: _Graph, adapter: ModelAdapter, hidden: str) -> str:
    """The final norm and the lm_head over the last ``logits_rows`` rows of ``hidden`` [1, S, H] -> logits
    [1, n, V]: prefill wants the last row only, a speculative step all k + 1."""
    neg = g.op("Neg", [TAIL_ROWS], ["head.start"], "head.start")[0]  # [1] = -n
    rows = g.op("Slice", [hidden, neg, g.const("head.end", np.array([np.iinfo(np.int64).max], np.int64)),
                          g.const("head.axis", np.array([1], np.int64))], ["head.rows"], "head.rows")[0]  # [1, n, H]
    norm = adapter.norm
    eps = float(getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6))
    x = g.norm(rows, _np(norm.weight), "norm", eps)  # [1, n, H]
    w, b = _linear(adapter.lm_head)  # [H, V]
    return g.op("Identity", [g.matmul(x, w, "lm_head", b)], [TAIL_OUTPUT], "logits")[0]  # [1, n, V]


def build_fused_front(adapter: ModelAdapter, n_layers: int, out_path: Path,
                      max_positions: int | None = None) -> Path:
    """Write the fused fp32 front graph for layers [0, n_layers) of ``adapter`` (interface: module docstring)."""
    return build_fused_layers(adapter, 0, n_layers, out_path, max_positions)


def build_fused_layers(adapter: ModelAdapter, first: int, last: int, out_path: Path,
                       max_positions: int | None = None) -> Path:
    """Write the fused fp32 graph of decoder layers [first, last) of ``adapter``.

    ``first == 0``: the front (token ids in, embeddings, boundary hidden states out: the module docstring).
    ``first > 0``: the u-shape *tail* (``partition_tools.export_tail``), which must end at the last layer: input
    ``boundary_states`` float32 [1, S, H] (the hidden states after layer ``first - 1``) instead of ``input_ids``,
    ``logits_rows`` int64 [1] = n, and output ``logits`` float32 [1, n, V]: the final norm and the lm_head over
    the last n of the S rows. KV inputs are numbered from 0 within the graph (``past_key.{j}`` is layer
    ``first + j``); nodes keep the model's layer numbers (``layers.{first + j}.mlp.down_proj``)."""
    if not 0 <= first < last <= adapter.num_layers or (first > 0 and last != adapter.num_layers):
        raise GraphBuildError(f"layers [{first}, {last}): a front starts at 0, a tail ends at layer "
                              f"{adapter.num_layers}")
    return build_fused_stack(adapter, range(first, last), out_path, max_positions)


def build_fused_stack(adapter: ModelAdapter, layer_ids: Sequence[int], out_path: Path,
                      max_positions: int | None = None) -> Path:
    """Write the fused fp32 graph of the decoder layers ``layer_ids`` (strictly increasing), run in that order.

    ``[0, n)``: the front. Not starting at 0: a stack over hidden states with the final norm and the lm_head,
    the interface of the tail (``build_fused_layers``): the u-shape tail ``[L - M, L)``, or the layer-skipping
    drafter's subset of the cloud's layers (``partition_tools.draft_layers``), whose first layer reads the
    boundary states after layer N - 1 and whose skipped layers are simply absent. ``past_key.{j}`` is the KV of
    ``layer_ids[j]``; nodes keep the model's layer numbers."""
    layer_ids = [int(i) for i in layer_ids]
    n_layers = len(layer_ids)
    tail = bool(layer_ids) and layer_ids[0] > 0
    if (not layer_ids or layer_ids[-1] >= adapter.num_layers or any(b <= a for a, b in zip(layer_ids, layer_ids[1:]))
            or (not tail and layer_ids != list(range(n_layers)))):
        raise GraphBuildError(f"layers {layer_ids}: a front is [0, n), a stack strictly increasing layers of "
                              f"[1, {adapter.num_layers})")
    if adapter.family.name not in _INTERLEAVED and adapter.family.name != "llama":
        raise GraphBuildError(f"family {adapter.family.name!r}: no fused graph recipe")
    if getattr(adapter.config, "sliding_window", None) and getattr(adapter.config, "use_sliding_window", True):
        raise GraphBuildError("sliding-window attention: not built by the fused graph")
    nh, kvh, d, hsz = adapter.num_heads, adapter.num_kv_heads, adapter.head_dim, adapter.hidden_size
    if d % 8:
        raise GraphBuildError(f"head_dim {d}: GroupQueryAttention needs a multiple of 8")
    rot = rotary_dim(adapter)
    mrope = adapter.family.mrope
    if mrope and (adapter.rope_settings()["type"] != "default" or not adapter.rope_settings()["mrope_section"]):
        raise GraphBuildError("3-D rope with scaling or without mrope_section: edge_client.rope computes "
                              "default-type angles only")
    interleaved = int(adapter.family.name in _INTERLEAVED)
    layers = [layer_weights(adapter, i) for i in layer_ids]
    n_pos = max_positions or model_positions(adapter)

    g = _Graph()
    cap = "capacity"
    seq_input = TAIL_INPUT if tail else "input_ids"  # the input whose dim 1 is S
    inputs = [helper.make_tensor_value_info(TAIL_INPUT, TensorProto.FLOAT, [1, "S", hsz]) if tail else
              helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "S"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    if tail:
        inputs.append(helper.make_tensor_value_info(TAIL_ROWS, TensorProto.INT64, [1]))
        outputs = [helper.make_tensor_value_info(TAIL_OUTPUT, TensorProto.FLOAT, [1, "n", adapter.vocab_size])]
    else:
        outputs = [helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [1, "S", hsz])]
    for i in range(n_layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}.{i}", TensorProto.FLOAT, [1, kvh, cap, d]))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}.{i}", TensorProto.FLOAT,
                                                         [1, kvh, cap, d]))
    # Rotary: inside GroupQueryAttention when the op can (1-D rope, R/2 a multiple of 8), else the
    # RotaryEmbedding op on q and k before it, indexed by position ids computed here.
    fused_rotary = not mrope and (rot // 2) % 8 == 0
    if mrope:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["S", rot // 2]) for n in ROPE_INPUTS]
        cos_name, sin_name = ROPE_INPUTS
    else:
        cos, sin = rotary_caches(adapter, n_pos)
        cos_name, sin_name = g.const("rope.cos_cache", cos), g.const("rope.sin_cache", sin)
    if not fused_rotary:
        # position ids [1, S]: row s of the rope inputs (mrope), or absolute position P + s (cache)
        g.op("Shape", [seq_input], ["rope.shape"], "rope.shape", start=1, end=2)
        g.op("Squeeze", ["rope.shape"], ["rope.len"], "rope.len")
        if mrope:
            start = g.const("rope.zero", np.array(0, np.int64))
        else:  # P = total - S
            g.op("Cast", ["total_sequence_length"], ["rope.total"], "rope.total", to=TensorProto.INT64)
            start = g.op("Sub", ["rope.total", "rope.len"], ["rope.start"], "rope.start")[0]
            g.op("Add", [start, "rope.len"], ["rope.end"], "rope.end")
        end = "rope.len" if mrope else "rope.end"
        g.op("Range", [start, end, g.const("rope.one", np.array(1, np.int64))], ["rope.range"], "rope.range")
        g.op("Unsqueeze", ["rope.range", g.const("rope.axis0", np.array([0], np.int64))], ["rope.pos"], "rope.pos")

    if tail:
        hidden = TAIL_INPUT  # [1, S, H]: the residual stream after layer first - 1
    else:
        g.const("embed_tokens.weight", _np(adapter.embed_tokens.weight))  # [V, H]
        hidden = g.op("Gather", ["embed_tokens.weight", "input_ids"], ["embed.out"], "embed_tokens")[0]  # [1, S, H]
    residual = None  # the running residual stream; None: ``hidden`` itself (the graph's first layer)
    for i, w in enumerate(layers):
        p = f"layers.{layer_ids[i]}"

        x, residual = g.skip_norm(hidden, residual, w.input_norm, f"{p}.input_layernorm", w.eps)  # [1, S, H]
        qkv = g.matmul(x, w.qkv, f"{p}.self_attn.qkv_proj", w.qkv_bias)  # [1, S, (NH + 2 KVH) D]
        gqa_attrs = dict(num_heads=nh, kv_num_heads=kvh, scale=w.scaling, local_window_size=-1)
        cache = [f"past_key.{i}", f"past_value.{i}"]
        present = [f"present_key.{i}", f"present_value.{i}"]
        lens = ["seqlens_k", "total_sequence_length"]
        if not fused_rotary:
            q, k, v = g.op("Split", [qkv, g.const(f"{p}.qkv_split", np.array([nh * d, kvh * d, kvh * d], np.int64))],
                           [f"{p}.q", f"{p}.k", f"{p}.v"], f"{p}.self_attn.qkv_split", axis=-1)
            rope = dict(interleaved=interleaved, rotary_embedding_dim=rot)
            q = g.op("RotaryEmbedding", [q, "rope.pos", cos_name, sin_name], [f"{p}.q_rot"],
                     f"{p}.self_attn.q_rotary", domain=MS, num_heads=nh, **rope)[0]
            k = g.op("RotaryEmbedding", [k, "rope.pos", cos_name, sin_name], [f"{p}.k_rot"],
                     f"{p}.self_attn.k_rotary", domain=MS, num_heads=kvh, **rope)[0]
            attn = g.op("GroupQueryAttention", [q, k, v, *cache, *lens], [f"{p}.attn", *present],
                        f"{p}.self_attn.attention", domain=MS, do_rotary=0, **gqa_attrs)[0]
        else:  # packed q|k|v; the op rotates q and k at positions P + s
            attn = g.op("GroupQueryAttention", [qkv, "", "", *cache, *lens, cos_name, sin_name],
                        [f"{p}.attn", *present], f"{p}.self_attn.attention", domain=MS, do_rotary=1,
                        rotary_interleaved=interleaved, **gqa_attrs)[0]  # [1, S, NH D]
        o = g.matmul(attn, w.o, f"{p}.self_attn.o_proj")  # [1, S, H]
        if w.post_attn_norm is not None:
            o = g.norm(o, w.post_attn_norm, f"{p}.post_self_attn_layernorm", w.eps)
        x, residual = g.skip_norm(o, residual, w.mlp_norm, f"{p}.post_attention_layernorm", w.eps)
        gu = g.matmul(x, w.gate_up, f"{p}.mlp.gate_up_proj")  # [1, S, 2I]
        gate, up = g.op("Split", [gu, g.const(f"{p}.mlp.split", np.array([w.down.shape[0]] * 2, np.int64))],
                        [f"{p}.mlp.gate", f"{p}.mlp.up"], f"{p}.mlp.split", axis=-1)
        sig = g.op("Sigmoid", [gate], [f"{p}.mlp.sigmoid"], f"{p}.mlp.sigmoid")[0]
        silu = g.op("Mul", [gate, sig], [f"{p}.mlp.silu"], f"{p}.mlp.silu")[0]
        act = g.op("Mul", [silu, up], [f"{p}.mlp.act"], f"{p}.mlp.act")[0]  # [1, S, I]
        hidden = g.matmul(act, w.down, f"{p}.mlp.down_proj")  # [1, S, H]
        if w.post_mlp_norm is not None:
            hidden = g.norm(hidden, w.post_mlp_norm, f"{p}.post_mlp_layernorm", w.eps)
    if not tail:
        g.op("Add", [hidden, residual], ["hidden_states"], "final_residual")
    else:
        _head(g, adapter, g.op("Add", [hidden, residual], ["final.hidden"], "final_residual")[0])

    graph = helper.make_graph(g.nodes, "edge_tail_fused" if tail else "edge_front_fused", inputs, outputs, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                              producer_name="autoglm-split graph_builder")
    model.ir_version = 8
    props = {GRAPH_KIND_KEY: "fused-gqa-tail" if tail else "fused-gqa", MAX_POSITIONS_KEY: str(n_pos)}
    if mrope:  # what edge_client.rope needs to compute the rope inputs
        rope = adapter.rope_settings()
        props[MROPE_KEY] = json.dumps({"theta": rope["theta"], "rotary_dim": rot,
                                       "mrope_section": rope["mrope_section"]})
    helper.set_model_props(model, props)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    weight_bytes = sum(len(t.raw_data) for t in g.inits)
    if weight_bytes > (1 << 31) - (1 << 26):
        onnx.save(model, str(out_path), save_as_external_data=True, location=out_path.name + ".data")
    else:
        onnx.save(model, str(out_path))
    return out_path
