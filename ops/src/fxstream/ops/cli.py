"""The ``fxstream`` command line (``./fx`` runs it): up, down, status, test, bench."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, NoReturn, Protocol

import typer
from rich.console import Console
from rich.table import Table

from fxstream.ops.config import MAX_INSTANCES, ConfigError, PlatformConfig, repo_root
from fxstream.ops.install import InstallError, ensure_requirements
from fxstream.ops.platform import Platform, PlatformError, PlatformStatus
from fxstream.ops.process import ProcessStartError
from fxstream.topics import CredentialFileError, KafkaConnection, ProvisionError

__all__ = ["app", "main"]

app = typer.Typer(
    help="fxstream: a federated function-as-a-service on Apache Kafka.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks: each prints a table and, last, one JSON line.")
app.add_typer(bench_app, name="bench")
user_app = typer.Typer(help="Users of the platform (the platform admin's commands).")
app.add_typer(user_app, name="user")
demo_app = typer.Typer(help="Demonstrations on the running platform (./fx up first).")
app.add_typer(demo_app, name="demo")

console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

# The Python packages whose style and types `fxstream test` checks before the tests run.
PACKAGE_DIRS = ("topics", "service", "endpoint-agent", "stream-sdk", "connectors", "ops")


def _config() -> PlatformConfig:
    try:
        return PlatformConfig.load()
    except ConfigError as exc:
        err.print(f"[red]configuration error:[/red] {exc}")
        raise typer.Exit(2) from exc


def _print_status(status: PlatformStatus) -> None:
    table = Table(title=f"fxstream platform ({status.mode or 'stopped'})")
    for column in ("component", "address", "pid", "restarts", "health", "metrics"):
        table.add_column(column)
    for c in status.components:
        health = "[green]healthy[/green]" if c.healthy else f"[red]{c.detail or 'unhealthy'}[/red]"
        restarts = "-"
        if c.restarts:
            when = time.strftime("%H:%M:%S", time.localtime(c.last_restart_at or 0))
            restarts = f"{c.restarts} (last {when}, exit code {c.last_exit_code})"
        # The port: every metrics address is http://127.0.0.1:<port>/metrics.
        metrics = c.metrics_url.removeprefix("http://127.0.0.1").removesuffix("/metrics") or "-"
        table.add_row(c.name, c.address, str(c.pid or "-"), restarts, health, metrics)
    console.print(table)
    if status.metrics is not None:
        for line in status.metrics.lines():
            console.print(line, highlight=False)
    if status.metrics_error:
        console.print(f"[yellow]{status.metrics_error}[/yellow]")
    if status.topics is not None:
        present = len(status.topics.unchanged) + len(status.topics.created)
        console.print(f"topics: {present} as specified", end="")
        if status.topics.missing:
            console.print(f", [red]missing: {', '.join(status.topics.missing)}[/red]", end="")
        console.print()
        for drift in status.topics.drifted:
            console.print(f"[yellow]drift:[/yellow] {drift}")
    if status.topics_error:
        console.print(f"[red]{status.topics_error}[/red]")


@app.command()
def up(
    cluster: Annotated[
        bool, typer.Option("--cluster", help="Start the 3-broker KRaft cluster instead.")
    ] = False,
    quickstart: Annotated[
        bool, typer.Option(help="Run the 1,000-task quickstart once everything is up.")
    ] = True,
    quickstart_tasks: Annotated[
        int, typer.Option(min=1, help="Small tasks the quickstart runs.")
    ] = 1_000,
    quickstart_mb: Annotated[
        int,
        typer.Option(
            min=0, help="MiB of the quickstart's by-reference round trip (0 leaves it out)."
        ),
    ] = 100,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="DEVELOPMENT ONLY: PLAINTEXT Kafka with no authentication "
            "(also FXSTREAM_INSECURE=1). Anyone who reaches its ports owns the platform.",
        ),
    ] = False,
    router_instances: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=MAX_INSTANCES,
            help="Router processes (one consumer group) [default: the config's "
            "router_instances, FXSTREAM_ROUTER_INSTANCES, else 1]; takes effect when the "
            "services start (./fx down first if they run).",
        ),
    ] = None,
) -> None:
    """Install what is missing; start Kafka, Redis, the service and a local endpoint; quickstart.

    Secure by default: Kafka takes only SASL/SCRAM-SHA-512 over TLS, with certificates from a
    local CA in the platform home and the admin credential in ``<home>/credentials``.
    """
    config = _config()
    if insecure:
        config = config.with_overrides(insecure=True)
    if router_instances is not None:
        config = config.with_overrides(router_instances=router_instances)
    if config.insecure:
        err.print(
            "[bold red]WARNING: starting the INSECURE platform: Kafka without "
            "authentication, encryption or ACLs. Development on a private machine only."
            "[/bold red]"
        )
    platform = Platform(config)
    try:
        with console.status("starting fxstream") as spinner:
            connection = platform.up(
                cluster=cluster,
                services=True,
                step=lambda text: spinner.update(f"[bold]{text}"),
            )
    except (InstallError, PlatformError, ProcessStartError, ProvisionError, TimeoutError) as exc:
        err.print(f"[red]fxstream up failed:[/red] {exc}")
        err.print(f"logs: {config.home / 'logs'}")
        raise typer.Exit(1) from exc
    _print_status(platform.status())
    services = platform.services()
    running_routers = len(services.instances["router"])
    if running_routers != config.router_instances:
        err.print(
            f"[yellow]{running_routers} router process(es) run, not "
            f"{config.router_instances}: the services were already running; "
            "./fx down, then ./fx up, to change it[/yellow]"
        )
    endpoint_id = services.local_endpoint_id()
    if quickstart and endpoint_id is not None:
        from fxstream.ops.quickstart import run_quickstart

        run_quickstart(
            console,
            services.credentials_file,
            endpoint_id,
            tasks=quickstart_tasks,
            large_mb=quickstart_mb,
        )
    if endpoint_id is not None:
        from fxstream.ops.quickstart import snippet

        console.rule("submit from Python")
        print(snippet(services.credentials_file, endpoint_id))
    console.print(f"REST API: [bold]{services.service_url}[/bold] (docs at /docs)")
    console.print(f"Kafka bootstrap servers: [bold]{connection.bootstrap_servers}[/bold]")
    if connection.secure:
        console.print(
            f"Kafka: SASL/SCRAM-SHA-512 over TLS, CA {connection.ca_file}; admin credentials "
            f"in {platform.credentials_file('admin')} (0600)"
        )
    else:
        err.print("[bold red]Kafka: INSECURE (PLAINTEXT, no authentication)[/bold red]")
    console.print(
        f"Redis: [bold]{platform.redis().url}[/bold] (user fxstream; its password is in the "
        "connection file below)"
    )
    console.print(f"state and logs: {config.home}   connection file: {platform.info_file}")
    console.print("stop everything with [bold]./fx down[/bold]")


@app.command()
def down() -> None:
    """Stop every process the platform started (by PID) and wait for each to exit."""
    stopped = Platform(_config()).down()
    if stopped:
        for what in stopped:
            console.print(f"stopped {what}")
    else:
        console.print("nothing was running")


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Say what runs and whether it is healthy; exit 1 unless everything is healthy."""
    result = Platform(_config()).status()
    if as_json:
        print(result.to_json())
    else:
        _print_status(result)
    if not result.healthy:
        raise typer.Exit(1)


