"""The processors' explicit subscriptions: what a TopicFeed names, and a processor following it.

Real broker and topics throughout. The feed's sources are real registry views reading
records this test writes (the records the API writes); its listing is the cluster's.
The last test runs the ingress processor and registers an endpoint after it started:
the endpoint's records are forwarded well before the 30 s listing could have found its
topic, so the registry (not a timer) brought it in.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fxstream.service.registry import RegistryView
from fxstream.service.subscription import TopicFeed, endpoint_topics, user_topics
from fxstream.service.topic_directory import TopicDirectory
from fxstream.service.view_follower import ViewFollower
from fxstream.topics import encode, ensure_topics
from tests.conftest import RunningPlatform
from tests.service.test_ingress import USER, result, stamp_of
from tests.service.test_router import Deployment, Processors, key_is

WAIT_S = 20.0


@pytest.fixture
def dep(kafka_platform: RunningPlatform) -> Iterator[Deployment]:
    deployment = Deployment.provision(kafka_platform, users=[], endpoints=[])
    try:
        yield deployment
    finally:
        deployment.close(kafka_platform)


def create(platform: RunningPlatform, dep: Deployment, topic: str, spec_name: str) -> None:
    """Create ``topic`` (deleted with the deployment's)."""
    report = ensure_topics(platform.admin(), dep.catalogue, {topic: dep.catalogue.spec(spec_name)})
    assert report.ok, report
    dep.topics.append(topic)


def owned(view: RegistryView, dep: Deployment) -> ViewFollower:
    """``view`` as a feed owns it (the ingress's way)."""
    return ViewFollower(
        view,
        TopicDirectory(dep.kafka),
        [dep.catalogue.endpoints, dep.catalogue.users],
        name="test",
        catch_up_s=5.0,
        start_timeout_s=30.0,
    )


def until(feed: TopicFeed, predicate: object, timeout_s: float = WAIT_S) -> frozenset[str]:
    """Ask ``feed`` until ``predicate(wanted)`` holds; returns that answer."""
    assert callable(predicate)

    async def ask() -> frozenset[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            wanted = await feed.wanted()
            if predicate(wanted):
                return wanted
            assert time.monotonic() < deadline, f"the feed still says {sorted(wanted)}"
            await asyncio.sleep(0.1)

    return asyncio.run(ask())


def test_a_registered_endpoint_is_read_once_its_topic_exists_and_left_once_deleted(
    kafka_platform: RunningPlatform, dep: Deployment
) -> None:
    catalogue = dep.catalogue
    view = RegistryView(dep.kafka, catalogue, follow=("endpoints",), component=None)
    feed = TopicFeed(
        TopicDirectory(dep.kafka),
        [endpoint_topics(view, catalogue)],
        recheck_missing_s=0.2,
        owns=owned(view, dep),
    )
    asyncio.run(feed.start())
    try:
        assert asyncio.run(feed.wanted()) == frozenset()
        dep.add_endpoint("ep-a", "someone")
        topic = catalogue.from_endpoint("ep-a")
        # Named but missing: left out (a consumer would wait for its metadata).
        time.sleep(1.0)
        assert topic not in asyncio.run(feed.wanted())
        create(kafka_platform, dep, topic, "from.ep.{endpoint_id}")
        assert until(feed, lambda wanted: topic in wanted) == {topic}
        # The record deleted (the API's tombstone): no longer read.
        dep.producer.produce(catalogue.endpoints, key="ep-a", value=None)
        assert dep.producer.flush(10) == 0
        assert until(feed, lambda wanted: not wanted) == frozenset()
    finally:
        feed.close()


def test_a_topic_the_registry_does_not_name_is_found_by_the_listing(
    kafka_platform: RunningPlatform, dep: Deployment
) -> None:
    """Pattern-matching topics without a record are read too, found when the cluster is
    listed (at the first ask, then every ``list_every_s``); others are not."""
    catalogue = dep.catalogue
    view = RegistryView(dep.kafka, catalogue, follow=("users",), component=None)
    early, late = catalogue.from_user("u-early"), catalogue.from_user("u-late")
    create(kafka_platform, dep, early, "from.user.{user_id}")
    create(kafka_platform, dep, catalogue.results("u-early"), "results.{user_id}")
    feed = TopicFeed(
        TopicDirectory(dep.kafka),
        [user_topics(view, catalogue.from_user)],
        pattern=catalogue.from_user_pattern,
        list_every_s=2.0,
        owns=owned(view, dep),
    )
    asyncio.run(feed.start())
    try:
        assert asyncio.run(feed.wanted()) == {early}
        create(kafka_platform, dep, late, "from.user.{user_id}")
        began = time.monotonic()
        assert until(feed, lambda wanted: late in wanted) == {early, late}
        assert time.monotonic() - began <= 2.0 + 5.0
    finally:
        feed.close()


def test_the_ingress_reads_an_endpoint_registered_after_it_started(
    kafka_platform: RunningPlatform, tmp_path: Path
) -> None:
    dep = Deployment.provision(kafka_platform, users=[USER], endpoints=[])
    processors = Processors(dep.kafka, dep.catalogue, tmp_path, roles=("ingress",))
    endpoint = f"ep-{uuid.uuid4().hex[:8]}"
    try:
        processors.wait_for_log("ingress: accepting routing stamps of keys")
        assert "ingress: reading" not in processors.log()  # no endpoint yet, no topic
        began = time.monotonic()
        # What POST /v1/endpoints does: the topics first, then the record.
        topic = dep.catalogue.from_endpoint(endpoint)
        create(kafka_platform, dep, topic, "from.ep.{endpoint_id}")
        dep.add_endpoint(endpoint, USER)
        task_id = str(uuid.uuid4())
        answer = result(
            task_id,
            stamp_of(task_id, endpoint=endpoint, keys=processors.routing_keys),
            endpoint=endpoint,
        )
        dep.produce(topic, task_id, encode(answer))
        forwarded = dep.reader(dep.catalogue.results(USER)).wait_for(key_is(task_id))
        assert forwarded.value() == encode(answer)
        # Well inside the 30 s after which the listing would have found the topic.
        assert time.monotonic() - began < 15.0
        assert "(+1, -0)" in processors.log()
    finally:
        code = processors.stop()
        dep.close(kafka_platform)
    assert code == 0, processors.log()[-3000:]
