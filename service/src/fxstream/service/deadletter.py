"""Build dead-letter records: the original record's bytes and coordinates plus why it failed.

Every processor that gives up on a record writes one :class:`DeadLetter` to the
``dead-letter`` topic, keyed by the original key, and carries on. The helpers
here accept anything shaped like a Kafka record (a faust ``Message``, an
aiokafka ``ConsumerRecord``) or the raw fields, so both the router and the
task-state processor build them the same way.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, cast

from fxstream.topics import DeadLetter

__all__ = ["RawRecord", "dead_letter", "dead_letter_for", "normalise_headers"]

# The record schema's limits (DeadLetter.reason is Text, error_type/component are short).
_REASON_MAX = 65_536
_ERROR_TYPE_MAX = 256
_COMPONENT_MAX = 128
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,127}$")


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
    """Headers as the (name, value) list a DeadLetter holds, whatever shape they came in."""
    if headers is None:
        return []
    # faust passes either a list of pairs or a mapping; aiokafka a sequence of pairs.
    items = headers.items() if isinstance(headers, Mapping) else cast("Iterable[Any]", headers)
    result: list[tuple[str, bytes | None]] = []
    for name, value in items:
        result.append((str(name), None if value is None else bytes(value)))
    return result


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _task_id_from_key(key: bytes | None) -> str | None:
    # Task topics are keyed by task id; any other key (or garbage) is simply not recorded.
    if not key:
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
    error_type: str,
    component: str,
    task_id: str | None = None,
    failed_at: float | None = None,
) -> DeadLetter:
    """A dead letter from raw fields.

    ``task_id`` defaults to the key when the key is a valid id (task topics are
    keyed by task id). Texts are cut to the schema's limits so the record always encodes.
    """
    if task_id is None or not _ID_RE.match(task_id):
        task_id = _task_id_from_key(key)
    return DeadLetter(
        original_topic=topic,
        original_partition=partition,
        original_offset=offset,
        original_key=key,
        original_value=value,
        original_headers=normalise_headers(headers),
        reason=_cut(reason, _REASON_MAX),
        error_type=_cut(error_type, _ERROR_TYPE_MAX),
        component=_cut(component, _COMPONENT_MAX),
        failed_at=time.time() if failed_at is None else failed_at,
        task_id=task_id,
    )


def dead_letter_for(
    record: RawRecord,
    *,
    reason: str,
    error_type: str,
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
