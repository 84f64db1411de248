"""``fxstream-endpoint``: configure, start, stop, list and diagnose endpoints on this machine.

The agent itself (:class:`~fxstream.agent.agent.Agent`, its Kafka clients) is imported
only by ``start``: ``configure``, ``stop`` and ``list`` start faster without it, and so
do the agent's worker processes, which import this module as their ``__main__``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import httpx
import msgspec
import psutil
import typer
import yaml
from rich.console import Console
from rich.table import Table

from fxstream.agent.batch_settings import BatchSettings, BatchSettingsError, MpiSettings
from fxstream.agent.config import ConfigError, EndpointConfig, endpoint_dir, endpoints_root
from fxstream.agent.credentials import EndpointCredentials
from fxstream.agent.environment import protect_memory, reexec_without_secrets, scrubbed
from fxstream.agent.image_pools import DEFAULT_POOL_IDLE_S
from fxstream.agent.pick import DEFAULT_MAX_IMAGE_WAIT_S
from fxstream.agent.python_envs import PythonEnvironmentError
from fxstream.agent.staging import GlobusStaging, StagingSettings
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

    A Kafka principal the service issued (``kafka_username``, ``kafka_password``) is kept
    with the brokers and CA certificate of ``kafka`` (the endpoint's configured
    connection). When the service issued the endpoint no API token of its own, its
    owner's is used, with a warning: a task on the endpoint could then read its owner's
    token from the credentials file.
    """
    principal = None
    username, password = issued.get("kafka_username"), issued.get("kafka_password")
    if isinstance(username, str) and isinstance(password, str):
        if kafka.ca_file is None:
            raise ConfigError(
                f"the service issued endpoint {endpoint_id} the Kafka principal {username!r} "
                "but the platform's CA certificate is not known: pass --kafka-ca-file FILE "
                "(the platform home's pki/ca.pem, or the kafka_ca_file of a credentials file "
                "of this platform)"
            )
        principal = kafka.as_user(username, password)
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
    return EndpointCredentials(endpoint_id, token, principal)


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


def _yaml_section(path: Path, section: str) -> dict[str, Any]:
    """The mapping in the YAML file ``path`` given as ``--<section>``: the whole file, or
    its ``<section>:`` key; ``ConfigError`` naming the option otherwise."""
    try:
        raw: Any = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--{section} {path}: {exc}") from None
    if isinstance(raw, dict) and isinstance(raw.get(section), dict):
        raw = raw[section]
    if not isinstance(raw, dict):
        raise ConfigError(f"--{section} {path} must hold a mapping of {section} settings")
    return raw


def _batch_settings(path: Path) -> BatchSettings:
    """The batch settings in the YAML file ``path`` (its mapping, or its ``batch:`` key)."""
    raw = _yaml_section(path, "batch")
    known = {f.name for f in dataclasses.fields(BatchSettings)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"--batch {path}: unknown batch setting(s) {sorted(unknown)}")
    try:
        if raw.get("mpi") is not None:  # msgspec would drop its unknown keys silently
            MpiSettings.from_mapping(raw["mpi"])
    except (BatchSettingsError, TypeError) as exc:
        raise ConfigError(f"--batch {path}: {exc}") from None
    try:
        return msgspec.convert(raw, BatchSettings)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"--batch {path}: {exc}") from None


def _staging_settings(path: Path) -> StagingSettings:
    """The staging settings in the YAML file ``path`` (its mapping, or its ``staging:`` key)."""
    raw = _yaml_section(path, "staging")
    unknown = set(raw) - {f.name for f in dataclasses.fields(StagingSettings)}
    globus = raw.get("globus")
    if isinstance(globus, dict):
        known = {f.name for f in dataclasses.fields(GlobusStaging)}
        unknown |= {f"globus.{name}" for name in set(globus) - known}
    if unknown:
        raise ConfigError(f"--staging {path}: unknown staging setting(s) {sorted(unknown)}")
    try:
        return msgspec.convert(raw, StagingSettings)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"--staging {path}: {exc}") from None