@app.command()
def logs(
    endpoint_id: Annotated[str, typer.Argument(help="The endpoint whose agents' log to show.")],
    limit: Annotated[int, typer.Option(help="The newest lines to show (1-5000).")] = 200,
    level: Annotated[str, typer.Option(help="The lowest level: DEBUG, INFO, WARNING, ERROR.")] = (
        "INFO"
    ),
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep showing new lines.")] = False,
) -> None:
    """Show an endpoint's log, as its agents shipped it to the platform (owner only; your
    credentials as the SDK finds them: FXSTREAM_CREDENTIALS, else those `./fx up` wrote)."""
    from fxstream.sdk import Client, FxstreamError

    try:
        with Client() as client:
            since: float | None = None
            while True:
                answer = client.get_endpoint_logs(
                    endpoint_id, limit=limit, level=level.upper(), since=since
                )
                for line in answer["lines"]:
                    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(line["at"]))
                    console.print(
                        f"{stamp} {line['level']:<7} {line['hostname']} {line['logger']}: "
                        f"{line['message']}",
                        markup=False,
                        highlight=False,
                    )
                    since = line["at"]
                if answer["dropped"]:
                    err.print(f"({answer['dropped']} lines were dropped by the agents)")
                if not follow:
                    if not answer["complete"]:
                        err.print("(older lines exist: only the newest 2,000 batches are read)")
                    return
                time.sleep(2.0)
    except FxstreamError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        return


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def diagnose(ctx: typer.Context) -> None:
    """Check an endpoint host: `fxstream diagnose NAME [--bundle DIR]` is
    `fxstream-endpoint diagnose` (config, credential, service, Kafka, runtime, scheduler,
    disk; a tar.gz of the report, config and logs with --bundle)."""
    from fxstream.agent.cli import app as endpoint_app

    endpoint_app(["diagnose", *ctx.args], standalone_mode=True)


