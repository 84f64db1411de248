"""The local platform: Kafka (one node or a 3-node cluster) and Redis, with the catalogue's topics.

``up`` installs what is missing, starts everything in the background and
provisions topics; ``down`` stops by PID and waits; ``status`` reports what
runs and whether it answers. Where to connect is written to
``<home>/platform.json`` for the other parts (SDK, agent, service) to read; it holds no
secret. The secrets are in ``<home>/credentials/`` (0700), one 0600 JSON file per principal
(:meth:`~fxstream.topics.KafkaConnection.to_json` fields): ``admin.json`` (the Kafka admin,
the only super user), ``api.json`` (the REST API, which makes accounts, acts as the admin)
and ``service.json`` (what the service processes connect as) once the services start, with
``routing-keys.json`` (the router's and the ingress's routing keys, made once). The
local endpoint connects as its own principal, in its own credentials file
(:mod:`fxstream.ops.services`).

Secure by default: the home is 0700, the local CA and the nodes' certificates are made in
``<home>/pki`` (:mod:`fxstream.ops.pki`), and Kafka authenticates every connection (see
:mod:`fxstream.ops.kafka`). ``PlatformConfig.insecure`` (``./fx up --insecure``,
``FXSTREAM_INSECURE=1``) starts the old PLAINTEXT platform and says so on stderr at every start.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from fxstream.ops.config import PlatformConfig
from fxstream.ops.install import ensure_java, ensure_kafka, ensure_redis
from fxstream.ops.kafka import (
    ADMIN_PRINCIPAL,
    KafkaNode,
    KafkaSecurity,
    admin_password,
    cluster_id_for,
    kafka_nodes,
    wait_for_cluster,
)
from fxstream.ops.metrics_summary import MetricsSummary, scrape, summarize
from fxstream.ops.pki import LocalCA, ensure_private_dir
from fxstream.ops.process import ProcessStartError, stop_together
from fxstream.ops.redis_server import RedisServer
from fxstream.ops.services import ComponentStatus, ServiceSet
from fxstream.service.account_files import read_admin_token
from fxstream.topics import (
    Catalogue,
    CredentialFileError,
    KafkaConnection,
    ProvisionError,
    ProvisionReport,
    ensure_topics,
    write_secret_file,
)

__all__ = [
    "INSECURE_WARNING",
    "SECURITY_INSECURE",
    "SECURITY_SCRAM",
    "ComponentStatus",
    "ConnectionInfo",
    "Platform",
    "PlatformError",
    "PlatformStatus",
]

# ConnectionInfo.security: SASL/SCRAM-SHA-512 over TLS, or the insecure development platform.
SECURITY_SCRAM = "sasl_ssl-scram-sha-512"
# How long a cluster node may still run once its peers have exited at `down` (it can only
# be waiting for the controller quorum they took with them) before it is killed.
CLUSTER_STRAGGLER_S = 10.0
SECURITY_INSECURE = "insecure"

INSECURE_WARNING = """\
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
!! fxstream: INSECURE platform (--insecure / FXSTREAM_INSECURE=1): Kafka takes PLAINTEXT   !!
!! connections with NO authentication, NO encryption and NO authorization. Anyone who can !!
!! reach its ports can run code on every endpoint. Development on a private machine only. !!
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
"""

Step = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


class PlatformError(RuntimeError):
    """The platform cannot be started or stopped as asked; the message says what to do."""


@dataclass(frozen=True)
class ConnectionInfo:
    """Where a running platform listens (written to ``<home>/platform.json``, 0600).

    ``redis_url`` is the store URL clients use: it carries the ``fxstream`` Redis user's
    password, so it is left out of the repr and only ever shown redacted.
    """

    mode: str
    bootstrap_servers: str
    redis_url: str = field(repr=False)
    topic_prefix: str
    replication_factor: int
    min_insync_replicas: int
    # How clients authenticate (SECURITY_SCRAM or SECURITY_INSECURE) and the CA they trust.
    security: str = SECURITY_SCRAM
    ca_file: str = ""

    @property
    def secure(self) -> bool:
        """False on the insecure development platform."""
        return self.security != SECURITY_INSECURE

    def catalogue(self) -> Catalogue:
        """The topic catalogue of this platform."""
        return Catalogue(
            prefix=self.topic_prefix,
            replication_factor=self.replication_factor,
            min_insync_replicas=self.min_insync_replicas,
        )


@dataclass
class PlatformStatus:
    """Everything ``status`` knows."""

    mode: str | None
    components: list[ComponentStatus] = field(default_factory=list)
    topics: ProvisionReport | None = None
    topics_error: str = ""
    # The platform's metrics at a glance (docs/metrics.md), when the API answers.
    metrics: MetricsSummary | None = None
    metrics_error: str = ""

    @property
    def running(self) -> bool:
        """True if any component runs."""
        return any(c.pid is not None for c in self.components)

    @property
    def healthy(self) -> bool:
        """True when every component answers and every catalogue topic exists as specified."""
        return (
            bool(self.components)
            and all(c.healthy for c in self.components)
            and self.topics is not None
            and self.topics.ok
        )

    def to_json(self) -> str:
        """Machine-readable form (``fxstream status --json``)."""
        return json.dumps(
            {
                "mode": self.mode,
                "healthy": self.healthy,
                "components": [asdict(c) for c in self.components],
                "topics": None
                if self.topics is None
                else {
                    "present": sorted(self.topics.unchanged + self.topics.created),
                    "missing": sorted(self.topics.missing),
                    "drifted": [str(d) for d in self.topics.drifted],
                },
                "topics_error": self.topics_error,
                "metrics": None if self.metrics is None else asdict(self.metrics),
                "metrics_error": self.metrics_error,
            },
            indent=2,
        )


class Platform:
    """One local platform, rooted at ``config.home``."""

    def __init__(self, config: PlatformConfig) -> None:
        self.config = config

    # --- what is where -----------------------------------------------------------------

    @property
    def info_file(self) -> Path:
        """The connection file clients read."""
        return self.config.home / "platform.json"

    @property
    def ca(self) -> LocalCA:
        """The platform's local certificate authority (``<home>/pki``)."""
        return LocalCA(self.config.home / "pki")

    @property
    def credentials_dir(self) -> Path:
        """Where the principals' credential files are (0700; each file 0600)."""
        return self.config.home / "credentials"

    def credentials_file(self, name: str) -> Path:
        """``<home>/credentials/<name>.json``."""
        return self.credentials_dir / f"{name}.json"

    def secure(self) -> bool:
        """Whether this platform's Kafka authenticates: as the running platform was started
        (platform.json), else as the config asks."""
        try:
            return self.read_connection(self.config.home).secure
        except (PlatformError, TypeError, ValueError):
            return not self.config.insecure

    def kafka(self, *, cluster: bool) -> KafkaConnection:
        """The admin principal's connection to this platform's Kafka in the given mode
        (without a principal on the insecure platform)."""
        bootstrap = ",".join(node.bootstrap for node in self.nodes(cluster=cluster))
        if not self.secure():
            return KafkaConnection(bootstrap)
        return KafkaConnection(
            bootstrap, ADMIN_PRINCIPAL, admin_password(self.config.home), self.ca.cert_file
        )

    def security(self) -> KafkaSecurity | None:
        """What this platform's secure Kafka nodes need (None on the insecure platform).

        Pass it to :meth:`nodes` for a node that will be (re)started: a node started
        without it would render the insecure configuration.
        """
        if not self.secure():
            return None
        return KafkaSecurity(self.ca, admin_password(self.config.home))

    def redis(self, binary: str = "redis-server") -> RedisServer:
        """The Redis server of this platform."""
        return RedisServer(self.config, binary)

    def nodes(
        self, *, cluster: bool, java: str = "java", security: KafkaSecurity | None = None
    ) -> list[KafkaNode]:
        """The Kafka node(s) of this platform in the given mode."""
        return kafka_nodes(self.config, java, cluster=cluster, security=security)

    def running_mode(self) -> str | None:
        """ "single" or "cluster" if Kafka nodes of that mode run, else None."""
        for cluster in (False, True):
            if any(node.process.is_running() for node in self.nodes(cluster=cluster)):
                return "cluster" if cluster else "single"
        return None

    def connection(self, *, cluster: bool) -> ConnectionInfo:
        """How clients reach this platform in the given mode."""
        nodes = self.nodes(cluster=cluster)
        catalogue = Catalogue(prefix=self.config.topic_prefix)
        if cluster:
            catalogue = catalogue.for_cluster(len(nodes))
        secure = self.secure()
        return ConnectionInfo(
            mode="cluster" if cluster else "single",
            bootstrap_servers=",".join(node.bootstrap for node in nodes),
            redis_url=self.redis().client_url,
            topic_prefix=catalogue.prefix,
            replication_factor=catalogue.replication_factor,
            min_insync_replicas=catalogue.min_insync_replicas,
            security=SECURITY_SCRAM if secure else SECURITY_INSECURE,
            ca_file=str(self.ca.cert_file) if secure else "",
        )

    @staticmethod
    def read_connection(home: Path) -> ConnectionInfo:
        """The connection file of a running platform in ``home``."""
        path = home / "platform.json"
        try:
            return ConnectionInfo(**json.loads(path.read_text()))
        except FileNotFoundError as exc:
            raise PlatformError(
                f"no platform is running in {home}: start one with ./fx up"
            ) from exc

    # --- up / down / status ------------------------------------------------------------

    def up(
        self, *, cluster: bool = False, services: bool = False, step: Step = _quiet
    ) -> ConnectionInfo:
        """Install what is missing, start Redis and Kafka, provision topics. Safe to repeat.

        With ``services`` it also starts the REST API, the stream processors and
        the local endpoint (see :class:`~fxstream.ops.services.ServiceSet`).
        """
        running = self.running_mode()
        wanted = "cluster" if cluster else "single"
        if running is not None and running != wanted:
            raise PlatformError(
                f"a {running} platform already runs in {self.config.home}: "
                f"stop it with ./fx down before starting a {wanted} one"
            )
        if self.config.insecure:
            sys.stderr.write(INSECURE_WARNING)
            sys.stderr.flush()
        elif running is not None and not self.secure():
            raise PlatformError(
                f"an insecure platform already runs in {self.config.home}: stop it with "
                "./fx down before starting the secure one (or add --insecure)"
            )
        ensure_private_dir(self.config.home)
        step("checking Java")
        java = ensure_java()
        step(f"fetching Apache Kafka {self.config.kafka_version} (cached after the first time)")
        ensure_kafka(self.config)
        step("checking Redis")
        redis_binary = ensure_redis()

        redis = self.redis(redis_binary)
        step(f"starting Redis on port {self.config.redis_port}")
        redis.start()
        security = (
            None
            if self.config.insecure
            else KafkaSecurity(self.ca, admin_password(self.config.home))
        )
        if security is not None:
            step("making the local CA and the Kafka nodes' certificates (kept in pki/)")
            security.ca.ensure()
        nodes = self.nodes(cluster=cluster, java=java, security=security)
        cluster_id = cluster_id_for(nodes[0].directory.parent if cluster else nodes[0].directory)
        try:
            for node in nodes:
                step(f"starting Kafka node {node.node_id} on port {node.broker_port}")
                node.start(cluster_id)
        except ProcessStartError:
            self.down()
            raise
        bootstrap = ",".join(node.bootstrap for node in nodes)
        kafka = (
            KafkaConnection(bootstrap)
            if security is None
            else KafkaConnection(
                bootstrap, ADMIN_PRINCIPAL, security.admin_password, security.ca.cert_file
            )
        )
        try:
            redis.wait_ready()
            step("waiting for Kafka to elect a controller and register brokers")
            wait_for_cluster(nodes, kafka)
        except (ProcessStartError, TimeoutError):
            self.down()
            raise
        # Written first: everything below (and every client) reads the mode from it.
        connection = self._write_connection(cluster=cluster, secure=security is not None)
        self._write_credentials(kafka)
        step("provisioning topics")
        report = ensure_topics(self._admin(kafka), connection.catalogue())
        if report.drifted:
            step("topic drift: " + "; ".join(str(d) for d in report.drifted))
        if services:
            step("starting the service, the stream processors and the local endpoint")
            try:
                self.services().start(kafka, connection.topic_prefix, connection.redis_url)
            except (ProcessStartError, TimeoutError):
                self.down()
                raise
        return connection

    def _write_connection(self, *, cluster: bool, secure: bool) -> ConnectionInfo:
        # A platform.json left by an earlier run must not decide the mode of this one.
        self.info_file.unlink(missing_ok=True)
        info = self.connection(cluster=cluster)
        if not secure:
            info = ConnectionInfo(**{**asdict(info), "security": SECURITY_INSECURE, "ca_file": ""})
        # It holds the store URL with its password: owner-only, written atomically.
        write_secret_file(self.info_file, (json.dumps(asdict(info), indent=2) + "\n").encode())
        return info

    def _write_credentials(self, kafka: KafkaConnection) -> None:
        """``<home>/credentials/admin.json`` (0600, directory 0700): the admin's connection.

        The service set writes ``api.json`` and ``service.json`` when it starts.
        """
        ensure_private_dir(self.credentials_dir)
        if kafka.secure:
            text = (json.dumps(kafka.to_json(), indent=2) + "\n").encode()
            write_secret_file(self.credentials_file("admin"), text)

    def services(self) -> ServiceSet:
        """The Python services of this platform."""
        return ServiceSet(self.config)

    def down(self, timeout_s: float = 60.0) -> list[str]:
        """Stop every process of this platform by PID and wait for each; returns what stopped."""
        # The endpoint first (it finishes what it holds), then the service, then the brokers.
        stopped: list[str] = self.services().stop(timeout_s)
        # Then the brokers and Redis: nothing left running uses them. A cluster's nodes
        # stop together (its last node stopped alone has lost the controller quorum and
        # would wait for it until killed); one still waiting 10 s after its peers exited
        # waits for that quorum, and is killed (what it acknowledged is in the kernel's
        # page cache, which outlives the process; its next start recovers its logs).
        cluster = [node.process for node in self.nodes(cluster=True)]
        others = [*(node.process for node in self.nodes(cluster=False)), self.redis().process]
        processes = [*cluster, *others]
        pids = [process.pid() for process in processes]
        stop_together(cluster, timeout_s, straggler_s=CLUSTER_STRAGGLER_S)
        stop_together(others, timeout_s)
        stopped.extend(
            f"{process.name} (pid {pid})"
            for process, pid in zip(processes, pids, strict=True)
            if pid is not None
        )
        self.info_file.unlink(missing_ok=True)
        return stopped

    def status(self) -> PlatformStatus:
        """What runs, whether it answers, and whether the catalogue's topics are in place."""
        mode = self.running_mode()
        result = PlatformStatus(mode=mode)
        services = self.services()
        result.components.extend(services.status(expected=mode is not None))
        self._metrics(services, result)
        redis = self.redis()
        redis_pid = redis.process.pid()
        result.components.append(
            ComponentStatus(
                name="redis",
                address=redis.url,
                pid=redis_pid,
                healthy=redis_pid is not None and redis.ping(),
                detail="" if redis_pid is not None else "not running",
            )
        )
        cluster = mode == "cluster"
        nodes = self.nodes(cluster=cluster)
        connection = self.connection(cluster=cluster)
        registered: set[int] = set()
        admin = self._admin(self.kafka(cluster=cluster)) if mode is not None else None
        if admin is not None:
            try:
                described = admin.describe_cluster(request_timeout=3).result(timeout=5)
                registered = {n.id for n in described.nodes}
            except KafkaException as exc:
                result.topics_error = f"Kafka does not answer: {exc}"
        for node in nodes:
            pid = node.process.pid()
            healthy = pid is not None and node.node_id in registered
            detail = "not running" if pid is None else ("" if healthy else "not registered")
            result.components.append(
                ComponentStatus(f"kafka node {node.node_id}", node.bootstrap, pid, healthy, detail)
            )
        if registered and admin is not None:
            try:
                result.topics = ensure_topics(
                    admin, connection.catalogue(), create=False, timeout_s=10
                )
            except ProvisionError as exc:
                result.topics_error = str(exc)
        return result

    @staticmethod
    def _metrics(services: ServiceSet, result: PlatformStatus) -> None:
        """Summarise the API's and the supervisor's metrics into ``result`` (if they answer)."""
        urls = {c.name: c.metrics_url for c in result.components if c.metrics_url}
        api = urls.get(services.api.name)
        if api is None or not services.admin_token_file.is_file():
            return
        try:
            token = read_admin_token(services.admin_token_file)
            texts = [scrape(api, token)]
            if "supervisor" in urls:
                texts.append(scrape(urls["supervisor"]))
            result.metrics = summarize(*texts)
        except (httpx.HTTPError, CredentialFileError, ValueError) as exc:
            result.metrics_error = f"cannot read the metrics: {exc}"

    @staticmethod
    def _admin(kafka: KafkaConnection) -> AdminClient:
        return AdminClient(
            {
                **kafka.confluent(),
                "socket.timeout.ms": 5000,
                # Failures surface as exceptions with reasons; librdkafka's own log would
                # repeat them on stderr.
                "log_level": 2,
            }
        )
