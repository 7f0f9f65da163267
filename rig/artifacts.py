"""What the rig runs on, built once and cached: the split bundle and the whole-model export (all-edge).

Both live under ``$AUTOGLM_CACHE`` (default ``~/.cache/autoglm-split``), named by :func:`cache_dir`: the bundle
(``bundles/<model>-l<layer>``, through ``edge_client.demo.ensure_bundle``) and the export
(``whole/<model>-<quant>``). A cached one is used only when made from the model's present content (its source
identity); else it is built again. Building imports the partition tools (torch): the developer machine's job, done
before any phone starts.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import warnings
from pathlib import Path

from edge_client.demo import cache_root, ensure_bundle
from shared.whole_model import WHOLE_GRAPH, read_meta

__all__ = ["cache_dir", "ensure_bundle", "ensure_whole", "quiet_build_logs"]


def cache_dir(kind: str, source: str, tag: str) -> Path:
    """``<cache>/<kind>/<name>-<tag>``: a preset's name (``bundles/smollm2-l8``), or a checkpoint directory's or
    .gguf's file name and a hash of its absolute path (the path itself put an absolute one's artifacts beside the
    model, outside the cache, and gave one entry to every folder a relative one names from another directory)."""
    import hashlib
    import os

    from partition_tools.models import PRESETS

    where = os.path.abspath(source).encode("utf-8", "surrogateescape")
    name = source if source in PRESETS else f"{Path(source).name}-{hashlib.sha256(where).hexdigest()[:8]}"
    return cache_root() / kind / f"{name}-{tag}"


def quiet_build_logs() -> None:
    """Keep library chatter (torch's exporter warnings, transformers' GGUF progress bars) off the terminal;
    the partition tools' own step lines stay."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # a phone-only install: nothing to build here anyway
        pass
    try:  # the GGUF loader's bar is a plain tqdm, deaf to the switch above: route it through transformers' own
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
        from transformers.utils.logging import tqdm as hf_tqdm

        gguf_utils.tqdm = hf_tqdm
    except ImportError:
        pass
    for name in ("torch.onnx", "torch.onnx._internal.exporter._registration", "onnxscript", "onnx_ir",
                 "transformers", "onnxruntime"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def ensure_whole(source: str = "smollm2", quant: str = "int8", out: Path | None = None, quiet: bool = False,
                 identity: str | None = None) -> Path:
    """The cached whole-model ONNX export of ``source`` at ``quant`` (built if absent, incomplete, older than a
    ``whole.json`` key the runner reads, or exported from other weights than ``source``'s now: ``identity``, its
    source identity, read from ``source`` when None)."""
    from partition_tools.models import source_identity
    from shared.manifest import same_source

    out = Path(out) if out is not None else cache_dir("whole", source, quant)
    if (out / WHOLE_GRAPH).is_file():
        try:
            m = read_meta(out)
            cached = m.get("source_identity")
            if isinstance(cached, str) and same_source(cached, identity or source_identity(source)) \
                    and m.get("quant") == quant:
                return out
        except ValueError:  # none, unreadable, or older than a key the runner reads: built again
            pass
    if not quiet:
        print(f"exporting the whole {source} model ({quant}) for the all-edge baseline in {out} - once", flush=True)
    quiet_build_logs()
    from partition_tools.export_whole import export_whole
    from partition_tools.models import load_model

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # build aside, then swap in
        staged = Path(tmp) / "whole"
        export_whole(load_model(source), staged, quant)
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)
    return out