def _run(step: str, argv: list[str]) -> None:
    console.rule(f"[bold]{step}")
    done = subprocess.run(argv, cwd=repo_root())
    if done.returncode != 0:
        err.print(f"[red]{step} failed (exit {done.returncode})[/red]")
        raise typer.Exit(done.returncode)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def test(ctx: typer.Context) -> None:
    """Install what is missing, check style (ruff) and types (mypy), then run pytest.

    Extra arguments go to pytest, e.g. ``./fx test -k topics -x``. ``./fx test --fast`` is the
    edit loop's lane: no Kafka, Redis or platform is started and nothing is killed (tests
    marked platform/faults/cluster, or needing the session broker, are deselected).

    ``--workers N`` runs the test files in N pytest-xdist workers, a file at a time each
    (``--dist loadfile``, so a module's platform serves all its tests; each worker starts
    its own session broker). The default is 1 (no xdist): on a 2-core machine the suite is
    CPU-bound, and two workers took as long as one (33m48s against 32m).
    """
    fast = "--fast" in ctx.args
    args = _with_workers(list(ctx.args))
    python = sys.executable
    sources = [f"{d}/src" for d in PACKAGE_DIRS]
    _run("ruff format --check", [python, "-m", "ruff", "format", "--check", *PACKAGE_DIRS, "tests"])
    _run("ruff check", [python, "-m", "ruff", "check", *PACKAGE_DIRS, "tests"])
    _run("mypy", [python, "-m", "mypy", *sources])
    if fast:
        _pytest(args)
    console.rule(
        "[bold]requirements (Java, Apache Kafka, Redis, container runtimes, Slurm, MPICH, chromium)"
    )
    try:
        for name, where in ensure_requirements(_config()).items():
            console.print(f"{name}: {where}")
    except InstallError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    _pytest(args)


def _with_workers(args: list[str]) -> list[str]:
    """``args`` for pytest, with ``--workers N`` turned into xdist's options (see ``test``)."""
    workers = 1
    if "--workers" in args:
        at = args.index("--workers")
        value = args[at + 1] if at + 1 < len(args) else ""
        if not value.isdigit() or int(value) < 1:
            err.print(f"[red]--workers needs a whole number of at least 1, not {value!r}[/red]")
            raise typer.Exit(2)
        workers = int(value)
        del args[at : at + 2]
    if "--fast" in args or workers == 1 or any(a == "-n" or a.startswith("-n") for a in args):
        return args
    return [*args, "-n", str(workers), "--dist", "loadfile"]


def _pytest(args: list[str]) -> NoReturn:
    console.rule("[bold]pytest")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=repo_root(), env=env)
    raise typer.Exit(done.returncode)


@app.command()
def docs(
    check: Annotated[
        bool, typer.Option("--check", help="Only check docs/topics.md is current; exit 1 if not.")
    ] = False,
) -> None:
    """Render docs/topics.md from the topic catalogue and record schemas."""
    from fxstream.ops.topic_docs import render_topics_md

    target = repo_root() / "docs" / "topics.md"
    text = render_topics_md()
    if check:
        if not target.exists() or target.read_text() != text:
            err.print(f"{target} is out of date: run ./fx docs")
            raise typer.Exit(1)
        console.print(f"{target} is current")
        return
    target.parent.mkdir(exist_ok=True)
    target.write_text(text)
    console.print(f"wrote {target}")


@bench_app.command("kafka")
def bench_kafka(
    records: Annotated[int, typer.Option(help="Records per throughput phase.")] = 200_000,
    latency_samples: Annotated[int, typer.Option(help="Round trips timed for latency.")] = 2_000,
    bootstrap: Annotated[
        str | None,
        typer.Option(help="Measure this broker instead of starting a private one."),
    ] = None,
    kafka_credentials: Annotated[
        Path | None,
        typer.Option(
            help="Measure the broker of this 0600 Kafka credentials file (bootstrap, "
            "kafka_username, kafka_password, kafka_ca_file); --bootstrap overrides its brokers.",
            envvar="FXSTREAM_KAFKA_CREDENTIALS",
            dir_okay=False,
        ),
    ] = None,
) -> None:
    """Raw Kafka limits on this machine: produce, consume, round trip, 3-hop relay."""
    from fxstream.ops.bench.kafka import BenchError, run_kafka_bench

    try:
        kafka = None if bootstrap is None else KafkaConnection(bootstrap)
        if kafka_credentials is not None:
            kafka = KafkaConnection.from_file(kafka_credentials)
            if bootstrap is not None:
                kafka = dataclasses.replace(kafka, bootstrap=bootstrap)
        run_kafka_bench(
            console=console, records=records, latency_samples=latency_samples, kafka=kafka
        )
    except (
        BenchError,
        CredentialFileError,
        InstallError,
        PlatformError,
        ProcessStartError,
        TimeoutError,
    ) as exc:
        err.print(f"[red]bench kafka failed:[/red] {exc}")
        raise typer.Exit(1) from exc


def _task_bench_errors() -> tuple[type[Exception], ...]:
    """What a task-path bench can fail with, to be reported in one line.

    Its own BenchError, a platform that does not start, an SDK error (a task failed or
    was refused), a result that never came.
    """
    from fxstream.ops.bench.stack import BenchError
    from fxstream.sdk import FxstreamError

    return (
        BenchError,
        FxstreamError,
        InstallError,
        PlatformError,
        ProcessStartError,
        ProvisionError,
        TimeoutError,
    )


