"""A 3-broker cluster platform with its services, for the cluster fault tests.

The cluster (3 KRaft brokers, replication 3, ``min.insync.replicas=2``), Redis,
the REST API, the stream processors and the local endpoint run as the real
processes ``./fx up --cluster`` starts, in a temporary home on free ports, and
are stopped by PID when the module's tests end. The endpoint's lease is
Kafka's shortest (6 s). The pieces come from the chaos bench
(:mod:`fxstream.ops.bench.chaos`), so the test and the bench kill and count the
same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fxstream.ops import Platform
from fxstream.ops.bench.chaos import ChaosCluster
from fxstream.ops.private import private_config
from tests.conftest import free_port_block

__all__ = ["chaos_cluster"]


@pytest.fixture(scope="module")
def chaos_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosCluster]:
    """A running cluster platform with services (about 30 s to start), stopped afterwards."""
    home: Path = tmp_path_factory.mktemp("cluster-faults")
    platform = Platform(private_config(home, cluster_base_port=free_port_block(6)))
    try:
        yield ChaosCluster.start(platform)
    finally:
        platform.down()
