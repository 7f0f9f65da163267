"""TLS end to end: a server with a test certificate serves https:// and wss://; the edge client streams over
wss:// trusting the test CA (explicit ``ca_file`` and ``SSL_CERT_FILE``), and is refused with a clear error when
it trusts another CA, when it speaks plain ws:// to the TLS server, or wss:// to a plain one."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from cloud_support import ServerThread

from cloud_server.app import create_app
from cloud_server.config import EngineConfig, ServerConfig
from cloud_server.runtime import CloudRuntime
from edge_client.client import EdgeClient
from edge_client.config import RetryPolicy
from edge_client.demo import free_port
from edge_client.errors import EdgeClientError

RETRY = RetryPolicy(connect_timeout_s=5.0, max_retries=1, backoff_initial_s=0.05)
PROMPT = [5, 17, 99, 4, 250, 31, 8]


def _ca(tmp, name: str):
    """A self-signed CA: (key, certificate), the certificate written to ``tmp/<name>-ca.pem``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} test CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    path = tmp / f"{name}-ca.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, path


def _server_cert(tmp, ca_key, ca_cert, name: str = "server", host: str = "localhost", expired: bool = False):
    """A certificate for ``host`` (and 127.0.0.1 when it is localhost) signed by the CA, valid for a day from now
    or (``expired``) only in 2020: (cert path, key path), ``tmp/<name>.pem`` and ``.key``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    if expired:
        now = datetime.datetime(2020, 1, 2, tzinfo=datetime.timezone.utc)
    names = [x509.DNSName(host)] + ([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))] if host == "localhost" else [])
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = tmp / f"{name}.pem", tmp / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert, ca_path = _ca(tmp, "good")
    _, _, other_ca = _ca(tmp, "other")
    cert, key = _server_cert(tmp, ca_key, ca_cert)
    return {"ca": ca_path, "other_ca": other_ca, "cert": cert, "key": key,
            "expired": _server_cert(tmp, ca_key, ca_cert, "expired", expired=True),
            "misnamed": _server_cert(tmp, ca_key, ca_cert, "misnamed", host="other.example")}


@contextlib.contextmanager
def _tls_listener(cert_and_key):
    """A TLS server on 127.0.0.1 presenting ``(cert, key)`` (signed by the test CA): enough to fail a client's
    handshake on that certificate. Yields its port."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(*map(str, cert_and_key))
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            with conn, contextlib.suppress(OSError):
                conn.settimeout(5)
                ctx.wrap_socket(conn, server_side=True).close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        sock.close()


