"""Kafka authenticates every listener, on the real broker (issue 13, items 1 and 7).

The session platform is the secure one (``./fx up`` without ``--insecure``): its client
listener takes only SASL/SCRAM-SHA-512 over TLS, its controller listener only mutual TLS with
a certificate of the platform's CA, and its authorizer allows only what an ACL grants (the
admin principal is the only super user). Each refusal below is checked against a control
that succeeds, so a broken check cannot pass by accident.
"""

from __future__ import annotations

import datetime
import os
import socket
import ssl
import stat
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import (
    AdminClient,
    NewTopic,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialDeletion,
    UserScramCredentialUpsertion,
)
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fxstream.ops import ConnectionInfo, Platform
from fxstream.ops.kafka import ADMIN_PRINCIPAL, StorageMismatchError, kafka_nodes
from fxstream.ops.pki import LocalCA
from fxstream.ops.private import PrivatePlatform, private_config
from fxstream.topics import KafkaConnection
from tests.conftest import RunningPlatform, free_port_block
from tests.e2e.stack import added_endpoint
from tests.security.acl_matrix import check_every_cell, deployment

QUIET = {"log_level": 0, "socket.timeout.ms": 3000}


# --- helpers ---------------------------------------------------------------------------


def _errors_of(
    config: dict[str, str | int], expected: int, request_s: float = 2.0, seconds: float = 15.0
) -> list[KafkaError]:
    """The errors a client with ``config`` reports while it tries to read metadata.

    Its metadata request must fail (within ``request_s``: the admin's succeeds in a fraction
    of that); then the errors it reported are collected until one has code ``expected``, or
    ``seconds`` passed. A refused client does not give up by itself (librdkafka retries the
    connection until a request's timeout), so waiting longer would prove nothing more.
    """
    errors: list[KafkaError] = []
    admin = AdminClient({**config, **QUIET, "error_cb": errors.append})
    with pytest.raises(KafkaException):
        admin.list_topics(timeout=request_s)
    deadline = time.monotonic() + seconds
    while not any(e.code() == expected for e in errors) and time.monotonic() < deadline:
        admin.poll(0.1)  # error_cb is served by poll
    return errors


def _works(kafka: KafkaConnection) -> bool:
    """True when ``kafka`` reads the cluster's metadata."""
    metadata = AdminClient({**kafka.confluent(), **QUIET}).list_topics(timeout=15)
    return bool(metadata.brokers)


def _api_versions_request() -> bytes:
    """A Kafka ApiVersions v0 request (correlation id 7, client id 'probe')."""
    client_id = b"probe"
    body = struct.pack(">hhih", 18, 0, 7, len(client_id)) + client_id
    return struct.pack(">i", len(body)) + body


def _kafka_answers(sock: socket.socket) -> bool:
    """Send ApiVersions over ``sock``; True if a Kafka response with our id comes back."""
    try:
        sock.sendall(_api_versions_request())
        header = sock.recv(8)
    except (ssl.SSLError, OSError):
        return False
    return len(header) == 8 and struct.unpack(">ii", header)[1] == 7


