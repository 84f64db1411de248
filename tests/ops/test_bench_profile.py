"""``./fx bench profile``'s reading of py-spy's output and its settings, without a platform
(the bench itself runs one: `./fx bench profile`, figures in docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from fxstream.ops.bench.broker_counters import CounterReading
from fxstream.ops.bench.profile import ProfileSettings, _broker_figures, summarise_raw

SITE = "/v/lib/python3.11/site-packages"
SRC = "/w/service/src/fxstream/service"
RAW = "\n".join(
    [
        f"<module> ({SITE}/faust/cli.py:1);run ({SRC}/router_loop.py:230);"
        f"murmur2 ({SITE}/aiokafka/partitioner.py:40) 6",
        f"<module> ({SITE}/faust/cli.py:1);plan ({SRC}/router.py:10) 3",
        "<module> (/usr/lib/python3.11/asyncio/base_events.py:1);"
        "select (/usr/lib/python3.11/selectors.py:468) 1",
        "not a stack line",
    ]
)


def test_raw_stacks_give_self_time_by_function_and_area() -> None:
    summary = summarise_raw(RAW)
    assert summary["samples"] == 10
    assert summary["top_self"] == [
        ["murmur2 (aiokafka/partitioner.py)", 60.0],
        ["plan (fxstream/service/router.py)", 30.0],
        ["select (selectors.py)", 10.0],
    ]
    assert summary["areas"] == {"aiokafka": 60.0, "fxstream": 30.0, "selectors": 10.0}


def test_an_empty_profile_says_so() -> None:
    assert summarise_raw("") == {"samples": 0, "top_self": [], "areas": {}}


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        (ProfileSettings(tasks=10), "--tasks"),
        (ProfileSettings(warmup_tasks=-1), "--warmup-tasks"),
        (ProfileSettings(rate_hz=0), "--rate-hz"),
    ],
)
def test_settings_that_cannot_work_are_refused_by_name(
    settings: ProfileSettings, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        settings.validate()


def test_broker_figures_are_per_task_and_count_each_fetch_once() -> None:
    before = CounterReading(
        requests={"Fetch": 10, "FetchConsumer": 10, "Produce": 5},
        records_in={"fx.task-state": 100},
        bytes_in={"fx.task-state": 1_000},
        bytes_out={"fx.task-state": 5_000},
    )
    after = CounterReading(
        requests={"Fetch": 30, "FetchConsumer": 30, "Produce": 15, "EndTxn": 1},
        records_in={"fx.task-state": 300},
        bytes_in={"fx.task-state": 11_000},
        bytes_out={"fx.task-state": 55_000},
    )
    figures = _broker_figures("", before, after, 100)
    assert figures["broker_requests_per_task"] == {
        "Fetch": 0.2,
        "FetchConsumer": 0.2,
        "Produce": 0.1,
        "EndTxn": 0.01,
    }
    assert figures["broker_requests_per_task_total"] == 0.31
    assert figures["broker_records_in_per_task"] == {"fx.task-state": 2.0}
    assert figures["broker_bytes_in_per_task"] == {"fx.task-state": 100}
    assert figures["broker_bytes_out_per_task_total"] == 500


def test_broker_figures_left_out_say_why() -> None:
    assert _broker_figures("2 brokers (the counters read one)", None, None, 100) == {
        "broker_counters": "2 brokers (the counters read one)"
    }
