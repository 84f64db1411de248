"""How fast faust-streaming's windowed tables fold task states on this machine, next to the
analytics processor's own windows: the measurement docs/triggers.md "Windowed analytics"
quotes (issue 15 item 5: "if faust cannot keep up at the rates below, measure it").

``python -m tests.triggers.faust_window_rate [--states 20000]`` starts a private broker (no
services) in a temporary home, writes ``--states`` terminal task states to a topic of 8
partitions (as ``task-state`` has), then runs one faust worker (a subprocess) whose agent
folds each state into a tumbling (60 s) and a hopping (300 s every 60 s) windowed table
per user, function and endpoint (``table[key] += 1``, memory store, changelog topics
made by faust), and times it from the first state to the last, changelog flushed. The
same states are then folded by :class:`~fxstream.service.analytics.WindowedAggregates`
(counts, outcomes, states and the latency histogram) in this process. Every process is
stopped by PID. The last line is one JSON object: ``states``, ``faust_states_per_s``,
``analytics_states_per_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from fxstream.ops.private import private_platform
from fxstream.service.analytics import WindowedAggregates
from fxstream.topics import (
    KafkaConnection,
    TaskState,
    TaskStateName,
    TaskTimings,
    decode,
    encode,
    write_secret_file,
)

PARTITIONS = 8


def _states(count: int) -> list[TaskState]:
    now = time.time()
    return [
        TaskState(
            task_id=str(uuid.uuid4()),
            user_id=f"user-{n % 3}",
            function_id=f"fn-{n % 7}",
            endpoint_id=f"ep-{n % 2}",
            state=TaskStateName.SUCCEEDED if n % 5 else TaskStateName.FAILED,
            updated_at=now - 60 + n * 60 / count,
            timings=TaskTimings(submitted_at=now - 61 + n * 60 / count),
        )
        for n in range(count)
    ]


def _worker(kafka: KafkaConnection, topic: str, count: int) -> None:
    """The faust worker: fold ``count`` states, print the rate as JSON, exit."""
    import faust  # only in the worker process

    settings: dict[str, Any] = {"broker": f"kafka://{kafka.bootstrap}"}
    if kafka.secure:
        client = kafka.aiokafka()
        settings["broker_credentials"] = faust.SASLCredentials(
            username=client["sasl_plain_username"],
            password=client["sasl_plain_password"],
            ssl_context=client["ssl_context"],
            mechanism=client["sasl_mechanism"],
        )
    app = faust.App(
        f"faust-window-rate-{uuid.uuid4().hex[:8]}",
        **settings,
        store="memory://",
        key_serializer="raw",
        value_serializer="raw",
        web_enabled=False,
        topic_partitions=PARTITIONS,
        consumer_auto_offset_reset="earliest",
        datadir=tempfile.mkdtemp(prefix="faust-window-rate-"),
    )
    expires = timedelta(seconds=900)
    tumbling = app.Table("tumbling", default=int, partitions=PARTITIONS).tumbling(
        60, expires=expires
    )
    hopping = app.Table("hopping", default=int, partitions=PARTITIONS).hopping(
        300, 60, expires=expires
    )
    seen = {"n": 0, "first": 0.0}

    @app.agent(app.topic(topic))
    async def fold(stream: Any) -> None:
        async for value in stream:
            if seen["n"] == 0:
                seen["first"] = time.perf_counter()
            state = decode(value, TaskState)
            for key in (
                f"user|{state.user_id}",
                f"function|{state.function_id}",
                f"endpoint|{state.endpoint_id}",
            ):
                tumbling[key] += 1
                hopping[key] += 1
            seen["n"] += 1
            if seen["n"] == count:
                await app.producer.flush()
                elapsed = time.perf_counter() - seen["first"]
                print(json.dumps({"faust_states_per_s": count / elapsed}), flush=True)
                os._exit(0)

    worker = faust.Worker(app, loglevel="WARNING", quiet=True, redirect_stdouts=False)
    worker.execute_from_commandline()


def main(argv: list[str] | None = None) -> int:
    """Run the measurement; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tests.triggers.faust_window_rate")
    parser.add_argument("--states", type=int, default=20_000)
    parser.add_argument("--worker", nargs=2, metavar=("CREDENTIALS", "TOPIC"))
    args = parser.parse_args(argv)
    if args.worker:
        credentials, topic = args.worker
        _worker(KafkaConnection.from_file(Path(credentials)), topic, args.states)
        return 1  # not reached: the worker exits when done
    states = _states(args.states)
    encoded = [encode(s) for s in states]
    with (
        tempfile.TemporaryDirectory() as home,
        private_platform(Path(home), services=False) as platform,
    ):
        kafka = platform.kafka
        topic = f"faust-window-rate-{uuid.uuid4().hex[:8]}"
        admin = AdminClient({**kafka.confluent(), "log_level": 2})
        admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(30)
        producer = Producer({**kafka.confluent(), "linger.ms": 20, "log_level": 2})
        for state, raw in zip(states, encoded, strict=True):
            producer.produce(topic, key=state.task_id.encode(), value=raw)
            producer.poll(0)
        assert producer.flush(60) == 0
        credentials = Path(home) / "kafka.json"
        write_secret_file(credentials, json.dumps(kafka.to_json()).encode())
        command = [
            sys.executable,
            "-m",
            "tests.triggers.faust_window_rate",
            "--states",
            str(args.states),
            "--worker",
            str(credentials),
            topic,
        ]
        worker = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        try:
            out, _ = worker.communicate(timeout=600)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        found = [line for line in out.splitlines() if line.startswith('{"faust_states_per_s"')]
        if not found:
            raise SystemExit(f"the faust worker did not finish (exit {worker.returncode})")
        faust_rate = json.loads(found[-1])["faust_states_per_s"]
    aggregates = WindowedAggregates()
    began = time.perf_counter()
    for raw in encoded:
        aggregates.observe(decode(raw, TaskState), time.time())
    aggregates.flush(time.time())
    analytics_rate = len(encoded) / (time.perf_counter() - began)
    print(f"faust windowed tables: {faust_rate:,.0f} states/s")
    print(f"analytics processor windows: {analytics_rate:,.0f} states/s")
    print(
        json.dumps(
            {
                "states": args.states,
                "faust_states_per_s": round(faust_rate),
                "analytics_states_per_s": round(analytics_rate),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
