"""Who may do what on the broker: the one ACL table of fxstream, as data.

The broker runs ``StandardAuthorizer`` with ``allow.everyone.if.no.acl.found=false``, so a
principal may do exactly what an ALLOW in this table grants it, and nothing else. Five roles:

- **admin** (``fxstream-admin``): the only super user (``super.users``); it needs no ACL.
  Ops provisioning and the REST API's account manager act as admin.
- **service** (``fxstream-service``): the processors (router, task-state, liveness, ingress,
  trigger). It reads the inputs, writes the registry, the dispatches, results and task-state,
  and a trigger rule's firings on its owner's ``from.user.<U>`` (which the router then
  authorises as that user's), in its own consumer groups and transactional ids; it creates,
  deletes and alters nothing.
- **user** ``U`` (``u.<U>``): writes only ``from.user.<U>`` and reads only ``results.<U>``,
  in groups and transactional ids starting ``fxstream-user.<U>.``.
- **endpoint** ``E`` (``ep.<E>``): reads only ``tasks.ep.<E>`` in the group
  ``fxstream-endpoint.<E>``, writes only ``from.ep.<E>``, with transactional ids starting
  ``fxstream-agent.<E>.``.
- **source** ``S`` (``src.<S>``): an event source (file watcher, ADIOS2 steps): writes and
  reads only ``events.<S>`` (it reads its recent keys at start, so a restart repeats no
  event), with groups and transactional ids starting ``fxstream-source.<S>.``.

Topic names come from the :class:`~fxstream.topics.catalogue.Catalogue` (so a deployment's
prefix is honoured); ids never contain ``.``, which therefore ends every prefix safely.
:func:`bindings_for` turns a role's rows into confluent-kafka ``AclBinding``\\ s,
:func:`binding_filters_for` matches them for deletion, :func:`is_allowed` evaluates the table
the way the broker does (for tests and docs), and :func:`render_acl_table_md` renders it for
docs/security.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    ResourcePatternType,
    ResourceType,
)

from fxstream.topics.catalogue import Catalogue, TopicSpec, _check_id

__all__ = [
    "ADMIN_USERNAME",
    "ALL_TOPICS",
    "NOT_GRANTED",
    "SERVICE_GROUP_PREFIX",
    "SERVICE_USERNAME",
    "TABLE",
    "Grant",
    "Operation",
    "Pattern",
    "Resource",
    "Role",
    "Rule",
    "binding_filters_for",
    "bindings_for",
    "endpoint_group",
    "endpoint_transactional_prefix",
    "every_acl",
    "grants_for",
    "is_allowed",
    "principal_for",
    "render_acl_table_md",
    "source_prefix",
    "user_group_prefix",
    "username_for",
]

ADMIN_USERNAME = "fxstream-admin"
SERVICE_USERNAME = "fxstream-service"
# The processors' consumer groups and transactional ids all start with their app id
# (fxstream.service.processors.DEFAULT_APP_ID): <app id>, <app id>-router, -task-state, ...
SERVICE_GROUP_PREFIX = "fxstream-processors"
# The service's registry views assign partitions themselves under this (never joined) group.
SERVICE_VIEW_GROUP = "fxstream-registry-view-unused"
_USER_PREFIX = "u."
_ENDPOINT_PREFIX = "ep."
_SOURCE_PREFIX = "src."


class Role(StrEnum):
    """A kind of principal."""

    ADMIN = "admin"
    SERVICE = "service"
    USER = "user"
    ENDPOINT = "endpoint"
    SOURCE = "source"


class Resource(StrEnum):
    """A Kafka resource type the table names."""

    TOPIC = "TOPIC"
    GROUP = "GROUP"
    TRANSACTIONAL_ID = "TRANSACTIONAL_ID"
    CLUSTER = "CLUSTER"


class Pattern(StrEnum):
    """How a rule's name matches a resource: the whole name, or its beginning."""

    LITERAL = "LITERAL"
    PREFIXED = "PREFIXED"


class Operation(StrEnum):
    """A Kafka ACL operation."""

    READ = "READ"
    WRITE = "WRITE"
    CREATE = "CREATE"
    DELETE = "DELETE"
    ALTER = "ALTER"
    DESCRIBE = "DESCRIBE"
    CLUSTER_ACTION = "CLUSTER_ACTION"
    DESCRIBE_CONFIGS = "DESCRIBE_CONFIGS"
    ALTER_CONFIGS = "ALTER_CONFIGS"
    IDEMPOTENT_WRITE = "IDEMPOTENT_WRITE"


