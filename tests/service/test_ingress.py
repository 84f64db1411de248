"""The ingress forwards a task's result or event only with the router's routing stamp of it.

A result (or task event) on ``from.ep.<E>`` is forwarded only when its ``routing_stamp``
is the router's HMAC of (its task, ``E``, its user, its function) under a key the
ingress holds; anything else is dead-lettered ``NotRoutedHere`` saying what is wrong, and
forwarded nowhere. The ingress follows no task-state: nothing here writes any.

The real broker and topics throughout: the first tests drive the ingress planner
directly (its results-topic lookups are the broker's), the last runs the ingress
processor (a subprocess reading its keys from ``FXSTREAM_ROUTING_KEYS``) and reads what
it committed. The rotation tests give the planner a real keys file
(``RoutingKeyFile``), rewritten on disk while it runs, as the keys command does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fxstream.service.ingress import Ingress
from fxstream.service.routing_keys import CHECK_INTERVAL_S, RoutingKeyFile
from fxstream.service.topic_directory import TopicDirectory
from fxstream.topics import (
    Catalogue,
    DeadLetter,
    DeadLetterReason,
    RoutingKeys,
    TaskEvent,
    TaskResult,
    TaskStateName,
    TaskTimings,
    decode,
    encode,
    ensure_topics,
    write_routing_keys,
)
from tests.conftest import RunningPlatform
from tests.e2e.stack import committed_records
from tests.service.test_lifecycle import Record
from tests.service.test_router import Deployment, Processors, decoded, key_is
from tests.service.test_routing_keys import secrets_of, write_loose

KEYS = RoutingKeys.generate()  # the service's keys in this module (never a default)
USER, OTHER_USER = f"u-{uuid.uuid4().hex[:8]}", f"u-{uuid.uuid4().hex[:8]}"
FUNCTION, ENDPOINT, OTHER_ENDPOINT = "fn-1", "ep-1", "ep-2"


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def results_topics(kafka_platform: RunningPlatform, catalogue: Catalogue) -> None:
    """``results.<USER>`` exists (``OTHER_USER`` has none); deleted with the module's prefix."""
    # ensure_topics waits until the broker's metadata shows it, as the API does.
    report = ensure_topics(
        kafka_platform.admin(),
        catalogue,
        {catalogue.results(USER): catalogue.spec("results.{user_id}")},
    )
    assert report.ok, report


def stamp_of(
    task_id: str,
    *,
    endpoint: str = ENDPOINT,
    user: str = USER,
    function: str = FUNCTION,
    keys: RoutingKeys = KEYS,
) -> str:
    """The router's stamp of ``task_id`` routed to ``endpoint`` for ``user`` and ``function``."""
    return keys.stamp(task_id=task_id, endpoint_id=endpoint, user_id=user, function_id=function)


def result(task_id: str, stamp: str, *, user: str = USER, endpoint: str = ENDPOINT) -> TaskResult:
    """An agent's answer to ``task_id`` carrying ``stamp``."""
    return TaskResult(
        task_id=task_id,
        user_id=user,
        function_id=FUNCTION,
        endpoint_id=endpoint,
        outcome="success",
        value=b"a value",
        worker="host:1",
        timings=TaskTimings(submitted_at=time.time(), finished_at=time.time()),
        routing_stamp=stamp,
    )


def on_topic(catalogue: Catalogue, value: TaskResult | TaskEvent, endpoint: str) -> Record:
    """``value`` as the ingress reads it from ``from.ep.<endpoint>``, keyed by its task."""
    return Record(
        value=encode(value),
        topic=catalogue.from_endpoint(endpoint),
        key=value.task_id.encode(),
    )


def plan(
    ingress: Ingress, loop: asyncio.AbstractEventLoop, records: list[Record]
) -> list[tuple[str, bytes | None, bytes]]:
    """(topic, key, value) of everything the ingress writes for ``records``."""
    planned = loop.run_until_complete(asyncio.wait_for(ingress.plan(records), 30))
    assert not planned.dispatches
    return [(o.topic, o.key, o.value) for o in planned.first]


