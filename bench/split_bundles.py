"""Bundles for the edge benches: one split per variant, reused while the source and the split layer match.

``common_args(parser)`` adds the options every edge bench shares (``--model``, ``--layer``, ``--work``) and
``choices`` reads a comma-separated list of known names;
``cached_split`` writes a bundle only when the one at ``out`` is missing or was cut from another model or layer;
``variant_bundle`` gives an fp32 bundle another edge graph (a quantization arm) without splitting again: the
cloud half and every other file are hard links to the fp32 bundle's, so the bundle id is the same.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path


def common_args(p: argparse.ArgumentParser, work: str) -> argparse.ArgumentParser:
    """The options of every edge bench: the model, the split layer and the scratch directory."""
    p.add_argument("--model", default="smollm2", help="model source (preset, checkpoint dir, .gguf)")
    p.add_argument("--layer", type=int, default=8, help="split layer N")
    p.add_argument("--work", type=Path, default=Path(work), help="scratch directory (bundles are reused)")
    return p


def choices(p: argparse.ArgumentParser, value: str, known, what: str) -> list[str]:
    """The comma-separated names in ``value``; an unknown one ends the run with a usage error."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in names if v not in known]
    if unknown:
        p.error(f"unknown {what}(s) {unknown}; choose from {list(known)}")
    return names


def _partition_code_stamp() -> str:
    """A digest of the partition tool's sources: a bundle split by other code (another recipe) is rebuilt."""
    import hashlib

    import partition_tools

    h = hashlib.sha256()
    for f in sorted(Path(partition_tools.__file__).parent.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def cached_split(lm, layer: int, out: Path, edge_quant: str = "fp32", edge_graph: str = "fused") -> Path:
    """``out``, split from ``lm`` at ``layer`` unless a bundle of the same source, layer and partition code is
    already there."""
    from partition_tools.split import SplitConfig, split
    from shared.manifest import BundleError, Manifest

    stamp = out / ".bench-code-stamp"
    try:
        m = Manifest.load(out)
        if (m.source_identity == lm.identity and m.split_layer == layer and m.edge_quant == edge_quant
                and stamp.is_file() and stamp.read_text() == _partition_code_stamp()):
            return out
    except BundleError:
        pass
    split(lm, SplitConfig(layer=layer, out=out, edge_quant=edge_quant, edge_graph=edge_graph))
    stamp.write_text(_partition_code_stamp())
    return out


def variant_bundle(fp32_bundle: Path, graph: Path, edge_quant: str, report: dict, out: Path) -> Path:
    """A bundle at ``out`` that is ``fp32_bundle`` with ``graph`` as its edge front (manifest: ``edge_quant``
    and ``report`` as its quant report; a report with ``prefill`` brings ``graph``'s prompt-phase graph along);
    rebuilt only when the graph(s) or the fp32 bundle changed."""
    from edge_client.front import FRONT, PREFILL_GRAPH, prefill_graph_path
    from shared.manifest import MANIFEST_NAME, BundleError, Manifest, sha256_file

    base = Manifest.load(fp32_bundle)
    prefill = prefill_graph_path(graph) if report.get("prefill") else None  # precision by phase
    digest = sha256_file(graph)
    try:
        m = Manifest.load(out)
        if (m.bundle_id == base.bundle_id and m.artifacts[FRONT].sha256 == digest
                and (prefill is None) == (PREFILL_GRAPH not in m.artifacts)
                and (prefill is None or m.artifacts[PREFILL_GRAPH].sha256 == sha256_file(prefill))):
            return out
    except (BundleError, KeyError):
        pass
    if out.exists():
        shutil.rmtree(out)
    for src in sorted(Path(fp32_bundle).rglob("*")):
        rel = src.relative_to(fp32_bundle).as_posix()
        if src.is_dir() or rel in (FRONT, MANIFEST_NAME):
            continue
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(src, dst)
    (out / FRONT).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(graph, out / FRONT)
    base.edge_quant = edge_quant
    base.quant_report = {**report, "edge_graph": base.quant_report.get("edge_graph", "fused-gqa")}
    base.add_artifact(out, FRONT, "edge")
    if prefill is not None:
        shutil.copyfile(prefill, out / PREFILL_GRAPH)
        base.add_artifact(out, PREFILL_GRAPH, "edge")
    base.save(out)
    return out
