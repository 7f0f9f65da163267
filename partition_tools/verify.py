"""``autoglm-partition verify``: the split pipeline against the unsplit model, on real text.

Two checks:

1. quality (``partition_tools.evaluate.evaluate_split``): edge graph in the phone's runtime -> boundary hidden
   states (fp16 round trip: the lossless wire codec) -> cloud half in PyTorch, versus the unsplit
   reference; top-1 agreement, mean KL, perplexities, boundary error;
2. incremental: prefill k tokens then single-token decode steps through the edge runtime's KV cache
   (``edge_client.front.FrontRuntime``, what the phone runs) must reproduce the full-sequence boundary
   hidden states.

A u-shape bundle (``--tail M``) is scored the same way through front + middle + tail (the middle's states
pass the fp16 round trip again on their way down), and a third check generates greedily through the three
parts as the phone and the cloud run them (the front's and the tail's KV caches, one step per token): with an
fp32 edge its tokens must equal the unsplit model's greedy tokens.

Thresholds depend on the edge quantization (``THRESHOLDS``); ``verify`` fails when any is missed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from shared.manifest import BundleError, Manifest


@dataclass(frozen=True, slots=True)
class Thresholds:
    min_top1: float  # top-1 next-token agreement with the unsplit model
    max_kl: float  # mean KL(reference || split), nats per token
    max_ppl_ratio: float  # split perplexity / reference perplexity
    max_incremental_err: float  # relative max error, decode-step vs full-sequence boundary states


# fp32 must be exact up to float noise. The int8/int4 gates are the quality floor for trained weights
# (SmolLM2: top-1 >= 0.98, KL <= 0.003, ppl +1 %); int4 is reported, gated only loosely.
THRESHOLDS = {
    "fp32": Thresholds(0.99, 1e-3, 1.005, 1e-3),
    "int8": Thresholds(0.98, 3e-3, 1.01, 1e-3),
    "int4": Thresholds(0.80, 5e-2, 1.10, 1e-3),
}
# Untrained (random-weight) models predict near-uniform distributions: their top-1 is decided among
# near-ties, so a quantized edge flips it often while KL stays tiny. For them the gates check the pipeline
# is wired right, not quality (which only trained weights can show).
UNTRAINED_THRESHOLDS = {
    "fp32": THRESHOLDS["fp32"],
    "int8": Thresholds(0.90, 1e-3, 1.01, 1e-3),
    "int4": Thresholds(0.80, 5e-2, 1.10, 1e-3),
}


def is_untrained(ppl_reference: float, vocab_size: int) -> bool:
    """A trained LM's perplexity on English text is far below its vocabulary size; a random one's is not."""
    return ppl_reference > vocab_size / 4


def incremental_check(bundle_dir: Path, ids: np.ndarray, prefill: int = 8, steps: int = 8) -> float:
    """Relative max error between (prefill + decode steps) and one full-sequence pass, both through the
    phone's own runtime (``edge_client.front.FrontRuntime``) over the bundle's edge graph."""
    from edge_client.front import FrontRuntime

    ids = ids[:prefill + steps].astype(np.int64)  # [T]
    front = FrontRuntime(bundle_dir, chunk=ids.size, verify=False, prefill_graph=None)  # the decode graph's own
    full = front.prefill(ids)  # [T, H] in one forward pass
    front.reset()
    pieces = [front.prefill(ids[:prefill])] + [front.decode(int(t)) for t in ids[prefill:]]  # [k, H], [1, H]...
    inc = np.concatenate(pieces, axis=0)  # [T, H]
    scale = max(float(np.abs(full).max()), 1e-6)
    return float(np.abs(inc - full).max()) / scale


def ushape_greedy_check(bundle_dir: Path, model, ids: np.ndarray, n_new: int = 16) -> dict:
    """u-shape: greedy tokens after ``ids`` through front -> middle -> tail (fp16 round trips at both
    boundaries, each new token one front step and one tail step on their KV caches) vs the unsplit ``model``'s."""
    import torch

    from edge_client.front import FrontRuntime
    from edge_client.tail import TailRuntime

    from .cloud_half import CloudModel
    from .evaluate import fp16_round_trip

    front = FrontRuntime(bundle_dir, verify=False)
    tail = TailRuntime(bundle_dir, verify=False)
    middle = CloudModel.from_bundle(bundle_dir, verify=False)
    sent = [fp16_round_trip(front.prefill(ids))]  # [S, H] per step: what went up
    logits = None
    with torch.no_grad():
        ref = model.generate(torch.from_numpy(ids)[None], max_new_tokens=n_new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, ids.size:].tolist()
        got: list[int] = []
        for _ in range(n_new):
            boundary = np.concatenate(sent)  # [T, H]
            states = middle(torch.from_numpy(boundary)[None], torch.arange(boundary.shape[0])[None])[0].numpy()
            logits = tail.run(fp16_round_trip(states[tail.length:]), 1)  # the rows the tail lacks
            got.append(int(np.argmax(logits[-1])))
            sent.append(fp16_round_trip(front.decode(got[-1])))
    same = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
    return {"ushape_tokens": got, "reference_tokens": ref, "ushape_matching_prefix": same}


