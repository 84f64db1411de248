"""Fuzz the record codec: bad bytes raise RecordDecodeError with a reason, and nothing else."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxstream.topics import (
    DeadLetter,
    Heartbeat,
    Record,
    RecordDecodeError,
    TaskDispatch,
    TaskResult,
    TaskSubmission,
    decode,
    decode_any,
    encode,
)
from tests.fuzz.strategies import (
    BadValue,
    bad_values,
    new_id,
    valid_dispatch,
    valid_heartbeat,
    valid_result,
    valid_submission,
)

FAST = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

SUBMISSION = valid_submission(user_id=new_id(), function_id=new_id(), endpoint_id=new_id())
SAMPLES: list[Record] = [
    SUBMISSION,
    valid_dispatch(SUBMISSION),
    valid_result(user_id=new_id()),
    valid_heartbeat(),
]


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_valid_samples_round_trip(record: Record) -> None:
    # The bad values are mutations of these: they must be valid to start with.
    assert decode(encode(record), type(record)) == record
    assert decode_any(encode(record)) == record


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
@FAST
@given(data=st.data())
def test_bad_values_raise_only_record_decode_error_with_a_reason(
    record: Record, data: st.DataObject
) -> None:
    bad: BadValue = data.draw(bad_values(record), label="bad")
    with pytest.raises(RecordDecodeError) as typed:
        decode(bad.value, type(record))
    assert typed.value.reason, bad
    assert str(typed.value).startswith("not a valid"), bad


@FAST
@given(value=st.one_of(st.none(), st.binary(max_size=4_000)))
def test_decode_any_raises_nothing_but_record_decode_error(value: bytes | None) -> None:
    for kind in (TaskSubmission, TaskDispatch, TaskResult, Heartbeat, DeadLetter):
        try:
            decode(value, kind)
        except RecordDecodeError as exc:
            assert exc.reason
    try:
        decode_any(value)
    except RecordDecodeError as exc:
        assert exc.reason


def test_deep_nesting_is_a_decode_error_not_a_recursion_error() -> None:
    for depth in (1_000, 100_000):
        nested = b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]
        with pytest.raises(RecordDecodeError):
            decode_any(nested)
        with pytest.raises(RecordDecodeError):
            decode(b"\x81\xa4kind" + nested, TaskSubmission)


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_a_record_without_its_kind_is_read_only_where_the_kind_is_known(record: Record) -> None:
    fields = msgspec.msgpack.decode(encode(record))
    del fields["kind"]
    untagged = msgspec.msgpack.encode(fields)
    assert decode(untagged, type(record)) == record
    with pytest.raises(RecordDecodeError, match="kind"):
        decode_any(untagged)


@pytest.mark.parametrize(
    ("record", "path"),
    [
        (SUBMISSION, ("submitted_at",)),
        (SUBMISSION, ("walltime_s",)),
        (SAMPLES[2], ("timings", "finished_at")),
        (SAMPLES[3], ("sent_at",)),
        (SAMPLES[3], ("period_s",)),
    ],
    ids=lambda p: ".".join(p) if isinstance(p, tuple) else type(p).__name__,
)
def test_regression_an_infinite_time_is_refused(record: Record, path: tuple[str, ...]) -> None:
    # Found by the fuzz: infinity passed the ``ge=0`` bound, and then pinned an endpoint
    # online forever (no later heartbeat is newer) and showed as null in the API.
    fields = msgspec.msgpack.decode(encode(record))
    target = fields
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = float("inf")
    with pytest.raises(RecordDecodeError, match=path[-1]):
        decode(msgspec.msgpack.encode(fields), type(record))
