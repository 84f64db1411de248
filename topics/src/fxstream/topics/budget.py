"""Every record's byte budget: topic limits, producer limits, and byte-safe truncation.

A Kafka topic refuses a record batch larger than its ``max.message.bytes``; a
librdkafka producer refuses, before sending, a record larger than its own
``message.max.bytes`` (1,000,000 by default, below our 1 MiB topics); aiokafka's
``max_request_size`` does the same. Whatever is refused inside an agent's
transaction or a processor's batch must never happen by surprise, so every
writer sizes its records here:

- :func:`record_bytes` is the most a record (key, value, headers) can take on
  the wire, batch framing included; :func:`fits` compares it with a topic's limit.
- :func:`producer_message_max_bytes` / :func:`aiokafka_max_request_size` are the
  producer settings that let through every record some topic accepts (and no
  more): the topic's own check is :func:`fits`, made before producing.
  :func:`aiokafka_max_batch_size` keeps an aiokafka batch (the unit the broker
  checks) within the smallest topic's limit.
- :func:`truncate_utf8` / :func:`truncate_utf8_tail` cut text to a number of UTF-8
  *bytes* at a character boundary, with a marker saying how much was cut.
- :func:`check_tags` checks a task's tags against their bounds (:data:`MAX_TASK_TAGS`
  tags, keys of :data:`MAX_TAG_KEY_CHARS`, values of :data:`MAX_TAG_VALUE_CHARS`; at most
  :data:`TAGS_MAX_BYTES` in a record), with errors that say what to change.
- :func:`bounded_error` bounds a :class:`~fxstream.topics.TaskError` in bytes;
  :func:`fit_result` and :func:`fit_state` shrink a result or a task state until it
  fits its topic (tracebacks first, then messages, then the oldest attempts), and
  raise :class:`RecordTooLarge` only when the *value* itself cannot fit.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Final

import msgspec

from fxstream.topics.catalogue import Catalogue, TopicSpec
from fxstream.topics.records import (
    MAX_TAG_KEY_CHARS,
    MAX_TAG_VALUE_CHARS,
    MAX_TASK_TAGS,
    TAG_KEY_PATTERN,
    TAG_VALUE_PATTERN,
    Attempt,
    TaskError,
    TaskResult,
    TaskState,
    encode,
)

__all__ = [
    "ATTEMPT_MESSAGE_MAX_BYTES",
    "DISPATCH_OVERHEAD_BYTES",
    "ERROR_MESSAGE_MAX_BYTES",
    "ERROR_TYPE_MAX_CHARS",
    "HEADER_OVERHEAD_BYTES",
    "MAX_TAG_KEY_CHARS",
    "MAX_TAG_VALUE_CHARS",
    "MAX_TASK_TAGS",
    "OUTPUT_MAX_BYTES",
    "RECORD_OVERHEAD_BYTES",
    "TAGS_MAX_BYTES",
    "TRACEBACK_MAX_BYTES",
    "Headers",
    "RecordTooLarge",
    "aiokafka_max_batch_size",
    "aiokafka_max_request_size",
    "bounded_error",
    "check_tags",
    "clean_text",
    "fit_result",
    "fit_state",
    "fits",
    "headers_bytes",
    "limit_of",
    "max_submission_bytes",
    "producer_message_max_bytes",
    "record_bytes",
    "truncate_utf8",
    "truncate_utf8_tail",
    "utf8_len",
]

RECORD_OVERHEAD_BYTES: Final = 1024
"""Room for the record batch header (61 bytes), the record's varints, timestamps and
attributes: generous, so a record :func:`fits` accepts is never refused for a few bytes."""
HEADER_OVERHEAD_BYTES: Final = 16
"""Per header: the varints around its name and value."""
ERROR_MESSAGE_MAX_BYTES: Final = 32_768
"""The most UTF-8 bytes of an error message kept in a result (the head is kept)."""
TRACEBACK_MAX_BYTES: Final = 65_536
"""The most UTF-8 bytes of a traceback kept in a result (the tail, which names the line)."""
ATTEMPT_MESSAGE_MAX_BYTES: Final = 4_096
"""The most bytes of an *earlier* attempt's message once space runs short."""
ERROR_TYPE_MAX_CHARS: Final = 256
"""TaskError.type's schema limit."""
OUTPUT_MAX_BYTES: Final = 16_384
"""The most UTF-8 bytes of a function's printed stdout (and again of its stderr) a result
keeps: the tail, after a marker naming how much was cut."""
_MIN_MESSAGE_BYTES: Final = 512
# Slack for msgpack's length prefixes, which grow by a few bytes with a string's length.
_SLACK: Final = 64

