"""Stream test helpers, and a stream consumer run as a real process (``python -m``).

Arrays carry their index: the first 8 bytes hold it, every other byte is
``index % 251``, so a consumer can check both the order and the content of
each item without the producer's copy.

As a process: ``python -m tests.sdk.stream_child KAFKA_CREDENTIALS_FILE PREFIX STREAM GROUP
HOLD_AFTER INSTANCE_ID`` consumes the stream and prints one JSON line per item
(``{"index": i}``, after checking the item's content). After ``HOLD_AFTER``
items (-1: never) it prints ``{"holding": true}`` and sleeps, keeping the last
item in hand (not asking for the next), until the test kills it. At end-of-stream
it prints ``{"end": true}``
and exits normally (committing everything).
"""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from proxystore.proxy import Proxy, extract
from proxystore.store import Store

from fxstream.connectors import RedisConnector, StoreSpec
from fxstream.sdk import stream_consumer
from fxstream.topics import KafkaConnection

__all__ = ["array_index", "check_array", "indexed_array", "redis_store"]

_STAMP = struct.Struct("<q")


def indexed_array(index: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """An array of ``nbytes`` bytes that says which item it is."""
    array = np.full(nbytes, index % 251, dtype=np.uint8)
    array[: _STAMP.size] = np.frombuffer(_STAMP.pack(index), dtype=np.uint8)
    return array


def array_index(item: Any) -> int:
    """The index an item (array or proxy of one) carries."""
    array = extract(item) if isinstance(item, Proxy) else item
    (index,) = _STAMP.unpack(bytes(array[: _STAMP.size]))
    return int(index)


def check_array(item: Any, nbytes: int | None = None) -> int:
    """The item's index, after checking its size (when given) and every byte of its content."""
    array = extract(item) if isinstance(item, Proxy) else item
    index = array_index(array)
    assert array.dtype == np.uint8, array.dtype
    assert nbytes is None or array.shape == (nbytes,), array.shape
    assert bool(np.all(array[_STAMP.size :] == index % 251)), f"item {index} content differs"
    return index


STREAM_LEASE_S = 7 * 24 * 3600
"""Objects outlive the stream topic's retention unless a consumer evicts them first."""


def redis_store(redis_url: str, name: str) -> Store[Any]:
    """A ProxyStore store on the platform's Redis, its keys under a prefix of ``name``'s own."""
    options = StoreSpec.parse(redis_url).options  # host, port and the store's credentials
    # Typed Any: mypy does not match this connector's key type to ProxyStore's Connector
    # protocol (fxstream.connectors.stores builds its stores from configs for the same reason).
    connector: Any = RedisConnector(
        **{**options, "lease_s": STREAM_LEASE_S, "key_prefix": f"fxobj:{name}:"}
    )
    return Store(name, connector)


def _emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


def main(
    kafka: KafkaConnection, prefix: str, stream: str, group: str, hold_after: int, instance_id: str
) -> None:
    """Consume ``stream`` as described in the module docstring."""
    consumer = stream_consumer(
        kafka,
        stream,
        group=group,
        topic_prefix=prefix,
        timeout_s=120,
        instance_id=instance_id,
    )
    with consumer:
        consumer.kafka.wait_for_assignment()
        _emit({"assigned": True})
        for received, item in enumerate(consumer, start=1):
            _emit({"index": check_array(item)})
            if received == hold_after:
                _emit({"holding": True})
                while True:
                    time.sleep(3600)
    _emit({"end": True})


if __name__ == "__main__":
    # The first argument names a Kafka credentials file: no secret on the command line.
    connection = KafkaConnection.from_file(Path(sys.argv[1]))
    main(connection, sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
