"""Task DAGs end to end (issue 15), on the session's shared platform started as `./fx up`
starts it: a TaskFuture passed as an argument makes its task a parent; the router holds the
child (``waiting-for-parents``), the dependencies processor releases it with its parents'
results once they succeeded, and the worker passes those in. A large result stays in the
proxy store: the child's record carries only its reference. A failed parent fails its
children, and theirs, with ParentFailed naming the parent; the children never run."""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fxstream.connectors import DEFAULT_PROXY_THRESHOLD_BYTES
from fxstream.ops.private import ExtraEndpoint
from fxstream.sdk import Client, Executor, ParentFailed, ParentResult, ParentUnknown
from fxstream.topics import (
    TaskErrorType,
    TaskSubmission,
    decode,
    payload_references,
    record_kind,
)
from tests.e2e.stack import (
    Stack,
    added_endpoint,
    committed_records,
    other_user_client,
    wait_for_state,
)

pytestmark = pytest.mark.platform

WAIT_S = 90.0
N = 100_000  # 800 kB of float64: far above the proxy threshold, so by reference


def slow_array(n: int, delay_s: float) -> Any:
    import time

    import numpy as np

    time.sleep(delay_s)
    return np.arange(n, dtype=np.float64)


def scaled(a: Any, factor: float) -> Any:
    return a * factor


def combined(b1: Any, b2: Any, *, offset: float) -> dict[str, Any]:
    return {"sum": float(b1.sum() + b2.sum()) + offset, "types": [type(b1).__name__]}


def fails(delay_s: float) -> int:
    import time

    time.sleep(delay_s)
    raise ValueError("the parent broke")


def marks(path: str, value: Any) -> Any:
    from pathlib import Path

    Path(path).write_text("ran")
    return value


@pytest.fixture(scope="module")
def stack(shared_platform: Stack) -> Stack:
    """The session's shared platform (tests/conftest.py): this module only uses it."""
    return shared_platform


@pytest.fixture(scope="module")
def endpoint(stack: Stack) -> Iterator[ExtraEndpoint]:
    """An endpoint of this module with the platform's store: results above the proxy
    threshold go there and only their reference travels."""
    with added_endpoint(stack, "dags", workers=2) as extra:
        yield extra


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[Client]:
    """A client of the platform's local user."""
    made = stack.client()
    try:
        yield made
    finally:
        made.close()


def _released(stack: Stack, client: Client, task_id: str) -> list[TaskSubmission]:
    """The submissions of ``task_id`` on its user's topic: as sent, then as released (in
    time order: the SDK's and the service's producers partition by key differently)."""
    topic = stack.catalogue.from_user(client.user_id)
    found = sorted(committed_records(stack.kafka, topic, task_id), key=lambda m: m.timestamp()[1])
    return [
        decode(m.value(), TaskSubmission)
        for m in found
        if record_kind(m.value()) == "submission"  # not its cancels
    ]


def _held_records(stack: Stack, task_id: str) -> list[bytes | None]:
    return [m.value() for m in committed_records(stack.kafka, stack.catalogue.held_tasks, task_id)]


def test_a_three_level_dag_passes_data_by_reference(
    stack: Stack, endpoint: ExtraEndpoint, client: Client
) -> None:
    with Executor(endpoint_id=endpoint.endpoint_id, client=client) as executor:
        a = executor.submit(slow_array, N, 5.0)
        b1 = executor.submit(scaled, a, 2.0)
        b2 = executor.submit(scaled, a, factor=3.0)
        c = executor.submit(combined, b1, b2, offset=0.5)
        # Held by the service while the root runs.
        wait_for_state(client, c.task_id, "waiting-for-parents", timeout_s=WAIT_S)
        wait_for_state(client, b1.task_id, "waiting-for-parents", timeout_s=WAIT_S)
        outcome = c.result(timeout=WAIT_S)
        root = a.result(timeout=WAIT_S)
        doubled = b1.result(timeout=WAIT_S)
    total = float(np.arange(N, dtype=np.float64).sum())
    assert outcome == {"sum": total * 5 + 0.5, "types": ["ndarray"]}
    np.testing.assert_array_equal(root, np.arange(N, dtype=np.float64))
    np.testing.assert_array_equal(doubled, np.arange(N, dtype=np.float64) * 2)
    for child, parents in ((b1, [a]), (b2, [a]), (c, [b1, b2])):
        wait_for_state(client, child.task_id, "succeeded", timeout_s=WAIT_S)
        sent, released = _released(stack, client, child.task_id)
        assert sent.depends_on == [p.task_id for p in parents] and sent.parent_results == {}
        assert released.depends_on == sent.depends_on and released.payload == sent.payload
        assert set(released.parent_results) == {p.task_id for p in parents}
        for parent in parents:
            bound = released.parent_results[parent.task_id]
            # Only the reference travelled: the 800 kB value stayed in the store.
            references, _ = payload_references(bound)
            assert len(references) == 1 and references[0].size_bytes > 8 * N
            assert len(bound) < DEFAULT_PROXY_THRESHOLD_BYTES // 16
        # Held once, decided once: its held record and then a tombstone.
        held = _held_records(stack, child.task_id)
        assert len(held) == 2 and held[0] is not None and held[1] is None
    assert _released(stack, client, a.task_id)[0].depends_on == []


