"""Staged files end to end (issue 16): a task declares input and output files by URL, the
endpoint's agent stages the inputs into the task's working directory before the function
runs there and the outputs out after it succeeded, and a transfer that fails is a clear
task error.

On the session's shared platform (started as `./fx up` starts it: broker, Redis, service,
processors), with one endpoint of this module's own configured with ``staging:`` (two
``file://`` roots, the platform's Redis store for ``store://``, and a Globus collection).

Globus: the Globus cloud cannot be reached from the test machines, so the endpoint's
Globus transfers go to a local stand-in of the Transfer API
(``tests/connectors/globus_stub.py``: a small HTTP server on 127.0.0.1 speaking the
Transfer API's JSON, whose "collections" are local directories and whose transfers copy
real bytes). The agent (its own process) runs the real globus-sdk client against it: what
is proven is fxstream's requests, batching per collection and failure handling, not
Globus's own behaviour.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fxstream.ops.private import ExtraEndpoint, PrivatePlatform
from fxstream.sdk import Client, Executor, StagingFailed, StagingSpec
from tests.connectors.globus_stub import GlobusTransferStub
from tests.e2e.stack import added_endpoint, other_user_client, wait_for_state

pytestmark = pytest.mark.platform

WAIT_S = 60.0
REMOTE = "31ce9ba0-176d-45a5-add3-f37d233ba47d"
LOCAL = "6c54cade-bde5-45c1-bdea-f4bd71dba2cc"
TOKEN = "stand-in-transfer-token"


def transform(name: str) -> dict[str, Any]:
    """Reads ``name`` and ``blob.bin`` in its working directory; writes ``out/upper.txt``
    and ``blob.rev`` there."""
    found = sorted(os.listdir("."))
    data = Path(name).read_bytes()
    blob = Path("blob.bin").read_bytes()
    os.makedirs("out", exist_ok=True)
    Path("out", "upper.txt").write_bytes(data.upper())
    Path("blob.rev").write_bytes(blob[::-1])
    return {
        "cwd": os.getcwd(),
        "env": os.environ.get("FXSTREAM_TASK_DIR"),
        "listing": found,
    }


def checksum(names: list[str]) -> str:
    """Writes the SHA-256 of the named files, concatenated, to ``sum.txt``."""
    digest = hashlib.sha256()
    for name in names:
        digest.update(Path(name).read_bytes())
    Path("sum.txt").write_text(digest.hexdigest())
    return digest.hexdigest()


def nothing() -> str:
    return "ran"


@dataclass
class Site:
    """This module's staging endpoint and the directories around it."""

    endpoint: ExtraEndpoint
    inputs: Path
    outputs: Path
    work: Path
    remote: Path
    stub: GlobusTransferStub


@pytest.fixture(scope="module")
def site(
    shared_platform: PrivatePlatform, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Site]:
    """A public endpoint staging files: roots ``in`` and ``out``, the platform's store, and
    the Globus stand-in serving a remote collection and the endpoint's work_dir."""
    base = tmp_path_factory.mktemp("staging-e2e")
    inputs, outputs, work, remote = (base / n for n in ("in", "out", "work", "remote"))
    for directory in (inputs, outputs, work, remote):
        directory.mkdir()
    token = base / "globus-token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    with GlobusTransferStub({REMOTE: remote, LOCAL: work}, tokens={TOKEN}) as stub:
        staging = {
            "work_dir": str(work),
            "roots": [str(inputs), str(outputs)],
            "slots": 2,
            "timeout_s": 30.0,
            "globus": {
                "collection": LOCAL,
                "collection_path": "/",
                "allowed_collections": [REMOTE],
                "auth": {"access_token_file": str(token)},
                "transfer_base_url": stub.url,
                "poll_initial_s": 0.05,
                "poll_max_s": 0.2,
            },
        }
        with added_endpoint(
            shared_platform, "staging", workers=1, public=True, staging=staging
        ) as endpoint:
            yield Site(endpoint, inputs, outputs, work, remote, stub)


@pytest.fixture(scope="module")
def client(shared_platform: PrivatePlatform) -> Iterator[Client]:
    """A client of the platform's local user (with the platform's store)."""
    made = shared_platform.client()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def executor(client: Client, site: Site) -> Iterator[Executor]:
    """An executor on the staging endpoint that never waits at exit."""
    ex = Executor(endpoint_id=site.endpoint.endpoint_id, client=client)
    try:
        yield ex
    finally:
        ex.shutdown(wait=False, cancel_futures=True)


