"""Apache Kafka in KRaft mode: one node, or a 3-node cluster, each node broker and controller."""

from __future__ import annotations

import base64
import socket
import string
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from fxstream.ops.config import PlatformConfig
from fxstream.ops.process import ManagedProcess, ProcessStartError, ensure_port_free

__all__ = ["KafkaNode", "cluster_id_for", "kafka_nodes", "wait_for_cluster"]


def _render(template: Path, values: dict[str, str]) -> str:
    return string.Template(template.read_text()).substitute(values)


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
            f"-Xms{min(self.heap_mb, 256)}m",
            f"-Xmx{self.heap_mb}m",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            # C1 only: on a small machine C2 kept a compiler thread busy for half the
            # broker's CPU under the task path's load, while the request handlers ran no
            # faster with its code (measured: 3.42 s vs 3.44 s per 20,000 tasks).
            "-XX:TieredStopAtLevel=1",
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

    def render(self) -> None:
        """Write server.properties from broker-config's templates."""
        values = {
            "node_id": str(self.node_id),
            "broker_port": str(self.broker_port),
            "controller_port": str(self.controller_port),
            "voters": self.voters,
            "log_dir": str(self.data_dir),
        }
        templates = self.config.broker_config_dir
        text = _render(templates / "kraft-common.properties", values)
        text += "\n" + _render(templates / f"kraft-{self.mode}.properties", values)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.properties_file.write_text(text)

    def format_storage(self, cluster_id: str) -> None:
        """Format the data dir on first start; a formatted dir is reused as it is."""
        if (self.data_dir / "meta.properties").exists():
            return
        log4j = self.config.broker_config_dir / "log4j2.properties"
        done = subprocess.run(
            [
                self.java,
                f"-Dlog4j2.configurationFile={log4j}",
                "-cp",
                f"{self.config.kafka_libs}/*",
                "kafka.tools.StorageTool",
                "format",
                f"--cluster-id={cluster_id}",
                f"--config={self.properties_file}",
                "--ignore-formatted",
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise ProcessStartError(
                f"kafka-storage format failed for node {self.node_id}: "
                f"{(done.stdout + done.stderr)[-2000:]}"
            )

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
        return self.process.start()


def kafka_nodes(config: PlatformConfig, java: str, *, cluster: bool) -> list[KafkaNode]:
    """The node(s) of a single-node platform, or of the 3-node cluster."""
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
    directory.mkdir(parents=True, exist_ok=True)
    cluster_id = _new_cluster_id()
    path.write_text(cluster_id + "\n")
    return cluster_id


def wait_for_cluster(nodes: list[KafkaNode], timeout_s: float = 90.0) -> None:
    """Wait until every node is a registered broker and a controller is elected.

    Raises :class:`ProcessStartError` (with the log's tail) if a node dies, or
    :class:`TimeoutError` if the cluster is not ready in time.
    """
    bootstrap = ",".join(node.bootstrap for node in nodes)
    deadline = time.monotonic() + timeout_s
    # Wait for the listeners first, so the admin client does not log refused connections.
    for node in nodes:
        while not _port_open(node.broker_port):
            node.process.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"Kafka node {node.node_id} never opened {node.bootstrap}")
            time.sleep(0.1)
    admin = AdminClient({"bootstrap.servers": bootstrap, "socket.timeout.ms": 2000, "log_level": 2})
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
