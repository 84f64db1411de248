"""Bad input end to end: the whole platform, as ``./fx up`` runs it, under fuzzed records.

Hypothesis makes a sample of bad records for each consumed topic
(``tasks.submitted``, ``heartbeats``, the user's ``results.<user>`` and the
endpoint's queue) and they are produced while real tasks run. Every bad record
must reach the dead-letter topic with a reason from the component that reads
it, every real task must complete with its value, and no process may exit.
Then fuzzed requests hit the real API process: never a 5xx, always a JSON
error, and the process stays up.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    Message,
    Producer,
    TopicPartition,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fxstream.ops import Platform
from fxstream.ops.services import Credentials
from fxstream.sdk import Client, ClientSettings, Executor
from fxstream.topics import Catalogue, DeadLetter, KafkaConnection, Record, decode
from tests.conftest import private_config
from tests.fuzz.api_fuzz import ApiRequest, KnownIds, assert_answer_is_sane, requests, send
from tests.fuzz.checks import assert_kept
from tests.fuzz.strategies import (
    BadValue,
    bad_values,
    headers,
    keys,
    new_id,
    valid_dispatch,
    valid_heartbeat,
    valid_result,
    valid_submission,
)

pytestmark = pytest.mark.platform

PER_TOPIC = 50  # 200 bad records in all
GOOD_TASKS = 200

# One example, no shrinking: each example costs a full run on the platform, and a
# failure names the offending record itself (topic, offset, how it was made).
ONCE = settings(
    max_examples=1,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)


@dataclass
class Stack:
    """The module's platform, its local user and endpoint."""

    platform: Platform
    kafka: KafkaConnection
    catalogue: Catalogue
    credentials_file: Path
    credentials: Credentials
    endpoint_id: str

    def client(self) -> Client:
        """A client of the local user (the caller closes it)."""
        env = {"FXSTREAM_CREDENTIALS": str(self.credentials_file)}
        return Client.from_settings(ClientSettings.from_environment(env))

    def pids(self) -> dict[str, int | None]:
        """The PID of each service process."""
        return {p.name: p.pid() for p in self.platform.services().processes()}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    platform = Platform(private_config(tmp_path_factory.mktemp("fuzz-e2e")))
    try:
        connection = platform.up(services=True)
        services = platform.services()
        endpoint_id = services.local_endpoint_id()
        credentials = Credentials.load(services.credentials_file)
        assert endpoint_id is not None and credentials is not None
        yield Stack(
            platform,
            platform.kafka(cluster=False),
            Catalogue(prefix=connection.topic_prefix),
            services.credentials_file,
            credentials,
            endpoint_id,
        )
    finally:
        platform.down()


def assert_alive(stack: Stack, before: dict[str, int | None]) -> None:
    """Every service process of ``before`` still runs with the same PID."""
    assert all(pid is not None for pid in before.values()), before
    assert stack.pids() == before, f"a process exited or restarted: {before} -> {stack.pids()}"
    for name, pid in before.items():
        assert pid is not None
        process = psutil.Process(pid)
        assert process.status() != psutil.STATUS_ZOMBIE, name


def double(x: int) -> int:
    return 2 * x


Headers = list[tuple[str, bytes | None]]
BadRecord = tuple[str, bytes | None, BadValue, Headers]


@dataclass(frozen=True)
class Sent:
    """A bad record on the broker: where it is and how it was made."""

    topic: str
    partition: int
    offset: int
    how: BadValue


def produce_all(kafka: KafkaConnection, records: list[BadRecord]) -> list[Sent]:
    """Produce ``(topic, key, bad value, headers)`` records; their coordinates once acknowledged."""
    producer = Producer({**kafka.confluent(), "acks": "all", "log_level": 2})
    sent: list[Sent] = []
    failures: list[str] = []
    for topic, key, bad, record_headers in records:

        def report(error: KafkaError | None, message: Message, bad: BadValue = bad) -> None:
            partition, offset = message.partition(), message.offset()
            if error is not None or partition is None or offset is None:
                failures.append(f"{bad!r}: {error}")
            else:
                sent.append(Sent(message.topic() or "", partition, offset, bad))

        producer.produce(
            topic,
            key=key,
            value=bad.value,
            headers=list[tuple[str, str | bytes | None]](record_headers),
            on_delivery=report,
        )
        producer.poll(0)
    assert producer.flush(60) == 0
    assert not failures, failures
    return sent


