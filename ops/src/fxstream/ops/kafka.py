"""Apache Kafka in KRaft mode: one node, or a 3-node cluster, each node broker and controller.

Secure by default (see broker-config/kraft-secure.properties): clients and brokers speak
SASL/SCRAM-SHA-512 over TLS, the controllers mutual TLS, and the StandardAuthorizer allows
only what an ACL grants, with the admin principal (``fxstream-admin``) the only super user.
The admin's SCRAM credential is written into the metadata log when a node's storage is
formatted. ``kafka-storage format --add-scram`` would put its password on a command line
(readable by every local user in ``/proc/<pid>/cmdline``), so the storage tool is started as
``java @<argfile>``: the JVM launcher reads the main class and its arguments from the file,
which is created 0600 in the node's 0700 directory and deleted when the tool exits.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import socket
import string
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from fxstream.ops.config import PlatformConfig
from fxstream.ops.pki import NODE_CN_PREFIX, ORGANIZATION, LocalCA, ensure_private_dir
from fxstream.ops.process import ManagedProcess, ProcessStartError, ensure_port_free
from fxstream.topics import (
    CredentialFileError,
    KafkaConnection,
    read_secret_json,
    write_secret_file,
)

__all__ = [
    "ADMIN_PRINCIPAL",
    "KafkaNode",
    "KafkaSecurity",
    "StorageMismatchError",
    "admin_password",
    "cluster_id_for",
    "kafka_nodes",
    "wait_for_cluster",
]

# The platform's Kafka admin: the only super user (issue 13's principal table).
ADMIN_PRINCIPAL = "fxstream-admin"

# Written beside a node's data at format time: how it was formatted (the admin credential's
# fingerprint, or "insecure"), so a secure start never meets data it cannot authenticate to.
_FORMAT_MARKER = "format-security"


class StorageMismatchError(ProcessStartError):
    """A node's data was formatted for another admin credential (or none)."""


@dataclass(frozen=True)
class KafkaSecurity:
    """What a secure node needs: the local CA and the admin's SCRAM password."""

    ca: LocalCA
    admin_password: str = field(repr=False)

    @property
    def fingerprint(self) -> str:
        """A digest naming the admin credential (the password is 256 random bits)."""
        return hashlib.sha256(self.admin_password.encode()).hexdigest()


def admin_password(home: Path) -> str:
    """The admin principal's SCRAM password, generated once per platform home.

    It lives in ``<home>/credentials/admin.json`` (0600), which also holds the rest of the
    admin's :class:`~fxstream.topics.KafkaConnection` once a platform started.
    """
    path = home / "credentials" / "admin.json"
    if path.exists():
        try:
            password = read_secret_json(path).get("kafka_password")
        except CredentialFileError as exc:
            raise ProcessStartError(str(exc)) from exc
        if isinstance(password, str) and password:
            return password
        raise ProcessStartError(
            f"{path} has no 'kafka_password'; restore it, or remove it together with the "
            f"Kafka data ({home / 'kafka'}, {home / 'cluster'}) to start afresh"
        )
    password = secrets.token_urlsafe(32)
    ensure_private_dir(path.parent)
    fields = {"kafka_username": ADMIN_PRINCIPAL, "kafka_password": password}
    write_secret_file(path, (json.dumps(fields, indent=2) + "\n").encode())
    return password


def _render(template: Path, values: dict[str, str]) -> str:
    return string.Template(template.read_text()).substitute(values)


def _argfile_quote(argument: str) -> str:
    """One argument as a line of a java launcher argument file (quoted, backslashes escaped)."""
    return '"' + argument.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _new_cluster_id() -> str:
    # Kafka's cluster id is a UUID in unpadded URL-safe base64; like Kafka's own generator we
    # avoid a leading '-', which command lines would read as an option.
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


