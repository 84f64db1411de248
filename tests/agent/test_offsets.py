"""OffsetTracker: commit positions never pass a record whose result is not durable, and the
commit metadata names every record answered past the position (and no other)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxstream.agent import OffsetTracker
from fxstream.agent.offsets import (
    MAX_METADATA_CHARS,
    METADATA_TAG,
    decode_answered,
    encode_answered,
)


def test_in_order_completion_advances_one_past_the_last_done() -> None:
    tracker = OffsetTracker()
    for offset in range(3):
        tracker.track(0, offset)
    assert tracker.committable() == {}
    assert tracker.done(0, 0)
    assert tracker.committable() == {0: 1}
    assert tracker.committable() == {}  # nothing moved since
    assert tracker.done(0, 1)
    assert tracker.done(0, 2)
    assert tracker.committable() == {0: 3}
    assert tracker.pending_count == 0


def test_out_of_order_completion_waits_for_the_earliest() -> None:
    tracker = OffsetTracker()
    for offset in range(10, 14):
        tracker.track(0, offset)
    tracker.done(0, 13)
    tracker.done(0, 11)
    assert tracker.committable() == {}
    assert tracker.pending_count == 2
    tracker.done(0, 10)
    assert tracker.committable() == {0: 12}
    tracker.done(0, 12)
    assert tracker.committable() == {0: 14}


def test_gaps_are_not_offsets_to_wait_for() -> None:
    # 6 and 8 were compacted away or are transaction markers: never dispatched.
    tracker = OffsetTracker()
    for offset in (5, 7, 9):
        tracker.track(3, offset)
    tracker.done(3, 7)
    assert tracker.committable() == {}
    tracker.done(3, 5)
    assert tracker.committable() == {3: 8}
    tracker.done(3, 9)
    assert tracker.committable() == {3: 10}


def test_partitions_are_independent() -> None:
    tracker = OffsetTracker()
    tracker.track(0, 0)
    tracker.track(1, 100)
    tracker.track(1, 101)
    tracker.done(1, 100)
    assert tracker.committable() == {1: 101}
    tracker.done(0, 0)
    assert tracker.committable() == {0: 1}
    assert tracker.positions() == {0: 1, 1: 101}
    assert tracker.pending_count == 1


def test_unknown_or_repeated_completions_are_ignored() -> None:
    tracker = OffsetTracker()
    tracker.track(0, 4)
    assert not tracker.done(1, 4)  # no such partition
    assert not tracker.done(0, 3)  # never tracked
    assert tracker.done(0, 4)
    assert not tracker.done(0, 4)  # already done
    assert tracker.pending_count == 0
    assert tracker.committable() == {0: 5}


def test_offsets_must_increase_per_partition() -> None:
    tracker = OffsetTracker()
    tracker.track(0, 7)
    with pytest.raises(ValueError, match="not after the last tracked offset 7"):
        tracker.track(0, 7)
    with pytest.raises(ValueError, match="not after"):
        tracker.track(0, 2)
    with pytest.raises(ValueError, match="negative"):
        tracker.track(1, -1)
    tracker.track(1, 2)  # other partitions are unaffected


def test_forget_partitions_drops_their_state() -> None:
    tracker = OffsetTracker()
    for offset in range(5):
        tracker.track(0, offset)
        tracker.track(1, offset)
    tracker.done(0, 0)
    tracker.done(1, 0)
    tracker.forget_partitions([0, 9])
    assert tracker.pending_count == 4
    assert tracker.committable() == {1: 1}
    assert not tracker.done(0, 1)  # a late result of a revoked partition
    # Reassigned later, the partition may restart anywhere.
    tracker.track(0, 2)
    tracker.done(0, 2)
    assert tracker.committable() == {0: 3}


def test_positions_repeat_what_was_already_committable() -> None:
    tracker = OffsetTracker()
    tracker.track(0, 0)
    tracker.done(0, 0)
    assert tracker.committable() == {0: 1}
    assert tracker.committable() == {}
    assert tracker.positions() == {0: 1}


@st.composite
def partition_offsets(draw: st.DrawFn) -> list[int]:
    """Increasing offsets with gaps, as a consumer delivers them from one partition."""
    start = draw(st.integers(min_value=0, max_value=1000))
    steps = draw(st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=30))
    offsets = [start]
    for step in steps[1:]:
        offsets.append(offsets[-1] + step)
    return offsets


@settings(max_examples=200, deadline=None)
@given(offsets=st.lists(partition_offsets(), min_size=1, max_size=3), data=st.data())
def test_committable_never_passes_an_unfinished_offset(
    offsets: list[list[int]], data: st.DataObject
) -> None:
    tracker = OffsetTracker()
    to_track = {p: list(reversed(o)) for p, o in enumerate(offsets)}  # pop() = next offset
    tracked: dict[int, list[int]] = {p: [] for p in to_track}
    finished: set[tuple[int, int]] = set()
    in_flight: list[tuple[int, int]] = []
    last_reported: dict[int, int] = {}

    def check(reported: dict[int, int]) -> None:
        for partition, position in reported.items():
            below = [o for o in tracked[partition] if o < position]
            assert below, "a position with nothing done below it"
            assert all((partition, o) in finished for o in below)
            assert position - 1 in below  # one past a done offset, never arithmetic past it
            assert position > last_reported.get(partition, -1)
            last_reported[partition] = position

    while any(to_track.values()) or in_flight:
        # "commit" last: the simplest draw must make progress, or the loop never ends.
        actions = []
        if any(to_track.values()):
            actions.append("track")
        if in_flight:
            actions.append("done")
        actions.append("commit")
        action = data.draw(st.sampled_from(actions))
        if action == "track":
            partition = data.draw(st.sampled_from([p for p, o in to_track.items() if o]))
            offset = to_track[partition].pop()
            tracker.track(partition, offset)
            tracked[partition].append(offset)
            in_flight.append((partition, offset))
        elif action == "done":
            index = data.draw(st.integers(min_value=0, max_value=len(in_flight) - 1))
            partition, offset = in_flight.pop(index)
            assert tracker.done(partition, offset)
            finished.add((partition, offset))
        else:
            check(tracker.committable())
        assert tracker.pending_count == len(in_flight)

    check(tracker.committable())
    assert tracker.positions() == {p: o[-1] + 1 for p, o in enumerate(offsets)}


# --- answered past the position: the commit metadata ------------------------------------


def test_answers_past_a_running_record_are_named_in_the_commit_and_skipped_by_the_next_owner() -> (
    None
):
    # The agent-kill duplicate: 10 is slow; 11, 12 and 14 are answered and committed before
    # the kill; the position stays 10. The restarted agent must not run 11, 12, 14 again.
    tracker = OffsetTracker()
    for offset in (10, 11, 12, 14, 15):  # 13 is a transaction marker
        tracker.track(0, offset)
    for offset in (11, 12, 14):
        assert tracker.admit(0, offset)
        tracker.done(0, offset)
    assert tracker.positions() == {}  # the prefix has not moved
    ((position, metadata),) = tracker.commits().values()
    assert position == 10
    assert metadata.startswith(METADATA_TAG)
    assert decode_answered(position, metadata) == [(11, 14)]  # 13 was never delivered

    successor = OffsetTracker()
    assert successor.resume(0, position, metadata) == [(11, 14)]
    assert [successor.track(0, o) for o in (10, 11, 12, 14, 15)] == [
        True,
        False,
        False,
        False,
        True,
    ]
    assert successor.pending_count == 2
    assert successor.done(0, 10)
    assert successor.positions() == {0: 15}  # over the settled ones
    assert successor.commits() == {0: (15, "")}


def test_a_commit_without_metadata_or_with_another_clients_resumes_with_nothing_answered() -> None:
    tracker = OffsetTracker()
    assert tracker.resume(0, 5, None) == []
    assert tracker.resume(1, 5, "") == []
    assert tracker.resume(2, 5, "someone else's note") == []
    assert tracker.resume(3, -1001, None) == []  # no commit yet
    assert all(tracker.track(p, 5) for p in range(4))
    with pytest.raises(ValueError, match="not base64"):
        tracker.resume(4, 5, METADATA_TAG + "!!")
    with pytest.raises(ValueError, match="truncated"):
        tracker.resume(4, 5, METADATA_TAG + "gA==")  # one varint byte saying "more follows"


def test_resuming_a_partition_forgets_what_was_tracked_of_it_before() -> None:
    """A partition assigned again starts at its committed offset, whatever was tracked of
    it before (records taken in an earlier assignment, or fetched before it was lost):
    before 2026-11-29 a partition already tracked was left as it was, so the committed
    offset was never resumed and its records, delivered again from it, were refused as
    "not after the last tracked offset"."""
    tracker = OffsetTracker()
    for offset in range(20, 25):
        tracker.track(0, offset)
    tracker.track(1, 7)
    assert tracker.pending_count == 6
    position, metadata = 10, encode_answered(10, [(12, 13)])
    assert tracker.resume(0, position, metadata) == [(12, 13)]
    assert tracker.pending_count == 1  # partition 1's record is still in flight
    assert [tracker.track(0, o) for o in (10, 11, 12, 13, 14)] == [True, True, False, False, True]
    assert tracker.done(0, 10) and tracker.done(0, 11)
    assert tracker.positions()[0] == 14
    assert not tracker.done(0, 20), "a record of the earlier assignment no longer commits"


def test_encoding_round_trips_and_refuses_unsorted_runs() -> None:
    runs = [(3, 3), (5, 9), (1_000_000, 1_000_500), (2**40, 2**40 + 1)]
    assert decode_answered(2, encode_answered(2, runs)) == runs
    assert encode_answered(7, []) == ""
    with pytest.raises(ValueError, match="sorted"):
        encode_answered(4, [(3, 3)])
    with pytest.raises(ValueError, match="sorted"):
        encode_answered(0, [(5, 9), (7, 12)])


def test_a_cancel_is_settled_only_by_its_tasks_answer() -> None:
    # Task at 20, its cancel at 21, another task at 22 answered: until the task's answer
    # commits, a successor must read the cancel again (it is not named as answered).
    tracker = OffsetTracker()
    for offset in (20, 21, 22):
        tracker.track(0, offset)
    tracker.done_with(0, 21, 20)
    tracker.done(0, 22)
    ((position, metadata),) = tracker.commits().values()
    assert decode_answered(position, metadata) == [(22, 22)]
    assert tracker.pending_count == 2
    tracker.done(0, 20)
    assert tracker.pending_count == 0
    assert tracker.commits() == {0: (23, "")}
    # An anchor already answered settles its rider at once.
    tracker.track(0, 30)
    tracker.done_with(0, 30, 20)
    assert tracker.positions() == {0: 31}


def test_answers_wait_when_the_metadata_is_full_and_the_head_is_always_admitted() -> None:
    # Every other record runs for ever (awaiting its code, say) while the rest are
    # answered: each answer is a run of its own, and the metadata has room for so many.
    tracker = OffsetTracker()
    count = 4_000
    for offset in range(count):
        tracker.track(0, offset)
    admitted = []
    for offset in range(1, count, 2):
        if tracker.admit(0, offset):
            tracker.done(0, offset)
            admitted.append(offset)
    assert 100 < len(admitted) < count // 2, "some answers admitted, then they wait"
    refused = admitted[-1] + 2
    assert not tracker.admit(0, refused)
    ((position, metadata),) = tracker.commits().values()
    assert len(metadata) <= MAX_METADATA_CHARS
    assert decode_answered(position, metadata) == [(o, o) for o in admitted]
    # The record at the position is always admitted, and once it and the answer after it
    # are done the runs move up, so the refused answer gets in.
    assert tracker.admit(0, 0)
    tracker.done(0, 0)
    assert tracker.admit(0, 2)
    tracker.done(0, 2)
    assert tracker.admit(0, refused)


@st.composite
def _deliveries(draw: st.DrawFn) -> list[int]:
    """Increasing offsets with gaps (markers, aborted records) of one partition."""
    start = draw(st.integers(min_value=0, max_value=2**40))
    steps = draw(
        st.lists(st.one_of(st.integers(1, 3), st.integers(1, 100_000)), min_size=1, max_size=120)
    )
    offsets = [start]
    for step in steps[1:]:
        offsets.append(offsets[-1] + step)
    return offsets


def test_a_claimed_run_ending_at_the_last_tracked_offset_still_commits() -> None:
    # The crash loop the merged agent hit: the previous owner answered 419 and 420 past
    # position 418; the successor tracks 418..420, and its commit must encode (the run
    # is covered by tracked offsets now), not stop the publisher on every restart.
    first = OffsetTracker()
    for offset in (418, 419, 420):
        first.track(0, offset)
    first.done(0, 419)
    first.done(0, 420)
    ((position, metadata),) = first.commits().values()
    successor = OffsetTracker()
    assert successor.resume(0, position, metadata) == [(419, 420)]
    assert [successor.track(0, o) for o in (418, 419, 420)] == [True, False, False]
    ((again, again_metadata),) = successor.commits().values()
    assert again == 418
    assert decode_answered(again, again_metadata) == [(419, 420)]


@settings(max_examples=150, deadline=None)
@given(offsets=_deliveries(), data=st.data())
def test_a_successor_skips_exactly_the_answered_records(
    offsets: list[int], data: st.DataObject
) -> None:
    """Whenever a commit is taken, a successor resuming from it skips exactly the records
    whose answers were committed (so none runs twice and none is lost), and the metadata
    fits Kafka's limit."""
    tracker = OffsetTracker()
    tracked: list[int] = []
    outstanding: list[int] = []
    answered: set[int] = set()
    remaining = list(reversed(offsets))
    while remaining or outstanding:
        actions = ["track"] if remaining else []
        actions += ["answer", "check"] if outstanding else ["check"]
        action = data.draw(st.sampled_from(actions))
        if action == "track":
            offset = remaining.pop()
            assert tracker.track(0, offset)
            tracked.append(offset)
            outstanding.append(offset)
        elif action == "answer":
            offset = outstanding[data.draw(st.integers(0, len(outstanding) - 1))]
            if tracker.admit(0, offset):
                assert tracker.done(0, offset)
                outstanding.remove(offset)
                answered.add(offset)
        commits = tracker.commits()
        if not commits:
            assert not answered
            continue
        position, metadata = commits[0]
        assert len(metadata) <= MAX_METADATA_CHARS
        successor = OffsetTracker()
        successor.resume(0, position, metadata)
        redelivered = [o for o in tracked if o >= position]
        cut = data.draw(
            st.integers(0, len(redelivered)), label="successor tracks before its commit"
        )
        skipped = {o for o in redelivered[:cut] if not successor.track(0, o)}
        # The successor commits having tracked only part of what it resumed (a claimed
        # run may end exactly at its last tracked offset): the commit encodes, and a
        # third owner resuming from it still skips exactly the answered records.
        third = OffsetTracker()
        for position_again, metadata_again in successor.commits().values():
            third.resume(0, position_again, metadata_again)
        skipped |= {o for o in redelivered[cut:] if not successor.track(0, o)}
        assert skipped == answered & set(redelivered)
        if successor.commits():
            assert {o for o in redelivered if not third.track(0, o)} == answered & set(redelivered)
        assert all(o in answered for o in tracked if o < position)
        if not remaining:
            # The head is always admitted: everything is answered eventually.
            offset = outstanding[0] if outstanding else None
            if offset is not None:
                assert tracker.admit(0, offset)
