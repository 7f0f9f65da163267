"""Cloud server processes for the rig: ``autoglm-cloud serve BUNDLE`` (split) and ``autoglm-cloud serve --full
SOURCE`` (the all-cloud baseline), optionally pinned to CPU cores with the thread count to match.

Like ``edge_client.demo.LocalCloud`` (which the edge tests use) but with the rig's needs: either mode,
core pinning (``os.sched_setaffinity`` in the child before torch starts its thread pool) and a log file per
server so that library output never reaches the rig's terminal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from edge_client.demo import die_with_parent, free_port, stop_gracefully, wait_ready

# `autoglm-cloud serve` flags a scenario's cloud_args may not give: the rig sets the address and the mode itself (a
# later flag wins: a --port there left the rig waiting 300 s for /ready on its own port), and its phones and /ready
# probes carry no key and speak plain ws:// and http://
RIG_OWNED_FLAGS = ("--host", "--port", "--full", "--api-key", "--keys-file", "--ssl-certfile", "--ssl-keyfile",
                   "--no-open-probes")
# their environment twins, the bundle's (beside --full: 'exactly one of') and a config file's, which may set them
RIG_OWNED_VARIABLES = {"AUTOGLM_CLOUD_" + f.removeprefix("--no-").removeprefix("--").replace("-", "_").upper()
                       for f in RIG_OWNED_FLAGS} | {"AUTOGLM_CLOUD_BUNDLE", "AUTOGLM_CLOUD_CONFIG"}


class CloudProcess:
    """One ``autoglm-cloud serve`` subprocess on localhost. ``bundle`` serves a split bundle's back half;
    ``full`` serves a whole model OpenAI-compatibly (exactly one of the two)."""

    def __init__(self, *, bundle: Path | None = None, full: str | None = None, cores: list[int] | None = None,
                 log_path: Path, extra_args: list[str] | None = None):
        if (bundle is None) == (full is None):
            raise ValueError("give exactly one of bundle= (split mode) or full= (full-model mode)")
        self.bundle, self.full = bundle, full
        self.cores = list(cores) if cores else None
        self.log_path = Path(log_path)
        self.extra_args = list(extra_args or [])
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def mode(self) -> str:
        return "split" if self.bundle is not None else "full"

    def start(self, timeout: float = 300.0) -> CloudProcess:
        """Launch and wait until ``/ready``."""
        return self.launch().wait_ready(timeout)

    def launch(self) -> CloudProcess:
        """Start the process without waiting (start several, then :meth:`wait_ready` on each)."""
        target = [str(self.bundle)] if self.bundle is not None else ["--full", str(self.full)]
        cmd = [sys.executable, "-c", "import sys; from cloud_server.cli import main; sys.exit(main())", "serve",
               *target, "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
               "--log-level", "warning", *self.extra_args]
        # nor from the rig's environment (an operator's own AUTOGLM_CLOUD_API_KEY locked the phones out)
        env = {k: v for k, v in os.environ.items() if k not in RIG_OWNED_VARIABLES}
        if self.cores:
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # torch's pool: one thread per pinned core
                env[var] = str(len(self.cores))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, preexec_fn=die_with_parent(self.cores),
                                         start_new_session=True)
        finally:
            log.close()
        return self

    def wait_ready(self, timeout: float = 300.0) -> CloudProcess:
        try:
            wait_ready(self.proc, f"http://127.0.0.1:{self.port}/ready", timeout,
                       f"{self.mode} cloud server (log: {self.log_path})")
        except RuntimeError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop_gracefully(self.proc)  # (it stays self.proc until stopped: stop_all kills it on a Ctrl-C)
        self.proc = None

    def __enter__(self) -> CloudProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_all(servers: Iterable[CloudProcess], notice: Callable[[], None] | None = None) -> None:
    """``notice()``, then stop each server in turn; a Ctrl-C from then on kills every one not stopped yet before it
    propagates (they run in their own sessions: one left behind would serve on, orphaned)."""
    servers = list(servers)
    try:
        if notice is not None:
            notice()
        for srv in servers:
            srv.stop()
    except KeyboardInterrupt:
        for srv in servers:
            if srv.proc is not None:
                srv.proc.kill()
                srv.proc.wait()
                srv.proc = None
        raise
