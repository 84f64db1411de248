"""Record schemas: every kind of record fxstream writes to Kafka.

Each record value is one MessagePack map. Two fields are in every record:
``kind`` (which schema, e.g. ``"submission"``) and ``v`` (that schema's
version). Readers ignore fields they do not know, so adding an optional field
keeps ``v``; any other change bumps it, and a reader refuses a version newer
than it knows rather than misreading it. Payloads (code, arguments, results)
are opaque ``bytes`` here: their encoding is the serialization strategy's job,
and the router forwards them without reading them.

All encoding and decoding goes through :func:`encode`, :func:`decode` and
:func:`decode_any`; bad bytes raise :class:`RecordDecodeError` and nothing else.
"""

from __future__ import annotations

import enum
import fnmatch
import math
import re
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec
from msgspec import Meta

from fxstream.topics.parents import MAX_PARENTS
from fxstream.topics.routing_stamp import ROUTING_STAMP_MAX_CHARS
from fxstream.topics.staging import MAX_STAGE_ITEMS, StageItem

__all__ = [
    "LATENCY_BUCKETS",
    "LATENCY_BUCKET_BASE_S",
    "LATENCY_BUCKET_GROWTH",
    "LATEST_TIMESTAMP",
    "MAX_ENDPOINT_GROUP",
    "MAX_MPI_NODES",
    "MAX_MPI_RANKS",
    "MAX_MPI_RANKS_PER_NODE",
    "MAX_TAG_KEY_CHARS",
    "MAX_TAG_VALUE_CHARS",
    "MAX_TASK_TAGS",
    "OTHER_KEY",
    "SCHEMA_VERSIONS",
    "TAG_KEY_PATTERN",
    "TAG_VALUE_PATTERN",
    "Attempt",
    "ClientInfo",
    "DataLocation",
    "DeadLetter",
    "Digest",
    "EndpointLogs",
    "EndpointRecord",
    "Event",
    "EventPredicate",
    "FunctionRecord",
    "Heartbeat",
    "HeldTask",
    "LogLine",
    "ObjectReference",
    "Record",
    "RecordDecodeError",
    "ResourceSpecification",
    "StorageTier",
    "Tags",
    "TaskCancel",
    "TaskDispatch",
    "TaskError",
    "TaskErrorType",
    "TaskEvent",
    "TaskLease",
    "TaskResult",
    "TaskState",
    "TaskStateName",
    "TaskSubmission",
    "TaskTimings",
    "TriggerFiring",
    "TriggerLimits",
    "TriggerRule",
    "UserRecord",
    "WarmAdvert",
    "WarmWorker",
    "WindowAggregate",
    "decode",
    "decode_any",
    "encode",
    "latency_bucket",
    "latency_bucket_upper_s",
    "record_kind",
    "task_state_glance",
    "task_state_group",
    "task_state_name",
]

_ID_RE = r"^[A-Za-z0-9][A-Za-z0-9-]{0,127}$"

Id = Annotated[
    str,
    Meta(
        pattern=_ID_RE,
        description="an identifier: 1-128 letters, digits and '-' (fxstream issues UUIDs)",
    ),
]
# Upper bounds keep floats finite: an infinite time passes a lower bound, and then a
# heartbeat sent "at infinity" is newer than every later one (its endpoint stays online
# forever), and JSON, which has no infinity, shows it as null.
LATEST_TIMESTAMP: Final = 253_402_300_799.0  # 9999-12-31T23:59:59Z
LONGEST_DURATION_S: Final = 1e9  # about 31 years
Timestamp = Annotated[
    float,
    Meta(ge=0, le=LATEST_TIMESTAMP, description="seconds since the Unix epoch, UTC"),
]
Count = Annotated[int, Meta(ge=0)]
Text = Annotated[str, Meta(max_length=65_536)]
Name = Annotated[str, Meta(min_length=1, max_length=256)]
SchemaVersion = Annotated[int, Meta(ge=1, description="schema version of this record kind")]
MAX_ENDPOINT_GROUP: Final = 16
"""The most endpoints one submission may name as its group (``endpoint_group``)."""
MAX_TASK_TAGS: Final = 8
"""The most tags one task may carry (``tags``; :func:`fxstream.topics.budget.check_tags`)."""
MAX_TAG_KEY_CHARS: Final = 32
"""A tag key: 1-32 letters, digits, '_', '.' or '-' (never ':', which splits a query's
``key:value``)."""
MAX_TAG_VALUE_CHARS: Final = 64
"""A tag value: 1-64 characters, no control characters."""
TAG_KEY_PATTERN: Final = rf"^[A-Za-z0-9_.-]{{1,{MAX_TAG_KEY_CHARS}}}\Z"
TAG_VALUE_PATTERN: Final = rf"^[^\x00-\x1f\x7f]{{1,{MAX_TAG_VALUE_CHARS}}}\Z"
Tags = Annotated[
    dict[
        Annotated[str, Meta(pattern=TAG_KEY_PATTERN)],
        Annotated[str, Meta(pattern=TAG_VALUE_PATTERN)],
    ],
    Meta(
        max_length=MAX_TASK_TAGS,
        description="the submitter's labels for the task (key -> value), for filtered "
        "queries (GET /v1/tasks?tag=key:value); set once, at submission; at most 8, keys "
        "of 1-32 letters, digits, '_', '.' or '-', values of 1-64 characters without "
        "control characters",
    ),
]


RoutingStamp = Annotated[
    str,
    Meta(
        max_length=ROUTING_STAMP_MAX_CHARS,
        description="the router's routing stamp of the task (fxstream.topics.routing_stamp): "
        "set on the dispatch, copied unchanged by the agent into the task's results and "
        "events, verified by the ingress; empty from an older router or agent",
    ),
]


class RecordDecodeError(ValueError):
    """Bytes that are not a valid fxstream record of the expected kind.

    ``reason`` says what is wrong, in words fit for a dead-letter record.
    """

    def __init__(self, reason: str, *, expected: str | None = None) -> None:
        self.reason = reason
        self.expected = expected
        what = f"not a valid {expected} record" if expected else "not a valid fxstream record"
        super().__init__(f"{what}: {reason}")


class Record(msgspec.Struct, tag_field="kind", kw_only=True, frozen=True):
    """Base of every record: the ``kind`` tag and the schema version ``v``."""

    v: SchemaVersion = 1


# --- task path -----------------------------------------------------------------------------


class ClientInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What produced a payload, so a worker that cannot load it can say why."""

    python_version: Annotated[str, Meta(max_length=64, description="e.g. '3.11.7'")]
    fxstream_version: Annotated[str, Meta(max_length=64)]
    serializers: Annotated[
        dict[str, str],
        Meta(description="serializer library name -> version, e.g. {'dill': '0.3.9'}"),
    ] = {}


class TriggerFiring(msgspec.Struct, kw_only=True, frozen=True):
    """Which rule fired a task, for which event (``TaskSubmission.trigger``)."""

    rule_id: Id
    source: Id
    event_key: Annotated[str, Meta(min_length=1, max_length=1024)]
    event_topic: Annotated[str, Meta(max_length=249)]
    event_partition: Annotated[int, Meta(ge=0)]
    event_offset: Annotated[int, Meta(ge=0)]


MAX_MPI_NODES: Final = 4096
"""The most nodes one task may ask for (``ResourceSpecification.num_nodes``)."""
MAX_MPI_RANKS_PER_NODE: Final = 1024
"""The most ranks one task may ask for on each node."""
MAX_MPI_RANKS: Final = 1_048_576
"""The most ranks one task may ask for in all."""


class ResourceSpecification(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What an MPI task needs (``TaskSubmission.resource_specification``, Globus Compute's
    ``resource_specification``): ``num_nodes`` nodes of one block, ``ranks_per_node``
    ranks on each, ``num_ranks`` in all, always ``num_nodes * ranks_per_node`` (the SDK
    completes a partial one, :meth:`from_mapping`). An unknown key is refused, not ignored:
    an endpoint that silently dropped a request for resources would run the task on fewer.
    """

    num_nodes: Annotated[int, Meta(ge=1, le=MAX_MPI_NODES)]
    ranks_per_node: Annotated[int, Meta(ge=1, le=MAX_MPI_RANKS_PER_NODE)]
    num_ranks: Annotated[int, Meta(ge=1, le=MAX_MPI_RANKS)]

    def __post_init__(self) -> None:
        if self.num_ranks != self.num_nodes * self.ranks_per_node:
            raise ValueError(
                f"num_ranks ({self.num_ranks}) must be num_nodes x ranks_per_node "
                f"({self.num_nodes} x {self.ranks_per_node} = "
                f"{self.num_nodes * self.ranks_per_node}): fix one of them, or give two "
                "and let the third be computed"
            )

    @classmethod
    def from_mapping(cls, spec: Any) -> ResourceSpecification:
        """A complete specification from Globus Compute's dict: ``num_nodes`` (default 1)
        and one or both of ``ranks_per_node`` and ``num_ranks`` (the other is computed;
        neither: one rank per node). ``ValueError`` saying what to change otherwise."""
        if isinstance(spec, ResourceSpecification):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(
                "resource_specification must be a dict such as "
                '{"num_nodes": 2, "ranks_per_node": 4}, not ' + type(spec).__name__
            )
        known = {"num_nodes", "ranks_per_node", "num_ranks"}
        unknown = sorted(str(key) for key in set(spec) - known)
        if unknown:
            raise ValueError(
                f"resource_specification has unknown key(s) {unknown}: it takes only "
                "num_nodes, ranks_per_node and num_ranks (launcher_options is not supported)"
            )
        values: dict[str, int] = {}
        for key in known & set(spec):
            value = spec[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"resource_specification[{key!r}] must be a positive integer, not {value!r}"
                )
            values[key] = value
        nodes = values.get("num_nodes", 1)
        per_node = values.get("ranks_per_node")
        ranks = values.get("num_ranks")
        if per_node is None and ranks is None:
            per_node = 1
        if per_node is None:
            assert ranks is not None
            if ranks % nodes:
                raise ValueError(
                    f"resource_specification: num_ranks {ranks} does not divide evenly over "
                    f"num_nodes {nodes}: give ranks_per_node, or a multiple of num_nodes"
                )
            per_node = ranks // nodes
        if ranks is None:
            ranks = nodes * per_node
        candidate = {"num_nodes": nodes, "ranks_per_node": per_node, "num_ranks": ranks}
        try:
            return msgspec.convert(candidate, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"resource_specification is not valid: {exc}") from None

    def as_dict(self) -> dict[str, int]:
        """``{"num_nodes": ..., "ranks_per_node": ..., "num_ranks": ...}``."""
        return {
            "num_nodes": self.num_nodes,
            "ranks_per_node": self.ranks_per_node,
            "num_ranks": self.num_ranks,
        }


class TaskSubmission(Record, tag="submission", kw_only=True, frozen=True):
    """A task as submitted (topic ``from.user.<user_id>``, key: task id).

    It carries no credential: who submitted it is the user whose topic it is on
    (only that user's principal may write there), and the router dead-letters a
    submission whose ``user_id`` names anyone else. ``function_sha256`` pins the
    function's code: the router refuses the task if the registered code has
    another digest, and the agent checks the code it fetches against it.

    ``endpoint_group`` (version 3) lets the router choose: the task may run on
    ``endpoint_id`` or any endpoint of the group (:meth:`candidates`), and the
    router authorises the user for every one of them and routes the task to the one
    its placement policy picks (the dispatch's ``endpoint_id``). Why a field on the
    submission and not a registered group record: it needs no new topic, ACL, API or
    registry view; the router authorises each candidate per task exactly as it does a
    single endpoint today (a group is never a way around sharing); and a group changes
    with what the user passes, not with an operator's registration. It is bounded
    (``MAX_ENDPOINT_GROUP``) so the router's work per task stays bounded. The version
    moved from 2 to 3 although the field is optional: a version-2 router would ignore
    it and route every grouped task to ``endpoint_id``, and a version-2 agent would
    refuse a grouped task routed to another member as a dispatch that disagrees with
    its submission; with the bump both say "upgrade fxstream" instead.

    ``tags`` (issue 15) are the submitter's labels, at most ``MAX_TASK_TAGS`` short
    ``key: value`` strings, copied by the router into the task's state (and by the agent
    into its result) so the API can filter on them. A reader that ignores them only leaves
    a task untagged, which changes no routing or running.

    ``depends_on`` (issue 15, version 4) names the task's parents
    (:mod:`fxstream.topics.parents`): the router holds a submission with a parent whose
    result is not in ``parent_results`` (on ``held-tasks``, state ``waiting-for-parents``)
    instead of routing it, and the dependencies processor releases it, to the submitter's
    own topic, with ``parent_results`` set once every parent has succeeded (or fails it
    with ``ParentFailed``, ``ParentUnknown`` or ``ParentResultUnavailable``).
    ``parent_results`` maps each parent's id to its serialized result exactly as the
    parent's result record carried it (inline, or the by-reference envelope of an object
    in the proxy store): the worker puts each in its :class:`~fxstream.topics.parents.ParentResult`
    placeholder's place. The version moved to 4: a version-3 router would route a
    dependent task at once, and a version-3 worker would call the function with the
    placeholders; with the bump both say "upgrade fxstream" instead.

    ``stage_in`` and ``stage_out`` (issue 16, version 5) name files the agent copies into
    the task's working directory before the function runs, and out of it after the
    function succeeded (:mod:`fxstream.topics.staging`: ``file://``, ``store://`` and
    ``globus://`` URLs, bounded and checked here).
    ``resource_specification`` (issue 16, version 5) is what an MPI task needs
    (:class:`ResourceSpecification`): an endpoint whose engine has no MPI mode refuses a
    task carrying one (``ResourcesUnavailable``) rather than run it on one process. The
    version moved to 5 for both: a version-4 agent would run the task without its inputs,
    drop its outputs, or run an MPI command without its launcher's nodes; with the bump it
    says "upgrade fxstream" instead.
    """

    v: SchemaVersion = 5
    task_id: Id
    function_id: Id
    endpoint_id: Annotated[
        Id,
        Meta(
            description="the endpoint the task should run on; with endpoint_group, one "
            "candidate among them"
        ),
    ]
    user_id: Annotated[Id, Meta(description="the submitter: must be the user of the topic")]
    function_sha256: Annotated[
        str,
        Meta(
            pattern=r"^[0-9a-f]{64}$",
            description="SHA-256 of the function's registered code (its code_sha256)",
        ),
    ]
    payload: Annotated[
        bytes,
        Meta(
            description="serialized (args, kwargs), strategy header first; the router reads at "
            "most its by-reference envelope (the objects' sites), never the arguments"
        ),
    ]
    client: ClientInfo
    submitted_at: Timestamp
    task_group_id: Id | None = None
    max_retries: Annotated[
        int,
        Meta(ge=0, le=100, description="further attempts after an infrastructure failure"),
    ] = 0
    walltime_s: Annotated[float, Meta(gt=0, le=LONGEST_DURATION_S)] | None = None
    retry_user_errors: Annotated[
        bool, Meta(description="also retry (up to max_retries) when the function raises")
    ] = False
    endpoint_group: (
        Annotated[
            list[Id],
            Meta(
                max_length=MAX_ENDPOINT_GROUP,
                description="further endpoints the router may choose instead of endpoint_id "
                "(the user must be allowed on every one)",
            ),
        ]
        | None
    ) = None
    tags: Tags = {}
    trigger: Annotated[
        TriggerFiring | None,
        Meta(
            description="set when a trigger rule fired the task (issue 15): the rule and the "
            "event, so event -> rule -> task -> result can be followed"
        ),
    ] = None
    depends_on: Annotated[
        list[Id],
        Meta(
            max_length=MAX_PARENTS,
            description="the task's parents (issue 15): it is held until each has succeeded, "
            "and its ParentResult placeholders then receive their results; each once, never "
            "the task itself",
        ),
    ] = []
    parent_results: Annotated[
        dict[Id, bytes],
        Meta(
            max_length=MAX_PARENTS,
            description="set by the dependencies processor when it releases the task: each "
            "parent's serialized result as its result record carried it (inline, or the "
            "by-reference envelope of an object in the proxy store)",
        ),
    ] = {}
    stage_in: Annotated[
        list[StageItem],
        Meta(
            max_length=MAX_STAGE_ITEMS,
            description="files copied into the task's working directory before it runs "
            "(issue 16): each a URL and a path in that directory, each path once",
        ),
    ] = []
    stage_out: Annotated[
        list[StageItem],
        Meta(
            max_length=MAX_STAGE_ITEMS,
            description="files copied out of the task's working directory after it "
            "succeeded (issue 16): each a path in that directory and the URL it goes to, "
            "each URL once",
        ),
    ] = []
    resource_specification: Annotated[
        ResourceSpecification | None,
        Meta(
            description="what an MPI task needs (issue 16): nodes, ranks per node and ranks "
            "of one block of the endpoint's MPI engine; refused by an endpoint without one"
        ),
    ] = None
    client_node: Annotated[
        str,
        Meta(
            pattern=r"^([0-9a-f]{32})?$",
            description="the submitting client's node key (fxstream.connectors.node_local), "
            "set when the endpoint's heartbeats advertise the same one: a worker with that "
            "key writes a large result to the node-local store instead of the endpoint's; "
            "'' for any other client",
        ),
    ] = ""

    def __post_init__(self) -> None:
        if not (self.stage_in or self.stage_out or self.depends_on or self.parent_results):
            return  # most tasks: nothing to cross-check (every record decoded passes here)
        stage_paths = [item.path for item in self.stage_in]
        if len(set(stage_paths)) != len(stage_paths):
            raise ValueError("stage_in names a local path more than once")
        stage_urls = [item.url for item in self.stage_out]
        if len(set(stage_urls)) != len(stage_urls):
            raise ValueError("stage_out names a destination URL more than once")
        if len(set(self.depends_on)) != len(self.depends_on):
            raise ValueError("depends_on names a parent more than once")
        if self.task_id in self.depends_on:
            raise ValueError(f"task {self.task_id} cannot depend on itself")
        stray = set(self.parent_results) - set(self.depends_on)
        if stray:
            raise ValueError(
                f"parent_results holds results of tasks that are not in depends_on: {sorted(stray)}"
            )

    def candidates(self) -> tuple[str, ...]:
        """The endpoints this task may run on: ``endpoint_id`` and its group, sorted, once each."""
        if not self.endpoint_group:
            return (self.endpoint_id,)
        return tuple(sorted({self.endpoint_id, *self.endpoint_group}))

    def unresolved(self) -> list[str]:
        """The parents whose results this submission does not carry yet (the router holds
        it while any is left)."""
        return [p for p in self.depends_on if p not in self.parent_results]


