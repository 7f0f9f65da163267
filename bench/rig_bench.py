"""The committed rig report: run a scenario (default bench/rig_smollm2.yaml) and write its JSON and plots
under docs/results/ as ``<name>.json`` and ``<name>_<workload>.png``.

    python bench/rig_bench.py [--scenario bench/rig_smollm2.yaml] [--results docs/results]

Same as ``autoglm-rig run SCENARIO`` plus the copy into docs/results (tests never write there).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rig.plan_check import check_plan, format_check  # noqa: E402
from rig.plots import plot_report  # noqa: E402
from rig.report import format_table  # noqa: E402
from rig.runner import Progress, run_scenario  # noqa: E402
from rig.scenario import load_scenario  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default=str(ROOT / "bench" / "rig_smollm2.yaml"))
    ap.add_argument("--results", default=str(ROOT / "docs" / "results"))
    args = ap.parse_args()
    sc = load_scenario(args.scenario)
    results = Path(args.results)
    with tempfile.TemporaryDirectory(prefix="rig-bench-") as tmp:
        report = run_scenario(sc, Path(tmp), Progress())
        if sc.plan_check:
            report["plan_check"] = check_plan(report, sc, Path(report["bundle"]),
                                              Path(report["whole"]) if report["whole"] else None)
    report["command"] = "python bench/rig_bench.py --scenario " + Path(args.scenario).relative_to(ROOT).as_posix() \
        if Path(args.scenario).resolve().is_relative_to(ROOT) else f"python bench/rig_bench.py --scenario {args.scenario}"
    report["note"] = ("a shared 2-core machine with other jobs running: absolute times are noisy; compare modes "
                      "within one profile (measured side by side in this run)")
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{sc.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    plots = plot_report(report["summary"], results, prefix=sc.name)
    print(format_table(report["summary"]))
    if "plan_check" in report:
        print("\n" + format_check(report["plan_check"]))
    print(f"wrote {results / (sc.name + '.json')}, " + ", ".join(str(p) for p in plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
