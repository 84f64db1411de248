"""``./fx demo beamline``: the XPCS analysis on simulated frames (no broker), and the demo
end to end through the real CLI on the shared platform.

The end-to-end run checks what a person reading the README would: every frame file got a
result from the endpoint, printed as it came; each result is the analysis of that very
file (re-run here, it gives the same numbers) and finds the simulated sample's dynamics;
the Parquet archive (read here with pandas, not with the demo's own reader) holds the
run's events and results once each; the processes it started are gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import psutil
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest

from fxstream.connectors.parquet_sink import SCHEMAS, event_row, result_row, task_state_row
from fxstream.ops.demo_beamline import BeamlineSettings, read_archive
from fxstream.ops.private import PrivatePlatform
from fxstream.ops.xpcs import (
    RINGS,
    SimulatedSample,
    analyse_frames,
    analyse_frames_file,
    fit_g2,
    g2_from_two_time,
    ring_masks,
    simulate_frames,
    two_time_correlation,
)
from fxstream.topics import (
    Event,
    Serializer,
    TaskError,
    TaskResult,
    TaskState,
    TaskStateName,
    TaskTimings,
)

FXSTREAM = Path(sys.executable).parent / "fxstream"


def _cli(
    *args: str, home: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FXSTREAM_")}
    if home is not None:
        env["FXSTREAM_HOME"] = str(home)
    return subprocess.run(
        [str(FXSTREAM), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


# --- the analysis, pure numpy ----------------------------------------------------------------


def test_the_two_time_correlation_is_its_definition() -> None:
    rng = np.random.default_rng(3)
    frames = rng.poisson(20.0, size=(7, 64, 64)).astype(np.uint16)
    mask = ring_masks(64)[1]
    got = two_time_correlation(frames, mask)
    pixels = frames[:, mask].astype(np.float64)
    for t1 in range(7):
        for t2 in range(7):
            numerator = np.mean(pixels[t1] * pixels[t2])
            expected = numerator / (pixels[t1].mean() * pixels[t2].mean())
            assert got[t1, t2] == pytest.approx(expected, rel=1e-12)
    g2 = g2_from_two_time(got)
    assert g2[2] == pytest.approx(np.mean([got[t, t + 2] for t in range(5)]), rel=1e-12)
    early = g2_from_two_time(got, 0, 3)
    assert early[1] == pytest.approx(np.mean([got[t, t + 1] for t in range(3)]), rel=1e-12)


def test_the_fit_recovers_an_exact_decay() -> None:
    lags = np.arange(60, dtype=np.float64)
    beta, tau = fit_g2(1.0 + 0.3 * np.exp(-lags / 7.0))
    assert beta == pytest.approx(0.3, rel=1e-9) and tau == pytest.approx(7.0, rel=1e-9)
    assert fit_g2(np.ones(10)) == (None, None)  # no decay: nothing to fit


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_analysis_finds_the_simulated_dynamics(seed: int) -> None:
    """100 frames of the simulated sample: per ring, the fitted contrast and relaxation time
    are those of the sample (the slow inner ring, with fewest independent samples, has the
    widest error, as in real XPCS), the mean counts too, and g2 has decayed to the ring's
    baseline at lag 20 of the fastest ring."""
    sample = SimulatedSample()
    frames = simulate_frames(100, sample, np.random.default_rng([seed, 0]))
    assert frames.shape == (100, 64, 64) and frames.dtype == np.uint16
    answer = analyse_frames(frames)
    assert answer["mean_intensity"] == pytest.approx(sample.expected_mean_intensity(), rel=0.02)
    expected_curves = sample.expected_g2(20)
    for ring, (beta, tau), tolerance, curve in zip(
        answer["rings"], sample.expected_fit(), (0.5, 0.3, 0.2, 0.2), expected_curves, strict=True
    ):
        assert tau is not None and beta is not None
        assert ring["tau_frames"] == pytest.approx(tau, rel=tolerance), ring
        assert ring["beta"] == pytest.approx(beta, abs=0.1), ring
        assert ring["g2_lag1_first_half"] == pytest.approx(curve[1], abs=0.1), ring
        assert ring["g2_lag1_second_half"] == pytest.approx(curve[1], abs=0.1), ring
    outer = answer["rings"][-1]
    assert outer["g2"][20] == pytest.approx(expected_curves[-1][20], abs=0.03)
    # Diffusion: the outer rings relax faster than the inner ones.
    taus = [ring["tau_frames"] for ring in answer["rings"][1:]]
    assert taus == sorted(taus, reverse=True)
    assert [ring["r_px"] for ring in answer["rings"]] == [list(r) for r in RINGS]


def test_the_rule_function_travels_by_value_and_needs_only_numpy(tmp_path: Path) -> None:
    """As registered, the function loads in a fresh interpreter that never imports
    fxstream.ops, reads the file the event names, and answers what the analysis here does."""
    stack = simulate_frames(30, SimulatedSample(), np.random.default_rng(5))
    path = tmp_path / "frame-0000.npy"
    np.save(path, stack)
    code = tmp_path / "code"
    code.write_bytes(Serializer().serialize_function(analyse_frames_file))
    program = textwrap.dedent(
        f"""
        import json, sys
        from fxstream.topics import Serializer
        fn = Serializer().deserialize_function(open({str(code)!r}, "rb").read())
        answer = fn({{"attributes": {{"path": {str(path)!r}}}, "occurred_at": 12.5}})
        answer["ops_imported"] = "fxstream.ops" in sys.modules
        print(json.dumps(answer))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["ops_imported"] is False
    assert answer["path"] == str(path) and answer["event_at"] == 12.5
    local = analyse_frames(stack)
    assert answer["rings"] == local["rings"]
    assert answer["mean_intensity"] == local["mean_intensity"]