def _controller_answers(port: int, context: ssl.SSLContext) -> bool:
    """True if the controller listener on ``port`` serves a TLS client with ``context``."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        try:
            tls = context.wrap_socket(raw, server_hostname="127.0.0.1")
        except (ssl.SSLError, OSError):
            return False
        with tls:
            return _kafka_answers(tls)


def _trusting_context(ca_file: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca_file))


def _self_signed(directory: Path, subject: str) -> tuple[Path, Path]:
    """A self-signed certificate with ``subject``'s CN and O=fxstream (not the CA's)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fxstream"),
            x509.NameAttribute(NameOID.COMMON_NAME, subject),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / f"{subject}.pem", directory / f"{subject}-key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def _assert_enforced(
    platform: Platform, kafka: KafkaConnection, tmp: Path, *, cluster: bool
) -> None:
    """Every refusal of this module's single-node tests, on each node of ``platform``."""
    ca_file = platform.ca.cert_file
    nodes = platform.nodes(cluster=cluster)
    for node in nodes:
        one = KafkaConnection(node.bootstrap, kafka.username, kafka.password, kafka.ca_file)
        assert _works(one), f"node {node.node_id}: the admin principal must work"
        with socket.create_connection(("127.0.0.1", node.broker_port), timeout=10) as plain:
            plain.settimeout(5)
            assert not _kafka_answers(plain), f"node {node.node_id} answered PLAINTEXT"
        wrong = _errors_of(
            one.as_user(ADMIN_PRINCIPAL, "not-the-password").confluent(),
            KafkaError._AUTHENTICATION,
        )
        assert any(e.code() == KafkaError._AUTHENTICATION for e in wrong), wrong
        # The controller listener: a CA-signed node certificate is served, nothing else.
        node_pem = platform.ca.node_file(node.node_id)
        with_node_cert = _trusting_context(ca_file)
        with_node_cert.load_cert_chain(node_pem)
        assert _controller_answers(node.controller_port, with_node_cert)
        assert not _controller_answers(node.controller_port, _trusting_context(ca_file))
        forged_cert, forged_key = _self_signed(tmp, f"fxstream-node-{node.node_id}")
        forged = _trusting_context(ca_file)
        forged.load_cert_chain(forged_cert, forged_key)
        assert not _controller_answers(node.controller_port, forged)


# --- the client listener -----------------------------------------------------------------


def test_the_admin_principal_produces_and_consumes(
    kafka: KafkaConnection, topic_cleanup: list[str]
) -> None:
    """The positive control for everything below: SCRAM over TLS as fxstream-admin works."""
    assert kafka.secure and kafka.username == ADMIN_PRINCIPAL
    topic = f"transport-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({**kafka.confluent(), **QUIET})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=30)
    topic_cleanup.append(topic)
    producer = Producer({**kafka.confluent(), **QUIET})
    producer.produce(topic, b"over TLS")
    assert producer.flush(30) == 0
    consumer = Consumer(
        {**kafka.confluent(), **QUIET, "group.id": topic, "auto.offset.reset": "earliest"}
    )
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 30
        message = None
        while message is None and time.monotonic() < deadline:
            polled = consumer.poll(1)
            if polled is not None and polled.error() is None:
                message = polled
        assert message is not None and message.value() == b"over TLS"
    finally:
        consumer.close()


def test_a_plaintext_client_is_refused(kafka: KafkaConnection) -> None:
    """No PLAINTEXT (nor unauthenticated) connection gets a Kafka answer."""
    host, port = kafka.bootstrap.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.settimeout(5)
        assert not _kafka_answers(sock)
    # librdkafka without security settings: no metadata (the broker drops the connection;
    # librdkafka would retry until any timeout, and the admin's answer takes milliseconds).
    with pytest.raises(KafkaException):
        AdminClient({"bootstrap.servers": kafka.bootstrap, **QUIET}).list_topics(timeout=2)


def test_a_wrong_password_or_unknown_user_is_refused(kafka: KafkaConnection) -> None:
    for username, password in ((ADMIN_PRINCIPAL, "not-the-password"), ("nobody", "x")):
        errors = _errors_of(
            kafka.as_user(username, password).confluent(), KafkaError._AUTHENTICATION
        )
        assert any(e.code() == KafkaError._AUTHENTICATION for e in errors), errors


