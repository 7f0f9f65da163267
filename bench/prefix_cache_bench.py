"""Common-prompt activation cache: cold vs warm for an AutoGLM-style request, side by side in one run.

The request is the agent's fixed system prompt (``edge_client/data/autoglm_system_prompt.txt``, 2.7 KB of
English) plus a short user turn, greedy. Three runs against one local cloud server (real process, real
WebSocket):

* **cold** - empty edge cache, cloud never saw the prompt: the front layers run over the whole prompt and
  all its hidden states go up;
* **warm** - what an agent's step k > 1 sees: the edge preloaded the system prompt (``preload_prompts``) and
  the cloud holds its blocks from an earlier step with a *different* user turn. Only the suffix runs and goes
  up;
* **edge-warm, cloud-cold** (for reference) - a fresh cloud: the edge skips its front layers; its Welcome lists
  none of the prompt's blocks, so the prefix's hidden states go up from the edge cache with the first Prefill.

Per run: edge compute (front-layer seconds), uplink bytes of the request, TTFT, and the generated tokens
(which must be identical across runs). Each configuration is repeated ``--reps`` times with the median
reported. Writes ``docs/results/prefix_cache.json``.

    python bench/prefix_cache_bench.py [--bundle DIR] [--reps 3] [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PROMPT = ROOT / "edge_client" / "data" / "autoglm_system_prompt.txt"
USER_TURN = "Task: open the Settings app and turn on Wi-Fi. Screen: the home screen with app icons."
WARMUP_TURN = "Task: open the Clock app and set an alarm for 7:00. Screen: the home screen."


def _messages(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT.read_text().strip("\n")}, {"role": "user", "content": user}]


def _run(client, user: str, max_tokens: int) -> dict:
    gen = client.complete(messages=_messages(user), max_tokens=max_tokens, temperature=0.0)
    st = gen.stats
    return {"ttft_s": st.ttft_s, "edge_compute_s": st.edge_prefill_s, "bytes_up": st.bytes_up,
            "prefill_bytes_up": st.prefill_bytes_up, "prompt_tokens": st.prompt_tokens,
            "cached_tokens": st.cached_tokens, "uploaded_prompt_tokens": st.uploaded_prompt_tokens,
            "prefix_misses": st.prefix_misses, "bytes_down": st.bytes_down, "tokens": list(gen.token_ids),
            "text": gen.text, "codec": st.codec}


def _median(runs: list[dict], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, help="bundle dir (default: the demo's cached SmolLM2 bundle)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--codec", default=None, help="wire codec (default: the precision policy's choice)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "prefix_cache.json")
    args = ap.parse_args(argv)

    from edge_client.client import EdgeClient
    from edge_client.demo import LocalCloud, ensure_bundle

    bundle = ensure_bundle(args.bundle)
    runs: dict[str, list[dict]] = {"cold": [], "warm": [], "edge_warm_cloud_cold": []}
    t_start = time.time()
    for rep in range(args.reps):
        # cold, then warm-up with another user turn, then warm: one fresh cloud per repetition
        with LocalCloud(bundle) as cloud:
            kw = dict(threads=args.threads, cache_prompts=False, codec=args.codec)
            with EdgeClient(bundle, cloud.ws_url, **kw) as cold_client:
                runs["cold"].append(_run(cold_client, USER_TURN, args.max_tokens))
            with EdgeClient(bundle, cloud.ws_url, **kw) as client:
                client.preload_prompts(SYSTEM_PROMPT)
                _run(client, WARMUP_TURN, args.max_tokens)  # an earlier agent step: the cloud learns the prefix
                runs["warm"].append(_run(client, USER_TURN, args.max_tokens))
        with LocalCloud(bundle) as cloud, EdgeClient(bundle, cloud.ws_url, **kw) as client:
            client.preload_prompts(SYSTEM_PROMPT)
            runs["edge_warm_cloud_cold"].append(_run(client, USER_TURN, args.max_tokens))
        print(f"rep {rep + 1}/{args.reps}: cold TTFT {runs['cold'][-1]['ttft_s'] * 1e3:.0f} ms, "
              f"warm TTFT {runs['warm'][-1]['ttft_s'] * 1e3:.0f} ms", flush=True)

    ref = runs["cold"][0]["tokens"]
    identical = all(r["tokens"] == ref for rs in runs.values() for r in rs)
    summary = {}
    for name, rs in runs.items():
        summary[name] = {k: _median(rs, k) for k in ("ttft_s", "edge_compute_s", "bytes_up", "prefill_bytes_up",
                                                     "uploaded_prompt_tokens", "cached_tokens")}
    cold, warm = summary["cold"], summary["warm"]
    ratios = {
        "edge_compute": cold["edge_compute_s"] / max(warm["edge_compute_s"], 1e-9),
        "uplink_bytes": cold["bytes_up"] / max(warm["bytes_up"], 1),
        "ttft": cold["ttft_s"] / max(warm["ttft_s"], 1e-9),
    }
    from shared.manifest import Manifest

    m = Manifest.load(bundle)
    report = {
        "benchmark": "prefix_cache", "command": "python bench/prefix_cache_bench.py " + " ".join(argv or sys.argv[1:]),
        "bundle": {"path": str(bundle), "source": m.source, "split_layer": m.split_layer,
                   "num_layers": m.num_layers, "edge_quant": m.edge_quant, "bundle_id": m.bundle_id},
        "request": {"system_prompt_bytes": len(SYSTEM_PROMPT.read_bytes()), "user_turn": USER_TURN,
                    "prompt_tokens": runs["cold"][0]["prompt_tokens"], "max_tokens": args.max_tokens,
                    "greedy": True, "codec": runs["cold"][0]["codec"]},
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "edge_threads": args.threads, "cloud": "local CPU process (same machine)"},
        "reps": args.reps, "median": summary, "cold_over_warm": ratios, "identical_output": identical,
        "targets": {"edge_compute": 10.0, "uplink_bytes": 10.0, "ttft": 5.0},
        "targets_met": {"edge_compute": ratios["edge_compute"] >= 10, "uplink_bytes": ratios["uplink_bytes"] >= 10,
                        "ttft": ratios["ttft"] >= 5, "identical_output": identical},
        "output_text": runs["cold"][0]["text"], "runs": runs, "wall_s": time.time() - t_start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'':24}{'cold':>12}{'warm':>12}{'cold/warm':>11}")
    for label, key, scale, unit in (("edge compute", "edge_compute_s", 1e3, "ms"), ("uplink", "bytes_up", 1 / 1024, "KiB"),
                                    ("TTFT", "ttft_s", 1e3, "ms")):
        r = cold[key] / max(warm[key], 1e-9)
        print(f"{label + ' (' + unit + ')':24}{cold[key] * scale:12.1f}{warm[key] * scale:12.1f}{r:10.1f}x")
    print(f"edge-warm/cloud-cold: TTFT {summary['edge_warm_cloud_cold']['ttft_s'] * 1e3:.0f} ms, "
          f"uplink {summary['edge_warm_cloud_cold']['bytes_up'] / 1024:.1f} KiB (prefix resent from the edge cache)")
    print(f"identical output across all runs: {identical}\nwrote {args.out}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
