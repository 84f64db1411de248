"""Record schemas: round trips for every kind, and bad bytes always raise RecordDecodeError."""

from __future__ import annotations

import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxstream.topics import (
    MAX_ENDPOINT_GROUP,
    SCHEMA_VERSIONS,
    Attempt,
    ClientInfo,
    DataLocation,
    DeadLetter,
    EndpointLogs,
    EndpointRecord,
    Event,
    EventPredicate,
    FunctionRecord,
    Heartbeat,
    HeldTask,
    LogLine,
    Record,
    RecordDecodeError,
    ResourceSpecification,
    TaskCancel,
    TaskDispatch,
    TaskError,
    TaskErrorType,
    TaskEvent,
    TaskLease,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskSubmission,
    TaskTimings,
    TriggerLimits,
    TriggerRule,
    UserRecord,
    WarmAdvert,
    WarmWorker,
    WindowAggregate,
    decode,
    decode_any,
    encode,
    record_kind,
    task_state_glance,
    task_state_group,
    task_state_name,
)

NOW = time.time()
CLIENT = ClientInfo(
    python_version="3.11.7", fxstream_version="0.1.0", serializers={"dill": "0.3.9"}
)
SUBMISSION = TaskSubmission(
    task_id="0b9c6a36-2f52-4c1e-9a0e-3f2c1d4e5f60",
    function_id="fn-1",
    endpoint_id="ep-1",
    user_id="alice",
    function_sha256="c" * 64,
    payload=b"\x00\x01payload",
    client=CLIENT,
    submitted_at=NOW,
    task_group_id="group-1",
    max_retries=2,
    walltime_s=30.0,
)
ERROR = TaskError(type="ZeroDivisionError", message="division by zero", traceback="Traceback...")
TIMINGS = TaskTimings(submitted_at=NOW, routed_at=NOW + 0.001, started_at=NOW + 0.002)