def _archive_file(root: Path, kind: str, rows: list[dict[str, Any]], first: int) -> None:
    """One file as the sink lays it out (hive day/hour directories, Kafka coordinates)."""
    directory = root / kind / "day=2026-11-25" / "hour=15"
    directory.mkdir(parents=True, exist_ok=True)
    kafka = [
        {
            "topic": f"fx.{kind}",
            "partition": 0,
            "offset": first + i,
            "kafka_time": 1_764_082_800_000,
        }
        for i in range(len(rows))
    ]
    table = pa.Table.from_pylist(
        [k | row for k, row in zip(kafka, rows, strict=True)], schema=SCHEMAS[kind]
    )
    name = f"fx.{kind}+0+{first:020d}-{first + len(rows) - 1:020d}.parquet"
    pq.write_table(table, directory / name)


def test_the_archive_reader_counts_the_runs_rows(tmp_path: Path) -> None:
    """What the demo prints of the archive: every row per kind, and the run's (its rule's
    task group, its frame files), read back with pyarrow; the sink's temporary files are
    not read."""
    root, frames = tmp_path / "archive", tmp_path / "run" / "frames"
    now = 1_764_082_800.0
    timings = TaskTimings(submitted_at=now, finished_at=now + 1)

    def result(task: str, group: str | None, ok: bool = True) -> dict[str, Any]:
        return result_row(
            TaskResult(
                task_id=task,
                user_id="u1",
                function_id="f1",
                endpoint_id="e1",
                task_group_id=group,
                outcome="success" if ok else "error",
                value=b"v" if ok else None,
                error=None if ok else TaskError(type="ValueError", message="bad"),
                timings=timings,
            )
        )

    def state(task: str, group: str | None, name: TaskStateName) -> dict[str, Any]:
        return task_state_row(
            TaskState(
                task_id=task,
                user_id="u1",
                function_id="f1",
                endpoint_id="e1",
                task_group_id=group,
                state=name,
                updated_at=now,
                timings=timings,
            )
        )

    def event(path: Path) -> dict[str, Any]:
        return event_row(
            Event(
                source="beamline",
                event_key=f"{path}|10|1",
                event_type="file-complete",
                occurred_at=now,
                attributes={"path": str(path)},
            )
        )

    rule = "rule-1"
    _archive_file(
        root,
        "results",
        [result("a", rule), result("b", rule), result("c", rule, ok=False), result("d", None)],
        0,
    )
    _archive_file(root, "results", [result("e", "rule-2")], 4)
    _archive_file(
        root,
        "task_state",
        [
            state("a", rule, TaskStateName.SUBMITTED),
            state("a", rule, TaskStateName.SUCCEEDED),
            state("b", rule, TaskStateName.SUCCEEDED),
            state("b", rule, TaskStateName.SUCCEEDED),
            state("e", "rule-2", TaskStateName.SUCCEEDED),
        ],
        0,
    )
    _archive_file(
        root,
        "events",
        [
            event(frames / "frame-0000.npy"),
            event(frames / "scan.json"),
            event(tmp_path / "run" / "frames2" / "frame-0000.npy"),  # a prefix, not the dir
            event(tmp_path / "elsewhere.npy"),
        ],
        0,
    )
    (root / "events" / "day=2026-11-25" / "hour=15" / ".half-written.parquet.tmp").write_bytes(
        b"not parquet"
    )
    counts = read_archive(root, rule_id=rule, frames_dir=frames)
    assert counts == {
        "directory": str(root),
        "results_rows": 5,
        "run_results_rows": 3,
        "run_results_success": 2,
        "events_rows": 4,
        "run_events_rows": 2,
        "task_state_rows": 5,
        "run_task_state_rows": 4,
        "run_tasks_succeeded": 2,
    }
    empty = read_archive(tmp_path / "none", rule_id=rule, frames_dir=frames)
    assert empty["results_rows"] == 0 and empty["run_tasks_succeeded"] == 0


