"""The byte budget: truncation in UTF-8 bytes, and every planned record fits its topic."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxstream.topics import (
    Attempt,
    Catalogue,
    DeadLetter,
    DeadLetterReason,
    RecordDecodeError,
    RecordTooLarge,
    RoutingKey,
    TaskDispatch,
    TaskError,
    TaskResult,
    TaskState,
    TaskStateName,
    WindowAggregate,
    dead_letter,
    decode,
    encode,
    fit_result,
    fit_state,
    fits,
    producer_message_max_bytes,
    record_bytes,
    routing_stamp,
    truncate_utf8,
    truncate_utf8_tail,
    utf8_len,
)
from fxstream.topics.budget import (
    DISPATCH_OVERHEAD_BYTES,
    ERROR_MESSAGE_MAX_BYTES,
    OUTPUT_MAX_BYTES,
    TRACEBACK_MAX_BYTES,
    max_submission_bytes,
)
from fxstream.topics.records import LATENCY_BUCKETS, LATEST_TIMESTAMP
from fxstream.topics.routing_stamp import MAX_KEY_ID_CHARS, ROUTING_STAMP_MAX_CHARS

CATALOGUE = Catalogue()
RESULTS = CATALOGUE.spec("results.{user_id}")
TASK_STATE = CATALOGUE.spec("task-state")
DEAD_LETTER = CATALOGUE.spec("dead-letter")
QUEUE = CATALOGUE.spec("tasks.ep.{endpoint_id}")
TASK = "7d1c1f44-3b55-4f2a-9d0e-4c1f1f0e2a11"
# The longest stamp a record may carry: the longest key id (results and events carry
# the dispatch's stamp, so every budget must leave room for it).
LONGEST_STAMP = routing_stamp(
    RoutingKey("k" * MAX_KEY_ID_CHARS, b"s" * 32),
    task_id=TASK,
    endpoint_id="e-1",
    user_id="u-1",
    function_id="f-1",
)
EMOJI = "\U0001f600"


def _result(
    *, message: str = "", traceback: str = "", value: bytes | None = None, attempts: int = 0
) -> TaskResult:
    error = None if value is not None else TaskError(type="ValueError", message=message)
    if error is not None:
        error = msgspec.structs.replace(error, traceback=traceback)
    earlier = [
        Attempt(
            attempt=n + 1,
            worker="host:1",
            error=TaskError(type="ValueError", message=message, traceback=traceback),
        )
        for n in range(attempts)
    ]
    return TaskResult(
        task_id=TASK,
        user_id="u-1",
        function_id="f-1",
        endpoint_id="e-1",
        outcome="success" if value is not None else "error",
        value=value,
        error=error,
        attempt=attempts + 1,
        earlier_attempts=earlier,
        routing_stamp=LONGEST_STAMP,
    )


# --- truncation ----------------------------------------------------------------------------


def test_truncation_counts_bytes_and_cuts_at_a_character_boundary() -> None:
    text = EMOJI * 1000  # 4,000 bytes
    cut = truncate_utf8(text, 1001)
    assert utf8_len(cut) <= 1001
    assert cut.startswith(EMOJI * 200)
    assert cut.endswith("bytes cut]")
    tail = truncate_utf8_tail("a" + text, 1001)
    assert utf8_len(tail) <= 1001
    assert tail.endswith(EMOJI * 200)
    assert tail.startswith("...[")


def test_text_within_the_limit_is_unchanged_and_lone_surrogates_are_replaced() -> None:
    assert truncate_utf8("short", 100) == "short"
    assert truncate_utf8("bad \ud800 half", 100) == "bad ? half"


@given(st.text(), st.integers(min_value=0, max_value=5000))
def test_truncation_never_exceeds_its_byte_limit(text: str, limit: int) -> None:
    assert utf8_len(truncate_utf8(text, limit)) <= limit
    assert utf8_len(truncate_utf8_tail(text, limit)) <= limit


# --- sizes ---------------------------------------------------------------------------------


def test_headers_count_against_the_topic() -> None:
    value = b"x" * (RESULTS.max_message_bytes - 2000)
    assert fits(RESULTS, b"k", value)
    assert not fits(RESULTS, b"k", value, [("trace", b"t" * 2000)])


def test_the_longest_stamp_is_the_schemas_bound() -> None:
    assert len(LONGEST_STAMP) == ROUTING_STAMP_MAX_CHARS
    # One character more is refused by the schema, wherever the stamp is carried.
    with pytest.raises(RecordDecodeError, match="routing_stamp"):
        decode(encode(msgspec.structs.replace(_result(), routing_stamp="x" * 64)), TaskResult)


ids = st.integers(min_value=1, max_value=128).map(lambda n: "a" * n)


@settings(max_examples=80, deadline=None)
@given(
    task=ids,
    endpoint=ids,
    user=ids,
    stamp_chars=st.integers(min_value=0, max_value=ROUTING_STAMP_MAX_CHARS),
    attempt=st.one_of(st.just(1), st.integers(min_value=1, max_value=2**63 - 1)),
    routed_at=st.floats(min_value=0, max_value=LATEST_TIMESTAMP),
    # Across msgpack's bin8, bin16 and bin32 headers.
    submission_bytes=st.sampled_from([0, 1, 255, 256, 65_535, 65_536, 1_000_000]),
)
def test_a_dispatch_adds_at_most_its_overhead_around_the_submission(
    task: str,
    endpoint: str,
    user: str,
    stamp_chars: int,
    attempt: int,
    routed_at: float,
    submission_bytes: int,
) -> None:
    """What the SDK, the trigger and dependencies processors leave room for
    (max_submission_bytes) covers every dispatch the router can write: the longest ids,
    stamp, attempt and timestamp, whatever the submission's size."""
    dispatch = TaskDispatch(
        task_id=task,
        endpoint_id=endpoint,
        user_id=user,
        function_sha256="0" * 64,
        routed_at=routed_at,
        attempt=attempt,
        submission=b"s" * submission_bytes,
        routing_stamp="v" * stamp_chars,
    )
    assert len(encode(dispatch)) - submission_bytes <= DISPATCH_OVERHEAD_BYTES


