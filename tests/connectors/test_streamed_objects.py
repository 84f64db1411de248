"""Large by-reference values written as they are pickled and loaded from their checked file.

Real files in a private directory (the node-local tier's kind of store), no broker: the
file connector's ``put_from`` must store exactly the payload ``serialize_value`` makes,
leave nothing behind when writing fails, and ``load_from`` must refuse a replaced object
before anything is loaded and a file changed between its check and its load. A large
value that is not one buffer (a dict of arrays) is kept in memory only up to the
threshold and then written on to its file; one that outgrows the tier's room goes to the
fallback store.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fxstream.connectors import ByReference, FileConnector, StoreIntegrityError, open_store
from fxstream.connectors.file import STREAMED_LOAD_BYTES
from fxstream.connectors.reference import collect_references
from fxstream.topics import PayloadSource, Serializer, StorageTier
from tests.security.test_store_integrity import _WritesMarker

_SERIALIZER = Serializer()
_LARGE = STREAMED_LOAD_BYTES + 1_000_000


def _node_directory(tmp_path: Path) -> Path:
    directory = tmp_path / "node"
    directory.mkdir(mode=0o700)
    return directory


def _connector(tmp_path: Path) -> FileConnector:
    return FileConnector(_node_directory(tmp_path), tier=StorageTier.EPHEMERAL)


def _node_store(directory: Path) -> Any:
    return open_store(f"file://{directory}?tier=ephemeral")


@pytest.mark.parametrize(
    "value",
    [
        os.urandom(300_000),
        bytearray(os.urandom(300_000)),
        np.arange(100_000, dtype=np.float64).reshape(100, 1_000),
        {"frames": [os.urandom(70_000), os.urandom(70_000)], "run": 7},
    ],
    ids=["bytes", "bytearray", "ndarray", "dict"],
)
def test_a_streamed_put_stores_the_payload_serialize_value_makes(
    tmp_path: Path, value: Any
) -> None:
    connector = _connector(tmp_path)
    key = connector.put_from(lambda sink: _SERIALIZER.serialize_value_into(value, sink))
    stored = connector._path(key).read_bytes()
    assert stored == _SERIALIZER.serialize_value(value)
    assert key.size_bytes == len(stored)
    assert key.sha256 == hashlib.sha256(stored).hexdigest()
    assert (connector._path(key).stat().st_mode & 0o777) == 0o600


def test_a_value_only_dill_writes_is_written_again_from_its_first_byte(tmp_path: Path) -> None:
    # The C pickler writes the list's first item, then meets the lambda: the sink starts
    # over and dill writes the whole payload.
    offset = 3
    value = [os.urandom(200_000), lambda x: x + offset]
    connector = _connector(tmp_path)
    key = connector.put_from(lambda sink: _SERIALIZER.serialize_value_into(value, sink))
    stored = connector._path(key).read_bytes()
    assert stored == _SERIALIZER.serialize_value(value)
    assert key.sha256 == hashlib.sha256(stored).hexdigest()
    loaded = _SERIALIZER.deserialize(stored)
    assert loaded[0] == value[0] and loaded[1](1) == 4


def test_a_failed_streamed_put_leaves_no_file(tmp_path: Path) -> None:
    connector = _connector(tmp_path)

    def write(sink: Any) -> None:
        sink.write(os.urandom(100_000))
        raise RuntimeError("the disk filled up")

    with pytest.raises(RuntimeError, match="the disk filled up"):
        connector.put_from(write)
    assert list(connector.store_dir.iterdir()) == []


def test_large_values_go_by_reference_through_the_file_and_come_back_equal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _node_store(_node_directory(tmp_path))
    packer = ByReference(store)
    loads: list[int] = []
    real_load_from = FileConnector.load_from

    def counted(self: FileConnector, key: Any, load: Any) -> Any:
        loads.append(key.size_bytes)
        return real_load_from(self, key, load)

    monkeypatch.setattr(FileConnector, "load_from", counted)
    data = os.urandom(_LARGE)
    array = np.random.default_rng(1).random(_LARGE // 8)

    packed = packer.pack_arguments((data,), {"array": array})
    assert len(packed.stored) == 2 and len(packed.payload) < 10_000
    args, kwargs = _SERIALIZER.unpack_arguments(packed.payload)
    assert args[0] == data  # a bytes argument is fetched while the payload loads
    assert np.array_equal(kwargs["array"], array)  # an array arrives as a proxy
    assert sorted(loads) == sorted(s.reference.size_bytes for s in packed.stored)

    result = packer.pack_value(array)
    with collect_references() as found:
        value = _SERIALIZER.deserialize(result.payload)
    assert len(found) == 1 and isinstance(value, np.ndarray)
    assert value.dtype == array.dtype and np.array_equal(value, array)
    assert len(loads) == 3


def test_a_replaced_large_object_is_refused_before_it_loads(tmp_path: Path) -> None:
    connector = _connector(tmp_path)
    data = os.urandom(_LARGE)
    key = connector.put_from(lambda sink: _SERIALIZER.serialize_value_into(data, sink))
    marker = tmp_path / "marker"
    crafted = _SERIALIZER.serialize_value(_WritesMarker(marker))
    # Padding after the pickle's STOP, so the replacement is as large as the object.
    connector._path(key).write_bytes(crafted + bytes(key.size_bytes - len(crafted)))
    with pytest.raises(StoreIntegrityError, match=key.filename):
        connector.load_from(key, _SERIALIZER.deserialize_from)
    assert not marker.exists()


@pytest.mark.parametrize("where", ["data", "end"])
def test_a_file_changed_between_its_check_and_its_load_is_refused(
    tmp_path: Path, where: str
) -> None:
    connector = _connector(tmp_path)
    data = os.urandom(_LARGE)
    key = connector.put_from(lambda sink: _SERIALIZER.serialize_value_into(data, sink))
    path = connector._path(key)

    def change_then_load(source: PayloadSource) -> Any:
        # After the check, before the load: the same file rewritten in the middle of the
        # value (it still loads) or at its end (the pickle no longer loads).
        with open(path, "r+b") as file:
            file.seek(key.size_bytes // 2 if where == "data" else key.size_bytes - 1_000)
            file.write(os.urandom(1_000))
        return _SERIALIZER.deserialize_from(source)

    with pytest.raises(StoreIntegrityError, match=key.filename):
        connector.load_from(key, change_then_load)
    unchanged = connector.put_from(lambda sink: _SERIALIZER.serialize_value_into(data, sink))
    assert connector.load_from(unchanged, _SERIALIZER.deserialize_from) == data


def test_a_gone_object_loads_as_none(tmp_path: Path) -> None:
    connector = _connector(tmp_path)
    key = connector.put_from(lambda sink: _SERIALIZER.serialize_value_into(b"x" * 100, sink))
    connector.evict(key)
    assert connector.load_from(key, _SERIALIZER.deserialize_from) is None


def test_a_stored_envelope_is_not_loaded_as_a_value(tmp_path: Path) -> None:
    connector = _connector(tmp_path)
    packer = ByReference(open_store(f"file://{connector.store_dir}?tier=ephemeral"))
    envelope = packer.pack_arguments((os.urandom(100_000),)).payload
    key = connector.put(envelope)
    with pytest.raises(Exception, match="not a by-reference envelope"):
        connector.load_from(key, _SERIALIZER.deserialize_from)
    assert pickle.HIGHEST_PROTOCOL >= 5


def test_a_large_value_of_any_type_is_written_on_to_its_file_as_it_is_made(
    tmp_path: Path,
) -> None:
    directory = _node_directory(tmp_path)
    packer = ByReference(_node_store(directory))
    arrays = [np.full(40_000, i, dtype=np.float64) for i in range(3)]
    frames: dict[str, Any] = {"run": 7, "frames": arrays}
    packed = packer.pack_value(frames)
    assert len(packed.stored) == 1 and len(packed.payload) < 10_000
    stored = Path(packed.stored[0].reference.object_key).read_bytes()
    assert stored == _SERIALIZER.serialize_value(frames)
    assert packed.stored[0].reference.sha256 == hashlib.sha256(stored).hexdigest()
    with collect_references():
        loaded = _SERIALIZER.deserialize(packed.payload)
    assert loaded["run"] == 7 and all(
        np.array_equal(a, b) for a, b in zip(loaded["frames"], arrays, strict=True)
    )
    # A small value stays inline, the same payload as without a store; nothing is written.
    small = {"run": 8, "frames": [1, 2, 3]}
    assert packer.pack_value(small).payload == _SERIALIZER.serialize_value(small)
    assert len(list(directory.iterdir())) == 1


def test_large_arguments_of_any_type_go_by_reference_and_small_ones_stay_inline(
    tmp_path: Path,
) -> None:
    directory = _node_directory(tmp_path)
    packer = ByReference(_node_store(directory))
    table: dict[str, Any] = {"x": np.arange(50_000, dtype=np.int64), "y": list(range(10_000))}
    packed = packer.pack_arguments((table, 3), {"label": "run 9"})
    assert len(packed.stored) == 1
    args, kwargs = _SERIALIZER.unpack_arguments(packed.payload)
    assert np.array_equal(args[0]["x"], table["x"]) and args[0]["y"] == table["y"]
    assert args[1] == 3 and kwargs == {"label": "run 9"}
    small = packer.pack_arguments(([1, 2], "a"), {"k": 1.5})
    assert small.stored == [] and small.payload == _SERIALIZER.pack_arguments(
        ([1, 2], "a"), {"k": 1.5}
    )
    with pytest.raises(Exception, match="keyword argument names are str"):
        packer.pack_arguments((), {1: "x"})  # type: ignore[dict-item]


def test_a_value_that_outgrows_the_tier_goes_to_the_fallback_store(tmp_path: Path) -> None:
    directory = _node_directory(tmp_path)
    fallback = open_store(f"file://{tmp_path / 'fallback'}")
    asked: list[int] = []

    def has_room(size: int) -> bool:
        asked.append(size)
        return size != 0  # room at the start; none once the value is 64 MiB along

    packer = ByReference(_node_store(directory), fallback=fallback, has_room=has_room)
    big = {"frames": [np.ones(5_000_000) for _ in range(2)]}  # 80 MB, not one buffer
    packed = packer.pack_value(big)
    assert 0 in asked
    assert packed.stored[0].reference.store == fallback.name
    assert list(directory.iterdir()) == []  # the partial file is gone
    with collect_references():
        loaded = _SERIALIZER.deserialize(packed.payload)
    assert all(np.array_equal(a, b) for a, b in zip(loaded["frames"], big["frames"], strict=True))
