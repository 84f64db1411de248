"""fxstream.connectors: where bulk data lives, and how it travels by reference.

- :mod:`~fxstream.connectors.redis`, :mod:`~fxstream.connectors.file`: ProxyStore
  connectors (Redis with chunking and leases; a directory on shared or node-local disk).
- :mod:`~fxstream.connectors.stores`: store URLs (``redis://``, ``file://``) and tiers.
- :mod:`~fxstream.connectors.reference`: automatic pass-by-reference of large values.
- :mod:`~fxstream.connectors.locations`: the ``data-locations`` publisher.
- :mod:`~fxstream.connectors.globus`: Globus transfers between sites (helper and connector).
"""

from fxstream.connectors.file import FileConnector, FileObjectKey, ObjectOnOtherNode
from fxstream.connectors.globus import (
    GlobusAuthConfig,
    GlobusConnector,
    GlobusKey,
    GlobusSite,
    GlobusTransferError,
    GlobusTransferHelper,
)
from fxstream.connectors.locations import LocationPublisher, location_of
from fxstream.connectors.redis import RedisConnector, RedisObjectKey
from fxstream.connectors.reference import (
    DEFAULT_PROXY_THRESHOLD_BYTES,
    ByReference,
    Packed,
    StoredObject,
    collect_references,
    evict_objects,
    load_payload,
)
from fxstream.connectors.stores import DEFAULT_LEASE_S, StoreSpec, StoreURLError, open_store

__all__ = [
    "DEFAULT_LEASE_S",
    "DEFAULT_PROXY_THRESHOLD_BYTES",
    "ByReference",
    "FileConnector",
    "FileObjectKey",
    "GlobusAuthConfig",
    "GlobusConnector",
    "GlobusKey",
    "GlobusSite",
    "GlobusTransferError",
    "GlobusTransferHelper",
    "LocationPublisher",
    "ObjectOnOtherNode",
    "Packed",
    "RedisConnector",
    "RedisObjectKey",
    "StoreSpec",
    "StoreURLError",
    "StoredObject",
    "collect_references",
    "evict_objects",
    "load_payload",
    "location_of",
    "open_store",
]