@settings(max_examples=30, deadline=None)
@given(key_chars=st.integers(min_value=1, max_value=128), header_bytes=st.integers(0, 100_000))
def test_the_largest_submission_the_sdk_sends_fits_the_queue_once_stamped(
    key_chars: int, header_bytes: int
) -> None:
    key = ("t" * key_chars).encode()
    headers = [("trace", b"h" * header_bytes)] if header_bytes else []
    room = max_submission_bytes(CATALOGUE, key, headers)
    longest = "a" * 128
    dispatch = TaskDispatch(
        task_id=longest,
        endpoint_id=longest,
        user_id=longest,
        function_sha256="0" * 64,
        routed_at=LATEST_TIMESTAMP,
        attempt=1,
        submission=b"s" * room,
        routing_stamp=LONGEST_STAMP,
    )
    assert fits(QUEUE, key, encode(dispatch), headers)


def test_producers_let_through_every_record_some_topic_accepts() -> None:
    largest = max(spec.max_message_bytes for spec in CATALOGUE.specs)
    assert producer_message_max_bytes(CATALOGUE) >= largest
    # librdkafka's default (1,000,000) is below a 1 MiB topic's records: the cause of
    # MSG_SIZE_TOO_LARGE inside an agent's transaction for a 999,530-byte result.
    assert producer_message_max_bytes(CATALOGUE) > 1_000_000


# --- results and states --------------------------------------------------------------------


def test_an_emoji_error_is_bounded_in_bytes() -> None:
    fitted = fit_result(_result(message=EMOJI * 300_000, traceback=EMOJI * 300_000), RESULTS)
    assert fitted.error is not None
    assert utf8_len(fitted.error.message) <= ERROR_MESSAGE_MAX_BYTES
    assert utf8_len(fitted.error.traceback) <= TRACEBACK_MAX_BYTES
    assert fits(RESULTS, TASK.encode(), encode(fitted))


