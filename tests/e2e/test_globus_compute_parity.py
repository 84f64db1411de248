"""A Globus Compute user's script, changed only in its import line and endpoint id, on the
session's shared platform (started as `./fx up` starts it): ``Client()`` with no
arguments, the Executor, a batch with Globus Compute's answer, ``get_task`` and
``get_batch_result`` in its words, a shell function with bash syntax, and the worker
hardware report (docs/globus-compute.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# from globus_compute_sdk import Client, Executor, ShellFunction
from fxstream.sdk import Client, Executor, NotFound, PermissionDenied, ShellFunction
from tests.e2e.stack import Stack, other_user_client, wait_for_state

pytestmark = pytest.mark.platform

WAIT_S = 60.0


def add(a: int, b: int) -> int:
    """Adds two numbers."""
    return a + b


@pytest.fixture
def gcc(shared_platform: Stack, monkeypatch: pytest.MonkeyPatch) -> Iterator[Client]:
    """``Client()`` as a Globus Compute script makes it: nothing passed, nothing set but
    the platform's home (where `./fx up` wrote the local user's credentials)."""
    for variable in [v for v in os.environ if v.startswith("FXSTREAM_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("FXSTREAM_HOME", str(shared_platform.platform.config.home))
    client = Client()
    try:
        yield client
    finally:
        client.close()


def test_a_globus_compute_script_runs_with_its_import_line_changed(
    shared_platform: Stack, gcc: Client
) -> None:
    endpoint_id = shared_platform.endpoint_id
    assert gcc.get_endpoint_status(endpoint_id)["status"] == "online"

    # The Executor guide: submit, result.
    with Executor(endpoint_id=endpoint_id, client=gcc) as gce:
        assert gce.submit(add, 5, 10).result(timeout=WAIT_S) == 15
        bash = ShellFunction("names=(a b); echo ${{names[1]}} {x}", return_dict=True)
        shell = gce.submit(bash, x="hi").result(timeout=WAIT_S)
        assert shell["stdout"] == "b hi\n" and shell["returncode"] == 0
        assert gce.task_count_submitted == 2

    # The Client tutorial: register, batch_run, get_batch_result, get_task.
    function_id = gcc.register_function(add)
    assert gcc.get_function(function_id)["description"] == "Adds two numbers."
    batch = gcc.create_batch()
    for i in range(3):
        batch.add(function_id, args=(i, i))
    batch_res = gcc.batch_run(endpoint_id, batch)
    task_ids = batch_res["tasks"][function_id]
    assert len(task_ids) == 3 and batch_res["task_group_id"] == gcc.session_task_group_id
    for task_id in task_ids:
        gcc.future(task_id).result(timeout=WAIT_S)
    results = gcc.get_batch_result(task_ids)
    assert [results[t]["result"] for t in task_ids] == [0, 2, 4]
    assert {results[t]["status"] for t in task_ids} == {"success"}

    # Asked of the service by a second client (not answered from its own futures).
    with Client() as other:
        # gcc answers from its own futures: wait until the service has folded the result.
        wait_for_state(other, task_ids[0], "succeeded")
        task = other.get_task(task_ids[0])
        assert task["status"] == "success" and task["pending"] is False
        assert task["result"] == 0 and float(task["completion_t"]) > 0
        # The session group holds the batch, so a later process can reload it.
        reloaded = Executor(client=other, task_group_id=gcc.session_task_group_id)
        try:
            assert {f.task_id for f in reloaded.reload_tasks()} >= set(task_ids)
        finally:
            reloaded.shutdown()


def test_the_worker_hardware_report(shared_platform: Stack, gcc: Client) -> None:
    task_id = gcc.get_worker_hardware_details(shared_platform.endpoint_id)
    report = gcc.future(task_id).result(timeout=WAIT_S)
    fields = dict(line.split(": ", 1) for line in report.splitlines())
    assert int(fields["cpu count"]) >= 1 and fields["python"].startswith("CPython 3.")
    assert fields["memtotal"].endswith("kB")


def chatty(n: int) -> int:
    import sys

    for i in range(n):
        print(f"step {i}")
    print("almost done", file=sys.stderr)
    if n < 0:
        raise ValueError("negative")
    return n


def test_what_a_function_prints_returns_to_the_user(shared_platform: Stack, gcc: Client) -> None:
    with Executor(endpoint_id=shared_platform.endpoint_id, client=gcc) as gce:
        done = gce.submit(chatty, 3)
        failed = gce.submit(chatty, -1)
        assert done.result(timeout=WAIT_S) == 3
        assert done.stdout == "step 0\nstep 1\nstep 2\n"
        assert done.stderr == "almost done\n"
        with pytest.raises(ValueError, match="negative"):
            failed.result(timeout=WAIT_S)
        assert failed.stderr == "almost done\n" and failed.stdout == ""
    # A task this client ran and keeps (run, batch_run): get_task shows its output too.
    task_id = gcc.run(2, endpoint_id=shared_platform.endpoint_id, function_id=gce_function(gcc))
    gcc.future(task_id).result(timeout=WAIT_S)
    assert gcc.get_task(task_id)["stdout"] == "step 0\nstep 1\n"


def gce_function(client: Client) -> str:
    """``chatty`` registered (what the Executor did for its tasks above)."""
    return client.register_function(chatty)


def test_an_endpoints_log_reaches_its_owner_and_no_one_else(
    shared_platform: Stack, gcc: Client
) -> None:
    endpoint_id = shared_platform.endpoint_id
    deadline = time.monotonic() + WAIT_S
    while True:  # shipped with each heartbeat (every few seconds)
        answer = gcc.get_endpoint_logs(endpoint_id, limit=1_000)
        messages = [line["message"] for line in answer["lines"]]
        if any("workers ready" in m for m in messages):
            break
        assert time.monotonic() < deadline, f"no start-up line in {messages[-20:]}"
        time.sleep(1.0)
    assert all(line["agent_id"] and line["hostname"] for line in answer["lines"])
    warnings = gcc.get_endpoint_logs(endpoint_id, level="WARNING")["lines"]
    assert all(line["level"] in ("WARNING", "ERROR", "CRITICAL") for line in warnings)
    # The CLI shows the same, with the credentials `./fx up` wrote.
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "fxstream"), "logs", endpoint_id, "--limit", "1000"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
        check=True,
    )
    assert "workers ready" in shown.stdout
    # Another user: as if the endpoint did not exist; a user it is shared with: 403.
    stranger = other_user_client(shared_platform, f"logs-{uuid.uuid4().hex[:8]}")
    try:
        with pytest.raises(NotFound):
            stranger.get_endpoint_logs(endpoint_id)
        shared = gcc.register_endpoint("shared-logs", allowed_users=[stranger.user_id])
        try:
            with pytest.raises(PermissionDenied, match="only the owner"):
                stranger.get_endpoint_logs(shared)
            assert gcc.get_endpoint_logs(shared)["lines"] == []  # no agent ever ran it
        finally:
            gcc.delete_endpoint(shared)
    finally:
        stranger.close()


def test_diagnose_checks_an_endpoint_host_and_bundles_no_secret(
    shared_platform: Stack, tmp_path: Path
) -> None:
    endpoints = shared_platform.platform.config.home / "endpoints"
    env = {**os.environ, "FXSTREAM_ENDPOINTS_DIR": str(endpoints), "COLUMNS": "250"}
    fxstream = str(Path(sys.executable).parent / "fxstream")
    done = subprocess.run(
        [fxstream, "diagnose", "local", "--bundle", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for found in ("0600", "answers", "queue", "GB free"):
        assert found in done.stdout, done.stdout
    [archive] = tmp_path.glob("fxstream-diagnose-local-*.tar.gz")
    with tarfile.open(archive) as bundle:
        names = bundle.getnames()
        report = json.loads(bundle.extractfile("report.json").read())  # type: ignore[union-attr]
        contents = b"".join(
            bundle.extractfile(m).read()  # type: ignore[union-attr]
            for m in bundle.getmembers()
            if m.isfile()
        )
    assert "config.yaml" in names and "report.json" in names
    # The endpoint directory's logs (a supervised endpoint logs under the platform's home).
    logs = {f"logs/{log.name}" for log in (endpoints / "local").glob("*.log")}
    assert {n for n in names if n.startswith("logs/")} == logs
    assert {c["name"] for c in report} >= {"config", "credential", "service", "kafka", "disk"}
    assert all(c["status"] != "fail" for c in report)
    credential = json.loads((endpoints / "local" / "credentials.json").read_text())
    assert credential["token"].encode() not in contents
    # An endpoint whose service is not there: the check fails, says what to do, exit 1.
    broken = tmp_path / "endpoints" / "broken"
    broken.mkdir(parents=True, mode=0o700)
    config = (endpoints / "local" / "config.yaml").read_text()
    url = shared_platform.settings.service_url.rstrip("/")
    (broken / "config.yaml").write_text(
        config.replace(url, "http://127.0.0.1:9").replace("name: local", "name: broken")
    )
    failed = subprocess.run(
        [fxstream, "diagnose", "broken"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "FXSTREAM_ENDPOINTS_DIR": str(tmp_path / "endpoints")},
    )
    assert failed.returncode == 1
    assert "does not answer" in failed.stdout and "check service_url" in failed.stdout
