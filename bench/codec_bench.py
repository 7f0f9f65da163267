"""Boundary codec benchmark: wire bytes, coding time and split-model quality of every codec in shared.codecs.

For SmolLM2-135M split at layers 4, 8 and 16, with an fp32 edge (so the codec alone is judged), this

1. runs the unsplit fp32 model over ``--windows`` windows of ``--window-tokens`` tokens of the built-in English
   text (each window a fresh sequence starting at position 0, so every window has its attention sink), keeping
   the boundary hidden states after layers [0, N) and the reference log-probabilities;
2. calibrates the outlier-aware codecs from the *last* ``--calib-tokens`` tokens of the same text (disjoint from
   the evaluation windows) with :func:`shared.codecs.find_outlier_channels` / ``find_sink_threshold``, and the
   PCA codecs from the text after its first 1,024 tokens (``partition_tools.codec_calibration``: the windows,
   targets and fit the partition tool writes into the bundle), exactly as the partition tool does at split time;
3. for every codec and layer: codes the boundary in prefill chunks of ``--chunk`` tokens, decodes it, runs layers
   [N, L) + norm + lm_head, and compares with the reference: top-1 agreement, mean KL(ref || split) and the split
   model's perplexity on the next tokens (every codec here codes rows independently, so single-token decode
   messages give the same hidden states; the script checks that);
4. measures bytes per hidden element of whole protocol frames (``encode_message``): a ``--chunk``-token Prefill
   and single-token DecodeSteps (of positions 1-64, the largest states, which the goals judge; and of the
   window's last 64 positions, the states of decode steps after a prompt, recorded as ``*_decode_late`` and
   ``goals_met_late_messages``), each with and without zstd; and the encode+decode time per token relative
   to fp16 (median of ``--repeats``);
5. optionally (``--compute``) measures the cloud compute variants (fp32, bf16, fp16, int8 weight-only) of the
   back half at one split layer with the fp16 codec, over one ``--compute-window-tokens`` window, by
   prompt-position bucket (0-127, 128-511, 512+): the evidence for shared.precision's compute policy;
6. optionally (``--ablations``) judges the variants tried on the way to ``int4-outlier`` (fake quantization at
   one layer: outlier channels, Hadamard rotation, midrise vs NF4 levels, channel pre-scaling, block and
   scale formats, k);
7. times encode + decode per token at GLM's hidden size 4096 (synthetic states, a 4096-wide orthonormal basis:
   the speed does not depend on the values) for ``int8-outlier`` and the PCA codecs (``--speed-hidden``; 128-token
   chunks, 16 single-token messages, median of 5);
8. prints markdown tables and writes ``--json`` (one record per codec and layer).

Usage (the numbers in docs/quality.md)::

    python bench/codec_bench.py --compute --ablations --json docs/results/codecs.json
    python bench/codec_bench.py --codecs fp16,int8-outlier,pca-fine,pca-compact,pca-ans-compact \
        --json docs/results/codecs.json --merge
    python bench/codec_bench.py --codecs fp16,pca-ans-compact,pca-tcq-compact --json docs/results/codecs.json --merge

References: docs/quality.md ("Boundary codecs"); Petals (Borzunov et al., 2023) for the blockwise-int8 anchor.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shared import codecs as C  # noqa: E402 (run as a script from bench/)
from shared import protocol as P  # noqa: E402

GOALS = {  # docs/quality.md: judged with an fp32 edge
    "near_lossless": {"bytes_per_element": 1.05, "top1_agreement": 0.995, "mean_kl": 0.001},
    "compact": {"bytes_per_element": 0.6, "top1_agreement": 0.97, "mean_kl": 0.01},
    # issue 14's codec moonshot: the same quality at fewer bytes
    "near_lossless_0.8": {"bytes_per_element": 0.8, "top1_agreement": 0.995, "mean_kl": 0.001},
    "compact_0.3": {"bytes_per_element": 0.3, "top1_agreement": 0.97, "mean_kl": 0.01},
}
BUCKETS = ((0, 128), (128, 512), (512, 1 << 30))  # prompt positions, matching the policy's thresholds


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="partition_tools.models.load_model source")
    p.add_argument("--layers", default="4,8,16", help="split layers N (comma-separated)")
    p.add_argument("--codecs", default=",".join(C.CODEC_NAMES), help="codecs to judge (comma-separated)")
    p.add_argument("--windows", type=int, default=2, help="evaluation windows (fresh sequences)")
    p.add_argument("--window-tokens", type=int, default=512, help="tokens per evaluation window")
    p.add_argument("--calib-tokens", type=int, default=1024, help="calibration tokens (end of the text)")
    p.add_argument("--outlier-k", type=int, default=8, help="outlier channels kept in float16")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens per Prefill message)")
    p.add_argument("--decode-messages", type=int, default=64, help="single-token messages to size and time")
    p.add_argument("--repeats", type=int, default=15, help="timing repeats (median of per-repeat ratios)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "2")))
    p.add_argument("--compute", action="store_true", help="also judge cloud compute variants (step 5)")
    p.add_argument("--compute-layer", type=int, default=8)
    p.add_argument("--compute-window-tokens", type=int, default=1024, help="one window, from the text's start")
    p.add_argument("--ablations", action="store_true", help="also judge the variants tried on the way (step 6)")
    p.add_argument("--ablation-layer", type=int, default=16)
    p.add_argument("--speed-hidden", type=int, default=4096, help="hidden size of the synthetic timing (0: skip)")
    p.add_argument("--json", type=Path, default=None, help="write the records here")
    p.add_argument("--merge", action="store_true",
                   help="keep --json's other records: this run's (codec, layer) records replace theirs, and its "
                        "command is added to the file's merged_commands")
    return p.parse_args(argv)


# -- model plumbing (mirrors transformers 5.x LlamaModel.forward: rotary once, sdpa causal, no cache) ----------

class SplitModel:
    def __init__(self, model, torch):
        self.m, self.torch = model, torch

    def _pos(self, t: int):
        return self.torch.arange(t).unsqueeze(0)  # [1, T]

    def run_layers(self, h, lo: int, hi: int, capture=()):
        """h [1, T, H] through layers [lo, hi); returns (h, {n: boundary [T, H] numpy for n in capture})."""
        pos = self._pos(h.shape[1])
        pe = self.m.model.rotary_emb(h, pos)
        got = {}
        for i in range(lo, hi):
            if i in capture:
                got[i] = h[0].numpy().copy()
            h = self.m.model.layers[i](h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        if hi in capture:
            got[hi] = h[0].numpy().copy()
        return h, got

    def logprobs(self, h):
        logits = self.m.lm_head(self.m.model.norm(h))[0].float()  # [T, V]
        return self.torch.log_softmax(logits, dim=-1)

    def front(self, ids, capture, logprobs: bool = True):
        """Boundaries after layers [0, n) for n in ``capture``; with ``logprobs`` the whole model runs."""
        h = self.m.model.embed_tokens(ids.unsqueeze(0))  # [1, T, H]
        hi = len(self.m.model.layers) if logprobs else max(capture)
        h, got = self.run_layers(h, 0, hi, capture)
        return got, (self.logprobs(h) if logprobs else None)

    def back(self, boundary: np.ndarray, layer: int, model=None):
        m = model or self.m
        torch = self.torch
        dtype = next(m.parameters()).dtype
        h = torch.from_numpy(np.ascontiguousarray(boundary)).unsqueeze(0).to(dtype)  # [1, T, H]
        pos = self._pos(h.shape[1])
        pe = m.model.rotary_emb(h, pos)
        for lyr in m.model.layers[layer:]:
            h = lyr(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        return torch.log_softmax(m.lm_head(m.model.norm(h))[0].float(), dim=-1)


def compare(ref, out, ids, torch):
    """Per-position top-1 agreement and KL(ref || out), and next-token NLL of ``out`` (positions 0..T-2)."""
    agree = (ref.argmax(-1) == out.argmax(-1)).double().numpy()
    kl = (ref.exp() * (ref - out)).sum(-1).double().numpy()
    nll = -out[:-1].gather(1, ids[1:].unsqueeze(1))[:, 0].double().numpy()
    return agree, kl, nll


def summarize(agree, kl, nll):
    pos = np.concatenate([np.arange(len(a)) for a in agree])
    a, k = np.concatenate(agree), np.concatenate(kl)
    rec = {"top1_agreement": float(a.mean()), "mean_kl": float(k.mean()),
           "perplexity": float(np.exp(np.concatenate(nll).mean())), "tokens": int(a.size)}
    rec["by_position"] = {f"{lo}-{min(hi, pos.max() + 1) - 1}": {"top1_agreement": float(a[(pos >= lo) & (pos < hi)].mean()),
                                                              "mean_kl": float(k[(pos >= lo) & (pos < hi)].mean())}
                          for lo, hi in BUCKETS if ((pos >= lo) & (pos < hi)).any()}
    return rec


# -- wire measurements --------------------------------------------------------------------------------------

def frame_sizes(codec, boundary: np.ndarray, chunk: int, n_decode: int) -> dict:
    """Bytes per hidden element of whole frames: one ``chunk``-token Prefill, and single-token DecodeSteps of
    rows 1..n_decode (``decode``: the first positions after the sink, the largest states) and of the window's
    last n_decode rows (``decode_late``: states at the positions of decode steps after a prompt that long)."""
    x = boundary[:chunk]
    out = {}
    for z in (False, True):
        zs = "_zstd" if z else ""
        msg = P.Prefill(request_id="bench-0001", start=0, hidden=codec.encode(x, zstd=z), last=True,
                        params=P.SamplingParams(max_tokens=256))
        out["prefill" + zs] = len(P.encode_message(msg)) / x.size
        out["prefill_payload" + zs] = len(msg.hidden.data) / x.size
        for kind, rows in (("decode", boundary[1:1 + n_decode]), ("decode_late", boundary[-n_decode:])):
            total = payload = 0
            for i in range(rows.shape[0]):
                step = P.DecodeStep(request_id="bench-0001", position=chunk + i,
                                    hidden=codec.encode(rows[i:i + 1], zstd=z))
                total += len(P.encode_message(step))
                payload += len(step.hidden.data)
            out[kind + zs] = total / rows.size
            out[kind + "_payload" + zs] = payload / rows.size
    return out


def coding_times(codecs: dict, boundary: np.ndarray, chunk: int, n_decode: int, repeats: int) -> dict:
    """Encode+decode seconds per token of every codec, in ``chunk``-token blocks and as single-token messages.

    Codecs run round-robin within each repeat, and the ratio to fp16 is taken per repeat before the median,
    so that load from other processes hits all codecs alike.
    """
    x = boundary[:chunk]
    rows = [boundary[1 + i:2 + i] for i in range(n_decode)]
    raw = {name: {"prefill": [], "decode": []} for name in codecs}
    for _ in range(repeats):
        for name, codec in codecs.items():
            t0 = time.perf_counter()
            codec.decode(codec.encode(x))
            raw[name]["prefill"].append((time.perf_counter() - t0) / x.shape[0])
            t0 = time.perf_counter()
            for r in rows:
                codec.decode(codec.encode(r))
            raw[name]["decode"].append((time.perf_counter() - t0) / len(rows))
    out = {}
    for name, t in raw.items():
        rec = {"prefill_s_per_token": float(np.median(t["prefill"])), "decode_s_per_token": float(np.median(t["decode"]))}
        if "fp16" in raw:
            for kind in ("prefill", "decode"):
                rec[f"time_vs_fp16_{kind}"] = float(np.median(np.array(t[kind]) / np.array(raw["fp16"][kind])))
        out[name] = rec
    return out


def goals_met(rec: dict, bytes_per_element: float) -> list[str]:
    return [g for g, lim in GOALS.items() if bytes_per_element <= lim["bytes_per_element"]
            and rec["top1_agreement"] >= lim["top1_agreement"] and rec["mean_kl"] <= lim["mean_kl"]]


def code_in_chunks(codec, boundary: np.ndarray, chunk: int) -> np.ndarray:
    parts = [codec.decode(codec.encode(boundary[i:i + chunk])) for i in range(0, boundary.shape[0], chunk)]
    return np.concatenate(parts, axis=0)  # [T, H]


# -- compute variants (step 5) --------------------------------------------------------------------------------

def compute_variant_model(model, variant: str, torch):
    """A copy of ``model`` whose back half runs as ``variant`` (int8: weight-only, per-output-channel absmax,
    dequantized on the fly - the numerics of a weight-only int8 GEMM with float accumulation)."""
    import copy

    m = copy.deepcopy(model)
    if variant == "fp32":
        return m
    if variant in ("bf16", "fp16"):
        return m.to(torch.bfloat16 if variant == "bf16" else torch.float16)
    if variant == "int8":
        with torch.no_grad():
            for layer in m.model.layers:
                for mod in layer.modules():
                    if isinstance(mod, torch.nn.Linear):
                        w = mod.weight
                        s = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
                        w.copy_(torch.clamp(torch.round(w / s), -127, 127) * s)
        return m
    raise ValueError(variant)


# -- ablations (--ablations): what was tried on the way to int4-outlier, as fake-quantization -----------------

NF4_LEVELS = np.array([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461,
                       0.3379, 0.4407, 0.5626, 0.7230, 1.0], np.float32)  # QLoRA's NormalFloat4 (Dettmers 2023)


def fake_quant(x, ch, bits=4, block=32, rotate=0, levels="sym", scales="f16", prescale=None):
    """Quantize-dequantize x [T, H]: channels ``ch`` float16, the rest in ``block``s (optionally Hadamard-rotated
    in groups of ``rotate``) with ``levels`` (sym: -q..q round; midrise: 2^bits levels; nf4) and ``scales``
    (f16 per block, or log8: one byte per block relative to a per-row reference)."""
    from shared.codecs_outlier import hadamard, rotation_signs

    t, h = x.shape
    rest = np.setdiff1d(np.arange(h), ch)
    r = x[:, rest] / (prescale if prescale is not None else 1)
    n = r.shape[1]
    if rotate:
        nf = n // rotate * rotate
        hm, sg = hadamard(rotate), rotation_signs(rotate)
        r = r.copy()
        r[:, :nf] = ((r[:, :nf].reshape(t, -1, rotate) * sg) @ hm).reshape(t, nf)
    nb = -(-n // block)
    z = np.concatenate([r, np.zeros((t, nb * block - n), np.float32)], 1).reshape(t, nb, block)
    amax = np.abs(z).max(-1, keepdims=True)
    if scales == "log8":
        ref = amax.max(1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            e = np.clip(np.nan_to_num(np.floor(-16 * np.log2(amax / ref)), nan=255, posinf=255), 0, 255)
        amax = ref * np.exp2(-e / 16)
    else:
        amax = amax.astype(np.float16).astype(np.float32)
    amax = np.where(amax > 0, amax, 1)
    if levels == "sym":
        qmax = 2 ** (bits - 1) - 1
        q = np.clip(np.rint(z / amax * qmax), -qmax, qmax) * amax / qmax
    elif levels == "midrise":
        half = 2 ** (bits - 1)
        q = (np.clip(np.floor(z / amax * half), -half, half - 1) + 0.5) * amax / half
    else:
        q = NF4_LEVELS[np.abs((z / amax)[..., None] - NF4_LEVELS).argmin(-1)] * amax
    q = q.reshape(t, -1)[:, :n]
    if rotate:
        q[:, :nf] = ((q[:, :nf].reshape(t, -1, rotate) @ hadamard(rotate)) * rotation_signs(rotate)).reshape(t, nf)
    out = x.astype(np.float16).astype(np.float32)
    out[:, rest] = q * (prescale if prescale is not None else 1)
    return out


def ablations(calib: np.ndarray, k: int) -> dict:
    """name -> (bytes per element, fake-quant function [T, H] -> [T, H]); calibration ``calib`` [T, H]."""
    h = calib.shape[1]
    ch8 = C.find_outlier_channels(calib, k)
    rest = np.setdiff1d(np.arange(h), ch8)
    sigma = calib[:, rest].std(0)
    pre = (sigma ** 0.5 / np.exp(np.log(sigma ** 0.5).mean())).astype(np.float32)  # geometric mean 1
    pre4 = (sigma ** 0.25 / np.exp(np.log(sigma ** 0.25).mean())).astype(np.float32)
    thr = C.find_sink_threshold(calib, ch8)
    def real(c):  # a wire codec: (its payload bytes per element, its round trip)
        return c.payload_bytes(512, h) / (512 * h), lambda x: c.decode(c.encode(x))

    def fq(bits=4, block=32, **kw):  # fake quantization with k float16 outliers and float16 (or byte) block scales
        n = h - k
        scale_bytes = 2 * -(-n // block) if kw.get("scales", "f16") == "f16" else -(-n // block) + 4
        return (2 * k + n * bits / 8 + scale_bytes) / h, lambda x: fake_quant(x, ch8, bits, block, **kw)

    def i4(kk):
        return real(C.get_codec("int4-outlier", outlier_channels=C.find_outlier_channels(calib, kk), sink_threshold=thr))

    return {
        "int4-b32 (plain blockwise)": real(C.get_codec("int4-b32")),
        "+ k outliers fp16": fq(),
        "+ Hadamard-32 rotation": fq(rotate=32),
        "+ midrise levels": fq(rotate=32, levels="midrise"),
        "+ NF4 levels instead": fq(rotate=32, levels="nf4"),
        "+ per-channel pre-scale x / sigma^0.5": fq(rotate=32, levels="midrise", prescale=pre),
        "+ Hadamard-64, blocks of 64": fq(block=64, rotate=64, levels="midrise"),
        "+ byte log-scales, blocks of 16 (int4-outlier)": i4(k),
        "int4-outlier layout, pre-scale x / sigma^0.25 (no sinks)": fq(block=16, rotate=16, levels="midrise",
                                                                    scales="log8", prescale=pre4),
        "int4-outlier with k=4": i4(4),
        "int4-outlier with k=16": i4(16),
        "int8-b64 + k outliers": fq(bits=8, block=64),
        "int8 per-row scale + k outliers (int8-outlier)": real(C.get_codec("int8-outlier", outlier_channels=ch8,
                                                                           sink_threshold=thr)),
    }


# -- PCA codecs: calibration as the partition tool does it, and timing at a large hidden size (step 7) ---------

def pca_calibration(sm, lm, layers) -> dict:
    """layer -> PcaBasis, from the partition tool's codec calibration windows (disjoint from the evaluation)."""
    from partition_tools.codec_calibration import TARGETS, codec_calibration_windows
    from shared.codecs_pca import calibrate_pca

    states = {}
    for w in codec_calibration_windows(lm, lm.model.config.vocab_size):
        got, _ = sm.front(w[0], set(layers), logprobs=False)
        for n, b in got.items():
            states.setdefault(n, []).append(b)
    return {n: calibrate_pca(np.concatenate(v), TARGETS) for n, v in states.items()}


