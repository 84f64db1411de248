"""``fxstream-service``: run the REST API or the stream processors.

Where Kafka is comes from ``--bootstrap``/``--prefix`` or from a platform's
``platform.json`` (``--connection``). Who the process is on Kafka (its SCRAM
principal, password and the platform's CA) comes from a credentials file, 0600 JSON
as ``fxstream`` writes it, named by ``--kafka-credentials`` or the
``FXSTREAM_KAFKA_CREDENTIALS`` variable: never a password on the command line.
Without one the process connects unauthenticated (the insecure development
platform only). The router and the ingress also read the service's routing keys from a
0600 file (``--routing-keys`` or ``FXSTREAM_ROUTING_KEYS``); ``routing-keys FILE`` makes,
rotates and retires them. Before serving, each command checks that Kafka answers and the
topics exist, so a start failure is one line saying what to do (exit status 1)
rather than a traceback.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from fxstream.service.account_files import (
    ADMIN_TOKEN_ENV,
    DEFAULT_LIFETIME_DAYS,
    GLOBUS_CREDENTIALS_ENV,
    admin_token_sha256,
    globus_provider,
)
from fxstream.service.body_limit import DEFAULT_MAX_BODY_BYTES, MAX_BODY_ENV, MAX_BODY_OPTION
from fxstream.service.placement import PlacementPolicy
from fxstream.service.routing_keys import RoutingKeysUnavailable, routing_keys_for
from fxstream.service.task_expiry import DEFAULT_RETENTION_S, RETENTION_ENV, retention_s
from fxstream.topics import (
    ROUTING_KEYS_ENV,
    Catalogue,
    CredentialFileError,
    InvalidTopicName,
    KafkaConnection,
    ProvisionError,
    RoutingKey,
    RoutingKeys,
    ensure_routing_keys,
    ensure_topics,
    write_routing_keys,
)

__all__ = ["KAFKA_CREDENTIALS_ENV", "Target", "app", "main", "target_from"]

DEFAULT_PORT = 19180  # the platform's `service_port` default (docs/api.md)
KAFKA_TIMEOUT_S = 10.0  # how long a start waits for Kafka to answer
KAFKA_CREDENTIALS_ENV = "FXSTREAM_KAFKA_CREDENTIALS"  # names the Kafka credentials file

app = typer.Typer(
    name="fxstream-service",
    help="The fxstream management service: REST API and stream processors.",
    add_completion=False,
    no_args_is_help=True,
)


@dataclass(frozen=True)
class Target:
    """Which Kafka to use, as whom, and the catalogue of its topics."""

    kafka: KafkaConnection
    catalogue: Catalogue
    kafka_timeout_s: float = KAFKA_TIMEOUT_S

    @property
    def bootstrap_servers(self) -> str:
        """The brokers' host:port list (for messages)."""
        return self.kafka.bootstrap


class StartError(RuntimeError):
    """The service cannot start; the message says what to do."""


def fail(message: str) -> NoReturn:
    """Print one line to stderr and exit with status 1."""
    typer.echo(f"fxstream-service: {message}", err=True)
    raise typer.Exit(1)


# --- where Kafka is ------------------------------------------------------------------------