def test_settings_refuse_what_cannot_run() -> None:
    BeamlineSettings().validate()
    for settings, option in (
        (BeamlineSettings(files=0), "--files"),
        (BeamlineSettings(rate=0), "--rate"),
        (BeamlineSettings(frames=3), "--frames"),
        (BeamlineSettings(frames=5_000), "--frames"),
        (BeamlineSettings(source="a b"), "--source"),
        (BeamlineSettings(idle_timeout_s=0), "--timeout"),
    ):
        with pytest.raises(ValueError, match=option):
            settings.validate()


def test_the_cli_refuses_a_bad_option_and_says_how_to_start_a_platform(tmp_path: Path) -> None:
    done = _cli("demo", "beamline", "--frames", "2", home=tmp_path)
    assert done.returncode == 2 and "--frames" in done.stderr
    done = _cli("demo", "beamline", home=tmp_path)
    assert done.returncode == 1
    assert f"no platform runs in {tmp_path}: start it with ./fx up" in done.stderr
    assert "Traceback" not in done.stderr


# --- the demo end to end ---------------------------------------------------------------------


@pytest.mark.platform
@pytest.mark.timeout(600)
def test_the_demo_runs_end_to_end(shared_platform: PrivatePlatform) -> None:
    files = 4
    source = f"beam-{uuid.uuid4().hex[:8]}"
    done = _cli(
        "demo",
        "beamline",
        "--files",
        str(files),
        "--rate",
        "2",
        "--frames",
        "60",
        "--source",
        source,
        "--json",
        home=shared_platform.home,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True and summary["source"] == source
    assert summary["received"] == files and summary["lost"] == 0 and summary["failed"] == 0
    names = [f"frame-{i:04d}.npy" for i in range(files)]
    assert sorted(summary["results"]) == names
    text = done.stdout
    for name in names:  # each printed as a line of the live table
        assert any(line.startswith(name) for line in text.splitlines()), name
    run = Path(summary["directory"])
    frames_dir = run / "frames"
    expected = summary["expected"]
    for name in names:
        result = summary["results"][name]
        # The endpoint analysed this very file: the same numbers as here.
        local = analyse_frames(np.load(frames_dir / name))
        assert result["rings"] == local["rings"] and result["frames"] == 60
        assert result["path"] == str(frames_dir / name)
        assert result["mean_intensity"] == pytest.approx(expected["mean_intensity"], rel=0.03)
        for ring in result["rings"]:
            assert ring["tau_frames"] is not None and ring["tau_frames"] > 0
            assert 1.2 < ring["g2"][1] < 1.8, ring
        for ring, truth in zip(result["rings"][2:], expected["rings"][2:], strict=True):
            assert ring["tau_frames"] == pytest.approx(truth["tau_frames"], rel=0.35)
        assert 0 < result["latency_ms"] < 120_000
        assert result["timings"]["finished"] >= result["timings"]["started"]
    # The archive, read here with pandas.
    archive = summary["archive"]
    assert archive["complete"] is True
    results = pd.read_parquet(Path(archive["directory"]) / "results")
    mine = results[results["task_group_id"] == summary["rule_id"]]
    assert len(mine) == files and mine["task_id"].nunique() == files
    assert set(mine["outcome"]) == {"success"}
    events = pd.read_parquet(Path(archive["directory"]) / "events")
    ours = events[events["source"] == source]
    paths = sorted(json.loads(a)["relative_path"] for a in ours["attributes"])
    assert paths == sorted([*names, "scan.json"])  # scan.json: an event, no task
    assert archive["run_results_rows"] == files and archive["run_events_rows"] == files + 1
    assert archive["run_tasks_succeeded"] == files
    # Everything it started was stopped, by PID.
    assert summary["all_stopped"] is True
    for pid in (summary["watcher_pid"], archive["sink_pid"]):
        assert isinstance(pid, int) and not psutil.pid_exists(pid), pid
    assert "Parquet archive:" in text and str(run / "archive") in text
