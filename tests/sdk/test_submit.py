"""Submissions land on the user's from.user topic as valid TaskSubmission records, or are
refused first."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from fxstream.sdk import Client, ConfigurationError, Executor, MPIFunction, PayloadTooLarge
from fxstream.topics import (
    ResourceSpecification,
    SerializationError,
    Serializer,
    client_info,
    encode,
)
from tests.conftest import write_kafka_credentials
from tests.sdk.conftest import CODE_DIGEST, OfflineClient, SdkTopics
from tests.sdk.streams import end_offsets, read_from, submissions

ENDPOINT = "ep-submit"


def test_run_produces_a_valid_submission_with_the_packed_arguments(
    client: Client, sdk_topics: SdkTopics
) -> None:
    topic = sdk_topics.submissions
    start = end_offsets(sdk_topics.kafka, topic)
    before = time.time()
    task_id = client.run(1, "two", endpoint_id=ENDPOINT, function_id="fn-a", three=[3, 3.0])
    after = time.time()

    [(key, record)] = list(submissions(read_from(sdk_topics.kafka, topic, start, count=1)))
    assert key == task_id == record.task_id
    assert uuid.UUID(task_id).version == 4
    assert record.function_id == "fn-a"
    assert record.endpoint_id == ENDPOINT
    assert record.user_id == sdk_topics.user_id
    # No credential travels: the topic says who submitted; the code digest is pinned.
    assert record.function_sha256 == CODE_DIGEST
    assert sdk_topics.token.encode() not in encode(record)
    assert record.client == client_info()
    assert before <= record.submitted_at <= after
    # Globus Compute's session task group: run() tasks can be reloaded later.
    assert record.task_group_id == client.session_task_group_id
    assert Serializer().unpack_arguments(record.payload) == ((1, "two"), {"three": [3, 3.0]})


def test_batch_run_sends_every_task_with_its_group(client: Client, sdk_topics: SdkTopics) -> None:
    topic = sdk_topics.submissions
    start = end_offsets(sdk_topics.kafka, topic)
    group = str(uuid.uuid4())
    batch = client.create_batch(task_group_id=group)
    batch.add("fn-a", args=(1,))
    batch.add("fn-b", kwargs={"x": 2})
    batch.add("fn-a", args=(3,), kwargs={"y": "z"})
    assert len(batch) == 3

    sent = client.batch_run(ENDPOINT, batch)
    # Globus Compute's answer: task ids by function, in the order added.
    assert set(sent) == {"request_id", "task_group_id", "endpoint_id", "tasks"}
    assert sent["task_group_id"] == group and sent["endpoint_id"] == ENDPOINT
    assert list(sent["tasks"]) == ["fn-a", "fn-b"]
    (a1, a3), (b2,) = sent["tasks"]["fn-a"], sent["tasks"]["fn-b"]
    task_ids = [a1, b2, a3]
    assert len(set(task_ids)) == 3

    found = dict(submissions(read_from(sdk_topics.kafka, topic, start, count=3)))
    assert set(found) == set(task_ids)
    unpack = Serializer().unpack_arguments
    expected = [("fn-a", ((1,), {})), ("fn-b", ((), {"x": 2})), ("fn-a", ((3,), {"y": "z"}))]
    for task_id, (function_id, arguments) in zip(task_ids, expected, strict=True):
        record = found[task_id]
        assert record.function_id == function_id
        assert record.task_group_id == group
        assert unpack(record.payload) == arguments


def test_a_batch_without_a_group_runs_in_the_session_group_and_an_empty_one_is_refused(
    client: Client, sdk_topics: SdkTopics
) -> None:
    topic = sdk_topics.submissions
    start = end_offsets(sdk_topics.kafka, topic)
    with pytest.raises(ValueError, match="no tasks in the batch"):
        client.batch_run(ENDPOINT, client.create_batch())
    batch = client.create_batch(create_websocket_queue=True)
    batch.add("fn-a", args=(1,))
    batch.add("fn-a", args=(2,))
    prepared = batch.prepare()
    assert prepared["task_group_id"] is None and prepared["resource_specification"] is None
    assert [Serializer().unpack_arguments(p) for p in prepared["tasks"]["fn-a"]] == [
        ((1,), {}),
        ((2,), {}),
    ]
    sent = client.batch_run(ENDPOINT, batch)
    assert sent["task_group_id"] == client.session_task_group_id
    found = dict(submissions(read_from(sdk_topics.kafka, topic, start, count=2)))
    assert set(found) == set(sent["tasks"]["fn-a"])
    assert {r.task_group_id for r in found.values()} == {client.session_task_group_id}
    with pytest.raises(ValueError, match="user_endpoint_config is not supported"):
        client.create_batch(user_endpoint_config={"worker_init": "module load x"})


def test_the_executor_takes_globus_computes_positional_parameters(client: Client) -> None:
    group = str(uuid.uuid4())
    ex = Executor(ENDPOINT, client, group, {"num_nodes": 1, "ranks_per_node": 2}, None, "mine")
    try:
        assert ex.task_group_id == group
        assert ex.resource_specification == {"num_nodes": 1, "ranks_per_node": 2, "num_ranks": 2}
        assert ex.label == "mine" and "label='mine'" in repr(ex)
        assert ex.serializer is client.serializer
        assert ex.task_count_submitted == 0
        ex.submit_to_registered_function("fn-mpi", (1,))
        ex.submit_to_registered_function("fn-mpi", (2,))
        # Counted once Kafka acknowledged each record (sent upstream, as Globus Compute's).
        deadline = time.monotonic() + 30
        while ex.task_count_submitted < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ex.task_count_submitted == 2
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
    with pytest.raises(ValueError, match="configured by its owner"):
        Executor(ENDPOINT, client, user_endpoint_config={"account": "abc"})


def test_executor_submissions_carry_the_task_group_and_future_ids(
    client: Client, sdk_topics: SdkTopics
) -> None:
    topic = sdk_topics.submissions
    start = end_offsets(sdk_topics.kafka, topic)
    ex = Executor(endpoint_id=ENDPOINT, client=client, batch_size=4)
    futures = [ex.submit_to_registered_function("fn-c", (i,)) for i in range(10)]
    found = dict(submissions(read_from(sdk_topics.kafka, topic, start, count=10)))
    ex.shutdown(wait=False, cancel_futures=True)
    assert set(found) == {f.task_id for f in futures}
    for i, future in enumerate(futures):
        record = found[future.task_id]
        assert record.task_group_id == ex.task_group_id
        assert Serializer().unpack_arguments(record.payload) == ((i,), {})


def test_a_resource_specification_of_the_executor_or_the_batch_travels_completed(
    client: Client, sdk_topics: SdkTopics
) -> None:
    topic = sdk_topics.submissions
    start = end_offsets(sdk_topics.kafka, topic)
    ex = Executor(
        endpoint_id=ENDPOINT, client=client, resource_specification={"num_nodes": 2, "num_ranks": 4}
    )
    assert ex.resource_specification == {"num_nodes": 2, "ranks_per_node": 2, "num_ranks": 4}
    first = ex.submit_to_registered_function("fn-mpi", (1,))
    ex.resource_specification = None
    plain = ex.submit_to_registered_function("fn-mpi", (2,))
    batch = client.create_batch(resource_specification={"num_nodes": 1, "ranks_per_node": 3})
    batch.add("fn-mpi", args=(3,))
    [batched] = client.batch_run(ENDPOINT, batch)["tasks"]["fn-mpi"]
    found = dict(submissions(read_from(sdk_topics.kafka, topic, start, count=3)))
    ex.shutdown(wait=False, cancel_futures=True)
    assert found[first.task_id].resource_specification == ResourceSpecification(
        num_nodes=2, ranks_per_node=2, num_ranks=4
    )
    assert found[plain.task_id].resource_specification is None
    assert found[batched].resource_specification == ResourceSpecification(
        num_nodes=1, ranks_per_node=3, num_ranks=3
    )


def test_a_bad_resource_specification_or_an_mpi_function_without_one_is_refused(
    client: Client,
) -> None:
    with pytest.raises(ValueError, match="num_nodes x ranks_per_node"):
        Executor(
            endpoint_id=ENDPOINT,
            client=client,
            resource_specification={"num_nodes": 2, "ranks_per_node": 2, "num_ranks": 3},
        )
    ex = Executor(endpoint_id=ENDPOINT, client=client)
    with pytest.raises(ValueError, match="unknown key"):
        ex.resource_specification = {"nodes": 2}
    with pytest.raises(ValueError, match="MPIFunction needs a resource_specification"):
        ex.submit(MPIFunction("hostname"))
    with pytest.raises(ValueError, match="positive integer"):
        client.create_batch(resource_specification={"num_nodes": -1})
    ex.shutdown(wait=False, cancel_futures=True)


def test_arguments_above_the_inline_limit_are_refused_before_sending(
    client: Client, sdk_topics: SdkTopics
) -> None:
    topic = sdk_topics.submissions
    client.start()
    start = end_offsets(sdk_topics.kafka, topic)
    big = os.urandom(600 * 1024)

    with pytest.raises(PayloadTooLarge) as caught:
        client.run(big, endpoint_id=ENDPOINT, function_id="fn-big")
    error = caught.value
    message = str(error)
    assert error.limit == 512 * 1024 and error.size > error.limit
    assert error.setting == "max_inline_bytes"
    assert f"{error.size:,} bytes" in message and "524,288 bytes" in message
    assert "max_inline_bytes" in message and "FXSTREAM_MAX_INLINE_BYTES" in message
    assert "store_url" in message and "FXSTREAM_STORE_URL" in message

    ex = Executor(endpoint_id=ENDPOINT, client=client)
    with pytest.raises(PayloadTooLarge):
        ex.submit_to_registered_function("fn-big", (big,))
    assert ex.outstanding == 0
    ex.shutdown()
    with pytest.raises(PayloadTooLarge):
        client.create_batch().add("fn-big", kwargs={"data": big})

    time.sleep(0.5)  # anything sent would be on the broker by now
    assert end_offsets(sdk_topics.kafka, topic) == start


def test_a_record_above_the_topic_limit_is_refused_naming_the_topic(
    sdk_topics: SdkTopics,
) -> None:
    topic = sdk_topics.submissions
    start = end_offsets(sdk_topics.kafka, topic)
    with (
        sdk_topics.client(max_inline_bytes=8 * 1024 * 1024) as roomy,
        pytest.raises(PayloadTooLarge) as caught,
    ):
        roomy.run(os.urandom(1_100_000), endpoint_id=ENDPOINT, function_id="fn-big")
    error = caught.value
    assert error.setting == "max_message_bytes"
    assert error.limit == sdk_topics.catalogue.spec("from.user.{user_id}").max_message_bytes
    assert topic in str(error) and "max.message.bytes" in str(error)
    assert "proxy store" in str(error)
    assert end_offsets(sdk_topics.kafka, topic) == start


def test_a_payload_just_under_the_record_limit_is_accepted_by_the_broker(
    sdk_topics: SdkTopics,
) -> None:
    topic = sdk_topics.submissions
    start = end_offsets(sdk_topics.kafka, topic)
    data = os.urandom(1_040_000)  # incompressible: lz4 cannot shrink it under the limit
    with sdk_topics.client(max_inline_bytes=2 * 1024 * 1024) as roomy:
        task_id = roomy.run(data, endpoint_id=ENDPOINT, function_id="fn-big")
    [(key, record)] = list(submissions(read_from(sdk_topics.kafka, topic, start, count=1)))
    assert key == task_id
    assert Serializer().unpack_arguments(record.payload) == ((data,), {})


def test_the_inline_limit_comes_from_the_environment(sdk_topics: SdkTopics, tmp_path: Path) -> None:
    # The Kafka principal comes from the credentials file; the rest from the variables.
    credentials = write_kafka_credentials(sdk_topics.kafka, tmp_path / "credentials.json")
    env = {
        "FXSTREAM_CREDENTIALS": str(credentials),
        "FXSTREAM_SERVICE_URL": sdk_topics.service_url,
        "FXSTREAM_TOPIC_PREFIX": sdk_topics.catalogue.prefix,
        "FXSTREAM_USER_ID": sdk_topics.user_id,
        "FXSTREAM_TOKEN": sdk_topics.token,
        "FXSTREAM_MAX_INLINE_BYTES": "1000",
    }
    with OfflineClient.from_environment(env) as small:
        assert small.max_inline_bytes == 1000
        with pytest.raises(PayloadTooLarge, match="1,000 bytes"):
            small.run("x" * 2000, endpoint_id=ENDPOINT, function_id="fn-a")
        assert small.run("x" * 100, endpoint_id=ENDPOINT, function_id="fn-a")


def test_invalid_fields_and_unserializable_arguments_are_refused(
    client: Client, sdk_topics: SdkTopics
) -> None:
    topic = sdk_topics.submissions
    client.start()
    start = end_offsets(sdk_topics.kafka, topic)
    with pytest.raises(ValueError, match="endpoint_id"):
        client.run(endpoint_id="not an id!", function_id="fn-a")
    with pytest.raises(SerializationError, match="argument 0: dill cannot serialize generator"):
        client.run((x for x in "ab"), endpoint_id=ENDPOINT, function_id="fn-a")
    time.sleep(0.5)
    assert end_offsets(sdk_topics.kafka, topic) == start


def test_submitting_without_a_token_names_the_setting(sdk_topics: SdkTopics) -> None:
    with (
        Client(
            sdk_topics.service_url,
            kafka=sdk_topics.kafka,
            topic_prefix=sdk_topics.catalogue.prefix,
            user_id=sdk_topics.user_id,
        ) as anonymous,
        pytest.raises(ConfigurationError, match="FXSTREAM_TOKEN"),
    ):
        anonymous.run(endpoint_id=ENDPOINT, function_id="fn-a")
