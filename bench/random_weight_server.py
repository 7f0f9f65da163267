"""``autoglm-cloud serve`` for a full-size model without a bundle: a random-weight back half built on the device.

A 9B bundle would take minutes of host time to write (random init on the CPU, safetensors, the edge's ONNX),
all of it spent before the first measurement of a scarce GPU lease, and speed does not depend on the weights'
values. This launcher instead writes a *stub bundle* (``manifest.json`` + ``calibration.json``, no weights:
:func:`write_stub_bundle`), then runs the real server (``cloud_server.cli``: the same runtime, engine, split
endpoint, metrics and drain) with ``cloud_server.model.load_split_model`` replaced by
``cloud_server.model.random_split_model`` (the function ``bench/cloud_gpu_bench.py --through-engine`` builds its
engine from), so the back half is made on the GPU itself and never passes through host memory.

The stub's calibration (outlier channels, attention-sink threshold, per-channel absmax) is synthetic but
shaped like a real boundary's; the load generator (``bench/served_load.py``) reads the same file, so both ends
build the same outlier-aware codec.

Usage (every option after the preset's goes to ``autoglm-cloud serve``)::

    python bench/random_weight_server.py --preset glm4v-9b-random --layer 12 --stub /tmp/stub -- \
        --port 8000 --max-sessions 300 --max-num-seqs 256 --num-blocks 12000

What ``autoglm-cloud serve`` would need to do this itself: a ``--random-preset NAME --random-layer N`` option
pair (the model comes from :func:`random_split_model` instead of the bundle's safetensors, the manifest and
calibration from :func:`write_stub_bundle`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRESETS = ("tiny-glm4", "tiny-glm4v", "glm4v-9b-random", "wide-cpu")
OUTLIER_CHANNELS = 8  # as many as the real calibrations pick (partition_tools.split)


def wide_cpu_config():
    """The served path's CPU proxy: the 9B model's boundary (hidden 4096, so every decode state on the wire
    and through the codec is full size) on a back half that costs little (2 layers, split at 1: one cloud
    layer with 2 narrow heads, a 256-wide MLP and a 512-token vocabulary). It isolates the front end:
    sockets, msgpack, codecs, the event loop and the hand-off to the engine thread."""
    from transformers import Glm4Config

    return Glm4Config(vocab_size=512, hidden_size=4096, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=8192,
                      pad_token_id=0, bos_token_id=1, eos_token_id=[2, 3], tie_word_embeddings=False)


def preset_config(preset: str):
    """The HF config of a random-weight preset (``partition_tools.models``, or :func:`wide_cpu_config`)."""
    from partition_tools import models

    builders = {"tiny-glm4": models.tiny_glm4_config, "tiny-glm4v": models.tiny_glm4v_config,
                "glm4v-9b-random": models.glm4v_9b_text_config, "wide-cpu": wide_cpu_config}
    if preset not in builders:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    return builders[preset]()


def synthetic_calibration(hidden: int, layer: int, seed: int) -> dict:
    """A boundary calibration shaped like a real one: per-channel absmax around 4 (log-normal spread), a few
    outlier channels 20x larger, and an attention-sink threshold 8x the median absmax (the ratio the tiny
    preset's measured calibration shows)."""
    rng = np.random.default_rng(seed)
    absmax = np.exp(rng.normal(np.log(4.0), 0.3, hidden))  # [H]
    outliers = np.sort(rng.choice(hidden, size=min(OUTLIER_CHANNELS, hidden // 4), replace=False))
    absmax[outliers] *= 20.0
    return {"layer": layer, "tokens": 0, "synthetic": True, "outlier_channels": [int(c) for c in outliers],
            "sink_threshold": float(8.0 * np.median(absmax)), "channel_absmax": [round(float(a), 4) for a in absmax],
            "boundary_absmax": float(absmax.max())}


def write_stub_bundle(out: Path, preset: str, layer: int, seed: int = 0):
    """``out``/manifest.json and calibration.json for ``preset`` split at ``layer`` (no weight files).
    Returns the :class:`~shared.manifest.Manifest` (its ``bundle_id`` is what edges present)."""
    from partition_tools.adapters import adapter_for_config
    from shared.manifest import FORMAT_VERSION, Manifest

    cfg = preset_config(preset)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    total = int(text.num_hidden_layers)
    if not 0 < layer < total:
        raise ValueError(f"--layer must be in [1, {total - 1}] for {preset}")
    heads = int(text.num_attention_heads)
    eos = getattr(text, "eos_token_id", None)
    eos = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])]
    m = Manifest(format_version=FORMAT_VERSION, source=preset, source_identity=f"random-weights:{preset}@seed{seed}",
                 architecture=adapter_for_config(cfg).name, model_type=cfg.model_type, split_layer=layer,
                 num_layers=total, hidden_size=int(text.hidden_size), num_heads=heads,
                 num_kv_heads=int(text.num_key_value_heads),
                 head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
                 vocab_size=int(text.vocab_size), rope={}, eos_token_ids=eos, edge_quant="fp32",
                 edge_dtype="float32", cloud_dtype="random")
    out.mkdir(parents=True, exist_ok=True)
    m.save(out)
    (out / "calibration.json").write_text(json.dumps(synthetic_calibration(m.hidden_size, layer, seed)) + "\n")
    return m


def install_random_weights(preset: str, layer: int, seed: int) -> None:
    """Make ``cloud_server.model.load_split_model`` build a random back half of ``preset`` on the device."""
    import cloud_server.model as cm

    cfg = preset_config(preset)

    def load_random(bundle_dir, variant: str, device: str = "cpu", shard=None):
        if shard is not None:
            raise ValueError("the random-weight server runs with --tp 1")
        return cm.random_split_model(cfg, layer, variant, device, seed=seed)

    cm.load_split_model = load_random


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True, choices=PRESETS)
    ap.add_argument("--layer", type=int, required=True, help="split layer N: the cloud runs [N, L)")
    ap.add_argument("--stub", type=Path, required=True, help="directory for the stub bundle (written)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gather-max-ms", type=float, default=None,
                    help="the engine's decode-cohort gather window cap (AsyncEngine.gather_max_s; 0: off)")
    a = ap.parse_args(argv)
    if a.gather_max_ms is not None:  # a bench knob: the served path measured with and without the gather
        from cloud_server.engine import async_engine

        async_engine.GATHER_MAX_S = a.gather_max_ms / 1000
    write_stub_bundle(a.stub, a.preset, a.layer, a.seed)
    install_random_weights(a.preset, a.layer, a.seed)
    from cloud_server import cli

    return cli.main(["serve", str(a.stub), *serve_args])


if __name__ == "__main__":
    raise SystemExit(main())
