"""What every fuzz test checks of a processor's output: one readable dead letter per bad record."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from fxstream.service.outgoing import Outgoing
from fxstream.topics import Catalogue, DeadLetter, Digest, decode
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
        assert_kept(letter.original_value, letter.original_value_digest, record.value, how)
        assert_kept(letter.original_key, letter.original_key_digest, record.key, how)
        assert letter.original_headers == record.headers, how
    unexpected = set(letters) - set(bad)
    assert not unexpected, f"good records were dead-lettered: {[letters[o] for o in unexpected]}"


def assert_kept(
    kept: bytes | None, digest: Digest | None, original: bytes | None, how: str
) -> None:
    """A dead letter keeps the original bytes whole, or (when large) a prefix and a digest."""
    if digest is None:
        assert kept == original, f"{how}: original bytes not kept"
        return
    assert original is not None and kept is not None, how
    assert original.startswith(kept) and len(kept) < len(original), f"{how}: prefix not kept"
    assert digest.size == len(original), how
    assert digest.sha256 == hashlib.sha256(original).hexdigest(), f"{how}: wrong digest"
