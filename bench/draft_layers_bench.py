"""The layer-skipping drafter in torch, teacher-forced: which of the cloud's layers, and how many (M).

SmolLM2-135M-Instruct split at N = 8 of 30. The drafter continues from the boundary state h_8 through M of the
layers [8, 30), then the final norm and the lm_head (``partition_tools.draft_layers``). Its top-1 agreement with
the full model's greedy next token is measured teacher-forced (one forward per sequence):

* the subset is chosen by greedy forward selection on *calibration* data only: the tail of
  ``partition_tools/data/sample.txt`` (its first 1,024 tokens held out) and the model's own greedy answers to
  ``partition_tools/data/draft_prompts.txt`` - checked here to share no prompt (nor a near-duplicate) with the
  rig's chat and agent workloads or either prompt set of ``bench/edge_answers_bench.py``;
* agreement per M is reported on held-out data: the sample text's first 1,024 tokens (prose), the model's
  answers to ``edge_answers_bench.HELD_OUT`` prompts (chat) and to the rig's chat prompts (the workload the
  speculation bench runs; measured only, never chosen on);
* baselines at the same M: the last M layers (the u-shape tail's), the first M after the split, M evenly
  spaced; M = 0 (h_8 straight into the norm and lm_head) and all 22 (the model itself: 100 %).

``--timing``: the int8 drafter graphs of the greedy subsets at a few M, exported and run as the phone runs
them (onnxruntime, 2 threads) beside the int8 front's decode step: ms per step at a 256-token context and
their bytes.

    python bench/draft_layers_bench.py [--budget 11] [--chat-held-out 24] [--timing] \\
        [--out docs/results/draft_layers.json]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from results_io import emit  # noqa: E402

SPLIT = 8
BASELINE_M = (4, 6, 8, 11)


_STOP = set("a an and are as at be by can do does for from give how i in is it me my of on or that the this to "
             "what when where which who why with you your".split())


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower())) - _STOP


def disjointness(prompts: list[str]) -> dict:
    """Refuse calibration prompts equal or near (Jaccard >= 0.5 of their words beyond stop words) to any
    evaluation prompt; returns the evaluation sets' sizes."""
    from edge_answers_bench import HELD_OUT, TUNING
    from rig.workloads import AGENT_TASKS, CHAT_PROMPTS

    evaluation = {"rig chat": list(CHAT_PROMPTS),
                  "rig agent": [t for t, screens in AGENT_TASKS for t in (t, *screens)],
                  "edge_answers held-out": HELD_OUT, "edge_answers tuning": TUNING}
    clashes = []
    for q in prompts:
        for name, texts in evaluation.items():
            for e in texts:
                a, b = _words(q), _words(e)
                if q.strip().lower() == e.strip().lower() or len(a & b) / max(1, len(a | b)) >= 0.5:
                    clashes.append(f"{q!r} ~ {name}: {e!r}")
    if clashes:
        raise SystemExit("calibration prompts overlap the evaluation sets:\n" + "\n".join(clashes))
    return {name: len(texts) for name, texts in evaluation.items()}


def spaced(lo: int, hi: int, m: int) -> list[int]:
    """``m`` layers evenly spread over [lo, hi), the last one included."""
    return sorted({int(round(x)) for x in np.linspace(lo, hi - 1, m)})


