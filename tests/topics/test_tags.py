"""Task tags in the wire contract: their bounds, the SDK-side check, and old records."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from fxstream.topics import (
    ClientInfo,
    RecordDecodeError,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskSubmission,
    decode,
    encode,
)
from fxstream.topics.budget import (
    MAX_TAG_KEY_CHARS,
    MAX_TAG_VALUE_CHARS,
    MAX_TASK_TAGS,
    TAGS_MAX_BYTES,
    check_tags,
)

SUBMISSION = TaskSubmission(
    task_id="t-1",
    function_id="f-1",
    endpoint_id="e-1",
    user_id="u-1",
    function_sha256="0" * 64,
    payload=b"p",
    client=ClientInfo(python_version="3.11.7", fxstream_version="0.1.0"),
    submitted_at=1.0,
)


def with_tags(tags: Any) -> bytes:
    return encode(msgspec.structs.replace(SUBMISSION, tags=tags))


def test_tags_round_trip_in_submissions_results_and_states() -> None:
    tags = {"run": "42", "beamline.sample": "8-ID-I: a/b é"}
    assert decode(with_tags(tags), TaskSubmission).tags == tags
    result = TaskResult(
        task_id="t-1", user_id="u-1", function_id="f-1", endpoint_id="e-1", outcome="success"
    )
    assert decode(encode(msgspec.structs.replace(result, tags=tags)), TaskResult).tags == tags
    state = TaskState(
        task_id="t-1",
        user_id="u-1",
        function_id="f-1",
        endpoint_id="e-1",
        state=TaskStateName.ROUTED,
        updated_at=1.0,
        tags=tags,
    )
    assert decode(encode(state), TaskState).tags == tags


def test_a_record_written_before_tags_reads_with_none() -> None:
    old = msgspec.msgpack.decode(encode(SUBMISSION))
    del old["tags"]
    old["v"] = 3
    record = decode(msgspec.msgpack.encode(old), TaskSubmission)
    assert record.tags == {} and record.v == 3


@pytest.mark.parametrize(
    "tags",
    [
        {f"k{i}": "v" for i in range(MAX_TASK_TAGS + 1)},
        {"a:b": "c"},
        {"": "c"},
        {"k" * (MAX_TAG_KEY_CHARS + 1): "v"},
        {"k": ""},
        {"k": "v" * (MAX_TAG_VALUE_CHARS + 1)},
        {"k": "line\n"},
        {"k\n": "v"},
        {"k": "\x00"},
    ],
)
def test_the_schema_refuses_tags_beyond_their_bounds(tags: dict[str, str]) -> None:
    with pytest.raises(RecordDecodeError, match="tags"):
        decode(with_tags(tags), TaskSubmission)
    with pytest.raises(ValueError, match="tag"):
        check_tags(tags)


def test_the_sdk_check_says_what_to_change() -> None:
    assert check_tags(None) == {}
    assert check_tags({"run": "42"}) == {"run": "42"}
    cases: list[tuple[Any, str]] = [
        ({f"k{i}": "v" for i in range(9)}, "at most 8 tags, not 9"),
        ({"a b": "c"}, "no ':' or spaces"),
        ({"n": 7}, r"pass str\(7\)"),
        ({"k": "x" * 65}, "put a longer text in the task's arguments"),
        (["run"], "mapping of str to str"),
        ({"k": "\ud800"}, "not valid"),
    ]
    for tags, says in cases:
        with pytest.raises(ValueError, match=says):
            check_tags(tags)


def test_the_largest_tags_fit_their_byte_bound() -> None:
    widest = {
        f"{i}".rjust(MAX_TAG_KEY_CHARS, "k"): "\U0001f600" * MAX_TAG_VALUE_CHARS
        for i in range(MAX_TASK_TAGS)
    }
    assert check_tags(widest) == widest
    added = len(with_tags(widest)) - len(encode(SUBMISSION))
    assert 0 < added <= TAGS_MAX_BYTES
