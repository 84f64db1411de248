"""The analytics processor's windows, without a broker: assignment to tumbling and hopping
windows, exact counts against an independent count, bounds, duplicates, restarts, and the
histogram's percentiles against exact ones."""

from __future__ import annotations

import math
import random
import time

import pytest

from fxstream.service.analytics import WindowedAggregates, WindowSpec
from fxstream.service.analytics_view import merge, percentile_s, summarize
from fxstream.topics import (
    OTHER_KEY,
    TaskState,
    TaskStateName,
    TaskTimings,
    WindowAggregate,
    decode,
    encode,
    latency_bucket,
    latency_bucket_upper_s,
)
from fxstream.topics.records import LATENCY_BUCKET_GROWTH, LATENCY_BUCKETS

T0 = 1_700_000_040.0  # a multiple of 60 s
TUMBLING = WindowSpec.tumbling(60)
HOPPING = WindowSpec.hopping(300, 60)


def state(
    task: str,
    name: TaskStateName,
    at: float,
    *,
    user: str = "alice",
    function: str = "fn-a",
    endpoint: str = "ep-1",
    group: str | None = None,
    submitted: float | None = None,
) -> TaskState:
    return TaskState(
        task_id=task,
        user_id=user,
        function_id=function,
        endpoint_id=endpoint,
        task_group_id=group,
        state=name,
        updated_at=at,
        timings=TaskTimings(submitted_at=submitted, result_published_at=at),
    )


def figures(records: list[WindowAggregate]) -> dict[tuple[str, float, str, str, str], int]:
    return {(r.window, r.start, r.dimension, r.user_id, r.key): r.finished for r in records}


def test_window_starts_hold_the_moment() -> None:
    assert TUMBLING.starts(T0 + 59.9) == [int(T0)]
    assert TUMBLING.starts(T0 + 60) == [int(T0) + 60]
    starts = HOPPING.starts(T0 + 10)
    assert starts == [int(T0) - 240 + 60 * i for i in range(5)]
    assert all(s <= T0 + 10 < s + 300 for s in starts)
    with pytest.raises(ValueError):
        WindowSpec("tumbling", 60, 30)
    with pytest.raises(ValueError):
        WindowSpec.hopping(60, 120)


def test_counts_equal_an_independent_count_for_every_window_and_series() -> None:
    """Random states over 20 minutes: every window's figures equal a brute-force count."""
    rng = random.Random(7)
    aggregates = WindowedAggregates(
        (TUMBLING, HOPPING), retain_s=3600, is_rule=lambda g, u: g == "rule-1"
    )
    expected: dict[tuple[str, float, str, str, str], int] = {}
    outcomes = [TaskStateName.SUCCEEDED, TaskStateName.FAILED, TaskStateName.CANCELLED]
    for n in range(2000):
        at = T0 + rng.uniform(0, 1200)
        user = rng.choice(["alice", "bob"])
        function = rng.choice(["fn-a", "fn-b", "fn-c"])
        group = rng.choice([None, "rule-1", "group-x"])
        outcome = rng.choice(outcomes)
        aggregates.observe(state(f"t{n}", TaskStateName.ROUTED, at - 0.5, user=user), at)
        aggregates.observe(
            state(
                f"t{n}", outcome, at, user=user, function=function, group=group, submitted=at - 1
            ),
            at,
        )
        keys = [("user", user), ("function", function), ("endpoint", "ep-1")]
        if group == "rule-1":
            keys.append(("rule", group))
        for spec in (TUMBLING, HOPPING):
            for start in range(int(T0) - 600, int(T0) + 1260, spec.step_s):
                if start <= at < start + spec.size_s:
                    for dimension, key in keys:
                        place = (spec.kind, float(start), dimension, user, key)
                        expected[place] = expected.get(place, 0) + 1
    records = aggregates.flush(T0 + 1200)
    assert figures(records) == expected
    # A tumbling window counts each task once: the windows of a series sum to all of them.
    tumbling_users = sum(
        r.finished for r in records if r.window == "tumbling" and r.dimension == "user"
    )
    assert tumbling_users == 2000
    # Outcomes add up, and every routed state is counted as a state change.
    for r in records:
        assert r.succeeded + r.failed + r.cancelled + r.rejected == r.finished
        assert sum(r.latency_histogram.values()) == r.finished
    assert aggregates.flush(T0 + 1200) == []  # nothing changed since


def test_a_repeated_state_counts_once_and_a_new_attempt_again() -> None:
    aggregates = WindowedAggregates((TUMBLING,))
    done = state("t1", TaskStateName.SUCCEEDED, T0 + 1, submitted=T0)
    for _ in range(3):
        aggregates.observe(done, T0 + 2)
    (record,) = [r for r in aggregates.flush(T0 + 2) if r.dimension == "user"]
    assert record.finished == 1
    assert aggregates.stats.duplicates == 2


def test_states_before_the_horizon_and_after_retention_are_not_counted() -> None:
    aggregates = WindowedAggregates((TUMBLING,), not_before=T0, retain_s=120, grace_s=5)
    aggregates.observe(state("early", TaskStateName.SUCCEEDED, T0 - 1), T0)
    aggregates.observe(state("ok", TaskStateName.SUCCEEDED, T0 + 1), T0 + 1)
    assert {r.start for r in aggregates.flush(T0 + 1)} == {T0}
    # The window closes; after its grace it is written once more, final.
    final = aggregates.flush(T0 + 60 + 5)
    assert final and all(r.final for r in final)
    # Past retention it is dropped; a state for it then is too late, not a new window.
    aggregates.flush(T0 + 60 + 120)
    assert aggregates.pane_count == 0
    aggregates.observe(state("late", TaskStateName.SUCCEEDED, T0 + 2), T0 + 200)
    assert aggregates.flush(T0 + 200) == []
    assert aggregates.stats.too_late == 2  # "early" and "late"


