"""``autoglm-cloud health [--pid PID]``: is the ``autoglm-cloud serve`` process PID (default 1, a container's main
process) answering ``/health`` where it listens? The image's HEALTHCHECK (deploy/Dockerfile).

Where it listens is what that process resolved: its command line and environment (``/proc/PID/cmdline``,
``/proc/PID/environ``, relative paths from its working directory) merged as ``serve`` merges them
(``cloud_server.cli.resolve``: flags, ``AUTOGLM_CLOUD_*``, the ``--config`` file), so a port, a TLS certificate or
``--no-open-probes`` given in any of the three is followed; a check built from the image's environment alone
reported a server configured by ``--config`` unhealthy. ``0.0.0.0`` / ``::`` are probed on the loopback; TLS without
verifying the certificate (it names the public host); with closed probes the ``--api-key`` is sent, and without
one (a keys file, whose keys are hashed) a 401 counts as an answer - ``/health`` has no state beyond the server
answering. Exit 0 healthy, 1 not (Docker reserves 2), with one line saying why.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 2.0  # under the HEALTHCHECK's --timeout=3s


def probe_url(config) -> str:
    """``/health`` of a server serving ``config`` (a :class:`~cloud_server.config.ServerConfig`), from this host."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(config.host, config.host)
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if config.ssl_certfile else 'http'}://{host}:{config.port}/health"


def served_config(pid: int):
    """The :class:`~cloud_server.config.ServerConfig` the ``autoglm-cloud serve`` process ``pid`` runs with."""
    from cloud_server.cli import build_parser, resolve

    proc = f"/proc/{pid}"
    try:
        with open(f"{proc}/cmdline", "rb") as f:
            argv = [a.decode(errors="surrogateescape") for a in f.read().split(b"\0")[:-1]]
        with open(f"{proc}/environ", "rb") as f:
            pairs = [a.decode(errors="surrogateescape") for a in f.read().split(b"\0") if b"=" in a]
        cwd = os.readlink(f"{proc}/cwd")
    except FileNotFoundError:
        raise ValueError(f"process {pid}: no such process") from None
    except OSError as e:
        raise ValueError(f"process {pid}: {e.strerror or e}") from None
    if "serve" not in argv[1:]:
        raise ValueError(f"process {pid} is not autoglm-cloud serve ({' '.join(argv)[:200]}); give --pid")
    args = build_parser().parse_args(argv[argv.index("serve", 1):])
    # where it listens does not depend on the device, and torch's import (the default device) outlasts the check
    args.device = args.device or "cpu"
    environ = dict(p.split("=", 1) for p in pairs)
    here = os.getcwd()
    os.chdir(cwd)  # its relative paths (the --config file) are relative to its working directory
    try:
        return resolve(args, environ)
    finally:
        os.chdir(here)


def check(pid: int) -> str | None:
    """Why the server process ``pid`` is not healthy, or None."""
    from cloud_server.config import ConfigError

    try:
        config = served_config(pid)
    except (ValueError, ConfigError, SystemExit) as e:  # SystemExit: argparse refused its command line
        return str(e) or f"process {pid}: its command line does not parse as autoglm-cloud serve"
    url = probe_url(config)
    request = urllib.request.Request(url)
    if not config.open_probes and config.api_key:
        request.add_header("Authorization", f"Bearer {config.api_key}")
    context = ssl._create_unverified_context() if config.ssl_certfile else None  # noqa: S323 - a liveness check
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as r:
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    except (OSError, ValueError) as e:  # refused, reset, timed out, TLS
        return f"{url}: {getattr(e, 'reason', None) or e}"
    if status == 200 or (status == 401 and not config.open_probes and not config.api_key):
        return None
    return f"{url}: HTTP {status}"


def main(pid: int) -> int:
    """``autoglm-cloud health --pid PID`` (parsed by ``cloud_server.cli``)."""
    problem = check(pid)
    if problem is not None:
        print(f"autoglm-cloud health: {problem}", file=sys.stderr)
        return 1
    return 0