def only_dead_letter(
    catalogue: Catalogue, written: list[tuple[str, bytes | None, bytes]]
) -> DeadLetter:
    """The one dead letter ``written`` holds (and nothing else)."""
    assert [topic for topic, _, _ in written] == [catalogue.dead_letter], written
    return decode(written[0][2], DeadLetter)


def test_a_result_with_its_routers_stamp_is_forwarded_to_its_users_results(
    kafka_platform: RunningPlatform,
    catalogue: Catalogue,
    results_topics: None,
    loop: asyncio.AbstractEventLoop,
) -> None:
    ingress = Ingress(catalogue, TopicDirectory(kafka_platform.kafka), keys=KEYS)
    task_id = str(uuid.uuid4())
    answer = result(task_id, stamp_of(task_id))
    event = TaskEvent(
        task_id=task_id,
        user_id=USER,
        function_id=FUNCTION,
        endpoint_id=ENDPOINT,
        state=TaskStateName.RETRYING,
        at=time.time(),
        source="agent",
        routing_stamp=stamp_of(task_id),
    )
    began = time.monotonic()
    written = plan(
        ingress, loop, [on_topic(catalogue, answer, ENDPOINT), on_topic(catalogue, event, ENDPOINT)]
    )
    # Decided from the records alone: no task-state was ever written for this task.
    assert time.monotonic() - began < 10
    assert written == [
        (catalogue.results(USER), task_id.encode(), encode(answer)),
        (catalogue.task_events, task_id.encode(), encode(event)),
    ]
    assert ingress.stats.forwarded == 2 and ingress.stats.dead_lettered == 0


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("no stamp", "carries no routing stamp"),
        ("another endpoint's stamp", "does not match"),
        ("another user's stamp", "does not match"),
        ("another function's stamp", "does not match"),
        ("another task's stamp", "does not match"),
        ("an unknown key's stamp", "which this ingress does not hold"),
        ("a malformed stamp", "is not a v1 stamp"),
    ],
)
def test_a_result_without_a_valid_stamp_is_dead_lettered_and_forwarded_nowhere(
    kafka_platform: RunningPlatform,
    catalogue: Catalogue,
    results_topics: None,
    loop: asyncio.AbstractEventLoop,
    case: str,
    words: str,
) -> None:
    ingress = Ingress(catalogue, TopicDirectory(kafka_platform.kafka), keys=KEYS)
    task_id = str(uuid.uuid4())
    stamp = {
        "no stamp": "",
        "another endpoint's stamp": stamp_of(task_id, endpoint=OTHER_ENDPOINT),
        "another user's stamp": stamp_of(task_id, user=OTHER_USER),
        "another function's stamp": stamp_of(task_id, function="fn-2"),
        "another task's stamp": stamp_of(str(uuid.uuid4())),
        "an unknown key's stamp": stamp_of(task_id, keys=RoutingKeys.generate()),
        "a malformed stamp": "v1." + "A" * 50,
    }[case]
    forged = result(task_id, stamp)
    letter = only_dead_letter(
        catalogue, plan(ingress, loop, [on_topic(catalogue, forged, ENDPOINT)])
    )
    assert letter.error_type == DeadLetterReason.NOT_ROUTED_HERE
    assert (letter.component, letter.task_id) == ("ingress", task_id)
    assert words in letter.reason, letter.reason
    assert f"endpoint {ENDPOINT!r} sent a result for task {task_id}" in letter.reason
    assert letter.original_value == encode(forged)
    if case == "no stamp":
        assert "upgrade fxstream on the endpoint" in letter.reason
    assert ingress.stats.not_routed_here == 1 and ingress.stats.forwarded == 0