def timing(lm, steps: list[dict], work: Path, ms: tuple[int, ...]) -> dict:
    """ms per one-row step of the int8 front and of int8 drafters (greedy subsets at ``ms``), 256-token context."""
    from edge_client.draft_layers import LayerDrafter
    from edge_client.front import FrontRuntime
    from partition_tools.adapters import ModelAdapter
    from partition_tools.draft_layers import export_drafter
    from split_bundles import cached_split
    from shared.manifest import Manifest

    bundle = cached_split(lm, SPLIT, work / "smollm2-int8", edge_quant="int8")
    manifest = Manifest.load(bundle)
    ctx = np.random.RandomState(0).randint(100, 20000, 256)

    def per_step(step, reps: int = 40) -> float:
        step()
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        return 1000 * (time.perf_counter() - t0) / reps

    front = FrontRuntime(bundle, verify=False)
    rows = front.prefill(ctx)  # [256, H]

    def front_step():
        front.truncate(256)
        front.decode(7)

    out = {"context_tokens": 256, "threads": 2, "front_int8_ms": round(per_step(front_step), 2),
           "front_bytes": sum(a.bytes for k, a in manifest.artifacts.items() if k.startswith("edge/front")),
           "drafters": []}
    adapter = ModelAdapter(lm.model)
    for m in ms:
        layers = steps[m - 1]["layers"]
        for vocab in (None, 8192):
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "d.onnx"
                ids = None if vocab is None else np.arange(vocab, dtype=np.int64)  # the cost only depends on K
                export_drafter(adapter, layers, path, "int8", ids)
                d = LayerDrafter(path, manifest, len(layers))
                d.graph.prefill(rows)

                def draft_step(d=d):
                    d.graph.truncate(256)
                    d.graph.run(rows[:1], 1)

                out["drafters"].append({"m": m, "layers": layers, "vocab": vocab or adapter.vocab_size,
                                        "bytes": path.stat().st_size, "step_ms": round(per_step(draft_step), 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=11, help="the search's largest M")
    ap.add_argument("--chat-held-out", type=int, default=24, help="edge_answers_bench.HELD_OUT prompts answered")
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--timing", action="store_true", help="also time the int8 drafters beside the int8 front")
    ap.add_argument("--timing-m", default="4,6,8")
    ap.add_argument("--work", type=Path, default=Path("/tmp/autoglm-draft-layers"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    from edge_answers_bench import HELD_OUT
    from partition_tools.adapters import ModelAdapter
    from partition_tools.draft_layers import (DraftLayersConfig, LayerProbe, calibration, chat_answers,
                                              held_out_prose, read_prompts, search)
    from partition_tools.models import load_model
    from rig.workloads import CHAT_PROMPTS

    t0 = time.time()
    prompts = read_prompts()
    checked = disjointness(prompts)
    lm = load_model("smollm2")
    adapter = ModelAdapter(lm.model)
    cfg = DraftLayersConfig(answer_tokens=args.answer_tokens)
    cal = LayerProbe(adapter, calibration(lm, adapter, cfg), SPLIT)
    held = {"prose": LayerProbe(adapter, held_out_prose(lm, adapter), SPLIT),
            "chat": LayerProbe(adapter, chat_answers(lm, HELD_OUT[:args.chat_held_out], args.answer_tokens), SPLIT),
            "rig_chat": LayerProbe(adapter, chat_answers(lm, list(CHAT_PROMPTS), args.answer_tokens), SPLIT)}
    print(f"data ready in {time.time() - t0:.0f} s: calibration {cal.targets.numel()} positions, held-out "
          + ", ".join(f"{k} {p.targets.numel()}" for k, p in held.items()), file=sys.stderr, flush=True)

    def scores(layers: list[int]) -> dict:
        return {"layers": layers, "calibration": round(cal.agreement(layers), 4),
                **{k: round(p.agreement(layers), 4) for k, p in held.items()}}

    t1 = time.time()
    steps = search(cal, args.budget)
    search_s = time.time() - t1
    greedy = [{"m": i + 1, **scores(s["layers"])} for i, s in enumerate(steps)]
    for g in greedy:
        print(g, file=sys.stderr, flush=True)
    result = {"model": "SmolLM2-135M-Instruct (fp32 torch, teacher-forced)", "split_layer": SPLIT,
              "calibration": {"sources": "sample.txt after its first 1,024 tokens; greedy answers to draft_prompts.txt",
                              "positions": int(cal.targets.numel()), "prompts": len(prompts),
                              "disjoint_from": checked},
              "held_out_positions": {k: int(p.targets.numel()) for k, p in held.items()},
              "greedy": greedy, "search_s": round(search_s, 1), "seconds": round(time.time() - t0, 1)}
    emit(result, args.out, "draft_layers_bench.py", argv)  # the search's results first: the rest takes a while
    top = adapter.num_layers
    baselines = []
    for m in (x for x in BASELINE_M if x <= args.budget):
        for name, layers in (("last", list(range(top - m, top))), ("first", list(range(SPLIT, SPLIT + m))),
                             ("spaced", spaced(SPLIT, top, m))):
            baselines.append({"m": m, "subset": name, **scores(layers)})
    result["baselines"] = baselines
    result["early_exit_m0"] = {k: round(p.score(p.boundary())[0], 4) for k, p in held.items()}
    if args.timing:
        result["timing"] = timing(lm, steps, args.work, tuple(int(x) for x in args.timing_m.split(",")))
    result["seconds"] = round(time.time() - t0, 1)
    emit(result, args.out, "draft_layers_bench.py", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
