"""``fxstream-endpoint``: configure, start, stop and list endpoints on this machine."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import httpx
import psutil
import typer
from rich.console import Console
from rich.table import Table

from fxstream.agent.agent import Agent
from fxstream.agent.config import ConfigError, EndpointConfig, endpoint_dir, endpoints_root
from fxstream.connectors import DEFAULT_PROXY_THRESHOLD_BYTES

__all__ = ["app", "main", "register_endpoint"]

app = typer.Typer(help="Run fxstream endpoints on this machine.", no_args_is_help=True)
console = Console(soft_wrap=True)

READY_LINE = "endpoint ready"


def register_endpoint(service_url: str, token: str, name: str) -> str:
    """Register an endpoint with the service and return its id."""
    response = httpx.post(
        f"{service_url}/v1/endpoints",
        headers={"Authorization": f"Bearer {token}"},
        json={
            "name": name,
            "public": False,
            "allowed_users": [],
            "description": "",
            "metadata": {},
        },
        timeout=30,
    )
    if response.status_code != 201:
        detail = response.json().get("detail", response.text) if response.content else ""
        raise ConfigError(f"the service refused to register endpoint {name!r}: {detail}")
    endpoint_id: str = response.json()["endpoint_id"]
    return endpoint_id


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
    bootstrap: Annotated[str, typer.Option(help="Kafka bootstrap servers.")],
    token: Annotated[str, typer.Option(help="The owner's API token.", envvar="FXSTREAM_TOKEN")],
    endpoint_id: Annotated[
        str | None, typer.Option(help="An existing endpoint id; registered if omitted.")
    ] = None,
    prefix: Annotated[str, typer.Option(help="Topic prefix.")] = "fx.",
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
) -> None:
    """Write the endpoint's YAML config (registering the endpoint with the service if needed)."""
    try:
        if endpoint_id is None:
            endpoint_id = register_endpoint(service_url, token, name)
        config = EndpointConfig(
            name=name,
            endpoint_id=endpoint_id,
            service_url=service_url,
            bootstrap_servers=bootstrap,
            token=token,
            topic_prefix=prefix,
            workers=workers,
            prefetch=prefetch,
            heartbeat_period_s=heartbeat_period,
            store_url=store_url,
            proxy_threshold=proxy_threshold,
        )
        path = config.save()
    except (ConfigError, httpx.HTTPError) as exc:
        raise _fail(f"cannot configure endpoint {name!r}: {exc}") from exc
    console.print(f"endpoint {name!r} ({endpoint_id}) configured in {path}")
    console.print(f"start it with: fxstream-endpoint start {name}")


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
        _serve(config)


def _serve(config: EndpointConfig) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
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