class _BenchSettings(Protocol):
    """A bench's settings: refuse what cannot run with ValueError."""

    def validate(self) -> None: ...


def _run_task_bench(name: str, settings: _BenchSettings, run: Callable[..., object]) -> None:
    """Validate ``settings`` (exit 2 naming the bad value), then run the task-path bench
    ``name`` (exit 1 with its error in one line)."""
    try:
        settings.validate()
    except ValueError as exc:
        err.print(f"[red]bench {name}:[/red] {exc}")
        raise typer.Exit(2) from exc
    try:
        run(console=console, settings=settings)
    except _task_bench_errors() as exc:
        err.print(f"[red]bench {name} failed:[/red] {exc}")
        raise typer.Exit(1) from exc


# The task-path benches' switch for the same figures with security off.
_PlainOption = Annotated[
    bool,
    typer.Option(
        "--plain/--no-plain",
        help="Also measure fxstream with security off (PLAINTEXT Kafka) in the same run and "
        "report secure_vs_plain; --no-plain skips it.",
    ),
]


# The task-path benches' switch to leave Ray out.
_SkipRayOption = Annotated[
    bool, typer.Option("--skip-ray", help="Leave Ray (a local runtime of 2 CPUs) out.")
]


@bench_app.command("throughput")
def bench_throughput(
    tasks: Annotated[int, typer.Option(min=1, help="No-op tasks timed per system.")] = 20_000,
    skip_parsl: Annotated[
        bool, typer.Option("--skip-parsl", help="Leave Parsl HTEX out (a quicker run).")
    ] = False,
    plain: _PlainOption = True,
    skip_ray: _SkipRayOption = False,
    curve_tasks: Annotated[
        int,
        typer.Option(
            min=1,
            help="No-op tasks timed per point of the scale curve (1, 2, 4 agents of 2 "
            "workers; 1 agent of 4 and of 8 workers).",
        ),
    ] = 5_000,
    skip_curve: Annotated[
        bool, typer.Option("--skip-curve", help="Leave the scale curve out.")
    ] = False,
) -> None:
    """No-op tasks/s: fxstream submit and map vs ProcessPoolExecutor(2), Parsl HTEX and Ray;
    fxstream's rate with 1, 2, 4 agents and 2, 4, 8 workers."""
    from fxstream.ops.bench.throughput import run_throughput_bench

    try:
        run_throughput_bench(
            console=console,
            tasks=tasks,
            skip_parsl=skip_parsl,
            plain=plain,
            skip_ray=skip_ray,
            curve_tasks=curve_tasks,
            skip_curve=skip_curve,
        )
    except _task_bench_errors() as exc:
        err.print(f"[red]bench throughput failed:[/red] {exc}")
        raise typer.Exit(1) from exc


@bench_app.command("latency")
def bench_latency(
    samples: Annotated[
        int, typer.Option(min=1, help="Sequential round trips timed per system.")
    ] = 500,
    skip_parsl: Annotated[
        bool, typer.Option("--skip-parsl", help="Leave Parsl HTEX out (a quicker run).")
    ] = False,
    plain: _PlainOption = True,
    skip_ray: _SkipRayOption = False,
) -> None:
    """Round trip of one warm no-op task (p50/p95/p99, hop by hop) vs Parsl HTEX and Ray."""
    from fxstream.ops.bench.latency import run_latency_bench

    try:
        run_latency_bench(
            console=console,
            samples=samples,
            skip_parsl=skip_parsl,
            plain=plain,
            skip_ray=skip_ray,
        )
    except _task_bench_errors() as exc:
        err.print(f"[red]bench latency failed:[/red] {exc}")
        raise typer.Exit(1) from exc


@bench_app.command("stream")
def bench_stream(
    items_1mb: Annotated[int, typer.Option(min=1, help="1 MB arrays per mode.")] = 200,
    items_10mb: Annotated[int, typer.Option(min=1, help="10 MB arrays per mode.")] = 40,
    modes: Annotated[
        str,
        typer.Option(help="Comma-separated: kafka+redis, adios2-sst, adios2-bp5, kafka-inline."),
    ] = "kafka+redis,adios2-sst,adios2-bp5,kafka-inline",
) -> None:
    """Stream 1 MB and 10 MB arrays to a consumer: Kafka+Redis, ADIOS2 SST/BP5, inline Kafka."""
    from fxstream.ops.bench.stream import run_stream_bench

    chosen = tuple(mode.strip() for mode in modes.split(",") if mode.strip())
    try:
        run_stream_bench(
            console=console, items={1_000_000: items_1mb, 10_000_000: items_10mb}, modes=chosen
        )
    except ValueError as exc:
        err.print(f"[red]bench stream:[/red] {exc}")
        raise typer.Exit(2) from exc
    except _task_bench_errors() as exc:
        err.print(f"[red]bench stream failed:[/red] {exc}")
        raise typer.Exit(1) from exc


