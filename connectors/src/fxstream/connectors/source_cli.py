"""``fxstream-source``: run an event source or the Parquet sink until SIGTERM or Ctrl-C.

- ``fxstream-source create-topic --source S``: create ``events.<S>`` (as the admin).
- ``fxstream-source watch DIR --source S``: the file watcher
  (:mod:`fxstream.connectors.file_watcher`).
- ``fxstream-source adios PATH --source S``: one event per step of a BP5 stream
  (:mod:`fxstream.connectors.adios_steps`).
- ``fxstream-source topic TOPIC --source S``: events from a topic's records
  (:mod:`fxstream.connectors.topic_source`).
- ``fxstream-source sink DIR``: the Parquet archive (:mod:`fxstream.connectors.parquet_sink`).

Kafka: ``--credentials`` (or ``FXSTREAM_KAFKA_CREDENTIALS``) names a 0600 credentials file
(the source's principal ``src.<S>``, the service's for the sink, or the admin's); without it
``--bootstrap`` (``FXSTREAM_BOOTSTRAP``) names an insecure development broker. No secret is
ever an argument. Each long-running command prints one line starting with :data:`READY_LINE`
once it runs, and stops cleanly on SIGTERM or SIGINT (what it took is committed first).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from fxstream.connectors.event_writer import (
    DEFAULT_SCAN_RECORDS,
    EventTopicMissing,
    EventWriter,
    ensure_event_topic,
)
from fxstream.topics import Catalogue, CredentialFileError, KafkaConnection, ProvisionError

__all__ = ["READY_LINE", "app", "main"]

app = typer.Typer(
    help="Run fxstream event sources (file watcher, ADIOS2 steps, Kafka topic) and the "
    "Parquet sink.",
    no_args_is_help=True,
)
console = Console(soft_wrap=True, highlight=False)
READY_LINE = "fxstream-source ready:"

Credentials = Annotated[
    Path | None,
    typer.Option(
        help="A 0600 Kafka credentials file (kafka_username, kafka_password, kafka_ca_file).",
        envvar="FXSTREAM_KAFKA_CREDENTIALS",
        dir_okay=False,
    ),
]
Bootstrap = Annotated[
    str | None,
    typer.Option(
        help="host:port of an insecure development broker (used without --credentials).",
        envvar="FXSTREAM_BOOTSTRAP",
    ),
]
Prefix = Annotated[str, typer.Option(help="Topic prefix.", envvar="FXSTREAM_TOPIC_PREFIX")]
Source = Annotated[str, typer.Option(help="The source's id: its topic is events.<SOURCE>.")]


def _connection(credentials: Path | None, bootstrap: str | None) -> KafkaConnection:
    if credentials is not None:
        try:
            return KafkaConnection.from_file(credentials)
        except CredentialFileError as exc:
            console.print(str(exc), style="red", markup=False)
            raise typer.Exit(2) from None
    if bootstrap:
        return KafkaConnection(bootstrap)
    console.print(
        "[red]no Kafka connection:[/] give --credentials FILE (or FXSTREAM_KAFKA_CREDENTIALS), "
        "or --bootstrap HOST:PORT for an insecure development broker"
    )
    raise typer.Exit(2)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def _announce_when(ready: threading.Event, stop: threading.Event, text: str) -> None:
    def wait() -> None:
        while not stop.is_set():
            if ready.wait(0.1):
                print(f"{READY_LINE} {text}", flush=True)
                return

    threading.Thread(target=wait, name="fxstream-source-ready", daemon=True).start()


def _run(run: Callable[[threading.Event], None], stop: threading.Event) -> None:
    """Run a source or sink; a refusal it explains (missing topic, directory in use) ends
    the command with its message and exit code 1 instead of a traceback."""
    from fxstream.connectors.parquet_sink import SinkDirectoryInUse

    try:
        run(stop)
    except (EventTopicMissing, SinkDirectoryInUse, NotADirectoryError, TimeoutError) as exc:
        console.print(str(exc), style="red", markup=False)
        raise typer.Exit(1) from None


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@app.command("create-topic")
def create_topic(
    source: Source,
    credentials: Credentials = None,
    bootstrap: Bootstrap = None,
    prefix: Prefix = "fx.",
) -> None:
    """Create the topic events.<SOURCE> as the catalogue specifies (run as the admin)."""
    try:
        topic = ensure_event_topic(_connection(credentials, bootstrap), Catalogue(prefix), source)
    except ProvisionError as exc:
        console.print(
            f"cannot create the event topic: {exc} (run it as the admin)", style="red", markup=False
        )
        raise typer.Exit(1) from None
    console.print(f"event topic {topic} is there")


@app.command()
def watch(
    directory: Annotated[Path, typer.Argument(exists=True, file_okay=False)],
    source: Source,
    mode: Annotated[
        str | None,
        typer.Option(help="close (inotify IN_CLOSE_WRITE; the default on Linux) or stable."),
    ] = None,
    stable_s: Annotated[
        float, typer.Option(min=0.01, help="Seconds a file's size must not change (stable).")
    ] = 2.0,
    include: Annotated[
        list[str] | None, typer.Option(help="A pattern of relative paths to watch (repeat it).")
    ] = None,
    exclude: Annotated[
        list[str] | None, typer.Option(help="A pattern of relative paths to ignore (repeat it).")
    ] = None,
    recursive: Annotated[bool, typer.Option(help="Also watch subdirectories.")] = False,
    scan_records: Annotated[
        int, typer.Option(min=1, help="Records per partition read at start to skip repeats.")
    ] = DEFAULT_SCAN_RECORDS,
    credentials: Credentials = None,
    bootstrap: Bootstrap = None,
    prefix: Prefix = "fx.",
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log each event.")] = False,
) -> None:
    """Write one event to events.<SOURCE> per complete file in DIRECTORY."""
    from fxstream.connectors.file_watcher import WATCH_MODES, FileWatcher

    _logging(verbose)
    if mode is not None and mode not in WATCH_MODES:
        console.print(
            f"--mode must be one of {', '.join(WATCH_MODES)}, not {mode!r}",
            style="red",
            markup=False,
        )
        raise typer.Exit(2)
    writer = EventWriter(
        _connection(credentials, bootstrap),
        source,
        role="watcher",
        catalogue=Catalogue(prefix),
        scan_records=scan_records,
    )
    watcher = FileWatcher(
        writer,
        directory,
        mode=mode,
        stable_s=stable_s,
        include=include or ["*"],
        exclude=exclude or [],
        recursive=recursive,
    )
    stop = _stop_on_signals()
    _announce_when(
        watcher.ready, stop, f"watching {watcher.root} ({watcher.mode}) -> {writer.topic}"
    )
    _run(watcher.run, stop)
    console.print(f"stopped: {watcher.emitted} events written")


@app.command()
def adios(
    path: Annotated[Path, typer.Argument(help="The BP5 file (directory) to follow.")],
    source: Source,
    idle_timeout_s: Annotated[
        float | None, typer.Option(help="Stop after this many seconds without a step.")
    ] = None,
    open_timeout_s: Annotated[float, typer.Option(help="Seconds to wait for the file.")] = 30.0,
    credentials: Credentials = None,
    bootstrap: Bootstrap = None,
    prefix: Prefix = "fx.",
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log each event.")] = False,
) -> None:
    """Write one event to events.<SOURCE> per step of the BP5 stream PATH."""
    from fxstream.connectors.adios_steps import Adios2StepSource

    _logging(verbose)
    writer = EventWriter(
        _connection(credentials, bootstrap), source, role="adios2", catalogue=Catalogue(prefix)
    )
    step_source = Adios2StepSource(
        writer, path, open_timeout_s=open_timeout_s, idle_timeout_s=idle_timeout_s
    )
    stop = _stop_on_signals()
    print(f"{READY_LINE} following {step_source.path} -> {writer.topic}", flush=True)
    _run(step_source.run, stop)
    console.print(f"stopped ({step_source.ended or 'signal'}): {step_source.emitted} events")


@app.command()
def topic(
    input_topic: Annotated[str, typer.Argument(help="The topic to read (its full name).")],
    source: Source,
    from_beginning: Annotated[
        bool, typer.Option(help="A new source starts at the topic's first record.")
    ] = True,
    credentials: Credentials = None,
    bootstrap: Bootstrap = None,
    prefix: Prefix = "fx.",
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log each event.")] = False,
) -> None:
    """Write one event to events.<SOURCE> per record of INPUT_TOPIC (by reference)."""
    from fxstream.connectors.topic_source import TopicEventSource

    _logging(verbose)
    writer = EventWriter(
        _connection(credentials, bootstrap), source, role="topic", catalogue=Catalogue(prefix)
    )
    topic_source = TopicEventSource(writer, input_topic, from_beginning=from_beginning)
    stop = _stop_on_signals()
    _announce_when(topic_source.ready, stop, f"{input_topic} -> {writer.topic}")
    _run(topic_source.run, stop)
    console.print(f"stopped: {topic_source.emitted} events written")


@app.command()
def sink(
    directory: Annotated[Path, typer.Argument(file_okay=False, help="The archive's root.")],
    kind: Annotated[
        list[str] | None,
        typer.Option(help="results, events or task_state (repeat it; default: all three)."),
    ] = None,
    max_rows: Annotated[int, typer.Option(min=1, help="Rows buffered before a flush.")] = 10_000,
    max_age_s: Annotated[
        float, typer.Option(min=0.01, help="Seconds the oldest buffered row waits.")
    ] = 30.0,
    group: Annotated[
        str | None, typer.Option(help="The consumer group (fixed per archive).")
    ] = None,
    credentials: Credentials = None,
    bootstrap: Bootstrap = None,
    prefix: Prefix = "fx.",
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log each flush.")] = False,
) -> None:
    """Archive results metadata, events and task-state changes to Parquet under DIRECTORY."""
    from fxstream.connectors.parquet_sink import DEFAULT_SINK_GROUP, KINDS, ParquetSink

    _logging(verbose)
    parquet_sink = ParquetSink(
        _connection(credentials, bootstrap),
        directory,
        catalogue=Catalogue(prefix),
        kinds=tuple(kind) if kind else KINDS,
        group=group or DEFAULT_SINK_GROUP,
        max_rows=max_rows,
        max_age_s=max_age_s,
    )
    stop = _stop_on_signals()
    _announce_when(parquet_sink.ready, stop, f"archiving into {parquet_sink.root}")
    _run(parquet_sink.run, stop)
    console.print(
        f"stopped: {parquet_sink.rows_written} rows in {parquet_sink.files_written} files"
    )


def main() -> None:
    """Entry point of ``fxstream-source``."""
    app()


if __name__ == "__main__":
    main()