Headers = Sequence[tuple[str, bytes | None]]


class RecordTooLarge(ValueError):
    """A record cannot be made to fit its topic: its value alone is too large.

    ``size`` is the record's wire size with everything else shrunk; ``limit`` the
    topic's ``max.message.bytes``.
    """

    def __init__(self, size: int, limit: int, what: str = "record") -> None:
        self.size = size
        self.limit = limit
        super().__init__(
            f"the {what} takes {size:,} bytes on the wire, above the topic's "
            f"max.message.bytes ({limit:,})"
        )


# --- sizes ---------------------------------------------------------------------------------


def headers_bytes(headers: Headers | None) -> int:
    """Bytes the headers take on the wire (names, values and their framing)."""
    if not headers:
        return 0
    return sum(
        len(name.encode("utf-8", "surrogatepass")) + len(value or b"") + HEADER_OVERHEAD_BYTES
        for name, value in headers
    )


def record_bytes(key: bytes | None, value: bytes | None, headers: Headers | None = None) -> int:
    """The most a record with this key, value and headers takes in a batch on the wire."""
    return len(key or b"") + len(value or b"") + headers_bytes(headers) + RECORD_OVERHEAD_BYTES


def limit_of(topic: TopicSpec | int) -> int:
    """A topic's ``max.message.bytes`` (or the number given)."""
    return topic if isinstance(topic, int) else topic.max_message_bytes


def fits(
    topic: TopicSpec | int,
    key: bytes | None,
    value: bytes | None,
    headers: Headers | None = None,
) -> bool:
    """True when the record is within ``topic``'s ``max.message.bytes``, headers included."""
    return record_bytes(key, value, headers) <= limit_of(topic)


DISPATCH_OVERHEAD_BYTES: Final = 704
"""What the router's dispatch adds around the submission it carries (its routing fields:
ids, the submitter, the code digest and the routing stamp: about 360 bytes with UUIDs, at
most 649 with 128-character ids, the longest stamp and the largest attempt number, the
submission's msgpack header included; ``tests/topics/test_budget.py`` checks the bound)."""


def max_submission_bytes(catalogue: Catalogue, key: bytes, headers: Headers | None = None) -> int:
    """The largest submission record value that both a user's ``from.user.<U>`` and,
    wrapped in its dispatch, an endpoint queue accept: what the SDK checks, so whatever it
    sends the router can route."""
    submitted = catalogue.spec("from.user.{user_id}").max_message_bytes
    queue = catalogue.spec("tasks.ep.{endpoint_id}").max_message_bytes - DISPATCH_OVERHEAD_BYTES
    return min(submitted, queue) - record_bytes(key, None, headers)


def producer_message_max_bytes(catalogue: Catalogue) -> int:
    """librdkafka's ``message.max.bytes`` for a producer of this deployment.

    The largest topic limit in the catalogue plus framing: every record some topic
    accepts passes the producer; each record is checked against its own topic with
    :func:`fits` before it is produced.
    """
    return max(spec.max_message_bytes for spec in catalogue.specs) + RECORD_OVERHEAD_BYTES


def aiokafka_max_request_size(catalogue: Catalogue) -> int:
    """aiokafka's ``max_request_size`` (faust: ``producer_max_request_size``) to match."""
    return producer_message_max_bytes(catalogue)


