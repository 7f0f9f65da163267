"""``autoglm-partition inspect``: what a bundle holds, how big each half is, and whether every hash still matches."""

from __future__ import annotations

from pathlib import Path

from shared.manifest import Manifest, sha256_file


def inspect_bundle(bundle_dir: str | Path) -> dict:
    bundle_dir = Path(bundle_dir)
    m = Manifest.load(bundle_dir)
    files, sizes, problems = [], {"edge": 0, "cloud": 0, "shared": 0}, []
    for rel, art in sorted(m.artifacts.items()):
        p = bundle_dir / rel
        if not p.is_file():
            status = "missing"
        elif p.stat().st_size != art.bytes:
            status = f"size {p.stat().st_size} != {art.bytes}"
        elif sha256_file(p) != art.sha256:
            status = "sha256 mismatch"
        else:
            status = "ok"
        if status != "ok":
            problems.append(f"{rel}: {status}")
        sizes["cloud" if art.role == "cloud-draft" else art.role] += art.bytes  # the cloud drafter's table: cloud side
        files.append({"path": rel, "role": art.role, "bytes": art.bytes, "status": status})
    return {
        "bundle_id": m.bundle_id,
        "source": m.source,
        "source_identity": m.source_identity,
        "architecture": m.architecture,
        "model_type": m.model_type,
        "split_layer": m.split_layer,
        "num_layers": m.num_layers,
        "tail_layers": m.tail_layers,
        "shape": {"hidden": m.hidden_size, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
                  "head_dim": m.head_dim, "vocab": m.vocab_size},
        "rope": m.rope,
        "eos_token_ids": m.eos_token_ids,
        "edge_quant": m.edge_quant,
        "quant_report": m.quant_report,
        "bytes": sizes,
        "files": files,
        "integrity": "ok" if not problems else "FAILED",
        "problems": problems,
    }


def _split_line(r: dict) -> str:
    n, total, tail = r["split_layer"], r["num_layers"], r.get("tail_layers", 0)
    if not tail:
        return f"split      edge layers [0, {n})  |  cloud layers [{n}, {total})"
    return (f"u-shape    edge layers [0, {n}) + [{total - tail}, {total}) + norm + lm_head  |  cloud layers "
            f"[{n}, {total - tail}) (returns hidden states, never samples)")


def recipe_summary(report: dict) -> str:
    """One line on how the edge front was quantized, from a manifest's ``quant_report`` ("" for fp32). The report is
    outside the bundle id, so a hand edit loads: one its entries do not read as split writes them is said to be so
    (inspect is where such a bundle is looked into; it stopped there with a KeyError / TypeError traceback)."""
    try:
        return _recipe_summary(report)
    except (KeyError, TypeError, AttributeError, ValueError):
        return "quant_report not as split writes it (edited?)"


def _recipe_summary(report: dict) -> str:
    kv = [f"KV cache {report['kv_cache']}"] if report.get("kv_cache") else []  # split --edge-kv int8
    if report.get("method") != "MatMulNBits":
        return ", ".join(kv)
    parts = [f"{report['bits']}-bit weights, block {report['block_size']}",
             {4: "int8 activations", 1: "fp32 activations"}.get(report.get("accuracy_level"),
                                                               f"accuracy level {report.get('accuracy_level')}")]
    grid = report.get("source_grid")
    if grid:
        exact = ", offsets exact in fp32" if grid.get("mode") == "exact" else ""
        parts.append(f"source grid kept on {len(grid['matmuls'])} of {report['quantized_matmuls']} MatMuls{exact}")
    elif report.get("smoothing"):
        parts.append(f"SmoothQuant alpha {report['smoothing']['alpha']}")
    split = report.get("outlier_channels")
    if split:
        parts.append(f"{split['k']} fp32 outlier channels on {len(split['matmuls'])} MatMuls")
    if report.get("float_matmuls"):
        parts.append(f"{len(report['float_matmuls'])} MatMuls fp32")
    return ", ".join(parts + kv)


def format_report(r: dict) -> str:
    mb = lambda b: f"{b / 1e6:8.2f} MB"  # noqa: E731
    lines = [
        f"bundle {r['bundle_id']}  ({r['architecture']}, model_type {r['model_type']})",
        f"source     {r['source']}  [{r['source_identity']}]",
        _split_line(r),
        "shape      " + ", ".join(f"{k} {v}" for k, v in r["shape"].items()),
        f"edge quant {r['edge_quant']}" + (f" ({recipe_summary(r['quant_report'])})"
                                            if recipe_summary(r["quant_report"]) else ""),
        f"sizes      edge {mb(r['bytes']['edge'])}   cloud {mb(r['bytes']['cloud'])}   shared {mb(r['bytes']['shared'])}",
        "files:",
    ]
    for f in r["files"]:
        lines.append(f"  {f['role']:6s} {mb(f['bytes'])}  {f['status']:>14s}  {f['path']}")
    lines.append(f"integrity  {r['integrity']}" + ("" if not r["problems"] else ": " + "; ".join(r["problems"])))
    return "\n".join(lines)