@dataclass
class KafkaNode:
    """One KRaft node of the platform (broker and controller in one JVM)."""

    config: PlatformConfig
    java: str
    node_id: int
    broker_port: int
    controller_port: int
    voters: str
    mode: str  # "single" or "cluster"
    heap_mb: int
    # None: the insecure development platform (PLAINTEXT everywhere).
    security: KafkaSecurity | None = None

    @property
    def directory(self) -> Path:
        """This node's own directory: config, data and PID file."""
        if self.mode == "single":
            return self.config.home / "kafka"
        return self.config.home / "cluster" / f"node-{self.node_id}"

    @property
    def data_dir(self) -> Path:
        """Kafka's log.dirs."""
        return self.directory / "data"

    @property
    def properties_file(self) -> Path:
        """The rendered server.properties."""
        return self.directory / "server.properties"

    @property
    def bootstrap(self) -> str:
        """host:port of this node's client listener."""
        return f"127.0.0.1:{self.broker_port}"

    @property
    def process(self) -> ManagedProcess:
        """The node's JVM as a managed process (identified by its unique properties path)."""
        classpath = f"{self.config.kafka_libs}/*"
        log4j = self.config.broker_config_dir / "log4j2.properties"
        argv = [
            self.java,
            # The heap is committed and touched at start (Kafka's own advice: -Xms equal to
            # -Xmx), so the broker's RSS is flat from its first minute instead of creeping
            # toward -Xmx over an hour as G1 grows the heap (soak 3: 682 -> 1,041 MB).
            f"-Xms{self.heap_mb}m",
            f"-Xmx{self.heap_mb}m",
            "-XX:+AlwaysPreTouch",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            # C2 only for the hottest code. C1-only (TieredStopAtLevel=1, kept until
            # 2026-11-28) saved a busy C2 compiler thread on the plaintext task path, but
            # Java's AES-GCM intrinsics (AES-NI, PCLMULQDQ) are emitted by C2 alone: on the
            # secure platform the C1 broker spent 688 µs of CPU per task, 606 of them in
            # its network and request threads (TLS). With C2 past ten times its usual
            # thresholds, only loops as hot as the ciphers' reach C2: 373 µs per task after
            # 30,000 tasks, the compiler thread 68 of them, and falling (`./fx bench
            # profile`, docs/benchmarks.md).
            "-XX:Tier4InvocationThreshold=50000",
            "-XX:Tier4MinInvocationThreshold=6000",
            "-XX:Tier4CompileThreshold=150000",
            "-XX:Tier4BackEdgeThreshold=400000",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={log4j}",
            "-cp",
            classpath,
            "kafka.Kafka",
            str(self.properties_file),
        ]
        return ManagedProcess(
            name=f"kafka node {self.node_id}",
            argv=argv,
            pid_file=self.directory / "kafka.pid",
            log_file=self.config.home / "logs" / f"kafka-{self.mode}-{self.node_id}.log",
            die_with_parent=self.config.tie_to_caller,
        )

    @property
    def format_marker(self) -> Path:
        """Says how the data was formatted (admin credential fingerprint, or "insecure")."""
        return self.directory / _FORMAT_MARKER

    def render(self) -> None:
        """Write server.properties from broker-config's templates (0600: it holds secrets)."""
        values = {
            "node_id": str(self.node_id),
            "broker_port": str(self.broker_port),
            "controller_port": str(self.controller_port),
            "voters": self.voters,
            "log_dir": str(self.data_dir),
        }
        templates = self.config.broker_config_dir
        security_file = "kraft-insecure.properties"
        if self.security is not None:
            security_file = "kraft-secure.properties"
            values.update(
                {
                    "admin_user": ADMIN_PRINCIPAL,
                    "admin_password": self.security.admin_password,
                    "keystore": str(self.security.ca.ensure_node(self.node_id)),
                    "truststore": str(self.security.ca.cert_file),
                    "node_cn_prefix": NODE_CN_PREFIX,
                    "organization": ORGANIZATION,
                }
            )
        text = _render(templates / "kraft-common.properties", values)
        text += "\n" + _render(templates / security_file, values)
        text += "\n" + _render(templates / f"kraft-{self.mode}.properties", values)
        ensure_private_dir(self.directory)
        write_secret_file(self.properties_file, text.encode())

    def check_formatted(self) -> None:
        """Refuse to start a secure node on data formatted without its admin credential."""
        if self.security is None or not (self.data_dir / "meta.properties").exists():
            return
        try:
            marker = self.format_marker.read_text().strip()
        except FileNotFoundError:
            marker = "insecure"
        if marker == self.security.fingerprint:
            return
        why = (
            "without credentials (an insecure or older platform)"
            if marker == "insecure"
            else "for another admin password (was credentials/admin.json replaced?)"
        )
        raise StorageMismatchError(
            f"the Kafka data in {self.data_dir} was formatted {why}, so no client could "
            f"authenticate to it. Start it as it was with `./fx up --insecure`, or remove "
            f"{self.directory} (its topics are lost) and run ./fx up again"
        )

    def format_storage(self, cluster_id: str) -> None:
        """Format the data dir on first start; a formatted dir is reused as it is.

        A secure node's format also writes the admin's SCRAM credential. Its password goes
        through a 0600 argument file the JVM launcher reads (``java @file``), never argv.
        """
        if (self.data_dir / "meta.properties").exists():
            self.check_formatted()
            return
        ensure_private_dir(self.data_dir)
        log4j = self.config.broker_config_dir / "log4j2.properties"
        arguments = [
            f"-Dlog4j2.configurationFile={log4j}",
            "-cp",
            f"{self.config.kafka_libs}/*",
            "kafka.tools.StorageTool",
            "format",
            f"--cluster-id={cluster_id}",
            f"--config={self.properties_file}",
            "--ignore-formatted",
        ]
        marker = "insecure"
        if self.security is not None:
            password = self.security.admin_password
            arguments += [
                "--add-scram",
                f"SCRAM-SHA-512=[name={ADMIN_PRINCIPAL},password={password}]",
            ]
            marker = self.security.fingerprint
        argfile = self.directory / "storage-format.args"
        write_secret_file(argfile, "\n".join(_argfile_quote(a) for a in arguments).encode())
        try:
            done = subprocess.run(
                [self.java, f"@{argfile}"], capture_output=True, text=True, check=False
            )
        finally:
            argfile.unlink(missing_ok=True)
        if done.returncode != 0:
            raise ProcessStartError(
                f"kafka-storage format failed for node {self.node_id}: "
                f"{(done.stdout + done.stderr)[-2000:]}"
            )
        self.format_marker.write_text(marker + "\n")

    def start(self, cluster_id: str) -> int:
        """Render, format if new, start; returns the PID (the running one if already up)."""
        if self.process.is_running():
            pid = self.process.pid()
            assert pid is not None
            return pid
        ensure_port_free(self.broker_port, "FXSTREAM_KAFKA_PORT / FXSTREAM_CLUSTER_BASE_PORT")
        ensure_port_free(
            self.controller_port, "FXSTREAM_CONTROLLER_PORT / FXSTREAM_CLUSTER_BASE_PORT"
        )
        self.render()
        self.format_storage(cluster_id)
        ensure_private_dir(self.data_dir)
        return self.process.start()


