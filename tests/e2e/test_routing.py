"""Endpoint groups end to end: the router chooses where each grouped task runs.

On the session's shared platform (its processors run the default ``warm`` placement
policy), with endpoints of this module's own: the SDK submits to a group, the router
authorises the user for every endpoint of it and picks one by liveness, the warm
adverts the agents publish, and backlog; the agent runs it as any task of its own.
The policy's ranking in detail is tested in tests/service/test_placement.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from fxstream.ops.private import ExtraEndpoint, PrivatePlatform
from fxstream.sdk import Client, Executor, TaskRejected
from fxstream.topics import WarmAdvert, decode
from tests.e2e.stack import added_endpoint, committed_records, other_user_client, wait_for_state

pytestmark = pytest.mark.platform

WAIT_S = 60.0
# The router's view of ``warm`` and ``heartbeats`` fetches with fetch.wait.max.ms 500: a
# record committed this long ago has been folded by it (unless the machine stalls).
VIEW_LAG_S = 2.0


def triple(x: int) -> int:
    return 3 * x


def quadruple(x: int) -> int:
    return 4 * x


@pytest.fixture(scope="module")
def pair(shared_platform: PrivatePlatform) -> Iterator[tuple[ExtraEndpoint, ExtraEndpoint]]:
    """Two endpoints of this module (two workers each; the second public), stopped after."""
    with (
        added_endpoint(shared_platform, "route-a", workers=2) as first,
        added_endpoint(shared_platform, "route-b", workers=2, public=True) as second,
    ):
        yield first, second


@contextmanager
def executor(client: Client, **options: object) -> Iterator[Executor]:
    """An executor that never waits at exit: a failed test must not hang on its futures."""
    ex = Executor(client=client, **options)  # type: ignore[arg-type]
    try:
        yield ex
    finally:
        ex.shutdown(wait=False, cancel_futures=True)


def wait_until_warm(platform: PrivatePlatform, endpoint_id: str, function_id: str) -> None:
    """Wait until ``endpoint_id``'s latest committed warm advert lists ``function_id``."""
    deadline = time.monotonic() + WAIT_S
    while True:
        adverts = [
            decode(m.value(), WarmAdvert)
            for m in committed_records(platform.kafka, platform.catalogue.warm)
            if m.value() is not None
        ]
        latest = max(
            (a for a in adverts if a.endpoint_id == endpoint_id),
            key=lambda a: a.advertised_at,
            default=None,
        )
        if latest is not None and any(function_id in w.function_ids for w in latest.workers):
            time.sleep(VIEW_LAG_S)
            return
        assert time.monotonic() < deadline, f"{endpoint_id} never advertised {function_id} warm"
        time.sleep(0.5)