def test_a_failed_parent_fails_its_children_and_theirs_naming_it(
    stack: Stack, endpoint: ExtraEndpoint, client: Client, tmp_path: Path
) -> None:
    ran = tmp_path / "child-ran"
    with Executor(endpoint_id=endpoint.endpoint_id, client=client) as executor:
        a = executor.submit(fails, 1.0)
        b = executor.submit(marks, str(ran), a)
        c = executor.submit(marks, str(ran), value=b)
        with pytest.raises(ValueError, match="the parent broke"):
            a.result(timeout=WAIT_S)
        with pytest.raises(ParentFailed) as b_failed:
            b.result(timeout=WAIT_S)
        with pytest.raises(ParentFailed) as c_failed:
            c.result(timeout=WAIT_S)
    assert b_failed.value.remote_type == TaskErrorType.PARENT_FAILED
    assert b_failed.value.parent_id == a.task_id
    assert f"parent task {a.task_id} failed: ValueError: the parent broke" in str(b_failed.value)
    assert c_failed.value.parent_id == b.task_id
    # The grandchild's error names its parent, whose error names the first failure.
    assert f"parent task {b.task_id} failed: ParentFailed: parent task {a.task_id}" in str(
        c_failed.value
    )
    for child in (b, c):
        wait_for_state(client, child.task_id, "failed", timeout_s=WAIT_S)
        task = client.get_task(child.task_id)
        assert task["error"]["type"] == "ParentFailed"
        assert len(_released(stack, client, child.task_id)) == 1  # never released
    assert not ran.exists(), "a child of a failed parent ran"


def test_a_held_task_cancelled_never_runs(
    stack: Stack, endpoint: ExtraEndpoint, client: Client, tmp_path: Path
) -> None:
    ran = tmp_path / "cancelled-child-ran"
    with Executor(endpoint_id=endpoint.endpoint_id, client=client) as executor:
        a = executor.submit(slow_array, 10, 5.0)
        b = executor.submit(marks, str(ran), a)
        wait_for_state(client, b.task_id, "waiting-for-parents", timeout_s=WAIT_S)
        client.cancel(b.task_id, reason="changed my mind")
        with pytest.raises(concurrent.futures.CancelledError):
            b.result(timeout=WAIT_S)
        assert len(a.result(timeout=WAIT_S)) == 10
    wait_for_state(client, b.task_id, "cancelled", timeout_s=WAIT_S)
    time.sleep(1.0)  # the parent's end releases nothing: the child is no longer held
    assert not ran.exists(), "a cancelled held task ran"
    assert len(_released(stack, client, b.task_id)) == 1


def test_a_child_of_a_parent_already_ended_is_decided_at_once(
    stack: Stack, endpoint: ExtraEndpoint, client: Client
) -> None:
    """A parent named by task id (a ParentResult) that succeeded before its child came."""
    function_id = client.register_function(scaled)
    parent = client.run(7.0, 1.0, endpoint_id=endpoint.endpoint_id, function_id=function_id)
    assert client.future(parent).result(timeout=WAIT_S) == 7.0
    client.forget([parent])  # from here on, get_task asks the service
    wait_for_state(client, parent, "succeeded", timeout_s=WAIT_S)
    child = client.run(
        ParentResult(parent), 6.0, endpoint_id=endpoint.endpoint_id, function_id=function_id
    )
    assert client.future(child).result(timeout=WAIT_S) == 42.0
    sent, released = _released(stack, client, child)
    assert sent.depends_on == [parent] and set(released.parent_results) == {parent}


def test_another_users_task_is_an_unknown_parent(
    stack: Stack, endpoint: ExtraEndpoint, client: Client
) -> None:
    other = other_user_client(stack, f"dag-other-{uuid.uuid4().hex[:8]}")
    try:
        theirs_fn = other.register_function(scaled)
        theirs = other.run(1.0, 1.0, endpoint_id=stack.endpoint_id, function_id=theirs_fn)
        # Run or rejected (the local endpoint may not be shared with them), it has a state.
        other.future(theirs).exception(timeout=WAIT_S)
        function_id = client.register_function(scaled)
        child = client.run(
            ParentResult(theirs), 2.0, endpoint_id=endpoint.endpoint_id, function_id=function_id
        )
        with pytest.raises(ParentUnknown) as unknown:
            client.future(child).result(timeout=WAIT_S)
        assert unknown.value.parent_id == theirs
        assert f"parent task {theirs} is not a task of user {client.user_id}" in str(unknown.value)
        client.forget([child])
        wait_for_state(client, child, "failed", timeout_s=WAIT_S)
    finally:
        other.close()
