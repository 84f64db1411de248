"""ensure_topics against the real broker: create, re-run as a no-op, report drift."""

from __future__ import annotations

from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic

from fxstream.topics import Catalogue, ensure_topics
from tests.conftest import RunningPlatform


def test_create_then_rerun_is_a_noop(
    kafka_platform: RunningPlatform, unique_prefix: str, topic_cleanup: list[str]
) -> None:
    admin = kafka_platform.admin()
    catalogue = Catalogue(prefix=unique_prefix)
    topic_cleanup.extend(catalogue.static_topics())

    first = ensure_topics(admin, catalogue)
    assert sorted(first.created) == sorted(catalogue.static_topics())
    assert first.ok

    second = ensure_topics(admin, catalogue)
    assert second.created == []
    assert sorted(second.unchanged) == sorted(catalogue.static_topics())
    assert second.ok

    described = admin.list_topics(timeout=10).topics
    for name, spec in catalogue.static_topics().items():
        assert len(described[name].partitions) == spec.partitions


def test_check_only_reports_missing_topics_without_creating(
    kafka_platform: RunningPlatform, unique_prefix: str
) -> None:
    admin = kafka_platform.admin()
    catalogue = Catalogue(prefix=unique_prefix)
    report = ensure_topics(admin, catalogue, create=False)
    assert sorted(report.missing) == sorted(catalogue.static_topics())
    assert not report.ok
    assert not set(catalogue.static_topics()) & set(admin.list_topics(timeout=10).topics)


def test_drift_is_reported_not_silently_ignored(
    kafka_platform: RunningPlatform, unique_prefix: str, topic_cleanup: list[str]
) -> None:
    admin = kafka_platform.admin()
    catalogue = Catalogue(prefix=unique_prefix)
    heartbeats, dead_letter = catalogue.heartbeats, catalogue.dead_letter
    topic_cleanup.extend(catalogue.static_topics())
    # Someone made these by hand: wrong partition count, and a changed retention.
    admin.create_topics([NewTopic(heartbeats, num_partitions=1, replication_factor=1)])[
        heartbeats
    ].result(timeout=30)
    ensure_topics(admin, catalogue, {dead_letter: catalogue.spec("dead-letter")})
    resource = ConfigResource(
        ConfigResource.Type.TOPIC,
        dead_letter,
        incremental_configs=[
            ConfigEntry("retention.ms", "1000", incremental_operation=AlterConfigOpType.SET)
        ],
    )
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(timeout=30)

    report = ensure_topics(admin, catalogue)
    drift = {(d.topic, d.setting): (d.expected, d.actual) for d in report.drifted}
    assert drift[(heartbeats, "partitions")] == ("4", "1")
    # Made with broker defaults, so its retention is the broker's 7 days, not the catalogue's 6 h.
    assert drift[(heartbeats, "retention.ms")] == (str(6 * 3_600_000), str(7 * 24 * 3_600_000))
    assert drift[(dead_letter, "retention.ms")] == (str(30 * 24 * 3_600_000), "1000")
    assert not report.ok
    assert heartbeats not in report.created
    # Drift is reported, never "fixed" behind the operator's back.
    assert len(admin.list_topics(timeout=10).topics[heartbeats].partitions) == 1
    assert "partitions is 1, catalogue says 4" in " ".join(str(d) for d in report.drifted)
