"""Records a processor decided to write, and writing a batch of them with one wait.

Processors first *plan* a batch (pure decisions, no I/O) into :class:`Outgoing`
records, then hand them to :func:`send_each`, which starts every send before
awaiting any: one round trip per batch instead of one per record.

Kafka can refuse a write for two kinds of reasons, and they are handled apart:

- the *record's own* fault (:func:`refuses_record`): it is larger than the
  topic or the producer allows, the broker finds it invalid, or its topic does
  not exist. Retrying or restarting cannot help, so the processor dead-letters
  the input that produced it and carries on with the rest;
- the *broker's* fault (connection lost past the timeout, no leader for the
  whole timeout, a fenced producer, authorisation): the processor stops
  without acknowledging its input, and its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from aiokafka.errors import (  # type: ignore[import-untyped]
    CorruptRecordException,
    InvalidTimestampError,
    InvalidTopicError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    UnknownTopicOrPartitionError,
    UnsupportedForMessageFormatError,
)
from faust.exceptions import ProducerSendError
from faust.types import ProducerT

__all__ = ["Outgoing", "Refused", "refuses_record", "send_each"]

# Kafka's answers that are about one record, not about the broker or the client.
_RECORD_ERRORS: tuple[type[BaseException], ...] = (
    MessageSizeTooLargeError,
    RecordTooLargeError,
    RecordListTooLargeError,
    CorruptRecordException,
    InvalidTopicError,
    InvalidTimestampError,
    UnsupportedForMessageFormatError,
    UnknownTopicOrPartitionError,
)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One record to produce: topic, key, value bytes and optional headers."""

    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]] | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """A record Kafka refused for a reason of its own, and the error it gave."""

    record: Outgoing
    error: BaseException


def refuses_record(exc: BaseException) -> bool:
    """True when ``exc`` is Kafka refusing one record (too large, invalid, no such topic).

    Such a record fails again however often it is retried; anything else (a
    timeout, a lost connection, a fenced producer) is the broker's state.
    faust wraps the client's errors in ``ProducerSendError``; the cause decides.
    """
    if isinstance(exc, ProducerSendError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return isinstance(exc, _RECORD_ERRORS)


async def send_each(producer: ProducerT, records: Sequence[Outgoing]) -> list[Refused]:
    """Produce ``records`` (not in a transaction), wait for every one, and return those
    Kafka refused for a reason of their own (:func:`refuses_record`).

    Every other record is acknowledged when this returns. Any other failure is
    raised, after every send has been waited for: the caller must then stop
    without acknowledging its input.
    """
    refused: list[Refused] = []
    pending: list[tuple[Outgoing, asyncio.Future[object]]] = []
    fatal: BaseException | None = None
    for r in records:
        try:
            future = await producer.send(r.topic, r.key, r.value, None, None, r.headers)
        except Exception as exc:  # refused before it left the client, e.g. too large
            if not refuses_record(exc):
                fatal = fatal or exc
                continue
            refused.append(Refused(r, exc))
            continue
        pending.append((r, asyncio.ensure_future(future)))
    outcomes = await asyncio.gather(*(f for _, f in pending), return_exceptions=True)
    for (record, _), outcome in zip(pending, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            if refuses_record(outcome):
                refused.append(Refused(record, outcome))
            else:
                fatal = fatal or outcome
    if fatal is not None:
        raise fatal
    return refused
