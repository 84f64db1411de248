"""Fuzz the task-state planner and the liveness monitor with batches of good and bad records.

No broker: both decide what to write without I/O. Each bad record must give
exactly one readable dead letter with a reason and the original bytes, good
records in the same batch must be processed as usual, and nothing may raise.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxstream.service.liveness import COMPONENT as LIVENESS
from fxstream.service.liveness import LivenessMonitor
from fxstream.service.task_state import COMPONENT as TASK_STATE
from fxstream.service.task_state import TaskStatePlanner
from fxstream.topics import Catalogue, Record, encode
from tests.fuzz.checks import expect_one_letter_each
from tests.fuzz.strategies import (
    BadValue,
    FuzzRecord,
    bad_values,
    headers,
    keys,
    new_id,
    valid_heartbeat,
    valid_result,
)

CATALOGUE = Catalogue(prefix="fz.")
USER = new_id()
RESULTS_TOPIC = CATALOGUE.results(USER)

FUZZ = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@st.composite
def batches(
    draw: st.DrawFn, topic: str, good: st.SearchStrategy[Record]
) -> tuple[list[FuzzRecord], dict[int, tuple[FuzzRecord, BadValue]], list[Record]]:
    """A batch mixing good records and bad ones; the bad ones by offset, and the good ones."""
    records: list[FuzzRecord] = []
    bad: dict[int, tuple[FuzzRecord, BadValue]] = {}
    goods: list[Record] = []
    template = draw(good)
    for offset in range(draw(st.integers(1, 8))):
        if draw(st.booleans()):
            value = draw(bad_values(template))
            record = FuzzRecord(topic, offset % 4, offset, draw(keys), value.value, draw(headers))
            bad[offset] = (record, value)
        else:
            fresh = draw(good)
            goods.append(fresh)
            record = FuzzRecord(topic, offset % 4, offset, b"k", encode(fresh), [])
        records.append(record)
    return records, bad, goods


results = st.builds(lambda: valid_result(user_id=USER))
heartbeats = st.builds(valid_heartbeat)


@FUZZ
@given(batch=batches(RESULTS_TOPIC, results))
def test_task_state_dead_letters_each_bad_result_and_folds_the_good(
    batch: tuple[list[FuzzRecord], dict[int, tuple[FuzzRecord, BadValue]], list[Record]],
) -> None:
    records, bad, goods = batch
    out = TaskStatePlanner(CATALOGUE).plan(records)
    expect_one_letter_each(CATALOGUE, out, bad, component=TASK_STATE)
    folded = {r.key for r in out if r.topic == CATALOGUE.task_state}
    for good in goods:
        assert good.task_id.encode() in folded  # type: ignore[attr-defined]


@FUZZ
@given(batch=batches(CATALOGUE.heartbeats, heartbeats))
def test_liveness_dead_letters_each_bad_heartbeat_and_folds_the_good(
    batch: tuple[list[FuzzRecord], dict[int, tuple[FuzzRecord, BadValue]], list[Record]],
) -> None:
    records, bad, goods = batch
    monitor = LivenessMonitor(CATALOGUE)
    transitions, letters = monitor.observe(records)
    expect_one_letter_each(CATALOGUE, letters, bad, component=LIVENESS)
    online = {t.endpoint_id for t in transitions if t.change == "online"}
    assert online == {g.endpoint_id for g in goods}  # type: ignore[attr-defined]
    # A later check for lost endpoints copes with whatever was folded.
    monitor.lost(now=0.0)
    monitor.lost(now=1e12)