def large_hidden_times(h: int, chunk: int, n_decode: int, repeats: int) -> dict:
    """Encode + decode seconds per token at hidden size ``h`` for int8-outlier and the PCA codecs, on synthetic
    states with a decaying spectrum in a Hadamard basis (orthonormal; the codecs' cost does not depend on
    which basis), levels fitted to the calibration targets as ``calibrate_pca`` does."""
    from partition_tools.codec_calibration import TARGETS
    from shared.codecs_outlier import hadamard
    from shared.codecs_pca import PcaBasis, fit_levels

    rng = np.random.default_rng(0)
    sd = 4.0 / np.sqrt(1 + np.arange(h))  # [H] component spreads
    coef = rng.standard_normal((2 * chunk, h)) * sd  # [T, H]
    basis = hadamard(h)
    pca = PcaBasis(np.zeros(h, np.float32), basis, fit_levels(coef[chunk:], TARGETS))
    x = (coef[:chunk] @ basis.T).astype(np.float32)
    x[:, 7] += 300.0  # a massive channel for int8-outlier's outlier list
    codecs = {"fp16": C.get_codec("fp16"),
              "int8-outlier": C.get_codec("int8-outlier", outlier_channels=list(range(7, 7 + 8 * 16, 16))),
              **{name: C.get_codec(name, basis=pca) for name in C.BASIS_CODECS}}
    return coding_times(codecs, x, chunk, n_decode, repeats)  # [chunk, H] float64 GEMMs: minutes at 4096


