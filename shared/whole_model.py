"""File names of a whole-model export (the all-edge baseline): written by ``partition_tools.export_whole``,
read by ``rig.all_edge`` on the phone. ``whole.json`` holds num_layers, num_kv_heads, head_dim, vocab_size,
eos_token_ids, quant and the quantization report."""

WHOLE_GRAPH = "model.onnx"
WHOLE_META = "whole.json"