def test_a_client_that_does_not_trust_the_ca_is_refused(
    kafka: KafkaConnection, tmp_path: Path
) -> None:
    """The broker's certificate is the platform CA's: a client trusting another CA (or the
    system's) refuses it, and so never sends its password."""
    host, port = kafka.bootstrap.split(":")
    other_ca = LocalCA(tmp_path / "other-pki")
    other_ca.ensure()
    for context in (_trusting_context(other_ca.cert_file), ssl.create_default_context()):
        with (
            socket.create_connection((host, int(port)), timeout=10) as raw,
            pytest.raises(ssl.SSLCertVerificationError),
        ):
            context.wrap_socket(raw, server_hostname=host)
    assert kafka.ca_file is not None
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        _trusting_context(kafka.ca_file).wrap_socket(raw, server_hostname=host).close()
    errors = _errors_of(
        KafkaConnection(
            kafka.bootstrap, kafka.username, kafka.password, other_ca.cert_file
        ).confluent(),
        KafkaError._SSL,
    )
    assert any(e.code() == KafkaError._SSL for e in errors), errors


def test_an_authenticated_principal_without_acls_may_do_nothing(
    kafka: KafkaConnection, topic_cleanup: list[str]
) -> None:
    """StandardAuthorizer with allow.everyone.if.no.acl.found=false: a valid SCRAM user that
    no ACL names sees no topic and cannot create one; only fxstream-admin is a super user."""
    admin = AdminClient({**kafka.confluent(), **QUIET})
    topic = f"transport-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=30)
    topic_cleanup.append(topic)
    user, password = f"u.probe{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096)
    upsert = UserScramCredentialUpsertion(user, info, password.encode())
    admin.alter_user_scram_credentials([upsert])[user].result(timeout=30)
    try:
        stranger = AdminClient({**kafka.as_user(user, password).confluent(), **QUIET})
        deadline = time.monotonic() + 30
        while True:  # the new credential reaches the broker through the metadata log
            try:
                metadata = stranger.list_topics(timeout=5)
                break
            except KafkaException:
                assert time.monotonic() < deadline, "the new SCRAM user never authenticated"
        assert topic not in metadata.topics
        assert topic in admin.list_topics(timeout=10).topics
        denied = f"transport-{uuid.uuid4().hex[:8]}"
        with pytest.raises(KafkaException) as refused:
            stranger.create_topics([NewTopic(denied, 1, 1)])[denied].result(timeout=30)
        assert refused.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    finally:
        admin.alter_user_scram_credentials([UserScramCredentialDeletion(user, info.mechanism)])[
            user
        ].result(timeout=30)


# --- the controller listener ---------------------------------------------------------------


def test_the_controller_listener_requires_a_certificate_of_the_platform_ca(
    kafka_platform: RunningPlatform, tmp_path: Path
) -> None:
    """mTLS: the node's own CA-signed certificate is served (control); no certificate, or a
    self-signed one claiming a node's name, is refused in the handshake."""
    _assert_enforced(kafka_platform.platform, kafka_platform.kafka, tmp_path, cluster=False)


# --- secrets at rest -----------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_configs_and_credentials_are_private(kafka_platform: RunningPlatform) -> None:
    home = kafka_platform.config.home
    platform = kafka_platform.platform
    node = platform.nodes(cluster=False)[0]
    for directory in (home, home / "pki", home / "credentials", node.directory, node.data_dir):
        assert _mode(directory) == 0o700, directory
    for secret in (
        platform.ca.key_file,
        platform.ca.node_file(1),
        node.properties_file,
        platform.credentials_file("admin"),
    ):
        assert _mode(secret) == 0o600, secret
    assert kafka_platform.kafka.password is not None
    assert kafka_platform.kafka.password in node.properties_file.read_text()
    assert KafkaConnection.from_file(platform.credentials_file("admin")).password == (
        kafka_platform.kafka.password
    )
    assert not (node.directory / "storage-format.args").exists()
    assert kafka_platform.kafka.password not in repr(kafka_platform.kafka)


