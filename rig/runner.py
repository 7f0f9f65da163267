"""Run a scenario: cloud servers, simulated phones behind emulated links, every (profile, workload, mode).

The flow (``run_scenario``):

1. artifacts: the split bundle and, for all-edge, the whole-model export (built once, cached);
2. for each link profile: fresh cloud processes (the split server with the bundle's back half, the
   full-model server for all-cloud; pinned to ``cloud_cores``; cold prefix caches, so no profile inherits
   another's), then for each workload and mode one :class:`~rig.link.LinkEmulator` per phone in front of the
   right server and ``phones`` phone processes (``python -m rig.phone``) pinned to ``phone_cores``; all
   phones warm up, then start together (a burst) and run their requests one after another;
3. all-edge has no link: it runs once per workload and its rows repeat under every profile;
4. the report: per-request records, the summary rows, link statistics, the scenario, the machine.

Progress goes to ``progress`` (one updating line on a terminal, one line per finished run otherwise);
server and phone logs go to files under the output directory, never to the terminal.
"""

from __future__ import annotations

import json
import os
import platform
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO
from collections.abc import Callable

from edge_client.demo import die_with_parent
from shared.manifest import BundleError

from .link import IDEAL, LinkEmulator
from .profiles import LinkProfile
from .report import decode_rate, percentile_ms, summarize
from .scenario import Scenario, ScenarioError
from .servers import CloudProcess, stop_all
from .workloads import build

STALL_S = 1800.0  # a run whose phones have all said nothing (no request done, no streamed text) this long is hung


