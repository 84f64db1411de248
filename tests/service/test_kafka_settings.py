"""How the service's Kafka clients are configured from a KafkaConnection (no broker needed).

The faust app of the stream processors takes its credentials in faust's own form; a
secure connection must give it SASL/SCRAM-SHA-512 over TLS with the platform's CA, and an
insecure one none at all.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from faust.auth import SASLCredentials
from faust.types.auth import AuthProtocol, SASLMechanism

from fxstream.service.processors import build_app
from fxstream.topics import Catalogue, KafkaConnection


def _ca_certificate(path: Path) -> Path:
    """A self-signed CA certificate (PEM), as the platform's local CA writes one."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return path


def test_the_processors_app_authenticates_with_scram_over_tls(tmp_path: Path) -> None:
    ca = _ca_certificate(tmp_path / "ca.pem")
    kafka = KafkaConnection("127.0.0.1:1,127.0.0.1:2", "fxstream-service", "s3cret", ca)
    app = build_app(kafka, Catalogue(), data_dir=tmp_path / "faust", roles=("liveness",))
    assert [str(url) for url in app.conf.broker] == ["kafka://127.0.0.1:1", "kafka://127.0.0.1:2"]
    credentials = app.conf.broker_credentials
    assert isinstance(credentials, SASLCredentials)
    assert credentials.protocol is AuthProtocol.SASL_SSL
    assert credentials.mechanism is SASLMechanism.SCRAM_SHA_512
    assert (credentials.username, credentials.password) == ("fxstream-service", "s3cret")
    assert credentials.ssl_context is not None
    assert "s3cret" not in repr(credentials)


def test_the_processors_app_of_the_insecure_platform_has_no_credentials(tmp_path: Path) -> None:
    app = build_app(
        KafkaConnection("127.0.0.1:1"),
        Catalogue(),
        data_dir=tmp_path / "faust",
        roles=("liveness",),
    )
    assert app.conf.broker_credentials is None
