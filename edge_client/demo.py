"""``autoglm-edge demo``: the whole split on localhost with the embedded default model.

1. Build (once, cached) a SmolLM2-135M-Instruct bundle split at layer 8 with an int8 edge, under
   ``$AUTOGLM_CACHE/bundles/smollm2-l8`` (default ``~/.cache/autoglm-split``). This step imports the
   partition tools (torch): it is the developer machine's job, not the phone's.
2. Start ``autoglm-cloud serve BUNDLE`` as a subprocess on a free port and wait for ``/ready``.
3. Stream an answer to a fixed prompt through :class:`~edge_client.client.EdgeClient`, print it, then print
   TTFT, tokens/s and bytes up/down (per token).
4. Stop the server cleanly (SIGINT, then SIGTERM, then SIGKILL if it hangs).

:class:`LocalCloud` (start/stop a cloud server process) is reused by the end-to-end tests and the benchmark.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from shared.cli_exit import shown
from shared.manifest import BundleError, Manifest, same_source
from shared.user_paths import user_path

_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # loaded here: not after a fork
_PR_SET_PDEATHSIG = 1


def die_with_parent(cores: list[int] | None = None):
    """A ``preexec_fn`` for a server or phone process this one starts: SIGTERM when this process ends, however it
    ends (a SIGKILL, the OOM killer: the servers run in their own sessions and served on, orphaned), and pinned
    to ``cores``. (Linux; the signal follows the thread that started the child, so start it from one that lives.)"""
    def setup() -> None:
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if cores:
            os.sched_setaffinity(0, cores)
    return setup


DEMO_PROMPT = "In three sentences, explain why splitting a language model between a phone and a server helps."
DEMO_LAYER = 8


def cache_root() -> Path:
    """``$AUTOGLM_CACHE`` (a leading ``~`` is the home directory, as in every path the edge takes), else
    ``~/.cache/autoglm-split``."""
    return user_path(os.environ.get("AUTOGLM_CACHE") or Path.home() / ".cache" / "autoglm-split")


def ensure_bundle(out: Path | None = None, source: str = "smollm2", layer: int = DEMO_LAYER,
                  edge_quant: str = "int8", rebuild: bool = False, quiet: bool = False,
                  identity: str | None = None) -> Path:
    """The cached bundle at ``out`` (default ``<cache>/bundles/smollm2-l8``), built if absent or broken, or, given
    ``identity`` (``source``'s source identity), if split from other weights (another model at that path before)."""
    out = Path(out) if out is not None else cache_root() / "bundles" / f"{source}-l{layer}"
    if not rebuild:
        try:
            m = Manifest.load(out)
            m.verify_files(out)
            if m.split_layer == layer and m.edge_quant == edge_quant and (
                    identity is None or same_source(m.source_identity, identity)):
                return out
        except BundleError:
            pass
    if out.is_file() or (out.is_dir() and not (out / "manifest.json").is_file() and any(out.iterdir())):
        # the rebuild below replaces ``out`` whole: a path that holds anything but a bundle (``--bundle ~``, a
        # project folder) was deleted
        raise BundleError(f"{out}: exists and is not a bundle; refusing to overwrite it (give a new or empty path)")
    if not quiet:
        print(f"building the {source} bundle (layer {layer}, {edge_quant} edge) in {out} - once", flush=True)
    from partition_tools.models import load_model
    from partition_tools.split import SplitConfig, split

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # build aside, then swap in: never half a bundle
        staged = Path(tmp) / "bundle"
        split(load_model(source), SplitConfig(layer=layer, out=staged, edge_quant=edge_quant))
        if out.exists():
            import shutil

            shutil.rmtree(out)
        staged.rename(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, ready_url: str, timeout: float, what: str) -> None:
    """Poll ``ready_url`` until it answers 200; ``RuntimeError`` naming ``what`` if ``proc`` exits or time runs out
    (the caller stops the process)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(ready_url, timeout=2.0) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s")


def stop_gracefully(proc: subprocess.Popen | None, drain_s: float = 15.0) -> None:
    """SIGINT (the server drains), then SIGTERM, then SIGKILL, each given its time to work. A Ctrl-C (or a
    SIGTERM turned into one) while it waits kills the server at once before it propagates: the server runs in
    its own session, so an impatient second Ctrl-C left it running, orphaned."""
    if proc is None or proc.poll() is not None:
        return
    try:
        for sig, wait in ((signal.SIGINT, drain_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                proc.send_signal(sig)
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue
    except KeyboardInterrupt:
        proc.kill()
        proc.wait()
        raise


class LocalCloud:
    """A cloud server subprocess (``autoglm-cloud serve``) on localhost."""

    def __init__(self, bundle: Path, port: int | None = None, api_key: str | None = None,
                 extra_args: list[str] | None = None, log_path: Path | None = None, die_with_parent: bool = False):
        self.bundle = Path(bundle)
        self.die_with_parent = die_with_parent  # the server ends with this process, a SIGKILL'd one too
        self.port = port or free_port()
        self.api_key = api_key
        self.extra_args = list(extra_args or [])
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        from .config import DEFAULT_SPLIT_PATH

        return f"ws://127.0.0.1:{self.port}{DEFAULT_SPLIT_PATH}"

    def start(self, timeout: float = 180.0) -> LocalCloud:
        cmd = [sys.executable, "-c", "import sys; from cloud_server.cli import main; sys.exit(main())",
               "serve", str(self.bundle), "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.log_path is not None:
            self._log = open(self.log_path, "ab")
        out = self._log if self._log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent() if self.die_with_parent else None)
        try:
            wait_ready(self.proc, f"{self.http_url}/ready", timeout,
                       "cloud server" + (f" (log: {self.log_path})" if self.log_path else ""))
        except RuntimeError:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 15.0) -> int | None:
        """Graceful stop: SIGINT (drain), then SIGTERM, then SIGKILL; returns the exit code."""
        proc, self.proc = self.proc, None
        stop_gracefully(proc, timeout)
        self._close_log()
        return None if proc is None else proc.returncode

    def kill(self) -> None:
        """Abrupt death (tests of the client's recovery): SIGKILL, no drain."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10.0)
        self.proc = None
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LocalCloud:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_demo(prompt: str = DEMO_PROMPT, max_tokens: int = 96, bundle: Path | None = None, rebuild: bool = False,
             threads: int = 2, port: int | None = None, out=sys.stdout) -> dict:
    """Steps 1-4 of the module docstring; returns the numbers it printed."""
    from .client import EdgeClient

    path = None
    if bundle is not None and not rebuild:  # a bundle the user names is used as it is (any model or split layer)
        try:
            Manifest.load(bundle).verify_files(bundle)
            path = Path(bundle)
        except BundleError:
            pass  # absent or broken: build the SmolLM2 bundle there
    path = path or ensure_bundle(bundle, rebuild=rebuild)
    m = Manifest.load(path)
    print(f"bundle {path} ({m.source}, layers [0, {m.split_layer}) on the edge as {m.edge_quant}, "
          f"[{m.split_layer}, {m.num_layers}) in the cloud)", file=out, flush=True)
    log = Path(tempfile.gettempdir()) / "autoglm-demo-cloud.log"
    with LocalCloud(path, port=port, log_path=log, die_with_parent=True) as cloud:
        print(f"cloud server ready on {cloud.ws_url}\n", file=out, flush=True)
        with EdgeClient(path, cloud.ws_url, threads=threads) as client:
            print(f"user> {prompt}\nassistant> ", end="", file=out, flush=True)
            gen = client.generate(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens)
            for delta in gen:
                print(shown(delta), end="", file=out, flush=True)  # control characters as escapes
            st = gen.stats
    summary = {
        "ttft_s": st.ttft_s, "tokens_per_s": st.tokens_per_s, "completion_tokens": st.completion_tokens,
        "prompt_tokens": st.prompt_tokens, "bytes_up": st.bytes_up, "bytes_down": st.bytes_down,
        "bytes_up_per_token": st.bytes_up / max(1, st.prompt_tokens + st.completion_tokens),
        "bytes_down_per_token": st.bytes_down / max(1, st.completion_tokens),
        "edge_compute_s": st.edge_compute_s, "codec": st.codec, "finish_reason": gen.finish_reason,
    }
    print(f"\n\n[{gen.finish_reason}] {st.prompt_tokens} prompt + {st.completion_tokens} generated tokens | "
          f"TTFT {1000 * (st.ttft_s or 0):.0f} ms | {st.tokens_per_s:.1f} tokens/s | "
          f"up {st.bytes_up / 1024:.1f} KiB ({summary['bytes_up_per_token']:.0f} B/token) | "
          f"down {st.bytes_down / 1024:.1f} KiB ({summary['bytes_down_per_token']:.0f} B/token) | "
          f"edge compute {1000 * st.edge_compute_s:.0f} ms | codec {st.codec}", file=out, flush=True)
    return summary