def wait_until_lost(client: Client, endpoint_id: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while client.get_endpoint_status(endpoint_id)["state"] != "lost":
        assert time.monotonic() < deadline, f"{endpoint_id} never showed lost"
        time.sleep(0.5)
    time.sleep(VIEW_LAG_S)


def test_a_grouped_task_goes_where_its_function_is_warm(
    shared_platform: PrivatePlatform, pair: tuple[ExtraEndpoint, ExtraEndpoint]
) -> None:
    warm, cold = pair
    client = shared_platform.client()
    try:
        # Warm the function on one endpoint only, by naming it.
        with executor(client, endpoint_id=warm.endpoint_id) as only_warm:
            assert only_warm.submit(triple, 1).result(timeout=WAIT_S) == 3
            function_id = only_warm.register_function(triple)
        wait_until_warm(shared_platform, warm.endpoint_id, function_id)
        # The same function id (an executor registers a function anew). endpoint_id names
        # the cold one: without warm routing it would be a candidate
        # as good as the other, and the tie-break would spread the tasks over both.
        with executor(
            client, endpoint_id=cold.endpoint_id, endpoint_group=[warm.endpoint_id]
        ) as grouped:
            for x in range(6):
                # One at a time, each after the endpoints' next heartbeat (every second):
                # the warm endpoint is idle again when the next one is routed.
                time.sleep(1.5)
                future = grouped.submit_to_registered_function(function_id, (x,))
                assert future.result(timeout=WAIT_S) == 3 * x
                assert future.endpoint_id == warm.endpoint_id, f"task {x} ran on the cold one"
                assert client.get_task(future.task_id)["endpoint_id"] == warm.endpoint_id
    finally:
        client.close()


def test_a_dead_endpoint_of_the_group_is_never_chosen(
    shared_platform: PrivatePlatform, pair: tuple[ExtraEndpoint, ExtraEndpoint]
) -> None:
    _, live = pair
    client = shared_platform.client()
    try:
        with added_endpoint(shared_platform, "route-dead", workers=2) as doomed:
            # Warm on the endpoint about to die: its last advert says so forever after.
            with executor(client, endpoint_id=doomed.endpoint_id) as only_doomed:
                assert only_doomed.submit(quadruple, 1).result(timeout=WAIT_S) == 4
                function_id = only_doomed.register_function(quadruple)
            wait_until_warm(shared_platform, doomed.endpoint_id, function_id)
            dead = doomed.endpoint_id
        wait_until_lost(client, dead)
        with executor(client, endpoint_group=[dead, live.endpoint_id]) as grouped:
            futures = [grouped.submit_to_registered_function(function_id, (x,)) for x in range(10)]
            assert [f.result(timeout=WAIT_S) for f in futures] == [4 * x for x in range(10)]
        assert {f.endpoint_id for f in futures} == {live.endpoint_id}
    finally:
        client.close()


def test_a_group_with_an_endpoint_the_user_may_not_use_is_refused(
    shared_platform: PrivatePlatform, pair: tuple[ExtraEndpoint, ExtraEndpoint]
) -> None:
    private, public = pair  # both the local user's; only the second is public
    stranger = other_user_client(shared_platform, "route-stranger")
    try:
        # The public endpoint alone is fine for the stranger...
        with executor(stranger, endpoint_id=public.endpoint_id) as alone:
            assert alone.submit(triple, 2).result(timeout=WAIT_S) == 6
        # ...but not a group that also names the owner's private one.
        with executor(
            stranger, endpoint_id=public.endpoint_id, endpoint_group=[private.endpoint_id]
        ) as grouped:
            future = grouped.submit(triple, 2)
            with pytest.raises(TaskRejected) as info:
                future.result(timeout=WAIT_S)
        message = str(info.value)
        assert private.endpoint_id in message
        assert "endpoint group" in message
        assert "not shared with you" in message
        wait_for_state(stranger, future.task_id, "rejected")
    finally:
        stranger.close()


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_a_grouped_task_is_cancelled_wherever_the_router_sent_it(
    shared_platform: PrivatePlatform, pair: tuple[ExtraEndpoint, ExtraEndpoint]
) -> None:
    warm, cold = pair
    client = shared_platform.client()
    try:
        with executor(client, endpoint_id=warm.endpoint_id) as only_warm:
            assert only_warm.submit(nap, 0.0).result(timeout=WAIT_S) == 0.0
            function_id = only_warm.register_function(nap)
        wait_until_warm(shared_platform, warm.endpoint_id, function_id)
        time.sleep(1.5)  # the warm endpoint's next heartbeat: idle again
        # Named endpoint: the cold one; the router sends it to the warm one. A cancel sent
        # only to the named endpoint would leave it running for its whole minute.
        with executor(
            client, endpoint_id=cold.endpoint_id, endpoint_group=[warm.endpoint_id]
        ) as grouped:
            future = grouped.submit_to_registered_function(function_id, (60.0,))
            wait_for_state(client, future.task_id, "running", timeout_s=WAIT_S)
            assert client.get_task(future.task_id)["endpoint_id"] == warm.endpoint_id
            assert grouped.kill(future, reason="routing test")
        wait_for_state(client, future.task_id, "cancelled", timeout_s=WAIT_S)
    finally:
        client.close()
