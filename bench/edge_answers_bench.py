"""Sequence-level fidelity of edge graphs: are greedy chat answers of the split identical to the unsplit model's?

For SmolLM2 split at N (default 8) and ``HELD_OUT`` chat prompts (written for this bench; no calibration or
tuning text: the recipes calibrate on the last 512 tokens of ``partition_tools/data/sample.txt``):

1. reference: the unsplit fp32 model's greedy answer, up to ``--new`` tokens (``generate``, chat template);
2. for each arm (an edge graph x a boundary codec) the split's greedy answer *teacher-forced*: the prompt plus
   the reference answer go through the edge graph (``FrontRuntime``, what the phone runs), the boundary
   through the codec (per token row, as the wire does it), and the cloud half (fp32 torch); the split's
   greedy answer equals the reference up to the first position where its argmax differs, so one forward
   per prompt gives "identical" and "tokens before the first divergence" exactly (every op here treats
   tokens independently of how they are batched: per-token activation quantization, per-row codecs);
3. writes per-arm: identical answers (share), mean share of reference tokens before the first divergence,
   and the prompts that diverge.

Arms: ``fp32`` / ``int8`` (the default recipe) / ``int4`` / int8 with an int8 KV cache / sensitivity arms
(one MatMul kind or one layer kept in fp32) / candidate fixes, each with the ``fp16`` wire and the default
``int8-outlier`` codec.

Usage::

    python bench/edge_answers_bench.py --json docs/results/edge_answers.json
    python bench/edge_answers_bench.py --arms fp32,int8 --codecs fp16 --prompts 20   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

HELD_OUT = [
    "What is the boiling point of water at sea level?", "Give me three tips for learning a new language.",
    "Explain what a black hole is to a ten-year-old.", "Write a short poem about autumn leaves.",
    "How do vaccines work?", "What are the main causes of climate change?",
    "Suggest a healthy breakfast idea.", "What is the difference between weather and climate?",
    "How many continents are there, and what are they?", "Explain the rules of chess briefly.",
    "Why do cats purr?", "What is machine learning?", "Describe the water cycle.",
    "Give me a recipe for a simple tomato soup.", "What is the tallest mountain in the world?",
    "How can I improve my handwriting?", "Write a two-sentence horror story.",
    "What does a CPU do in a computer?", "List four renewable energy sources.",
    "Why is exercise good for the brain?", "Translate 'good morning' into Spanish and French.",
    "What is the Pythagorean theorem?", "How do bees make honey?", "Explain inflation in simple terms.",
    "What should I pack for a weekend camping trip?", "Who wrote Romeo and Juliet?",
    "How does a rainbow form?", "Give me a motivational quote and explain it.",
    "What is the speed of light?", "How do I make a paper airplane?", "What are prime numbers?",
    "Describe the taste of a lemon.", "Why do leaves change color in the fall?",
    "What is the capital of Japan, and what is it known for?", "How can I save money on groceries?",
    "Explain what DNA is.", "Write a limerick about a cat.", "What is the difference between a virus and a bacterium?",
    "How does the internet work, in short?", "What are the benefits of reading books?",
    "Name three famous painters and one work by each.", "How do airplanes stay in the air?",
    "What is a haiku? Give an example.", "How do I start a vegetable garden?", "What causes earthquakes?",
    "Explain the greenhouse effect.", "Suggest a fun activity for a rainy day.", "What is 15 percent of 80?",
    "Why is the ocean salty?", "How do I apologize to a friend?", "What are the planets of the solar system?",
    "Describe a good morning routine.", "What is photosynthesis used for by plants?",
    "How do magnets work?", "Give me a tongue twister.", "What is a noun? Give examples.",
    "How do I calm down before an exam?", "What is the largest animal on Earth?",
    "Explain why we have seasons.", "Write a thank-you note to a teacher.",
]

I8 = {"mode": "int8", "block_size": 32, "accuracy_level": 4, "embedding": "int8", "smooth_alpha": 0.5}
# arm -> quantize_front kwargs on the fused fp32 graph (None: the fp32 graph itself); "recipe": recipe_for
ARMS: dict[str, dict | str | None] = {
    "fp32": None,
    "int8": "recipe",
    "int4": "recipe-int4",
    "int8-kv8": {**I8, "kv_cache": "int8"},
    "fp32-kv8": {"mode": "fp32", "kv_cache": "int8"},
    "int8-nosmooth": {**I8, "smooth_alpha": None},
    "int8-acc1": {**I8, "accuracy_level": 1},
    "int8-qkv-fp32": {**I8, "keep_float": ["layers.*.self_attn.qkv_proj"]},
    "int8-o-fp32": {**I8, "keep_float": ["layers.*.self_attn.o_proj"]},
    "int8-gate_up-fp32": {**I8, "keep_float": ["layers.*.mlp.gate_up_proj"]},
    "int8-down-fp32": {**I8, "keep_float": ["layers.*.mlp.down_proj"]},
    "int8-down-acc1": {**I8, "precise": ["layers.*.mlp.down_proj"]},
    "int8-had-down": {**I8, "rotate": ["layers.*.mlp.down_proj"]},
    "int8-had-all": {**I8, "rotate": ["layers.*"]},
    "int8-had-all-kv8": {**I8, "rotate": ["layers.*"], "kv_cache": "int8"},
    "int8-layer0-fp32": {**I8, "keep_float": ["layers.0.*"]},
    "int8-layer7-fp32": {**I8, "keep_float": ["layers.7.*"]},
}


def build_arm(name: str, fp32: Path, out_dir: Path, adapter, layer: int, tokenizer) -> tuple[Path, dict]:
    from partition_tools.quantize import calibration_tokens, kv_calibration_tokens, quantize_front, recipe_for

    spec = ARMS[name]
    if spec is None:
        return fp32, {"mode": "fp32"}
    dst = out_dir / f"{name}.onnx"
    if spec in ("recipe", "recipe-int4"):
        mode = "int8" if spec == "recipe" else "int4"
        return dst, quantize_front(fp32, dst, mode, **recipe_for(adapter, layer, mode, tokenizer))
    kwargs = {k: v for k, v in spec.items() if v is not None}
    if "smooth_alpha" in kwargs:
        kwargs["calibration_ids"] = calibration_tokens(tokenizer, adapter.vocab_size)
    if "kv_cache" in kwargs:
        kwargs["kv_calibration_ids"] = kv_calibration_tokens(tokenizer, adapter.vocab_size)
    return dst, quantize_front(fp32, dst, kwargs.pop("mode"), **kwargs)


@torch.no_grad()
def references(lm, prompts: list[str], new: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) of the unsplit model for each prompt."""
    out = []
    for q in prompts:
        text = lm.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                add_generation_prompt=True)
        ids = lm.tokenizer(text, return_tensors="pt").input_ids  # [1, P]
        gen = lm.model.generate(ids, max_new_tokens=new, do_sample=False, num_beams=1,
                                pad_token_id=lm.tokenizer.eos_token_id)
        out.append((ids[0].tolist(), gen[0, ids.shape[1]:].tolist()))
    return out


