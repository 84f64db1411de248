"""fxstream.connectors: where bulk data lives, and how it travels by reference.

- :mod:`~fxstream.connectors.redis`, :mod:`~fxstream.connectors.file`: ProxyStore
  connectors (Redis with chunking and leases; a directory on shared or node-local disk).
- :mod:`~fxstream.connectors.stores`: store URLs (``redis://``, ``file://``) and tiers.
- :mod:`~fxstream.connectors.reference`: automatic pass-by-reference of large values.
- :mod:`~fxstream.connectors.node_local`: the node-local tier (shared memory) when a
  client and a worker share a node, recognised by their node key.
- :mod:`~fxstream.connectors.futures`: proxy futures, references to values not yet
  written (``ProxyFuture``; a consumer blocks on first use until a producer sets it).
- :mod:`~fxstream.connectors.locations`: the ``data-locations`` publisher.
- :mod:`~fxstream.connectors.globus`: Globus transfers between sites (helper and connector).
- :mod:`~fxstream.connectors.named_objects`: a user's named objects in the Redis store
  (``store://NAME`` staged files).
- :mod:`~fxstream.connectors.adios`: a ProxyStore connector on ADIOS2 BP5 files.
- :mod:`~fxstream.connectors.adios_stream`: producer -> consumer array streams over
  ADIOS2 (SST over TCP, or BP5 read while written).
- :mod:`~fxstream.connectors.file_stream`: read-while-writing byte streams on files.
- :mod:`~fxstream.connectors.liveness`: stream writer leases, and ``StreamAborted``.
- :mod:`~fxstream.connectors.descriptions`: (key, size, tier) of what a connector made.
- :mod:`~fxstream.connectors.integrity`: the SHA-256 every stored object's key carries,
  checked before anything is deserialized (``StoreIntegrityError``).

Event sources and the sink (docs/triggers.md):

- :mod:`~fxstream.connectors.event_writer`: writes typed events to ``events.<source>``
  in transactions, and reads the recent keys a restarted source skips.
- :mod:`~fxstream.connectors.file_watcher`: one event per complete file in a directory.
- :mod:`~fxstream.connectors.adios_steps`: one event per step of an ADIOS2 BP5 stream.
- :mod:`~fxstream.connectors.topic_source`: events from the records of a Kafka topic.
- :mod:`~fxstream.connectors.parquet_sink`: results metadata, events and task-state
  changes archived to Parquet by day and hour, each row once.
- :mod:`~fxstream.connectors.source_cli`: the ``fxstream-source`` command.

The ADIOS2, watchdog and pyarrow names are imported on first use: ``adios2`` alone takes
about 0.3 s to import, which every user of this package would otherwise pay.
"""

import importlib
from typing import TYPE_CHECKING, Any

from fxstream.connectors.descriptions import ObjectDescription
from fxstream.connectors.file import FileConnector, FileObjectKey, ObjectOnOtherNode
from fxstream.connectors.file_stream import FileStreamReader, FileStreamWriter
from fxstream.connectors.futures import (
    DEFAULT_PROXY_FUTURE_TIMEOUT_S,
    FutureHold,
    ProducerHold,
    ProxyFuture,
    ProxyFutureError,
    ProxyFutureFailed,
    ProxyFutureForged,
    ProxyFutureTimeout,
    hold_futures,
)
from fxstream.connectors.globus import (
    GlobusAuthConfig,
    GlobusConnector,
    GlobusKey,
    GlobusSite,
    GlobusTransferError,
    GlobusTransferHelper,
)
from fxstream.connectors.integrity import StoreIntegrityError
from fxstream.connectors.liveness import StreamAborted
from fxstream.connectors.locations import LocationPublisher, location_of
from fxstream.connectors.named_objects import (
    MAX_NAMED_OBJECT_BYTES,
    NamedObjects,
    NamedObjectTooLarge,
)
from fxstream.connectors.node_local import NodeLocal, find_node_local
from fxstream.connectors.redis import RedisConnector, RedisObjectKey, redact_url
from fxstream.connectors.reference import (
    DEFAULT_PROXY_THRESHOLD_BYTES,
    ByReference,
    Packed,
    StoredObject,
    collect_references,
    evict_objects,
    load_payload,
    proxies_by_value,
)
from fxstream.connectors.stores import DEFAULT_LEASE_S, StoreSpec, StoreURLError, open_store

if TYPE_CHECKING:
    from fxstream.connectors.adios import Adios2Connector, Adios2Key
    from fxstream.connectors.adios_steps import Adios2StepSource
    from fxstream.connectors.adios_stream import (
        Adios2Stream,
        Adios2StreamReader,
        Adios2StreamWriter,
        StreamStep,
    )
    from fxstream.connectors.event_writer import EventWriter
    from fxstream.connectors.file_watcher import FileWatcher
    from fxstream.connectors.parquet_sink import ParquetSink
    from fxstream.connectors.topic_source import TopicEventSource

_LAZY_NAMES = {
    "Adios2Connector": "fxstream.connectors.adios",
    "Adios2Key": "fxstream.connectors.adios",
    "Adios2Stream": "fxstream.connectors.adios_stream",
    "Adios2StreamReader": "fxstream.connectors.adios_stream",
    "Adios2StreamWriter": "fxstream.connectors.adios_stream",
    "StreamStep": "fxstream.connectors.adios_stream",
    "Adios2StepSource": "fxstream.connectors.adios_steps",
    "EventWriter": "fxstream.connectors.event_writer",
    "FileWatcher": "fxstream.connectors.file_watcher",
    "ParquetSink": "fxstream.connectors.parquet_sink",
    "TopicEventSource": "fxstream.connectors.topic_source",
}

__all__ = [
    "DEFAULT_LEASE_S",
    "DEFAULT_PROXY_FUTURE_TIMEOUT_S",
    "DEFAULT_PROXY_THRESHOLD_BYTES",
    "MAX_NAMED_OBJECT_BYTES",
    "Adios2Connector",
    "Adios2Key",
    "Adios2StepSource",
    "Adios2Stream",
    "Adios2StreamReader",
    "Adios2StreamWriter",
    "ByReference",
    "EventWriter",
    "FileConnector",
    "FileObjectKey",
    "FileStreamReader",
    "FileStreamWriter",
    "FileWatcher",
    "FutureHold",
    "GlobusAuthConfig",
    "GlobusConnector",
    "GlobusKey",
    "GlobusSite",
    "GlobusTransferError",
    "GlobusTransferHelper",
    "LocationPublisher",
    "NamedObjectTooLarge",
    "NamedObjects",
    "NodeLocal",
    "ObjectDescription",
    "ObjectOnOtherNode",
    "Packed",
    "ParquetSink",
    "ProducerHold",
    "ProxyFuture",
    "ProxyFutureError",
    "ProxyFutureFailed",
    "ProxyFutureForged",
    "ProxyFutureTimeout",
    "RedisConnector",
    "RedisObjectKey",
    "StoreIntegrityError",
    "StoreSpec",
    "StoreURLError",
    "StoredObject",
    "StreamAborted",
    "StreamStep",
    "TopicEventSource",
    "collect_references",
    "evict_objects",
    "find_node_local",
    "hold_futures",
    "load_payload",
    "location_of",
    "open_store",
    "proxies_by_value",
    "redact_url",
]


def __getattr__(name: str) -> Any:
    """Import an ADIOS2, event-source or sink name from its module on first use."""
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
