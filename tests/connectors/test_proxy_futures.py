"""Proxy futures (fxstream.connectors.futures) on a real file store: no broker, no Redis.

A reader started before the value exists waits for it; the value is written once; a slot
written by anyone but a holder of the future, a value substituted after it was written and
a reference whose public key was altered are refused before anything is deserialized; a
wait is bounded; a producer's failure reaches the reader; the owner evicts once its
consumers' holds are released. The Redis store and real workers: tests/e2e/test_proxy_futures.py.
"""

from __future__ import annotations

import json
import pickle
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from proxystore.proxy import Proxy, extract, get_factory
from proxystore.store.base import Store

from fxstream.connectors import (
    FileConnector,
    ProxyFuture,
    ProxyFutureError,
    ProxyFutureFailed,
    ProxyFutureForged,
    ProxyFutureTimeout,
    StoreIntegrityError,
    evict_objects,
    hold_futures,
    open_store,
)
from fxstream.connectors.futures import FutureFactory
from fxstream.sdk import Client, ConfigurationError
from fxstream.sdk.submit import build_task
from fxstream.topics import KafkaConnection, Serializer


def _store(tmp_path: Path) -> Store[Any]:
    return open_store(f"file://{tmp_path}/store?name=pf-{tmp_path.name}")


def _connector(store: Store[Any]) -> FileConnector:
    connector = store.connector
    assert isinstance(connector, FileConnector)
    return connector


def test_a_reader_started_first_waits_for_the_value(tmp_path: Path) -> None:
    store = _store(tmp_path)
    future = ProxyFuture.create(store, timeout_s=30)
    proxy = future.proxy()
    assert not future.done()
    seen: dict[str, Any] = {}

    def consume() -> None:
        started = time.monotonic()
        seen["value"] = extract(proxy)  # blocks on first use
        seen["waited"] = time.monotonic() - started

    reader = threading.Thread(target=consume)
    reader.start()
    time.sleep(0.5)
    assert reader.is_alive(), "the reader did not wait for the value"
    future.set_result({"frames": list(range(5))})
    reader.join(10)
    assert seen["value"] == {"frames": [0, 1, 2, 3, 4]}
    assert seen["waited"] >= 0.4
    assert future.done() and future.result() == {"frames": [0, 1, 2, 3, 4]}
    # A proxy travels without the signing key; the future pickles with it (for a producer).
    pickled_proxy = pickle.dumps(future.proxy())
    assert future._signing_key not in pickled_proxy
    assert extract(pickle.loads(pickled_proxy)) == {"frames": [0, 1, 2, 3, 4]}
    assert pickle.loads(pickle.dumps(future)).result() == {"frames": [0, 1, 2, 3, 4]}
    assert "signing" not in repr(future) and future._signing_key.hex() not in repr(future)


def test_a_future_is_written_once(tmp_path: Path) -> None:
    future = ProxyFuture.create(_store(tmp_path), timeout_s=5)
    future.set_result(1)
    objects = _connector(_store(tmp_path)).count_objects()
    with pytest.raises(ProxyFutureError, match="already set"):
        future.set_result(2)
    with pytest.raises(ProxyFutureError, match="already set"):
        future.set_exception("too late")
    assert future.result() == 1
    # The refused value was not left behind.
    assert _connector(_store(tmp_path)).count_objects() == objects


def test_a_slot_written_by_someone_else_is_refused_unread(tmp_path: Path) -> None:
    store = _store(tmp_path)
    connector = _connector(store)
    future = ProxyFuture.create(store, timeout_s=5)
    proxy = future.proxy()
    # A pointer to a real object, signed with a key that is not the future's.
    key = connector.put(pickle.dumps("forged"))
    body = json.dumps({"key": list(key)}).encode()
    other = Ed25519PrivateKey.generate()
    message = b"fxstream proxy future v1\x00" + future.slot.encode() + b"\x00" + body
    assert connector.set_slot(future.slot, other.sign(message) + body)
    with pytest.raises(Exception) as refused:
        extract(proxy)
    cause = refused.value.__cause__ or refused.value
    assert isinstance(cause, ProxyFutureForged) and isinstance(cause, StoreIntegrityError)
    assert "does not verify with the future's public key" in str(cause)
    # The real producer is told the slot was taken by someone else.
    with pytest.raises(ProxyFutureForged):
        future.set_result("real")


def test_a_value_substituted_after_it_was_written_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    future = ProxyFuture.create(store, timeout_s=5)
    future.set_result(b"the real value" * 100)
    factory = get_factory(future.proxy())
    assert isinstance(factory, FutureFactory)
    values = [p for p in (tmp_path / "store").glob("*.fxobj") if not p.name.startswith("pf-")]
    assert len(values) == 1
    values[0].write_bytes(pickle.dumps(b"substituted"))
    with pytest.raises(StoreIntegrityError, match="differs from the"):
        factory.resolve()


def test_a_reference_with_an_altered_key_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    future = ProxyFuture.create(store, timeout_s=5)
    future.set_result("value")
    good = get_factory(future.proxy())
    assert isinstance(good, FutureFactory)
    for verify_key in (
        "",
        "00" * 32,
        Ed25519PrivateKey.generate().public_key().public_bytes_raw().hex(),
    ):
        forged = FutureFactory(good.key, good.store_config, verify_key=verify_key, timeout_s=5)
        with pytest.raises(ProxyFutureForged):
            forged.resolve()
        with pytest.raises(Exception) as through_a_proxy:
            extract(Proxy(forged))
        assert isinstance(through_a_proxy.value.__cause__, ProxyFutureForged)


