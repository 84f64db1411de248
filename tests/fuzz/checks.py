"""What every fuzz test checks of a processor's output: one readable dead letter per bad record."""

from __future__ import annotations

from collections.abc import Sequence

from fxstream.service.outgoing import Outgoing
from fxstream.topics import Catalogue, DeadLetter, decode
from tests.fuzz.strategies import BadValue, FuzzRecord

__all__ = ["dead_letters_by_offset", "expect_one_letter_each"]


def dead_letters_by_offset(
    catalogue: Catalogue, out: Sequence[Outgoing]
) -> dict[int, list[DeadLetter]]:
    """The dead letters in ``out``, decoded (they must be readable), by original offset."""
    letters: dict[int, list[DeadLetter]] = {}
    for record in out:
        if record.topic == catalogue.dead_letter:
            letter = decode(record.value, DeadLetter)
            letters.setdefault(letter.original_offset, []).append(letter)
    return letters


def expect_one_letter_each(
    catalogue: Catalogue,
    out: Sequence[Outgoing],
    bad: dict[int, tuple[FuzzRecord, BadValue]],
    *,
    component: str,
) -> None:
    """Each bad record (by offset) has exactly one dead letter with a reason and its bytes."""
    letters = dead_letters_by_offset(catalogue, out)
    for offset, (record, how) in bad.items():
        found = letters.get(offset, [])
        assert len(found) == 1, f"{how}: {len(found)} dead letters, expected 1"
        letter = found[0]
        assert letter.reason.strip(), f"{how}: the dead letter has no reason"
        assert letter.error_type, how
        assert letter.component == component, how
        assert letter.original_topic == record.topic, how
        assert letter.original_value == record.value, f"{how}: original bytes not kept"
        assert letter.original_key == record.key, f"{how}: original key not kept"
        assert letter.original_headers == record.headers, how
    unexpected = set(letters) - set(bad)
    assert not unexpected, f"good records were dead-lettered: {[letters[o] for o in unexpected]}"
