"""The ADIOS2 BP5 ProxyStore connector against real ADIOS2 files and real processes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from proxystore.connectors.protocols import Connector
from proxystore.store import Store

from fxstream.connectors import Adios2Connector, Adios2Key, StoreIntegrityError
from fxstream.topics import StorageTier
from tests.connectors.roles import chunk_bytes, start_role

LARGE = 50 * 1024 * 1024


def _sha(data: bytes | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


def test_round_trips_small_and_large_objects_and_evicts(workdir: Path) -> None:
    connector = Adios2Connector(workdir / "store")
    assert isinstance(connector, Connector)
    large = os.urandom(LARGE)
    objects = [b"", b"x", bytearray(b"some bytes"), memoryview(chunk_bytes(3, 1000)), large]
    keys = [connector.put(obj) for obj in objects]
    for key, obj in zip(keys, objects, strict=True):
        assert key.size_bytes == len(bytes(obj))
        assert connector.exists(key)
        got = connector.get(key)
        assert got is not None and bytes(got) == bytes(obj)
    # Listed keys carry no digest (the directory is not trusted), so they cannot be read.
    listed = connector.keys()
    assert sorted(k[:2] for k in listed) == sorted(k[:2] for k in keys)
    with pytest.raises(StoreIntegrityError, match="carries no sha256 digest"):
        connector.get(listed[0])
    connector.evict(keys[-1])
    connector.evict(keys[-1])  # evicting twice is not an error
    assert not connector.exists(keys[-1])
    assert connector.get(keys[-1]) is None
    assert len(connector.keys()) == len(keys) - 1
    # Nothing is left behind but the objects still stored: no temporary or evicted files.
    assert sorted(p.name for p in (workdir / "store").iterdir()) == sorted(
        f"{k.object_id}.bp" for k in keys[:-1]
    )
    missing = Adios2Key("0" * 32, 3)
    assert connector.get_batch([keys[1], missing]) == [bytearray(b"x"), None]
    batch = connector.put_batch([b"a", b"bc"])
    assert [bytes(b or b"") for b in connector.get_batch(batch)] == [b"a", b"bc"]
    connector.close(clear=True)
    assert not (workdir / "store").exists()


def test_another_process_reads_what_this_one_wrote_and_back(workdir: Path) -> None:
    connector = Adios2Connector(workdir / "store")
    large = os.urandom(LARGE)
    keys = [connector.put(b"small object"), connector.put(large)]
    gone = connector.put(b"evicted before the other process looks")
    connector.evict(gone)
    config = json.dumps(connector.config())
    wanted = json.dumps([list(k) for k in [*keys, gone]])
    with start_role(workdir, "connector-get", "--config", config, "--keys", wanted) as reader:
        reports = [reader.next_report(60) for _ in range(3)]
        assert reader.wait() == 0
    assert reports == [
        {"key": list(keys[0]), "size": 12, "sha256": _sha(b"small object")},
        {"key": list(keys[1]), "size": LARGE, "sha256": _sha(large)},
        {"key": list(gone), "missing": True},
    ]
    with start_role(
        workdir, "connector-put", "--config", config, "--count", "2", "--size", "3000000"
    ) as writer:
        written = [writer.next_report(60) for _ in range(2)]
        assert writer.wait() == 0
    for report in written:
        data = connector.get(Adios2Key(*report["key"]))
        assert data is not None and _sha(data) == report["sha256"]


def test_concurrent_writer_processes_share_one_directory(workdir: Path) -> None:
    connector = Adios2Connector(workdir / "store")
    config = json.dumps(connector.config())
    reports = []
    with contextlib.ExitStack() as running:
        # All three start before any is read from: their puts overlap in time.
        writers = [
            running.enter_context(
                start_role(
                    workdir,
                    "connector-put",
                    "--config",
                    config,
                    "--count",
                    "15",
                    "--size",
                    "200000",
                    "--offset",
                    str(100 * i),
                )
            )
            for i in range(3)
        ]
        for writer in writers:
            reports += [writer.next_report(60) for _ in range(15)]
            assert writer.wait() == 0
    assert len({tuple(r["key"]) for r in reports}) == 45
    for report in reports:
        data = connector.get(Adios2Key(*report["key"]))
        assert data is not None and _sha(data) == report["sha256"]
    assert len(connector.keys()) == 45


def test_config_round_trip_tier_and_description(workdir: Path) -> None:
    connector = Adios2Connector(workdir / "local", tier="ephemeral", lease_s=60.0)
    rebuilt = Adios2Connector.from_config(connector.config())
    assert (
        rebuilt.config()
        == connector.config()
        == {
            "store_dir": str(workdir / "local"),
            "tier": "ephemeral",
            "lease_s": 60.0,
            "clear": False,
        }
    )
    key = connector.put(b"12345")
    assert rebuilt.get(key) == b"12345"
    object_path = str(workdir / "local" / f"{key.object_id}.bp")
    assert rebuilt.describe(key) == (
        object_path,
        5,
        "ephemeral",
        socket.gethostname(),
        True,
        key.sha256,
    )
    assert rebuilt.object_key(key) == object_path and rebuilt.size_of(key) == 5
    reference = rebuilt.describe(key).reference("adios", site="endpoint-1")
    assert (reference.object_key, reference.tier, reference.site) == (
        object_path,
        StorageTier.EPHEMERAL,
        "endpoint-1",
    )
    assert Adios2Connector(workdir / "shared").describe(key).tier is StorageTier.DURABLE
    with pytest.raises(ValueError, match="unknown storage tier 'fast'"):
        Adios2Connector(workdir / "x", tier="fast")
    with pytest.raises(ValueError, match="not an Adios2Connector key"):
        connector.get(Adios2Key("../escape", 1))


def test_objects_past_their_lease_are_swept(workdir: Path) -> None:
    connector = Adios2Connector(workdir / "store", lease_s=100.0)
    keys = [connector.put(b"old"), connector.put(b"older")]
    assert connector.count_objects() == 2
    assert connector.sweep_expired() == 0, "nothing is past a 100 s lease yet"
    assert connector.sweep_expired(now=time.time() + 101) == 2
    assert connector.count_objects() == 0
    assert not any(connector.exists(key) for key in keys)
    assert Adios2Connector(workdir / "forever").sweep_expired(now=time.time() + 1e9) == 0


def test_a_proxy_resolves_in_a_separate_process(workdir: Path) -> None:
    array = np.random.default_rng(7).random((1024, 1024))  # 8 MB
    with Store("fxstream-adios-test", Adios2Connector(workdir / "store")) as store:
        proxy = store.proxy(array)
        (workdir / "proxy.pickle").write_bytes(pickle.dumps(proxy))
        with start_role(
            workdir, "proxy-resolve", "--proxy", str(workdir / "proxy.pickle")
        ) as resolver:
            report = resolver.next_report(60)
            assert resolver.wait() == 0
        assert len(store.connector.keys()) == 1
    assert report == {"shape": [1024, 1024], "sha256": _sha(array.tobytes())}