def test_no_password_on_any_command_line_of_the_platform(kafka_platform: RunningPlatform) -> None:
    """The broker, Redis and (for the format) the storage tool get no secret on argv."""
    password = kafka_platform.kafka.password
    assert password is not None
    platform = kafka_platform.platform
    pids = [node.process.pid() for node in platform.nodes(cluster=False)]
    pids.append(platform.redis().process.pid())
    assert all(pid is not None for pid in pids)
    for pid in pids:
        assert pid is not None
        for process in (psutil.Process(pid), *psutil.Process(pid).children(recursive=True)):
            cmdline = "\0".join(process.cmdline())
            assert password not in cmdline
            assert "password" not in cmdline.lower(), cmdline


def _square(x: int) -> int:
    return x * x


@pytest.mark.platform
def test_the_services_connect_by_credential_files_that_stay_private(
    shared_platform: PrivatePlatform,
) -> None:
    """The full secure platform (service processes, the local endpoint and an added one)
    runs tasks; every credential file is 0600 in a 0700 directory, no process of the platform
    has a secret on its command line, and no log holds the admin password. (The session's
    shared platform: what every other module using it did is in its logs too.)"""
    running = shared_platform
    with added_endpoint(running, "extra") as extra:
        with running.executor() as local, running.executor(extra.endpoint_id) as other:
            assert list(local.map(_square, range(5))) == [0, 1, 4, 9, 16]
            assert other.submit(_square, 7).result(timeout=120) == 49
        home = running.home
        password = running.kafka.password
        assert running.kafka.secure and password is not None
        assert _mode(home) == 0o700 and _mode(home / "credentials") == 0o700
        services = running.platform.services()
        files = [
            services.credentials_file,
            services.service_credentials_file,
            services.endpoint_credentials_file,
            running.platform.credentials_file("admin"),
        ]
        for path in files:
            assert _mode(path) == 0o600, path
        user = KafkaConnection.from_file(services.credentials_file)
        assert user.secure and _works(user)
        pids = [c.pid for c in running.platform.status().components if c.pid is not None]
        pids += [extra.process.pid()]
        assert len(pids) >= 9  # supervisor, API, 3 processors, 2 endpoints, broker, Redis
        token = running.settings.token
        assert token is not None
        for pid in pids:
            assert pid is not None
            root = psutil.Process(pid)
            for process in (root, *root.children(recursive=True)):
                cmdline = "\0".join(process.cmdline())
                assert password not in cmdline and token not in cmdline, cmdline
        for log in (home / "logs").iterdir():
            assert password not in log.read_text(errors="replace"), log


@pytest.mark.platform
def test_the_insecure_switch_is_explicit_and_loud(tmp_path: Path) -> None:
    """`./fx up --insecure` runs PLAINTEXT Kafka and says so on stderr at every start."""
    home = tmp_path / "insecure"
    private_config(home)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FXSTREAM_")}
    env["FXSTREAM_HOME"] = str(home)
    fxstream = str(Path(sys.executable).parent / "fxstream")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [fxstream, *args], env=env, capture_output=True, text=True, timeout=240
        )

    try:
        up = cli("up", "--insecure", "--no-quickstart")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "INSECURE" in up.stderr and "NO authentication" in up.stderr
        info = Platform.read_connection(home)
        assert not info.secure and info.ca_file == ""
        assert _works(KafkaConnection(info.bootstrap_servers))
        assert not (home / "credentials" / "admin.json").exists()
        again = cli("up", "--insecure", "--no-quickstart")  # every start says it
        assert again.returncode == 0 and "INSECURE" in again.stderr
        # A secure start does not silently reuse the running insecure platform.
        secure = cli("up", "--no-quickstart")
        assert secure.returncode == 1 and "--insecure" in secure.stderr
    finally:
        assert cli("down").returncode == 0


