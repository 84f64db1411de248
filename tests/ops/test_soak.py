"""The soak bench's verdict on RSS samples (pure functions; the bench itself runs the platform)."""

from __future__ import annotations

import pytest

from fxstream.ops.bench.soak import SoakSettings, judge, slope_per_10min

SETTINGS = SoakSettings(rate=100, minutes=10, warmup_minutes=2, interval_s=60)


def test_slope_is_in_mb_per_10_minutes() -> None:
    assert slope_per_10min([(0.0, 100.0), (60.0, 101.0), (120.0, 102.0)]) == pytest.approx(10.0)
    assert slope_per_10min([(0.0, 5.0)]) == 0.0


def test_a_process_that_grows_with_every_task_is_not_flat() -> None:
    # The API before issue 12: ~25 MB a minute at 300 tasks/s.
    series = [(60.0 * i, 80.0 + 25.0 * i) for i in range(11)]
    figures = judge("service api", [1], series, SETTINGS)
    assert figures is not None
    assert not figures.flat
    assert figures.slope_mb_per_10min == pytest.approx(250.0)
    assert figures.post_warmup_mb == 130.0 and figures.end_mb == 330.0


def test_growth_during_warm_up_then_a_plateau_is_flat() -> None:
    series: list[tuple[float, float | None]] = [(0.0, 50.0), (60.0, 90.0)]
    series += [(60.0 * i, 100.0 + (0.5 if i % 2 else 0.0)) for i in range(2, 11)]
    figures = judge("broker", [1], series, SETTINGS)
    assert figures is not None and figures.flat
    assert figures.first_mb == 50.0 and figures.max_mb == 100.5


def test_a_slow_leak_past_the_growth_limit_is_not_flat() -> None:
    # Under the slope limit in the second half, but 20 % up since the warm-up.
    series = [(60.0 * i, 100.0 if i < 3 else 120.0 + 0.1 * i) for i in range(11)]
    figures = judge("agent", [1], series, SETTINGS)
    assert figures is not None and figures.slope_mb_per_10min < SETTINGS.max_slope_mb
    assert not figures.flat


def test_a_process_gone_before_the_warm_up_ended_is_not_judged() -> None:
    assert judge("worker", [1], [(0.0, 30.0), (60.0, 31.0), (120.0, None)], SETTINGS) is None


@pytest.mark.parametrize(
    ("settings", "option"),
    [
        (SoakSettings(rate=0), "--rate"),
        (SoakSettings(minutes=4, warmup_minutes=2), "--warmup-minutes"),
        (SoakSettings(minutes=1, warmup_minutes=0.2, interval_s=20), "--interval"),
    ],
)
def test_settings_out_of_range_name_the_option(settings: SoakSettings, option: str) -> None:
    with pytest.raises(ValueError, match=option):
        settings.validate()
