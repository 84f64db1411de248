"""The ACL matrix: every principal tries every operation on every resource, against the broker.

Run on the session's single node (test_acl_matrix.py) and on the secure 3-node cluster
(test_transport.py): :func:`deployment` makes the principals and resources on a broker,
:func:`check_every_cell` runs the cells and asserts each.

The cells come from the one table (:mod:`fxstream.topics.acls`): for each principal (admin,
the service, two users, two endpoints, all made by :class:`AccountManager` as registration
makes them) and each resource of one deployment (every catalogue topic, including the other
user's and the other endpoint's, the groups and transactional ids of every role, the cluster),
the expected answer is what the table grants, evaluated as the broker evaluates ACLs
(:func:`~fxstream.topics.acls.is_allowed`); anything the table does not list must be refused.
Then the principal really does it (produce, fetch, metadata, create/delete/alter topics and
configs, join a group, commit offsets, commit offsets in a transaction, init a transaction,
open a transaction on a registry topic, create ACLs, set a SCRAM credential) and the broker's
answer must match, cell by cell. Destructive cells (deleting topics and groups) run only for
principals the table must refuse; the admin (super user) runs every non-destructive cell.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)

from fxstream.service.accounts import AccountManager
from fxstream.topics import Catalogue, KafkaConnection, ensure_topics
from fxstream.topics.acls import (
    SERVICE_GROUP_PREFIX,
    SERVICE_VIEW_GROUP,
    Grant,
    Operation,
    Resource,
    Role,
    endpoint_group,
    endpoint_transactional_prefix,
    every_acl,
    grants_for,
    is_allowed,
    user_group_prefix,
)

__all__ = ["Matrix", "check_every_cell", "deployment"]

TIMEOUT_S = 20.0
DENIED = {
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.GROUP_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
}


@dataclass(frozen=True)
class Actor:
    """A principal of the matrix: its role, its connection and what the table grants it."""

    label: str
    role: Role
    kafka: KafkaConnection
    grants: tuple[Grant, ...]
    # A topic it may read and a group it may use, for cells about something else.
    home_topic: str
    home_group: str
    home_txn: str

    @property
    def superuser(self) -> bool:
        return self.role is Role.ADMIN

    def allowed(self, resource: Resource, name: str, operation: Operation) -> bool:
        return self.superuser or is_allowed(self.grants, resource, name, operation)

    def cell(
        self,
        resource: Resource,
        name: str,
        action: str,
        operation: Operation,
        observed: bool | str,
    ) -> Cell:
        """The cell of ``action`` on ``name``: expected is whether the table grants
        ``operation`` on it."""
        expected = self.allowed(resource, name, operation)
        return Cell(self.label, resource, name, action, expected, observed)


@dataclass(frozen=True)
class Cell:
    """One principal x resource x operation, with the expected and the observed answer."""

    actor: str
    resource: Resource
    name: str
    action: str
    expected: bool
    observed: bool | str  # str: an answer that is neither an allow nor an authorization denial

    @property
    def ok(self) -> bool:
        return self.observed is self.expected

    def __str__(self) -> str:
        want = "allow" if self.expected else "deny"
        got = (
            self.observed
            if isinstance(self.observed, str)
            else ("allow" if self.observed else "deny")
        )
        return f"{self.actor}: {self.action} {self.resource} {self.name}: want {want}, got {got}"


def _code(exc: BaseException) -> int | None:
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return error.code() if isinstance(error, KafkaError) else None


def _answer(
    error: KafkaError | BaseException | None, allowed_errors: Sequence[int] = ()
) -> bool | str:
    """True (the broker let it through), False (it refused: authorization), or what else."""
    if error is None:
        return True
    code = error.code() if isinstance(error, KafkaError) else _code(error)
    if code in DENIED:
        return False
    if code in allowed_errors:
        return True
    return f"{type(error).__name__}: {error}"


def _quiet(kafka: KafkaConnection, **more: Any) -> dict[str, Any]:
    return {**kafka.confluent(), "log_level": 0, "error_cb": lambda _: None, **more}


@dataclass
class Matrix:
    """The deployment under test: its catalogue, its actors and its resources."""

    catalogue: Catalogue
    admin: AdminClient
    actors: list[Actor]
    topics: list[str]
    groups: list[str]
    txn_ids: list[str]


@contextmanager
def deployment(kafka: KafkaConnection) -> Iterator[Matrix]:
    """A deployment of its own on ``kafka`` (the admin's connection): topics, principals
    and resources under a fresh prefix, all removed at the end."""
    tag = uuid.uuid4().hex[:8]
    catalogue = Catalogue(prefix=f"acl{tag}.")
    assert kafka.secure, "the ACL matrix needs the secure platform"
    admin = AdminClient(_quiet(kafka))
    manager = AccountManager.connect(kafka, catalogue)
    ensure_topics(admin, catalogue)
    users, endpoints = [f"ua{tag}", f"ub{tag}"], [f"ea{tag}", f"eb{tag}"]
    service_username = f"fxstream-service-{tag}"
    service = manager.ensure_service_principal(service_username)
    made_users = [manager.create_user_principal(u) for u in users]
    made_endpoints = [manager.create_endpoint_principal(e) for e in endpoints]
    # Topics no role may use, made by the admin like the catalogue's others.
    extra = {
        catalogue.events(f"src{tag}"): catalogue.spec("events.{source}"),
        catalogue.stream(f"st{tag}"): catalogue.spec("streams.{stream}"),
    }
    ensure_topics(admin, catalogue, extra)

    service_group = f"{SERVICE_GROUP_PREFIX}-acl{tag}"
    actors = [
        Actor(
            "admin",
            Role.ADMIN,
            kafka,
            (),
            catalogue.users,
            f"acl-admin-{tag}",
            f"acl-admin-{tag}",
        ),
        Actor(
            "service",
            Role.SERVICE,
            service.connection(kafka),
            tuple(grants_for(Role.SERVICE, catalogue)),
            catalogue.task_state,
            service_group,
            f"{SERVICE_GROUP_PREFIX}-acl{tag}-router-0",
        ),
    ]
    for user, principal in zip(users, made_users, strict=True):
        actors.append(
            Actor(
                f"user {user}",
                Role.USER,
                principal.connection(kafka),
                tuple(grants_for(Role.USER, catalogue, user)),
                catalogue.results(user),
                user_group_prefix(user) + "sdk",
                user_group_prefix(user) + "txn",
            )
        )
    for endpoint, principal in zip(endpoints, made_endpoints, strict=True):
        actors.append(
            Actor(
                f"endpoint {endpoint}",
                Role.ENDPOINT,
                principal.connection(kafka),
                tuple(grants_for(Role.ENDPOINT, catalogue, endpoint)),
                catalogue.endpoint_queue(endpoint),
                endpoint_group(endpoint),
                endpoint_transactional_prefix(endpoint) + "host.agent",
            )
        )
    topics = sorted(
        [*catalogue.static_topics(), *extra]
        + [catalogue.from_user(u) for u in users]
        + [catalogue.results(u) for u in users]
        + [catalogue.endpoint_queue(e) for e in endpoints]
        + [catalogue.from_endpoint(e) for e in endpoints]
    )
    # One record in every topic, so a fetch that is allowed has something to return.
    producer = Producer(_quiet(kafka, acks="all"))
    for topic in topics:
        producer.produce(topic, key=b"k", value=b"seed", partition=0)
    assert producer.flush(TIMEOUT_S) == 0
    groups = [a.home_group for a in actors] + [SERVICE_VIEW_GROUP]
    # The broker's first group makes its offsets topic: done here, not mid-matrix.
    warm = AdminClient(_quiet(kafka))
    request = ConsumerGroupTopicPartitions(f"acl-warm-{tag}", [TopicPartition(topics[0], 0, 0)])
    warm.alter_consumer_group_offsets([request])[f"acl-warm-{tag}"].result(timeout=60)
    txn_ids = [a.home_txn for a in actors]

    def cleanup() -> None:
        for user in users:
            manager.delete_user_principal(user)
        for endpoint in endpoints:
            manager.delete_endpoint_principal(endpoint)
        manager.delete_service_principal(service_username)
        rest = [*catalogue.static_topics(), *extra]
        for future in admin.delete_topics(rest, operation_timeout=30).values():
            future.result(timeout=30)

    try:
        yield Matrix(catalogue, admin, actors, topics, groups, txn_ids)
    finally:
        cleanup()


# --- the operations ------------------------------------------------------------------------


def _per_future(
    futures: dict[Any, Future[Any]], allowed_errors: Sequence[int] = ()
) -> dict[Any, bool | str]:
    answers: dict[Any, bool | str] = {}
    for key, future in futures.items():
        try:
            future.result(timeout=TIMEOUT_S)
            answers[key] = True
        except KafkaException as exc:
            answers[key] = _answer(exc, allowed_errors)
    return answers


def topic_admin_cells(m: Matrix, actor: Actor) -> list[Cell]:
    """Describe, create, alter, configure (and, where it must be refused, delete) topics."""
    admin = AdminClient(_quiet(actor.kafka))
    cells: list[Cell] = []

    def add(name: str, action: str, op: Operation, observed: bool | str) -> None:
        cells.append(actor.cell(Resource.TOPIC, name, action, op, observed))

    for topic in m.topics:
        described = admin.list_topics(topic=topic, timeout=TIMEOUT_S).topics[topic]
        add(topic, "describe (metadata)", Operation.DESCRIBE, _answer(described.error))
    created = admin.create_topics(
        [NewTopic(t, num_partitions=1, replication_factor=1) for t in m.topics],
        validate_only=True,
        request_timeout=TIMEOUT_S,
    )
    for t, answer in _per_future(created, [KafkaError.TOPIC_ALREADY_EXISTS]).items():
        add(t, "create", Operation.CREATE, answer)
    partitions = admin.create_partitions(
        [NewPartitions(t, 64) for t in m.topics], validate_only=True, request_timeout=TIMEOUT_S
    )
    for t, answer in _per_future(partitions).items():
        add(t, "add partitions", Operation.ALTER, answer)
    resources = [ConfigResource(ConfigResource.Type.TOPIC, t) for t in m.topics]
    for r, answer in _per_future(
        admin.describe_configs(resources, request_timeout=TIMEOUT_S)
    ).items():
        add(r.name, "describe configs", Operation.DESCRIBE_CONFIGS, answer)
    altering = [
        ConfigResource(
            ConfigResource.Type.TOPIC,
            t,
            incremental_configs=[
                ConfigEntry("retention.ms", "60000", incremental_operation=AlterConfigOpType.SET)
            ],
        )
        for t in m.topics
    ]
    altered = admin.incremental_alter_configs(
        altering, validate_only=True, request_timeout=TIMEOUT_S
    )
    for r, answer in _per_future(altered).items():
        add(r.name, "alter configs", Operation.ALTER_CONFIGS, answer)
    if not actor.superuser:
        refused = [t for t in m.topics if not actor.allowed(Resource.TOPIC, t, Operation.DELETE)]
        assert refused == m.topics, "the table grants no role DELETE on a topic"
        deleted = admin.delete_topics(
            refused, operation_timeout=TIMEOUT_S, request_timeout=TIMEOUT_S
        )
        for t, answer in _per_future(deleted).items():
            add(t, "delete", Operation.DELETE, answer)
    return cells


def produce_cells(m: Matrix, actor: Actor) -> list[Cell]:
    """Produce one record to every topic (not idempotent: WRITE alone decides)."""
    producer = Producer(_quiet(actor.kafka, acks="all", **{"message.timeout.ms": 15_000}))
    answers: dict[str, bool | str] = {}

    def report(error: KafkaError | None, message: Any) -> None:
        answers[message.topic()] = _answer(error)

    for topic in m.topics:
        producer.produce(topic, key=b"matrix", value=actor.label.encode(), on_delivery=report)
    producer.flush(TIMEOUT_S + 5)
    return [
        actor.cell(
            Resource.TOPIC, t, "produce", Operation.WRITE, answers.get(t, "no delivery report")
        )
        for t in m.topics
    ]


def fetch_cells(m: Matrix, actor: Actor) -> list[Cell]:
    """Subscribe to every topic in the actor's own group and fetch from the beginning.

    A subscribed topic the actor may not describe is reported by the client as unavailable
    (authorization failed); one it may describe but not read fails its fetches.
    """
    consumer = Consumer(
        _quiet(
            actor.kafka,
            **{
                "group.id": actor.home_group,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
            },
        )
    )
    answers: dict[str, bool | str] = {}
    try:
        consumer.subscribe(m.topics)
        deadline = time.monotonic() + TIMEOUT_S
        while len(answers) < len(m.topics) and time.monotonic() < deadline:
            message = consumer.poll(0.2)
            topic = None if message is None else message.topic()
            if message is None or topic is None or topic in answers:
                continue
            answers[topic] = _answer(message.error())
    finally:
        consumer.close()
    return [
        actor.cell(
            Resource.TOPIC, t, "fetch", Operation.READ, answers.get(t, "no record and no error")
        )
        for t in m.topics
    ]


def join_cell(actor: Actor, group: str) -> Cell:
    """Join ``group`` subscribed to a topic the actor may read."""
    consumer = Consumer(
        _quiet(
            actor.kafka,
            **{"group.id": group, "enable.auto.commit": False, "session.timeout.ms": 6000},
        )
    )
    assigned: list[bool] = []
    observed: bool | str = "no assignment and no error"
    try:
        consumer.subscribe([actor.home_topic], on_assign=lambda c, p: assigned.append(True))
        deadline = time.monotonic() + TIMEOUT_S
        while not assigned and time.monotonic() < deadline:
            message = consumer.poll(0.2)
            error = None if message is None else message.error()
            if error is not None and error.code() != KafkaError._PARTITION_EOF:
                observed = _answer(error)
                break
        if assigned:
            observed = True
    finally:
        consumer.close()
    return actor.cell(Resource.GROUP, group, "join", Operation.READ, observed)


def commit_cell(actor: Actor, group: str) -> Cell:
    """Commit (set) an offset in ``group`` without joining it, as a standalone consumer or an
    operator's tool does (OffsetCommit with no generation: READ on the group and the topic)."""
    admin = AdminClient(_quiet(actor.kafka))
    request = ConsumerGroupTopicPartitions(group, [TopicPartition(actor.home_topic, 0, 1)])
    observed: bool | str
    try:
        answer = admin.alter_consumer_group_offsets([request], request_timeout=TIMEOUT_S)
        result = answer[group].result(timeout=TIMEOUT_S)
        errors = [tp.error for tp in result.topic_partitions or [] if tp.error is not None]
        observed = _answer(errors[0] if errors else None)
    except KafkaException as exc:
        observed = _answer(exc)
    return actor.cell(Resource.GROUP, group, "commit offsets", Operation.READ, observed)


def group_admin_cells(m: Matrix, actor: Actor) -> list[Cell]:
    """Describe every group (and delete them, where that must be refused)."""
    admin = AdminClient(_quiet(actor.kafka))
    cells = []
    answers: dict[Any, bool | str] = {}
    for _ in range(10):
        described = admin.describe_consumer_groups(m.groups, request_timeout=TIMEOUT_S)
        answers = _per_future(described, [KafkaError.GROUP_ID_NOT_FOUND])
        # A group's coordinator moves while the offsets topic settles: ask again.
        if not any(
            "NOT_COORDINATOR" in str(a) or "COORDINATOR_" in str(a) for a in answers.values()
        ):
            break
        time.sleep(0.5)
    for g, answer in answers.items():
        cells.append(actor.cell(Resource.GROUP, g, "describe", Operation.DESCRIBE, answer))
    if not actor.superuser:
        deleted = admin.delete_consumer_groups(m.groups, request_timeout=TIMEOUT_S)
        for g, answer in _per_future(deleted).items():
            cells.append(actor.cell(Resource.GROUP, g, "delete", Operation.DELETE, answer))
    return cells


def _transactional(actor: Actor, txn_id: str) -> Producer:
    return Producer(
        _quiet(actor.kafka, **{"transactional.id": txn_id, "transaction.timeout.ms": 10_000})
    )


def init_txn_cell(actor: Actor, txn_id: str) -> Cell:
    """Initialise a transactional producer with ``txn_id``."""
    try:
        _transactional(actor, txn_id).init_transactions(TIMEOUT_S)
        observed: bool | str = True
    except KafkaException as exc:
        observed = _answer(exc)
    return actor.cell(
        Resource.TRANSACTIONAL_ID, txn_id, "init transactions", Operation.WRITE, observed
    )


def txn_offsets_cell(actor: Actor, group: str) -> Cell:
    """In the actor's own transaction, commit an offset of its readable topic in ``group``."""
    producer = _transactional(actor, actor.home_txn)
    consumer = Consumer(_quiet(actor.kafka, **{"group.id": group, "enable.auto.commit": False}))
    try:
        producer.init_transactions(TIMEOUT_S)
        producer.begin_transaction()
        producer.send_offsets_to_transaction(
            [TopicPartition(actor.home_topic, 0, 1)],
            consumer.consumer_group_metadata(),
            TIMEOUT_S,
        )
        producer.commit_transaction(TIMEOUT_S)
        observed: bool | str = True
    except KafkaException as exc:
        observed = _answer(exc)
    finally:
        consumer.close()
    return actor.cell(
        Resource.GROUP, group, "commit offsets in a transaction", Operation.READ, observed
    )


def registry_txn_cell(m: Matrix, actor: Actor) -> Cell:
    """Open a transaction (the actor's own id) that writes to the users registry topic."""
    producer = _transactional(actor, actor.home_txn)
    topic = m.catalogue.users
    delivery: list[KafkaError | None] = []
    observed: bool | str
    try:
        producer.init_transactions(TIMEOUT_S)
        producer.begin_transaction()
        producer.produce(
            topic, key=b"matrix", value=b"matrix", on_delivery=lambda e, _: delivery.append(e)
        )
        producer.commit_transaction(TIMEOUT_S)
        observed = True
    except KafkaException as exc:
        # A refused partition fails the record; the commit then reports only "failed delivery".
        refused = [e for e in delivery if e is not None]
        observed = _answer(refused[0] if refused else exc)
    return actor.cell(Resource.TOPIC, topic, "transaction writing to", Operation.WRITE, observed)


def idempotent_cell(actor: Actor) -> Cell:
    """An idempotent producer (what every fxstream producer is) writing where it may.

    Kafka lets a principal with WRITE on any topic produce idempotently (KIP-679), so the
    table grants no IDEMPOTENT_WRITE; every role may write somewhere.
    """
    writable = next(
        (
            g.name
            for g in actor.grants
            if g.operation is Operation.WRITE
            and g.resource is Resource.TOPIC
            and g.pattern.value == "LITERAL"
        ),
        None,
    )
    producer = Producer(_quiet(actor.kafka, acks="all", **{"enable.idempotence": True}))
    answers: list[bool | str] = []
    topic = writable or actor.home_topic
    producer.produce(
        topic,
        key=b"matrix",
        value=b"idempotent",
        on_delivery=lambda e, _: answers.append(_answer(e)),
    )
    producer.flush(TIMEOUT_S)
    expected = actor.superuser or any(g.operation is Operation.WRITE for g in actor.grants)
    return Cell(
        actor.label,
        Resource.CLUSTER,
        "kafka-cluster",
        f"idempotent produce to {topic}",
        expected,
        answers[0] if answers else "no delivery report",
    )


def cluster_cells(m: Matrix, actor: Actor) -> list[Cell]:
    """ACLs, SCRAM credentials, broker configs and creating a new topic: the cluster's."""
    admin = AdminClient(_quiet(actor.kafka))
    cells: list[Cell] = []

    def add(action: str, op: Operation, observed: bool | str) -> None:
        expected = actor.allowed(Resource.CLUSTER, "kafka-cluster", op)
        cells.append(
            Cell(actor.label, Resource.CLUSTER, "kafka-cluster", action, expected, observed)
        )

    def one(futures: Any, allowed_errors: Sequence[int] = ()) -> bool | str:
        if isinstance(futures, Future):
            futures = {"only": futures}
        return next(iter(_per_future(futures, allowed_errors).values()))

    everyone = every_acl()
    # The matrix's principals have ACLs, so an allowed DescribeAcls lists some; a refused
    # one comes back as an error or (as confluent-kafka reports it) as an empty list.
    try:
        listed = admin.describe_acls(everyone, request_timeout=TIMEOUT_S).result(TIMEOUT_S)
        disclosed: bool | str = bool(listed)
    except KafkaException as exc:
        disclosed = _answer(exc)
    add("describe ACLs", Operation.DESCRIBE, disclosed)
    grant_all = AclBinding(
        ResourceType.TOPIC,
        m.catalogue.prefix,
        ResourcePatternType.PREFIXED,
        f"User:{actor.kafka.username}",
        "*",
        AclOperation.ALL,
        AclPermissionType.ALLOW,
    )
    if not actor.superuser:
        add(
            "create an ACL",
            Operation.ALTER,
            one(admin.create_acls([grant_all], request_timeout=TIMEOUT_S)),
        )
        add(
            "delete ACLs",
            Operation.ALTER,
            one(admin.delete_acls([everyone], request_timeout=TIMEOUT_S)),
        )
        upsert = UserScramCredentialUpsertion(
            "fxstream-admin",
            ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192),
            b"taken-over",
        )
        add(
            "set the admin's SCRAM password",
            Operation.ALTER,
            one(admin.alter_user_scram_credentials([upsert], request_timeout=TIMEOUT_S)),
        )
    # No "describe SCRAM credentials" cell: confluent-kafka 2.x aborts the process
    # (munmap_chunk) when the broker refuses DescribeUserScramCredentials.
    broker = str(next(iter(admin.list_topics(timeout=TIMEOUT_S).brokers)))
    add(
        "describe broker configs",
        Operation.DESCRIBE_CONFIGS,
        one(
            admin.describe_configs(
                [ConfigResource(ConfigResource.Type.BROKER, broker)], request_timeout=TIMEOUT_S
            )
        ),
    )
    change = ConfigResource(
        ConfigResource.Type.BROKER,
        broker,
        incremental_configs=[
            ConfigEntry("log.cleaner.threads", "1", incremental_operation=AlterConfigOpType.SET)
        ],
    )
    add(
        "alter broker configs",
        Operation.ALTER_CONFIGS,
        one(
            admin.incremental_alter_configs([change], validate_only=True, request_timeout=TIMEOUT_S)
        ),
    )
    new = NewTopic(
        m.catalogue.prefix + "not-in-the-catalogue", num_partitions=1, replication_factor=1
    )
    add(
        "create a new topic",
        Operation.CREATE,
        one(admin.create_topics([new], validate_only=True, request_timeout=TIMEOUT_S)),
    )
    return cells