@app.command()
def configure(
    name: str,
    service_url: Annotated[str, typer.Option(help="The service's REST API.")],
    bootstrap: Annotated[str, typer.Option(help="Kafka bootstrap servers.")],
    credentials: Annotated[
        Path | None,
        typer.Option(
            help=(
                "The endpoint's own credential: a 0600 JSON file (endpoint_id, token, and "
                "the Kafka principal the service issued it, if any). Without it the "
                "endpoint is registered with its owner's token, read from FXSTREAM_TOKEN, "
                "and the credential the service issues is written beside the config."
            ),
            dir_okay=False,
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
    kafka_credentials: Annotated[
        Path | None,
        typer.Option(
            help="The endpoint's Kafka credentials file (0600 JSON: kafka_username, "
            "kafka_password, kafka_ca_file); its path goes in the config, never the secret. "
            "Omit on the insecure development platform, or when the service issues the "
            "endpoint its Kafka principal.",
            envvar="FXSTREAM_KAFKA_CREDENTIALS",
            dir_okay=False,
        ),
    ] = None,
    kafka_ca_file: Annotated[
        Path | None,
        typer.Option(
            help="The platform's CA certificate (its home's pki/ca.pem): the agent verifies "
            "the brokers with it when it connects as the Kafka principal the service issues "
            "the endpoint at registration.",
            envvar="FXSTREAM_KAFKA_CA_FILE",
            dir_okay=False,
            exists=True,
        ),
    ] = None,
    workers: Annotated[int, typer.Option(help="Warm worker processes.")] = 2,
    prefetch: Annotated[int, typer.Option(help="Tasks fetched beyond idle workers.")] = 16,
    heartbeat_period: Annotated[float, typer.Option(help="Seconds between heartbeats.")] = 5.0,
    store_url: Annotated[
        str | None,
        typer.Option(
            help="Proxy store for large results (redis://USER:PASSWORD@HOST:PORT or "
            "file:///DIR). A Redis URL holds a password: pass it in the environment.",
            envvar="FXSTREAM_STORE_URL",
        ),
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
    runtime: Annotated[
        str,
        typer.Option(
            help="The container runtime the workers run in: process (none), bubblewrap, "
            "podman, docker or apptainer."
        ),
    ] = "process",
    allow_image: Annotated[
        list[str] | None,
        typer.Option(
            help="An image the endpoint allows, NAME=RUNTIME:REFERENCE, e.g. "
            "worker=bubblewrap:/ (repeat it; `fxstream-endpoint image` builds one)."
        ),
    ] = None,
    image: Annotated[
        str | None, typer.Option(help="The allowed image (its NAME) the workers run in.")
    ] = None,
    writable_dir: Annotated[
        list[str] | None,
        typer.Option(help="A host directory the workers may write (repeat it)."),
    ] = None,
    pool_idle: Annotated[
        float,
        typer.Option(
            help="Seconds an image's pool (not the default image's) may sit idle before "
            "its workers stop."
        ),
    ] = DEFAULT_POOL_IDLE_S,
    max_workers: Annotated[
        int | None,
        typer.Option(
            help="The most workers across the image pools (default: --workers per image); "
            "beyond it the least recently used idle pool is released."
        ),
    ] = None,
    max_image_wait: Annotated[
        float,
        typer.Option(
            help="With fewer pools than images (--max-workers), tasks of images whose "
            "pools run go first; an image's oldest task passed over this many seconds "
            "gets its turn (a pool released for it)."
        ),
    ] = DEFAULT_MAX_IMAGE_WAIT_S,
    interpreter: Annotated[
        list[str] | None,
        typer.Option(
            help="Another Python interpreter the workers may run, for tasks submitted from "
            "its version: the absolute path of a virtualenv's python with fxstream-agent "
            "installed (repeat it)."
        ),
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            help="process (warm workers beside the agent) or htex (Parsl's "
            "HighThroughputExecutor on a batch scheduler's blocks: see --batch)."
        ),
    ] = "process",
    batch: Annotated[
        Path | None,
        typer.Option(
            help="With --engine htex: a YAML file holding the batch settings (provider, "
            "partition or queue, walltime, blocks, ...; see docs/hpc.md)."
        ),
    ] = None,
    staging: Annotated[
        Path | None,
        typer.Option(
            help="A YAML file holding the staging settings (work_dir, roots, slots, "
            "timeout_s, globus; see docs/hpc.md, 'Staging'): the endpoint then stages the "
            "files tasks declare (stage_in, stage_out)."
        ),
    ] = None,
) -> None:
    """Write the endpoint's YAML config and its 0600 credentials file (registering the
    endpoint with the service if needed). No secret is taken on the command line: the
    owner's token, needed only to register, comes from FXSTREAM_TOKEN."""
    owner_token = os.environ.get("FXSTREAM_TOKEN") or None
    try:
        settings: dict[str, Any] = {
            "name": name,
            "service_url": service_url,
            "bootstrap_servers": bootstrap,
            "kafka_credentials": None
            if kafka_credentials is None
            else str(kafka_credentials.absolute()),
            "topic_prefix": prefix,
            "workers": workers,
            "prefetch": prefetch,
            "heartbeat_period_s": heartbeat_period,
            "store_url": store_url,
            "proxy_threshold": proxy_threshold,
            "allowed_functions": tuple(allow_function or ()),
            "allowed_serializers": tuple(allow_serializer or ()),
            "runtime": runtime,
            "image": image,
            "images": _images(allow_image or ()),
            "writable_dirs": tuple(writable_dir or ()),
            "pool_idle_s": pool_idle,
            "max_workers": max_workers,
            "max_image_wait_s": max_image_wait,
            "interpreters": tuple(interpreter or ()),
            "engine": engine,
            "batch": None if batch is None else _batch_settings(batch),
            "staging": None if staging is None else _staging_settings(staging),
        }
        if credentials is not None:
            path = credentials.expanduser().absolute()
            given = EndpointCredentials.load(path)
            if endpoint_id is not None and endpoint_id != given.endpoint_id:
                raise ConfigError(
                    f"{credentials} is the credential of endpoint {given.endpoint_id}, not "
                    f"{endpoint_id}"
                )
            config = EndpointConfig(
                endpoint_id=given.endpoint_id, credentials_file=str(path), **settings
            )
            config.validate()
        else:
            EndpointConfig(endpoint_id="-", **settings).validate()
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
            if issued.get("kafka_username") and settings["kafka_credentials"] is not None:
                # The endpoint's own principal: kafka_credentials, which config.kafka()
                # prefers, would have its agents connect as another one (its CA is used).
                _warn(
                    f"the service issued endpoint {endpoint_id} its own Kafka principal "
                    f"{issued['kafka_username']!r}: its agents connect as it, not as the "
                    f"principal of {kafka_credentials} (only that file's CA certificate is used)"
                )
                settings["kafka_credentials"] = None
                if kafka_ca_file is None:
                    assert kafka_credentials is not None
                    kafka_ca_file = KafkaConnection.from_file(kafka_credentials).ca_file
            config = EndpointConfig(endpoint_id=endpoint_id, **settings)
            # The brokers (and CA) the issued principal is used with; not config.kafka(),
            # which would read a credentials file left by an endpoint registered before.
            kafka = (
                config.kafka()
                if config.kafka_credentials is not None
                else KafkaConnection(config.bootstrap_servers)
            )
            if kafka_ca_file is not None:
                kafka = dataclasses.replace(kafka, ca_file=kafka_ca_file.absolute())
            endpoint_credentials = _kept_credentials(config, issued) or issued_credentials(
                endpoint_id,
                issued,
                kafka=kafka,
                owner_token=owner_token,
                warn=_warn,
            )
            endpoint_credentials.save(config.credentials_path)
        path = config.save()
    except (ConfigError, CredentialFileError, ValueError, httpx.HTTPError) as exc:
        raise _fail(f"cannot configure endpoint {name!r}: {exc}") from exc
    console.print(f"endpoint {name!r} ({config.endpoint_id}) configured in {path}")
    console.print(f"its credential: {config.credentials_path} (mode 600)")
    console.print(f"start it with: fxstream-endpoint start {name}")


def _images(entries: Sequence[str]) -> dict[str, str]:
    images: dict[str, str] = {}
    for entry in entries:
        name, sep, spec = entry.partition("=")
        if not sep or not name or not spec:
            raise _fail(f"--allow-image {entry!r}: write it as NAME=RUNTIME:REFERENCE")
        images[name] = spec
    return images


@app.command("image")
def build_image(
    destination: Annotated[
        Path, typer.Argument(help="The directory to build the worker rootfs in.")
    ],
    podman: Annotated[bool, typer.Option(help="Also import it as a local podman image.")] = False,
    docker: Annotated[
        bool, typer.Option(help="Also import it as a local Docker image (a daemon must answer).")
    ] = False,
) -> None:
    """Build a worker image on this machine, from its own files (nothing is pulled): a
    minimal rootfs directory (for bubblewrap and apptainer) and, if asked, a local OCI
    image made from it; prints the config entries that allow them."""
    from fxstream.agent.containers import ContainerError
    from fxstream.agent.images import build_podman_image, build_rootfs

    try:
        rootfs = build_rootfs(destination)
        console.print(f"rootfs: {rootfs}")
        console.print(f"  --allow-image worker=bubblewrap:{rootfs}")
        for wanted, binary in ((podman, "podman"), (docker, "docker")):
            if wanted:
                tag = build_podman_image(rootfs, binary=binary)
                console.print(f"{binary} image: {tag}")
                console.print(f"  --allow-image worker-{binary}={binary}:{tag}")
    except (ContainerError, OSError) as exc:
        raise _fail(f"cannot build the image: {exc}") from exc


def _warn(message: str) -> None:
    console.print(f"[yellow]warning: {message}[/yellow]")


def _kept_credentials(config: EndpointConfig, issued: dict[str, Any]) -> EndpointCredentials | None:
    """The endpoint's credential already on file, when nothing new was issued and it is
    this endpoint's (configuring an endpoint again keeps its credential)."""
    if issued:
        return None
    try:
        kept = EndpointCredentials.load(config.credentials_path)
    except CredentialFileError:
        return None
    return kept if kept.endpoint_id == config.endpoint_id else None


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
    from fxstream.agent.agent import Agent

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # No process of this user (a task included) may read this one's memory.
    if not protect_memory():
        logging.getLogger(__name__).warning(
            "cannot make the agent non-dumpable here: tasks may read its memory"
        )
    agent = Agent(config)
    # The whole process's log reaches the endpoint's owner (GET /v1/endpoints/{id}/logs).
    logging.getLogger().addHandler(agent.log_shipper)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    pid_file = _pid_file(config.name)
    started = psutil.Process(os.getpid()).create_time()
    pid_file.write_text(f"{os.getpid()} {started!r}\n")

    def ready() -> None:
        print(f"{READY_LINE}: {config.name} ({config.endpoint_id}), pid {os.getpid()}", flush=True)

    try:
        agent.run(ready=ready)
    except PythonEnvironmentError as exc:
        raise _fail(f"endpoint {config.name!r} cannot start: {exc}") from exc
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


@app.command()
def diagnose(
    name: str,
    bundle_dir: Annotated[
        Path | None,
        typer.Option("--bundle", help="Also write a tar.gz (report, config, logs) there."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each service.")] = 10.0,
) -> None:
    """Check this host can serve endpoint NAME: config, credential, service, Kafka,
    container runtime, scheduler, disk (exit 1 if any check fails)."""
    from fxstream.agent.diagnose import bundle
    from fxstream.agent.diagnose import diagnose as run_checks

    try:
        config = EndpointConfig.load(name)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    checks = run_checks(config, timeout_s=timeout)
    table = Table(title=f"endpoint {name!r} ({config.endpoint_id}) on this host")
    for column in ("check", "status", "found", "what to do"):
        table.add_column(column)
    colours = {"ok": "green", "warn": "yellow", "fail": "red"}
    for check in checks:
        status = f"[{colours[check.status]}]{check.status}[/{colours[check.status]}]"
        table.add_row(check.name, status, check.detail, check.remedy)
    console.print(table)
    if bundle_dir is not None:
        bundle_dir.mkdir(parents=True, exist_ok=True)
        console.print(f"bundle (no credential in it): {bundle(config, checks, bundle_dir)}")
    if any(check.status == "fail" for check in checks):
        raise typer.Exit(1)


def main() -> None:
    """Entry point of ``fxstream-endpoint``."""
    app()


if __name__ == "__main__":
    main()