def test_many_large_attempts_drop_the_oldest_with_a_note() -> None:
    result = _result(message="m" * 30_000, traceback="t" * 60_000, attempts=100)
    # 100 attempts keep 4 kB messages each: 400 kB fits a 1 MiB topic, not a 200 kB one.
    assert fits(RESULTS, TASK.encode(), encode(fit_result(result, RESULTS)))
    fitted = fit_result(result, 200_000)
    assert fits(200_000, TASK.encode(), encode(fitted))
    assert fitted.error is not None
    assert len(fitted.earlier_attempts) < 100
    assert "oldest of 100 attempts left out" in fitted.error.message
    # The newest attempts are the ones kept.
    assert fitted.earlier_attempts[-1].attempt == 100


def test_a_value_that_cannot_fit_raises_with_the_sizes() -> None:
    with pytest.raises(RecordTooLarge) as raised:
        fit_result(_result(value=b"x" * RESULTS.max_message_bytes), RESULTS)
    assert raised.value.limit == RESULTS.max_message_bytes
    assert raised.value.size > raised.value.limit


def test_printed_output_keeps_its_tail_and_gives_way_to_the_value() -> None:
    lines = "".join(f"line {n}\n" for n in range(10_000))  # 98,890 bytes
    fitted = fit_result(msgspec.structs.replace(_result(value=b"v"), stdout=lines), RESULTS)
    assert utf8_len(fitted.stdout) <= OUTPUT_MAX_BYTES
    assert fitted.stdout.endswith("line 9999\n") and "bytes cut]" in fitted.stdout
    # A value that leaves no room: the output shrinks (to nothing), the value stays.
    room = RESULTS.max_message_bytes - 2_000
    big = msgspec.structs.replace(_result(value=b"x" * room), stdout=lines, stderr=EMOJI * 9_000)
    squeezed = fit_result(big, RESULTS)
    assert squeezed.value == big.value
    assert utf8_len(squeezed.stdout) + utf8_len(squeezed.stderr) < 2_000
    assert fits(RESULTS, TASK.encode(), encode(squeezed))


def test_a_state_drops_a_value_that_does_not_fit() -> None:
    state = TaskState(
        task_id=TASK,
        user_id="u-1",
        function_id="f-1",
        endpoint_id="e-1",
        state=TaskStateName.SUCCEEDED,
        updated_at=1.0,
        value=b"v" * TASK_STATE.max_message_bytes,
    )
    fitted = fit_state(state, TASK_STATE)
    assert fitted.value is None
    small = msgspec.structs.replace(state, value=b"v" * 10)
    assert fit_state(small, TASK_STATE).value == b"v" * 10


