"""The task-path benches' ``secure_vs_plain`` figures (built from two measured dicts)."""

from __future__ import annotations

from fxstream.ops.bench.stack import secure_vs_plain


def test_each_figure_gets_both_values_and_the_secure_over_plain_ratio() -> None:
    secure = {"fxstream_tasks_per_s": 1_500, "fxstream_s": 4.0, "hops_p50_ms": {"a->b": 0.3}}
    plain = {"fxstream_tasks_per_s": 3_000, "fxstream_s": 2.0, "hops_p50_ms": {"a->b": 0.2}}
    assert secure_vs_plain(secure, plain) == {
        "fxstream_tasks_per_s": {"secure": 1_500, "plain": 3_000, "ratio": 0.5},
        "fxstream_s": {"secure": 4.0, "plain": 2.0, "ratio": 2.0},
        "hops_p50_ms": {"a->b": {"secure": 0.3, "plain": 0.2, "ratio": 1.5}},
    }


def test_a_zero_or_missing_figure_has_no_ratio() -> None:
    compared = secure_vs_plain({"x_per_s": 10, "y_per_s": 5}, {"x_per_s": 0})
    assert compared == {"x_per_s": {"secure": 10, "plain": 0, "ratio": None}}
