"""``autoglm-partition``: split / draft-head / verify / inspect / plan a GLM-family checkpoint.

Every value flag but ``--preset`` has an environment-variable twin (``AUTOGLM_PARTITION_<FLAG>``, e.g.
``AUTOGLM_PARTITION_LAYER``; a path there may start with ``~``, a home as on a shell's command line); the switches
(``--fp32-prefill``, ``--cloud``, ``--json``) have none. Bad input ends in one line on
stderr and exit status 2; a failed verification exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from shared.cli_exit import run_command, sigterm_unwinds
from shared.user_paths import user_path


def _env(name: str, default=None):
    return os.environ.get(f"AUTOGLM_PARTITION_{name}", default)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autoglm-partition", description=__doc__.splitlines()[0].split(": ", 1)[1])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("split", help="cut a model at layer N into an edge/cloud bundle",
                       description="Cut a model at layer N into an edge/cloud bundle.")
    s.add_argument("source", nargs="?", help="checkpoint directory, .gguf file or preset name")
    s.add_argument("--preset", help="preset name: tiny-glm4, tiny-glm4v, smollm2, glm4v-9b-random")
    s.add_argument("--layer", type=int, default=_env("LAYER"), help="N: layers [0, N) run on the edge")
    s.add_argument("--out", default=_env("OUT"), help="bundle directory to write: new, empty, or an earlier bundle holding none "
                        "but its own files (replaced whole, once the new one is written beside it on its file "
                        "system); it must take new files, or its parent when it does not exist yet. One split or "
                        "draft-head at a time per directory")
    s.add_argument("--edge-quant", choices=("auto", "int8", "int4", "fp32"), default=_env("EDGE_QUANT", "auto"),
                   help="edge weight precision (default auto: int4 for a checkpoint already on a 4-bit grid, "
                        "e.g. a Q4 GGUF, whose own codes then run exactly with fp32 activations; int8 otherwise)")
    s.add_argument("--edge-kv", choices=("fp32", "int8"), default=_env("EDGE_KV", "fp32"),
                   help="the front's KV cache on the phone (default fp32). int8: a quarter of its bytes (SmolLM2 "
                        "split at 8: 36 MiB less at 4,096 tokens), static per-channel scales calibrated at split "
                        "time; it costs answers (SmolLM2, held-out chats: 32/60 identical to the unsplit model "
                        "instead of 60/60, docs/quality.md), so it is for phones short of memory. Fused edge "
                        "graph only, not with --fp32-prefill")
    s.add_argument("--fp32-prefill", action="store_true",
                   help="precision by phase (int8/int4 edge): also ship an fp32 copy of the front "
                        "(edge/front_prefill.onnx) that runs the prompt, decode steps staying quantized; about "
                        "3x the edge's memory, no measured gain in identical answers (docs/quality.md)")
    s.add_argument("--vision-quant", choices=("int8", "fp32", "none"), default=_env("VISION_QUANT"),
                   help="GLM-4.1V: the edge vision tower's weights (default: int8, fp32 with an fp32 front; "
                        "none: no vision tower)")
    s.add_argument("--audio-encoder", default=_env("AUDIO_ENCODER"),
                   help="attach an audio encoder: a Whisper checkpoint dir with projector.json/.safetensors, "
                        "or the random preset tiny-whisper (GLM-4.1V ships none)")
    s.add_argument("--tail", type=int, default=_env("TAIL", "0"),
                   help="M > 0: a u-shape bundle, the last M layers + norm + lm_head on the edge too (the cloud "
                        "runs the middle and never sees an output token)")
    s.add_argument("--seed", type=int, default=_env("SEED", "0"), help="seed for random-weight presets (0 to 2^64 - 1)")

    d = sub.add_parser("draft-head", help="add a drafter to a bundle for speculative decoding: a draft head "
                                         "(default), a layer-skipping drafter (--layers) or the cloud drafter (--cloud)",
                       description="Add a drafter to a bundle for speculative decoding: a draft head (default), "
                                   "a layer-skipping drafter (--layers) or the cloud drafter (--cloud). A u-shape "
                                   "bundle (split with --tail) takes none: it drafts by prompt lookup. Its files "
                                   "are written aside and go in with the manifest, all or nothing; refused while a "
                                   "running edge client holds the bundle, or another split or draft-head writes it.")
    d.add_argument("bundle", help="bundle directory written by split")
    d.add_argument("--source", default=_env("SOURCE"),
                   help="the model it was split from (default: the manifest's); another model, even of the same "
                        "shape, is refused (its identity is not the manifest's source_identity)")
    d.add_argument("--text", default=_env("TEXT"), help="calibration text, UTF-8 (default: built-in sample's tail)")
    d.add_argument("--vocab", type=int, default=_env("VOCAB"),
                   help="K: propose only the K most frequent calibration tokens (default: the whole vocabulary)")
    d.add_argument("--quant", choices=("int8", "int4", "fp32"), default=_env("QUANT"),
                   help="drafter weights (default int8; int4: --layers only; not --cloud: its table is float16)")
    d.add_argument("--layers", default=_env("LAYERS"),
                   help="a layer-skipping drafter instead of the lens: 'auto' (greedy search for --budget of the "
                        "cloud's layers on calibration data) or the cloud layers, comma-separated (e.g. 8,12,29)")
    d.add_argument("--budget", type=int, default=_env("BUDGET"), help="M: layers --layers auto picks (default 6; "
                   "--layers auto only)")
    d.add_argument("--cloud", action="store_true",
                   help="the cloud drafter instead: a table mapping each token to an approximate boundary state, so "
                        "the server drafts the next tokens with its own layers (cloud/draft_inputs.npy)")

    v = sub.add_parser("verify", help="check a bundle against the unsplit model on real text",
                       description="Check a bundle against the unsplit model on real text.")
    v.add_argument("bundle", help="bundle directory written by split")
    v.add_argument("--source", default=_env("SOURCE"), help="reference model (default: the manifest's source)")
    v.add_argument("--text", default=_env("TEXT"), help="UTF-8 text file to evaluate on (default: built-in sample)")
    v.add_argument("--max-tokens", type=int, default=_env("MAX_TOKENS"), help="tokens to evaluate (default 1024, or the "
                        "positions the edge graph holds - the model's context - when fewer; at most those positions)")
    v.add_argument("--json", action="store_true", help="print exactly one JSON object")

    i = sub.add_parser("inspect", help="show what a bundle holds and re-check its hashes",
                       description="Show what a bundle holds and re-check its hashes.")
    i.add_argument("bundle", help="bundle directory written by split")
    i.add_argument("--json", action="store_true", help="print the report as JSON")

    pl = sub.add_parser("plan", help="choose the split layer N from measured edge/cloud/link costs",
                        description="Choose the split layer N from measured edge/cloud/link costs.")
    pl.add_argument("source", help="checkpoint directory, .gguf file or preset name")
    pl.add_argument("--link", default=_env("LINK", "4g"), help="link profile: wifi, 5g, 4g, 3g-poor (default 4g)")
    pl.add_argument("--edge-threads", type=int, default=_env("EDGE_THREADS", "2"), help="edge onnxruntime threads (1 to 256)")
    pl.add_argument("--bundle", default=_env("BUNDLE"), help="time this bundle's front instead of a probe export (a bundle of "
                                                            "SOURCE: another model's is refused)")
    pl.add_argument("--cloud-results", default=_env("CLOUD_RESULTS"),
                    help="cloud costs from a cloud_gpu.json (default: measure torch on this CPU)")
    pl.add_argument("--cloud-threads", type=int, default=_env("CLOUD_THREADS", "1"), help="CPU cloud threads (1 to 256)")
    pl.add_argument("--codec", default=_env("CODEC", "int8-outlier"), help="wire codec of the prediction")
    pl.add_argument("--edge-memory-mb", type=float, default=_env("EDGE_MEMORY_MB", "1024"),
                    help="edge memory budget (MB)")
    pl.add_argument("--candidates", default=_env("CANDIDATES"), help="split layers to try, comma-separated")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _cmd_split(args) -> int:
    from .models import has_vision_tower, layer_count, load_model
    from .split import SplitConfig, check_layers, check_vision, split

    source = args.preset or args.source
    if not source:
        raise UsageError("split needs SOURCE or --preset NAME")
    if args.preset and args.source:
        raise UsageError("give SOURCE or --preset, not both")
    if args.layer is None or not args.out:  # an empty one (AUTOGLM_PARTITION_OUT="") is none: it was the working
        raise UsageError("split needs --layer N and --out DIR")  # directory, where the bundle then went
    cfg = SplitConfig(layer=int(args.layer), out=Path(args.out), edge_quant=args.edge_quant,
                      vision_quant=args.vision_quant, audio_encoder=args.audio_encoder, tail=args.tail,
                      fp32_prefill=args.fp32_prefill, edge_kv=args.edge_kv)
    if (layers := layer_count(source)) is not None:  # before the weights load (minutes for a 9B model)
        check_layers(cfg, layers)
    check_vision(cfg, source, has_vision_tower(source))
    t0 = time.perf_counter()
    lm = load_model(source, seed=args.seed)
    m = split(lm, cfg)
    seconds = time.perf_counter() - t0
    sizes = {"edge": 0, "cloud": 0, "shared": 0}
    for a in m.artifacts.values():
        sizes[a.role] += a.bytes
    print(f"bundle {m.bundle_id} -> {cfg.out}")
    phases = " (prompt: an fp32 copy)" if "prefill" in m.quant_report else ""
    print(f"  edge  : embeddings + layers [0, {m.split_layer}) {m.edge_quant} ONNX{phases}, "
          f"{sizes['edge'] / 1e6:.2f} MB")
    from .inspect_bundle import recipe_summary

    recipe = recipe_summary(m.quant_report)
    if recipe:
        print(f"  recipe: {recipe}")
    lo, hi = m.cloud_layers
    if m.tail_layers:
        print(f"  tail  : layers [{hi}, {m.num_layers}) + norm + lm_head {m.edge_quant} ONNX (on the edge, "
              "in the edge size above)")
    print(f"  cloud : layers [{lo}, {hi})" + ("" if m.tail_layers else " + norm + lm_head")
          + f", {sizes['cloud'] / 1e6:.2f} MB")
    print(f"  took  : {seconds:.1f} s (load + export + quantize + write)")
    return 0


def _source(args) -> str:
    """The model a bundle command reloads: --source, else the one the bundle's manifest names - which may have moved
    since the split (then the error says so, and what to pass)."""
    if args.source:
        return args.source
    from shared.manifest import Manifest

    from .models import ModelLoadError, check_source

    source = Manifest.load(args.bundle).source
    try:
        check_source(source)
    except ModelLoadError as e:
        raise UsageError(f"the model {args.bundle} was split from: {e}; give its path with --source") from None
    return source


def _text(args) -> str | None:
    """``--text``'s contents, checked before the model loads: UTF-8 text, and a source with a tokenizer to read it
    (a random preset, calibrated and verified on random token ids: verify stopped with a ValueError traceback and
    the draft head ignored the file without a word). draft-head read the file only after the model loaded: a
    missing one was said minutes later, one not UTF-8 was a UnicodeDecodeError traceback."""
    if not args.text:
        return None
    try:
        text = Path(args.text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--text {args.text}: {e}") from None
    if not text.strip():
        raise UsageError(f"--text {args.text}: the file holds no text")
    from .models import has_tokenizer

    source = _source(args)
    if not has_tokenizer(source):
        raise UsageError(f"--text {args.text}: {source} has no tokenizer to read it with (without one, random "
                         "token ids are used); leave --text out")
    return text


def _cmd_draft_head(args) -> int:
    from .draft_head import STEPS, DraftHeadConfig, add_draft_head

    _text(args)
    vocab = int(args.vocab) if args.vocab is not None else None
    text = Path(args.text) if args.text else None
    # a flag that does not apply to the drafter asked for is refused, never ignored (a user would get another drafter)
    if args.budget is not None and args.layers != "auto":
        raise UsageError("--budget is for --layers auto (the number of layers its search picks)")
    if args.cloud:
        if args.layers is not None or vocab is not None:
            raise UsageError("--cloud takes neither --layers nor --vocab (the table covers the whole vocabulary)")
        if args.quant is not None:
            raise UsageError(f"--quant {args.quant} is not for --cloud (the cloud drafter's table is float16)")
        return _cloud_drafter(args, text)
    quant = args.quant or "int8"
    if args.layers is not None:
        return _draft_layers(args, text, vocab, quant)
    if quant == "int4":
        raise UsageError("--quant int4 is for --layers drafters (the lens head is int8 or fp32)")
    cfg = DraftHeadConfig(text=text, vocab=vocab, quant=quant)
    with _drafter_progress(args, STEPS) as (lm, progress, staged):
        r = add_draft_head(lm, Path(args.bundle), cfg, progress, staged)
    print(f"draft head -> {args.bundle}: {r['vocab']} tokens, {r['quant']}, calibrated on {r['calibration_tokens']} "
          f"tokens; top-1 agreement {100 * r['held_out_top1_agreement']:.1f} % on {r['held_out_tokens']} held-out")
    return 0


@contextlib.contextmanager
def _drafter_progress(args, steps: int, check=None):
    """The source of the bundle loaded, the progress lines of draft-head (``partition_tools.progress``: the
    source's load, then the drafter's ``steps``) and the bundle's staging directory, held (``split.writing``) until
    the block ends; a write the disk had no room for (an OSError traceback) is one line. ``check(manifest)``: the
    drafter's own checks of the bundle, after the one every drafter makes and before the model loads."""
    from shared.manifest import BundleError, Manifest, no_room

    from .draft_head import check_takes_a_drafter
    from .models import load_bundle_source
    from .progress import Steps
    from .split import refuse_if_held, writing

    started = time.perf_counter()
    progress = Steps(1 + steps, "draft-head")
    source = _source(args)
    manifest = Manifest.load(args.bundle)
    check_takes_a_drafter(args.bundle, manifest)
    if check is not None:
        check(manifest)
    try:
        with writing(Path(args.bundle)) as staged:  # one writer of a bundle at a time (split.writing)
            refuse_if_held(Path(args.bundle))  # before the load; again as its files go in (split.add_files)
            progress.next(f"load {source}")
            yield load_bundle_source(args.bundle, source), progress, staged
    except Exception as e:
        reason = no_room(e)
        if reason is None:
            raise
        raise BundleError(f"{args.bundle}: the drafter does not fit ({reason}); make room and run draft-head "
                          "again") from None
    progress.done(time.perf_counter() - started)