class TaskDispatch(Record, tag="dispatch", kw_only=True, frozen=True):
    """A routed task (topic ``tasks.ep.<endpoint_id>``, key: task id).

    ``submission`` holds the submission record's bytes exactly as the router read
    them: the router adds routing facts around them and never re-encodes arguments.
    ``user_id`` and ``function_sha256`` are the router's: the agent trusts them (only
    the service may write an endpoint queue), not the submission's own fields.
    ``routing_stamp`` (:mod:`fxstream.topics.routing_stamp`) authenticates the task's
    routing (task, endpoint, user, function) under the service's key; the agent cannot
    check it (it holds no key) and copies it into each result and event of the task, where
    the ingress does.
    """

    v: SchemaVersion = 2
    task_id: Id
    endpoint_id: Annotated[Id, Meta(description="the endpoint the router routed it to")]
    user_id: Annotated[
        Id, Meta(description="the submitter, as the broker authenticated it (the topic's user)")
    ]
    function_sha256: Annotated[
        str, Meta(pattern=r"^[0-9a-f]{64}$", description="the code digest the router checked")
    ]
    routed_at: Timestamp
    attempt: Annotated[int, Meta(ge=1, description="1 for the first delivery")] = 1
    submission: Annotated[bytes, Meta(description="an encoded TaskSubmission record")]
    routing_stamp: RoutingStamp = ""


class TaskCancel(Record, tag="cancel", kw_only=True, frozen=True):
    """A request to cancel a task (key: task id).

    The SDK writes it to ``from.user.<user_id>``; the router checks that ``user_id``
    is the topic's user (the principal the broker authenticated) and that the user
    may use the endpoint, and forwards the same bytes to ``tasks.ep.<endpoint_id>``.
    Keyed by task id, it lands on the partition of the task's own submission (and then dispatch),
    after it, so whoever holds the task reads its cancel after the task itself:
    per-task order with no join against task state. The agent that holds the
    task skips it if queued or kills its worker if running, and answers it with
    a ``TaskCancelled`` error result; a cancel for a task it no longer holds
    changes nothing. With ``kill`` false (``future.cancel()``, which by the
    ``concurrent.futures`` contract never stops an executing call) a task that
    has started runs on and is answered as usual: only a task not yet started
    is skipped.

    A task held for its parents (issue 15) is on no endpoint's queue yet: the router
    copies each authorised cancel to ``held-tasks`` too, where the dependencies processor
    cancels the task if it holds it (kill or not: it has not started).
    """

    v: SchemaVersion = 2
    task_id: Id
    user_id: Annotated[
        Id, Meta(description="who asks: the topic's user; must be the task's submitter")
    ]
    endpoint_id: Annotated[Id, Meta(description="the endpoint the task was submitted to")]
    requested_at: Timestamp
    reason: Annotated[str, Meta(max_length=1024, description="why, for the task's error")] = ""
    kill: Annotated[
        bool, Meta(description="also stop the task if it already started (its worker is killed)")
    ] = True


class TaskTimings(msgspec.Struct, kw_only=True, frozen=True):
    """When a task passed each hop; a hop it has not reached is null."""

    submitted_at: Timestamp | None = None
    routed_at: Timestamp | None = None
    dequeued_at: Annotated[
        Timestamp | None, Meta(description="when the agent took it off its queue")
    ] = None
    started_at: Timestamp | None = None
    finished_at: Timestamp | None = None
    result_published_at: Timestamp | None = None