def _load_connection(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except OSError as exc:
        raise StartError(
            f"cannot read {path}: {exc.strerror}; start the platform (./fx up) or pass "
            "--bootstrap and --prefix"
        ) from exc
    except ValueError as exc:
        raise StartError(f"{path} is not JSON ({exc}); run ./fx up to rewrite it") from exc
    if not isinstance(loaded, dict):
        raise StartError(f"{path} is not a platform.json object; run ./fx up to rewrite it")
    return loaded


def _from_connection(path: Path) -> tuple[str, Catalogue]:
    info = _load_connection(path)
    try:
        catalogue = Catalogue(
            prefix=str(info["topic_prefix"]),
            replication_factor=int(info["replication_factor"]),
            min_insync_replicas=int(info["min_insync_replicas"]),
        )
        return str(info["bootstrap_servers"]), catalogue
    except KeyError as exc:
        raise StartError(f"{path} has no {exc.args[0]!r}; run ./fx up to rewrite it") from exc
    except (TypeError, ValueError) as exc:
        raise StartError(f"{path} is not usable ({exc}); run ./fx up to rewrite it") from exc


def _admin(kafka: KafkaConnection) -> AdminClient:
    # Silent: a broker that does not answer is reported once, by us, in words.
    return AdminClient({**kafka.confluent(), "log_level": 0})


def _broker_count(kafka: KafkaConnection, timeout_s: float) -> int:
    try:
        metadata = _admin(kafka).list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise _unreachable(kafka.bootstrap, timeout_s) from exc
    return len(metadata.brokers)


def _unreachable(bootstrap_servers: str, timeout_s: float) -> StartError:
    return StartError(
        f"Kafka at {bootstrap_servers} does not answer within {timeout_s:g}s; "
        "start the platform with ./fx up, or fix --bootstrap (and check the credentials "
        "file named by --kafka-credentials)"
    )


def _kafka(bootstrap: str | None, credentials: Path | None) -> KafkaConnection | None:
    """The connection of ``credentials`` (its brokers overridden by ``bootstrap``), else an
    unauthenticated one to ``bootstrap``, else None."""
    if credentials is None:
        return None if bootstrap is None else KafkaConnection(bootstrap)
    try:
        kafka = KafkaConnection.from_file(credentials)
    except CredentialFileError as exc:
        raise StartError(str(exc)) from exc
    return kafka if bootstrap is None else dataclasses.replace(kafka, bootstrap=bootstrap)


def target_from(
    bootstrap: str | None,
    prefix: str | None,
    connection: Path | None,
    *,
    kafka_credentials: Path | None = None,
    kafka_timeout_s: float = KAFKA_TIMEOUT_S,
) -> Target:
    """Where to connect: ``connection`` (platform.json) gives defaults, the flags override.

    ``kafka_credentials`` names the credentials file of the principal to connect as (its
    brokers are used unless ``bootstrap`` overrides them); without it the connection is
    unauthenticated. Without a connection file the replication of new per-user and
    per-endpoint topics follows the broker count (1 broker: RF 1; 3 or more: RF 3, ISR 2).
    """
    kafka = _kafka(bootstrap, kafka_credentials)
    if connection is not None:
        servers, catalogue = _from_connection(connection)
        kafka = kafka or KafkaConnection(servers)
        try:
            catalogue = Catalogue(
                prefix=catalogue.prefix if prefix is None else prefix,
                replication_factor=catalogue.replication_factor,
                min_insync_replicas=catalogue.min_insync_replicas,
            )
        except InvalidTopicName as exc:
            raise StartError(str(exc)) from exc
        return Target(kafka, catalogue, kafka_timeout_s)
    if kafka is None:
        raise StartError(
            "say where Kafka is: --bootstrap HOST:PORT, --kafka-credentials FILE or "
            "--connection platform.json"
        )
    try:
        catalogue = Catalogue(prefix="fx." if prefix is None else prefix)
    except InvalidTopicName as exc:
        raise StartError(str(exc)) from exc
    brokers = _broker_count(kafka, kafka_timeout_s)
    return Target(kafka, catalogue.for_cluster(brokers), kafka_timeout_s)


def check_topics(target: Target, topics: Iterable[str]) -> None:
    """Fail unless Kafka answers and every one of ``topics`` exists."""
    wanted = set(topics)
    specs = {
        name: spec for name, spec in target.catalogue.static_topics().items() if name in wanted
    }
    try:
        report = ensure_topics(
            _admin(target.kafka),
            target.catalogue,
            specs,
            create=False,
            timeout_s=target.kafka_timeout_s,
        )
    except (ProvisionError, KafkaException) as exc:
        raise _unreachable(target.bootstrap_servers, target.kafka_timeout_s) from exc
    if report.missing:
        raise StartError(
            f"topics missing on {target.bootstrap_servers}: {', '.join(sorted(report.missing))}; "
            "provision them with ./fx up (and check --prefix)"
        )


def _api_topics(catalogue: Catalogue) -> list[str]:
    return [
        catalogue.users,
        catalogue.functions,
        catalogue.endpoints,
        catalogue.heartbeats,
        catalogue.task_state,
    ]


# --- serving -------------------------------------------------------------------------------


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, bound here so "port in use" is caught up front."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise StartError(f"cannot resolve --host {host!r}: {exc.strerror}") from exc
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise StartError(
            f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port, or stop "
            "what is using it"
        ) from exc
    sock.listen(2048)
    return sock


def accounts_from(
    admin_token_file: Path | None, globus_credentials: Path | None, token_lifetime_days: float
) -> Any:
    """The API's AccountSettings from the admin token and Globus credentials files."""
    from fxstream.service.api import AccountSettings

    try:
        admin_hash = None if admin_token_file is None else admin_token_sha256(admin_token_file)
        providers = (
            {} if globus_credentials is None else {"globus": globus_provider(globus_credentials)}
        )
    except (CredentialFileError, ValueError) as exc:
        raise StartError(str(exc)) from exc
    return AccountSettings(
        admin_token_sha256=admin_hash,
        token_lifetime_s=token_lifetime_days * 86400,
        identity_providers=providers,
    )


def serve(
    target: Target,
    sock: socket.socket,
    log_level: str,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    accounts: Any = None,
    metrics: str = "admin",
) -> bool:
    """Run the API with uvicorn (one worker) on ``sock``; False if it did not start."""
    # Imported here so `worker` (and every start failure) does not pay for FastAPI.
    import uvicorn

    from fxstream.service.api import create_app

    # The service's own INFO lines (its memory reports among them) go to the log as the
    # processors' do; without a handler on the root logger Python drops them.
    logging.basicConfig(
        level=logging.INFO, format="[%(asctime)s] [%(process)d] [%(levelname)s] %(message)s"
    )
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        create_app(
            target.kafka,
            target.catalogue,
            max_body_bytes=max_body_bytes,
            accounts=accounts,
            metrics=metrics,
        ),
        host=host,
        port=port,
        lifespan="on",
        log_level=log_level,
        workers=1,
    )
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    return server.started