def _cloud_drafter(args, text: Path | None) -> int:
    from .cloud_drafter import STEPS, CloudDrafterConfig, add_cloud_drafter

    with _drafter_progress(args, STEPS) as (lm, progress, staged):
        r = add_cloud_drafter(lm, Path(args.bundle), CloudDrafterConfig(text=text), progress, staged)
    print(f"cloud drafter -> {args.bundle}: {r['file']} ({r['bytes'] / 1e6:.1f} MB, ridge lambda {r['ridge_lambda']}, "
          f"{r['positions']} calibration positions); top-1 agreement {100 * r['held_out_top1_agreement']:.1f} % on "
          f"{r['held_out_tokens']} held-out")
    return 0


def _draft_layers(args, text: Path | None, vocab: int | None, quant: str) -> int:
    from .draft_layers import STEPS, DraftLayersConfig, add_draft_layers

    if args.layers == "auto":
        layers = None
    else:
        try:
            layers = tuple(int(x) for x in args.layers.split(",") if x.strip())
        except ValueError:
            raise UsageError(f"--layers {args.layers!r}: 'auto' or comma-separated layer numbers") from None
    budget = {} if args.budget is None else {"budget": args.budget}  # else DraftLayersConfig's default
    cfg = DraftLayersConfig(layers=layers, text=text, vocab=vocab, quant=quant, **budget)

    def layers_fit(manifest) -> None:  # before the model loads
        cfg.checked_layers(manifest.split_layer, manifest.num_layers)

    with _drafter_progress(args, STEPS, layers_fit) as (lm, progress, staged):
        r = add_draft_layers(lm, Path(args.bundle), cfg, progress, staged)
    print(f"draft layers -> {args.bundle}: layers {r['layers']} ({r['chosen_by']}) + norm + lm_head, {r['quant']}, "
          f"{r['vocab']} tokens, {r['bytes'] / 1e6:.1f} MB; top-1 agreement {100 * r['held_out_top1_agreement']:.1f} % "
          f"on {r['held_out_tokens']} held-out")
    return 0


