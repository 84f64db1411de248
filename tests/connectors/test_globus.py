"""Globus transfer helper and connector, tested up to the HTTP boundary.

The Globus cloud cannot be reached from the test machines, so these tests run
the real globus-sdk ``TransferClient`` (and, for client credentials, the real
``ConfidentialAppAuthClient``) against a local stand-in server
(``globus_stub.GlobusTransferStub``) on 127.0.0.1 that speaks the Transfer
API's JSON and "transfers" by copying real files between two directories that
play two collections. What is proven here: the requests our code sends, our
handling of every task outcome, and real bytes arriving at the other "site".
What is not: Globus's own behaviour beyond the documented API shapes.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import globus_sdk
import pytest
from proxystore.store import Store
from proxystore.store.utils import get_key

from fxstream.connectors import ByReference, evict_objects, location_of
from fxstream.connectors.globus import (
    GlobusAuthConfig,
    GlobusConnector,
    GlobusKey,
    GlobusSite,
    GlobusTransferError,
    GlobusTransferFailed,
    GlobusTransferFaulted,
    GlobusTransferHelper,
    GlobusTransferRejected,
    GlobusTransferTimeout,
    TransferItem,
)
from fxstream.topics import StorageTier

from .globus_stub import GlobusTransferStub

COLLECTION_A = "6c54cade-bde5-45c1-bdea-f4bd71dba2cc"
COLLECTION_B = "31ce9ba0-176d-45a5-add3-f37d233ba47d"
TOKEN = "stand-in-transfer-token"
TOKEN_ENV = "FXSTREAM_TEST_GLOBUS_TOKEN"
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def collections(tmp_path: Path) -> dict[str, Path]:
    """Two directories standing for two sites' collections."""
    roots = {COLLECTION_A: tmp_path / "site-a", COLLECTION_B: tmp_path / "site-b"}
    for root in roots.values():
        root.mkdir()
    return roots


@pytest.fixture
def stub(collections: dict[str, Path]) -> Iterator[GlobusTransferStub]:
    """The stand-in Transfer API, serving those collections (stopped after the test)."""
    with GlobusTransferStub(collections, tokens={TOKEN}) as server:
        yield server


@pytest.fixture
def helper(stub: GlobusTransferStub) -> Iterator[GlobusTransferHelper]:
    """A helper on the stub with fast polling."""
    transfer = GlobusTransferHelper(
        globus_sdk.AccessTokenAuthorizer(TOKEN),
        base_url=stub.url,
        poll_initial_s=0.02,
        poll_max_s=0.2,
    )
    yield transfer
    transfer.close()


def sites(collections: dict[str, Path]) -> list[GlobusSite]:
    """The two sites; each keeps objects in ``/fxstream`` of its collection."""
    return [
        GlobusSite(
            "site-a", COLLECTION_A, "/fxstream", str(collections[COLLECTION_A] / "fxstream")
        ),
        GlobusSite(
            "site-b", COLLECTION_B, "/fxstream", str(collections[COLLECTION_B] / "fxstream")
        ),
    ]


def connector_at(
    site: str, collections: dict[str, Path], stub: GlobusTransferStub
) -> GlobusConnector:
    """A connector for ``site`` whose token comes from ``TOKEN_ENV``."""
    return GlobusConnector(
        sites(collections),
        site,
        auth=GlobusAuthConfig(access_token_env=TOKEN_ENV),
        transfer_base_url=stub.url,
        timeout_s=20,
        poll_initial_s=0.02,
        poll_max_s=0.2,
    )


# --- transfer helper --------------------------------------------------------------------------


