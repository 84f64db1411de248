"""Setting aside the inputs whose output Kafka refuses, so one record cannot stop a processor.

A processor plans a batch of outputs from a batch of inputs. When Kafka refuses
one output for a reason of its own (too large, invalid, topic gone: see
:func:`~fxstream.service.outgoing.refuses_record`), restarting would read the
same input and fail again: a crash loop. Instead the *input* that produced it
is dead-lettered with the reason, and the processor acknowledges the batch
and moves on. Outputs and inputs are matched by key: every task record is
keyed by its task id, and a dead letter by its original key.

If even the dead letter is refused (the input itself is near the dead-letter
topic's limit), a second one is written without the original value; if that
is refused too, the failure is raised and the processor stops.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from aiokafka.errors import UnknownTopicOrPartitionError  # type: ignore[import-untyped]
from faust.types import ProducerT

from fxstream.service.metrics import PROCESSOR_METRICS
from fxstream.service.outgoing import Outgoing, Refused, send_each
from fxstream.topics import (
    Catalogue,
    DeadLetterReason,
    RawRecord,
    dead_letter,
    dead_letter_for,
    encode,
)

__all__ = [
    "OUTPUT_REFUSED",
    "dead_letters_for_refused",
    "refusal_reason",
    "write_or_quarantine",
]

log = logging.getLogger(__name__)

# The dead letter's error type for an input whose output Kafka refused.
OUTPUT_REFUSED = DeadLetterReason.OUTPUT_UNWRITABLE


def refusal_reason(catalogue: Catalogue, component: str, refused: Refused) -> str:
    """Why the input was set aside: which output, which topic, what Kafka said, what to do."""
    record, error = refused.record, refused.error
    cause = error.__cause__ if error.__cause__ is not None else error
    size = len(record.key or b"") + len(record.value)
    size += sum(len(name) + len(value) for name, value in record.headers or [])
    spec = catalogue.spec_for_topic(record.topic)
    limit = f"max.message.bytes {spec.max_message_bytes}" if spec else "no catalogue topic"
    return (
        f"{component}: Kafka refused this input's {size}-byte output record on "
        f"{record.topic!r} ({limit}): {type(cause).__name__}: {cause}. The input was set "
        "aside here and the processor went on; a value this large must travel by reference "
        "(a proxy store), not inside the record"
    )


def dead_letters_for_refused(
    catalogue: Catalogue,
    component: str,
    refused: Sequence[Refused],
    inputs: Sequence[RawRecord],
    *,
    keep_value: bool = True,
) -> list[Outgoing]:
    """One dead letter per input whose key is the key of a refused output.

    A refused output with no input of its key (one a timer produced, say) is
    dead-lettered itself, with offset -1 and the topic it was meant for.
    """
    by_key: dict[bytes | None, Refused] = {}
    for item in refused:
        by_key.setdefault(item.record.key, item)
    letters: list[Outgoing] = []
    matched: set[bytes | None] = set()
    for record in inputs:
        found = by_key.get(record.key)
        if found is None:
            continue
        matched.add(record.key)
        reason = refusal_reason(catalogue, component, found)
        if keep_value:
            letter = dead_letter_for(
                record, reason=reason, error_type=OUTPUT_REFUSED, component=component
            )
        else:
            letter = dead_letter(
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                key=record.key,
                value=None,
                headers=record.headers,
                reason=reason + " (the original value was too large to keep here)",
                error_type=OUTPUT_REFUSED,
                component=component,
            )
        letters.append(Outgoing(catalogue.dead_letter, record.key, encode(letter)))
        log.error(
            "%s: dead-lettered %s[%d]@%d: %s",
            component,
            record.topic,
            record.partition,
            record.offset,
            reason,
        )
    for key, item in by_key.items():
        if key in matched:
            continue
        reason = refusal_reason(catalogue, component, item)
        letter = dead_letter(
            topic=item.record.topic,
            partition=-1,
            offset=-1,
            key=key,
            value=item.record.value if keep_value else None,
            headers=item.record.headers,
            reason=reason,
            error_type=OUTPUT_REFUSED,
            component=component,
        )
        letters.append(Outgoing(catalogue.dead_letter, key, encode(letter)))
        log.error("%s: dead-lettered an output for %s: %s", component, item.record.topic, reason)
    return letters


async def write_or_quarantine(
    producer: ProducerT,
    catalogue: Catalogue,
    component: str,
    records: Sequence[Outgoing],
    inputs: Sequence[RawRecord],
) -> int:
    """Write ``records``; dead-letter the inputs of any Kafka refuses. Returns how many
    inputs (or outputs without an input) were set aside.

    Raises when the broker fails (not one record), when a catalogue topic is
    missing, or when a dead letter cannot be written even without its value:
    the caller must then stop without acknowledging ``inputs``.
    """
    refused = await send_each(producer, records)
    if records or inputs:
        PROCESSOR_METRICS.batch(component, catalogue, len(inputs), records)
    if not refused:
        return 0
    static = set(catalogue.static_topics())
    for item in refused:
        if item.record.topic in static and item.record.topic != catalogue.dead_letter:
            cause = item.error.__cause__ or item.error
            if isinstance(cause, UnknownTopicOrPartitionError):
                raise RuntimeError(
                    f"{component}: topic {item.record.topic!r} does not exist; provision the "
                    "catalogue's topics (./fx up does)"
                ) from item.error
    letters = dead_letters_for_refused(catalogue, component, refused, inputs)
    again = await send_each(producer, letters)
    if again:
        keys = {item.record.key for item in again}
        dropped = [item for item in refused if item.record.key in keys]
        letters = dead_letters_for_refused(catalogue, component, dropped, inputs, keep_value=False)
        last = await send_each(producer, letters)
        if last:
            raise RuntimeError(
                f"{component}: Kafka refused even a dead letter without its value "
                f"({last[0].error!r})"
            ) from last[0].error
    return len({item.record.key for item in refused})