SAMPLES: list[Record] = [
    UserRecord(user_id="alice", name="Alice", token_sha256="b" * 64, created_at=NOW),
    SUBMISSION,
    TaskDispatch(
        task_id="t-1",
        endpoint_id="ep-1",
        user_id="alice",
        function_sha256="c" * 64,
        routed_at=NOW,
        submission=encode(SUBMISSION),
    ),
    TaskCancel(
        task_id="t-1",
        user_id="alice",
        endpoint_id="ep-1",
        requested_at=NOW,
        reason="no longer needed",
    ),
    TaskResult(
        task_id="t-1",
        user_id="alice",
        function_id="fn-1",
        endpoint_id="ep-1",
        outcome="success",
        value=b"result",
        worker="host:123",
        timings=TIMINGS,
    ),
    TaskResult(
        task_id="t-2",
        user_id="alice",
        function_id="fn-1",
        endpoint_id="ep-1",
        outcome="error",
        error=ERROR,
        attempt=2,
        earlier_attempts=[Attempt(attempt=1, worker="h:1", error=ERROR)],
    ),
    TaskState(
        task_id="t-1",
        user_id="alice",
        function_id="fn-1",
        endpoint_id="ep-1",
        state=TaskStateName.WAITING_FOR_ENDPOINT,
        updated_at=NOW,
        attempts=[Attempt(attempt=1, worker="h:1", error=ERROR)],
        error=ERROR,
    ),
    HeldTask(
        task_id="t-3",
        user_id="alice",
        depends_on=["t-1", "t-2"],
        held_at=NOW,
        submission=encode(SUBMISSION),
    ),
    TaskEvent(
        task_id="t-1",
        user_id="alice",
        function_id="fn-1",
        endpoint_id="ep-1",
        state=TaskStateName.WAITING_FOR_ENDPOINT,
        at=NOW,
        source="liveness",
        attempt=Attempt(
            attempt=1,
            worker="node1",
            error=TaskError(type=TaskErrorType.AGENT_LOST, message="no heartbeat for 30 s"),
        ),
    ),
    FunctionRecord(
        function_id="fn-1",
        name="double",
        owner_id="alice",
        code=b"code",
        code_sha256="a" * 64,
        created_at=NOW,
        container="docker://python:3.11",
        public=True,
        allowed_users=["bob"],
    ),
    EndpointRecord(
        endpoint_id="ep-1", name="laptop", owner_id="alice", created_at=NOW, metadata={"k": "v"}
    ),
    Heartbeat(
        endpoint_id="ep-1",
        agent_id="agent-1",
        sent_at=NOW,
        sequence=7,
        period_s=5.0,
        hostname="node1",
        pid=4242,
        workers_total=4,
        workers_idle=3,
        workers_busy=1,
        queue_depth=2,
        leases=[TaskLease(task_id="t-1", user_id="u-1", function_id="fn-1", attempt=2)],
    ),
    EndpointLogs(
        endpoint_id="ep-1",
        agent_id="agent-1",
        hostname="node1",
        sent_at=NOW,
        lines=[LogLine(at=NOW, level="INFO", logger="fxstream.agent", message="2 workers ready")],
        dropped=3,
    ),
    WarmAdvert(
        endpoint_id="ep-1",
        manager_id="m-1",
        advertised_at=NOW,
        workers=[WarmWorker(worker_id="w-1", container=None, function_ids=["fn-1"])],
    ),
    DataLocation(object_key="obj-1", store="redis", site="ep-1", size_bytes=10, updated_at=NOW),
    Event(
        source="detector-1",
        event_key="/data/run1/f001.h5",
        event_type="created",
        occurred_at=NOW,
        attributes={"size": 1024, "ok": True, "label": "x", "ratio": 0.5, "none": None},
    ),
    TriggerRule(
        rule_id="rule-1",
        owner_id="alice",
        name="frames",
        source="detector-1",
        key_pattern="*.h5",
        predicates=[EventPredicate(attribute="size", op="ge", value=1024)],
        function_id="fn-1",
        function_sha256="c" * 64,
        endpoint_id="ep-1",
        arguments="template",
        template={"path": "attributes.path"},
        limits=TriggerLimits(max_in_flight=4, max_per_second=10.0),
        created_at=NOW,
        updated_at=NOW,
    ),
    DeadLetter(
        original_topic="fx.from.user.alice",
        original_partition=3,
        original_offset=42,
        original_key=b"k",
        original_value=b"\xff\xfe",
        original_headers=[("h", b"v"), ("empty", None)],
        reason="not a valid submission record: truncated",
        error_type="RecordDecodeError",
        component="router",
        failed_at=NOW,
    ),
    WindowAggregate(
        window="hopping",
        size_s=300,
        step_s=60,
        start=NOW - 300,
        end=NOW,
        dimension="function",
        key="fn-1",
        user_id="alice",
        finished=3,
        succeeded=2,
        failed=1,
        states={TaskStateName.ROUTED: 3, TaskStateName.SUCCEEDED: 2, TaskStateName.FAILED: 1},
        latency_histogram={0: 1, 40: 2},
        latency_sum_s=2.5,
        latency_max_s=1.2,
        updated_at=NOW,
    ),
]


def test_every_record_kind_has_a_sample() -> None:
    kinds = {msgspec.inspect.type_info(type(r)).tag for r in SAMPLES}  # type: ignore[attr-defined]
    assert kinds == set(SCHEMA_VERSIONS)


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_round_trip(record: Record) -> None:
    data = encode(record)
    assert decode(data, type(record)) == record
    assert decode_any(data) == record


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_every_record_carries_kind_and_version(record: Record) -> None:
    raw = msgspec.msgpack.decode(encode(record))
    assert raw["v"] == SCHEMA_VERSIONS[raw["kind"]]
    assert raw["kind"] == msgspec.inspect.type_info(type(record)).tag  # type: ignore[attr-defined]


def test_wrong_kind_is_refused_with_reason() -> None:
    with pytest.raises(RecordDecodeError, match="heartbeat") as info:
        decode(encode(SUBMISSION), Heartbeat)
    assert info.value.expected == "heartbeat"
    assert "submission" in info.value.reason