def test_transfer_moves_files_and_sends_options(
    helper: GlobusTransferHelper, stub: GlobusTransferStub, collections: dict[str, Path]
) -> None:
    """Two files cross collections; sync level, checksum and label are in the request."""
    source = collections[COLLECTION_A]
    (source / "in").mkdir()
    payloads = {"x.bin": os.urandom(300_000), "y.bin": os.urandom(1234)}
    for name, data in payloads.items():
        (source / "in" / name).write_bytes(data)

    status = helper.transfer(
        COLLECTION_A,
        COLLECTION_B,
        [TransferItem(f"/in/{name}", f"/out/{name}") for name in payloads],
        timeout_s=10,
        label="fxstream test transfer",
        sync_level="checksum",
        verify_checksum=True,
    )

    assert status.status == "SUCCEEDED"
    assert status.files_transferred == 2
    assert status.bytes_transferred == sum(len(d) for d in payloads.values())
    for name, data in payloads.items():
        assert (collections[COLLECTION_B] / "out" / name).read_bytes() == data
    [submit] = stub.requests_to("POST", "/v0.10/transfer")
    body = submit.body
    assert body["DATA_TYPE"] == "transfer"
    assert body["source_endpoint"] == COLLECTION_A
    assert body["destination_endpoint"] == COLLECTION_B
    assert body["sync_level"] == 3  # "checksum" on the wire
    assert body["verify_checksum"] is True
    assert body["label"] == "fxstream test transfer"
    assert [(i["source_path"], i["destination_path"]) for i in body["DATA"]] == [
        ("/in/x.bin", "/out/x.bin"),
        ("/in/y.bin", "/out/y.bin"),
    ]
    # submit_transfer fetched a submission id first, and used it
    [sub_id] = stub.requests_to("GET", "/v0.10/submission_id")
    assert body["submission_id"]
    assert sub_id.path == "/v0.10/submission_id"


def test_sync_level_exists_skips_a_present_destination(
    helper: GlobusTransferHelper, stub: GlobusTransferStub, collections: dict[str, Path]
) -> None:
    """sync_level='exists' reaches the server (0) and leaves an existing file alone."""
    (collections[COLLECTION_A] / "f").write_bytes(b"new contents")
    (collections[COLLECTION_B] / "f").write_bytes(b"old")

    status = helper.transfer(
        COLLECTION_A, COLLECTION_B, [("/f", "/f")], timeout_s=10, sync_level="exists"
    )

    assert status.files_skipped == 1 and status.files_transferred == 0
    assert (collections[COLLECTION_B] / "f").read_bytes() == b"old"
    [submit] = stub.requests_to("POST", "/v0.10/transfer")
    assert submit.body["sync_level"] == 0
    # without a sync level the file is copied
    status = helper.transfer(COLLECTION_A, COLLECTION_B, [("/f", "/f")], timeout_s=10)
    assert status.files_transferred == 1
    assert (collections[COLLECTION_B] / "f").read_bytes() == b"new contents"
    assert "sync_level" not in stub.requests_to("POST", "/v0.10/transfer")[1].body


def test_every_request_carries_the_bearer_token(
    helper: GlobusTransferHelper, stub: GlobusTransferStub, collections: dict[str, Path]
) -> None:
    """The authorizer's token is on every Transfer API request."""
    (collections[COLLECTION_A] / "f").write_bytes(b"x")
    helper.transfer(COLLECTION_A, COLLECTION_B, [("/f", "/g")], timeout_s=10)
    transfer_requests = [r for r in stub.requests if r.path.startswith("/v0.10/")]
    assert len(transfer_requests) >= 3  # submission id, submit, at least one status poll
    assert {r.headers.get("authorization") for r in transfer_requests} == {f"Bearer {TOKEN}"}


def test_bad_token_is_rejected_with_what_to_do(
    stub: GlobusTransferStub, collections: dict[str, Path]
) -> None:
    """A token the API does not accept gives a 401 error naming the Transfer scope."""
    (collections[COLLECTION_A] / "f").write_bytes(b"x")
    helper = GlobusTransferHelper(globus_sdk.AccessTokenAuthorizer("expired"), base_url=stub.url)
    with pytest.raises(GlobusTransferRejected) as caught:
        helper.submit(COLLECTION_A, COLLECTION_B, [("/f", "/g")])
    helper.close()
    assert caught.value.http_status == 401
    assert "transfer.api.globus.org:all" in str(caught.value)
    assert stub.requests_to("POST", "/v0.10/transfer") == []  # refused at the submission id


