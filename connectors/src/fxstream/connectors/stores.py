"""Store URLs: how a user or an endpoint names the store its bulk data goes to.

A store is a ProxyStore :class:`~proxystore.store.base.Store` around one of
fxstream's connectors, named by a URL (the ``store_url`` client setting, or an
endpoint config's ``store.url``):

=====================================================  =====================================
URL                                                    store
=====================================================  =====================================
``redis://USER:PASSWORD@HOST:PORT[/DB]``               :class:`RedisConnector` (durable: AOF)
``rediss://USER:PASSWORD@HOST:PORT[/DB]?ca_file=PATH`` the same over TLS
``file:///shared/dir``                                 :class:`FileConnector`, durable tier
``file:///local/dir?tier=ephemeral``                   :class:`FileConnector`, node-local
``adios2:///shared/dir``                               :class:`Adios2Connector` (BP5 files)
=====================================================  =====================================

Query parameters common to all: ``lease_s`` (how long an object nobody
evicted lives; default :data:`DEFAULT_LEASE_S`), ``tier`` (``durable`` or
``ephemeral``) and ``name`` (the ProxyStore store name; default derived from
the URL, so every process that opens the same URL shares one registered store).

A Redis URL carries the store's user and password: it is a secret. A
:class:`StoreSpec` keeps only the redacted URL (password ``***``) in
:attr:`StoreSpec.url`, its repr and its errors; the password goes to the
connector, which keeps it out of every config it hands out (see
:mod:`fxstream.connectors.redis`).
"""

from __future__ import annotations

import hashlib
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Final

from proxystore.store import get_or_create_store
from proxystore.store.base import Store
from proxystore.store.config import ConnectorConfig, StoreConfig

from fxstream.connectors.adios import Adios2Connector
from fxstream.connectors.file import FileConnector
from fxstream.connectors.redis import RedisConnector, redact_url
from fxstream.topics import Catalogue, StorageTier

__all__ = ["DEFAULT_LEASE_S", "StoreSpec", "StoreURLError", "open_store"]


def _longest_replay_window_s() -> float:
    catalogue = Catalogue()
    families = (
        "from.user.{user_id}",
        "tasks.ep.{endpoint_id}",
        "from.ep.{endpoint_id}",
        "results.{user_id}",
    )
    return max(catalogue.spec(name).retention_ms for name in families) / 1000


DEFAULT_LEASE_S: Final = _longest_replay_window_s()
"""An object's lease: the longest retention of a topic whose records can refer to it.

A task's input must outlive every replay of its submission (a retry, an agent
restarted from committed offsets), so the lease is at least that retention.
Objects are evicted sooner once their task's result is consumed (see
docs/data-plane.md, "Lifetimes"); the lease only reclaims what a dead client
never evicted.
"""

_SCHEMES: Final = ("redis", "rediss", "file", "adios2")


class StoreURLError(ValueError):
    """A store URL that does not name a store fxstream can open."""