def test_newer_schema_version_is_refused() -> None:
    raw = msgspec.msgpack.decode(encode(SUBMISSION))
    raw["v"] = SCHEMA_VERSIONS["submission"] + 1
    with pytest.raises(RecordDecodeError, match="newer than this reader"):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)
    with pytest.raises(RecordDecodeError, match="upgrade fxstream"):
        decode_any(msgspec.msgpack.encode(raw))


@pytest.mark.parametrize("kind", ["cancel", "dispatch"])
def test_records_that_lost_the_token_are_version_2(kind: str) -> None:
    # Issue 13: no credential in any record (the token left submissions and cancels), and
    # the dispatch gained the router-stamped submitter and code digest.
    assert SCHEMA_VERSIONS[kind] == 2


def test_the_submission_with_staged_files_and_resources_is_version_5() -> None:
    # Issue 13 took its token (v2); issue 14 added its endpoint group (v3); issue 15 its
    # parents (v4); issue 16 its staged files and MPI resource specification (v5): an older
    # reader refuses it ("upgrade fxstream") instead of running a task without its inputs,
    # dropping its outputs, or running an MPI command without its nodes.
    assert SCHEMA_VERSIONS["submission"] == 5


def test_a_resource_specification_travels_and_is_checked_on_decode() -> None:
    spec = ResourceSpecification.from_mapping({"num_nodes": 2, "ranks_per_node": 2})
    assert spec.as_dict() == {"num_nodes": 2, "ranks_per_node": 2, "num_ranks": 4}
    mpi = msgspec.structs.replace(SUBMISSION, resource_specification=spec)
    assert decode(encode(mpi), TaskSubmission).resource_specification == spec
    raw = msgspec.msgpack.decode(encode(mpi))
    raw["resource_specification"]["num_ranks"] = 5
    with pytest.raises(RecordDecodeError, match="num_ranks"):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)
    raw["resource_specification"] = {"num_nodes": 2, "ranks_per_node": 2, "num_ranks": 4, "x": 1}
    with pytest.raises(RecordDecodeError, match="x"):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)
    raw["resource_specification"] = {"num_nodes": 10**6, "ranks_per_node": 1, "num_ranks": 10**6}
    with pytest.raises(RecordDecodeError, match="num_nodes"):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)


@pytest.mark.parametrize(
    ("given", "complete"),
    [
        ({"num_nodes": 2, "ranks_per_node": 3}, (2, 3, 6)),
        ({"num_nodes": 2, "num_ranks": 4}, (2, 2, 4)),
        ({"num_ranks": 4}, (1, 4, 4)),
        ({"num_nodes": 3}, (3, 1, 3)),
        ({"num_nodes": 2, "ranks_per_node": 2, "num_ranks": 4}, (2, 2, 4)),
    ],
)
def test_a_partial_resource_specification_is_completed(
    given: dict[str, int], complete: tuple[int, int, int]
) -> None:
    spec = ResourceSpecification.from_mapping(given)
    assert (spec.num_nodes, spec.ranks_per_node, spec.num_ranks) == complete


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"num_nodes": 2, "ranks_per_node": 2, "num_ranks": 5}, "num_nodes x ranks_per_node"),
        ({"num_nodes": 2, "num_ranks": 3}, "divide evenly"),
        ({"num_nodes": 0}, "positive integer"),
        ({"num_nodes": "2"}, "positive integer"),
        ({"nodes": 2}, "unknown key"),
        ({"launcher_options": "--bind-to core"}, "launcher_options is not supported"),
        ({"num_nodes": 5000}, "4096"),
        ([("num_nodes", 2)], "must be a dict"),
    ],
)
def test_a_bad_resource_specification_is_refused_saying_what_to_change(
    given: object, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        ResourceSpecification.from_mapping(given)


def test_a_submission_s_candidates_are_its_endpoint_and_group_sorted_once_each() -> None:
    assert SUBMISSION.candidates() == ("ep-1",)
    grouped = msgspec.structs.replace(SUBMISSION, endpoint_group=["ep-3", "ep-1", "ep-2"])
    assert decode(encode(grouped), TaskSubmission).candidates() == ("ep-1", "ep-2", "ep-3")
    assert msgspec.structs.replace(SUBMISSION, endpoint_group=[]).candidates() == ("ep-1",)


def test_an_endpoint_group_is_bounded_and_made_of_ids() -> None:
    raw = msgspec.msgpack.decode(encode(SUBMISSION))
    raw["endpoint_group"] = [f"ep-{i}" for i in range(MAX_ENDPOINT_GROUP + 1)]
    with pytest.raises(RecordDecodeError, match="endpoint_group"):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)
    raw["endpoint_group"] = ["not an id"]
    with pytest.raises(RecordDecodeError, match="endpoint_group"):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)