def _cmd_verify(args) -> int:
    from .verify import verify_bundle

    if args.max_tokens is not None and args.max_tokens < 16:
        raise UsageError("--max-tokens must be at least 16")
    text = _text(args)
    r = verify_bundle(args.bundle, source=_source(args), text=text, max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps(r, sort_keys=True))
    else:
        print(f"bundle {r['bundle_id']} (edge {r['edge_quant']}, split at {r['split_layer']}), {r['tokens']} tokens,"
              f" {r['weights']} weights")
        print(f"  top-1 agreement   {r['top1_agreement']:.4f}")
        print(f"  mean KL           {r['mean_kl']:.5f}")
        print(f"  perplexity        reference {r['ppl_reference']:.3f}  split {r['ppl_split']:.3f}")
        print(f"  boundary error    max {r['boundary_max_abs_err']:.3e}  mean {r['boundary_mean_abs_err']:.3e}")
        print(f"  incremental error {r['incremental_rel_err']:.2e} (decode steps vs full sequence, relative)")
        if r.get("tail_layers"):
            print(f"  u-shape greedy    {r['ushape_matching_prefix']} of {len(r['reference_tokens'])} tokens equal "
                  "the unsplit model's (front + middle + tail, step by step)")
        print("  PASSED" if r["passed"] else "  FAILED: " + "; ".join(r["failures"]))
    return 0 if r["passed"] else 1


