"""Which endpoints share this client's node: the node-local tier's choice of store.

A client and an endpoint whose workers run on the same machine, as the same user, can
pass large arguments and results through shared memory instead of Redis
(:mod:`fxstream.connectors.node_local`). The endpoint's agents say so in their
heartbeats (``Heartbeat.node_key``); the service shows it in the endpoint's status
(``node_key``: the key every live agent of the endpoint advertises, else ''), and
:class:`EndpointNodes` asks for it: at the first task to an endpoint (waiting at most
``first_wait_s``, so a slow service delays that task by no more), then again in the
background when the answer is older than ``ttl_s``. Until an answer arrives, and after
a failed look-up, the endpoint counts as remote (the usual store): never a wrong guess
towards shared memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final

__all__ = ["DEFAULT_NODE_TTL_S", "EndpointNodes"]

log = logging.getLogger(__name__)

DEFAULT_NODE_TTL_S: Final = 30.0
"""How long an endpoint's node key is used before it is asked again (in the background)."""

_FIRST_WAIT_S: Final = 1.0
_MAX_ENDPOINTS: Final = 4_096


class EndpointNodes:
    """A cache of endpoints' node keys, filled by ``fetch(endpoint_id) -> key`` ('' if none).

    Thread-safe; each look-up runs on its own daemon thread, one at a time per endpoint.
    """

    def __init__(
        self,
        fetch: Callable[[str], str],
        *,
        ttl_s: float = DEFAULT_NODE_TTL_S,
        first_wait_s: float = _FIRST_WAIT_S,
    ) -> None:
        self._fetch = fetch
        self._ttl_s = ttl_s
        self._first_wait_s = first_wait_s
        self._lock = threading.Lock()
        self._known: dict[str, tuple[str, float]] = {}
        self._asking: dict[str, threading.Event] = {}

    def key_of(self, endpoint_id: str) -> str:
        """The endpoint's node key as last seen ('' when remote, unknown or unanswered)."""
        now = time.monotonic()
        with self._lock:
            known = self._known.get(endpoint_id)
            asking = self._asking.get(endpoint_id)
            if asking is None and (known is None or now - known[1] > self._ttl_s):
                asking = self._asking[endpoint_id] = threading.Event()
                threading.Thread(
                    target=self._ask,
                    args=(endpoint_id, asking),
                    name="fxstream-endpoint-node",
                    daemon=True,
                ).start()
        if known is None and asking is not None:
            asking.wait(self._first_wait_s)
            with self._lock:
                known = self._known.get(endpoint_id)
        return "" if known is None else known[0]

    def _ask(self, endpoint_id: str, done: threading.Event) -> None:
        try:
            key = self._fetch(endpoint_id)
        except Exception as exc:  # the service unreachable, the endpoint not ours: remote
            log.debug("node key of endpoint %s not known: %s", endpoint_id, exc)
            key = ""
        with self._lock:
            if len(self._known) >= _MAX_ENDPOINTS and endpoint_id not in self._known:
                self._known.pop(next(iter(self._known)))
            self._known[endpoint_id] = (key, time.monotonic())
            self._asking.pop(endpoint_id, None)
        done.set()
