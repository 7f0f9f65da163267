"""Edge per-layer time of a full-size GLM-4.1V-9B text decoder layer on this CPU, int8 and int4 edges:
what ``autoglm-partition plan`` for AutoGLM-Phone-9B rests on.

A ``Glm4ForCausalLM`` with GLM-4.1V-9B's layer dimensions (hidden 4096, 32 heads, 2 KV heads of 128,
MLP 13696, qkv bias, half-rotary) and random weights (speed does not depend on weight values), 2 layers and
a 4,096-token vocabulary (the embedding is a row gather and the lm_head stays in the cloud, so the vocabulary
does not enter the edge's per-layer time), split at layer 1 with the edge recipe, timed by the edge runtime
(``partition_tools.plan.edge_layer_times``: ``edge_client.front.FrontRuntime``) at the given threads.

    python bench/glm4v_layer_edge_bench.py [--threads 2] [--contexts 16,256,2048] [--float-outliers 0] [--out docs/results/glm4v_layer_edge.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="16,256,2048")
    ap.add_argument("--quants", default="int8,int4")
    ap.add_argument("--float-outliers", type=int, default=0,
                    help="MatMuls the int8 recipe keeps fp32 (its default 2 would keep this one layer's down_proj: "
                         "0 times the layer every other layer of a deep front is)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "glm4v_layer_edge.json"))
    args = ap.parse_args()
    import torch
    from transformers import Glm4Config, Glm4ForCausalLM

    from partition_tools.models import LoadedModel
    from partition_tools.plan import edge_layer_times
    from partition_tools.split import SplitConfig, split

    cfg = Glm4Config(vocab_size=4096, hidden_size=4096, intermediate_size=13696, num_hidden_layers=2,
                     num_attention_heads=32, num_key_value_heads=2, head_dim=128, attention_bias=True,
                     partial_rotary_factor=0.5, max_position_embeddings=8192, rms_norm_eps=1e-5, pad_token_id=0,
                     bos_token_id=1, eos_token_id=[2], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Glm4ForCausalLM(cfg).eval()
    layer_params = sum(p.numel() for p in model.model.layers[0].parameters())
    lm = LoadedModel(model, None, "preset:glm4v-9b-layer-shape@seed0", "glm4v-9b-layer-shape")
    contexts = [int(c) for c in args.contexts.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for quant in args.quants.split(","):
            t0 = time.perf_counter()
            bundle = Path(tmp) / quant
            m = split(lm, SplitConfig(layer=1, out=bundle, edge_quant=quant, float_outliers=args.float_outliers))
            build_s = time.perf_counter() - t0
            t = edge_layer_times(bundle, args.threads, 128, contexts)
            edge_bytes = sum(a.bytes for a in m.artifacts.values() if a.role == "edge")
            results[quant] = {
                "decode_ms_per_layer": {str(k): 1000 * v for k, v in t["decode"].items()},
                "prefill_ms_per_token_layer": 1000 * t["prefill_per_token"], "graph": t["graph"],
                "edge_bytes_one_layer_plus_embedding": edge_bytes, "build_s": build_s,
            }
            print(f"{quant}: decode " + ", ".join(f"{v:.1f} ms @{k}" for k, v in results[quant]
                                                   ["decode_ms_per_layer"].items())
                  + f", prefill {results[quant]['prefill_ms_per_token_layer']:.2f} ms/token ({t['graph']} graph)",
                  flush=True)
    out = {"command": "python bench/glm4v_layer_edge_bench.py " + " ".join(sys.argv[1:]),
           "layer": {"hidden": 4096, "heads": 32, "kv_heads": 2, "head_dim": 128, "mlp": 13696,
                     "params": layer_params},
           "threads": args.threads, "float_outliers": args.float_outliers, "contexts": contexts, "results": results,
           "loadavg": list(os.getloadavg())}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