def _cmd_inspect(args) -> int:
    from .inspect_bundle import format_report, inspect_bundle

    r = inspect_bundle(args.bundle)
    print(json.dumps(r, indent=2, sort_keys=True) if args.json else format_report(r))
    return 0 if r["integrity"] == "ok" else 1


def _cmd_plan(args) -> int:
    from shared.link_profiles import LinkProfileError, get_profile

    from .models import layer_count, load_bundle_source, load_model
    from .plan import PlanConfig, check_candidates, format_plan, plan

    try:
        link = get_profile(args.link)
    except LinkProfileError as e:
        raise UsageError(str(e)) from None
    try:
        cands = [int(x) for x in args.candidates.split(",")] if args.candidates else None
    except ValueError:
        raise UsageError(f"--candidates {args.candidates!r}: expected split layers, comma-separated (e.g. 2,4,8)") \
            from None
    cfg = PlanConfig(link=link, edge_threads=args.edge_threads, cloud_threads=args.cloud_threads, codec=args.codec,
                     edge_memory_mb=args.edge_memory_mb, candidates=cands,
                     cloud_results=Path(args.cloud_results) if args.cloud_results else None)
    if (layers := layer_count(args.source)) is not None:  # before the weights load (minutes for a 9B model)
        check_candidates(cfg, layers)
    lm = load_bundle_source(args.bundle, args.source) if args.bundle else load_model(args.source)
    r = plan(lm, cfg, Path(args.bundle) if args.bundle else None)
    print(json.dumps(r, indent=1) if args.json else format_plan(r))
    return 0


