"""A platform of one's own: the one helper tests and benchmarks start platforms with.

A *private* platform runs exactly what ``./fx up`` runs (broker or 3-broker
cluster, Redis, and optionally the supervised service processes and the local
endpoint) in a directory of the caller's, on free ports, with every process
tied to the caller (it dies with it) and stopped by PID at the end. Extra
endpoint agents (one worker, no store, ...) are added with
:meth:`PrivatePlatform.add_endpoint`, as ``fxstream-endpoint configure`` and
``start`` would run them.

Before this module each test area and the benchmarks had their own copy of
this start-up (free ports, config, up, credentials, local endpoint).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fxstream.ops.config import PlatformConfig
from fxstream.ops.platform import ConnectionInfo, Platform
from fxstream.ops.process import ManagedProcess, free_ports
from fxstream.ops.services import KAFKA_CREDENTIALS_ENV
from fxstream.sdk import Client, ClientSettings, Executor
from fxstream.service.account_files import ADMIN_TOKEN_FILE_NAME, read_admin_token
from fxstream.topics import Catalogue, KafkaConnection

__all__ = [
    "ExtraEndpoint",
    "PrivatePlatform",
    "PrivatePlatformError",
    "private_config",
    "private_platform",
    "start_private_platform",
]

# How long an added endpoint may take to come online.
ENDPOINT_ONLINE_S = 90.0


class PrivatePlatformError(RuntimeError):
    """The private platform did not start as asked."""


def private_config(
    home: Path,
    *,
    cluster_base_port: int | None = None,
    insecure: bool = False,
    settings: Mapping[str, int] | None = None,
) -> PlatformConfig:
    """A platform config in ``home`` on free ports, also written to ``home/fxstream.toml``.

    The TOML file lets a subprocess (the real CLI) find the same platform with only
    ``FXSTREAM_HOME`` set. Every process started from it dies with the caller. The platform
    is the secure one unless ``insecure`` (the benches' plain comparison only).
    ``settings`` are more of the file's integer settings (e.g. ``task_retention_s``).
    """
    kafka, controller, redis, service = free_ports(4)
    home.mkdir(parents=True, exist_ok=True)
    lines = [
        f"kafka_port = {kafka}",
        f"controller_port = {controller}",
        f"redis_port = {redis}",
        f"service_port = {service}",
    ]
    if cluster_base_port is not None:
        lines.append(f"cluster_base_port = {cluster_base_port}")
    if insecure:
        lines.append("insecure = true")
    lines.extend(f"{name} = {int(value)}" for name, value in (settings or {}).items())
    (home / "fxstream.toml").write_text("\n".join(lines) + "\n")
    return PlatformConfig.load(env={}, home=home, tie_to_caller=True)


@dataclass
class ExtraEndpoint:
    """An endpoint agent added beside the local one: its id and its process."""

    name: str
    endpoint_id: str
    process: ManagedProcess


@dataclass
class PrivatePlatform:
    """A running private platform and how to reach it as its local user.

    ``credentials`` is None and ``endpoint_id`` empty when it runs without services.
    """

    platform: Platform
    connection: ConnectionInfo
    credentials: Path | None = None
    endpoint_id: str = ""
    extra_endpoints: list[ExtraEndpoint] = field(default_factory=list)

    @property
    def home(self) -> Path:
        """The platform's home directory."""
        return self.platform.config.home

    @property
    def config(self) -> PlatformConfig:
        """The platform's config."""
        return self.platform.config

    @property
    def admin_token(self) -> str:
        """The platform admin's API token (creates users), from its 0600 file in the home."""
        return read_admin_token(self.home / "credentials" / ADMIN_TOKEN_FILE_NAME)

    @property
    def bootstrap(self) -> str:
        """Kafka's bootstrap servers."""
        return self.connection.bootstrap_servers

    @property
    def kafka(self) -> KafkaConnection:
        """The platform's Kafka as its admin principal (every ops-side client uses it)."""
        return self.platform.kafka(cluster=self.connection.mode == "cluster")

    @property
    def prefix(self) -> str:
        """The topic prefix."""
        return self.connection.topic_prefix

    @property
    def catalogue(self) -> Catalogue:
        """The platform's topic catalogue."""
        return Catalogue(prefix=self.prefix)

    @property
    def settings(self) -> ClientSettings:
        """The local user's client settings."""
        if self.credentials is None:
            raise PrivatePlatformError("this platform was started without its services")
        return ClientSettings.from_environment({"FXSTREAM_CREDENTIALS": str(self.credentials)})

    def client(self) -> Client:
        """A client of the local user (the caller closes it)."""
        return Client.from_settings(self.settings)

    @contextmanager
    def executor(self, endpoint_id: str | None = None) -> Iterator[Executor]:
        """An executor on ``endpoint_id`` (the local endpoint by default) whose client is
        closed with it.

        If the block raises, the executor's unfinished futures are cancelled rather than
        awaited: a lost task would otherwise keep the shutdown waiting forever.
        """
        client = self.client()
        executor = Executor(endpoint_id=endpoint_id or self.endpoint_id, client=client)
        try:
            yield executor
        except BaseException:
            executor.shutdown(wait=True, cancel_futures=True)
            raise
        else:
            executor.shutdown(wait=True)
        finally:
            client.close()

    def add_endpoint(
        self,
        name: str,
        *,
        workers: int = 1,
        prefetch: int = 0,
        heartbeat_period_s: float = 1.0,
        store_url: str | None = "platform",
        public: bool = False,
        allowed_functions: Sequence[str] = (),
        allowed_serializers: Sequence[str] = (),
        runtime: str = "process",
        images: Mapping[str, str] | None = None,
        image: str | None = None,
        interpreters: Sequence[str] = (),
        max_workers: int | None = None,
        engine: str = "process",
        batch: Mapping[str, Any] | None = None,
        staging: Mapping[str, Any] | None = None,
    ) -> ExtraEndpoint:
        """Register, configure and start another endpoint agent; wait until it is online.

        ``store_url`` ``"platform"`` gives it the platform's store, None none (large
        results then travel inline). ``allowed_functions`` and ``allowed_serializers`` set
        what it runs (see the endpoint config); ``runtime``, ``images`` (name ->
        ``"runtime:reference"``) and ``image`` the container its workers run in;
        ``interpreters`` other Pythons its workers may run (see the endpoint config);
        ``max_workers`` the most workers across its image pools; ``engine`` ``"htex"``
        with ``batch`` (the endpoint YAML's ``batch:`` settings) runs its tasks through
        Parsl's HighThroughputExecutor (docs/hpc.md); ``staging`` (the endpoint YAML's
        ``staging:`` settings) makes it stage the files tasks declare. It is stopped by
        :meth:`stop_extra_endpoints` (and by :func:`private_platform` at the end).
        """
        settings = self.settings
        endpoints_dir = self.home / "extra-endpoints"
        env = {**os.environ, "FXSTREAM_ENDPOINTS_DIR": str(endpoints_dir)}
        cli = str(Path(sys.executable).parent / "fxstream-endpoint")
        argv = [
            cli,
            "configure",
            name,
            "--service-url",
            settings.service_url,
            "--bootstrap",
            self.bootstrap,
            "--prefix",
            self.prefix,
            "--workers",
            str(workers),
            "--prefetch",
            str(prefetch),
            "--heartbeat-period",
            str(heartbeat_period_s),
        ]
        if public:
            argv.append("--public")
        for function_id in allowed_functions:
            argv += ["--allow-function", function_id]
        for serializer in allowed_serializers:
            argv += ["--allow-serializer", serializer]
        argv += ["--runtime", runtime]
        for image_name, spec in (images or {}).items():
            argv += ["--allow-image", f"{image_name}={spec}"]
        if image is not None:
            argv += ["--image", image]
        for interpreter in interpreters:
            argv += ["--interpreter", interpreter]
        if max_workers is not None:
            argv += ["--max-workers", str(max_workers)]
        argv += ["--engine", engine]
        if batch is not None:
            endpoints_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            batch_file = endpoints_dir / f"{name}.batch.yaml"
            batch_file.write_text(yaml.safe_dump(dict(batch)))
            argv += ["--batch", str(batch_file)]
        if staging is not None:
            endpoints_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            staging_file = endpoints_dir / f"{name}.staging.yaml"
            staging_file.write_text(yaml.safe_dump(dict(staging)))
            argv += ["--staging", str(staging_file)]
        store = settings.store_url if store_url == "platform" else store_url
        # The owner's token registers the endpoint: through the environment of this one
        # command, never a command line; the agent gets its own credential file, with the
        # API token and Kafka principal (ep.<id>) the service issues the endpoint. On the
        # secure platform it is given the CA certificate only, never another principal's
        # file. The store URL (it holds the Redis password) goes through the environment too.
        secrets_env = {"FXSTREAM_TOKEN": settings.token or ""}
        if store:
            secrets_env["FXSTREAM_STORE_URL"] = store
        else:
            env.pop("FXSTREAM_STORE_URL", None)
        env.pop(KAFKA_CREDENTIALS_ENV, None)
        if self.kafka.ca_file is not None:
            secrets_env["FXSTREAM_KAFKA_CA_FILE"] = str(self.kafka.ca_file)
        done = subprocess.run(
            argv,
            env={**env, **secrets_env},
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise PrivatePlatformError(
                f"fxstream-endpoint configure {name}: {done.stdout}{done.stderr}"
            )
        endpoint_id = _configured_endpoint_id(endpoints_dir / name / "config.yaml")
        process = ManagedProcess(
            name=f"endpoint {name}",
            argv=[cli, "start", name],
            pid_file=self.home / f"endpoint-{name}.pid",
            log_file=self.home / f"endpoint-{name}.log",
            env=env,
            die_with_parent=True,
        )
        process.start()
        extra = ExtraEndpoint(name, endpoint_id, process)
        self.extra_endpoints.append(extra)
        deadline = time.monotonic() + ENDPOINT_ONLINE_S
        with self.client() as owner:
            while owner.get_endpoint_status(endpoint_id)["state"] != "online":
                process.check_alive()
                if time.monotonic() > deadline:
                    raise PrivatePlatformError(
                        f"endpoint {name} not online after {ENDPOINT_ONLINE_S:.0f} s; "
                        f"see {process.log_file}"
                    )
                time.sleep(0.1)
        return extra

    def stop_extra_endpoints(self, timeout_s: float = 60.0) -> None:
        """Stop every endpoint :meth:`add_endpoint` started, by PID."""
        while self.extra_endpoints:
            self.extra_endpoints.pop().process.stop(timeout_s=timeout_s)


def _configured_endpoint_id(config_file: Path) -> str:
    endpoint_id = yaml.safe_load(config_file.read_text()).get("endpoint_id")
    if not isinstance(endpoint_id, str):
        raise PrivatePlatformError(f"{config_file} has no endpoint_id")
    return endpoint_id


def start_private_platform(
    platform: Platform,
    *,
    services: bool = True,
    step: Callable[[str], None] | None = None,
) -> PrivatePlatform:
    """Start ``platform`` (made with :func:`private_config`), with the service processes
    and the local endpoint unless ``services`` is False. The caller stops it with
    ``platform.down()`` (also when this raises)."""
    if step is None:
        connection = platform.up(services=services)
    else:
        connection = platform.up(services=services, step=step)
    if not services:
        return PrivatePlatform(platform, connection)
    service_set = platform.services()
    endpoint_id = service_set.local_endpoint_id()
    if endpoint_id is None:
        raise PrivatePlatformError("the private platform started without its local endpoint")
    return PrivatePlatform(platform, connection, service_set.credentials_file, endpoint_id)


@contextmanager
def private_platform(
    home: Path,
    *,
    services: bool = True,
    step: Callable[[str], None] | None = None,
) -> Iterator[PrivatePlatform]:
    """A private platform in ``home`` for the block; every process is stopped after it."""
    platform = Platform(private_config(home))
    started: PrivatePlatform | None = None
    try:
        started = start_private_platform(platform, services=services, step=step)
        yield started
    finally:
        if started is not None:
            started.stop_extra_endpoints()
        platform.down()