def test_a_wait_is_bounded_and_names_the_setting(tmp_path: Path) -> None:
    future = ProxyFuture.create(_store(tmp_path), timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(ProxyFutureTimeout) as waited:
        future.result()
    assert 0.3 <= time.monotonic() - started < 5
    assert "was not set within 0.3 s" in str(waited.value)
    assert "timeout_s argument of Client.proxy_future" in str(waited.value)
    # It travels from a worker with its fields.
    again = pickle.loads(pickle.dumps(waited.value))
    assert isinstance(again, ProxyFutureTimeout) and str(again) == str(waited.value)
    assert isinstance(again, TimeoutError)


def test_a_producers_failure_reaches_the_readers_at_once(tmp_path: Path) -> None:
    future = ProxyFuture.create(_store(tmp_path), timeout_s=30)
    future.set_exception(ValueError("detector offline"))
    started = time.monotonic()
    with pytest.raises(ProxyFutureFailed, match="ValueError: detector offline"):
        future.result()
    assert time.monotonic() - started < 5


def test_the_owner_evicts_once_its_consumers_are_done(tmp_path: Path) -> None:
    store = _store(tmp_path)
    connector = _connector(store)
    future = ProxyFuture.create(store, timeout_s=5, consumers=2)
    proxy = future.proxy()
    first = hold_futures([proxy, 3], {"x": "not a proxy"})
    second = hold_futures([], {"data": proxy})
    assert len(first) == 1 and len(second) == 1
    # A proxy that came from elsewhere (unpickled) has no owner here: no hold.
    assert hold_futures([pickle.loads(pickle.dumps(proxy))]) == []
    future.set_result(list(range(1000)))
    assert connector.count_objects() == 2  # the value and its slot
    assert evict_objects(first) == []
    assert connector.count_objects() == 2, "evicted while a consumer still holds it"
    evicted = evict_objects(second)
    assert future.slot in evicted and len(evicted) == 2
    assert connector.count_objects() == 0
    # A hold of a task never sent ends without counting: nothing is evicted for it.
    later = ProxyFuture.create(store, timeout_s=5)
    never_sent = hold_futures([later.proxy()])[0]
    later.set_result("kept")
    never_sent.discard()
    assert later.result() == "kept"
    assert later.evict() and connector.count_objects() == 0


def test_packing_a_task_never_waits_for_a_proxy_future(tmp_path: Path) -> None:
    """The SDK packs a proxy future's proxy without resolving it (isinstance would), holds
    the future for the task, and ends that hold without counting a task never sent."""
    store = _store(tmp_path)
    client = Client(
        "http://127.0.0.1:9",
        kafka=KafkaConnection("127.0.0.1:9"),
        user_id=str(uuid.uuid4()),
        store=store,
        proxy_threshold=16,
    )
    future, proxy = client.proxy_future(timeout_s=1.0)
    started = time.monotonic()
    packed = client.pack("fn", (proxy, b"a large buffer " * 10), {"same": proxy})
    assert time.monotonic() - started < 0.9, "packing waited for the future's value"
    assert len(packed.holds) == 2 and len(packed.stored) == 1  # the buffer went by reference
    task = build_task(
        catalogue=client.catalogue,
        user_id=client.user_id,
        endpoint_id=str(uuid.uuid4()),
        function_id=str(uuid.uuid4()),
        function_sha256="0" * 64,
        payload=packed,
    )
    assert set(task.stored) == {*packed.stored, *packed.holds}
    args, kwargs = Serializer().unpack_arguments(packed.payload)
    factory = get_factory(args[0])
    assert isinstance(factory, FutureFactory) and factory.key == future.slot
    assert factory.owner is None  # what travels holds no bookkeeping
    future.set_result("late")
    client.release(task)  # never sent: the holds end, the value stays for other readers
    assert future.result() == "late" and extract(kwargs["same"]) == "late"
    assert future.evict()
    client.close()
    with pytest.raises(ConfigurationError, match="store_url"):
        Client("http://127.0.0.1:9", kafka=KafkaConnection("127.0.0.1:9")).proxy_future()


def test_a_producer_that_ended_without_setting_fails_its_readers(tmp_path: Path) -> None:
    store = _store(tmp_path)
    connector = _connector(store)
    future = ProxyFuture.create(store, timeout_s=30)
    consumer = hold_futures([future.proxy()])
    producer = hold_futures([future])
    assert [type(h).__name__ for h in (*consumer, *producer)] == ["FutureHold", "ProducerHold"]
    # The producer's result was consumed, and it set nothing: the reader is told at once.
    assert evict_objects(producer) == []
    started = time.monotonic()
    with pytest.raises(ProxyFutureFailed, match="producer task it was given ended"):
        future.result()
    assert time.monotonic() - started < 5
    assert evict_objects(consumer) and connector.count_objects() == 0
    # Nobody waits any more (or the value was evicted): a producer's end writes nothing.
    ended = ProxyFuture.create(store, timeout_s=30)
    hold_futures([ended.proxy()])[0].release()
    hold_futures([ended])[0].release()
    assert not ended.done() and connector.count_objects() == 0
