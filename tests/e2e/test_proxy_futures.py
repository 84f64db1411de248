"""Proxy futures end to end (issue 15 item 4): the platform's Redis, a real agent and workers.

A consumer task given a proxy future's proxy starts at once and blocks on its first use
until the value is set, by the client or by a producer task given the future itself, so
the two tasks overlap. The value is verified on the worker before it is loaded (a slot
written by someone without the future's key, or a value substituted after it was set, is
refused: nothing is deserialized); a wait is bounded and says which setting bounds it; a
producer's failure reaches the consumer at once. The value is evicted once its consumer's
result is consumed.
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fxstream.connectors import RedisConnector, RedisObjectKey, StoreIntegrityError, StoreSpec
from fxstream.ops.private import ExtraEndpoint
from fxstream.sdk import (
    Client,
    Executor,
    ProxyFutureFailed,
    ProxyFutureForged,
    ProxyFutureTimeout,
)
from fxstream.topics import Serializer
from tests.e2e.stack import Stack, added_endpoint

pytestmark = pytest.mark.platform

WAIT_S = 90.0
N = 100_000  # 800 kB of float64: chunked by nothing, but far above the proxy threshold
TOTAL = float(np.arange(N, dtype=np.float64).sum())


def consume(data: Any, marker: str) -> dict[str, float]:
    import time
    from pathlib import Path

    started = time.time()
    Path(marker).write_text("started")
    total = float(data.sum())  # the first use: waits for the value
    return {"started": started, "resolved": time.time(), "total": total}


def consume_after_startup(data: Any, startup_s: float) -> float:
    import time

    time.sleep(startup_s)  # start-up work (loading a model, say), overlapped with the producer
    return float(data.sum())


def produce(future: Any, n: int, work_s: float) -> int:
    import time

    import numpy as np

    time.sleep(work_s)
    future.set_result(np.arange(n, dtype=np.float64))
    time.sleep(work_s)  # more work after its output exists
    return n


def fail_to_produce(future: Any) -> str:
    future.set_exception(RuntimeError("the detector went offline"))
    return "told them"


def use(data: Any) -> Any:
    return data + 1


def crash(future: Any) -> None:
    raise ValueError("no frames today")


class _OpensAFile:
    """Loading this pickle creates ``path``: the proof that something was deserialized."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (self.path, "w")


@pytest.fixture(scope="module")
def stack(shared_platform: Stack) -> Stack:
    """The session's shared platform (tests/conftest.py): this module only uses it."""
    return shared_platform


@pytest.fixture(scope="module")
def endpoint(stack: Stack) -> Iterator[ExtraEndpoint]:
    """An endpoint of this module with the platform's store and two workers (a producer
    and a consumer run at the same time)."""
    with added_endpoint(stack, "proxy-futures", workers=2) as extra:
        yield extra


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[Client]:
    """A client of the platform's local user (its store is the platform's Redis)."""
    made = stack.client()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def redis(stack: Stack) -> Iterator[RedisConnector]:
    """The platform's Redis as any holder of its password sees it (every user and
    endpoint: docs/security.md): the stand-in for someone tampering with the store."""
    url = stack.settings.store_url
    assert url is not None, "./fx up must write the platform's Redis into the credentials"
    spec = StoreSpec.parse(url)
    connector = RedisConnector(**spec.options)
    yield connector
    connector.close()