def merge_results(old: dict, new: dict) -> dict:
    """``old`` with ``new``'s records in place of the same (codec, layer), its timing at a large hidden size,
    and its command in ``merged_commands`` (the rest of ``old`` - compute variants, ablations - stays)."""
    for key in ("model", "windows", "window_tokens", "chunk"):
        if old.get(key) != new[key]:
            sys.exit(f"--merge: {key} differs ({old.get(key)!r} in the file, {new[key]!r} now): run the full command")
    mine = {(r["codec"], r["layer"]) for r in new["records"]}
    out = dict(old)
    out["records"] = [r for r in old["records"] if (r["codec"], r["layer"]) not in mine] + new["records"]
    out["goals"] = new["goals"]
    out["speed_large_hidden"] = new["speed_large_hidden"]
    out["merged_commands"] = [*old.get("merged_commands", []), {"command": new["command"], "wall_s": new["wall_s"],
                                                                "records": sorted(f"{c}@{n}" for c, n in mine)}]
    return out


# -- main -------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from partition_tools.models import load_model

    t_start = time.perf_counter()
    layers = [int(x) for x in args.layers.split(",")]
    names = [x for x in args.codecs.split(",") if x]
    for n in names:
        if n not in C.CODECS:
            sys.exit(f"unknown codec {n!r}; known: {', '.join(C.CODEC_NAMES)}")
    lm = load_model(args.model)
    model, tok = lm.model.eval(), lm.tokenizer
    text = (ROOT / "partition_tools" / "data" / "sample.txt").read_text()
    ids = tok(text, return_tensors="pt").input_ids[0]  # [N]
    W, nw = args.window_tokens, args.windows
    if nw * W + args.calib_tokens > ids.numel():
        sys.exit(f"text has {ids.numel()} tokens; need {nw * W} for evaluation + {args.calib_tokens} for calibration")
    from partition_tools.codec_calibration import EVAL_TOKENS

    if any(n in C.BASIS_CODECS for n in names) and nw * W > EVAL_TOKENS:
        sys.exit(f"the PCA codecs calibrate on the text after its first {EVAL_TOKENS} tokens: evaluate on at most "
                 f"{EVAL_TOKENS} tokens (windows x window tokens)")
    windows = [ids[i * W:(i + 1) * W] for i in range(nw)]
    calib_ids = ids[-args.calib_tokens:]
    sm = SplitModel(model, torch)
    print(f"# {args.model}: {len(model.model.layers)} layers, hidden {model.config.hidden_size}; "
          f"{nw} x {W} evaluation tokens, {args.calib_tokens} calibration tokens, {args.threads} threads",
          file=sys.stderr)

    with torch.inference_mode():
        # 1. reference passes (boundaries + log-probs), checked once against the stock forward
        refs = []
        for w in windows:
            bounds, lp = sm.front(w, set(layers))
            refs.append((bounds, lp))
        stock = torch.log_softmax(model(windows[0].unsqueeze(0)).logits[0].float(), -1)
        drift = float((stock - refs[0][1]).abs().max())
        if drift > 1e-3:
            sys.exit(f"manual forward differs from model.forward by {drift}: the layer plumbing is wrong")
        ref_nll = np.concatenate([-lp[:-1].gather(1, w[1:].unsqueeze(1))[:, 0].double().numpy()
                                  for (_, lp), w in zip(refs, windows)])
        ref_ppl = float(np.exp(ref_nll.mean()))
        # 2. calibration (disjoint text), per layer
        calib = {}
        for start in range(0, calib_ids.numel(), W):
            got, _ = sm.front(calib_ids[start:start + W], set(layers), logprobs=False)
            for n, b in got.items():
                calib.setdefault(n, []).append(b)
        calib = {n: np.concatenate(v) for n, v in calib.items()}  # [T_cal, H]
        bases = pca_calibration(sm, lm, layers) if any(n in C.BASIS_CODECS for n in names) else {}
        print(f"# reference perplexity {ref_ppl:.3f}; setup {time.perf_counter() - t_start:.0f} s", file=sys.stderr)

        records = []
        for n in layers:
            ch = C.find_outlier_channels(calib[n], args.outlier_k)
            thr = C.find_sink_threshold(calib[n], ch)
            codecs = {}
            for name in names:
                kw = ({"outlier_channels": ch, "sink_threshold": thr} if name in C.OUTLIER_CODECS
                      else {"basis": bases[n]} if name in C.BASIS_CODECS else {})
                codecs[name] = C.get_codec(name, **kw)
            layer_records = []
            for name, codec in codecs.items():
                t0 = time.perf_counter()
                agree, kl, nll = [], [], []
                for (bounds, lp), w in zip(refs, windows):
                    b = bounds[n]  # [W, H] fp32 edge output
                    coded = code_in_chunks(codec, b, args.chunk)
                    rows = np.concatenate([codec.decode(codec.encode(b[i:i + 1])) for i in range(8)])
                    if not np.array_equal(rows, coded[:8]):
                        sys.exit(f"{name}: per-token coding differs from chunk coding; quality numbers would not "
                                 "hold for decode steps")
                    a, k, x = compare(lp, sm.back(coded, n), w, torch)
                    agree.append(a), kl.append(k), nll.append(x)
                rec = {"codec": name, "layer": n, **summarize(agree, kl, nll), "reference_perplexity": ref_ppl}
                sizes = frame_sizes(codec, refs[0][0][n], args.chunk, args.decode_messages)
                rec.update({
                    "bytes_per_element": sizes["prefill"], "bytes_per_element_zstd": sizes["prefill_zstd"],
                    "bytes_per_element_decode": sizes["decode"], "bytes_per_element_decode_zstd": sizes["decode_zstd"],
                    "payload_bytes_per_element": sizes["prefill_payload"],
                    "payload_bytes_per_element_zstd": sizes["prefill_payload_zstd"],
                    "payload_bytes_per_element_decode": sizes["decode_payload"],
                    "payload_bytes_per_element_decode_zstd": sizes["decode_payload_zstd"],
                    "bytes_per_element_decode_late": sizes["decode_late"],
                    "payload_bytes_per_element_decode_late": sizes["decode_late_payload"],
                })
                if name in C.OUTLIER_CODECS:
                    rec["outlier_channels"], rec["sink_threshold"] = ch, thr
                if name in C.BASIS_CODECS:
                    lv = bases[n].levels[name]
                    rec["pca"] = {"step": lv.step, "components": lv.r, "digest": bases[n].digest[:16]}
                # goals judge the codec: payload bytes of prefill chunks and of single-token messages
                worst = max(rec["payload_bytes_per_element"], rec["payload_bytes_per_element_decode"])
                rec["goals_met"] = goals_met(rec, worst)
                # the same with one-row messages at the window's last positions (decode steps after a prompt)
                rec["goals_met_late_messages"] = goals_met(rec, max(rec["payload_bytes_per_element"],
                                                                    rec["payload_bytes_per_element_decode_late"]))
                layer_records.append(rec)
                print(f"# layer {n:2d} {name:13s} top1 {rec['top1_agreement']:.4f} KL {rec['mean_kl']:.5f} "
                      f"ppl {rec['perplexity']:.3f} B/el {rec['bytes_per_element']:.3f} "
                      f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
            times = coding_times(codecs, refs[0][0][n], args.chunk, args.decode_messages, args.repeats)
            for rec in layer_records:
                rec.update(times[rec["codec"]])
            records += layer_records

        compute = []
        if args.compute:
            n = args.compute_layer
            if n not in layers:
                sys.exit("--compute-layer must be one of --layers")
            fp16 = C.get_codec("fp16")
            # one long window, so that prompt positions beyond 512 (the policy's bf16 threshold) are covered
            long_w = ids[:args.compute_window_tokens]
            long_bounds, long_lp = sm.front(long_w, {n})
            for variant in ("fp32", "bf16", "fp16", "int8"):
                t0 = time.perf_counter()
                mv = compute_variant_model(model, variant, torch)
                agree, kl, nll = [], [], []
                coded = code_in_chunks(fp16, long_bounds[n], args.chunk)
                a, k, x = compare(long_lp, sm.back(coded, n, mv), long_w, torch)
                agree.append(a), kl.append(k), nll.append(x)
                del mv
                compute.append({"compute": variant, "layer": n, "codec": "fp16", **summarize(agree, kl, nll)})
                print(f"# compute {variant:5s} top1 {compute[-1]['top1_agreement']:.4f} KL {compute[-1]['mean_kl']:.5f}"
                      f" ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)

        ablation = []
        if args.ablations:
            n = args.ablation_layer
            if n not in layers:
                sys.exit("--ablation-layer must be one of --layers")
            for label, (bpe, fn) in ablations(calib[n], args.outlier_k).items():
                t0 = time.perf_counter()
                agree, kl, nll = [], [], []
                for (bounds, lp), w in zip(refs, windows):
                    a, k, x = compare(lp, sm.back(fn(bounds[n]), n), w, torch)
                    agree.append(a), kl.append(k), nll.append(x)
                ablation.append({"variant": label, "layer": n, "bytes_per_element": bpe, **summarize(agree, kl, nll)})
                print(f"# ablation {label:48s} top1 {ablation[-1]['top1_agreement']:.4f} "
                      f"KL {ablation[-1]['mean_kl']:.5f} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)

    speed = {}
    if args.speed_hidden:
        speed = large_hidden_times(args.speed_hidden, min(args.chunk, 128), min(args.decode_messages, 16),
                                   min(args.repeats, 5))

    # 8. report
    print(f"\n{nw} windows x {W} tokens of partition_tools/data/sample.txt, fp32 edge and cloud; reference "
          f"perplexity {ref_ppl:.3f}\n")
    print("| layer | codec | B/el prefill | +zstd | B/el decode msg | +zstd | payload B/el decode (pos 1-64 / last 64) "
          "| time vs fp16 (prefill / decode) | top-1 | mean KL | ppl |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in records:
        tv = (f"{r['time_vs_fp16_prefill']:.2f} / {r['time_vs_fp16_decode']:.2f}"
              if "time_vs_fp16_prefill" in r else "-")
        print(f"| {r['layer']} | {r['codec']} | {r['bytes_per_element']:.4f} | {r['bytes_per_element_zstd']:.4f} | "
              f"{r['bytes_per_element_decode']:.4f} | {r['bytes_per_element_decode_zstd']:.4f} | "
              f"{r['payload_bytes_per_element_decode']:.4f} / {r['payload_bytes_per_element_decode_late']:.4f} | {tv} | "
              f"{r['top1_agreement']:.4f} | {r['mean_kl']:.5f} | {r['perplexity']:.3f} |")
    if compute:
        print("\n| compute (back half) | top-1 | mean KL | " +
              " | ".join(f"top-1 / KL @ {k}" for k in compute[0]["by_position"]) + " |")
        print("|---|---:|---:|" + "---:|" * len(compute[0]["by_position"]))
        for r in compute:
            cells = " | ".join(f"{v['top1_agreement']:.4f} / {v['mean_kl']:.5f}" for v in r["by_position"].values())
            print(f"| {r['compute']} | {r['top1_agreement']:.4f} | {r['mean_kl']:.5f} | {cells} |")
    if ablation:
        print(f"\n| ablation at layer {ablation[0]['layer']} | B/el | top-1 | mean KL | ppl |")
        print("|---|---:|---:|---:|---:|")
        for r in ablation:
            print(f"| {r['variant']} | {r['bytes_per_element']:.3f} | {r['top1_agreement']:.4f} | "
                  f"{r['mean_kl']:.5f} | {r['perplexity']:.3f} |")
    if speed:
        print(f"\n| codec at H = {args.speed_hidden} (synthetic) | encode+decode µs/token, {args.chunk}-token chunk "
              "| µs per single-token message |")
        print("|---|---:|---:|")
        for name, t in speed.items():
            print(f"| {name} | {t['prefill_s_per_token'] * 1e6:.1f} | {t['decode_s_per_token'] * 1e6:.1f} |")
    for key, what in (("goals_met", "single-token messages of positions 1-64"),
                      ("goals_met_late_messages", "single-token messages of the window's last 64 positions")):
        print(f"\nGoals (fp32 edge; bytes = codec payload, the larger of prefill chunks and {what}):")
        for g, lim in GOALS.items():
            met = sorted({(r["codec"]) for r in records if g in r[key]})
            per = {c: [r["layer"] for r in records if r["codec"] == c and g in r[key]] for c in met}
            print(f"  {g} {lim}: " + (", ".join(f"{c} at layers {per[c]}" for c in met) or "none"))
    wall = time.perf_counter() - t_start
    print(f"\nwall time {wall:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "command": "python bench/codec_bench.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
            "model": lm.identity, "windows": nw, "window_tokens": W, "calib_tokens": args.calib_tokens,
            "chunk": args.chunk, "threads": args.threads, "edge": "fp32", "cloud": "fp32",
            "reference_perplexity": ref_ppl, "goals": GOALS, "machine": platform.platform(),
            "wall_s": round(wall, 1), "records": records, "compute_variants": compute, "ablations": ablation,
            "speed_large_hidden": {"hidden": args.speed_hidden, "codecs": speed},
        }
        if args.merge and args.json.is_file():
            doc = merge_results(json.loads(args.json.read_text()), doc)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