@dataclass(frozen=True)
class StoreSpec:
    """A parsed store URL: what connector, where, which tier and lease.

    ``url`` is the URL with its password redacted; ``options`` (the connector's
    arguments, the password among them) is left out of the repr.
    """

    url: str
    scheme: str
    name: str
    tier: StorageTier
    lease_s: float | None
    options: dict[str, Any] = field(repr=False)

    @classmethod
    def parse(cls, url: str) -> StoreSpec:
        """Parse a store URL; :class:`StoreURLError` says what is wrong and what is accepted.

        The errors name the URL with its password redacted.
        """
        secret_url, url = url, redact_url(url)
        parsed = urllib.parse.urlsplit(secret_url)
        if parsed.scheme not in _SCHEMES:
            raise StoreURLError(
                f"store URL {url!r}: unknown scheme {parsed.scheme!r}; use "
                "redis://USER:PASSWORD@HOST:PORT (rediss:// for TLS), "
                "file:///DIRECTORY (add ?tier=ephemeral for node-local disk) or "
                "adios2:///DIRECTORY"
            )
        query = dict(urllib.parse.parse_qsl(parsed.query, strict_parsing=False))
        unknown = sorted(set(query) - {"lease_s", "tier", "name", "chunk_bytes", "ca_file"})
        if unknown:
            raise StoreURLError(
                f"store URL {url!r}: unknown parameters {unknown}; known: lease_s, tier, name, "
                "chunk_bytes (redis only), ca_file (rediss only)"
            )
        try:
            tier = StorageTier(query.get("tier", StorageTier.DURABLE.value))
        except ValueError:
            raise StoreURLError(
                f"store URL {url!r}: tier must be 'durable' or 'ephemeral', not {query['tier']!r}"
            ) from None
        lease_s = _positive(url, "lease_s", query.get("lease_s"), DEFAULT_LEASE_S)
        options: dict[str, Any]
        if parsed.scheme in ("redis", "rediss"):
            try:
                port = parsed.port
            except ValueError:
                port = None
            if not parsed.hostname or port is None:
                raise StoreURLError(
                    f"store URL {url!r}: a Redis URL is "
                    f"{parsed.scheme}://USER:PASSWORD@HOST:PORT[/DB]"
                )
            db_text = parsed.path.strip("/") or "0"
            if not db_text.isdigit():
                raise StoreURLError(f"store URL {url!r}: the Redis database must be a number")
            options = {
                "hostname": parsed.hostname,
                "port": port,
                "db": int(db_text),
                "lease_s": lease_s,
                "tier": tier.value,
            }
            if parsed.username:
                options["username"] = urllib.parse.unquote(parsed.username)
            if parsed.password is not None:
                options["password"] = urllib.parse.unquote(parsed.password)
            if parsed.scheme == "rediss":
                options["tls"] = True
                if "ca_file" in query:
                    options["ca_file"] = query["ca_file"]
            elif "ca_file" in query:
                raise StoreURLError(f"store URL {url!r}: ca_file needs TLS, a rediss:// URL")
            if "chunk_bytes" in query:
                options["chunk_bytes"] = int(_positive(url, "chunk_bytes", query["chunk_bytes"], 0))
        else:
            if parsed.netloc not in ("", "localhost") or not parsed.path:
                raise StoreURLError(
                    f"store URL {url!r}: a directory store URL is "
                    f"{parsed.scheme}:///ABSOLUTE/DIRECTORY"
                )
            options = {"store_dir": urllib.parse.unquote(parsed.path), "tier": tier.value}
            options["lease_s"] = lease_s
        digest = hashlib.sha256(url.encode()).hexdigest()[:12]
        name = query.get("name") or f"fx-{parsed.scheme}-{digest}"
        return cls(url, parsed.scheme, name, tier, lease_s, options)

    def connector_type(self) -> type[RedisConnector | FileConnector | Adios2Connector]:
        """The connector class this URL names."""
        if self.scheme == "adios2":
            return Adios2Connector
        return RedisConnector if self.scheme in ("redis", "rediss") else FileConnector

    def store_config(self) -> StoreConfig:
        """The ProxyStore config that recreates this store in any process (a worker's)."""
        kind = f"{self.connector_type().__module__}.{self.connector_type().__qualname__}"
        # No cache: a worker's resolved 1 GB argument must not outlive its task.
        return StoreConfig(
            name=self.name,
            connector=ConnectorConfig(kind=kind, options=dict(self.options)),
            serializer=None,
            deserializer=None,
            cache_size=0,
            metrics=False,
            populate_target=False,
            auto_register=False,
        )


def open_store(spec: StoreSpec | str) -> Store[Any]:
    """The process-wide ProxyStore store for a URL (created and registered on first use)."""
    if isinstance(spec, str):
        spec = StoreSpec.parse(spec)
    return get_or_create_store(spec.store_config())


def _positive(url: str, name: str, text: str | None, default: float) -> float:
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise StoreURLError(f"store URL {url!r}: {name} must be a positive number, not {text!r}")
    return value
