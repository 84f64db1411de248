"""The topic catalogue: names, templates, validation and cluster sizing."""

from __future__ import annotations

import pytest

from fxstream.topics import Catalogue, CleanupPolicy, InvalidTopicName

DESIGN_TOPICS = {
    "users": CleanupPolicy.COMPACT,
    "functions": CleanupPolicy.COMPACT,
    "endpoints": CleanupPolicy.COMPACT,
    "from.user.{user_id}": CleanupPolicy.DELETE,
    "tasks.ep.{endpoint_id}": CleanupPolicy.DELETE,
    "heartbeats": CleanupPolicy.DELETE,
    "endpoint-logs": CleanupPolicy.DELETE,
    "warm": CleanupPolicy.COMPACT,
    "data-locations": CleanupPolicy.COMPACT,
    "results.{user_id}": CleanupPolicy.DELETE,
    "task-state": CleanupPolicy.COMPACT,
    "task-events": CleanupPolicy.DELETE,
    "events.{source}": CleanupPolicy.DELETE,
    "triggers": CleanupPolicy.COMPACT,
    "held-tasks": CleanupPolicy.COMPACT,
    "analytics": CleanupPolicy.DELETE,
    "streams.{stream}": CleanupPolicy.DELETE,
    "from.ep.{endpoint_id}": CleanupPolicy.DELETE,
    "dead-letter": CleanupPolicy.DELETE,
}


def test_catalogue_holds_every_topic_of_the_design_with_its_policy() -> None:
    catalogue = Catalogue()
    assert {spec.name: spec.cleanup_policy for spec in catalogue.specs} == DESIGN_TOPICS


def test_static_topics_are_prefixed_and_exclude_templates() -> None:
    topics = Catalogue(prefix="prod.").static_topics()
    assert "prod.task-state" in topics
    assert all(name.startswith("prod.") for name in topics)
    assert not any("{" in name for name in topics)
    assert len(topics) == 13


def test_templates_fill_ids() -> None:
    catalogue = Catalogue()
    assert catalogue.endpoint_queue("3f2c-ep") == "fx.tasks.ep.3f2c-ep"
    assert catalogue.results("alice") == "fx.results.alice"
    assert catalogue.events("detector-7") == "fx.events.detector-7"
    assert catalogue.stream("camera-1") == "fx.streams.camera-1"
    assert catalogue.from_user("alice") == "fx.from.user.alice"
    assert catalogue.from_endpoint("3f2c-ep") == "fx.from.ep.3f2c-ep"


def test_the_sender_of_a_topic_is_read_from_its_name_only() -> None:
    catalogue = Catalogue()
    assert catalogue.user_of("fx.from.user.alice") == "alice"
    assert catalogue.endpoint_of("fx.from.ep.3f2c-ep") == "3f2c-ep"
    # Another family, another prefix, or an id Kafka names cannot hold: nobody.
    assert catalogue.user_of("fx.from.ep.alice") is None
    assert catalogue.endpoint_of("fx.from.user.3f2c-ep") is None
    assert catalogue.user_of("other.from.user.alice") is None
    assert catalogue.user_of("fx.from.user.a.b") is None
    assert catalogue.user_of("fx.from.user.") is None


def test_sender_patterns_match_exactly_their_family() -> None:
    import re

    catalogue = Catalogue(prefix="p.")
    users, endpoints = catalogue.from_user_pattern, catalogue.from_endpoint_pattern
    assert re.match(users, "p.from.user.alice")
    assert not re.match(users, "p.from.user.alice.x")
    assert not re.match(users, "pXfrom.user.alice")
    assert not re.match(users, "p.from.ep.e1")
    assert re.match(endpoints, "p.from.ep.e1")
    assert not re.match(endpoints, "p.tasks.ep.e1")


@pytest.mark.parametrize("bad", ["", "has space", "under_score", "dot.ted", "-lead", "x" * 129])
def test_ids_unusable_in_topic_names_are_refused_clearly(bad: str) -> None:
    with pytest.raises(InvalidTopicName, match="letters, digits and '-'"):
        Catalogue().endpoint_queue(bad)


def test_bad_prefix_names_the_setting() -> None:
    with pytest.raises(InvalidTopicName, match="FXSTREAM_TOPIC_PREFIX"):
        Catalogue(prefix="bad prefix/")


def test_spec_for_topic_recognises_templates() -> None:
    catalogue = Catalogue()
    assert catalogue.spec_for_topic("fx.tasks.ep.abc") is catalogue.spec("tasks.ep.{endpoint_id}")
    assert catalogue.spec_for_topic("fx.from.user.u1") is catalogue.spec("from.user.{user_id}")
    assert catalogue.spec_for_topic("fx.from.ep.e1") is catalogue.spec("from.ep.{endpoint_id}")
    assert catalogue.spec_for_topic("other.task-state") is None
    assert catalogue.spec_for_topic("fx.unknown") is None


def test_cluster_catalogue_replicates_three_ways_with_two_in_sync() -> None:
    cluster = Catalogue().for_cluster(3)
    assert (cluster.replication_factor, cluster.min_insync_replicas) == (3, 2)
    configs = cluster.spec("task-state").kafka_configs(
        min_insync_replicas=cluster.min_insync_replicas
    )
    assert configs["min.insync.replicas"] == "2"


def test_min_insync_cannot_exceed_replication() -> None:
    with pytest.raises(ValueError, match="cannot exceed"):
        Catalogue(replication_factor=1, min_insync_replicas=2)


def test_busy_compacted_topics_roll_segments_hourly_so_the_cleaner_can_compact() -> None:
    """Kafka compacts only rolled segments: without segment.ms a compacted topic keeps
    every superseded state and tombstone for up to a week (or 1 GiB a partition)."""
    catalogue = Catalogue()
    for name in ("task-state", "warm", "data-locations"):
        configs = catalogue.spec(name).kafka_configs(min_insync_replicas=1)
        assert configs["segment.ms"] == str(3_600_000), name
    assert "segment.ms" not in catalogue.spec("users").kafka_configs(min_insync_replicas=1)
