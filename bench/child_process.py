"""Stopping a benchmark's child server the way an orchestrator does: SIGTERM (a graceful drain), then SIGKILL."""

from __future__ import annotations

import signal
import subprocess


def stop_gracefully(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM ``proc`` if it still runs and wait up to ``timeout_s`` for it to exit; kill it if it does not."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
