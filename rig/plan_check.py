"""Check the planner against the rig: predicted vs measured TTFT and per-token latency, per profile and mode.

The planner (``partition_tools.plan``) measures its costs on the same cores the rig pinned its phone and its
cloud servers to (the edge at the phone's threads, the cloud at one torch thread per cloud core), then
predicts each measured (profile, workload, mode) row from the request shapes the rig saw (mean prompt tokens,
mean tokens served by the edge cache, mean output tokens). A prediction passes when it is within
``tolerance`` (25 %) of the measured median.
"""

from __future__ import annotations

import statistics

TOLERANCE = 0.25


def _shape(records: list[dict]):
    from partition_tools.plan import Shape

    prompt = statistics.mean(r["prompt_tokens"] for r in records)
    cached = statistics.mean(r["edge_cached_tokens"] if r["mode"] != "all-cloud" else r["cloud_cached_tokens"]
                             for r in records)
    out = statistics.mean(r["completion_tokens"] for r in records)
    return Shape(round(prompt), round(cached), max(1, round(out)), round(4 * prompt))  # ~4 bytes per BPE token


def check_plan(report: dict, scenario, bundle, tolerance: float = TOLERANCE) -> dict:
    """Predict every measured row of ``report`` with the planner; returns rows of predicted vs measured."""
    from partition_tools.models import load_model
    from partition_tools.plan import PlanConfig, measure_costs, predict

    from .profiles import resolve_profile

    profiles = {p["name"]: resolve_profile({k: v for k, v in p.items()}) for p in report["scenario"]["profiles"]}
    base = PlanConfig(link=next(iter(profiles.values())), edge_threads=scenario.edge_threads,
                      cloud_threads=len(scenario.cloud_cores or [0]), edge_cores=scenario.phone_cores,
                      cloud_cores=scenario.cloud_cores, candidates=[scenario.split_layer])
    groups: dict[tuple, list[dict]] = {}
    for r in report["records"]:
        groups.setdefault((r["profile"], r["workload"], r["mode"]), []).append(r)
    shapes = {k: _shape(v) for k, v in groups.items()}
    chat = next((s for (_, w, _), s in shapes.items() if w == "chat"), base.chat)
    agent = next((s for (_, w, _), s in shapes.items() if w == "agent"), base.agent)
    base.chat, base.agent = chat, agent
    costs = measure_costs(load_model(scenario.model), base, bundle)
    rows = []
    for (prof, workload, mode), recs in groups.items():
        cfg = PlanConfig(link=profiles[prof], edge_threads=base.edge_threads, codec=_codec(recs),
                         candidates=base.candidates)
        n = scenario.split_layer if mode == "split" else mode
        pred = predict(costs, cfg, n, shapes[(prof, workload, mode)])
        ttft = statistics.median(r["ttft_s"] for r in recs)
        gaps = [g for r in recs for g in r["itl_s"]]
        itl = statistics.median(gaps) if gaps else None
        row = {"profile": prof, "workload": workload, "mode": mode,
               "ttft_ms_predicted": 1000 * pred["ttft_s"], "ttft_ms_measured": 1000 * ttft,
               "per_token_ms_predicted": 1000 * pred["per_token_s"],
               "per_token_ms_measured": None if itl is None else 1000 * itl}
        row["ttft_error"] = pred["ttft_s"] / ttft - 1
        row["per_token_error"] = None if itl is None else pred["per_token_s"] / itl - 1
        row["within_tolerance"] = abs(row["ttft_error"]) <= tolerance and (
            row["per_token_error"] is None or abs(row["per_token_error"]) <= tolerance)
        rows.append(row)
    from partition_tools.plan import _costs_dict

    return {"tolerance": tolerance, "costs": _costs_dict(costs), "rows": rows,
            "passed": sum(r["within_tolerance"] for r in rows), "total": len(rows)}


def _codec(records: list[dict]) -> str:
    codecs = [r.get("codec") for r in records if r.get("codec") not in (None, "", "text", "none")]
    return max(set(codecs), key=codecs.count) if codecs else "int8-outlier"


def format_check(check: dict) -> str:
    lines = [f"{'profile':<8} {'workload':<6} {'mode':<9} {'TTFT pred':>10} {'meas':>7} {'err':>6} "
             f"{'tok pred':>9} {'meas':>7} {'err':>6}"]
    for r in check["rows"]:
        pt = "-" if r["per_token_ms_measured"] is None else f"{r['per_token_ms_measured']:.1f}"
        pe = "-" if r["per_token_error"] is None else f"{100 * r['per_token_error']:+.0f}%"
        lines.append(f"{r['profile']:<8} {r['workload']:<6} {r['mode']:<9} {r['ttft_ms_predicted']:>10.0f} "
                     f"{r['ttft_ms_measured']:>7.0f} {100 * r['ttft_error']:>+5.0f}% "
                     f"{r['per_token_ms_predicted']:>9.1f} {pt:>7} {pe:>6}"
                     + ("" if r["within_tolerance"] else "  (outside)"))
    lines.append(f"planner vs rig: {check['passed']}/{check['total']} rows within "
                 f"{100 * check['tolerance']:.0f} %")
    return "\n".join(lines)