def kafka_nodes(
    config: PlatformConfig,
    java: str,
    *,
    cluster: bool,
    security: KafkaSecurity | None = None,
) -> list[KafkaNode]:
    """The node(s) of a single-node platform, or of the 3-node cluster.

    ``security`` None gives the insecure development nodes (PLAINTEXT).
    """
    if not cluster:
        return [
            KafkaNode(
                config=config,
                java=java,
                node_id=1,
                broker_port=config.kafka_port,
                controller_port=config.controller_port,
                voters=f"1@127.0.0.1:{config.controller_port}",
                mode="single",
                heap_mb=config.kafka_heap_mb,
                security=security,
            )
        ]
    ids = (1, 2, 3)
    voters = ",".join(f"{i}@127.0.0.1:{config.cluster_ports(i)[1]}" for i in ids)
    return [
        KafkaNode(
            config=config,
            java=java,
            node_id=i,
            broker_port=config.cluster_ports(i)[0],
            controller_port=config.cluster_ports(i)[1],
            voters=voters,
            mode="cluster",
            heap_mb=max(256, config.kafka_heap_mb // 2),
            security=security,
        )
        for i in ids
    ]


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def cluster_id_for(directory: Path) -> str:
    """The cluster id stored in ``directory`` (created on first use and kept)."""
    path = directory / "cluster.id"
    if path.exists():
        return path.read_text().strip()
    ensure_private_dir(directory)
    cluster_id = _new_cluster_id()
    path.write_text(cluster_id + "\n")
    return cluster_id


def wait_for_cluster(
    nodes: list[KafkaNode], connection: KafkaConnection, timeout_s: float = 90.0
) -> None:
    """Wait until every node is a registered broker and a controller is elected.

    Raises :class:`ProcessStartError` (with the log's tail) if a node dies, or
    :class:`TimeoutError` if the cluster is not ready in time.
    """
    bootstrap = connection.bootstrap
    deadline = time.monotonic() + timeout_s
    # Wait for the listeners first, so the admin client does not log refused connections.
    for node in nodes:
        while not _port_open(node.broker_port):
            node.process.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"Kafka node {node.node_id} never opened {node.bootstrap}")
            time.sleep(0.1)
    admin = AdminClient({**connection.confluent(), "socket.timeout.ms": 2000, "log_level": 2})
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        for node in nodes:
            node.process.check_alive()
        try:
            described = admin.describe_cluster(request_timeout=2).result(timeout=5)
            if described.controller is not None and len(described.nodes) == len(nodes):
                return
            last_error = f"{len(described.nodes)} of {len(nodes)} brokers registered"
        except KafkaException as exc:
            last_error = str(exc)
        time.sleep(0.3)
    raise TimeoutError(f"Kafka at {bootstrap} not ready after {timeout_s:.0f}s: {last_error}")
