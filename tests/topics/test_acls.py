"""The ACL table in fxstream.topics.acls: complete, tight, and rendered as the broker reads it.

(The ACL-matrix test in tests/security checks the same table against a real broker.)
"""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AclOperation, AclPermissionType, ResourcePatternType

from fxstream.topics import Catalogue, InvalidTopicName
from fxstream.topics.acls import (
    ALL_TOPICS,
    NOT_GRANTED,
    TABLE,
    Operation,
    Resource,
    Role,
    binding_filters_for,
    bindings_for,
    endpoint_group,
    grants_for,
    is_allowed,
    principal_for,
    render_acl_table_md,
    source_prefix,
    user_group_prefix,
)

CATALOGUE = Catalogue(prefix="t1.")


def test_every_catalogue_topic_is_in_the_table_or_says_why_not() -> None:
    named = {rule.name for rule in TABLE if rule.resource is Resource.TOPIC}
    for spec in CATALOGUE.specs:
        assert (spec.name in named) != (spec.name in NOT_GRANTED), spec.name


def test_topic_rules_name_catalogue_topics() -> None:
    for rule in TABLE:
        if rule.resource is Resource.TOPIC and rule.name != ALL_TOPICS:
            assert CATALOGUE.spec(rule.name) is not None


def test_no_role_may_create_delete_or_alter_anything() -> None:
    roles = ((Role.SERVICE, None), (Role.USER, "a"), (Role.ENDPOINT, "e"), (Role.SOURCE, "s"))
    for role, ident in roles:
        ops = {g.operation for g in grants_for(role, CATALOGUE, ident)}
        assert ops <= {Operation.READ, Operation.WRITE, Operation.DESCRIBE_CONFIGS}, role


def test_admin_needs_no_acl() -> None:
    assert bindings_for(Role.ADMIN, CATALOGUE) == []


def test_a_user_writes_only_its_submissions_and_reads_only_its_results() -> None:
    grants = grants_for(Role.USER, CATALOGUE, "a")
    topic = Resource.TOPIC
    assert is_allowed(grants, topic, "t1.from.user.a", Operation.WRITE)
    assert is_allowed(grants, topic, "t1.from.user.a", Operation.DESCRIBE)
    assert not is_allowed(grants, topic, "t1.from.user.a", Operation.READ)
    assert is_allowed(grants, topic, "t1.results.a", Operation.READ)
    assert not is_allowed(grants, topic, "t1.results.a", Operation.WRITE)
    # A user whose id starts with another's gets nothing of the other's.
    for other in ("t1.from.user.a-b", "t1.results.a-b", "t1.results.b", "t1.tasks.ep.a"):
        for op in Operation:
            assert not is_allowed(grants, topic, other, op), (other, op)
    for registry in (CATALOGUE.users, CATALOGUE.functions, CATALOGUE.task_state):
        for op in Operation:
            assert not is_allowed(grants, topic, registry, op), (registry, op)
    assert is_allowed(grants, Resource.GROUP, user_group_prefix("a") + "sdk-1", Operation.READ)
    assert not is_allowed(grants, Resource.GROUP, user_group_prefix("a-b") + "x", Operation.READ)
    assert not is_allowed(grants, Resource.GROUP, "fxstream-processors-router", Operation.READ)


def test_an_endpoint_reads_only_its_queue_in_its_group() -> None:
    grants = grants_for(Role.ENDPOINT, CATALOGUE, "e")
    assert is_allowed(grants, Resource.TOPIC, "t1.tasks.ep.e", Operation.READ)
    assert not is_allowed(grants, Resource.TOPIC, "t1.tasks.ep.e", Operation.WRITE)
    assert not is_allowed(grants, Resource.TOPIC, "t1.tasks.ep.e-2", Operation.READ)
    assert is_allowed(grants, Resource.TOPIC, "t1.from.ep.e", Operation.WRITE)
    assert not is_allowed(grants, Resource.TOPIC, "t1.from.ep.e-2", Operation.WRITE)
    for topic in (CATALOGUE.heartbeats, CATALOGUE.results("u"), CATALOGUE.dead_letter):
        assert not is_allowed(grants, Resource.TOPIC, topic, Operation.WRITE), topic
    assert is_allowed(grants, Resource.GROUP, endpoint_group("e"), Operation.READ)
    assert not is_allowed(grants, Resource.GROUP, endpoint_group("e") + "x", Operation.READ)
    assert is_allowed(grants, Resource.TRANSACTIONAL_ID, "fxstream-agent.e.h.a", Operation.WRITE)
    assert not is_allowed(
        grants, Resource.TRANSACTIONAL_ID, "fxstream-agent.e-2.h.a", Operation.WRITE
    )