class TaskErrorType(enum.StrEnum):
    """The platform's own error types (a function's exceptions keep their own type names)."""

    REJECTED = "TaskRejected"
    CANCELLED = "TaskCancelled"
    WORKER_LOST = "WorkerLost"
    BLOCK_LOST = "BlockLost"
    """A batch engine's block (a scheduler job) ended under the task: cancelled, past its
    walltime, or its node failed. Retried even without ``max_retries`` (up to the agent's
    block-loss limit), since it is never the task's doing."""
    WALLTIME_EXCEEDED = "WalltimeExceeded"
    AGENT_LOST = "AgentLost"
    FUNCTION_UNAVAILABLE = "FunctionUnavailable"
    RESULT_TOO_LARGE = "ResultTooLarge"
    RESULT_REFUSED = "ResultRefused"
    """Kafka refused to write the task's result (see the message for the limit to change)."""
    CODE_INTEGRITY = "CodeIntegrityError"
    """The function code the agent fetched does not have the digest the task was routed with."""
    NOT_ALLOWED = "NotAllowedOnEndpoint"
    """The endpoint's owner does not allow this function or argument serializer there
    (allowed_functions / allowed_serializers); refused before anything was deserialized."""
    PYTHON_MISMATCH = "PythonVersionMismatch"
    """No worker environment of the endpoint runs the Python major.minor that serialized the
    function (the submission's ``client.python_version``); refused before it ran."""
    PARENT_FAILED = "ParentFailed"
    """A parent of the task (``depends_on``) failed, was rejected or was cancelled: the
    message names the parent and its error; the task never ran."""
    PARENT_UNKNOWN = "ParentUnknown"
    """A parent of the task is not a task of its submitter (no such task, or another user's);
    the task never ran."""
    PARENT_RESULT_UNAVAILABLE = "ParentResultUnavailable"
    """A parent succeeded, but its result can no longer be read (not kept in task-state, too
    large to pass on, or gone from the proxy store): the message names the parent."""
    STAGING_FAILED = "StagingFailed"
    """A file of the task's ``stage_in`` or ``stage_out`` could not be staged for a reason a
    retry does not cure (a source that does not exist, a URL outside the endpoint's staging
    roots, a permission refused, an output the function did not write): the message names
    the file, the site and what to do. Not retryable. Staged in, the task never ran; staged
    out, it ran and its result is not kept."""
    STAGING_UNAVAILABLE = "StagingUnavailable"
    """A staging site (a Globus collection or the Transfer API, the store) could not be
    reached or a transfer ran past its timeout: retryable, and retried by the agent up to
    the task's ``max_retries`` (staging in again, running again)."""
    RESOURCES_UNAVAILABLE = "ResourcesUnavailable"
    """The task's ``resource_specification`` cannot be met on its endpoint (no MPI engine, or
    more nodes than one of its blocks has): the message says what to change; never retried."""


class TaskError(msgspec.Struct, kw_only=True, frozen=True):
    """Why a task failed: the remote exception, or the platform's reason."""

    type: Annotated[str, Meta(max_length=256, description="e.g. 'ZeroDivisionError', 'WorkerLost'")]
    message: Text
    traceback: Annotated[str, Meta(max_length=262_144)] = ""
    retryable: Annotated[
        bool, Meta(description="true for infrastructure failures a retry may cure")
    ] = False


class Attempt(msgspec.Struct, kw_only=True, frozen=True):
    """One attempt at running a task."""

    attempt: Annotated[int, Meta(ge=1)]
    worker: Annotated[str, Meta(max_length=256, description="host:pid, or the agent's host")] = ""
    started_at: Timestamp | None = None
    finished_at: Timestamp | None = None
    error: TaskError | None = None


class TaskResult(Record, tag="result", kw_only=True, frozen=True):
    """The outcome of one attempt of a task (topic ``results.<user_id>``, key: task id).

    An agent writes it to its ``from.ep.<endpoint>`` with its dispatch's
    ``routing_stamp``; the ingress forwards it (bytes unchanged) only if the stamp is the
    router's for this task, endpoint, user and function. The router's and the
    dependencies processor's own results (written straight to ``results.<user>``) carry
    none.
    """

    task_id: Id
    user_id: Id
    function_id: Id
    endpoint_id: Id
    task_group_id: Id | None = None
    outcome: Literal["success", "error"]
    value: Annotated[
        bytes | None,
        Meta(
            description=(
                "on success the serialized return value (inline, or a serialized proxy); on "
                "an error, optionally the raised exception serialized with the client's data "
                "strategy (at most 16 KiB)"
            )
        ),
    ] = None
    error: TaskError | None = None
    attempt: Annotated[int, Meta(ge=1)] = 1
    worker: Annotated[str, Meta(max_length=256, description="host:pid of the worker")] = ""
    timings: TaskTimings = TaskTimings()
    earlier_attempts: Annotated[
        list[Attempt], Meta(description="the failed attempts before this one, oldest first")
    ] = []
    tags: Annotated[
        Tags, Meta(description="the submission's tags (bounded as there), copied by the agent")
    ] = {}
    stdout: Annotated[
        str,
        Meta(
            description=(
                "what the function printed to sys.stdout during this attempt: the tail, at "
                "most OUTPUT_MAX_BYTES (fxstream.topics.budget), less when the record "
                "needs the room"
            )
        ),
    ] = ""
    stderr: Annotated[str, Meta(description="the same for sys.stderr")] = ""
    routing_stamp: RoutingStamp = ""


class TaskStateName(enum.StrEnum):
    """The states of a task's lifecycle."""

    SUBMITTED = "submitted"
    REJECTED = "rejected"
    WAITING_FOR_PARENTS = "waiting-for-parents"
    ROUTED = "routed"
    WAITING_FOR_ENDPOINT = "waiting-for-endpoint"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class TaskState(Record, tag="task-state", kw_only=True, frozen=True):
    """The latest known state of a task (topic ``task-state``, compacted, key: task id)."""

    task_id: Id
    user_id: Id
    function_id: Id
    endpoint_id: Id
    task_group_id: Id | None = None
    state: TaskStateName
    updated_at: Timestamp
    timings: TaskTimings = TaskTimings()
    attempts: list[Attempt] = []
    error: TaskError | None = None
    value: Annotated[
        bytes | None,
        Meta(description="the serialized result once succeeded, for get_result"),
    ] = None
    tags: Annotated[
        Tags,
        Meta(description="the submission's tags (bounded as there; the router's copy stands)"),
    ] = {}


class TaskEvent(Record, tag="task-event", kw_only=True, frozen=True):
    """A lifecycle step other than the result (topic ``task-events``, key: task id).

    Written by agents (``retrying``, ``cancelled``), with their dispatch's
    ``routing_stamp`` (checked by the ingress, as a result's), and the liveness processor
    (``running`` while an agent's heartbeats lease the task, ``waiting-for-endpoint``
    once that agent is lost; no stamp: it writes ``task-events`` itself); the task-state
    processor applies it to the task's state if the lifecycle allows the step, and
    dead-letters it if not.
    """

    task_id: Id
    user_id: Id
    function_id: Id
    endpoint_id: Id
    task_group_id: Id | None = None
    state: TaskStateName
    at: Timestamp
    source: Annotated[str, Meta(max_length=128, description="who saw it, e.g. 'liveness'")]
    attempt: Annotated[
        Attempt | None, Meta(description="the attempt this step ends or starts, with its error")
    ] = None
    reason: Text = ""
    routing_stamp: RoutingStamp = ""


