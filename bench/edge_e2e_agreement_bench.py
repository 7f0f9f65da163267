"""The default int8 edge, end to end: greedy chat answers through the real split vs the unsplit model.

The demo's bundle (SmolLM2 split at layer 8, int8 edge; built and cached by ``edge_client.demo``) behind a
real ``autoglm-cloud serve`` process and WebSocket, the precision policy's wire codec, 8 chat questions,
greedy, up to ``--max-tokens`` tokens each; the reference is the unsplit fp32 model's ``generate``. Per
question: reference length, tokens before the first divergence, identical or not, and the codec used.
Writes ``docs/results/edge_int8_e2e_agreement.json`` (``tests/edge_client/test_end_to_end.py`` runs this with
``--out`` in a temporary folder and checks the floor).

    python bench/edge_e2e_agreement_bench.py [--max-tokens 32] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "Name three primary colors.", "What is the capital of France?", "Give me a tip for better sleep.",
    "Explain photosynthesis in one sentence.", "Write a haiku about the sea.", "What is 12 times 7?",
    "Suggest a name for a pet turtle.", "Why is the sky blue?",
]


def _greedy(model, ids: list[int], n: int, eos: set[int]) -> list[int]:
    """The unsplit model's greedy continuation of ``ids``, up to ``n`` tokens, through the first EOS."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    return out[: next((i + 1 for i, t in enumerate(out) if t in eos), len(out))]


def measure(max_tokens: int, log_path: Path) -> dict:
    from edge_client.client import EdgeClient
    from edge_client.config import RetryPolicy
    from edge_client.demo import LocalCloud, ensure_bundle
    from partition_tools.models import load_model

    model = load_model("smollm2").model
    bundle = ensure_bundle()
    retry = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=60.0, max_retries=40)
    rows = []
    with LocalCloud(bundle, log_path=log_path) as cloud, EdgeClient(bundle, cloud.ws_url, retry=retry) as c:
        eos = set(c.tokenizer.eos_token_ids)
        for q in QUESTIONS:
            msgs = [{"role": "user", "content": q}]
            ref = _greedy(model, c.tokenizer.encode(c.tokenizer.apply_chat_template(msgs)), max_tokens, eos)
            got = c.complete(messages=msgs, max_tokens=max_tokens)
            agree = next((i for i, (a, b) in enumerate(zip(got.token_ids, ref)) if a != b),
                         min(len(ref), len(got.token_ids)))
            rows.append({"question": q, "ref_tokens": len(ref), "agree_prefix": agree,
                         "identical": got.token_ids == ref, "codec": got.stats.codec})
    return {"bundle": str(bundle), "edge_quant": "int8", "split_layer": 8, "max_new_tokens": max_tokens,
            "identical_sequences": sum(r["identical"] for r in rows) / len(rows),
            "tokens_before_first_divergence": sum(r["agree_prefix"] for r in rows)
            / sum(r["ref_tokens"] for r in rows),
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "edge_int8_e2e_agreement.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = measure(args.max_tokens, Path(tmp) / "cloud.log")
    report["command"] = shlex.join(["python", "bench/edge_e2e_agreement_bench.py", *(argv or sys.argv[1:])])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"int8 edge, end to end: {report['identical_sequences']:.0%} identical greedy sequences, "
          f"{report['tokens_before_first_divergence']:.0%} of tokens before the first divergence ({args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