def aiokafka_max_batch_size(catalogue: Catalogue) -> int:
    """aiokafka's ``max_batch_size`` (faust: ``producer_max_batch_size``) to match: the
    smallest topic limit in the catalogue.

    The broker checks a whole record batch (every record one request carries for one
    partition) against the topic's ``max.message.bytes``, not each record: two 177 kB
    heartbeats in one batch for ``heartbeats`` (256 KiB) were refused together, though
    each fits. aiokafka closes a batch before a record that would take it past this
    size, and a lone record larger than it still gets a batch of its own, so with it no
    batch exceeds the limit of the topic it goes to, and each record is sized against
    its own topic with :func:`fits`.
    """
    return min(spec.max_message_bytes for spec in catalogue.specs)


# --- text ----------------------------------------------------------------------------------


def clean_text(text: str) -> str:
    """``text`` with anything UTF-8 cannot encode (lone surrogates) replaced by '?'."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def utf8_len(text: str) -> int:
    """The UTF-8 size of ``text`` in bytes (lone surrogates count as their replacement)."""
    return len(clean_text(text).encode("utf-8"))


def _marker(cut: int) -> str:
    return f" ...[{cut:,} bytes cut]"


def truncate_utf8(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes, keeping its head.

    The cut is at a character boundary and ends with a marker naming how many
    bytes were cut; text within the limit is returned unchanged (cleaned of lone
    surrogates). Below the marker's own size the head is cut without a marker.
    """
    text = clean_text(text)
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    if max_bytes <= 0:
        return ""
    room = max_bytes - len(_marker(len(data)).encode())
    if room <= 0:
        return data[:max_bytes].decode("utf-8", "ignore")
    head = data[:room].decode("utf-8", "ignore")
    return head + _marker(len(data) - len(head.encode("utf-8")))