@bench_app.command("payload")
def bench_payload(
    sizes: Annotated[
        str, typer.Option(help="Argument (and result) sizes, comma-separated: 10kB, 1MB, 1GB.")
    ] = "10kB,100kB,1MB,10MB,100MB,1GB",
    repeats: Annotated[
        int | None,
        typer.Option(
            min=1, help="Round trips per size [default: 10; 5 from 10MB; 3 from 100MB; 2 from 1GB]."
        ),
    ] = None,
    time_limit: Annotated[
        float, typer.Option(min=1.0, help="Seconds one size may take on one system.")
    ] = 300.0,
    sweep_sizes: Annotated[
        str,
        typer.Option(help="Sizes of the inline vs by-reference sweep ('' skips it)."),
    ] = "16kB,32kB,64kB,128kB,256kB,512kB",
    sweep_repeats: Annotated[
        int, typer.Option(min=1, help="Round trips per size and mode in the sweep.")
    ] = 15,
    skip_dask: Annotated[
        bool, typer.Option("--skip-dask", help="Leave Dask distributed out.")
    ] = False,
    skip_parsl: Annotated[bool, typer.Option("--skip-parsl", help="Leave Parsl HTEX out.")] = False,
    skip_ray: _SkipRayOption = False,
    store_url: Annotated[
        str | None,
        typer.Option(help="Proxy store of client and endpoint [default: the platform's Redis]."),
    ] = None,
    warmup_small: Annotated[
        int, typer.Option(min=0, help="Untimed 1 kB round trips per system first.")
    ] = 30,
    warmup_large: Annotated[
        int, typer.Option(min=0, help="Untimed 1 MB round trips per system after those.")
    ] = 3,
) -> None:
    """Round trip of bytes 10 kB..1 GB: fxstream (by reference via Redis) vs Dask, HTEX, Ray."""
    from fxstream.ops.bench.payload import PayloadSettings, run_payload_bench

    settings = PayloadSettings(
        sizes=_labels(sizes),
        repeats=repeats,
        time_limit_s=time_limit,
        skip_dask=skip_dask,
        skip_parsl=skip_parsl,
        skip_ray=skip_ray,
        sweep_sizes=_labels(sweep_sizes),
        sweep_repeats=sweep_repeats,
        store_url=store_url,
        warmup_small=warmup_small,
        warmup_large=warmup_large,
    )
    _run_task_bench("payload", settings, run_payload_bench)


@bench_app.command("idle")
def bench_idle(
    settle: Annotated[
        float, typer.Option(min=0.0, help="Seconds the platform settles after start.")
    ] = 15.0,
    window: Annotated[float, typer.Option(min=0.1, help="Seconds CPU is measured.")] = 30.0,
) -> None:
    """CPU seconds per process of a private platform doing nothing."""
    from fxstream.ops.bench.idle import IdleSettings, run_idle_bench

    settings = IdleSettings(settle_s=settle, window_s=window)
    _run_task_bench("idle", settings, run_idle_bench)


@bench_app.command("soak")
def bench_soak(
    rate: Annotated[int, typer.Option(min=1, help="No-op tasks submitted per second.")] = 500,
    minutes: Annotated[float, typer.Option(min=0.1, help="How long the load runs.")] = 10.0,
    warmup_minutes: Annotated[
        float, typer.Option(min=0.0, help="Minutes before RSS is judged (under half the run).")
    ] = 2.0,
    interval: Annotated[float, typer.Option(min=0.5, help="Seconds between RSS samples.")] = 10.0,
    max_slope: Annotated[
        float, typer.Option(min=0.0, help="Flat: at most this many MB per 10 min (2nd half).")
    ] = 5.0,
    max_growth: Annotated[
        float, typer.Option(min=0.0, help="Flat: end at most (1 + this) x post-warm-up RSS.")
    ] = 0.10,
    task_retention_s: Annotated[
        int | None,
        typer.Option(
            min=1, help="The platform's task retention (default a week): finished tasks expire."
        ),
    ] = None,
) -> None:
    """RSS and disk of every process (broker, Redis, service, agent, workers, SDK) under
    steady load."""
    from fxstream.ops.bench.soak import SoakSettings, run_soak_bench

    settings = SoakSettings(
        rate=rate,
        minutes=minutes,
        warmup_minutes=warmup_minutes,
        interval_s=interval,
        max_slope_mb=max_slope,
        max_growth=max_growth,
        task_retention_s=task_retention_s,
    )
    _run_task_bench("soak", settings, run_soak_bench)


