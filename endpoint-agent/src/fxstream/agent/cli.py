"""``fxstream-endpoint``: configure, start, stop and list endpoints on this machine."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import httpx
import psutil
import typer
from rich.console import Console
from rich.table import Table

from fxstream.agent.agent import Agent
from fxstream.agent.config import ConfigError, EndpointConfig, endpoint_dir, endpoints_root
from fxstream.agent.credentials import EndpointCredentials
from fxstream.agent.environment import protect_memory, reexec_without_secrets, scrubbed
from fxstream.connectors import DEFAULT_PROXY_THRESHOLD_BYTES
from fxstream.topics.connection import CredentialFileError, KafkaConnection

__all__ = ["app", "issued_credentials", "main", "register_endpoint"]

app = typer.Typer(help="Run fxstream endpoints on this machine.", no_args_is_help=True)
console = Console(soft_wrap=True)

READY_LINE = "endpoint ready"


def register_endpoint(
    service_url: str,
    token: str,
    name: str,
    *,
    public: bool = False,
    allowed_users: list[str] | None = None,
    metadata: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Register an endpoint with the service as its owner (``token``); the service's answer.

    The answer holds ``endpoint_id`` and what the service issues the endpoint (its API
    ``token`` and Kafka principal ``kafka_username`` / ``kafka_password``, once it does).
    """
    response = httpx.post(
        f"{service_url}/v1/endpoints",
        headers={"Authorization": f"Bearer {token}"},
        json={
            "name": name,
            "public": public,
            "allowed_users": allowed_users or [],
            "description": "",
            "metadata": metadata or {},
        },
        timeout=30,
    )
    if response.status_code != 201:
        detail = response.json().get("detail", response.text) if response.content else ""
        raise ConfigError(f"the service refused to register endpoint {name!r}: {detail}")
    issued: dict[str, Any] = response.json()
    return issued


def issued_credentials(
    endpoint_id: str,
    issued: dict[str, Any],
    *,
    kafka: KafkaConnection,
    owner_token: str | None,
    warn: Callable[[str], None],
) -> EndpointCredentials:
    """The endpoint's credential from what the service issued at registration.

    ``kafka`` is the connection to use when the service issued no Kafka principal (the
    insecure development platform, or one given with ``--kafka-credentials``). When the
    service issued no API token for the endpoint the owner's is used, with a warning:
    then a task on the endpoint can read its owner's token from the credentials file.
    """
    username, password = issued.get("kafka_username"), issued.get("kafka_password")
    if isinstance(username, str) and isinstance(password, str):
        if kafka.ca_file is None:
            raise ConfigError(
                f"the service issued endpoint {endpoint_id} the Kafka principal {username!r} "
                "but no CA certificate is known: pass --kafka-credentials FILE (a credentials "
                "file of this platform, for its kafka_ca_file)"
            )
        kafka = kafka.as_user(username, password)
    token = issued.get("token")
    if not isinstance(token, str) or not token:
        if not owner_token:
            raise ConfigError(
                f"no API token for endpoint {endpoint_id}: the service issued none; pass "
                "--credentials FILE (the endpoint's credential) or set FXSTREAM_TOKEN"
            )
        warn(
            f"the service issued endpoint {endpoint_id} no API token of its own, so the agent "
            "uses its owner's (FXSTREAM_TOKEN), kept in the endpoint's 0600 credentials "
            "file. Tasks run as the same OS user can read that file: do not let other users "
            "run tasks on this endpoint"
        )
        token = owner_token
    return EndpointCredentials(endpoint_id, kafka, token)


def _fail(message: str) -> typer.Exit:
    console.print(f"[red]{message}[/red]")
    return typer.Exit(1)


def _pid_file(name: str) -> Path:
    return endpoint_dir(name) / "endpoint.pid"


def _log_file(name: str) -> Path:
    return endpoint_dir(name) / "endpoint.log"


def _running_pid(name: str) -> int | None:
    """The PID of the agent serving ``name``, checked against its recorded start time."""
    # No file, a malformed one, or a process that is gone: all mean "not running".
    with contextlib.suppress(OSError, ValueError, psutil.Error):
        pid_text, started = _pid_file(name).read_text().split()
        process = psutil.Process(int(pid_text))
        if process.create_time() == float(started) and process.is_running():
            return process.pid
    return None