# --- commands ------------------------------------------------------------------------------

Bootstrap = Annotated[
    str | None, typer.Option("--bootstrap", help="Kafka bootstrap servers, HOST:PORT[,...]")
]
KafkaCredentials = Annotated[
    Path | None,
    typer.Option(
        "--kafka-credentials",
        envvar=KAFKA_CREDENTIALS_ENV,
        help="the 0600 JSON credentials file of the Kafka principal to connect as "
        "(bootstrap, kafka_username, kafka_password, kafka_ca_file); none: unauthenticated",
        dir_okay=False,
    ),
]
Prefix = Annotated[
    str | None, typer.Option("--prefix", help="topic name prefix", show_default="fx.")
]


class MetricsAccess(StrEnum):
    """Who may read the API's ``GET /metrics``."""

    ADMIN = "admin"
    OPEN = "open"
    OFF = "off"


class LogLevel(StrEnum):
    """uvicorn's log levels."""

    CRITICAL = "critical"
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"
    DEBUG = "debug"


KafkaTimeout = Annotated[
    float, typer.Option("--kafka-timeout", help="seconds to wait for Kafka at start", min=0.1)
]
Connection = Annotated[
    Path | None,
    typer.Option(
        "--connection",
        help="the platform.json that ./fx up writes in its home (bootstrap, prefix, "
        "replication); --bootstrap and --prefix override it",
        dir_okay=False,
    ),
]