@bench_app.command("service-scale")
def bench_service_scale(
    endpoints: Annotated[
        int, typer.Option(min=1, help="Simulated endpoints (registered, heartbeating).")
    ] = 10_000,
    tasks: Annotated[
        int, typer.Option(min=0, help="No-op tasks queued on them (never pulled).")
    ] = 1_000_000,
    minutes: Annotated[
        float, typer.Option(min=0.05, help="Steady window once the tasks are queued.")
    ] = 3.0,
    period: Annotated[
        float, typer.Option(min=0.1, help="Each endpoint's heartbeat period, s.")
    ] = 5.0,
    task_endpoints: Annotated[
        int, typer.Option(min=1, help="Endpoints the tasks are spread over (in turn).")
    ] = 16,
    sample_endpoints: Annotated[
        int, typer.Option(min=1, help="Endpoints whose status the prober polls for the lag.")
    ] = 20,
    interval: Annotated[float, typer.Option(min=0.5, help="Seconds between RSS samples.")] = 5.0,
    batch: Annotated[int, typer.Option(min=1, help="Tasks per Client.batch_run call.")] = 2_000,
    kafka_heap_mb: Annotated[
        int | None,
        typer.Option(
            min=256, help="The broker's heap, MB (default: 1,024, or 0.3 MB per endpoint)."
        ),
    ] = None,
) -> None:
    """Many endpoints heartbeating and a large queued backlog: service RSS and status lag."""
    from fxstream.ops.bench.service_scale import ServiceScaleSettings, run_service_scale_bench

    settings = ServiceScaleSettings(
        endpoints=endpoints,
        tasks=tasks,
        minutes=minutes,
        period_s=period,
        task_endpoints=task_endpoints,
        sample_endpoints=sample_endpoints,
        interval_s=interval,
        batch=batch,
        kafka_heap_mb=kafka_heap_mb,
    )
    _run_task_bench("service-scale", settings, run_service_scale_bench)


def _labels(text: str) -> tuple[str, ...]:
    """Comma-separated labels, blanks dropped."""
    return tuple(label.strip() for label in text.split(",") if label.strip())


@bench_app.command("chaos")
def bench_chaos(
    tasks: Annotated[int, typer.Option(min=1, help="Tasks to run under chaos.")] = 50_000,
    kill_interval: Annotated[
        float, typer.Option(min=0.1, help="Seconds between one restart and the next kill.")
    ] = 5.0,
    downtime: Annotated[
        float, typer.Option(min=0.0, help="Seconds a killed component stays down.")
    ] = 1.0,
    deadline: Annotated[
        float,
        typer.Option(min=1.0, help="Seconds after the last restart before a task counts lost."),
    ] = 120.0,
    sleep_fraction: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Share of tasks that sleep 5-50 ms.")
    ] = 0.1,
    components: Annotated[
        str, typer.Option(help="What the killer picks from (comma-separated).")
    ] = "worker,agent,router,broker",
    max_retries: Annotated[int, typer.Option(min=0, max=100, help="Retries per task.")] = 3,
    seed: Annotated[int | None, typer.Option(help="Seed of the random choices.")] = None,
) -> None:
    """Tasks on the 3-broker cluster while a killer SIGKILLs worker, agent, router, broker."""
    from fxstream.ops.bench.chaos import ChaosSettings, run_chaos_bench

    settings = ChaosSettings(
        tasks=tasks,
        kill_interval_s=kill_interval,
        downtime_s=downtime,
        deadline_s=deadline,
        sleep_fraction=sleep_fraction,
        components=tuple(c.strip() for c in components.split(",") if c.strip()),
        max_retries=max_retries,
        seed=seed,
    )
    _run_task_bench("chaos", settings, run_chaos_bench)


@bench_app.command("coldstart")
def bench_coldstart(
    repetitions: Annotated[
        int, typer.Option(min=1, help="Cold starts (an engine of one worker) per runtime.")
    ] = 5,
    warm_tasks: Annotated[
        int, typer.Option(min=0, help="Warm tasks timed after each cold start.")
    ] = 20,
    runtimes: Annotated[
        str,
        typer.Option(
            help="Comma-separated: multiprocessing-spawn, process, bubblewrap, "
            "bubblewrap-host, podman."
        ),
    ] = "multiprocessing-spawn,process,bubblewrap,bubblewrap-host,podman",
) -> None:
    """Worker cold start (container + interpreter + function load) and warm task, per runtime."""
    from fxstream.ops.bench.coldstart import run_coldstart_bench

    try:
        run_coldstart_bench(
            console=console,
            repetitions=repetitions,
            warm_tasks=warm_tasks,
            runtimes=_labels(runtimes),
        )
    except ValueError as exc:
        err.print(f"[red]bench coldstart:[/red] {exc}")
        raise typer.Exit(2) from exc
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        err.print(f"[red]bench coldstart failed:[/red] {exc}")
        raise typer.Exit(1) from exc


