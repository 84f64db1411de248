"""The one dead-letter builder, and the closed vocabulary of reasons a record is dead-lettered.

Every component that gives up on a record (the router, the task-state and
liveness processors, the registry views, the agent, the SDK's stream
subscriber) writes one :class:`~fxstream.topics.DeadLetter` to the
``dead-letter`` topic through :func:`dead_letter` / :func:`dead_letter_for`,
keyed by :attr:`DeadLetter.original_key`, and carries on.

A dead letter is bounded by construction: an original value up to
:data:`ORIGINAL_KEPT_MAX_BYTES` is kept whole, a larger one as its first
:data:`ORIGINAL_PREFIX_BYTES` bytes plus a :class:`~fxstream.topics.Digest` (size
and SHA-256); keys and headers likewise; texts are cut in UTF-8 bytes. The
largest dead letter therefore stays far below the topic's ``max.message.bytes``.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any, Final, Protocol, cast

from fxstream.topics.budget import clean_text, truncate_utf8
from fxstream.topics.records import DeadLetter, Digest

__all__ = [
    "COMPONENT_MAX_CHARS",
    "HEADERS_KEPT_MAX_BYTES",
    "KEY_KEPT_MAX_BYTES",
    "ORIGINAL_KEPT_MAX_BYTES",
    "ORIGINAL_PREFIX_BYTES",
    "REASON_MAX_BYTES",
    "DeadLetterReason",
    "RawRecord",
    "dead_letter",
    "dead_letter_for",
    "normalise_headers",
]

ORIGINAL_KEPT_MAX_BYTES: Final = 1_048_576
"""An original value up to this size is kept whole in its dead letter."""
ORIGINAL_PREFIX_BYTES: Final = 65_536
"""How much of a larger original value is kept, beside its digest."""
KEY_KEPT_MAX_BYTES: Final = 4_096
"""An original key up to this size is kept whole; a longer one as a prefix and a digest."""
HEADERS_KEPT_MAX_BYTES: Final = 65_536
"""Headers are kept in order while their total stays within this; the rest are counted."""
REASON_MAX_BYTES: Final = 16_384
"""The most UTF-8 bytes of a dead letter's reason."""
COMPONENT_MAX_CHARS: Final = 128
_TOPIC_MAX_CHARS: Final = 249
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,127}$")


class DeadLetterReason(StrEnum):
    """Why a record was dead-lettered: the ``error_type`` of every dead letter."""

    DECODE_ERROR = "RecordDecodeError"
    """The bytes are not a valid record of the kind the topic carries."""
    STREAM_DECODE_ERROR = "StreamRecordDecodeError"
    """A stream record is not a ProxyStore event batch of its stream."""
    KEY_MISMATCH = "KeyMismatch"
    """A registry record whose Kafka key is not the id inside it."""
    REJECTED = "TaskRejected"
    """The router refused the task (not authorised, no queue topic, too large)."""
    CANCEL_REFUSED = "CancelRefused"
    """A cancel from someone other than the task's submitter, or for no known queue."""
    IMPOSSIBLE_TRANSITION = "ImpossibleTransition"
    """A task event the task's lifecycle does not allow."""
    MISPLACED_RESULT = "MisplacedResult"
    """A result on another user's results topic."""
    ROUTER_ERROR = "RouterError"
    """The router failed on this record (a bug); the record cost one task."""
    TASK_STATE_ERROR = "TaskStateError"
    """The task-state processor failed on this record (a bug)."""
    TASK_UNDELIVERABLE = "TaskUndeliverable"
    """The agent cannot answer the task anywhere (its user has no results topic)."""
    RESULT_TOO_LARGE = "ResultTooLarge"
    """An answer larger than its topic allows; the task got a small error result instead."""
    PRODUCE_FAILED = "ProduceFailed"
    """Kafka refused to write an answer; the task got a small error result instead."""
    OUTPUT_UNWRITABLE = "OutputUnwritable"
    """A processor could not write what it derived from this input record."""
    IDENTITY_MISMATCH = "IdentityMismatch"
    """A record naming another principal than the one whose topic it is on (a submission
    or cancel on ``from.user.<U>`` for another user, a heartbeat, warm advert or data
    location on ``from.ep.<E>`` for another endpoint, a dispatch on an agent's queue for
    another endpoint)."""
    NOT_ROUTED_HERE = "NotRoutedHere"
    """A result or task event from an endpoint the task was not routed to, or for a task
    the service never routed."""
    FUNCTION_CHANGED = "FunctionChanged"
    """A submission pinned to a code digest the function's registered code no longer has."""
    CODE_INTEGRITY = "CodeIntegrityError"
    """Function code whose SHA-256 is not the digest its dispatch was routed with."""
    TRIGGER_UNFIREABLE = "TriggerUnfireable"
    """An event a trigger rule matched that cannot become a task: its arguments do not
    serialize, or the submission would be too large (the rule's other firings go on)."""