@app.command()
def api(
    bootstrap: Bootstrap = None,
    prefix: Prefix = None,
    connection: Connection = None,
    kafka_credentials: KafkaCredentials = None,
    kafka_timeout: KafkaTimeout = KAFKA_TIMEOUT_S,
    port: Annotated[int, typer.Option(help="port to listen on", min=1, max=65535)] = DEFAULT_PORT,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    log_level: Annotated[LogLevel, typer.Option(help="uvicorn's log level")] = LogLevel.INFO,
    max_body_bytes: Annotated[
        int,
        typer.Option(
            MAX_BODY_OPTION,
            envvar=MAX_BODY_ENV,
            help="largest request body accepted; larger ones get 413 unread",
            min=0,
        ),
    ] = DEFAULT_MAX_BODY_BYTES,
    admin_token_file: Annotated[
        Path | None,
        typer.Option(
            envvar=ADMIN_TOKEN_ENV,
            help="the platform admin's API token file (0600 JSON); without it no user can "
            "be created but through an identity provider",
            dir_okay=False,
        ),
    ] = None,
    globus_credentials: Annotated[
        Path | None,
        typer.Option(
            envvar=GLOBUS_CREDENTIALS_ENV,
            help="Globus Auth client credentials (0600 JSON): enables POST /v1/login/globus",
            dir_okay=False,
        ),
    ] = None,
    token_lifetime_days: Annotated[
        float, typer.Option(help="how long a user token lives", min=0.001)
    ] = DEFAULT_LIFETIME_DAYS,
    metrics: Annotated[
        MetricsAccess,
        typer.Option(
            "--metrics",
            envvar="FXSTREAM_API_METRICS",
            help="who may read GET /metrics: admin (the platform admin's token), open "
            "(anyone reaching the port) or off (docs/metrics.md)",
        ),
    ] = MetricsAccess.ADMIN,
) -> None:
    """Serve the REST API (docs/api.md) until SIGTERM or Ctrl-C."""
    try:
        target = target_from(
            bootstrap,
            prefix,
            connection,
            kafka_credentials=kafka_credentials,
            kafka_timeout_s=kafka_timeout,
        )
        check_topics(target, _api_topics(target.catalogue))
        accounts = accounts_from(admin_token_file, globus_credentials, token_lifetime_days)
        sock = bind(host, port)
    except StartError as exc:
        fail(str(exc))
    typer.echo(
        f"fxstream-service: API on http://{host}:{port}/v1 (Kafka {target.bootstrap_servers}, "
        f"topics {target.catalogue.prefix}*)",
        err=True,
    )
    if not serve(target, sock, log_level.value, max_body_bytes, accounts, metrics.value):
        fail("the API did not start (the log above says why); check that ./fx up succeeded")


class Processor(StrEnum):
    """The stream processors ``worker --only`` can run on their own."""

    ROUTER = "router"
    INGRESS = "ingress"
    TASK_STATE = "task-state"
    LIVENESS = "liveness"
    TRIGGER = "trigger"
    DEPENDENCIES = "dependencies"
    ANALYTICS = "analytics"


@app.command()
def worker(
    bootstrap: Bootstrap = None,
    prefix: Prefix = None,
    connection: Connection = None,
    kafka_credentials: KafkaCredentials = None,
    kafka_timeout: KafkaTimeout = KAFKA_TIMEOUT_S,
    only: Annotated[
        list[Processor] | None,
        typer.Option(
            "--only",
            help="run only this processor, in this process (repeatable); all of them by default",
        ),
    ] = None,
    placement: Annotated[
        PlacementPolicy,
        typer.Option(
            "--placement",
            envvar="FXSTREAM_PLACEMENT",
            help="how the router chooses among a task's endpoint group: warm (warmth, then "
            "backlog, data locality, a hash of the task id), backlog, round-robin or random",
        ),
    ] = PlacementPolicy.WARM,
    instance: Annotated[
        int,
        typer.Option(
            "--instance",
            min=0,
            help="this process's number among those running the same processors (0, 1, ...): "
            "several share each processor's consumer group, each with its own transactional id",
        ),
    ] = 0,
    task_retention_s: Annotated[
        float | None,
        typer.Option(
            "--task-retention-s",
            help="how long a finished task stays in task-state, in seconds (default: "
            f"${RETENTION_ENV}, else {DEFAULT_RETENTION_S:.0f}, 7 days)",
        ),
    ] = None,
    routing_keys: Annotated[
        Path | None,
        typer.Option(
            "--routing-keys",
            envvar=ROUTING_KEYS_ENV,
            help="the service's 0600 routing keys file (the router stamps dispatches, the "
            "ingress verifies results with it); `fxstream-service routing-keys FILE` makes one",
            dir_okay=False,
        ),
    ] = None,
) -> None:
    """Run the stream processors (router, ingress, task state, liveness, trigger, analytics)
    until stopped."""
    try:
        retention = retention_s(task_retention_s)
    except ValueError as exc:
        fail(str(exc))
    try:
        target = target_from(
            bootstrap,
            prefix,
            connection,
            kafka_credentials=kafka_credentials,
            kafka_timeout_s=kafka_timeout,
        )
        check_topics(target, target.catalogue.static_topics())
    except StartError as exc:
        fail(str(exc))
    roles = tuple(p.value for p in only) if only else tuple(p.value for p in Processor)
    try:
        keys = routing_keys_for(roles, routing_keys)
    except RoutingKeysUnavailable as exc:
        fail(str(exc))
    run_processors = _load_processors()
    try:
        run_processors(
            target.kafka,
            target.catalogue,
            roles=roles,
            placement=placement,
            instance=instance,
            task_retention_s=retention,
            routing_keys=keys,
        )
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