def test_client_credentials_mint_the_transfer_token(
    stub: GlobusTransferStub, collections: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A confidential client gets a token from (stand-in) Globus Auth and uses it."""
    stub.clients["f2d4a9d0-client"] = "s3cret"
    monkeypatch.setenv("FXSTREAM_TEST_GLOBUS_SECRET", "s3cret")
    auth = GlobusAuthConfig(
        client_id="f2d4a9d0-client",
        client_secret_env="FXSTREAM_TEST_GLOBUS_SECRET",
        auth_base_url=stub.url,
    )
    (collections[COLLECTION_A] / "f").write_bytes(b"payload")
    helper = GlobusTransferHelper(auth.authorizer(), base_url=stub.url, poll_initial_s=0.02)
    helper.transfer(COLLECTION_A, COLLECTION_B, [("/f", "/f")], timeout_s=10)
    helper.close()

    [token_request] = stub.requests_to("POST", "/v2/oauth2/token")
    assert token_request.body["grant_type"] == "client_credentials"
    assert "transfer.api.globus.org:all" in token_request.body["scope"]
    assert token_request.headers["authorization"].startswith("Basic ")
    [submit] = stub.requests_to("POST", "/v0.10/transfer")
    assert submit.headers["authorization"].startswith("Bearer minted-")
    assert (collections[COLLECTION_B] / "f").read_bytes() == b"payload"


def test_failed_task_raises_with_the_reason(
    helper: GlobusTransferHelper, collections: dict[str, Path]
) -> None:
    """A task that ends FAILED (missing source) raises with Globus's code and advice."""
    with pytest.raises(GlobusTransferFailed) as caught:
        helper.transfer(COLLECTION_A, COLLECTION_B, [("/missing", "/x")], timeout_s=10)
    message = str(caught.value)
    assert "FAILED" in message and "FILE_NOT_FOUND" in message
    assert "What to do" in message
    assert caught.value.status.fatal_error_code == "FILE_NOT_FOUND"
    assert any(event.code == "FILE_NOT_FOUND" for event in caught.value.events)


def test_faulting_task_is_cancelled_after_max_faults(
    stub: GlobusTransferStub, collections: dict[str, Path]
) -> None:
    """A task that keeps faulting is cancelled once it passes max_faults, with its events."""
    (collections[COLLECTION_A] / "f").write_bytes(b"x")
    stub.fault_code = "PERMISSION_DENIED"
    helper = GlobusTransferHelper(
        globus_sdk.AccessTokenAuthorizer(TOKEN),
        base_url=stub.url,
        poll_initial_s=0.02,
        poll_max_s=0.1,
        max_faults=2,
    )
    with pytest.raises(GlobusTransferFaulted) as caught:
        helper.transfer(COLLECTION_A, COLLECTION_B, [("/f", "/f")], timeout_s=10)
    helper.close()
    assert caught.value.status.faults > 2
    assert "PERMISSION_DENIED" in str(caught.value) and "cancelled" in str(caught.value)
    assert len(stub.requests_to("POST", "/cancel")) == 1
    task = stub.tasks[str(caught.value.task_id)]
    assert task.doc["status"] == "FAILED" and task.doc["fatal_error"]["code"] == "CANCELED"
    assert not (collections[COLLECTION_B] / "f").exists()


def test_timeout_cancels_and_polls_with_backoff(
    stub: GlobusTransferStub, collections: dict[str, Path]
) -> None:
    """A task still ACTIVE at the timeout is cancelled; polling backs off meanwhile."""
    (collections[COLLECTION_A] / "f").write_bytes(b"x")
    stub.task_latency_s = 30
    helper = GlobusTransferHelper(
        globus_sdk.AccessTokenAuthorizer(TOKEN),
        base_url=stub.url,
        poll_initial_s=0.05,
        poll_max_s=0.4,
    )
    started = time.monotonic()
    with pytest.raises(GlobusTransferTimeout) as caught:
        helper.transfer(COLLECTION_A, COLLECTION_B, [("/f", "/f")], timeout_s=1.0)
    elapsed = time.monotonic() - started
    helper.close()
    assert 1.0 <= elapsed < 5
    assert caught.value.cancelled and "after 1 s" in str(caught.value)
    polls = stub.requests_to("GET", f"/v0.10/task/{caught.value.task_id}")
    # a fixed 0.05 s interval would poll ~20 times in 1 s; doubling up to 0.4 s polls ~6
    assert 3 <= len(polls) <= 8
    assert len(stub.requests_to("POST", "/cancel")) == 1


# --- connector --------------------------------------------------------------------------------


def test_connector_round_trip_between_two_sites(
    stub: GlobusTransferStub, collections: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Put at site A writes locally; get at site B transfers it; evict at B removes both."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    at_a = connector_at("site-a", collections, stub)
    at_b = connector_at("site-b", collections, stub)
    data = os.urandom(2_000_000)

    key = at_a.put(data)
    assert stub.requests == []  # put is local: no Globus call
    origin = collections[COLLECTION_A] / "fxstream" / key.object_id
    assert origin.read_bytes() == data
    assert at_a.describe(key).size_bytes == len(data)
    assert at_a.describe(key).tier == "durable"

    assert at_b.exists(key)  # by a stat on A's collection
    assert at_b.get(key) == data
    replica = collections[COLLECTION_B] / "fxstream" / key.object_id
    assert replica.read_bytes() == data
    [submit] = stub.requests_to("POST", "/v0.10/transfer")
    assert submit.body["source_endpoint"] == COLLECTION_A
    assert submit.body["destination_endpoint"] == COLLECTION_B
    assert submit.body["verify_checksum"] is True
    location = at_b.describe(key)
    assert (location.site, location.collection_id) == ("site-b", COLLECTION_B)
    assert location.key == f"globus:site-a:{key.object_id}"

    # a second get is served by the local copy
    assert at_b.get(key) == data
    assert len(stub.requests_to("POST", "/v0.10/transfer")) == 1

    at_b.evict(key)
    assert not replica.exists() and not origin.exists()
    assert not at_b.exists(key) and not at_a.exists(key)
    assert at_b.get(key) is None
    # no stray partial files on either side
    for root in collections.values():
        assert list((root / "fxstream").iterdir()) == []
    at_a.close()
    at_b.close()


def test_connector_batches_one_transfer_per_site(
    stub: GlobusTransferStub, collections: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """get_batch fetches every missing object of a site in one task; unknown ids give None."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    at_a = connector_at("site-a", collections, stub)
    at_b = connector_at("site-b", collections, stub)
    objects = [os.urandom(n) for n in (10, 20_000, 300_000)]
    keys = at_a.put_batch(objects)
    missing = GlobusKey(object_id="0" * 32, site="site-a")

    assert at_b.get_batch([*keys, missing]) == [*objects, None]
    [submit] = stub.requests_to("POST", "/v0.10/transfer")
    assert len(submit.body["DATA"]) == 3


def test_config_round_trips_without_the_secret(
    stub: GlobusTransferStub, collections: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """config() names the token's variable, not the token; the site variable picks the site."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    at_a = connector_at("site-a", collections, stub)
    config = at_a.config()
    assert TOKEN not in json.dumps(config)

    monkeypatch.delenv("FXSTREAM_GLOBUS_SITE", raising=False)
    assert GlobusConnector.from_config(config).local.name == "site-a"
    monkeypatch.setenv("FXSTREAM_GLOBUS_SITE", "site-b")
    rebuilt = GlobusConnector.from_config(config)
    assert rebuilt.local.name == "site-b"
    assert rebuilt.config() == {**config, "default_site": "site-b"}


def test_missing_credentials_and_unknown_site_say_what_to_do(
    stub: GlobusTransferStub, collections: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unset token variable, an unknown site and a half-given auth config fail clearly."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    at_a = connector_at("site-a", collections, stub)
    at_b = connector_at("site-b", collections, stub)
    key = at_a.put(b"x")  # no token needed to write locally
    with pytest.raises(GlobusTransferError, match=f"export {TOKEN_ENV}="):
        at_b.get(key)
    with pytest.raises(ValueError, match="add that site's collection"):
        at_b.get(GlobusKey(object_id=key.object_id, site="site-c"))
    with pytest.raises(ValueError, match="not among the configured sites"):
        connector_at("site-c", collections, stub)
    with pytest.raises(ValueError, match="exactly one kind of credential"):
        GlobusAuthConfig()
    with pytest.raises(ValueError, match="exactly one of client_secret_env"):
        GlobusAuthConfig(client_id="c")


def test_proxy_resolves_in_a_process_at_the_other_site(
    stub: GlobusTransferStub,
    collections: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """A proxy made at site A is resolved by another process at site B via a transfer."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    data = os.urandom(1_500_000)
    with Store("fxstream-globus-test", connector_at("site-a", collections, stub)) as store:
        proxy = store.proxy(data)
        key = get_key(proxy)
        proxy_file = tmp_path / "proxy.pickle"
        proxy_file.write_bytes(pickle.dumps(proxy))
        out_file = tmp_path / "resolved.bin"

        env = {**os.environ, "FXSTREAM_GLOBUS_SITE": "site-b"}
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.connectors.globus_site_reader",
                str(proxy_file),
                str(out_file),
            ],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr

        assert hashlib.sha256(out_file.read_bytes()).digest() == hashlib.sha256(data).digest()
        assert isinstance(key, GlobusKey) and key.site == "site-a"
        replica = collections[COLLECTION_B] / "fxstream" / key.object_id
        assert replica.exists()  # the object crossed to B's collection
        [submit] = stub.requests_to("POST", "/v0.10/transfer")
        assert (submit.body["source_endpoint"], submit.body["destination_endpoint"]) == (
            COLLECTION_A,
            COLLECTION_B,
        )
        store.evict(key)


def test_unreachable_api_says_so(collections: dict[str, Path]) -> None:
    """A Transfer API that does not answer gives an error naming the URL and what to check."""
    with GlobusTransferStub(collections, tokens={TOKEN}) as gone:
        url = gone.url  # a port that was just closed: nothing listens there any more
    helper = GlobusTransferHelper(
        globus_sdk.AccessTokenAuthorizer(TOKEN), base_url=url, max_retries=0
    )
    with pytest.raises(GlobusTransferError, match="cannot reach the Globus Transfer API at"):
        helper.status("00000000-0000-0000-0000-000000000000")
    helper.close()


def test_connector_get_surfaces_a_faulting_transfer(
    stub: GlobusTransferStub, collections: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get whose transfer keeps faulting raises (not None, not a hang) and leaves nothing."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    at_a = connector_at("site-a", collections, stub)
    at_b = connector_at("site-b", collections, stub)
    key = at_a.put(b"data")
    stub.fault_code = "PERMISSION_DENIED"
    with pytest.raises(GlobusTransferFaulted, match="PERMISSION_DENIED"):
        at_b.get(key)
    assert list((collections[COLLECTION_B] / "fxstream").iterdir()) == []


def test_auto_proxy_references_name_the_globus_object(
    stub: GlobusTransferStub, collections: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ByReference over a Globus store yields data-locations records for the object."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    at_a = connector_at("site-a", collections, stub)
    with Store("fxstream-globus-byref", at_a) as store:
        packer = ByReference(store, threshold_bytes=1000, site="endpoint-a")
        packed = packer.pack_arguments((os.urandom(50_000),))
        [reference] = packed.references
        [stored] = packed.stored
        assert reference.object_key == at_a.object_key(stored.key)
        assert reference.object_key.startswith("globus:site-a:")
        assert reference.tier == StorageTier.DURABLE
        assert reference.size_bytes == at_a.size_of(stored.key)
        location = location_of(reference)
        assert (location.object_key, location.size_bytes) == (
            reference.object_key,
            reference.size_bytes,
        )
        assert evict_objects(packed.stored) == [reference.object_key]
        assert not (collections[COLLECTION_A] / "fxstream" / stored.key.object_id).exists()