DEFAULT_TOKENS = 1024  # tokens verify scores unless told (fewer where the edge graph holds fewer positions)


def verify_bundle(bundle_dir: str | Path, source: str | None = None, text: str | None = None,
                  max_tokens: int | None = None) -> dict:
    """Run both checks; returns the report dict with a ``passed`` flag and the ``failures`` list. ``max_tokens``:
    at most the positions the edge graph holds (BundleError past them); None: ``DEFAULT_TOKENS``, or those positions
    when fewer (a model of a 512-token context was refused its default with no --max-tokens given)."""
    from edge_client.front import FrontRuntime

    from .evaluate import evaluate_split, fp16_round_trip
    from .models import load_bundle_source
    from .progress import Steps

    started = time.perf_counter()
    bundle_dir = Path(bundle_dir)
    manifest = Manifest.load(bundle_dir)
    steps = Steps(4 + bool(manifest.tail_layers), "verify")
    steps.next("re-hash the bundle's files")
    manifest.verify_files(bundle_dir)
    positions = FrontRuntime(bundle_dir, verify=False, prefill_graph=None).max_positions
    if max_tokens is None:
        max_tokens = min(DEFAULT_TOKENS, positions)
    if max_tokens > positions:  # the edge graph refused them with a FrontError traceback after the reference ran
        raise BundleError(f"--max-tokens {max_tokens}: the bundle's edge graph holds {positions} positions")
    steps.next(f"load {source or manifest.source}")
    lm = load_bundle_source(bundle_dir, source)
    steps.next(f"score up to {max_tokens} tokens: split vs unsplit")
    report = evaluate_split(bundle_dir, text=text, max_tokens=max_tokens, codec=fp16_round_trip, lm=lm)
    # The incremental check exercises the graph's KV plumbing; any ids will do.
    steps.next("decode steps vs the full sequence")
    ids = np.random.default_rng(0).integers(4, manifest.vocab_size, 16)
    report["incremental_rel_err"] = incremental_check(bundle_dir, ids)
    if manifest.tail_layers:  # u-shape: greedy generation through the phone's two ends and the cloud's middle
        steps.next("u-shape: greedy tokens through front, middle and tail")
        report.update(ushape_greedy_check(bundle_dir, lm.model, ids[:12].astype(np.int64)))
    steps.done(time.perf_counter() - started)
    untrained = is_untrained(report["ppl_reference"], manifest.vocab_size)
    # an int8 KV cache (split --edge-kv int8) is lossy: an fp32 front with it is gated as an int8 one
    gate = "int8" if manifest.edge_quant == "fp32" and manifest.quant_report.get("kv_cache") else manifest.edge_quant
    th = (UNTRAINED_THRESHOLDS if untrained else THRESHOLDS)[gate]
    failures = []
    if report["top1_agreement"] < th.min_top1:
        failures.append(f"top-1 agreement {report['top1_agreement']:.4f} < {th.min_top1}")
    if report["mean_kl"] > th.max_kl:
        failures.append(f"mean KL {report['mean_kl']:.5f} > {th.max_kl}")
    ratio = report["ppl_split"] / report["ppl_reference"]
    if ratio > th.max_ppl_ratio:
        failures.append(f"perplexity ratio {ratio:.4f} > {th.max_ppl_ratio}")
    if report["incremental_rel_err"] > th.max_incremental_err:
        failures.append(f"incremental decode error {report['incremental_rel_err']:.2e} > {th.max_incremental_err}")
    if manifest.tail_layers and manifest.edge_quant == "fp32" and report["ushape_tokens"] != report["reference_tokens"]:
        failures.append(f"u-shape greedy tokens differ from the unsplit model's after "
                        f"{report['ushape_matching_prefix']} of {len(report['reference_tokens'])}")
    report.update(weights="untrained" if untrained else "trained", edge_quant=manifest.edge_quant, split_layer=manifest.split_layer, bundle_id=manifest.bundle_id,
                  tail_layers=manifest.tail_layers,
                  thresholds=asdict(th),
                  passed=not failures, failures=failures)
    return report