def _until(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _count_becomes(redis: RedisConnector, expected: int, timeout_s: float = 30.0) -> int:
    # Eviction runs just after a future resolves (on the listener's threads).
    deadline = time.monotonic() + timeout_s
    count = redis.count_objects()
    while count != expected and time.monotonic() < deadline:
        time.sleep(0.1)
        count = redis.count_objects()
    return count


def test_a_consumer_submitted_first_waits_for_the_clients_value(
    stack: Stack,
    endpoint: ExtraEndpoint,
    client: Client,
    redis: RedisConnector,
    tmp_path: Path,
) -> None:
    before = redis.count_objects()
    marker = tmp_path / "consumer-started"
    future, proxy = client.proxy_future(timeout_s=120)
    password = StoreSpec.parse(stack.settings.store_url or "").options["password"]
    assert password.encode() not in pickle.dumps(proxy)
    assert password.encode() not in pickle.dumps(future)
    with Executor(endpoint_id=endpoint.endpoint_id, client=client) as executor:
        consumer = executor.submit(consume, proxy, str(marker))
        _until(marker.exists)  # the consumer runs...
        time.sleep(1.0)
        assert not consumer.done(), "the consumer finished without the value"  # ...and waits
        set_at = time.time()
        future.set_result(np.arange(N, dtype=np.float64))
        outcome = consumer.result(timeout=WAIT_S)
    assert outcome["total"] == TOTAL
    assert outcome["started"] < set_at <= outcome["resolved"] + 0.05
    started = consumer.timings["started"]
    assert started is not None and started < set_at
    # Consumed: the value and its slot are evicted.
    assert _count_becomes(redis, before) == before
    assert redis.get_slot(future.slot) is None


def test_a_producer_task_and_its_consumer_overlap(
    endpoint: ExtraEndpoint, client: Client, redis: RedisConnector
) -> None:
    before = redis.count_objects()
    with Executor(endpoint_id=endpoint.endpoint_id, client=client) as executor:
        future, proxy = executor.proxy_future(timeout_s=120)
        consumer = executor.submit(consume_after_startup, proxy, 1.0)
        producer = executor.submit(produce, future, N, 3.0)
        assert consumer.result(timeout=WAIT_S) == TOTAL
        assert producer.result(timeout=WAIT_S) == N
    c_started, c_finished = consumer.timings["started"], consumer.timings["finished"]
    p_started, p_finished = producer.timings["started"], producer.timings["finished"]
    assert None not in (c_started, c_finished, p_started, p_finished)
    assert c_started is not None and c_finished is not None and p_finished is not None
    # The consumer started before the producer ended, and even finished before it did:
    # the stages overlapped instead of running one after the other.
    assert c_started < p_finished
    assert c_finished < p_finished, (consumer.timings, producer.timings)
    assert _count_becomes(redis, before) == before


def test_a_forged_or_tampered_value_is_refused_by_the_worker(
    endpoint: ExtraEndpoint, client: Client, redis: RedisConnector, tmp_path: Path
) -> None:
    before = redis.count_objects()
    loaded = tmp_path / "something-was-deserialized"
    evil = Serializer(data="pk").serialize_value(_OpensAFile(str(loaded)))
    # 1. Someone with the store's password but not the future's key writes the slot first:
    # a pointer to their own object (its digest right), signed with their own key.
    forged, forged_proxy = client.proxy_future(timeout_s=60)
    theirs = redis.put(evil)
    body = json.dumps({"key": list(theirs)}).encode()
    message = b"fxstream proxy future v1\x00" + forged.slot.encode() + b"\x00" + body
    assert redis.set_slot(forged.slot, Ed25519PrivateKey.generate().sign(message) + body)
    # 2. A value set by the future's holder, then replaced in the store.
    tampered, tampered_proxy = client.proxy_future(timeout_s=60)
    tampered.set_result(np.arange(10.0))
    slot_data = redis.get_slot(tampered.slot)
    assert slot_data is not None
    value_key = RedisObjectKey(*json.loads(slot_data[64:])["key"])
    redis._client.set(value_key.redis_key, evil)
    with Executor(endpoint_id=endpoint.endpoint_id, client=client) as executor:
        on_forged = executor.submit(use, forged_proxy)
        on_tampered = executor.submit(use, tampered_proxy)
        with pytest.raises(ProxyFutureForged) as refused:
            on_forged.result(timeout=WAIT_S)
        with pytest.raises(StoreIntegrityError) as substituted:
            on_tampered.result(timeout=WAIT_S)
    assert "does not verify with the future's public key" in str(refused.value)
    assert isinstance(refused.value, StoreIntegrityError)
    assert "differs from the" in str(substituted.value)
    assert not isinstance(substituted.value, ProxyFutureForged)
    assert not loaded.exists(), "the worker deserialized an unauthenticated object"
    # The owner evicted the tampered future's value (its pointer is authentic) and both
    # slots; the forger's own object is not the owner's to evict.
    redis.evict(theirs)
    assert _count_becomes(redis, before) == before


def test_a_wait_is_bounded_and_a_producers_failure_arrives_at_once(
    endpoint: ExtraEndpoint, client: Client, redis: RedisConnector
) -> None:
    before = redis.count_objects()
    _never, never_proxy = client.proxy_future(timeout_s=2.0)
    failing, failing_proxy = client.proxy_future(timeout_s=120)
    with Executor(endpoint_id=endpoint.endpoint_id, client=client) as executor:
        waits = executor.submit(use, never_proxy)
        with pytest.raises(ProxyFutureTimeout) as timed_out:
            waits.result(timeout=WAIT_S)
        told = executor.submit(use, failing_proxy)
        assert executor.submit(fail_to_produce, failing).result(timeout=WAIT_S) == "told them"
        with pytest.raises(ProxyFutureFailed) as failed:
            told.result(timeout=WAIT_S)
        # A producer task that crashes before setting it: once its failure is consumed, the
        # SDK fails the future for the consumer still waiting.
        crashed, crashed_proxy = client.proxy_future(timeout_s=120)
        orphan = executor.submit(use, crashed_proxy)
        with pytest.raises(ValueError, match="no frames today"):
            executor.submit(crash, crashed).result(timeout=WAIT_S)
        with pytest.raises(ProxyFutureFailed, match="producer task it was given ended"):
            orphan.result(timeout=WAIT_S)
    assert "was not set within 2 s" in str(timed_out.value)
    assert "timeout_s argument of Client.proxy_future" in str(timed_out.value)
    started, finished = waits.timings["started"], waits.timings["finished"]
    assert started is not None and finished is not None and 2.0 <= finished - started < 30
    assert "RuntimeError: the detector went offline" in str(failed.value)
    t_started, t_finished = told.timings["started"], told.timings["finished"]
    assert t_started is not None and t_finished is not None and t_finished - t_started < 60
    assert _count_becomes(redis, before) == before