class HeldTask(Record, tag="held-task", kw_only=True, frozen=True):
    """A task held until its parents succeed (topic ``held-tasks``, compacted, key: task id).

    Written by the router, in the transaction that would otherwise have routed the task,
    for a submission with parents whose results it does not carry
    (:meth:`TaskSubmission.unresolved`); the dependencies processor releases or fails it
    and writes a tombstone under its key in the same transaction, so a task is held
    (and decided) exactly once, across restarts of either. ``submission`` holds the
    submission record's bytes exactly as the router read them.
    """

    task_id: Id
    user_id: Annotated[Id, Meta(description="the submitter (the user of the topic it came on)")]
    depends_on: Annotated[list[Id], Meta(max_length=MAX_PARENTS)]
    held_at: Timestamp
    submission: Annotated[bytes, Meta(description="an encoded TaskSubmission record")]


# --- registry ------------------------------------------------------------------------------


class UserRecord(Record, tag="user", kw_only=True, frozen=True):
    """A registered user (topic ``users``, compacted, key: user id)."""

    user_id: Id
    name: Name
    token_sha256: Annotated[
        str, Meta(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the user's API token")
    ]
    created_at: Timestamp
    # Accounts (issue 13): optional fields, so records written before them still read.
    token_expires_at: Annotated[
        Timestamp | None, Meta(description="when the token expires; null: created_at + default")
    ] = None
    token_revoked_at: Annotated[
        Timestamp | None, Meta(description="when the token was revoked; null: not revoked")
    ] = None
    previous_token_sha256: (
        Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$", description="the token rotated away")] | None
    ) = None
    previous_token_valid_until: Annotated[
        Timestamp | None, Meta(description="end of the rotated-away token's grace")
    ] = None
    external_identity: (
        Annotated[
            str,
            Meta(max_length=512, description="'<provider>:<subject>' of a linked identity"),
        ]
        | None
    ) = None


class FunctionRecord(Record, tag="function", kw_only=True, frozen=True):
    """A registered function (topic ``functions``, compacted, key: function id)."""

    function_id: Id
    name: Name
    owner_id: Id
    code: Annotated[bytes, Meta(description="serialized function, strategy header first")]
    code_sha256: Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]
    created_at: Timestamp
    container: Annotated[str, Meta(max_length=1024)] | None = None
    public: bool = False
    allowed_users: list[Id] = []
    description: Text = ""
    metadata: Annotated[
        dict[str, str],
        Meta(description="the registrant's labels, e.g. python_version, sdk_version"),
    ] = {}


class EndpointRecord(Record, tag="endpoint", kw_only=True, frozen=True):
    """A registered endpoint (topic ``endpoints``, compacted, key: endpoint id)."""

    endpoint_id: Id
    name: Name
    owner_id: Id
    created_at: Timestamp
    public: bool = False
    allowed_users: list[Id] = []
    description: Text = ""
    metadata: dict[str, str] = {}
    token_sha256: (
        Annotated[
            str,
            Meta(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the endpoint's own token"),
        ]
        | None
    ) = None


# --- endpoint telemetry --------------------------------------------------------------------


class TaskLease(msgspec.Struct, kw_only=True, frozen=True):
    """One task an agent holds: taken off its queue and not yet answered durably."""

    task_id: Id
    user_id: Id
    function_id: Id
    task_group_id: Id | None = None
    attempt: Annotated[int, Meta(ge=1)] = 1
    started_at: Annotated[
        Timestamp | None, Meta(description="when a worker started it; null while queued")
    ] = None


class Heartbeat(Record, tag="heartbeat", kw_only=True, frozen=True):
    """An agent's periodic liveness and load report (topic ``heartbeats``, key: endpoint id)."""

    endpoint_id: Id
    agent_id: Annotated[Id, Meta(description="this agent process's instance id")]
    sent_at: Timestamp
    sequence: Count
    period_s: Annotated[
        float, Meta(gt=0, le=LONGEST_DURATION_S, description="seconds until the next heartbeat")
    ]
    hostname: Annotated[str, Meta(max_length=256)]
    pid: Count
    workers_total: Count
    workers_idle: Count
    workers_busy: Count
    queue_depth: Annotated[int, Meta(ge=0, description="tasks fetched but not yet started")]
    leases: Annotated[
        list[TaskLease],
        Meta(description="the tasks this agent holds (renewed by each heartbeat), at most 1,000"),
    ] = []
    leases_truncated: Annotated[
        bool, Meta(description="true when the agent held more tasks than it listed")
    ] = False
    agent_version: Annotated[str, Meta(max_length=64)] = ""
    node_key: Annotated[
        str,
        Meta(
            pattern=r"^([0-9a-f]{32})?$",
            description="the node key of this agent's workers (fxstream.connectors.node_local: "
            "machine, boot, OS user and node-local directory) when they run on its node and "
            "share its node-local store; '' otherwise (a batch engine's remote blocks)",
        ),
    ] = ""
    python_versions: Annotated[
        list[Annotated[str, Meta(max_length=16)]],
        Meta(
            max_length=32,
            description="the Python major.minor versions this agent's workers run, e.g. "
            "['3.11', '3.12']: a task submitted from another is refused (PythonVersionMismatch)",
        ),
    ] = []
    pool_slots: Annotated[
        int,
        Meta(
            ge=0,
            le=1_000_000,
            description="how many image pools the endpoint runs at once when that is fewer "
            "than its images (a task of another image then releases one: a cold start); 0: "
            "every image's pool fits",
        ),
    ] = 0
    blocks_pending: Annotated[
        int,
        Meta(
            ge=0,
            le=1_000_000,
            description="a batch engine's blocks submitted to the scheduler and not yet "
            "running (0 for engines without blocks)",
        ),
    ] = 0
    blocks_running: Annotated[
        int, Meta(ge=0, le=1_000_000, description="a batch engine's blocks running")
    ] = 0
    blocks_idle: Annotated[
        int,
        Meta(
            ge=0,
            le=1_000_000,
            description="a batch engine's running blocks with no task on any worker",
        ),
    ] = 0


class WarmWorker(msgspec.Struct, kw_only=True, frozen=True):
    """One warm worker: the container it runs in, the functions it has loaded, and whether
    it held no task when advertised (``idle``)."""

    worker_id: Annotated[str, Meta(max_length=128)]
    container: Annotated[str, Meta(max_length=1024)] | None = None
    function_ids: list[Id] = []
    idle: bool = False


class LogLine(msgspec.Struct, kw_only=True, frozen=True):
    """One line of an agent's log."""

    at: Timestamp
    level: Annotated[str, Meta(max_length=16, description="DEBUG, INFO, WARNING, ERROR...")]
    logger: Annotated[str, Meta(max_length=256)]
    message: Annotated[str, Meta(max_length=8_192, description="the formatted message")]


class EndpointLogs(Record, tag="endpoint-logs", kw_only=True, frozen=True):
    """A batch of one agent's log lines (topic ``endpoint-logs``, key: endpoint id), for
    the endpoint's owner to read through the API (``GET /v1/endpoints/{id}/logs``)."""

    endpoint_id: Id
    agent_id: Annotated[Id, Meta(description="the agent process's instance id")]
    hostname: Annotated[str, Meta(max_length=256)]
    sent_at: Timestamp
    lines: Annotated[list[LogLine], Meta(max_length=500)]
    dropped: Annotated[
        int, Meta(ge=0, description="lines the agent dropped since its last batch (too many)")
    ] = 0


class WarmAdvert(Record, tag="warm", kw_only=True, frozen=True):
    """What an endpoint manager holds warm (topic ``warm``, compacted)."""

    endpoint_id: Id
    manager_id: Annotated[str, Meta(max_length=128)]
    advertised_at: Timestamp
    workers: list[WarmWorker] = []


class StorageTier(enum.StrEnum):
    """How a store keeps its objects (docs/data-plane.md, "Tiers")."""

    DURABLE = "durable"
    """Survives a restart and is reachable from every node: Redis with AOF, shared files."""
    EPHEMERAL = "ephemeral"
    """Node-local, no replication: written once, read many, lost with the node."""


ObjectKey = Annotated[str, Meta(min_length=1, max_length=1024)]


class ObjectReference(msgspec.Struct, kw_only=True, frozen=True):
    """A proxied object that a payload refers to (what data-locations and eviction need)."""

    object_key: ObjectKey
    store: Annotated[str, Meta(max_length=256, description="the store's name, e.g. 'redis'")]
    size_bytes: Count
    tier: StorageTier = StorageTier.DURABLE
    site: Annotated[str, Meta(max_length=256, description="an endpoint id, or '' for a client")] = (
        ""
    )
    node: Annotated[str, Meta(max_length=256, description="the host that wrote it")] = ""
    sha256: Annotated[
        str,
        Meta(
            pattern="^([0-9a-f]{64})?$",
            description="SHA-256 of the stored bytes, checked before they are deserialized",
        ),
    ] = ""


class DataLocation(Record, tag="data-location", kw_only=True, frozen=True):
    """Where a proxied object lives (topic ``data-locations``, compacted, key: object key).

    Published when an object is created (``complete`` false while a stream is
    still being written) and again when a stream closes; a tombstone (null
    value) under the same key says the object was evicted.
    """

    object_key: ObjectKey
    store: Annotated[str, Meta(max_length=256, description="the store's name, e.g. 'redis'")]
    site: Annotated[str, Meta(max_length=256, description="where the store is (an endpoint id)")]
    size_bytes: Count
    updated_at: Timestamp
    tier: StorageTier = StorageTier.DURABLE
    node: Annotated[str, Meta(max_length=256, description="the host that wrote it")] = ""
    complete: bool = True
    sha256: Annotated[
        str,
        Meta(
            pattern="^([0-9a-f]{64})?$",
            description="SHA-256 of the object's bytes ('' for a stream until complete)",
        ),
    ] = ""


# --- events and failures -------------------------------------------------------------------

AttributeValue = str | int | float | bool | None


class Event(Record, tag="event", kw_only=True, frozen=True):
    """An event from a source such as a file watcher (topic ``events.<source>``)."""

    source: Id
    event_key: Annotated[str, Meta(min_length=1, max_length=1024)]
    event_type: Annotated[str, Meta(min_length=1, max_length=128, description="e.g. 'created'")]
    occurred_at: Timestamp
    attributes: dict[str, AttributeValue] = {}
    data: Annotated[
        bytes | None, Meta(description="small inline data or a serialized proxy to bulk data")
    ] = None


PredicateOp = Literal["eq", "ne", "prefix", "suffix", "glob", "lt", "le", "gt", "ge", "exists"]
_TEXT_OPS: Final = frozenset({"prefix", "suffix", "glob"})
_NUMBER_OPS: Final = frozenset({"lt", "le", "gt", "ge"})
MAX_PREDICATES: Final = 32
MAX_TEMPLATE: Final = 64
_EVENT_FIELDS: Final = ("event_key", "source", "event_type", "occurred_at")
_TEMPLATE_REF: Final = re.compile(
    r"(event_key|source|event_type|occurred_at|attributes|attributes\..{1,256})"
)


def _check_value(what: str, value: object) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what}: {value!r} is not a finite number (JSON has none)")
    if isinstance(value, int) and not -(2**63) <= value < 2**64:
        raise ValueError(f"{what}: {value!r} does not fit in 64 bits")


