"""The broker's own counters and JFR recording that ``./fx bench profile`` reads, against
the session's real broker: requests by API and records by topic move by what a producer
wrote; a JFR recording of the broker is written and summarised."""

from __future__ import annotations

from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import NewTopic

from fxstream.ops.bench.broker_counters import BrokerCounters, per_item
from fxstream.ops.bench.broker_jfr import BrokerRecording, summarise_jfr_text
from tests.conftest import RunningPlatform

RECORDS = 500


def _broker_pid(kafka_platform: RunningPlatform) -> int:
    pid = kafka_platform.platform.nodes(cluster=False)[0].process.pid()
    assert pid is not None
    return pid


def _create(kafka_platform: RunningPlatform, topic: str) -> None:
    admin = kafka_platform.admin()
    for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        future.result(timeout=30)


def _produce(kafka_platform: RunningPlatform, topic: str, records: int) -> None:
    producer = Producer({**kafka_platform.kafka.confluent(), "linger.ms": 5, "log_level": 2})
    for n in range(records):
        producer.produce(topic, key=str(n).encode(), value=b"x" * 100)
        producer.poll(0)
    assert producer.flush(30) == 0


def test_the_counters_count_what_a_producer_wrote(
    kafka_platform: RunningPlatform, unique_prefix: str, topic_cleanup: list[str]
) -> None:
    topic = f"{unique_prefix}counted"
    topic_cleanup.append(topic)
    _create(kafka_platform, topic)
    with BrokerCounters(_broker_pid(kafka_platform)) as counters:
        before = counters.read()
        _produce(kafka_platform, topic, RECORDS)
        after = counters.read()
    assert after.records_in.get(topic, 0) - before.records_in.get(topic, 0) == RECORDS
    requests = per_item(before.requests, after.requests, 1)
    assert requests.get("Produce", 0) >= 1
    assert requests.get("Metadata", 0) >= 1  # the new producer asked where the topic is


def test_a_probe_that_cannot_attach_says_why() -> None:
    with pytest.raises(RuntimeError, match="probe stopped"):
        BrokerCounters(2**22 + 1)  # above Linux's pid_max: no such process


def test_a_jfr_recording_of_the_broker_is_written_and_summarised(
    kafka_platform: RunningPlatform, unique_prefix: str, topic_cleanup: list[str], tmp_path: Path
) -> None:
    topic = f"{unique_prefix}recorded"
    topic_cleanup.append(topic)
    _create(kafka_platform, topic)
    recording = BrokerRecording(_broker_pid(kafka_platform), tmp_path / "broker.jfr")
    recording.start()
    try:
        for _ in range(5):
            _produce(kafka_platform, topic, 5_000)
    finally:
        summary = recording.stop()
    assert (tmp_path / "broker.jfr").stat().st_size > 0
    assert summary["samples"] > 0
    assert abs(sum(summary["threads"].values()) - 100.0) < 1.0


JFR_TEXT = """\
jdk.ExecutionSample {
  startTime = 10:58:19.903
  sampledThread = "data-plane-kafka-request-handler-0" (javaThreadId = 76)
  state = "STATE_RUNNABLE"
  stackTrace = [
    scala.collection.convert.AsScalaConverters.asScala$(AsScalaConverters, Iterator) line: 40
    kafka.server.AuthHelper.filterByAuthorized(RequestContext, AclOperation) line: 114
    kafka.server.KafkaApis.handleFetchRequest(RequestChannel$Request) line: 611
    kafka.server.KafkaApis.handle(RequestChannel$Request, RequestLocal) line: 171
    java.lang.Thread.run() line: 840
  ]
}

jdk.ExecutionSample {
  startTime = 10:58:19.913
  sampledThread = "data-plane-kafka-network-thread-1-ListenerName(SASL_SSL)-SASL_SSL-2"
  state = "STATE_RUNNABLE"
  stackTrace = [
    com.sun.crypto.provider.GaloisCounterMode.encrypt(byte[], int) line: 1
    sun.security.ssl.SSLEngineImpl.wrap(ByteBuffer[], int) line: 2
    org.apache.kafka.common.network.SslTransportLayer.write(ByteBuffer[]) line: 3
  ]
}
"""


def test_jfr_samples_are_counted_by_thread_api_area_and_self_time() -> None:
    summary = summarise_jfr_text(JFR_TEXT)
    assert summary["samples"] == 2
    assert summary["threads"] == {"request handlers": 50.0, "network threads": 50.0}
    assert summary["apis"] == {"Fetch": 50.0}
    assert summary["areas"]["TLS"] == 50.0
    assert summary["areas"]["authorisation (ACLs)"] == 50.0
    assert summary["areas"]["ciphers (AES-GCM, SHA)"] == 50.0
    assert summary["top_self"] == {
        "scala.collection.convert.AsScalaConverters.asScala$": 50.0,
        "com.sun.crypto.provider.GaloisCounterMode.encrypt": 50.0,
    }
