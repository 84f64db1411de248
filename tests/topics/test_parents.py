"""Task DAGs in the wire contract: the ParentResult placeholder, depends_on and
parent_results on the submission, and the held-task record."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from fxstream.topics import (
    MAX_PARENTS,
    ClientInfo,
    HeldTask,
    ParentResult,
    RecordDecodeError,
    SerializationError,
    Serializer,
    TaskErrorType,
    TaskStateName,
    TaskSubmission,
    bind_parents,
    decode,
    encode,
    parents_in,
)

NOW = time.time()
CLIENT = ClientInfo(python_version="3.11.7", fxstream_version="0.1.0")


def _submission(**fields: Any) -> TaskSubmission:
    values: dict[str, Any] = {
        "task_id": "child-1",
        "function_id": "fn-1",
        "endpoint_id": "ep-1",
        "user_id": "alice",
        "function_sha256": "c" * 64,
        "payload": b"fx",
        "client": CLIENT,
        "submitted_at": NOW,
        **fields,
    }
    return TaskSubmission(**values)


@pytest.mark.parametrize("data", ["dl", "pk"])
def test_a_placeholder_travels_in_a_pickled_payload_and_is_bound_there(data: str) -> None:
    serializer = Serializer(data=data)
    payload = serializer.pack_arguments(
        (ParentResult("a-1"), 2), {"b": ParentResult("b-1"), "c": [ParentResult("a-1")]}
    )
    args, kwargs = serializer.unpack_arguments(payload)
    assert parents_in(args, kwargs) == ["a-1", "b-1"]
    bound_args, bound_kwargs = bind_parents(args, kwargs, {"a-1": 10, "b-1": "B"})
    assert bound_args == (10, 2)
    # Top level only: a placeholder inside a container is left as it is.
    assert bound_kwargs == {"b": "B", "c": [ParentResult("a-1")]}


def test_binding_without_a_parent_s_value_names_the_parent() -> None:
    with pytest.raises(KeyError, match="parent task p-9"):
        bind_parents((ParentResult("p-9"),), {}, {})


def test_json_refuses_a_placeholder() -> None:
    with pytest.raises(SerializationError):
        Serializer(data="js").pack_arguments((ParentResult("a-1"),))


@pytest.mark.parametrize("bad", ["", "has space", "x" * 129, "under_score"])
def test_a_placeholder_names_a_task_id(bad: str) -> None:
    with pytest.raises(ValueError, match="parent task id"):
        ParentResult(bad)


def test_a_submission_with_parents_round_trips_and_says_what_is_unresolved() -> None:
    submission = _submission(depends_on=["a-1", "b-1"], parent_results={"a-1": b"fxdl\n..."})
    again = decode(encode(submission), TaskSubmission)
    assert again == submission
    assert again.unresolved() == ["b-1"]
    assert _submission().unresolved() == [] and _submission().depends_on == []


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"depends_on": ["a-1", "a-1"]}, "more than once"),
        ({"depends_on": ["child-1"]}, "cannot depend on itself"),
        ({"depends_on": ["a-1"], "parent_results": {"b-1": b""}}, "not in depends_on"),
    ],
)
def test_inconsistent_parents_are_refused(fields: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        _submission(**fields)
    raw = msgspec.msgpack.decode(encode(_submission()))
    raw.update(fields)
    with pytest.raises(RecordDecodeError, match=reason):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)


def test_parents_are_bounded_and_made_of_ids() -> None:
    raw = msgspec.msgpack.decode(encode(_submission()))
    raw["depends_on"] = [f"p-{i}" for i in range(MAX_PARENTS + 1)]
    with pytest.raises(RecordDecodeError):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)
    raw["depends_on"] = ["not an id"]
    with pytest.raises(RecordDecodeError):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)


def test_the_vocabulary_has_the_dag_failures_and_state() -> None:
    assert str(TaskErrorType.PARENT_FAILED) == "ParentFailed"
    assert str(TaskErrorType.PARENT_UNKNOWN) == "ParentUnknown"
    assert str(TaskErrorType.PARENT_RESULT_UNAVAILABLE) == "ParentResultUnavailable"
    assert str(TaskStateName.WAITING_FOR_PARENTS) == "waiting-for-parents"


def test_a_held_task_keeps_the_submission_s_bytes() -> None:
    submission = encode(_submission(depends_on=["a-1"]))
    held = HeldTask(
        task_id="child-1", user_id="alice", depends_on=["a-1"], held_at=NOW, submission=submission
    )
    assert decode(encode(held), HeldTask).submission == submission
