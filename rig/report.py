"""The rig's report: per-request records in, one summary row per (profile, workload, mode) out.

Each row: TTFT and inter-token latency p50/p95/p99 (ms), decode tokens/s (mean over the requests that decoded:
a one-token answer has no decode rate, not a rate of 0; None when none did), bytes up and
down per request and per token (up: per prompt + generated token, since the split uploads one state per
position; down: per generated token), edge compute per request (ms), and the cache hit rates (prompt tokens
the edge's activation cache served; prompt tokens the cloud's prefix cache served). ``format_table`` is the
terminal summary.
"""

from __future__ import annotations

import numpy as np

MODE_ORDER = ("split", "all-cloud", "all-edge")


def percentile_ms(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` (seconds) in ms (numpy's linear interpolation), None for none."""
    return float(np.percentile(values, q)) * 1000.0 if values else None


def decode_rate(records: list[dict]) -> float | None:
    """Mean decode tokens/s over the records with inter-token gaps (None for none): a record of one token (a
    ``stop`` at once, ``max_tokens`` 1) has no decode time, and counted as 0 it pulled the mean down."""
    rates = [r["tokens_per_s"] for r in records if r.get("itl_s")]
    return float(np.mean(rates)) if rates else None


def summarize(records: list[dict]) -> list[dict]:
    """Group request records by (profile, workload, mode) and reduce each group to one row."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["profile"], r["workload"], r["mode"]), []).append(r)
    rows = []
    for (profile, workload, mode), rs in groups.items():
        ttft = [r["ttft_s"] for r in rs]
        itl = [g for r in rs for g in r["itl_s"]]
        prompt = sum(r["prompt_tokens"] for r in rs)
        gen = sum(r["completion_tokens"] for r in rs)
        up = sum(r["bytes_up"] for r in rs)
        down = sum(r["bytes_down"] for r in rs)
        rows.append({
            "profile": profile, "workload": workload, "mode": mode, "requests": len(rs),
            "prompt_tokens": prompt, "completion_tokens": gen,
            "ttft_ms_p50": percentile_ms(ttft, 50), "ttft_ms_p95": percentile_ms(ttft, 95),
            "ttft_ms_p99": percentile_ms(ttft, 99),
            "itl_ms_p50": percentile_ms(itl, 50), "itl_ms_p95": percentile_ms(itl, 95),
            "itl_ms_p99": percentile_ms(itl, 99),
            "tokens_per_s": decode_rate(rs),
            "total_s_mean": float(np.mean([r["total_s"] for r in rs])),
            "bytes_up_per_request": up / len(rs), "bytes_down_per_request": down / len(rs),
            "bytes_up_per_token": up / max(1, prompt + gen), "bytes_down_per_token": down / max(1, gen),
            "edge_compute_ms_per_request": 1000.0 * float(np.mean([r["edge_compute_s"] for r in rs])),
            "edge_cache_hit_rate": sum(r["edge_cached_tokens"] for r in rs) / max(1, prompt),
            "cloud_cache_hit_rate": sum(r["cloud_cached_tokens"] for r in rs) / max(1, prompt),
            "reconnects": sum(r.get("reconnects", 0) for r in rs),
        })
    order = {m: i for i, m in enumerate(MODE_ORDER)}
    profiles = list(dict.fromkeys(r["profile"] for r in records))
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    rows.sort(key=lambda x: (profiles.index(x["profile"]), workloads.index(x["workload"]), order[x["mode"]]))
    return rows


def _f(v: float | None, fmt: str = ".0f") -> str:
    return "-" if v is None else format(v, fmt)


def _size(n: float) -> str:
    return f"{n / 1024:.1f}K" if n >= 1024 else f"{n:.0f}"


def format_table(rows: list[dict]) -> str:
    """The terminal summary: one line per (profile, workload, mode)."""
    head = (f"{'profile':<8} {'workload':<6} {'mode':<9} {'n':>3} {'TTFT p50':>9} {'p95':>7} {'ITL p50':>8} "
            f"{'p95':>6} {'tok/s':>6} {'up/req':>8} {'down/req':>8} {'up/tok':>7} {'edge ms':>8} "
            f"{'edge$':>6} {'cloud$':>6}")
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        key = (r["profile"], r["workload"])
        if last is not None and key != last:
            lines.append("")
        last = key
        lines.append(
            f"{r['profile']:<8} {r['workload']:<6} {r['mode']:<9} {r['requests']:>3} {_f(r['ttft_ms_p50']):>9} "
            f"{_f(r['ttft_ms_p95']):>7} {_f(r['itl_ms_p50']):>8} {_f(r['itl_ms_p95']):>6} "
            f"{_f(r['tokens_per_s'], '.1f'):>6} {_size(r['bytes_up_per_request']):>8} "
            f"{_size(r['bytes_down_per_request']):>8} {r['bytes_up_per_token']:>7.0f} "
            f"{r['edge_compute_ms_per_request']:>8.0f} {100 * r['edge_cache_hit_rate']:>5.0f}% "
            f"{100 * r['cloud_cache_hit_rate']:>5.0f}%")
    lines.append("TTFT/ITL in ms; up/down in bytes per request; up/tok = bytes up per prompt+generated token; "
                 "edge$ / cloud$ = prompt tokens served by the edge / cloud cache")
    return "\n".join(lines)
