"""Hypothesis strategies for records a consumer must refuse, and the records they start from.

Every bad value here is bad *by construction*, so a consumer that accepts one
has a bug: random bytes, a truncated valid record, a valid MessagePack map of
another ``kind``, a schema version newer than this code, a field of the wrong
type, a missing required field, a huge or malformed id, non-finite numbers,
and the tombstone (``None``). Each is a :class:`BadValue` that says which of
these it is, so a failing example names what went wrong.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from hypothesis import strategies as st

from fxstream.topics import (
    SCHEMA_VERSIONS,
    Heartbeat,
    Record,
    RoutingKeys,
    TaskDispatch,
    TaskLease,
    TaskResult,
    TaskSubmission,
    TaskTimings,
    client_info,
    decode_any,
    encode,
)

__all__ = [
    "BAD_KINDS",
    "BadValue",
    "FuzzRecord",
    "bad_values",
    "headers",
    "keys",
    "valid_dispatch",
    "valid_heartbeat",
    "valid_result",
    "valid_submission",
]

# Every way a value can be bad, as the ``how`` of a BadValue.
BAD_KINDS = (
    "tombstone",
    "empty",
    "random-bytes",
    "not-a-map",
    "truncated",
    "wrong-kind",
    "newer-version",
    "wrong-type",
    "missing-field",
    "huge-id",
    "invalid-id",
    "non-finite",
    "huge-stamp",
)

# Longer than any id or text limit of the schemas (ids: 128, texts: 65,536).
HUGE = 70_000


@dataclass(frozen=True)
class BadValue:
    """A record value no consumer may accept, and how it was made."""

    how: str
    value: bytes | None

    def __repr__(self) -> str:
        shown = self.value if self.value is None or len(self.value) <= 120 else self.value[:120]
        size = 0 if self.value is None else len(self.value)
        return f"BadValue({self.how}, {size} bytes: {shown!r})"


@dataclass(frozen=True)
class FuzzRecord:
    """A consumed Kafka record, shaped as the processors receive one (``RawRecord``)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]] = field(default_factory=list)
    timestamp: int = 0


# The samples' routing stamps are made with a key of their own (no test shares it).
SAMPLE_KEYS = RoutingKeys.generate()


def new_id() -> str:
    """A fresh uuid4, as fxstream issues ids."""
    return str(uuid.uuid4())


def valid_submission(
    *,
    user_id: str,
    function_id: str,
    endpoint_id: str,
    task_id: str | None = None,
    function_sha256: str = "0" * 64,
) -> TaskSubmission:
    """A well-formed submission (its payload is opaque bytes: the router never reads it)."""
    return TaskSubmission(
        task_id=task_id or new_id(),
        function_id=function_id,
        endpoint_id=endpoint_id,
        user_id=user_id,
        function_sha256=function_sha256,
        payload=b"FXS\x00opaque arguments",
        client=client_info(),
        submitted_at=time.time(),
        task_group_id=new_id(),
        max_retries=2,
        walltime_s=30.0,
    )


def valid_result(*, user_id: str, task_id: str | None = None) -> TaskResult:
    """A well-formed success result, stamped as routed (with :data:`SAMPLE_KEYS`)."""
    task_id, function_id, endpoint_id = task_id or new_id(), new_id(), new_id()
    return TaskResult(
        task_id=task_id,
        user_id=user_id,
        function_id=function_id,
        endpoint_id=endpoint_id,
        task_group_id=new_id(),
        outcome="success",
        value=b"a value",
        worker="host:1",
        timings=TaskTimings(submitted_at=time.time(), finished_at=time.time()),
        routing_stamp=SAMPLE_KEYS.stamp(
            task_id=task_id, endpoint_id=endpoint_id, user_id=user_id, function_id=function_id
        ),
    )


def valid_heartbeat(*, endpoint_id: str | None = None) -> Heartbeat:
    """A well-formed heartbeat leasing one task."""
    return Heartbeat(
        endpoint_id=endpoint_id or new_id(),
        agent_id=new_id(),
        sent_at=time.time(),
        sequence=3,
        period_s=5.0,
        hostname="node-1",
        pid=123,
        workers_total=2,
        workers_idle=1,
        workers_busy=1,
        queue_depth=0,
        leases=[TaskLease(task_id=new_id(), user_id=new_id(), function_id=new_id())],
        agent_version="0.1.0",
    )


