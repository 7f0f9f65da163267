"""File names of a whole-model export (the all-edge baseline): written by ``partition_tools.export_whole``,
read by ``rig.all_edge`` on the phone. ``whole.json`` holds num_layers, num_kv_heads, head_dim, vocab_size,
eos_token_ids, max_positions (the positions a request may fill, prompt + answer), quant and the quantization
report."""

import json
from pathlib import Path

WHOLE_GRAPH = "model.onnx"
WHOLE_META = "whole.json"
RUNNER_KEYS = ("num_layers", "num_kv_heads", "head_dim", "eos_token_ids", "max_positions")  # what the runner reads


def read_meta(whole_dir: str | Path) -> dict:
    """``whole.json`` of the export in ``whole_dir``; ValueError naming what is wrong: none, not a JSON object, or
    without a key the runner reads (an export older than that key: export it again)."""
    path = Path(whole_dir) / WHOLE_META
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{whole_dir}: no readable {WHOLE_META} ({e}); export it with "
                         "partition_tools.export_whole") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a JSON object")
    missing = [k for k in RUNNER_KEYS if k not in meta]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} (an older export): export it again")
    return meta
