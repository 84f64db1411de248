"""The SDK side of task DAGs, without a broker: a TaskFuture (or a ParentResult) passed as a
top-level argument becomes a placeholder and an entry of the submission's ``depends_on``;
a future already holding its value passes the value; one inside a container is refused
with advice. The platform side runs in tests/e2e/test_dags.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fxstream.sdk import (
    Client,
    ParentFailed,
    ParentResult,
    ParentResultUnavailable,
    ParentUnknown,
    TaskExecutionFailed,
    TaskFuture,
)
from fxstream.sdk.errors import task_failure
from fxstream.topics import (
    MAX_PARENTS,
    KafkaConnection,
    SerializationError,
    Serializer,
    TaskError,
    TaskSubmission,
    decode,
)
from tests.sdk.conftest import OfflineClient


@pytest.fixture
def client() -> Iterator[Client]:
    """A client that never reaches a service or a broker (nothing here is sent)."""
    made = OfflineClient(
        "http://127.0.0.1:9",
        kafka=KafkaConnection("127.0.0.1:9"),
        topic_prefix="fx.",
        user_id="u-1",
        token="t",
    )
    try:
        yield made
    finally:
        made.close()


def _future(task_id: str) -> TaskFuture:
    return TaskFuture(task_id, function_id="fn-0", endpoint_id="ep-0", submitted_at=0.0)


def test_a_future_argument_is_a_parent_and_its_placeholder(client: Client) -> None:
    parent, other = _future("p-1"), _future("p-2")
    task = client.prepare_task("ep-1", "fn-1", (parent, 2), {"y": other, "z": parent})
    record = decode(task.record, TaskSubmission)
    assert record.depends_on == ["p-1", "p-2"] and record.parent_results == {}
    args, kwargs = Serializer().unpack_arguments(record.payload)
    assert args == (ParentResult("p-1"), 2)
    assert kwargs == {"y": ParentResult("p-2"), "z": ParentResult("p-1")}
    # Their results, once they come, stay in the store for this child to read.
    assert parent._keep_result and other._keep_result


def test_a_parent_by_task_id_and_in_a_batch(client: Client) -> None:
    task = client.prepare_task("ep-1", "fn-1", (ParentResult("p-9"),))
    assert decode(task.record, TaskSubmission).depends_on == ["p-9"]
    batch = client.create_batch()
    batch.add("fn-1", (_future("p-3"),))
    batch.add("fn-1", (1,))
    (_, first), (_, second) = list(batch)
    assert first.parents == ("p-3",) and second.parents == ()
    tasks = [client.prepare_task("ep-1", f, payload=p) for f, p in batch]
    assert [decode(t.record, TaskSubmission).depends_on for t in tasks] == [["p-3"], []]


def test_a_future_whose_value_is_here_passes_the_value(client: Client) -> None:
    done = _future("p-4")
    done.set_result({"v": 1})
    task = client.prepare_task("ep-1", "fn-1", (done,))
    record = decode(task.record, TaskSubmission)
    assert record.depends_on == []
    assert Serializer().unpack_arguments(record.payload) == (({"v": 1},), {})


@pytest.mark.parametrize("nested", [lambda f: [f], lambda f: {"x": f}, lambda f: (1, f)])
def test_a_future_inside_a_container_is_refused_with_advice(client: Client, nested: object) -> None:
    parent = _future("p-5")
    with pytest.raises(SerializationError, match="as a top-level argument") as refused:
        client.prepare_task("ep-1", "fn-1", (nested(parent),))  # type: ignore[operator]
    assert "future.result()" in str(refused.value)


def test_too_many_parents_are_refused(client: Client) -> None:
    parents = tuple(_future(f"p-{i}") for i in range(MAX_PARENTS + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_PARENTS} tasks"):
        client.prepare_task("ep-1", "fn-1", parents)


@pytest.mark.parametrize(
    ("error_type", "cls"),
    [
        ("ParentFailed", ParentFailed),
        ("ParentUnknown", ParentUnknown),
        ("ParentResultUnavailable", ParentResultUnavailable),
    ],
)
def test_the_dag_failures_raise_their_own_classes_naming_the_parent(
    error_type: str, cls: type[TaskExecutionFailed]
) -> None:
    error = TaskError(type=error_type, message="parent task p-7 failed: ValueError: no")
    failure = task_failure("c-1", error)
    assert type(failure) is cls and isinstance(failure, TaskExecutionFailed)
    assert failure.parent_id == "p-7"  # type: ignore[attr-defined]
