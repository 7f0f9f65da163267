"""How every console script ends: one rule for exit codes and error lines.

``run_command`` calls the chosen subcommand's handler and turns what it raises into the exit status users and scripts
rely on: 2 and ``<prog> <command>: error: <message>`` for bad input (``usage_errors``: a wrong argument, a
missing or broken file), 1 and ``<prog> <command>: <message>`` for a run that failed (``failure_errors``),
130 on Ctrl-C (and on SIGTERM where the script installs :func:`sigterm_unwinds`), 141 and no message when the reader of stdout went away (``| head``: SIGPIPE's status, as a
shell tool ends). Anything else is a bug and propagates with its traceback.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable


def run_command(prog: str, command: str, handler: Callable[[object], int], args,
                usage_errors: tuple[type[BaseException], ...],
                failure_errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run ``handler(args)`` (the subcommand ``command``) and return its exit status (see the module docstring)."""
    try:
        return handler(args)
    except usage_errors as e:
        print(f"{prog} {command}: error: {e}", file=sys.stderr)
        return 2
    except failure_errors as e:
        print(f"{prog} {command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader closed it (| head): stop quietly, as a shell tool does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not raise again
        return 141


class Terminated(KeyboardInterrupt):
    """A SIGTERM, unwinding as Ctrl-C does (:func:`sigterm_unwinds`); apart from a Ctrl-C for a handler that gives
    Ctrl-C a meaning of its own (the edge chat's stops an answer: a SIGTERM ends the chat)."""


def _terminated(signum, frame) -> None:
    raise Terminated


def sigterm_unwinds() -> None:
    """SIGTERM (a CI cancel, ``timeout``, systemd, ``kill``) unwinds as Ctrl-C does - a KeyboardInterrupt, so every
    ``finally`` runs (the rig's phones and servers stopped, a split's staging directory removed: a killed split left
    ``.<out>.autoglm-split.partial`` behind, as big as the bundle) and :func:`run_command` ends 'interrupted', 130.
    Call it from the main thread before the command runs."""
    signal.signal(signal.SIGTERM, _terminated)


def host_problem(host: str, name: str = "--host") -> str | None:
    """Why ``host`` (the option ``name``) is no listen address to give a server, or None: an empty one (``--host
    "$HOST"`` with HOST unset) listened on every interface, IPv4 and IPv6, where the default is loopback only, an
    IPv6 address in a URL's brackets failed as 'Name or service not known', and bytes that are no UTF-8 (argv's
    surrogateescape, a config file's "\ud800"), a NUL or another control or invisible character (a soft hyphen, a
    zero-width space pasted with the name) were a TypeError traceback from the socket's bind."""
    if not host.strip():
        return f"{name} is empty: give the listen address (0.0.0.0 for every interface)"
    if (problem := not_utf8(host)) is not None:
        return f"{name} is {problem}"
    if not host.isprintable():
        return f"{name} {host!r}: a control or invisible character is in no host name or address"
    if host.startswith("[") and host.endswith("]"):
        return f"{name} {host}: give an IPv6 address without brackets ({host[1:-1]})"
    return None


def not_utf8(text: str) -> str | None:
    """Why ``text`` from argv or stdin (decoded with surrogateescape) is no text to use, or None: bytes that are no
    UTF-8 (a Latin-1 terminal's 'é', a binary file piped in) ended the edge chat, exit 2, on a strict stdin, failed
    its turns as "can't encode character '\\udce9' ... surrogates not allowed" on a surrogateescape one, and as a
    served model name made every answer naming it (/v1/models, /metrics) a 500."""
    for i, ch in enumerate(text):
        if 0xDC80 <= ord(ch) <= 0xDCFF:  # surrogateescape's stand-in for the byte ord(ch) - 0xDC00
            return f"not UTF-8 text (byte 0x{ord(ch) - 0xDC00:02x} after {text[max(0, i - 20):i]!r})"
        if 0xD800 <= ord(ch) <= 0xDFFF:  # a config file's or variable's "\ud800" escape
            return f"not text (a lone surrogate U+{ord(ch):04X} after {text[max(0, i - 20):i]!r})"
    return None


# C0 controls but newline and tab, DEL and the C1 controls: a terminal acts on them instead of showing them; the
# bidirectional embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069): it reorders the text around them
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x09, 0x0A)} | \
    {c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def shown(text: str) -> str:
    """``text`` (a model's answer) as a terminal may be given it: each control character written as its escape
    (``\\x1b``), and each bidirectional override, embedding or isolate too (``\\u202e``), the rest as is. Written
    raw, an answer's ESC sequences (a prompt injection asks for them: OSC 52 writes the clipboard, CSI clears the
    screen), a shift-out (0x0e: every later letter in line-drawing glyphs until a reset) or a carriage return (the
    line's start overwritten) acted on the user's terminal, and its bidi controls reordered what the user read
    (Trojan Source: a command shown harmless that runs otherwise when pasted); the edge chat and demo printed a
    random model's answers so. Right-to-left text and its marks (U+200E, U+200F) are shown as they are. What an
    answer says is kept whole elsewhere (the conversation, the API)."""
    return text.translate(_CONTROLS)


def listen_problem(host: str, port: int, named: str | None = None) -> str | None:
    """Why a server could not listen on ``host:port`` (:func:`host_problem`, the port in use, an address not this
    machine's, a privileged port), or None: a probe bound as uvicorn binds (IPv6 for a host with ':',
    SO_REUSEADDR) and closed at once. The servers call it before they load a model, so a taken port is a one-line
    usage error instead of uvicorn's bind error, exit 3, after the load. ``named``: the options the message names
    (default ``--host H --port P``; the demo, which has no --host, names its ``--port P``)."""
    import socket

    if (problem := host_problem(host)) is not None:
        return problem
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:  # socket.gaierror included: a host name that does not resolve
            return f"{named or f'--host {host} --port {port}'}: cannot listen there ({e.strerror or e})"
        except (TypeError, UnicodeError):  # a non-ASCII name IDNA cannot encode (a label over 63 characters)
            return f"{named or f'--host {host} --port {port}'}: cannot listen there (not a host name IDNA encodes)"
    return None


MAX_DURATION_S = ((1 << 31) - 1) // 1000  # 2147483 s (24.8 days): an int32 of milliseconds, a duration on the wire
MIN_DURATION_S = 0.001  # one millisecond, the wire's unit (a shorter duration is 0 ms there)


def duration_problem(seconds: float, least: float = MIN_DURATION_S) -> str | None:
    """Why ``seconds`` is no value of a duration option (None: it is one): a number of seconds from ``least`` to
    :data:`MAX_DURATION_S`, the one rule of the servers' timeouts, grace periods and deadlines (``autoglm-cloud
    serve``'s ``--handshake-timeout-s``, ``--session-grace-s``, ``--step-timeout-s``, ``--drain-timeout-s`` and
    ``--engine-stall-s``, with their own ``least``; ``autoglm-edge serve``'s ``--handshake-timeout-s``). NaN,
    infinity or a longer one (1e300) is a deadline that never comes - a silent socket, a wedged engine kept for
    ever - or one the wire's int32 of milliseconds cannot carry (``Welcome.limits``, ``Drain.grace_ms``); 0, a
    negative or less than a millisecond times everything out at once."""
    if not least <= seconds <= MAX_DURATION_S:
        return f"must be a number of seconds from {least:g} to {MAX_DURATION_S} (got {seconds!r})"
    return None
