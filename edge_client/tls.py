"""TLS for the edge's link: which certificates it trusts, and clear words when TLS is the reason a connect failed.

Trust, for a ``wss://`` URL (Python's ``ssl.create_default_context``: certificate and host name verified):

* ``ca_file`` (``EdgeConfig.ca_file``, ``--ca-file``, ``AUTOGLM_EDGE_CA_FILE``): trust exactly the CAs in this
  PEM file (a private CA, a test certificate);
* otherwise the system trust store, which OpenSSL's ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` environment variables
  replace when set.

A ``ws://`` URL never uses TLS. What goes wrong is named (:func:`explain`), never retried, and surfaces as an
``EdgeClientError`` with one of these codes:

* ``tls_verify_failed`` - the server's certificate does not verify against the trusted CAs (an unknown CA, an
  expired certificate, a host name that does not match; the message's hint fits the cause);
* ``tls_required`` - a ``ws://`` URL to a server that speaks TLS (found by a short probe once the plain
  upgrade failed): use ``wss://``;
* ``tls_error`` - any other TLS failure (for instance ``wss://`` to a server without TLS).
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path
from urllib.parse import urlsplit

PROBE_TIMEOUT_S = 2.0
# what to do about a certificate that does not verify, by OpenSSL's verify code (X509_V_ERR_*); any other code
# (an unknown CA: 18, 19, 20, ...) is a trust problem the CA file answers
_VERIFY_HINTS = {
    9: "it is not valid yet: check the server's and this device's clocks",  # CERT_NOT_YET_VALID
    10: "the server's operator must renew it (a CA file does not help)",  # CERT_HAS_EXPIRED
    62: "connect by a host name the certificate lists, or have it reissued for this one",  # HOSTNAME_MISMATCH
    64: "connect by an address or host name the certificate lists, or have it reissued",  # IP_ADDRESS_MISMATCH
}


def client_context(url: str, ca_file: str | Path | None = None) -> ssl.SSLContext | None:
    """The TLS context for ``url`` (None for ``ws://``). Raises ``FileNotFoundError`` for a missing CA file."""
    if urlsplit(url).scheme != "wss":
        return None
    return trust_context(ca_file)


def trust_context(ca_file: str | Path | None = None) -> ssl.SSLContext:
    """A verifying client context trusting ``ca_file`` (None: the system store). ``FileNotFoundError`` for a missing
    file, ``ValueError`` for one that holds no PEM certificate or that this process may not read (another user's
    file, a folder it may not enter: a PermissionError traceback at the start)."""
    try:
        if ca_file is not None and not Path(ca_file).is_file():
            raise FileNotFoundError(f"ca_file {ca_file}: no such file")
        return ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)
    except ssl.SSLError as e:
        raise ValueError(f"ca_file {ca_file}: no PEM CA certificate in it ({e.reason or e})") from None
    except PermissionError as e:
        raise ValueError(f"ca_file {ca_file}: cannot be read ({e.strerror}); the user running this needs read access "
                         "to it") from None


def speaks_tls(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the server behind ``url`` completes a TLS handshake (certificate not checked: only asks the
    question "is this port TLS?")."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "wss" else 80)
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=host):
            return True
    except (OSError, ssl.SSLError):
        return False


def explain(url: str, exc: BaseException, ca_file: str | Path | None = None) -> tuple[str, str] | None:
    """``(code, message)`` when TLS is why connecting to ``url`` failed with ``exc``; None otherwise."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        trust = f"the CA file {ca_file}" if ca_file is not None else "the system trust store (or SSL_CERT_FILE)"
        hint = _VERIFY_HINTS.get(exc.verify_code, "pass the server's CA with --ca-file")
        return ("tls_verify_failed", f"{url}: the server's TLS certificate does not verify against {trust}: "
                                     f"{exc.verify_message or exc}; {hint}")
    if isinstance(exc, ssl.SSLError):
        hint = " (is the server serving TLS? use ws:// for a plain server)" if urlsplit(url).scheme == "wss" else ""
        return "tls_error", f"{url}: TLS handshake failed: {exc.reason or exc}{hint}"
    if urlsplit(url).scheme == "ws" and speaks_tls(url):
        return "tls_required", f"{url}: the server speaks TLS; use wss:// instead of ws://"
    return None
