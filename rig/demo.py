"""``autoglm-rig demo``: the README's first command. The embedded default (SmolLM2-135M-Instruct, split at
layer 8, int8 edge) on localhost behind an emulated ``4g`` link:

1. build once, cached: the split bundle and the whole-model export (all-edge);
2. start the split cloud server and the full-model server (all-cloud) as processes;
3. one simulated phone per mode streams answers to a few chat questions and a few AutoGLM agent steps; the
   first answer (split mode) is printed as it streams;
4. print the side-by-side summary: split vs all-cloud vs all-edge.

Logs of the servers and phones go to files (the paths are printed), never to the terminal.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from .profiles import resolve_profile
from .scenario import Scenario, Workload

DEMO_REQUESTS = {"chat": 3, "agent": 3}


def demo_scenario(profile: str = "4g", threads: int = 1) -> Scenario:
    return Scenario(name="demo", model="smollm2", split_layer=8, edge_quant="int8",
                    profiles=[resolve_profile(profile)], modes=["split", "all-cloud", "all-edge"], phones=1,
                    edge_threads=threads, workloads=[Workload("chat", DEMO_REQUESTS["chat"], 64),
                                                     Workload("agent", DEMO_REQUESTS["agent"], 24)])


def run_demo(profile: str = "4g", threads: int = 1, out: Path | None = None, rebuild: bool = False,
             stream=sys.stdout) -> dict:
    """Steps 1-4 of the module docstring; returns the report."""
    from .artifacts import cache_dir, ensure_bundle, ensure_whole, quiet_build_logs
    from .cli import keep_partial, write_report
    from .report import format_table
    from .runner import Progress, check_model, run_scenario
    from .workloads import CHAT_PROMPTS

    sc = demo_scenario(profile, threads)
    quiet_build_logs()
    identity = check_model(sc)  # (a ScenarioError when the model is not there: the SmolLM2 GGUF)
    bundle = ensure_bundle(cache_dir("bundles", sc.model, f"l{sc.split_layer}"), source=sc.model,
                           layer=sc.split_layer, edge_quant=sc.edge_quant, rebuild=rebuild, identity=identity)
    whole = ensure_whole(sc.model, sc.edge_quant, identity=identity) if not rebuild else _rebuild_whole(sc)
    out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="autoglm-rig-demo-"))
    p = sc.profiles[0]
    print(f"link {p.name}: RTT {p.rtt_ms:.0f} ms, {p.down_mbps:g} Mbps down / {p.up_mbps:g} Mbps up, "
          f"{100 * p.loss:g} % segments retransmitted; phone: {threads} onnxruntime thread(s)", file=stream)
    state = {"answer": "pending"}  # pending -> streaming -> done

    def on_delta(text: str) -> None:
        if state["answer"] == "pending":
            state["answer"] = "streaming"
            stream.write(f"\nuser> {CHAT_PROMPTS[0]}\nassistant (split, over {p.name})> ")
        if state["answer"] == "streaming":
            stream.write(text)
            stream.flush()

    def end_answer() -> None:  # the first progress output after the answer ends it
        if state["answer"] == "streaming":
            state["answer"] = "done"
            stream.write("\n\n")
            stream.flush()

    report = keep_partial(out, lambda: run_scenario(sc, out, Progress(before_output=end_answer), on_delta=on_delta,
                                                    bundle=bundle, whole=whole))
    report["command"] = "autoglm-rig demo" + (f" --profile {profile}" if profile != "4g" else "")
    files = write_report(report, out)
    print("\n" + format_table(report["summary"]), file=stream)
    print(f"\nreport and plots: {', '.join(str(f) for f in files)}\nlogs: {out / 'logs'}", file=stream)
    return report


def _rebuild_whole(sc: Scenario) -> Path:
    import shutil

    from .artifacts import cache_dir, ensure_whole

    shutil.rmtree(cache_dir("whole", sc.model, sc.edge_quant), ignore_errors=True)
    return ensure_whole(sc.model, sc.edge_quant)