def test_a_genuine_stamp_copied_to_another_endpoint_or_user_does_not_verify(
    kafka_platform: RunningPlatform,
    catalogue: Catalogue,
    results_topics: None,
    loop: asyncio.AbstractEventLoop,
) -> None:
    """The stamp of a task routed to ENDPOINT for USER, as USER reads it on its results,
    replayed: from OTHER_ENDPOINT's topic, or with the result redirected to OTHER_USER."""
    ingress = Ingress(catalogue, TopicDirectory(kafka_platform.kafka), keys=KEYS)
    task_id = str(uuid.uuid4())
    genuine = stamp_of(task_id)
    elsewhere = result(task_id, genuine, endpoint=OTHER_ENDPOINT)
    redirected = result(task_id, genuine, user=OTHER_USER)
    # ENDPOINT's own stamp on its own topic, the result naming another endpoint.
    misnamed = result(task_id, genuine, endpoint=OTHER_ENDPOINT)
    written = plan(
        ingress,
        loop,
        [
            on_topic(catalogue, elsewhere, OTHER_ENDPOINT),
            on_topic(catalogue, redirected, ENDPOINT),
            on_topic(catalogue, misnamed, ENDPOINT),
        ],
    )
    assert {topic for topic, _, _ in written} == {catalogue.dead_letter}
    letters = [decode(value, DeadLetter) for _, _, value in written]
    assert [(d.error_type, d.original_value) for d in letters] == [
        (DeadLetterReason.NOT_ROUTED_HERE, encode(elsewhere)),
        (DeadLetterReason.NOT_ROUTED_HERE, encode(redirected)),
        (DeadLetterReason.IDENTITY_MISMATCH, encode(misnamed)),
    ]
    assert "names endpoint 'ep-2': an endpoint reports only for itself" in letters[2].reason


def test_old_and_new_keys_are_accepted_during_a_rotation(
    kafka_platform: RunningPlatform,
    catalogue: Catalogue,
    results_topics: None,
    loop: asyncio.AbstractEventLoop,
) -> None:
    old = RoutingKeys.generate()
    rotated = old.rotated()
    before, after = str(uuid.uuid4()), str(uuid.uuid4())
    from_old = result(before, stamp_of(before, keys=old))  # routed before the rotation
    from_new = result(after, stamp_of(after, keys=rotated))
    records = [on_topic(catalogue, from_old, ENDPOINT), on_topic(catalogue, from_new, ENDPOINT)]
    directory = TopicDirectory(kafka_platform.kafka)

    # An ingress given the rotated file: both verify.
    both = Ingress(catalogue, directory, keys=rotated)
    assert [topic for topic, _, _ in plan(both, loop, records)] == [catalogue.results(USER)] * 2
    # Fixed keys without the new one (the processors pass a RoutingKeyFile instead, which
    # is re-read: the tests below): the new key is unknown to it.
    stale = plan(Ingress(catalogue, directory, keys=old), loop, records)
    assert [topic for topic, _, _ in stale] == [catalogue.results(USER), catalogue.dead_letter]
    assert "does not hold" in decode(stale[1][2], DeadLetter).reason
    # The old key retired: only what the new one stamped verifies.
    retired = plan(Ingress(catalogue, directory, keys=RoutingKeys(rotated.signing)), loop, records)
    assert [topic for topic, _, _ in retired] == [catalogue.dead_letter, catalogue.results(USER)]