class UsageError(Exception):
    pass


# the arguments that name a file or directory (a preset's name passes unchanged): '~' there is a home, as a shell
# expands it - an environment twin (AUTOGLM_PARTITION_OUT=~/b) reaches the CLI as written
PATH_ARGS = ("source", "out", "audio_encoder", "bundle", "text", "cloud_results")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .progress import quiet_library_bars

    quiet_library_bars()
    for name in PATH_ARGS:
        if isinstance(getattr(args, name, None), str) and getattr(args, name):  # "" stays unset (Path("") is ".")
            setattr(args, name, str(user_path(getattr(args, name))))
    from shared.manifest import BundleError

    from .adapters import UnsupportedArchitecture
    from .export_audio import AudioEncoderError
    from .models import ModelLoadError
    from .plan import PlanError

    expected = (UsageError, BundleError, ModelLoadError, UnsupportedArchitecture, PlanError, FileNotFoundError,
                PermissionError, IsADirectoryError, AudioEncoderError)
    handlers = {"split": _cmd_split, "draft-head": _cmd_draft_head, "verify": _cmd_verify, "inspect": _cmd_inspect, "plan": _cmd_plan}
    sigterm_unwinds()  # a split or draft-head killed so removes its staging directory, as on Ctrl-C
    return run_command("autoglm-partition", args.command, handlers[args.command], args, expected)


if __name__ == "__main__":
    sys.exit(main())