@app.command()
def configure(
    name: str,
    service_url: Annotated[str, typer.Option(help="The service's REST API.")],
    bootstrap: Annotated[
        str | None,
        typer.Option(help="Kafka bootstrap servers (taken from --credentials if given)."),
    ] = None,
    credentials: Annotated[
        Path | None,
        typer.Option(
            help=(
                "The endpoint's credential: a 0600 JSON file (endpoint_id, token, bootstrap, "
                "kafka_username, kafka_password, kafka_ca_file). Without it the endpoint is "
                "registered with its owner's token, read from FXSTREAM_TOKEN."
            )
        ),
    ] = None,
    kafka_credentials: Annotated[
        Path | None,
        typer.Option(
            help="A 0600 credentials file naming the brokers, CA (and principal) to use when "
            "the service issues the endpoint no Kafka principal."
        ),
    ] = None,
    endpoint_id: Annotated[
        str | None, typer.Option(help="An existing endpoint id; registered if omitted.")
    ] = None,
    public: Annotated[
        bool, typer.Option(help="Registering: every user may run tasks on the endpoint.")
    ] = False,
    allowed_user: Annotated[
        list[str] | None,
        typer.Option(help="Registering: a user id that may run tasks on it (repeat it)."),
    ] = None,
    prefix: Annotated[str, typer.Option(help="Topic prefix.")] = "fx.",
    workers: Annotated[int, typer.Option(help="Warm worker processes.")] = 2,
    prefetch: Annotated[int, typer.Option(help="Tasks fetched beyond idle workers.")] = 16,
    heartbeat_period: Annotated[float, typer.Option(help="Seconds between heartbeats.")] = 5.0,
    store_url: Annotated[
        str | None,
        typer.Option(help="Proxy store for large results (redis://HOST:PORT or file:///DIR)."),
    ] = None,
    proxy_threshold: Annotated[
        int, typer.Option(help="Results above this many bytes go to the proxy store.")
    ] = DEFAULT_PROXY_THRESHOLD_BYTES,
    allow_function: Annotated[
        list[str] | None,
        typer.Option(help="Run only these function ids (repeat it; default: any function)."),
    ] = None,
    allow_serializer: Annotated[
        list[str] | None,
        typer.Option(
            help="Accept only arguments of these data strategies, e.g. json (repeat it; "
            "default: any)."
        ),
    ] = None,
) -> None:
    """Write the endpoint's YAML config and its 0600 credentials file (registering the
    endpoint with the service if needed). No secret is taken on the command line: the
    owner's token, needed only to register, comes from FXSTREAM_TOKEN."""
    owner_token = os.environ.get("FXSTREAM_TOKEN") or None
    try:
        settings = dict(
            name=name,
            service_url=service_url,
            topic_prefix=prefix,
            workers=workers,
            prefetch=prefetch,
            heartbeat_period_s=heartbeat_period,
            store_url=store_url,
            proxy_threshold=proxy_threshold,
            allowed_functions=tuple(allow_function or ()),
            allowed_serializers=tuple(allow_serializer or ()),
        )
        if credentials is not None:
            given = EndpointCredentials.load(credentials.expanduser().resolve())
            if endpoint_id is not None and endpoint_id != given.endpoint_id:
                raise ConfigError(
                    f"{credentials} is the credential of endpoint {given.endpoint_id}, not "
                    f"{endpoint_id}"
                )
            config = EndpointConfig(
                endpoint_id=given.endpoint_id,
                credentials_file=str(credentials.expanduser().resolve()),
                **settings,  # type: ignore[arg-type]
            )
            config.validate()
        else:
            kafka = _kafka(bootstrap, kafka_credentials)
            EndpointConfig(endpoint_id="-", **settings).validate()  # type: ignore[arg-type]
            issued: dict[str, Any] = {}
            if endpoint_id is None:
                if owner_token is None:
                    raise ConfigError(
                        "registering an endpoint needs its owner's API token: set "
                        "FXSTREAM_TOKEN (never on the command line), or pass --credentials "
                        "FILE with the endpoint's credential"
                    )
                issued = register_endpoint(
                    service_url,
                    owner_token,
                    name,
                    public=public,
                    allowed_users=list(allowed_user or ()),
                )
                endpoint_id = str(issued["endpoint_id"])
            config = EndpointConfig(endpoint_id=endpoint_id, **settings)  # type: ignore[arg-type]
            endpoint_credentials = _kept_credentials(config, kafka) or issued_credentials(
                endpoint_id, issued, kafka=kafka, owner_token=owner_token, warn=_warn
            )
            endpoint_credentials.save(config.credentials_path)
        path = config.save()
    except (ConfigError, CredentialFileError, ValueError, httpx.HTTPError) as exc:
        raise _fail(f"cannot configure endpoint {name!r}: {exc}") from exc
    console.print(f"endpoint {name!r} ({config.endpoint_id}) configured in {path}")
    console.print(f"its credential: {config.credentials_path} (mode 600)")
    console.print(f"start it with: fxstream-endpoint start {name}")


def _warn(message: str) -> None:
    console.print(f"[yellow]warning: {message}[/yellow]")


