"""Test support for deploy/: the replica and nginx helpers of ``bench/routing_bench.py`` (one copy of the code
that starts `autoglm-cloud serve` replicas as real processes and nginx in front of them)."""

from __future__ import annotations

from pathlib import Path

from bench_support import load_bench

ROOT = Path(__file__).resolve().parents[2]

routing_bench = load_bench("routing_bench")
DEPLOY = routing_bench.DEPLOY
Replica = routing_bench.Replica
Router = routing_bench.Router
http_get = routing_bench.http_get
hit_rate = routing_bench.hit_rate
metric_sum = routing_bench.metric_sum


def self_signed(tmp: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A self-signed certificate for ``host`` (an IP address) and its key: ``tmp/tls.pem``, ``tmp/tls.key``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
            .sign(key, hashes.SHA256()))
    (tmp / "tls.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    return tmp / "tls.pem", tmp / "tls.key"