@bench_app.command("scaling")
def bench_scaling(
    workers: Annotated[
        str, typer.Option(help="Comma-separated worker counts (one block of each).")
    ] = "8,16,32,64,128,256",
    tasks_per_worker: Annotated[
        int, typer.Option(min=1, help="Weak scaling: sleep tasks per worker.")
    ] = 10,
    task_s: Annotated[float, typer.Option(min=0.0, help="Each task's sleep, seconds.")] = 1.0,
    strong_tasks: Annotated[
        int, typer.Option(min=1, help="Strong scaling: the fixed batch of sleep tasks.")
    ] = 512,
    slurm: Annotated[
        bool, typer.Option(help="Also run the smallest size as a job of a real Slurm (root).")
    ] = False,
) -> None:
    """funcX's weak and strong scaling through the batch engine (Parsl HTEX blocks)."""
    from fxstream.ops.bench.scaling import run_scaling_bench

    try:
        if not all(w.isdigit() for w in _labels(workers)):
            raise ValueError(f"--workers takes whole numbers separated by commas, not {workers!r}")
        sizes = [int(w) for w in _labels(workers)]
        run_scaling_bench(
            console=console,
            workers=sizes,
            tasks_per_worker=tasks_per_worker,
            task_s=task_s,
            strong_tasks=strong_tasks,
            slurm=slurm,
        )
    except ValueError as exc:
        err.print(f"[red]bench scaling:[/red] {exc}")
        raise typer.Exit(2) from exc
    except RuntimeError as exc:
        err.print(f"[red]bench scaling failed:[/red] {exc}")
        raise typer.Exit(1) from exc


@bench_app.command("routing")
def bench_routing(
    tasks: Annotated[
        int, typer.Option(min=1, help="Tasks of the warm-routing comparison.")
    ] = 3_000,
    endpoints: Annotated[
        int, typer.Option(min=2, max=16, help="Endpoints of the warm-routing comparison.")
    ] = 4,
    images: Annotated[
        int, typer.Option(min=1, max=100, help="Container images (one function each).")
    ] = 10,
    pool_slots: Annotated[
        int, typer.Option(min=1, help="Image pools an endpoint runs at once (max_workers).")
    ] = 3,
    group_tasks: Annotated[
        int, typer.Option(min=1, help="Tasks of the backlog vs round-robin comparison.")
    ] = 1_000,
    group_endpoints: Annotated[
        int, typer.Option(min=2, max=16, help="Endpoints of 1, 2, 3, ... workers for it.")
    ] = 3,
    seed: Annotated[int, typer.Option(help="Seeds the task mix (the same for each policy).")] = 7,
) -> None:
    """Warm routing vs random (completion, cold starts), shortest backlog vs round robin."""
    from fxstream.ops.bench.routing import RoutingSettings, run_routing_bench

    settings = RoutingSettings(
        tasks=tasks,
        endpoints=endpoints,
        images=images,
        pool_slots=pool_slots,
        group_tasks=group_tasks,
        group_endpoints=group_endpoints,
        seed=seed,
    )
    _run_task_bench("routing", settings, run_routing_bench)


@bench_app.command("trigger")
def bench_trigger(
    steady_files: Annotated[
        int, typer.Option(min=0, help="Files written at the steady rate (measured).")
    ] = 300,
    rate: Annotated[float, typer.Option(help="Files per second in the steady phase.")] = 20.0,
    burst_files: Annotated[int, typer.Option(min=0, help="Files of the burst.")] = 1_000,
    burst_seconds: Annotated[
        float, typer.Option(help="Seconds the burst's files are spread over.")
    ] = 1.0,
    file_bytes: Annotated[int, typer.Option(help="Bytes per file.")] = 65_536,
    warmup_files: Annotated[
        int, typer.Option(help="Files awaited before measuring (not counted).")
    ] = 5,
    idle_timeout: Annotated[
        float, typer.Option(help="Seconds without a result before the missing count as lost.")
    ] = 60.0,
    warmup_tasks: Annotated[
        int,
        typer.Option(
            help="No-op tasks first, to warm the broker's JIT (not counted); 0: a cold platform."
        ),
    ] = 20_000,
) -> None:
    """File close -> analysis result at a subscriber, through a file watcher and a rule."""
    from fxstream.ops.bench.trigger import TriggerSettings, run_trigger_bench

    settings = TriggerSettings(
        steady_files=steady_files,
        rate=rate,
        burst_files=burst_files,
        burst_s=burst_seconds,
        file_bytes=file_bytes,
        warmup_files=warmup_files,
        idle_timeout_s=idle_timeout,
        warmup_tasks=warmup_tasks,
    )
    _run_task_bench("trigger", settings, run_trigger_bench)