def test_an_ingress_accepts_at_once_a_stamp_under_a_key_added_after_it_started(
    kafka_platform: RunningPlatform,
    catalogue: Catalogue,
    results_topics: None,
    loop: asyncio.AbstractEventLoop,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The rotation's hazard, gone: a router that read the rotated file first stamps with
    the new key before this ingress has looked at the file again; the ingress looks again
    at once before refusing, and forwards the result. Its periodic look is an hour away
    here, so only the look an unknown key id makes can have found the new key."""
    path = tmp_path / "routing-keys.json"
    old = RoutingKeys.generate()
    write_routing_keys(path, old)
    caplog.set_level(logging.INFO, logger="fxstream.service.routing_keys")
    keys_file = RoutingKeyFile(path, check_interval_s=3600)
    ingress = Ingress(catalogue, TopicDirectory(kafka_platform.kafka), keys=keys_file)
    before = str(uuid.uuid4())
    from_old = result(before, stamp_of(before, keys=old))
    assert plan(ingress, loop, [on_topic(catalogue, from_old, ENDPOINT)])[0][0] == (
        catalogue.results(USER)
    )

    rotated = old.rotated()
    write_routing_keys(path, rotated)  # what `routing-keys --rotate` does
    after = str(uuid.uuid4())
    from_new = result(after, stamp_of(after, keys=rotated))  # the router read it first
    again = str(uuid.uuid4())
    from_old_again = result(again, stamp_of(again, keys=old))  # routed before the rotation
    written = plan(
        ingress,
        loop,
        [on_topic(catalogue, from_new, ENDPOINT), on_topic(catalogue, from_old_again, ENDPOINT)],
    )
    assert written == [
        (catalogue.results(USER), after.encode(), encode(from_new)),
        (catalogue.results(USER), again.encode(), encode(from_old_again)),
    ]
    assert ingress.stats.not_routed_here == 0 and ingress.stats.dead_lettered == 0
    assert ingress.keys == rotated
    assert f"signing key {rotated.signing.key_id}" in caplog.text
    assert not any(secret in caplog.text for secret in secrets_of(rotated))


def test_a_retired_key_is_refused_once_the_ingress_has_re_read_its_file(
    kafka_platform: RunningPlatform,
    catalogue: Catalogue,
    results_topics: None,
    loop: asyncio.AbstractEventLoop,
    tmp_path: Path,
) -> None:
    path = tmp_path / "routing-keys.json"
    rotated = RoutingKeys.generate().rotated()  # a new signing key, the old one accepted
    old_key = rotated.retired[0]
    write_routing_keys(path, rotated)
    ingress = Ingress(catalogue, TopicDirectory(kafka_platform.kafka), keys=RoutingKeyFile(path))
    old_ring = RoutingKeys(old_key)
    first = str(uuid.uuid4())
    accepted = plan(
        ingress,
        loop,
        [on_topic(catalogue, result(first, stamp_of(first, keys=old_ring)), ENDPOINT)],
    )
    assert [topic for topic, _, _ in accepted] == [catalogue.results(USER)]

    write_routing_keys(path, RoutingKeys(rotated.signing))  # what `--retire <old>` does
    time.sleep(CHECK_INTERVAL_S + 0.05)
    late, current = str(uuid.uuid4()), str(uuid.uuid4())
    from_old = result(late, stamp_of(late, keys=old_ring))
    from_new = result(current, stamp_of(current, keys=rotated))
    written = plan(
        ingress,
        loop,
        [on_topic(catalogue, from_old, ENDPOINT), on_topic(catalogue, from_new, ENDPOINT)],
    )
    assert [topic for topic, _, _ in written] == [catalogue.dead_letter, catalogue.results(USER)]
    letter = decode(written[0][2], DeadLetter)
    assert letter.error_type == DeadLetterReason.NOT_ROUTED_HERE
    assert f"made with key {old_key.key_id!r}, which this ingress does not hold" in letter.reason
    assert ingress.keys.key_ids == (rotated.signing.key_id,)


def test_a_loose_new_keys_file_leaves_the_ingress_on_its_last_good_keys(
    kafka_platform: RunningPlatform,
    catalogue: Catalogue,
    results_topics: None,
    loop: asyncio.AbstractEventLoop,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A new file others may read is never used: its keys verify nothing, the old ones
    still do, and the ingress says why (and keeps going)."""
    path = tmp_path / "routing-keys.json"
    good = RoutingKeys.generate()
    write_routing_keys(path, good)
    ingress = Ingress(catalogue, TopicDirectory(kafka_platform.kafka), keys=RoutingKeyFile(path))
    caplog.set_level(logging.INFO, logger="fxstream.service.routing_keys")
    loose = RoutingKeys.generate()
    write_loose(path, loose)
    time.sleep(CHECK_INTERVAL_S + 0.05)
    kept, refused = str(uuid.uuid4()), str(uuid.uuid4())
    written = plan(
        ingress,
        loop,
        [
            on_topic(catalogue, result(kept, stamp_of(kept, keys=good)), ENDPOINT),
            on_topic(catalogue, result(refused, stamp_of(refused, keys=loose)), ENDPOINT),
        ],
    )
    assert [topic for topic, _, _ in written] == [catalogue.results(USER), catalogue.dead_letter]
    assert "which this ingress does not hold" in decode(written[1][2], DeadLetter).reason
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(f"chmod 600 {path}" in e and "still using the last good keys" in e for e in errors)
    assert ingress.keys == good
    assert not any(secret in caplog.text for secret in secrets_of(good, loose))


def test_the_other_checks_stay(
    kafka_platform: RunningPlatform,
    catalogue: Catalogue,
    results_topics: None,
    loop: asyncio.AbstractEventLoop,
) -> None:
    ingress = Ingress(catalogue, TopicDirectory(kafka_platform.kafka), keys=KEYS)
    task_id = str(uuid.uuid4())
    # A valid stamp, but the user has no results topic (deleted since): undeliverable.
    orphan = result(task_id, stamp_of(task_id, user=OTHER_USER), user=OTHER_USER)
    letter = only_dead_letter(
        catalogue, plan(ingress, loop, [on_topic(catalogue, orphan, ENDPOINT)])
    )
    assert letter.error_type == DeadLetterReason.TASK_UNDELIVERABLE
    assert f"user {OTHER_USER!r} has no results topic" in letter.reason
    # A valid result keyed by something else than its task: a compacted topic's key.
    genuine = result(task_id, stamp_of(task_id))
    wrong_key = dataclasses.replace(on_topic(catalogue, genuine, ENDPOINT), key=b"other")
    letter = only_dead_letter(catalogue, plan(ingress, loop, [wrong_key]))
    assert letter.error_type == DeadLetterReason.IDENTITY_MISMATCH
    assert "must be keyed" in letter.reason


def test_the_ingress_processor_reads_its_keys_and_forwards_only_stamped_results(
    kafka_platform: RunningPlatform, tmp_path: Path
) -> None:
    """The real ingress process (keys from FXSTREAM_ROUTING_KEYS) and what it committed."""
    dep = Deployment.provision(kafka_platform, users=[USER], endpoints=[ENDPOINT])
    processors = Processors(dep.kafka, dep.catalogue, tmp_path, roles=("ingress",))
    keys = processors.routing_keys
    try:
        processors.wait_for_log("ingress: accepting routing stamps of keys")
        genuine_id, forged_id = str(uuid.uuid4()), str(uuid.uuid4())
        genuine = result(genuine_id, stamp_of(genuine_id, keys=keys))
        forged = result(forged_id, stamp_of(forged_id, endpoint=OTHER_ENDPOINT, keys=keys))
        topic = dep.catalogue.from_endpoint(ENDPOINT)
        dep.produce(topic, forged_id, encode(forged))
        dep.produce(topic, genuine_id, encode(genuine))

        results = dep.reader(dep.catalogue.results(USER))
        assert results.wait_for(key_is(genuine_id)).value() == encode(genuine)
        letter = decoded(
            dep.reader(dep.catalogue.dead_letter).wait_for(key_is(forged_id)), DeadLetter
        )
        assert letter.error_type == DeadLetterReason.NOT_ROUTED_HERE
        assert "does not match" in letter.reason
        # The forged result was decided (dead-lettered), so it is on no results topic.
        assert not committed_records(dep.kafka, dep.catalogue.results(USER), forged_id)
        # Nothing wrote task-state: the ingress decided from the records and its keys.
        assert not committed_records(dep.kafka, dep.catalogue.task_state)
        assert keys.signing.key_id in processors.log()
        assert keys.signing.secret.hex() not in processors.log()
    finally:
        code = processors.stop()
        dep.close(kafka_platform)
    assert code == 0, processors.log()[-3000:]