def test_a_secure_start_refuses_data_formatted_without_its_credential(tmp_path: Path) -> None:
    """Data formatted by an insecure (or older) platform has no admin credential: the secure
    start says how to proceed instead of starting a broker no client can use."""
    from fxstream.ops.kafka import KafkaSecurity

    config = private_config(tmp_path)
    security = KafkaSecurity(LocalCA(tmp_path / "pki"), "a-password")
    node = kafka_nodes(config, "java", cluster=False, security=security)[0]
    node.data_dir.mkdir(parents=True)
    (node.data_dir / "meta.properties").write_text("formatted\n")
    with pytest.raises(StorageMismatchError, match="--insecure"):
        node.check_formatted()
    node.format_marker.write_text(KafkaSecurity(security.ca, "other").fingerprint + "\n")
    with pytest.raises(StorageMismatchError, match="another admin password"):
        node.check_formatted()
    node.format_marker.write_text(security.fingerprint + "\n")
    node.check_formatted()


def test_the_local_ca_is_made_once_and_reused(tmp_path: Path) -> None:
    ca = LocalCA(tmp_path / "pki")
    first = ca.ensure_node(2)
    before = first.read_bytes(), ca.cert_file.read_bytes()
    assert ca.ensure_node(2).read_bytes() == before[0]
    assert ca.cert_file.read_bytes() == before[1]
    cert = x509.load_pem_x509_certificates(first.read_bytes())[0]
    assert cert.subject.rfc4514_string() == "CN=fxstream-node-2,O=fxstream"
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in sans.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    # A node certificate of another CA is replaced (signed by this one).
    other = LocalCA(tmp_path / "other")
    first.write_bytes(other.ensure_node(2).read_bytes())
    replaced = x509.load_pem_x509_certificates(ca.ensure_node(2).read_bytes())[0]
    replaced.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.cert_file.read_bytes()))
    for path in (ca.key_file, ca.node_file(2)):
        assert _mode(path) == 0o600
    assert _mode(ca.directory) == 0o700


# --- the cluster -------------------------------------------------------------------------


@dataclass(frozen=True)
class SecureCluster:
    """The module's secure 3-node cluster: its launcher, connection and admin principal."""

    platform: Platform
    connection: ConnectionInfo
    kafka: KafkaConnection


@pytest.fixture(scope="module")
def secure_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    """A secure 3-node cluster for this module's cluster tests, stopped by PID after them."""
    home = tmp_path_factory.mktemp("secure-cluster")
    platform = Platform(private_config(home, cluster_base_port=free_port_block(6)))
    try:
        connection = platform.up(cluster=True)
        yield SecureCluster(platform, connection, platform.kafka(cluster=True))
    finally:
        platform.down()


@pytest.mark.cluster
def test_the_cluster_enforces_the_same_on_every_node(
    secure_cluster: SecureCluster, tmp_path: Path
) -> None:
    connection, kafka = secure_cluster.connection, secure_cluster.kafka
    assert connection.secure
    _assert_enforced(secure_cluster.platform, kafka, tmp_path, cluster=True)
    # Replication between the brokers runs over the authenticated listener.
    topic = connection.catalogue().task_events
    producer = Producer({**kafka.confluent(), **QUIET, "acks": "all"})
    delivered: list[str] = []
    for i in range(20):
        producer.produce(
            topic,
            key=str(i).encode(),
            value=b"x",
            on_delivery=lambda err, _msg: delivered.append("ok" if err is None else str(err)),
        )
    assert producer.flush(30) == 0
    assert delivered == ["ok"] * 20
    metadata = AdminClient({**kafka.confluent(), **QUIET}).list_topics(topic, timeout=10)
    for partition in metadata.topics[topic].partitions.values():
        assert sorted(partition.isrs) == [1, 2, 3]


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_the_acl_matrix_holds_on_the_cluster(secure_cluster: SecureCluster) -> None:
    """Every cell of the ACL matrix (tests/security/acl_matrix.py), on three nodes: each
    broker enforces the same table (ACLs live in the controllers' metadata log)."""
    with deployment(secure_cluster.kafka) as matrix:
        check_every_cell(matrix)
