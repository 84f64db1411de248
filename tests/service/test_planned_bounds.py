"""Every record the task-state processor plans fits its topic, whatever results it folds."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxstream.service.task_state import TaskStatePlanner
from fxstream.topics import (
    Attempt,
    Catalogue,
    TaskError,
    TaskResult,
    TaskTimings,
    encode,
    fits,
)

CATALOGUE = Catalogue()
USER = "u-1"
EMOJI = "\U0001f600"

texts = st.builds(
    lambda c, n: c * n,
    st.sampled_from(["a", "\u00e9", "\u20ac", EMOJI]),
    st.integers(min_value=0, max_value=300_000),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    message=texts,
    traceback=texts,
    value_size=st.one_of(st.none(), st.integers(min_value=0, max_value=1_040_000)),
    retries=st.integers(min_value=0, max_value=100),
    header_bytes=st.integers(min_value=0, max_value=100_000),
)
def test_every_planned_task_state_and_dead_letter_fits(
    message: str, traceback: str, value_size: int | None, retries: int, header_bytes: int
) -> None:
    error = TaskError(type="ValueError", message=message, traceback=traceback)
    earlier = [Attempt(attempt=n + 1, worker="h:1", error=error) for n in range(retries)]
    result = TaskResult(
        task_id="t-1",
        user_id=USER,
        function_id="f-1",
        endpoint_id="e-1",
        outcome="error" if value_size is None else "success",
        value=None if value_size is None else b"v" * value_size,
        error=error if value_size is None else None,
        attempt=retries + 1,
        earlier_attempts=earlier,
        timings=TaskTimings(finished_at=2.0),
    )
    headers = [("trace", b"h" * header_bytes)] if header_bytes else []
    planner = TaskStatePlanner(CATALOGUE, clock=lambda: 3.0)
    good = SimpleNamespace(
        topic=CATALOGUE.results(USER),
        partition=0,
        offset=1,
        key=b"t-1",
        value=encode(result),
        headers=headers,
    )
    # The same bytes on another user's topic: dead-lettered, whatever their size.
    misplaced = SimpleNamespace(**{**vars(good), "topic": CATALOGUE.results("u-2")})
    garbage = SimpleNamespace(**{**vars(good), "value": b"\xc1" * (value_size or 10)})
    out = planner.plan([good, misplaced, garbage])
    assert {o.topic for o in out} <= {CATALOGUE.task_state, CATALOGUE.dead_letter}
    assert len(out) == 3
    for record in out:
        spec = CATALOGUE.spec_for_topic(record.topic)
        assert spec is not None
        assert fits(spec, record.key, record.value, record.headers), (
            record.topic,
            len(record.value),
        )