def test_no_task_record_has_a_field_for_a_credential() -> None:
    for record_type in (TaskSubmission, TaskCancel, TaskDispatch):
        names = {f.name for f in msgspec.structs.fields(record_type)}
        assert not {n for n in names if "token" in n or "secret" in n or "password" in n}


def test_a_submission_without_a_code_digest_is_refused() -> None:
    raw = msgspec.msgpack.decode(encode(SUBMISSION))
    del raw["function_sha256"]
    with pytest.raises(RecordDecodeError, match="function_sha256"):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)
    raw["function_sha256"] = "not-a-digest"
    with pytest.raises(RecordDecodeError, match="function_sha256"):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)


def test_unknown_fields_are_ignored_for_additive_evolution() -> None:
    raw = msgspec.msgpack.decode(encode(SUBMISSION))
    raw["added_in_a_later_minor_release"] = [1, 2, 3]
    assert decode(msgspec.msgpack.encode(raw), TaskSubmission) == SUBMISSION


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("task_id", "has space", "task_id"),
        ("task_id", "", "task_id"),
        ("submitted_at", -1.0, "submitted_at"),
        ("payload", "not bytes", "payload"),
        ("max_retries", 1000, "max_retries"),
        ("client", None, "client"),
    ],
)
def test_bad_field_values_name_the_field(field: str, value: object, reason: str) -> None:
    raw = msgspec.msgpack.decode(encode(SUBMISSION))
    raw[field] = value
    with pytest.raises(RecordDecodeError, match=reason):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)


def test_missing_field_is_named() -> None:
    raw = msgspec.msgpack.decode(encode(SUBMISSION))
    del raw["function_id"]
    with pytest.raises(RecordDecodeError, match="function_id"):
        decode(msgspec.msgpack.encode(raw), TaskSubmission)


def test_a_cancel_needs_the_endpoint_and_is_not_a_submission() -> None:
    cancel = TaskCancel(task_id="t-1", user_id="alice", endpoint_id="ep-1", requested_at=NOW)
    assert decode(encode(cancel), TaskCancel).reason == ""
    raw = msgspec.msgpack.decode(encode(cancel))
    del raw["endpoint_id"]
    with pytest.raises(RecordDecodeError, match="endpoint_id"):
        decode(msgspec.msgpack.encode(raw), TaskCancel)
    with pytest.raises(RecordDecodeError, match="cancel"):
        decode(encode(cancel), TaskSubmission)
    with pytest.raises(RecordDecodeError, match="submission"):
        decode(encode(SUBMISSION), TaskCancel)


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_record_kind_names_the_kind_without_checking_the_rest(record: Record) -> None:
    raw = msgspec.msgpack.decode(encode(record))
    assert record_kind(encode(record)) == raw["kind"]
    del raw["v"]
    assert record_kind(msgspec.msgpack.encode(raw)) == raw["kind"]


@pytest.mark.parametrize("data", [None, b"", b"\x93\x01\x02", msgspec.msgpack.encode({"v": 1})])
def test_record_kind_is_none_without_a_kind(data: bytes | None) -> None:
    assert record_kind(data) is None


