"""Fuzz Router.plan with batches of good, malformed and unroutable submissions.

The router's registry view and topic directory follow the real session broker
(one user, function and endpoint registered as the API would), so unknown ids,
wrong tokens and oversized tasks meet the real lookups. Each bad record must
get exactly one readable dead letter with a reason and the original bytes; a
refused (decodable) one also a ``rejected`` state; no bad record is dispatched;
every good one is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxstream.service.registry import RegistryView
from fxstream.service.router import COMPONENT, Router
from fxstream.service.topic_directory import TopicDirectory
from fxstream.topics import (
    Catalogue,
    RoutingKeys,
    TaskDispatch,
    TaskState,
    TaskStateName,
    TaskSubmission,
    decode,
    encode,
)
from tests.conftest import RunningPlatform
from tests.fuzz.checks import expect_one_letter_each
from tests.fuzz.conftest import Registry
from tests.fuzz.strategies import (
    BadValue,
    FuzzRecord,
    bad_values,
    headers,
    keys,
    new_id,
    valid_submission,
)

FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)


UNROUTABLE = ("unknown-function", "unknown-endpoint", "stale-digest", "huge-payload")
# On the user's own topic but naming another user: dead-lettered, never a state of theirs.
FORGED = ("foreign-user",)
# The router's routing keys, this module's own.
KEYS = RoutingKeys.generate()


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for the module: the router's locks and clients live on it."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def router(
    kafka_platform: RunningPlatform,
    fuzz_catalogue: Catalogue,
    registry: Registry,
    loop: asyncio.AbstractEventLoop,
) -> Iterator[Router]:
    """A started router on the fuzz deployment."""
    kafka = kafka_platform.kafka
    view = RegistryView(kafka, fuzz_catalogue, follow=("users", "functions", "endpoints"))
    router = Router(fuzz_catalogue, view, TopicDirectory(kafka), keys=KEYS, catch_up_s=0.5)
    loop.run_until_complete(router.start())
    assert view.user(registry.user_id) is not None
    assert view.endpoint(registry.endpoint_id) is not None
    yield router
    router.close()


def _good(registry: Registry) -> TaskSubmission:
    return valid_submission(
        user_id=registry.user_id,
        function_id=registry.function_id,
        endpoint_id=registry.endpoint_id,
        function_sha256=registry.code_sha256,
    )


@st.composite
def unroutable(draw: st.DrawFn, registry: Registry) -> BadValue:
    """A well-formed submission the router must refuse: unknown ids, a stale code digest,
    too large, or naming another user than its topic's."""
    good = _good(registry)
    how = draw(st.sampled_from(UNROUTABLE + FORGED))
    changes: dict[str, dict[str, object]] = {
        "foreign-user": {"user_id": new_id()},
        "unknown-function": {"function_id": new_id()},
        "unknown-endpoint": {"endpoint_id": new_id()},
        "stale-digest": {"function_sha256": "f" * 64},
        "huge-payload": {"payload": b"x" * 1_100_000},
    }
    return BadValue(how, encode(msgspec.structs.replace(good, **changes[how])))


@st.composite
def batches(
    draw: st.DrawFn, topic: str, registry: Registry
) -> tuple[list[FuzzRecord], dict[int, tuple[FuzzRecord, BadValue]], list[TaskSubmission]]:
    """Up to 8 records: good submissions, malformed ones and unroutable ones."""
    records: list[FuzzRecord] = []
    bad: dict[int, tuple[FuzzRecord, BadValue]] = {}
    goods: list[TaskSubmission] = []
    for offset in range(draw(st.integers(1, 8))):
        choice = draw(st.sampled_from(["good", "malformed", "unroutable"]))
        if choice == "good":
            good = _good(registry)
            goods.append(good)
            record = FuzzRecord(topic, 0, offset, good.task_id.encode(), encode(good), [])
        else:
            strategy = (
                bad_values(_good(registry)) if choice == "malformed" else unroutable(registry)
            )
            value = draw(strategy)
            record = FuzzRecord(topic, 0, offset, draw(keys), value.value, draw(headers))
            bad[offset] = (record, value)
        records.append(record)
    return records, bad, goods


def test_fuzz_router_plan(
    router: Router,
    fuzz_catalogue: Catalogue,
    registry: Registry,
    loop: asyncio.AbstractEventLoop,
) -> None:
    catalogue = fuzz_catalogue
    queue = catalogue.endpoint_queue(registry.endpoint_id)

    @FUZZ
    @given(batch=batches(catalogue.from_user(registry.user_id), registry))
    def check(
        batch: tuple[
            list[FuzzRecord], dict[int, tuple[FuzzRecord, BadValue]], list[TaskSubmission]
        ],
    ) -> None:
        records, bad, goods = batch
        plan = loop.run_until_complete(router.plan(records))
        everything = [*plan.first, *plan.dispatches]
        expect_one_letter_each(catalogue, everything, bad, component=COMPONENT)
        dispatched = [decode(d.value, TaskDispatch) for d in plan.dispatches]
        assert all(d.topic == queue for d in plan.dispatches)
        assert sorted(d.task_id for d in dispatched) == sorted(g.task_id for g in goods)
        by_id = {g.task_id: g for g in goods}
        for d in dispatched:  # each stamped: the routing of its task, under the router's key
            KEYS.verify(
                d.routing_stamp,
                task_id=d.task_id,
                endpoint_id=d.endpoint_id,
                user_id=d.user_id,
                function_id=by_id[d.task_id].function_id,
            )
        states = [decode(r.value, TaskState) for r in plan.first if r.topic == catalogue.task_state]
        rejected = {s.task_id for s in states if s.state == TaskStateName.REJECTED}
        for record, value in bad.values():
            if value.how in UNROUTABLE:
                task_id = decode(record.value, TaskSubmission).task_id
                assert task_id in rejected, f"{value.how}: no rejected state"
            if value.how in FORGED:
                task_id = decode(record.value, TaskSubmission).task_id
                assert task_id not in {s.task_id for s in states}, f"{value.how}: a state"

    check()
