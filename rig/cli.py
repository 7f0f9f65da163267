"""``autoglm-rig``: the simulated-mobile test rig.

    autoglm-rig run SCENARIO.yaml [--out DIR]     run a scenario; writes DIR/report.json and DIR/*.png
    autoglm-rig demo [--profile 4g]               the whole split on localhost over an emulated 4G link,
                                                  a streamed answer, then split vs all-cloud vs all-edge

Every flag has an environment twin ``AUTOGLM_RIG_<FLAG>``. A bad scenario ends in one line on stderr and
exit status 2; a failed phone or server in exit status 1 (with the log file to read).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from shared.cli_exit import run_command, sigterm_unwinds
from shared.user_paths import user_path


def _env(name: str, default=None):
    return os.environ.get(f"AUTOGLM_RIG_{name}", default)


def _threads(value: str) -> int:
    """``demo --threads``: the scenario's ``edge_threads`` range, said of the flag (it was "edge_threads 0: ...")."""
    from shared.threads import MAX_THREADS

    try:
        n = int(value)
    except ValueError:
        n = None
    if n is None or not 1 <= n <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_THREADS}], got {value!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autoglm-rig", description="The simulated-mobile test rig: emulated "
                                "links, simulated phones, split vs all-cloud vs all-edge.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a scenario file (YAML or JSON)",
                       description="Run a scenario file (YAML or JSON).")
    r.add_argument("scenario", help="scenario file (docs/rig.md describes the keys)")
    r.add_argument("--out", default=_env("OUT"), help="report directory (default rig-report/<scenario name>) "
                                                      "[env AUTOGLM_RIG_OUT]")
    r.add_argument("--no-plots", action="store_true", help="skip the PNG plots")

    d = sub.add_parser("demo", help="the split, all-cloud and all-edge on localhost over an emulated link",
                       description="The split, all-cloud and all-edge on localhost over an emulated link.")
    d.add_argument("--profile", default=_env("PROFILE", "4g"), help="link profile (default 4g) "
                                                                    "[env AUTOGLM_RIG_PROFILE]")
    d.add_argument("--threads", type=_threads, default=_env("THREADS", "1"),
                   help="onnxruntime threads of the simulated phone (default 1) [env AUTOGLM_RIG_THREADS]")
    d.add_argument("--out", default=_env("OUT"), help="report directory (default: a temporary one) "
                                                      "[env AUTOGLM_RIG_OUT]")
    d.add_argument("--rebuild", action="store_true", help="rebuild the cached bundle and whole-model export")
    return p


class OutDirError(ValueError):
    """``--out`` cannot hold the report (a file, under a file, not writable): said before anything starts."""


def check_out_dir(out: Path) -> Path:
    """Make ``out`` (and ``out/logs``) and prove a file can be written there; OutDirError otherwise. A leading
    ``~`` is the home (``AUTOGLM_RIG_OUT=~/reports`` made a folder named ``~`` here)."""
    out = user_path(out)
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
        probe = out / ".autoglm-rig-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OutDirError(f"--out {out}: cannot write the report there ({e.strerror or e})") from None
    return out


def write_report(report: dict, out: Path, plots: bool = True) -> list[Path]:
    """``out/report.json`` (+ ``out/rig_<workload>.png``); returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    files = [path]
    if plots:
        from .plots import plot_report

        files += plot_report(report["summary"], out, prefix="rig")
    return files


def keep_partial(out: Path, run: Callable[[], dict]) -> dict:
    """``run()``; when Ctrl-C or SIGTERM interrupts it, or a phone or server fails, write what finished to
    ``out/report.json`` (marked ``"interrupted": true`` or ``"failed": <why>``, no plots) and say where, before
    the exception propagates (exit 130, exit 1)."""
    from .runner import RigError, RunInterrupted

    try:
        return run()
    except RunInterrupted as e:
        _write_partial(dict(e.report, interrupted=True), out)
        raise
    except RigError as e:
        if e.report is not None and e.report["records"]:
            _write_partial(dict(e.report, failed=str(e)), out)
        raise


def _write_partial(report: dict, out: Path) -> None:
    path = write_report(report, out, plots=False)[0]
    print(f"partial report (the {len(report['records'])} requests of the runs that finished): {path}; "
          f"logs: {out / 'logs'}", file=sys.stderr)


def _cmd_run(args) -> int:
    from .report import format_table
    from .runner import Progress, run_scenario
    from .scenario import load_scenario

    sc = load_scenario(args.scenario)
    out = check_out_dir(Path(args.out or Path("rig-report") / sc.name))
    report = keep_partial(out, lambda: run_scenario(sc, out, Progress()))
    report["command"] = f"autoglm-rig run {args.scenario}" + (f" --out {args.out}" if args.out else "")
    if sc.plan_check:
        report = keep_partial(out, lambda: _with_plan_check(report, sc))
    files = write_report(report, out, plots=not args.no_plots)
    print(format_table(report["summary"]))
    if "plan_check" in report:
        from .plan_check import format_check

        print("\n" + format_check(report["plan_check"]))
    print("report: " + ", ".join(str(f) for f in files))
    return 0


def _with_plan_check(report: dict, sc) -> dict:
    """``report`` with its ``plan_check``; a Ctrl-C or SIGTERM during the check interrupts the run as one during
    its runs does: the report, every run's records in it, is written marked ``interrupted``."""
    from .runner import RunInterrupted

    try:
        print("checking the planner's predictions (measuring its costs on the same cores)", file=sys.stderr)
        from .plan_check import check_plan

        return dict(report, plan_check=check_plan(report, sc, Path(report["bundle"]),
                                                  Path(report["whole"]) if report["whole"] else None))
    except KeyboardInterrupt:
        raise RunInterrupted(report) from None


def _cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(profile=args.profile, threads=args.threads, out=check_out_dir(Path(args.out)) if args.out else None,
             rebuild=args.rebuild)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .profiles import LinkProfileError
    from .runner import RigError
    from .scenario import ScenarioError

    handler = {"run": _cmd_run, "demo": _cmd_demo}[args.command]
    sigterm_unwinds()  # clean up as on Ctrl-C: the servers run in their own sessions
    return run_command("autoglm-rig", args.command, handler, args,
                       (ScenarioError, LinkProfileError, FileNotFoundError, OutDirError), (RigError,))


if __name__ == "__main__":
    sys.exit(main())