def _same(a: object, b: object) -> bool:
    # True == 1 in Python; an event's flag is not its count.
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class EventPredicate(msgspec.Struct, kw_only=True, frozen=True):
    """One condition on an event's attribute (all of a rule's predicates must hold).

    ``eq``/``ne``: equal or not (any value); ``prefix``/``suffix``/``glob`` (an
    ``fnmatch`` pattern): a text attribute and a text ``value``; ``lt``/``le``/``gt``/``ge``:
    a number attribute compared with a number ``value``; ``exists``: the attribute is
    there (``value`` unused). A predicate on an attribute the event does not have is
    false, whatever its op (``exists`` aside); so is a text or number op on a value of
    another type. Nothing is ever evaluated as code.
    """

    attribute: Annotated[str, Meta(min_length=1, max_length=256)]
    op: PredicateOp
    value: AttributeValue = None

    def __post_init__(self) -> None:
        _check_value(f"predicate on {self.attribute!r}", self.value)
        if self.op in _TEXT_OPS and not isinstance(self.value, str):
            raise ValueError(
                f"predicate on {self.attribute!r}: op {self.op!r} needs a text value, "
                f"not {self.value!r}"
            )
        if self.op in _NUMBER_OPS and not _is_number(self.value):
            raise ValueError(
                f"predicate on {self.attribute!r}: op {self.op!r} needs a number value, "
                f"not {self.value!r}"
            )

    def holds(self, attributes: dict[str, AttributeValue]) -> bool:
        """Whether this condition holds for an event with ``attributes``."""
        if self.attribute not in attributes:
            return False
        if self.op == "exists":
            return True
        have = attributes[self.attribute]
        want = self.value
        if self.op in ("eq", "ne"):
            return _same(have, want) == (self.op == "eq")
        if self.op in _TEXT_OPS:
            if not isinstance(have, str) or not isinstance(want, str):
                return False
            if self.op == "prefix":
                return have.startswith(want)
            if self.op == "suffix":
                return have.endswith(want)
            return fnmatch.fnmatchcase(have, want)
        if not _is_number(have) or not _is_number(want):
            return False
        assert isinstance(have, int | float) and isinstance(want, int | float)
        if self.op == "lt":
            return have < want
        if self.op == "le":
            return have <= want
        if self.op == "gt":
            return have > want
        return have >= want


class TriggerLimits(msgspec.Struct, kw_only=True, frozen=True):
    """A rule's limits: tasks in flight (fired, not yet finished) and firings per second.

    When a firing would pass a limit, the event waits on its topic (the trigger
    processor does not read past it) until the rule is under its limits again.
    """

    max_in_flight: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None
    max_per_second: Annotated[float, Meta(gt=0, le=1_000_000)] | None = None