@pytest.mark.parametrize("value", [None, b""])
def test_empty_value_is_refused(value: bytes | None) -> None:
    with pytest.raises(RecordDecodeError, match="empty"):
        decode(value, TaskSubmission)
    with pytest.raises(RecordDecodeError, match="empty"):
        decode_any(value)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_always_raise_the_typed_error(data: bytes) -> None:
    # Random bytes are never a complete record (a record needs ~10 typed fields), so every
    # input must be refused, and refused with RecordDecodeError, never another exception.
    with pytest.raises(RecordDecodeError):
        decode_any(data)
    with pytest.raises(RecordDecodeError):
        decode(data, TaskSubmission)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_truncated_records_always_raise(record: Record, data: st.DataObject) -> None:
    encoded = encode(record)
    cut = data.draw(st.integers(min_value=0, max_value=len(encoded) - 1))
    with pytest.raises(RecordDecodeError):
        decode(encoded[:cut], type(record))


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(SAMPLES),
    st.dictionaries(
        st.sampled_from(["kind", "v", "task_id", "payload", "x"]), msgpack_values, max_size=3
    ),
)
def test_well_formed_msgpack_with_wrong_fields_is_refused_or_valid(
    record: Record, changes: dict[str, object]
) -> None:
    # Structurally valid MessagePack with fields overwritten by arbitrary values: the
    # decoder either refuses it with the typed error or yields a fully valid record.
    raw = msgspec.msgpack.decode(encode(record))
    raw.update(changes)
    try:
        decoded = decode_any(msgspec.msgpack.encode(raw))
    except RecordDecodeError:
        return
    assert isinstance(decoded, Record)
    assert decode_any(encode(decoded)) == decoded


# --- glances: a task state's few fields without decoding the rest ----------------------------

ids = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9-]{0,40}\Z")
task_states = st.builds(
    TaskState,
    task_id=ids,
    user_id=ids,
    function_id=ids,
    endpoint_id=ids,
    task_group_id=st.none() | ids,
    state=st.sampled_from(list(TaskStateName)),
    updated_at=st.floats(min_value=0, max_value=4e9),
    timings=st.just(TaskTimings()) | st.just(TIMINGS),
    attempts=st.lists(
        st.builds(Attempt, attempt=st.integers(1, 9), error=st.none() | st.just(ERROR)),
        max_size=3,
    ),
    error=st.none() | st.just(ERROR),
    value=st.none() | st.binary(max_size=64),
    tags=st.dictionaries(
        st.from_regex(r"\A[a-z][a-z0-9_.-]{0,8}\Z"),
        st.from_regex(r"\A[a-z0-9]{1,8}\Z"),
        max_size=3,
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(task_states)
def test_the_glances_agree_with_the_full_decode(state: TaskState) -> None:
    encoded = encode(state)
    decoded = decode(encoded, TaskState)
    assert task_state_group(encoded) == (decoded.user_id, decoded.task_group_id)
    assert task_state_glance(encoded) == (decoded.state, decoded.updated_at)
    assert task_state_name(encoded) == (decoded.task_id, decoded.state)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    task_states,
    st.dictionaries(
        st.sampled_from(["kind", "user_id", "task_group_id", "task_id", "state", "x"]),
        msgpack_values | ids,
        max_size=2,
    ),
)
def test_a_task_state_the_full_decode_accepts_glances_the_same(
    state: TaskState, changes: dict[str, object]
) -> None:
    # Fields overwritten by arbitrary values: whatever the full decode accepts, the glance
    # reads the same user and group from (it may read more than the full decode accepts:
    # it checks nothing else, and a view decodes what it keeps).
    raw = msgspec.msgpack.decode(encode(state))
    raw.update(changes)
    encoded = msgspec.msgpack.encode(raw)
    try:
        decoded = decode(encoded, TaskState)
    except RecordDecodeError:
        return
    assert task_state_group(encoded) == (decoded.user_id, decoded.task_group_id)
    assert task_state_name(encoded) == (decoded.task_id, decoded.state)


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_the_group_glance_reads_no_other_kind(record: Record) -> None:
    glance = task_state_group(encode(record))
    name = task_state_name(encode(record))
    if isinstance(record, TaskState):
        assert glance == (record.user_id, record.task_group_id)
        assert name == (record.task_id, record.state)
    else:
        assert glance is None
        assert name is None


@pytest.mark.parametrize("data", [None, b"", b"\x93\x01\x02", msgspec.msgpack.encode({"v": 1})])
def test_the_group_glance_of_bytes_holding_no_task_state_is_none(data: bytes | None) -> None:
    assert task_state_group(data) is None
    assert task_state_name(data) is None
