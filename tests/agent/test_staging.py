"""The agent's staging hop in this process: a real worker pool (one worker process running
the agent's runner) and real files, no broker and no Redis.

Globus transfers go to the local stand-in of the Transfer API
(``tests/connectors/globus_stub.py``, real globus-sdk up to the HTTP boundary) because the
Globus cloud cannot be reached from the test machines: what is proven is our requests,
batching and failure handling, and real bytes arriving; not Globus's own behaviour.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import yaml

from fxstream.agent.config import ConfigError, EndpointConfig
from fxstream.agent.engine import WorkItem, WorkOutcome
from fxstream.agent.process_engine import ProcessEngine
from fxstream.agent.runner import runner_for
from fxstream.agent.staging import GlobusStaging, Stager, StagingSettings
from fxstream.topics import Serializer, StageItem, TaskSubmission, client_info, encode
from tests.connectors.globus_stub import GlobusTransferStub

SERIALIZER = Serializer()
REMOTE = "31ce9ba0-176d-45a5-add3-f37d233ba47d"
LOCAL = "6c54cade-bde5-45c1-bdea-f4bd71dba2cc"
TOKEN = "stand-in-transfer-token"
WAIT_S = 30.0


def shout(name: str) -> dict[str, Any]:
    """Reads ``name`` in its working directory, writes ``out/<name>.upper`` there."""
    data = Path(name).read_bytes()
    os.makedirs("out", exist_ok=True)
    Path("out", f"{name}.upper").write_bytes(data.upper())
    return {
        "cwd": os.getcwd(),
        "env": os.environ.get("FXSTREAM_TASK_DIR"),
        "gc": os.environ.get("GC_TASK_SANDBOX_DIR"),
    }


def link_out(target: str) -> None:
    """Leaves ``leak`` as a symbolic link to ``target`` (outside its directory)."""
    os.symlink(target, "leak")


def where() -> str:
    return os.getcwd()


def touch(path: str) -> None:
    Path(path).touch()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProcessEngine, Path]]:
    """One warm worker running the agent's runner, its staged tasks under ``work``."""
    work = tmp_path_factory.mktemp("staging") / "work"
    work.mkdir()
    pool = ProcessEngine(1, runner_for(None, task_root=str(work)))
    try:
        assert pool.wait_ready(WAIT_S)
        yield pool, work
    finally:
        pool.close()


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    """A staging root for inputs and one for outputs."""
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    outputs.mkdir()
    return inputs, outputs


def run(
    stager: Stager,
    engine: ProcessEngine,
    fn: Any,
    args: tuple[Any, ...] = (),
    *,
    stage_in: Sequence[tuple[str, str]] = (),
    stage_out: Sequence[tuple[str, str]] = (),
) -> WorkOutcome:
    """Stage, run and stage out one task of ``fn``; its outcome."""
    _, future = start(stager, engine, fn, args, stage_in=stage_in, stage_out=stage_out)
    return future.result(timeout=WAIT_S)


def start(
    stager: Stager,
    engine: ProcessEngine,
    fn: Any,
    args: tuple[Any, ...] = (),
    *,
    stage_in: Sequence[tuple[str, str]] = (),
    stage_out: Sequence[tuple[str, str]] = (),
) -> tuple[str, Future[WorkOutcome]]:
    """Start one task of ``fn`` through the stager; its id and future."""
    task_id = str(uuid.uuid4())
    code = SERIALIZER.serialize_function(fn)
    sha = hashlib.sha256(code).hexdigest()
    submission = TaskSubmission(
        task_id=task_id,
        function_id=f"fn-{fn.__name__.replace('_', '-')}",
        endpoint_id="ep-1",
        user_id="alice",
        function_sha256=sha,
        payload=SERIALIZER.pack_arguments(args, {}),
        client=client_info(),
        submitted_at=time.time(),
        stage_in=[StageItem(url=url, path=path) for url, path in stage_in],
        stage_out=[StageItem(url=url, path=path) for path, url in stage_out],
    )
    item = WorkItem(task_id, submission.function_id, sha, code, encode(submission))
    return task_id, stager.run(submission, "alice", item, engine, lambda: None)