@torch.no_grad()
def first_divergences(front, back, codecs: list, prompt: list[int], answer: list[int]) -> list[int]:
    """Per codec: index of the first answer token the split would not produce greedily (len(answer):
    identical). The edge runs once; each codec's boundary goes through the cloud half."""
    seq = np.asarray(prompt + answer[:-1], np.int64)  # the last answer token is predicted, never fed
    front.reset()
    edge = front.prefill(seq)  # [T, H]
    pos = torch.arange(seq.size)[None]
    out = []
    for codec in codecs:
        logits = back(torch.from_numpy(codec(edge))[None], pos)[0]  # [T, V]
        pred = logits[len(prompt) - 1:].argmax(-1).numpy()  # predictions of answer[0..]
        miss = np.nonzero(pred != np.asarray(answer))[0]
        out.append(int(miss[0]) if miss.size else len(answer))
    return out


def codec_fn(name: str, bundle: Path):
    from partition_tools.evaluate import fp16_round_trip
    from shared.codecs import available_codecs

    if name == "fp16":
        return fp16_round_trip
    codec = available_codecs(json.loads((bundle / "calibration.json").read_text()))[name]
    return lambda x: codec.decode(codec.encode(x))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--layer", type=int, default=8)
    p.add_argument("--work", type=Path, default=Path("/tmp/edge_answers_bench"))
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--codecs", default="fp16,int8-outlier")
    p.add_argument("--prompts", type=int, default=len(HELD_OUT))
    p.add_argument("--new", type=int, default=48, help="greedy answer tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.arm_list = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in args.arm_list if a not in ARMS]
    if bad:
        p.error(f"unknown arm(s) {bad}; choose from {list(ARMS)}")
    args.codec_list = [c.strip() for c in args.codecs.split(",") if c.strip()]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from edge_client.front import FrontRuntime
    from partition_tools.adapters import ModelAdapter
    from partition_tools.cloud_half import CloudModel
    from partition_tools.models import load_model
    from partition_tools.split import SplitConfig, split
    from shared.manifest import BundleError, Manifest

    started = time.perf_counter()
    lm = load_model(args.model)
    adapter = ModelAdapter(lm.model)
    bundle = args.work / "bundle-fp32"
    try:
        m = Manifest.load(bundle)
        fresh = m.source_identity == lm.identity and m.split_layer == args.layer
    except BundleError:
        fresh = False
    if not fresh:
        split(lm, SplitConfig(layer=args.layer, out=bundle, edge_quant="fp32", edge_graph="fused"))
    fp32 = bundle / "edge" / "front.onnx"
    (args.work / "arms").mkdir(parents=True, exist_ok=True)
    prompts = HELD_OUT[:args.prompts]
    cached = args.work / f"references-{args.new}.json"  # the unsplit answers do not depend on the arms
    known = json.loads(cached.read_text()) if cached.is_file() else {}
    missing = [q for q in prompts if q not in known]
    for q, ref in zip(missing, references(lm, missing, args.new)):
        known[q] = ref
    cached.write_text(json.dumps(known))
    refs = [tuple(known[q]) for q in prompts]
    print(f"references: {len(refs)} prompts, {sum(len(a) for _, a in refs)} answer tokens", file=sys.stderr)
    back = CloudModel.from_bundle(bundle)
    rows = []
    for arm in args.arm_list:
        path, report = build_arm(arm, fp32, args.work / "arms", adapter, args.layer, lm.tokenizer)
        front = FrontRuntime(bundle, threads=args.threads, chunk=512, verify=False, graph=path)
        codecs = [codec_fn(c, bundle) for c in args.codec_list]
        per_prompt = [first_divergences(front, back, codecs, p, a) for p, a in refs]  # [prompt][codec]
        for ci, cname in enumerate(args.codec_list):
            div = [d[ci] for d in per_prompt]
            same = [d == len(a) for d, (_, a) in zip(div, refs)]
            row = {"arm": arm, "codec": cname, "identical": float(np.mean(same)),
                   "identical_count": int(sum(same)), "prompts": len(refs),
                   "tokens_before_divergence": float(sum(div) / sum(len(a) for _, a in refs)),
                   "diverging": [{"prompt": prompts[i], "at": div[i], "of": len(refs[i][1])}
                                 for i in range(len(refs)) if not same[i]],
                   "report": {k: v for k, v in report.items() if k != "calibration_ids"}}
            rows.append(row)
            print(f"{arm} + {cname}: {row['identical_count']}/{len(refs)} identical, "
                  f"{row['tokens_before_divergence']:.3f} of tokens before divergence", file=sys.stderr, flush=True)
        write(args, lm, prompts, rows, started, argv)
    return 0


def write(args, lm, prompts: list[str], rows: list[dict], started: float, argv) -> None:
    """The report so far (rewritten after every arm, so a long run leaves its finished arms behind)."""
    result = {
        "command": "python bench/edge_answers_bench.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "model": lm.source, "identity": lm.identity, "split_layer": args.layer, "new_tokens": args.new,
        "method": "teacher-forced greedy comparison through FrontRuntime + codec + fp32 cloud half (offline, "
                  "no server)", "prompts": prompts, "seconds": time.perf_counter() - started,
        "loadavg": os.getloadavg(), "arms": rows,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
