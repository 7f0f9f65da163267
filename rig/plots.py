"""PNG plots of a rig report (matplotlib, Agg backend: no display needed).

One figure per workload, four panels: TTFT (p50 bar, p95 and p99 marks), inter-token latency (same),
decode tokens/s, and bytes up per request (log scale), each grouped by link profile with one bar per mode.
"""

from __future__ import annotations

from pathlib import Path

from .report import MODE_ORDER

COLORS = {"split": "#1f77b4", "all-cloud": "#ff7f0e", "all-edge": "#2ca02c"}


def plot_report(rows: list[dict], out_dir: Path, prefix: str = "rig") -> list[Path]:
    """Write ``<prefix>_<workload>.png`` per workload into ``out_dir``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        rs = [r for r in rows if r["workload"] == workload]
        profiles = list(dict.fromkeys(r["profile"] for r in rs))
        modes = [m for m in MODE_ORDER if any(r["mode"] == m for r in rs)]
        fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
        panels = (("ttft_ms", "time to first token (ms)", False), ("itl_ms", "inter-token latency (ms)", False),
                  ("tokens_per_s", "decode tokens/s", False), ("bytes_up_per_request", "bytes up per request", True))
        width = 0.8 / max(1, len(modes))
        for ax, (key, title, log) in zip(axes.flat, panels):
            for j, mode in enumerate(modes):
                xs, ys, p95, p99 = [], [], [], []
                for i, prof in enumerate(profiles):
                    row = next((r for r in rs if r["profile"] == prof and r["mode"] == mode), None)
                    if row is None:
                        continue
                    value = row.get(f"{key}_p50", row.get(key))
                    if value is None or (log and value <= 0):
                        continue
                    xs.append(i + (j - (len(modes) - 1) / 2) * width)
                    ys.append(value)
                    p95.append(row.get(f"{key}_p95"))
                    p99.append(row.get(f"{key}_p99"))
                ax.bar(xs, ys, width=width, color=COLORS[mode], label=mode)
                for x, a, b in zip(xs, p95, p99):
                    if a is not None:
                        ax.plot([x], [a], marker="_", color="black", markersize=12)
                    if b is not None:
                        ax.plot([x], [b], marker="v", color="black", markersize=4)
            ax.set_xticks(range(len(profiles)), profiles)
            ax.set_title(title + (" (p50 bar, p95 -, p99 v)" if key.endswith("_ms") else ""), fontsize=10)
            if log:
                ax.set_yscale("log")
            ax.grid(axis="y", alpha=0.3)
        axes[0][0].legend(fontsize=9)
        fig.suptitle(f"{prefix}: {workload} workload, split vs all-cloud vs all-edge per link profile")
        fig.tight_layout()
        path = out_dir / f"{prefix}_{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