texts = st.one_of(
    st.text(max_size=50),
    st.builds(
        lambda c, n: c * n,
        st.sampled_from(["a", "\u00e9", "\u20ac", EMOJI]),
        st.integers(min_value=0, max_value=400_000),
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    message=texts,
    traceback=texts,
    value_size=st.one_of(st.none(), st.integers(min_value=0, max_value=1_100_000)),
    attempts=st.integers(min_value=0, max_value=100),
    header_bytes=st.integers(min_value=0, max_value=200_000),
    printed=texts,
)
def test_every_planned_record_fits_its_topic(
    message: str,
    traceback: str,
    value_size: int | None,
    attempts: int,
    header_bytes: int,
    printed: str,
) -> None:
    """Results, states and dead letters from any error, value, retries, printed output and
    headers fit."""
    headers = [("trace", b"h" * header_bytes)] if header_bytes else []
    key = TASK.encode()
    value = None if value_size is None else b"x" * value_size
    result = _result(message=message, traceback=traceback, value=value, attempts=attempts % 10)
    result = msgspec.structs.replace(result, stdout=printed, stderr=printed[::-1])
    if attempts >= 10:
        result = msgspec.structs.replace(
            result,
            earlier_attempts=[
                msgspec.structs.replace(result.earlier_attempts[0], attempt=n + 1)
                for n in range(attempts)
            ]
            if result.earlier_attempts
            else [],
        )
    try:
        fitted = fit_result(result, RESULTS, key=key, headers=headers)
    except RecordTooLarge:
        assert value is not None
        assert not fits(RESULTS, key, value, headers)
        fitted = None
    if fitted is not None:
        assert fits(RESULTS, key, encode(fitted), headers)
        decode(encode(fitted), TaskResult)  # and it is valid
    error = result.error or TaskError(type="ValueError", message=message, traceback=traceback)
    state = TaskState(
        task_id=TASK,
        user_id="u-1",
        function_id="f-1",
        endpoint_id="e-1",
        state=TaskStateName.FAILED,
        updated_at=1.0,
        attempts=[*result.earlier_attempts, Attempt(attempt=attempts + 1, error=error)],
        error=error,
        value=value,
    )
    fitted_state = fit_state(state, TASK_STATE, key=key)
    assert fits(TASK_STATE, key, encode(fitted_state))
    decode(encode(fitted_state), TaskState)
    letter = dead_letter(
        topic="fx.results.u-1",
        partition=0,
        offset=1,
        key=key * (1 + header_bytes // 1000),
        value=encode(result) if value_size is None or value_size < 2_000_000 else value,
        headers=headers * 3,
        reason=message * 3,
        error_type=DeadLetterReason.RESULT_TOO_LARGE,
        component="agent " + message,
    )
    encoded = encode(letter)
    assert fits(DEAD_LETTER, letter.original_key, encoded)
    decode(encoded, DeadLetter)


def test_a_dead_letter_of_an_oversized_original_keeps_a_digest() -> None:
    original = b"\x00garbage" * 300_000  # 2.4 MB
    letter = dead_letter(
        topic="fx.tasks.ep.e-1",
        partition=0,
        offset=7,
        key=b"k",
        value=original,
        reason="not a dispatch",
        error_type=DeadLetterReason.DECODE_ERROR,
        component="agent e-1",
    )
    assert letter.original_value_digest is not None
    assert letter.original_value_digest.size == len(original)
    assert letter.original_value_digest.sha256 == hashlib.sha256(original).hexdigest()
    assert letter.original_value is not None
    assert original.startswith(letter.original_value)
    assert record_bytes(letter.original_key, encode(letter)) < 100_000


def test_a_dead_letter_reason_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="not a valid DeadLetterReason"):
        dead_letter(
            topic="t",
            partition=0,
            offset=0,
            key=None,
            value=None,
            reason="r",
            error_type="Whatever",  # type: ignore[arg-type]
            component="c",
        )


def test_the_largest_window_aggregate_fits_the_analytics_topic_many_times_over() -> None:
    """Every field of a window's aggregate is bounded: the longest keys, every state and
    every histogram bucket at the largest counts still fit (with room for a batch)."""
    big = 2**63 - 1
    longest = "a" * 128
    aggregate = WindowAggregate(
        window="tumbling",
        size_s=86_400,
        step_s=86_400,
        start=1e11,
        end=1e11 + 86_400,
        dimension="function",
        key=longest,
        user_id=longest,
        finished=big,
        succeeded=big,
        failed=big,
        cancelled=big,
        rejected=big,
        states=dict.fromkeys(TaskStateName, big),
        latency_histogram=dict.fromkeys(range(LATENCY_BUCKETS), big),
        latency_sum_s=1e15,
        latency_max_s=1e9,
        final=True,
        updated_at=1e11,
    )
    key = aggregate.topic_key().encode()
    value = encode(aggregate)
    assert decode(value, WindowAggregate) == aggregate
    assert record_bytes(key, value) * 50 < CATALOGUE.spec("analytics").max_message_bytes
