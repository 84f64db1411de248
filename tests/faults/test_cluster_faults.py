"""In cluster mode, a broker is SIGKILLed mid-flight and stays down: the one leading the task
topics, or the one coordinating the agent's consumer group (the agent then loses its
partitions with its session and is assigned them again).

The two remaining brokers (replication 3, ``min.insync.replicas=2``) carry on:
every future completes exactly once with its own value, and the user's results
topic holds one committed result per task (a second one would have been a
duplicate the SDK had to suppress, which the agent's transactions must prevent
here: no agent was killed). Then the broker is restarted and a further batch
completes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from confluent_kafka import Consumer, TopicPartition

from fxstream.ops.bench.chaos import (
    ChaosCluster,
    ChaosLedger,
    chaos_task,
    read_result_counts,
    read_topic,
)
from fxstream.sdk import Executor
from fxstream.topics import RecordDecodeError, TaskCancel, TaskDispatch, decode
from fxstream.topics.acls import endpoint_group
from tests.faults.cluster_stack import chaos_cluster

__all__ = ["chaos_cluster"]

pytestmark = [pytest.mark.faults, pytest.mark.cluster]

TASKS = 3_000
AFTER_RESTART = 500
# Every 50th task sleeps, so tasks are running when the broker dies.
SLOW_EVERY = 50
SLOW_S = 0.02
SETTLE_S = 120.0


@contextmanager
def _executor(cluster: ChaosCluster) -> Iterator[Executor]:
    client = cluster.client()
    executor = Executor(endpoint_id=cluster.endpoint_id, client=client, max_retries=3)
    try:
        yield executor
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        client.close()


def _submit(executor: Executor, ledger: ChaosLedger, start: int, count: int) -> None:
    for index in range(start, start + count):
        sleep_s = SLOW_S if index % SLOW_EVERY == 0 else 0.0
        ledger.add(index, executor.submit(chaos_task, index, sleep_s))


def _wait_settled(ledger: ChaosLedger, timeout_s: float = SETTLE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while ledger.outstanding and time.monotonic() < deadline:
        time.sleep(0.2)


def _where_outstanding(cluster: ChaosCluster, ledger: ChaosLedger, shown: int = 3) -> str:
    """What the service says of the first few unresolved tasks (for a failure's message)."""
    ids = ledger.outstanding_task_ids()
    lines = [f"{sum(1 for i in ids if i is None)} of them never sent"]
    client = cluster.client()
    try:
        for task_id in [i for i in ids if i is not None][:shown]:
            try:
                task = client.get_task(task_id)
                events = [event.get("state") for event in task.get("events", [])]
                lines.append(f"{task_id}: state {task.get('state')}, events {events}")
            except Exception as error:  # a diagnostic: say what failed, whatever it is
                lines.append(f"{task_id}: {type(error).__name__}: {error}")
    finally:
        client.close()
    lines.append(_queue_story(cluster, {i for i in ids if i is not None}, shown))
    return "; ".join(lines)


def _queue_story(cluster: ChaosCluster, task_ids: set[str], shown: int) -> str:
    """Where the endpoint queue holds the dispatches and cancels of ``task_ids`` (read
    uncommitted and committed), and what the agent's group committed on each partition."""
    topic = cluster.connection.catalogue().endpoint_queue(cluster.endpoint_id)
    story: list[str] = []
    for isolation in ("read_uncommitted", "read_committed"):
        try:
            found: dict[str, list[tuple[int, int]]] = {}
            for message in read_topic(cluster.kafka, topic, isolation=isolation, timeout_s=30):
                value = message.value() or b""
                for kind, schema in (("dispatch", TaskDispatch), ("cancel", TaskCancel)):
                    try:
                        task_id = decode(value, schema).task_id  # type: ignore[attr-defined]
                    except RecordDecodeError:
                        continue
                    if task_id in task_ids:
                        found.setdefault(kind, []).append(
                            (message.partition() or 0, message.offset() or 0)
                        )
                    break
            counts = {kind: len(at) for kind, at in found.items()}
            where = {kind: sorted(at)[:shown] for kind, at in found.items()}
            story.append(f"{isolation}: {counts} of the outstanding, first at {where}")
        except Exception as error:  # a diagnostic: say what failed, whatever it is
            story.append(f"{isolation}: {type(error).__name__}: {error}")
    group = Consumer(
        {
            **cluster.kafka.confluent(),
            "group.id": endpoint_group(cluster.endpoint_id),
            "enable.auto.commit": False,
            "log_level": 0,
        }
    )
    try:
        partitions = group.list_topics(topic, timeout=10).topics[topic].partitions
        agent = group.committed([TopicPartition(topic, p) for p in partitions], timeout=10)
        story.append(
            "agent committed " + str({tp.partition: (tp.offset, tp.metadata) for tp in agent})
        )
    except Exception as error:  # a diagnostic: say what failed, whatever it is
        story.append(f"agent committed: {type(error).__name__}: {error}")
    finally:
        group.close()
    return "; ".join(story)


def _assert_exactly_once(cluster: ChaosCluster, ledger: ChaosLedger, total: int) -> None:
    assert ledger.submitted == total
    assert ledger.outstanding == 0, (
        f"{ledger.outstanding} tasks never completed ({_where_outstanding(cluster, ledger)})"
    )
    assert ledger.failed == 0, f"failed tasks: {dict(ledger.errors)}"
    assert ledger.wrong_values == 0
    assert ledger.resolved_more_than_once == 0
    assert ledger.completed == total
    counts = read_result_counts(cluster, ledger.task_ids())
    assert len(counts) == total, f"{total - len(counts)} tasks have no committed result"
    # A leader change can move the agent's group coordinator and rebalance the agent, and
    # a transaction can fail and be retried: still exactly one committed result per task.
    several = {task: n for task, n in counts.items() if n > 1}
    assert not several, (
        f"{len(several)} tasks have more than one committed result on results.<user>: {several}"
    )


@pytest.mark.parametrize("victim_of", ["task-leader", "agent-coordinator"])
def test_leader_broker_killed_and_not_restarted_then_restarted(
    chaos_cluster: ChaosCluster, victim_of: str
) -> None:
    """``task-leader`` kills the broker leading the most partitions of the task topics;
    ``agent-coordinator`` kills the one coordinating the agent's consumer group, so the
    agent loses its partitions with its session and is assigned them again mid-flight
    (the loss of 2026-11-29: after regaining its partitions the agent read on past 443
    dispatches it had taken before, their answers dropped, and never ran them). When one
    broker is both, the two runs kill the same one."""
    cluster = chaos_cluster
    assert cluster.under_replicated() == 0
    ledger = ChaosLedger()
    with _executor(cluster) as executor:
        _submit(executor, ledger, 0, TASKS)
        deadline = time.monotonic() + 60
        while ledger.done < TASKS // 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert 0 < ledger.done < TASKS, "the kill must land while tasks are in flight"

        if victim_of == "task-leader":
            victim = cluster.broker_leading(cluster.task_topics)
        else:
            victim = cluster.group_coordinator(endpoint_group(cluster.endpoint_id))
        agent_log = cluster.agent.log_file
        logged_before = agent_log.stat().st_size
        assert cluster.kill_broker(victim)
        _wait_settled(ledger)
        _assert_exactly_once(cluster, ledger, TASKS)
        if victim_of == "agent-coordinator":
            with agent_log.open("rb") as log:
                log.seek(logged_before)
                since = log.read().decode(errors="replace")
            assert "lost partitions" in since, (
                "the agent kept its session when its group coordinator died: this run did "
                "not stage the loss and regain of its partitions"
            )
        # The survivors took over every partition: none is led by the dead broker.
        leaders = cluster.partition_leaders(cluster.task_topics)
        assert victim.node_id not in leaders
        assert sum(leaders.values()) > 0

        cluster.restart_broker(victim)
        _submit(executor, ledger, TASKS, AFTER_RESTART)
        _wait_settled(ledger)
        _assert_exactly_once(cluster, ledger, TASKS + AFTER_RESTART)
    assert cluster.wait_fully_replicated(timeout_s=60)