def test_keys_past_the_bound_count_under_other_and_totals_stay_exact() -> None:
    aggregates = WindowedAggregates((TUMBLING,), max_keys=3)
    for n in range(10):
        aggregates.observe(state(f"t{n}", TaskStateName.FAILED, T0 + 1, function=f"fn-{n}"), T0 + 1)
    records = aggregates.flush(T0 + 1)
    functions = {r.key: r.finished for r in records if r.dimension == "function"}
    assert functions == {"fn-0": 1, "fn-1": 1, "fn-2": 1, OTHER_KEY: 7}
    (user,) = [r for r in records if r.dimension == "user"]
    assert user.finished == user.failed == 10
    for r in records:
        assert decode(encode(r), WindowAggregate) == r  # "~other" is a valid key


def test_a_restart_that_re_reads_the_horizon_writes_the_same_figures() -> None:
    """The processor's state is a function of the states in its horizon: a second
    aggregator fed the same states (in another order, with repeats) writes the same."""
    rng = random.Random(3)
    states = [
        state(f"t{n}", rng.choice(list(TaskStateName)), T0 + rng.uniform(0, 600), submitted=T0)
        for n in range(500)
    ]
    first = WindowedAggregates((TUMBLING, HOPPING), retain_s=3600)
    for s in states:
        first.observe(s, T0 + 600)
    second = WindowedAggregates((TUMBLING, HOPPING), retain_s=3600)
    replay = states + states[:100]
    rng.shuffle(replay)
    for s in replay:
        second.observe(s, T0 + 600)

    def strip(records: list[WindowAggregate]) -> set[bytes]:
        return {encode(r) for r in records}

    assert strip(first.flush(T0 + 600)) == strip(second.flush(T0 + 600))


def test_percentiles_are_within_one_bucket_of_the_exact_ones() -> None:
    rng = random.Random(11)
    latencies = [rng.lognormvariate(-2, 1.5) for _ in range(5000)]
    aggregates = WindowedAggregates((TUMBLING,))
    for n, latency in enumerate(latencies):
        aggregates.observe(
            state(f"t{n}", TaskStateName.SUCCEEDED, T0 + 30, submitted=T0 + 30 - latency),
            T0 + 30,
        )
    (record,) = [r for r in aggregates.flush(T0 + 30) if r.dimension == "user"]
    ordered = sorted(latencies)
    for q in (0.5, 0.9, 0.99):
        exact = ordered[math.ceil(q * len(ordered)) - 1]
        estimate = percentile_s(record, q)
        assert estimate is not None
        assert exact <= estimate * (1 + 1e-9) <= exact * LATENCY_BUCKET_GROWTH * (1 + 1e-9)
    assert record.latency_max_s == pytest.approx(max(latencies))
    summary = summarize(record)
    assert summary["latency_s"]["samples"] == 5000
    assert summary["finished_per_s"] == 5000 / 60
    assert summary["error_rate"] == 0


def test_latency_buckets_are_bounded_and_ordered() -> None:
    assert latency_bucket(0.0) == 0
    assert latency_bucket(-3.0) == 0
    assert latency_bucket(0.001) == 0
    assert latency_bucket(1e9) == LATENCY_BUCKETS - 1
    for seconds in (0.0011, 0.05, 1.0, 3.7, 600.0):
        bucket = latency_bucket(seconds)
        assert latency_bucket_upper_s(bucket - 1) < seconds <= latency_bucket_upper_s(bucket)
    assert latency_bucket_upper_s(LATENCY_BUCKETS - 1) == math.inf


def test_merging_users_adds_their_figures() -> None:
    aggregates = WindowedAggregates((TUMBLING,))
    for n, user in enumerate(["alice", "bob", "bob"]):
        aggregates.observe(
            state(f"t{n}", TaskStateName.FAILED, T0 + 5, user=user, submitted=T0 + n), T0 + 5
        )
    functions = [r for r in aggregates.flush(T0 + 5) if r.dimension == "function"]
    assert sorted(r.finished for r in functions) == [1, 2]
    total = merge(functions)
    assert (total.finished, total.failed) == (3, 3)
    assert sum(total.latency_histogram.values()) == 3
    assert total.latency_max_s == 5.0


def test_folding_keeps_up_with_the_platform(capsys: pytest.CaptureFixture[str]) -> None:
    """Folding (decode included) must outpace the platform's measured ceiling (about
    1,600 tasks a second, 3-4 states each: docs/benchmarks.md), even on a loaded machine."""
    states = [
        encode(state(f"t{n}", TaskStateName.SUCCEEDED, T0 + n / 100, submitted=T0))
        for n in range(20_000)
    ]
    aggregates = WindowedAggregates()
    began = time.perf_counter()
    for raw in states:
        aggregates.observe(decode(raw, TaskState), T0 + 200)
    elapsed = time.perf_counter() - began
    rate = len(states) / elapsed
    with capsys.disabled():
        print(f"\nanalytics: {rate:,.0f} states/s folded (decode included)")
    assert rate > 1_600 * 4
