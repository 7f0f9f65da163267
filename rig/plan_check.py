"""Check the planner against the rig: predicted vs measured TTFT and per-token latency, per profile and mode.

1. The planner (``partition_tools.plan``) measures its costs on the cores the rig pinned its phone and its
   cloud servers to: the edge front (the scenario's bundle) and the whole-model graph at the phone's
   threads, the cloud's decoder layer in torch at one thread per cloud core.
2. Calibration on the loopback link (the runner adds it to a ``plan_check`` scenario): what the layer
   timings miss (asyncio, msgpack, HTTP/SSE, the engine's Python step; or, when negative, what they
   overstate) is the measured minus the predicted latency there, per (workload, mode) for TTFT and per
   token. It is the only thing taken from the rig; the link's share of every other profile is the planner's
   own model.
3. Every other (profile, workload, mode) row: each request predicted from its own shape (prompt tokens, the
   tokens the caches served, output tokens); the medians compared with the measured medians. A row passes
   when both are within ``tolerance`` (25 %).
"""

from __future__ import annotations

import statistics

from .link import IDEAL

TOLERANCE = 0.25


def _shape(r: dict):
    from partition_tools.plan import Shape

    cached = r["cloud_cached_tokens"] if r["mode"] == "all-cloud" else r["edge_cached_tokens"]
    text = max(0, r["bytes_up"] - 300) if r["mode"] == "all-cloud" else 4 * r["prompt_tokens"]
    return Shape(r["prompt_tokens"], cached, max(1, r["completion_tokens"]), text)


def _predict_group(costs, cfg, n, recs: list[dict]) -> tuple[float, float]:
    from partition_tools.plan import predict

    preds = [predict(costs, cfg, n, _shape(r)) for r in recs]
    return (statistics.median(p["ttft_s"] for p in preds), statistics.median(p["per_token_s"] for p in preds))


def _measured(recs: list[dict]) -> tuple[float, float | None]:
    gaps = [g for r in recs for g in r["itl_s"]]
    return statistics.median(r["ttft_s"] for r in recs), (statistics.median(gaps) if gaps else None)


def check_plan(report: dict, scenario, bundle, whole=None, tolerance: float = TOLERANCE) -> dict:
    """Predict every measured row of ``report`` with the planner; returns rows of predicted vs measured."""
    from partition_tools.models import load_model
    from partition_tools.plan import PlanConfig, _costs_dict, measure_costs

    from .profiles import resolve_profile

    profiles = {p["name"]: resolve_profile(dict(p)) for p in report["scenario"]["profiles"]}
    profiles[IDEAL.name] = IDEAL
    groups: dict[tuple, list[dict]] = {}
    for r in report["records"]:
        groups.setdefault((r["profile"], r["workload"], r["mode"]), []).append(r)
    ctx = {w: max(r["prompt_tokens"] + r["completion_tokens"] // 2 for (_, w2, _), rs in groups.items()
                  if w2 == w for r in rs) for (_, w, _) in groups}
    shapes = {w: _shape(next(rs[0] for (_, w2, _), rs in groups.items() if w2 == w)) for w in ctx}
    base = PlanConfig(link=IDEAL, edge_threads=scenario.edge_threads, cloud_threads=len(scenario.cloud_cores or [0]),
                      edge_cores=scenario.phone_cores, cloud_cores=scenario.cloud_cores,
                      candidates=[scenario.split_layer], whole=whole,
                      chat=shapes.get("chat", PlanConfig.__dataclass_fields__["chat"].default_factory()),
                      agent=shapes.get("agent", PlanConfig.__dataclass_fields__["agent"].default_factory()))
    costs = measure_costs(load_model(scenario.model), base, bundle)

    def config(prof: str, mode: str, overheads: dict) -> PlanConfig:
        cfg = PlanConfig(link=profiles[prof], edge_threads=base.edge_threads, candidates=base.candidates,
                         codec=_codec(groups.get((prof, "chat", mode), []) + groups.get((prof, "agent", mode), [])),
                         overheads=overheads)
        return cfg

    # 2. calibration: loopback, zero assumed overhead -> the overhead is what is left
    calibration = {}
    for (prof, workload, mode), recs in groups.items():
        if prof != IDEAL.name or mode == "all-edge":
            continue
        n = scenario.split_layer if mode == "split" else mode
        zero = config(prof, mode, {mode: (0.0, 0.0)})
        p_ttft, p_tok = _predict_group(costs, zero, n, recs)
        m_ttft, m_tok = _measured(recs)
        # signed: a negative residual means the layer timings overestimate (e.g. the engine batches better)
        calibration[(workload, mode)] = (m_ttft - p_ttft, (m_tok or p_tok) - p_tok)
    # 3. every other row
    rows = []
    for (prof, workload, mode), recs in groups.items():
        if prof == IDEAL.name:
            continue
        n = scenario.split_layer if mode == "split" else mode
        over = {mode: calibration.get((workload, mode), (0.0, 0.0))}
        p_ttft, p_tok = _predict_group(costs, config(prof, mode, over), n, recs)
        m_ttft, m_tok = _measured(recs)
        row = {"profile": prof, "workload": workload, "mode": mode,
               "ttft_ms_predicted": 1000 * p_ttft, "ttft_ms_measured": 1000 * m_ttft,
               "per_token_ms_predicted": 1000 * p_tok, "per_token_ms_measured": None if m_tok is None else 1000 * m_tok,
               "ttft_error": p_ttft / m_ttft - 1, "per_token_error": None if m_tok is None else p_tok / m_tok - 1}
        row["within_tolerance"] = abs(row["ttft_error"]) <= tolerance and (
            row["per_token_error"] is None or abs(row["per_token_error"]) <= tolerance)
        rows.append(row)
    return {"tolerance": tolerance, "costs": _costs_dict(costs), "rows": rows,
            "calibration_ms": {f"{w}/{m}": {"ttft": 1000 * a, "per_token": 1000 * b}
                               for (w, m), (a, b) in calibration.items()},
            "passed": sum(r["within_tolerance"] for r in rows), "total": len(rows)}


def _codec(records: list[dict]) -> str:
    codecs = [r.get("codec") for r in records if r.get("codec") not in (None, "", "text", "none")]
    return max(set(codecs), key=codecs.count) if codecs else "int8-outlier"


def format_check(check: dict) -> str:
    cal = ", ".join(f"{k} {v['ttft']:+.0f}/{v['per_token']:+.1f} ms" for k, v in check["calibration_ms"].items())
    lines = [f"software overhead calibrated on loopback (TTFT/per token): {cal or 'none'}",
             f"{'profile':<8} {'workload':<6} {'mode':<9} {'TTFT pred':>10} {'meas':>7} {'err':>6} "
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