def test_files_are_staged_in_the_function_runs_in_its_directory_and_outputs_go_out(
    engine: tuple[ProcessEngine, Path], roots: tuple[Path, Path]
) -> None:
    pool, work = engine
    inputs, outputs = roots
    (inputs / "a.txt").write_bytes(b"hello staging")
    stager = Stager(
        StagingSettings(work_dir=str(work), roots=(str(inputs), str(outputs))),
        endpoint_dir=work.parent,
        store_url=None,
    )
    try:
        outcome = run(
            stager,
            pool,
            shout,
            ("a.txt",),
            stage_in=[(f"file://{inputs}/a.txt", "a.txt")],
            stage_out=[("out/a.txt.upper", f"file://{outputs}/deep/A.txt")],
        )
        assert outcome.ok, outcome.error_message
        seen = SERIALIZER.deserialize(outcome.value or b"")
        task_dir = str(work / outcome.task_id)
        assert seen == {"cwd": task_dir, "env": task_dir, "gc": task_dir}
        assert (outputs / "deep" / "A.txt").read_bytes() == b"HELLO STAGING"
        assert not (work / outcome.task_id).exists()  # removed before the answer
        # The warm worker's next task (not staged) runs where the worker was, no variable.
        plain = run(stager, pool, where)
        assert plain.ok and SERIALIZER.deserialize(plain.value or b"") != task_dir
    finally:
        stager.close()


def test_a_file_outside_the_roots_is_refused_even_through_a_symbolic_link(
    engine: tuple[ProcessEngine, Path], roots: tuple[Path, Path], tmp_path: Path
) -> None:
    pool, work = engine
    inputs, outputs = roots
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    (inputs / "innocent.txt").symlink_to(secret)
    stager = Stager(
        StagingSettings(work_dir=str(work), roots=(str(inputs),)),
        endpoint_dir=work.parent,
        store_url=None,
    )
    try:
        for url in (f"file://{inputs}/innocent.txt", f"file://{secret}"):
            outcome = run(stager, pool, shout, ("a",), stage_in=[(url, "a")])
            assert outcome.error_type == "StagingFailed"
            assert "outside this endpoint's staging roots" in outcome.error_message
            assert "The function did not run" in outcome.error_message
            assert not outcome.retryable
        # An output may not be written outside the roots either (the function ran).
        (inputs / "a.txt").write_bytes(b"a")
        outcome = run(
            stager,
            pool,
            shout,
            ("a.txt",),
            stage_in=[(f"file://{inputs}/a.txt", "a.txt")],
            stage_out=[("out/a.txt.upper", f"file://{outputs}/x")],
        )
        assert outcome.error_type == "StagingFailed"
        assert "outside this endpoint's staging roots" in outcome.error_message
        assert "The function ran and succeeded" in outcome.error_message
        assert not (outputs / "x").exists()
    finally:
        stager.close()


def test_an_output_the_function_did_not_write_or_left_as_a_link_fails_the_task(
    engine: tuple[ProcessEngine, Path], roots: tuple[Path, Path], tmp_path: Path
) -> None:
    pool, work = engine
    inputs, outputs = roots
    stager = Stager(
        StagingSettings(work_dir=str(work), roots=(str(inputs), str(outputs))),
        endpoint_dir=work.parent,
        store_url=None,
    )
    try:
        missing = run(stager, pool, where, stage_out=[("never.dat", f"file://{outputs}/n")])
        assert missing.error_type == "StagingFailed"
        assert "did not write it" in missing.error_message
        assert "The function ran and succeeded" in missing.error_message
        assert missing.started_at is not None  # it ran
        (tmp_path / "private.key").write_text("key")
        leak = run(
            stager,
            pool,
            link_out,
            (str(tmp_path / "private.key"),),
            stage_out=[("leak", f"file://{outputs}/leaked")],
        )
        assert leak.error_type == "StagingFailed"
        assert not (outputs / "leaked").exists()
    finally:
        stager.close()


