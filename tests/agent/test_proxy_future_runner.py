"""The worker's side of proxy futures, in this process (no broker, no worker pool): a
function given a proxy future's proxy gets the value once set; a timeout, a producer's
failure and a forged slot fail the call with the proxy-future error itself (not ProxyStore's
ProxyResolveError), serialized for the client; a function given the future sets it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fxstream.agent.runner import EXCEPTION_ATTRIBUTE, load_function
from fxstream.connectors import (
    FileConnector,
    ProxyFuture,
    ProxyFutureFailed,
    ProxyFutureForged,
    ProxyFutureTimeout,
    open_store,
)
from fxstream.topics import Serializer, TaskSubmission, client_info, encode

SERIALIZER = Serializer()


def total(data: Any) -> float:
    return float(sum(data))


def sets(future: Any, n: int) -> str:
    future.set_result(list(range(n)))
    return "set"


def _call(function: Any, *args: Any, store_url: str) -> Any:
    submission = TaskSubmission(
        task_id="task-1",
        function_id="fn-1",
        endpoint_id="ep-1",
        user_id="u-1",
        function_sha256="0" * 64,
        payload=SERIALIZER.pack_arguments(args, {}),
        client=client_info(),
        submitted_at=time.time(),
    )
    call = load_function(SERIALIZER.serialize_function(function), store_url=store_url)
    return SERIALIZER.deserialize(call(encode(submission)))


def test_a_consumer_waits_and_a_producer_sets_from_the_worker(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    future = ProxyFuture.create(open_store(url), timeout_s=30)
    got: dict[str, Any] = {}
    consumer = threading.Thread(
        target=lambda: got.update(value=_call(total, future.proxy(), store_url=url))
    )
    consumer.start()
    time.sleep(0.5)
    assert consumer.is_alive() and not got
    assert _call(sets, future, 100, store_url=url) == "set"  # the future, pickled to a task
    consumer.join(30)
    assert got["value"] == float(sum(range(100)))


@pytest.mark.parametrize("case", ["timeout", "failed", "forged"])
def test_the_call_fails_with_the_proxy_future_error_itself(tmp_path: Path, case: str) -> None:
    url = f"file://{tmp_path / 'store'}"
    store = open_store(url)
    future = ProxyFuture.create(store, timeout_s=0.5 if case == "timeout" else 30)
    expected: type[Exception] = ProxyFutureTimeout
    if case == "failed":
        future.set_exception("no beam")
        expected = ProxyFutureFailed
    elif case == "forged":
        connector = store.connector
        assert isinstance(connector, FileConnector)
        key = connector.put(SERIALIZER.serialize_value([1, 2]))
        body = json.dumps({"key": list(key)}).encode()
        message = b"fxstream proxy future v1\x00" + future.slot.encode() + b"\x00" + body
        connector.set_slot(future.slot, Ed25519PrivateKey.generate().sign(message) + body)
        expected = ProxyFutureForged
    with pytest.raises(expected) as failed:
        _call(total, future.proxy(), store_url=url)
    assert type(failed.value) is expected and failed.value.__cause__ is None
    # Serialized beside its text, for the client to raise with its own type.
    again = SERIALIZER.deserialize(getattr(failed.value, EXCEPTION_ATTRIBUTE))
    assert type(again) is expected and str(again) == str(failed.value)
