"""The platform's local certificate authority and its Kafka nodes' TLS certificates.

``<home>/pki/`` (mode 0700) holds:

- ``ca.pem``: the CA certificate, public; every client trusts the brokers through it
  (``KafkaConnection.ca_file``).
- ``ca-key.pem``: the CA's private key (0600). Whoever reads it can mint a controller
  certificate, so it never leaves the platform home.
- ``node-<id>.pem``: one Kafka node's private key, its certificate and the CA certificate,
  in the order Kafka's PEM keystore reads them (0600). The certificate names
  ``IP:127.0.0.1`` and ``DNS:localhost`` (clients verify the broker's address against
  them) and serves both sides of TLS: the node's listeners, and the node as a client of
  the other nodes' controller listeners (mutual TLS, where its subject
  ``CN=fxstream-node-<id>,O=fxstream`` is mapped to the admin principal).
- ``<server>.crt`` and ``<server>.key`` (0600): a TLS server certificate of another
  platform server for the same names, e.g. Redis's (``redis.crt``, ``redis.key``) when
  the operator asks for Redis over TLS; clients verify it against ``ca.pem``.

Everything is made once and reused while it is valid: a certificate that expires within
:data:`RENEW_BEFORE`, that another CA signed, or that lacks the names is made again. Keys are
ECDSA P-256, written unencrypted in PKCS#8 (what Kafka's PEM keystore reads without a
password); their protection is the file mode, like an SSH key's.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fxstream.topics import write_secret_file

__all__ = [
    "CA_VALIDITY",
    "NODE_CN_PREFIX",
    "NODE_VALIDITY",
    "ORGANIZATION",
    "RENEW_BEFORE",
    "LocalCA",
    "ensure_private_dir",
]

CA_VALIDITY = datetime.timedelta(days=3650)
NODE_VALIDITY = datetime.timedelta(days=825)
RENEW_BEFORE = datetime.timedelta(days=30)
ORGANIZATION = "fxstream"
# A node's certificate subject is CN=<prefix><id>,O=fxstream; the controller listener maps it
# to the admin principal (broker-config/kraft-secure.properties).
NODE_CN_PREFIX = "fxstream-node-"
_SANS = (x509.IPAddress(ipaddress.IPv4Address("127.0.0.1")), x509.DNSName("localhost"))


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) and make it readable by its owner only."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _fresh(cert: x509.Certificate) -> bool:
    now = _now()
    return cert.not_valid_before_utc <= now and cert.not_valid_after_utc - RENEW_BEFORE > now


@dataclass(frozen=True)
class LocalCA:
    """The certificate authority in ``directory`` (``<home>/pki``)."""

    directory: Path

    @property
    def cert_file(self) -> Path:
        """The CA certificate (public: clients trust the brokers through it)."""
        return self.directory / "ca.pem"

    @property
    def key_file(self) -> Path:
        """The CA's private key (0600)."""
        return self.directory / "ca-key.pem"

    def node_file(self, node_id: int) -> Path:
        """Node ``node_id``'s key, certificate and the CA certificate, one PEM file (0600)."""
        return self.directory / f"node-{node_id}.pem"

    @staticmethod
    def node_subject(node_id: int) -> str:
        """The subject Kafka sees for node ``node_id``'s certificate (RFC 2253)."""
        return f"CN={NODE_CN_PREFIX}{node_id},O={ORGANIZATION}"

    # --- the CA ------------------------------------------------------------------------

    def _load_ca(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
        try:
            cert = x509.load_pem_x509_certificate(self.cert_file.read_bytes())
            key = serialization.load_pem_private_key(self.key_file.read_bytes(), password=None)
        except (OSError, ValueError, TypeError):
            return None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            return None
        if cert.public_key() != key.public_key() or not _fresh(cert):
            return None
        try:
            basic = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            return None
        return (cert, key) if basic.ca else None

    def ensure(self) -> x509.Certificate:
        """The CA certificate, made (with its key) unless a valid one is there."""
        ensure_private_dir(self.directory)
        loaded = self._load_ca()
        if loaded is not None:
            return loaded[0]
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                x509.NameAttribute(NameOID.COMMON_NAME, f"fxstream local CA {os.getpid()}"),
            ]
        )
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + CA_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        # The key first: a certificate without its key would be taken for a valid CA.
        write_secret_file(self.key_file, _key_pem(key))
        self.cert_file.write_bytes(_cert_pem(cert))
        self.cert_file.chmod(0o644)
        return cert

    # --- node certificates -------------------------------------------------------------

    def _node_valid(self, path: Path, ca: x509.Certificate, node_id: int) -> bool:
        try:
            data = path.read_bytes()
            key = serialization.load_pem_private_key(data, password=None)
            cert = x509.load_pem_x509_certificates(data)[0]
            cert.verify_directly_issued_by(ca)
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except (OSError, ValueError, TypeError, IndexError, InvalidSignature):
            return False
        except x509.ExtensionNotFound:
            return False
        return (
            cert.public_key() == key.public_key()
            and _fresh(cert)
            and all(name in sans for name in _SANS)
            and cert.subject.rfc4514_string() == self.node_subject(node_id)
        )

    def ensure_node(self, node_id: int) -> Path:
        """Node ``node_id``'s PEM keystore file, made unless a valid one is there."""
        ca = self.ensure()
        path = self.node_file(node_id)
        if self._node_valid(path, ca, node_id):
            return path
        key, cert = self._issue(
            f"{NODE_CN_PREFIX}{node_id}",
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        )
        write_secret_file(path, _key_pem(key) + _cert_pem(cert) + _cert_pem(ca))
        return path

    # --- other servers' certificates ---------------------------------------------------

    def server_files(self, server: str) -> tuple[Path, Path]:
        """Where ``server``'s certificate and key are (``<server>.crt``, ``<server>.key``)."""
        return self.directory / f"{server}.crt", self.directory / f"{server}.key"

    def ensure_server(self, server: str) -> tuple[Path, Path]:
        """``server``'s TLS certificate and key (``CN=fxstream-<server>``, the node names
        127.0.0.1 and localhost, server use only), made unless valid ones are there."""
        ca = self.ensure()
        cert_file, key_file = self.server_files(server)
        subject = f"CN={ORGANIZATION}-{server},O={ORGANIZATION}"
        if self._valid(key_file.read_bytes() if key_file.is_file() else b"", cert_file, ca):
            cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
            if cert.subject.rfc4514_string() == subject:
                return cert_file, key_file
        key, cert = self._issue(f"{ORGANIZATION}-{server}", [ExtendedKeyUsageOID.SERVER_AUTH])
        # The key first (0600), then the certificate that names it.
        write_secret_file(key_file, _key_pem(key))
        write_secret_file(cert_file, _cert_pem(cert))
        return cert_file, key_file

    def _valid(self, key_pem: bytes, cert_file: Path, ca: x509.Certificate) -> bool:
        try:
            key = serialization.load_pem_private_key(key_pem, password=None)
            cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
            cert.verify_directly_issued_by(ca)
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except (OSError, ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
            return False
        return (
            cert.public_key() == key.public_key()
            and _fresh(cert)
            and all(name in sans for name in _SANS)
        )

    def _issue(
        self, common_name: str, usages: list[x509.ObjectIdentifier]
    ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        """A new key and a certificate for it, signed by the CA, for the platform's names."""
        ca = self.ensure()
        loaded = self._load_ca()
        assert loaded is not None
        _, ca_key = loaded
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name(
                    [
                        x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                    ]
                )
            )
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + NODE_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(list(_SANS)), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
            .sign(ca_key, hashes.SHA256())
        )
        return key, cert