class TriggerRule(Record, tag="trigger-rule", kw_only=True, frozen=True):
    """A trigger rule (topic ``triggers``, compacted, key: rule id; a tombstone deletes).

    Written only by the service's API, for the authenticated caller (``owner_id``): the
    trigger processor submits each firing as that user, on ``from.user.<owner_id>``, so
    the router authorises it like any other submission of that user. An event fires the
    rule when it is on ``events.<source>``, was written at or after ``created_at`` (its
    Kafka timestamp), the rule is not paused, ``event_type`` (if set) is its type, its
    key matches ``key_pattern`` (``fnmatch``) and every predicate holds.

    How the event becomes the function's keyword arguments (``arguments``):
    ``event``: one argument ``event``, a dict with ``source``, ``event_key``,
    ``event_type``, ``occurred_at`` and ``attributes``; ``attributes``: each attribute is
    an argument; ``template``: ``template`` maps argument names to ``event_key``,
    ``source``, ``event_type``, ``occurred_at``, ``attributes`` (all of them, a dict) or
    ``attributes.<name>`` (one; null when the event lacks it). ``constants`` are added
    to every call (the event's arguments win on a clash).
    """

    rule_id: Id
    owner_id: Id
    name: Name
    source: Id
    event_type: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    key_pattern: Annotated[str, Meta(min_length=1, max_length=1024)] = "*"
    predicates: Annotated[list[EventPredicate], Meta(max_length=MAX_PREDICATES)] = []
    function_id: Id
    function_sha256: Annotated[
        str,
        Meta(pattern=r"^[0-9a-f]{64}$", description="the function's code digest at registration"),
    ]
    endpoint_id: Id
    endpoint_group: Annotated[list[Id], Meta(max_length=MAX_ENDPOINT_GROUP)] | None = None
    arguments: Literal["event", "attributes", "template"] = "event"
    template: Annotated[
        dict[
            Annotated[str, Meta(min_length=1, max_length=128)],
            Annotated[str, Meta(min_length=1, max_length=268)],
        ],
        Meta(max_length=MAX_TEMPLATE),
    ] = {}
    constants: Annotated[
        dict[Annotated[str, Meta(min_length=1, max_length=128)], AttributeValue],
        Meta(max_length=MAX_TEMPLATE),
    ] = {}
    paused: bool = False
    limits: TriggerLimits = TriggerLimits()
    client: Annotated[
        ClientInfo | None,
        Meta(description="the registering client's versions, sent with every firing"),
    ] = None
    created_at: Timestamp
    updated_at: Timestamp

    def __post_init__(self) -> None:
        if self.arguments == "template" and not self.template:
            raise ValueError(
                "arguments 'template' needs a template: map argument names to event_key, "
                "source, event_type, occurred_at, attributes or attributes.<name>"
            )
        if self.arguments != "template" and self.template:
            raise ValueError("a template is used only with arguments 'template'")
        for name, value in self.constants.items():
            _check_value(f"constant {name!r}", value)
        for argument, ref in self.template.items():
            if not _TEMPLATE_REF.fullmatch(ref):
                raise ValueError(
                    f"template argument {argument!r}: {ref!r} is not one of event_key, source, "
                    "event_type, occurred_at, attributes or attributes.<name>"
                )

    def matches(self, event: Event) -> bool:
        """Whether ``event`` passes this rule's filter (paused and time are not checked)."""
        if event.source != self.source:
            return False
        if self.event_type is not None and event.event_type != self.event_type:
            return False
        if not fnmatch.fnmatchcase(event.event_key, self.key_pattern):
            return False
        return all(p.holds(event.attributes) for p in self.predicates)

    def kwargs_for(self, event: Event) -> dict[str, Any]:
        """The keyword arguments a firing for ``event`` calls the function with."""
        kwargs: dict[str, Any] = dict(self.constants)
        if self.arguments == "event":
            kwargs["event"] = {
                **{name: getattr(event, name) for name in _EVENT_FIELDS},
                "attributes": dict(event.attributes),
            }
        elif self.arguments == "attributes":
            kwargs.update(event.attributes)
        else:
            for argument, ref in self.template.items():
                if ref == "attributes":
                    kwargs[argument] = dict(event.attributes)
                elif ref.startswith("attributes."):
                    kwargs[argument] = event.attributes.get(ref[len("attributes.") :])
                else:
                    kwargs[argument] = getattr(event, ref)
        return kwargs


class Digest(msgspec.Struct, kw_only=True, frozen=True):
    """What identifies bytes a dead letter kept only a prefix of: their size and SHA-256."""

    size: Count
    sha256: Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]


class DeadLetter(Record, tag="dead-letter", kw_only=True, frozen=True):
    """A record that could not be processed (topic ``dead-letter``, key: the original key).

    ``error_type`` is one of :class:`~fxstream.topics.DeadLetterReason`. An original
    key or value too large to keep whole is kept as a prefix, with its ``*_digest``
    (size and SHA-256) set, so the dead letter itself always fits its topic.
    """

    original_topic: Annotated[str, Meta(max_length=249)]
    original_partition: int
    original_offset: int
    original_key: bytes | None
    original_value: bytes | None
    original_headers: list[tuple[str, bytes | None]] = []
    reason: Text
    error_type: Annotated[str, Meta(max_length=256)]
    component: Annotated[str, Meta(max_length=128, description="who gave up, e.g. 'router'")]
    failed_at: Timestamp
    task_id: Id | None = None
    original_key_digest: Annotated[
        Digest | None, Meta(description="set when original_key holds only a prefix")
    ] = None
    original_value_digest: Annotated[
        Digest | None, Meta(description="set when original_value holds only a prefix")
    ] = None
    original_headers_dropped: Annotated[
        int, Meta(ge=0, description="headers left out to keep the dead letter bounded")
    ] = 0


# --- streaming analytics ----------------------------------------------------------------

LATENCY_BUCKETS: Final = 100
"""How many buckets a :class:`WindowAggregate`'s latency histogram has (its bound)."""
LATENCY_BUCKET_BASE_S: Final = 0.001
"""The upper bound of bucket 0: latencies of at most 1 ms."""
LATENCY_BUCKET_GROWTH: Final = 2**0.25
"""Each bucket's upper bound is this factor (about 1.19) times the previous one's, so a
percentile read as its bucket's upper bound is at most 19 % above the true value."""
OTHER_KEY: Final = "~other"
"""A window's key for one user's series past the per-dimension bound (never an id)."""


def latency_bucket(seconds: float) -> int:
    """The histogram bucket of a latency: 0 for <= 1 ms, ``i`` for <= 1 ms x 2^(i/4), and
    the last bucket (:data:`LATENCY_BUCKETS` - 1) for everything above 1 ms x 2^(98/4)
    (about 6.6 hours)."""
    if not seconds > LATENCY_BUCKET_BASE_S:  # also NaN and negative clock skew
        return 0
    index = math.ceil(math.log(seconds / LATENCY_BUCKET_BASE_S, LATENCY_BUCKET_GROWTH) - 1e-9)
    return min(max(index, 0), LATENCY_BUCKETS - 1)


def latency_bucket_upper_s(index: int) -> float:
    """The upper bound of bucket ``index`` in seconds (infinity for the last bucket)."""
    if index >= LATENCY_BUCKETS - 1:
        return math.inf
    return float(LATENCY_BUCKET_BASE_S * LATENCY_BUCKET_GROWTH**index)


class WindowAggregate(Record, tag="window-aggregate", kw_only=True, frozen=True):
    """One window's aggregate of one user's tasks by one dimension (topic ``analytics``,
    key: :meth:`topic_key`; the latest record per key is the window's current figure).

    A task counts in the window holding the time its state was recorded
    (``TaskState.updated_at``): ``finished`` and the outcome counts once per task, at its
    terminal state; ``states`` once per state change seen (``routed``, ``running``, ...).
    ``latency_histogram`` holds, per bucket (:func:`latency_bucket`), the finished tasks
    whose time from ``submitted_at`` to their result took that long. ``final`` is set
    once the window has closed and its grace passed (a late state can still update it).
    """

    window: Literal["tumbling", "hopping"]
    size_s: Annotated[int, Meta(ge=1, le=86_400)]
    step_s: Annotated[int, Meta(ge=1, le=86_400)]
    start: Timestamp
    end: Timestamp
    dimension: Literal["user", "function", "endpoint", "rule"]
    key: Annotated[
        str,
        Meta(
            pattern=r"^(?:[A-Za-z0-9][A-Za-z0-9-]{0,127}|~other)$",
            description="the user, function, endpoint or rule id ('~other' past the bound)",
        ),
    ]
    user_id: Id
    finished: Count = 0
    succeeded: Count = 0
    failed: Count = 0
    cancelled: Count = 0
    rejected: Count = 0
    states: Annotated[dict[TaskStateName, Count], Meta(max_length=16)] = {}
    latency_histogram: Annotated[
        dict[Annotated[int, Meta(ge=0, lt=LATENCY_BUCKETS)], Count],
        Meta(max_length=LATENCY_BUCKETS, description="bucket index -> finished tasks"),
    ] = {}
    latency_sum_s: Annotated[float, Meta(ge=0, le=1e15)] = 0.0
    latency_max_s: Annotated[float, Meta(ge=0, le=LONGEST_DURATION_S)] = 0.0
    final: bool = False
    updated_at: Timestamp

    def topic_key(self) -> str:
        """The record's key on ``analytics``: one per window, series and user."""
        return (
            f"{self.window}|{self.size_s}|{self.step_s}|{self.dimension}|{self.user_id}|"
            f"{self.key}|{int(self.start)}"
        )