# What the broker implies: an ALLOW of the key grants the values too (Kafka's AclEntry).
_IMPLIED: dict[Operation, frozenset[Operation]] = {
    Operation.DESCRIBE: frozenset(
        {Operation.READ, Operation.WRITE, Operation.DELETE, Operation.ALTER}
    ),
    Operation.DESCRIBE_CONFIGS: frozenset({Operation.ALTER_CONFIGS}),
}


@dataclass(frozen=True)
class Rule:
    """One row of the table: ``role`` may do ``operation`` on the resource(s) named.

    For a topic, ``name`` is a catalogue spec name (``results.{user_id}``); its template is
    filled with the principal's own id for a LITERAL rule and cut before the ``{`` for a
    PREFIXED rule (every user's results). For groups and transactional ids ``name`` is the
    name itself with ``{id}`` standing for the principal's id.
    """

    role: Role
    resource: Resource
    pattern: Pattern
    name: str
    operation: Operation
    why: str


@dataclass(frozen=True)
class Grant:
    """A rule made concrete for one principal of one deployment."""

    resource: Resource
    pattern: Pattern
    name: str
    operation: Operation

    def matches(self, resource: Resource, name: str) -> bool:
        """True when this grant's resource pattern covers ``resource`` ``name``."""
        if resource is not self.resource:
            return False
        if self.pattern is Pattern.LITERAL:
            return name == self.name
        return name.startswith(self.name)


# A topic rule's name for every topic of the deployment (its prefix, PREFIXED).
ALL_TOPICS = "*"

_S, _U, _E, _SRC = Role.SERVICE, Role.USER, Role.ENDPOINT, Role.SOURCE
_T, _G, _X = Resource.TOPIC, Resource.GROUP, Resource.TRANSACTIONAL_ID
_LIT, _PRE = Pattern.LITERAL, Pattern.PREFIXED
_R, _W = Operation.READ, Operation.WRITE