def test_an_endpoint_without_staging_says_so(engine: tuple[ProcessEngine, Path]) -> None:
    pool, work = engine
    stager = Stager(None, endpoint_dir=work.parent, store_url=None)
    try:
        outcome = run(stager, pool, where, stage_in=[("file:///etc/hostname", "h")])
        assert outcome.error_type == "StagingFailed"
        assert "does not stage files" in outcome.error_message
        store = run(stager, pool, where, stage_in=[("store://x", "x")])
        assert "does not stage files" in store.error_message
    finally:
        stager.close()


@pytest.fixture
def globus(
    engine: tuple[ProcessEngine, Path], tmp_path: Path
) -> Iterator[tuple[GlobusTransferStub, Path, Stager]]:
    """The Transfer API stand-in serving a remote collection and the endpoint's own (its
    work_dir), and a stager using it with a token file."""
    _, work = engine
    remote = tmp_path / "remote"
    remote.mkdir()
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    with GlobusTransferStub({REMOTE: remote, LOCAL: work}, tokens={TOKEN}) as stub:
        stager = Stager(
            StagingSettings(
                work_dir=str(work),
                timeout_s=3.0,
                globus=GlobusStaging(
                    collection=LOCAL,
                    collection_path="/",
                    allowed_collections=(REMOTE,),
                    auth={"access_token_file": str(token)},
                    transfer_base_url=stub.url,
                    poll_initial_s=0.02,
                    poll_max_s=0.2,
                ),
            ),
            endpoint_dir=work.parent,
            store_url=None,
        )
        try:
            yield stub, remote, stager
        finally:
            stager.close()


def test_globus_files_move_in_one_transfer_per_site_and_direction(
    engine: tuple[ProcessEngine, Path],
    globus: tuple[GlobusTransferStub, Path, Stager],
) -> None:
    pool, _ = engine
    stub, remote, stager = globus
    (remote / "inbox").mkdir()
    (remote / "inbox" / "g.txt").write_bytes(b"globus bytes")
    (remote / "inbox" / "h.txt").write_bytes(b"second")
    outcome = run(
        stager,
        pool,
        shout,
        ("g.txt",),
        stage_in=[
            (f"globus://{REMOTE}/inbox/g.txt", "g.txt"),
            (f"globus://{REMOTE}/inbox/h.txt", "more/h.txt"),
        ],
        stage_out=[("out/g.txt.upper", f"globus://{REMOTE}/outbox/G.txt")],
    )
    assert outcome.ok, outcome.error_message
    assert (remote / "outbox" / "G.txt").read_bytes() == b"GLOBUS BYTES"
    transfers = [r.body for r in stub.requests_to("POST", "/v0.10/transfer")]
    assert len(transfers) == 2  # the two inputs in one transfer, the output in another
    staged_in, staged_out = transfers
    assert (staged_in["source_endpoint"], staged_in["destination_endpoint"]) == (REMOTE, LOCAL)
    assert [i["destination_path"] for i in staged_in["DATA"]] == [
        f"/{outcome.task_id}/g.txt",
        f"/{outcome.task_id}/more/h.txt",
    ]
    assert (staged_out["source_endpoint"], staged_out["destination_endpoint"]) == (LOCAL, REMOTE)


def test_globus_failures_are_clear_task_errors(
    engine: tuple[ProcessEngine, Path],
    globus: tuple[GlobusTransferStub, Path, Stager],
) -> None:
    pool, _ = engine
    stub, remote, stager = globus
    missing = run(stager, pool, where, stage_in=[(f"globus://{REMOTE}/nope.dat", "n")])
    assert missing.error_type == "StagingFailed" and not missing.retryable
    assert "FILE_NOT_FOUND" in missing.error_message and REMOTE in missing.error_message
    other = "00000000-0000-4000-8000-000000000000"
    refused = run(stager, pool, where, stage_in=[(f"globus://{other}/a", "a")])
    assert refused.error_type == "StagingFailed"
    assert "allowed_collections" in refused.error_message
    # A transfer still running at the timeout: cancelled on Globus, retryable.
    (remote / "slow.dat").write_bytes(b"x")
    stub.task_latency_s = 30.0
    began = time.monotonic()
    slow = run(stager, pool, where, stage_in=[(f"globus://{REMOTE}/slow.dat", "s")])
    assert slow.error_type == "StagingUnavailable" and slow.retryable
    assert "it was cancelled" in slow.error_message
    assert time.monotonic() - began < 15


