"""The 3-node KRaft cluster starts, elects leaders, and takes acks=all writes."""

from __future__ import annotations

import time

import psutil
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from fxstream.ops import Platform
from fxstream.ops.private import private_config
from tests.conftest import free_port_block

pytestmark = pytest.mark.cluster

# How long a broker may take to learn of a topic the controller created.
METADATA_S = 30.0


def test_three_node_cluster_replicates_and_stops_cleanly(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    home = tmp_path_factory.mktemp("cluster")
    platform = Platform(private_config(home, cluster_base_port=free_port_block(6)))
    try:
        connection = platform.up(cluster=True)
        assert connection.mode == "cluster"
        assert len(connection.bootstrap_servers.split(",")) == 3
        assert (connection.replication_factor, connection.min_insync_replicas) == (3, 2)

        kafka = platform.kafka(cluster=True)
        admin = AdminClient({**kafka.confluent(), "log_level": 2})
        cluster = admin.describe_cluster(request_timeout=10).result(timeout=15)
        assert {node.id for node in cluster.nodes} == {1, 2, 3}
        assert cluster.controller is not None

        topic = connection.catalogue().task_events
        # The controller has created the topic when `up` returns; the broker this client
        # asks may apply that metadata a moment later (seen on a loaded CI machine).
        deadline = time.monotonic() + METADATA_S
        partitions = admin.list_topics(topic, timeout=10).topics[topic].partitions
        while not partitions and time.monotonic() < deadline:
            time.sleep(0.2)
            partitions = admin.list_topics(topic, timeout=10).topics[topic].partitions
        assert partitions, f"{topic} has no partitions on the cluster after {METADATA_S:g} s"
        for partition in partitions.values():
            assert partition.leader in {1, 2, 3}
            assert sorted(partition.replicas) == [1, 2, 3]
            assert sorted(partition.isrs) == [1, 2, 3]

        delivered: list[str] = []
        producer = Producer(
            {
                **kafka.confluent(),
                "acks": "all",
                "enable.idempotence": True,
                "log_level": 2,
            }
        )
        for i in range(100):
            producer.produce(
                topic,
                key=str(i).encode(),
                value=b"x",
                on_delivery=lambda err, msg: delivered.append("ok" if err is None else str(err)),
            )
        assert producer.flush(30) == 0
        assert delivered == ["ok"] * 100

        status = platform.status()
        assert status.healthy, status.to_json()
        pids = [c.pid for c in status.components if c.pid is not None]
        assert len(pids) == 4
    finally:
        platform.down()
    assert not any(psutil.pid_exists(pid) for pid in pids)
    assert platform.running_mode() is None


def test_single_and_cluster_cannot_run_at_once_in_one_home(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from fxstream.ops import PlatformError

    home = tmp_path_factory.mktemp("modes")
    platform = Platform(private_config(home, cluster_base_port=free_port_block(6)))
    try:
        platform.up()
        with pytest.raises(PlatformError, match=r"stop it with \./fx down"):
            platform.up(cluster=True)
    finally:
        platform.down()
