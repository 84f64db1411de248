"""What aiokafka's Python protocol code costs the ingress per round at a number of endpoints.

The ingress reads every endpoint's ``from.ep.<E>`` with aiokafka
(:mod:`fxstream.service.router_loop`), subscribed to the explicit list of the endpoints
its registry view holds (:mod:`fxstream.service.subscription`). Two of its costs grow
with the endpoints, whatever the traffic:

- the metadata of the topics it reads (one ``from.ep`` partition per endpoint), decoded
  and folded into the client's cluster view in Python at each refresh (every 30 s, or
  when a leader moves). Before the explicit subscriptions, the router and the ingress
  subscribed by pattern and refreshed the metadata of *every* topic of the cluster every
  2 s (``tasks.ep`` and ``from.ep`` of every endpoint, 4 partitions each):
  ``pattern_metadata_s`` times that, for comparison;
- aiokafka has no incremental fetch sessions (KIP-227): every fetch request names every
  assigned partition, and every response lists them all back, so each fetch round of the
  ingress encodes and decodes one entry per endpoint (four before ``from.ep`` had one
  partition).

:func:`client_costs` builds those messages for ``endpoints`` endpoints, in this process
and without a broker, and times aiokafka encoding and decoding them: a measured lower
bound of the CPU seconds per round (the broker's own work, the fetcher's bookkeeping per
partition and TLS come on top).
"""

from __future__ import annotations

import io
import time
from typing import Any

from aiokafka.cluster import ClusterMetadata  # type: ignore[import-untyped]
from aiokafka.protocol.fetch import (  # type: ignore[import-untyped]
    FetchRequest,
    FetchRequest_v11,
    FetchResponse_v11,
)
from aiokafka.protocol.metadata import MetadataResponse_v5  # type: ignore[import-untyped]

from fxstream.topics import Catalogue

__all__ = ["FROM_EP_PARTITIONS", "QUEUE_PARTITIONS", "client_costs"]

_CATALOGUE = Catalogue()
FROM_EP_PARTITIONS = _CATALOGUE.spec("from.ep.{endpoint_id}").partitions
"""Partitions of an endpoint's ``from.ep`` (the catalogue's)."""
QUEUE_PARTITIONS = _CATALOGUE.spec("tasks.ep.{endpoint_id}").partitions
"""Partitions of an endpoint's ``tasks.ep`` (the catalogue's)."""
# What every endpoint's two topics had when the router and the ingress read by pattern.
_PATTERN_PARTITIONS = 4

# An id as long as the real ones (a UUID).
_ID = "{:08d}-0000-4000-8000-000000000000"


def _topic(kind: str, n: int, prefix: str) -> str:
    return f"{prefix}.{kind}.{_ID.format(n)}"


def client_costs(endpoints: int, *, prefix: str = "fxstream", repeats: int = 3) -> dict[str, Any]:
    """Seconds aiokafka takes, per round, for ``endpoints`` endpoints' topics (the
    median of ``repeats``: the machine is shared).

    ``metadata_s``: decoding the metadata of the ingress's ``from.ep`` topics and folding
    it into a ``ClusterMetadata`` (every refresh); ``pattern_metadata_s``: the same for
    every topic of the cluster at 4 partitions each (what each pattern-subscribed reader
    paid every 2 s before); ``fetch_round_s``: encoding a fetch request for every
    ``from.ep`` partition and decoding the empty response (every fetch).
    """
    rounds = [_one_round(endpoints, prefix) for _ in range(max(1, repeats))]
    figures = dict(rounds[0])
    for key in ("metadata_s", "pattern_metadata_s", "fetch_round_s"):
        figures[key] = sorted(r[key] for r in rounds)[len(rounds) // 2]
    return figures


def _metadata(topics: list[str], partitions: int) -> tuple[int, float]:
    """The encoded size of a metadata response for ``topics`` and the seconds aiokafka
    takes to decode it and fold it into its cluster view."""
    metadata = MetadataResponse_v5(
        throttle_time_ms=0,
        brokers=[(1, "127.0.0.1", 9092, None)],
        cluster_id="bench",
        controller_id=1,
        topics=[
            (0, name, False, [(0, p, 1, [1], [1], []) for p in range(partitions)])
            for name in topics
        ],
    )
    raw = metadata.encode()
    started = time.perf_counter()
    decoded = MetadataResponse_v5.decode(io.BytesIO(raw))
    cluster = ClusterMetadata(metadata_max_age_ms=30_000)
    cluster.update_metadata(decoded)
    return len(raw), time.perf_counter() - started


def _one_round(endpoints: int, prefix: str) -> dict[str, Any]:
    from_ep = [_topic("from.ep", n, prefix) for n in range(endpoints)]
    every = [*from_ep, *(_topic("tasks.ep", n, prefix) for n in range(endpoints))]
    metadata_bytes, metadata_s = _metadata(from_ep, FROM_EP_PARTITIONS)
    pattern_metadata_bytes, pattern_metadata_s = _metadata(every, _PATTERN_PARTITIONS)

    partitions = range(FROM_EP_PARTITIONS)
    wanted = [(name, [(p, 100, 1_048_576) for p in partitions]) for name in from_ep]
    response = FetchResponse_v11(
        0,
        0,
        0,
        [(name, [(p, 0, 100, 100, 0, [], -1, b"") for p in partitions]) for name in from_ep],
    )
    raw_response = response.encode()
    started = time.perf_counter()
    request = FetchRequest(500, 1, 52_428_800, 1, wanted).build(FetchRequest_v11).encode()
    FetchResponse_v11.decode(io.BytesIO(raw_response))
    fetch_s = time.perf_counter() - started
    return {
        "endpoints": endpoints,
        "cluster_partitions": endpoints * (FROM_EP_PARTITIONS + QUEUE_PARTITIONS),
        "ingress_partitions": len(from_ep) * FROM_EP_PARTITIONS,
        "metadata_bytes": metadata_bytes,
        "metadata_s": round(metadata_s, 6),
        "pattern_metadata_bytes": pattern_metadata_bytes,
        "pattern_metadata_s": round(pattern_metadata_s, 6),
        "fetch_request_bytes": len(request),
        "fetch_round_s": round(fetch_s, 6),
    }