class RawRecord(Protocol):
    """The fields of a consumed Kafka record that a dead letter keeps."""

    @property
    def topic(self) -> str:
        """The topic the record was read from."""
        ...

    @property
    def partition(self) -> int:
        """Its partition."""
        ...

    @property
    def offset(self) -> int:
        """Its offset."""
        ...

    @property
    def key(self) -> bytes | None:
        """Its key bytes."""
        ...

    @property
    def value(self) -> bytes | None:
        """Its value bytes."""
        ...

    @property
    def headers(self) -> object:
        """Its headers: a sequence of (name, value) pairs or a mapping (faust allows both)."""
        ...


def normalise_headers(headers: object) -> list[tuple[str, bytes | None]]:
    """Headers as (name, value) pairs, whatever shape they came in (None, mapping, pairs)."""
    if headers is None:
        return []
    # faust passes either a list of pairs or a mapping; aiokafka and librdkafka pairs.
    items = headers.items() if isinstance(headers, Mapping) else cast("Iterable[Any]", headers)
    result: list[tuple[str, bytes | None]] = []
    for name, value in items:
        if isinstance(value, str):
            value = value.encode("utf-8", "replace")
        result.append((str(name), None if value is None else bytes(value)))
    return result


def _kept(data: bytes | None, whole: int, prefix: int) -> tuple[bytes | None, Digest | None]:
    if data is None or len(data) <= whole:
        return data, None
    return data[:prefix], Digest(size=len(data), sha256=hashlib.sha256(data).hexdigest())


def _kept_headers(headers: object) -> tuple[list[tuple[str, bytes | None]], int]:
    kept: list[tuple[str, bytes | None]] = []
    room = HEADERS_KEPT_MAX_BYTES
    pairs = normalise_headers(headers)
    for name, value in pairs:
        name = truncate_utf8(name, 1024)
        size = len(name.encode()) + len(value or b"")
        if size > room:
            break
        room -= size
        kept.append((name, value))
    return kept, len(pairs) - len(kept)


def _task_id_from_key(key: bytes | None) -> str | None:
    # Task topics are keyed by task id; any other key (or garbage) is simply not recorded.
    if not key or len(key) > 128:
        return None
    try:
        text = key.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if _ID_RE.match(text) else None


def dead_letter(
    *,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    headers: object = None,
    reason: str,
    error_type: DeadLetterReason,
    component: str,
    task_id: str | None = None,
    failed_at: float | None = None,
) -> DeadLetter:
    """A bounded dead letter from raw fields (see the module notes for what is kept).

    ``task_id`` defaults to the key when the key is a valid id (task topics are
    keyed by task id). Write it keyed by its ``original_key`` (bounded too).
    """
    if task_id is None or not _ID_RE.match(task_id):
        task_id = _task_id_from_key(key)
    kept_key, key_digest = _kept(key, KEY_KEPT_MAX_BYTES, KEY_KEPT_MAX_BYTES)
    kept_value, value_digest = _kept(value, ORIGINAL_KEPT_MAX_BYTES, ORIGINAL_PREFIX_BYTES)
    kept_headers, dropped = _kept_headers(headers)
    return DeadLetter(
        original_topic=clean_text(topic)[:_TOPIC_MAX_CHARS],
        original_partition=partition,
        original_offset=offset,
        original_key=kept_key,
        original_value=kept_value,
        original_headers=kept_headers,
        reason=truncate_utf8(reason, REASON_MAX_BYTES),
        error_type=str(DeadLetterReason(error_type)),
        component=clean_text(component)[:COMPONENT_MAX_CHARS],
        failed_at=time.time() if failed_at is None else failed_at,
        task_id=task_id,
        original_key_digest=key_digest,
        original_value_digest=value_digest,
        original_headers_dropped=dropped,
    )


def dead_letter_for(
    record: RawRecord,
    *,
    reason: str,
    error_type: DeadLetterReason,
    component: str,
    task_id: str | None = None,
    failed_at: float | None = None,
) -> DeadLetter:
    """A dead letter for a consumed record (a faust ``event.message`` or an aiokafka record)."""
    return dead_letter(
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key,
        value=record.value,
        headers=record.headers,
        reason=reason,
        error_type=error_type,
        component=component,
        task_id=task_id,
        failed_at=failed_at,
    )