# --- the test ------------------------------------------------------------------------------


def as_list(cell: Callable[..., Cell], *args: Any) -> list[Cell]:
    """``[cell(*args)]``: one cell as a job's list of cells."""
    return [cell(*args)]


def check_every_cell(m: Matrix) -> None:
    """Run every cell of ``m`` against its broker; assert each answer is the table's."""
    started = time.monotonic()
    cells: list[Cell] = []
    # Phase 1: what uses no group but the actor's own (fetching) and no transaction but
    # the one cell's.
    with ThreadPoolExecutor(max_workers=16) as pool:
        jobs: list[Future[list[Cell]]] = []
        for actor in m.actors:
            jobs += [
                pool.submit(topic_admin_cells, m, actor),
                pool.submit(produce_cells, m, actor),
                pool.submit(fetch_cells, m, actor),
                pool.submit(group_admin_cells, m, actor),
                pool.submit(cluster_cells, m, actor),
                pool.submit(as_list, idempotent_cell, actor),
            ]
            jobs += [pool.submit(as_list, init_txn_cell, actor, t) for t in m.txn_ids]
        for job in jobs:
            cells += job.result()
    timings = {"phase 1 (topics, cluster, txn ids)": time.monotonic() - started}
    # Phase 2: every actor joins every group (after the fetching members left them).
    with ThreadPoolExecutor(max_workers=16) as pool:
        joins = [pool.submit(join_cell, a, g) for a in m.actors for g in m.groups]
        cells += [job.result() for job in joins]
    timings["phase 2 (joins)"] = time.monotonic() - started
    # Commits after every join has left, so each group is empty (a standalone commit is
    # refused by a group with members, whoever asks).
    with ThreadPoolExecutor(max_workers=16) as pool:
        commits = [pool.submit(commit_cell, a, g) for a in m.actors for g in m.groups]
        cells += [job.result() for job in commits]
    timings["phase 3 (commits)"] = time.monotonic() - started

    # Transactions after the plain commits; each actor's own transactional id is used by
    # one transaction at a time (a second producer with it would fence the first).
    def transactions(actor: Actor) -> list[Cell]:
        return [registry_txn_cell(m, actor)] + [txn_offsets_cell(actor, g) for g in m.groups]

    with ThreadPoolExecutor(max_workers=len(m.actors)) as pool:
        for done in pool.map(transactions, m.actors):
            cells += done

    timings["phase 4 (transactions)"] = time.monotonic() - started
    print("; ".join(f"{k} done at {v:.1f}s" for k, v in timings.items()))
    wrong = [cell for cell in cells if not cell.ok]
    allowed = sum(1 for cell in cells if cell.expected)
    print(
        f"ACL matrix: {len(cells)} cells ({allowed} allow, {len(cells) - allowed} deny) "
        f"in {time.monotonic() - started:.1f}s"
    )
    assert not wrong, f"{len(wrong)} of {len(cells)} cells differ:\n" + "\n".join(map(str, wrong))
    # The matrix must have checked both answers for every role but the super user.
    for actor in m.actors[1:]:
        mine = [c for c in cells if c.actor == actor.label]
        assert any(c.expected for c in mine) and any(not c.expected for c in mine)