def test_files_and_store_objects_are_staged_in_and_out(
    site: Site, client: Client, executor: Executor
) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    (site.inputs / "a.txt").write_bytes(b"staged through a file")
    blob = os.urandom(100_000)
    client.put_object(f"{run}/blob.bin", blob)
    try:
        spec = StagingSpec(
            stage_in=[
                (f"file://{site.inputs}/a.txt", "data/a.txt"),
                (f"store://{run}/blob.bin", "blob.bin"),
            ],
            stage_out=[
                ("out/upper.txt", f"file://{site.outputs}/{run}/upper.txt"),
                ("blob.rev", f"store://{run}/blob.rev"),
            ],
        )
        future = executor.submit_staged(spec, transform, "data/a.txt")
        seen = future.result(timeout=WAIT_S)
        task_dir = str(site.work / future.task_id)
        assert seen["cwd"] == task_dir and seen["env"] == task_dir
        assert seen["listing"] == ["blob.bin", "data"]  # before the function wrote anything
        assert (site.outputs / run / "upper.txt").read_bytes() == b"STAGED THROUGH A FILE"
        assert client.get_object(f"{run}/blob.rev") == blob[::-1]
        assert not Path(task_dir).exists()  # removed before the answer
    finally:
        client.delete_object(f"{run}/blob.bin")
        client.delete_object(f"{run}/blob.rev")


def test_globus_files_are_staged_through_the_stand_in(site: Site, executor: Executor) -> None:
    """Through the local stand-in of the Globus Transfer API (the Globus cloud cannot be
    reached here): two inputs from the remote collection in one transfer, the output back
    in another."""
    run = f"run-{uuid.uuid4().hex[:8]}"
    inbox = site.remote / run
    inbox.mkdir()
    parts = [os.urandom(5_000), os.urandom(7_000)]
    for index, data in enumerate(parts):
        (inbox / f"p{index}.bin").write_bytes(data)
    before = len(site.stub.requests_to("POST", "/v0.10/transfer"))
    spec = StagingSpec(
        stage_in=[(f"globus://{REMOTE}/{run}/p{i}.bin", f"p/{i}.bin") for i in range(2)],
        stage_out=[("sum.txt", f"globus://{REMOTE}/{run}/out/sum.txt")],
    )
    future = executor.submit_staged(spec, checksum, ["p/0.bin", "p/1.bin"])
    expected = hashlib.sha256(b"".join(parts)).hexdigest()
    assert future.result(timeout=WAIT_S) == expected
    assert (inbox / "out" / "sum.txt").read_text() == expected
    transfers = [r.body for r in site.stub.requests_to("POST", "/v0.10/transfer")][before:]
    assert [
        (t["source_endpoint"], t["destination_endpoint"], len(t["DATA"])) for t in transfers
    ] == [
        (REMOTE, LOCAL, 2),
        (LOCAL, REMOTE, 1),
    ]
    assert {r.headers.get("authorization") for r in site.stub.requests} == {f"Bearer {TOKEN}"}


def test_a_transfer_failure_is_a_clear_task_error(
    site: Site, client: Client, executor: Executor
) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    cases = {
        "missing file": (
            StagingSpec(stage_in=[(f"file://{site.inputs}/{run}-absent.txt", "a")]),
            "no such file",
        ),
        "outside the roots": (
            StagingSpec(stage_in=[("file:///etc/hostname", "h")]),
            "outside this endpoint's staging roots",
        ),
        "missing Globus file": (
            StagingSpec(stage_in=[(f"globus://{REMOTE}/{run}/absent.bin", "a")]),
            "FILE_NOT_FOUND",
        ),
        "output never written": (
            StagingSpec(stage_out=[("never.txt", f"file://{site.outputs}/{run}.txt")]),
            "did not write it",
        ),
    }
    futures = {name: executor.submit_staged(spec, nothing) for name, (spec, _) in cases.items()}
    failures: dict[str, StagingFailed] = {}
    for name, (_, says) in cases.items():
        with pytest.raises(StagingFailed) as caught:
            futures[name].result(timeout=WAIT_S)
        failure = failures[name] = caught.value
        assert failure.remote_type == "StagingFailed", name
        assert says in failure.remote_message, (name, failure.remote_message)
        assert "What to do" in failure.remote_message, name
        assert not failure.retryable, name
    assert "The function did not run" in failures["missing file"].remote_message
    assert "ran and succeeded" in failures["output never written"].remote_message
    wait_for_state(client, futures["missing Globus file"].task_id, "failed", timeout_s=WAIT_S)
    assert not (site.outputs / f"{run}.txt").exists()


def test_a_store_object_is_read_only_in_its_submitter_s_namespace(
    shared_platform: PrivatePlatform, site: Site, client: Client
) -> None:
    name = f"run-{uuid.uuid4().hex[:8]}/mine.bin"
    client.put_object(name, b"only for its owner")
    other = other_user_client(shared_platform, f"staging-other-{uuid.uuid4().hex[:6]}")
    try:
        with Executor(endpoint_id=site.endpoint.endpoint_id, client=other) as executor:
            future = executor.submit_staged(
                StagingSpec(stage_in=[(f"store://{name}", "x")]), nothing
            )
            with pytest.raises(StagingFailed, match=f"no such object of user {other.user_id}"):
                future.result(timeout=WAIT_S)
    finally:
        other.close()
        client.delete_object(name)


def test_an_endpoint_without_staging_refuses_staged_tasks(
    shared_platform: PrivatePlatform, client: Client
) -> None:
    with Executor(endpoint_id=shared_platform.endpoint_id, client=client) as executor:
        future = executor.submit_staged(StagingSpec(stage_in=[("store://x", "x")]), nothing)
        with pytest.raises(StagingFailed, match="does not stage files"):
            future.result(timeout=WAIT_S)