def test_a_task_cancelled_while_its_files_stage_in_never_runs(
    engine: tuple[ProcessEngine, Path],
    globus: tuple[GlobusTransferStub, Path, Stager],
    tmp_path: Path,
) -> None:
    pool, _ = engine
    stub, remote, stager = globus
    (remote / "big.dat").write_bytes(b"x")
    marker = tmp_path / "ran"
    stub.task_latency_s = 1.0
    task_id, future = start(
        stager, pool, touch, (str(marker),), stage_in=[(f"globus://{REMOTE}/big.dat", "b")]
    )
    deadline = time.monotonic() + 5
    while not stub.requests_to("POST", "/v0.10/transfer") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stager.cancel(task_id, "not wanted")
    outcome = future.result(timeout=WAIT_S)
    assert outcome.error_type == "TaskCancelled" and "not wanted" in outcome.error_message
    assert not marker.exists()
    assert not stager.cancel(outcome.task_id, "too late")  # answered: not staging any more


def test_the_staging_settings_are_checked_and_round_trip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FXSTREAM_ENDPOINTS_DIR", str(tmp_path / "endpoints"))

    def config(staging: StagingSettings) -> EndpointConfig:
        return EndpointConfig(
            name="stager",
            endpoint_id="ep-1",
            service_url="http://127.0.0.1:1",
            bootstrap_servers="127.0.0.1:1",
            staging=staging,
        )

    for bad, says in [
        (StagingSettings(roots=("data",)), "staging.roots must be absolute"),
        (StagingSettings(roots=("/",)), "may not be /"),
        (StagingSettings(work_dir="tasks"), "staging.work_dir must be an absolute path"),
        (StagingSettings(slots=0), "staging.slots"),
        (StagingSettings(globus=GlobusStaging(collection=LOCAL)), "staging.globus.auth"),
    ]:
        with pytest.raises(ConfigError, match=says):
            config(bad).validate()
    good = config(
        StagingSettings(
            roots=(str(tmp_path),),
            globus=GlobusStaging(
                collection=LOCAL,
                allowed_collections=(REMOTE,),
                auth={"access_token_file": str(tmp_path / "token")},
            ),
        )
    )
    path = good.save()
    assert EndpointConfig.load("stager") == good
    # The tasks' directories default to the endpoint's own, and the workers may write there.
    assert good.staging_root() == good.directory / "tasks"
    assert str(good.directory / "tasks") in good.worker_paths()[1]
    raw = yaml.safe_load(path.read_text())
    raw["staging"]["rootz"] = []
    raw["staging"]["globus"]["token"] = "secret"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(
        ConfigError, match=r"unknown staging setting\(s\) \['globus.token', 'rootz'\]"
    ):
        EndpointConfig.load("stager")


def test_an_unreachable_store_is_a_retryable_staging_error(
    engine: tuple[ProcessEngine, Path], tmp_path: Path
) -> None:
    pool, work = engine
    # Nothing listens on port 1: the store cannot be reached (no Redis is started here).
    stager = Stager(
        StagingSettings(work_dir=str(work)),
        endpoint_dir=work.parent,
        store_url="redis://fxstream:secret@127.0.0.1:1/0",
    )
    try:
        outcome = run(stager, pool, where, stage_in=[("store://run/in.dat", "in.dat")])
        assert outcome.error_type == "StagingUnavailable" and outcome.retryable
        assert "cannot be reached" in outcome.error_message
        assert "secret" not in outcome.error_message  # the store's password never shows
    finally:
        stager.close()
