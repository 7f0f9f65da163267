"""Inversion benchmark: the fraction of input tokens the cloud recovers from the boundary hidden states.

For SmolLM2-135M at split layers N (default 0, 1, 2, 4, 8, 16; N = 0 sends the embeddings themselves, the
control where the trivial attack must be exact), this

1. tokenizes the two corpora of ``bench/inversion_corpus.py`` - the attacker's training text and a disjoint,
   held-out test text (chat, code, Chinese, numbers, prose) - checks that they are disjoint, and cuts every
   document into windows of at most ``--window`` tokens, each its own sequence (positions from 0);
2. collects the boundary states after layers [0, N) of both (``partition_tools.privacy.boundary_states``, an fp32
   front);
3. builds each wire codec from the calibration ``autoglm-partition split`` would store for that N
   (``partition_tools.split.calibrate`` on the built-in calibration text) and sends the test states through it,
   one encode + decode per window;
4. runs every attack of ``partition_tools.privacy`` per N and codec, each fitted on the clean training states:
   ``embedding`` (nearest embedding row), ``nearest`` (nearest training state), ``linear`` (linear inverter into
   the embedding space) and ``linear-ctx`` (the same, also seeing one neighbouring state on each side); states
   through a codec meet the two strongest, ``nearest`` and ``linear-ctx`` (the time budget);
5. reports the fraction of test tokens recovered (top-1): overall, per kind and the mean over kinds, and for
   the tokens the training text never had (the closed-set ``nearest`` attack cannot name those); writes
   ``--json``.

Everything is deterministic: the corpora are fixed (the number records come from fixed seeds), the attacks
are closed-form. Usage (the figures in docs/security.md)::

    python bench/inversion_bench.py --json docs/results/privacy_inversion.json

References: arXiv:2602.16760 (~59 % of input tokens recovered at a 2-layer split, ~35 % at 8 layers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import inversion_corpus as corpus  # noqa: E402 (run as a script from bench/)

ATTACKS = ("embedding", "nearest", "linear", "linear-ctx")
CODEC_ATTACKS = ("nearest", "linear-ctx")  # through a codec: the two strongest on clean states (time budget)
DEFAULT_CODECS = ("fp16", "int8-outlier", "int4-outlier")
PAPER = {"source": "arXiv:2602.16760", "recovered": {"2": 0.59, "8": 0.35}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="partition_tools.models.load_model source (needs a tokenizer)")
    p.add_argument("--layers", default="0,1,2,4,8,16", help="split layers N (comma-separated)")
    p.add_argument("--codecs", default=",".join(DEFAULT_CODECS),
                   help="wire codecs to attack through (comma-separated; '' for none)")
    p.add_argument("--window", type=int, default=256, help="tokens per window (longer documents are cut)")
    p.add_argument("--calib-tokens", type=int, default=512, help="calibration tokens for the outlier codecs")
    p.add_argument("--outlier-k", type=int, default=8, help="outlier channels of the outlier codecs")
    p.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "2")))
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(argv)


def _digest(docs) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(d.kind.encode() + b"\0" + d.text.encode() + b"\0")
    return h.hexdigest()


def _kinds(docs, token_ids) -> list[str]:
    return [d.kind for d, ids in zip(docs, token_ids) for _ in ids]


def _by_kind(hit, kinds: list[str]) -> dict[str, float]:
    out = {}
    for k in sorted(set(kinds)):
        mask = [i for i, kk in enumerate(kinds) if kk == k]
        out[k] = round(float(hit[mask].float().mean()), 4)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from partition_tools import privacy as P
    from partition_tools.adapters import ModelAdapter
    from partition_tools.models import load_model
    from partition_tools.split import calibrate, calibration_ids
    from shared.codecs import available_codecs

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)  # no step draws random numbers today; seeded so one that starts to stays deterministic
    layers = sorted({int(x) for x in args.layers.split(",") if x.strip()})
    codec_names = [c for c in args.codecs.split(",") if c.strip()]
    timings: dict[str, float] = {}
    started = time.perf_counter()

    # 1. corpora
    t = time.perf_counter()
    lm = load_model(args.model)
    if lm.tokenizer is None:
        raise SystemExit(f"--model {args.model}: has no tokenizer; the corpora are text")
    adapter = ModelAdapter(lm.model)
    timings["load_model"] = time.perf_counter() - t
    train_docs, test_docs = corpus.training_corpus(lm.tokenizer), corpus.test_corpus(lm.tokenizer)
    corpus.check_disjoint(train_docs, test_docs)
    train_tok = [lm.tokenizer(d.text).input_ids for d in train_docs]
    test_tok = [lm.tokenizer(d.text).input_ids for d in test_docs]
    test_kinds = _kinds(test_docs, test_tok)

    # 2. boundary states
    t = time.perf_counter()
    train = P.boundary_states(adapter, P.windows(train_tok, args.window), layers)
    test = P.boundary_states(adapter, P.windows(test_tok, args.window), layers)
    timings["boundary_states"] = time.perf_counter() - t
    seen = torch.isin(test.ids, train.ids)  # [T] closed-set attacks can only name these
    print(f"train {train.ids.numel()} tokens, test {test.ids.numel()} tokens "
          f"({seen.float().mean():.1%} of them occur in the training text)", flush=True)

    # 3. codecs, from each layer's calibration
    t = time.perf_counter()
    calib_ids = calibration_ids(lm, adapter, args.calib_tokens)
    variants: dict[tuple[int, str], torch.Tensor] = {}  # (N, codec) -> test states as the cloud decodes them
    for n in layers:
        variants[(n, P.NO_CODEC)] = test.states[n]
        if n == 0 or not codec_names:
            continue  # N = 0 is the control: embeddings as they are
        codecs = available_codecs(calibrate(adapter, calib_ids, n, args.outlier_k))
        for name in codec_names:
            if name not in codecs:
                raise SystemExit(f"--codecs: unknown codec {name!r} (known: {', '.join(codecs)})")
            variants[(n, name)] = P.through_codec(test.states[n], test.position, codecs[name])
    timings["codecs"] = time.perf_counter() - t

    # 4. attacks
    t = time.perf_counter()
    embedding = adapter.embed_tokens.weight.detach().float()  # [V, H]
    records = []
    for n in layers:
        inverters = {
            "linear": P.train_inverter(train.states[n], train.ids, train.position, embedding, P.InverterConfig()),
            "linear-ctx": P.train_inverter(train.states[n], train.ids, train.position, embedding,
                                           P.InverterConfig(context=1)),
        }
        for (vn, codec), states in variants.items():
            if vn != n:
                continue
            attacks = ATTACKS if codec == P.NO_CODEC else CODEC_ATTACKS
            for attack in attacks:
                if attack == "embedding":
                    guess = P.embedding_match(states, embedding)
                elif attack == "nearest":
                    guess = P.nearest_neighbour(train.states[n], train.ids, states)
                else:
                    guess = inverters[attack].predict(states, test.position)
                hit = guess == test.ids  # [T]
                by_kind = _by_kind(hit, test_kinds)
                records.append({
                    "layer": n, "codec": codec, "attack": attack,
                    "recovered": round(P.recovered(guess, test.ids), 4),
                    "recovered_unseen": round(float(hit[~seen].float().mean()), 4) if (~seen).any() else None,
                    "kind_mean": round(sum(by_kind.values()) / len(by_kind), 4),
                    "by_kind": by_kind,
                })
            row = {r["attack"]: r["recovered"] for r in records[-len(attacks):]}
            print(f"N={n:2d} {codec:12s} " + "  ".join(f"{a} {v:.3f}" for a, v in row.items()), flush=True)
    timings["attacks"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - started

    best: dict[str, dict[str, float]] = {}
    for r in records:
        cur = best.setdefault(r["codec"], {}).get(str(r["layer"]), 0.0)
        best[r["codec"]][str(r["layer"])] = max(cur, r["recovered"])

    _print_table(records, layers)
    if args.json:
        out = {
            "command": "python " + " ".join(shlex.quote(a) for a in [f"bench/{Path(__file__).name}",
                                                                      *(argv if argv is not None else sys.argv[1:])]),
            "model": lm.identity,
            "layers": layers,
            "codecs": [P.NO_CODEC, *codec_names],
            "attacks": list(ATTACKS),
            "codec_attacks": list(CODEC_ATTACKS),
            "corpus": {
                "window": args.window,
                "train_tokens": int(train.ids.numel()), "test_tokens": int(test.ids.numel()),
                "train_documents": len(train_docs), "test_documents": len(test_docs),
                "train_tokens_by_kind": _count(_kinds(train_docs, train_tok)),
                "test_tokens_by_kind": _count(test_kinds),
                "test_tokens_in_train_vocab": round(float(seen.float().mean()), 4),
                "train_sha256": _digest(train_docs), "test_sha256": _digest(test_docs),
                "stdlib_modules": list(corpus.STDLIB_MODULES),
            },
            "seeds": {"torch": 0, "number_records_train": 1, "number_records_test": 2},
            "calibration": {"tokens": args.calib_tokens, "outlier_k": args.outlier_k},
            "records": records,
            "best": best,
            "reference": PAPER,
            "timings_s": {k: round(v, 1) for k, v in timings.items()},
            "platform": {"python": platform.python_version(), "torch": torch.__version__,
                         "machine": platform.machine(), "threads": args.threads},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _count(kinds: list[str]) -> dict[str, int]:
    return {k: kinds.count(k) for k in sorted(set(kinds))}


def _print_table(records, layers) -> None:
    codecs = list(dict.fromkeys(r["codec"] for r in records))
    print("\nfraction of held-out input tokens recovered (top-1), best attack [attack]")
    print("| codec | " + " | ".join(f"N={n}" for n in layers) + " |")
    print("|---|" + "---|" * len(layers))
    for c in codecs:
        cells = []
        for n in layers:
            rs = [r for r in records if r["codec"] == c and r["layer"] == n]
            if rs:
                b = max(rs, key=lambda r: r["recovered"])
                cells.append(f"{b['recovered']:.1%} [{b['attack']}]")
            else:
                cells.append("-")
        print(f"| {c} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