def read_dead_letters(
    kafka: KafkaConnection,
    catalogue: Catalogue,
    wanted: set[tuple[str, int, int]],
    timeout_s: float,
) -> dict[tuple[str, int, int], list[DeadLetter]]:
    """Dead letters by their original coordinates, until all of ``wanted`` are in (or timeout)."""
    consumer = Consumer({**kafka.confluent(), "group.id": "unused", "log_level": 2})
    topic = catalogue.dead_letter
    partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    letters: dict[tuple[str, int, int], list[DeadLetter]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while not wanted <= letters.keys() and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None or message.error() is not None:
                continue
            letter = decode(message.value(), DeadLetter)
            coordinates = (letter.original_topic, letter.original_partition, letter.original_offset)
            letters.setdefault(coordinates, []).append(letter)
    finally:
        consumer.close()
    return letters


def test_bad_records_on_every_topic_are_dead_lettered_while_tasks_run(stack: Stack) -> None:
    catalogue, user_id = stack.catalogue, stack.credentials.user_id
    submission = valid_submission(
        user_id=user_id, function_id=new_id(), endpoint_id=stack.endpoint_id, token="x"
    )
    samples: dict[str, Record] = {
        catalogue.tasks_submitted: submission,
        catalogue.heartbeats: valid_heartbeat(endpoint_id=new_id()),
        catalogue.results(user_id): valid_result(user_id=user_id),
        catalogue.endpoint_queue(stack.endpoint_id): valid_dispatch(submission),
    }
    readers = {
        catalogue.tasks_submitted: "router",
        catalogue.heartbeats: "liveness",
        catalogue.results(user_id): "task-state",
        catalogue.endpoint_queue(stack.endpoint_id): f"agent {stack.endpoint_id}",
    }
    before = stack.pids()

    @ONCE
    @given(
        data=st.tuples(
            *(
                st.lists(
                    st.tuples(keys, bad_values(sample), headers),
                    min_size=PER_TOPIC,
                    max_size=PER_TOPIC,
                )
                for sample in samples.values()
            )
        )
    )
    def run(
        data: tuple[list[tuple[bytes | None, BadValue, list[tuple[str, bytes | None]]]], ...],
    ) -> None:
        bad = [
            (topic, key, value, record_headers)
            for topic, drawn in zip(samples, data, strict=True)
            for key, value, record_headers in drawn
        ]
        client = stack.client()
        try:
            with Executor(endpoint_id=stack.endpoint_id, client=client) as executor:
                futures = [executor.submit(double, i) for i in range(GOOD_TASKS // 2)]
                sent = produce_all(stack.kafka, bad)
                futures += [executor.submit(double, i) for i in range(GOOD_TASKS // 2, GOOD_TASKS)]
                values = [f.result(timeout=120) for f in futures]
        finally:
            client.close()
        assert values == [2 * i for i in range(GOOD_TASKS)]
        assert len(sent) == PER_TOPIC * len(samples)
        wanted = {(s.topic, s.partition, s.offset) for s in sent}
        letters = read_dead_letters(stack.kafka, catalogue, wanted, timeout_s=90)
        missing = [s for s in sent if (s.topic, s.partition, s.offset) not in letters]
        assert not missing, f"{len(missing)} bad records not dead-lettered, e.g. {missing[:5]}"
        for s in sent:
            for letter in letters[(s.topic, s.partition, s.offset)]:
                assert letter.reason.strip(), s
                assert letter.component == readers[s.topic], (s, letter.component)
                assert_kept(
                    letter.original_value, letter.original_value_digest, s.how.value, str(s)
                )
        assert_alive(stack, before)

    run()


def test_fuzzed_requests_to_the_real_api_never_5xx_and_it_stays_up(stack: Stack) -> None:
    before = stack.pids()
    token = stack.credentials.token
    with httpx.Client(base_url=stack.credentials.service_url, timeout=30) as http:
        # Its own function and endpoint: the fuzz may delete them, never the local endpoint.
        auth = {"Authorization": f"Bearer {token}"}
        client = stack.client()
        try:
            function_id = client.register_function(double)
        finally:
            client.close()
        endpoint = http.post("/v1/endpoints", json={"name": "fuzzed"}, headers=auth)
        assert endpoint.status_code == 201, endpoint.text
        known = KnownIds(
            token, stack.credentials.user_id, function_id, endpoint.json()["endpoint_id"]
        )

        @settings(ONCE, max_examples=150, phases=[Phase.generate, Phase.shrink])
        @given(request=requests(known))
        def check(request: ApiRequest) -> None:
            assert_answer_is_sane(request, send(http, request))

        check()
        assert http.get("/v1/health").json() == {"status": "ok", "kafka": True}
    assert_alive(stack, before)