def _kafka(bootstrap: str | None, kafka_credentials: Path | None) -> KafkaConnection:
    """The brokers (and CA, and principal) to reach when the service issues none."""
    if kafka_credentials is not None:
        connection = KafkaConnection.from_file(kafka_credentials.expanduser())
        if bootstrap is None or bootstrap == connection.bootstrap:
            return connection
        return dataclasses.replace(connection, bootstrap=bootstrap)
    if bootstrap is None:
        raise ConfigError("--bootstrap HOST:PORT is needed (or --credentials FILE)")
    return KafkaConnection(bootstrap)


def _kept_credentials(config: EndpointConfig, kafka: KafkaConnection) -> EndpointCredentials | None:
    """The endpoint's credential already on file, when it is this endpoint's and its
    brokers have not changed (configuring again keeps it)."""
    try:
        kept = EndpointCredentials.load(config.credentials_path)
    except CredentialFileError:
        return None
    if kept.endpoint_id != config.endpoint_id or kept.kafka.bootstrap != kafka.bootstrap:
        return None
    return kept


@app.command()
def start(
    name: str,
    daemon: Annotated[bool, typer.Option("--daemon", help="Run in the background.")] = False,
) -> None:
    """Serve the endpoint (in the foreground unless --daemon)."""
    try:
        config = EndpointConfig.load(name)
    except ConfigError as exc:
        raise _fail(str(exc)) from exc
    if _running_pid(name) is not None:
        console.print(f"endpoint {name!r} already runs (pid {_running_pid(name)})")
        return
    if daemon:
        _start_daemon(name)
    else:
        # Workers inherit the agent's environment: start again (same PID) without any
        # variable that looks secret, so neither they nor /proc/<pid>/environ show one.
        reexec_without_secrets([sys.executable, "-m", "fxstream.agent.cli", "start", name])
        _serve(config)


def _serve(config: EndpointConfig) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # No process of this user (a task included) may read this one's memory.
    if not protect_memory():
        logging.getLogger(__name__).warning(
            "cannot make the agent non-dumpable here: tasks may read its memory"
        )
    agent = Agent(config)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    pid_file = _pid_file(config.name)
    started = psutil.Process(os.getpid()).create_time()
    pid_file.write_text(f"{os.getpid()} {started!r}\n")

    def ready() -> None:
        print(f"{READY_LINE}: {config.name} ({config.endpoint_id}), pid {os.getpid()}", flush=True)

    try:
        agent.run(ready=ready)
    finally:
        pid_file.unlink(missing_ok=True)


def _start_daemon(name: str, timeout_s: float = 60.0) -> None:
    log_file = _log_file(name)
    log_file.touch()
    start_at = log_file.stat().st_size
    with log_file.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "fxstream.agent.cli", "start", name],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=scrubbed(os.environ),
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-20:])
            raise _fail(f"endpoint {name!r} failed to start; the end of {log_file}:\n{tail}")
        if READY_LINE in _read_from(log_file, start_at):
            console.print(f"endpoint {name!r} runs in the background (pid {process.pid})")
            console.print(f"log: {log_file}; stop it with: fxstream-endpoint stop {name}")
            return
        time.sleep(0.2)
    raise _fail(f"endpoint {name!r} did not become ready in {timeout_s:.0f}s; see {log_file}")


def _read_from(path: Path, offset: int) -> str:
    with path.open("rb") as handle:
        handle.seek(offset)
        return handle.read().decode(errors="replace")


@app.command()
def stop(name: str, timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 60) -> None:
    """Stop a running endpoint by PID; it finishes the tasks it holds first."""
    pid = _running_pid(name)
    if pid is None:
        console.print(f"endpoint {name!r} is not running")
        return
    process = psutil.Process(pid)
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except psutil.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
    _pid_file(name).unlink(missing_ok=True)
    console.print(f"stopped endpoint {name!r} (pid {pid})")


@app.command("list")
def list_endpoints() -> None:
    """The endpoints configured on this machine and whether each runs."""
    table = Table(title=f"endpoints in {endpoints_root()}")
    for column in ("name", "endpoint id", "state", "pid"):
        table.add_column(column)
    root = endpoints_root()
    for directory in sorted(root.iterdir()) if root.is_dir() else []:
        if not (directory / "config.yaml").is_file():
            continue
        try:
            config = EndpointConfig.load(directory.name)
        except ConfigError as exc:
            table.add_row(directory.name, "-", f"[red]{exc}[/red]", "-")
            continue
        pid = _running_pid(directory.name)
        state = "[green]running[/green]" if pid else "stopped"
        table.add_row(config.name, config.endpoint_id, state, str(pid or "-"))
    console.print(table)


def main() -> None:
    """Entry point of ``fxstream-endpoint``."""
    app()


if __name__ == "__main__":
    main()