TABLE: tuple[Rule, ...] = (
    # --- the service: processors and the registry views ----------------------------------
    Rule(_S, _T, _LIT, "users", _R, "registry views (API, router)"),
    Rule(_S, _T, _LIT, "users", _W, "the registry is written by the service only"),
    Rule(_S, _T, _LIT, "functions", _R, "registry views (API, router)"),
    Rule(_S, _T, _LIT, "functions", _W, "the registry is written by the service only"),
    Rule(_S, _T, _LIT, "endpoints", _R, "registry views (API, router)"),
    Rule(_S, _T, _LIT, "endpoints", _W, "the registry is written by the service only"),
    Rule(_S, _T, _PRE, "from.user.{user_id}", _R, "router: every user's submissions"),
    Rule(_S, _T, _PRE, "from.ep.{endpoint_id}", _R, "ingress: everything agents write"),
    Rule(_S, _T, _PRE, "tasks.ep.{endpoint_id}", _W, "router: dispatches and cancels"),
    Rule(_S, _T, _PRE, "results.{user_id}", _R, "task-state follows every user's results"),
    Rule(_S, _T, _PRE, "results.{user_id}", _W, "ingress forwards results; router rejections"),
    Rule(_S, _T, _LIT, "heartbeats", _R, "liveness, registry views"),
    Rule(_S, _T, _LIT, "heartbeats", _W, "ingress forwards checked heartbeats"),
    Rule(_S, _T, _LIT, "endpoint-logs", _R, "the API: an endpoint's logs, for its owner"),
    Rule(_S, _T, _LIT, "endpoint-logs", _W, "ingress forwards checked log batches"),
    Rule(_S, _T, _LIT, "warm", _R, "router (warm routing)"),
    Rule(_S, _T, _LIT, "warm", _W, "ingress forwards checked warm adverts"),
    Rule(_S, _T, _LIT, "data-locations", _R, "router (locality)"),
    Rule(_S, _T, _LIT, "data-locations", _W, "ingress forwards checked data locations"),
    Rule(_S, _T, _LIT, "task-state", _R, "task-state processor and the API's view"),
    Rule(_S, _T, _LIT, "task-state", _W, "task-state processor"),
    Rule(_S, _T, _LIT, "task-events", _R, "task-state processor"),
    Rule(_S, _T, _LIT, "task-events", _W, "liveness, ingress (agents' events)"),
    Rule(_S, _T, _LIT, "dead-letter", _W, "every processor dead-letters what it refuses"),
    Rule(
        _S,
        _T,
        _PRE,
        "events.{source}",
        _R,
        "trigger processor; the Parquet sink archives every source's events",
    ),
    Rule(_S, _T, _LIT, "triggers", _R, "trigger processor, registry views"),
    Rule(_S, _T, _LIT, "triggers", _W, "the registry is written by the service only"),
    Rule(_S, _T, _LIT, "analytics", _W, "analytics processor: windowed aggregates"),
    Rule(_S, _T, _LIT, "analytics", _R, "the API's analytics view"),
    Rule(
        _S,
        _T,
        _PRE,
        "from.user.{user_id}",
        _W,
        "trigger processor: a rule's firings, as its owner (the router authorises them); "
        "dependencies processor: a held task released with its parents' results",
    ),
    Rule(_S, _T, _LIT, "held-tasks", _R, "dependencies processor: the held tasks"),
    Rule(_S, _T, _LIT, "held-tasks", _W, "router holds tasks; dependencies tombstones them"),
    Rule(
        _S, _T, _PRE, ALL_TOPICS, Operation.DESCRIBE_CONFIGS, "start-up check: topics as specified"
    ),
    Rule(_S, _G, _PRE, SERVICE_GROUP_PREFIX, _R, "processors' groups, offset commits"),
    Rule(_S, _G, _LIT, SERVICE_VIEW_GROUP, _R, "registry views (assigned, never joined)"),
    Rule(_S, _X, _PRE, SERVICE_GROUP_PREFIX, _W, "router / ingress transactions"),
    # --- a user: its SDK ----------------------------------------------------------------
    Rule(_U, _T, _LIT, "from.user.{user_id}", _W, "its submissions and cancels"),
    Rule(_U, _T, _LIT, "results.{user_id}", _R, "its results"),
    Rule(_U, _G, _PRE, "fxstream-user.{id}.", _R, "its SDK's groups"),
    Rule(_U, _X, _PRE, "fxstream-user.{id}.", _W, "its SDK's transactions"),
    # --- an endpoint: its agents -------------------------------------------------------
    Rule(_E, _T, _LIT, "tasks.ep.{endpoint_id}", _R, "its queue"),
    Rule(_E, _T, _LIT, "from.ep.{endpoint_id}", _W, "results, heartbeats, warm, locations, logs"),
    Rule(_E, _G, _LIT, "fxstream-endpoint.{id}", _R, "its agents' group (and txn commits)"),
    Rule(_E, _X, _PRE, "fxstream-agent.{id}.", _W, "its agents' transactions"),
    # --- an event source: a file watcher, an ADIOS2 step source ---------------------------
    Rule(_SRC, _T, _LIT, "events.{source}", _W, "its events"),
    Rule(_SRC, _T, _LIT, "events.{source}", _R, "its recent keys at start (no repeats)"),
    Rule(_SRC, _G, _PRE, "fxstream-source.{id}.", _R, "its groups"),
    Rule(_SRC, _X, _PRE, "fxstream-source.{id}.", _W, "its transactions"),
)

# Catalogue topics no role but admin may touch, and why.
NOT_GRANTED: dict[str, str] = {
    "streams.{stream}": "SDK streams have no per-user namespace yet: admin only",
}


def username_for(role: Role, principal_id: str | None = None) -> str:
    """The SCRAM username of a role's principal (``u.<U>``, ``ep.<E>``)."""
    if role is Role.ADMIN:
        return ADMIN_USERNAME
    if role is Role.SERVICE:
        return SERVICE_USERNAME
    ident = _require_id(role, principal_id)
    prefix = {Role.USER: _USER_PREFIX, Role.ENDPOINT: _ENDPOINT_PREFIX}.get(role, _SOURCE_PREFIX)
    return prefix + ident


def principal_for(role: Role, principal_id: str | None = None) -> str:
    """The Kafka principal (``User:<username>``) of a role's principal."""
    return f"User:{username_for(role, principal_id)}"


def user_group_prefix(user_id: str) -> str:
    """The prefix of every consumer group and transactional id user ``user_id`` may use."""
    return f"fxstream-user.{_require_id(Role.USER, user_id)}."