def valid_dispatch(submission: TaskSubmission) -> TaskDispatch:
    """A well-formed dispatch of ``submission``, as the router writes it (stamped with
    :data:`SAMPLE_KEYS`, which no service holds)."""
    return TaskDispatch(
        task_id=submission.task_id,
        endpoint_id=submission.endpoint_id,
        user_id=submission.user_id,
        function_sha256=submission.function_sha256,
        routed_at=time.time(),
        submission=encode(submission),
        routing_stamp=SAMPLE_KEYS.stamp(
            task_id=submission.task_id,
            endpoint_id=submission.endpoint_id,
            user_id=submission.user_id,
            function_id=submission.function_id,
        ),
    )


# --- mutations of a valid record ---------------------------------------------------------


def _as_map(record: Record) -> dict[str, Any]:
    fields: dict[str, Any] = msgspec.msgpack.decode(encode(record))
    return fields


def _pack(fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


def _wrong_type_for(value: object) -> st.SearchStrategy[object]:
    """Values of a type the schema never accepts where ``value`` stands."""
    if isinstance(value, bool):
        return st.sampled_from(["true", 1.5, [True], {"b": 1}])
    if isinstance(value, int | float):
        return st.sampled_from(["12", b"12", [1], {"n": 1}, True])
    if isinstance(value, str):
        return st.sampled_from([12, 1.5, b"bytes", ["a"], {"s": "a"}, True])
    if isinstance(value, bytes):
        return st.sampled_from([12, 1.5, ["a"], {"b": b"x"}, True])
    if isinstance(value, list):
        return st.sampled_from([12, "a list", {"l": 1}, b"x", True])
    if isinstance(value, dict):
        return st.sampled_from([12, "a map", [1, 2], b"x", True])
    raise AssertionError(f"no wrong type known for {value!r}")


@st.composite
def _wrong_type(draw: st.DrawFn, record: Record) -> BadValue:
    fields = _as_map(record)
    names = sorted(n for n, v in fields.items() if n != "kind" and v is not None)
    name = draw(st.sampled_from(names))
    fields[name] = draw(_wrong_type_for(fields[name]))
    return BadValue(f"wrong-type:{name}", _pack(fields))


@st.composite
def _missing_field(draw: st.DrawFn, record: Record) -> BadValue:
    fields = _as_map(record)
    required = sorted(f.encode_name for f in _required_fields(type(record)))
    # Not ``kind``: a reader that knows which kind it expects (the topic says) accepts
    # a record without its tag; decode_any, which cannot know, refuses it.
    name = draw(st.sampled_from(required))
    del fields[name]
    return BadValue(f"missing-field:{name}", _pack(fields))


def _required_fields(kind: type[Record]) -> list[msgspec.inspect.Field]:
    info = msgspec.inspect.type_info(kind)
    assert isinstance(info, msgspec.inspect.StructType)
    return [f for f in info.fields if f.required]


def _id_fields(record: Record) -> list[str]:
    return sorted(
        name
        for name, value in _as_map(record).items()
        if name.endswith("_id") and isinstance(value, str)
    )


@st.composite
def _huge_id(draw: st.DrawFn, record: Record) -> BadValue:
    fields = _as_map(record)
    name = draw(st.sampled_from(_id_fields(record)))
    fields[name] = draw(st.sampled_from(["a" * HUGE, "1" * 129]))
    return BadValue(f"huge-id:{name}", _pack(fields))


# Ids are 1-128 of [A-Za-z0-9-], starting with a letter or digit: each of these breaks that.
_invalid_ids = st.one_of(
    st.just(""),
    st.just("-leading-dash"),
    st.just("has_underscore"),
    st.just("../../etc/passwd"),
    st.just("with space"),
    st.just("dot.ted"),
    st.text(min_size=1, max_size=20).map(lambda s: s + "/" + s),
    st.text(alphabet="äößé€漢字\x00\n\t", min_size=1, max_size=10),
)


@st.composite
def _invalid_id(draw: st.DrawFn, record: Record) -> BadValue:
    fields = _as_map(record)
    name = draw(st.sampled_from(_id_fields(record)))
    fields[name] = draw(_invalid_ids)
    return BadValue(f"invalid-id:{name}", _pack(fields))


def _float_paths(fields: dict[str, Any]) -> list[tuple[str, ...]]:
    # The top-level and one-level-nested floats: timestamps, periods, walltimes.
    paths: list[tuple[str, ...]] = []
    for name, value in fields.items():
        if isinstance(value, float):
            paths.append((name,))
        elif isinstance(value, dict):
            paths.extend((name, inner) for inner, v in value.items() if isinstance(v, float))
    return sorted(paths)


@st.composite
def _non_finite(draw: st.DrawFn, record: Record) -> BadValue:
    fields = _as_map(record)
    path = draw(st.sampled_from(_float_paths(fields)))
    target = fields
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = draw(st.sampled_from([math.inf, -math.inf, math.nan]))
    return BadValue(f"non-finite:{'.'.join(path)}", _pack(fields))


@st.composite
def _huge_stamp(draw: st.DrawFn, record: Record) -> BadValue:
    fields = _as_map(record)
    fields["routing_stamp"] = draw(st.sampled_from(["v1.k." + "A" * 59, "x" * HUGE]))
    return BadValue("huge-stamp", _pack(fields))


@st.composite
def _wrong_kind(draw: st.DrawFn, record: Record) -> BadValue:
    fields = _as_map(record)
    own = fields["kind"]
    others = [k for k in SCHEMA_VERSIONS if k != own]
    fields["kind"] = draw(
        st.one_of(st.sampled_from(others), st.text(max_size=30), st.integers(-(2**63), 2**63))
    )
    if fields["kind"] == own:
        fields["kind"] = own + "x"
    return BadValue("wrong-kind", _pack(fields))


@st.composite
def _newer_version(draw: st.DrawFn, record: Record) -> BadValue:
    fields = _as_map(record)
    fields["v"] = SCHEMA_VERSIONS[fields["kind"]] + draw(st.integers(1, 2**40))
    return BadValue("newer-version", _pack(fields))


@st.composite
def _truncated(draw: st.DrawFn, record: Record) -> BadValue:
    whole = encode(record)
    cut = draw(st.integers(1, len(whole) - 1))
    return BadValue(f"truncated:{cut}/{len(whole)}", whole[:cut])


def _is_not_a_record(data: bytes) -> bool:
    try:
        decode_any(data)
    except Exception:
        return True
    return False


# MessagePack values that are not maps at all: scalars, arrays, extension types.
_not_a_map = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=50),
    st.binary(max_size=50),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5),
    st.none(),
    st.booleans(),
).map(_pack)


def bad_values(record: Record) -> st.SearchStrategy[BadValue]:
    """Every kind of bad value, most of them derived from ``record`` (a valid one)."""
    stamped = [_huge_stamp(record)] if "routing_stamp" in _as_map(record) else []
    return st.one_of(
        st.just(BadValue("tombstone", None)),
        st.just(BadValue("empty", b"")),
        # Random bytes are very rarely a valid record; the filter makes "rarely" "never".
        st.binary(min_size=1, max_size=2_000)
        .filter(_is_not_a_record)
        .map(lambda b: BadValue("random-bytes", b)),
        _not_a_map.map(lambda b: BadValue("not-a-map", b)),
        _truncated(record),
        _wrong_kind(record),
        _newer_version(record),
        _wrong_type(record),
        _missing_field(record),
        _huge_id(record),
        _invalid_id(record),
        _non_finite(record),
        *stamped,
    )


# --- keys and headers, as anyone may send them --------------------------------------------

keys = st.one_of(st.none(), st.binary(max_size=200), st.just(b"\xff" * 10_000))
headers = st.lists(
    st.tuples(st.text(max_size=30), st.one_of(st.none(), st.binary(max_size=100))), max_size=4
)