AnyRecord = (
    UserRecord
    | TaskSubmission
    | TaskCancel
    | TaskDispatch
    | TaskResult
    | TaskState
    | TaskEvent
    | HeldTask
    | FunctionRecord
    | EndpointRecord
    | Heartbeat
    | EndpointLogs
    | WarmAdvert
    | DataLocation
    | Event
    | TriggerRule
    | DeadLetter
    | WindowAggregate
)

RECORD_TYPES: Final[tuple[type[Record], ...]] = (
    UserRecord,
    TaskSubmission,
    TaskCancel,
    TaskDispatch,
    TaskResult,
    TaskState,
    TaskEvent,
    HeldTask,
    FunctionRecord,
    EndpointRecord,
    Heartbeat,
    EndpointLogs,
    WarmAdvert,
    DataLocation,
    Event,
    TriggerRule,
    DeadLetter,
    WindowAggregate,
)

# The newest schema version this code reads and writes, per record kind.
# A kind's version is its ``v`` default: 2 for the records issue 13 changed (no token,
# pinned code digest, the router-stamped submitter), 4 for the submission (its endpoint
# group, issue 14, then its parents, issue 15; 5: its staged files, issue 16), 1 for the
# rest.
SCHEMA_VERSIONS: Final[dict[str, int]] = {
    str(msgspec.inspect.type_info(t).tag): int(  # type: ignore[attr-defined]
        next(f.default for f in msgspec.structs.fields(t) if f.name == "v")
    )
    for t in RECORD_TYPES
}

R = TypeVar("R", bound=Record)

_encoder = msgspec.msgpack.Encoder()
_any_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(AnyRecord)
_decoders: dict[type[Record], msgspec.msgpack.Decoder[Any]] = {
    t: msgspec.msgpack.Decoder(t) for t in RECORD_TYPES
}
_kind_of: dict[type[Record], str] = {
    t: str(msgspec.inspect.type_info(t).tag)  # type: ignore[attr-defined]
    for t in RECORD_TYPES
}


def encode(record: Record) -> bytes:
    """Encode a record to the bytes written as a Kafka record value."""
    return _encoder.encode(record)


def _check_version(record: Record) -> None:
    kind = _kind_of[type(record)]
    newest = SCHEMA_VERSIONS[kind]
    if record.v > newest:
        raise RecordDecodeError(
            f"schema version {record.v} of {kind!r} is newer than this reader knows "
            f"({newest}); upgrade fxstream on this side",
            expected=kind,
        )


def decode(data: bytes | None, expected: type[R]) -> R:
    """Decode bytes that must hold a record of kind ``expected``.

    Raises :class:`RecordDecodeError` with the reason for anything else:
    empty or tombstone values, malformed or truncated bytes, another kind,
    missing or mistyped fields, or a schema version newer than this code.
    """
    kind = _kind_of[expected]
    if not data:
        raise RecordDecodeError("the value is empty (a tombstone?)", expected=kind)
    try:
        record: R = _decoders[expected].decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RecordDecodeError(str(exc), expected=kind) from exc
    _check_version(record)
    return record


class _KindOnly(msgspec.Struct):
    kind: str


_kind_decoder = msgspec.msgpack.Decoder(_KindOnly)


def record_kind(data: bytes | None) -> str | None:
    """The ``kind`` a record's bytes claim to be, or None when they hold no such field.

    For a reader of a topic that carries more than one kind (``from.user.<U>``:
    submissions and cancels) to pick the decoder whose error explains bad bytes
    best; nothing else is checked, so :func:`decode` the bytes afterwards.
    """
    if not data:
        return None
    try:
        return _kind_decoder.decode(data).kind
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class _Glance(msgspec.Struct):
    """What every glance at a record reads: its kind."""

    kind: str


_G = TypeVar("_G", bound=_Glance)


def _glanced(decoder: msgspec.msgpack.Decoder[_G], data: bytes | None) -> _G | None:
    """The fields ``decoder`` reads of a ``task-state`` record; None for anything else."""
    if not data:
        return None
    try:
        glance = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return glance if glance.kind == _kind_of[TaskState] else None


class _TaskStateGlance(_Glance):
    state: TaskStateName
    updated_at: float


_task_state_glance = msgspec.msgpack.Decoder(_TaskStateGlance)


def task_state_glance(data: bytes | None) -> tuple[TaskStateName, float] | None:
    """A ``task-state`` record's state and ``updated_at``, read without the rest of it
    (its attempts, error and value are skipped, not decoded); None for bytes that hold
    no task state. For a reader that looks at every record of ``task-state`` and needs
    only these two (the expiry of finished tasks); :func:`decode` anything it keeps."""
    glance = _glanced(_task_state_glance, data)
    return None if glance is None else (glance.state, glance.updated_at)


class _TaskStateGroup(_Glance):
    user_id: str
    task_group_id: str | None = None


_task_state_group = msgspec.msgpack.Decoder(_TaskStateGroup)


def task_state_group(data: bytes | None) -> tuple[str, str | None] | None:
    """A ``task-state`` record's ``user_id`` and ``task_group_id``, read without the rest
    of it (nothing else is decoded or checked); None for bytes that hold no task state.
    For a view that keeps only some groups' tasks (the trigger processor's: a rule's
    tasks are its task group) and would otherwise decode every state to drop most of
    them; :func:`decode` anything it keeps."""
    glance = _glanced(_task_state_group, data)
    return None if glance is None else (glance.user_id, glance.task_group_id)


class _TaskStateName(_Glance):
    task_id: str
    state: TaskStateName


_task_state_name = msgspec.msgpack.Decoder(_TaskStateName)


def task_state_name(data: bytes | None) -> tuple[str, TaskStateName] | None:
    """A ``task-state`` record's ``task_id`` and ``state``, read without the rest of it
    (nothing else is decoded or checked); None for bytes that hold no task state. For a
    view that looks states up by task id only and would otherwise decode every state as
    it reads it (the dependencies processor's); :func:`decode` a state when it is used."""
    glance = _glanced(_task_state_name, data)
    return None if glance is None else (glance.task_id, glance.state)


def decode_any(data: bytes | None) -> AnyRecord:
    """Decode bytes holding any fxstream record; raises :class:`RecordDecodeError`."""
    if not data:
        raise RecordDecodeError("the value is empty (a tombstone?)")
    try:
        record: AnyRecord = _any_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RecordDecodeError(str(exc)) from exc
    _check_version(record)
    return record