class RigError(RuntimeError):
    """A phone or a server failed; the message says which and where its log is. ``report``: the runs that
    finished before it (set by :func:`run_scenario`; the CLI writes them, marked ``failed``)."""

    report: dict | None = None


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM mid-run, after every phone, link and server was stopped; ``report`` holds the runs that
    finished (the CLI writes it, marked ``interrupted``)."""

    def __init__(self, report: dict):
        super().__init__()
        self.report = report


@dataclass(slots=True)
class Progress:
    """The progress line: rewritten in place on a terminal, one line per finished run otherwise.
    ``before_output`` runs before anything is written (the demo ends its streamed answer there)."""

    out: TextIO = field(default_factory=lambda: sys.stderr)
    before_output: Callable[[], None] | None = None
    tty: bool = False
    _width: int = 0

    def __post_init__(self):
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())

    def update(self, text: str) -> None:
        if self.tty:
            if self.before_output is not None:
                self.before_output()
            pad = max(0, self._width - len(text))
            self.out.write("\r" + text + " " * pad)
            self.out.flush()
            self._width = len(text)

    def line(self, text: str) -> None:
        if self.before_output is not None:
            self.before_output()
        if self.tty and self._width:
            self.out.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.out.write(text + "\n")
        self.out.flush()


@dataclass(slots=True)
class Targets:
    bundle: Path  # the split bundle (the edge half; also the tokenizer for all-edge)
    whole: Path | None  # the whole-model export (all-edge)


def _phone_job(sc: Scenario, targets: Targets, mode: str, phone: int, port: int | None, requests: list[dict],
               stream_first: bool, link: LinkProfile | None) -> dict:
    """Phone ``phone``'s job (rig.phone): ``link_kbps`` is its link's uplink, which its edge client is told as an
    app on that link is (EdgeConfig.link_kbps, the platform's estimate): the precision policy's slow-link tier."""
    url = None
    if mode == "split":
        url = f"ws://127.0.0.1:{port}/v1/split"
    elif mode == "all-cloud":
        url = f"http://127.0.0.1:{port}"
    cores = None
    if sc.phone_cores:
        cores = [sc.phone_cores[phone % len(sc.phone_cores)]] if sc.phones > 1 else list(sc.phone_cores)
    return {"phone": phone, "mode": mode, "bundle": str(targets.bundle),
            "whole": str(targets.whole) if targets.whole else None, "url": url, "threads": sc.edge_threads,
            "cores": cores, "requests": requests, "stream_first": stream_first, "speculate": sc.speculate,
            "link_kbps": link.up_mbps * 1000 if link is not None else None}


def _reader(proc: subprocess.Popen, phone: int, events: queue.Queue) -> None:
    for line in proc.stdout:
        line = line.strip()
        if line:
            try:
                events.put((phone, json.loads(line)))
            except json.JSONDecodeError:
                events.put((phone, {"event": "noise", "text": line}))
    events.put((phone, {"event": "exit", "code": proc.wait()}))


def run_phones(sc: Scenario, targets: Targets, mode: str, workload, ports: list[int | None], log_dir: Path,
               tag: str, progress: Progress, on_delta=None, stall_s: float = STALL_S,
               on_go: Callable[[], None] | None = None, link: LinkProfile | None = None,
               servers: tuple[CloudProcess, ...] = ()) -> list[dict]:
    """Start ``sc.phones`` phone processes for one (workload, mode, link), release them together, collect
    their request records. ``ports[i]`` is phone i's link port (None for all-edge), ``link`` the profile of those
    links; ``on_go`` runs as they are released (the links' scheduled disconnects start then). The run may take as
    long as its phones keep reporting: a RigError when none has said anything for ``stall_s`` (a hung phone), or
    at once when one of ``servers`` (the cloud server the phones talk to) exits."""
    events: queue.Queue = queue.Queue()
    procs = []
    env = dict(os.environ, OMP_NUM_THREADS=str(sc.edge_threads), PYTHONWARNINGS="ignore")
    for i in range(sc.phones):
        reqs = [r.to_dict() for r in build(workload.kind, workload.requests, workload.max_tokens, offset=i)]
        job = _phone_job(sc, targets, mode, i, ports[i], reqs, stream_first=on_delta is not None and i == 0, link=link)
        log = open(log_dir / f"phone-{tag}-{i}.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", "rig.phone"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=log, env=env, text=True, cwd=str(Path(__file__).resolve().parent.parent),
                             preexec_fn=die_with_parent())
        log.close()
        p.stdin.write(json.dumps(job) + "\n")
        p.stdin.flush()
        procs.append(p)
        threading.Thread(target=_reader, args=(p, i, events), daemon=True).start()
    records: list[dict] = []
    ready, exited = set(), set()
    total = sc.phones * workload.requests
    heard = time.monotonic()  # when a phone last said something
    try:
        while len(exited) < len(procs):
            for srv in servers:  # (a dead one's phones retried for their reconnect window, 90 s, then failed naming
                # their own logs: "cannot reach the cloud")
                if srv.proc is not None and (code := srv.proc.poll()) is not None:
                    raise RigError(f"[{tag}] the {srv.mode} cloud server exited with code {code} mid-run "
                                   f"({len(records)}/{total} requests done; log: {srv.log_path})")
            try:
                phone, ev = events.get(timeout=min(1.0, stall_s))
            except queue.Empty:
                if time.monotonic() - heard < stall_s:
                    continue
                raise RigError(f"[{tag}] {len(procs) - len(exited)} phone(s) said nothing for {stall_s:g} s "
                               f"({len(records)}/{total} requests done; logs: {log_dir}/phone-{tag}-*.log)") from None
            heard = time.monotonic()
            kind = ev.get("event")
            if kind == "ready":
                ready.add(phone)
                if len(ready) == len(procs):  # the burst: every phone starts at once
                    for p in procs:
                        p.stdin.write("go\n")
                        p.stdin.flush()
                    if on_go is not None:
                        on_go()
            elif kind == "delta" and on_delta is not None:
                on_delta(ev["text"])
            elif kind == "request":
                records.append(ev)
                progress.update(f"[{tag}] {len(records)}/{total} requests | last: TTFT "
                                f"{1000 * ev['ttft_s']:.0f} ms, {ev['tokens_per_s']:.1f} tok/s, "
                                f"{ev['completion_tokens']} tokens")
            elif kind == "error":
                raise RigError(f"[{tag}] phone {phone}: {ev['message']} (log: {log_dir}/phone-{tag}-{phone}.log)")
            elif kind == "exit":
                exited.add(phone)
                if ev["code"] != 0:
                    raise RigError(f"[{tag}] phone {phone} exited with code {ev['code']} "
                                   f"(log: {log_dir}/phone-{tag}-{phone}.log)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    return records


def check_model(sc: Scenario) -> str:
    """ScenarioError, before anything is built or started, for a ``model`` the run cannot use: no preset,
    checkpoint directory or .gguf (it was a ModelLoadError traceback), or, with ``all-cloud``, a model without a
    tokenizer (the random presets: the full server refuses every text request, so the run failed only at its
    first all-cloud phone); then :func:`check_artifacts`. Returns the model's source identity."""
    from partition_tools.models import ModelLoadError, has_tokenizer, source_identity

    try:
        identity = source_identity(sc.model)
    except ModelLoadError as e:
        raise ScenarioError(f"model: {e}") from None
    check_artifacts(sc, identity)
    if "all-cloud" in sc.modes and not has_tokenizer(sc.model):
        raise ScenarioError(f"modes: all-cloud needs a model with a tokenizer (the full server's OpenAI API takes "
                            f"text) and model {sc.model} has none: use smollm2 or a checkpoint with tokenizer "
                            f"files, or drop all-cloud")
    return identity


def check_artifacts(sc: Scenario, identity: str) -> None:
    """ScenarioError when the scenario's own ``bundle`` or ``whole`` was built from another model than ``model``
    (``identity``, its source identity), or the bundle is split at another layer than ``split_layer``: the run
    measured one model's split against another's full server and all-edge export, and the report (and the plan
    check's predictions) named ``model`` and ``split_layer``."""
    from shared.manifest import Manifest, same_source
    from shared.whole_model import read_meta

    if sc.bundle is not None:
        try:
            m = Manifest.load(sc.bundle)
        except BundleError as e:
            raise ScenarioError(f"bundle: {e}") from None
        if not same_source(m.source_identity, identity):
            raise ScenarioError(f"bundle {sc.bundle}: split from another model ({m.source_identity}), not model "
                                f"{sc.model} ({identity})")
        if m.split_layer != sc.split_layer:
            raise ScenarioError(f"bundle {sc.bundle}: split at layer {m.split_layer}, not at split_layer "
                                f"{sc.split_layer}: make them agree")
    if sc.whole is not None and "all-edge" in sc.modes:
        try:
            whole_identity = read_meta(sc.whole).get("source_identity")
        except ValueError as e:
            raise ScenarioError(f"whole {e}") from None
        if not isinstance(whole_identity, str) or not same_source(whole_identity, identity):
            raise ScenarioError(f"whole {sc.whole}: exported from another model ({whole_identity}), not model "
                                f"{sc.model} ({identity})")


def run_scenario(sc: Scenario, out_dir: Path, progress: Progress | None = None, on_delta=None,
                 bundle: Path | None = None, whole: Path | None = None) -> dict:
    """Run every (workload, mode, profile) of ``sc``; returns the report dict (also the JSON written by the
    CLI). ``on_delta`` receives the first phone's first answer text of the first run, as it streams."""
    from .artifacts import cache_dir, ensure_bundle, ensure_whole, quiet_build_logs

    progress = progress or Progress()
    out_dir = Path(out_dir)
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    quiet_build_logs()
    identity = check_model(sc)
    # an earlier run's, in this --out (a model refused above leaves them): its logs (the processes append: its lines
    # would mix with this run's), its report and plots (a run that failed before any run finished, or was
    # interrupted building, left them there)
    for old in [*log_dir.glob("phone-*.log"), *log_dir.glob("cloud-*.log"), out_dir / "report.json",
                *out_dir.glob("rig_*.png")]:
        old.unlink(missing_ok=True)
    try:  # (the cache's, when made from the model's present weights)
        bundle = Path(bundle or sc.bundle or ensure_bundle(cache_dir("bundles", sc.model, f"l{sc.split_layer}"),
                                                           source=sc.model, layer=sc.split_layer,
                                                           edge_quant=sc.edge_quant, identity=identity))
    except BundleError as e:  # e.g. a split_layer past the model's layers: a bad value, not a failed run
        raise ScenarioError(f"cannot build the {sc.model} bundle (split_layer {sc.split_layer}, edge_quant "
                            f"{sc.edge_quant}): {e}") from None
    if "all-edge" in sc.modes:
        whole = Path(whole or sc.whole or ensure_whole(sc.model, sc.edge_quant, identity=identity))
    records: list[dict] = []
    links_report: list[dict] = []
    state = {"stream": on_delta}

    def report() -> dict:
        return {
            "scenario": sc.to_dict(), "created_unix": started, "wall_s": time.time() - started,
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "cpus": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0))},
            "bundle": str(bundle), "whole": str(whole) if whole else None,
            "summary": summarize(records), "links": links_report, "records": records,
        }

    def take_stream():
        cb, state["stream"] = state["stream"], None
        return cb

    def finished(tag: str, recs: list[dict]) -> None:
        ttft = percentile_ms([r["ttft_s"] for r in recs], 50)  # the summary's p50: the table shows the same
        rate = decode_rate(recs)
        progress.line(f"[{tag}] {len(recs)} requests, TTFT p50 {ttft:.0f} ms, "
                      f"{'-' if rate is None else format(rate, '.1f')} tok/s")

    try:
        # 1. over each link profile: fresh cloud servers (cold prefix caches, so no profile inherits another's);
        # a plan check first calibrates the planner's software overhead on a loopback link
        networked = [m for m in sc.modes if m != "all-edge"]
        link_profiles = ([IDEAL] if sc.plan_check else []) + list(sc.profiles)
        for prof in link_profiles if networked else []:
            servers = {}
            try:
                progress.line(f"[{prof.name}] starting the cloud server(s): {', '.join(networked)}")
                if "split" in networked:
                    servers["split"] = CloudProcess(bundle=bundle, cores=sc.cloud_cores, extra_args=sc.cloud_args,
                                                    log_path=log_dir / f"cloud-split-{prof.name}.log").launch()
                if "all-cloud" in networked:
                    servers["all-cloud"] = CloudProcess(full=sc.model, cores=sc.cloud_cores, extra_args=sc.cloud_args,
                                                        log_path=log_dir / f"cloud-full-{prof.name}.log").launch()
                for srv in servers.values():
                    try:
                        srv.wait_ready()
                    except RuntimeError as e:  # it exited or never got ready: its log says why
                        raise RigError(f"[{prof.name}] {e}") from None
                for workload in sc.workloads:
                    for mode in networked:
                        tag = f"{prof.name}/{workload.kind}/{mode}"
                        links = [LinkEmulator(servers[mode].port, prof, seed=sc.seed + 1000 * i)
                                 for i in range(sc.phones)]
                        for link in links:
                            link.start()
                        try:
                            targets = Targets(bundle, whole)
                            recs = run_phones(sc, targets, mode, workload, [lk.port for lk in links], log_dir,
                                              tag.replace("/", "-"), progress, take_stream(),
                                              on_go=lambda lks=links: [lk.schedule(sc.disconnects) for lk in lks],
                                              link=prof, servers=(servers[mode],))
                        finally:
                            for link in links:
                                link.stop()
                        links_report.append({"profile": prof.name, "workload": workload.kind, "mode": mode,
                                             "bytes_up": sum(lk.bytes_up for lk in links),
                                             "bytes_down": sum(lk.bytes_down for lk in links),
                                             "retransmitted_segments": sum(lk.retransmitted for lk in links),
                                             "connections": sum(lk.connections for lk in links),
                                             "cuts": sum(lk.cuts for lk in links)})
                        records += [dict(r, profile=prof.name, workload=workload.kind) for r in recs]
                        finished(tag, recs)
            except KeyboardInterrupt:
                stop_all(servers.values(), notice=lambda: progress.line(
                    "interrupted: stopping the cloud server(s) (they drain for up to 15 s; Ctrl-C again stops them at "
                    "once)"))
                raise
            finally:
                stop_all(servers.values())  # (none left after an interrupt)
        # 2. all-edge: no network, so one run per workload; its rows repeat under every profile
        if "all-edge" in sc.modes:
            for workload in sc.workloads:
                tag = f"no-link/{workload.kind}/all-edge"
                recs = run_phones(sc, Targets(bundle, whole), "all-edge", workload, [None] * sc.phones, log_dir,
                                  tag.replace("/", "-"), progress, take_stream())
                for p in link_profiles:
                    records += [dict(r, profile=p.name, workload=workload.kind) for r in recs]
                finished(tag, recs)
    except KeyboardInterrupt:
        raise RunInterrupted(report()) from None
    except RigError as e:
        e.report = report()
        raise
    return report()
