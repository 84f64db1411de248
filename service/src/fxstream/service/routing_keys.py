"""Where the router and the ingress get the service's routing keys, and what to do without.

The router stamps every dispatch and the ingress verifies every result and task event
with the routing keys (:mod:`fxstream.topics.routing_stamp`). They live in one 0600 JSON
file, named to a processor by ``--routing-keys FILE`` or the ``FXSTREAM_ROUTING_KEYS``
variable: never a key on a command line, in a record or in a log (only key ids, which
are not secret, are ever shown). ``./fx up`` makes ``<home>/credentials/routing-keys.json``
at its first start and passes it to the router and ingress processes; elsewhere
``fxstream-service routing-keys FILE`` makes one. There is no default key: a router or
ingress without a readable file does not start, and says what to run.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Final

from fxstream.topics import (
    ROUTING_KEYS_ENV,
    CredentialFileError,
    RoutingKeys,
    read_routing_keys,
)

__all__ = ["ROLES_WITH_KEYS", "RoutingKeysUnavailable", "routing_keys_for"]

ROLES_WITH_KEYS: Final = frozenset({"router", "ingress"})
"""The processors that read the routing keys (the others never open the file)."""


class RoutingKeysUnavailable(RuntimeError):
    """The router or the ingress cannot start without routing keys; the message says why and
    what to run."""


def routing_keys_for(roles: Collection[str], path: Path | None) -> RoutingKeys | None:
    """The routing keys in ``path`` if ``roles`` include the router or the ingress (None if
    they include neither: the file is not even opened).

    Raises :class:`RoutingKeysUnavailable` naming the remedy when no file is named, or it is
    missing, readable by others or malformed.
    """
    if not ROLES_WITH_KEYS & set(roles):
        return None
    make = (
        "`./fx up` makes <home>/credentials/routing-keys.json and passes it on; for processors "
        "run by hand, make one with `fxstream-service routing-keys FILE` (owner-only, a new "
        "random key) and pass the same file to every router and ingress"
    )
    if path is None:
        raise RoutingKeysUnavailable(
            "the router and the ingress need the service's routing keys: name the file with "
            f"--routing-keys FILE or ${ROUTING_KEYS_ENV}. {make}"
        )
    try:
        return read_routing_keys(path)
    except CredentialFileError as exc:
        if not path.exists():
            remedy = make
        elif "chmod" in str(exc):
            remedy = "its mode must let only its owner read it"
        else:
            remedy = (
                "restore it from the platform's credentials, or replace it with "
                "`fxstream-service routing-keys FILE` (results of tasks routed under the "
                "old keys will then be refused)"
            )
        raise RoutingKeysUnavailable(f"cannot read the routing keys: {exc}. {remedy}") from None
