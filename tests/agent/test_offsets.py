"""OffsetTracker: commit positions never pass a record whose result is not durable."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxstream.agent import OffsetTracker


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