def endpoint_group(endpoint_id: str) -> str:
    """The one consumer group endpoint ``endpoint_id``'s agents share."""
    return f"fxstream-endpoint.{_require_id(Role.ENDPOINT, endpoint_id)}"


def endpoint_transactional_prefix(endpoint_id: str) -> str:
    """The prefix of the transactional ids endpoint ``endpoint_id``'s agents may use."""
    return f"fxstream-agent.{_require_id(Role.ENDPOINT, endpoint_id)}."


def source_prefix(source: str) -> str:
    """The prefix of every consumer group and transactional id source ``source`` may use."""
    return f"fxstream-source.{_require_id(Role.SOURCE, source)}."


def _require_id(role: Role, principal_id: str | None) -> str:
    if role in (Role.ADMIN, Role.SERVICE):
        if principal_id is not None:
            raise TypeError(f"the {role} principal has no id")
        return ""
    if principal_id is None:
        raise TypeError(f"a {role} principal needs its id")
    # The catalogue's check: letters, digits and '-', so '.' always ends the id.
    return _check_id(f"{role} id", principal_id)


def _spec(catalogue: Catalogue, name: str) -> TopicSpec | None:
    try:
        return catalogue.spec(name)
    except KeyError:
        return None


def _grant(catalogue: Catalogue, rule: Rule, principal_id: str | None) -> Grant | None:
    if rule.resource is not Resource.TOPIC:
        name = rule.name.format(id=principal_id) if "{id}" in rule.name else rule.name
        return Grant(rule.resource, rule.pattern, name, rule.operation)
    if rule.name == ALL_TOPICS:
        return Grant(rule.resource, rule.pattern, catalogue.prefix, rule.operation)
    spec = _spec(catalogue, rule.name)
    if spec is None:
        # A topic this deployment's catalogue does not have: nothing to grant on it.
        return None
    if spec.template_field is None:
        return Grant(rule.resource, rule.pattern, catalogue.topic(spec), rule.operation)
    if rule.pattern is Pattern.PREFIXED:
        head = spec.name.split("{", 1)[0]
        return Grant(rule.resource, rule.pattern, catalogue.prefix + head, rule.operation)
    assert principal_id is not None
    name = catalogue.topic(spec, **{spec.template_field: principal_id})
    return Grant(rule.resource, rule.pattern, name, rule.operation)


def grants_for(role: Role, catalogue: Catalogue, principal_id: str | None = None) -> list[Grant]:
    """Every ALLOW the table gives one principal in ``catalogue``'s deployment.

    Empty for admin, whose rights come from ``super.users``, not from ACLs.
    """
    _require_id(role, principal_id)
    grants: list[Grant] = []
    for rule in (r for r in TABLE if r.role is role):
        if rule.name == ALL_TOPICS and not catalogue.prefix:
            # Kafka has no empty prefix: without a deployment prefix, each static topic.
            grants += [
                Grant(Resource.TOPIC, Pattern.LITERAL, name, rule.operation)
                for name in catalogue.static_topics()
            ]
            continue
        grant = _grant(catalogue, rule, principal_id)
        if grant is not None:
            grants.append(grant)
    return grants


_RESOURCE_TYPES = {
    Resource.TOPIC: ResourceType.TOPIC,
    Resource.GROUP: ResourceType.GROUP,
    Resource.TRANSACTIONAL_ID: ResourceType.TRANSACTIONAL_ID,
    Resource.CLUSTER: ResourceType.BROKER,
}
_PATTERN_TYPES = {
    Pattern.LITERAL: ResourcePatternType.LITERAL,
    Pattern.PREFIXED: ResourcePatternType.PREFIXED,
}


def bindings_for(
    role: Role,
    catalogue: Catalogue,
    principal_id: str | None = None,
    *,
    username: str | None = None,
) -> list[AclBinding]:
    """The ``AclBinding``\\ s (ALLOW, any host) to create for one principal.

    ``username`` replaces the role's SCRAM username (a test's own service principal, so it
    never touches the running platform's).
    """
    principal = f"User:{username}" if username else principal_for(role, principal_id)
    return [
        AclBinding(
            _RESOURCE_TYPES[g.resource],
            "kafka-cluster" if g.resource is Resource.CLUSTER else g.name,
            _PATTERN_TYPES[g.pattern],
            principal,
            "*",
            getattr(AclOperation, g.operation.value),
            AclPermissionType.ALLOW,
        )
        for g in grants_for(role, catalogue, principal_id)
    ]