def truncate_utf8_tail(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes, keeping its tail (a traceback's
    end names the failing line), with a leading marker; see :func:`truncate_utf8`."""
    text = clean_text(text)
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    if max_bytes <= 0:
        return ""
    marker = _marker(len(data)).lstrip() + " "
    room = max_bytes - len(marker.encode())
    if room <= 0:
        return data[len(data) - max_bytes :].decode("utf-8", "ignore")
    tail = data[len(data) - room :].decode("utf-8", "ignore")
    cut = len(data) - len(tail.encode("utf-8"))
    return (_marker(cut).lstrip() + " ") + tail


# --- task tags -----------------------------------------------------------------------------

TAGS_MAX_BYTES: Final = MAX_TASK_TAGS * (MAX_TAG_KEY_CHARS + 4 * MAX_TAG_VALUE_CHARS + 8)
"""The most bytes a task's tags add to a record (UTF-8 keys and values, up to 4 bytes a
character, and msgpack's string headers): 2,368. The bounds exist because tags are
copied into the task's state and result and indexed per tag by the API's view of
task-state: one task costs at most this many bytes, and ``1 + MAX_TASK_TAGS`` index
entries, wherever it is held."""
_TAG_KEY: Final = re.compile(TAG_KEY_PATTERN)
_TAG_VALUE: Final = re.compile(TAG_VALUE_PATTERN)


def check_tags(tags: Mapping[str, str] | None) -> dict[str, str]:
    """``tags`` as the dict a submission carries, or ``ValueError`` saying what to change.

    A task carries at most :data:`MAX_TASK_TAGS` tags; a key is 1-32 letters, digits,
    '_', '.' or '-' (no ':', which separates key and value in a query); a value is a
    string of 1-64 characters without control characters (pass ``str(value)`` for a
    number). The router checks the same bounds (the record's schema), so a task the SDK
    lets through is never refused for its tags.
    """
    if tags is None:
        return {}
    if not isinstance(tags, Mapping):
        raise ValueError(
            f"tags must be a mapping of str to str, e.g. {{'run': '42'}}, not {type(tags).__name__}"
        )
    if len(tags) > MAX_TASK_TAGS:
        raise ValueError(
            f"a task may carry at most {MAX_TASK_TAGS} tags, not {len(tags)}: keep the ones "
            "you will query by, or join related labels into one value"
        )
    checked: dict[str, str] = {}
    for key, value in tags.items():
        if not isinstance(key, str) or not _TAG_KEY.match(key):
            raise ValueError(
                f"tag key {key!r} is not valid: use 1-{MAX_TAG_KEY_CHARS} letters, digits, "
                "'_', '.' or '-' (no ':' or spaces), e.g. 'run' or 'beamline.sample'"
            )
        if not isinstance(value, str):
            raise ValueError(
                f"tag {key!r} has a value of type {type(value).__name__}: tag values are "
                f"strings; pass str({value!r})"
            )
        if not _TAG_VALUE.match(value) or clean_text(value) != value:
            raise ValueError(
                f"tag {key!r} has value {value!r}, which is not valid: use 1-"
                f"{MAX_TAG_VALUE_CHARS} characters without control characters (newlines, "
                "tabs); put a longer text in the task's arguments instead"
            )
        checked[key] = value
    return checked


# --- task errors, results and states -------------------------------------------------------


def bounded_error(
    error: TaskError,
    *,
    message_bytes: int = ERROR_MESSAGE_MAX_BYTES,
    traceback_bytes: int = TRACEBACK_MAX_BYTES,
) -> TaskError:
    """``error`` with its message and traceback cut to byte limits (and its type to the
    schema's), so it always encodes and stays small."""
    kind = clean_text(error.type)[:ERROR_TYPE_MAX_CHARS] or "Error"
    message = truncate_utf8(error.message, message_bytes)
    traceback = truncate_utf8_tail(error.traceback, traceback_bytes)
    if (kind, message, traceback) == (error.type, error.message, error.traceback):
        return error
    return msgspec.structs.replace(error, type=kind, message=message, traceback=traceback)


def _bounded_attempt(attempt: Attempt, message_bytes: int, traceback_bytes: int) -> Attempt:
    if attempt.error is None:
        return attempt
    error = bounded_error(
        attempt.error, message_bytes=message_bytes, traceback_bytes=traceback_bytes
    )
    return attempt if error is attempt.error else msgspec.structs.replace(attempt, error=error)


def _size(record: TaskResult | TaskState, key: bytes | None, headers: Headers | None) -> int:
    return record_bytes(key, encode(record), headers)


def _shrunk_text(text: str, excess: int, floor: int, *, tail: bool) -> str:
    have = utf8_len(text)
    want = max(floor, have - excess - _SLACK)
    if want >= have:
        return text
    return truncate_utf8_tail(text, want) if tail else truncate_utf8(text, want)


_R = TaskResult | TaskState


def _fit_errors(
    record: _R,
    limit: int,
    key: bytes | None,
    headers: Headers | None,
    attempts_field: str,
    size: int | None = None,
) -> _R:
    """Shrink the error texts and attempt history of ``record`` until it fits ``limit``
    (``size``: the record's size with ``key`` and ``headers``, if the caller has it)."""
    attempts: list[Attempt] = list(getattr(record, attempts_field))
    bounded = [_bounded_attempt(a, ERROR_MESSAGE_MAX_BYTES, TRACEBACK_MAX_BYTES) for a in attempts]
    error = None if record.error is None else bounded_error(record.error)
    current: _R
    if error is record.error and all(b is a for b, a in zip(bounded, attempts, strict=True)):
        # Nothing was cut (most records): no copy, and the size is known or measured once.
        current = record
        if size is None:
            size = _size(current, key, headers)
    else:
        current = msgspec.structs.replace(record, error=error, **{attempts_field: bounded})
        size = _size(current, key, headers)
    if size <= limit:
        return current
    # 1. Earlier attempts keep a short message and no traceback.
    bounded = [_bounded_attempt(a, ATTEMPT_MESSAGE_MAX_BYTES, 0) for a in bounded]
    current = msgspec.structs.replace(current, **{attempts_field: bounded})
    # 2. The error's traceback, then 3. its message, shrink by what is still too much.
    for field, floor, tail in (("traceback", 0, True), ("message", _MIN_MESSAGE_BYTES, False)):
        excess = _size(current, key, headers) - limit
        if excess <= 0 or current.error is None:
            break
        text = getattr(current.error, field)
        error = msgspec.structs.replace(
            current.error, **{field: _shrunk_text(text, excess, floor, tail=tail)}
        )
        current = msgspec.structs.replace(current, error=error)
    # 4. The oldest attempts go (the latest one, which the error is, stays longest).
    dropped = 0
    while _size(current, key, headers) > limit and bounded:
        bounded = bounded[1:]
        dropped += 1
        current = msgspec.structs.replace(current, **{attempts_field: bounded})
    if dropped and current.error is not None:
        note = f" [{dropped} oldest of {len(attempts)} attempts left out to fit the topic]"
        message = truncate_utf8(current.error.message, _MIN_MESSAGE_BYTES) + note
        current = msgspec.structs.replace(
            current, error=msgspec.structs.replace(current.error, message=message)
        )
    return current


def fit_result(
    result: TaskResult,
    topic: TopicSpec | int,
    *,
    key: bytes | None = None,
    headers: Headers | None = None,
) -> TaskResult:
    """``result`` bounded in bytes, shrunk until it fits ``topic`` with ``key`` and ``headers``.

    Error messages and tracebacks are cut to :data:`ERROR_MESSAGE_MAX_BYTES` and
    :data:`TRACEBACK_MAX_BYTES`, printed output to its last :data:`OUTPUT_MAX_BYTES`,
    always; when the record is still too large, the earlier attempts lose their
    tracebacks, then the error's traceback and message shrink, then the oldest attempts
    are left out (the message says how many), then the printed output shrinks (to
    nothing if need be). Raises :class:`RecordTooLarge` when the result's value alone
    does not fit.
    """
    limit = limit_of(topic)
    key = key if key is not None else result.task_id.encode()
    result = _bounded_output(result, OUTPUT_MAX_BYTES)
    fitted = _fit_errors(result, limit, key, headers, "earlier_attempts")
    assert isinstance(fitted, TaskResult)
    size = _size(fitted, key, headers)
    if size > limit and (fitted.stdout or fitted.stderr):
        # The printed output goes before the value: it shrinks to what is left.
        excess = size - limit
        room = max(0, utf8_len(fitted.stdout) + utf8_len(fitted.stderr) - excess - _SLACK)
        fitted = _bounded_output(fitted, room // 2)
        size = _size(fitted, key, headers)
        if size > limit:
            fitted = msgspec.structs.replace(fitted, stdout="", stderr="")
            size = _size(fitted, key, headers)
    if size > limit:
        raise RecordTooLarge(size, limit, "result")
    return fitted


def _bounded_output(result: TaskResult, max_bytes: int) -> TaskResult:
    """``result`` with its printed stdout and stderr each cut to their last ``max_bytes``."""
    stdout = truncate_utf8_tail(result.stdout, max_bytes)
    stderr = truncate_utf8_tail(result.stderr, max_bytes)
    if stdout == result.stdout and stderr == result.stderr:
        return result
    return msgspec.structs.replace(result, stdout=stdout, stderr=stderr)


def fit_state(
    state: TaskState,
    topic: TopicSpec | int,
    *,
    key: bytes | None = None,
    headers: Headers | None = None,
) -> TaskState:
    """``state`` shrunk until it fits ``topic``: a value that does not fit is left out
    (it stays on the user's results topic), then errors and attempts shrink as in
    :func:`fit_result`. Always returns a state that fits (a state without a value,
    errors or attempts is a few hundred bytes)."""
    limit = limit_of(topic)
    key = key if key is not None else state.task_id.encode()
    size = None
    if state.value is not None:
        size = _size(state, key, headers)
        if size > limit:
            state = msgspec.structs.replace(state, value=None)
            size = None
    fitted = _fit_errors(state, limit, key, headers, "attempts", size)
    assert isinstance(fitted, TaskState)
    return fitted
