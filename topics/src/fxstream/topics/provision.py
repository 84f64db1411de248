"""Idempotent topic provisioning through the Kafka Admin API, with drift detection."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ClusterMetadata, ConfigResource, NewTopic

from fxstream.topics.catalogue import Catalogue, TopicSpec

__all__ = ["Drift", "ProvisionError", "ProvisionReport", "ensure_topics"]


class ProvisionError(RuntimeError):
    """Topics could not be created or inspected (the broker refused or did not answer)."""


@dataclass(frozen=True)
class Drift:
    """A topic that exists with a setting other than the catalogue's."""

    topic: str
    setting: str
    expected: str
    actual: str

    def __str__(self) -> str:
        return f"{self.topic}: {self.setting} is {self.actual}, catalogue says {self.expected}"


@dataclass
class ProvisionReport:
    """What ``ensure_topics`` did: topics created, found as specified, and found drifted."""

    created: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    drifted: list[Drift] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every topic exists exactly as the catalogue says."""
        return not self.drifted and not self.missing


def _expected(catalogue: Catalogue, spec: TopicSpec) -> dict[str, str]:
    return spec.kafka_configs(min_insync_replicas=catalogue.min_insync_replicas)


def _wait_visible(admin: AdminClient, names: list[str], timeout_s: float) -> ClusterMetadata:
    # A created topic reaches the brokers' metadata caches a moment after CreateTopics
    # returns; checking it before then would misreport it as missing.
    deadline = time.monotonic() + timeout_s
    while True:
        metadata = admin.list_topics(timeout=timeout_s)
        pending = [
            n for n in names if n not in metadata.topics or not metadata.topics[n].partitions
        ]
        if not pending:
            return metadata
        if time.monotonic() > deadline:
            raise ProvisionError(f"created topics not visible after {timeout_s}s: {pending}")
        time.sleep(0.05)


def ensure_topics(
    admin: AdminClient,
    catalogue: Catalogue,
    topics: Mapping[str, TopicSpec] | None = None,
    *,
    create: bool = True,
    timeout_s: float = 30.0,
) -> ProvisionReport:
    """Create the topics that are missing and report the ones that differ from the catalogue.

    ``topics`` maps full names to specs and defaults to the catalogue's static
    topics. Existing topics are never altered: a difference in partitions,
    replication factor or a managed config is reported as :class:`Drift` so an
    operator decides. Running it again is a no-op. With ``create=False`` it only
    checks, listing absent topics in ``missing``.
    """
    wanted = dict(catalogue.static_topics() if topics is None else topics)
    report = ProvisionReport()
    try:
        metadata = admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise ProvisionError(f"cannot list topics: {exc}") from exc

    missing = [name for name in wanted if name not in metadata.topics]
    if missing and not create:
        report.missing.extend(missing)
    elif missing:
        new_topics = [
            NewTopic(
                name,
                num_partitions=wanted[name].partitions,
                replication_factor=catalogue.replication_factor,
                config=_expected(catalogue, wanted[name]),
            )
            for name in missing
        ]
        futures = admin.create_topics(new_topics, request_timeout=timeout_s)
        for name, future in futures.items():
            try:
                future.result(timeout=timeout_s)
                report.created.append(name)
            except KafkaException as exc:
                error = exc.args[0]
                # Someone else created it between our list and our create: check it as existing.
                if (
                    isinstance(error, KafkaError)
                    and error.code() == KafkaError.TOPIC_ALREADY_EXISTS
                ):
                    continue
                raise ProvisionError(f"cannot create topic {name}: {exc}") from exc
        metadata = _wait_visible(admin, missing, timeout_s)

    existing = [name for name in wanted if name in metadata.topics and name not in report.created]
    if not existing:
        return report
    resources = [ConfigResource(ConfigResource.Type.TOPIC, name) for name in existing]
    try:
        described = {
            resource.name: future.result(timeout=timeout_s)
            for resource, future in admin.describe_configs(
                resources, request_timeout=timeout_s
            ).items()
        }
    except KafkaException as exc:
        raise ProvisionError(f"cannot describe topic configs: {exc}") from exc

    for name in existing:
        spec = wanted[name]
        drifts: list[Drift] = []
        topic_meta = metadata.topics.get(name)
        if topic_meta is not None and topic_meta.partitions:
            partitions = len(topic_meta.partitions)
            if partitions != spec.partitions:
                drifts.append(Drift(name, "partitions", str(spec.partitions), str(partitions)))
            replicas = min(len(p.replicas) for p in topic_meta.partitions.values())
            if replicas != catalogue.replication_factor:
                drifts.append(
                    Drift(
                        name,
                        "replication.factor",
                        str(catalogue.replication_factor),
                        str(replicas),
                    )
                )
        actual_configs = described.get(name, {})
        for key, value in _expected(catalogue, spec).items():
            entry = actual_configs.get(key)
            actual = entry.value if entry is not None else "<unset>"
            if actual != value:
                drifts.append(Drift(name, key, value, str(actual)))
        if drifts:
            report.drifted.extend(drifts)
        else:
            report.unchanged.append(name)
    return report
