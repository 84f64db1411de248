"""What aiokafka's Python protocol code costs per round at a number of endpoints.

The router and the ingress read their inputs with aiokafka (``from.user.*`` and
``from.ep.*`` by pattern, :mod:`fxstream.service.router_loop`). Two of its costs grow
with the partitions, whatever the traffic:

- a pattern subscription refreshes the metadata of *every* topic in the cluster every
  ``metadata_max_age_ms`` (2 s): each endpoint adds two topics of 4 partitions
  (``tasks.ep.<E>``, ``from.ep.<E>``), so the response, decoded and folded into the
  client's cluster view in Python, grows with the endpoints, in the router as in the
  ingress;
- aiokafka has no incremental fetch sessions (KIP-227): every fetch request names every
  assigned partition, and every response lists them all back, so each fetch round of the
  ingress encodes and decodes 4 entries per endpoint.

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

__all__ = ["ENDPOINT_PARTITIONS", "client_costs"]

ENDPOINT_PARTITIONS = 4
"""Partitions of each of an endpoint's two topics (the catalogue's)."""

# An id as long as the real ones (a UUID).
_ID = "{:08d}-0000-4000-8000-000000000000"


def _topic(kind: str, n: int, prefix: str) -> str:
    return f"{prefix}.{kind}.{_ID.format(n)}"


def client_costs(
    endpoints: int,
    *,
    prefix: str = "fxstream",
    partitions: int = ENDPOINT_PARTITIONS,
    repeats: int = 3,
) -> dict[str, Any]:
    """Seconds aiokafka takes, per round, for ``endpoints`` endpoints' topics (the
    median of ``repeats``: the machine is shared).

    ``metadata_s``: decoding a full metadata response and folding it into a
    ``ClusterMetadata`` (router and ingress, every refresh); ``fetch_round_s``: encoding
    a fetch request for every ``from.ep`` partition and decoding the empty response
    (ingress, every fetch).
    """
    rounds = [_one_round(endpoints, prefix, partitions) for _ in range(max(1, repeats))]
    figures = dict(rounds[0])
    for key in ("metadata_s", "fetch_round_s"):
        figures[key] = sorted(r[key] for r in rounds)[len(rounds) // 2]
    return figures


def _one_round(endpoints: int, prefix: str, partitions: int) -> dict[str, Any]:
    from_ep = [_topic("from.ep", n, prefix) for n in range(endpoints)]
    every = [*from_ep, *(_topic("tasks.ep", n, prefix) for n in range(endpoints))]
    metadata = MetadataResponse_v5(
        throttle_time_ms=0,
        brokers=[(1, "127.0.0.1", 9092, None)],
        cluster_id="bench",
        controller_id=1,
        topics=[
            (0, name, False, [(0, p, 1, [1], [1], []) for p in range(partitions)]) for name in every
        ],
    )
    raw_metadata = metadata.encode()
    started = time.perf_counter()
    decoded = MetadataResponse_v5.decode(io.BytesIO(raw_metadata))
    cluster = ClusterMetadata(metadata_max_age_ms=2_000)
    cluster.need_all_topic_metadata = True
    cluster.update_metadata(decoded)
    metadata_s = time.perf_counter() - started

    wanted = [(name, [(p, 100, 1_048_576) for p in range(partitions)]) for name in from_ep]
    response = FetchResponse_v11(
        0,
        0,
        0,
        [(name, [(p, 0, 100, 100, 0, [], -1, b"") for p in range(partitions)]) for name in from_ep],
    )
    raw_response = response.encode()
    started = time.perf_counter()
    request = FetchRequest(500, 1, 52_428_800, 1, wanted).build(FetchRequest_v11).encode()
    FetchResponse_v11.decode(io.BytesIO(raw_response))
    fetch_s = time.perf_counter() - started
    return {
        "endpoints": endpoints,
        "cluster_partitions": len(every) * partitions,
        "ingress_partitions": len(from_ep) * partitions,
        "metadata_bytes": len(raw_metadata),
        "metadata_s": round(metadata_s, 3),
        "fetch_request_bytes": len(request),
        "fetch_round_s": round(fetch_s, 3),
    }