def test_an_event_source_writes_and_reads_only_its_own_events_topic() -> None:
    grants = grants_for(Role.SOURCE, CATALOGUE, "s")
    assert principal_for(Role.SOURCE, "s") == "User:src.s"
    own = CATALOGUE.events("s")
    assert is_allowed(grants, Resource.TOPIC, own, Operation.WRITE)
    assert is_allowed(grants, Resource.TOPIC, own, Operation.READ)
    for topic in (CATALOGUE.events("s-2"), CATALOGUE.events("t"), CATALOGUE.results("s")):
        for op in Operation:
            assert not is_allowed(grants, Resource.TOPIC, topic, op), (topic, op)
    assert is_allowed(grants, Resource.TRANSACTIONAL_ID, source_prefix("s") + "w", Operation.WRITE)
    assert not is_allowed(
        grants, Resource.TRANSACTIONAL_ID, "fxstream-source.s-2.w", Operation.WRITE
    )
    assert is_allowed(grants, Resource.GROUP, source_prefix("s") + "scan", Operation.READ)
    assert not is_allowed(grants, Resource.GROUP, "fxstream-processors-x", Operation.READ)
    # The service's Parquet sink reads every source's events, and writes none.
    service = grants_for(Role.SERVICE, CATALOGUE)
    assert is_allowed(service, Resource.TOPIC, own, Operation.READ)
    assert not is_allowed(service, Resource.TOPIC, own, Operation.WRITE)


def test_the_service_writes_the_registry_and_dispatches_but_not_agents_topics() -> None:
    grants = grants_for(Role.SERVICE, CATALOGUE)
    for topic in (CATALOGUE.users, CATALOGUE.endpoint_queue("e"), CATALOGUE.task_state):
        assert is_allowed(grants, Resource.TOPIC, topic, Operation.WRITE), topic
    assert is_allowed(grants, Resource.TOPIC, CATALOGUE.from_user("u"), Operation.READ)
    # The trigger processor writes a rule's firings as its owner (the router checks them).
    assert is_allowed(grants, Resource.TOPIC, CATALOGUE.from_user("u"), Operation.WRITE)
    assert not is_allowed(grants, Resource.TOPIC, CATALOGUE.from_endpoint("e"), Operation.WRITE)
    assert not is_allowed(grants, Resource.TOPIC, CATALOGUE.endpoint_queue("e"), Operation.READ)
    # Another deployment's topics (another prefix) are not the service's.
    assert not is_allowed(grants, Resource.TOPIC, "t2.users", Operation.READ)
    # The analytics processor writes the windows, the API's view reads them; a user reads
    # them only through the API (which shows it its own).
    assert is_allowed(grants, Resource.TOPIC, CATALOGUE.analytics, Operation.WRITE)
    assert is_allowed(grants, Resource.TOPIC, CATALOGUE.analytics, Operation.READ)
    user = grants_for(Role.USER, CATALOGUE, "u")
    assert not is_allowed(user, Resource.TOPIC, CATALOGUE.analytics, Operation.READ)


def test_bindings_are_allows_for_the_principal() -> None:
    bindings = bindings_for(Role.ENDPOINT, CATALOGUE, "e")
    assert len(bindings) == len(grants_for(Role.ENDPOINT, CATALOGUE, "e"))
    for binding in bindings:
        assert binding.principal == principal_for(Role.ENDPOINT, "e") == "User:ep.e"
        assert binding.permission_type == AclPermissionType.ALLOW
        assert binding.host == "*"
    queue = [b for b in bindings if b.name == "t1.tasks.ep.e"]
    assert [(b.resource_pattern_type, b.operation) for b in queue] == [
        (ResourcePatternType.LITERAL, AclOperation.READ)
    ]
    (selector,) = binding_filters_for(Role.USER, "a")
    assert selector.principal == "User:u.a"
    assert selector.operation == AclOperation.ANY


@pytest.mark.parametrize("bad", ["a.b", "", "a_b", "-a"])
def test_ids_that_could_break_a_prefix_are_refused(bad: str) -> None:
    with pytest.raises(InvalidTopicName):
        bindings_for(Role.USER, CATALOGUE, bad)


def test_ids_are_required_exactly_where_a_role_has_many_principals() -> None:
    with pytest.raises(TypeError):
        bindings_for(Role.USER, CATALOGUE)
    with pytest.raises(TypeError):
        bindings_for(Role.SERVICE, CATALOGUE, "x")


def test_the_rendered_table_has_a_row_per_rule() -> None:
    text = render_acl_table_md(CATALOGUE)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == len(TABLE) + 2  # header and the admin row
    assert "`t1.results.<U>`" in text and "`t1.from.ep.*`" in text