@pytest.fixture(scope="module")
def tls_server(tiny_bundle, pki, tmp_path_factory):
    """A real ``autoglm-cloud serve --ssl-certfile F --ssl-keyfile F`` process."""
    port = free_port()
    log = tmp_path_factory.mktemp("tls-log") / "serve.log"
    cmd = [sys.executable, "-c", "import sys; from cloud_server.cli import main; sys.exit(main())", "serve",
           str(tiny_bundle), "--port", str(port), "--ssl-certfile", str(pki["cert"]), "--ssl-keyfile", str(pki["key"]),
           "--num-blocks", "64", "--block-size", "4", "--device", "cpu"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    srv = SimpleNamespace(url=f"https://127.0.0.1:{port}", ws_url=f"wss://127.0.0.1:{port}/v1/split", proc=proc,
                          log=log)
    trust = ssl.create_default_context(cafile=str(pki["ca"]))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(srv.url + "/ready", verify=trust, timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    yield srv
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


@pytest.fixture(scope="module")
def reference(tiny_bundle, tls_server):
    """The same request over plain ws:// to a second, plain server (the output TLS must not change)."""
    rt = CloudRuntime(ServerConfig(bundle=tiny_bundle, engine=EngineConfig(num_blocks=64, block_size=4))).start()
    with ServerThread(create_app(rt)) as plain:
        with EdgeClient(tiny_bundle, plain.ws_url, codec="fp16", retry=RETRY) as c:
            tokens = c.complete(prompt_ids=PROMPT, max_tokens=8).token_ids
        plain_url = plain.ws_url
    rt.stop()
    return tokens, plain_url


def test_edge_streams_over_wss_with_the_test_ca(tiny_bundle, tls_server, pki, reference, caplog):
    assert tls_server.ws_url.startswith("wss://")
    with caplog.at_level("INFO", logger="edge_client.generation"), \
            EdgeClient(tiny_bundle, tls_server.ws_url, codec="fp16", retry=RETRY, ca_file=pki["ca"]) as c:
        gen = c.generate(prompt_ids=PROMPT, max_tokens=8)
        streamed = [token for token, _ in gen.iter_tokens()]  # token by token, as they arrive
        assert streamed == gen.token_ids == reference[0] and gen.finish_reason == "length"
    # one trace id for the request, in the edge's log and in the cloud's
    trace = gen.stats.trace_id
    assert any(f"trace={trace} start" in r.getMessage() for r in caplog.records)
    deadline = time.monotonic() + 5
    while f"trace={trace} " not in tls_server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    cloud_log = tls_server.log.read_text()
    assert f"trace={trace} session=" in cloud_log and "finish=length tokens=8" in cloud_log
    ready = httpx.get(tls_server.url + "/ready", verify=ssl.create_default_context(cafile=str(pki["ca"])))
    assert tls_server.url.startswith("https://") and ready.status_code == 200


def test_ssl_cert_file_is_the_trust_store_when_no_ca_file_is_given(tiny_bundle, tls_server, pki, reference):
    """OpenSSL reads SSL_CERT_FILE when the default context loads the system store: run in a fresh process,
    since the variable is read when a context is created."""
    code = (f"from edge_client.client import EdgeClient; from edge_client.config import RetryPolicy\n"
            f"with EdgeClient({str(tiny_bundle)!r}, {tls_server.ws_url!r}, codec='fp16', "
            f"retry=RetryPolicy(connect_timeout_s=5.0, max_retries=0)) as c:\n"
            f"    print(c.complete(prompt_ids={PROMPT}, max_tokens=8).token_ids)\n")
    env = {"SSL_CERT_FILE": str(pki["ca"]), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(reference[0])


def test_an_openai_https_base_url_is_the_servers_wss_with_the_same_trust(tiny_bundle, tls_server, pki, reference):
    """The base URL an OpenAI client of this server takes (``https://host:port/v1``) was a ConfigError: it is the
    server's ``wss://`` endpoint, and ``ca_file`` applies to it (another CA is refused as for ``wss://``)."""
    with EdgeClient(tiny_bundle, f"{tls_server.url}/v1", codec="fp16", retry=RETRY, ca_file=pki["ca"]) as c:
        assert c.config.url == tls_server.ws_url
        assert c.complete(prompt_ids=PROMPT, max_tokens=8).token_ids == reference[0]
    with EdgeClient(tiny_bundle, f"{tls_server.url}/v1", codec="fp16", retry=RETRY, ca_file=pki["other_ca"]) as c:
        with pytest.raises(EdgeClientError) as e:
            c.complete(prompt_ids=PROMPT, max_tokens=4)
    assert e.value.code == "tls_verify_failed"


def test_a_client_trusting_another_ca_is_refused_clearly(tiny_bundle, tls_server, pki):
    with EdgeClient(tiny_bundle, tls_server.ws_url, codec="fp16", retry=RETRY, ca_file=pki["other_ca"]) as c:
        with pytest.raises(EdgeClientError) as e:
            c.complete(prompt_ids=PROMPT, max_tokens=4)
    assert e.value.code == "tls_verify_failed"
    assert "certificate does not verify" in str(e.value) and str(pki["other_ca"]) in str(e.value)


@pytest.mark.parametrize("cert, says", [("expired", "must renew it"), ("misnamed", "host name the certificate lists")])
def test_an_expired_or_misnamed_certificate_says_what_to_do(tiny_bundle, pki, cert, says):
    """The hint fits the cause: a CA file cannot fix an expired certificate or one for another host."""
    with _tls_listener(pki[cert]) as port, \
            EdgeClient(tiny_bundle, f"wss://localhost:{port}/v1/split", retry=RETRY, ca_file=pki["ca"]) as c:
        with pytest.raises(EdgeClientError) as e:
            c.connect()
    assert e.value.code == "tls_verify_failed" and says in str(e.value), e.value
    assert "--ca-file" not in str(e.value)


def test_bundle_downloads_name_tls_failures_as_the_link_does(tls_server, pki):
    """preload --update / auto_update over https: an untrusted CA, an expired certificate and ws:// to the TLS
    server are tls_verify_failed / tls_required with the split link's words, not 'unreachable'."""
    from edge_client.bundle_sync import BundleServer, BundleSyncError

    assert BundleServer(tls_server.ws_url, ca_file=pki["ca"]).listing()  # trusted: the listing comes
    with pytest.raises(BundleSyncError) as other:
        BundleServer(tls_server.ws_url, ca_file=pki["other_ca"]).listing()
    assert other.value.code == "tls_verify_failed" and "pass the server's CA with --ca-file" in str(other.value)
    with _tls_listener(pki["expired"]) as port, pytest.raises(BundleSyncError) as expired:
        BundleServer(f"wss://localhost:{port}", ca_file=pki["ca"]).listing()
    assert expired.value.code == "tls_verify_failed" and "must renew it" in str(expired.value)
    with pytest.raises(BundleSyncError) as plain:
        BundleServer(tls_server.ws_url.replace("wss://", "ws://")).listing()
    assert plain.value.code == "tls_required" and "use wss://" in str(plain.value)


def test_plain_ws_to_a_tls_server_says_use_wss(tiny_bundle, tls_server):
    plain_url = tls_server.ws_url.replace("wss://", "ws://")
    with EdgeClient(tiny_bundle, plain_url, codec="fp16", retry=RETRY) as c:
        with pytest.raises(EdgeClientError) as e:
            c.complete(prompt_ids=PROMPT, max_tokens=4)
    assert e.value.code == "tls_required" and "use wss://" in str(e.value)


def test_wss_to_a_plain_server_is_a_tls_error(tiny_bundle, reference, pki):
    _, plain_url = reference  # that server is gone: start another plain one on the same terms
    rt = CloudRuntime(ServerConfig(bundle=tiny_bundle, engine=EngineConfig(num_blocks=16, block_size=4))).start()
    try:
        with ServerThread(create_app(rt)) as plain:
            url = plain.ws_url.replace("ws://", "wss://")
            with EdgeClient(tiny_bundle, url, codec="fp16", retry=RETRY, ca_file=pki["ca"]) as c:
                with pytest.raises(EdgeClientError) as e:
                    c.complete(prompt_ids=PROMPT, max_tokens=4)
    finally:
        rt.stop()
    assert e.value.code == "tls_error" and "ws://" in str(e.value)


def test_the_certificate_needs_its_key(tiny_bundle, pki, capsys):
    from cloud_server import cli

    assert cli.main(["serve", str(tiny_bundle), "--ssl-certfile", str(pki["cert"])]) == 2
    assert "ssl_certfile and ssl_keyfile go together" in capsys.readouterr().err


def test_the_ca_file_reaches_the_edge_config_from_the_flag_and_the_environment(tiny_bundle, pki, monkeypatch):
    from edge_client import cli
    from edge_client.config import EdgeConfig

    args = cli.build_parser().parse_args(["chat", "--bundle", str(tiny_bundle), "--url", "wss://h:1",
                                          "--ca-file", str(pki["ca"])])
    assert cli._config(args).ca_file == pki["ca"]
    monkeypatch.setenv("AUTOGLM_EDGE_CA_FILE", str(pki["other_ca"]))
    assert EdgeConfig.from_env(bundle=tiny_bundle).ca_file == pki["other_ca"]


def test_a_certificate_and_key_that_do_not_load_are_refused_before_the_server_starts(tiny_bundle, pki, tmp_path,
                                                                                       capsys):
    """Not PEM, a key of another certificate or a passphrase-protected key: a one-line error naming what is wrong, exit
    2, not an ssl traceback at startup. The mismatch read 'not a PEM certificate' and the passphrase a tuple's repr
    ("(('the key is passphrase-protected ...',))")."""
    from cryptography.hazmat.primitives import serialization

    from cloud_server import cli

    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    locked = tmp_path / "locked.key"
    locked.write_bytes(serialization.load_pem_private_key(pki["key"].read_bytes(), None).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")))
    for cert, key, said in ((junk, junk, "not a PEM certificate and its key"),
                            (pki["cert"], junk, "not a PEM certificate and its key"),
                            (pki["ca"], pki["key"], f"--ssl-keyfile {pki['key']} is not the key of the certificate "
                                                    f"in --ssl-certfile {pki['ca']} ("),
                            (pki["cert"], locked, f"--ssl-keyfile {locked}: the key is passphrase-protected (give an "
                                                  f"unencrypted key)\n")):
        assert cli.main(["serve", str(tiny_bundle), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err and "(('" not in err, err


def test_an_expired_certificate_is_served_with_a_warning_a_valid_one_without(tiny_bundle, tls_server, pki,
                                                                             monkeypatch, caplog):
    """It started with no word, every verifying client then refusing it; the stdlib reads the dates through an
    in-memory handshake (cloud_server.cli._certificate_dates_problem)."""
    from cloud_server import cli

    monkeypatch.setattr(cli, "serve", lambda config, log_level: 0)  # everything before serving, then stop
    cert, key = pki["expired"]
    with caplog.at_level(logging.WARNING, logger="autoglm.cloud"):
        assert cli.main(["serve", str(tiny_bundle), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                         "--device", "cpu", "--port", "0"]) == 0
    said = [r.getMessage() for r in caplog.records if "ssl-certfile" in r.getMessage()]
    assert len(said) == 1 and "certificate has expired" in said[0] and str(cert) in said[0]
    assert "clients that verify it" not in tls_server.log.read_text()  # the valid certificate: no warning