@bench_app.command("profile")
def bench_profile(
    tasks: Annotated[int, typer.Option(help="No-op tasks accounted for (and sampled).")] = 10_000,
    warmup_tasks: Annotated[int, typer.Option(help="Untimed tasks first.")] = 2_000,
    py_spy: Annotated[
        bool,
        typer.Option(
            "--py-spy/--no-py-spy", help="Sample each Python process with py-spy afterwards."
        ),
    ] = True,
    rate_hz: Annotated[int, typer.Option(help="py-spy samples per second.")] = 250,
    profile_dir: Annotated[
        Path | None,
        typer.Option(
            help="Keep py-spy's raw stacks (flame graph input) and the broker's JFR "
            "recording in this directory."
        ),
    ] = None,
    broker_jfr: Annotated[
        bool,
        typer.Option(
            "--broker-jfr/--no-broker-jfr",
            help="Record the broker's JVM with Java Flight Recorder while sampling.",
        ),
    ] = False,
) -> None:
    """Where a task's CPU goes: microseconds per task in every process and the broker's
    requests, then py-spy (and with --broker-jfr, the broker's JVM)."""
    from fxstream.ops.bench.profile import ProfileSettings, run_profile_bench

    settings = ProfileSettings(
        tasks=tasks,
        warmup_tasks=warmup_tasks,
        py_spy=py_spy,
        rate_hz=rate_hz,
        profile_dir=profile_dir,
        broker_jfr=broker_jfr,
    )
    _run_task_bench("profile", settings, run_profile_bench)


@bench_app.command("pipeline")
def bench_pipeline(
    stages: Annotated[int, typer.Option(help="Tasks in the chain.")] = 4,
    seconds: Annotated[float, typer.Option(help="Seconds one stage takes.")] = 2.0,
    overhead: Annotated[
        float, typer.Option(help="Fraction of a stage that is start-up, before its input.")
    ] = 0.5,
    megabytes: Annotated[float, typer.Option(help="MB each stage passes to the next.")] = 10.0,
    repeats: Annotated[int, typer.Option(help="Runs of each mode (the median is reported).")] = 3,
) -> None:
    """A chain of tasks: one after the other, as a DAG, and pipelined with proxy futures."""
    from fxstream.ops.bench.pipeline import PipelineSettings, run_pipeline_bench

    settings = PipelineSettings(
        stages=stages, seconds=seconds, overhead=overhead, megabytes=megabytes, repeats=repeats
    )
    _run_task_bench("pipeline", settings, run_pipeline_bench)


@demo_app.command("beamline")
def demo_beamline(
    files: Annotated[int, typer.Option(help="Frame files the simulated detector writes.")] = 10,
    rate: Annotated[float, typer.Option(help="Files per second.")] = 2.0,
    frames: Annotated[int, typer.Option(help="Frames (64 x 64) per file.")] = 100,
    source: Annotated[
        str, typer.Option(help="The event source: its topic is events.<SOURCE>.")
    ] = "beamline",
    seed: Annotated[int, typer.Option(help="Seeds the simulated detector.")] = 0,
    timeout: Annotated[
        float, typer.Option(help="Seconds without a new result before the missing count as lost.")
    ] = 120.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Also print the summary as one JSON line, last.")
    ] = False,
) -> None:
    """A simulated XPCS detector writes frame files; a trigger rule runs a two-time
    correlation on the local endpoint for each; results print live; then the Parquet archive.
    """
    from fxstream.ops.demo_beamline import (
        BeamlineSettings,
        DemoError,
        attach_running_platform,
        run_beamline_demo,
    )

    settings = BeamlineSettings(
        files=files, rate=rate, frames=frames, source=source, seed=seed, idle_timeout_s=timeout
    )
    try:
        settings.validate()
    except ValueError as exc:
        err.print(f"[red]demo beamline:[/red] {exc}")
        raise typer.Exit(2) from exc
    failures: tuple[type[Exception], ...] = (DemoError, *_task_bench_errors())
    try:
        platform = attach_running_platform(_config())
        summary = run_beamline_demo(console, platform, settings)
    except failures as exc:
        err.print(f"[red]demo beamline failed:[/red] {exc}")
        raise typer.Exit(1) from exc
    if as_json:
        print(json.dumps(summary), flush=True)
    if not summary["ok"]:
        err.print(
            "[red]demo beamline: not every file had its analysis, or the archive lacks rows "
            "(see above)[/red]"
        )
        raise typer.Exit(1)


@user_app.command("add")
def user_add(
    name: Annotated[str, typer.Argument(help="the user's display name")],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="where to write its credentials (default <home>/credentials/user-<id>.json)",
        ),
    ] = None,
) -> None:
    """Create a user (Kafka principal, ACLs, topics, API token) and write its credentials 0600."""
    from fxstream.ops.users import UserAddError, add_user

    try:
        added = add_user(Platform(_config()), name, out)
    except UserAddError as exc:
        err.print(f"[red]cannot add user {name!r}:[/red] {exc}")
        raise typer.Exit(1) from exc
    principal = added.kafka_username or "none: the platform is insecure"
    console.print(f"user {added.name!r}: id {added.user_id}, Kafka principal {principal}")
    console.print(
        f"credentials (0600): {added.credentials_file}; give this file to the user only, "
        f"who sets FXSTREAM_CREDENTIALS={added.credentials_file}"
    )


def main() -> None:
    """Entry point of the ``fxstream`` script."""
    app()


if __name__ == "__main__":
    main()