def every_acl() -> AclBindingFilter:
    """A filter that matches every ACL of the cluster (DescribeAcls asks for all of them)."""
    return AclBindingFilter(
        ResourceType.ANY,
        None,  # type: ignore[arg-type]
        ResourcePatternType.ANY,
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        AclOperation.ANY,
        AclPermissionType.ANY,
    )


def binding_filters_for(
    role: Role, principal_id: str | None = None, *, username: str | None = None
) -> list[AclBindingFilter]:
    """Filters matching every ACL of one principal, whatever it is (for ``delete_acls``).

    They match the principal's bindings from any version of the table, so deleting a
    principal leaves none of its rights behind.
    """
    # None matches any name and any host (confluent-kafka's stubs say str, its code takes None).
    return [
        AclBindingFilter(
            ResourceType.ANY,
            None,  # type: ignore[arg-type]
            ResourcePatternType.ANY,
            f"User:{username}" if username else principal_for(role, principal_id),
            None,  # type: ignore[arg-type]
            AclOperation.ANY,
            AclPermissionType.ANY,
        )
    ]


def is_allowed(
    grants: Iterable[Grant], resource: Resource, name: str, operation: Operation
) -> bool:
    """Whether the broker lets a principal holding ``grants`` do ``operation`` on a resource.

    Follows Kafka's rules: an ALLOW of READ, WRITE, DELETE or ALTER also allows DESCRIBE,
    and ALTER_CONFIGS allows DESCRIBE_CONFIGS.
    """
    covering = {g.operation for g in grants if g.matches(resource, name)}
    if operation in covering:
        return True
    return bool(covering & _IMPLIED.get(operation, frozenset()))


_ID_SHOWN = {Role.USER: "<U>", Role.ENDPOINT: "<E>", Role.SOURCE: "<S>"}


def _shown_name(catalogue: Catalogue, rule: Rule) -> str:
    if rule.resource is not Resource.TOPIC:
        name = rule.name.replace("{id}", _ID_SHOWN.get(rule.role, "{id}"))
        return f"`{name}*`" if rule.pattern is Pattern.PREFIXED else f"`{name}`"
    if rule.name == ALL_TOPICS:
        return f"`{catalogue.prefix}*`"
    spec = _spec(catalogue, rule.name)
    if spec is None:
        return f"`{catalogue.prefix}{rule.name}` (not in this catalogue)"
    if spec.template_field is None:
        return f"`{catalogue.topic(spec)}`"
    head = spec.name.split("{", 1)[0]
    if rule.pattern is Pattern.PREFIXED:
        return f"`{catalogue.prefix}{head}*`"
    return f"`{catalogue.prefix}{head}{_ID_SHOWN[rule.role]}`"


def _principal_shown(role: Role) -> str:
    if role is Role.USER:
        return f"`{_USER_PREFIX}<U>`"
    if role is Role.ENDPOINT:
        return f"`{_ENDPOINT_PREFIX}<E>`"
    if role is Role.SOURCE:
        return f"`{_SOURCE_PREFIX}<S>`"
    return f"`{username_for(role)}`"


def render_acl_table_md(catalogue: Catalogue | None = None) -> str:
    """The table as Markdown (for docs/security.md): every ALLOW, by role."""
    catalogue = catalogue or Catalogue()
    lines = [
        "| role | principal | resource | pattern | name | operation | why |",
        "|---|---|---|---|---|---|---|",
        f"| admin | `{ADMIN_USERNAME}` | everything | | | every | super user "
        "(`super.users`); no ACL |",
    ]
    for rule in TABLE:
        lines.append(
            f"| {rule.role} | {_principal_shown(rule.role)} | {rule.resource} | "
            f"{rule.pattern} | {_shown_name(catalogue, rule)} | {rule.operation} | {rule.why} |"
        )
    lines += [
        "",
        "Anything not listed is denied (`allow.everyone.if.no.acl.found=false`). READ, WRITE, "
        "DELETE and ALTER imply DESCRIBE; an idempotent producer needs WRITE on some topic "
        "(no IDEMPOTENT_WRITE grant). No role but admin may CREATE, DELETE or ALTER anything.",
        "",
        "Topics no role but admin may use:",
        "",
    ]
    lines += [f"- `{catalogue.prefix}{name}`: {why}" for name, why in NOT_GRANTED.items()]
    return "\n".join(lines) + "\n"