@app.command("routing-keys")
def routing_keys_command(
    file: Annotated[
        Path,
        typer.Argument(
            help="the routing keys file (made 0600 if it does not exist)", dir_okay=False
        ),
    ],
    rotate: Annotated[
        bool,
        typer.Option(
            "--rotate",
            help="add a new signing key; the current keys are still accepted. The routers "
            "and the ingresses re-read the file within about a second, in any order (an "
            "ingress handed a stamp under a key it does not hold re-reads it first): no "
            "restart",
        ),
    ] = False,
    retire: Annotated[
        str | None,
        typer.Option(
            "--retire",
            metavar="KEY_ID",
            help="stop accepting a key that no longer signs, only once no task routed "
            "under it is queued or running (their results would be refused); the ingresses "
            "re-read the file within about a second",
        ),
    ] = None,
) -> None:
    """Make, rotate or retire the service's routing keys (their ids are shown, never the keys).

    Without options: make FILE with one new random key unless it exists, and show its keys.
    The file is replaced whole (renamed into place); running routers and ingresses re-read
    it within about a second.
    """
    try:
        keys = ensure_routing_keys(file)
        if rotate:
            keys = keys.rotated()
            write_routing_keys(file, keys)
        if retire is not None:
            keys = _retired(keys, retire)
            write_routing_keys(file, keys)
    except (CredentialFileError, ValueError) as exc:
        fail(str(exc))
    retired = ", ".join(k.key_id for k in keys.retired) or "none"
    typer.echo(f"{file}: signing key {keys.signing.key_id}; also accepted: {retired}")


def _retired(keys: RoutingKeys, key_id: str) -> RoutingKeys:
    """``keys`` without the accepted-only key ``key_id`` (the signing key cannot be retired)."""
    if key_id == keys.signing.key_id:
        raise ValueError(
            f"key {key_id} signs the dispatches: rotate first (--rotate; the routers sign "
            "with the new key within about a second), and retire it once no task routed "
            "under it is queued or running"
        )
    kept: tuple[RoutingKey, ...] = tuple(k for k in keys.retired if k.key_id != key_id)
    if len(kept) == len(keys.retired):
        raise ValueError(f"no key {key_id!r} to retire; the keys are {', '.join(keys.key_ids)}")
    return RoutingKeys(keys.signing, kept)


def _load_processors() -> Callable[..., None]:
    # Imported here, not at the top: the processors are their own module with heavier
    # dependencies, and the API must start without them.
    try:
        module = importlib.import_module("fxstream.service.processors")
    except ImportError as exc:
        fail(f"the stream processors are not available in this install ({exc})")
    run: Callable[..., None] | None = getattr(module, "run_processors", None)
    if run is None:
        fail("fxstream.service.processors has no run_processors; reinstall fxstream-service")
    return run


def main() -> None:
    """Entry point of the ``fxstream-service`` script."""
    app()
